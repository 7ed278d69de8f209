"""Tensors as the kernels read them: broadcast to the problem and seen as [M, N]."""
from __future__ import annotations

import torch

from .arguments import CACHE_SIZE, Problem

INT32_LIMIT = 2**31

# (shape, strides, problem shape, chunks) → (row stride, column stride), for layouts whose
# [M, N] view needs no copy: the kernel then reads the tensor itself through those strides.
_VIEW_STRIDES: dict[tuple, tuple[int, int]] = {}


def view_2d(tensor: torch.Tensor, problem: Problem, chunks: int = 1) -> tuple[torch.Tensor, int, int]:
    """The tensor broadcast to the problem, as [M, N] (or [M, chunks * N]) with its strides
    (0 where broadcast).

    A view where the layout allows; when broadcast dims cannot merge into one row stride
    (e.g. [B, 1, N] against [B, S, N]) torch's reshape copies, which is then the only copy.
    """
    key = (tensor.shape, tensor.stride(), problem.shape, chunks)
    strides = _VIEW_STRIDES.get(key)
    if strides is not None:
        return tensor, strides[0], strides[1]
    width = problem.n * chunks
    flat = tensor.expand(*problem.shape[:-1], width).reshape(problem.m, width)
    if flat.data_ptr() == tensor.data_ptr() and flat.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        # A view: the kernel reads the tensor itself through these strides (the returned
        # tensor is `tensor` exactly when no copy was made).
        if len(_VIEW_STRIDES) >= CACHE_SIZE:
            _VIEW_STRIDES.clear()
        _VIEW_STRIDES[key] = strides = (flat.stride(0), flat.stride(1))
        return tensor, strides[0], strides[1]
    return flat, flat.stride(0), flat.stride(1)


def traced_view_2d(tensor: torch.Tensor, problem: Problem, chunks: int = 1) -> tuple[torch.Tensor, int, int]:
    """view_2d in a traced graph (fake tensors, possibly symbolic sizes): the [M, N] tensor
    itself, a view or a copy as torch's reshape decides, which the kernel then reads."""
    flat = tensor.expand(*problem.shape[:-1], problem.n * chunks).reshape(problem.m, problem.n * chunks)
    return flat, flat.stride(0), flat.stride(1)


def needs_int64(problem: Problem, views: list[tuple[torch.Tensor, int, int]]) -> bool:
    """Whether any element offset can reach 2**31 (int32 index math would overflow)."""
    last = problem.m * problem.n
    for tensor, stride_m, stride_n in views:
        # A view's columns are N, or all chunks side by side: as many as the tensor's row.
        width = tensor.shape[-1] if tensor.dim() else 1
        last = max(last, (problem.m - 1) * stride_m + (width - 1) * stride_n + 1)
    return last >= INT32_LIMIT
