"""The layout model: what an op declares about its arguments, as data. fusegen.spec parses it
once; the plan hands it on, and each generated module writes it out as these literals for
fusegen.runtime to check calls against (no dim strings are parsed twice)."""
from __future__ import annotations


from dataclasses import dataclass


# An input's dtypes besides "float": read by the kernels as they are (compared, conditions).
INTEGER_DTYPES = ("int64", "int32", "bool")
# An output's declared dtypes (`q: {expr: ..., dtype: float8_e4m3fn}`), torch's names; without
# one an output takes the float inputs' dtype. The quantized ones have no gradient.
QUANTIZED_DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8")
OUTPUT_DTYPES = (*QUANTIZED_DTYPES, "float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class Input:
    """A tensor input: its dims ("...", a dim name, or "1"), and how many chunks its last
    dim holds (x [..., 2N] is Input("x", ("...", "N"), chunks=2): two N-wide chunks); or its
    first (chunk_dim 0: a matmul's weight [2N, K], nn.Linear's layout of two projections)."""

    name: str
    dims: tuple[str, ...]
    chunks: int = 1
    # "float" (any of the float dtypes; differentiable), or one integer or bool dtype, which
    # the kernels read as such and never differentiate (INTEGER_DTYPES).
    dtype: str = "float"
    chunk_dim: int = -1  # the dim written kN: the last, or 0 (a two-dim matmul operand)

    @property
    def differentiable(self) -> bool:
        return self.dtype == "float"

    @property
    def declared(self) -> str:
        """The dims as the spec writes them: [..., 2N]."""
        dims = list(self.dims)
        if self.chunks > 1:
            dims[self.chunk_dim] = f"{self.chunks}{dims[self.chunk_dim]}"
        return "[" + ", ".join(dims) + "]"

    @property
    def one_per_row(self) -> bool:
        """Declared [..., 1]: one value per row, broadcast along the columns."""
        return self.chunks == 1 and bool(self.dims) and self.dims[-1] == "1"


@dataclass(frozen=True)
class Scalar:
    """A runtime number: passed to the kernels on every call, checked against its range."""

    name: str
    type: str  # "float" or "int", as the spec's `type:`
    low: float | int | None = None
    high: float | int | None = None
    # Exclusive bounds (a spec's gt: / lt:): the value must differ from them too.
    low_open: bool = False
    high_open: bool = False


@dataclass(frozen=True)
class Choice:
    """A compile-time choice between functions: one kernel specialization each."""

    name: str
    choices: tuple[str, ...]


def range_text(low, high, low_open: bool = False, high_open: bool = False) -> str:
    """A scalar's range as errors and docstrings print it: `in [0.0, 1.0]`, `in (0.0, 1.0]`,
    `≥ 0.0`, `> 0.0`, `≤ 1.0`, `< 1.0` or ""."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low!r}, {high!r}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '≥'} {low!r}"
    return "" if high is None else f"{'<' if high_open else '≤'} {high!r}"


def in_range(value, low, high, low_open: bool = False, high_open: bool = False) -> bool:
    """Whether value lies within the bounds (inclusive, or exclusive where open)."""
    if low is not None and (value <= low if low_open else value < low):
        return False
    return high is None or (value < high if high_open else value <= high)


@dataclass(frozen=True)
class LowRank:
    """A low-rank product `(a @ T(down)) @ T(up)` (LoRA's: down [R, K], up [N, R], R small; each
    without T: [K, R], [R, N]): beside an op's matmul of the same `a`, its [..., N] value is
    another that the rest of the op reads; its inner [..., R] product is read by it alone."""

    a: str
    down: str
    up: str
    down_transposed: bool
    up_transposed: bool

    @property
    def text(self) -> str:
        down = f"T({self.down})" if self.down_transposed else self.down
        up = f"T({self.up})" if self.up_transposed else self.up
        return f"({self.a} @ {down}) @ {up}"


@dataclass(frozen=True)
class Hidden:
    """A hidden layer before an op's matmul (an MLP's `f(a @ T(weight) + bias) @ T(b)`): its
    [..., H] value, an elementwise function of its own product a @ T(weight) ([H, K] under T,
    else [K, H]) and of [H] inputs and params, is the matmul's left operand; H is small (a tile
    holds its rows' [BLOCK_M, H]). `text` is the function as the spec writes it."""

    weight: str
    transposed: bool
    inputs: tuple[str, ...] = ()  # the [H] inputs the function reads
    text: str = ""


@dataclass(frozen=True)
class MatMul:
    """An op's matmul `a @ b` (b [K, N]) or `a @ T(b)` (transposed: b [N, K], nn.Linear's
    weight), by its operands' input names: its product [..., N] is what the rest of the op reads;
    with a low-rank product of the same a beside it (LoRA), that one's too. With a hidden layer,
    a is that layer's input and the product hidden(a) @ b (an MLP's two layers)."""

    a: str
    b: str
    transposed: bool
    lowrank: LowRank | None = None
    # A hidden layer of a between: the product is hidden(a) @ b, hidden(a) [..., H] (an MLP's).
    hidden: Hidden | None = None

    @property
    def text(self) -> str:
        a = f"({self.hidden.text})" if self.hidden else self.a
        return f"{a} @ T({self.b})" if self.transposed else f"{a} @ {self.b}"

    @property
    def operands(self) -> tuple[str, ...]:
        """The inputs only the matmuls read: a and b, the low-rank product's two, and the hidden
        layer's weight and inputs."""
        hidden = (self.hidden.weight, *self.hidden.inputs) if self.hidden else ()
        return (self.a, self.b) + ((self.lowrank.down, self.lowrank.up) if self.lowrank else ()) + hidden
