"""The expression IR: a tiny closed set of frozen nodes, parsed from spec text.

Expressions are parsed with Python's `ast` in eval mode and a strict whitelist: spec
text is never evaluated. Names are resolved here (inputs, params, intermediates) and
calls are checked against the function registry, so later stages see only valid trees.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass, replace
from typing import Union

from .errors import SpecError
from .functions import BUILTINS, FUNCTIONS, LITERALS, REDUCTIONS, known_function_names
# Matmul nodes, `a @ b` / `a @ T(b)` and the low-rank `(a @ T(down)) @ T(up)`, as the runtime declares them too.
from .layout import Hidden, LowRank, MatMul
from .spec import MAX_FLOAT_MAGNITUDE, MAX_INT_MAGNITUDE, Binding, ChoiceParam, InputSpec, OpSpec, ScalarParam

# Bounds on one expression, intermediates inlined: later stages recurse over the whole tree.
MAX_DEPTH = 64
MAX_NODES = 1000
# Functions nested in functions: sympy's derivative of such a chain grows exponentially with
# its length (silu nested 10 deep builds in 0.5 s, 12 deep in 10 s, 14 deep in 40 s).
MAX_CALL_NESTING = 10


@dataclass(frozen=True)
class Const:
    value: float | int


@dataclass(frozen=True)
class InputRef:
    name: str


@dataclass(frozen=True)
class ChunkRef:
    """chunk(x, i): the i-th of x's chunks along its last dim (x declared [..., kN])."""

    name: str
    index: int


@dataclass(frozen=True)
class ProductChunk:
    """chunk(a @ T(b), i): the i-th of the product's chunks along its last dim, b holding them
    (declared [kN, K] under T, [K, kN] without): the product of a with b's i-th chunk."""

    matmul: MatMul
    index: int
    count: int  # b's chunks


@dataclass(frozen=True)
class Col:
    """The built-in `col`: the element's index along the last dim, 0 <= col < N."""


@dataclass(frozen=True)
class ParamRef:
    name: str


@dataclass(frozen=True)
class Unary:
    op: str  # "-" or "+"
    operand: "Expr"


@dataclass(frozen=True)
class Binary:
    op: str  # + - * / **
    left: "Expr"
    right: "Expr"


@dataclass(frozen=True)
class Compare:
    op: str  # < <= > >= == !=
    left: "Expr"
    right: "Expr"


@dataclass(frozen=True)
class Logic:
    """Conditions combined: `&` and `|` of two, `~` of one (where's condition, as in torch)."""

    op: str  # "&", "|" or "~"
    args: tuple["Expr", ...]  # conditions: Compare or Logic


@dataclass(frozen=True)
class Call:
    func: str  # a name in functions.FUNCTIONS
    args: tuple["Expr", ...]


@dataclass(frozen=True)
class ChoiceCall:
    """A call through a choice param: which function is a compile-time choice."""

    param: str
    args: tuple["Expr", ...]


@dataclass(frozen=True)
class Where:
    cond: "Compare | Logic"
    if_true: "Expr"
    if_false: "Expr"


@dataclass(frozen=True)
class Dropout:
    value: "Expr"
    p: str  # a float param
    stream: int  # which dropout in the spec: each gets its own random numbers


@dataclass(frozen=True)
class Reduce:
    """A row reduction: `op` (sum, mean, max, min) of `value` over the last dim, one value
    per row, broadcast back along it (torch's keepdim=True)."""

    op: str
    value: "Expr"


# The product's value name in simplify and plan building: no spec name has a '@'; and the
# low-rank product's.
PRODUCT = "@product"
LOWRANK = "@lowrank"
HIDDEN_PRODUCT = "@hidden_product"  # a hidden layer's own product, [..., H]; and its value
HIDDEN = "@hidden"

Expr = Union[Const, InputRef, ChunkRef, Col, ParamRef, Unary, Binary, Compare, Logic, Call, ChoiceCall, Where, Dropout,
             Reduce, MatMul, ProductChunk, LowRank]
CONDITIONS = (Compare, Logic)


@dataclass(frozen=True)
class OpIR:
    spec: OpSpec
    # Intermediates are inlined: a name bound in `let` stands for its whole tree, the same
    # objects as in `lets` (so a tree's nodes can be traced back to the binding that wrote them).
    outputs: tuple[tuple[str, Expr], ...]
    dropouts: tuple[Dropout, ...]
    lets: tuple[tuple[str, Expr], ...] = ()
    row_outputs: frozenset[str] = frozenset()  # outputs with one value per row, [..., 1]
    # Concatenated outputs (`y: [a, b]`): (spec name, parts); `outputs` holds each part as a
    # value of its own, y[0], y[1] (part_name), in order.
    output_parts: tuple[tuple[str, int], ...] = ()
    matmul: MatMul | None = None  # the op's one matmul, if any (with the low-rank product beside it)
    # With a hidden layer (matmul.hidden), its function: a tree over its own matmul (a MatMul
    # node, whose product it reads as HIDDEN_PRODUCT) and its [H] inputs.
    hidden: Expr | None = None

    @property
    def has_reductions(self) -> bool:
        return _has_reductions(self.outputs)

    @property
    def epilogue_inputs(self) -> tuple[InputSpec, ...]:
        """What the elementwise code reads: the spec's inputs, a matmul's operands replaced by
        its product (value name PRODUCT, [..., N]) and the low-rank product's by that one's
        (LOWRANK, [..., N]), in that order."""
        if self.matmul is None:
            return self.spec.inputs
        m, by_name = self.matmul, {i.name: i for i in self.spec.inputs}
        a, b = by_name[m.a], by_name[m.b]
        # b's chunks are the product's, along its last dim: [..., 2N] read as chunk(a @ T(b), k)
        dims = (*a.dims[:-1], b.dims[0] if m.transposed else b.dims[1])
        products = [InputSpec(PRODUCT, dims, a.line, b.chunks)]
        if m.lowrank is not None:
            products.append(InputSpec(LOWRANK, dims, by_name[m.lowrank.up].line))
        return (*products, *(i for i in self.spec.inputs if i.name not in m.operands))


