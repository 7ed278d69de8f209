"""The gemm kind's launches. The forward kernel (gemm_kernel_text.py) takes the matmul's
operands as [M, K] and [K, N] with their strides, the epilogue's inputs as the pointwise kind
takes its inputs, and a grid of output tiles. The backward is the pointwise kind's launch of
the g kernel on the epilogue (the product, saved by the forward, in place of the operands),
then the operands' gradients as torch.matmul of g: dA = g @ bᵀ, dB = aᵀ @ g."""
from __future__ import annotations

import functools
import math

import torch
import triton
from torch._subclasses.fake_tensor import is_fake

from fusegen.layout import Input
from fusegen.runtime.views import INT32_LIMIT

from . import gemm_lib, gemm_tuning, tuning
from .launch import Kernels, Launch, Slot, _Bound, _launches, _Tile
from .naming import (A_K_MAJOR, B_K_MAJOR, BLOCK_H, BLOCK_K, BLOCK_M, BLOCK_N, BLOCK_R, COMPUTE_FP64, FP64_PRODUCT,
                     GROUP_M, HIDDEN, INDEX_64, INPUT_PRECISION, K, KEEP, PARTS, RANK, TMA)


class GemmKernels(Kernels):
    """A gemm op's kernels, as its module declares them: `backward_reads` and `gradients` are
    the g kernel's (the epilogue's inputs, `product` the product's name among them);
    `product_gradient`: the output whose incoming gradient is g (the product passes through
    to it), where the g kernel does not form g; `hidden_partials`: with a hidden layer, which of
    the partials its forward keeps (after its values, H-wide each) is its product's, then each
    [H] input's."""

    def __init__(self, *args, product: str, product_gradient: str | None = None, lowrank: str | None = None,
                 lowrank_gradient: str | None = None, hidden_partials: tuple[int, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.product, self.product_gradient = product, product_gradient
        self.lowrank, self.lowrank_gradient = lowrank, lowrank_gradient
        self.hidden_partials = hidden_partials

    def bind(self, op) -> "_BoundGemm":
        return _BoundGemm(self, op)


class _Epilogue:
    """The op as the epilogue's kernels see it (what launch._Bound reads of a FusedOp): the
    product, [..., N], in place of the matmul's operands (and the low-rank product in place of
    its own)."""

    def __init__(self, op, product: str, lowrank: str | None):
        self.name = op.name
        self.inputs = (Input(product, ("...", "N"), op.product_chunks),
                       *((Input(lowrank, ("...", "N")),) if lowrank else ()),
                       *(i for i in op.inputs if i.name not in op.matmul.operands))
        self.params, self.outputs, self.output_parts = op.params, op.outputs, op.output_parts
        self.has_dropout, self._dropout_indices = op.has_dropout, op._dropout_indices


class _BoundGemm(_Bound):
    def __init__(self, kernels: GemmKernels, op):
        super().__init__(kernels, _Epilogue(op, kernels.product, kernels.lowrank))
        matmul, names = op.matmul, [i.name for i in op.inputs]
        self.fused = op
        self._a, self._b, self._transposed = names.index(matmul.a), names.index(matmul.b), matmul.transposed
        self._others = [k for k, name in enumerate(names) if name not in matmul.operands]
        self._saved = bool(kernels.statistics)
        # With a hidden layer the forward keeps its values and partials beside the product (if
        # kept): the product is saved where the g kernel reads it (its signature takes it).
        self._hidden, self._hidden_partials = matmul.hidden, kernels.hidden_partials
        self._hidden_values = 1 + max(kernels.hidden_partials) + 1 if kernels.hidden_partials else 0
        self._product_saved = kernels.product in kernels.backward_reads if matmul.hidden else self._saved
        self._product_gradient = None if kernels.product_gradient is None else op.outputs.index(kernels.product_gradient)
        parameter = kernels.names
        self._operand_names = (
            (parameter("pointer", matmul.a), parameter("stride_m", matmul.a), parameter("stride_k", matmul.a)),
            (parameter("pointer", matmul.b), parameter("stride_k", matmul.b), parameter("stride_n", matmul.b)),
        )
        # The low-rank product's down [K, R] and up [R, N] (each its transpose under T), by index.
        self._lowrank = matmul.lowrank
        self._products = 1 + (matmul.lowrank is not None)  # the epilogue's inputs before the op's own
        self._lowrank_gradient = None
        if matmul.lowrank is not None:
            r = matmul.lowrank
            self._down, self._up = names.index(r.down), names.index(r.up)
            self._lowrank_names = tuple((parameter("pointer", n), parameter("stride_k", n), parameter("stride_n", n))
                                        for n in (r.down, r.up))
            if kernels.lowrank_gradient is not None:
                self._lowrank_gradient = op.outputs.index(kernels.lowrank_gradient)
        if matmul.hidden is not None:
            h = matmul.hidden
            self._weight, self._layer_inputs = names.index(h.weight), [names.index(n) for n in h.inputs]
            self._weight_names = (parameter("pointer", h.weight), parameter("stride_k", h.weight),
                                  parameter("stride_n", h.weight))
            self._layer_input_names = [(parameter("pointer", n), parameter("stride_n", n)) for n in h.inputs]
        self._product_pointer = parameter("pointer", kernels.product)

    def statistics_width(self, problem, keep: bool = True) -> int:
        """What the forward keeps a row: the product (all its chunks side by side, [..., k·N]),
        where the backward reads it; with a hidden layer, then its values and each partial (H each).
        Nothing where no gradient follows (`keep` off): the kernel then writes none of it."""
        if not keep:
            return 0
        width = problem.n * self.fused.product_chunks if self._product_saved else 0
        return width + problem.hidden * self._hidden_values

    def _kept_buffer(self, problem) -> torch.Tensor:
        """A buffer for what the forward keeps, as the op keeps it."""
        return torch.empty(self.fused.statistics_shape(problem), dtype=problem.out_dtype, device=problem.device)

    def _product_buffer(self, problem) -> torch.Tensor:
        """A buffer for the saved product, [..., k·N] in the outputs' dtype, as the op keeps it
        (with a hidden layer, the first columns of what its forward keeps)."""
        if self._hidden is not None and self._product_saved:
            return _product_of(self._kept_buffer(problem), problem.n)
        shape = (*problem.shape[:-1], problem.n * self.fused.product_chunks)
        return torch.empty(shape, dtype=problem.out_dtype, device=problem.device)

    def forward(self, call, tensors, outputs, seed, tile: tuple[int, int, int] | None = None, statistics=None,
                traced: bool = False, keep: bool = True) -> None:
        """`tile` (BLOCK_M, BLOCK_N[, BLOCK_K]): that tile, not the autotuner's (tests; each side at
        least 16, as tl.dot takes it)."""
        problem = call.problem
        if statistics is None and self._saved and keep:  # a caller with no backward to feed (tests)
            statistics = self._kept_buffer(problem)
        if _launches(problem, traced):
            self.prepare_forward(call, tensors, tile, traced, keep)((*tensors, *outputs, statistics, seed))

    def prepare_forward(self, call, tensors, tile: tuple[int, int, int] | None = None, traced: bool = False,
                        keep: bool = True) -> Launch:
        """`traced`: the tensors are a traced graph's; the operands' [M, K] and [K, N] go into the
        argument list themselves (reshaped as the graph records it), as _Bound's views do. `keep`
        off: no gradient follows; the kernel writes nothing for the backward and reads no
        `statistics` (its slot may hold None)."""
        if self._hidden is not None:
            return self._prepare_hidden_forward(call, tensors, tile, traced, keep)
        problem = call.problem
        m, n = problem.m, problem.n
        count, outputs = len(tensors), len(self.op.outputs)
        others = [tensors[k] for k in self._others]
        skip = self._products  # the epilogue's inputs formed in the kernel
        args, copies, views = self._views(problem, others, self._chunks[skip:], self._others,
                                          self._input_names[skip:], traced)
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
            self._kept_arguments(args, count, outputs, keep)
        args.update(self._common(call, Slot(count + outputs + 1), traced))
        args[K] = k
        reach = 0
        if self._lowrank is not None:
            reach = self._lowrank_arguments(args, tensors, traced)
        # From the sizes themselves: in a graph traced with symbolic sizes each comparison is a guard.
        # The saved product holds all its chunks side by side: [M, k·N].
        chunks = self.fused.product_chunks
        args[INDEX_64] = bool(self._index_64(problem, views) or m * n * chunks >= INT32_LIMIT
                              or _reach(a_2d) >= INT32_LIMIT or _reach(b) >= INT32_LIMIT or reach >= INT32_LIMIT)
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
        if majors is not None and self._lowrank is not None:
            # down through a descriptor too: as a's dtype, stored [R, K] (nn.Linear's lora_a layout)
            down = tensors[self._down]
            if gemm_lib.tma_layouts(a_2d, down.mT if self._lowrank.down_transposed else down) != (majors[0], True):
                majors = None
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

    def _kept_arguments(self, args: dict, count: int, outputs: int, keep: bool) -> None:
        """Where the forward writes what it keeps, and whether it does: without `keep`, the pointer
        is the first output's, which the kernel then never writes through (no buffer at all)."""
        args[self._product_pointer] = Slot(count + outputs) if keep else Slot(count)
        args[KEEP] = keep

    def _prepare_hidden_forward(self, call, tensors, tile: tuple[int, int, int] | None, traced: bool,
                                keep: bool) -> Launch:
        """prepare_forward with a hidden layer: its weight and [H] inputs beside the operands;
        the pointer mainloop, a program a tile."""
        problem = call.problem
        m, n = problem.m, problem.n
        count, outputs = len(tensors), len(self.op.outputs)
        others = [tensors[k] for k in self._others]
        args, copies, views = self._views(problem, others, self._chunks[1:], self._others, self._input_names[1:], traced)
        a, b, weight = tensors[self._a], tensors[self._b], tensors[self._weight]
        k = a.shape[-1]
        if traced:
            a_2d = a.reshape(m, k)
            a_value, b_value, weight_value = a_2d, b, weight
        else:
            a_2d, a_copy = _rows_of(a)
            a_value, b_value, weight_value = Slot(self._a), Slot(self._b), Slot(self._weight)
            if a_copy:
                copies.append((self._a, _copied_rows))
        (a_ptr, a_stride_m, a_stride_k), (b_ptr, b_stride_k, b_stride_n) = self._operand_names
        weight_ptr, weight_stride_k, weight_stride_n = self._weight_names
        args[a_ptr], args[a_stride_m], args[a_stride_k] = a_value, a_2d.stride(0), a_2d.stride(1)
        args[b_ptr], (args[b_stride_k], args[b_stride_n]) = b_value, _strides_kn(b, self._transposed)
        args[weight_ptr], (args[weight_stride_k], args[weight_stride_n]) = (weight_value,
                                                                            _strides_kn(weight, self._hidden.transposed))
        for (pointer, stride), index in zip(self._layer_input_names, self._layer_inputs):
            args[pointer], args[stride] = tensors[index] if traced else Slot(index), tensors[index].stride(0)
        for j, name in enumerate(self._output_names):
            args[name] = Slot(count + j)
        self._kept_arguments(args, count, outputs, keep)
        args.update(self._common(call, Slot(count + outputs + 1), traced))
        args[K], args[HIDDEN] = k, problem.hidden
        args[INDEX_64] = bool(self._index_64(problem, views) or m * self.statistics_width(problem) >= INT32_LIMIT
                              or any(_reach(t) >= INT32_LIMIT for t in (a_2d, b, weight)))
        args[COMPUTE_FP64] = args[FP64_PRODUCT] = problem.compute_dtype == torch.float64
        args[INPUT_PRECISION] = "ieee"
        args[BLOCK_H] = max(gemm_tuning.SMALLEST, triton.next_power_of_2(problem.hidden))
        args = self._signatures[0].ordered(args)
        if tile is not None:  # (BLOCK_M, BLOCK_N[, BLOCK_K]), each at least tl.dot's 16
            block_m, block_n, block_k = (max(gemm_tuning.SMALLEST, size) for size in (*tile, 16)[:3])
            constexprs = {BLOCK_M: block_m, BLOCK_N: block_n, BLOCK_K: block_k, GROUP_M: gemm_tuning.GROUP_M,
                          PARTS: gemm_tuning.PINNED_PARTS or 1}
            return Launch(_Tile(self.forward_kernel), (_grid(m, n, block_m, block_n, None),), args, tuple(copies),
                          constexprs)
        return Launch(self._graph_forward if traced else self._forward,
                      lambda meta: (_grid(m, n, meta[BLOCK_M], meta[BLOCK_N], None),), args, tuple(copies))

    def _lowrank_arguments(self, args: dict, tensors, traced: bool) -> int:
        """The low-rank product's operands, R and BLOCK_R into `args`; their farthest reach."""
        r = self._lowrank
        down, up = tensors[self._down], tensors[self._up]
        for (pointer, stride_k, stride_n), t, index, transposed in zip(
                self._lowrank_names, (down, up), (self._down, self._up), (r.down_transposed, r.up_transposed)):
            args[pointer] = t if traced else Slot(index)
            args[stride_k], args[stride_n] = (t.stride(1), t.stride(0)) if transposed else (t.stride(0), t.stride(1))
        rank = down.shape[0] if r.down_transposed else down.shape[1]
        args[RANK], args[BLOCK_R] = rank, max(gemm_tuning.SMALLEST, triton.next_power_of_2(rank))
        return max(_reach(down), _reach(up))

    def backward(self, call, tensors, grads, needs, seed, statistics=None, traced: bool = False,
                 **layout) -> list[torch.Tensor]:
        problem = call.problem
        if statistics is None and self._saved and problem.launches:
            # No forward's product at hand (tests launching the kernel): a forward makes it.
            statistics = self._kept_buffer(problem)
            outputs = [torch.empty(self.fused.output_shape(problem, i), dtype=self.fused.output_dtype(problem, i),
                                   device=problem.device) for i in range(len(self.fused.outputs))]
            self.forward(call, tensors, outputs, seed, statistics=statistics)
        # A traced launch holds its tensors (no slots): the product itself, not its layout.
        product = statistics if traced and self._hidden is None else None
        if traced and self._hidden is not None and self._product_saved:  # its columns of what was kept
            product = _product_of(statistics, call.problem.n)
        prepared = self.prepare_backward(call, tensors, grads, needs, traced=traced, product=product, **layout)
        return prepared(tensors, grads, seed, statistics)

    def prepare_backward(self, call, tensors, grads, needs, tile: tuple[int, int] | None = None,
                         rows_per_program: int | None = None, traced: bool = False,
                         product: torch.Tensor | None = None) -> "_PreparedGemmBackward":
        problem = call.problem
        needs_g = needs[self._a] or needs[self._b]
        if self._hidden is not None:  # every gradient of the hidden layer is from g too
            needs_g = needs_g or needs[self._weight] or any(needs[k] for k in self._layer_inputs)
        products = (needs_g and self._product_gradient is None,)
        if self._lowrank is not None:  # its gradient, where x's, down's or up's is wanted
            needs_lowrank = needs[self._a] or needs[self._down] or needs[self._up]
            products += (needs_lowrank and self._lowrank_gradient is None,)
        epilogue_needs = (*products, *(needs[k] for k in self._others))
        if product is None:  # the g kernel is prepared for the product's layout: contiguous [..., N]
            product = self._product_buffer(problem)
        epilogue = None
        if any(epilogue_needs):
            # The low-rank product is never kept (planning refuses a backward that reads it): the
            # g kernel is handed the product's buffer in its place, which it does not read.
            formed = (product,) * len(products)
            epilogue = super().prepare_backward(call, (*formed, *(tensors[k] for k in self._others)), grads,
                                                epilogue_needs, tile, rows_per_program, traced)
        return _PreparedGemmBackward(self, needs, epilogue, products, traced)


class _PreparedGemmBackward:
    """The backward for one call key and backward key: the g kernel (where anything of the
    epilogue is needed), then the operands' gradients as matmuls of g."""

    def __init__(self, bound: _BoundGemm, needs, epilogue, forms: tuple[bool, ...], traced: bool = False):
        """`forms`: whether the g kernel forms the product's gradient, and the low-rank one's;
        `traced`: the tensors are a traced graph's (a hidden layer's kernel recorded in it)."""
        self._bound, self._needs, self._epilogue, self._forms = bound, tuple(needs), epilogue, forms
        self._traced = traced

    def __call__(self, tensors, grads, seed, statistics, in_place: bool = False) -> list[torch.Tensor]:
        bound, needs = self._bound, self._needs
        results = []
        if self._epilogue is not None:
            # The saved product for each product the epilogue reads (the low-rank one's unread).
            product = statistics
            if bound._hidden is not None:  # its columns of what the forward kept, where it kept it
                product = _product_of(statistics, grads[0].shape[-1]) if bound._product_saved else None
            epilogue = (*(product,) * bound._products, *(tensors[k] for k in bound._others))
            results = self._epilogue(epilogue, grads, seed, None)
        g = results.pop(0) if self._forms[0] else None
        if g is None and bound._product_gradient is not None:
            g = grads[bound._product_gradient]
        gradients = {}
        if bound._lowrank is not None:
            g_lowrank = results.pop(0) if self._forms[1] else None
            if g_lowrank is None and bound._lowrank_gradient is not None:
                g_lowrank = grads[bound._lowrank_gradient]
            x_grad = _lowrank_gradients(bound, tensors, needs, g_lowrank, gradients)
        else:
            x_grad = None
        if bound._hidden is not None:
            _hidden_gradients(bound, tensors, needs, g, statistics, gradients, self._traced)
        elif needs[bound._a] or needs[bound._b]:
            a, b = tensors[bound._a], tensors[bound._b]
            # In the operands' dtype (promoted), as autograd casts g back for F.linear's: bf16
            # operands take bf16 GEMMs (cuBLAS, fp32 accumulation) under an fp32 bias too.
            dtype = torch.promote_types(a.dtype, b.dtype)
            g_2d, a_2d, b = _rows_of(g)[0].to(dtype), _rows_of(a)[0].to(dtype), b.to(dtype)
            if needs[bound._a]:
                grad = g_2d @ b if bound._transposed else g_2d @ b.mT
                if x_grad is not None:  # the low-rank product's share
                    grad += x_grad
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


def _lowrank_gradients(bound: _BoundGemm, tensors, needs, g_lowrank, gradients: dict) -> torch.Tensor | None:
    """down's and up's gradients into `gradients`, from the low-rank product's gradient; returns
    its share of a's ([M, K], None where a's is not wanted). Its inner product [M, R] is formed
    again here (an M·K·R matmul), not kept by the forward."""
    r, a, down, up = bound._lowrank, tensors[bound._a], tensors[bound._down], tensors[bound._up]
    wanted = needs[bound._a], needs[bound._down], needs[bound._up]
    if not any(wanted):
        return None
    dtype = functools.reduce(torch.promote_types, (a.dtype, down.dtype, up.dtype))
    a_2d = _rows_of(a)[0].to(dtype)
    down_kr = (down.mT if r.down_transposed else down).to(dtype)  # [K, R]
    up_rn = (up.mT if r.up_transposed else up).to(dtype)  # [R, N]
    g_2d = _rows_of(g_lowrank)[0].to(dtype)
    # Each gradient formed in its operand's own layout ([N, R] under T, else [R, N]): contiguous.
    if wanted[2]:
        inner = a_2d @ down_kr  # [M, R]
        grad = g_2d.mT @ inner if r.up_transposed else inner.mT @ g_2d
        gradients[bound._up] = grad.to(up.dtype)
    if not (wanted[0] or wanted[1]):
        return None
    g_inner = g_2d @ up_rn.mT  # [M, R]
    if wanted[1]:
        grad = g_inner.mT @ a_2d if r.down_transposed else a_2d.mT @ g_inner
        gradients[bound._down] = grad.to(down.dtype)
    return g_inner @ down_kr.mT if wanted[0] else None


def _hidden_gradients(bound: _BoundGemm, tensors, needs, g, kept, gradients: dict, traced: bool = False) -> None:
    """With a hidden layer, its gradients and the matmul's into `gradients`, from g (the
    product's gradient) and what the forward kept (`kept`: [..., k], its values and partials in
    its last H-wide columns): b's is gᵀ hidden; the layer's, dh = g @ bᵀ times each input's
    partial, summed over rows for its [H] inputs; then a's and the weight's are matmuls of
    g_h = dh times the product's partial. The matmuls of the operands in their dtype, as
    autograd's; dh, [M, H] (H, N small), in the compute dtype, so that the products and sums
    after it round once (gemm_lib.hidden_gradient_kernel)."""
    h, a, b, weight = bound._hidden, tensors[bound._a], tensors[bound._b], tensors[bound._weight]
    width = weight.shape[0] if h.transposed else weight.shape[1]
    dtype = functools.reduce(torch.promote_types, (a.dtype, b.dtype, weight.dtype))
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    kept = _rows_of(kept)[0]
    first = kept.shape[-1] - bound._hidden_values * width  # the values' first column
    values = [kept[:, first + j * width:first + (j + 1) * width] for j in range(bound._hidden_values)]
    hidden, partials = values[0].to(dtype), values[1:]
    layer = [needs[k] for k in bound._layer_inputs]
    if not (needs[bound._b] or needs[bound._a] or needs[bound._weight] or any(layer)):
        return  # only the epilogue's own inputs' gradients: the g kernel's
    g_2d = _rows_of(g)[0]
    if needs[bound._b]:  # in b's own layout: [N, H] under T, else [H, N], in the operands' dtype
        g_low = g_2d.to(dtype)
        grad = g_low.mT @ hidden if bound._transposed else hidden.mT @ g_low
        gradients[bound._b] = grad.to(b.dtype)
    wants_g_h = needs[bound._a] or needs[bound._weight]
    if not (wants_g_h or any(layer)):
        return
    g_wide, b_wide = g_2d.to(compute), b.to(compute)  # g as the g kernel wrote it, not rounded again
    dh = g_wide @ b_wide if bound._transposed else g_wide @ b_wide.mT  # [M, H]
    if g_2d.shape[-1] == 0:  # no product columns: no forward ran to keep the layer's values, nor needs to
        partials = [torch.zeros_like(dh) for _ in partials]
    partial_of, g_h = bound._hidden_partials, None
    for k, partial in enumerate(partials):  # each partial once: g_h and the sums of the inputs sharing it
        summed = [i for i, wanted, j in zip(bound._layer_inputs, layer, partial_of[1:]) if wanted and j == k]
        write = wants_g_h and k == partial_of[0]
        if write or summed:
            product, sums = _layer_step(dh, partial, dtype, write, bool(summed), traced)
            g_h = product if write else g_h
            for i in summed:
                gradients[i] = sums.to(tensors[i].dtype)
    if needs[bound._a]:
        grad = g_h @ weight.to(dtype) if h.transposed else g_h @ weight.to(dtype).mT
        gradients[bound._a] = grad.reshape(a.shape).to(a.dtype)
    if needs[bound._weight]:
        a_2d = _rows_of(a)[0].to(dtype)
        grad = g_h.mT @ a_2d if h.transposed else a_2d.mT @ g_h
        gradients[bound._weight] = grad.to(weight.dtype)


_LAYER_ROWS = 256  # rows a program of hidden_gradient_kernel sums


def _layer_step(dh: torch.Tensor, partial: torch.Tensor, dtype: torch.dtype, write: bool, sums: bool,
                traced: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dh × partial in `dtype` where `write`, its column sums where `sums`): one pass of
    gemm_lib.hidden_gradient_kernel (recorded by wrap_triton in a traced graph), its programs'
    sums added by torch, in a fixed order."""
    m, width = dh.shape
    programs = max(1, tuning.cdiv(m, _LAYER_ROWS))
    block_h = max(gemm_tuning.SMALLEST, triton.next_power_of_2(width))
    g = torch.empty((m, width), dtype=dtype, device=dh.device) if write else dh
    column_sums = torch.empty((programs, width), dtype=dh.dtype, device=dh.device) if sums else dh
    if m and (traced or _has_data(dh)):
        kernel = gemm_lib.hidden_gradient_kernel
        if traced:
            from torch.library import wrap_triton

            kernel = wrap_triton(kernel)
        kernel[(programs,)](
            dh, partial, partial.stride(0), g, column_sums, m, width, WRITE_G=write, SUMS=sums, ROWS=_LAYER_ROWS,
            BLOCK_M=max(1, 4096 // block_h), BLOCK_H=block_h)
    elif sums and _has_data(dh):
        column_sums.zero_()
    return (g if write else None), (column_sums.sum(0) if sums else None)


def _has_data(t: torch.Tensor) -> bool:
    """Not a meta tensor nor a FakeTensor (shapes only: nothing to launch on)."""
    return t.device.type != "meta" and not is_fake(t)


def _product_of(kept: torch.Tensor, n: int) -> torch.Tensor:
    """The product's [..., N] columns of what a forward with a hidden layer keeps (its first)."""
    return kept[..., :n]


def _strides_kn(t: torch.Tensor, transposed: bool) -> tuple[int, int]:
    """A matmul's right operand's strides as [K, N] (its transpose's, stored [N, K] under T)."""
    return (t.stride(1), t.stride(0)) if transposed else (t.stride(0), t.stride(1))


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
