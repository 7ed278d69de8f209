"""Command-line arguments of `fusegen bench`, and the values `fusegen profile` shares with it."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .timing import DEFAULT_TIMER, TIMERS

# (B, S, H): from a tiny decoder step to a large training batch. The smallest cases fit
# in L2; do_bench's flush (see fusegen.bench.timing) keeps them honest.
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

# A provider's first call (torch.compile, autotuning) gets this long. Inductor can grind for
# many minutes on the eager dropout's Philox integer arithmetic; a bench run must go on.
DEFAULT_FIRST_CALL_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------
# Command-line values


def parse_shape(text: str) -> tuple[int, ...]:
    """"8x2048x4096" → (B, S, H); "1x16384x4096x11008" → (B, S, K, H): an op with a matmul's
    dim summed over, K (without it, K is H); "1x16384x4096x4096x16" → (B, S, K, H, R): an op
    with a low-rank product too, its rank R (a hidden layer, its width)."""
    parts = text.strip().lower().split("x")
    try:
        sizes = tuple(int(part) for part in parts)
    except ValueError:
        sizes = ()
    if len(sizes) not in (3, 4, 5) or any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"shape {text!r} must be BxSxH (or BxSxKxH for an op with a matmul, BxSxKxHxR "
                                         "with a low-rank product) with positive integers, e.g. 8x2048x4096")
    return sizes


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
                        help="comma-separated (B, S, H) shapes, e.g. 8x2048x4096,1x128x1024; for an op with a "
                             "matmul, (B, S, K, H) too: 1x16384x4096x11008 (K, the dim summed over, else H); with a "
                             "low-rank product, (B, S, K, H, R): 1x16384x4096x4096x16 (R its rank; a hidden layer's "
                             "width)")
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
    parser.add_argument("--backend", dest="backends", action="append", choices=("cuda",), default=[],
                        help="also time the op built by this backend (fusegen-cuda), beside the generated module's")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write rows and metadata as JSON")
    parser.add_argument("--csv", type=Path, default=None, metavar="FILE", help="write rows as CSV")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                        help="plot GB/s against size per provider (needs matplotlib)")
    add_op_location_arguments(parser)


def selected_shapes(args) -> list[tuple[int, int, int]]:
    """--shapes when given, else the sweep (--sweep or neither)."""
    return list(args.shapes) if args.shapes else list(SWEEP_SHAPES)
