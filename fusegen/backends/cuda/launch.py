"""The CUDA backend's run-time kernels (runtime.backend's contract): a generated module's CUDA C++
source, compiled by NVRTC on first use per dtype combination (compiler.py), launched through
cuda-core on torch's current stream (so CUDA graphs capture the launches).

The pointwise kind (pointwise_source.py): a forward thread takes a pack of adjacent elements of a
row, a backward thread a pack of columns over a block of rows; the pack is 16 bytes of the
narrowest element type, in vector loads, where the call's views allow it (_pack), else one
element. Each input is read through its
[M, N] view's strides, as the Triton kernels read it (runtime.views); a gradient is written as the
input's own dtype where the input is the problem's shape, summed over each block's rows where the
input is one row broadcast to all (a [blocks, N] buffer in the compute type that torch then adds
up in order: deterministic), else written whole in the compute type and summed to the input's
shape by torch.

Not yet: launches recorded in a compiled graph (the library ops stay opaque to torch.compile),
the C++ eager call (calls stay in Python), DTensor shards."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from fusegen.runtime.arguments import FusegenArgumentError
from fusegen.runtime.dropout import dropout_scale, dropout_threshold
from fusegen.runtime.views import view_2d
from fusegen.runtime.out import E4M3_SATURATES

from . import compiler

BLOCK = 256  # threads a block: the forward's elements, the backward's columns
_C_TYPES = {torch.float32: "float", torch.float64: "double", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16",
            torch.int64: "int64_t", torch.int32: "int32_t", torch.int16: "int16_t", torch.int8: "int8_t",
            torch.uint8: "uint8_t", torch.bool: "bool", torch.float8_e5m2: "fusegen::float8_e5m2",
            torch.float8_e4m3fn: f"fusegen::float8_e4m3<{str(E4M3_SATURATES).lower()}>"}  # as the installed torch
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


def source_beside(module_file: str) -> str:
    """A generated module's kernels' source: <op>.cu beside the module (codegen.beside)."""
    path = Path(module_file).with_suffix(".cu")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ImportError(f"{path.name} is missing beside {Path(module_file).name}: build the op again "
                          "(fusegen build --backend cuda)") from None


class CudaKernels:
    """What a generated module hands its FusedOp: the op's CUDA source and which inputs and params
    each kernel reads, by spec name (fusegen.backends.cuda.codegen writes them from the plan)."""

    def __init__(self, source: str, op: str, *, scalars: tuple[str, ...] = (), backward_reads: tuple[str, ...],
                 gradients: tuple[str, ...], forward_reads: tuple[str, ...], backward_scalars: tuple[str, ...] = (),
                 forward_dropout: tuple[str, ...] = (), backward_dropout: tuple[str, ...] = (),
                 forward_choices: tuple[str, ...] = (), backward_choices: tuple[str, ...] = ()):
        self.source, self.op = source, op
        self.gradients = gradients
        self.statistics = 0  # the pointwise kind keeps nothing for the backward
        self._reads = (forward_reads, backward_reads)
        self._scalars = (scalars, backward_scalars)
        self._dropout = (forward_dropout, backward_dropout)
        self._choices = (forward_choices, backward_choices)  # template arguments: the choice's index

    def bind(self, op) -> "_BoundCuda":
        return _BoundCuda(self, op)


class _BoundCuda:
    traceable = False  # a compiled graph keeps the library ops opaque

    def __init__(self, kernels: CudaKernels, op):
        self.kernels, self.op = kernels, op
        inputs = [i.name for i in op.inputs]
        params = [p.name for p in op.params]
        self._reads = tuple(tuple(inputs.index(n) for n in reads) for reads in kernels._reads)
        self._scalars = tuple(tuple(params.index(n) for n in names) for names in kernels._scalars)
        self._integer = frozenset(k for k, p in enumerate(op.params) if getattr(p, "type", None) == "int")  # int64_t
        self._dropout = tuple(tuple(params.index(n) for n in names) for names in kernels._dropout)
        self._choices = tuple(tuple(params.index(n) for n in names) for names in kernels._choices)
        self._gradients = tuple(inputs.index(n) for n in kernels.gradients)
        self.chunks = tuple(i.chunks for i in op.inputs)  # k N-wide chunks side by side in the last dim
        self._modules: dict[tuple, object] = {}  # (arch, expression) → its kernel
        self._lock = threading.Lock()

    # -- the contract --------------------------------------------------------------------

    def check_device(self, device: torch.device) -> None:
        raise FusegenArgumentError(f"{self.op.name}(): tensors are on {device.type}, but this op's kernels are "
                                   "CUDA C++ (built with --backend cuda); use CUDA tensors, or call reference(...)")

    def statistics_width(self, problem, keep: bool = True) -> int:
        return 0

    def forward(self, call, tensors, outputs, seed, *, statistics=None, traced: bool = False, keep: bool = True) -> None:
        if call.problem.launches:
            self.prepare_forward(call, tensors)((*tensors, *outputs, statistics, seed))

    def backward(self, call, tensors, grads, needs, seed, *, statistics=None, traced: bool = False) -> list:
        return self.prepare_backward(call, tensors, grads, needs)(tensors, grads, seed, statistics)

    def prepare_forward(self, call, tensors, *, keep: bool = True):
        return self.launches()[0](self, call, tensors)

    def prepare_backward(self, call, tensors, grads, needs):
        return self.launches()[1](self, call, tensors, grads, needs)

    def launches(self) -> tuple[type, type]:
        """The kind's prepared forward and backward launches (the pointwise kind's here)."""
        return _Forward, _Backward

    # -- shared by the launches ----------------------------------------------------------

    def kernel(self, device: torch.device, expression: str):
        """The kernel of `expression` for `device`'s arch, compiled on first use (each prepared
        launch asks once, then keeps it)."""
        self.compile_together(device, (expression,))
        return self._modules[(_arch(device), expression)]

    def compile_together(self, device: torch.device, expressions) -> None:
        """Those of `expressions` not yet compiled for `device`'s arch, in one NVRTC program: one
        compile where a launcher weighs several layouts (row_launch)."""
        arch = _arch(device)
        with self._lock:
            missing = [e for e in dict.fromkeys(expressions) if (arch, e) not in self._modules]
            if missing:
                binary = compiler.compile_source(self.kernels.source, f"{self.kernels.op}.cu", tuple(missing), arch)
                for expression, kernel in _load(binary).items():
                    self._modules[(arch, expression)] = kernel

    def template_choices(self, call, which: int) -> list[str]:
        """Each choice param's template argument: the call's choice, by its index among the choices."""
        return [str(self.op.params[i].choices.index(call.params[i])) for i in self._choices[which]]

    def mask_shard(self, call, which: int):
        """The call's DTensor shard where kernel `which` (0 the forward, 1 the backward) draws
        dropout's masks: their flat indices are the global problem's; else None (a shard's place
        changes nothing else in the kernels)."""
        return call.shard if self._dropout[which] and call.has_dropout else None

    def scalar_arguments(self, call, which: int) -> list:
        """The params the kernel reads: in the compute type, an int param as int64."""
        t = _NUMPY[call.problem.compute_dtype]
        return [(np.int64 if i in self._integer else t)(call.params[i]) for i in self._scalars[which]]

    def dropout_arguments(self, call, which: int, seed, shard) -> list:
        """The seed tensor's address (0 without dropout), dropout's flag, the six sizes' address of
        `shard` (mask_shard's, which the caller's pack took too; 0 for None), each p's threshold and
        scale."""
        if not self._dropout[which]:
            return []
        t = _NUMPY[call.problem.compute_dtype]
        params = call.params
        values = [0 if seed is None or not call.has_dropout else seed.data_ptr(), np.bool_(call.has_dropout)]
        values.append(0 if shard is None else shard.buffer(call.problem.device).data_ptr())
        for i in self._dropout[which]:
            values += [np.int32(dropout_threshold(params[i])), t(dropout_scale(params[i]))]
        return values


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _load(binary: compiler.Binary) -> dict:
    from cuda.core import ObjectCode

    code = ObjectCode.from_cubin(binary.cubin, name=binary.name)
    # By the mangled names: the kernels are templates (pointwise_source), instantiated by expression.
    return {expression: code.get_kernel(lowered.encode()) for expression, lowered in binary.lowered.items()}


_STREAMS: dict[int, object] = {}
_CURRENT = threading.local()


def _config(grid: tuple[int, int], block: int = BLOCK, shared: int = 0, cluster: int = 1):
    """A launch of `grid` blocks, or with `cluster` > 1 of `grid` clusters of that many blocks."""
    from cuda.core import LaunchConfig

    if cluster > 1:
        return LaunchConfig(grid=grid, cluster=(cluster, 1, 1), block=(block, 1, 1), shmem_size=shared)
    return LaunchConfig(grid=grid, block=(block, 1, 1), shmem_size=shared)


def _resident(kernel, device: torch.device, threads: int, shared: int, cluster: int = 1) -> int:
    """Blocks of `kernel` an SM of `device` runs at once, of `threads` threads and `shared` bytes
    of dynamic shared memory each (its registers, threads and shared memory), or with `cluster` >
    1 its clusters of that many blocks the whole GPU runs at once (a cluster's blocks share a GPC:
    fewer than the SMs' count divided by the cluster where the GPCs' SMs do not divide evenly):
    the driver's counts. Asked in the calling thread (autograd's, for a backward), with the
    device's context current there."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        _make_current(index)
        if cluster == 1:
            return kernel.occupancy.max_active_blocks_per_multiprocessor(threads, shared)
        from cuda.core import Device

        return kernel.occupancy.max_active_clusters(_config((1, 1), threads, shared, cluster),
                                                    stream=Device(index).default_stream)


