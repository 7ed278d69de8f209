"""What a kernel kind brings, backend-neutral, and what it hands back.

A kind (pointwise, row, ...) is one module beside this one, registered in
fusegen/kinds/__init__.py. It brings the part of plan building that is its own (the names
of its symbols, its kernels' bodies as the plan holds them) and the part of the module's
Python face that is its own (the reference body in torch, what its backward keeps). Each
backend registers the kind's kernel text, launcher binding and tuning space beside its own
code (fusegen/backends/<name>/kinds.py), under the same name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fusegen.names import Namer
    from fusegen.plan import Body, OpPlan, RowBody
    from fusegen.printers import TorchPrinter
    from fusegen.simplify import SimplifiedOp


@dataclass
class ReferenceBody:
    """The reference's body (`_reference` in a generated module): its arguments and return,
    the lines with dropout's masks and without, then the lines after either."""

    arguments: str
    returns: str
    dropout_lines: list[str]
    plain_lines: list[str]
    lines: list[str] = field(default_factory=list)


def fused_backward_doc(plan: OpPlan, recomputes: str = "", keeps: str = "", kernel: str | None = None) -> str:
    """The backward as one fused kernel: what it reads back from the forward beside the inputs
    (`recomputes`), and what is saved for it (`keeps`), each empty or starting " and "; `kernel`:
    what the kernel does, in place of recomputing and writing every gradient in one pass."""
    redraw = ", draws the dropout masks again from the seed" if plan.has_dropout else ""
    saved = ["the inputs"] + ["the seed tensor"] * plan.has_dropout + [keeps.removeprefix(" and ")] * bool(keeps)
    saved_text = saved[0] if len(saved) == 1 else f"{', '.join(saved[:-1])} and {saved[-1]}"
    kernel = kernel or (f"one fused kernel recomputes the forward from the saved inputs{recomputes}{redraw} and "
                        "writes every input gradient in one pass")
    return f"Backward: {kernel}. Saved for it: {saved_text}, nothing else."


class Kind(Protocol):
    name: str  # the plan's `kind`, and each backend's key for the kind's kernel text
    def backward_doc(self, plan: OpPlan) -> str:
        """The module docstring's sentences on the backward (`fused_backward_doc`'s, for most)."""

    def matches(self, op: SimplifiedOp) -> bool:
        """Whether simplify's op is this kind's (exactly one kind matches)."""

    def symbol_names(self, namer: Namer, op: SimplifiedOp) -> dict[str, str]:
        """Simplify's symbol names of this kind's own (row values, say) → local names."""

    def body(self, block, rename: dict, temps: dict[str, str], results: dict[str, str]) -> Body | RowBody:
        """Simplify's block as the plan holds it: over local names (`rename`, sympy's
        xreplace; `temps` for temporaries), results named by `results`."""

    def row_values(self, plan: OpPlan) -> frozenset[str]:
        """Locals that hold one value per row ([BLOCK_M, 1], [..., 1]): what printers broadcast."""

    def statistics(self, plan: OpPlan) -> int:
        """Values per row the forward keeps for the backward."""

    def reference(self, plan: OpPlan, printer: TorchPrinter) -> ReferenceBody:
        """The forward's body in torch: what `reference` and the oracle tests run."""

    def sections(self, plan: OpPlan) -> list[tuple[str, list[str]]]:
        """What `fusegen show` prints of the kernels' bodies: (heading, lines)."""


def torch_constant(text: str) -> str:
    """A reference's result that reads no tensor, broadcast to the problem."""
    return f"torch.full(problem.shape, {text}, dtype=problem.compute_dtype, device=problem.device)"


def tuple_text(names) -> str:
    """`(a, b)`, or `(a,)` for one."""
    names = list(names)
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


def reference_signature(plan: OpPlan) -> tuple[str, str, set[str]]:
    """The reference's arguments, its return, and the locals that are tensors (the
    forward's values and masks): as every kind's reference takes and gives them."""
    kernel = plan.forward  # the reference computes what the forward kernel does, in torch
    # With a matmul (the gemm kind) it takes the operands too, and forms the product first.
    values = [v.local for i in (plan.inputs if plan.matmul else kernel.inputs) for v in i.values]
    arguments = ["problem", *values, *(p.local for p in plan.params)] + (["masks"] if plan.has_dropout else [])
    returns = []
    for (name, _), out in zip(plan.outputs, kernel.outputs):
        parts = plan.parts_of(name)
        # A concatenated output: its parts (each as broadcast as its own inputs) side by side.
        returns.append(out if parts is None else
                       f"torch.cat([part.expand(problem.shape) for part in {tuple_text(parts.values)}], dim=-1)")
    tensors = set(values) | {m.local for m in kernel.masks} | (
        {v.local for v in plan.matmul.product.values} if plan.matmul else set())
    return ", ".join(arguments), tuple_text(returns), tensors
