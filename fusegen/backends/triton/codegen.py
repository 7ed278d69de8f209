"""Plan → the text of a generated Triton module: the kernels, the op's declaration for
fusegen.runtime, its reference body and its public functions.

Everything is computed here and handed to templates/op.py.jinja as ready strings and
lists of lines; the template holds layout only.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from importlib import resources

import jinja2
import sympy

from fusegen import templating
from fusegen.errors import SpecError
from fusegen.functions import FUNCTIONS
from fusegen.layout import Choice, Scalar, range_text
from fusegen.names import PYTHON_BUILTINS, Namer
from fusegen.plan import Body, GradientPlan, HelperPlan, InputPlan, KernelPlan, OpPlan, public_signature
from fusegen.printers import EagerPrinter, ElementwisePrinter, TorchPrinter
from fusegen.pyformat import format_module

from .printer import COMPUTE_DTYPE, TritonPrinter

# What a generated module imports; an op named so would hide one.
MODULE_IMPORTS = frozenset(
    {"torch", "F", "triton", "tl", "libdevice", "runtime", "launch", "tuning", "dropout_mask", "sqrt_rn", "rsqrt_rn"}
)
# Names the generated code uses for itself: fusegen.plan names nothing spec-derived so.
RESERVED_NAMES = (
    MODULE_IMPORTS
    | {"reference", "eager", "_OP", "_reference"}
    # the kernels' own arguments and locals
    | {"rows", "cols", "in_bounds", "M", "N", "M_BUCKET", "seed", "seed_ptr", "first_row", "row_offset"}
    | {"HAS_DROPOUT", "DROPOUT_WHOLE_GROUPS", "INDEX_64", "COMPUTE_FP64", "BLOCK_M", "BLOCK_N", "ROWS_PER_PROGRAM"}
    # the reference body's and the module class's
    | {"problem", "masks", "self", "training"}
    | PYTHON_BUILTINS
)
_TO_COMPUTE = f".to({COMPUTE_DTYPE})"


def module_class_name(op_name: str) -> str:
    """The op's torch.nn.Module class: its name in CamelCase (bias_gelu_dropout_add →
    BiasGeluDropoutAdd), with "Module" added where that is the op's own name or a name the
    module already uses (op Gelu → GeluModule, op f → FModule)."""
    name = "".join(word[:1].upper() + word[1:] for word in op_name.split("_"))
    taken = name == op_name or name in MODULE_IMPORTS or name in PYTHON_BUILTINS
    return f"{name}Module" if taken else name


@dataclass
class _Kernel:
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


@dataclass
class _Helper:
    name: str
    param: str
    arguments: str
    selector: str
    branches: list[dict]


@dataclass(frozen=True)
class _InputNames:
    pointer: str
    stride_m: str
    stride_n: str


def render(plan: OpPlan) -> str:
    """The text of generated/<op>.py."""
    spec = plan.spec
    # The op function is module-level: it must not hide what the module's code reads there.
    if spec.name in MODULE_IMPORTS:
        raise SpecError(spec.path, spec.name_line, f"op name '{spec.name}' would hide the module's import of {spec.name}")
    if spec.name in PYTHON_BUILTINS:
        raise SpecError(spec.path, spec.name_line, f"op name '{spec.name}' would hide Python's builtin {spec.name}")
    names = _TritonNames(plan)
    op = spec.name
    triton = TritonPrinter(names.triton_helpers, names.constexprs)
    torch_printer = TorchPrinter(names.torch_helpers, {p.name: p.local for p in plan.params})
    forward = _forward_kernel(plan, names, triton)
    backward = _backward_kernel(plan, names, triton)
    triton_helpers = [h for helper in plan.helpers for h in _triton_helpers(helper, names, triton)]
    torch_helpers = [_torch_helper(helper, names, torch_printer) for helper in plan.helpers]
    reference = _reference(plan, torch_printer)
    eager_helpers = [_eager_helper(helper, names) for helper in plan.helpers]
    eager_lines = _eager_lines(plan, names)
    kernel_code = "\n".join(
        [*_kernel_lines(forward), *_kernel_lines(backward)]
        + [line for h in triton_helpers for b in h.branches for line in b["lines"]]
    )
    class_name = module_class_name(op)
    params = plan.params
    public = [i.name for i in plan.inputs] + [p.name for p in params] + (["training", "seed"] if plan.has_dropout else [])
    context = dict(
        op=op,
        doc=spec.doc,
        spec_path=spec.path,
        spec_sha256=spec.sha256,
        docstring=_docstring(plan, class_name),
        uses_functional="F." in "\n".join(eager_lines + [line for h in eager_helpers for b in h.branches for line in b["lines"]]),
        uses_libdevice="libdevice." in kernel_code,
        kernel_lib_names=", ".join(
            n for n in ("dropout_mask", "rsqrt_rn", "sqrt_rn") if f"{n}(" in kernel_code
        ),
        exports=", ".join(f'"{n}"' for n in (op, class_name, "reference", "eager")),
        triton_helpers=triton_helpers,
        forward=_with_arguments(forward),
        backward=_with_arguments(backward),
        column_sum_buffers=", ".join(f'"{names.gradient_pointer[g.input.name]}"' for g in plan.backward.gradients if g.one_per_row),
        torch_helpers=torch_helpers,
        reference=reference,
        op_declaration=_op_declaration(plan, forward, backward),
        public_signature=_public_signature(plan),
        public_arguments=", ".join(public),
        class_name=class_name,
        class_doc=_class_doc(plan),
        # The class's methods take the spec's names and read nothing global but _OP (spec
        # names never start with '_'), so those names need no renaming there.
        init_signature=", ".join(["self"] + [f"{p.name}={p.default!r}" for p in params]),
        init_arguments=", ".join(p.name for p in params),
        has_params=bool(params),
        forward_signature=", ".join(["self"] + [i.name for i in plan.inputs]),
        module_call=", ".join(
            [i.name for i in plan.inputs] + [f"self.{p.name}" for p in params]
            + (["self.training", "None"] if plan.has_dropout else [])
        ),
        extra_repr='f"' + ", ".join(f"{p.name}={{self.{p.name}!r}}" for p in params) + '"',
        has_dropout=plan.has_dropout,
        eager_helpers=eager_helpers,
        eager_signature=", ".join(
            [i.local for i in plan.inputs] + [f"{p.local}={p.default!r}" for p in params]
            + (["training=True", "seed=None"] if plan.has_dropout else [])
        ),
        eager_lines=eager_lines,
    )
    return format_module(_environment().get_template("op.py.jinja").render(**context))


class _TritonNames:
    """The Triton module's own names for what the plan named: pointers, strides, gradient
    buffers and sums, constexprs, dropout arguments and helper functions; from the plan's
    namer, so none is a spec name or another's."""

    def __init__(self, plan: OpPlan):
        namer: Namer = plan.namer.child()
        self.inputs = {
            i.name: _InputNames(namer.claim(f"{i.local}_ptr"), namer.claim(f"{i.local}_stride_m"),
                                namer.claim(f"{i.local}_stride_n"))
            for i in plan.inputs
        }
        self.incoming = {
            g: _InputNames(namer.claim(f"{g}_ptr"), namer.claim(f"{g}_stride_m"), namer.claim(f"{g}_stride_n"))
            for g in plan.backward.incoming
        }
        self.gradient_pointer = {}
        self.needs, self.sums, self.column_sums, self.accumulator = {}, {}, {}, {}
        for gradient in plan.backward.gradients:
            name, local = gradient.input.name, gradient.input.local
            self.gradient_pointer[name] = namer.claim(f"grad_{local}_ptr")
            self.needs[name] = namer.claim(f"NEEDS_GRAD_{local.upper()}")
            self.sums[name] = namer.claim(f"SUM_GRAD_{local.upper()}")
            if gradient.one_per_row:
                self.column_sums[name] = namer.claim(f"SUM_COLS_GRAD_{local.upper()}")
            for value in gradient.values:
                self.accumulator[value] = namer.claim(f"{value}_sum")
        self.threshold = {p.name: namer.claim(f"dropout_threshold_{p.local}") for p in plan.params if p.dropout_p}
        self.scale = {p.name: namer.claim(f"dropout_scale_{p.local}") for p in plan.params if p.dropout_p}
        self.constexprs = {p.name: namer.claim(p.local.upper()) for p in plan.forward.choices}
        # Module-level helpers start with '_', as spec names never do: they only need to
        # differ from each other.
        self.triton_helpers, self.torch_helpers, self.eager_helpers = {}, {}, {}
        for helper in plan.helpers:
            param, arity = helper.param, len(helper.args)
            self.triton_helpers[(param.name, None)] = namer.claim(f"_{param.local}")
            for k in range(arity):
                suffix = "_grad" if arity == 1 else f"_grad{k}"
                self.triton_helpers[(param.name, k)] = namer.claim(f"_{param.local}{suffix}")
            self.torch_helpers[(param.name, None)] = namer.claim(f"_{param.local}_torch")
            self.eager_helpers[param.name] = namer.claim(f"_{param.local}_eager")
        self.chunks = {i.name: namer.claim(f"{i.local}_chunks") for i in plan.inputs if i.layout.chunks > 1}


