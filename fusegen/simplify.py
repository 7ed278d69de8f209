"""IR → sympy: one expression per output, gradients by differentiation, CSE'd into blocks.

A compile-time choice (activation) stays an opaque sympy function in the op's body, so
the kernel holds one body and each choice becomes a small helper with its own CSE'd
forward and derivative. Dropout becomes a multiplication by a per-element mask symbol
(scale where kept, 0 where dropped); with dropout off it disappears. A subexpression that
is a constant is folded to one literal as it is lowered, or refused (fusegen.constants).
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, replace

import sympy

from . import calculus, constants, ir, rows
from .calculus import derivative
from .rows import RowProgram
from .errors import SpecError
from .functions import COL, FUNCTIONS, INF, in_compute, negated

_RELATIONS = {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge, "==": sympy.Eq, "!=": sympy.Ne}
_LOGIC = {"&": sympy.And, "|": sympy.Or, "~": negated}
_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "**": operator.pow}
HELPER_ARGS = ("x", "y", "z")  # a choice helper's argument names, by arity


@dataclass(frozen=True)
class Block:
    """Straight-line code: temporaries in order, then named results."""

    temps: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    results: tuple[tuple[str, sympy.Expr], ...]

    # As a RowProgram answers them, so that plan building asks either the same.
    @property
    def definitions(self) -> tuple[tuple[sympy.Symbol, sympy.Expr], ...]:
        return self.temps

    def free_symbols(self) -> set:
        found = set()
        for _, expr in (*self.temps, *self.results):
            found |= expr.free_symbols
        return found


@dataclass(frozen=True)
class ChoiceHelper:
    """The functions a choice param can name, each CSE'd, with their partial derivatives."""

    param: str
    args: tuple[sympy.Symbol, ...]
    forward: tuple[tuple[str, Block], ...]  # (choice, block with result "out")
    grads: tuple[tuple[tuple[str, Block], ...], ...]  # per argument k: (choice, block for ∂out/∂arg_k)


@dataclass(frozen=True)
class Gradient:
    input: str  # a value name: an input, or a chunk of one (x[1])
    # Set when the gradient is exactly one output's incoming gradient, with dropout on and
    # off: then it is passed through, with no kernel work.
    passthrough_of: str | None
    # Set when the gradient is exactly an earlier input's, with dropout on and off (x and
    # residual in x + residual): where the two tensors agree in shape and dtype, the kernel
    # writes it once and both inputs get that one tensor, as torch's add gives its inputs.
    same_as: str | None = None
    # The outputs whose incoming gradients it reads, in the op's order: where none of them
    # has one (an unused output's), the input has no gradient, as in torch (not zeros).
    reads: tuple[str, ...] = ()


@dataclass(frozen=True)
class HiddenLayer:
    """A hidden layer's function (ir.OpIR.hidden) over its product HIDDEN_PRODUCT and [H]
    inputs, with its partial derivatives: what the forward keeps for the backward, which
    multiplies the layer's incoming gradient by them (elementwise, so the layer's backward is
    matmuls and products). `partials` holds each distinct one; `partial_of` says which is
    each value's (`reads`: HIDDEN_PRODUCT, then the inputs)."""

    reads: tuple[sympy.Symbol, ...]
    value: Block  # result HIDDEN alone (the reference's)
    forward: Block  # HIDDEN, then each partial, by partial_name
    partial_of: tuple[int, ...]
    count: int


@dataclass(frozen=True)
class SimplifiedOp:
    ir: ir.OpIR
    inputs: tuple[sympy.Symbol, ...]  # one per value: an input, or each chunk of a chunked input
    scalar_params: tuple[sympy.Symbol, ...]  # those the kernel needs as values
    masks: tuple[sympy.Symbol, ...]  # one per dropout stream
    grad_outputs: tuple[sympy.Symbol, ...]  # incoming gradient per output
    # An op with row reductions has one row program each way (fusegen.rows), with dropout on
    # (off, its masks are 1), and no *_no_dropout blocks.
    forward: Block | RowProgram  # dropout on
    forward_no_dropout: Block | None
    backward: Block | RowProgram  # results named by value (x, x[1]), pass-throughs left out
    backward_no_dropout: Block | None
    gradients: tuple[Gradient, ...]
    helpers: tuple[ChoiceHelper, ...]
    hidden: HiddenLayer | None = None  # the matmul's hidden layer (an MLP's), if any


