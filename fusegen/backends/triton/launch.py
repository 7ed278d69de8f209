"""An op's two Triton kernels, and their argument lists made from a call's checked arguments.

The generated kernels take their arguments in one order, which the template writes and
`_Bound` follows (both from the same plan):

forward: for each input its pointer, row stride and column stride; each output's pointer;
    M, N, M_BUCKET (tuning's view of M); each scalar param the body reads; each dropout p's threshold and scale; the
    seed pointer; each choice (constexpr); HAS_DROPOUT and DROPOUT_WHOLE_GROUPS (ops with
    dropout); INDEX_64; COMPUTE_FP64; then the autotuner's BLOCK_M, BLOCK_N.
backward: for each input it reads its pointer and strides; for each output its incoming
    gradient's pointer and strides; each computed gradient's buffer; M, N, M_BUCKET; scalars,
    dropout, seed, choices and the flags as above; for each computed gradient NEEDS_GRAD,
    SUM_GRAD (summed over rows) and, for inputs declared [..., 1], SUM_COLS_GRAD;
    ROWS_PER_PROGRAM; BLOCK_M, BLOCK_N.
"""
from __future__ import annotations

import torch

from fusegen.layout import Choice
from fusegen.runtime import GradTarget, dropout_scale, dropout_threshold, needs_int64, view_2d
from fusegen.runtime.views import INT32_LIMIT

from . import tuning
from .interpreter import (
    check_runs_off_cuda,
    is_interpreting,
    patch_bfloat16_rounding,
    patch_libdevice,
    patch_scalar_index,
)
from .cached_launcher import CachedLauncher

if is_interpreting():  # every generated module imports this one before its kernels run
    patch_bfloat16_rounding()
    patch_libdevice()
    patch_scalar_index()


class Kernels:
    """What a generated module hands its FusedOp: the kernels, and which params and inputs
    they take beyond the ones every kernel takes (by spec name). Pointwise kernels; row
    kernels take RowKernels."""

    def __init__(self, forward, backward, *, scalars: tuple[str, ...] = (), backward_reads: tuple[str, ...],
                 gradients: tuple[str, ...], statistics: int = 0):
        self.forward, self.backward = forward, backward
        self.scalars, self.backward_reads, self.gradients = scalars, backward_reads, gradients
        self.statistics = statistics  # values per row the forward keeps for the backward

    def bind(self, op) -> "_Bound":
        return _Bound(self, op)


class RowKernels(Kernels):
    """Row kernels (fusegen.backends.triton.row_kernel_text): the same arguments, then
    BLOCK_N and ONE_TILE; a grid over rows only. The forward also writes each row's
    reductions to `saved` ([M, statistics]), which the backward reads."""

    def bind(self, op) -> "_BoundRows":
        return _BoundRows(self, op)


