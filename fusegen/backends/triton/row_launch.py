"""The row kind's launches: its kernels take the pointwise kind's arguments (launch.py's
_Bound names and orders them), then BLOCK_N and ONE_TILE, and a grid over rows only. The
forward also writes each row's statistics (its reductions, [M, statistics]), which the
backward reads."""
from __future__ import annotations

import functools

import torch

from fusegen.runtime import GradTarget, needs_int64
from fusegen.runtime.views import INT32_LIMIT

from . import layout_choice, row_tuning, tuning
from .launch import Kernels, Launch, PreparedBackward, Slot, Zeroed, _Bound, _launches, _Tile
from .naming import BLOCK_M, BLOCK_N, EXCHANGE, ONE_TILE, ROWS_PER_PROGRAM, SHARES, SPLITS, STATISTICS


class RowKernels(Kernels):
    """Row kernels (row_kernel_text.py), as a generated module declares them; `shares`: the
    values a round where a row is split across programs (the widest pass's reductions, forward
    or backward: row_kernel_text.split_shares_count)."""

    def __init__(self, *args, shares: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.shares = shares

    def bind(self, op) -> "_BoundRows":
        return _BoundRows(self, op)


class _BoundRows(_Bound):
    def __init__(self, kernels: Kernels, op):
        super().__init__(kernels, op)
        self.statistics = kernels.statistics
        self.shares = kernels.shares

    def forward(self, call, tensors, outputs, seed, tile: tuple[int, int] | None = None, statistics=None,
                traced: bool = False, keep: bool = True, splits: int = 1) -> None:
        if statistics is None and self.statistics:  # a caller with no backward to feed (tests launching the kernel)
            statistics = self._statistics_buffer(call.problem)
        super().forward(call, tensors, outputs, seed, tile, statistics, traced, splits=splits)

    def _exchange(self, problem, splits: int) -> Zeroed | None:
        """A split row's exchange (kernel_lib.split_program): a ticket, a counter per row group
        (at most M groups), two rounds of shares per row; the shares start past M + 1 counters."""
        if splits == 1:
            return None
        m = problem.m
        return Zeroed(m + 1 + 2 * m * self.shares * splits, problem.compute_dtype, problem.device)

    def _statistics_buffer(self, problem) -> torch.Tensor:
        return torch.empty(self.op.statistics_shape(problem), dtype=problem.compute_dtype, device=problem.device)

    def _extra_args(self, statistics_slot: int) -> dict:
        return {STATISTICS: Slot(statistics_slot)}  # each row's statistics, [M, statistics]

    def _index_64(self, problem, views) -> bool:
        """Some offset reaches 2**31: in a tensor, or in the [M, statistics] buffer."""
        return needs_int64(problem, views) or problem.m * self.statistics >= INT32_LIMIT

    def prepare_forward(self, call, tensors, tile: tuple[int, int] | None = None, traced: bool = False,
                        keep: bool = True, splits: int = 1) -> Launch:
        """`splits` with a `tile`: its rows split across that many programs (tests reach the
        split layout so; otherwise the layout is measured among row_tuning.forward_layouts)."""
        problem = call.problem
        m, n = problem.m, problem.n
        args, copies = self._forward_args(call, tensors, traced)
        args[SHARES] = self.shares
        if tile is not None:
            return self._launch(0, args, copies, problem, (tile[1], splits), traced, block_m=tile[0])
        # The candidates: by the row's width, the tiles a program loads and their dtypes.
        tiles = sum(not i.one_per_row for i in self.op.inputs)
        narrow = any(t.is_floating_point() and t.element_size() < 4 for t in tensors)
        layouts = row_tuning.forward_layouts(n, m, problem.device, tiles, narrow)
        return layout_choice.choose(
            layouts, functools.partial(self._launch, 0, args, copies, problem, traced=traced),
            lambda: layout_choice.key_of(self.forward_kernel, problem, tensors, layouts), traced)

    def _launch(self, which: int, args: dict, copies, problem, layout: tuple[int, int], traced: bool,
                rows: int | None = None, block_m: int | None = None) -> Launch:
        """The forward's (`which` 0: BLOCK_M rows a program) or the backward's (1: `rows` a
        program) launch at one layout; with `block_m`, that tile (tests), not the autotuner's."""
        m, n = problem.m, problem.n
        block_n, splits = layout
        args = dict(args)
        # ONE_TILE: for a symbolic N, a guard (a graph traced with one tile per row holds only for such rows)
        args[BLOCK_N], args[SPLITS], args[ONE_TILE] = block_n, splits, bool(block_n * splits >= n)
        args[EXCHANGE] = self._exchange(problem, splits)
        args = self._signatures[which].ordered(args)
        kernel, tuned, graph = ((self.forward_kernel, self._forward, self._graph_forward) if which == 0 else
                                (self.backward_kernel, self._backward, self._graph_backward))
        if rows is not None:
            grid = (tuning.cdiv(m, rows) * splits,)
        elif block_m is not None:
            grid = (tuning.cdiv(m, block_m) * splits,)
        else:
            grid = lambda meta: (tuning.cdiv(m, meta[BLOCK_M]) * splits,)  # noqa: E731
        if block_m is not None:
            return Launch(_Tile(kernel), grid, args, copies, {BLOCK_M: block_m})
        return Launch(graph if traced else tuned, grid, args, copies)

    def backward(self, call, tensors, grads, needs, seed, tile: tuple[int, int] | None = None,
                 rows_per_program: int | None = None, statistics=None, traced: bool = False,
                 splits: int = 1) -> list[torch.Tensor]:
        problem = call.problem
        if statistics is None and self.statistics and problem.launches:
            # No forward's statistics at hand (tests launching the kernel): a forward makes them.
            statistics = self._statistics_buffer(problem)
            outputs = [torch.empty(self.op.output_shape(problem, i), dtype=self.op.output_dtype(problem, i),
                                   device=problem.device) for i in range(len(self.op.outputs))]
            self.forward(call, tensors, outputs, seed, tile=tile, statistics=statistics)
        return super().backward(call, tensors, grads, needs, seed, tile, rows_per_program, statistics, traced,
                                splits=splits)

    def prepare_backward(self, call, tensors, grads, needs, tile: tuple[int, int] | None = None,
                         rows_per_program: int | None = None, traced: bool = False,
                         splits: int = 1) -> PreparedBackward:
        problem = call.problem
        m, n = problem.m, problem.n
        per_row = any(one and needs[i] for i, one in zip(self._gradients, self._one_per_row))
        if tile is not None:
            layouts = [(tile[1], splits)]
        else:  # as the forward's, for the tiles the backward loads (a [..., 1] gradient: never split)
            tiles = len(self._reads) + len(self.op.outputs)
            narrow = any(t is not None and t.is_floating_point() and t.element_size() < 4 for t in (*tensors, *grads))
            layouts = row_tuning.backward_layouts(n, m, problem.device, tiles, narrow, not per_row, self.shares)
        summed = self._sums_over_rows(problem, tensors, needs)
        # Many rows a program only where a gradient is summed over rows: fewer partial sums.
        rows = rows_per_program or row_tuning.row_backward_rows_per_program(tuning.m_bucket(m), summed)
        # A program owns whole rows: a [..., 1] input's gradient is one row sum, [1, M] (a
        # split's part of it where the tile given splits such a row: tests).
        row_sums = layouts[0][1] if per_row else 1
        targets = [
            GradTarget.of(tensors[i], problem, tuning.cdiv(m, rows), row_sums, self._chunks[i], one)
            if needs[i] else None
            for i, one in zip(self._gradients, self._one_per_row)
        ]
        if not _launches(problem, traced):
            return PreparedBackward(None, targets, self._gradients)
        args, copies = self._backward_args(call, tensors, grads, targets, traced)
        args[ROWS_PER_PROGRAM], args[SHARES] = rows, self.shares
        build = functools.partial(self._launch, 1, args, copies, problem, traced=traced, rows=rows,
                                  block_m=None if tile is None else tile[0])
        launch = layout_choice.choose(
            layouts, build,
            lambda: layout_choice.key_of(self.backward_kernel, problem, (*tensors, *grads), layouts, rows,
                                         tuple(needs)), traced)
        return PreparedBackward(launch, targets, self._gradients, traced)
