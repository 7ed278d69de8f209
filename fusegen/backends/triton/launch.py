"""An op's two Triton kernels, and their argument lists made from a call's checked arguments.

`_Bound` names each value it passes (an input's pointer and strides, an output's pointer,
M, N, the params, the seed, the flags...) by the kernel parameter it is for, and orders
them by name, from the kernel's own signature (`arg_names`), once per call key: the
order has one owner, the kernel text. The names come from naming.py, as the kernel text
writes them: its constants (M, SEED, HAS_DROPOUT...) and, for what a spec names,
ParameterNames (WANTED, and the generated module's `renamed` where a clash made the namer
choose another name). A parameter with no value, or a value for no parameter, is a
KernelSignatureError. The trailing parameters no value names are the autotuner's tile
(BLOCK_M, BLOCK_N), which its configs or a given tile supply.
"""
from __future__ import annotations

import functools
import inspect

import torch

from fusegen.layout import Choice
from fusegen.runtime import GradTarget, dropout_scale, dropout_threshold, needs_int64, view_2d
from fusegen.runtime.views import INT32_LIMIT, traced_view_2d

from . import tuning
from .interpreter import (
    check_runs_off_cuda,
    is_interpreting,
    kernel_is_interpreted,
    patch_bfloat16_dot,
    patch_bfloat16_rounding,
    patch_cooperative_grid,
    patch_device_calls,
    patch_libdevice,
    patch_scalar_index,
    patch_splat_dtype,
    quiet_numpy,
)
from .cached_launcher import CachedLauncher, hooks_active
from .graph_launcher import GraphLauncher, traceable
from .kernel_lib import sum_partials_kernel
from .naming import (
    BLOCK_M,
    BLOCK_N,
    COMPUTE_FP64,
    DROPOUT_WHOLE_GROUPS,
    EXCHANGE,
    HAS_DROPOUT,
    INDEX_64,
    M,
    M_BUCKET,
    N,
    ONE_TILE,
    ROWS_PER_PROGRAM,
    STATISTICS,
    SEED,
    SHARD,
    SHARES,
    SHARDED,
    SPLITS,
    ParameterNames,
)

if is_interpreting():  # every generated module imports this one before its kernels run
    patch_bfloat16_dot()
    patch_bfloat16_rounding()
    patch_cooperative_grid()
    patch_device_calls()
    patch_libdevice()
    patch_scalar_index()
    patch_splat_dtype()


class Kernels:
    """What a generated module hands its FusedOp (a runtime.backend.BackendKernels): the
    kernels, and which params and inputs they take beyond the ones every kernel takes (by
    spec name), and the parameters the namer named otherwise than naming.WANTED (`renamed`,
    for ParameterNames). Pointwise kernels; each other kind subclasses it (row_launch.RowKernels)."""

    def __init__(self, forward, backward, *, scalars: tuple[str, ...] = (), backward_reads: tuple[str, ...],
                 gradients: tuple[str, ...], statistics: int = 0, renamed: dict | None = None):
        self.forward, self.backward = forward, backward
        self.scalars, self.backward_reads, self.gradients = scalars, backward_reads, gradients
        self.statistics = statistics  # values per row the forward keeps for the backward
        self.names = ParameterNames(renamed)  # the kernels' parameters by what they are for

    def bind(self, op) -> "_Bound":
        return _Bound(self, op)


class KernelSignatureError(Exception):
    """The values launch.py names and a kernel's parameters disagree: the kernel text and
    the names here drifted apart (a fusegen bug, never the caller's)."""


def _python_function(kernel):
    """The Python function under a kernel's wrappers (autotuner, jit, interpreter)."""
    while not inspect.isfunction(kernel):
        kernel = kernel.fn
    return kernel


