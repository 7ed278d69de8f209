"""Simplified op → plan: what each kernel of the op does, as typed data, every name final.

The plan is the one object a backend reads. It says, per kernel: its kind, the inputs it
loads (and each value an input supplies: the input, or each of its chunks), the params it
takes, the dropout masks it draws, its CSE'd body, and what it stores: outputs, or input
gradients with how each is reduced. Expressions are sympy over symbols already named as
the generated code names them; a backend prints them and lays them out, deciding nothing
about the op itself.

Names: a spec name stays as the user wrote it, unless the backend's generated code
already uses it for itself (then it takes a trailing underscore, inside the generated
code only: public signatures keep the spec's names). See fusegen.names.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import sympy

from . import ir
from .errors import SpecError
from .functions import FUNCTIONS
from .names import PYTHON_BUILTINS, Namer
from .printers import EagerPrinter
from .layout import Choice, Input, Scalar
from .rows import ADJOINT_PREFIX, ADJOINT_SUM_PREFIX, EXTREME_PREFIX, REDUCTION_PREFIX, TIES_PREFIX, WIDTH, RowProgram
# A row kernel's body is simplify's frozen RowProgram with every name final (renamed here):
# the backend reads it as the plan's, under these names, and imports nothing of fusegen.rows.
from .rows import Reduction as RowReduction, RowPass, RowProgram as RowBody  # noqa: F401  (the plan's API)
from .calculus import TEMPORARY_PREFIX
from .simplify import Block, ChoiceHelper, SimplifiedOp, value_names
from .spec import ChoiceParam, OpSpec


class KernelKind(enum.Enum):
    """What a kernel's program computes. A new kind (row reductions, say) adds a member here
    and a template in each backend; the pointwise kinds are untouched."""

    POINTWISE = "pointwise"  # each element of the output from the same element of each input
    POINTWISE_BACKWARD = "pointwise_backward"  # each input's gradient, element by element
    # A program owns whole rows: reductions along the row (passes of a fusegen.rows.RowProgram),
    # then each element of the outputs, or of each input's gradient.
    ROW = "row"
    ROW_BACKWARD = "row_backward"

    @property
    def is_row(self) -> bool:
        return self in (KernelKind.ROW, KernelKind.ROW_BACKWARD)


@dataclass(frozen=True)
class Value:
    """One value an input supplies to expressions: the input, or one of its chunks."""

    local: str  # its name in generated code
    chunk: int  # which chunk (0 for an input without chunks)


@dataclass(frozen=True)
class InputPlan:
    name: str  # the spec's (and the public signature's) name
    local: str  # the name generated functions use for it
    layout: Input
    values: tuple[Value, ...]


@dataclass(frozen=True)
class ParamPlan:
    name: str
    local: str
    declaration: Scalar | Choice
    default: object
    dropout_p: bool  # some dropout's probability: the kernels take its threshold and scale


@dataclass(frozen=True)
class Mask:
    """A dropout mask: scale where kept, 0 where dropped, drawn from the seed per element."""

    local: str
    stream: int  # the Philox stream that tells this mask from the op's others
    p: ParamPlan


@dataclass(frozen=True)
class Body:
    """Straight-line code: temporaries in order, then named results."""

    temps: tuple[tuple[str, sympy.Expr], ...]
    results: tuple[tuple[str, sympy.Expr], ...]  # (local name of the result, expression)


@dataclass(frozen=True)
class GradientPlan:
    """An input gradient a backward kernel computes. How it is reduced follows from how the
    input was broadcast, which the runtime sees: written as it is (same shape), summed
    over rows ([N]-like), summed along each row (declared [..., 1]: `one_per_row`), or
    written in full and summed by torch (any other broadcast)."""

    input: InputPlan
    values: tuple[str, ...]  # local name of each chunk's gradient, in chunk order
    one_per_row: bool


@dataclass(frozen=True)
class KernelPlan:
    kind: KernelKind
    inputs: tuple[InputPlan, ...]  # inputs the kernel loads
    incoming: tuple[str, ...]  # backward: local names of the outputs' incoming gradients
    outputs: tuple[str, ...]  # forward: local names of the outputs it stores
    gradients: tuple[GradientPlan, ...]  # backward: the input gradients it stores
    scalars: tuple[ParamPlan, ...]  # numbers the body reads
    masks: tuple[Mask, ...]
    choices: tuple[ParamPlan, ...]
    # Pointwise kinds: a Body with dropout (where the op has any) and one without.
    # Row kinds: one RowBody; with dropout off its masks are 1.
    body: Body | RowBody
    body_no_dropout: Body | None  # training=False or p == 0; None for ops without dropout
    row_width: str | None = None  # row kinds: the local holding N in the compute type, if read


@dataclass(frozen=True)
class HelperPlan:
    """A choice param's functions: one body per choice, for the function and each partial
    derivative. Helpers have their own scope: arguments args, result `out`."""

    param: ParamPlan
    args: tuple[str, ...]
    forward: tuple[tuple[str, Body], ...]  # (choice, body)
    derivatives: tuple[tuple[tuple[str, Body], ...], ...]  # per argument: (choice, body)
    # The eager twin's helper (module-level, so '_'-prefixed): its name, and per choice the
    # expression a PyTorch user writes for it (F.gelu(x)), over args.
    eager_name: str
    eager: tuple[tuple[str, str], ...]  # (choice, expression)


@dataclass(frozen=True)
class OpPlan:
    op: str  # the op's name: its module's, its function's
    doc: str  # the spec's doc text
    spec_path: str  # the spec file, as the build was given it, and its sha256: the module's header
    spec_sha256: str
    public_signature: str  # the op function's parameters, as its `def` line writes them
    op_signature: str  # the op's own parameters (`reference`'s): the public ones, inplace_backward
    inputs: tuple[InputPlan, ...]
    params: tuple[ParamPlan, ...]
    outputs: tuple[tuple[str, str], ...]  # (spec name, local name)
    row_outputs: frozenset[str]  # spec names of outputs with one value per row, [..., 1]
    output_dims: tuple[tuple[str, tuple[str, ...]], ...]  # (spec name, its dims as the spec names them)
    masks: tuple[Mask, ...]
    forward: KernelPlan
    backward: KernelPlan
    passthrough: tuple[tuple[str, str], ...]  # (input, output): the input's gradient is the output's
    same_gradient: tuple[tuple[str, str], ...]  # (input, earlier input): the same gradient (simplify.Gradient)
    # (input, outputs): an input whose gradient reads the incoming gradients of only some
    # outputs, those (simplify.Gradient.reads); inputs that read every output's are left out.
    gradient_reads: tuple[tuple[str, tuple[str, ...]], ...]
    # The user-style baseline's body (`eager`, over the inputs' and params' locals): chunked
    # inputs split, the spec's intermediates as locals, then `return` the outputs as the
    # spec writes them, in PyTorch (F.gelu, F.dropout).
    eager: tuple[str, ...]
    helpers: tuple[HelperPlan, ...]
    # Every name the module's code uses so far (the backend's reserved names, and each the plan
    # gave out): a backend's own derived names start from these (names.Namer(taken)).
    taken: frozenset[str]

    @property
    def has_dropout(self) -> bool:
        return bool(self.masks)


def plan(op: SimplifiedOp, reserved: frozenset[str], module_names: frozenset[str] = frozenset()) -> OpPlan:
    """`reserved`: the names the backend's generated code uses for itself; `module_names`:
    the module-level names its modules import, which the op (a module-level function) must
    not hide (check_op_name)."""
    spec = op.ir.spec
    check_op_name(spec.name, spec.path, spec.name_line, module_names)
    namer = Namer(reserved)
    # The spec's own names first: each keeps its name wherever the backend does not use it.
    names = {}
    for item in (*spec.inputs, *spec.params, *spec.outputs):
        names[item.name] = namer.claim(item.name)
    symbols: dict[str, str] = {}  # simplify's symbol names → local names
    inputs = []
    for spec_input in spec.inputs:
        local = names[spec_input.name]
        values = []
        for k, value in enumerate(value_names(spec_input)):
            symbols[value] = local if spec_input.chunks == 1 else namer.claim(f"{local}_chunk{k}")
            values.append(Value(symbols[value], k))
        inputs.append(InputPlan(spec_input.name, local, spec_input.layout, tuple(values)))
    dropout_ps = {d.p for d in op.ir.dropouts}
    params = []
    for p in spec.params:
        symbols[p.name] = names[p.name]
        if isinstance(p, ChoiceParam):
            declaration: Scalar | Choice = Choice(p.name, p.choices)
        else:
            declaration = Scalar(p.name, p.type, p.min, p.max)
        params.append(ParamPlan(p.name, names[p.name], declaration, p.default, p.name in dropout_ps))
    by_name = {p.name: p for p in params}
    masks = []
    for symbol, dropout in zip(op.masks, op.ir.dropouts):
        symbols[symbol.name] = namer.claim(f"dropout_mask{dropout.stream}")
        masks.append(Mask(symbols[symbol.name], dropout.stream, by_name[dropout.p]))
    for symbol, (output, _) in zip(op.grad_outputs, op.ir.outputs):
        symbols[symbol.name] = namer.claim(f"grad_{names[output]}")
    # Gradients the backward kernel computes (the others pass an output's gradient on).
    kernel_values = {g.input for g in op.gradients if g.passthrough_of is None}
    grad_locals = {
        value: namer.claim(f"grad_{symbols[value]}")
        for spec_input in spec.inputs
        for value in value_names(spec_input)
        if value in kernel_values
    }
    rows = isinstance(op.forward, RowProgram)
    if rows:
        symbols.update(_row_names(namer, op.forward, op.backward))
    blocks = (op.forward, op.forward_no_dropout, op.backward, op.backward_no_dropout)
    temps = _temporary_names(namer, [b for b in blocks if b is not None])
    rename = {sympy.Symbol(k, real=True): sympy.Symbol(v, real=True) for k, v in {**symbols, **temps}.items()}
    outputs = tuple((name, names[name]) for name, _ in op.ir.outputs)
    has_dropout = bool(masks)

    def body(block: Block | RowProgram, result_names: dict[str, str]) -> Body | RowBody:
        if isinstance(block, RowProgram):
            return block.renamed(rename, result_names)
        return Body(
            tuple((temps[t.name], e.xreplace(rename)) for t, e in block.temps),
            tuple((result_names[n], e.xreplace(rename)) for n, e in block.results),
        )

    scalars = tuple(by_name[s.name] for s in op.scalar_params)
    choices = tuple(p for p in params if isinstance(p.declaration, Choice))
    width = symbols.get(WIDTH.name)
    forward = KernelPlan(
        kind=KernelKind.ROW if rows else KernelKind.POINTWISE,
        inputs=tuple(inputs),
        incoming=(),
        outputs=tuple(local for _, local in outputs),
        gradients=(),
        scalars=scalars,
        masks=tuple(masks),
        choices=choices,
        body=body(op.forward, names),
        body_no_dropout=body(op.forward_no_dropout, names) if has_dropout and not rows else None,
        row_width=width if rows and WIDTH in op.forward.free_symbols() else None,
    )
    backward_symbols = (
        op.backward.free_symbols() if rows else _free_symbols(op.backward) | _free_symbols(op.backward_no_dropout)
    )
    spec_inputs = {i.name: i for i in spec.inputs}
    gradients = tuple(
        GradientPlan(
            i,
            tuple(grad_locals[n] for n in value_names(spec_inputs[i.name])),
            i.layout.one_per_row,
        )
        for i in inputs
        if any(n in kernel_values for n in value_names(spec_inputs[i.name]))
    )
    backward = KernelPlan(
        kind=KernelKind.ROW_BACKWARD if rows else KernelKind.POINTWISE_BACKWARD,
        inputs=tuple(
            i for i in inputs
            if any(sympy.Symbol(n, real=True) in backward_symbols for n in value_names(spec_inputs[i.name]))
        ),
        incoming=tuple(symbols[g.name] for g in op.grad_outputs),
        outputs=(),
        gradients=gradients,
        scalars=scalars,
        masks=tuple(masks),
        choices=choices,
        body=body(op.backward, grad_locals),
        body_no_dropout=body(op.backward_no_dropout, grad_locals) if has_dropout and not rows else None,
        row_width=width if rows and WIDTH in backward_symbols else None,
    )
    eager_lets = tuple((namer.claim(name), expr) for name, expr in op.ir.lets)
    # The eager function's own names: the tuple of each chunked input's chunks, each choice
    # param's helper.
    eager_helpers = {h.param: namer.claim(f"_{by_name[h.param].local}_eager") for h in op.helpers}
    chunk_tuples = {i.name: namer.claim(f"{i.local}_chunks") for i in inputs if i.layout.chunks > 1}
    eager = _eager_lines(
        tuple(expr for _, expr in op.ir.outputs), eager_lets, tuple(inputs), names, chunk_tuples, eager_helpers
    )
    return OpPlan(
        op=spec.name,
        doc=spec.doc,
        spec_path=spec.path,
        spec_sha256=spec.sha256,
        public_signature=public_signature(spec, has_dropout),
        op_signature=op_signature(spec, has_dropout),
        inputs=tuple(inputs),
        params=tuple(params),
        outputs=outputs,
        row_outputs=op.ir.row_outputs,
        output_dims=tuple(
            (name, (*spec.out_dims[:-1], "1") if name in op.ir.row_outputs else tuple(spec.out_dims))
            for name, _ in outputs
        ),
        masks=tuple(masks),
        forward=forward,
        backward=backward,
        passthrough=tuple((g.input, g.passthrough_of) for g in op.gradients if g.passthrough_of is not None),
        same_gradient=tuple((g.input, g.same_as) for g in op.gradients if g.same_as is not None),
        gradient_reads=_gradient_reads(spec, op),
        eager=eager,
        helpers=tuple(_helper(h, by_name[h.param], eager_helpers[h.param]) for h in op.helpers),
        taken=namer.all_taken(),
    )


def _gradient_reads(spec: OpSpec, op: SimplifiedOp) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per input (all its chunks), the outputs whose incoming gradients its gradient reads,
    where that is not all of them."""
    reads = {g.input: set(g.reads) for g in op.gradients}
    every = [name for name, _ in op.ir.outputs]
    result = []
    for spec_input in spec.inputs:
        read = set().union(*(reads[n] for n in value_names(spec_input)))
        if len(read) < len(every):
            result.append((spec_input.name, tuple(name for name in every if name in read)))
    return tuple(result)


