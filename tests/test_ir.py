"""ir: expression text → resolved IR trees, through a whitelist of Python's ast; never evaluated."""
import builtins
from pathlib import Path

import pytest

from fusegen import ir
from fusegen.errors import SpecError
from fusegen.ir import (
    Binary,
    Call,
    ChoiceCall,
    Compare,
    Const,
    Dropout,
    InputRef,
    ParamRef,
    Unary,
    Where,
)
from fusegen.spec import load_spec

a, b, c = InputRef("a"), InputRef("b"), InputRef("c")

INPUTS = "inputs:\n  a: [..., N]\n  b: [N]\n  c: [..., N]\n"
PARAMS = """params:
  p: {type: float, default: 0.1, min: 0.0, max: 1.0}
  q: {type: float, default: 0.2, min: 0.0, max: 0.5}
  k: {type: int, default: 2}
  act: {choices: [relu, gelu], default: relu}
  pick: {choices: [min, max], default: max}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "specs" / "x.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _op(tmp_path, outputs: str, lets: str = "", inputs: str = "inputs:\n  a: [..., N]\n", params: str = ""):
    """Line 1 name, 2 doc, then inputs, params, let, outputs: as given."""
    text = f"name: op\ndoc: d\n{inputs}{params}{lets}outputs:\n{outputs}"
    return ir.build_ir(load_spec(_write(tmp_path, text)))


def _expr(tmp_path, text: str) -> ir.Expr:
    """The tree of `y: text`, with inputs a, b, c, and every param declared; unused ones are fine here."""
    used = " + 0 * (p + q + k + act(a) + pick(a, b) + a + b + c)"
    op = _op(tmp_path, f"  y: {text}\n  unused: {used}\n", inputs=INPUTS, params=PARAMS)
    return op.outputs[0][1]


def _error(tmp_path, text: str) -> str:
    """The message for `y: text`, on line 14 of a spec with inputs a, b, c and all params."""
    with pytest.raises(SpecError) as info:
        _op(tmp_path, f"  y: {text}\n", inputs=INPUTS, params=PARAMS)
    return str(info.value)


# ---------------------------------------------------------------------------
# Trees


@pytest.mark.parametrize(
    "text, tree",
    [
        ("a + b * c", Binary("+", a, Binary("*", b, c))),
        ("a * b + c", Binary("+", Binary("*", a, b), c)),
        ("(a + b) * c", Binary("*", Binary("+", a, b), c)),
        ("a - b - c", Binary("-", Binary("-", a, b), c)),
        ("a / b / c", Binary("/", Binary("/", a, b), c)),
        ("a ** b ** c", Binary("**", a, Binary("**", b, c))),
        ("a * b ** 2", Binary("*", a, Binary("**", b, Const(2)))),
        ("-a", Unary("-", a)),
        ("+a", a),
        ("--a", Unary("-", Unary("-", a))),
        ("-a ** 2", Unary("-", Binary("**", a, Const(2)))),
        ("a ** -1", Binary("**", a, Unary("-", Const(1)))),
        ("-a * b", Binary("*", Unary("-", a), b)),
        ("2 * a + 0.5", Binary("+", Binary("*", Const(2), a), Const(0.5))),
        ("1e-3 * a", Binary("*", Const(0.001), a)),
        ("a * p + k", Binary("+", Binary("*", a, ParamRef("p")), ParamRef("k"))),
    ],
)
def test_operators_and_precedence(tmp_path, text, tree):
    assert _expr(tmp_path, text) == tree


def test_constants_keep_int_or_float(tmp_path):
    tree = _expr(tmp_path, "a * 2 + 2.0")
    assert type(tree.left.right.value) is int and type(tree.right.value) is float


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "==", "!="])
def test_comparisons_inside_where(tmp_path, op):
    tree = _expr(tmp_path, f"where(a {op} 0, a, 0.5 * a)")
    assert tree == Where(Compare(op, a, Const(0)), a, Binary("*", Const(0.5), a))


def test_nested_calls(tmp_path):
    tree = _expr(tmp_path, "tanh(exp(a) + max(a, b * 2))")
    assert tree == Call("tanh", (Binary("+", Call("exp", (a,)), Call("max", (a, Binary("*", b, Const(2))))),))


def test_where_nested_in_calls_and_calls_in_where(tmp_path):
    tree = _expr(tmp_path, "relu(where(exp(a) >= b, a, leaky_relu(a, 0.1)))")
    assert tree == Call(
        "relu", (Where(Compare(">=", Call("exp", (a,)), b), a, Call("leaky_relu", (a, Const(0.1)))),)
    )


def test_choice_calls(tmp_path):
    assert _expr(tmp_path, "act(a + b)") == ChoiceCall("act", (Binary("+", a, b),))
    assert _expr(tmp_path, "pick(a, act(b))") == ChoiceCall("pick", (a, ChoiceCall("act", (b,))))


def test_lets_are_inlined_and_shared(tmp_path):
    op = _op(
        tmp_path,
        "  y: u * v\n",
        lets="let:\n  u: a + b\n  v: u - 1\n",
        inputs="inputs:\n  a: [..., N]\n  b: [N]\n",
    )
    u = Binary("+", a, b)
    ((name, tree),) = op.outputs
    assert name == "y"
    assert tree == Binary("*", u, Binary("-", u, Const(1)))
    assert tree.left is tree.right.left  # one tree, not a copy per use


def test_lets_are_kept_by_name_as_the_same_trees(tmp_path):
    op = _op(tmp_path, "  y: u * v\n", lets="let:\n  u: a + 1\n  v: u - 1\n")
    ((_, tree),) = op.outputs
    assert [name for name, _ in op.lets] == ["u", "v"]
    assert dict(op.lets)["u"] is tree.left and dict(op.lets)["v"] is tree.right


@pytest.mark.parametrize(
    "text",
    [
        "0 ** -1", "9 ** 9 ** 9", "(-2) ** 2", "-2 ** 2", "(a ** b) ** c", "a ** -b ** 2", "a - (b - c)",
        "a - b - c", "a / (b * c)", "-(a + b) * c", "a * -b", "--a", "(a + 1) / -(b - 2)", "a * 1e+30",
        "where(a > 0, act(a), dropout(-a, p))", "max(a, log(-2))", "pick(a, k * 2.5)",
    ],
)
def test_unparse_writes_the_text_back(tmp_path, text):
    tree = _expr(tmp_path, text)
    assert ir.unparse(tree) == text
    assert _expr(tmp_path, ir.unparse(tree)) == tree


def test_unparse_names_intermediates(tmp_path):
    op = _op(tmp_path, "  y: u * (u + 1)\n", lets="let:\n  u: a - 1\n")
    ((_, tree),) = op.outputs
    names = {id(expr): name for name, expr in op.lets}
    assert ir.unparse(tree, names) == "u * (u + 1)"
    assert ir.unparse(tree) == "(a - 1) * (a - 1 + 1)"
    assert ir.unparse(dict(op.lets)["u"], names) == "a - 1"  # the tree itself, not its name


def test_outputs_in_order_and_spec_kept(tmp_path):
    op = _op(tmp_path, "  z: a\n  y: -a\n")
    assert [name for name, _ in op.outputs] == ["z", "y"]
    assert op.spec.name == "op"


def test_dropout_streams_are_numbered_in_order_of_appearance(tmp_path):
    op = _op(
        tmp_path,
        "  y: dropout(a, p) + dropout(dropout(d, q), p)\n  z: dropout(d, q) + d\n",
        lets="let:\n  d: dropout(a * 2, p)\n",
        params="params:\n  p: {type: float, default: 0.1, min: 0.0, max: 1.0}\n"
        "  q: {type: float, default: 0.1, min: 0.0, max: 1.0}\n",
    )
    # Lets first, then outputs; left to right; an outer dropout before the ones inside it.
    d0 = Dropout(Binary("*", a, Const(2)), "p", 0)
    assert op.dropouts == (
        d0,
        Dropout(a, "p", 1),
        Dropout(Dropout(d0, "q", 3), "p", 2),
        Dropout(d0, "q", 3),
        Dropout(d0, "q", 4),
    )
    assert [d.stream for d in op.dropouts] == list(range(5))
    y, z = (tree for _, tree in op.outputs)
    assert y == Binary("+", op.dropouts[1], op.dropouts[2])
    assert z == Binary("+", op.dropouts[4], d0)
    # The intermediate is one draw, however many times it is used.
    assert y.right.value.value is z.right is op.dropouts[0]


def test_block_scalar_expression_spans_lines(tmp_path):
    op = _op(tmp_path, "  y: |\n    a *\n    2\n")
    assert op.outputs[0][1] == Binary("*", a, Const(2))


def test_walk_visits_parents_first(tmp_path):
    tree = _expr(tmp_path, "where(a > 0, exp(-a), dropout(b, p))")
    kinds = [type(node).__name__ for node in ir.walk(tree)]
    assert kinds == ["Where", "Compare", "InputRef", "Const", "Call", "Unary", "InputRef", "Dropout", "InputRef"]


# ---------------------------------------------------------------------------
# Nothing is ever evaluated


HOSTILE = [
    ("__import__('os').system('touch pwned')", "unsupported call: __import__('os').system('touch pwned') (call a function by its name)"),
    ("__import__('os')", "unknown function '__import__' (known: T, abs, chunk, clamp, cos, dropout, erf, exp, expm1, floor, gelu, gelu_tanh, identity, leaky_relu, log, log1p, max, mean, min, quick_gelu, relu, round, rsqrt, sigmoid, sign, silu, sin, softplus, sqrt, squared_relu, sum, take, tanh, where)"),
    ("eval('1')", "unknown function 'eval' (known: T, abs, chunk, clamp, cos, dropout, erf, exp, expm1, floor, gelu, gelu_tanh, identity, leaky_relu, log, log1p, max, mean, min, quick_gelu, relu, round, rsqrt, sigmoid, sign, silu, sin, softplus, sqrt, squared_relu, sum, take, tanh, where)"),
    ("a.__class__", "unsupported syntax: a.__class__"),
    ("exp.__globals__", "unsupported syntax: exp.__globals__"),
    ("a[0]", "unsupported syntax: a[0]"),
    ("a[::-1]", "unsupported syntax: a[::-1]"),
    ("(lambda: 1)()", "unsupported call: (lambda: 1)() (call a function by its name)"),
    ("lambda: a", "unsupported syntax: lambda: a"),
    ("f'{a}'", "unsupported syntax: f'{a}'"),
    ("'a'", "unsupported constant 'a': only numbers"),
    ("b'a'", "unsupported constant b'a': only numbers"),
    ("[a, b]", "unsupported syntax: [a, b]"),
    ("(a, b)", "unsupported syntax: (a, b)"),
    ("{a: b}", "unsupported syntax: {a: b}"),
    ("[x for x in a]", "unsupported syntax: [x for x in a]"),
    ("(y := a)", "unsupported syntax: (y := a)"),
    ("a if b else c", "unsupported syntax: a if b else c"),
    ("...", "unsupported constant Ellipsis: only numbers"),
    ("None", "unsupported constant None: only numbers"),
    ("True * a", "unsupported constant True: only numbers"),
    ("2j * a", "unsupported constant 2j: only numbers"),
    ("await a", "unsupported syntax: await a"),
    ("exp(*a)", "exp(...) takes positional arguments only"),
    ("exp(x=a)", "exp(...) takes positional arguments only"),
    ("exp(**a)", "exp(...) takes positional arguments only"),
]


@pytest.mark.parametrize("text, message", HOSTILE, ids=[t for t, _ in HOSTILE])
def test_anything_but_the_language_is_rejected(tmp_path, monkeypatch, text, message):
    monkeypatch.chdir(tmp_path)
    quoted = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    assert _error(tmp_path, quoted) == f"specs/x.yaml:14: {message}"
    assert not (tmp_path / "pwned").exists()


def test_statements_do_not_parse(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _error(tmp_path, "'a; import os'") == "specs/x.yaml:14: cannot parse 'a; import os': invalid syntax"
    assert _error(tmp_path, "'import os'") == "specs/x.yaml:14: cannot parse 'import os': invalid syntax"


def test_parsing_evaluates_nothing(tmp_path, monkeypatch):
    """Building the IR of every kind of node calls no eval or exec (ast.parse compiles only)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("spec text was evaluated")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    tree = _expr(tmp_path, "where(a > 0, act(a) + pick(a, b), -dropout(b ** 2, p)) * k / exp(c)")
    assert isinstance(tree, Binary)


