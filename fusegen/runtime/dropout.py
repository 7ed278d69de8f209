"""Dropout's seed and random mask: drawn on the device for the kernels, reproduced on the
host bit for bit (see triton_helpers.dropout_mask)."""
from __future__ import annotations

import operator

import torch

from .philox import MASK32, philox4x32

THRESHOLD_BITS = 24
SEED_LIMIT = 2**63  # seeds live in an int64 tensor: 0 <= seed < 2**63


def dropout_threshold(p: float) -> int:
    """p as the 24-bit threshold that a kept element's random word must reach."""
    return round(p * (1 << THRESHOLD_BITS))


def dropout_scale(p: float) -> float:
    """What kept elements are multiplied by; p == 1 drops everything, so any value works."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def check_seed(op: str, seed) -> int | None:
    """An explicit seed as an int in [0, 2**63), or None (draw one)."""
    if seed is None:
        return None
    if isinstance(seed, bool):
        raise _seed_error(op, seed)
    try:
        value = operator.index(seed)  # ints, numpy ints, 0-d integer tensors; not 1.5 or "abc"
    except TypeError:
        raise _seed_error(op, seed) from None
    if not 0 <= value < SEED_LIMIT:
        raise _seed_error(op, seed)
    return value


def _seed_error(op: str, seed) -> ValueError:
    from .launch import FusegenArgumentError

    shown = repr(seed) if isinstance(seed, (int, float, str)) else type(seed).__name__
    return FusegenArgumentError(f"{op}(): seed must be None or an int in [0, 2**63), got {shown}")


def seed_tensor(seed: int | None, device: torch.device) -> torch.Tensor:
    """The one-element int64 tensor on `device` that the kernels read the seed from.

    seed=None draws it from the device's own generator with a torch RNG op on the current
    stream: no host synchronisation, torch.manual_seed reproduces it, and a CUDA graph (or
    torch.compile's reduce-overhead mode) that captured the draw draws anew on each replay.
    An explicit seed is written there by a fill, which a graph replays as it is.
    """
    if seed is None:
        return torch.randint(0, SEED_LIMIT - 1, (1,), dtype=torch.int64, device=device)
    return torch.full((1,), seed, dtype=torch.int64, device=device)


def dropout_keep(seed, index: torch.Tensor, stream: int, p: float) -> torch.Tensor:
    """Whether the elements at flat indices `index` (int64) are kept: the kernel's rule."""
    groups = index >> 2
    words = philox4x32(seed, groups & MASK32, groups >> 32, torch.full_like(groups, stream), torch.zeros_like(groups))
    word = torch.stack(torch.broadcast_tensors(*words), dim=-1).gather(-1, (index & 3).unsqueeze(-1)).squeeze(-1)
    return (word >> 8) >= dropout_threshold(p)


def dropout_mask_reference(seed, problem, stream: int, p: float) -> torch.Tensor:
    """The multiplier (scale or 0) that the kernel's dropout_mask draws, in the problem's shape.

    `seed` is an int or the kernels' one-element seed tensor (read on its device, no sync)."""
    device, dtype = problem.device, problem.compute_dtype
    index = torch.arange(problem.m * problem.n, device=device, dtype=torch.int64)
    keep = dropout_keep(seed, index, stream, p)
    scale = torch.tensor(dropout_scale(p), dtype=torch.float32).to(dtype)
    mask = torch.where(keep, scale.to(device), torch.zeros((), dtype=dtype, device=device))
    return mask.reshape(problem.shape)
