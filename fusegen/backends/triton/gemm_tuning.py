"""The gemm kind's tiles: Triton's matmul configurations for Hopper (BLOCK_M, BLOCK_N,
BLOCK_K, stages, warps), from the research behind the kind (docs/design/gemm-research.md:
Triton's tutorials, Inductor's mm configs), pruned to those that fit a problem; one small
tile under the interpreter. The g kernel of the backward is pointwise and tunes as that kind."""
from __future__ import annotations

import triton

from .interpreter import is_interpreting
from .tuning import Space, size_hint

GROUP_M = 8  # tile rows a group of programs walks down one tile column (gemm_lib.grouped_tile)

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
_TILES = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4), (64, 256, 64, 4, 4),
          (128, 128, 128, 3, 8), (64, 128, 64, 4, 4), (64, 64, 64, 3, 4), (32, 64, 32, 4, 4), (16, 64, 64, 4, 4)]
# The epilogue over the whole tile (PARTS 1), or half of it at a time (2) where a tile is large
# (its fp32 values and the epilogue's inputs weigh on registers: Triton's tutorial 09 subtiles
# so; the hand-written TMA kernel of docs/scripts/gemm_tile.py was fastest so on the H100).
_HALVED = 128 * 128
FORWARD_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": GROUP_M, "PARTS": parts},
                                 num_stages=s, num_warps=w)
                   for m, n, k, s, w in _TILES for parts in ((1, 2) if m * n >= _HALVED else (1,))]
SMALLEST = 16  # tl.dot's least size along each dim
PINNED_PARTS: int | None = None  # tests pin the epilogue's parts (1 or 2) to reach both on any tile


def prune_forward_configs(configs, named_args, **kwargs):
    """Tiles not far past the problem along any dim (each at least tl.dot's 16); under the
    interpreter one small tile, at most 32 by 32 by 16 (as few numpy steps as the shapes allow).
    PINNED_PARTS set: every tile runs its epilogue in that many parts."""
    m, n, k = named_args["M_BUCKET"], size_hint(named_args["N"]), size_hint(named_args["K"])
    fit = lambda size, cap: min(cap, max(SMALLEST, triton.next_power_of_2(max(size, 1))))  # noqa: E731
    if is_interpreting():
        return [triton.Config({"BLOCK_M": fit(m, 32), "BLOCK_N": fit(n, 32), "BLOCK_K": SMALLEST, "GROUP_M": 1,
                               "PARTS": PINNED_PARTS or 1})]
    fitting = [c for c in configs if c.kwargs["BLOCK_M"] <= fit(m, 128) and c.kwargs["BLOCK_N"] <= fit(n, 256)
               and c.kwargs["BLOCK_K"] <= fit(k, 128)]
    chosen = fitting or [min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.kwargs["PARTS"]))]
    if PINNED_PARTS is not None:  # each tile has a PARTS 1 config: that one, pinned
        chosen = [triton.Config({**c.kwargs, "PARTS": PINNED_PARTS}, num_stages=c.num_stages, num_warps=c.num_warps)
                  for c in chosen if c.kwargs["PARTS"] == 1]
    return chosen


FORWARD = Space(FORWARD_CONFIGS, prune_forward_configs)
# A product in chunks keeps an accumulator a chunk: its tiles hold chunks x BLOCK_M x BLOCK_N
# fp32 values, at most the largest one-chunk tile's (128 x 256); a larger one would spill.
_MOST_VALUES = max(m * n for m, n, *_ in _TILES)


def forward_space(chunks: int) -> Space:
    """The forward's tiles for a product of `chunks` chunks (1: FORWARD)."""
    if chunks == 1:
        return FORWARD
    return Space([c for c in FORWARD_CONFIGS if chunks * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= _MOST_VALUES],
                 prune_forward_configs)


# A hidden layer's tiles (an MLP's two layers, gemm_kernel_text._hidden_forward_kernel): each
# program holds its rows' [BLOCK_M, H] hidden values (H up to 256: BLOCK_H), their partials,
# and the [BLOCK_M, BLOCK_N] product, so its row blocks are smaller than a plain matmul's.
_HIDDEN_TILES = [(64, 64, 32, 3, 4), (64, 128, 32, 3, 8), (32, 64, 64, 3, 4), (32, 128, 32, 3, 4),
                 (128, 64, 32, 3, 8), (16, 64, 64, 3, 4), (64, 32, 64, 3, 4), (16, 32, 64, 4, 4)]
_HIDDEN_VALUES = 64 * 256  # at most BLOCK_M x BLOCK_H hidden values a program
HIDDEN_FORWARD_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": GROUP_M, "PARTS": 1},
                                        num_stages=s, num_warps=w) for m, n, k, s, w in _HIDDEN_TILES]


def prune_hidden_configs(configs, named_args, **kwargs):
    """Tiles not far past the problem, holding at most _HIDDEN_VALUES hidden values; under the
    interpreter one small tile."""
    hidden = max(SMALLEST, triton.next_power_of_2(max(size_hint(named_args["H"]), 1)))
    chosen = [c for c in prune_forward_configs(configs, named_args)
              if is_interpreting() or c.kwargs["BLOCK_M"] * hidden <= _HIDDEN_VALUES]
    return chosen or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


HIDDEN_FORWARD = Space(HIDDEN_FORWARD_CONFIGS, prune_hidden_configs)