# ---------------------------------------------------------------------------
# Errors: the full `file:line: message`, the line being the expression's


ERRORS = [
    ("gelux(a)", "unknown function 'gelux' (known: T, abs, chunk, clamp, cos, dropout, erf, exp, expm1, floor, gelu, gelu_tanh, identity, leaky_relu, log, log1p, max, mean, min, quick_gelu, relu, round, rsqrt, sigmoid, sign, silu, sin, softplus, sqrt, squared_relu, sum, take, tanh, where)"),
    ("a + z", "unknown name 'z' (known: a, b, c, k, p, q)"),
    ("max()", "max() takes 1 argument (a row reduction) or 2 (elementwise), got 0"),
    ("min(a, b, a)", "min() takes 1 argument (a row reduction) or 2 (elementwise), got 3"),
    ("exp(a, b)", "exp() takes 1 argument, got 2"),
    ("where(a > 0, a)", "where() takes 3 arguments, got 2"),
    ("dropout(a)", "dropout() takes 2 arguments, got 1"),
    ("act(a, b)", "act() takes 1 argument, got 2"),
    ("pick(a)", "pick() takes 2 arguments, got 1"),
    ("a +", "cannot parse 'a +': invalid syntax"),
    ("exp(a", "cannot parse 'exp(a': '(' was never closed"),
    ("a > 0", "a comparison can only be the first argument of where(...)"),
    ("(a > 0) * a", "a comparison can only be the first argument of where(...)"),
    ("exp(a > 0)", "a comparison can only be the first argument of where(...)"),
    ("where(a > 0, a > 1, a)", "a comparison can only be the first argument of where(...)"),
    ("where(a, a, 0)", "where's first argument must be a comparison, as in where(x > 0, x, 0)"),
    ("where(0 < a < 1, a, 0)", "only single comparisons (<, <=, >, >=, ==, !=) are supported"),
    ("where(a in b, a, 0)", "only single comparisons (<, <=, >, >=, ==, !=) are supported"),
    ("where(a is b, a, 0)", "only single comparisons (<, <=, >, >=, ==, !=) are supported"),
    ("a // b", "unsupported operator in a // b (supported: + - * / ** and comparisons, combined by & | ~)"),
    ("a % b", "unsupported operator in a % b (supported: + - * / ** and comparisons, combined by & | ~)"),
    ("a @ b", "'a @ b': 'b' must have two named dims, as [K, N]"),
    ("a & b", "& | ~ combine conditions, and a is not one: write a comparison, as in (x > 0) & (y < 1)"),
    ("~a", "& | ~ combine conditions, and a is not one: write a comparison, as in (x > 0) & (y < 1)"),
    ("not a", "unsupported operator in not a: combine conditions with & | ~, each comparison in parentheses, as in (x > 0) & (x < 1)"),
    ("a and b", "unsupported operator in a and b: combine conditions with & | ~, each comparison in parentheses, as in (x > 0) & (x < 1)"),
    ("a * act", "'act' is a choice of function; call it, as in act(x)"),
    ("a * relu", "'relu' is a function; call it, as in relu(x)"),
    ("dropout + a", "'dropout' is a function; call it, as in dropout(x)"),
    ("a(b)", "'a' is not a function"),
    ("p(a)", "'p' is not a function"),
    ("dropout(a, k)", "dropout's second argument must be the name of a float param, as in dropout(x, p)"),
    ("dropout(a, 0.1)", "dropout's second argument must be the name of a float param, as in dropout(x, p)"),
    ("dropout(a, p * 1)", "dropout's second argument must be the name of a float param, as in dropout(x, p)"),
    ("dropout(a, b)", "dropout's second argument must be the name of a float param, as in dropout(x, p)"),
    ("dropout(a > 0, p)", "a comparison can only be the first argument of where(...)"),
    ("1e400 * a", "constant inf is not finite"),
    ("1e31 * a", "constant 1e+31 is out of range (at most 1e30 in magnitude)"),
    ("9007199254740993 * a", "constant 9007199254740993 is out of range (at most 2**53 in magnitude)"),
    ("1" + "0" * 400 + " * a", "constant 1" + "0" * 36 + "... is out of range (at most 2**53 in magnitude)"),
]