def _allow(kernel, device: torch.device, shared: int, cluster: int = 1) -> None:
    """Let `kernel` launch with `shared` bytes of dynamic shared memory (48 KB with the static
    shared memory without asking) and clusters of `cluster` blocks (past 8, not portable)."""
    from cuda.bindings import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    attributes = driver.CUfunction_attribute
    for attribute, value, needed in ((attributes.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared, shared > 0),
                                     (attributes.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1, cluster > 8)):
        if needed:
            (result,) = driver.cuKernelSetAttribute(attribute, value, kernel.handle, index)
            if result != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"fusegen: a kernel's {attribute.name} = {value}: {result}")


def _make_current(index: int) -> None:
    """torch's primary context of device `index` current in this thread, for cuda-core (once a
    thread: torch keeps it current after)."""
    from cuda.core import Device

    current = getattr(_CURRENT, "devices", None)
    if current is None:
        current = _CURRENT.devices = set()
    if index not in current:
        Device(index).set_current()
        current.add(index)


def _launch(kernel, device: torch.device, config, arguments: list) -> None:
    from cuda.core import Stream, launch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index != torch.cuda.current_device():  # the tensors' device's context current, torch's device restored
        with torch.cuda.device(index):
            _launch(kernel, torch.device("cuda", index), config, arguments)
        return
    _make_current(index)
    handle = torch.cuda.current_stream(index).cuda_stream
    stream = _STREAMS.get(handle)
    if stream is None:
        stream = _STREAMS[handle] = Stream.from_handle(handle)
    launch(stream, config, kernel, *arguments)


