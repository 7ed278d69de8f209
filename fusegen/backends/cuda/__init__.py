"""The CUDA C++ backend (issue 33; `fusegen build --backend cuda`, or `backend: cuda` in a spec): the
pointwise and row kinds. Build wing: codegen.py (the module, the shared face, and <op>.cu beside
it; the kinds' table), pointwise_source.py and row_source.py (the kernels' text), printer.py (the
expressions over the compute type T), csrc/fusegen_cuda.cuh (the device functions they call:
NaN-propagating max and min, the logistic function and division as Triton computes them, a
correctly rounded 1 / sqrt, Philox4x32-10 with dropout's keep rule, bit for bit Triton's; vector
loads and stores, a held row's copies in shared memory; a block's and a cluster's reductions).
Run wing: compiler.py (NVRTC, cubins cached on disk), launch.py (CudaKernels on the runtime's
backend contract, launches through cuda-core) and row_launch.py (the row kind's). docs/design/
cuda-backend-plan.md has the plan and what is left."""
