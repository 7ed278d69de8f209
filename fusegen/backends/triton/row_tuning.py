"""The row kind's tuning: a program owns BLOCK_M whole rows; its configurations, the pruners
that keep those that fit a problem, and the backward's rows per program. What every kind
shares (the autotuner, M's bucket, size hints) is tuning.py's."""
from __future__ import annotations

import torch
import triton

from .interpreter import is_interpreting
from .tuning import (
    INTERPRETER_BLOCK_ELEMENTS,
    MAX_ROWS_PER_PROGRAM,
    MIN_BLOCK_N,
    MIN_ROWS_PER_PROGRAM,
    Space,
    cdiv,
    m_bucket,
    size_hint,
)

# Row kernels: a program owns BLOCK_M whole rows. BLOCK_N is not tuned: it is the row's
# width rounded up to a power of two where that fits on chip (ONE_TILE), else a fixed step
# of a loop along the row; the autotuner picks BLOCK_M and the warps.
ROW_CONFIGS = [
    triton.Config({"BLOCK_M": block_m}, num_warps=warps)
    for block_m in (1, 2, 4, 8, 16)
    for warps in (1, 2, 4, 8, 16, 32)
]
ONE_TILE_LIMIT = 16384  # the widest row a forward program holds in registers
ONE_TILE_LIMIT_BACKWARD = 8192  # the backward holds the incoming gradient and more
ROW_STEP = 4096  # the looped forward's step along the row
ROW_STEP_BACKWARD = 2048
ROW_TILE_ELEMENTS = (512, 16384)  # BLOCK_M × BLOCK_N within these
ROW_ELEMENTS_PER_THREAD = (2, 64)  # and that many elements for each thread
# Under the interpreter a loop step costs a Python step per tile: rows up to this width are
# one tile there (tests reach the looped layout by passing a narrower tile).
_INTERPRETER_ONE_TILE = 1024


def row_block_n(n: int, backward: bool = False) -> int:
    """BLOCK_N for a row kernel: the whole row where it fits, else the loop's step."""
    n = size_hint(n)
    width = max(MIN_BLOCK_N, 1 << max(n - 1, 0).bit_length())
    if is_interpreting():
        return min(width, _INTERPRETER_ONE_TILE)
    if width <= (ONE_TILE_LIMIT_BACKWARD if backward else ONE_TILE_LIMIT):
        return width
    return ROW_STEP_BACKWARD if backward else ROW_STEP


# A 16-bit row up to ONE_TILE_NARROW wide is one tile where the program's tiles (its [..., N]
# inputs, the backward's outputs too) hold few enough values; wider tiles spill. H100, bf16
# (4096, 32768), one tile against looped, ms: softmax forward 0.201 / 0.242, log_softmax 0.205
# / 0.219, rmsnorm (two tiles) 0.197 / 0.194, layernorm (three) 0.392 / looped; forward+
# backward softmax 0.517 / 0.666, log_softmax 0.489 / 0.577.
ONE_TILE_NARROW = 32768
ONE_TILE_NARROW_VALUES = 32768  # a forward program's tiles, at most
ONE_TILE_NARROW_VALUES_BACKWARD = 65536


def _narrow_one_tile(n: int, tiles: int, values: int) -> bool:
    width = triton.next_power_of_2(size_hint(n))
    return not is_interpreting() and ONE_TILE_LIMIT < width <= ONE_TILE_NARROW and width * tiles <= values


# A forward row wider than ONE_TILE_LIMIT is split across programs that each hold one part of
# it in registers (kernel_lib.split_program: the row read once, as one tile is) where the GPU
# can hold a row group's programs at once; else looped. About eight parts a row did best
# (fewer programs a round wait less). H100, split against looped, ms forward: fp32 (1024,
# 65536) softmax 0.211 / 0.281, rmsnorm 0.211 / 0.278, layernorm 0.291 / 0.367 (8192-wide
# parts); fp32 (256, 262144) softmax 0.230 / 0.296, rmsnorm 0.255 / 0.284 (32768), but
# layernorm 1.136 / 0.373 (three 32768-wide tiles a program: too many registers); bf16 (1024,
# 131072) slower split at every op (0.33-0.46 / 0.28-0.37: the shares' float32 tile and the
# bf16 input's take different layouts, and the compiler moves the tile between them). So:
# float32 inputs only, and at most SPLIT_VALUES values of the inputs' tiles a program.
SPLIT_PARTS = 8
SPLIT_PART = (8192, 32768)  # a part's width, within these
SPLIT_VALUES = 65536  # a part's width times the tiles a program loads, at most
SPLIT_PROGRAMS = 512  # at least this many programs in all (few rows): narrower parts


