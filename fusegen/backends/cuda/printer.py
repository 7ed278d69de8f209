"""CUDA C++ spellings of sympy expressions: the bodies of the CUDA backend's kernels.

Values are scalars of the compute type T (float or double, a template parameter of each
kernel, as Triton's `compute`); every number, integers too, is written T(...) and `col` is read
as T(col), so that float kernels compute in float as the Triton ones do: a bare 0.5 is a double
in C++ and would widen the arithmetic around it, a bare 1 would make `col / (col + 1)` an
integer division and `exp(col)` a host-only integer overload. The functions without a C++
spelling of their own are csrc/fusegen_cuda.cuh's, in namespace fusegen."""
from __future__ import annotations

import re

import sympy

from fusegen.printers import ElementwisePrinter

# A number as the shared printer writes it (0.5, 1e-06, 2.5e+30, 3): made T(...) after printing.
_NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)(?![\w.])")


class CudaPrinter(ElementwisePrinter):
    """CUDA C++ device code over the compute type T; std:: math, which nvcc maps to the device's
    correctly rounded or 2-ulp functions for float and double alike (every argument is a T)."""

    language = "C++"
    known_functions = {
        "exp": "std::exp",
        "log": "std::log",
        "tanh": "std::tanh",
        "erf": "std::erf",
        "Abs": "std::fabs",
        "sigmoid": "fusegen::sigmoid",
        "round_half_even": "std::nearbyint",  # the default rounding mode: halves to even, as torch.round
        "floor": "std::floor",
        "log1p": "std::log1p",
        "expm1": "std::expm1",
        "sin": "std::sin",
        "cos": "std::cos",
    }
    sqrt, rsqrt, power = "std::sqrt", "fusegen::rsqrt_rn", "std::pow"
    column = "T(col)"  # each kernel names the element's index along the row `col` (an integer)
    # Integer values (int params, integer inputs, the row kind's): compared as integers where a
    # comparison reads one (a class index with the column: exact past 2**24), a T elsewhere.
    integers: frozenset[str] = frozenset()
    integer_column = "col"
    _exact = False

    def doprint(self, expr, assign_to=None):
        return _NUMBER.sub(r"T(\1)", super().doprint(expr, assign_to))

    def _print_Symbol(self, expr):
        name = super()._print_Symbol(expr)
        return name if self._exact or expr.name not in self.integers else f"T({name})"

    def _print_column(self, expr):
        return self.integer_column if self._exact else self.column

    def _print_Relational(self, expr):
        if self._exact or not {s.name for s in expr.free_symbols} & self.integers:
            return super()._print_Relational(expr)
        self._exact = True
        try:
            return super()._print_Relational(expr)
        finally:
            self._exact = False

    def narrow_results(self, flag: str) -> None:
        """exp as `fusegen::exp<flag>`: the faster float exp where `flag`, a kernel's constant,
        says its results are all 16-bit or narrower (csrc/fusegen_cuda.cuh)."""
        self.known_functions = {**self.known_functions, "exp": f"fusegen::exp<{flag}>"}

    def _get_comment(self, text):
        return f"// {text}"

    def converted(self, value):
        return f"T({value})"

    def choose(self, cond, if_true, if_false, false_text):
        # Only the side taken is computed (the values are those of a where of both).
        return f"({self._print(cond)} ? {self._print(if_true)} : {false_text})"

    def divide(self, numerator, denominator):
        # As the Triton kernels divide (fusegen_cuda.cuh: div.full.f32 in float).
        return f"fusegen::divide({numerator}, {denominator})"

    def maximum(self, a, b):
        return f"fusegen::maximum<T>({a}, {b})"

    def minimum(self, a, b):
        return f"fusegen::minimum<T>({a}, {b})"

    def scalar(self, number):
        return f"T({number})"

    def _print_relu(self, expr):
        return self.maximum(self._print(expr.args[0]), "0.0")

    def _print_infinity(self, expr):
        return "fusegen::infinity<T>()"

    def _print_And(self, expr):
        return " && ".join(f"({self._print(a)})" for a in expr.args)

    def _print_Or(self, expr):
        return " || ".join(f"({self._print(a)})" for a in expr.args)

    def _print_negated(self, expr):
        return f"!({self._print(expr.args[0])})"

    def _print_Heaviside(self, expr):
        # As the shared printer's, in a ternary (where has no C++ spelling of its own).
        x = self._print(expr.args[0])
        at_zero = expr.pargs[1] if len(expr.pargs) > 1 else sympy.Rational(1, 2)
        if at_zero == 0:
            return f"({x} > 0 ? 1.0 : 0.0)"
        return f"({x} > 0 ? 1.0 : ({x} < 0 ? 0.0 : {self._print(at_zero)}))"

    def _print_sign(self, expr):
        x = self._print(expr.args[0])
        return f"({x} > 0 ? 1.0 : ({x} < 0 ? -1.0 : 0.0))"

    def _print_Function(self, expr):
        # A choice param's function: its helper instantiated for the call's choice, a template
        # argument of the kernel (pointwise_source's helpers), as Triton's constexpr selects it.
        param = getattr(expr.func, "choice_param", None)
        if param is not None:
            args = ", ".join(self._print(a) for a in expr.args)
            return f"{self.helpers[(param, expr.func.derivative)]}<T, {self.choices[param]}>({args})"
        return super()._print_Function(expr)
