"""Constant subexpressions: each folds to one number the printers can write, or is refused.

sympy evaluates numbers exactly and eagerly: `0 ** -1` is zoo, `sqrt(-1)` is I (which the
printers would write as 1), `9 ** 9 ** 9` is an integer of 370 million digits, and some
constants it cannot decide at all (`0 >= relu(sigmoid(-7))`). So lowering hands every
subexpression that has become a number to `fold`, which evaluates it once, numerically,
and gives back an exact number (an integer or a fraction, kept exact) or a float: later
stages never see a constant they could hang on or misprint. A constant that is not a finite
real number is refused (a NaN or an inf that a spec computes from constants alone is almost
surely a mistake), and so is one beyond the bounds the parser sets for literals: folded
constants are literals the kernel holds.

Errors are `ConstantError(problem)`; simplify adds where (the field, the subexpression).
"""
from __future__ import annotations

import math

import sympy

from .spec import MAX_FLOAT_MAGNITUDE, MAX_INT_MAGNITUDE

_INT_LIMIT = "at most 2**53 in magnitude"
_FLOAT_LIMIT = "at most 1e30 in magnitude"
# An exact power whose result would hold more bits than this is computed in floats (or
# refused, when that many bits are its magnitude: 2**4096 is far beyond the bounds above).
_MAX_POWER_BITS = 4096
_DIGITS = 20  # evalf's precision: more than a double holds


class ConstantError(Exception):
    """What is wrong with a constant, as the end of a sentence: 'is out of range (...)'."""


class CoefficientError(ConstantError):
    """What is wrong with the constant factor of an expression that is not a constant."""


def fold(value: sympy.Expr) -> sympy.Expr:
    """A number subexpression as an Integer, a Rational or a Float, within the literal bounds."""
    if value.is_Integer:
        if abs(value.p) > MAX_INT_MAGNITUDE:
            raise ConstantError(f"is out of range ({_INT_LIMIT})")
        return value
    if value.is_Rational:
        try:
            magnitude = abs(value.p) / value.q  # Python divides huge integers correctly...
        except OverflowError:  # ... or says the quotient is too large for a float
            magnitude = math.inf
        _check_magnitude(magnitude)
        if abs(value.p) > MAX_INT_MAGNITUDE or value.q > MAX_INT_MAGNITUDE:
            return sympy.Float(value.p / value.q)  # keeps later exact arithmetic small
        return value
    number = value if value.is_Float else value.evalf(_DIGITS)
    problem = not_finite_real(number)
    if problem:
        raise ConstantError(f"is not a finite real number (it is {problem})")
    if not number.is_Number:
        raise ConstantError("cannot be evaluated to a number")
    _check_magnitude(float(abs(number)))  # a Float beyond a double's range converts to inf
    return value if value.is_Float else sympy.Float(float(number))


def power(base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
    """base ** exponent, without letting sympy compute an exact number too large to hold.

    sympy raises an exact base to an exact exponent exactly, and hands an integer exponent
    on to the numbers inside the base: a product's coefficient ((2 * x) ** n is 2**n * x**n),
    each branch of a where. Either can run for minutes ((1 + 2**-52) ** 2**53 is a fraction
    of 2**106 bits, though close to e**2). So where the exact result could be that long, the
    base's exact numbers become floats first (mpmath raises them at a double's precision, in
    no time), or the power is refused at once where its size alone puts it out of range.
    """
    if not exponent.is_Rational:
        return base**exponent  # a float exponent: mpmath's work
    exact = [a for a in base.atoms(sympy.Rational) if abs(a) not in (0, 1)]
    bits = max((math.log2(abs(a.p)) + math.log2(a.q) for a in exact), default=0)
    if abs(float(exponent)) * bits <= _MAX_POWER_BITS:
        return base**exponent  # short enough to compute exactly
    coefficient = base if base.is_number else base.as_coeff_Mul()[0]
    if coefficient.is_Rational and abs(coefficient) not in (0, 1):
        if float(exponent) * (math.log2(abs(coefficient.p)) - math.log2(coefficient.q)) > _MAX_POWER_BITS:
            exact_integer = coefficient.is_Integer and exponent.is_Integer and exponent > 0
            error = ConstantError if base.is_number else CoefficientError
            raise error(f"is out of range ({_INT_LIMIT if exact_integer else _FLOAT_LIMIT})")
    return base.xreplace({a: sympy.Float(a) for a in exact}) ** exponent


def check_coefficients(value: sympy.Expr) -> None:
    """The numbers sympy gathered into a sum, a product or a power (x * 10**10 * 10**10 is
    10**20 * x) are finite, real and within the literal bounds."""
    if value.is_Add or value.is_Mul or value.is_Pow:
        for arg in value.args:
            if arg.is_number:
                fold(arg)


def check_all_numbers(expr: sympy.Expr) -> None:
    """Every number anywhere in expr is finite, real and within the literal bounds."""
    for atom in expr.atoms():
        if atom.is_number:  # zoo and I are numbers, but not Numbers
            fold(atom)


def check_finite(expr: sympy.Expr) -> None:
    """No number in expr is infinite, NaN or complex (bounds aside: a derivative may
    multiply a literal by an exponent)."""
    for atom in expr.atoms():
        problem = not_finite_real(atom) if atom.is_number else ""
        if problem:
            raise ConstantError(f"is not a finite real number (it is {problem})")


def not_finite_real(number: sympy.Expr) -> str:
    """'' for a finite real number; else what it is: 'infinite', 'NaN' or 'complex'."""
    if number is sympy.nan:
        return "NaN"
    if number.is_infinite or number is sympy.zoo:
        return "infinite"
    if number.has(sympy.I) or number.is_extended_real is False:
        return "complex"
    return ""


def _check_magnitude(magnitude: float) -> None:
    if magnitude > MAX_FLOAT_MAGNITUDE:
        raise ConstantError(f"is out of range ({_FLOAT_LIMIT})")