_BINARY_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}
_COMPARE_OPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_UNARY_OPS = {ast.USub: "-", ast.UAdd: "+"}
_LOGIC_OPS = {ast.BitAnd: "&", ast.BitOr: "|"}


class _Located(Exception):
    """A problem inside one expression; `_Scope.parse` adds the file and the binding's line."""


@dataclass(frozen=True)
class _Let:
    """An intermediate's tree, with the depth and size it adds wherever it is inlined."""

    expr: Expr
    depth: int
    nodes: int


def build_ir(spec: OpSpec) -> OpIR:
    """Parse every `let` and output of a spec into resolved IR trees."""
    scope = _Scope(spec)
    outputs = []
    for binding in spec.lets:
        scope.lets[binding.name] = scope.parse(binding)
    for value, binding in output_bindings(spec).items():
        outputs.append((value, scope.parse(binding).expr))
        if _call_nesting(outputs[-1][1], {}) > MAX_CALL_NESTING:
            raise SpecError(
                spec.path,
                binding.line,
                f"'{binding.name}' nests functions more than {MAX_CALL_NESTING} deep (counting "
                "intermediates): its gradient would be too large to simplify",
            )
    _check_all_used(spec, scope)
    output_parts = tuple((b.name, len(b.parts)) for b in spec.outputs if b.parts)
    # With row reductions, an output constant along the row has one value per row: [..., 1].
    row_outputs = frozenset()
    if _has_reductions(outputs):
        if output_parts:
            binding = next(b for b in spec.outputs if b.parts)
            raise SpecError(spec.path, binding.line, f"output '{binding.name}': a concatenated output is not "
                            "supported yet in an op with row reductions (sum, mean, max, min)")
        row_outputs = frozenset(name for name, expr in outputs if row_constant(expr, scope.dims))
    lets = tuple((name, let.expr) for name, let in scope.lets.items())
    matmul = _check_matmul(spec, scope, outputs)
    hidden = scope.hiddens.get(matmul) if matmul is not None else None
    return OpIR(spec=spec, outputs=tuple(outputs), dropouts=tuple(scope.dropouts), lets=lets, row_outputs=row_outputs,
                output_parts=output_parts, matmul=matmul, hidden=hidden)


def part_name(output: str, index: int) -> str:
    """A concatenated output's part k as a value of the op (y[0]; no spec name has brackets),
    as a chunked input's chunks are (simplify.chunk_name)."""
    return f"{output}[{index}]"


def output_values(output: str, parts: int) -> tuple[str, ...]:
    """An output's value names: itself, or each of its parts."""
    return tuple(part_name(output, k) for k in range(parts)) if parts else (output,)


def output_bindings(spec: OpSpec) -> dict[str, Binding]:
    """Each output value's binding, by its value name: an output, or each part of a
    concatenated one (part_name)."""
    values = {}
    for binding in spec.outputs:
        parts = binding.part_bindings
        for k, part in enumerate(parts):
            values[part_name(binding.name, k) if binding.parts else binding.name] = part
    return values


