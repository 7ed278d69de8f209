"""printers: one sympy Printer per target; the same expression spelled for Triton and torch."""
import pytest
import sympy

from fusegen.functions import FUNCTIONS, sigmoid
from fusegen.backends.triton.printer import TritonPrinter
from fusegen.printers import TorchPrinter
from fusegen.simplify import choice_function

x, y, z = sympy.symbols("x y z", real=True)
ACT = choice_function("act", 1)
# How the plan names a choice's helpers and selector: here as the generated code spells them.
triton = TritonPrinter({("act", None): "_act"}, {"act": "ACT"})
torch_ = TorchPrinter({("act", None): "_act_torch"}, {"act": "act"})


@pytest.mark.parametrize(
    "expr, triton_text, torch_text",
    [
        (x**2, "x * x", "x * x"),
        (x**3 + y, "x * x * x + y", "x * x * x + y"),
        (1 / x, "1.0 / x", "1.0 / x"),
        (y / (x + 1), "y / (x + 1)", "y / (x + 1)"),
        (sympy.sqrt(x), "sqrt_rn(x)", "torch.sqrt(x)"),
        (1 / sympy.sqrt(x), "rsqrt_rn(x)", "torch.rsqrt(x)"),
        (sigmoid(x), "tl.sigmoid(x)", "torch.sigmoid(x)"),
        (sympy.tanh(x), "libdevice.tanh(x)", "torch.tanh(x)"),
        (sympy.Max(x, 0), "maximum(x, 0)", "torch.clamp_min(x, 0)"),
        (sympy.Piecewise((x, x > 0), (0.5 * x, True)), "tl.where(x > 0, x, 0.5 * x)", "torch.where(x > 0, x, 0.5 * x)"),
        (x / 2, "0.5 * x", "0.5 * x"),
        (-x, "-x", "-x"),
        (x**y, "libdevice.pow(x, y)", "torch.pow(x, y)"),
        # libdevice.pow picks its overload by argument types: numbers come in the compute type.
        (x**1.7, "libdevice.pow(x, tl.full((), 1.7, compute))", "torch.pow(x, 1.7)"),
        (x**1.5, "x * sqrt_rn(x)", "x * torch.sqrt(x)"),
        (x**-2.5, "rsqrt_rn(x) / (x * x)", "torch.rsqrt(x) / (x * x)"),  # no overflowing x*x*sqrt(x)
        (2**x, "libdevice.pow(tl.full((), 2, compute), x)", "torch.pow(2, x)"),
        (FUNCTIONS["round"].sympy_form(x), "libdevice.rint(x)", "torch.round(x)"),
        (FUNCTIONS["floor"].sympy_form(x), "libdevice.floor(x)", "torch.floor(x)"),
        (FUNCTIONS["sign"].sympy_form(x), "tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))", "torch.sign(x)"),
        (FUNCTIONS["log1p"].sympy_form(x), "libdevice.log1p(x)", "torch.log1p(x)"),
        (FUNCTIONS["expm1"].sympy_form(x), "libdevice.expm1(x)", "torch.expm1(x)"),
        (FUNCTIONS["sin"].sympy_form(x), "libdevice.sin(x)", "torch.sin(x)"),
        (FUNCTIONS["cos"].sympy_form(x), "libdevice.cos(x)", "torch.cos(x)"),
        (FUNCTIONS["softplus"].sympy_form(x), "tl.where(x > 20, x, libdevice.log1p(libdevice.exp(x)))",
         "torch.where(x > 20, x, torch.log1p(torch.exp(x)))"),
        (FUNCTIONS["clamp"].sympy_form(x, -1, y),
         "minimum(maximum(x, -1), y)",  # kernel_lib's NaN-propagating maximum and minimum
         "torch.clamp(x, torch.tensor(-1, dtype=problem.compute_dtype, device=problem.device), y)"),
        (FUNCTIONS["clamp"].sympy_form(x, -1, 1), "minimum(maximum(x, -1), 1)", "torch.clamp(x, -1, 1)"),
        # clamp's derivative: 1 on [lo, hi] inclusive, with & between the comparisons.
        (sympy.diff(FUNCTIONS["clamp"].sympy_form(x, -1, y), x), "tl.where((x >= -1) & (x <= y), 1, 0)",
         "torch.where((x >= -1) & (x <= y), 1, 0)"),
    ],
)
def test_spellings(expr, triton_text, torch_text):
    assert triton.doprint(expr) == triton_text
    assert torch_.doprint(expr) == torch_text


