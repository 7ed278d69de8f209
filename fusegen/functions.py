"""The expression language's functions, each defined once as a sympy expression.

A function's sympy form is its whole definition: simplification, differentiation and
every printed spelling (Triton, PyTorch) derive from it. Printers only know how to
spell sympy's own primitives (exp, tanh, Max, Piecewise, ...) plus `sigmoid` below.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import math

import sympy
from sympy.codegen.cfunctions import expm1, log1p
from sympy.logic.boolalg import BooleanFunction


class sigmoid(sympy.Function):
    """The logistic function 1 / (1 + exp(-x)), kept whole so targets print their fused op."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if x.is_zero:
            return sympy.Rational(1, 2)
        return None

    def fdiff(self, argindex=1):
        # sigmoid(x) * (1 - sigmoid(x)), with 1 - sigmoid(x) as sigmoid(-x): the subtraction
        # cancels as sigmoid(x) -> 1, where sigmoid(-x) keeps its relative accuracy.
        x = self.args[0]
        return sigmoid(x) * sigmoid(-x)

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return 1 / (1 + sympy.exp(-x))


class relu(sympy.Function):
    """max(x, 0), kept whole: its derivative at 0 is 0, as torch.relu's is (sympy's Max
    would give 1/2 there), and NaN passes through as torch.relu lets it."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if x.is_Number:
            return sympy.Max(x, 0)
        return None

    def fdiff(self, argindex=1):
        return sympy.Heaviside(self.args[0], 0)

    def _eval_rewrite_as_Max(self, x, **kwargs):
        return sympy.Max(x, 0)


class saturated(sympy.Function):
    """x clamped to [-bound, bound], for the argument of a function that is flat to the last bit
    (in fp64) beyond the bound. Its derivative is taken as 1: exact inside the bound, and
    outside it multiplied by the function's derivative, which is 0 there."""

    nargs = 2

    @classmethod
    def eval(cls, x, bound):
        if x.is_Number:
            return sympy.Max(sympy.Min(x, bound), -bound)
        return None

    def fdiff(self, argindex=1):
        return sympy.Integer(1) if argindex == 1 else sympy.Integer(0)

    def _eval_rewrite_as_Max(self, x, bound, **kwargs):
        return sympy.Max(sympy.Min(x, bound), -bound)