@pytest.mark.parametrize("text, message", ERRORS, ids=[text[:30] for text, _ in ERRORS])
def test_expression_errors(tmp_path, text, message):
    quoted = "'" + text.replace("'", "''") + "'"
    assert _error(tmp_path, quoted) == f"specs/x.yaml:14: {message}"


def test_an_output_is_not_a_name(tmp_path):
    with pytest.raises(SpecError) as info:
        _op(tmp_path, "  y: a\n  z: y + 1\n")
    assert str(info.value) == (
        "specs/x.yaml:7: 'y' is an output, which expressions cannot use; compute it in 'let' to reuse it"
    )


def test_lets_see_only_earlier_names(tmp_path):
    with pytest.raises(SpecError) as info:
        _op(tmp_path, "  y: u\n", lets="let:\n  u: v + 1\n  v: a\n")
    assert str(info.value) == "specs/x.yaml:6: unknown name 'v' (known: a)"
    with pytest.raises(SpecError) as info:
        _op(tmp_path, "  y: u\n", lets="let:\n  u: u + a\n")
    assert str(info.value) == "specs/x.yaml:6: unknown name 'u' (known: a)"


def test_dropout_p_must_be_a_probability(tmp_path):
    """The error points at the param's declaration, which is what needs fixing."""
    for bounds in ("", ", min: 0.0", ", max: 1.0", ", min: -0.5, max: 1.0", ", min: 0.0, max: 2.0"):
        with pytest.raises(SpecError) as info:
            _op(tmp_path, "  y: dropout(a, p)\n", params=f"params:\n  p: {{type: float, default: 0.1{bounds}}}\n")
        assert str(info.value) == (
            "specs/x.yaml:6: param 'p' is dropout's p, so its range must lie in [0, 1]: give it min: 0.0 and max: 1.0"
        )
    narrower = _op(tmp_path, "  y: dropout(a, p)\n", params="params:\n  p: {type: float, default: 0.1, min: 0.0, max: 0.5}\n")
    assert narrower.dropouts == (Dropout(a, "p", 0),)


