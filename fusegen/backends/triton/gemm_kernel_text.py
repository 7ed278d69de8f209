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
from .naming import (A_K_MAJOR, B_K_MAJOR, BLOCK_H, BLOCK_K, BLOCK_M, BLOCK_N, BLOCK_R, FP64_PRODUCT, GROUP_M, HIDDEN, KEEP,
                     INPUT_PRECISION, K, M, M_BUCKET, N, PARTS, RANK, TMA, TritonNames)
from .printer import COMPUTE_DTYPE, TritonPrinter


KEEP_ARGUMENT = f"{KEEP}: tl.constexpr,  # write what the backward reads (off: no gradient follows this call)"


def forward_kernel(plan: OpPlan, names: TritonNames, printer: TritonPrinter) -> KernelText:
    if plan.matmul.hidden is not None:
        return _hidden_forward_kernel(plan, names, printer)
    kernel, m = plan.forward, plan.matmul
    (a_ptr, a_stride_m, a_stride_k), (b_ptr, b_stride_k, b_stride_n) = (names.operands[m.a.name],
                                                                        names.operands[m.b.name])
    width = "N" if m.b.layout.chunks == 1 else f"{m.b.layout.chunks}N"
    b_layout = f"{m.b.name} {m.b.layout.declared}" + (f", read as its transpose [K, {width}]" if m.transposed else "")
    arguments = [f"{a_ptr}, {a_stride_m}, {a_stride_k},  # {m.a.name} {m.a.layout.declared}, as [M, K]",
                 f"{b_ptr}, {b_stride_k}, {b_stride_n},  # {b_layout}"]
    lowrank = m.lowrank
    if lowrank is not None:
        for operand, transposed, read_as in ((lowrank.down, lowrank.down_transposed, "[K, R]"),
                                             (lowrank.up, lowrank.up_transposed, "[R, N]")):
            ptr, stride_k, stride_n = names.operands[operand.name]
            layout = f"{operand.name} {operand.layout.declared}" + (f", read as its transpose {read_as}" if transposed
                                                                    else "")
            arguments.append(f"{ptr}, {stride_k}, {stride_n},  # {layout}")
    arguments += [input_argument(i, names) for i in kernel.inputs]
    arguments += [f"{names.output_pointer[name]},  # {name}, contiguous [M, N]" for name, _ in plan.outputs]
    saved = names.inputs[m.product.name].pointer
    if m.saved:
        chunks = m.product.layout.chunks
        shape = "[M, N]" if chunks == 1 else f"[M, {chunks}N], its chunks side by side"
        arguments.append(f"{saved},  # the product, contiguous {shape}: the backward forms g from it")
    arguments.append(f"{M}, {N}, {K},  # the product's rows (all leading dims), columns, and the dim summed over")
    if lowrank is not None:
        arguments.append(f"{RANK},  # the low-rank product's inner dim")
    arguments.append(f"{M_BUCKET},  # M rounded up to a power of two: what tuning keys on")
    arguments += shared_arguments(plan, kernel, names, forward=True)
    arguments += [f"{FP64_PRODUCT}: tl.constexpr,  # the fp64 compute dtype: the product in fp64 too",
                  f'{INPUT_PRECISION}: tl.constexpr,  # tl.dot\'s: "ieee" (fp32 as torch.mm), "tf32"',
                  f"{TMA}: tl.constexpr,  # operands through tensor descriptors (gemm_lib.tma_layouts), tiles walked "
                  "persistently",
                  f"{A_K_MAJOR}: tl.constexpr, {B_K_MAJOR}: tl.constexpr,  # with TMA: which of each operand's strides is 1"]
    if lowrank is not None:
        arguments.append(f"{BLOCK_R}: tl.constexpr,  # R rounded up to a power of two, at least 16")
    if m.saved:
        arguments.append(KEEP_ARGUMENT)
    arguments += [f"{BLOCK_M}: tl.constexpr, {BLOCK_N}: tl.constexpr, {BLOCK_K}: tl.constexpr, {GROUP_M}: tl.constexpr,",
                  f"{PARTS}: tl.constexpr,  # the epilogue's parts of a tile's columns: 1, or 2 (halves)"]
    # The product's values: itself, or each of its chunks (b holding them: [2N, K] under T),
    # each formed by a mainloop of its own over its rows (columns) of b: a's tile is read once
    # a chunk (from L2 after the first); one loop with an accumulator a chunk would read it once.
    values = [v.local for v in m.product.values]
    chunked = len(values) > 1
    tensors = {v.local for i in kernel.inputs for v in i.values} | set(values)
    later = range(1, len(values))  # the chunks after the first: each its own start in b, its own descriptor
    b_of = [b_ptr, *(names.claim_once(f"{b_ptr} chunk {k}", f"{m.b.local}_chunk{k}_ptr") for k in later)]
    descriptors = ["b_desc"] if not chunked else [names.claim_once(f"b_desc {k}", f"b_desc{k}") for k in (0, *later)]
    lines = [
        COMPUTE_LINE,
        *scalars_in_compute_type(plan, kernel, names),  # before the loop: a loop's variables keep their type
        *(f"{b} = chunk_start({b_ptr}, {k}, {N}, {b_stride_n}, INDEX_64)" for k, b in enumerate(b_of) if k),
        f"if {TMA}:",
    ]
    lines += [
        f"    a_desc, {descriptors[0]} = tma_operands(",
        f"        {a_ptr}, {a_stride_m}, {a_stride_k}, {b_ptr}, {b_stride_k}, {b_stride_n},",
        f"        {M}, {N}, {K}, {BLOCK_M}, {BLOCK_N}, {BLOCK_K}, {A_K_MAJOR}, {B_K_MAJOR},",
        "    )",
    ]
    lines += [f"    {descriptor} = tma_b({b}, {b_stride_k}, {b_stride_n}, {N}, {K}, {BLOCK_N}, {BLOCK_K}, {B_K_MAJOR})"
              for descriptor, b in zip(descriptors[1:], b_of[1:])]
    if lowrank is not None:  # down [R, K] (the launcher takes TMA only so), read as b is: [K, R]
        down_ptr, _, down_stride_r = names.operands[lowrank.down.name]
        lines.append(f"    down_desc = tma_b({down_ptr}, 1, {down_stride_r}, {RANK}, {K}, {BLOCK_R}, {BLOCK_K}, True)")
    lines += [
        # One tile a program without TMA (as many programs as tiles); with it, as many programs as
        # SMs, each walking its tiles with the next tile's loads under this one's epilogue.
        f"tiles = tl.cdiv({M}, {BLOCK_M}) * tl.cdiv({N}, {BLOCK_N})",
        f"for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten={TMA}):",
    ]
    tiles_of = {value: names.claim_once(f"{value} tile", f"{value}_tile") for value in values}
    # With a low-rank product, the mainloop forms its inner product [BLOCK_M, R] from the same
    # tiles of a (there are no chunks then: ir refuses both).
    inner = names.claim_once("inner", "inner") if lowrank is not None else None
    down = ", ".join(names.operands[lowrank.down.name]) if lowrank is not None else None
    returned = lambda tile: f"rows, _, {tile}" + (f", {inner}" if inner else "")  # noqa: E731
    tma_loop, pointer_loop = ("matmul_lowrank_tile_tma", "matmul_lowrank_tile") if inner else ("matmul_tile_tma",
                                                                                              "matmul_tile")
    body = [f"tile_m, tile_n = tile_of(tile, {M}, {N}, {BLOCK_M}, {BLOCK_N}, {GROUP_M})", f"if {TMA}:"]
    for value, descriptor in zip(values, descriptors):
        body += [
            f"    {returned(tiles_of[value])} = {tma_loop}(",
            f"        a_desc, {descriptor},{' down_desc,' if inner else ''} tile_m, tile_n, {K},",
            f"        {BLOCK_M}, {BLOCK_N}, {BLOCK_K},{f' {BLOCK_R},' if inner else ''} INDEX_64, {INPUT_PRECISION}, "
            f"{A_K_MAJOR}, {B_K_MAJOR},",
            "    )",
        ]
    body.append("else:")
    for value, b in zip(values, b_of):
        body += [
            f"    {returned(tiles_of[value])} = {pointer_loop}(",
            f"        {a_ptr}, {a_stride_m}, {a_stride_k},",
            f"        {b}, {b_stride_k}, {b_stride_n},",
            *([f"        {down},"] if inner else []),
            f"        tile_m, tile_n, {M}, {N}, {K},{f' {RANK},' if inner else ''} {BLOCK_M}, {BLOCK_N}, {BLOCK_K},"
            f"{f' {BLOCK_R},' if inner else ''}",
            f"        INDEX_64, {INPUT_PRECISION}, {FP64_PRODUCT},",
            "    )",
        ]
    # The epilogue a part of the tile's columns at a time (PARTS 2: half its inputs' tiles and
    # temporaries live at once, as Triton's tutorial 09 subtiles it; the accumulator itself stays
    # live until its last part), each part's columns and values from the whole tile's.
    body.append(f"for part in tl.static_range({PARTS}):  # {PARTS} 2: the epilogue a half tile at a time")
    epilogue = [
        *(f"cols, {value} = column_part(tile_n, {tiles_of[value]}, part, {PARTS}, {BLOCK_N}, INDEX_64)"
          for value in values),
        *(f"{value} = {value}.to({COMPUTE_DTYPE})" for value in values),
    ]
    if lowrank is not None:  # the part's columns of the low-rank product: the inner product times up's
        value, output = lowrank.value.local, names.output_pointer[plan.outputs[0][0]]
        epilogue += [
            f"{value} = inner_matmul(",
            f"    {inner}, {', '.join(names.operands[lowrank.up.name])},",
            f"    cols, {N}, {RANK}, {BLOCK_R}, INDEX_64, {INPUT_PRECISION}, {FP64_PRODUCT},",
            f"    {output}.dtype.element_ty,  # the inner product rounded so, as torch's",
            f").to({COMPUTE_DTYPE})",
        ]
        tensors.add(value)
    epilogue.append("in_bounds = (rows[:, None] < M) & (cols[None, :] < N)")
    product_values = values[:len(m.product.values)]
    body += ["    " + line for line in _epilogue(plan, kernel, names, printer, epilogue, product_values, saved, tensors)]
    lines += ["    " + line for line in body]
    # The operands' K strides too: a tile tuned for a row-major operand (stride 1 along K, as
    # nn.Linear's weight) is not the one for its transpose; and the mainloop.
    layout = (K, a_stride_k, b_stride_k, TMA, *((RANK,) if lowrank else ()))
    # A tile holds an accumulator a chunk of the product (the low-rank product's a part at a time).
    space = "gemm_tuning.FORWARD" if len(values) == 1 else f"gemm_tuning.forward_space({len(values)})"
    return KernelText(f"{plan.op}_kernel", kernel_key(plan, backward=False, layout=layout), arguments, lines, space)


