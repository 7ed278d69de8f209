"""The Triton backend: kernels printed from the plan (codegen), and what the generated
modules use at run time (launch, tuning, kernel_lib). Importing it costs no code
generation: codegen is imported only by `fusegen build`."""
from .interpreter import is_interpreting, patch_bfloat16_rounding, patch_libdevice

if is_interpreting():
    patch_bfloat16_rounding()
    patch_libdevice()
