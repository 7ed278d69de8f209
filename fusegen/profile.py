"""`fusegen profile`: torch.profiler tables for eager, the generated op and torch.compile.

Each provider is warmed up first (compilation, autotuning and lazy initialisation stay out
of the trace), then a few calls are profiled with CPU and CUDA activity. The closing line
counts the distinct CUDA kernels each provider ran: the generated op should launch one,
eager many (one per torch op, plus the Philox ops of its dropout mask).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from typing import Any, Callable, Iterable

import torch

from . import bench
from .errors import SpecError

DEFAULT_SHAPE = "8x2048x4096"
DEFAULT_DTYPE = "bf16"
DEFAULT_P = 0.1
PROFILE_ORDER = ("eager", "fusegen", "compile")
WARMUP_CALLS = 3
PROFILED_CALLS = 5
ROW_LIMIT = 10

# Device events that are copies or fills, not kernels.
_NOT_KERNELS = ("Memcpy", "Memset")


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op", metavar="SPEC_OR_NAME", help="an op name (generated/<name>.py) or a spec file")
    parser.add_argument("--shape", type=bench.parse_shape, default=bench.parse_shape(DEFAULT_SHAPE), metavar="BxSxH",
                        help=f"(B, S, H) of the inputs (default: {DEFAULT_SHAPE})")
    parser.add_argument("--dtype", type=bench.parse_dtype, default=bench.parse_dtype(DEFAULT_DTYPE),
                        help=f"fp32, bf16, fp16 or fp64 (default: {DEFAULT_DTYPE})")
    parser.add_argument("--p", type=bench.parse_p, default=DEFAULT_P,
                        help=f"dropout probability (default: {DEFAULT_P}; ignored for ops without dropout)")
    parser.add_argument("--row-limit", type=int, default=ROW_LIMIT, help=f"rows per table (default: {ROW_LIMIT})")
    parser.add_argument("--first-call-timeout", type=float, default=bench.DEFAULT_FIRST_CALL_TIMEOUT_S,
                        metavar="SECONDS", help="give up on a provider whose first call (compilation, autotuning) "
                                                f"takes longer (default: {bench.DEFAULT_FIRST_CALL_TIMEOUT_S:g}; 0: no limit)")
    bench.add_op_location_arguments(parser)


def cuda_kernel_names(events: Iterable[Any]) -> Counter:
    """Kernel name → launches, from profiler events (copies and memsets left out)."""
    from torch.autograd import DeviceType

    launches: Counter = Counter()
    for event in events:
        if event.device_type == DeviceType.CUDA and not event.name.startswith(_NOT_KERNELS):
            launches[event.name] += 1
    return launches


def profile_provider(fn: Callable[[], Any], calls: int = PROFILED_CALLS, first_call_timeout_s: float = 0.0):
    """Warm up (the first call under the time limit), then profile `calls` calls with CPU and CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    with bench.time_limit(first_call_timeout_s, "the first call"):
        fn()
    for _ in range(WARMUP_CALLS - 1):
        fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        # One profile per provider, one cycle each: torch's note about clearing events between cycles is noise.
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    return prof


def kernel_summary(counts: dict[str, Counter | str], calls: int = PROFILED_CALLS) -> str:
    """One line: distinct kernels (and launches per call) for each provider, or its error."""
    parts = []
    for provider, launches in counts.items():
        if isinstance(launches, str):
            parts.append(f"{provider} failed")
        else:
            per_call = sum(launches.values()) / calls
            parts.append(f"{provider} {len(launches)} ({per_call:g} launches per call)")
    return "distinct CUDA kernels: " + ", ".join(parts)


def run_profile(args) -> int:
    refusal = bench.no_gpu_exit("profile", "profiles") or bench.interpreter_refusal("profile")
    if refusal:
        return refusal
    try:
        bench_op = bench.load_bench_op(args.op, args.specs, args.generated, command="profile")
    except (SpecError, ImportError) as exc:
        print(f"fusegen profile: {exc}", file=sys.stderr)
        return 1
    p = args.p if bench_op.has_dropout else None
    case = bench.Case(bench_op.name, args.dtype, tuple(args.shape), p)
    inputs = bench.make_inputs(bench_op.spec, case.bsh, case.dtype, "cuda")
    kwargs = bench.op_kwargs(bench_op, p)
    providers = bench.make_providers(bench_op)

    counts: dict[str, Counter | str] = {}
    for name in PROFILE_ORDER:
        print(f"\n== {name}: {case.label} ==")
        try:
            prof = profile_provider(bench.forward_fn(providers[name], inputs, kwargs),
                                    first_call_timeout_s=args.first_call_timeout)
        except Exception as exc:  # e.g. a compile failure: the other providers still get profiled
            counts[name] = "timed out" if bench.is_timeout(exc) else bench.describe_error(exc)
            print(f"{name} failed: {counts[name]}")
            continue
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.row_limit))
        counts[name] = cuda_kernel_names(prof.events())
    print(kernel_summary(counts))
    return 0
