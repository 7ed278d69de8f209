"""Timing for `fusegen bench`: do_bench and a device timer, peak memory, first-call time limits.

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

First calls run under a time limit (--first-call-timeout), so a provider that cannot
compile in reasonable time is reported as timed out rather than hanging the sweep.
"""
from __future__ import annotations

import contextlib
import gc
import math
import signal
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

QUANTILES = (0.5, 0.2, 0.8)  # median first: do_bench returns them in this order
COPY_BANDWIDTH_BYTES = 1 << 30  # 1 GiB source: far past L2, long enough to time well
HOST_OVERHEAD_WARMUP = 50
HOST_OVERHEAD_CALLS = 500
TRITON_FLUSH_BYTES = 256 * 1024 * 1024  # the buffer triton.testing.do_bench zeroes


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