# ---------------------------------------------------------------------------
# Kernels


def _forward_kernel(plan: OpPlan, names: _TritonNames, printer: TritonPrinter) -> _Kernel:
    kernel = plan.forward
    arguments = [_input_argument(i, names) for i in kernel.inputs]
    arguments += [f"{out}_ptr,  # {name}, contiguous [M, N]" for (name, _), out in zip(plan.outputs, kernel.outputs)]
    arguments.append("M, N,  # rows (all leading dims) and columns (the last dim)")
    arguments.append("M_BUCKET,  # M rounded up to a power of two: what tuning keys on")
    arguments += _shared_arguments(plan, kernel, names, forward=True)
    arguments += ["BLOCK_M: tl.constexpr,", "BLOCK_N: tl.constexpr,"]
    tensors = {v.local for i in kernel.inputs for v in i.values} | {m.local for m in kernel.masks}
    result = _Kernel(
        name=f"{plan.spec.name}_kernel",
        key=_key(plan, backward=False),
        arguments=arguments,
        prologue=_scalars_in_compute_type(kernel),
        loads=[line for i in kernel.inputs for line in _loads(i, names.inputs[i.name])],
        stores=[
            f"tl.store({out}_ptr + rows[:, None] * N + cols[None, :], {out}.to({out}_ptr.dtype.element_ty), mask=in_bounds)"
            for out in kernel.outputs
        ],
    )
    if kernel.body_no_dropout is not None:
        result.dropout_lines = ["seed = tl.load(seed_ptr)"] + _mask_lines(plan, names)
        result.dropout_lines += _statements(kernel.body, printer, _triton_constant, tensors)
        result.plain_lines = _statements(kernel.body_no_dropout, printer, _triton_constant, tensors)
    else:
        result.plain_lines = _statements(kernel.body, printer, _triton_constant, tensors)
    return result