@functools.lru_cache(maxsize=None)
def choice_function(param: str, arity: int, derivative: int | None = None) -> type[sympy.Function]:
    """The opaque sympy function standing for `param(...)`; derivative k is ∂/∂arg_k.

    Cached so that the same name always is the same class (sympy compares by class).
    """
    # "__" cannot occur in spec names, so no choice param's helper can take these names.
    if derivative is None:
        name = f"_{param}"
    else:
        name = f"_{param}__grad" if arity == 1 else f"_{param}__grad{derivative}"

    def fdiff(self, argindex=1):
        if derivative is not None:
            raise NotImplementedError("fusegen derives first derivatives only")
        return choice_function(param, arity, argindex - 1)(*self.args)

    # Never a number, even of constant arguments (act(1)): as for sympy's undefined functions,
    # its value is unknown here, so nothing may evaluate, compare or print it as one.
    return type(
        name,
        (sympy.Function,),
        {"nargs": arity, "fdiff": fdiff, "choice_param": param, "derivative": derivative, "is_number": False},
    )


# Symbols this stage makes for itself have names no spec name can have (spec names are
# identifiers): chunk values x[0], masks mask[0], incoming gradients grad[y], temporaries %t0.
# fusegen.plan gives every symbol its name in the generated code.


def value_names(input_spec) -> list[str]:
    """The values an input supplies to expressions: itself, or each of its chunks."""
    if input_spec.chunks == 1:
        return [input_spec.name]
    return [chunk_name(input_spec.name, k) for k in range(input_spec.chunks)]


def chunk_name(input_name: str, index: int) -> str:
    return f"{input_name}[{index}]"


def partial_name(index: int) -> str:
    """A hidden layer's partial derivative, by its index among the distinct ones."""
    return f"{ir.HIDDEN}_partial[{index}]"


def mask_name(stream: int) -> str:
    return f"mask[{stream}]"


def grad_output_name(output: str) -> str:
    return f"grad[{output}]"


def simplify(op: ir.OpIR) -> SimplifiedOp:
    spec = op.spec
    # What the expressions read: with a matmul, its product stands for its operands, and their
    # gradients are the backend's (from the product's).
    read = op.epilogue_inputs
    chunked = {n for i in read if i.chunks > 1 for n in value_names(i)}
    # An input broadcast by its declaration ([N], [..., 1]) has its gradient summed: in the
    # backward kernel, which reads the incoming gradient anyway, not by torch, in a pass of its own.
    chunked |= {i.name for i in read if not i.has_ellipsis or i.dims[-1] == "1"}
    inputs = {n: sympy.Symbol(n, real=True) for i in read for n in value_names(i)}
    # Integer and bool inputs are read, never differentiated: no gradient is derived for them.
    wrt = {n: s for n, s in inputs.items() if n not in {i.name for i in read if i.dtype != "float"}}
    if not any(b.differentiable for b in spec.outputs):  # quantized outputs: the op has no gradient
        wrt = {}
    params = {p.name: sympy.Symbol(p.name, real=True) for p in spec.scalar_params}
    masks = tuple(sympy.Symbol(mask_name(d.stream), real=True) for d in op.dropouts)
    symbols = {**inputs, **params}
    if op.has_reductions:
        return _simplify_rows(op, inputs, params, masks, chunked, wrt)

    outputs = {}
    for has_dropout in (True, False):
        lower = _Lowering(op, symbols, masks if has_dropout else None)
        outputs[has_dropout] = lower.outputs()

    grad_outputs = tuple(sympy.Symbol(grad_output_name(name), real=True) for name, _ in op.outputs)
    totals = {
        has_dropout: _input_gradients(op, outputs[has_dropout], wrt, grad_outputs) for has_dropout in (True, False)
    }
    # A part of a concatenated output is never a whole tensor: no gradient passes it through.
    parts = {ir.part_name(name, k) for name, count in op.output_parts for k in range(count)}
    whole = tuple(g for g in grad_outputs if _output_of(g) not in parts)
    gradients = _same_gradients(tuple(
        Gradient(
            name,
            _passthrough(totals[True][name], whole)
            # A chunk is never a whole tensor; a broadcast input's gradient is a sum.
            if totals[True][name] == totals[False][name] and name not in chunked
            else None,
        )
        for name in wrt
    ), [totals[True], totals[False]], chunked | {ir.PRODUCT, ir.LOWRANK})  # g (the products') is no input's
    gradients = tuple(
        replace(g, reads=_reads((totals[True][g.input], totals[False][g.input]), grad_outputs)) for g in gradients
    )
    backward = {
        has_dropout: [(g.input, totals[has_dropout][g.input]) for g in gradients if g.passthrough_of is None]
        for has_dropout in (True, False)
    }

    used = set().union(*(e.free_symbols for _, e in outputs[True] + outputs[False]))
    product = [inputs[n] for n in value_names(read[0])] if op.matmul is not None else []
    if product and not any(p in used for p in product):
        binding = spec.outputs[0]
        raise SpecError(spec.path, binding.line, f"the product {op.matmul.text} simplifies away: no output reads it")
    lowrank = op.matmul.lowrank if op.matmul is not None else None
    if lowrank is not None and inputs[ir.LOWRANK] not in used:
        binding = spec.outputs[0]
        raise SpecError(spec.path, binding.line, f"the low-rank product {lowrank.text} simplifies away: no output "
                        "reads it")
    used |= set().union(*(e.free_symbols for _, e in backward[True] + backward[False]))
    hidden = _hidden_layer(op, params) if op.hidden is not None else None
    if hidden is not None:
        used |= hidden.forward.free_symbols()
    return SimplifiedOp(
        ir=op,
        inputs=tuple(inputs.values()),
        scalar_params=tuple(s for s in params.values() if s in used),
        masks=masks,
        grad_outputs=grad_outputs,
        forward=_cse(outputs[True]),
        forward_no_dropout=_cse(outputs[False]),
        backward=_cse(backward[True]),
        backward_no_dropout=_cse(backward[False]),
        gradients=gradients,
        helpers=tuple(_choice_helper(p) for p in spec.choice_params),
        hidden=hidden,
    )


