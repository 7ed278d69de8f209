"""The CUDA C++ backend (issue 33), under construction: what exists is the printer of the
plan's expressions in CUDA C++ (printer.py) and the device functions they call (csrc/
fusegen_cuda.cuh: NaN-propagating max and min, the logistic function, a correctly rounded
1 / sqrt, and Philox4x32-10 with dropout's keep test, bit for bit Triton's). Nothing renders
a module or launches a kernel yet; docs/design/cuda-backend-plan.md has the plan."""
