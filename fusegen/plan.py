"""The plan: what each kernel of the op does, as typed frozen data, every name final
(fusegen.planning builds it from the simplified op).

The plan is the one object a backend reads. It says, per kernel: its kind, the inputs it
loads (and each value an input supplies: the input, or each of its chunks), the params it
takes, the dropout masks it draws, its CSE'd body, and what it stores: outputs, or input
gradients with how each is reduced. Expressions are sympy over symbols already named as
the generated code names them; a backend prints them and lays them out, deciding nothing
about the op itself.

Names: a spec name stays as the user wrote it, unless the backend's generated code
already uses it for itself (then it takes a trailing underscore, inside the generated
code only: public signatures keep the spec's names). See fusegen.names.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from .layout import Choice, Input, Scalar
# A row kernel's body is simplify's frozen RowProgram with every name final (renamed by
# plan building): the backend reads it as the plan's, under these names, and imports
# nothing of fusegen.rows.
from .rows import SHIFT_NEW, SHIFT_OLD, Reduction as RowReduction, RowPass, RowProgram as RowBody  # noqa: F401  (the plan's API)


@dataclass(frozen=True)
class Value:
    """One value an input supplies to expressions: the input, or one of its chunks."""

    local: str  # its name in generated code
    chunk: int  # which chunk (0 for an input without chunks)


@dataclass(frozen=True)
class InputPlan:
    name: str  # the spec's (and the public signature's) name
    local: str  # the name generated functions use for it
    layout: Input
    values: tuple[Value, ...]


@dataclass(frozen=True)
class ParamPlan:
    name: str
    local: str
    declaration: Scalar | Choice
    default: object
    dropout_p: bool  # some dropout's probability: the kernels take its threshold and scale


@dataclass(frozen=True)
class Mask:
    """A dropout mask: scale where kept, 0 where dropped, drawn from the seed per element."""

    local: str
    stream: int  # the Philox stream that tells this mask from the op's others
    p: ParamPlan


@dataclass(frozen=True)
class Body:
    """Straight-line code: temporaries in order, then named results."""

    temps: tuple[tuple[str, sympy.Expr], ...]
    results: tuple[tuple[str, sympy.Expr], ...]  # (local name of the result, expression)


@dataclass(frozen=True)
class GradientPlan:
    """An input gradient a backward kernel computes. How it is reduced follows from how the
    input was broadcast, which the runtime sees: written as it is (same shape), summed
    over rows ([N]-like), summed along each row (declared [..., 1]: `one_per_row`), or
    written in full and summed by torch (any other broadcast)."""

    input: InputPlan
    values: tuple[str, ...]  # local name of each chunk's gradient, in chunk order
    one_per_row: bool


@dataclass(frozen=True)
class OutputParts:
    """An output concatenated along its last dim (`y: [a, b]`, [..., kN]): part k fills its
    columns k·N to (k + 1)·N; the mirror of a chunked input's values. The output's pointer
    and its incoming gradient's are the output's own (KernelPlan.outputs, .incoming)."""

    name: str  # the spec's name
    values: tuple[str, ...]  # the forward body's result for each part, in order
    incoming: tuple[str, ...]  # the backward body's incoming gradient of each part, in order


@dataclass(frozen=True)
class KernelPlan:
    inputs: tuple[InputPlan, ...]  # inputs the kernel loads
    incoming: tuple[str, ...]  # backward: local names of the outputs' incoming gradients
    outputs: tuple[str, ...]  # forward: local names of the outputs it stores
    gradients: tuple[GradientPlan, ...]  # backward: the input gradients it stores
    scalars: tuple[ParamPlan, ...]  # numbers the body reads
    masks: tuple[Mask, ...]
    choices: tuple[ParamPlan, ...]
    # The pointwise kind: a Body with dropout (where the op has any) and one without.
    # The row kind: one RowBody; with dropout off its masks are 1.
    body: Body | RowBody
    body_no_dropout: Body | None  # training=False or p == 0; None for ops without dropout
    row_width: str | None = None  # the row kind: the local holding N in the compute type, if read


@dataclass(frozen=True)
class HelperPlan:
    """A choice param's functions: one body per choice, for the function and each partial
    derivative. Helpers have their own scope: arguments args, result `out`."""

    param: ParamPlan
    args: tuple[str, ...]
    forward: tuple[tuple[str, Body], ...]  # (choice, body)
    derivatives: tuple[tuple[tuple[str, Body], ...], ...]  # per argument: (choice, body)
    # The reference's helper (module-level, so '_'-prefixed; its bodies are `forward`).
    torch_name: str
    # The eager twin's helper: its name, and per choice the expression a PyTorch user writes
    # for it (F.gelu(x)), over args.
    eager_name: str
    eager: tuple[tuple[str, str], ...]  # (choice, expression)


@dataclass(frozen=True)
class LowRankPlan:
    """The low-rank product beside the matmul, `(a @ T(down)) @ T(up)` (LoRA's): its [..., N]
    value (`value`) is the bodies' as the product is; the forward forms it per tile from its
    [BLOCK_M, R] inner product; the backward takes its gradient from the g kernel (or an
    output's incoming gradient: `incoming`), and the operands' from it by matmuls."""

    down: InputPlan  # [R, K] under T, else [K, R]
    up: InputPlan  # [N, R] under T, else [R, N]
    down_transposed: bool
    up_transposed: bool
    value: InputPlan
    incoming: str | None  # the output whose incoming gradient is the low-rank product's, if any


@dataclass(frozen=True)
class HiddenPlan:
    """A hidden layer before the matmul (an MLP's): its own product `a @ T(weight)` ([..., H],
    the local `product`), its function of that and of its [H] `inputs` (`body`: results `value`,
    then `partials`, the distinct partial derivatives the forward keeps for the backward), and
    each read value's partial by index (`partial_of`: the product's, then each input's)."""

    weight: InputPlan  # [H, K] under T, else [K, H]
    transposed: bool
    text: str  # the function as the spec writes it
    inputs: tuple[InputPlan, ...]
    product: str
    value: str
    partials: tuple[str, ...]
    partial_of: tuple[int, ...]
    body: Body  # value and partials: the forward kernel's
    reference: Body  # value alone: the reference's


@dataclass(frozen=True)
class MatmulPlan:
    """The gemm kind's matmul, `a @ b` or `a @ T(b)`: its product is a value of the kernels'
    bodies as an input is (`product`, [..., N]), formed by the forward kernel; the backward
    forms its gradient g from the saved product (`saved`) or takes an output's incoming
    gradient as g (`incoming`: the product passes through to that output), then a's and b's
    gradients are matmuls of g."""

    a: InputPlan
    b: InputPlan
    transposed: bool  # b is [N, K] (nn.Linear's weight), else [K, N]
    product: InputPlan
    saved: bool  # the backward body reads the product: the forward stores it
    incoming: str | None  # the output whose incoming gradient is the product's, if any
    lowrank: LowRankPlan | None = None  # the low-rank product beside it (LoRA's), if any
    hidden: HiddenPlan | None = None  # the hidden layer of a before it (an MLP's), if any


@dataclass(frozen=True)
class OpPlan:
    op: str  # the op's name: its module's, its function's
    kind: str  # its kernels' kind, by its registered name (fusegen.kinds.KINDS)
    doc: str  # the spec's doc text
    spec_path: str  # the spec file, as the build was given it, and its sha256: the module's header
    spec_sha256: str
    public_signature: str  # the op function's parameters, as its `def` line writes them
    op_signature: str  # the op's own parameters (`reference`'s): the public ones, inplace_backward
    inputs: tuple[InputPlan, ...]
    params: tuple[ParamPlan, ...]
    outputs: tuple[tuple[str, str], ...]  # (spec name, local name)
    row_outputs: frozenset[str]  # spec names of outputs with one value per row, [..., 1]
    output_dims: tuple[tuple[str, tuple[str, ...]], ...]  # (spec name, its dims as the spec names them)
    masks: tuple[Mask, ...]
    forward: KernelPlan
    backward: KernelPlan
    passthrough: tuple[tuple[str, str], ...]  # (input, output): the input's gradient is the output's
    same_gradient: tuple[tuple[str, str], ...]  # (input, earlier input): the same gradient (simplify.Gradient)
    # (input, outputs): an input whose gradient reads the incoming gradients of only some
    # outputs, those (simplify.Gradient.reads); inputs that read every output's are left out.
    gradient_reads: tuple[tuple[str, tuple[str, ...]], ...]
    # The user-style baseline's body (`eager`, over the inputs' and params' locals): chunked
    # inputs split, the spec's intermediates as locals, then `return` the outputs as the
    # spec writes them, in PyTorch (F.gelu, F.dropout).
    eager: tuple[str, ...]
    helpers: tuple[HelperPlan, ...]
    # Every name the module's code uses so far (the backend's reserved names, and each the plan
    # gave out): a backend's own derived names start from these (names.Namer(taken)).
    taken: frozenset[str]
    # (spec name, dtype) of each output that declares its own dtype (layout.OUTPUT_DTYPES; the
    # others take the float inputs'), converted as torch's tensor.to(dtype) does; and the
    # outputs that have no gradient (quantized ones, `differentiable: false`).
    output_dtypes: tuple[tuple[str, str], ...] = ()
    no_gradient: frozenset[str] = frozenset()
    # The outputs written as parts side by side along their last dim; the others are whole.
    output_parts: tuple[OutputParts, ...] = ()
    matmul: MatmulPlan | None = None  # the gemm kind's

    def parts_of(self, output: str) -> OutputParts | None:
        """The output's parts, by its spec name; None for a whole output."""
        return next((p for p in self.output_parts if p.name == output), None)

    @property
    def has_dropout(self) -> bool:
        return bool(self.masks)

    @property
    def forward_only(self) -> bool:
        """No output has a gradient (a float8 q and its scale): no backward kernel, no autograd."""
        return len(self.no_gradient) == len(self.outputs)