def _simplify_rows(op: ir.OpIR, inputs: dict, params: dict, masks: tuple, chunked: set, wrt: dict) -> SimplifiedOp:
    spec = op.spec
    along = {inputs[n] for i in spec.inputs if i.dims and i.dims[-1] != "1" for n in value_names(i)}
    reductions = rows.Reductions(along | set(masks) | {COL})
    outputs = _Lowering(op, {**inputs, **params}, masks, reductions).outputs()
    grad_outputs = tuple(sympy.Symbol(grad_output_name(name), real=True) for name, _ in op.outputs)
    lines = {b.name: b.line for b in spec.outputs}

    def check(output: str, name: str, partial: sympy.Expr) -> None:
        try:
            constants.check_finite(partial)
        except constants.ConstantError as exc:
            message = f"output '{output}': its derivative with respect to {name} has a constant that {exc}"
            raise SpecError(spec.path, lines[output], message) from None

    # Outputs without a gradient (quantized ones) send none back.
    kept = [k for k, b in enumerate(spec.outputs) if b.differentiable]
    found, row_values, totals = rows.backward(reductions.found, [outputs[k] for k in kept], inputs,
                                              tuple(grad_outputs[k] for k in kept), masks, check, op.row_outputs,
                                              wrt=frozenset(wrt), along=reductions.along)
    gradients = _same_gradients(tuple(
        Gradient(name, None if name in chunked else _passthrough(totals[name], grad_outputs)) for name in wrt
    ), [totals], chunked)
    # A gradient reads the incoming ones directly and through the backward's row sums and values.
    definitions = {r.symbol: r.value for r in found} | dict(row_values)
    gradients = tuple(replace(g, reads=_reads((totals[g.input],), grad_outputs, definitions)) for g in gradients)
    results = [(g.input, totals[g.input]) for g in gradients if g.passthrough_of is None]
    elements = set(inputs.values()) | set(masks) | {COL}
    forward = rows.schedule(reductions.found, [], outputs, elements)
    backward = rows.schedule(found, row_values, results, elements | set(grad_outputs),
                             forward_statistics=forward.statistics)
    used = forward.free_symbols() | backward.free_symbols()
    return SimplifiedOp(
        ir=op,
        inputs=tuple(inputs.values()),
        scalar_params=tuple(s for s in params.values() if s in used),
        masks=masks,
        grad_outputs=grad_outputs,
        forward=forward,
        forward_no_dropout=None,
        backward=backward,
        backward_no_dropout=None,
        gradients=gradients,
        helpers=tuple(_choice_helper(p) for p in spec.choice_params),
    )