@pytest.mark.parametrize(
    "kind, declaration, message",
    [
        ("input", "inputs:\n  a: [..., N]\n  b: [N]\n", "specs/x.yaml:5: input 'b' is never used"),
        (
            "param",
            "inputs:\n  a: [..., N]\nparams:\n  s: {type: float, default: 1.0}\n",
            "specs/x.yaml:6: param 's' is never used",
        ),
        (
            "choice",
            "inputs:\n  a: [..., N]\nparams:\n  act: {choices: [relu], default: relu}\n",
            "specs/x.yaml:6: param 'act' is never used",
        ),
    ],
)
def test_unused_names(tmp_path, kind, declaration, message):
    with pytest.raises(SpecError) as info:
        _op(tmp_path, "  y: a\n", inputs=declaration)
    assert str(info.value) == message


def test_unused_intermediate(tmp_path):
    with pytest.raises(SpecError) as info:
        _op(tmp_path, "  y: a\n", lets="let:\n  u: a + 1\n")
    assert str(info.value) == "specs/x.yaml:6: intermediate 'u' is never used"


# ---------------------------------------------------------------------------
# Size: bounded with a clear message, never a RecursionError


def test_depth_limit(tmp_path):
    ok = "-" * (ir.MAX_DEPTH - 1) + "a"  # unary minus: deep, but no function calls
    assert isinstance(_op(tmp_path, f"  y: '{ok}'\n").outputs[0][1], Unary)
    message = f"specs/x.yaml:6: expression is nested more than {ir.MAX_DEPTH} levels deep, counting the intermediates it uses"
    for deep in ("-" * 1990 + "a", "-(" * 100 + "a" + ")" * 100, " + ".join(["a"] * 500)):
        with pytest.raises(SpecError) as info:
            _op(tmp_path, f"  y: '{deep}'\n")
        assert str(info.value) == message


