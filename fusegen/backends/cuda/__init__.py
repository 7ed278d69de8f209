"""The CUDA C++ backend (issue 33), under construction: the printer of the plan's expressions in
CUDA C++ (printer.py), the device functions they call (csrc/fusegen_cuda.cuh: NaN-propagating
max and min, the logistic function, a correctly rounded 1 / sqrt, Philox4x32-10 with dropout's
keep rule, bit for bit Triton's), and the pointwise kind's source (pointwise_source.py: the
forward's and the backward's element functions and kernels). Nothing compiles or launches a kernel
at run time yet, and `fusegen build` does not offer the backend; docs/design/cuda-backend-plan.md
has the plan."""
