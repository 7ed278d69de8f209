"""out=: where a kernel writes its outputs, and handing them back."""
from __future__ import annotations

import itertools

import torch

from .arguments import FusegenArgumentError, Problem, any_requires_grad

# Whether the installed torch converts a float32 past float8_e4m3fn's range to ±448 (2.13) or to
# NaN (2.11 and earlier): the CUDA backend's kernels convert as it does (the Triton backend's
# kernel_lib asks torch the same question for its kernels' constexpr).
E4M3_SATURATES = bool(torch.tensor(1e4).to(torch.float8_e4m3fn).float().isfinite())


def check_out_without_grad(op: str, tensors) -> None:
    if torch.is_grad_enabled() and any_requires_grad(tensors):
        raise FusegenArgumentError(f"{op}(): out= does not support autograd (an input requires grad)")


def output_buffer(op: str, out, index: int, count: int, problem: Problem, inputs: tuple, shape=None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Where the kernel writes output `index`: a new tensor, or `out` itself when it is
    contiguous (the kernel writes [M, N] row-major) and shares no memory with an input.
    Otherwise a new tensor, copied into `out` after: the autotuner runs the kernel several
    times on its first call, and a second run would read what the first wrote (out=x).
    `shape`: the output's, where it is not the problem's (one value per row); `dtype`: its
    own (float8, int8), where it is not the inputs'."""
    shape = problem.shape if shape is None else torch.Size(shape)
    dtype = problem.out_dtype if dtype is None else dtype
    if out is None:
        return torch.empty(shape, dtype=dtype, device=problem.device)
    if index == 0:
        check_out_targets(op, out, count, problem.has_data)
    target = _out_tensor(op, out, index, count)
    if target.shape != shape or target.dtype != dtype or target.device != problem.device:
        raise FusegenArgumentError(
            f"{op}(): out{'' if count == 1 else f'[{index}]'} must be {dtype} {list(shape)} "
            f"on {problem.device}, got {target.dtype} {list(target.shape)} on {target.device}"
        )
    # Without data (meta, fake) nothing is written: out, checked, is the result.
    if not problem.has_data or target.is_contiguous() and not any(_may_overlap(target, t) for t in inputs):
        return target
    return torch.empty(shape, dtype=dtype, device=problem.device)


def check_out_targets(op: str, out, count: int, has_data: bool) -> None:
    """What torch's out= refuses, before anything runs: a target that requires grad (with
    grad mode on), a target whose elements share memory (expanded: the copy into it fails
    after the kernel ran), and targets that share memory (out=(h, h): one output lost).
    Targets whose byte ranges intersect count as sharing."""
    targets = [_out_tensor(op, out, i, count) for i in range(count)]
    prefix = f"{op}(): "
    names = ["out"] if count == 1 else [f"out[{i}]" for i in range(count)]
    for name, target in zip(names, targets):
        if target.requires_grad and torch.is_grad_enabled():
            raise FusegenArgumentError(f"{prefix}out= does not support autograd ({name} requires grad)")
        if torch._debug_has_internal_overlap(target) == 1:  # 1: it has; 2: too hard to tell
            raise FusegenArgumentError(f"{prefix}{name} has elements that share memory (an expanded tensor)")
    if has_data:
        for (a, ta), (b, tb) in itertools.combinations(zip(names, targets), 2):
            if _may_overlap(ta, tb):
                raise FusegenArgumentError(f"{prefix}{a} and {b} share memory")


def _may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes a and b span intersect (a superset of sharing an element). Addresses,
    not storages: two storages may share memory (torch.from_dlpack)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    (a_start, a_end), (b_start, b_end) = _byte_span(a), _byte_span(b)
    return a_start < b_end and b_start < a_end


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def write_out(out, results: tuple[torch.Tensor, ...], copy: bool = False) -> tuple[torch.Tensor, ...]:
    """The outputs to return: `results`, or with out= the out tensors, filled with them."""
    if out is None:
        return results
    targets = (out,) if isinstance(out, torch.Tensor) else tuple(out)
    for target, result in zip(targets, results):
        if target is not result:
            if copy:
                _check_out_matches(target, result)
            target.copy_(result)
    return targets


def _out_tensor(op: str, out, index: int, count: int) -> torch.Tensor:
    if count == 1 and isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and len(out) == count and all(isinstance(t, torch.Tensor) for t in out):
        return out[index]
    expected = "a tensor" if count == 1 else f"a tuple of {count} tensors"
    raise FusegenArgumentError(f"{op}(): out must be {expected}")


def _check_out_matches(target: torch.Tensor, result: torch.Tensor) -> None:
    if target.shape != result.shape or target.dtype != result.dtype or target.device != result.device:
        raise FusegenArgumentError(
            f"out must be {result.dtype} {list(result.shape)} on {result.device}, "
            f"got {target.dtype} {list(target.shape)} on {target.device}"
        )