def _backward_kernel(plan: OpPlan, names: _TritonNames, printer: TritonPrinter) -> _Kernel:
    kernel = plan.backward
    arguments = [_input_argument(i, names) for i in kernel.inputs]
    for (output, _), incoming in zip(plan.outputs, kernel.incoming):
        n = names.incoming[incoming]
        arguments.append(f"{n.pointer}, {n.stride_m}, {n.stride_n},  # incoming gradient of {output}")
    for gradient in kernel.gradients:
        name, width = gradient.input.name, _row_width(gradient.input)
        pointer, sums = names.gradient_pointer[name], names.sums[name]
        more = "; or row sums [column tiles, M]" if gradient.one_per_row else ""
        arguments.append(f"{pointer},  # gradient of {name}: [M, {width}]; with {sums}, column sums [programs, {width}]{more}")
    arguments.append("M, N, M_BUCKET,")
    arguments += _shared_arguments(plan, kernel, names, forward=False)
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
    prologue = _scalars_in_compute_type(kernel)
    if kernel.body_no_dropout is not None:
        prologue += ["if HAS_DROPOUT:", "    seed = tl.load(seed_ptr)"]
    loads = [line for i in kernel.inputs for line in _loads(i, names.inputs[i.name])]
    for incoming in kernel.incoming:
        n = names.incoming[incoming]
        loads += [
            f"{incoming} = tl.load({n.pointer} + rows[:, None] * {n.stride_m} + cols[None, :] * {n.stride_n}, mask=in_bounds)",
            f"{incoming} = {incoming}{_TO_COMPUTE}",
        ]
    result = _Kernel(
        name=f"{plan.spec.name}_backward_kernel",
        key=_key(plan, backward=True),
        arguments=arguments,
        prologue=prologue,
        loads=loads,
        accumulators=[
            f"{names.accumulator[v]} = tl.zeros((BLOCK_M, BLOCK_N), {COMPUTE_DTYPE})"
            for g in kernel.gradients for v in g.values
        ],
        stores=[line for g in kernel.gradients for line in _gradient_stores(g, names)],
        epilogue=[line for g in kernel.gradients for line in _gradient_sums(g, names)],
    )
    if kernel.body_no_dropout is not None:
        result.dropout_lines = _mask_lines(plan, names) + _statements(kernel.body, printer, _triton_constant, tensors)
        result.plain_lines = _statements(kernel.body_no_dropout, printer, _triton_constant, tensors)
    else:
        result.plain_lines = _statements(kernel.body, printer, _triton_constant, tensors)
    return result