def _temporary_names(namer: Namer | None, blocks) -> dict[str, str]:
    """simplify's %t0, %t1, ... as t0, t1, ...: claimed for the whole module (the backend's
    own names, given out later, must not take them); a helper (namer None) has no others."""
    defined = [pair for b in blocks for pair in (b.definitions if isinstance(b, RowProgram) else b.temps)]
    used = sorted(
        {t.name for t, _ in defined if t.name.startswith(TEMPORARY_PREFIX)},  # not a row program's row values
        key=lambda n: int(n[len(TEMPORARY_PREFIX):]),
    )
    plain = {name: "t" + name[len(TEMPORARY_PREFIX):] for name in used}
    return plain if namer is None else {name: namer.claim(local) for name, local in plain.items()}


def _row_names(namer: Namer, forward: RowProgram, backward: RowProgram) -> dict[str, str]:
    """Row symbols as the generated code names them: each forward reduction by its kind
    (mean0, max1), the backward's tie counts, row sums and adjoints (ties0, row_sum2,
    grad_mean0), and N in the compute type (row_width)."""
    names = {WIDTH.name: namer.claim("row_width")}
    kinds = {r.symbol.name: r.kind for r in forward.reductions}
    for r in (*forward.reductions, *backward.reductions):
        name = r.symbol.name
        if name in names:
            continue
        if name.startswith(REDUCTION_PREFIX):
            names[name] = namer.claim(f"{kinds[name]}{name[len(REDUCTION_PREFIX):]}")
        elif name.startswith(TIES_PREFIX):
            names[name] = namer.claim(f"ties{name[len(TIES_PREFIX):]}")
        elif name.startswith(EXTREME_PREFIX):
            k = name[len(EXTREME_PREFIX):]
            names[name] = namer.claim(f"{kinds[REDUCTION_PREFIX + k]}{k}_again")
        elif name.startswith(ADJOINT_SUM_PREFIX):
            names[name] = namer.claim(f"row_sum{name[len(ADJOINT_SUM_PREFIX):]}")
    for item in (*backward.row_values, *(v for p in backward.passes for v in p.row_values)):
        name = item[0].name
        if name.startswith(ADJOINT_PREFIX):
            reduction = REDUCTION_PREFIX + name[len(ADJOINT_PREFIX):]
            names[name] = namer.claim(f"grad_{names[reduction]}")
    return names