def _hidden_forward_kernel(plan: OpPlan, names: TritonNames, printer: TritonPrinter) -> KernelText:
    """A program a tile of the product hidden(a) @ b (an MLP's two layers): the hidden layer's
    [BLOCK_M, H] product over all of K (gemm_lib.matmul_tile with the whole layer one tile), its
    function and partial derivatives, then its values (rounded to the outputs' dtype, as torch
    rounds a layer's output) times b's [H, BLOCK_N] columns, then the epilogue. The tiles of one
    row block each form the hidden layer again (N / BLOCK_N times); the first keeps its values
    and partials for the backward. The pointer mainloop only: K may be small and unaligned (a
    DLRM's 13 dense features), which TMA cannot read."""
    kernel, m, h = plan.forward, plan.matmul, plan.matmul.hidden
    (a_ptr, a_stride_m, a_stride_k), (b_ptr, b_stride_k, b_stride_n), (w_ptr, w_stride_k, w_stride_n) = (
        names.operands[m.a.name], names.operands[m.b.name], names.operands[h.weight.name])
    declared = lambda i, t, as_: f"{i.name} {i.layout.declared}" + (f", read as its transpose {as_}" if t else "")  # noqa: E731
    arguments = [f"{a_ptr}, {a_stride_m}, {a_stride_k},  # {m.a.name} {m.a.layout.declared}, as [M, K]",
                 f"{w_ptr}, {w_stride_k}, {w_stride_n},  # {declared(h.weight, h.transposed, '[K, H]')}",
                 *(f"{names.inputs[i.name].pointer}, {names.inputs[i.name].stride_n},  # {i.name} [H]" for i in h.inputs),
                 f"{b_ptr}, {b_stride_k}, {b_stride_n},  # {declared(m.b, m.transposed, '[H, N]')}"]
    arguments += [input_argument(i, names) for i in kernel.inputs]
    arguments += [f"{names.output_pointer[name]},  # {name}, contiguous [M, N]" for name, _ in plan.outputs]
    saved = names.inputs[m.product.name].pointer
    kept = ["the product"] * m.saved + ["the hidden values"] + [f"partial {k}" for k in range(len(h.partials))]
    arguments.append(f"{saved},  # for the backward, contiguous [M, {_saved_width(m)}]: {', '.join(kept)}")
    arguments += [f"{M}, {N}, {K},  # the product's rows (all leading dims), columns, and the first layer's dim summed over",
                  f"{HIDDEN},  # the hidden layer's width",
                  f"{M_BUCKET},  # M rounded up to a power of two: what tuning keys on"]
    arguments += shared_arguments(plan, kernel, names, forward=True)
    arguments += [f"{FP64_PRODUCT}: tl.constexpr,  # the fp64 compute dtype: the products in fp64 too",
                  f'{INPUT_PRECISION}: tl.constexpr,  # tl.dot\'s: "ieee" (fp32 as torch.mm), "tf32"',
                  f"{BLOCK_H}: tl.constexpr,  # H rounded up to a power of two, at least 16",
                  KEEP_ARGUMENT,
                  f"{BLOCK_M}: tl.constexpr, {BLOCK_N}: tl.constexpr, {BLOCK_K}: tl.constexpr, {GROUP_M}: tl.constexpr,",
                  f"{PARTS}: tl.constexpr,  # the epilogue's parts of a tile's columns: 1, or 2 (halves)"]
    hidden_cols, in_hidden = names.claim_once("hidden cols", "hidden_cols"), names.claim_once("in hidden", "in_hidden")
    width = names.claim_once("saved width", "saved_width")
    tile = names.claim_once("product tile", f"{m.product.local}_tile")
    tensors = {v.local for i in kernel.inputs for v in i.values} | {m.product.local, h.product, *(i.local for i in h.inputs)}
    output = names.output_pointer[plan.outputs[0][0]]
    lines = [
        COMPUTE_LINE,
        *scalars_in_compute_type(plan, kernel, names),
        f"tile_m, tile_n = tile_of(tl.program_id(0), {M}, {N}, {BLOCK_M}, {BLOCK_N}, {GROUP_M})",
        f"rows, {hidden_cols}, {h.product} = matmul_tile(",
        f"    {a_ptr}, {a_stride_m}, {a_stride_k},",
        f"    {w_ptr}, {w_stride_k}, {w_stride_n},",
        f"    tile_m, 0, {M}, {HIDDEN}, {K}, {BLOCK_M}, {BLOCK_H}, {BLOCK_K},",
        f"    INDEX_64, {INPUT_PRECISION}, {FP64_PRODUCT},",
        ")",
        f"{h.product} = {h.product}.to({COMPUTE_DTYPE})",
        f"{in_hidden} = (rows[:, None] < {M}) & ({hidden_cols}[None, :] < {HIDDEN})",
        *(f"{i.local} = load_tile({names.inputs[i.name].pointer}, 0, {names.inputs[i.name].stride_n}, rows, "
          f"{hidden_cols}, {in_hidden}, {COMPUTE_DTYPE})" for i in h.inputs),
        *statements(h.body, printer, triton_constant, tensors),
        f"{width} = {_saved_width(m)}",
        f"if {KEEP}:",
        "    if tile_n == 0:  # one tile of the row block keeps its hidden values and partials",
        *(f"        store_tile({saved}, {value}, rows, {' + '.join([hidden_cols, *_offset(m.saved, k)])}, {width}, "
          f"{in_hidden})" for k, value in enumerate((h.value, *h.partials))),
        f"{tile} = inner_matmul(",
        f"    {h.value}, {b_ptr}, {b_stride_k}, {b_stride_n},",
        f"    indices(tile_n * {BLOCK_N}, {BLOCK_N}, INDEX_64), {N}, {HIDDEN}, {BLOCK_H},",
        f"    INDEX_64, {INPUT_PRECISION}, {FP64_PRODUCT},",
        f"    {output}.dtype.element_ty,  # the hidden values rounded so, as torch's",
        ")",
        f"for part in tl.static_range({PARTS}):  # {PARTS} 2: the epilogue a half tile at a time",
    ]
    epilogue = [f"cols, {m.product.local} = column_part(tile_n, {tile}, part, {PARTS}, {BLOCK_N}, INDEX_64)",
                f"{m.product.local} = {m.product.local}.to({COMPUTE_DTYPE})",
                "in_bounds = (rows[:, None] < M) & (cols[None, :] < N)"]
    lines += ["    " + line for line in _epilogue(plan, kernel, names, printer, epilogue, [m.product.local], saved,
                                                   tensors, width)]
    layout = (K, a_stride_k, w_stride_k, b_stride_k, HIDDEN)
    return KernelText(f"{plan.op}_kernel", kernel_key(plan, backward=False, layout=layout), arguments, lines,
                      "gemm_tuning.HIDDEN_FORWARD")


