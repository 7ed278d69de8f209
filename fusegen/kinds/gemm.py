"""The gemm kind: one matmul, `a @ b` or `a @ T(b)` ([..., K] by [K, N], or nn.Linear's [N, K]
weight), whose product the elementwise rest of the op reads as an input (its epilogue). The
epilogue's bodies are the pointwise kind's, over the product as a value (plan.MatmulPlan).
The forward forms the product tile by tile and runs the epilogue on it before anything is
written; the backward forms g, the product's gradient, elementwise from the saved product
(the pointwise backward, with the product as an input), and a's and b's gradients are
matmuls of g."""
from __future__ import annotations

from fusegen.plan import OpPlan
from fusegen.printers import TorchPrinter
from fusegen.simplify import SimplifiedOp

from .base import ReferenceBody
from .pointwise import Pointwise


class Gemm(Pointwise):
    name = "gemm"
    recomputes = ""
    keeps = " and the product of the matmul"

    def matches(self, op: SimplifiedOp) -> bool:
        return op.ir.matmul is not None

    def statistics(self, plan: OpPlan) -> int:
        """The saved product, where the backward reads it (FusedOp keeps it whole, [..., N])."""
        return int(plan.matmul.saved)

    def reference(self, plan: OpPlan, printer: TorchPrinter) -> ReferenceBody:
        body = super().reference(plan, printer)  # over the product, which it takes first
        m = plan.matmul
        product = f"{m.product.local} = {m.a.local} @ {m.b.local}{'.mT' if m.transposed else ''}"
        dropout = [product, *body.dropout_lines] if body.dropout_lines else []
        return ReferenceBody(body.arguments, body.returns, dropout, [product, *body.plain_lines], body.lines)

    def sections(self, plan: OpPlan) -> list[tuple[str, list[str]]]:
        m = plan.matmul
        product = f"{m.product.local} = {m.a.local} @ {m.b.local}{'.T' if m.transposed else ''}"
        return [("the matmul", [product]), *super().sections(plan)]


KIND = Gemm()