def _with_arguments(kernel: _Kernel) -> _Kernel:
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


def _key(plan: OpPlan, backward: bool) -> str:
    key = ["M_BUCKET", "N"] + (["HAS_DROPOUT"] if plan.has_dropout else []) + (["ROWS_PER_PROGRAM"] if backward else [])
    return "[" + ", ".join(f'"{k}"' for k in key) + "]"


def _shared_arguments(plan: OpPlan, kernel: KernelPlan, names: _TritonNames, forward: bool) -> list[str]:
    """Params, dropout and the flags: in the order fusegen.backends.triton.launch passes them."""
    arguments = [f"{p.local}," for p in kernel.scalars]
    for p in plan.params:
        if p.dropout_p:
            comment = f"  # {p.name} as a 24-bit keep threshold, and 1 / (1 - {p.name})" if forward else ""
            arguments.append(f"{names.threshold[p.name]}, {names.scale[p.name]},{comment}")
    if plan.has_dropout:
        arguments.append(
            "seed_ptr,  # one int64 on the device: the Philox key of the dropout masks" if forward
            else "seed_ptr,  # the forward's seed: its dropout masks are drawn again, bit for bit"
        )
    arguments += [f"{names.constexprs[p.name]}: tl.constexpr,  # {p.name}" for p in kernel.choices]
    if plan.has_dropout:
        arguments += [
            "HAS_DROPOUT: tl.constexpr,  # training and p > 0; otherwise no random numbers at all",
            "DROPOUT_WHOLE_GROUPS: tl.constexpr,  # N % 4 == 0: rows hold whole groups of four dropout words",
        ]
    arguments += ["INDEX_64: tl.constexpr,  # some offset reaches 2**31", "COMPUTE_FP64: tl.constexpr,"]
    return arguments


def _input_argument(i: InputPlan, names: _TritonNames) -> str:
    n = names.inputs[i.name]
    return f"{n.pointer}, {n.stride_m}, {n.stride_n},  # {i.name} {i.layout.declared}, as [M, {_row_width(i)}]"


def _row_width(i: InputPlan) -> str:
    chunks = i.layout.chunks
    return "N" if chunks == 1 else f"{chunks} * N"


def _column(chunk: int) -> str:
    """Where chunk k of an input's row starts: chunk k of x [..., kN] is at cols + k * N."""
    if chunk == 0:
        return "cols[None, :]"
    return f"(cols[None, :] + {'' if chunk == 1 else f'{chunk} * '}N)"


def _loads(i: InputPlan, n: _InputNames) -> list[str]:
    lines = []
    for value in i.values:
        lines += [
            f"{value.local} = tl.load({n.pointer} + rows[:, None] * {n.stride_m} + {_column(value.chunk)} * {n.stride_n}, "
            "mask=in_bounds)",
            f"{value.local} = {value.local}{_TO_COMPUTE}",
        ]
    return lines


def _scalars_in_compute_type(kernel: KernelPlan) -> list[str]:
    if not kernel.scalars:
        return []
    return ["# Scalar params in the compute type: Triton passes a Python float as fp32, an int as an int."] + [
        f"{p.local} = tl.full((), {p.local}, {COMPUTE_DTYPE})" for p in kernel.scalars
    ]


def _mask_lines(plan: OpPlan, names: _TritonNames) -> list[str]:
    return [
        f"{m.local} = dropout_mask(seed, rows, tl.program_id(1) * BLOCK_N, N, BLOCK_N, {m.stream}, "
        f"{names.threshold[m.p.name]}, {names.scale[m.p.name]}, DROPOUT_WHOLE_GROUPS)"
        for m in plan.masks
    ]


