"""The pointwise kind: each element of the outputs from the same element of each input,
and each input's gradient element by element. Its bodies are straight-line code
(plan.Body): one with dropout and, where the op has dropout, one without."""
from __future__ import annotations

from fusegen.body_text import statements
from fusegen.plan import Body, OpPlan
from fusegen.printers import TorchPrinter
from fusegen.simplify import Block, SimplifiedOp

from .base import ReferenceBody, fused_backward_doc, reference_signature, torch_constant, tuple_text


class Pointwise:
    name = "pointwise"
    def backward_doc(self, plan: OpPlan) -> str:
        return fused_backward_doc(plan)  # nothing read back but the inputs

    def matches(self, op: SimplifiedOp) -> bool:
        return isinstance(op.forward, Block) and op.ir.matmul is None

    def symbol_names(self, namer, op: SimplifiedOp) -> dict[str, str]:
        return {}  # every symbol is an input's, a param's, a mask's, a gradient's or a temporary

    def body(self, block: Block, rename: dict, temps: dict[str, str], results: dict[str, str]) -> Body:
        return Body(
            tuple((temps[t.name], e.xreplace(rename)) for t, e in block.temps),
            tuple((results[n], e.xreplace(rename)) for n, e in block.results),
        )

    def row_values(self, plan: OpPlan) -> frozenset[str]:
        return frozenset()

    def statistics(self, plan: OpPlan) -> int:
        return 0

    def reference(self, plan: OpPlan, printer: TorchPrinter) -> ReferenceBody:
        arguments, returns, tensors = reference_signature(plan)
        kernel = plan.forward
        if kernel.body_no_dropout is None:
            return ReferenceBody(arguments, returns, [], statements(kernel.body, printer, torch_constant, tensors))
        return ReferenceBody(
            arguments,
            returns,
            [f"{tuple_text(m.local for m in kernel.masks)} = masks"]
            + statements(kernel.body, printer, torch_constant, tensors),
            statements(kernel.body_no_dropout, printer, torch_constant, tensors),
        )

    def sections(self, plan: OpPlan) -> list[tuple[str, list[str]]]:
        forward, backward, dropout = plan.forward, plan.backward, plan.has_dropout
        bodies = [
            ("forward (dropout on)", forward.body if dropout else None),
            ("forward (dropout off)" if dropout else "forward", forward.body_no_dropout or forward.body),
            ("backward (dropout on)", backward.body if dropout else None),
            ("backward (dropout off)" if dropout else "backward", backward.body_no_dropout or backward.body),
        ]
        return [
            (f"{title}, simplified and CSE'd", [f"{name} = {expr}" for name, expr in (*body.temps, *body.results)])
            for title, body in bodies if body is not None
        ]


KIND = Pointwise()