class _Bound:
    def __init__(self, kernels: Kernels, op):
        inputs = [i.name for i in op.inputs]
        params = [p.name for p in op.params]
        self.op = op
        self.forward_kernel, self.backward_kernel = kernels.forward, kernels.backward
        # Triton tunes and compiles on the first call per specialization; later calls go
        # straight to the binary.
        self._forward = CachedLauncher(kernels.forward)
        self._backward = CachedLauncher(kernels.backward)
        self._chunks = [i.chunks for i in op.inputs]
        self._scalars = [params.index(name) for name in kernels.scalars]
        self._dropout = op._dropout_indices
        self._choices = [i for i, p in enumerate(op.params) if isinstance(p, Choice)]
        self._reads = [inputs.index(name) for name in kernels.backward_reads]
        self._gradients = [inputs.index(name) for name in kernels.gradients]
        self._one_per_row = [op.inputs[i].one_per_row for i in self._gradients]

    def check_device(self, device: torch.device) -> None:
        check_runs_off_cuda(self.op.name, device, self.forward_kernel)

    def _common(self, call, seed) -> list:
        """M, N, M_BUCKET, the params, the seed and the dropout flags: what both kernels take."""
        problem, params = call.problem, call.params
        args = [problem.m, problem.n, tuning.m_bucket(problem.m), *(params[i] for i in self._scalars)]
        for i in self._dropout:
            args += [dropout_threshold(params[i]), dropout_scale(params[i])]
        if self.op.has_dropout:
            args.append(seed)
        args += [params[i] for i in self._choices]
        if self.op.has_dropout:
            args += [call.has_dropout, problem.n % 4 == 0]  # HAS_DROPOUT, DROPOUT_WHOLE_GROUPS
        return args

    def forward(self, call, tensors, outputs, seed, tile: tuple[int, int] | None = None, saved=None) -> None:
        """`tile` (BLOCK_M, BLOCK_N): launch the kernel itself with that tile, not the
        autotuner (tests use it to check every tile computes the same). Pointwise kernels
        keep nothing for the backward: `saved` is None."""
        problem = call.problem
        args = self._forward_args(call, tensors, outputs, seed, ())
        m, n = problem.m, problem.n
        if tile is not None:
            grid = (tuning.cdiv(m, tile[0]), tuning.cdiv(n, tile[1]))
            self.forward_kernel.fn[grid](*args, BLOCK_M=tile[0], BLOCK_N=tile[1])
            return
        self._forward[lambda meta: (tuning.cdiv(m, meta["BLOCK_M"]), tuning.cdiv(n, meta["BLOCK_N"]))](*args)

    def _forward_args(self, call, tensors, outputs, seed, extra) -> list:
        """The forward's arguments up to COMPUTE_FP64: views, outputs, `extra` buffers, the rest."""
        problem = call.problem
        views, args = [], []
        for tensor, chunks in zip(tensors, self._chunks):
            view = view_2d(tensor, problem, chunks)
            views.append(view)
            args += view
        args += outputs
        args += extra
        args += self._common(call, seed)
        args += [self._index_64(problem, views), problem.compute_dtype == torch.float64]
        return args

    def _index_64(self, problem, views) -> bool:
        return needs_int64(problem, views)

    def backward(self, call, tensors, grads, needs, seed, tile: tuple[int, int] | None = None,
                 rows_per_program: int | None = None, saved=None) -> list[torch.Tensor]:
        """The gradients of the inputs flagged in `needs` (a flag per input), in input order."""
        problem = call.problem
        m, n = problem.m, problem.n
        bucket = tuning.m_bucket(m)
        rows = rows_per_program or tuning.backward_rows_per_program(bucket, n)
        column_tiles = 0
        if any(one and needs[i] for i, one in zip(self._gradients, self._one_per_row)):
            # Row sums land one row per column tile: as many rows as the narrowest tile needs.
            width = tile[1] if tile is not None else tuning.narrowest_backward_block_n(bucket, n, rows)
            column_tiles = tuning.cdiv(n, width)
        targets = [
            GradTarget(tensors[i], problem, tuning.cdiv(m, rows), column_tiles, self._chunks[i], one)
            if needs[i] else None
            for i, one in zip(self._gradients, self._one_per_row)
        ]
        if problem.launches:
            views = [view_2d(tensors[i], problem, self._chunks[i]) for i in self._reads]
            grad_views = [view_2d(g, problem) for g in grads]
            args = [*(a for view in views + grad_views for a in view)]
            args += [None if t is None else t.buffer for t in targets]
            args += self._common(call, seed)
            args += [self._index_64(problem, views + grad_views), problem.compute_dtype == torch.float64]
            for target, one in zip(targets, self._one_per_row):
                args += [target is not None, target is not None and target.kind == "rows"]
                if one:
                    args.append(target is not None and target.kind == "columns")
            args.append(rows)
            if tile is not None:
                grid = (tuning.cdiv(m, rows), tuning.cdiv(n, tile[1]))
                self.backward_kernel.fn[grid](*args, BLOCK_M=tile[0], BLOCK_N=tile[1])
            else:
                self._backward[lambda meta: (tuning.cdiv(m, rows), tuning.cdiv(n, meta["BLOCK_N"]))](*args)
        return [t.result() for t in targets if t is not None]