def row_forward_layout(n: int, m: int, device, tiles: int = 1, narrow: bool = False,
                       values: int = SPLIT_VALUES) -> tuple[int, int]:
    """(BLOCK_N, SPLITS) for a row forward: the whole row in one tile, split into SPLITS parts
    of BLOCK_N columns, or (SPLITS = 1, BLOCK_N < N) looped along the row. `tiles`: the [..., N]
    inputs a program loads; `narrow`: some input is 16-bit (not split, as measured above);
    `values`: a program's tiles hold at most this many values."""
    block_n = row_block_n(n)
    if narrow and _narrow_one_tile(n, tiles, ONE_TILE_NARROW_VALUES):
        return triton.next_power_of_2(size_hint(n)), 1
    if block_n >= size_hint(n) or is_interpreting() or narrow:
        return block_n, 1
    n, m = size_hint(n), m_bucket(m)  # by what tuning keys on: one layout a tuned key
    low, high = SPLIT_PART
    high = max(low, min(high, triton.next_power_of_2(values // max(tiles, 1) + 1) // 2))
    part = min(high, max(low, triton.next_power_of_2(cdiv(n, SPLIT_PARTS))))
    while part > low and m * cdiv(n, part) < SPLIT_PROGRAMS:
        part //= 2
    splits = triton.next_power_of_2(cdiv(n, part))
    if splits > _multiprocessors(device):  # a group's programs must all be on the GPU at once
        return block_n, 1
    return part, splits


# The backward splits as the forward, with fewer values a program (it holds the incoming
# gradient's tile and the input's, and more). H100, split against looped, ms forward+backward
# (forward split in both): fp32 (1024, 65536) softmax 0.520 / 0.722, log_softmax 0.497 /
# 0.583, rmsnorm 0.562 / 0.728, layernorm 0.689 / 0.875 (8192-wide parts); fp32 (256, 262144)
# softmax 0.542 / 1.299 (16384-wide parts; 0.736 at 32768: hence SPLIT_VALUES_BACKWARD),
# rmsnorm 0.692 / 1.311, but layernorm 1.481 / 1.788 (torch.compile 0.876). ptxas on the sm_90
# code says why: layernorm's backward at 16384-wide parts spills (124-296 bytes at 8-32 warps),
# rmsnorm's not at 32 warps, and neither at 8192. A cap of 32768 values would give both 8192-
# wide parts at that width: to be measured before it changes. (The forwards' 32768-wide parts
# spill too, 4-996 bytes at 32 warps: docs/scripts/row_registers.py; parts of at most 16384
# are the next A/B.)
# Measured since (eleventh session, same shape, one process): a cap of 32768 took layernorm
# to 0.801 ms (compile 0.875) and rmsnorm to 0.824 (from 0.687): the cap follows the values a
# program keeps per row, which the split's shares count (2 for layernorm, 1 for rmsnorm). With
# 32768 for shares > 1 only (A/B, one process): layernorm fp32 (256, 262144) 0.802 / 1.483, and
# softmax, log_softmax, rmsnorm, layernorm at fp32 (256, 262144) and (1024, 65536) within 0.3%.
SPLIT_BACKWARD = True
SPLIT_VALUES_BACKWARD = 49152
SPLIT_VALUES_BACKWARD_SHARED = 32768  # a program exchanging two or more values a round (shares)


def row_backward_layout(n: int, m: int, device, tiles: int = 2, narrow: bool = False,
                        splittable: bool = True, shares: int = 1) -> tuple[int, int]:
    """(BLOCK_N, SPLITS) for a row backward, as row_forward_layout's (SPLITS = 1 where
    SPLIT_BACKWARD is off, or where not `splittable`: some gradient is one value a row);
    `shares`: the values a split program exchanges a round (more registers per row)."""
    block_n = row_block_n(n, backward=True)
    if narrow and _narrow_one_tile(n, tiles, ONE_TILE_NARROW_VALUES_BACKWARD):
        return triton.next_power_of_2(size_hint(n)), 1
    if not (SPLIT_BACKWARD and splittable) or block_n >= size_hint(n) or is_interpreting() or narrow:
        return block_n, 1
    values = SPLIT_VALUES_BACKWARD_SHARED if shares > 1 else SPLIT_VALUES_BACKWARD
    part, splits = row_forward_layout(n, m, device, tiles, narrow, values)
    return (part, splits) if splits > 1 else (block_n, 1)


# The layout is measured (layout_choice.py): where a row is wider than one program's tile, the
# rule's layout above and these alternatives are timed on a shape bucket's first launch and
# the fastest kept. The rule's stays first: it runs wherever nothing can be timed.
SPLIT_PART_CHOICES = (8192, 16384, 32768)


def forward_layouts(n: int, m: int, device, tiles: int = 1, narrow: bool = False) -> list[tuple[int, int]]:
    """The (BLOCK_N, SPLITS) layouts worth timing for a row forward (row_forward_layout's first)."""
    rule = row_forward_layout(n, m, device, tiles, narrow)
    if is_interpreting() or row_block_n(n) >= size_hint(n):
        return [rule]
    return _alternatives(rule, n, device, ROW_STEP, tiles, narrow, ONE_TILE_NARROW_VALUES, True)


def backward_layouts(n: int, m: int, device, tiles: int = 2, narrow: bool = False, splittable: bool = True,
                     shares: int = 1) -> list[tuple[int, int]]:
    """The layouts worth timing for a row backward (row_backward_layout's first); never split
    where not `splittable` (some gradient is one value a row)."""
    rule = row_backward_layout(n, m, device, tiles, narrow, splittable, shares)
    if is_interpreting() or row_block_n(n, backward=True) >= size_hint(n):
        return [rule]
    return _alternatives(rule, n, device, ROW_STEP_BACKWARD, tiles, narrow, ONE_TILE_NARROW_VALUES_BACKWARD,
                         splittable and SPLIT_BACKWARD)


def _alternatives(rule, n: int, device, step: int, tiles: int, narrow: bool, narrow_values: int,
                  splittable: bool) -> list[tuple[int, int]]:
    """The rule's layout, the loop, one 16-bit tile where it fits, and each split whose parts
    hold at most SPLIT_VALUES values of the program's tiles and whose programs a row group the
    GPU holds at once."""
    width = triton.next_power_of_2(size_hint(n))
    layouts = [rule, (step, 1)]
    if narrow and _narrow_one_tile(n, tiles, narrow_values):
        layouts.append((width, 1))
    for part in SPLIT_PART_CHOICES if splittable else ():
        splits = triton.next_power_of_2(cdiv(size_hint(n), part))
        if 2 <= splits <= _multiprocessors(device) and part * max(tiles, 1) <= SPLIT_VALUES:
            layouts.append((part, splits))
    return list(dict.fromkeys(layouts))


def _multiprocessors(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _row_configs(configs, m: int, block_n: int, max_block_m: int, backward: bool = False):
    if is_interpreting():
        # The forward: no taller than the rows. The backward: as many of a program's rows
        # (max_block_m) as the tile holds, past M too (masked): a program steps through all
        # of them, and each step costs the interpreter the same whatever its rows.
        tall = max_block_m if backward else min(triton.next_power_of_2(m), max_block_m)
        block_m = max(1, min(tall, INTERPRETER_BLOCK_ELEMENTS // block_n))
        return [triton.Config({"BLOCK_M": block_m}, num_warps=4)]
    low, high = ROW_TILE_ELEMENTS
    fewest, most = ROW_ELEMENTS_PER_THREAD
    tall = min(max(triton.next_power_of_2(m), 1), max_block_m)
    kept = []
    for c in configs:
        block_m = c.kwargs["BLOCK_M"]
        elements = block_m * block_n
        per_thread = elements // (32 * c.num_warps)
        if block_m <= tall and elements <= max(high, block_n) and (elements >= low or block_m == tall) \
                and fewest <= per_thread <= most:
            kept.append(c)
    return kept or [min(configs, key=lambda c: (c.kwargs["BLOCK_M"], -c.num_warps))]


def prune_row_configs(configs, named_args, **kwargs):
    return _row_configs(configs, named_args["M_BUCKET"], named_args["BLOCK_N"], max_block_m=16)


def prune_row_backward_configs(configs, named_args, **kwargs):
    return _row_configs(configs, named_args["M_BUCKET"], named_args["BLOCK_N"], named_args["ROWS_PER_PROGRAM"],
                        backward=True)


# Where a forward has online sums (softmax's Σ exp(x - max)), its looped layout comes two
# ways: online (one read of the row fewer, more work per element) or a loop after the max
# (H100: online 1.30x faster at fp32 (1024, 65536), 0.88x at bf16 (4096, 32768), where the
# second read comes from L2): the autotuner picks per shape. One tile: nothing to choose.
INTERPRETER_ONLINE = True  # the interpreter's one config (tests set it to reach the other)


def _with_online(configs, n: int, block_n: int) -> list:
    if is_interpreting():
        return [triton.Config({**c.kwargs, "ONLINE": INTERPRETER_ONLINE}, num_warps=c.num_warps) for c in configs]
    choices = (True,) if block_n >= n else (True, False)
    return [triton.Config({**c.kwargs, "ONLINE": online}, num_warps=c.num_warps) for c in configs for online in choices]


def prune_row_online_configs(configs, named_args, **kwargs):
    kept = _row_configs(configs, named_args["M_BUCKET"], named_args["BLOCK_N"], max_block_m=16)
    return _with_online(kept, size_hint(named_args["N"]), named_args["BLOCK_N"])


ROW_FORWARD = Space(ROW_CONFIGS, prune_row_configs)
ROW_FORWARD_ONLINE = Space(ROW_CONFIGS, prune_row_online_configs)
ROW_BACKWARD = Space(ROW_CONFIGS, prune_row_backward_configs)


def row_backward_rows_per_program(m: int, summed: bool = True) -> int:
    """Rows each row-backward program walks: where some gradient is summed over rows, about
    ROW_BACKWARD_PROGRAMS programs, each writing one row of partial column sums per [N]-like
    input (summed after, in order); otherwise as few as the tallest tile, for more programs."""
    rows = MIN_ROWS_PER_PROGRAM
    if is_interpreting() and m < rows:
        # One program either way; its rows past M would be interpreter steps of masked lanes.
        return max(1, m)
    if not summed:
        return rows
    while rows < MAX_ROWS_PER_PROGRAM and cdiv(m, 2 * rows) >= ROW_BACKWARD_PROGRAMS:
        rows *= 2
    return rows


ROW_BACKWARD_PROGRAMS = 512
