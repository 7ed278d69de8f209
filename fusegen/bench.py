"""`fusegen bench`: time each generated op against eager PyTorch and torch.compile.

For every case (op × dtype × shape × p) three providers run the same computation:

- fusegen: the generated Triton op,
- eager:   the generated `eager`: the spec as a PyTorch user writes it (F.gelu, F.silu,
  torch's own F.dropout), independent of the kernel and of sympy,
- compile: torch.compile(eager, dynamic=False), compiled afresh for each case.

With dropout the baselines draw torch's own masks (the same distribution, other values),
so they do the work a user's code does.

Timing follows `triton.testing.do_bench` (median, with the 20th and 80th percentiles); the
first call and warm-up runs are not timed, so compilation and autotuning never count.
Two timers (--timer):

- do_bench (default): triton.testing.do_bench unchanged. Its timed region opens when the GPU has
  finished the L2 flush (~85 µs on an H100); a call whose host work takes longer leaves
  the GPU idle inside the region, so small and mid-size cases partly time the host (on
  the H100 used, 4x512x4096 bf16 timed 59 µs where the profiler showed a 17 µs kernel).
- device: the same flush, warm-up, repetitions and quantiles, plus a GPU sleep
  (torch.cuda._sleep) before each timed run that lasts longer than the host needs to
  enqueue the call: the time is the GPU's. Host cost is reported apart (host overhead).

Cache: both rely on Triton's own L2 flush, not on rotating inputs. In Triton 3.6 do_bench
zeroes a 256 MB buffer before every timed run, outside the timed events; that is 5× the
H100's 50 MB L2, so every run reads its inputs from HBM, small cases included. Rotating
copies of the inputs would do the same job at k× the memory and an extra index in the
timed function.

Bandwidth is judged against a bytes model derived from the spec: each input read once at
its own size (broadcast inputs counted once), each output written once. The ceiling is
a device-to-device copy measured in the same run (bytes read + written).

First calls run under a time limit (--first-call-timeout), so a provider that cannot
compile in reasonable time is reported as timed out rather than hanging the sweep.

Everything per case lives in small functions (shape mapping, bytes model, timing, rows,
rendering) so that the CPU-only tests can check the arithmetic without a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import importlib
import inspect
import json
import math
import platform
import re
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from .errors import SpecError
from .spec import ELLIPSIS, OpSpec, find_spec, load_spec

PROVIDERS = ("fusegen", "eager", "compile")

# (B, S, H): from a tiny decoder step to a large training batch. The smallest cases fit
# in L2; do_bench's flush (see the module docstring) keeps them honest.
SWEEP_SHAPES: tuple[tuple[int, int, int], ...] = (
    (1, 128, 1024),
    (2, 256, 2048),
    (4, 512, 4096),
    (8, 1024, 4096),
    (8, 2048, 4096),
    (16, 2048, 8192),
)
SWEEP_P: tuple[float, ...] = (0.0, 0.1)
DEFAULT_DTYPES = "fp32,bf16,fp16"

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp64": torch.float64,
    "float64": torch.float64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
}

QUANTILES = (0.5, 0.2, 0.8)  # median first: do_bench returns them in this order
DROPOUT_SEED = 20240607  # one fixed seed, so all three providers draw the same mask
COPY_BANDWIDTH_BYTES = 1 << 30  # 1 GiB source: far past L2, long enough to time well
HOST_OVERHEAD_SHAPE = (1, 1, 8)  # (B, S, H): a launch whose GPU work is negligible
HOST_OVERHEAD_WARMUP = 50
HOST_OVERHEAD_CALLS = 500
TRITON_FLUSH_BYTES = 256 * 1024 * 1024  # the buffer triton.testing.do_bench zeroes
# A provider's first call (torch.compile, autotuning) gets this long. Inductor can grind for
# many minutes on the eager dropout's Philox integer arithmetic; a bench run must go on.
DEFAULT_FIRST_CALL_TIMEOUT_S = 120.0

# A dim such as "2N": an input that holds two N-wide halves (split with chunk).
_SCALED_DIM = re.compile(r"^(\d+)\*?([A-Za-z_]\w*)$")


def _fail(command: str, message: str) -> int:
    print(f"fusegen {command}: {message}", file=sys.stderr)
    return 1


def no_gpu_exit(command: str, what: str) -> int | None:
    """1 (after one stderr line) when there is no CUDA GPU; None when there is one."""
    if not torch.cuda.is_available():
        return _fail(command, f"no CUDA GPU here; {what} need one")
    return None


# ---------------------------------------------------------------------------
# Command-line values


def parse_shape(text: str) -> tuple[int, int, int]:
    """"8x2048x4096" → (B, S, H)."""
    parts = text.strip().lower().split("x")
    try:
        sizes = tuple(int(part) for part in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"shape {text!r} must be BxSxH with positive integers, e.g. 8x2048x4096")
    return sizes  # type: ignore[return-value]


def parse_shape_list(text: str) -> list[tuple[int, int, int]]:
    return [parse_shape(part) for part in text.split(",") if part.strip()]


def parse_dtype(text: str) -> torch.dtype:
    key = text.strip().lower()
    if key not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r} (known: fp32, bf16, fp16, fp64)")
    return DTYPES[key]


def parse_dtype_list(text: str) -> list[torch.dtype]:
    dtypes: list[torch.dtype] = []
    for part in text.split(","):
        if part.strip() and (dtype := parse_dtype(part)) not in dtypes:
            dtypes.append(dtype)
    if not dtypes:
        raise argparse.ArgumentTypeError("--dtype needs at least one dtype")
    return dtypes


def parse_p(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"dropout probability {text!r} is not a number") from None
    if not 0.0 <= p < 1.0:
        raise argparse.ArgumentTypeError(f"dropout probability {p} must be in [0, 1)")
    return p


def parse_p_list(text: str) -> list[float]:
    values: list[float] = []
    for part in text.split(","):
        if part.strip() and (p := parse_p(part)) not in values:
            values.append(p)
    if not values:
        raise argparse.ArgumentTypeError("--p needs at least one value")
    return values


def add_op_location_arguments(parser: argparse.ArgumentParser) -> None:
    """--specs and --generated: shared by bench and profile."""
    parser.add_argument("--specs", type=Path, default=Path("specs"), metavar="DIR",
                        help="where specs are looked up by op name (default: specs)")
    parser.add_argument("--generated", type=Path, default=Path("generated"), metavar="DIR",
                        help="the package of generated modules (default: generated)")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ops", nargs="+", metavar="SPEC_OR_NAME",
                        help="op names (generated/<name>.py) or spec files")
    parser.add_argument("--dtype", dest="dtypes", type=parse_dtype_list, default=parse_dtype_list(DEFAULT_DTYPES),
                        metavar="LIST", help=f"comma-separated dtypes (default: {DEFAULT_DTYPES})")
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--shapes", type=parse_shape_list, default=None, metavar="BxSxH,...",
                        help="comma-separated (B, S, H) shapes, e.g. 8x2048x4096,1x128x1024")
    shapes.add_argument("--sweep", action="store_true",
                        help="the default sweep: " + ", ".join("x".join(map(str, s)) for s in SWEEP_SHAPES))
    parser.add_argument("--p", dest="ps", type=parse_p_list, default=list(SWEEP_P), metavar="LIST",
                        help="comma-separated dropout probabilities (default: 0,0.1; ignored for ops without dropout)")
    parser.add_argument("--backward", action="store_true",
                        help="also time forward+backward and record peak memory")
    parser.add_argument("--first-call-timeout", type=float, default=DEFAULT_FIRST_CALL_TIMEOUT_S, metavar="SECONDS",
                        help="give up on a provider whose first call (compilation, autotuning) takes longer, and "
                             "skip it for the op's later cases in the same dropout state "
                             f"(default: {DEFAULT_FIRST_CALL_TIMEOUT_S:g}; 0: no limit)")
    parser.add_argument("--timer", choices=sorted(TIMERS), default=DEFAULT_TIMER,
                        help="device: do_bench's method with the host's launch cost hidden behind a GPU sleep, "
                             "so small cases time the GPU; do_bench: triton.testing.do_bench unchanged "
                             f"(default: {DEFAULT_TIMER})")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write rows and metadata as JSON")
    parser.add_argument("--csv", type=Path, default=None, metavar="FILE", help="write rows as CSV")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                        help="plot GB/s against size per provider (needs matplotlib)")
    add_op_location_arguments(parser)


def selected_shapes(args) -> list[tuple[int, int, int]]:
    """--shapes when given, else the sweep (--sweep or neither)."""
    return list(args.shapes) if args.shapes else list(SWEEP_SHAPES)


# ---------------------------------------------------------------------------
# Finding the op: its spec (for dims and params) and its generated module


@dataclass(frozen=True)
class BenchOp:
    name: str
    spec: OpSpec
    module: Any
    op: Callable
    reference: Callable
    eager: Callable
    dropout_params: tuple[str, ...]  # the scalar params that are dropout probabilities
    has_dropout: bool  # the op takes training= and seed=


def import_generated(name: str, generated_dir: Path):
    """Import `<generated_dir>.<name>` (normally `generated.<name>`) with its parent on sys.path."""
    package_dir = generated_dir.resolve()
    if not (package_dir / f"{name}.py").is_file():
        raise SpecError(str(generated_dir / f"{name}.py"), None, "no generated module: run `fusegen build` first")
    parent = str(package_dir.parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    return importlib.import_module(f"{package_dir.name}.{name}")


def _generated_spec_sha(module) -> str | None:
    header = Path(module.__file__).read_text(encoding="utf-8").splitlines()[:5]
    for line in header:
        if line.startswith("# spec sha256:"):
            return line.split(":", 1)[1].strip()
    return None


def dropout_param_names(spec: OpSpec) -> tuple[str, ...]:
    """The params that some dropout(...) in the spec takes as its probability."""
    from . import ir  # the IR parse is the one authority on what dropout(...) names

    names: list[str] = []
    for dropout in ir.build_ir(spec).dropouts:
        if dropout.p not in names:
            names.append(dropout.p)
    return tuple(names)


def load_bench_op(spec_or_name: str, specs_dir: Path, generated_dir: Path, command: str = "bench") -> BenchOp:
    spec_path = find_spec(spec_or_name, specs_dir)
    op_spec = load_spec(spec_path)
    module = import_generated(op_spec.name, generated_dir)
    if _generated_spec_sha(module) not in (None, op_spec.sha256):
        # Benchmarking a module built from another version of the spec measures the wrong op.
        print(f"fusegen {command}: warning: {module.__file__} was built from another version of "
              f"{spec_path}; run `fusegen build`", file=sys.stderr)
    op = getattr(module, op_spec.name)
    return BenchOp(
        name=op_spec.name,
        spec=op_spec,
        module=module,
        op=op,
        reference=module.reference,
        eager=module.eager,
        dropout_params=dropout_param_names(op_spec),
        has_dropout="training" in inspect.signature(op).parameters,
    )


# ---------------------------------------------------------------------------
# Shapes and the bytes model


def _split_scaled_dim(dim: str) -> tuple[int, str]:
    """"2N" → (2, "N"); "N" → (1, "N")."""
    match = _SCALED_DIM.match(dim)
    return (int(match.group(1)), match.group(2)) if match else (1, dim)


def hidden_dim_name(out_dims: Sequence[str]) -> str | None:
    """The output's last named dim: the one that becomes H."""
    for dim in reversed(out_dims):
        if dim not in (ELLIPSIS, "1"):
            return _split_scaled_dim(dim)[1]
    return None