def _gradient_stores(gradient: GradientPlan, names: _TritonNames) -> list[str]:
    name = gradient.input.name
    pointer, width = names.gradient_pointer[name], _row_width(gradient.input)
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
        f"        tl.store({pointer} + rows[:, None] * {width} + {_column(k)}, {v}.to({pointer}.dtype.element_ty), "
        "mask=in_bounds)"
        for k, v in enumerate(gradient.values)
    ]
    return lines


def _gradient_sums(gradient: GradientPlan, names: _TritonNames) -> list[str]:
    name = gradient.input.name
    pointer, width = names.gradient_pointer[name], _row_width(gradient.input)
    lines = [f"if {names.needs[name]} and {names.sums[name]}:", "    # One reduction across rows per program, after the loop."]
    for k, v in enumerate(gradient.values):
        column = "cols" if k == 0 else f"cols + {'' if k == 1 else f'{k} * '}N"
        lines.append(
            f"    tl.store({pointer} + tl.program_id(0) * {width} + {column}, tl.sum({names.accumulator[v]}, axis=0), "
            "mask=cols < N)"
        )
    return lines


def _kernel_lines(kernel: _Kernel) -> list[str]:
    return [*kernel.prologue, *kernel.loads, *kernel.dropout_lines, *kernel.plain_lines, *kernel.stores, *kernel.epilogue]


# ---------------------------------------------------------------------------
# Bodies


def _statements(body: Body, printer: ElementwisePrinter, constant, tensors: set[str]) -> list[str]:
    """`t0 = ...` lines then `name = ...` lines, each after a comment naming the constants
    it spells as literals; a result that reaches no tensor is broadcast by `constant`."""
    lines = []

    def emit(target: str, text: str) -> None:
        for literal, meaning in printer.constants.items():
            lines.append(f"# {literal} = {meaning}")
        printer.constants.clear()
        lines.append(f"{target} = {text}")

    temps = dict(body.temps)
    for target, expr in body.temps:
        emit(target, printer.doprint(expr))
    for target, expr in body.results:
        text = printer.doprint(expr)
        if constant is not None and not _depends_on(expr, temps, tensors):
            text = constant(text)
        emit(target, text)
    return lines


def _depends_on(expr: sympy.Expr, temps: dict, tensors: set[str]) -> bool:
    """Whether a result reaches one of `tensors`, directly or through temporaries."""
    pending, seen = [s.name for s in expr.free_symbols], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in temps:
            pending.extend(s.name for s in temps[name].free_symbols)
        elif name in tensors:
            return True
    return False


def _triton_constant(text: str) -> str:
    return f"tl.full((BLOCK_M, BLOCK_N), {text}, {COMPUTE_DTYPE})"


def _torch_constant(text: str) -> str:
    return f"torch.full(problem.shape, {text}, dtype=problem.compute_dtype, device=problem.device)"


@dataclass
class _ReferenceBody:
    arguments: str
    returns: str
    dropout_lines: list[str]
    plain_lines: list[str]


def _reference(plan: OpPlan, printer: TorchPrinter) -> _ReferenceBody:
    kernel = plan.reference
    values = [v.local for i in kernel.inputs for v in i.values]
    tensors = set(values) | {m.local for m in kernel.masks}
    arguments = ["problem", *values, *(p.local for p in plan.params)] + (["masks"] if plan.has_dropout else [])
    returns = "(" + ", ".join(kernel.outputs) + ("," if len(kernel.outputs) == 1 else "") + ")"
    if kernel.body_no_dropout is None:
        return _ReferenceBody(", ".join(arguments), returns, [], _statements(kernel.body, printer, _torch_constant, tensors))
    masks = "(" + ", ".join(m.local for m in kernel.masks) + ("," if len(kernel.masks) == 1 else "") + ")"
    return _ReferenceBody(
        ", ".join(arguments),
        returns,
        [f"{masks} = masks"] + _statements(kernel.body, printer, _torch_constant, tensors),
        _statements(kernel.body_no_dropout, printer, _torch_constant, tensors),
    )


# ---------------------------------------------------------------------------
# Choice helpers


def _branches(choices: tuple[tuple[str, Body], ...], printer: ElementwisePrinter) -> list[dict]:
    return [
        dict(keyword="if" if k == 0 else "elif", choice=repr(choice), lines=_statements(body, printer, None, set()))
        for k, (choice, body) in enumerate(choices)
    ]


