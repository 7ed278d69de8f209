"""What every generated launcher does before it launches: argument checks, broadcasting,
2-D views, dtypes and the autotuner's configurations."""
from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from triton import knobs

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT32_LIMIT = 2**31
FLOAT32_MAX = 3.4028234663852886e38
GRID_Y_LIMIT = 65535


class FusegenArgumentError(ValueError):
    """A generated op was called with arguments it cannot take."""


def is_interpreting() -> bool:
    """Whether triton.jit would now build kernels for its CPU interpreter: TRITON_INTERPRET
    as Triton itself reads it (1, true, on, yes; 0, false, off, no, unset), or its knob."""
    return bool(knobs.runtime.interpret)


def kernel_is_interpreted(kernel) -> bool:
    """Whether `kernel` (a @triton.jit function, or an autotuner over one) runs on the
    interpreter: triton.jit decided that when it decorated it, by TRITON_INTERPRET then."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction) or isinstance(getattr(kernel, "fn", None), InterpretedFunction)


# ---------------------------------------------------------------------------
# Autotuning

# Measured on an H100 (docs/benchmarks.md): wide rows of 2048-4096 columns with 4-8 warps
# reach 0.94-0.97 of copy bandwidth at 16M+ elements; the narrow tiles serve small N.
FORWARD_CONFIGS = [
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 4096}, num_warps=8),
    triton.Config({"BLOCK_M": 2, "BLOCK_N": 2048}, num_warps=8),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 2048}, num_warps=4),
    triton.Config({"BLOCK_M": 2, "BLOCK_N": 1024}, num_warps=4),
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 1024}, num_warps=8),
    triton.Config({"BLOCK_M": 8, "BLOCK_N": 512}, num_warps=8),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 256}, num_warps=8),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 8}, num_warps=4),
    triton.Config({"BLOCK_M": 512, "BLOCK_N": 4}, num_warps=4),
    # Small problems (below SMALL_PROBLEM_ELEMENTS) only: 4096-element tiles leave most of an
    # H100's 132 SMs idle there ((1, 128, 1024) at p=0.1 ran 32 programs in 22 µs, eager 14 µs).
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 1024}, num_warps=4),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 512}, num_warps=4),
    triton.Config({"BLOCK_M": 2, "BLOCK_N": 256}, num_warps=2),
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 128}, num_warps=2),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 4}, num_warps=2),
]
MIN_BLOCK_N = 4  # dropout draws one Philox call per four columns
# Rows at least this wide use tiles at least this wide: narrow tiles on wide rows measured
# up to 1.6x slower, and the autotuner's timings did not always rule them out.
WIDE_BLOCK_N = 512
# Below this many elements the forward wants programs more than wide tiles: tiles of at most
# 1/256 of the problem (and at least SMALL_TILE_ELEMENTS), at least SMALL_BLOCK_N wide.
SMALL_PROBLEM_ELEMENTS = 2**22
SMALL_TILE_ELEMENTS = 512
SMALL_BLOCK_N = 128
LARGE_TILE_ELEMENTS = 2048  # and above it, tiles at least this big

# The backward walks ROWS_PER_PROGRAM rows per program, BLOCK_M at a time.
BACKWARD_CONFIGS = [
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 1024}, num_warps=4),
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 2048}, num_warps=8),
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 512}, num_warps=8),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 1024}, num_warps=4),
    triton.Config({"BLOCK_M": 8, "BLOCK_N": 256}, num_warps=4),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64}, num_warps=4),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=2),
]
MIN_ROWS_PER_PROGRAM = 16  # >= every backward config's BLOCK_M
MAX_ROWS_PER_PROGRAM = 256

# The interpreter runs one Python step per program: few, mid-sized tiles are fastest.
_INTERPRETER_BLOCK_ELEMENTS = 1024


def _interpreter_config(m: int, n: int, max_block_m: int | None = None) -> triton.Config:
    block_n = max(MIN_BLOCK_N, min(triton.next_power_of_2(n), _INTERPRETER_BLOCK_ELEMENTS))
    block_m = min(triton.next_power_of_2(m), max(1, _INTERPRETER_BLOCK_ELEMENTS // block_n))
    if max_block_m is not None:
        block_m = min(block_m, max_block_m)
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=4)


def _fitting(configs, m: int, n: int, max_block_m: int, wide_block_n: int = WIDE_BLOCK_N):
    """Tiles no wider than N (nor much narrower when N is wide), no taller than M, and
    within the grid's 65535 column tiles."""
    width = max(triton.next_power_of_2(n), MIN_BLOCK_N)
    narrowest = min(width, wide_block_n)
    tall = min(max(triton.next_power_of_2(m), 1), max_block_m)
    wide_enough = [
        c
        for c in configs
        if narrowest <= c.kwargs["BLOCK_N"] <= width and cdiv(n, c.kwargs["BLOCK_N"]) <= GRID_Y_LIMIT
    ]
    fitting = [c for c in wide_enough if c.kwargs["BLOCK_M"] <= tall]
    if fitting:
        return fitting
    if wide_enough:
        return [min(wide_enough, key=lambda c: c.kwargs["BLOCK_M"])]
    return [min(configs, key=lambda c: abs(c.kwargs["BLOCK_N"] - width))]