def shape_for_dims(dims: Sequence[str], bsh: tuple[int, int, int], hidden: str | None) -> tuple[int, ...]:
    """Map spec dims to sizes: '...' → (B, S), the hidden dim → H (k·H for 'kN'), other names → B·S, '1' → 1."""
    b, s, h = bsh
    shape: list[int] = []
    for dim in dims:
        if dim == ELLIPSIS:
            shape += [b, s]
        elif dim == "1":
            shape.append(1)
        else:
            factor, name = _split_scaled_dim(dim)
            shape.append(factor * (h if name == hidden else b * s))
    return tuple(shape)


def input_shapes(spec: OpSpec, bsh: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
    hidden = hidden_dim_name(spec.out_dims)
    return {inp.name: shape_for_dims(inp.dims, bsh, hidden) for inp in spec.inputs}


def output_shape(spec: OpSpec, bsh: tuple[int, int, int]) -> tuple[int, ...]:
    return shape_for_dims(spec.out_dims, bsh, hidden_dim_name(spec.out_dims))


@dataclass(frozen=True)
class BytesModel:
    """The least traffic the op needs: inputs read once, outputs written once."""

    read: int
    written: int
    output_elements: int  # over all outputs

    @property
    def total(self) -> int:
        return self.read + self.written


def bytes_model(spec: OpSpec, bsh: tuple[int, int, int], dtype: torch.dtype) -> BytesModel:
    """All inputs share `dtype`, so every output has it too (torch's promotion of equal dtypes)."""
    itemsize = dtype.itemsize
    read = sum(math.prod(shape) * itemsize for shape in input_shapes(spec, bsh).values())
    output_elements = len(spec.outputs) * math.prod(output_shape(spec, bsh))
    return BytesModel(read=read, written=output_elements * itemsize, output_elements=output_elements)


def op_kwargs(bench_op: BenchOp, p: float | None) -> dict[str, Any]:
    """Params beyond the tensors: dropout probabilities set to p, a fixed seed; the rest keep their defaults."""
    if not bench_op.has_dropout:
        return {}
    kwargs: dict[str, Any] = {name: p for name in bench_op.dropout_params}
    kwargs.update(training=True, seed=DROPOUT_SEED)  # p > 0 needs training; p == 0 runs no RNG anyway
    return kwargs


def make_inputs(spec: OpSpec, bsh, dtype: torch.dtype, device, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Random normal inputs (never zeros: a kernel must not get to skip work on them)."""
    return [
        torch.randn(shape, dtype=dtype, device=device, generator=generator)
        for shape in input_shapes(spec, bsh).values()
    ]


# ---------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    op: str
    dtype: torch.dtype
    bsh: tuple[int, int, int]
    p: float | None  # None: the op has no dropout

    @property
    def label(self) -> str:
        p = "" if self.p is None else f" p={self.p:g}"
        return f"{self.op} {DTYPE_NAMES.get(self.dtype, str(self.dtype))} {'x'.join(map(str, self.bsh))}{p}"


def plan_cases(ops: Iterable[BenchOp], dtypes, shapes, ps) -> list[Case]:
    """op × dtype × shape × p; an op without dropout runs once per shape, with p None."""
    cases = []
    for bench_op in ops:
        op_ps = list(ps) if bench_op.has_dropout else [None]
        for dtype in dtypes:
            for p in op_ps:
                for bsh in shapes:
                    cases.append(Case(bench_op.name, dtype, tuple(bsh), p))
    return cases


# ---------------------------------------------------------------------------
# Measuring (GPU only)


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float


@dataclass
class Measurement:
    timing: Timing | None = None
    peak_bytes: int | None = None  # above what was allocated before the call
    error: str | None = None
    timed_out: bool = False  # the first call ran past the limit (see FirstCallTimeout)


@dataclass
class ProviderResult:
    provider: str
    forward: Measurement
    forward_backward: Measurement | None = None  # None when --backward was not asked for


class FirstCallTimeout(Exception):
    """A provider's first call (compilation, autotuning) ran past its time limit."""


def time_fn(fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor] | None = None) -> Timing:
    """triton.testing.do_bench as it is: median and 20/80th percentiles, L2 flushed before each run.

    Its timed region starts when the GPU reaches the start event, right after the flush
    (~85 µs for 256 MB on an H100); a call whose host work takes longer than that leaves
    the GPU waiting inside the region, so small cases partly time the host.
    """
    from triton.testing import do_bench

    median, p20, p80 = do_bench(fn, quantiles=list(QUANTILES), grad_to_none=grad_to_none)
    return Timing(median, p20, p80)


def quantiles(times: Sequence[float], qs: Sequence[float]) -> list[float]:
    """Linear-interpolated quantiles, as triton.testing.do_bench computes them."""
    ordered = sorted(times)
    last = len(ordered) - 1
    values = []
    for q in qs:
        point = q * last
        lower, upper = math.floor(point), math.ceil(point)
        values.append(ordered[lower] + (point - lower) * (ordered[upper] - ordered[lower]))
    return values


_SLEEP_CYCLES_PER_S: float | None = None
MAX_RUNS = 1000  # plenty for a median


def sleep_cycles_per_second() -> float:
    """How many torch.cuda._sleep cycles the GPU spins per second (measured once per process)."""
    global _SLEEP_CYCLES_PER_S
    if _SLEEP_CYCLES_PER_S is None:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # warm the kernel up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_S = cycles / (start.elapsed_time(end) * 1e-3)
    return _SLEEP_CYCLES_PER_S


def host_cover_cycles(host_seconds: float, cycles_per_second: float) -> int:
    """Sleep cycles that keep the GPU busy while the host enqueues one call: 1.5× its host time + 50 µs."""
    return int((1.5 * host_seconds + 50e-6) * cycles_per_second)


def time_fn_device(fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor] | None = None,
                   warmup_ms: float = 25.0, rep_ms: float = 100.0) -> Timing:
    """do_bench's method (same flush, warm-up, repetitions and quantiles), timing only the GPU.

    Before each timed run the GPU also spins (torch.cuda._sleep) for longer than the
    host needs to enqueue the call, so every kernel of the call is queued when the start
    event fires: the time is the GPU's, host launch cost excluded (reported apart, as
    host overhead). For large cases both timers agree; for small ones this one gives
    the kernel time that the profiler shows.
    """
    from triton import runtime

    driver = runtime.driver.active
    flush_buffer = driver.get_empty_cache_for_benchmark()
    fn()
    torch.cuda.synchronize()

    # The host cost of one call (no sync: the GPU work runs behind it), to size the sleep.
    host_times = []
    for _ in range(3):
        begin = time.perf_counter()
        fn()
        host_times.append(time.perf_counter() - begin)
    torch.cuda.synchronize()
    cover = host_cover_cycles(max(host_times), sleep_cycles_per_second())

    def timed_runs(count: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        for start, end in zip(starts, ends):
            if grad_to_none is not None:
                for tensor in grad_to_none:
                    tensor.grad = None  # so that backward does not accumulate into .grad
            driver.clear_cache(flush_buffer)
            torch.cuda._sleep(cover)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in zip(starts, ends)]

    # Like do_bench, warm up for ~warmup_ms and time for ~rep_ms; but a timed run here costs
    # flush + sleep + call, and a warm-up call at least its host time, so count those.
    begin = time.perf_counter()
    estimate_ms = statistics.median(timed_runs(5))
    per_run_ms = (time.perf_counter() - begin) * 1e3 / 5
    per_warmup_ms = max(estimate_ms, statistics.median(host_times) * 1e3, 1e-3)
    for _ in range(min(MAX_RUNS, max(1, int(warmup_ms / per_warmup_ms)))):
        fn()
    times = timed_runs(min(MAX_RUNS, max(10, int(rep_ms / per_run_ms))))
    median, p20, p80 = quantiles(times, QUANTILES)
    return Timing(median, p20, p80)


