"""simplify: IR → sympy, dropout as a mask symbol, gradients, CSE."""
import sympy

from fusegen import ir, simplify, spec


def _op(tmp_path, outputs: str, inputs: str = "  x: [..., N]\n  bias: [N]\n", params: str = ""):
    path = tmp_path / "op.yaml"
    path.write_text(f"name: op\ndoc: test\ninputs:\n{inputs}{params}outputs:\n{outputs}")
    return simplify.simplify(ir.build_ir(spec.load_spec(path)))


def test_dropout_is_a_mask_symbol_that_vanishes_without_dropout(tmp_path):
    op = _op(tmp_path, "  y: dropout(x + bias, p)\n", params="params:\n  p: {type: float, default: 0.1, min: 0.0, max: 1.0}\n")
    x, bias = sympy.symbols("x bias", real=True)
    mask = sympy.Symbol(simplify.mask_name(0), real=True)
    assert dict(op.forward.results)["y"] == mask * (x + bias)
    assert dict(op.forward_no_dropout.results)["y"] == x + bias
    assert op.scalar_params == ()  # p reaches the kernel as a threshold and a scale only


def test_gradients_and_passthrough(tmp_path):
    op = _op(
        tmp_path,
        "  y: x * bias + residual\n",
        inputs="  x: [..., N]\n  bias: [N]\n  residual: [..., N]\n",
    )
    x, bias = sympy.symbols("x bias", real=True)
    grad_y = sympy.Symbol(simplify.grad_output_name("y"), real=True)
    grads = {g.input: g for g in op.gradients}
    assert grads["residual"].passthrough_of == "y"
    assert grads["x"].passthrough_of is None
    results = dict(op.backward.results)
    assert sympy.simplify(results["x"].xreplace(dict(op.backward.temps)) - grad_y * bias) == 0
    assert sympy.simplify(results["bias"].xreplace(dict(op.backward.temps)) - grad_y * x) == 0


def test_cse_shares_work_between_gradients(tmp_path):
    op = _op(tmp_path, "  y: tanh(x + bias)\n")
    # d/dx and d/dbias are the same expression: computed once.
    assert len(op.backward.temps) == 1
    results = dict(op.backward.results)
    assert results["x"] == results["bias"] == op.backward.temps[0][0]


def test_choice_stays_opaque_with_a_derivative_helper(tmp_path):
    op = _op(
        tmp_path,
        "  y: act(x + bias)\n",
        params="params:\n  act: {choices: [relu, silu], default: relu}\n",
    )
    (helper,) = op.helpers
    assert [c for c, _ in helper.forward] == ["relu", "silu"]
    x = helper.args[0]
    silu_grad = dict(helper.grads[0])["silu"]
    derivative = silu_grad.results[0][1].xreplace(dict(silu_grad.temps))
    expected = sympy.diff(x / (1 + sympy.exp(-x)), x)
    value = {x: 0.7}
    assert abs(float(derivative.rewrite(sympy.exp).subs(value)) - float(expected.subs(value))) < 1e-12


def test_user_constants_are_kept_exactly(tmp_path):
    op = _op(tmp_path, "  y: x * 0.044715 + bias\n")
    (expr,) = [e for _, e in op.forward.results]
    assert sympy.Float(0.044715) in expr.atoms(sympy.Float)


def test_gradient_keeps_common_factors_out_of_the_sum(tmp_path):
    """∂(silu(a) * b)/∂a is g * b * s * (a * sigmoid(-a) + 1), s = sigmoid(a): b is a factor,
    not distributed over silu''s two terms (where b = ±inf that sum would be inf - inf)."""
    from fusegen.functions import sigmoid

    op = _op(tmp_path, "  y: silu(x) * bias\n")
    x, bias = sympy.symbols("x bias", real=True)
    grad_y = sympy.Symbol(simplify.grad_output_name("y"), real=True)
    grad_x = dict(op.backward.results)["x"].xreplace(dict(op.backward.temps))
    assert grad_x == grad_y * bias * sigmoid(x) * (x * sigmoid(-x) + 1)


def test_gradient_of_a_sum_with_numeric_common_factors_is_left_alone():
    x = sympy.Symbol("x", real=True)
    expr = x / 2 * (1 + sympy.erf(x / sympy.sqrt(2)))  # gelu: only a 1/2 in common
    assert simplify.derivative(expr, x) == sympy.diff(expr, x)


