"""The text of an op's two Triton kernels, and of straight-line bodies for any printer:
the kernels' arguments in the order fusegen.backends.triton.launch passes them, their loads,
bodies, stores and gradient reductions, as lists of lines for the template."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from fusegen.body_text import statements
from fusegen.plan import GradientPlan, InputPlan, KernelPlan, OpPlan

from .naming import InputNames, TritonNames
from .printer import COMPUTE_DTYPE, TritonPrinter

_TO_COMPUTE = f".to({COMPUTE_DTYPE})"


@dataclass
class KernelText:
    name: str
    key: str
    arguments: list[str]
    prologue: list[str] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)
    dropout_lines: list[str] = field(default_factory=list)
    plain_lines: list[str] = field(default_factory=list)
    stores: list[str] = field(default_factory=list)
    accumulators: list[str] = field(default_factory=list)
    epilogue: list[str] = field(default_factory=list)


def forward_kernel(plan: OpPlan, names: TritonNames, printer: TritonPrinter) -> KernelText:
    kernel = plan.forward
    arguments = [input_argument(i, names) for i in kernel.inputs]
    arguments += [f"{out}_ptr,  # {name}, contiguous [M, N]" for (name, _), out in zip(plan.outputs, kernel.outputs)]
    arguments.append("M, N,  # rows (all leading dims) and columns (the last dim)")
    arguments.append("M_BUCKET,  # M rounded up to a power of two: what tuning keys on")
    arguments += shared_arguments(plan, kernel, names, forward=True)
    arguments += ["BLOCK_M: tl.constexpr,", "BLOCK_N: tl.constexpr,"]
    tensors = {v.local for i in kernel.inputs for v in i.values} | {m.local for m in kernel.masks}
    result = KernelText(
        name=f"{plan.op}_kernel",
        key=kernel_key(plan, backward=False),
        arguments=arguments,
        prologue=scalars_in_compute_type(plan, kernel, names),
        loads=[line for i in kernel.inputs for line in input_loads(i, names.inputs[i.name])],
        stores=[
            f"tl.store({out}_ptr + rows[:, None] * N + cols[None, :], {out}.to({out}_ptr.dtype.element_ty), mask=in_bounds)"
            for out in kernel.outputs
        ],
    )
    if kernel.body_no_dropout is not None:
        result.dropout_lines = ["seed = tl.load(seed_ptr)"] + _mask_lines(plan, names)
        result.dropout_lines += statements(kernel.body, printer, triton_constant, tensors)
        result.plain_lines = statements(kernel.body_no_dropout, printer, triton_constant, tensors)
    else:
        result.plain_lines = statements(kernel.body, printer, triton_constant, tensors)
    return result


def backward_kernel(plan: OpPlan, names: TritonNames, printer: TritonPrinter) -> KernelText:
    kernel = plan.backward
    arguments = [input_argument(i, names) for i in kernel.inputs]
    for (output, _), incoming in zip(plan.outputs, kernel.incoming):
        n = names.incoming[incoming]
        arguments.append(f"{n.pointer}, {n.stride_m}, {n.stride_n},  # incoming gradient of {output}")
    for gradient in kernel.gradients:
        name, width = gradient.input.name, width_text(gradient.input)
        pointer, sums = names.gradient_pointer[name], names.sums[name]
        more = "; or row sums [column tiles, M]" if gradient.one_per_row else ""
        arguments.append(f"{pointer},  # gradient of {name}: [M, {width}]; with {sums}, column sums [programs, {width}]{more}")
    arguments.append("M, N, M_BUCKET,")
    arguments += shared_arguments(plan, kernel, names, forward=False)
    for gradient in kernel.gradients:
        name = gradient.input.name
        arguments += [f"{names.needs[name]}: tl.constexpr,", f"{names.sums[name]}: tl.constexpr,  # {name} is broadcast along rows"]
        if gradient.one_per_row:
            arguments.append(f"{names.column_sums[name]}: tl.constexpr,  # {name} is broadcast along columns")
    arguments += [
        "ROWS_PER_PROGRAM: tl.constexpr,  # a multiple of BLOCK_M; fixed before launch: it sizes the sums",
        "BLOCK_M: tl.constexpr,",
        "BLOCK_N: tl.constexpr,",
    ]
    tensors = {v.local for i in kernel.inputs for v in i.values} | {m.local for m in kernel.masks}
    tensors |= set(kernel.incoming)
    prologue = scalars_in_compute_type(plan, kernel, names)
    if kernel.body_no_dropout is not None:
        prologue += ["if HAS_DROPOUT:", "    seed = tl.load(seed_ptr)"]
    loads = [line for i in kernel.inputs for line in input_loads(i, names.inputs[i.name])]
    for incoming in kernel.incoming:
        n = names.incoming[incoming]
        loads += [
            f"{incoming} = tl.load({n.pointer} + rows[:, None] * {n.stride_m} + cols[None, :] * {n.stride_n}, mask=in_bounds)",
            f"{incoming} = {incoming}{_TO_COMPUTE}",
        ]
    result = KernelText(
        name=f"{plan.op}_backward_kernel",
        key=kernel_key(plan, backward=True),
        arguments=arguments,
        prologue=prologue,
        loads=loads,
        accumulators=[
            f"{names.accumulator[v]} = tl.zeros((BLOCK_M, BLOCK_N), {COMPUTE_DTYPE})"
            for g in kernel.gradients for v in g.values
        ],
        stores=[line for g in kernel.gradients for line in gradient_stores(g, names)],
        epilogue=[line for g in kernel.gradients for line in gradient_sums(g, names)],
    )
    if kernel.body_no_dropout is not None:
        result.dropout_lines = _mask_lines(plan, names) + statements(kernel.body, printer, triton_constant, tensors)
        result.plain_lines = statements(kernel.body_no_dropout, printer, triton_constant, tensors)
    else:
        result.plain_lines = statements(kernel.body, printer, triton_constant, tensors)
    return result


def with_argument_comments(kernel: KernelText) -> KernelText:
    """A kernel argument whose comment does not fit beside it gets the comment above it."""
    lines = []
    for line in kernel.arguments:
        code, _, comment = line.partition("  # ")
        if comment and len(line) + 4 > 100:
            lines += [f"# {part}" for part in textwrap.wrap(comment, width=92)] + [code]
        else:
            lines.append(line)
    kernel.arguments = lines
    return kernel


def kernel_key(plan: OpPlan, backward: bool) -> str:
    """The autotuner's key: what a tuned config is kept for."""
    key = ["M_BUCKET", "N"] + (["HAS_DROPOUT"] if plan.has_dropout else []) + (["ROWS_PER_PROGRAM"] if backward else [])
    return "[" + ", ".join(f'"{k}"' for k in key) + "]"


