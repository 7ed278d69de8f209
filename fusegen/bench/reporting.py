"""Reporting `fusegen bench`'s results: rows, rich tables, run metadata, JSON, CSV and a plot."""
from __future__ import annotations

import csv
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from .arguments import DTYPE_NAMES
from .cases import DROPOUT_SEED, BytesModel, Case
from .peers import PeerStatus
from .running import HOST_OVERHEAD_RANK, HOST_OVERHEAD_SHAPE, ProviderResult
from .timing import COPY_BANDWIDTH_BYTES, DEFAULT_TIMER, TRITON_FLUSH_BYTES, Measurement


# ---------------------------------------------------------------------------
# Rows: one per (case, provider), the unit of the table, the JSON and the CSV

ROW_FIELDS = (
    # K: a matmul's dim summed over, R: a low-rank product's rank or a hidden layer's width (None without)
    "op", "dtype", "B", "S", "H", "K", "R", "p", "provider",
    "output_elements", "bytes_read", "bytes_written",
    "ms", "ms_p20", "ms_p80", "gelem_per_s", "gb_per_s", "copy_fraction", "tflop_per_s",
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
            "B": case.bsh[0], "S": case.bsh[1], "H": case.bsh[3] if len(case.bsh) > 3 else case.bsh[2],
            "K": case.bsh[2] if len(case.bsh) > 3 else None, "R": case.bsh[4] if len(case.bsh) > 4 else None,
            "p": case.p, "provider": result.provider,
            "output_elements": model.output_elements, "bytes_read": model.read, "bytes_written": model.written,
            "ms": ms,
            "ms_p20": fwd.timing.p20_ms if fwd.timing else None,
            "ms_p80": fwd.timing.p80_ms if fwd.timing else None,
            "gelem_per_s": _ratio(model.output_elements / 1e9, seconds),
            "gb_per_s": gb_per_s,
            "copy_fraction": _ratio(gb_per_s, copy_gbs),
            # The matmul's work (an op with one), at the forward's time: what a GEMM is judged by.
            "tflop_per_s": _ratio(model.matmul_flops / 1e12, seconds) if model.matmul_flops else None,
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
    flops = any(row.get("tflop_per_s") is not None for row in rows)  # some op with a matmul
    for column in ("ms", "Gelem/s", "GB/s", "% copy", *(("TFLOP/s",) if flops else ()), "× eager", "× compile",
                   "peak MiB"):
        table.add_column(column, justify="right")
    if backward:
        for column in ("fwd+bwd ms", "× eager", "× compile", "peak MiB"):
            table.add_column(column, justify="right")
    notes: list[str] = []

    def note(text: str) -> str:
        notes.append(text)
        return f"error [{len(notes)}]"

    for index, row in enumerate(rows):
        case_key = _case_key(row)
        next_key = _case_key(rows[index + 1]) if index + 1 < len(rows) else None
        shape = "x".join(str(row[d]) for d in ("B", "S", "K", "H", "R") if row.get(d) is not None)
        label = f"{row['op']} {row['dtype']} {shape} p={row['p']}"
        cells = [row["op"], row["dtype"], shape,
                 "–" if row["p"] is None else f"{row['p']:g}", row["provider"]]
        if row["error"]:
            cells += [note(f"{label} {row['provider']}: {row['error']}")] + [""] * (7 if flops else 6)
        else:
            cells += [
                _fmt(row["ms"], ".4f"), _fmt(row["gelem_per_s"], ".1f"), _fmt(row["gb_per_s"], ".0f"),
                _fmt(row["copy_fraction"], ".0%"), *((_fmt(row.get("tflop_per_s"), ".0f"),) if flops else ()),
                _fmt(row["speedup_vs_eager"], ".2f", "×"),
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
        style = "bold" if row["provider"].startswith("fusegen") else None
        table.add_row(*cells, style=style, end_section=next_key != case_key)
    return table, notes


def _case_key(row: dict) -> tuple:
    """The case a row belongs to: the table's sections."""
    return tuple(row.get(field) for field in ("op", "dtype", "B", "S", "H", "K", "R", "p"))


def host_overhead_table(rows: Sequence[dict]):
    from rich.table import Table

    table = Table(title=f"host overhead: µs per call on a {'x'.join(map(str, HOST_OVERHEAD_SHAPE))} input (rank "
                        f"{HOST_OVERHEAD_RANK} for a low-rank product or hidden layer; median wall time, no sync per "
                        "call)",
                  header_style="bold")
    for column in ("op", "dtype", "p", "provider"):
        table.add_column(column)
    table.add_column("µs/call", justify="right")
    for row in rows:
        value = row["error"] or _fmt(row["us_per_call"], ".1f")
        table.add_row(row["op"], row["dtype"], "–" if row["p"] is None else f"{row['p']:g}", row["provider"], value)
    return table


def run_metadata(copy_gbs: float | None, timer: str = DEFAULT_TIMER,
                 peers: Sequence[PeerStatus] = ()) -> dict[str, Any]:
    import triton

    from ..runtime import native

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
        "autograd_node": native.status(),  # the C++ node or the Python Function (fusegen.runtime.native)
        # Each peer's name, installed version (None: skipped), the ops it ran and any note.
        "peers": [status.metadata() for status in peers],
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
