"""`fusegen bench` itself (run_bench), and the refusals (no GPU, the interpreter) that profile shares."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from ..errors import SpecError
from .arguments import selected_shapes
from .cases import bytes_model, load_bench_op, plan_cases, shape_problem
from .reporting import (
    case_rows,
    host_overhead_table,
    matplotlib_missing,
    results_table,
    run_metadata,
    write_csv,
    write_json,
    write_plot,
)
from .peers import peer_statuses
from .running import TimeoutMemo, measure_host_overhead, provider_names, run_case
from .timing import TIMERS, copy_bandwidth_gbs


def _fail(command: str, message: str) -> int:
    print(f"fusegen {command}: {message}", file=sys.stderr)
    return 1


def no_gpu_exit(command: str, what: str) -> int | None:
    """1 (after one stderr line) when there is no CUDA GPU; None when there is one."""
    if not torch.cuda.is_available():
        return _fail(command, f"no CUDA GPU here; {what} need one")
    return None


def interpreter_refusal(command: str) -> int | None:
    from ..backends.triton.interpreter import is_interpreting

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
    twins = Path(tempfile.mkdtemp(prefix="fusegen-bench-")) if args.backends else None  # --backend's builds
    try:
        loaded = [load_bench_op(name, args.specs, args.generated, backends=args.backends, twins_dir=twins)
                  for name in args.ops]
    except (SpecError, ImportError) as exc:
        return _fail("bench", str(exc))
    ops = list({bench_op.name: bench_op for bench_op in loaded}.values())  # an op named twice runs once
    plot_path = args.plot
    if plot_path is not None and matplotlib_missing():
        print("fusegen bench: --plot needs matplotlib (pip install 'fusegen[plot]'); no plot will be drawn",
              file=sys.stderr)
        plot_path = None

    problem = next((p for shape in selected_shapes(args) for bench_op in ops if (p := shape_problem(bench_op.spec, shape))),
                   None)
    if problem:
        return _fail("bench", problem)
    cases = plan_cases(ops, args.dtypes, selected_shapes(args), args.ps)
    by_name = {bench_op.name: bench_op for bench_op in ops}
    timer = TIMERS[args.timer]
    copy_gbs = copy_bandwidth_gbs(timer=timer)
    statuses = peer_statuses([bench_op.name for bench_op in ops])
    peers = [status.peer for status in statuses if status.available and status.ops]
    metadata = run_metadata(copy_gbs, args.timer, statuses)
    console.print(f"{metadata.get('device')} · torch {metadata['torch']} · triton {metadata['triton']} · "
                  f"copy {copy_gbs:.0f} GB/s · timer {args.timer} · {len(cases)} cases × "
                  f"{max(len(provider_names(bench_op)) for bench_op in ops) + len(peers)} providers")
    for status in statuses:  # one line each: its version and ops, or why it is skipped
        console.print(status.line(), markup=False, highlight=False)

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
                               first_call_timeout_s=args.first_call_timeout, memo=memo, peers=peers)
            rows += case_rows(case, bytes_model(bench_op.spec, case.bsh, case.dtype), results, copy_gbs)
            progress.advance(task)

    # Host overhead: per op, in the first dtype, for each p (dropout changes eager's work most).
    host_rows: list[dict] = []
    for bench_op in ops:
        for p in (args.ps if bench_op.has_dropout else [None]):
            host_rows += measure_host_overhead(bench_op, args.dtypes[0], p,
                                               first_call_timeout_s=args.first_call_timeout, memo=memo,
                                               peers=peers)

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
