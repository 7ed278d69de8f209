"""A fix for Triton 3.6's CPU interpreter, applied only when TRITON_INTERPRET=1.

The interpreter converts float32 → bfloat16 by truncating the mantissa, whereas the GPU
(and torch) round to nearest even. Left alone, every bf16 result on the interpreter is
up to 1 ulp off what the same kernel gives on a GPU, and tests would have to allow for
an error the product does not have. We route that one conversion through torch.
"""
from __future__ import annotations

import numpy as np
import torch
import triton.language as tl

_PATCHED = False


def _to_bfloat16_bits(data: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(data)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def patch_bfloat16_rounding() -> None:
    global _PATCHED
    if _PATCHED:
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def rounds_to_bf16(src, dst_type) -> bool:
        return dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64)

    def patched_cast_impl(self, src, dst_type):
        if rounds_to_bf16(src, dst_type):
            return interpreter.TensorHandle(_to_bfloat16_bits(src.data), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        if rounds_to_bf16(src, dst_type):
            return interpreter.TensorHandle(_to_bfloat16_bits(src.data), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl = patched_cast_impl
    builder.create_fp_trunc = patched_cast_impl
    builder.create_fp_to_fp = patched_fp_to_fp
    _PATCHED = True