def shared_arguments(plan: OpPlan, kernel: KernelPlan, names: TritonNames, forward: bool) -> list[str]:
    """Params, dropout and the flags: in the order fusegen.backends.triton.launch passes them."""
    # A float param as fp64 (Triton would pass a Python float as fp32): an fp64 kernel keeps
    # every bit, an fp32 one rounds it on entry as the launch did.
    arguments = [f"{p.local}: tl.float64," if p.declaration.kind == "float" else f"{p.local}," for p in kernel.scalars]
    for p in plan.params:
        if p.dropout_p:
            comment = f"  # {p.name} as a 24-bit keep threshold, and 1 / (1 - {p.name})" if forward else ""
            arguments.append(f"{names.threshold[p.name]}, {names.scale[p.name]}: tl.float64,{comment}")
    if plan.has_dropout:
        arguments.append(
            "seed_ptr,  # one int64 on the device: the Philox key of the dropout masks" if forward
            else "seed_ptr,  # the forward's seed: its dropout masks are drawn again, bit for bit"
        )
        arguments.append("shard_ptr,  # with SHARDED: where this shard sits in the global problem")
    arguments += [f"{names.constexprs[p.name]}: tl.constexpr,  # {p.name}" for p in kernel.choices]
    if plan.has_dropout:
        arguments += [
            "HAS_DROPOUT: tl.constexpr,  # training and p > 0; otherwise no random numbers at all",
            "DROPOUT_WHOLE_GROUPS: tl.constexpr,  # N % 4 == 0: rows hold whole groups of four dropout words",
            "SHARDED: tl.constexpr,  # a DTensor's shard: masks keyed by the global flat index",
        ]
    arguments += ["INDEX_64: tl.constexpr,  # some offset reaches 2**31", "COMPUTE_FP64: tl.constexpr,"]
    return arguments


