"""The gemm kind's Triton forward kernel (fusegen.kinds.gemm): a program owns a [BLOCK_M,
BLOCK_N] tile of the product a @ b (gemm_lib.matmul_tile, fp32 accumulation), keeps it for
the backward where the backward reads it, and runs the epilogue (the pointwise forward body)
on it, loading the epilogue's inputs and writing the outputs once. Its backward kernel is the
pointwise one over the product as an input: it writes g (and a bias's sums); a's and b's
gradients are matmuls of g, the launcher's (gemm_launch.py)."""
from __future__ import annotations

from fusegen.body_text import statements
from fusegen.plan import OpPlan

from . import pointwise_kernel_text
from .kernel_text import (
    COMPUTE_LINE,
    KernelText,
    TritonKind,
    input_argument,
    input_loads,
    kernel_key,
    output_stores,
    scalars_in_compute_type,
    shared_arguments,
    triton_constant,
)
from .naming import BLOCK_K, BLOCK_M, BLOCK_N, FP64_PRODUCT, GROUP_M, INPUT_PRECISION, K, M, M_BUCKET, N, TritonNames
from .printer import COMPUTE_DTYPE, TritonPrinter


def forward_kernel(plan: OpPlan, names: TritonNames, printer: TritonPrinter) -> KernelText:
    kernel, m = plan.forward, plan.matmul
    (a_ptr, a_stride_m, a_stride_k), (b_ptr, b_stride_k, b_stride_n) = (names.operands[m.a.name],
                                                                        names.operands[m.b.name])
    b_layout = f"{m.b.name} {m.b.layout.declared}" + (", read as its transpose [K, N]" if m.transposed else "")
    product = m.product.local
    arguments = [f"{a_ptr}, {a_stride_m}, {a_stride_k},  # {m.a.name} {m.a.layout.declared}, as [M, K]",
                 f"{b_ptr}, {b_stride_k}, {b_stride_n},  # {b_layout}"]
    arguments += [input_argument(i, names) for i in kernel.inputs]
    arguments += [f"{names.output_pointer[name]},  # {name}, contiguous [M, N]" for name, _ in plan.outputs]
    saved = names.inputs[m.product.name].pointer
    if m.saved:
        arguments.append(f"{saved},  # the product, contiguous [M, N]: the backward forms g from it")
    arguments.append(f"{M}, {N}, {K},  # the product's rows (all leading dims), columns, and the dim summed over")
    arguments.append(f"{M_BUCKET},  # M rounded up to a power of two: what tuning keys on")
    arguments += shared_arguments(plan, kernel, names, forward=True)
    arguments += [f"{FP64_PRODUCT}: tl.constexpr,  # the fp64 compute dtype: the product in fp64 too",
                  f'{INPUT_PRECISION}: tl.constexpr,  # tl.dot\'s: "ieee" (fp32 as torch.mm), "tf32"',
                  f"{BLOCK_M}: tl.constexpr, {BLOCK_N}: tl.constexpr, {BLOCK_K}: tl.constexpr, {GROUP_M}: tl.constexpr,"]
    tensors = {v.local for i in kernel.inputs for v in i.values} | {product}
    lines = [
        COMPUTE_LINE,
        f"tile_m, tile_n = grouped_tile({M}, {N}, {BLOCK_M}, {BLOCK_N}, {GROUP_M})",
        f"rows, cols, {product} = matmul_tile(",
        f"    {a_ptr}, {a_stride_m}, {a_stride_k},",
        f"    {b_ptr}, {b_stride_k}, {b_stride_n},",
        f"    tile_m, tile_n, {M}, {N}, {K}, {BLOCK_M}, {BLOCK_N}, {BLOCK_K}, INDEX_64, {INPUT_PRECISION}, {FP64_PRODUCT},",
        ")",
        f"{product} = {product}.to({COMPUTE_DTYPE})",
        "in_bounds = (rows[:, None] < M) & (cols[None, :] < N)",
    ]
    if m.saved:
        lines.append(f"store_tile({saved}, {product}, rows, cols, N, in_bounds)")
    lines += scalars_in_compute_type(plan, kernel, names)
    lines += [line for i in kernel.inputs for line in input_loads(i, names.inputs[i.name])]
    tensors |= {m.local for m in kernel.masks}
    if kernel.body_no_dropout is not None:  # masks keyed by the product's flat index, as every kind's
        lines += pointwise_kernel_text.branches(
            ["seed = tl.load(seed_ptr)", *pointwise_kernel_text.mask_lines(plan, names, f"tile_n * {BLOCK_N}"),
             *statements(kernel.body, printer, triton_constant, tensors)],
            statements(kernel.body_no_dropout, printer, triton_constant, tensors),
        )
    else:
        lines += statements(kernel.body, printer, triton_constant, tensors)
    lines += output_stores(plan, kernel)
    # The operands' K strides too: a tile tuned for a row-major operand (stride 1 along K, as
    # nn.Linear's weight) is not the one for its transpose.
    layout = (K, a_stride_k, b_stride_k)
    return KernelText(f"{plan.op}_kernel", kernel_key(plan, backward=False, layout=layout), arguments, lines,
                      "gemm_tuning.FORWARD")


def _keywords(plan: OpPlan) -> tuple[str, ...]:
    m = plan.matmul
    product = f'product="{m.product.name}"'
    incoming = (f'product_gradient="{m.incoming}"',) if m.incoming else ()
    return (product, *incoming)


KIND = TritonKind(
    name="gemm",
    forward=forward_kernel,
    backward=pointwise_kernel_text.backward_kernel,
    binding="gemm_launch.GemmKernels",
    doc="The forward kernel multiplies in fp32 (fp64 for fp64 operands) on the tensor cores and runs the "
        "elementwise rest on each tile of the product before writing anything; the backward forms the product's "
        "gradient elementwise and the operands' by torch.matmul.",
    reserved=frozenset({K, BLOCK_K, GROUP_M, INPUT_PRECISION, FP64_PRODUCT, "tile_m", "tile_n", "gemm_launch",
                        "gemm_tuning"}),
    modules=("gemm_launch", "gemm_tuning", "tuning"),
    keywords=_keywords,
)