def _hidden_layer(op: ir.OpIR, params: dict) -> HiddenLayer:
    """The hidden layer's value and its distinct partial derivatives, over its own product and
    inputs (its MatMul node lowered to HIDDEN_PRODUCT)."""
    spec, layer = op.spec, op.matmul.hidden
    product = sympy.Symbol(ir.HIDDEN_PRODUCT, real=True)
    inputs = {n: sympy.Symbol(n, real=True) for n in layer.inputs}
    # Reported at the output whose tree holds the matmul (its intermediates inlined).
    output = next(v for v, e in op.outputs if any(n == op.matmul for n in ir.walk(e)))
    binding = ir.output_bindings(spec)[output]
    lower = _Lowering(op, {**params, **inputs, ir.PRODUCT: product}, None)
    value = lower._lower_binding(binding, "output", op.hidden)
    if product not in value.free_symbols:
        raise SpecError(spec.path, binding.line, f"output '{binding.name}': the hidden layer {layer.text} simplifies "
                        "to a function without its product")
    reads = (product, *inputs.values())
    distinct, partial_of = [], []
    for symbol in reads:
        # relu's step as torch's relu backward takes it: 0 where x <= 0, else 1, NaN included
        # (the backward's zero partial gives a zero gradient whatever dh is; a NaN x passes dh on).
        partial = derivative(value, symbol).replace(
            lambda e: isinstance(e, sympy.Heaviside) and len(e.args) > 1 and e.args[1] == 0,
            lambda e: sympy.Piecewise((sympy.Float(0.0), e.args[0] <= 0), (sympy.Float(1.0), True)))
        try:
            constants.check_finite(partial)
        except constants.ConstantError as exc:
            raise SpecError(spec.path, binding.line, f"output '{binding.name}': the hidden layer's derivative with "
                            f"respect to {symbol.name.lstrip('@')} has a constant that {exc}") from None
        if partial not in distinct:
            distinct.append(partial)
        partial_of.append(distinct.index(partial))
    forward = _cse([(ir.HIDDEN, value), *((partial_name(k), d) for k, d in enumerate(distinct))])
    return HiddenLayer(reads, _cse([(ir.HIDDEN, value)]), forward, tuple(partial_of), len(distinct))


