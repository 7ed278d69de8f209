"""The pointwise kind's Triton kernels (fusegen.kinds.pointwise): a program owns a
[BLOCK_M, BLOCK_N] tile of the problem; the forward writes each output element from the
same elements of the inputs, the backward walks ROWS_PER_PROGRAM rows of one column tile,
writing each gradient or summing it over rows (a bias's) per program. With dropout, the
body with masks runs under HAS_DROPOUT and the one without otherwise."""
from __future__ import annotations

from fusegen.body_text import statements
from fusegen.plan import OpPlan

from .kernel_text import (
    COMPUTE_LINE,
    KernelText,
    backward_arguments,
    TritonKind,
    chunk_columns,
    gradient_stores,
    gradient_sums,
    incoming_values,
    indent,
    input_argument,
    input_loads,
    kernel_key,
    load_line,
    output_stores,
    output_width,
    scalars_in_compute_type,
    shared_arguments,
    triton_constant,
)
from .naming import BLOCK_M, BLOCK_N, M, M_BUCKET, N, ROWS_PER_PROGRAM, TritonNames
from .printer import COMPUTE_DTYPE, TritonPrinter


def forward_kernel(plan: OpPlan, names: TritonNames, printer: TritonPrinter) -> KernelText:
    kernel = plan.forward
    arguments = [input_argument(i, names) for i in kernel.inputs]
    arguments += [
        f"{names.output_pointer[name]},  # {name}, contiguous [M, {output_width(plan, name)}]" for name, _ in plan.outputs
    ]
    arguments.append(f"{M}, {N},  # rows (all leading dims) and columns (the last dim)")
    arguments.append(f"{M_BUCKET},  # M rounded up to a power of two: what tuning keys on")
    arguments += shared_arguments(plan, kernel, names, forward=True)
    arguments += [f"{BLOCK_M}: tl.constexpr,", f"{BLOCK_N}: tl.constexpr,"]
    tensors = {v.local for i in kernel.inputs for v in i.values} | {m.local for m in kernel.masks}
    lines = [
        COMPUTE_LINE,
        "rows = indices(tl.program_id(0) * BLOCK_M, BLOCK_M, INDEX_64)",
        "cols, in_bounds = column_tile(rows, tl.program_id(1) * BLOCK_N, M, N, BLOCK_N, INDEX_64)",
        *scalars_in_compute_type(plan, kernel, names),
        *[line for i in kernel.inputs for line in input_loads(i, names.inputs[i.name])],
    ]
    if kernel.body_no_dropout is not None:
        lines += branches(
            ["seed = tl.load(seed_ptr)", *mask_lines(plan, names), *statements(kernel.body, printer, triton_constant, tensors)],
            statements(kernel.body_no_dropout, printer, triton_constant, tensors),
        )
    else:
        lines += statements(kernel.body, printer, triton_constant, tensors)
    lines += output_stores(plan, kernel)
    return KernelText(f"{plan.op}_kernel", kernel_key(plan, backward=False), arguments, lines,
                      "tuning.FORWARD")


def backward_kernel(plan: OpPlan, names: TritonNames, printer: TritonPrinter) -> KernelText:
    kernel = plan.backward
    arguments = backward_arguments(plan, names, "column tiles, M", [])
    arguments += [
        f"{ROWS_PER_PROGRAM}: tl.constexpr,  # a multiple of BLOCK_M; fixed before launch: it sizes the sums",
        f"{BLOCK_M}: tl.constexpr,",
        f"{BLOCK_N}: tl.constexpr,",
    ]
    tensors = {v.local for i in kernel.inputs for v in i.values} | {m.local for m in kernel.masks}
    tensors |= {value for value, _, _ in incoming_values(plan, kernel)}
    lines = [
        COMPUTE_LINE,
        "cols = indices(tl.program_id(1) * BLOCK_N, BLOCK_N, INDEX_64)",
        "first_row = tl.program_id(0) * ROWS_PER_PROGRAM",
        "if INDEX_64:",
        "    first_row = first_row.to(tl.int64)",
        *[f"{names.accumulator[v]} = tl.zeros((BLOCK_M, BLOCK_N), {COMPUTE_DTYPE})" for g in kernel.gradients for v in g.values],
        *scalars_in_compute_type(plan, kernel, names),
    ]
    if kernel.body_no_dropout is not None:
        lines += ["if HAS_DROPOUT:", "    seed = tl.load(seed_ptr)"]
    row = [line for i in kernel.inputs for line in input_loads(i, names.inputs[i.name])]
    row += [
        load_line(value, names.incoming[incoming], chunk_columns(k)) for value, incoming, k in incoming_values(plan, kernel)
    ]
    if kernel.body_no_dropout is not None:
        row += branches(
            mask_lines(plan, names) + statements(kernel.body, printer, triton_constant, tensors),
            statements(kernel.body_no_dropout, printer, triton_constant, tensors),
        )
    else:
        row += statements(kernel.body, printer, triton_constant, tensors)
    row += [line for g in kernel.gradients for line in gradient_stores(g, names)]
    lines += [
        "for row_offset in range(0, ROWS_PER_PROGRAM, BLOCK_M):",
        "    rows = first_row + row_offset + tl.arange(0, BLOCK_M)",
        "    in_bounds = (rows[:, None] < M) & (cols[None, :] < N)",
        *indent(row),
        *[line for g in kernel.gradients for line in gradient_sums(g, names)],
    ]
    buffers = ", ".join(f'"{names.gradient_pointer[g.input.name]}"' for g in kernel.gradients if g.one_per_row)
    pre_hook = [
        "# Row sums land one row per column tile, and tile widths differ between configs: every",
        "# trial, and the launch after tuning, starts from zeros.",
        f"pre_hook=tuning.zero_before_trials({buffers}),",
    ] if buffers else []
    return KernelText(f"{plan.op}_backward_kernel", kernel_key(plan, backward=True), arguments, lines,
                      "tuning.BACKWARD", pre_hook)


def branches(dropout: list[str], plain: list[str]) -> list[str]:
    """The body with dropout's masks, and the one with no random numbers at all."""
    return ["if HAS_DROPOUT:", *indent(dropout), "else:", *indent(plain)]


def mask_lines(plan: OpPlan, names: TritonNames, first_col: str = "tl.program_id(1) * BLOCK_N",
               width: str = "BLOCK_N") -> list[str]:
    """Each dropout's mask over the tile whose first column is `first_col`, `width` columns wide."""
    return [
        f"{m.local} = dropout_mask(seed, rows, {first_col}, N, {width}, {m.stream}, "
        f"{names.threshold[m.p.name]}, {names.scale[m.p.name]}, DROPOUT_WHOLE_GROUPS, shard_ptr, SHARDED)"
        for m in plan.masks
    ]


KIND = TritonKind(
    name="pointwise",
    forward=forward_kernel,
    backward=backward_kernel,
    binding="launch.Kernels",
    doc="The Triton kernels load every input once, compute in fp32 (fp64 for fp64 inputs) and write every output "
        "once, in the dtype torch's type promotion gives.",
)