def test_numeric_factors_fold_into_one_literal():
    expr = FUNCTIONS["gelu_tanh"].sympy_form(x)
    text = triton.doprint(expr)
    assert "1.5957691216057308" in text  # 2 * sqrt(2 / pi), evaluated once
    assert "0.044715" in text  # the user's constant, exactly as written
    assert "pi" not in text and "sqrt_rn(2)" not in text


def test_unknown_function_is_an_error_not_garbage():
    with pytest.raises(Exception):
        triton.doprint(sympy.besselj(0, x))


def test_printed_code_evaluates_like_sympy():
    # Every registry function, printed for torch, computes what its sympy form says.
    import math

    import torch

    for name, function in FUNCTIONS.items():
        args = (x, y, z)[: function.arity]
        expr = function.sympy_form(*args)
        text = torch_.doprint(expr)
        values = {n: torch.tensor(v, dtype=torch.float64) for n, v in (("x", 0.7), ("y", 0.3), ("z", 0.9))}
        got = eval(text, {"torch": torch}, values)  # noqa: S307 - our own printer's output, in a test
        # sin and cos rewritten as exponentials are complex, with a rounding-sized imaginary part.
        value = expr.rewrite(sympy.exp).subs({x: 0.7, y: 0.3, z: 0.9}).evalf()
        assert abs(float(sympy.im(value))) < 1e-15, name
        want = float(sympy.re(value))
        assert math.isclose(float(got), want, rel_tol=1e-12, abs_tol=1e-15), name


def test_integers_past_2_53_print_as_floats():
    # A derivative may multiply a folded constant by an exponent; Triton has no integer literal past 2**63.
    assert triton.doprint(2**106 * x) == "8.112963841460668e+31 * x"
    assert triton.doprint(2**53 * x) == "9007199254740992 * x"


def test_a_choice_of_a_number_gets_a_tensor():
    act = ACT
    assert triton.doprint(act(1) * x) == "x * _act(tl.full((), 1, compute), ACT)"
    assert torch_.doprint(act(x)) == "_act_torch(x, act)"
    assert torch_.doprint(act(sympy.Float(0.5))) == (
        "_act_torch(torch.tensor(0.5, dtype=problem.compute_dtype, device=problem.device), act)"
    )


def test_constants_that_are_not_plain_decimals_are_named():
    printer = TritonPrinter()
    assert printer.doprint(x * sympy.sqrt(2) / sympy.sqrt(sympy.pi)) == "0.7978845608028654 * x"
    assert printer.constants == {"0.7978845608028654": "sqrt(2)/sqrt(π)"}
    printer.constants.clear()
    printer.doprint(x / 3 + y / 2)  # 1/3 gets a name; 1/2 is plain as 0.5
    assert printer.constants == {"0.3333333333333333": "1/3"}


def test_relu_step_is_one_where():
    assert triton.doprint(sympy.Heaviside(x, 0)) == "tl.where(x > 0, 1.0, 0.0)"
    # At 1/2 (sympy's own) the tie needs its own branch.
    assert triton.doprint(sympy.Heaviside(x)) == "tl.where(x > 0, 1.0, tl.where(x < 0, 0.0, 0.5))"


def test_bounded_factors_come_first():
    # (x * sigmoid(x)) * y as torch computes it: x * y may overflow where the product does not (issue 27).
    w, v = sympy.symbols("w v", real=True)
    assert triton.doprint(x * y * sigmoid(x)) == "tl.sigmoid(x) * x * y"
    assert torch_.doprint(x * y * sigmoid(x)) == "torch.sigmoid(x) * x * y"
    assert triton.doprint(w * x / sympy.sqrt(v)) == "rsqrt_rn(v) * w * x"
    assert triton.doprint(w * x * v**-1.5) == "rsqrt_rn(v) * w * x / v"


def test_row_values_are_subtracted_last():
    # exp((mask + x) - max) as the forward rounds it, <= 0, not exp(mask - max + x) (issue 27).
    m, mask = sympy.symbols("max0 mask", real=True)
    rows = TritonPrinter(row_values={"max0"})
    assert rows.doprint(sympy.exp(mask - m + x)) == "libdevice.exp(mask + x - max0)"
    assert rows.doprint(m + x - y) == "max0 + x - y"  # only a subtracted row value moves
    assert triton.doprint(sympy.exp(mask - m + x)) == "libdevice.exp(mask - max0 + x)"