def _triton_helpers(helper: HelperPlan, names: _TritonNames, printer: TritonPrinter) -> list[_Helper]:
    param = helper.param
    selector = names.constexprs[param.name]
    arguments = ", ".join([*helper.args, f"{selector}: tl.constexpr"])
    variants = [(None, helper.forward)] + list(enumerate(helper.derivatives))
    return [
        _Helper(names.triton_helpers[(param.name, k)], param.name, arguments, selector, _branches(blocks, printer))
        for k, blocks in variants
    ]


def _torch_helper(helper: HelperPlan, names: _TritonNames, printer: TorchPrinter) -> _Helper:
    arguments = ", ".join([*helper.args, "choice"])
    name = names.torch_helpers[(helper.param.name, None)]
    return _Helper(name, helper.param.name, arguments, "choice", _branches(helper.forward, printer))


def _eager_helper(helper: HelperPlan, names: _TritonNames) -> _Helper:
    param = helper.param
    args = helper.args
    branches = [
        dict(keyword="if" if k == 0 else "elif", choice=repr(c), lines=[FUNCTIONS[c].torch_idiom.format(*args)])
        for k, c in enumerate(param.declaration.choices)
    ]
    return _Helper(names.eager_helpers[param.name], param.name, ", ".join([*args, "choice"]), "choice", branches)


def _eager_lines(plan: OpPlan, names: _TritonNames) -> list[str]:
    printer = EagerPrinter(plan.names, names.chunks, names.eager_helpers)
    lines = [f"{names.chunks[i.name]} = {i.local}.chunk({i.layout.chunks}, dim=-1)" for i in plan.inputs if i.layout.chunks > 1]
    return lines + ["return " + ", ".join(printer.doprint(expr) for expr in plan.eager)]


# ---------------------------------------------------------------------------
# The op's declaration and public face


def _op_declaration(plan: OpPlan, forward: _Kernel, backward: _Kernel) -> list[str]:
    """The arguments of `_OP = runtime.FusedOp(...)`, one a line (a long one over several)."""
    inputs = []
    for i in plan.inputs:
        chunks = f", chunks={i.layout.chunks}" if i.layout.chunks > 1 else ""
        inputs.append(f'runtime.Input("{i.name}", {_strings(i.layout.dims)}{chunks})')
    lines = [f'"{plan.spec.name}",', *_argument("inputs", inputs, tuple_=True)]
    params = []
    for p in plan.params:
        d = p.declaration
        if isinstance(d, Scalar):
            params.append(f'runtime.Scalar("{d.name}", "{d.kind}", {d.low!r}, {d.high!r})')
        else:
            params.append(f'runtime.Choice("{d.name}", {_strings(d.choices)})')
    if params:
        lines += _argument("params", params, tuple_=True)
    lines.append(f"outputs={_strings([name for name, _ in plan.outputs])},")
    if plan.masks:
        lines.append(f"masks={_strings([m.p.name for m in plan.masks])},  # each dropout's p, by Philox stream")
    if plan.passthrough:
        pairs = ", ".join(f'"{i}": "{o}"' for i, o in plan.passthrough)
        lines.append(f"passthrough={{{pairs}}},  # these inputs' gradients are those outputs' own")
    kernel = plan.backward
    kernels = [forward.name, backward.name]
    if plan.forward.scalars:
        kernels.append(f"scalars={_strings([p.name for p in plan.forward.scalars])}")
    kernels += [
        f"backward_reads={_strings([i.name for i in kernel.inputs])}",
        f"gradients={_strings([g.input.name for g in kernel.gradients])}",
    ]
    return lines + _argument("kernels", kernels, call="launch.Kernels") + ["reference=_reference,"]


def _argument(name: str, items: list[str], tuple_: bool = False, call: str = "") -> list[str]:
    """`name=(a, b),` or `name=call(a, b),` on one line where it fits, else an item a line."""
    opening = f"{name}={call}("
    one_line = opening + ", ".join(items) + ("," if tuple_ and len(items) == 1 else "") + "),"
    if len(one_line) <= 92:  # inside FusedOp(...), indented 4
        return [one_line]
    return [opening, *(f"    {item}," for item in items), "),"]


def _strings(items) -> str:
    items = list(items)
    return "(" + ", ".join(f'"{s}"' for s in items) + ("," if len(items) == 1 else "") + ")"


