"""sympy helpers shared by simplify and rows: derivatives as the chain rule leaves them, and
common-subexpression elimination into numbered temporaries."""
from __future__ import annotations

import sympy

from .functions import INF

TEMPORARY_PREFIX = "%t"  # CSE temporaries: %t0, %t1, ...


def derivative(expr: sympy.Expr, symbol: sympy.Symbol) -> sympy.Expr:
    """∂expr/∂symbol, its terms' common factors taken out, as the chain rule leaves them.

    The product rule hands back a sum in which a factor is distributed over the terms:
    ∂(silu(a) * b)/∂a = b*s + a*b*s*sigmoid(-a). Where b = ±inf and a < 0 that sum is
    inf - inf = NaN, where b * silu'(a), as eager PyTorch computes it, is ±inf; taking the
    common factors out, b*s*(a*sigmoid(-a) + 1), gives the same value without the NaN,
    and no more operations. Only the top-level sum is factored, and only for a factor that
    is not just a number: the terms stay as sympy wrote them (factor_terms would also
    rewrite function arguments, away from the forward's).

    Powers with an exponent that is not a number and relu's step differentiate as torch's
    backward formulas do (_Power, _masked): no 0/0 or inf * 0 where torch gives a number.
    """
    d = _masked(sympy.diff(_with_powers(expr), symbol).replace(_Power, lambda base, exponent: base**exponent))
    factored = sympy.gcd_terms(d, fraction=False)
    if factored.is_Mul and any(not f.is_number and not f.is_Add for f in factored.args):
        return factored
    return d


class _Power(sympy.Function):
    """base ** exponent, an exponent not a number, while it is differentiated. sympy's
    derivative divides by the base (k*x**k/x: 0/0 at x = 0, where torch gives 0, or 1 for
    k = 1); this one is torch's pow backward: k*x**(k - 1), 0 where k = 0, and x**k*log(x)
    for the exponent, 0 where x = 0 and k >= 0."""

    nargs = 2

    def fdiff(self, argindex=1):
        base, exponent = self.args
        if argindex == 1:
            return sympy.Piecewise((0, sympy.Eq(exponent, 0)), (exponent * base ** (exponent - 1), True))
        at_zero = sympy.And(sympy.Eq(base, 0), exponent >= 0)
        return sympy.Piecewise((0, at_zero), (base**exponent * sympy.log(base), True))


def _with_powers(expr: sympy.Expr) -> sympy.Expr:
    return expr.replace(
        lambda e: e.is_Pow and not e.exp.is_number and not e.base.is_number,
        lambda e: _Power(e.base, e.exp),
    )


def _masked(expr: sympy.Expr) -> sympy.Expr:
    """Each product by relu's step, Heaviside(a, 0), as a selection: 0 where a <= 0, what
    the other factors give elsewhere (NaN where a is NaN). torch's relu backward selects so,
    and an infinite factor (relu(x)**0.5's derivative at 0) then gives 0, not inf * 0 = NaN."""

    def select(product):
        steps = [f for f in product.args if isinstance(f, sympy.Heaviside) and f.pargs[1:] == (0,)]
        selected = sympy.Mul(*[f for f in product.args if f not in steps])
        for step in steps:
            selected = sympy.Piecewise((0, step.args[0] <= 0), (selected, True))
        return selected

    return expr.replace(lambda e: e.is_Mul, select)


def is_literal(expr: sympy.Expr) -> bool:
    """A number, or one built from the literal inf (-inf): what a printer writes as a literal."""
    return expr.is_number or (bool(expr.free_symbols) and expr.free_symbols <= {INF})


def cse(exprs: list[sympy.Expr]) -> tuple[list[tuple[sympy.Symbol, sympy.Expr]], list[sympy.Expr]]:
    """Temporaries in order, and the expressions rewritten over them."""
    temps = sympy.numbered_symbols(TEMPORARY_PREFIX, real=True)
    replacements, reduced = sympy.cse(exprs, symbols=temps)
    # A temporary that is only a number (2*sqrt(2/pi), -inf) reads better as the literal it prints to.
    # A condition stays where it is used (one compare more where two wheres share it): a
    # printer then sees which wheres a condition of params alone decides.
    inline = {}
    for t, e in replacements:
        e = e.xreplace(inline)
        if is_literal(e) or isinstance(e, sympy.logic.boolalg.Boolean):
            inline[t] = e
    kept = [(t, e.xreplace(inline)) for t, e in replacements if t not in inline]
    return kept, [e.xreplace(inline) for e in reduced]
