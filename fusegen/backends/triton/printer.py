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

    def __init__(self, helpers=None, choices=None, row_values=frozenset(), scalars=frozenset(), tiles=frozenset()):
        # A where decided by params takes one side for the whole call (`choose`): a kernel then
        # spends nothing on softcap's tanh with softcap off.
        super().__init__(helpers, choices, row_values, scalars)
        # Values that are whole tiles in the compute type (inputs' and incoming gradients'
        # loads): an expression that reads one is such a tile too.
        self.tiles = frozenset(tiles)

    def converted(self, value):
        return f"{value}.to({COMPUTE_DTYPE})"

    def choose(self, cond, if_true, if_false, false_text):
        # A condition of params is a 0-d tensor: `a if c else b` is a branch (scf.if) that
        # computes one side, where tl.where computes both. Its sides must have one type: each
        # reads a tile, or is a number made a tile like the other side's.
        if self.decided_once(cond):
            sides = [self._tile_of(e) for e in (if_true, if_false)]
            tile = next((t for t in sides if t), None)
            if tile and all(t or e.is_number for t, e in zip(sides, (if_true, if_false))):
                true_text, false_text = (
                    text if t else f"tl.zeros_like({tile}) + {self._print(e)}"
                    for t, e, text in zip(sides, (if_true, if_false), (self._print(if_true), false_text)))
                return f"({true_text} if {self._print(cond)} else {false_text})"
        return super().choose(cond, if_true, if_false, false_text)

    def _tile_of(self, expr) -> str | None:
        """A tile that `expr` reads (the first by name), if any."""
        return min((s.name for s in expr.free_symbols if s.name in self.tiles), default=None)

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