def _public_signature(plan: OpPlan) -> str:
    return public_signature(plan.spec, plan.has_dropout)


def _class_doc(plan: OpPlan) -> list[str]:
    """Lines not wrapped: where a spec's names fall must not move the line breaks."""
    lines = [f"The op as a torch.nn.Module: forward({', '.join(i.name for i in plan.inputs)}) calls {plan.spec.name}."]
    if plan.params:
        lines.append("Its params are fixed at construction, and checked then.")
    if plan.has_dropout:
        lines.append("Dropout is on in train() mode and off in eval(); seeds come from torch's generator.")
    return lines


def _docstring(plan: OpPlan, class_name: str) -> list[str]:
    spec = plan.spec
    wrap = lambda text, indent="": textwrap.wrap(text, width=92, subsequent_indent=indent)  # noqa: E731
    class_arguments = ", ".join(f"{p.name}={p.default!r}" for p in plan.params)
    tensors = ", ".join(i.name for i in plan.inputs)
    lines = [spec.doc.replace("\\", "\\\\").replace('"', '\\"'), ""]
    lines += ["    " + line for line in wrap(f"{spec.name}({_public_signature(plan)})", "    ")]
    lines += ["    " + line for line in wrap(f"{class_name}({class_arguments})({tensors}): the same, as a torch.nn.Module", "    ")]
    lines.append("")
    lines += wrap("Inputs (broadcast as torch broadcasts): " + ", ".join(f"{i.name} {i.layout.declared}" for i in plan.inputs))
    lines += wrap("Outputs: " + ", ".join(f"{name} [{', '.join(spec.out_dims)}]" for name, _ in plan.outputs))
    for p in plan.params:
        d = p.declaration
        if isinstance(d, Scalar):
            bounds = range_text(d.low, d.high)
            bounds = f" {bounds}" if bounds else ""
            lines += wrap(f"Param {p.name}: {d.kind}{bounds}, default {p.default!r} (runtime: no recompilation).", "    ")
        elif isinstance(d, Choice):
            choices = ", ".join(d.choices)
            lines += wrap(f"Param {p.name}: one of {choices}; default {p.default!r} (compile-time: one kernel each).", "    ")
    if plan.has_dropout:
        lines += wrap("training=False, or every dropout p == 0, takes a kernel with no random numbers.", "    ")
        lines += wrap("seed=None draws the dropout seed from torch's default generator (torch.manual_seed).", "    ")
    lines += [""] + wrap(
        "The Triton kernels load every input once, compute in fp32 (fp64 for fp64 inputs) and write every output "
        "once, in the dtype torch's type promotion gives."
    )
    if plan.has_dropout:
        lines += wrap(
            "Dropout draws Philox4x32-10 keyed by the seed at each element's flat index: the mask does not depend on "
            "the input's 2-D layout or the kernel's block shape, and `reference` reproduces it. The seed is a "
            "one-element int64 tensor on the inputs' device, drawn there by torch (seed=None) or filled in "
            "(seed=int): no host sync, and a CUDA graph that captured a call draws a new mask on each replay."
        )
    redraw = ", draws the same dropout masks again from the seed" if plan.has_dropout else ""
    saved = " and the seed tensor" if plan.has_dropout else ""
    lines += [""] + wrap(
        f"Backward: one fused kernel recomputes the forward from the saved inputs{redraw} and writes every input "
        "gradient in one pass; gradients of inputs broadcast along rows are summed per program in fp32 and then "
        f"across programs, in a fixed order (no atomics). Memory: saved for backward are the inputs{saved}, "
        "nothing else: no mask, no intermediates."
    )
    lines += wrap(
        " ".join(
            f"The gradient of {i} is the gradient of {o}, passed on without a copy (summed only where {i} was broadcast)."
            for i, o in plan.passthrough
        )
    )
    lines += [""] + wrap(
        "`reference` is the same computation in eager PyTorch, generated from the same spec; `eager` is the op as a "
        "PyTorch user writes it (torch.nn.functional), the benchmarks' baseline."
    )
    return lines


def _environment() -> jinja2.Environment:
    loader = jinja2.FunctionLoader(
        lambda name: resources.files("fusegen.backends.triton").joinpath("templates", name).read_text(encoding="utf-8")
    )
    return templating.environment(loader)
