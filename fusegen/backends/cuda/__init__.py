"""The CUDA C++ backend (issue 33; `fusegen build --backend cuda`, or `backend: cuda` in a spec): the
pointwise kind. Build wing: codegen.py (the module: the source as CUDA_SOURCE, the shared face),
pointwise_source.py (the kernels' text), printer.py (the expressions over the compute type T),
csrc/fusegen_cuda.cuh (the device functions they call: NaN-propagating max and min, the logistic
function, a correctly rounded 1 / sqrt, Philox4x32-10 with dropout's keep rule, bit for bit
Triton's). Run wing: compiler.py (NVRTC, cubins cached on disk) and launch.py (CudaKernels on the
runtime's backend contract, launches through cuda-core). docs/design/cuda-backend-plan.md has the
plan and what is left."""