class _Signature:
    """A kernel's parameters in its signature's order (the @triton.jit function's
    `arg_names`): what orders the values a launch names."""

    def __init__(self, kernel):
        self.kernel = kernel.fn.__name__
        self.parameters = tuple(kernel.arg_names)
        # The autotuner's tile: trailing parameters its configs give (or a given tile, `_Tile`),
        # and those with a default, which its pruner may set (row kernels' ONLINE).
        self.tile = frozenset(name for config in getattr(kernel, "configs", ()) for name in config.kwargs) | {
            name for name, p in inspect.signature(_python_function(kernel)).parameters.items()
            if p.default is not inspect.Parameter.empty}

    def ordered(self, values: dict) -> list:
        """The values, by parameter name, as the kernel takes them positionally."""
        parameters = self.parameters
        end = len(parameters)
        while end and parameters[end - 1] in self.tile and parameters[end - 1] not in values:
            end -= 1
        try:
            ordered = [values[name] for name in parameters[:end]]
        except KeyError:
            ordered = None
        if ordered is None or len(ordered) != len(values):
            missing = [f"parameter {name!r} has no value" for name in parameters[:end] if name not in values]
            extra = [f"value {name!r} is for no parameter" for name in values if name not in parameters[:end]]
            raise KernelSignatureError(f"{self.kernel}: {'; '.join(missing + extra)}")
        return ordered