def _views(tensors, indices, chunks, problem) -> list[tuple[torch.Tensor, int, int]]:
    """Each read tensor's [M, chunks·N] view and strides (the view a copy where no strides make it)."""
    return [view_2d(tensors[i], problem, chunks[i]) for i in indices]


def _pack(problem, views, outputs, shard=None) -> int:
    """Elements a thread takes side by side: 16 bytes of the narrowest element type (at least 4,
    for dropout's groups of four; at most 8: a wider type's pack is two 16-byte loads), where every
    view's column stride is 1 or 0 (one value for the row), N a multiple of the pack and each row of
    a view and each output aligned to its pack's size (pointwise_source), and where masks are drawn
    for a DTensor's `shard`, its global rows of whole groups of four from a group's start; else 1."""
    if shard is not None and not shard.whole_groups:
        return 1
    sizes = [v.element_size() for v, _, _ in views] + [o.element_size() for o in outputs]
    pack = min(8, max(4, 16 // min(sizes)))
    if problem.n % pack:
        return 1
    for view, stride_m, stride_n in views:
        if stride_n == 0:
            continue
        if stride_n != 1 or (problem.m > 1 and stride_m % pack) or view.data_ptr() % (pack * view.element_size()):
            return 1
    if any(o.data_ptr() % (pack * o.element_size()) for o in outputs):
        return 1
    return pack


def view_arguments(views, index: type) -> list:
    """Each view's pointer and strides, as the kernels take them."""
    return [a for view, stride_m, stride_n in views for a in (view.data_ptr(), index(stride_m), index(stride_n))]


def _index(problem, views, widest: int) -> type:
    """int32 index arithmetic where no element offset, nor a thread's number, can reach 2**31."""
    # Past the end by a block's packs at most; a row or block of rows counted on past M (a row
    # kernel's block's run of rows, the backward's last block's rows) by at most M.
    last = max(problem.m * problem.n * widest + 1024 * 8, 2 * problem.m + 1024)
    for view, stride_m, stride_n in views:
        width = view.shape[-1] if view.dim() else 1
        last = max(last, (problem.m - 1) * abs(stride_m) + (width - 1) * abs(stride_n) + 1)
    return np.int32 if last < 2**31 else np.int64


_INDEX = {np.int32: "int32_t", np.int64: "int64_t"}


def gradient_forms(bound: _BoundCuda, problem, tensors, needs) -> list[str | None]:
    """How each gradient the backward kernel computes is written: "write", as the input's dtype
    (the input is the problem's shape); "sums", in T, over blocks of rows (an input of one row
    broadcast to all); "whole", in T, for torch to sum (another broadcast input); None where not
    wanted."""
    forms = []
    for i in bound._gradients:
        tensor, width = tensors[i], problem.n * bound.chunks[i]
        if not needs[i]:
            forms.append(None)
        elif tensor.shape == (*problem.shape[:-1], width):
            forms.append("write")
        elif problem.m > 1 and tensor.numel() == width and view_2d(tensor, problem, bound.chunks[i])[1] == 0:
            forms.append("sums")
        else:
            forms.append("whole")
    return forms


def backward_views(bound: _BoundCuda, problem, tensors, grads) -> list[tuple[torch.Tensor, int, int]]:
    """What a backward kernel reads: its inputs' views, then the incoming gradients' ([M, k·N] for
    an output in parts)."""
    views = _views(tensors, bound._reads[1], bound.chunks, problem)
    return views + [view_2d(g, problem, parts) for g, parts in zip(grads, bound.op.output_parts)]


def backward_types(bound: _BoundCuda, problem, tensors, grads, forms) -> list[str]:
    """A backward kernel's element types: its reads', then each gradient buffer's (gradient_forms)."""
    reads = [_C_TYPES[tensors[i].dtype] for i in bound._reads[1]] + [_C_TYPES[g.dtype] for g in grads]
    compute = _C_TYPES[problem.compute_dtype]
    return reads + [_C_TYPES[tensors[i].dtype] if form == "write" else compute for i, form in zip(bound._gradients, forms)]


def gradient_arguments(buffers, forms) -> list:
    """Each gradient buffer's pointer (0 where not wanted) and whether it holds sums."""
    return [a for buffer, form in zip(buffers, forms) for a in (0 if buffer is None else buffer.data_ptr(),
                                                                np.bool_(form == "sums"))]


def gradient_buffers(bound: _BoundCuda, problem, tensors, forms, blocks: int) -> list:
    """The buffers the backward kernel writes each gradient to, by its form (gradient_forms)."""
    buffers = []
    for i, form in zip(bound._gradients, forms):
        width = problem.n * bound.chunks[i]
        shape = {"write": (*problem.shape[:-1], width), "sums": (blocks, width), "whole": (problem.m, width)}.get(form)
        dtype = tensors[i].dtype if form == "write" else problem.compute_dtype
        buffers.append(None if form is None else torch.empty(shape, dtype=dtype, device=problem.device))
    return buffers


def gradients_of(bound: _BoundCuda, problem, tensors, needs, forms, buffers) -> list[torch.Tensor]:
    """Each wanted gradient from its buffer: block sums added up in order, a whole one summed
    to the input's shape by torch."""
    results = []
    for i, need in enumerate(needs):
        if not need:
            continue
        k = bound._gradients.index(i)
        buffer, form, tensor = buffers[k], forms[k], tensors[i]
        if form == "sums":  # each block's sums, added up in order: the input's N values
            buffer = buffer.sum(0).to(tensor.dtype)
        elif form == "whole":
            whole = (*problem.shape[:-1], problem.n * bound.chunks[i])
            buffer = buffer.reshape(whole).sum_to_size(tensor.shape).to(tensor.dtype)
        results.append(buffer.reshape(tensor.shape))
    return results


class _Forward:
    """The forward's launch for one call key: `launch((*tensors, *outputs, statistics, seed))`;
    Pack chosen at each call (its pointers' alignment), the index type at the first, a kernel
    each."""

    def __init__(self, bound: _BoundCuda, call, tensors):
        self._bound, self._call = bound, call
        problem = call.problem
        t = _C_TYPES[problem.compute_dtype]
        reads = [_C_TYPES[tensors[i].dtype] for i in bound._reads[0]]
        outputs = [_C_TYPES[bound.op.output_dtype(problem, j)] for j in range(len(bound.op.outputs))]
        self._types = (t, bound.template_choices(call, 0), [*reads, *outputs])
        self._count = len(tensors)
        self._widest = max([*(bound.chunks[i] for i in bound._reads[0]), *bound.op.output_parts, 1])
        self._index = None  # the call key's shapes and strides decide it: on the first launch
        self._kernels: dict[tuple, tuple] = {}  # (pack, index) → (kernel, launch config), compiled on first use

    def expression(self, pack: int, index: type) -> str:
        t, chosen, types = self._types
        return f"{self._bound.kernels.op}_forward<{', '.join([t, _INDEX[index], *chosen, str(pack), *types])}>"

    def grid(self, pack: int) -> tuple[int, int]:
        problem = self._call.problem
        return (-(-problem.m * (problem.n // pack) // BLOCK), 1)

    def __call__(self, values: tuple) -> None:
        bound, call = self._bound, self._call
        problem = call.problem
        tensors, rest = values[:self._count], values[self._count:]
        outputs, seed = rest[:-2], rest[-1]
        views = _views(tensors, bound._reads[0], bound.chunks, problem)  # a copied view lives until the launch is queued
        if self._index is None:
            self._index = _index(problem, views, self._widest)
        shard = bound.mask_shard(call, 0)
        pack, index = _pack(problem, views, outputs, shard), self._index
        arguments = view_arguments(views, index) + [o.data_ptr() for o in outputs]
        arguments += bound.scalar_arguments(call, 0) + bound.dropout_arguments(call, 0, seed, shard)
        arguments += [index(problem.m), index(problem.n)]
        launch = self._kernels.get((pack, index))
        if launch is None:
            launch = self._kernels[(pack, index)] = (bound.kernel(problem.device, self.expression(pack, index)),
                                                     _config(self.grid(pack)))
        _launch(launch[0], problem.device, launch[1], arguments)

    def native_form(self) -> None:
        return None  # calls stay in Python


class _Backward:
    """The backward's launch for one call key, incoming gradients' layout and `needs`; Pack and
    the index type chosen as the forward's."""

    def __init__(self, bound: _BoundCuda, call, tensors, grads, needs):
        self._bound, self._call, self._needs = bound, call, tuple(needs)
        problem = call.problem
        self._forms = gradient_forms(bound, problem, tensors, needs)
        self._types = (_C_TYPES[problem.compute_dtype], bound.template_choices(call, 1),
                       backward_types(bound, problem, tensors, grads, self._forms))
        self._widest = max([*(bound.chunks[i] for i in bound._reads[1]), *bound.op.output_parts,
                            *(bound.chunks[i] for i in bound._gradients), 1])
        self._index = None  # as the forward's
        self._kernels: dict[tuple, tuple] = {}  # (pack, index) → (kernel, launch config), compiled on first use
        self._geometry: dict[int, tuple] = {}  # pack → geometry(pack)

    def expression(self, pack: int, index: type) -> str:
        t, chosen, types = self._types
        return f"{self._bound.kernels.op}_backward<{', '.join([t, _INDEX[index], *chosen, str(pack), *types])}>"

    def geometry(self, pack: int) -> tuple[tuple[int, int], int]:
        """The grid (blocks of BLOCK packs of columns, blocks of rows) and a block's rows: where a
        gradient is summed over rows, about four blocks an SM (each block's sums one row of the
        buffer torch adds up); else a block a row, up to 65535 blocks."""
        problem = self._call.problem
        columns = max(1, -(-(problem.n // pack) // BLOCK))
        if "sums" in self._forms:
            programs = 4 * torch.cuda.get_device_properties(problem.device).multi_processor_count
            chunks = max(1, min(problem.m, -(-programs // columns)))
        else:
            chunks = max(1, min(problem.m, 65535))
        rows = -(-problem.m // chunks) if problem.m else 1
        return (columns, -(-problem.m // rows) if problem.m else 0), rows

    def __call__(self, tensors, grads, seed, statistics, in_place: bool = False) -> list[torch.Tensor]:
        bound, call = self._bound, self._call
        problem = call.problem
        device = problem.device
        views = backward_views(bound, problem, tensors, grads) if problem.launches else []
        # The buffers are torch's (aligned, each row a multiple of the pack): only the reads decide.
        shard = bound.mask_shard(call, 1)
        pack = _pack(problem, views, [], shard) if views else 1
        geometry = self._geometry.get(pack)
        if geometry is None:
            geometry = self._geometry[pack] = self.geometry(pack) if problem.launches else ((1, problem.m), 1)
        grid, rows = geometry
        buffers = gradient_buffers(bound, problem, tensors, self._forms, grid[1])
        if problem.launches:
            if self._index is None:
                self._index = _index(problem, views, self._widest)
            index = self._index
            arguments = view_arguments(views, index) + bound.scalar_arguments(call, 1)
            arguments += bound.dropout_arguments(call, 1, seed, shard) + gradient_arguments(buffers, self._forms)
            arguments += [index(problem.m), index(problem.n), index(rows)]
            launch = self._kernels.get((pack, index))
            if launch is None:
                launch = self._kernels[(pack, index)] = (bound.kernel(device, self.expression(pack, index)),
                                                         _config(grid))
            _launch(launch[0], device, launch[1], arguments)
        elif problem.m * problem.n == 0:
            buffers = [None if b is None else b.zero_() for b in buffers]
        return gradients_of(bound, problem, tensors, self._needs, self._forms, buffers)

    def native_form(self) -> None:
        return None
