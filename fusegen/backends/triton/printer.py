"""Triton's spellings of sympy expressions: the kernel bodies' printer."""
from __future__ import annotations

from fusegen.printers import ElementwisePrinter

# The type a kernel computes in (a compile-time choice between float32 and float64): a
# local every kernel sets first (kernel_text.COMPUTE_LINE).
COMPUTE_DTYPE = "compute"


class TritonPrinter(ElementwisePrinter):
    """Triton: values are fp32 (or fp64) blocks; `tl.` ops, libdevice where tl has none."""

    known_functions = {
        # tl.exp is ex2.approx on NVIDIA GPUs: 4e-7 relative error at |x| ~ 8 in fp32, 20x
        # torch's (measured on the H100); libdevice's expf is within 2 ulp.
        "exp": "libdevice.exp",
        "log": "tl.log",
        "tanh": "libdevice.tanh",
        "erf": "tl.erf",
        "Abs": "tl.abs",
        "sigmoid": "tl.sigmoid",
        # libdevice's, correctly rounded or within 2 ulp; tl.sin and tl.cos may lower to the
        # approximate PTX instructions, whose error grows with |x|.
        "round_half_even": "libdevice.rint",  # rounds halves to even, as torch.round
        "floor": "libdevice.floor",
        "log1p": "libdevice.log1p",
        "expm1": "libdevice.expm1",
        "sin": "libdevice.sin",
        "cos": "libdevice.cos",
    }
    where, sqrt, rsqrt, power = "tl.where", "sqrt_rn", "rsqrt_rn", "libdevice.pow"
    column = "cols[None, :]"  # every kind's kernels index a tile's columns by `cols` (naming.SHARED_NAMES)

    def converted(self, value):
        return f"{value}.to({COMPUTE_DTYPE})"

    def maximum(self, a, b):  # kernel_lib's: NaN propagates, as in torch
        return f"maximum({a}, {b})"

    def _print_relu(self, expr):
        return self.maximum(self._print(expr.args[0]), "0.0")

    def minimum(self, a, b):
        return f"minimum({a}, {b})"

    def scalar(self, number):
        return f"tl.full((), {number}, {COMPUTE_DTYPE})"

    def _power_operand(self, expr):
        # libdevice.pow has overloads for (fp32, fp32) and (fp64, fp64) (and an int32 exponent)
        # and picks one by its arguments' types: a number must be in the compute type too.
        # (The kernel converts its scalar params to the compute type on entry.)
        return self.scalar(self._print(expr)) if expr.is_number else self._print(expr)