class Slot:
    """Where a per-call tensor goes in a prepared argument list: `values[index]`."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class Zeroed:
    """A buffer of `numel` zeros in `dtype` a launch makes for itself each call (a split
    row's exchange: kernel_lib.split_program), in a prepared argument list's place."""

    __slots__ = ("numel", "dtype", "device")

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device

    def new(self) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)


class Launch:
    """One kernel's launch for one call key (shapes, strides, dtypes, params, alignment),
    worked out once: the argument list with a `Slot` for each tensor that changes from call
    to call, the grid, and after the first launch the binary itself. `launch(values)` fills
    the slots and launches; it holds no tensor between calls.

    Launching the remembered binary directly is safe because everything its key depends on
    is fixed by the call key, except the alignment of tensors allocated per call
    (outputs, gradient buffers, copies, seeds), which torch's allocator and the seed batches
    keep 16-byte aligned."""

    __slots__ = ("_launcher", "_grid", "_template", "_slots", "_zeroed", "_copies", "_constexprs", "_binary")

    def __init__(self, launcher, grid, template: list, copies: tuple = (), constexprs: dict | None = None):
        self._launcher, self._grid, self._template = launcher, grid, template
        self._slots = tuple((position, a.index) for position, a in enumerate(template) if type(a) is Slot)
        self._zeroed = tuple((position, a) for position, a in enumerate(template) if type(a) is Zeroed)
        self._copies = copies  # (value index, remake): a value whose view is a copy, remade per call
        self._constexprs = constexprs or {}
        self._binary = None

    @property
    def settled(self) -> bool:
        """Whether launching runs the kernel once: tuned already, or never tuned (a given
        tile, the interpreter). Before that the autotuner runs it several times on the same
        buffers, so it must not write into anything it reads."""
        return self._binary is not None or not self._launcher.tunes

    def native_form(self) -> tuple | None:
        """This launch for a compiled caller (`Binary.native_form`; slots index the values as
        `launch(values)` takes them), or None: before the first launch, or where a call does
        more than launch one binary (a broadcast view copied per call, a given tile)."""
        if self._binary is None or self._copies or self._constexprs or self._zeroed:
            return None
        return self._binary.native_form(self._template, dict(self._slots))

    def __call__(self, values: tuple) -> None:
        if self._copies:
            values = list(values)
            for i, remake in self._copies:
                values[i] = remake(values[i])
        args = self._template.copy()
        zeroed = [(position, buffer.new()) for position, buffer in self._zeroed]  # alive past the launch
        binary = self._binary
        if binary is not None and torch._C._cuda_getDevice() == binary.device and not hooks_active():
            # Addresses, not tensors: Triton's C launcher then skips asking the driver about
            # each pointer (the devices were checked when this call key was prepared).
            for position, i in self._slots:
                value = values[i]
                args[position] = None if value is None else value.data_ptr()
            for position, buffer in zeroed:
                args[position] = buffer.data_ptr()
            binary(args)
            return
        for position, i in self._slots:
            args[position] = values[i]
        for position, buffer in zeroed:
            args[position] = buffer
        self._binary = self._launcher.launch(self._grid, args, self._constexprs)


class _Tile:
    """A kernel launched with a given tile, not the autotuner (tests check every tile)."""

    tunes = False

    def __init__(self, kernel):
        self.fn = kernel.fn
        self.interpreted = kernel_is_interpreted(kernel)

    def launch(self, grid, args, constexprs) -> None:
        if not self.interpreted:
            self.fn[grid](*args, **constexprs)
            return
        with quiet_numpy():
            self.fn[grid](*args, **constexprs)


_SUM_PARTIALS = CachedLauncher(sum_partials_kernel)
_SUM_PARTIALS_SIGNATURE = _Signature(sum_partials_kernel)
SUM_PARTIALS_LIMIT = 2**18  # partial sums summed by sum_partials_kernel at most (fp32: 1 MiB)


def _sum_partials(target: GradTarget) -> Launch | None:
    """For a gradient the backward kernel leaves as partial sums ([R, N]: inputs broadcast
    along "rows" or "columns"), the launch that sums them into the gradient, in its dtype: one small kernel,
    where torch's sum, reshape and cast cost three launches' host time."""
    if target is None or target.broadcast not in ("rows", "columns"):
        return None
    r, n = target.buffer_shape
    if r * n > SUM_PARTIALS_LIMIT:
        return None  # large: torch's sum runs at bandwidth (this kernel is a few programs), and host time no longer shows
    args = _SUM_PARTIALS_SIGNATURE.ordered({"partials_ptr": Slot(0), "out_ptr": Slot(1), "R": r, N: n})
    return Launch(_SUM_PARTIALS, lambda meta: (tuning.cdiv(n, meta[BLOCK_N]),), args)


class PreparedBackward:
    """The backward kernel's launch for one call key and backward key, and where it writes
    each gradient: `prepared(tensors, grads, seed, statistics)` gives the gradients of the
    inputs it was prepared for, in input order.

    `in_place`: an input's gradient may be written into the input's own memory (the
    generated ops' inplace_backward=True), where that is safe for this call: its gradient
    has the input's shape, dtype and (contiguous) layout, each program reads an element
    before it writes the gradient there, the input is no leaf (never a parameter) and no
    view, shares memory with no other tensor of the call, and the kernel is past tuning. The input's
    version counter is then bumped, so that autograd refuses any later use of its old value."""

    __slots__ = ("_launch", "_targets", "_inputs", "_sums", "_none_written")

    def __init__(self, launch: Launch | None, targets: list, inputs: list[int], traced: bool = False):
        self._launch, self._targets, self._inputs = launch, targets, inputs  # inputs: each target's
        # In a traced graph partial sums are summed by torch's ops, which the graph records.
        self._sums = [_sum_partials(t) if launch is not None and not traced else None for t in targets]
        self._none_written = (False,) * len(targets)

    def __call__(self, tensors, grads, seed, statistics, in_place: bool = False) -> list[torch.Tensor]:
        # An input written in place is handed on detached: the same memory (and version
        # counter) as a gradient, without the input's own autograd history.
        written = [target is not None and self._writable(target, tensors[i], tensors, grads)
                   for target, i in zip(self._targets, self._inputs)] if in_place else self._none_written
        buffers = [
            None if target is None else tensors[i].detach() if into else target.new_buffer()
            for target, i, into in zip(self._targets, self._inputs, written)
        ]
        if self._launch is not None:
            self._launch((*tensors, *grads, *buffers, statistics, seed))
        results = []
        for target, buffer, sums, into in zip(self._targets, buffers, self._sums, written):
            if target is None:
                continue
            if into:
                torch.autograd.graph.increment_version(buffer)
            if sums is None:
                results.append(target.result(buffer))
            else:
                result = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                sums((buffer, result))
                results.append(result)
        return results

    def native_form(self) -> tuple | None:
        """(launch form, targets, inputs) for a compiled caller (runtime/csrc/eager_call.cpp),
        or None. Its targets: one per gradient the kernel computes (of the inputs listed),
        None where not needed, else (summed, buffer shape, buffer dtype, gradient shape,
        gradient dtype, the sums' launch form or None): a "full" gradient is the buffer, a
        "rows" one the buffer summed by the small kernel. Other broadcasts (a torch sum) stay here."""
        if self._launch is None:
            return None
        form = self._launch.native_form()
        if form is None:
            return None
        targets = []
        for target, sums in zip(self._targets, self._sums):
            if target is None:
                targets.append(None)
            elif target.broadcast == "full":
                targets.append((False, target.buffer_shape, target.buffer_dtype, None, None, None))
            else:
                sums_form = sums.native_form() if target.broadcast == "rows" and sums is not None else None
                if sums_form is None:
                    return None
                targets.append((True, target.buffer_shape, target.buffer_dtype, tuple(target.shape), target.dtype,
                                sums_form))
        return form, targets, list(self._inputs)

    def _writable(self, target: GradTarget, tensor: torch.Tensor, tensors, grads) -> bool:
        """Whether this call may write `tensor`'s gradient into `tensor` (see the class)."""
        # A view is refused too: its memory may be a leaf's (x.view(...) of a parameter).
        if target.broadcast != "full" or tensor.is_leaf or tensor._is_view() or not tensor.is_contiguous():
            return False
        if self._launch is None or not self._launch.settled:
            return False
        storage = tensor.untyped_storage().data_ptr()
        others = [t for t in tensors if t is not tensor] + list(grads)
        return len(others) == len(tensors) - 1 + len(grads) and all(
            t.untyped_storage().data_ptr() != storage for t in others
        )


class _Bound:
    def __init__(self, kernels: Kernels, op):
        inputs = [i.name for i in op.inputs]
        params = [p.name for p in op.params]
        names = kernels.names
        self.op = op
        self.forward_kernel, self.backward_kernel = kernels.forward, kernels.backward
        # Triton tunes and compiles on the first call per specialization; later calls go
        # straight to the binary.
        self._forward = CachedLauncher(kernels.forward)
        self._backward = CachedLauncher(kernels.backward) if kernels.backward else None  # None: forward only
        # What a traced graph records instead (graph_launcher); None under the CPU interpreter,
        # whose kernels a graph cannot record: the library ops stay opaque there.
        self.traceable = traceable(kernels.forward)
        self._graph_forward = GraphLauncher(kernels.forward) if self.traceable else None
        self._graph_backward = GraphLauncher(kernels.backward) if self.traceable and kernels.backward else None
        self._chunks = [i.chunks for i in op.inputs]
        self._scalars = [params.index(name) for name in kernels.scalars]
        self._dropout = op._dropout_indices
        self._choices = [i for i, p in enumerate(op.params) if isinstance(p, Choice)]
        self._reads = [inputs.index(name) for name in kernels.backward_reads]
        self._gradients = [inputs.index(name) for name in kernels.gradients]
        self._one_per_row = [op.inputs[i].one_per_row for i in self._gradients]
        # Each value's parameter name (naming.py), and the kernels' order of them.
        self._signatures = (_Signature(kernels.forward), _Signature(kernels.backward) if kernels.backward else None)
        self._input_names = [(names("pointer", i), names("stride_m", i), names("stride_n", i)) for i in inputs]
        self._incoming_names = [(names("incoming", o), names("incoming_stride_m", o), names("incoming_stride_n", o))
                                for o in op.outputs]
        self._output_names = [names("output", o) for o in op.outputs]
        self._scalar_names = [names("scalar", name) for name in kernels.scalars]
        self._dropout_names = [(names("threshold", params[i]), names("scale", params[i])) for i in self._dropout]
        self._statistics = kernels.statistics
        self._choice_names = [names("choice", params[i]) for i in self._choices]
        self._gradient_names = [(names("gradient", name), names("needs", name), names("sums", name),
                                 names("column_sums", name)) for name in kernels.gradients]
        # Two values of one name in a kernel would leave one out, unseen by the signature's check.
        common = [M, N, M_BUCKET, SEED, SHARD, HAS_DROPOUT, DROPOUT_WHOLE_GROUPS, SHARDED, INDEX_64, COMPUTE_FP64,
                  ROWS_PER_PROGRAM, BLOCK_N, ONE_TILE, STATISTICS, EXCHANGE, SPLITS, SHARES, *self._scalar_names,
                  *self._choice_names,
                  *(name for pair in self._dropout_names for name in pair)]
        forward = [*common, *self._output_names, *(name for triple in self._input_names for name in triple)]
        backward = [*common, *(name for i in self._reads for name in self._input_names[i]),
                    *(name for triple in self._incoming_names for name in triple)]
        for names_, one in zip(self._gradient_names, self._one_per_row):
            backward += names_ if one else names_[:3]
        for signature, named in zip(self._signatures, (forward, backward)):
            twice = sorted({name for name in named if named.count(name) > 1})
            if twice:
                raise KernelSignatureError(f"{signature.kernel}: values {', '.join(map(repr, twice))} share a name")


    def statistics_width(self, problem, keep: bool = True) -> int:
        """Values per row the forward keeps: the kernels' statistics, also where no gradient
        follows (`keep` off): a row's few statistics cost less than a kernel of its own."""
        return self._statistics

    def check_device(self, device: torch.device) -> None:
        check_runs_off_cuda(self.op.name, device, self.forward_kernel)

    # -- the calls that tests and the slow path make: prepare, then launch once ---------

    def forward(self, call, tensors, outputs, seed, tile: tuple[int, int] | None = None, statistics=None,
                traced: bool = False, keep: bool = True, **layout) -> None:
        """`tile` (BLOCK_M, BLOCK_N): launch the kernel itself with that tile, not the
        autotuner (tests use it to check every tile computes the same); `layout`: a kind's
        other choices with it (a row kind's `splits`). Pointwise kernels keep nothing for the
        backward: `statistics` is None. `traced`: the tensors are a traced graph's (fake): the
        launch is recorded in the graph (graph_launcher). `keep`: see statistics_width."""
        if _launches(call.problem, traced):
            self.prepare_forward(call, tensors, tile, traced, **layout)((*tensors, *outputs, statistics, seed))

    def backward(self, call, tensors, grads, needs, seed, tile: tuple[int, int] | None = None,
                 rows_per_program: int | None = None, statistics=None, traced: bool = False,
                 **layout) -> list[torch.Tensor]:
        """The gradients of the inputs flagged in `needs` (a flag per input), in input order,
        each in a new buffer."""
        prepared = self.prepare_backward(call, tensors, grads, needs, tile, rows_per_program, traced, **layout)
        return prepared(tensors, grads, seed, statistics)

    # -- preparing: once per call key ------------------------------------------------------

    @staticmethod
    def _views(problem, tensors, chunks, values, names, traced: bool = False):
        """The [M, N] views' arguments (a slot for values[k], then the strides) of tensors[k],
        by names[k] (pointer, stride_m, stride_n), the copies among them (a broadcast whose
        view is a copy, made per call), and the views themselves (for INDEX_64). Traced: the
        [M, N] tensors themselves, in place of slots (a launch in a traced graph is prepared
        for that one launch)."""
        args, copies, views = {}, [], []
        for tensor, chunk, value, (pointer, stride_m, stride_n) in zip(tensors, chunks, values, names):
            if traced:
                view = traced_view_2d(tensor, problem, chunk)
                args[pointer], args[stride_m], args[stride_n] = view
                views.append(view)
                continue
            view = view_2d(tensor, problem, chunk)
            if view[0] is not tensor:
                copies.append((value, functools.partial(_copied_view, problem=problem, chunks=chunk)))
            views.append(view)
            args[pointer], args[stride_m], args[stride_n] = Slot(value), view[1], view[2]
        return args, copies, views

    def _common(self, call, seed, traced: bool = False) -> dict:
        """M, N, M_BUCKET, the params, the seed and the dropout flags: what both kernels take."""
        problem, params = call.problem, call.params
        args = {M: problem.m, N: problem.n, M_BUCKET: tuning.m_bucket(problem.m)}
        for name, i in zip(self._scalar_names, self._scalars):
            args[name] = params[i]
        for (threshold, scale), i in zip(self._dropout_names, self._dropout):
            args[threshold], args[scale] = dropout_threshold(params[i]), dropout_scale(params[i])
        shard = call.shard
        if self.op.has_dropout:
            args[SEED], args[SHARD] = seed, None if shard is None else shard.buffer(problem.device, traced)
        for name, i in zip(self._choice_names, self._choices):
            args[name] = params[i]
        if self.op.has_dropout:
            args[HAS_DROPOUT] = call.has_dropout
            args[DROPOUT_WHOLE_GROUPS] = problem.n % 4 == 0 and (shard is None or shard.whole_groups)
            args[SHARDED] = shard is not None
        return args

    def _forward_args(self, call, tensors, traced: bool = False) -> tuple[dict, tuple]:
        """The forward's arguments up to COMPUTE_FP64, by name, with slots for the values
        (*tensors, *outputs, statistics, seed), and the copies among the views."""
        problem = call.problem
        count, outputs = len(tensors), len(self.op.outputs)
        args, copies, views = self._views(problem, tensors, self._chunks, range(count), self._input_names, traced)
        for j, name in enumerate(self._output_names):
            args[name] = Slot(count + j)
        args.update(self._extra_args(count + outputs))
        args.update(self._common(call, Slot(count + outputs + 1), traced))
        # The outputs are contiguous; one of k parts holds k times the problem's elements.
        widest = problem.m * problem.n * max(self.op.output_parts, default=1)
        args[INDEX_64] = self._index_64(problem, views) or widest >= INT32_LIMIT
        args[COMPUTE_FP64] = problem.compute_dtype == torch.float64
        return args, tuple(copies)

    def _extra_args(self, statistics_slot: int) -> dict:
        return {}  # pointwise kernels keep nothing for the backward

    def _index_64(self, problem, views) -> bool:
        return needs_int64(problem, views)

    def prepare_forward(self, call, tensors, tile: tuple[int, int] | None = None, traced: bool = False,
                        keep: bool = True) -> Launch:
        """The forward's launch for calls like this one: `launch((*tensors, *outputs, statistics, seed))`.
        `keep`: see statistics_width."""
        problem = call.problem
        m, n = problem.m, problem.n
        args, copies = self._forward_args(call, tensors, traced)
        args = self._signatures[0].ordered(args)
        if tile is not None:
            grid = (tuning.cdiv(m, tile[0]), tuning.cdiv(n, tile[1]))
            return Launch(_Tile(self.forward_kernel), grid, args, copies, {BLOCK_M: tile[0], BLOCK_N: tile[1]})
        return Launch(self._graph_forward if traced else self._forward,
                      lambda meta: (tuning.cdiv(m, meta[BLOCK_M]), tuning.cdiv(n, meta[BLOCK_N])), args, copies)

    def _backward_args(self, call, tensors, grads, targets, traced: bool = False) -> tuple[dict, tuple]:
        """The backward's arguments but its tile, by name, with slots for the values
        (*tensors, *grads, *gradient buffers, statistics, seed)."""
        problem = call.problem
        count = len(tensors)
        reads = self._reads
        args, copies, views = self._views(problem, [tensors[i] for i in reads], [self._chunks[i] for i in reads], reads,
                                          [self._input_names[i] for i in reads], traced)
        grad_args, grad_copies, grad_views = self._views(
            problem, grads, self.op.output_parts, range(count, count + len(grads)), self._incoming_names, traced
        )
        args.update(grad_args)
        for k, names in enumerate(self._gradient_names):
            args[names[0]] = Slot(count + len(grads) + k)
        args.update(self._extra_args(count + len(grads) + len(targets)))
        args.update(self._common(call, Slot(count + len(grads) + len(targets) + 1), traced))
        # A chunked input's gradient, written in full, holds its chunks side by side: [M, k·N].
        widest = problem.m * problem.n * max(self._chunks, default=1)
        args[INDEX_64] = self._index_64(problem, views + grad_views) or widest >= INT32_LIMIT
        args[COMPUTE_FP64] = problem.compute_dtype == torch.float64
        for target, one, (_, needs, sums, column_sums) in zip(targets, self._one_per_row, self._gradient_names):
            args[needs], args[sums] = target is not None, target is not None and target.broadcast == "rows"
            if one:
                args[column_sums] = target is not None and target.broadcast == "columns"
        return args, (*copies, *grad_copies)

    def _sums_over_rows(self, problem, tensors, needs) -> bool:
        """Whether some needed gradient is summed over rows (a bias's): then the backward's
        programs walk many rows each, for fewer partial sums."""
        return any(needs[i] and GradTarget.broadcast_of(tensors[i], problem, self._chunks[i]) == "rows"
                   for i in self._gradients)

    def prepare_backward(self, call, tensors, grads, needs, tile: tuple[int, int] | None = None,
                         rows_per_program: int | None = None, traced: bool = False) -> PreparedBackward:
        problem = call.problem
        m, n = problem.m, problem.n
        bucket, n_hint = tuning.m_bucket(m), tuning.size_hint(n)
        summed = self._sums_over_rows(problem, tensors, needs)
        rows = rows_per_program or tuning.backward_rows_per_program(bucket, n_hint, summed)
        column_tiles = 0
        if any(one and needs[i] for i, one in zip(self._gradients, self._one_per_row)):
            # Row sums land one row per column tile: as many rows as the narrowest tile needs.
            width = tile[1] if tile is not None else tuning.narrowest_backward_block_n(bucket, n_hint, rows)
            column_tiles = tuning.cdiv(n, width)
        targets = [
            GradTarget.of(tensors[i], problem, tuning.cdiv(m, rows), column_tiles, self._chunks[i], one)
            if needs[i] else None
            for i, one in zip(self._gradients, self._one_per_row)
        ]
        if not _launches(problem, traced):
            return PreparedBackward(None, targets, self._gradients)
        args, copies = self._backward_args(call, tensors, grads, targets, traced)
        args[ROWS_PER_PROGRAM] = rows
        args = self._signatures[1].ordered(args)
        if tile is not None:
            grid = (tuning.cdiv(m, rows), tuning.cdiv(n, tile[1]))
            launch = Launch(_Tile(self.backward_kernel), grid, args, copies, {BLOCK_M: tile[0], BLOCK_N: tile[1]})
        else:
            launch = Launch(self._graph_backward if traced else self._backward,
                            lambda meta: (tuning.cdiv(m, rows), tuning.cdiv(n, meta[BLOCK_N])), args, copies)
        return PreparedBackward(launch, targets, self._gradients, traced)


def _copied_view(tensor, problem, chunks):
    """A broadcast tensor's [M, N] view where that is a copy (made per call)."""
    return view_2d(tensor, problem, chunks)[0]


def _launches(problem, traced: bool) -> bool:
    """Whether a kernel has anything to do. A traced graph's tensors have no data, but the
    launch is recorded for the graph's real ones."""
    return problem.m * problem.n > 0 if traced else problem.launches