class _Scope:
    def __init__(self, spec: OpSpec):
        self.spec = spec
        self.inputs = {i.name for i in spec.inputs}
        self.chunks = {i.name: i.chunks for i in spec.inputs}
        self.chunk_dims = {i.name: i.chunk_dim for i in spec.inputs}
        self.dims = {i.name: i.dims for i in spec.inputs}
        self.bools = {i.name for i in spec.inputs if i.dtype == "bool"}
        self.integers = {i.name for i in spec.inputs if i.dtype not in ("float", "bool")}
        self.scalars = {p.name: p for p in spec.params if isinstance(p, ScalarParam)}
        self.choices = {p.name: p for p in spec.params if isinstance(p, ChoiceParam)}
        self.outputs = {b.name for b in spec.outputs}
        self.lets: dict[str, _Let] = {}
        # Numbered in order of appearance: lets, then outputs, each read left to right,
        # an outer dropout before the dropouts inside its argument.
        self.dropouts: list[Dropout] = []
        self.used: set[str] = set()
        self.matmuls: dict[MatMul, Binding] = {}  # each matmul, with the first binding writing it
        self.lowranks: dict[LowRank, Binding] = {}  # each low-rank product, so
        self.hiddens: dict[MatMul, Expr] = {}  # a matmul with a hidden layer: the layer's function
        self._binding: Binding | None = None
        # Depth and size of the tree being built, intermediates counted in full: they are
        # inlined, and later stages (sympy, printers) recurse over the whole tree.
        self._nodes = 0
        self._depth = 0

    def parse(self, binding: Binding) -> _Let:
        self._nodes = self._depth = 0
        self._binding = binding
        # A YAML block scalar may spread an expression over lines: newlines are spaces.
        text = " ".join(binding.text.split("\n"))
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as exc:
            raise self._error(binding, f"cannot parse '{_shorten(text)}': {exc.msg}") from None
        except (RecursionError, MemoryError):
            raise self._error(binding, f"cannot parse '{_shorten(text)}': too complex") from None
        except ValueError as exc:  # null bytes, which spec.py already refuses
            raise self._error(binding, f"cannot parse '{_shorten(text)}': {exc}") from None
        try:
            expr = self._value(tree.body, 0)
        except _Located as exc:
            raise self._error(binding, str(exc)) from None
        return _Let(expr, self._depth, self._nodes)

    def _error(self, binding: Binding, message: str) -> SpecError:
        return SpecError(self.spec.path, binding.line, message)

    def _count(self, depth: int, nodes: int = 1) -> None:
        """Account for `nodes` more nodes reaching down to `depth`; refuse trees too big."""
        self._nodes += nodes
        self._depth = max(self._depth, depth)
        if depth > MAX_DEPTH:
            raise _Located(
                f"expression is nested more than {MAX_DEPTH} levels deep, counting the intermediates it uses"
            )
        if self._nodes > MAX_NODES:
            raise _Located(f"expression has more than {MAX_NODES} terms, counting each use of an intermediate in full")

    def _lower(self, node: ast.AST, depth: int) -> Expr:
        self._count(depth)
        d = depth + 1
        if isinstance(node, ast.Constant):
            return _constant(node.value)
        if isinstance(node, ast.Name):
            return self._resolve(node.id, depth)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
            operand = self._value(node.operand, d)
            return operand if isinstance(node.op, ast.UAdd) else Unary("-", operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
            left, right = self._value(node.left, d), self._value(node.right, d)
            if _is_inf(left) or _is_inf(right):
                # inf is a symbol to sympy, which would cancel it (inf - inf is 0, 0 * inf is 0;
                # torch gives NaN): refused rather than silently wrong.
                raise _Located(f"'{_snippet(node)}': inf takes no arithmetic; use it in comparisons, where's "
                               "branches, max, min and clamp")
            return Binary(_BINARY_OPS[type(node.op)], left, right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            if isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.MatMult):
                return self._lowrank(node)
            if not isinstance(node.left, ast.Name) or node.left.id in self.lets:
                return self._hidden_matmul(node, d)
            matmul = self._matmul(node)
            chunks = self.chunks[matmul.b]
            if chunks > 1:
                raise _Located(f"'{_snippet(node)}' holds {chunks} chunks along its last dim, as {matmul.b} does: "
                               f"use chunk({_snippet(node)}, 0) ... chunk({_snippet(node)}, {chunks - 1})")
            return matmul
        if isinstance(node, ast.BinOp) and type(node.op) in _LOGIC_OPS:
            return Logic(_LOGIC_OPS[type(node.op)], (self._condition(node.left, d), self._condition(node.right, d)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            return Logic("~", (self._condition(node.operand, d),))
        if isinstance(node, ast.BoolOp) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)):
            raise _Located(
                f"unsupported operator in {_snippet(node)}: combine conditions with & | ~, each comparison in "
                "parentheses, as in (x > 0) & (x < 1)"
            )
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):
            raise _Located(
                f"unsupported operator in {_snippet(node)} (supported: + - * / ** and comparisons, "
                "combined by & | ~)"
            )
        if isinstance(node, ast.Compare):
            if len(node.ops) != 1 or type(node.ops[0]) not in _COMPARE_OPS:
                hint = ""
                if any(isinstance(n, ast.BinOp) and type(n.op) in _LOGIC_OPS for n in ast.walk(node)):
                    hint = " (& and | bind tighter than comparisons: parenthesize each, as in (x > 0) & (x < 1))"
                raise _Located(f"only single comparisons (<, <=, >, >=, ==, !=) are supported{hint}")
            return Compare(
                _COMPARE_OPS[type(node.ops[0])], self._value(node.left, d), self._value(node.comparators[0], d)
            )
        if isinstance(node, ast.Call):
            return self._call(node, d)
        raise _Located(f"unsupported syntax: {_snippet(node)}")

    def _value(self, node: ast.AST, depth: int) -> Expr:
        """A numeric operand: comparisons only make sense as where's condition."""
        expr = self._lower(node, depth)
        if isinstance(expr, Compare) and isinstance(node, ast.Name):
            raise _Located(f"'{node.id}' is a bool input, a condition: use it in where(...), as in where({node.id}, x, 0.0)")
        if isinstance(expr, CONDITIONS):
            raise _Located("a comparison can only be the first argument of where(...)")
        return expr

    def _condition(self, node: ast.AST, depth: int) -> Expr:
        """where's condition, or an operand of & | ~ in it: a comparison, or comparisons combined."""
        expr = self._lower(node, depth)
        if not isinstance(expr, CONDITIONS):
            raise _Located(
                f"& | ~ combine conditions, and {_snippet(node)} is not one: write a comparison, as in (x > 0) & (y < 1)"
            )
        return expr

    def _resolve(self, name: str, depth: int) -> Expr:
        if name in self.inputs:
            if self.chunks[name] > 1 and self.chunk_dims[name] != -1:
                raise _Located(f"'{name}' holds its chunks along its first dim: only a matmul reads it, as "
                               f"chunk(x @ T({name}), 0)")
            if self.chunks[name] > 1:
                raise _Located(
                    f"'{name}' holds {self.chunks[name]} chunks along its last dim: use chunk({name}, 0) "
                    f"... chunk({name}, {self.chunks[name] - 1})"
                )
            self.used.add(name)
            if name in self.bools:  # a condition: where(mask, x, 0.0), ~mask, mask & (x > 0)
                return Compare("!=", InputRef(name), Const(0))
            return InputRef(name)
        if name in self.scalars:
            self.used.add(name)
            return ParamRef(name)
        if name in self.lets:
            self.used.add(name)
            let = self.lets[name]
            self._count(depth + let.depth, let.nodes - 1)  # its root is this name's node
            return let.expr
        if name in LITERALS:
            return Const(LITERALS[name])
        if name == "col":
            if not any(d and d[-1] != "1" for d in self.dims.values()):
                raise _Located("'col' is the element's index along the last dim, and no input of this op has one")
            return Col()
        if name in self.choices:
            raise _Located(f"'{name}' is a choice of function; call it, as in {name}(x)")
        if name in FUNCTIONS or name in BUILTINS:
            raise _Located(f"'{name}' is a function; call it, as in {name}(x)")
        if name in self.outputs:
            raise _Located(f"'{name}' is an output, which expressions cannot use; compute it in 'let' to reuse it")
        known = sorted([*self.inputs, *self.scalars, *self.lets])
        raise _Located(f"unknown name '{name}' (known: {', '.join(known)})")

    def _call(self, node: ast.Call, depth: int) -> Expr:
        if not isinstance(node.func, ast.Name):
            raise _Located(f"unsupported call: {_snippet(node)} (call a function by its name)")
        name = node.func.id
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise _Located(f"{name}(...) takes positional arguments only")
        if name in self.choices:
            param = self.choices[name]
            arity = FUNCTIONS[param.choices[0]].arity
            self._check_arity(name, len(node.args), arity)
            self.used.add(name)
            return ChoiceCall(name, tuple(self._value(a, depth) for a in node.args))
        if name == "where":
            self._check_arity(name, len(node.args), BUILTINS[name])
            cond = self._lower(node.args[0], depth)
            if not isinstance(cond, CONDITIONS):
                raise _Located("where's first argument must be a comparison, as in where(x > 0, x, 0)")
            return Where(cond, self._value(node.args[1], depth), self._value(node.args[2], depth))
        if name == "dropout":
            return self._dropout(node, depth)
        if name in REDUCTIONS and (len(node.args) == 1 or name in ("sum", "mean")):
            return self._reduce(name, node, depth)
        if name in REDUCTIONS and len(node.args) != 2:
            raise _Located(f"{name}() takes 1 argument (a row reduction) or 2 (elementwise), got {len(node.args)}")
        if name == "chunk":
            return self._chunk(node)
        if name == "T":
            raise _Located("T(...) transposes a matmul's right operand: write x @ T(weight), weight [N, K]")
        if name == "take":
            return self._take(node, depth)
        if name in FUNCTIONS:
            self._check_arity(name, len(node.args), FUNCTIONS[name].arity)
            return Call(name, tuple(self._value(a, depth) for a in node.args))
        if name in self.inputs or name in self.scalars or name in self.lets:
            raise _Located(f"'{name}' is not a function")
        raise _Located(f"unknown function '{name}' (known: {', '.join(known_function_names())})")

    def _dropout(self, node: ast.Call, depth: int) -> Dropout:
        self._check_arity("dropout", len(node.args), BUILTINS["dropout"])
        p_node = node.args[1]
        param = self.scalars.get(p_node.id) if isinstance(p_node, ast.Name) else None
        if param is None or param.type != "float":
            raise _Located("dropout's second argument must be the name of a float param, as in dropout(x, p)")
        # The kernel turns p into a keep threshold and a scale 1 / (1 - p): p must be a
        # probability. The param's declaration is what to fix, so the error points there.
        if param.min is None or param.max is None or param.min < 0 or param.max > 1:
            raise SpecError(
                self.spec.path,
                param.line,
                f"param '{param.name}' is dropout's p, so its range must lie in [0, 1]: give it min: 0.0 and max: 1.0",
            )
        self.used.add(param.name)
        stream = len(self.dropouts)
        self.dropouts.append(None)  # type: ignore[arg-type] - this dropout's place, filled below
        self.dropouts[stream] = Dropout(self._value(node.args[0], depth), param.name, stream)
        return self.dropouts[stream]

    def _reduce(self, name: str, node: ast.Call, depth: int) -> Reduce:
        self._check_arity(name, len(node.args), 1)
        value = self._value(node.args[0], depth)
        along, across = _row_shape(value, self.dims, {})
        if not along:
            if not any(d for d in self.dims.values()) and self.dims:
                raise _Located(f"{name}(...) reduces over the last dim, and this op's inputs are 0-d: there is none")
            raise _Located(
                f"{name}({_snippet(node.args[0])}) reduces over the last dim, along which its argument is "
                "constant (built from reductions, [..., 1] inputs and params only)"
            )
        if not across:
            raise _Located(
                f"{name}({_snippet(node.args[0])}) reduces an expression of [N]-shaped inputs only: the same "
                "value for every row; reduce an expression of a full-shape input such as [..., N]"
            )
        return Reduce(name, value)

    def _take(self, node: ast.Call, depth: int) -> Reduce:
        """take(x, target): x at column target, one value per row. Sugar for
        sum(where(col == target, x, 0.0)), so its gradient is the scatter back, and a target
        outside [0, N) picks nothing (0.0): nothing is read out of bounds."""
        self._check_arity("take", len(node.args), BUILTINS["take"])
        source, target = node.args
        if not (isinstance(target, ast.Name) and target.id in self.integers and self.dims[target.id][-1:] == ("1",)):
            raise _Located(
                f"take's second argument must be the name of an integer input with one index per row, "
                f"as target: {{dims: [..., 1], dtype: int64}}; got {_snippet(target)}"
            )
        value = self._value(source, depth)
        if not _row_shape(value, self.dims, {})[0]:
            raise _Located(
                f"take({_snippet(source)}, {target.id}) picks an element along the last dim, along which its "
                "first argument is constant (built from reductions, [..., 1] inputs and params only)"
            )
        self._count(depth + 2, 4)  # the sum, where, comparison and 0.0 it stands for
        self.used.add(target.id)
        return Reduce("sum", Where(Compare("==", Col(), InputRef(target.id)), value, Const(0.0)))

    def _matmul(self, node: ast.BinOp) -> MatMul:
        """`a @ b` or `a @ T(b)`: a [..., K] and b [K, N] (or [N, K] under T), float inputs."""
        a, b, transposed = self._operands(node)
        self.used |= {a, b}
        matmul = MatMul(a, b, transposed)
        self.matmuls.setdefault(matmul, self._binding)
        return matmul

    def _lowrank(self, node: ast.BinOp) -> LowRank:
        """`(a @ T(down)) @ T(up)`: down [R, K] and up [N, R] (each [K, R], [R, N] without T); the
        inner product [..., R] is read by the outer one alone (LoRA's)."""
        a, down, down_transposed = self._operands(node.left, "R")
        up, up_transposed = self._right_operand(node, "a low-rank product's outer operand is an input, as "
                                                      "(x @ T(lora_a)) @ T(lora_b)")
        for name in (down, up):
            if self.chunks[name] > 1:
                raise _Located(f"'{_snippet(node)}': '{name}' holds chunks; a low-rank product's operands cannot")
        if up in (a, down):
            raise _Located(f"'{_snippet(node)}': '{up}' is read twice; the low-rank product takes three inputs")
        rank = self.dims[down][0 if down_transposed else 1]
        up_dims = self.dims[up]
        if len(up_dims) != 2 or "1" in up_dims or "..." in up_dims:
            raise _Located(f"'{_snippet(node)}': '{up}' must have two named dims, as "
                           f"{f'[N, {rank}]' if up_transposed else f'[{rank}, N]'}")
        if up_dims[1 if up_transposed else 0] != rank:
            raise _Located(f"'{_snippet(node)}': {up}'s {'last' if up_transposed else 'first'} dim "
                           f"{up_dims[1 if up_transposed else 0]} is not the inner product's last dim {rank}")
        self.used |= {a, down, up}
        lowrank = LowRank(a, down, up, down_transposed, up_transposed)
        self.lowranks.setdefault(lowrank, self._binding)
        return lowrank

    def _hidden_matmul(self, node: ast.BinOp, depth: int) -> MatMul:
        """`f(a @ T(weight) + bias) @ T(b)`: the matmul of a hidden layer's [..., H] value (an
        MLP's two layers), f elementwise over the layer's own product and [H] inputs and params."""
        b, transposed = self._right_operand(node, _MATMUL_USAGE)
        expr = self._value(node.left, depth)
        nodes = list(walk(expr))
        inner = list(dict.fromkeys(n for n in nodes if isinstance(n, MatMul)))
        text = _snippet(node.left)
        refused = [(Dropout, "dropout"), (Reduce, "a row reduction"), (Col, "col"), (LowRank, "a low-rank product"),
                   (ProductChunk, "a chunk of a product"), (ChunkRef, "a chunk of an input")]
        for kind, what in refused:
            if any(isinstance(n, kind) for n in nodes):
                raise _Located(f"'{text}': {what} in a hidden layer is not supported yet")
        if len(inner) != 1 or inner[0].hidden is not None:
            raise _Located(f"'{_snippet(node)}': {_MATMUL_USAGE}")
        first = inner[0]
        if self.chunks[first.b] > 1 or self.chunks[b] > 1:
            raise _Located(f"'{_snippet(node)}': a hidden layer's matmuls take weights without chunks")
        width = self.dims[first.b][0 if first.transposed else 1]
        names = tuple(dict.fromkeys(n.name for n in nodes if isinstance(n, InputRef)))
        for name in names:
            if name in self.bools or name in self.integers:
                raise _Located(f"'{text}': '{name}' is a {'bool' if name in self.bools else 'integer'} input; the "
                               "hidden layer's function takes float inputs only (for now)")
            if self.dims[name] != (width,):
                raise _Located(f"'{text}': '{name}' {_declared(self.dims[name])} is read by the hidden layer, whose "
                               f"function takes float inputs of one value per hidden column, [{width}]")
        b_dims = self.dims[b]
        if len(b_dims) != 2 or "1" in b_dims or "..." in b_dims:
            raise _Located(f"'{_snippet(node)}': '{b}' must have two named dims, as "
                           f"{f'[N, {width}]' if transposed else f'[{width}, N]'}")
        k = b_dims[1] if transposed else b_dims[0]
        if k != width:
            raise _Located(f"'{_snippet(node)}': the hidden layer is [..., {width}] and {b}'s "
                           f"{'last' if transposed else 'first'} dim is {k}")
        if b in (first.a, first.b) or b in names:
            raise _Located(f"'{_snippet(node)}': '{b}' is read twice; the second matmul takes a weight of its own")
        self.matmuls.pop(first, None)  # the layer's own, not the op's (_check_matmul looks again)
        self.used.add(b)
        matmul = MatMul(first.a, b, transposed, hidden=Hidden(first.b, first.transposed, names, unparse(expr)))
        self.matmuls.setdefault(matmul, self._binding)
        self.hiddens[matmul] = expr
        return matmul

    def _right_operand(self, node: ast.BinOp, usage: str) -> tuple[str, bool]:
        """A matmul's right operand: an input's name, and whether it is written T(...)."""
        right, transposed = node.right, False
        if (isinstance(right, ast.Call) and isinstance(right.func, ast.Name) and right.func.id == "T"
                and len(right.args) == 1 and not right.keywords):
            right, transposed = right.args[0], True
        if not isinstance(right, ast.Name):
            raise _Located(f"'{_snippet(node)}': {usage}")
        self._check_operand(node, right.id, usage)
        return right.id, transposed

    def _check_operand(self, node: ast.BinOp, name: str, usage: str) -> None:
        if name not in self.inputs:
            raise _Located(f"'{_snippet(node)}': '{name}' is not an input; {usage}")
        if name in self.bools or name in self.integers:
            raise _Located(f"'{_snippet(node)}': '{name}' must be a float input")

    def _operands(self, node: ast.BinOp, width: str = "N") -> tuple[str, str, bool]:
        """(a, b, transposed) of `a @ b` or `a @ T(b)`, checked (b's other dim named `width` in errors)."""
        usage = _MATMUL_USAGE
        b, transposed = self._right_operand(node, usage)
        if not isinstance(node.left, ast.Name):
            raise _Located(f"'{_snippet(node)}': {usage}")
        self._check_operand(node, node.left.id, usage)
        a = node.left.id
        # b's chunks side by side along the product's columns: its first dim under T ([2N, K],
        # nn.Linear's layout of two projections), its last without ([K, 2N]); a holds none.
        if self.chunks[a] > 1:
            raise _Located(f"'{_snippet(node)}': '{a}' holds chunks, and a matmul's left operand cannot; its right "
                           "operand may ([2N, K] under T, [K, 2N] without)")
        if self.chunks[b] > 1 and self.chunk_dims[b] != (0 if transposed else -1):
            declared = "[K, 2N]" if transposed else "[2N, K]"
            raise _Located(f"'{_snippet(node)}': '{b}' {declared} holds its chunks along its "
                           f"{'last' if transposed else 'first'} dim: read it as "
                           f"chunk({a} @ {b if transposed else f'T({b})'}, k), or declare it "
                           f"{'[2N, K]' if transposed else '[K, 2N]'}")
        if a == b:  # its gradient would be the sum of two matmuls of g, which the backward does not form
            raise _Located(f"'{_snippet(node)}': a matmul of an input with itself is not supported yet")
        a_dims, b_dims = self.dims[a], self.dims[b]
        if not a_dims or a_dims[-1] in ("1", "..."):
            raise _Located(f"'{_snippet(node)}': '{a}' must have a named last dim, as [..., K]")
        if len(b_dims) != 2 or "1" in b_dims or "..." in b_dims:
            want = f"[{width}, K]" if transposed else f"[K, {width}]"
            raise _Located(f"'{_snippet(node)}': '{b}' must have two named dims, as {want}")
        k = b_dims[1] if transposed else b_dims[0]
        if k != a_dims[-1]:
            hint = " (nn.Linear's [N, K] weight is written x @ T(weight))" if not transposed and b_dims[1] == a_dims[-1] else ""
            raise _Located(f"'{_snippet(node)}': {a}'s last dim {a_dims[-1]} is not {b}'s "
                           f"{'last' if transposed else 'first'} dim {k}{hint}")
        return a, b, transposed

    def _chunk(self, node: ast.Call) -> ChunkRef | ProductChunk:
        self._check_arity("chunk", len(node.args), BUILTINS["chunk"])
        source, index = node.args
        matmul = None
        if isinstance(source, ast.BinOp) and isinstance(source.op, ast.MatMult):
            if isinstance(source.left, ast.BinOp) and isinstance(source.left.op, ast.MatMult):
                raise _Located(f"'{_snippet(source)}': a low-rank product holds no chunks")
            if not isinstance(source.left, ast.Name) or source.left.id in self.lets:
                raise _Located(f"'{_snippet(source)}': the product of a hidden layer holds no chunks (its matmuls "
                               "take weights without chunks)")
            matmul = self._matmul(source)
            count = self.chunks[matmul.b]
            if count == 1:
                raise _Located(f"'{_snippet(source)}' holds no chunks: its right operand would be declared "
                               f"{'[2N, K]' if matmul.transposed else '[K, 2N]'}")
        elif not (isinstance(source, ast.Name) and self.chunks.get(source.id, 1) > 1):
            raise _Located("chunk's first argument must be an input declared with a chunked last dim, as x: [..., 2N], "
                           "or a matmul whose right operand holds chunks")
        elif self.chunk_dims[source.id] != -1:
            raise _Located(f"'{source.id}' holds its chunks along its first dim: only a matmul reads it, as "
                           f"chunk(x @ T({source.id}), 0)")
        else:
            count = self.chunks[source.id]
        if not (isinstance(index, ast.Constant) and type(index.value) is int and 0 <= index.value < count):
            raise _Located(f"chunk's second argument must be a whole number from 0 to {count - 1}")
        if matmul is not None:
            return ProductChunk(matmul, index.value, count)
        self.used.add(source.id)
        return ChunkRef(source.id, index.value)

    @staticmethod
    def _check_arity(name: str, got: int, want: int) -> None:
        if got != want:
            plural = "argument" if want == 1 else "arguments"
            raise _Located(f"{name}() takes {want} {plural}, got {got}")


