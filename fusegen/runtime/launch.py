"""What every generated launcher does before it launches: argument checks, broadcasting,
2-D views, dtypes, seeds and the autotuner's configurations."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT32_LIMIT = 2**31
GRID_Y_LIMIT = 65535


class FusegenArgumentError(ValueError):
    """A generated op was called with arguments it cannot take."""


def is_interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------------
# Autotuning

ELEMENTWISE_CONFIGS = [
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 2048}, num_warps=8),
    triton.Config({"BLOCK_M": 2, "BLOCK_N": 1024}, num_warps=4),
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 1024}, num_warps=8),
    triton.Config({"BLOCK_M": 8, "BLOCK_N": 512}, num_warps=8),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 256}, num_warps=8),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 8}, num_warps=4),
    triton.Config({"BLOCK_M": 1024, "BLOCK_N": 1}, num_warps=4),
]

# The interpreter runs one Python step per program: few, mid-sized tiles are fastest.
_INTERPRETER_BLOCK_ELEMENTS = 1024


def prune_configs(configs, named_args, **kwargs):
    """Keep the tiles that fit the problem; under the interpreter keep exactly one.

    Tiles much wider than N only mask lanes off, and the grid's second axis is limited
    to 65535 tiles, so those go. Under the interpreter there is nothing to time.
    """
    m, n = named_args["M"], named_args["N"]
    if is_interpreting():
        block_n = min(triton.next_power_of_2(n), _INTERPRETER_BLOCK_ELEMENTS)
        block_m = min(triton.next_power_of_2(m), max(1, _INTERPRETER_BLOCK_ELEMENTS // block_n))
        return [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=4)]
    width = max(triton.next_power_of_2(n), 8)
    fitting = [
        c
        for c in configs
        if c.kwargs["BLOCK_N"] <= width
        and c.kwargs["BLOCK_M"] <= max(triton.next_power_of_2(m), 1)
        and triton.cdiv(n, c.kwargs["BLOCK_N"]) <= GRID_Y_LIMIT
    ]
    return fitting or [max(configs, key=lambda c: c.kwargs["BLOCK_N"])]


def autotune_do_bench():
    """The autotuner's timer: Triton's own on a GPU; none needed under the interpreter.

    With no GPU, Triton 3.6's default benchmarker fails ("0 active drivers"); there
    `prune_configs` leaves a single config, whose timing is never compared.
    """
    if is_interpreting():
        return lambda kernel_call, quantiles: [0.0 for _ in quantiles]
    return None


def grid_2d(meta, m: int, n: int):
    return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))


# ---------------------------------------------------------------------------
# Arguments


def draw_seed() -> int:
    """A dropout seed from torch's default generator, so torch.manual_seed reproduces a run."""
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


