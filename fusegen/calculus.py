"""sympy helpers shared by simplify and rows: derivatives as the chain rule leaves them, and
common-subexpression elimination into numbered temporaries."""
from __future__ import annotations

import sympy

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
    """
    d = sympy.diff(expr, symbol)
    factored = sympy.gcd_terms(d, fraction=False)
    if factored.is_Mul and any(not f.is_number and not f.is_Add for f in factored.args):
        return factored
    return d


def cse(exprs: list[sympy.Expr]) -> tuple[list[tuple[sympy.Symbol, sympy.Expr]], list[sympy.Expr]]:
    """Temporaries in order, and the expressions rewritten over them."""
    temps = sympy.numbered_symbols(TEMPORARY_PREFIX, real=True)
    replacements, reduced = sympy.cse(exprs, symbols=temps)
    # A temporary that is only a number (2*sqrt(2/pi)) reads better as the literal it prints to.
    numbers = {t: e for t, e in replacements if e.is_number}
    kept = [(t, e.xreplace(numbers)) for t, e in replacements if t not in numbers]
    return kept, [e.xreplace(numbers) for e in reduced]