def _offset(saved: bool, k: int) -> list[str]:
    """Where the k-th of a hidden layer's kept values starts in a row: past the product (if
    kept) and k H-wide values."""
    return [N] * saved + ([HIDDEN] if k == 1 else [f"{k} * {HIDDEN}"] if k else [])


def _saved_width(m) -> str:
    """The row width of what a forward with a hidden layer keeps: the product's N columns where
    the backward reads it, then H each for the hidden values and each partial."""
    return " + ".join([N] * m.saved + [f"{1 + len(m.hidden.partials)} * {HIDDEN}"])


def _epilogue(plan, kernel, names, printer, lines, values, saved, tensors, width: str | None = None) -> list[str]:
    """The loop's body: the mainloop's `lines`, then the epilogue on the product's tile (its
    chunks': `values`); `width`: the saved buffer's row width (N a chunk, else)."""
    m = plan.matmul
    if m.saved:  # all chunks side by side: [M, 2N]
        width = width or ("N" if len(values) == 1 else f"{len(values)} * N")
        lines.append(f"if {KEEP}:")
        for k, value in enumerate(values):
            cols = "cols" if k == 0 else "cols + N" if k == 1 else f"cols + {k} * N"
            lines.append(f"    store_tile({saved}, {value}, rows, {cols}, {width}, in_bounds)")
    lines += [line for i in kernel.inputs for line in input_loads(i, names.inputs[i.name])]
    tensors |= {m.local for m in kernel.masks}
    if kernel.body_no_dropout is not None:  # masks keyed by the product's flat index, as every kind's
        first_col, width = f"tile_n * {BLOCK_N} + part * ({BLOCK_N} // {PARTS})", f"{BLOCK_N} // {PARTS}"
        lines += pointwise_kernel_text.branches(
            ["seed = tl.load(seed_ptr)", *pointwise_kernel_text.mask_lines(plan, names, first_col, width),
             *statements(kernel.body, printer, triton_constant, tensors)],
            statements(kernel.body_no_dropout, printer, triton_constant, tensors),
        )
    else:
        lines += statements(kernel.body, printer, triton_constant, tensors)
    lines += output_stores(plan, kernel)
    return lines


