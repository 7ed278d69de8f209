"""Dropout's random mask, reproduced on the host bit for bit (see triton_helpers.dropout_mask)."""
from __future__ import annotations

import torch

from .philox import philox4x32

THRESHOLD_BITS = 24


def dropout_threshold(p: float) -> int:
    """p as the 24-bit threshold that a kept element's random word must reach."""
    return round(p * (1 << THRESHOLD_BITS))


def dropout_scale(p: float) -> float:
    """What kept elements are multiplied by; p == 1 drops everything, so any value works."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout_mask_reference(seed: int, problem, stream: int, p: float) -> torch.Tensor:
    """The multiplier (scale or 0) that the kernel's dropout_mask draws, in the problem's shape."""
    device, dtype = problem.device, problem.compute_dtype
    row = torch.arange(problem.m, device=device, dtype=torch.int64)[:, None]
    col = torch.arange(problem.n, device=device, dtype=torch.int64)[None, :]
    zero = torch.zeros((), device=device, dtype=torch.int64)
    # Column 4g + k takes word k of the Philox call for group g (see dropout_mask).
    words = philox4x32(seed, col >> 2, row & 0xFFFFFFFF, row >> 32, zero + stream)
    r = torch.stack(torch.broadcast_tensors(*words), dim=-1)
    r = r.gather(-1, (col & 3).expand(problem.m, problem.n).unsqueeze(-1)).squeeze(-1)
    keep = (r >> 8) >= dropout_threshold(p)
    scale = torch.tensor(dropout_scale(p), dtype=torch.float32).to(dtype)
    mask = torch.where(keep, scale.to(device), torch.zeros((), dtype=dtype, device=device))
    return mask.reshape(problem.shape)
