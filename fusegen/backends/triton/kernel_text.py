"""What every kind's Triton kernels are made of: the kernels' arguments (named as naming.py
names them, which is how fusegen.backends.triton.launch passes them), their loads, stores and gradient reductions, as
lists of lines; `KernelText`, one kernel as the template takes it, and `TritonKind`, what a
kind registers (kinds.py)."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Callable

from fusegen.plan import GradientPlan, InputPlan, KernelPlan, OpPlan

from .naming import (
    COMPUTE_FP64,
    DROPOUT_WHOLE_GROUPS,
    HAS_DROPOUT,
    INDEX_64,
    M,
    M_BUCKET,
    N,
    SEED,
    SHARD,
    SHARDED,
    InputNames,
    TritonNames,
)
from .printer import COMPUTE_DTYPE, TritonPrinter

# A kernel's first line: the type it computes in, named once.
COMPUTE_LINE = f"{COMPUTE_DTYPE} = tl.float64 if COMPUTE_FP64 else tl.float32"


@dataclass
class KernelText:
    """One kernel as the template lays it out: its autotuner (the kind's tuning space, and a
    `pre_hook` where a kind needs one), signature and body."""

    name: str
    key: str
    arguments: list[str]
    lines: list[str]
    space: str  # the kernel's tuning.Space, as the module names it
    pre_hook: list[str] = field(default_factory=list)  # the autotuner's pre_hook argument, with its comment

    @property
    def autotune_on_one_line(self) -> bool:
        """Whether `@tuning.autotune(space, key=...)` fits in 100 columns (else an argument a line)."""
        return not self.pre_hook and len(f"@tuning.autotune({self.space}, key={self.key})") <= 100


@dataclass(frozen=True)
class TritonKind:
    """A kernel kind as the Triton backend renders it (registered in kinds.py under the
    kind's name, fusegen.kinds): its two kernels' text, the launcher class the module
    declares them with (its binding: argument lists and grids; launch.py's for pointwise),
    the module docstring's words on the kernels, and the names its kernels use for
    themselves (no spec-derived name takes them)."""

    name: str
    forward: Callable[[OpPlan, TritonNames, TritonPrinter], KernelText]
    backward: Callable[[OpPlan, TritonNames, TritonPrinter], KernelText]
    binding: str
    doc: str
    reserved: frozenset[str] = frozenset()
    # The backend's modules the generated module imports (its binding's and tuning spaces').
    modules: tuple[str, ...] = ("launch", "tuning")
    # Its binding's own keywords in the module's declaration ("name=value"), from the plan.
    keywords: Callable[[OpPlan], tuple[str, ...]] = lambda plan: ()


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


def kernel_key(plan: OpPlan, backward: bool, layout: tuple[str, ...] = ()) -> str:
    """The autotuner's key: what a tuned config is kept for (`layout`: a kind's arguments that
    change the program's shape, which a config tuned for another would not fit)."""
    key = ["M_BUCKET", "N", *layout] + (["HAS_DROPOUT"] if plan.has_dropout else []) + (
        ["ROWS_PER_PROGRAM"] if backward else [])
    return "[" + ", ".join(f'"{k}"' for k in key) + "]"


def shared_arguments(plan: OpPlan, kernel: KernelPlan, names: TritonNames, forward: bool) -> list[str]:
    """Params, dropout and the flags (launch.py passes them by name, in the kernel's order)."""
    # A float param as fp64 (Triton would pass a Python float as fp32): an fp64 kernel keeps
    # every bit, an fp32 one rounds it on entry as the launch did.
    arguments = [f"{p.local}: tl.float64," if p.declaration.type == "float" else f"{p.local}," for p in kernel.scalars]
    for p in plan.params:
        if p.dropout_p:
            comment = f"  # {p.name} as a 24-bit keep threshold, and 1 / (1 - {p.name})" if forward else ""
            arguments.append(f"{names.threshold[p.name]}, {names.scale[p.name]}: tl.float64,{comment}")
    if plan.has_dropout:
        arguments.append(
            f"{SEED},  # one int64 on the device: the Philox key of the dropout masks" if forward
            else f"{SEED},  # the forward's seed: its dropout masks are drawn again, bit for bit"
        )
        arguments.append(f"{SHARD},  # with SHARDED: where this shard sits in the global problem")
    arguments += [f"{names.constexprs[p.name]}: tl.constexpr,  # {p.name}" for p in kernel.choices]
    if plan.has_dropout:
        arguments += [
            f"{HAS_DROPOUT}: tl.constexpr,  # training and p > 0; otherwise no random numbers at all",
            f"{DROPOUT_WHOLE_GROUPS}: tl.constexpr,  # N % 4 == 0: rows hold whole groups of four dropout words",
            f"{SHARDED}: tl.constexpr,  # a DTensor's shard: masks keyed by the global flat index",
        ]
    arguments += [f"{INDEX_64}: tl.constexpr,  # some offset reaches 2**31", f"{COMPUTE_FP64}: tl.constexpr,"]
    return arguments


def backward_arguments(plan: OpPlan, names: TritonNames, row_sums: str, statistics: list[str]) -> list[str]:
    """The backward's arguments up to ROWS_PER_PROGRAM: what it reads, the gradients it
    writes (`row_sums`: the shape of a [..., 1] input's row sums), the `statistics` arguments a
    kind adds (the row kind's buffer), M, N, M_BUCKET, the shared ones, and each gradient's flags."""
    kernel = plan.backward
    arguments = [input_argument(i, names) for i in kernel.inputs]
    for (output, _), incoming in zip(plan.outputs, kernel.incoming):
        n = names.incoming[incoming]
        arguments.append(f"{n.pointer}, {n.stride_m}, {n.stride_n},  # incoming gradient of {output}")
    for gradient in kernel.gradients:
        name, width = gradient.input.name, width_text(gradient.input)
        pointer, sums = names.gradient_pointer[name], names.sums[name]
        more = f"; or row sums [{row_sums}]" if gradient.one_per_row else ""
        arguments.append(f"{pointer},  # gradient of {name}: [M, {width}]; with {sums}, column sums [programs, {width}]{more}")
    arguments += statistics
    arguments.append(f"{M}, {N}, {M_BUCKET},")
    arguments += shared_arguments(plan, kernel, names, forward=False)
    for gradient in kernel.gradients:
        name = gradient.input.name
        # An input's two flags on one line: its gradient is wanted; it is broadcast along rows.
        arguments.append(f"{names.needs[name]}: tl.constexpr, {names.sums[name]}: tl.constexpr,"
                         f"  # summed over rows where {name} is broadcast along them")
        if gradient.one_per_row:
            arguments.append(f"{names.column_sums[name]}: tl.constexpr,  # {name} is broadcast along columns")
    return arguments


def input_argument(i: InputPlan, names: TritonNames) -> str:
    n = names.inputs[i.name]
    return f"{n.pointer}, {n.stride_m}, {n.stride_n},  # {i.name} {i.layout.declared}, as [M, {width_text(i)}]"


def width_text(i: InputPlan) -> str:
    chunks = i.layout.chunks
    return "N" if chunks == 1 else f"{chunks} * N"


def chunk_columns(chunk: int) -> str:
    """The columns of chunk k of a strided input's row: chunk k of x [..., kN] is at cols + k * N
    (an offset of the columns, not of the pointer: those are multiplied by the stride in int64
    where INDEX_64 needs it)."""
    if chunk == 0:
        return "cols"
    return f"cols + {'' if chunk == 1 else f'{chunk} * '}N"


def chunk_end(chunk: int) -> str:
    """Where chunk k's columns end, (k + 1) * N: the gradient helpers store the columns before
    it, of the shifted cols (a pointer offset instead would be computed even for a gradient not
    asked for, whose pointer is None)."""
    return "N" if chunk == 0 else f"{chunk + 1} * N"


def load_line(target: str, n: InputNames, columns: str = "cols", dtype: str = COMPUTE_DTYPE) -> str:
    return f"{target} = load_tile({n.pointer}, {n.stride_m}, {n.stride_n}, rows, {columns}, in_bounds, {dtype})"


def per_row_load_line(target: str, n: InputNames, dtype: str = COMPUTE_DTYPE) -> str:
    """A [..., 1] tensor's values as a [rows, 1] column (kernel_lib.load_per_row)."""
    return f"{target} = load_per_row({n.pointer}, {n.stride_m}, rows, {M}, {dtype})"


def input_loads(i: InputPlan, n: InputNames) -> list[str]:
    # An integer or bool input stays in its own type: compared exactly (a class index with
    # col), a condition as is; Triton converts it where arithmetic mixes it with floats.
    dtype = COMPUTE_DTYPE if i.layout.differentiable else f"{n.pointer}.dtype.element_ty"
    if i.layout.one_per_row:
        return [per_row_load_line(value.local, n, dtype) for value in i.values]
    return [load_line(value.local, n, chunk_columns(value.chunk), dtype) for value in i.values]


def output_width(plan: OpPlan, output: str) -> str:
    """An output's row length: N, or k * N for one of k parts side by side."""
    parts = plan.parts_of(output)
    return "N" if parts is None else f"{len(parts.values)} * N"


def output_stores(plan: OpPlan, kernel: KernelPlan) -> list[str]:
    """The forward's stores of a tile: each output into its contiguous [M, N]; a concatenated
    output's parts side by side in its [M, k * N] (part k at cols + k * N)."""
    lines = []
    for (name, _), out in zip(plan.outputs, kernel.outputs):
        parts = plan.parts_of(name)
        if parts is None:
            lines.append(f"store_tile({out}_ptr, {out}, rows, cols, N, in_bounds)")
            continue
        width = output_width(plan, name)
        lines += [f"store_tile({out}_ptr, {value}, rows, {chunk_columns(k)}, {width}, in_bounds)"
                  for k, value in enumerate(parts.values)]
    return lines


def per_row_incoming(plan: OpPlan) -> frozenset[str]:
    """The backward's incoming gradients of outputs with one value a row ([..., 1]): one value
    a row too, loaded once a row (per_row_load_line), never a whole tile."""
    return frozenset(g for (name, _), g in zip(plan.outputs, plan.backward.incoming) if name in plan.row_outputs)


def incoming_values(plan: OpPlan, kernel: KernelPlan) -> list[tuple[str, str, int]]:
    """The backward's incoming gradients as its body reads them: (value, the output's
    incoming gradient, chunk), a concatenated output's part by part, as a chunked input's."""
    values = []
    for (name, _), incoming in zip(plan.outputs, kernel.incoming):
        parts = plan.parts_of(name)
        values += [(incoming, incoming, 0)] if parts is None else [(v, incoming, k) for k, v in enumerate(parts.incoming)]
    return values


def scalars_in_compute_type(plan: OpPlan, kernel: KernelPlan, names: TritonNames) -> list[str]:
    scalars = [p.local for p in kernel.scalars] + [names.scale[p.name] for p in plan.params if p.dropout_p]
    if not scalars:
        return []
    return ["# Scalar params in the compute type: a float is passed as fp64, an int as an int."] + [
        f"{name} = tl.full((), {name}, {COMPUTE_DTYPE})" for name in scalars
    ]


def gradient_stores(gradient: GradientPlan, names: TritonNames, column_tile: str = "tl.program_id(1)") -> list[str]:
    """One tile's gradient of an input: stored, or added to the program's sums (store_gradient);
    a [..., 1] input's row sums by `column_tile`, the tile's place along the row."""
    name = gradient.input.name
    pointer, width = names.gradient_pointer[name], width_text(gradient.input)
    if not gradient.one_per_row:
        return [
            f"{names.accumulator[v]} = store_gradient({pointer}, {v}, {names.accumulator[v]}, rows, {chunk_columns(k)}, "
            f"{width}, in_bounds, {names.needs[name]}, {names.sums[name]})"
            for k, v in enumerate(gradient.values)
        ]
    value, accumulator = gradient.values[0], names.accumulator[gradient.values[0]]
    return [
        f"if {names.needs[name]}:",
        f"    if {names.sums[name]}:",
        f"        {accumulator} += tl.where(in_bounds, {value}, 0.0)",
        f"    elif {names.column_sums[name]}:",
        "        # This column tile's part of each row's sum: [column tiles, M], summed after.",
        f"        tl.store({pointer} + {column_tile} * M + rows, tl.sum(tl.where(in_bounds, {value}, 0.0), axis=1), "
        "mask=rows < M)",
        "    else:",
        f"        store_tile({pointer}, {value}, rows, cols, {width}, in_bounds)",
    ]


def gradient_sums(gradient: GradientPlan, names: TritonNames, program: str = "tl.program_id(0)") -> list[str]:
    """After the program's rows: its sums of a row-broadcast input's gradient, reduced and stored
    in the `program`'s row of partial sums."""
    name = gradient.input.name
    pointer, width = names.gradient_pointer[name], width_text(gradient.input)
    return [
        f"store_column_sums({pointer}, {names.accumulator[v]}, {program}, {chunk_columns(k)}, {chunk_end(k)}, {width}, "
        f"{names.needs[name]}, {names.sums[name]})"
        for k, v in enumerate(gradient.values)
    ]


def indent(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


def triton_constant(text: str) -> str:
    return f"tl.full((BLOCK_M, BLOCK_N), {text}, {COMPUTE_DTYPE})"
