"""The Triton kernels' tile shapes: the autotuner's configurations, the pruners that keep
those that fit a problem (each pair a kernel's tuning space), and the backward's rows per
program; for the pointwise kind, and what every kind's tuning shares (the autotuner, M's
bucket, size hints). The row kind's own are in row_tuning.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton

from .interpreter import is_interpreting

GRID_Y_LIMIT = 65535


# Measured on an H100 (docs/benchmarks.md): wide rows of 2048-4096 columns with 4-8 warps
# reach 0.94-0.97 of copy bandwidth at 16M+ elements; the narrow tiles serve small N.
# Whole 8192-wide rows (16 warps, as Liger-Kernel runs its GLUs) took the GLU forwards from
# 0.97-1.00x Liger to 0.99-1.00x (16384 rows, bf16 and fp32).
# Rows wider than 8192 (LLaMA's 11008): one 16384-wide masked tile a row, 32 warps, took
# the GLU forwards at bf16 (8192, 11008) from 0.97x Liger to 1.01x (swiglu), 1.03x to 1.10x (geglu).
FORWARD_CONFIGS = [
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 16384}, num_warps=32),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 16384}, num_warps=16),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 8192}, num_warps=16),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 8192}, num_warps=8),
    triton.Config({"BLOCK_M": 2, "BLOCK_N": 4096}, num_warps=8),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 4096}, num_warps=4),
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

# The backward walks ROWS_PER_PROGRAM rows per program, BLOCK_M at a time. The one- and
# two-row tiles (the first five) took the GLU forward+backward from 0.96-0.98x Liger to
# 0.98-1.00x (H100, docs/benchmarks.md).
BACKWARD_CONFIGS = [
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 16384}, num_warps=32),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 16384}, num_warps=16),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 8192}, num_warps=16),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 4096}, num_warps=8),
    triton.Config({"BLOCK_M": 2, "BLOCK_N": 4096}, num_warps=16),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 2048}, num_warps=4),
    triton.Config({"BLOCK_M": 2, "BLOCK_N": 2048}, num_warps=8),
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 1024}, num_warps=4),
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 2048}, num_warps=8),
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 512}, num_warps=8),
    triton.Config({"BLOCK_M": 1, "BLOCK_N": 1024}, num_warps=4),
    triton.Config({"BLOCK_M": 8, "BLOCK_N": 256}, num_warps=4),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64}, num_warps=4),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=2),
]
MIN_ROWS_PER_PROGRAM = 16  # >= every backward config's BLOCK_M
UNSUMMED_ROWS_PER_PROGRAM = 4
# Rows at least this wide walk one row a program where nothing is summed over rows (as
# Liger-Kernel's GLU backwards do): GLU forward+backward at bf16 (16384, 8192) 0.7149 ms
# against 0.7237 with up to 4 rows (swiglu; 1.00x Liger), and 0.5081 against 0.5135 at (8192, 11008).
ONE_ROW_WIDTH = 8192
MAX_ROWS_PER_PROGRAM = 256

# The interpreter runs one Python step per program: few, mid-sized tiles are fastest.
INTERPRETER_BLOCK_ELEMENTS = 1024


def _interpreter_config(m: int, n: int, max_block_m: int | None = None) -> triton.Config:
    """The interpreter's one tile. The forward's: no taller than the rows. The backward's
    (`max_block_m`: its rows per program): as many of a program's rows as the tile holds,
    past M too (masked), since a program steps through all of them, BLOCK_M at a time, and
    each step costs the interpreter the same whatever its rows."""
    block_n = max(MIN_BLOCK_N, min(triton.next_power_of_2(n), INTERPRETER_BLOCK_ELEMENTS))
    fits = max(1, INTERPRETER_BLOCK_ELEMENTS // block_n)
    block_m = min(triton.next_power_of_2(m), fits) if max_block_m is None else min(max_block_m, fits)
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
    m, n = named_args["M_BUCKET"], size_hint(named_args["N"])
    if is_interpreting():
        return [_interpreter_config(m, n)]
    elements = lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"]  # noqa: E731
    if m * n < SMALL_PROBLEM_ELEMENTS:
        largest = max(SMALL_TILE_ELEMENTS, m * n // 256)
        small = [c for c in configs if elements(c) <= largest]
        return _fitting(small, m, n, max_block_m=m, wide_block_n=SMALL_BLOCK_N)
    return _fitting([c for c in configs if elements(c) >= LARGE_TILE_ELEMENTS], m, n, max_block_m=m)


def prune_backward_configs(configs, named_args, **kwargs):
    m, n, rows = named_args["M_BUCKET"], size_hint(named_args["N"]), named_args["ROWS_PER_PROGRAM"]
    if is_interpreting():
        return [_interpreter_config(m, n, max_block_m=rows)]
    return _fitting(configs, m, n, max_block_m=rows)


@dataclass(frozen=True)
class Space:
    """A kernel's tuning space: its configs, and the pruner that keeps those fitting a problem."""

    configs: list
    prune: Callable