def _constant(value: object) -> Const:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Located(f"unsupported constant {_shorten(repr(value))}: only numbers")
    if isinstance(value, float) and not math.isfinite(value):  # isfinite(10**400) would overflow
        raise _Located(f"constant {value!r} is not finite")
    limit, limit_text = (MAX_INT_MAGNITUDE, "2**53") if isinstance(value, int) else (MAX_FLOAT_MAGNITUDE, "1e30")
    if abs(value) > limit:
        raise _Located(f"constant {_shorten(repr(value))} is out of range (at most {limit_text} in magnitude)")
    return Const(value)


def _call_nesting(expr: Expr, memo: dict) -> int:
    """The longest chain of calls inside calls; trees share nodes through lets, hence memo."""
    key = id(expr)
    if key not in memo:
        depth = max((_call_nesting(c, memo) for c in _children(expr)), default=0)
        memo[key] = depth + isinstance(expr, (Call, ChoiceCall))
    return memo[key]


def _has_reductions(outputs) -> bool:
    return any(isinstance(node, Reduce) for _, expr in outputs for node in walk(expr))


def _row_shape(expr: Expr, dims: dict[str, tuple[str, ...]], memo: dict) -> tuple[bool, bool]:
    """Whether a value may vary along a row (over the last dim) and across rows."""
    key = id(expr)
    if key not in memo:
        if isinstance(expr, (InputRef, ChunkRef)):
            d = dims[expr.name]
            memo[key] = (bool(d) and d[-1] != "1", len(d) > 1 or (bool(d) and d[0] == "..."))
        elif isinstance(expr, Col):  # as an [N] input
            memo[key] = (True, False)
        elif isinstance(expr, (MatMul, ProductChunk, LowRank)):  # [..., N]
            memo[key] = (True, True)
        elif isinstance(expr, Reduce):
            memo[key] = (False, _row_shape(expr.value, dims, memo)[1])
        else:
            shapes = [_row_shape(c, dims, memo) for c in _children(expr)]
            memo[key] = (any(a for a, _ in shapes), any(b for _, b in shapes))
    return memo[key]


