"""The Triton backend: kernels printed from the plan (codegen, printer, templates), and what
the generated modules use at run time (launch, cached_launcher, tuning, kernel_lib, interpreter).
Light to import: codegen imports no torch, and the run-time modules no codegen."""