def prune_forward_configs(configs, named_args, **kwargs):
    """Keep the tiles that fit the problem; under the interpreter keep exactly one."""
    m, n = named_args["M"], named_args["N"]
    if is_interpreting():
        return [_interpreter_config(m, n)]
    elements = lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"]  # noqa: E731
    if m * n < SMALL_PROBLEM_ELEMENTS:
        largest = max(SMALL_TILE_ELEMENTS, m * n // 256)
        small = [c for c in configs if elements(c) <= largest]
        return _fitting(small, m, n, max_block_m=m, wide_block_n=SMALL_BLOCK_N)
    return _fitting([c for c in configs if elements(c) >= LARGE_TILE_ELEMENTS], m, n, max_block_m=m)


def prune_backward_configs(configs, named_args, **kwargs):
    m, n, rows = named_args["M"], named_args["N"], kwargs["ROWS_PER_PROGRAM"]
    if is_interpreting():
        return [_interpreter_config(m, n, max_block_m=rows)]
    return _fitting(configs, m, n, max_block_m=rows)


def autotune_do_bench():
    """The autotuner's timer: Triton's own on a GPU; none needed under the interpreter.

    With no GPU, Triton 3.6's default benchmarker fails ("0 active drivers"); there the
    pruners leave a single config, whose timing is never compared.
    """
    if is_interpreting():
        return lambda kernel_call, quantiles: [0.0 for _ in quantiles]
    return None


def cdiv(a: int, b: int) -> int:
    """ceil(a / b). triton.cdiv is a constexpr_function in Triton 3.6, costing microseconds a
    call from plain Python, and these run on every launch."""
    return -(-a // b)


def grid_2d(meta, m: int, n: int, rows_per_program: int | None = None):
    rows = rows_per_program or meta["BLOCK_M"]
    return (cdiv(m, rows), cdiv(n, meta["BLOCK_N"]))


def narrowest_backward_block_n(problem: "Problem", rows_per_program: int) -> int:
    """The narrowest column tile the backward's pruner may pick for this problem."""
    if is_interpreting():
        return _interpreter_config(problem.m, problem.n).kwargs["BLOCK_N"]
    return min(c.kwargs["BLOCK_N"] for c in _fitting(BACKWARD_CONFIGS, problem.m, problem.n, max_block_m=rows_per_program))


def backward_rows_per_program(problem: "Problem") -> int:
    """Rows each backward program walks: enough programs to fill a GPU (~1024), but as few
    as that allows, since each writes one row of partial column sums per reduced input."""
    if is_interpreting():
        return max(MIN_ROWS_PER_PROGRAM, min(MAX_ROWS_PER_PROGRAM, triton.next_power_of_2(problem.m)))
    column_tiles = cdiv(problem.n, 1024)
    rows = MIN_ROWS_PER_PROGRAM
    while rows < MAX_ROWS_PER_PROGRAM and cdiv(problem.m, 2 * rows) * column_tiles >= 1024:
        rows *= 2
    return rows


# ---------------------------------------------------------------------------
# Arguments


def _float32(value) -> float:
    return struct.unpack("f", struct.pack("f", float(value)))[0]


def check_choice(op: str, name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise FusegenArgumentError(f"{op}(): {name} must be one of {', '.join(choices)}; got {value!r}")


def range_text(low, high) -> str:
    """A spec's range as errors and docstrings print it: `in [0.0, 1.0]`, `≥ 0.0`, `≤ 1.0`
    or "" (fusegen.render._range_text prints the same; tests/test_arguments.py pins both)."""
    if low is not None and high is not None:
        return f"in [{low!r}, {high!r}]"
    if low is not None:
        return f"≥ {low!r}"
    return "" if high is None else f"≤ {high!r}"


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
        raise FusegenArgumentError(f"{op}(): {name} must be {range_text(low, high)}, got {value!r}")
    if kind == "float" and abs(value) > FLOAT32_MAX:
        raise FusegenArgumentError(f"{op}(): {name}={value!r} does not fit a float32")
    # Rounded to float32 here, as a GPU launch passes it: the interpreter would keep the
    # double, and reference (which rounds) would then disagree in fp64.
    return _float32(value) if kind == "float" else value


@dataclass(frozen=True)
class Problem:
    """The broadcast output shape, seen as M rows of N columns, and its dtypes."""

    shape: torch.Size
    m: int
    n: int
    out_dtype: torch.dtype
    compute_dtype: torch.dtype
    device: torch.device
    # False for meta tensors and FakeTensors: shapes without memory. An op on them only
    # makes outputs of the right shape, as torch's own ops do, and launches nothing.
    has_data: bool = True

    @property
    def launches(self) -> bool:
        """Whether a kernel has anything to do."""
        return self.has_data and self.m * self.n > 0


# Problems already checked, by what the checks depend on (shapes, dtypes, devices): the
# launcher runs on every call, and a training loop repeats a few shapes.
_PROBLEMS: dict[tuple, Problem] = {}
# Fake and functional tensors (torch.compile's) take the uncached path: their shapes may be symbolic.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_PROBLEM_CACHE_SIZE = 4096


def broadcast_problem(
    op: str, inputs: dict[str, tuple[object, tuple[str, ...]]], needs_kernel: bool, kernel=None
) -> Problem:
    """Check tensors against the spec's dims and broadcast them as torch would; with
    needs_kernel, also that `kernel` (the op's, if given) can run where the tensors are."""
    if all(type(value) in _PLAIN_TENSOR_TYPES for value, _ in inputs.values()):
        key = (op, *((v.shape, v.dtype, v.device, dims) for v, dims in inputs.values()))
        problem = _PROBLEMS.get(key)
        if problem is None:
            problem = _check_and_broadcast(op, inputs)
            if len(_PROBLEMS) >= _PROBLEM_CACHE_SIZE:
                _PROBLEMS.clear()
            _PROBLEMS[key] = problem
    else:
        problem = _check_and_broadcast(op, inputs)
    if needs_kernel and problem.has_data and problem.device.type != "cuda":
        _check_kernel_runs_off_cuda(op, problem.device, kernel)
    return problem


def _check_kernel_runs_off_cuda(op: str, device: torch.device, kernel) -> None:
    """Off CUDA only the interpreter runs kernels: kernels triton.jit built for it, calling
    Triton's own jit functions (tl.sigmoid, tl.sum's combine), built at triton's import."""
    if kernel is None:
        on_interpreter = is_interpreting()
    else:
        on_interpreter = kernel_is_interpreted(kernel) and kernel_is_interpreted(tl.sigmoid)
    if on_interpreter:
        return
    if is_interpreting():
        # Set after triton's import (in a notebook, say): too late for the kernels built then.
        raise FusegenArgumentError(
            f"{op}(): tensors are on {device.type}, and TRITON_INTERPRET is set, but it was not when triton was "
            "imported (kernels are built for the interpreter or for CUDA then); set TRITON_INTERPRET=1 before "
            "importing triton (restart Python or the notebook kernel), or call reference(...)"
        )
    raise FusegenArgumentError(
        f"{op}(): tensors are on {device.type}, but the Triton kernel needs a CUDA device; set "
        "TRITON_INTERPRET=1 before importing triton to run it on the CPU, or call reference(...)"
    )


def _check_and_broadcast(op: str, inputs: dict[str, tuple[object, tuple[str, ...]]]) -> Problem:
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
    _check_named_dims(op, inputs)
    # A chunked input ([..., 2N]) broadcasts as one of its chunks ([..., N]).
    value_shapes = [
        t.shape[:-1] + (t.shape[-1] // chunk_count(dims),) if chunk_count(dims) > 1 else t.shape
        for t, dims in inputs.values()
    ]
    try:
        shape = torch.broadcast_shapes(*value_shapes)
    except RuntimeError:
        shown = " and ".join(f"{n} {list(t.shape)}" for n, t in tensors.items())
        raise FusegenArgumentError(f"{op}(): shapes do not broadcast: {shown}") from None
    n = shape[-1] if len(shape) else 1
    m = shape.numel() // n if n else functools.reduce(lambda a, b: a * b, shape[:-1], 1)
    out_dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors.values()))
    compute_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    has_data = device.type != "meta" and not any(is_fake(t) for t in tensors.values())
    return Problem(shape, m, n, out_dtype, compute_dtype, device, has_data)


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
            chunked = _CHUNKED_DIM.fullmatch(dim)
            if chunked:
                count, dim = int(chunked.group(1)), chunked.group(2)
                if size % count:
                    raise FusegenArgumentError(
                        f"{op}(): {name} must have shape {declared}, got {list(tensor.shape)} "
                        f"({size} is not a multiple of {count})"
                    )
                size //= count
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


# The spec's "2N": an input's last dim holding that many chunks of N (see fusegen.spec).
_CHUNKED_DIM = re.compile(r"([0-9]+)([A-Za-z_][A-Za-z0-9_]*)")


def chunk_count(dims: tuple[str, ...]) -> int:
    match = _CHUNKED_DIM.fullmatch(dims[-1]) if dims else None
    return int(match.group(1)) if match else 1


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
        if len(_VIEW_STRIDES) >= _PROBLEM_CACHE_SIZE:
            _VIEW_STRIDES.clear()
        _VIEW_STRIDES[key] = (flat.stride(0), flat.stride(1))
    return flat, flat.stride(0), flat.stride(1)


def needs_int64(problem: Problem, views: list[tuple[torch.Tensor, int, int]]) -> bool:
    """Whether any element offset can reach 2**31 (int32 index math would overflow)."""
    last = problem.m * problem.n
    for tensor, stride_m, stride_n in views:
        # A view's columns are N, or all chunks side by side: as many as the tensor's row.
        width = tensor.shape[-1] if tensor.dim() else 1
        last = max(last, (problem.m - 1) * stride_m + (width - 1) * stride_n + 1)
    return last >= INT32_LIMIT


class Call:
    """One call's checked arguments: the problem, dropout state, the explicit seed (None:
    draw one) and each param by name."""

    def __init__(self, problem: Problem, has_dropout: bool, seed: int | None, **params):
        self.problem = problem
        self.has_dropout = has_dropout
        self.seed = seed
        self.__dict__.update(params)


def any_requires_grad(*tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def sum_to_input(grad: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """An output's gradient as the gradient of an input it passes through: itself (no copy)
    where shapes agree, else summed over the broadcast dims."""
    if grad.shape == tensor.shape:
        return grad
    return grad.sum_to_size(tensor.shape)


class GradTarget:
    """Where the backward kernel writes one input's gradient, and how it becomes that gradient.

    - same shape as the output: written in place, in the input's dtype;
    - broadcast along rows (bias [N] against [..., N]): per-program column sums in fp32
      [programs along M, N], summed across programs here, in a fixed order;
    - broadcast along columns (scale [..., 1], where the kernel sums those: `one_per_row`):
      per-column-tile row sums in fp32 [column tiles, M], zeroed first (the tuned tile width
      is not known before launch: as many slots as the narrowest tile needs), summed here;
    - any other broadcast: a full fp32 gradient, summed to the input's shape here.
    """

    def __init__(self, tensor: torch.Tensor, problem: Problem, rows_per_program: int, chunks: int = 1,
                 one_per_row: bool = False):
        self.shape, self.dtype = tensor.shape, tensor.dtype
        accumulate = torch.float64 if problem.compute_dtype == torch.float64 else torch.float32
        device = problem.device
        width = problem.n * chunks  # a chunked input ([..., 2N]) has all its chunks side by side
        full_shape = (*problem.shape[:-1], width) if len(problem.shape) else problem.shape
        if tensor.shape == full_shape:
            self.kind = "full"
            self.buffer = torch.empty(full_shape, dtype=tensor.dtype, device=device)
        elif tensor.numel() == width and tensor.dim() >= 1 and tensor.shape[-1] == width:
            self.kind = "rows"
            programs = cdiv(problem.m, rows_per_program)
            self.buffer = torch.empty((programs, width), dtype=accumulate, device=device)
        elif one_per_row and tensor.shape == (*problem.shape[:-1], 1):
            self.kind = "columns"
            tiles = cdiv(problem.n, narrowest_backward_block_n(problem, rows_per_program))
            self.buffer = torch.zeros((tiles, problem.m), dtype=accumulate, device=device)
        else:
            self.kind = "sum"
            self.buffer = torch.empty(full_shape, dtype=accumulate, device=device)

    @staticmethod
    def buffer_of(target: "GradTarget | None"):
        return None if target is None else target.buffer

    @staticmethod
    def sums_rows(target: "GradTarget | None") -> bool:
        return target is not None and target.kind == "rows"

    @staticmethod
    def sums_columns(target: "GradTarget | None") -> bool:
        return target is not None and target.kind == "columns"

    def result(self) -> torch.Tensor:
        if self.kind == "full":
            return self.buffer
        if self.kind in ("rows", "columns"):
            return self.buffer.sum(dim=0).reshape(self.shape).to(self.dtype)
        return self.buffer.sum_to_size(self.shape).to(self.dtype)


def check_out_without_grad(op: str, *tensors) -> None:
    if torch.is_grad_enabled() and any_requires_grad(*tensors):
        raise FusegenArgumentError(f"{op}(): out= does not support autograd (an input requires grad)")


def zero_before_trials(*names: str):
    """An autotuner pre_hook: zero the named buffers before every trial run and before the
    launch after tuning (Autotuner's own reset_to_zero fails on a gradient not asked for: None)."""

    def zero(kwargs: dict, reset_only: bool = False) -> None:
        for name in names:
            if kwargs[name] is not None:
                kwargs[name].zero_()

    return zero


def output_buffer(op: str, out, index: int, count: int, problem: Problem, inputs: tuple) -> torch.Tensor:
    """Where the kernel writes output `index`: a new tensor, or `out` itself when it is
    contiguous (the kernel writes [M, N] row-major) and shares no memory with an input.
    Otherwise a new tensor, copied into `out` after: the autotuner runs the kernel several
    times on its first call, and a second run would read what the first wrote (out=x)."""
    if out is None:
        return torch.empty(problem.shape, dtype=problem.out_dtype, device=problem.device)
    target = _out_tensor(op, out, index, count)
    if target.shape != problem.shape or target.dtype != problem.out_dtype or target.device != problem.device:
        raise FusegenArgumentError(
            f"{op}(): out{'' if count == 1 else f'[{index}]'} must be {problem.out_dtype} {list(problem.shape)} "
            f"on {problem.device}, got {target.dtype} {list(target.shape)} on {target.device}"
        )
    # Without data (meta, fake) nothing is written: out, checked, is the result.
    if not problem.has_data or target.is_contiguous() and not any(_may_overlap(target, t) for t in inputs):
        return target
    return torch.empty(problem.shape, dtype=problem.out_dtype, device=problem.device)


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