TIMERS: dict[str, Callable] = {"device": time_fn_device, "do_bench": time_fn}
DEFAULT_TIMER = "do_bench"  # what the user sees, host cost included; "device" isolates the GPU


def peak_memory_bytes(fn: Callable[[], Any]) -> int:
    """Peak allocation during one call, above what was live before it (inputs, cached state)."""
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


def describe_error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def release_memory() -> None:
    """Free what a case (or a failed call, e.g. out of memory) left, before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Raise FirstCallTimeout inside the block after `seconds` (SIGALRM; main thread, Unix only).

    Inductor's compile is Python, so the alarm lands in it. Some layers catch and wrap
    exceptions, or fall back to eager; so once the alarm has fired, leaving the block
    raises FirstCallTimeout even if the block itself returned normally.
    """
    usable = seconds > 0 and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return
    fired = False

    def on_alarm(signum, frame):
        nonlocal fired
        fired = True
        raise FirstCallTimeout(f"{what} took longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if fired:
        raise FirstCallTimeout(f"{what} took longer than {seconds:g} s")


def is_timeout(exc: BaseException) -> bool:
    """Whether a FirstCallTimeout is this exception or anywhere in its cause/context chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, FirstCallTimeout):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def measure(fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor] | None = None,
            timer: Callable = time_fn_device, peak: Callable = peak_memory_bytes,
            first_call_timeout_s: float = 0.0) -> Measurement:
    """Time fn and record its peak memory; an exception becomes the measurement's error.

    The first call (where torch.compile compiles and Triton autotunes) runs alone under
    the time limit; do_bench then calls fn again untimed before it starts timing.
    """
    try:
        with time_limit(first_call_timeout_s, "the first call"):
            fn()
        timing = timer(fn, grad_to_none)
        if grad_to_none:
            for tensor in grad_to_none:
                tensor.grad = None
        return Measurement(timing=timing, peak_bytes=peak(fn))
    except Exception as exc:  # one failing provider or case must not end the whole run
        release_memory()
        if is_timeout(exc):
            return Measurement(error=f"timed out: the first call took longer than {first_call_timeout_s:g} s",
                               timed_out=True)
        return Measurement(error=describe_error(exc))


class TimeoutMemo:
    """Providers whose first call timed out, so that later cases skip them instead of waiting again.

    Keyed by (op, dropout on, provider, phase): with dynamic=False every shape and dtype
    compiles afresh, and what made one compile run away (e.g. the Philox graph of the
    eager dropout) is there in the next. A forward timeout skips fwd+bwd too.
    """

    def __init__(self):
        self.reasons: dict[tuple, str] = {}

    @staticmethod
    def _key(op: str, p: float | None, provider: str, phase: str) -> tuple:
        return (op, bool(p), provider, phase)

    def skip_reason(self, op: str, p: float | None, provider: str, phase: str) -> str | None:
        return self.reasons.get(self._key(op, p, provider, phase))

    def record(self, op: str, p: float | None, provider: str, phase: str, measurement: Measurement) -> None:
        if not measurement.timed_out:
            return
        reason = "skipped: its first call timed out on an earlier case"
        for skipped_phase in (("forward", "forward_backward") if phase == "forward" else (phase,)):
            self.reasons.setdefault(self._key(op, p, provider, skipped_phase), reason)


def make_providers(bench_op: BenchOp) -> dict[str, Callable]:
    """The three providers; compile is a fresh torch.compile, with dynamo state reset first."""
    torch._dynamo.reset()  # no guards or recompile counts carried over from earlier cases
    # The baselines are the op as a PyTorch user writes it (the generated `eager`: F.gelu,
    # torch's own dropout), not `reference`, whose bit-exact host Philox is a test oracle:
    # ~290 small kernels eagerly, and a graph inductor does not finish compiling.
    return {
        "fusegen": bench_op.op,
        "eager": bench_op.eager,
        "compile": torch.compile(bench_op.eager, dynamic=False),
    }


def _as_tuple(outputs) -> tuple[torch.Tensor, ...]:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def forward_fn(provider: Callable, inputs: Sequence[torch.Tensor], kwargs: dict) -> Callable[[], Any]:
    return lambda: provider(*inputs, **kwargs)


def forward_backward_fn(provider: Callable, inputs: Sequence[torch.Tensor], kwargs: dict,
                        grad_outputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        outputs = _as_tuple(provider(*inputs, **kwargs))
        torch.autograd.backward(outputs, grad_tensors=list(grad_outputs))

    return step


def run_case(bench_op: BenchOp, case: Case, backward: bool, device="cuda",
             timer: Callable = time_fn_device, peak: Callable = peak_memory_bytes,
             first_call_timeout_s: float = 0.0, memo: TimeoutMemo | None = None) -> list[ProviderResult]:
    """All providers on one case: forward for each, then (with backward) forward+backward for each."""
    memo = memo if memo is not None else TimeoutMemo()
    inputs = make_inputs(bench_op.spec, case.bsh, case.dtype, device)
    kwargs = op_kwargs(bench_op, case.p)
    providers = make_providers(bench_op)

    def run(name: str, phase: str, fn: Callable, grad_to_none=None) -> Measurement:
        reason = memo.skip_reason(case.op, case.p, name, phase)
        if reason:
            return Measurement(error=reason)
        measurement = measure(fn, grad_to_none, timer=timer, peak=peak, first_call_timeout_s=first_call_timeout_s)
        memo.record(case.op, case.p, name, phase, measurement)
        return measurement

    results = {
        name: ProviderResult(name, run(name, "forward", forward_fn(fn, inputs, kwargs)))
        for name, fn in providers.items()
    }
    if backward:
        for tensor in inputs:
            tensor.requires_grad_(True)
        out_shape = output_shape(bench_op.spec, case.bsh)
        grad_outputs = [torch.randn(out_shape, dtype=case.dtype, device=device) for _ in bench_op.spec.outputs]
        for name, fn in providers.items():
            step = forward_backward_fn(fn, inputs, kwargs, grad_outputs)
            results[name].forward_backward = run(name, "forward_backward", step, grad_to_none=inputs)
        del grad_outputs
    del inputs, providers
    release_memory()
    return list(results.values())


def copy_bandwidth_gbs(nbytes: int = COPY_BANDWIDTH_BYTES, timer: Callable = time_fn_device, device="cuda") -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes), counting bytes read and written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    src.fill_(1.0)
    timing = timer(lambda: dst.copy_(src), None)
    del src, dst
    release_memory()
    return 2 * nbytes / (timing.median_ms * 1e-3) / 1e9


def host_overhead_us(fn: Callable[[], Any], calls: int = HOST_OVERHEAD_CALLS, warmup: int = HOST_OVERHEAD_WARMUP,
                     synchronize: Callable[[], None] = torch.cuda.synchronize) -> float:
    """Median wall time of one call in µs, synchronizing only around the loop: the per-call CPU cost."""
    for _ in range(warmup):
        fn()
    synchronize()
    per_call_ns = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        per_call_ns.append(time.perf_counter_ns() - start)
    synchronize()
    return statistics.median(per_call_ns) / 1e3


def measure_host_overhead(bench_op: BenchOp, dtype: torch.dtype, p: float | None, device="cuda",
                          synchronize: Callable[[], None] = torch.cuda.synchronize,
                          first_call_timeout_s: float = 0.0, memo: TimeoutMemo | None = None) -> list[dict[str, Any]]:
    """One row per provider: µs per call on a tiny input, or why there is none."""
    memo = memo if memo is not None else TimeoutMemo()
    inputs = make_inputs(bench_op.spec, HOST_OVERHEAD_SHAPE, dtype, device)
    kwargs = op_kwargs(bench_op, p)
    rows = []
    for name, provider in make_providers(bench_op).items():
        row: dict[str, Any] = {"op": bench_op.name, "dtype": DTYPE_NAMES.get(dtype, str(dtype)), "p": p,
                               "provider": name, "us_per_call": None, "error": None}
        fn = forward_fn(provider, inputs, kwargs)
        row["error"] = memo.skip_reason(bench_op.name, p, name, "forward")
        if row["error"] is None:
            try:
                with time_limit(first_call_timeout_s, "the first call"):
                    fn()
                row["us_per_call"] = host_overhead_us(fn, synchronize=synchronize)
            except Exception as exc:
                row["error"] = "timed out" if is_timeout(exc) else describe_error(exc)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Rows: one per (case, provider), the unit of the table, the JSON and the CSV

ROW_FIELDS = (
    "op", "dtype", "B", "S", "H", "p", "provider",
    "output_elements", "bytes_read", "bytes_written",
    "ms", "ms_p20", "ms_p80", "gelem_per_s", "gb_per_s", "copy_fraction",
    "speedup_vs_eager", "speedup_vs_compile", "peak_fwd_mib", "error",
    "fwd_bwd_ms", "fwd_bwd_ms_p20", "fwd_bwd_ms_p80",
    "fwd_bwd_speedup_vs_eager", "fwd_bwd_speedup_vs_compile", "peak_fwd_bwd_mib", "fwd_bwd_error",
)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def case_rows(case: Case, model: BytesModel, results: Sequence[ProviderResult], copy_gbs: float | None) -> list[dict]:
    """Rates, fraction of copy bandwidth and speed-ups for each provider of one case."""
    def median(measurement: Measurement | None) -> float | None:
        return measurement.timing.median_ms if measurement and measurement.timing else None

    by_name = {r.provider: r for r in results}
    eager_ms = median(by_name["eager"].forward) if "eager" in by_name else None
    compile_ms = median(by_name["compile"].forward) if "compile" in by_name else None
    eager_fb_ms = median(by_name["eager"].forward_backward) if "eager" in by_name else None
    compile_fb_ms = median(by_name["compile"].forward_backward) if "compile" in by_name else None
    rows = []
    for result in results:
        fwd = result.forward
        ms = median(fwd)
        seconds = ms * 1e-3 if ms else None
        gb_per_s = _ratio(model.total / 1e9, seconds)
        row = {
            "op": case.op, "dtype": DTYPE_NAMES.get(case.dtype, str(case.dtype)),
            "B": case.bsh[0], "S": case.bsh[1], "H": case.bsh[2], "p": case.p, "provider": result.provider,
            "output_elements": model.output_elements, "bytes_read": model.read, "bytes_written": model.written,
            "ms": ms,
            "ms_p20": fwd.timing.p20_ms if fwd.timing else None,
            "ms_p80": fwd.timing.p80_ms if fwd.timing else None,
            "gelem_per_s": _ratio(model.output_elements / 1e9, seconds),
            "gb_per_s": gb_per_s,
            "copy_fraction": _ratio(gb_per_s, copy_gbs),
            "speedup_vs_eager": _ratio(eager_ms, ms),
            "speedup_vs_compile": _ratio(compile_ms, ms),
            "peak_fwd_mib": _mib(fwd.peak_bytes),
            "error": fwd.error,
        }
        fb = result.forward_backward
        fb_ms = median(fb)
        row.update({
            "fwd_bwd_ms": fb_ms,
            "fwd_bwd_ms_p20": fb.timing.p20_ms if fb and fb.timing else None,
            "fwd_bwd_ms_p80": fb.timing.p80_ms if fb and fb.timing else None,
            "fwd_bwd_speedup_vs_eager": _ratio(eager_fb_ms, fb_ms),
            "fwd_bwd_speedup_vs_compile": _ratio(compile_fb_ms, fb_ms),
            "peak_fwd_bwd_mib": _mib(fb.peak_bytes) if fb else None,
            "fwd_bwd_error": fb.error if fb else None,
        })
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Reporting


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def results_table(rows: Sequence[dict], backward: bool, copy_gbs: float | None):
    """A rich Table, one section per case; errors show as a numbered note below the table."""
    from rich.table import Table

    title = "fusegen bench" + ("" if copy_gbs is None else f" (copy bandwidth {copy_gbs:.0f} GB/s)")
    table = Table(title=title, header_style="bold", show_lines=False)
    for column in ("op", "dtype", "BxSxH", "p", "provider"):
        table.add_column(column)
    for column in ("ms", "Gelem/s", "GB/s", "% copy", "× eager", "× compile", "peak MiB"):
        table.add_column(column, justify="right")
    if backward:
        for column in ("fwd+bwd ms", "× eager", "× compile", "peak MiB"):
            table.add_column(column, justify="right")
    notes: list[str] = []

    def note(text: str) -> str:
        notes.append(text)
        return f"error [{len(notes)}]"

    for index, row in enumerate(rows):
        case_key = (row["op"], row["dtype"], row["B"], row["S"], row["H"], row["p"])
        next_key = None
        if index + 1 < len(rows):
            nxt = rows[index + 1]
            next_key = (nxt["op"], nxt["dtype"], nxt["B"], nxt["S"], nxt["H"], nxt["p"])
        label = f"{row['op']} {row['dtype']} {row['B']}x{row['S']}x{row['H']} p={row['p']}"
        cells = [row["op"], row["dtype"], f"{row['B']}x{row['S']}x{row['H']}",
                 "–" if row["p"] is None else f"{row['p']:g}", row["provider"]]
        if row["error"]:
            cells += [note(f"{label} {row['provider']}: {row['error']}")] + [""] * 6
        else:
            cells += [
                _fmt(row["ms"], ".4f"), _fmt(row["gelem_per_s"], ".1f"), _fmt(row["gb_per_s"], ".0f"),
                _fmt(row["copy_fraction"], ".0%"), _fmt(row["speedup_vs_eager"], ".2f", "×"),
                _fmt(row["speedup_vs_compile"], ".2f", "×"), _fmt(row["peak_fwd_mib"], ".0f"),
            ]
        if backward:
            if row["fwd_bwd_error"]:
                cells += [note(f"{label} {row['provider']} fwd+bwd: {row['fwd_bwd_error']}"), "", "", ""]
            else:
                cells += [
                    _fmt(row["fwd_bwd_ms"], ".4f"), _fmt(row["fwd_bwd_speedup_vs_eager"], ".2f", "×"),
                    _fmt(row["fwd_bwd_speedup_vs_compile"], ".2f", "×"), _fmt(row["peak_fwd_bwd_mib"], ".0f"),
                ]
        style = "bold" if row["provider"] == "fusegen" else None
        table.add_row(*cells, style=style, end_section=next_key != case_key)
    return table, notes


def host_overhead_table(rows: Sequence[dict]):
    from rich.table import Table

    table = Table(title=f"host overhead: µs per call on a {'x'.join(map(str, HOST_OVERHEAD_SHAPE))} input "
                        "(median wall time, no sync per call)", header_style="bold")
    for column in ("op", "dtype", "p", "provider"):
        table.add_column(column)
    table.add_column("µs/call", justify="right")
    for row in rows:
        value = row["error"] or _fmt(row["us_per_call"], ".1f")
        table.add_row(row["op"], row["dtype"], "–" if row["p"] is None else f"{row['p']:g}", row["provider"], value)
    return table


def run_metadata(copy_gbs: float | None, timer: str = DEFAULT_TIMER) -> dict[str, Any]:
    import triton

    metadata: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": sys.argv,
        "timer": timer,
        "timer_method": {
            "device": "do_bench's method (flush, warm-up, repetitions, median and 20/80th percentiles) with a GPU "
                      "sleep before each timed run that hides the host's launch cost",
            "do_bench": "triton.testing.do_bench, median and 20/80th percentiles",
        }[timer] + "; first call and warm-up untimed",
        "l2_handling": f"do_bench zeroes a {TRITON_FLUSH_BYTES >> 20} MB buffer before every timed run",
        "dropout_seed": DROPOUT_SEED,
        "copy_bandwidth_gbs": copy_gbs,
        "copy_bandwidth_method": f"dst.copy_(src), {COPY_BANDWIDTH_BYTES >> 20} MiB fp32, read + write bytes",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        metadata["device"] = props.name
        metadata["l2_bytes"] = getattr(props, "L2_cache_size", None)
        metadata["multiprocessors"] = props.multi_processor_count
    return metadata


def write_json(path: Path, metadata: dict, rows: Sequence[dict], host_rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"metadata": metadata, "rows": list(rows), "host_overhead": list(host_rows)}
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def write_csv(path: Path, metadata: dict, rows: Sequence[dict]) -> None:
    """Each row carries device and versions too, so a CSV from one run stands on its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {key: metadata.get(key) for key in ("device", "torch", "triton", "date")}
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*extra, *ROW_FIELDS])
        writer.writeheader()
        for row in rows:
            writer.writerow({**extra, **{key: row.get(key) for key in ROW_FIELDS}})


def matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def plot_series(rows: Sequence[dict]) -> dict[tuple[str, Any], dict[str, list[tuple[int, float]]]]:
    """(dtype, p) → line label → sorted (elements, GB/s) points, from the rows that have a time."""
    ops = {row["op"] for row in rows}
    panels: dict[tuple[str, Any], dict[str, list[tuple[int, float]]]] = {}
    for row in rows:
        if row["gb_per_s"] is None:
            continue
        label = row["provider"] if len(ops) == 1 else f"{row['op']} {row['provider']}"
        panels.setdefault((row["dtype"], row["p"]), {}).setdefault(label, []).append(
            (row["output_elements"], row["gb_per_s"]))
    for lines in panels.values():
        for points in lines.values():
            points.sort()
    return panels


def write_plot(path: Path, rows: Sequence[dict], copy_gbs: float | None, title: str) -> None:
    """GB/s against output elements per provider, one subplot per (dtype, p), copy bandwidth as a line."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a GPU box
    import matplotlib.pyplot as plt

    panels = plot_series(rows)
    if not panels:
        return
    keys = sorted(panels, key=lambda k: (k[0], -1.0 if k[1] is None else k[1]))
    dtypes = sorted({k[0] for k in keys})
    ps = sorted({k[1] for k in keys}, key=lambda p: -1.0 if p is None else p)
    # One colour per line label in every panel, so a provider reads the same everywhere.
    labels = sorted({label for lines in panels.values() for label in lines})
    colours = {label: f"C{index % 10}" for index, label in enumerate(labels)}
    fig, axes = plt.subplots(len(dtypes), len(ps), figsize=(5.5 * len(ps), 4 * len(dtypes)), squeeze=False)
    for (dtype, p), lines in panels.items():
        ax = axes[dtypes.index(dtype)][ps.index(p)]
        for label, points in sorted(lines.items()):
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=label, color=colours[label])
        if copy_gbs:
            ax.axhline(copy_gbs, color="grey", linestyle="--", label=f"copy {copy_gbs:.0f} GB/s")
        ax.set_xscale("log")
        ax.set_xlabel("output elements")
        ax.set_ylabel("GB/s (bytes model)")
        ax.set_title(f"{dtype}" + ("" if p is None else f", p={p:g}"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    for row_axes in axes:
        for ax in row_axes:
            if not ax.has_data():
                ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def interpreter_refusal(command: str) -> int | None:
    from .runtime.launch import is_interpreting

    if is_interpreting():
        return _fail(command, "TRITON_INTERPRET is set: kernels would run on the CPU interpreter; unset it")
    return None


def run_bench(args) -> int:
    refusal = no_gpu_exit("bench", "benchmarks") or interpreter_refusal("bench")
    if refusal:
        return refusal
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # Piped to a file or a log, rich would squeeze the table to 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        loaded = [load_bench_op(name, args.specs, args.generated) for name in args.ops]
    except (SpecError, ImportError) as exc:
        return _fail("bench", str(exc))
    ops = list({bench_op.name: bench_op for bench_op in loaded}.values())  # an op named twice runs once
    plot_path = args.plot
    if plot_path is not None and matplotlib_missing():
        print("fusegen bench: --plot needs matplotlib (pip install 'fusegen[plot]'); no plot will be drawn",
              file=sys.stderr)
        plot_path = None

    cases = plan_cases(ops, args.dtypes, selected_shapes(args), args.ps)
    by_name = {bench_op.name: bench_op for bench_op in ops}
    timer = TIMERS[args.timer]
    copy_gbs = copy_bandwidth_gbs(timer=timer)
    metadata = run_metadata(copy_gbs, args.timer)
    console.print(f"{metadata.get('device')} · torch {metadata['torch']} · triton {metadata['triton']} · "
                  f"copy {copy_gbs:.0f} GB/s · timer {args.timer} · {len(cases)} cases × {len(PROVIDERS)} providers")

    rows: list[dict] = []
    memo = TimeoutMemo()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    with progress:
        task = progress.add_task("benchmarking", total=len(cases))
        for case in cases:
            progress.update(task, description=case.label)
            bench_op = by_name[case.op]
            results = run_case(bench_op, case, args.backward, timer=timer,
                               first_call_timeout_s=args.first_call_timeout, memo=memo)
            rows += case_rows(case, bytes_model(bench_op.spec, case.bsh, case.dtype), results, copy_gbs)
            progress.advance(task)

    # Host overhead: per op, in the first dtype, for each p (dropout changes eager's work most).
    host_rows: list[dict] = []
    for bench_op in ops:
        for p in (args.ps if bench_op.has_dropout else [None]):
            host_rows += measure_host_overhead(bench_op, args.dtypes[0], p,
                                               first_call_timeout_s=args.first_call_timeout, memo=memo)

    table, notes = results_table(rows, args.backward, copy_gbs)
    console.print(table)
    for number, text in enumerate(notes, 1):
        console.print(f"[{number}] {text}", markup=False, highlight=False)
    console.print(host_overhead_table(host_rows))

    if args.json:
        write_json(args.json, metadata, rows, host_rows)
        console.print(f"wrote {args.json}")
    if args.csv:
        write_csv(args.csv, metadata, rows)
        console.print(f"wrote {args.csv}")
    if plot_path:
        write_plot(plot_path, rows, copy_gbs, f"{', '.join(b.name for b in ops)} on {metadata.get('device')}")
        console.print(f"wrote {plot_path}")
    return 0