def row_constant(expr: Expr, dims: dict[str, tuple[str, ...]]) -> bool:
    """Constant along each row: built from reductions, [..., 1] inputs, params and numbers."""
    return not _row_shape(expr, dims, {})[0]


def _children(expr: Expr) -> tuple:
    if isinstance(expr, Unary):
        return (expr.operand,)
    if isinstance(expr, (Binary, Compare)):
        return (expr.left, expr.right)
    if isinstance(expr, (Call, ChoiceCall, Logic)):
        return expr.args
    if isinstance(expr, Where):
        return (expr.cond, expr.if_true, expr.if_false)
    if isinstance(expr, (Dropout, Reduce)):
        return (expr.value,)
    return ()


def _is_inf(expr: Expr) -> bool:
    """The literal inf or -inf."""
    if isinstance(expr, Unary):
        expr = expr.operand
    return isinstance(expr, Const) and expr.value in (math.inf, -math.inf)


def _check_all_used(spec: OpSpec, scope: _Scope) -> None:
    for item in (*spec.inputs, *spec.params):
        if item.name not in scope.used:
            kind = "input" if item in spec.inputs else "param"
            raise SpecError(spec.path, item.line, f"{kind} '{item.name}' is never used")
    for binding in spec.lets:
        if binding.name not in scope.used:
            raise SpecError(spec.path, binding.line, f"intermediate '{binding.name}' is never used")