class _Lowering:
    """IR → sympy, node by node. A node whose value is a number is folded to one literal
    (constants.fold), and the numbers sympy gathers into a node's sum or product are checked:
    a constant that cannot be a literal is a spec error naming the field and the subexpression."""

    def __init__(self, op: ir.OpIR, symbols: dict[str, sympy.Symbol], masks: tuple[sympy.Symbol, ...] | None,
                 reductions: rows.Reductions | None = None):
        self.op = op
        self.reductions = reductions  # where row reductions go: ops that have them
        self.symbols = symbols
        self.masks = masks
        self.lowered: dict[int, sympy.Basic] = {}  # by id(node): intermediates' trees are shared
        # A subtree an intermediate stands for is shown by its name in messages.
        self.let_names = {id(expr): name for name, expr in op.lets}
        self.integers = {i.name for i in op.spec.inputs if i.dtype != "float"}
        self.binding = None

    def outputs(self) -> list[tuple[str, sympy.Expr]]:
        """Every output's expression; intermediates first, so that a problem in one is
        reported at its own line (and lowered once, wherever it is used)."""
        bindings = {b.name: b for b in self.op.spec.lets} | ir.output_bindings(self.op.spec)
        # A hidden layer's intermediates are its own (over its product and inputs: _hidden_layer).
        layer = {id(node) for node in ir.walk(self.op.hidden)} if self.op.hidden is not None else set()
        for name, expr in self.op.lets:
            if id(expr) not in layer:
                self._lower_binding(bindings[name], "intermediate", expr)
        return [(name, self._lower_binding(bindings[name], "output", expr)) for name, expr in self.op.outputs]

    def _lower_binding(self, binding, kind: str, expr: ir.Expr) -> sympy.Expr:
        self.binding = (binding, kind)
        value = self(expr)
        try:
            constants.check_all_numbers(value)
        except constants.ConstantError as exc:
            raise self._error(f"`{self._text(expr)}` simplifies to an expression whose constant {exc}") from None
        return value

    def _error(self, message: str) -> SpecError:
        binding, kind = self.binding
        return SpecError(self.op.spec.path, binding.line, f"{kind} '{binding.name}': {message}")

    def _text(self, e: ir.Expr) -> str:
        text = ir.unparse(e, self.let_names)
        return text if len(text) <= 60 else text[:57] + "..."

    def __call__(self, e: ir.Expr) -> sympy.Basic:
        key = id(e)
        if key not in self.lowered:
            self.lowered[key] = self._checked(e)
        return self.lowered[key]

    def _checked(self, e: ir.Expr) -> sympy.Basic:
        try:
            value = self._lower(e)
        except ZeroDivisionError:  # sympy's Float / Float(0)
            raise self._error(f"{self._constant(e)} is not a finite real number (it divides by zero)") from None
        except constants.CoefficientError as exc:  # (2 * x) ** 9 ** 9, before sympy computes 2 ** 9 ** 9
            raise self._error(f"`{self._text(e)}` simplifies to a product whose constant factor {exc}") from None
        except constants.ConstantError as exc:  # 9 ** 9 ** 9, or act(0) for a choice of log
            raise self._error(f"{self._constant(e)} {exc}") from None
        if isinstance(e, ir.CONDITIONS):
            return value
        try:
            if value.is_number:
                return constants.fold(value)
            constants.check_coefficients(value)
        except constants.ConstantError as exc:
            where = self._constant(e) if value.is_number else f"`{self._text(e)}` simplifies to {_shape(value)}"
            raise self._error(f"{where} {exc}") from None
        return value

    def _constant(self, e: ir.Expr) -> str:
        return f"constant subexpression `{self._text(e)}`"

    def _lower(self, e: ir.Expr) -> sympy.Basic:
        if isinstance(e, ir.Const):
            if e.value == math.inf:
                return INF
            return sympy.Integer(e.value) if isinstance(e.value, int) else sympy.Float(e.value)
        if isinstance(e, ir.InputRef) and e.name in self.integers:
            # Arithmetic reads it in the compute type; a comparison as it is (_operand).
            return in_compute(self.symbols[e.name])
        if isinstance(e, (ir.InputRef, ir.ParamRef)):
            return self.symbols[e.name]
        if isinstance(e, ir.MatMul):
            return self.symbols[ir.PRODUCT]
        if isinstance(e, ir.LowRank):
            return self.symbols[ir.LOWRANK]
        if isinstance(e, ir.ProductChunk):
            return self.symbols[chunk_name(ir.PRODUCT, e.index)]
        if isinstance(e, ir.ChunkRef):
            return self.symbols[chunk_name(e.name, e.index)]
        if isinstance(e, ir.Col):
            return COL
        if isinstance(e, ir.Unary):
            return -self(e.operand)
        if isinstance(e, ir.Binary):
            if e.op == "**":
                return constants.power(self(e.left), self(e.right))
            return _BINARY[e.op](self(e.left), self(e.right))
        if isinstance(e, ir.Compare):
            return _RELATIONS[e.op](self._operand(e.left), self._operand(e.right))
        if isinstance(e, ir.Logic):
            return _LOGIC[e.op](*(self(a) for a in e.args))
        if isinstance(e, ir.Call):
            return FUNCTIONS[e.func].sympy_form(*(self(a) for a in e.args))
        if isinstance(e, ir.ChoiceCall):
            return self._choice_call(e)
        if isinstance(e, ir.Where):
            return sympy.Piecewise((self(e.if_true), self(e.cond)), (self(e.if_false), True))
        if isinstance(e, ir.Dropout):
            value = self(e.value)
            return value * self.masks[e.stream] if self.masks is not None else value
        if isinstance(e, ir.Reduce):
            return self.reductions.add(e.op, self(e.value))
        raise TypeError(f"unknown IR node {type(e).__name__}")

    def _operand(self, e: ir.Expr) -> sympy.Basic:
        """A comparison's operand: an integer or bool input as it is (a class index compared
        with col exactly), anything else as lowered."""
        if isinstance(e, ir.InputRef) and e.name in self.integers:
            return self.symbols[e.name]
        return self(e)

    def _choice_call(self, e: ir.ChoiceCall) -> sympy.Expr:
        args = [self(a) for a in e.args]
        if all(a.is_number for a in args):
            # act(1) stays a call (which function is chosen at compile time), but each
            # choice's value must be a literal the kernel could hold.
            param = next(p for p in self.op.spec.choice_params if p.name == e.param)
            for choice in param.choices:
                try:
                    constants.fold(FUNCTIONS[choice].sympy_form(*args))
                except constants.ConstantError as exc:
                    raise constants.ConstantError(f"with {e.param} = {choice} {exc}") from None
        return choice_function(e.param, len(args))(*args)