def _keywords(plan: OpPlan) -> tuple[str, ...]:
    m = plan.matmul
    product = f'product="{m.product.name}"'
    incoming = (f'product_gradient="{m.incoming}"',) if m.incoming else ()
    lowrank = ()
    if m.lowrank is not None:
        lowrank = (f'lowrank="{m.lowrank.value.name}"',
                   *((f'lowrank_gradient="{m.lowrank.incoming}"',) if m.lowrank.incoming else ()))
    hidden = (f"hidden_partials={tuple(m.hidden.partial_of)}",) if m.hidden is not None else ()
    return (product, *incoming, *lowrank, *hidden)


KIND = TritonKind(
    name="gemm",
    forward=forward_kernel,
    backward=pointwise_kernel_text.backward_kernel,
    binding="gemm_launch.GemmKernels",
    doc="The forward kernel multiplies in fp32 (fp64 for fp64 operands) on the tensor cores and runs the "
        "elementwise rest on each tile of the product before writing anything; the backward forms the product's "
        "gradient elementwise and the operands' by torch.matmul.",
    reserved=frozenset({K, BLOCK_K, GROUP_M, INPUT_PRECISION, FP64_PRODUCT, TMA, A_K_MAJOR, B_K_MAJOR, RANK, BLOCK_R, HIDDEN,
                        BLOCK_H, KEEP, "tile_m",
                        "tile_n", "tiles", "tile", "part", PARTS, "a_desc", "b_desc", "down_desc", "gemm_launch",
                        "gemm_tuning"}),
    modules=("gemm_launch", "gemm_tuning", "tuning"),
    keywords=_keywords,
)