def _check_matmul(spec: OpSpec, scope: _Scope, outputs) -> MatMul | None:
    """An op takes one matmul (and at most one low-rank product of the same left operand
    beside it), and (for now) no row reduction, col or output of another dtype or in parts
    beside it; their operands are read only through them."""
    lowranks = [(r, b.line) for r, b in scope.lowranks.items()]
    if not scope.matmuls:
        if lowranks:
            lowrank, line = lowranks[0]
            raise SpecError(spec.path, line, f"{lowrank.text} is a low-rank product, which an op adds to a matmul of "
                            f"{lowrank.a}, as {lowrank.a} @ T(weight) + ...; this op has none")
        return None
    (first, line), *others = [(m, b.line) for m, b in scope.matmuls.items()]
    if others:
        second, second_line = others[0]
        raise SpecError(spec.path, second_line, f"an op takes one matmul: {second.text} here, {first.text} "
                        f"at line {line}")
    if lowranks and first.hidden is not None:
        raise SpecError(spec.path, lowranks[0][1], f"a low-rank product beside a hidden layer ({first.text}) is not "
                        "supported yet")
    if lowranks:
        first = _with_lowrank(spec, scope, first, lowranks)
    nodes = [node for _, expr in outputs for node in walk(expr)]  # a matmul's operands are not its nodes
    products = {n.matmul if isinstance(n, ProductChunk) else n for n in nodes if isinstance(n, (MatMul, ProductChunk))}
    others = products - {replace(first, lowrank=None)}
    if others:  # a hidden layer's own matmul read elsewhere too
        raise SpecError(spec.path, line, f"an op takes one matmul: {first.text} and {others.pop().text}")
    read = {n.name for n in nodes if isinstance(n, (InputRef, ChunkRef))}  # elementwise
    both = [n for n in first.operands if n in read]
    if both:
        product = first.lowrank.text if first.lowrank and both[0] in (first.lowrank.down, first.lowrank.up) else first.text
        raise SpecError(spec.path, line, f"'{both[0]}' is an operand of {product} and cannot also be read "
                        "elementwise")
    unsupported = [(Reduce, "row reductions (sum, mean, max, min, take)"), (Col, "col")]
    for kind, what in unsupported:
        if any(isinstance(node, kind) for node in nodes):
            raise SpecError(spec.path, line, f"{what} in an op with a matmul ({first.text}) are not supported yet"
                            if what.startswith("row") else f"{what} in an op with a matmul ({first.text}) is not "
                            "supported yet")
    for binding in spec.outputs:
        if binding.parts or binding.dtype or not binding.differentiable:
            raise SpecError(spec.path, binding.line, f"output '{binding.name}': a concatenated output or one of "
                            f"its own dtype is not supported yet in an op with a matmul ({first.text})")
    return first


