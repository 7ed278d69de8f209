"""The CUDA backend's row kind at run time (row_source.py): a block (or cluster) a run of rows,
its threads by the row's width; the forward writes each row's statistics, the backward reads them
and sums the gradients of inputs broadcast along rows over each block's rows."""
from __future__ import annotations

import numpy as np
import torch

from . import launch as pointwise  # the pointwise kind's launcher: what the row kind shares of it
from .launch import (_C_TYPES, _INDEX, CudaKernels, _BoundCuda, _index, _pack, _views, backward_types, backward_views,
                     gradient_arguments, gradient_buffers, gradient_forms, gradients_of, view_arguments)

MAX_THREADS, MIN_THREADS = 1024, 32
LAYOUTS = {2: (((32,), False), ((16, 8), False)), 4: (((16,), True), ((16, 8), False))}  # by the size of a row's
# widest held elements (2: 16-bit or narrower; 4: wider), the forward's and the backward's values of a row a thread
# takes (of several, the one whose compiled kernel the GPU runs the most threads of at once; on a tie the first)
# and whether a row one block holds is kept in registers (else in shared memory). H100, rows of 8192 bf16 and 4096
# fp32 (twenty-first session): 16-bit forwards ran best from shared memory at 32 values a thread (in registers
# 0.44-0.99x as fast, from more registers a thread), fp32 forwards from registers at 16 (0.91-1.00x the Triton
# kernels; shared memory 0.80-0.98x); the backwards from shared memory (at 32, or in registers: mixed). Backwards
# at 8 against 16 (twenty-second session, forward+backward, GPU time): faster or level in 8 of the 9 cells where 8
# let the GPU run more threads at once (bf16 layernorm 0.661 -> 0.586 ms, fp32 add_rmsnorm 1.108 -> 1.021; bf16
# layernorm_dropout_add 2 % slower), never faster in the 5 where it did not (bf16 rmsnorm 0.515 -> 0.546)
REGISTER_BYTES = 128  # a thread's held row at most in registers (more: shared memory)
SM_REGISTERS = 65536  # an SM's: a held row in registers takes at most a quarter of a thread's share
# (__launch_bounds__(1024) leaves 64 a thread; ptxas spilled an fp32 forward holding 128 bytes there)
PART = 64 * 1024  # a cluster's block's shared memory at most, where a cluster of MAX_CLUSTER allows: two
# blocks an SM, one loading while the other computes
RESERVED = 1024 + 512  # shared memory an SM keeps a block (sm_80 and later), and a row's reductions'
MAX_CLUSTER = 16  # blocks a row at most, on sm_90 and later (past 8: an H100's non-portable sizes)
CLUSTER_THREADS = 512  # a cluster's block's threads at most where two of its blocks fit an SM: its
# registers past 32 a thread then cost an SM a quarter of its threads, not half (H100, wide 16-bit rows:
# forward 0.74-0.77 of the copy bandwidth at 1024 threads, 0.80-0.86 at 512; forward+backward 1.02-1.28x faster)
_SIZES = {name: dtype.itemsize for dtype, name in _C_TYPES.items()} | {"unsigned char": 1}  # held masks: a byte


class CudaRowKernels(CudaKernels):
    """What a generated row module hands its FusedOp: CudaKernels, how many values a row its
    forward keeps (`statistics`), and what each kernel holds where the row is held (`held`:
    row_source.held_arrays)."""

    def __init__(self, *args, statistics: int, held: tuple[tuple, tuple], **kwargs):
        super().__init__(*args, **kwargs)
        self.statistics, self.held = statistics, held

    def bind(self, op) -> "_BoundRows":
        return _BoundRows(self, op)


class _BoundRows(_BoundCuda):
    def statistics_width(self, problem, keep: bool = True) -> int:
        return self.kernels.statistics  # a row's few values: kept, gradient or not

    def launches(self) -> tuple[type, type]:
        return _RowForward, _RowBackward