def check_choice(op: str, name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise FusegenArgumentError(f"{op}(): {name} must be one of {', '.join(choices)}; got {value!r}")


def check_scalar(op: str, name: str, value, kind: str, low, high):
    """A runtime scalar param: right type, finite, inside the spec's range."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FusegenArgumentError(f"{op}(): {name} must be a number, got {type(value).__name__}")
    if kind == "int" and not isinstance(value, int):
        raise FusegenArgumentError(f"{op}(): {name} must be an int, got {value!r}")
    if value != value:
        raise FusegenArgumentError(f"{op}(): {name} must not be NaN")
    if (low is not None and value < low) or (high is not None and value > high):
        raise FusegenArgumentError(f"{op}(): {name}={value!r} is outside [{low}, {high}]")
    return float(value) if kind == "float" else value


@dataclass(frozen=True)
class Problem:
    """The broadcast output shape, seen as M rows of N columns, and its dtypes."""

    shape: torch.Size
    m: int
    n: int
    out_dtype: torch.dtype
    compute_dtype: torch.dtype
    device: torch.device


def broadcast_problem(op: str, inputs: dict[str, tuple[object, tuple[str, ...]]], needs_kernel: bool) -> Problem:
    """Check tensors against the spec's dims and broadcast them as torch would."""
    tensors = {}
    for name, (value, _) in inputs.items():
        if not isinstance(value, torch.Tensor):
            raise FusegenArgumentError(f"{op}(): {name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in SUPPORTED_DTYPES:
            raise FusegenArgumentError(
                f"{op}(): {name} has dtype {value.dtype}; supported: float16, bfloat16, float32, float64"
            )
        tensors[name] = value
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        shown = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise FusegenArgumentError(f"{op}(): all tensors must be on one device; got {shown}")
    device = devices.pop()
    if needs_kernel and device.type != "cuda" and not is_interpreting():
        raise FusegenArgumentError(
            f"{op}(): tensors are on {device.type}, but the Triton kernel needs a CUDA device; set "
            "TRITON_INTERPRET=1 before importing triton to run it on the CPU, or call reference(...)"
        )
    _check_named_dims(op, inputs)
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors.values()))
    except RuntimeError:
        shown = " and ".join(f"{n} {list(t.shape)}" for n, t in tensors.items())
        raise FusegenArgumentError(f"{op}(): shapes do not broadcast: {shown}") from None
    n = shape[-1] if len(shape) else 1
    m = shape.numel() // n if n else functools.reduce(lambda a, b: a * b, shape[:-1], 1)
    out_dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors.values()))
    compute_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    return Problem(shape, m, n, out_dtype, compute_dtype, device)


def _check_named_dims(op: str, inputs: dict[str, tuple[torch.Tensor, tuple[str, ...]]]) -> None:
    bound: dict[str, tuple[int, str]] = {}
    for name, (tensor, dims) in inputs.items():
        explicit = [d for d in dims if d != "..."]
        has_ellipsis = len(explicit) != len(dims)
        declared = "[" + ", ".join(dims) + "]"
        if tensor.dim() < len(explicit) or (not has_ellipsis and tensor.dim() != len(explicit)):
            raise FusegenArgumentError(
                f"{op}(): {name} must have shape {declared}, got {list(tensor.shape)}"
            )
        for dim, size in zip(explicit, tensor.shape[tensor.dim() - len(explicit):]):
            if dim == "1":
                if size != 1:
                    raise FusegenArgumentError(f"{op}(): {name} must have shape {declared}, got {list(tensor.shape)}")
            elif dim in bound and bound[dim][0] != size:
                other_size, other = bound[dim]
                other_shape = list(inputs[other][0].shape)
                raise FusegenArgumentError(
                    f"{op}(): {other} {other_shape} and {name} {list(tensor.shape)} disagree on dim {dim} "
                    f"({other_size} vs {size})"
                )
            else:
                bound.setdefault(dim, (size, name))


def view_2d(tensor: torch.Tensor, problem: Problem) -> tuple[torch.Tensor, int, int]:
    """The tensor broadcast to the problem, as [M, N] with its strides (0 where broadcast).

    A view where the layout allows; when broadcast dims cannot merge into one row stride
    (e.g. [B, 1, N] against [B, S, N]) torch's reshape copies, which is then the only copy.
    """
    flat = tensor.expand(problem.shape).reshape(problem.m, problem.n)
    return flat, flat.stride(0), flat.stride(1)


def needs_int64(problem: Problem, views: list[tuple[torch.Tensor, int, int]]) -> bool:
    """Whether any element offset can reach 2**31 (int32 index math would overflow)."""
    last = problem.m * problem.n
    for _, stride_m, stride_n in views:
        last = max(last, (problem.m - 1) * stride_m + (problem.n - 1) * stride_n + 1)
    return last >= INT32_LIMIT


class Call:
    """One call's checked arguments: the problem, dropout state, and each param by name."""

    def __init__(self, problem: Problem, has_dropout: bool, seed: int, **params):
        self.problem = problem
        self.has_dropout = has_dropout
        self.seed = seed
        self.__dict__.update(params)