_MATMUL_USAGE = ("@ multiplies two inputs, as x @ weight (weight [K, N]) or x @ T(weight) (weight [N, K]); a "
                 "low-rank product, as (x @ T(lora_a)) @ T(lora_b); or a hidden layer, a function of one matmul "
                 "and [H] inputs, as relu(x @ T(w1) + b1) @ T(w2)")


def _declared(dims: tuple[str, ...]) -> str:
    return "[" + ", ".join(dims) + "]"


def _with_lowrank(spec: OpSpec, scope: _Scope, matmul: MatMul, lowranks) -> MatMul:
    """The matmul with its low-rank product: one, of the same left operand, as wide as it."""
    (lowrank, line), *others = lowranks
    if others:
        raise SpecError(spec.path, others[0][1], f"an op takes one low-rank product: {others[0][0].text} here, "
                        f"{lowrank.text} at line {line}")
    if lowrank.a != matmul.a:
        raise SpecError(spec.path, line, f"{lowrank.text} multiplies {lowrank.a}, and the op's matmul {matmul.text} "
                        f"multiplies {matmul.a}: a low-rank product takes the matmul's left operand")
    if scope.chunks[matmul.b] > 1:
        raise SpecError(spec.path, line, f"a low-rank product beside a matmul in chunks ({matmul.text}) is not "
                        "supported yet")
    shared = {lowrank.down, lowrank.up} & {matmul.b}
    if shared:
        raise SpecError(spec.path, line, f"'{shared.pop()}' is read by {matmul.text} and {lowrank.text}; the "
                        "low-rank product takes inputs of its own")
    n = scope.dims[matmul.b][0 if matmul.transposed else 1]
    up_n = scope.dims[lowrank.up][0 if lowrank.up_transposed else 1]
    if up_n != n:
        raise SpecError(spec.path, line, f"{lowrank.text} is [..., {up_n}] and {matmul.text} [..., {n}]: a "
                        "low-rank product is as wide as the matmul's")
    return replace(matmul, lowrank=lowrank)