def test_sigmoid_derivative_has_no_cancelling_subtraction():
    from fusegen.functions import sigmoid

    x = sympy.Symbol("x", real=True)
    assert sympy.diff(sigmoid(x), x) == sigmoid(x) * sigmoid(-x)


def _y(op) -> sympy.Expr:
    return dict(op.forward.results)["y"].xreplace(dict(op.forward.temps))


def test_constant_subexpressions_fold_to_one_literal(tmp_path):
    x = sympy.Symbol("x", real=True)
    assert _y(_op(tmp_path, "  y: x + relu(exp(1))\n", inputs="  x: [N]\n")) == x + sympy.Float(2.718281828459045)
    assert _y(_op(tmp_path, "  y: x * (2 / 3)\n", inputs="  x: [N]\n")) == sympy.Rational(2, 3) * x  # exact
    # sympy alone could not decide this comparison (it ran for minutes): folded, it is false.
    assert _y(_op(tmp_path, "  y: where(0 >= relu(sigmoid(-7)), x, 1)\n", inputs="  x: [N]\n")) == 1
    # An exact power whose exact value would be huge is computed in floats: close to e**2.
    y = _y(_op(tmp_path, "  y: x * (1 + 2 ** -52) ** 2 ** 53\n", inputs="  x: [N]\n"))
    assert abs(float(y.coeff(x)) - 7.38905609893065) < 1e-12


def test_a_choice_of_a_constant_stays_a_call(tmp_path):
    op = _op(tmp_path, "  y: act(1) * x\n", inputs="  x: [N]\n", params="params:\n  act: {choices: [relu, gelu], default: relu}\n")
    act = simplify.choice_function("act", 1)
    assert _y(op) == act(1) * sympy.Symbol("x", real=True)
    assert not act(1).is_number  # so nothing tries to evaluate or print it as one


def test_an_input_whose_gradient_is_an_earlier_inputs_shares_it(tmp_path):
    inputs = "  x: [..., N]\n  residual: [..., N]\n  weight: [N]\n"
    grads = {g.input: g for g in _op(tmp_path, "  y: relu(x + residual) * weight\n", inputs=inputs).gradients}
    assert grads["residual"].same_as == "x" and grads["x"].same_as is None
    assert grads["weight"].same_as is None  # broadcast: its gradient is a sum
    # x * residual's gradients differ: not marked. A row op's, the same: marked.
    grads = {g.input: g for g in _op(tmp_path, "  y: x * residual * weight\n", inputs=inputs).gradients}
    assert grads["residual"].same_as is None
    rows = _op(tmp_path, "  y: (x + residual) * rsqrt(mean((x + residual) * (x + residual)) + 1.0e-6) * weight\n",
               inputs=inputs)
    assert {g.input: g.same_as for g in rows.gradients} == {"x": None, "residual": "x", "weight": None}
    # Only where equal with dropout on and off: the same without dropout, but dropout on x
    # alone masks x's gradient only.
    with_dropout = _op(tmp_path, "  y: relu(dropout(x, p) + residual)\n", inputs="  x: [..., N]\n  residual: [..., N]\n",
                       params="params:\n  p: {type: float, default: 0.1, min: 0.0, max: 1.0}\n")
    assert all(g.same_as is None and g.passthrough_of is None for g in with_dropout.gradients)


def test_each_gradient_says_which_outputs_incoming_gradients_it_reads(tmp_path):
    """Pointwise: directly; with row reductions: also through the backward's row sums (h's
    gradient reaches x through the norm's mean). An input reaching only one output reads
    only its gradient: without it (an unused output) the input has no gradient."""
    op = _op(tmp_path, "  h: x + bias\n  y: tanh(x) * scale\n", inputs="  x: [..., N]\n  bias: [N]\n  scale: [N]\n")
    assert {g.input: g.reads for g in op.gradients} == {"x": ("h", "y"), "bias": ("h",), "scale": ("y",)}
    (tmp_path / "rows").mkdir()
    rows = _op(tmp_path / "rows", "  h: s\n  y: (s - mean(s)) * rsqrt(mean((s - mean(s)) ** 2) + 1.0e-5) * w\n",
               inputs="  x: [..., N]\n  bias: [N]\n  w: [N]\n", params="let:\n  s: x + bias\n")
    assert {g.input: g.reads for g in rows.gradients} == {"x": ("h", "y"), "bias": ("h", "y"), "w": ("y",)}