def layout(problem, pack: int, sizes: tuple[int, ...] = (), shared: int = 0, clusters: int = 1,
           share: int = LAYOUTS[2][0][0][0]) -> tuple[int, int, int]:
    """A block's threads (`share` of its part of the row's values each, a power of two from
    MIN_THREADS to MAX_THREADS), the packs each holds and the blocks a row: one block where the
    row's held arrays (elements of `sizes`) fit its `shared` bytes of shared memory, else the
    smallest cluster (a power of two to `clusters`) whose blocks' parts fit PART, else `shared`;
    else one block and Items 0, the row read again each pass. A cluster's blocks take at most
    CLUSTER_THREADS threads (more values each) where two of them fit an SM's shared memory."""
    packs = problem.n // pack

    def parts(cluster: int, most_threads: int = MAX_THREADS) -> tuple[int, int]:
        part = -(-packs // cluster)
        threads = min(most_threads, max(MIN_THREADS, 1 << max(0, -(-part // max(1, share // pack)) - 1).bit_length()))
        return threads, -(-part // threads)

    def fits(cluster: int, most: int) -> bool:
        threads, items = parts(cluster)
        return shared_bytes(threads * items * pack, sizes) <= most

    if sizes:
        wider = [1 << k for k in range(1, clusters.bit_length())]  # 2, 4, ... to `clusters`
        for cluster, most in [(1, shared), *((c, min(PART, shared)) for c in wider), *((c, shared) for c in wider)]:
            if fits(cluster, most):
                threads, items = parts(cluster)
                if cluster > 1 and threads > CLUSTER_THREADS:
                    fewer = parts(cluster, CLUSTER_THREADS)
                    if 2 * shared_bytes(fewer[0] * fewer[1] * pack, sizes) + RESERVED <= shared:
                        threads, items = fewer
                return threads, items, cluster
    return parts(1)[0], 0, 1


def in_registers(threads: int, items: int, cluster: int, pack: int, sizes: tuple[int, ...]) -> bool:
    """Whether a row one block holds (Items packs a thread of each of `sizes`) fits its threads'
    registers: REGISTER_BYTES a thread at most, and a quarter of its share of an SM's."""
    held = items * pack * sum(sizes)
    return cluster == 1 and 0 < held <= min(REGISTER_BYTES, SM_REGISTERS // threads)


def shared_bytes(span: int, sizes: tuple[int, ...]) -> int:
    """Dynamic shared memory of arrays of `span` elements of each size (fusegen::take's)."""
    return sum(-(-span * size // 128) * 128 for size in sizes)


def shared_limit(device) -> tuple[int, int]:
    """A block's most dynamic shared memory and the most blocks a cluster."""
    properties = torch.cuda.get_device_properties(device)
    return properties.shared_memory_per_multiprocessor - RESERVED, MAX_CLUSTER if properties.major >= 9 else 1


class _RowLaunch:
    """A row kernel's launch for one call key: Pack chosen at each call (the views' alignment),
    the index type at the first, a kernel and launch config each."""

    def __init__(self, bound: _BoundRows, call, name: str, types: list[str]):
        self._bound, self._call = bound, call
        self._name, self._types = name, [_C_TYPES[call.problem.compute_dtype], *types]
        self._kernels: dict[tuple, tuple] = {}  # (pack, index) → (kernel, launch config, blocks)
        self._index = None  # the call key's shapes and strides decide it: on the first launch
        held = bound.kernels.held[name == "backward"]
        self._sizes = tuple(_SIZES[self._types[0] if p == "T" else p if isinstance(p, str) else self._types[1 + p]]
                            for p in held)
        self._layouts: dict[tuple, tuple] = {}  # (pack, index) → (threads, items, cluster, registers, shared bytes)

    def layout(self, pack: int, index: type) -> tuple[int, int, int, bool, int]:
        """Threads, Items, the blocks a row, whether a held row is in registers and the dynamic
        shared memory of a block at `pack` (kept by pack and index type). Of several values a
        thread (LAYOUTS), the one whose kernel the GPU runs the most threads of at once."""
        found = self._layouts.get((pack, index))
        if found is None:
            problem = self._call.problem
            most, clusters = shared_limit(problem.device)
            shares, registers = LAYOUTS[2 if max(self._sizes, default=2) <= 2 else 4][self._name == "backward"]
            candidates = []
            for share in shares:
                threads, items, cluster = layout(problem, pack, self._sizes, most, clusters, share)
                held = registers and in_registers(threads, items, cluster, pack, self._sizes)
                candidate = (threads, items, cluster, held, 0 if held else shared_bytes(threads * items * pack, self._sizes))
                if candidate not in candidates:  # narrow or wide rows: shares may give the same layout
                    candidates.append(candidate)
            if len(candidates) > 1:
                self._bound.compile_together(problem.device, [self.expression(pack, index, c) for c in candidates])
                found = max(candidates, key=lambda c: self.threads_resident(pack, index, c))  # the first on a tie
            else:
                found = candidates[0]
            self._layouts[(pack, index)] = found
        return found

    def threads_resident(self, pack: int, index: type, layout: tuple) -> int:
        """Threads of the kernel at `layout` the whole GPU runs at once (the driver's count)."""
        threads, _, cluster, _, shared = layout
        kernel = self.compiled(pack, index, layout)
        pointwise._allow(kernel, self._call.problem.device, shared, cluster)
        return self.resident(layout, kernel) * cluster * threads

    def resident(self, layout: tuple, kernel) -> int:
        """Blocks of `kernel` at `layout` (clusters, where a row takes several) the whole GPU runs
        at once: the driver's counts (launch._resident: an SM's blocks, or the GPU's clusters)."""
        device = self._call.problem.device
        threads, _, cluster, _, shared = layout
        found = pointwise._resident(kernel, device, threads, shared, cluster)
        return found * torch.cuda.get_device_properties(device).multi_processor_count if cluster == 1 else found

    def expression(self, pack: int, index: type, layout: tuple) -> str:
        """The name expression of the kernel at `pack`, `index` and `layout`."""
        t, *types = self._types
        threads, items, cluster, registers, _ = layout
        arguments = [str(pack), str(threads), str(items), str(cluster), "true" if registers else "false"]
        return f"{self._bound.kernels.op}_{self._name}<{', '.join([t, _INDEX[index], *arguments, *types])}>"

    def compiled(self, pack: int, index: type, layout: tuple):
        """The kernel at `pack`, `index` and `layout` (compiled once a process; the cubin cached on
        disk once a machine: compiler.py)."""
        return self._bound.kernel(self._call.problem.device, self.expression(pack, index, layout))

    def prepared(self, pack: int, index: type) -> tuple:
        """The kernel at `pack` and `index`, its launch config, its grid's blocks (the backward's
        size its buffer of sums, every call) and a block's run of rows, rows_each (the host divides:
        an integer division is dozens of instructions a thread, where a 16-bit row's thread has a
        few hundred); kept by call key."""
        found = self._kernels.get((pack, index))
        if found is None:
            problem = self._call.problem
            layout = self.layout(pack, index)
            threads, _, cluster, _, shared = layout
            compiled = self.compiled(pack, index, layout)
            pointwise._allow(compiled, problem.device, shared, cluster)
            blocks = self.count_blocks(layout, compiled)
            found = self._kernels[(pack, index)] = (compiled, pointwise._config((blocks, 1), threads, shared, cluster),
                                                    blocks, index(-(-problem.m // blocks)))
        return found

    def count_blocks(self, layout: tuple, kernel) -> int:
        raise NotImplementedError

    def launch(self, pack: int, index: type, arguments: list) -> None:
        """The kernel at `pack` and `index` on `arguments`, then M, N and a block's run of rows."""
        kernel, config, _, rows_each = self.prepared(pack, index)
        problem = self._call.problem
        pointwise._launch(kernel, problem.device, config, arguments + [index(problem.m), index(problem.n), rows_each])

    def index(self, views) -> type:
        """As the pointwise kind's, the [M, statistics] buffer's offsets too (once: the call key's)."""
        if self._index is None:
            problem = self._call.problem
            index = _index(problem, views, 1)
            self._index = index if problem.m * max(1, self._bound.kernels.statistics) < 2**31 else np.int64
        return self._index


class _RowForward(_RowLaunch):
    def __init__(self, bound: _BoundRows, call, tensors):
        problem = call.problem
        reads = [_C_TYPES[tensors[i].dtype] for i in bound._reads[0]]
        outputs = [_C_TYPES[bound.op.output_dtype(problem, j)] for j in range(len(bound.op.outputs))]
        super().__init__(bound, call, "forward", reads + outputs)
        self._count = len(tensors)

    def count_blocks(self, layout: tuple, kernel) -> int:
        """Clusters of blocks (one block where the row takes one): one a row."""
        return min(self._call.problem.m, (2**31 - 1) // layout[2])

    def __call__(self, values: tuple) -> None:
        bound, call = self._bound, self._call
        problem = call.problem
        tensors, rest = values[:self._count], values[self._count:]
        outputs, statistics, seed = rest[:-2], rest[-2], rest[-1]
        views = _views(tensors, bound._reads[0], bound.chunks, problem)  # a copied view lives until the launch is queued
        shard = bound.mask_shard(call, 0)
        pack, index = _pack(problem, views, outputs, shard), self.index(views)
        arguments = view_arguments(views, index) + [o.data_ptr() for o in outputs]
        arguments.append(0 if statistics is None else statistics.data_ptr())
        arguments += bound.scalar_arguments(call, 0) + bound.dropout_arguments(call, 0, seed, shard)
        self.launch(pack, index, arguments)

    def native_form(self) -> None:
        return None  # calls stay in Python


class _RowBackward(_RowLaunch):
    def __init__(self, bound: _BoundRows, call, tensors, grads, needs):
        problem = call.problem
        self._needs = tuple(needs)
        self._forms = gradient_forms(bound, problem, tensors, needs)
        super().__init__(bound, call, "backward", backward_types(bound, problem, tensors, grads, self._forms))

    def count_blocks(self, layout: tuple, kernel) -> int:
        """As many blocks, or clusters of blocks, as the GPU runs at once (a second wave would
        leave the GPU half idle at the end): the driver's counts for the compiled kernel
        (launch._resident: its registers, threads and shared memory, and for clusters how the SMs
        group), each taking a run of adjacent rows, none without one.
        Where a gradient is summed over rows, a row of partial sums each."""
        problem = self._call.problem
        each = -(-problem.m // max(1, self.resident(layout, kernel)))  # a block's run of rows (rows_each)
        return max(1, -(-problem.m // each))  # no block without a row: each writes its row of sums

    def __call__(self, tensors, grads, seed, statistics, in_place: bool = False) -> list[torch.Tensor]:
        bound, call = self._bound, self._call
        problem = call.problem
        views, pack, index, shard = [], 1, None, bound.mask_shard(call, 1)
        if problem.launches:
            views = backward_views(bound, problem, tensors, grads)
            pack = _pack(problem, views, [], shard)  # the buffers are torch's: rows of whole packs
            index = self.index(views)
        blocks = self.prepared(pack, index)[2] if problem.launches else problem.m
        buffers = gradient_buffers(bound, problem, tensors, self._forms, blocks)
        if problem.launches:
            arguments = view_arguments(views, index) + [0 if statistics is None else statistics.data_ptr()]
            arguments += bound.scalar_arguments(call, 1) + bound.dropout_arguments(call, 1, seed, shard)
            arguments += gradient_arguments(buffers, self._forms)
            self.launch(pack, index, arguments)
        elif problem.m * problem.n == 0:
            buffers = [None if b is None else b.zero_() for b in buffers]
        return gradients_of(bound, problem, tensors, self._needs, self._forms, buffers)

    def native_form(self) -> None:
        return None