class _BoundRows(_Bound):
    def __init__(self, kernels: Kernels, op):
        super().__init__(kernels, op)
        self.statistics = kernels.statistics
        self._block_n: dict[tuple[int, bool], int] = {}  # by (N, backward): this runs every launch

    def block_n(self, n: int, backward: bool = False) -> int:
        key = (n, backward)
        if key not in self._block_n:
            self._block_n[key] = tuning.row_block_n(n, backward)
        return self._block_n[key]

    def forward(self, call, tensors, outputs, seed, tile: tuple[int, int] | None = None, saved=None) -> None:
        problem = call.problem
        if saved is None and self.statistics:  # a caller with no backward to feed (tests launching the kernel)
            saved = self._saved_buffer(problem)
        args = self._forward_args(call, tensors, outputs, seed, (saved,))
        m, n = problem.m, problem.n
        block_n = tile[1] if tile is not None else self.block_n(n)
        args += [block_n, block_n >= n]  # BLOCK_N, ONE_TILE
        if tile is not None:
            self.forward_kernel.fn[(tuning.cdiv(m, tile[0]),)](*args, BLOCK_M=tile[0])
            return
        self._forward[lambda meta: (tuning.cdiv(m, meta["BLOCK_M"]),)](*args)

    def _saved_buffer(self, problem) -> torch.Tensor:
        return torch.empty((problem.m, self.statistics), dtype=problem.compute_dtype, device=problem.device)

    def _index_64(self, problem, views) -> bool:
        """Some offset reaches 2**31: in a tensor, or in the [M, statistics] buffer."""
        return needs_int64(problem, views) or problem.m * self.statistics >= INT32_LIMIT

    def backward(self, call, tensors, grads, needs, seed, tile: tuple[int, int] | None = None,
                 rows_per_program: int | None = None, saved=None) -> list[torch.Tensor]:
        problem = call.problem
        m, n = problem.m, problem.n
        if saved is None and self.statistics and problem.launches:
            # No forward's statistics at hand (tests launching the kernel): a forward makes them.
            saved = self._saved_buffer(problem)
            outputs = [torch.empty(self.op.output_shape(problem, i), dtype=problem.out_dtype, device=problem.device)
                       for i in range(len(self.op.outputs))]
            self.forward(call, tensors, outputs, seed, tile=tile, saved=saved)
        summed = any(needs[i] and GradTarget.kind_of(tensors[i], problem, self._chunks[i]) == "rows"
                     for i in self._gradients)
        # Many rows a program only where a gradient is summed over rows: fewer partial sums.
        rows = rows_per_program or tuning.row_backward_rows_per_program(tuning.m_bucket(m), summed)
        # A program owns whole rows: a [..., 1] input's gradient is one row sum, [1, M].
        targets = [
            GradTarget(tensors[i], problem, tuning.cdiv(m, rows), 1, self._chunks[i], one) if needs[i] else None
            for i, one in zip(self._gradients, self._one_per_row)
        ]
        if problem.launches:
            views = [view_2d(tensors[i], problem, self._chunks[i]) for i in self._reads]
            grad_views = [view_2d(g, problem) for g in grads]
            args = [*(a for view in views + grad_views for a in view)]
            args += [None if t is None else t.buffer for t in targets]
            args.append(saved)
            args += self._common(call, seed)
            args += [self._index_64(problem, views + grad_views), problem.compute_dtype == torch.float64]
            for target, one in zip(targets, self._one_per_row):
                args += [target is not None, target is not None and target.kind == "rows"]
                if one:
                    args.append(target is not None and target.kind == "columns")
            block_n = tile[1] if tile is not None else self.block_n(n, backward=True)
            args += [rows, block_n, block_n >= n]  # ROWS_PER_PROGRAM, BLOCK_N, ONE_TILE
            if tile is not None:
                self.backward_kernel.fn[(tuning.cdiv(m, rows),)](*args, BLOCK_M=tile[0])
            else:
                self._backward[(tuning.cdiv(m, rows),)](*args)
        return [t.result() for t in targets if t is not None]