def _shorten(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def _snippet(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # noqa: BLE001 - only for the message
        text = type(node).__name__
    return _shorten(text)


# Python's binding strengths: unary minus binds tighter than * and less than ** on its left.
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "**": 4}
_UNARY, _ATOM = 3, 5


def unparse(expr: Expr, names: dict[int, str] | None = None) -> str:
    """Spec text for a tree, with only the parentheses Python needs. A subtree that an
    intermediate stands for is written as its name: `names` maps id(subtree) to the name."""
    return _unparse(expr, names or {}, top=True)[0]


def _unparse(e: Expr, names: dict[int, str], top: bool = False) -> tuple[str, int]:
    if not top and id(e) in names:
        return names[id(e)], _ATOM
    if isinstance(e, Const):
        return ("inf" if e.value == math.inf else repr(e.value)), _ATOM
    if isinstance(e, (InputRef, ParamRef)):
        return e.name, _ATOM
    if isinstance(e, ChunkRef):
        return f"chunk({e.name}, {e.index})", _ATOM
    if isinstance(e, Col):
        return "col", _ATOM
    if isinstance(e, (MatMul, LowRank)):
        return e.text, _PRECEDENCE["*"]
    if isinstance(e, ProductChunk):
        return f"chunk({e.matmul.text}, {e.index})", _ATOM
    if isinstance(e, Unary):
        text, strength = _unparse(e.operand, names)
        return "-" + (text if strength >= _UNARY else f"({text})"), _UNARY
    if isinstance(e, (Binary, Compare)):
        strength = _PRECEDENCE.get(e.op, 0)
        (left, left_strength), (right, right_strength) = _unparse(e.left, names), _unparse(e.right, names)
        if e.op == "**":  # right-associative, and its right operand may be a unary minus
            left_ok, right_ok = left_strength > strength, right_strength >= _UNARY
        else:
            left_ok, right_ok = left_strength >= strength, right_strength > strength
        left = left if left_ok else f"({left})"
        right = right if right_ok else f"({right})"
        return f"{left} {e.op} {right}", strength
    if isinstance(e, Logic):
        parts = [_unparse(a, names)[0] for a in e.args]
        if e.op == "~":
            return f"~({parts[0]})", _ATOM
        return f" {e.op} ".join(f"({p})" for p in parts), 0
    if isinstance(e, (Call, ChoiceCall)):
        args = ", ".join(_unparse(a, names)[0] for a in e.args)
        return f"{e.func if isinstance(e, Call) else e.param}({args})", _ATOM
    if isinstance(e, Where):
        parts = ", ".join(_unparse(a, names)[0] for a in (e.cond, e.if_true, e.if_false))
        return f"where({parts})", _ATOM
    if isinstance(e, Dropout):
        return f"dropout({_unparse(e.value, names)[0]}, {e.p})", _ATOM
    if isinstance(e, Reduce):
        return f"{e.op}({_unparse(e.value, names)[0]})", _ATOM
    raise TypeError(f"unknown IR node {type(e).__name__}")


def walk(expr: Expr):
    """Every node of a tree, parents before children."""
    yield expr
    for child in _children(expr):
        yield from walk(child)