FORWARD = Space(FORWARD_CONFIGS, prune_forward_configs)
BACKWARD = Space(BACKWARD_CONFIGS, prune_backward_configs)


def m_bucket(m: int) -> int:
    """What tuning sees of the row count: M rounded up to a power of two. Rows in one bucket
    share a tuned config (a new sequence length does not retune), and every choice that
    follows from the config (pruning, the backward's rows per program and row-sum slots) is
    made from the bucket, so a config tuned at one M of the bucket fits every other."""
    m = size_hint(m)
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


def size_hint(size):
    """A size as tuning sees it. In a graph traced with symbolic sizes (torch.compile's
    dynamic shapes) that is the size it was traced with: every tile computes the same values
    at every size, so choosing tiles by it constrains nothing (no guard, no recompilation)."""
    if type(size) is int or not isinstance(size, torch.SymInt):
        return size
    hint = size.node.hint
    return hint if hint is not None else _UNKNOWN_SIZE


_UNKNOWN_SIZE = 4096  # a size without an example value (data-dependent): tiles for a mid-sized problem


def autotune(space: Space, key: list[str], pre_hook=None):
    """Triton's autotuner as every generated kernel takes it: the space's configs, pruned to
    those that fit each problem, timed by autotune_do_bench(), the results kept across
    processes where persist_results() allows; `key` and `pre_hook` as Triton's."""
    return triton.autotune(configs=space.configs, key=key, prune_configs_by={"early_config_prune": space.prune},
                           pre_hook=pre_hook, do_bench=autotune_do_bench(), cache_results=persist_results())


def persist_results() -> bool:
    """Tuned configs kept across processes, in Triton's cache (keyed by the kernel, the GPU,
    the pruned configs and the tuning key); not under the interpreter, which has no GPU."""
    return not is_interpreting()


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


def narrowest_backward_block_n(m: int, n: int, rows_per_program: int) -> int:
    """The narrowest column tile the backward's pruner may pick for this problem."""
    if is_interpreting():
        return _interpreter_config(m, n).kwargs["BLOCK_N"]
    return min(c.kwargs["BLOCK_N"] for c in _fitting(BACKWARD_CONFIGS, m, n, max_block_m=rows_per_program))


def backward_rows_per_program(m: int, n: int, summed: bool = True) -> int:
    """Rows each backward program walks. With a gradient summed over rows (`summed`): enough
    programs to fill a GPU (~1024), but as few as that allows, since each writes one row of
    partial column sums per reduced input. Without: the tallest tile that fits at most
    UNSUMMED_ROWS_PER_PROGRAM rows (one on rows ONE_ROW_WIDTH wide), for as many programs
    as the tiles allow (swiglu's backward at bf16 (16384, 8192) measured 3% faster with 4 rows
    a program than with 128, and 1% faster again with one)."""
    if is_interpreting():
        # Up to MAX_ROWS_PER_PROGRAM rows a program (the interpreter runs programs one by one),
        # and no more than M's bucket: below MIN_ROWS_PER_PROGRAM rows a program is the
        # same one program either way, and its rows past M would be steps of masked lanes.
        return min(MAX_ROWS_PER_PROGRAM, triton.next_power_of_2(m))
    if not summed:
        rows = 1 if n >= ONE_ROW_WIDTH else UNSUMMED_ROWS_PER_PROGRAM
        fitting = _fitting(BACKWARD_CONFIGS, m, n, max_block_m=rows)
        return max(c.kwargs["BLOCK_M"] for c in fitting)  # the pruner, given this, keeps the same tiles
    column_tiles = cdiv(n, 1024)
    rows = MIN_ROWS_PER_PROGRAM
    while rows < MAX_ROWS_PER_PROGRAM and cdiv(m, 2 * rows) * column_tiles >= 1024:
        rows *= 2
    return rows


def zero_before_trials(*names: str):
    """An autotuner pre_hook: zero the named buffers before every trial run and before the
    launch after tuning (Autotuner's own reset_to_zero fails on a gradient not asked for: None)."""

    def zero(kwargs: dict, reset_only: bool = False) -> None:
        for name in names:
            if kwargs[name] is not None:
                kwargs[name].zero_()

    return zero