def test_depth_counts_inlined_intermediates(tmp_path):
    half = ir.MAX_DEPTH // 2 + 1
    lets = f"let:\n  u: {'exp(' * half}a{')' * half}\n  v: {'exp(' * half}u{')' * half}\n"
    with pytest.raises(SpecError) as info:
        _op(tmp_path, "  y: v\n", lets=lets)
    assert str(info.value) == (
        f"specs/x.yaml:7: expression is nested more than {ir.MAX_DEPTH} levels deep, counting the intermediates it uses"
    )


def test_size_counts_each_use_of_an_intermediate(tmp_path):
    # Each let doubles the tree: small text, exponential work for sympy if it were let through.
    lets = "let:\n  u0: a\n" + "".join(f"  u{i}: u{i - 1} * u{i - 1}\n" for i in range(1, 30))
    with pytest.raises(SpecError) as info:
        _op(tmp_path, "  y: u29\n", lets=lets)
    assert str(info.value) == (
        f"specs/x.yaml:15: expression has more than {ir.MAX_NODES} terms, counting each use of an intermediate in full"
    )


def test_too_many_parentheses(tmp_path):
    deep = "(" * 300 + "a" + ")" * 300
    with pytest.raises(SpecError) as info:
        _op(tmp_path, f"  y: '{deep}'\n")
    assert str(info.value) == "specs/x.yaml:6: cannot parse '(((((((((((((((((((((((((((((((((((((...': too many nested parentheses"


def test_deeply_nested_functions_are_refused_before_sympy_sees_them(tmp_path):
    """silu nested 12 deep took sympy 10 s to differentiate; the IR refuses past 10."""
    import time

    from fusegen import ir as ir_module
    from fusegen.errors import SpecError
    from fusegen.spec import load_spec

    def spec_with(depth):
        expr = "x"
        for _ in range(depth):
            expr = f"silu({expr})"
        path = tmp_path / f"op{depth}.yaml"
        path.write_text(f"name: op\ndoc: d\ninputs:\n  x: [...]\nlet:\n  h: {expr}\noutputs:\n  y: silu(h)\n")
        return load_spec(path)

    ir_module.build_ir(spec_with(ir_module.MAX_CALL_NESTING - 1))
    started = time.monotonic()
    with pytest.raises(SpecError, match=r"op10\.yaml:8: 'y' nests functions more than 10 deep \(counting intermediates\)"):
        ir_module.build_ir(spec_with(ir_module.MAX_CALL_NESTING))
    assert time.monotonic() - started < 1.0