def _free_symbols(block: Block) -> set:
    found = set()
    for _, expr in (*block.temps, *block.results):
        found |= expr.free_symbols
    return found


def _eager_lines(outputs: tuple[ir.Expr, ...], lets: tuple[tuple[str, ir.Expr], ...], inputs: tuple[InputPlan, ...],
                 names: dict[str, str], chunk_tuples: dict[str, str], helpers: dict[str, str]) -> tuple[str, ...]:
    """The eager function's body: the spec's IR printed as a PyTorch user writes it."""
    printer = EagerPrinter(names, chunk_tuples, helpers, {id(expr): local for local, expr in lets})
    lines = [
        f"{chunk_tuples[i.name]} = {i.local}.chunk({i.layout.chunks}, dim=-1)" for i in inputs if i.layout.chunks > 1
    ]
    lines += [f"{local} = {printer.doprint(expr, defining=True)}" for local, expr in lets]
    return tuple(lines + ["return " + ", ".join(printer.doprint(expr) for expr in outputs)])


def _helper(helper: ChoiceHelper, param: ParamPlan, eager_name: str) -> HelperPlan:
    """A helper's scope holds no spec names: its temporaries are simply t0, t1, ..."""
    temps = _temporary_names(None, [b for _, b in (*helper.forward, *(pair for g in helper.grads for pair in g))])
    rename = {sympy.Symbol(k, real=True): sympy.Symbol(v, real=True) for k, v in temps.items()}

    def body(block: Block) -> Body:
        return Body(
            tuple((temps[t.name], e.xreplace(rename)) for t, e in block.temps),
            tuple((n, e.xreplace(rename)) for n, e in block.results),
        )

    return HelperPlan(
        param=param,
        args=tuple(a.name for a in helper.args),
        forward=tuple((choice, body(b)) for choice, b in helper.forward),
        derivatives=tuple(tuple((choice, body(b)) for choice, b in g) for g in helper.grads),
        eager_name=eager_name,
        eager=tuple(
            (c, FUNCTIONS[c].torch_idiom.format(*(a.name for a in helper.args))) for c in param.declaration.choices
        ),
    )


def check_op_name(name: str, path: str, line: int | None, module_names: frozenset[str]) -> None:
    """The op function is module-level: it must not hide what the module's code reads there
    (`module_names`, the backend's imports) or a Python builtin. (Also asked by `fusegen new`,
    before it writes a spec.)"""
    if name in module_names:
        raise SpecError(path, line, f"op name '{name}' would hide the module's import of {name}")
    if name in PYTHON_BUILTINS:
        raise SpecError(path, line, f"op name '{name}' would hide Python's builtin {name}")


def public_signature(spec: OpSpec, has_dropout: bool) -> str:
    """The generated op's parameters, as its `def` line writes them: the spec's names."""
    parts = [i.name for i in spec.inputs] + [f"{p.name}={p.default!r}" for p in spec.params]
    parts += ["training=True", "seed=None"] if has_dropout else []
    return ", ".join(parts + ["*", "out=None"])


def op_signature(spec: OpSpec, has_dropout: bool) -> str:
    """The op's own parameters: `reference`'s, and the backward's memory choice."""
    return public_signature(spec, has_dropout) + ", inplace_backward=False"
