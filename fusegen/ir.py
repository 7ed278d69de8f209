"""The expression IR: a tiny closed set of frozen nodes, parsed from spec text.

Expressions are parsed with Python's `ast` in eval mode and a strict whitelist: spec
text is never evaluated. Names are resolved here (inputs, params, intermediates) and
calls are checked against the function registry, so later stages see only valid trees.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Union

from .errors import SpecError
from .functions import BUILTINS, FUNCTIONS, known_function_names
from .spec import Binding, ChoiceParam, OpSpec, ScalarParam

MAX_DEPTH = 64
MAX_NODES = 1000


@dataclass(frozen=True)
class Const:
    value: float | int


@dataclass(frozen=True)
class InputRef:
    name: str


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
    cond: Compare
    if_true: "Expr"
    if_false: "Expr"


@dataclass(frozen=True)
class Dropout:
    value: "Expr"
    p: str  # a float param
    stream: int  # which dropout in the spec: each gets its own random numbers


Expr = Union[Const, InputRef, ParamRef, Unary, Binary, Compare, Call, ChoiceCall, Where, Dropout]


@dataclass(frozen=True)
class OpIR:
    spec: OpSpec
    # Intermediates are inlined: a name bound in `let` stands for its whole tree.
    outputs: tuple[tuple[str, Expr], ...]
    dropouts: tuple[Dropout, ...]


_BINARY_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}
_COMPARE_OPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_UNARY_OPS = {ast.USub: "-", ast.UAdd: "+"}


class _Located(Exception):
    pass


def build_ir(spec: OpSpec) -> OpIR:
    """Parse every `let` and output of a spec into resolved IR trees."""
    scope = _Scope(spec)
    outputs = []
    for binding in spec.lets:
        scope.lets[binding.name] = scope.parse(binding)
    for binding in spec.outputs:
        outputs.append((binding.name, scope.parse(binding)))
    _check_all_used(spec, scope)
    return OpIR(spec=spec, outputs=tuple(outputs), dropouts=tuple(scope.dropouts))


class _Scope:
    def __init__(self, spec: OpSpec):
        self.spec = spec
        self.inputs = {i.name for i in spec.inputs}
        self.scalars = {p.name: p for p in spec.params if isinstance(p, ScalarParam)}
        self.choices = {p.name: p for p in spec.params if isinstance(p, ChoiceParam)}
        self.lets: dict[str, Expr] = {}
        self.dropouts: list[Dropout] = []
        self.used: set[str] = set()
        self._nodes = 0

    def parse(self, binding: Binding) -> Expr:
        self._nodes = 0
        try:
            tree = ast.parse(binding.text, mode="eval")
        except SyntaxError as exc:
            raise self._error(binding, f"cannot parse expression for '{binding.name}': {exc.msg}") from None
        except (RecursionError, MemoryError, ValueError):
            raise self._error(binding, f"cannot parse expression for '{binding.name}': too complex") from None
        try:
            return self._lower(tree.body, 0)
        except _Located as exc:
            raise self._error(binding, f"in '{binding.name}': {exc}") from None

    def _error(self, binding: Binding, message: str) -> SpecError:
        return SpecError(self.spec.path, binding.line, message)

    def _lower(self, node: ast.AST, depth: int) -> Expr:
        self._nodes += 1
        if depth > MAX_DEPTH:
            raise _Located(f"expression is nested more than {MAX_DEPTH} levels deep; split it with 'let'")
        if self._nodes > MAX_NODES:
            raise _Located(f"expression has more than {MAX_NODES} terms; split it with 'let'")
        d = depth + 1
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise _Located(f"unsupported constant {node.value!r}: only numbers")
            if isinstance(node.value, int) and abs(node.value) >= 2**53:
                raise _Located(f"integer constant {node.value} is too large")
            if node.value != node.value or abs(node.value) == float("inf"):
                raise _Located(f"constant {node.value!r} is not finite")
            return Const(node.value)
        if isinstance(node, ast.Name):
            return self._resolve(node.id)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
            operand = self._value(node.operand, d)
            return operand if isinstance(node.op, ast.UAdd) else Unary("-", operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
            return Binary(_BINARY_OPS[type(node.op)], self._value(node.left, d), self._value(node.right, d))
        if isinstance(node, ast.Compare):
            if len(node.ops) != 1 or type(node.ops[0]) not in _COMPARE_OPS:
                raise _Located("only single comparisons (<, <=, >, >=, ==, !=) are supported")
            return Compare(
                _COMPARE_OPS[type(node.ops[0])], self._value(node.left, d), self._value(node.comparators[0], d)
            )
        if isinstance(node, ast.Call):
            return self._call(node, d)
        raise _Located(f"unsupported syntax '{_snippet(node)}'")

    def _value(self, node: ast.AST, depth: int) -> Expr:
        """A numeric operand: comparisons only make sense as where's condition."""
        expr = self._lower(node, depth)
        if isinstance(expr, Compare):
            raise _Located("a comparison can only be the first argument of where(...)")
        return expr

    def _resolve(self, name: str) -> Expr:
        if name in self.inputs:
            self.used.add(name)
            return InputRef(name)
        if name in self.scalars:
            self.used.add(name)
            return ParamRef(name)
        if name in self.lets:
            self.used.add(name)
            return self.lets[name]
        if name in self.choices:
            raise _Located(f"'{name}' is a choice of function; call it, as in {name}(x)")
        if name in FUNCTIONS or name in BUILTINS:
            raise _Located(f"'{name}' is a function; call it, as in {name}(x)")
        known = sorted([*self.inputs, *self.scalars, *self.lets])
        raise _Located(f"unknown name '{name}' (known: {', '.join(known)})")

    def _call(self, node: ast.Call, depth: int) -> Expr:
        if not isinstance(node.func, ast.Name):
            raise _Located(f"unsupported call '{_snippet(node.func)}': call a function by name")
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
            if not isinstance(cond, Compare):
                raise _Located("where's first argument must be a comparison, as in where(x > 0, x, 0)")
            return Where(cond, self._value(node.args[1], depth), self._value(node.args[2], depth))
        if name == "dropout":
            self._check_arity(name, len(node.args), BUILTINS[name])
            value = self._value(node.args[0], depth)
            p_node = node.args[1]
            if not (isinstance(p_node, ast.Name) and p_node.id in self.scalars and self.scalars[p_node.id].type == "float"):
                raise _Located("dropout's second argument must be the name of a float param, as in dropout(x, p)")
            self.used.add(p_node.id)
            site = Dropout(value, p_node.id, len(self.dropouts))
            self.dropouts.append(site)
            return site
        if name in FUNCTIONS:
            self._check_arity(name, len(node.args), FUNCTIONS[name].arity)
            return Call(name, tuple(self._value(a, depth) for a in node.args))
        if name in self.inputs or name in self.scalars or name in self.lets:
            raise _Located(f"'{name}' is not a function")
        raise _Located(f"unknown function '{name}' (known: {', '.join(known_function_names())})")

    @staticmethod
    def _check_arity(name: str, got: int, want: int) -> None:
        if got != want:
            plural = "argument" if want == 1 else "arguments"
            raise _Located(f"{name}() takes {want} {plural}, got {got}")


def _check_all_used(spec: OpSpec, scope: _Scope) -> None:
    for item in (*spec.inputs, *spec.params):
        if item.name not in scope.used:
            kind = "input" if item in spec.inputs else "param"
            raise SpecError(spec.path, item.line, f"{kind} '{item.name}' is never used")
    for binding in spec.lets:
        if binding.name not in scope.used:
            raise SpecError(spec.path, binding.line, f"intermediate '{binding.name}' is never used")


def _snippet(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # noqa: BLE001 - only for the message
        text = type(node).__name__
    return text if len(text) <= 30 else text[:27] + "..."


def walk(expr: Expr):
    """Every node of a tree, parents before children."""
    yield expr
    if isinstance(expr, Unary):
        yield from walk(expr.operand)
    elif isinstance(expr, (Binary, Compare)):
        yield from walk(expr.left)
        yield from walk(expr.right)
    elif isinstance(expr, (Call, ChoiceCall)):
        for arg in expr.args:
            yield from walk(arg)
    elif isinstance(expr, Where):
        yield from walk(expr.cond)
        yield from walk(expr.if_true)
        yield from walk(expr.if_false)
    elif isinstance(expr, Dropout):
        yield from walk(expr.value)
