"""The gemm kind's launches. The forward kernel (gemm_kernel_text.py) takes the matmul's
operands as [M, K] and [K, N] with their strides, the epilogue's inputs as the pointwise kind
takes its inputs, and a grid of output tiles. The backward is the pointwise kind's launch of
the g kernel on the epilogue (the product, saved by the forward, in place of the operands),
then the operands' gradients as torch.matmul of g: dA = g @ bᵀ, dB = aᵀ @ g."""
from __future__ import annotations

import math

import torch

from fusegen.layout import Input
from fusegen.runtime.views import INT32_LIMIT

from . import gemm_lib, gemm_tuning, tuning
from .launch import Kernels, Launch, Slot, _Bound, _launches, _Tile
from .naming import (A_K_MAJOR, B_K_MAJOR, BLOCK_K, BLOCK_M, BLOCK_N, COMPUTE_FP64, FP64_PRODUCT, GROUP_M, INDEX_64,
                     INPUT_PRECISION, K, PARTS, TMA)


class GemmKernels(Kernels):
    """A gemm op's kernels, as its module declares them: `backward_reads` and `gradients` are
    the g kernel's (the epilogue's inputs, `product` the product's name among them);
    `product_gradient`: the output whose incoming gradient is g (the product passes through
    to it), where the g kernel does not form g."""

    def __init__(self, *args, product: str, product_gradient: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.product, self.product_gradient = product, product_gradient

    def bind(self, op) -> "_BoundGemm":
        return _BoundGemm(self, op)


class _Epilogue:
    """The op as the epilogue's kernels see it (what launch._Bound reads of a FusedOp): the
    product, [..., N], in place of the matmul's operands."""

    def __init__(self, op, product: str):
        operands = (op.matmul.a, op.matmul.b)
        self.name = op.name
        self.inputs = (Input(product, ("...", "N"), op.product_chunks),
                       *(i for i in op.inputs if i.name not in operands))
        self.params, self.outputs, self.output_parts = op.params, op.outputs, op.output_parts
        self.has_dropout, self._dropout_indices = op.has_dropout, op._dropout_indices


class _BoundGemm(_Bound):
    def __init__(self, kernels: GemmKernels, op):
        super().__init__(kernels, _Epilogue(op, kernels.product))
        matmul, names = op.matmul, [i.name for i in op.inputs]
        self.fused = op
        self._a, self._b, self._transposed = names.index(matmul.a), names.index(matmul.b), matmul.transposed
        self._others = [k for k, name in enumerate(names) if name not in (matmul.a, matmul.b)]
        self._saved = bool(kernels.statistics)
        self._product_gradient = None if kernels.product_gradient is None else op.outputs.index(kernels.product_gradient)
        parameter = kernels.names
        self._operand_names = (
            (parameter("pointer", matmul.a), parameter("stride_m", matmul.a), parameter("stride_k", matmul.a)),
            (parameter("pointer", matmul.b), parameter("stride_k", matmul.b), parameter("stride_n", matmul.b)),
        )
        self._product_pointer = parameter("pointer", kernels.product)

    def _product_buffer(self, problem) -> torch.Tensor:
        """A buffer for the saved product, [..., k·N] in the outputs' dtype, as the op keeps it."""
        return torch.empty(self.fused.statistics_shape(problem), dtype=problem.out_dtype, device=problem.device)

    def forward(self, call, tensors, outputs, seed, tile: tuple[int, int, int] | None = None, statistics=None,
                traced: bool = False) -> None:
        """`tile` (BLOCK_M, BLOCK_N[, BLOCK_K]): that tile, not the autotuner's (tests; each side at
        least 16, as tl.dot takes it)."""
        problem = call.problem
        if statistics is None and self._saved:  # a caller with no backward to feed (tests)
            statistics = self._product_buffer(problem)
        if _launches(problem, traced):
            self.prepare_forward(call, tensors, tile, traced)((*tensors, *outputs, statistics, seed))

    def prepare_forward(self, call, tensors, tile: tuple[int, int, int] | None = None, traced: bool = False) -> Launch:
        """`traced`: the tensors are a traced graph's; the operands' [M, K] and [K, N] go into the
        argument list themselves (reshaped as the graph records it), as _Bound's views do."""
        problem = call.problem
        m, n = problem.m, problem.n
        count, outputs = len(tensors), len(self.op.outputs)
        others = [tensors[k] for k in self._others]
        args, copies, views = self._views(problem, others, self._chunks[1:], self._others, self._input_names[1:],
                                          traced)
        a, b = tensors[self._a], tensors[self._b]
        k = a.shape[-1]
        if traced:
            a_2d, a_value, b_value = a.reshape(m, k), a.reshape(m, k), b
        else:
            a_2d, a_copy = _rows_of(a)
            a_value, b_value = Slot(self._a), Slot(self._b)
            if a_copy:
                copies.append((self._a, _copied_rows))
        (a_ptr, a_stride_m, a_stride_k), (b_ptr, b_stride_k, b_stride_n) = self._operand_names
        args[a_ptr], args[a_stride_m], args[a_stride_k] = a_value, a_2d.stride(0), a_2d.stride(1)
        b_strides = (b.stride(1), b.stride(0)) if self._transposed else (b.stride(0), b.stride(1))
        args[b_ptr], (args[b_stride_k], args[b_stride_n]) = b_value, b_strides
        for j, name in enumerate(self._output_names):
            args[name] = Slot(count + j)
        if self._saved:
            args[self._product_pointer] = Slot(count + outputs)
        args.update(self._common(call, Slot(count + outputs + 1), traced))
        args[K] = k
        # From the sizes themselves: in a graph traced with symbolic sizes each comparison is a guard.
        # The saved product holds all its chunks side by side: [M, k·N].
        chunks = self.fused.product_chunks
        args[INDEX_64] = bool(self._index_64(problem, views) or m * n * chunks >= INT32_LIMIT
                              or _reach(a_2d) >= INT32_LIMIT or _reach(b) >= INT32_LIMIT)
        args[COMPUTE_FP64] = problem.compute_dtype == torch.float64
        args[FP64_PRODUCT] = problem.compute_dtype == torch.float64  # the product too, as the reference forms it
        # torch.mm's default for fp32 (torch.backends.cuda.matmul.allow_tf32 off); tf32: later.
        args[INPUT_PRECISION] = "ieee"
        # Descriptors where TMA reads both operands as they lie (eager and CUDA graphs; a traced
        # graph's kernel takes the pointer mainloop: Inductor gives in-kernel descriptors no scratch).
        fp64 = problem.compute_dtype == torch.float64  # the product in fp64: the pointer mainloop's
        majors = None if traced or fp64 else gemm_lib.tma_layouts(a_2d, b.mT if self._transposed else b)
        if majors is not None and chunks > 1 and n * b_strides[1] * b.element_size() % 16:
            majors = None  # a chunk of b starts where TMA cannot (each descriptor's base: 16-byte aligned)
        args[TMA] = majors is not None
        args[A_K_MAJOR], args[B_K_MAJOR] = majors or (False, False)
        if majors is not None:
            gemm_lib.set_tma_allocator()
        programs = _programs(problem.device) if majors is not None else None
        args = self._signatures[0].ordered(args)
        if tile is not None:  # (BLOCK_M, BLOCK_N[, BLOCK_K]), each at least tl.dot's 16
            block_m, block_n, block_k = (max(gemm_tuning.SMALLEST, size) for size in (*tile, 16)[:3])
            grid = (_grid(m, n, block_m, block_n, programs),)
            constexprs = {BLOCK_M: block_m, BLOCK_N: block_n, BLOCK_K: block_k, GROUP_M: gemm_tuning.GROUP_M,
                          PARTS: gemm_tuning.PINNED_PARTS or 1}
            return Launch(_Tile(self.forward_kernel), grid, args, tuple(copies), constexprs)
        return Launch(self._graph_forward if traced else self._forward,
                      lambda meta: (_grid(m, n, meta[BLOCK_M], meta[BLOCK_N], programs),), args, tuple(copies))

    def backward(self, call, tensors, grads, needs, seed, statistics=None, traced: bool = False,
                 **layout) -> list[torch.Tensor]:
        problem = call.problem
        if statistics is None and self._saved and problem.launches:
            # No forward's product at hand (tests launching the kernel): a forward makes it.
            statistics = self._product_buffer(problem)
            outputs = [torch.empty(self.fused.output_shape(problem, i), dtype=self.fused.output_dtype(problem, i),
                                   device=problem.device) for i in range(len(self.fused.outputs))]
            self.forward(call, tensors, outputs, seed, statistics=statistics)
        # A traced launch holds its tensors (no slots): the product itself, not its layout.
        prepared = self.prepare_backward(call, tensors, grads, needs, traced=traced,
                                         product=statistics if traced else None, **layout)
        return prepared(tensors, grads, seed, statistics)

    def prepare_backward(self, call, tensors, grads, needs, tile: tuple[int, int] | None = None,
                         rows_per_program: int | None = None, traced: bool = False,
                         product: torch.Tensor | None = None) -> "_PreparedGemmBackward":
        problem = call.problem
        needs_g = needs[self._a] or needs[self._b]
        epilogue_needs = (needs_g and self._product_gradient is None, *(needs[k] for k in self._others))
        if product is None:  # the g kernel is prepared for the product's layout: contiguous [..., N]
            product = self._product_buffer(problem)
        epilogue = None
        if any(epilogue_needs):
            epilogue = super().prepare_backward(call, (product, *(tensors[k] for k in self._others)), grads,
                                                epilogue_needs, tile, rows_per_program, traced)
        return _PreparedGemmBackward(self, needs, epilogue, epilogue_needs[0])


class _PreparedGemmBackward:
    """The backward for one call key and backward key: the g kernel (where anything of the
    epilogue is needed), then the operands' gradients as matmuls of g."""

    def __init__(self, bound: _BoundGemm, needs, epilogue, forms_g: bool):
        self._bound, self._needs, self._epilogue, self._forms_g = bound, tuple(needs), epilogue, forms_g

    def __call__(self, tensors, grads, seed, statistics, in_place: bool = False) -> list[torch.Tensor]:
        bound, needs = self._bound, self._needs
        results = []
        if self._epilogue is not None:
            epilogue = (statistics, *(tensors[k] for k in bound._others))
            results = self._epilogue(epilogue, grads, seed, None)
        g = results.pop(0) if self._forms_g else None
        if g is None and bound._product_gradient is not None:
            g = grads[bound._product_gradient]
        gradients = {}
        if needs[bound._a] or needs[bound._b]:
            a, b = tensors[bound._a], tensors[bound._b]
            # In the operands' dtype (promoted), as autograd casts g back for F.linear's: bf16
            # operands take bf16 GEMMs (cuBLAS, fp32 accumulation) under an fp32 bias too.
            dtype = torch.promote_types(a.dtype, b.dtype)
            g_2d, a_2d, b = _rows_of(g)[0].to(dtype), _rows_of(a)[0].to(dtype), b.to(dtype)
            if needs[bound._a]:
                grad = g_2d @ b if bound._transposed else g_2d @ b.mT
                gradients[bound._a] = grad.reshape(a.shape).to(a.dtype)
            if needs[bound._b]:
                grad = g_2d.mT @ a_2d if bound._transposed else a_2d.mT @ g_2d
                gradients[bound._b] = grad.to(tensors[bound._b].dtype)
        others = iter(results)
        for k in bound._others:
            if needs[k]:
                gradients[k] = next(others)
        return [gradients[k] for k in range(len(needs)) if needs[k]]

    def native_form(self) -> None:
        return None  # the operands' matmuls are torch's: such backwards stay in Python


def _grid(m: int, n: int, block_m: int, block_n: int, programs: int | None) -> int:
    """Programs of the forward: one a tile, or at most `programs` walking the tiles (TMA)."""
    tiles = tuning.cdiv(m, block_m) * tuning.cdiv(n, block_n)
    return tiles if programs is None else max(1, min(tiles, programs))


def _programs(device: torch.device) -> int:
    """A persistent kernel's programs: one an SM (one a tile under the interpreter)."""
    if device.type != "cuda":
        return 2**31 - 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _rows_of(a: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """a [..., K] as [M, K]: a view where its strides allow, else a copy (made per call)."""
    try:
        return a.view(_rows(a), a.shape[-1]), False
    except RuntimeError:
        return _copied_rows(a), True


def _copied_rows(a: torch.Tensor) -> torch.Tensor:
    return a.reshape(_rows(a), a.shape[-1])


def _rows(a: torch.Tensor) -> int:
    return math.prod(a.shape[:-1])


def _reach(t: torch.Tensor):
    """One past the farthest element offset a kernel computes in `t` (0 for no element)."""
    if t.numel() == 0:
        return 0
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