class _Stepwise(sympy.Function):
    """A function constant between its steps: its derivative is 0 everywhere, as torch's
    backward of round, floor and sign is (sympy's own would give DiracDelta terms, or stay
    unevaluated). A number argument is evaluated by `_number`, as torch would."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if x.is_Number:
            return cls._number(x)
        return None

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


class round_half_even(_Stepwise):
    """torch.round: to the nearest integer, halves to the even one."""

    @staticmethod
    def _number(x):
        # Python's round is half to even, for an exact fraction as for a double.
        return sympy.Integer(round(Fraction(x.p, x.q))) if x.is_Rational else sympy.Float(round(float(x)))


class floor(_Stepwise):
    """torch.floor: the largest integer not above x."""

    @staticmethod
    def _number(x):
        return sympy.floor(x)


class sign(_Stepwise):
    """torch.sign: -1, 0 or 1 (0 for NaN, as torch gives on CPU and GPU). Printed as sympy's
    sign (Abs's derivative) is; a class of its own for its derivative, 0."""

    @staticmethod
    def _number(x):
        return sympy.sign(x)


class clamp(sympy.Function):
    """torch.clamp(x, lo, hi) = min(max(x, lo), hi), NaN passing through. Its derivatives are
    torch's: 1 for x on [lo, hi] inclusive (min(max(...)) would give 1/2 at the bounds), for
    lo where x is below it and lo < hi, for hi where x is above it or lo > hi (hi wins where
    lo > hi; where x < lo == hi, torch gives no argument a gradient, and so do these)."""

    nargs = 3

    @classmethod
    def eval(cls, x, lo, hi):
        if x.is_Number and lo.is_Number and hi.is_Number:
            return sympy.Min(sympy.Max(x, lo), hi)
        return None

    def fdiff(self, argindex=1):
        x, lo, hi = self.args
        selected = {
            1: sympy.And(x >= lo, x <= hi),
            2: sympy.And(x < lo, lo < hi),
            3: sympy.Or(x > hi, lo > hi),
        }[argindex]
        return sympy.Piecewise((1, selected), (0, True))


# torch's F.softplus default: above this x (beta 1), softplus(x) is x to the last bit of fp32.
SOFTPLUS_THRESHOLD = 20


def _softplus(x):
    # Its derivative follows: 1 above the threshold, exp(x) / (exp(x) + 1) below, torch's form.
    return sympy.Piecewise((x, x > SOFTPLUS_THRESHOLD), (log1p(sympy.exp(x)), True))


@dataclass(frozen=True)
class Function:
    name: str
    arity: int
    sympy_form: Callable[..., sympy.Expr]
    doc: str
    # How a PyTorch user writes it (torch.nn.functional as F where torch has the op): the
    # generated `eager` baseline that benchmarks time. A spelling, not the definition.
    torch_idiom: str


_SQRT_2_OVER_PI = sympy.sqrt(2 / sympy.pi)
# Kept as the literal the GELU paper and PyTorch use; sympy.Float keeps it exact to print.
_GELU_TANH_CUBIC = sympy.Float("0.044715")
_QUICK_GELU_SLOPE = sympy.Float("1.702")
# gelu_tanh's tanh argument takes x within [-24, 24]: there 2u is past 1000, where sigmoid is
# exactly 0 or 1 even in fp64, so no value changes; unbounded, x**3 (and x * x**2 in the
# derivative) overflows fp32 from |x| ~ 1e13 and meets sigmoid's 0 as inf * 0 = NaN.
_GELU_TANH_BOUND = 24


def _gelu_tanh_inner(x):
    return x + _GELU_TANH_CUBIC * x**3


FUNCTIONS: dict[str, Function] = {
    f.name: f
    for f in [
        Function("identity", 1, lambda x: x, "x", "{0}"),
        Function("abs", 1, sympy.Abs, "|x|", "torch.abs({0})"),
        Function("exp", 1, sympy.exp, "e**x", "torch.exp({0})"),
        Function("log", 1, sympy.log, "natural logarithm", "torch.log({0})"),
        Function("sqrt", 1, sympy.sqrt, "square root", "torch.sqrt({0})"),
        Function("rsqrt", 1, lambda x: 1 / sympy.sqrt(x), "1 / sqrt(x)", "torch.rsqrt({0})"),
        Function("tanh", 1, sympy.tanh, "hyperbolic tangent", "torch.tanh({0})"),
        Function("erf", 1, sympy.erf, "error function", "torch.erf({0})"),
        Function("sigmoid", 1, sigmoid, "1 / (1 + exp(-x))", "torch.sigmoid({0})"),
        Function("min", 2, sympy.Min, "smaller of a and b", "torch.minimum({0}, torch.as_tensor({1}))"),
        Function("max", 2, sympy.Max, "larger of a and b", "torch.maximum({0}, torch.as_tensor({1}))"),
        Function("relu", 1, relu, "max(x, 0)", "F.relu({0})"),
        Function("squared_relu", 1, lambda x: relu(x) ** 2, "max(x, 0)**2 (Primer)", "torch.square(F.relu({0}))"),
        Function(
            "leaky_relu",
            2,
            lambda x, slope: sympy.Piecewise((x, x > 0), (slope * x, True)),
            "x if x > 0 else slope * x",
            "F.leaky_relu({0}, {1})",
        ),
        Function(
            "gelu",
            1,
            lambda x: x / 2 * (1 + sympy.erf(x / sympy.sqrt(2))),
            "exact GELU, x * Phi(x)",
            "F.gelu({0})",
        ),
        Function(
            "gelu_tanh",
            1,
            # 0.5 x (1 + tanh(u)) == x sigmoid(2u): one transcendental instead of two.
            lambda x: x * sigmoid(2 * _SQRT_2_OVER_PI * _gelu_tanh_inner(saturated(x, _GELU_TANH_BOUND))),
            "tanh-approximated GELU, in its sigmoid form",
            'F.gelu({0}, approximate="tanh")',
        ),
        Function("silu", 1, lambda x: x * sigmoid(x), "x * sigmoid(x) (swish)", "F.silu({0})"),
        Function(
            "quick_gelu",
            1,
            lambda x: x * sigmoid(_QUICK_GELU_SLOPE * x),
            "x * sigmoid(1.702 x)",
            "{0} * torch.sigmoid(1.702 * {0})",
        ),
        Function("round", 1, round_half_even, "nearest integer, halves to even", "torch.round({0})"),
        Function("floor", 1, floor, "largest integer <= x", "torch.floor({0})"),
        Function("sign", 1, sign, "-1, 0 or 1", "torch.sign({0})"),
        # torch.clamp takes its bounds both numbers or both tensors (on x's device): the two
        # one-sided clamps take either, and clamp_max last lets hi win where lo > hi, as clamp.
        Function("clamp", 3, clamp, "x limited to [lo, hi]", "torch.clamp_max(torch.clamp_min({0}, {1}), {2})"),
        Function("softplus", 1, _softplus, "log(1 + exp(x)), x above 20", "F.softplus({0})"),
        Function("log1p", 1, log1p, "log(1 + x)", "torch.log1p({0})"),
        Function("expm1", 1, expm1, "exp(x) - 1", "torch.expm1({0})"),
        Function("sin", 1, sympy.sin, "sine", "torch.sin({0})"),
        Function("cos", 1, sympy.cos, "cosine", "torch.cos({0})"),
    ]
}

class infinity(sympy.Symbol):
    """The literal inf. A symbol, not sympy's oo, which would absorb what it meets (x + oo is oo,
    where x = -inf gives NaN) and which a constant may not be (fusegen.constants); printers spell
    it as the float. Like any symbol it would cancel itself (inf - inf is 0 to sympy, NaN in
    torch), so the parser refuses arithmetic on it (ir._is_inf)."""


INF = infinity("%inf", real=True)  # a name no spec name can have


class negated(BooleanFunction):
    """`~cond`, kept whole: sympy's Not turns ~(x > 0) into x <= 0, which is False for NaN where
    torch's ~ gives True."""

    nargs = 1

    @classmethod
    def eval(cls, cond):
        if cond in (sympy.true, sympy.false):
            return sympy.false if cond is sympy.true else sympy.true
        return None


class column(sympy.Symbol):
    """The built-in name `col`: each element's index along the last dim, 0 <= col < N. Varies
    along the row like an [N] input, has no gradient; printers spell it as the kernel's or
    torch's column index."""


COL = column("%col", real=True)


class in_compute(sympy.Function):
    """An integer or bool input where arithmetic reads it, converted to the compute type (a
    comparison reads it as it is: exact). Such inputs are never differentiated."""

    nargs = 1


# The language's literal names: `inf` (and `-inf`, its negation), a float.
LITERALS = {"inf": math.inf}
# Names the language defines, besides its functions: a spec name may not be one.
BUILTIN_NAMES = frozenset({*LITERALS, "col"})

# Built into the language rather than the registry: `where` takes a comparison,
# `dropout` is stochastic, `chunk(x, i)` names part of an input and `take(x, target)` is sugar
# for a row sum (x at column target), and `T(w)` transposes a matmul's right operand
# (`x @ T(weight)`, nn.Linear's [N, K] weight), so none is a plain sympy function of its arguments.
BUILTINS = {"where": 3, "dropout": 2, "chunk": 2, "take": 2, "T": 1}

# Row reductions over the last dim: one value per row ([..., 1], broadcast back along it).
# max and min with two arguments stay the elementwise functions above, as in torch.
REDUCTIONS = ("sum", "mean", "max", "min")


def known_function_names() -> list[str]:
    return sorted({*FUNCTIONS, *BUILTINS, *REDUCTIONS})