def input_argument(i: InputPlan, names: TritonNames) -> str:
    n = names.inputs[i.name]
    return f"{n.pointer}, {n.stride_m}, {n.stride_n},  # {i.name} {i.layout.declared}, as [M, {width_text(i)}]"


def width_text(i: InputPlan) -> str:
    chunks = i.layout.chunks
    return "N" if chunks == 1 else f"{chunks} * N"


def column_offset(chunk: int) -> str:
    """Where chunk k of an input's row starts: chunk k of x [..., kN] is at cols + k * N."""
    if chunk == 0:
        return "cols[None, :]"
    return f"(cols[None, :] + {'' if chunk == 1 else f'{chunk} * '}N)"


def input_loads(i: InputPlan, n: InputNames) -> list[str]:
    lines = []
    for value in i.values:
        lines += [
            f"{value.local} = tl.load({n.pointer} + rows[:, None] * {n.stride_m} + {column_offset(value.chunk)} * {n.stride_n}, "
            "mask=in_bounds)",
            f"{value.local} = {value.local}{_TO_COMPUTE}",
        ]
    return lines


def scalars_in_compute_type(plan: OpPlan, kernel: KernelPlan, names: TritonNames) -> list[str]:
    scalars = [p.local for p in kernel.scalars] + [names.scale[p.name] for p in plan.params if p.dropout_p]
    if not scalars:
        return []
    return ["# Scalar params in the compute type: a float is passed as fp64, an int as an int."] + [
        f"{name} = tl.full((), {name}, {COMPUTE_DTYPE})" for name in scalars
    ]


def _mask_lines(plan: OpPlan, names: TritonNames) -> list[str]:
    return [
        f"{m.local} = dropout_mask(seed, rows, tl.program_id(1) * BLOCK_N, N, BLOCK_N, {m.stream}, "
        f"{names.threshold[m.p.name]}, {names.scale[m.p.name]}, DROPOUT_WHOLE_GROUPS, shard_ptr, SHARDED)"
        for m in plan.masks
    ]


def gradient_stores(gradient: GradientPlan, names: TritonNames) -> list[str]:
    name = gradient.input.name
    pointer, width = names.gradient_pointer[name], width_text(gradient.input)
    lines = [f"if {names.needs[name]}:", f"    if {names.sums[name]}:"]
    lines += [f"        {names.accumulator[v]} += tl.where(in_bounds, {v}, 0.0)" for v in gradient.values]
    if gradient.one_per_row:
        lines += [
            f"    elif {names.column_sums[name]}:",
            "        # This column tile's part of each row's sum: [column tiles, M], summed after.",
            f"        tl.store({pointer} + tl.program_id(1) * M + rows, "
            f"tl.sum(tl.where(in_bounds, {gradient.values[0]}, 0.0), axis=1), mask=rows < M)",
        ]
    lines.append("    else:")
    lines += [
        f"        tl.store({pointer} + rows[:, None] * {width} + {column_offset(k)}, {v}.to({pointer}.dtype.element_ty), "
        "mask=in_bounds)"
        for k, v in enumerate(gradient.values)
    ]
    return lines


def gradient_sums(gradient: GradientPlan, names: TritonNames) -> list[str]:
    name = gradient.input.name
    pointer, width = names.gradient_pointer[name], width_text(gradient.input)
    lines = [f"if {names.needs[name]} and {names.sums[name]}:", "    # One reduction across rows per program, after the loop."]
    for k, v in enumerate(gradient.values):
        column = "cols" if k == 0 else f"cols + {'' if k == 1 else f'{k} * '}N"
        lines.append(
            f"    tl.store({pointer} + tl.program_id(0) * {width} + {column}, tl.sum({names.accumulator[v]}, axis=0), "
            "mask=cols < N)"
        )
    return lines


def kernel_lines(kernel: KernelText) -> list[str]:
    return [*kernel.prologue, *kernel.loads, *kernel.dropout_lines, *kernel.plain_lines, *kernel.stores, *kernel.epilogue]


def triton_constant(text: str) -> str:
    return f"tl.full((BLOCK_M, BLOCK_N), {text}, {COMPUTE_DTYPE})"


def torch_constant(text: str) -> str:
    return f"torch.full(problem.shape, {text}, dtype=problem.compute_dtype, device=problem.device)"