def _shape(value: sympy.Expr) -> str:
    """Where the number constants.check_coefficients refused sits, for a message."""
    if value.is_Add:
        return "a sum whose constant term"
    if value.is_Mul:
        return "a product whose constant factor"
    return "a power whose constant base or exponent"


def _input_gradients(op: ir.OpIR, outputs, inputs, grad_outputs) -> dict[str, sympy.Expr]:
    """grad_input = Σ_outputs grad_output · ∂output/∂input, for every input (a matmul's product
    as one)."""
    spec = op.spec
    bindings = ir.output_bindings(spec)
    lines = {value: b.line for value, b in bindings.items()}
    differentiable = {value for value, b in bindings.items() if b.differentiable}  # the others send no gradient back
    shown = {n: n for n in inputs} | {
        n: f"chunk({i.name}, {k})" for i in spec.inputs if i.chunks > 1 for k, n in enumerate(value_names(i))
    }
    if op.matmul:  # the product, or each of its chunks
        product = value_names(op.epilogue_inputs[0])
        shown |= {n: op.matmul.text if len(product) == 1 else f"chunk({op.matmul.text}, {k})"
                  for k, n in enumerate(product)}
        if op.matmul.lowrank is not None:
            shown[ir.LOWRANK] = op.matmul.lowrank.text
    totals = {}
    for name, symbol in inputs.items():
        terms = []
        for g, (output, expr) in zip(grad_outputs, outputs):
            if output not in differentiable:
                continue
            partial = derivative(expr, symbol)
            try:
                constants.check_finite(partial)
            except constants.ConstantError as exc:  # (-2) ** x: its derivative holds log(-2)
                message = f"output '{output}': its derivative with respect to {shown[name]} has a constant that {exc}"
                raise SpecError(spec.path, lines[output], message) from None
            terms.append(g * partial)
        totals[name] = sympy.Add(*terms)
    return totals


def _same_gradients(gradients: tuple[Gradient, ...], totals: list[dict], chunked: set) -> tuple[Gradient, ...]:
    """Each whole input whose gradient is an earlier whole input's, in every variant of the
    backward (`totals`: with dropout and without), marked `same_as` that input."""
    result, first = [], {}
    for g in gradients:
        if g.passthrough_of is None and g.input not in chunked:
            key = tuple(t[g.input] for t in totals)
            if key in first:
                g = Gradient(g.input, None, same_as=first[key])
            else:
                first[key] = g.input
        result.append(g)
    return tuple(result)


def _reads(totals, grad_outputs, definitions: dict | None = None) -> tuple[str, ...]:
    """The outputs whose incoming gradients appear in `totals`, directly or through the
    symbols `definitions` defines."""
    seen, pending = set(), [s for total in totals for s in total.free_symbols]
    while pending:
        symbol = pending.pop()
        if symbol not in seen:
            seen.add(symbol)
            if definitions and symbol in definitions:
                pending.extend(definitions[symbol].free_symbols)
    return tuple(_output_of(g) for g in grad_outputs if g in seen)


def _output_of(grad_output: sympy.Symbol) -> str:
    """The output whose incoming gradient `grad_output` (grad[y]) is."""
    return grad_output.name[len("grad["):-1]


def _passthrough(total: sympy.Expr, grad_outputs) -> str | None:
    """The output whose incoming gradient this gradient is, unchanged; else None."""
    return next((_output_of(g) for g in grad_outputs if total == g), None)


def _cse(results: list[tuple[str, sympy.Expr]]) -> Block:
    temps, reduced = calculus.cse([e for _, e in results])
    return Block(tuple(temps), tuple((n, e) for (n, _), e in zip(results, reduced)))


def _choice_helper(param) -> ChoiceHelper:
    arity = FUNCTIONS[param.choices[0]].arity
    args = tuple(sympy.Symbol(n, real=True) for n in HELPER_ARGS[:arity])
    forward = []
    grads: list[list[tuple[str, Block]]] = [[] for _ in args]
    for choice in param.choices:
        expr = FUNCTIONS[choice].sympy_form(*args)
        forward.append((choice, _cse([("out", expr)])))
        for k, a in enumerate(args):
            grads[k].append((choice, _cse([("out", derivative(expr, a))])))
    return ChoiceHelper(param.name, args, tuple(forward), tuple(tuple(g) for g in grads))
