"""The gemm kind: one matmul, `a @ b` or `a @ T(b)` ([..., K] by [K, N], or nn.Linear's [N, K]
weight), whose product the elementwise rest of the op reads as an input (its epilogue), with
at most one low-rank product `(a @ T(down)) @ T(up)` beside it (LoRA's), read so too. The
epilogue's bodies are the pointwise kind's, over the product as a value (plan.MatmulPlan).
The forward forms the product tile by tile and runs the epilogue on it before anything is
written; the backward forms g, the product's gradient, elementwise from the saved product
(the pointwise backward, with the product as an input), and a's and b's gradients are
matmuls of g."""
from __future__ import annotations

from fusegen.plan import OpPlan
from fusegen.printers import TorchPrinter
from fusegen.simplify import SimplifiedOp

from fusegen.body_text import statements

from .base import ReferenceBody, fused_backward_doc, torch_constant
from .pointwise import Pointwise


class Gemm(Pointwise):
    name = "gemm"
    def backward_doc(self, plan: OpPlan) -> str:
        m, r = plan.matmul, plan.matmul.lowrank
        products = [("the product's", m.incoming), *([("the low-rank product's", r.incoming)] if r else [])]
        formed = [name for name, incoming in products if incoming is None]
        passed = [f"{name} gradient is {incoming}'s" for name, incoming in products if incoming is not None]
        redraw = ", its dropout masks drawn again from the seed," if plan.has_dropout else ""
        source = "product" if m.saved else "inputs"
        kernel = "; ".join([
            *([f"one elementwise kernel forms {' and '.join(formed)} gradient{'s' * (len(formed) > 1)} from the saved "
               f"{source}{redraw} and the other inputs' gradients in one pass"] if formed else
              [f"one elementwise kernel forms the other inputs' gradients{redraw.rstrip(',')}"]),
            *passed,
            "the operands' gradients are matmuls of these" + (" (the low-rank product's inner product formed again)"
                                                              if r else ""),
        ])
        if m.hidden is not None:
            kernel += ("; the hidden layer's gradients are matmuls of the one it passes back times the partial "
                       "derivatives its forward kept")
            keeps = (" and the product of the matmul" if m.saved else "") + (
                " and the hidden layer's values and partial derivatives")
            return fused_backward_doc(plan, keeps=keeps, kernel=kernel)
        return fused_backward_doc(plan, keeps=" and the product of the matmul" if m.saved else "", kernel=kernel)

    def matches(self, op: SimplifiedOp) -> bool:
        return op.ir.matmul is not None

    def statistics(self, plan: OpPlan) -> int:
        """Whether the forward keeps anything: the product, where the backward reads it, and a
        hidden layer's values and partials (gemm_launch lays them out side by side)."""
        return int(plan.matmul.saved or plan.matmul.hidden is not None)

    def reference(self, plan: OpPlan, printer: TorchPrinter) -> ReferenceBody:
        body = super().reference(plan, printer)  # over the product, which it takes first
        hidden = plan.matmul.hidden
        layer = []
        if hidden is not None:  # the hidden layer's value, from its product and its [H] inputs
            tensors = {hidden.product, *(v.local for i in hidden.inputs for v in i.values)}
            layer = statements(hidden.reference, printer, torch_constant, tensors)
        product = _products(plan, ".mT", layer)
        dropout = [*product, *body.dropout_lines] if body.dropout_lines else []
        return ReferenceBody(body.arguments, body.returns, dropout, [*product, *body.plain_lines], body.lines)

    def sections(self, plan: OpPlan) -> list[tuple[str, list[str]]]:
        hidden = plan.matmul.hidden
        layer = [f"{name} = {expr}" for name, expr in (*hidden.body.temps, *hidden.body.results)] if hidden else []
        return [("the matmuls" if hidden else "the matmul", _products(plan, ".T", layer)), *super().sections(plan)]


def _products(plan: OpPlan, transpose: str, layer: list[str]) -> list[str]:
    """`product = x @ weight.mT`; where b holds chunks, each chunk's product of its chunk of b;
    with a hidden layer, its product, then its lines (`layer`), then the product of its value."""
    m, r, h = plan.matmul, plan.matmul.lowrank, plan.matmul.hidden
    a = m.a.local
    lines = []
    if h is not None:
        lines = [f"{h.product} = {a} @ {h.weight.local}{transpose if h.transposed else ''}", *layer]
        a = h.value
    lines += [f"{p.local} = {a} @ {b.local}{transpose if m.transposed else ''}"
              for p, b in zip(m.product.values, m.b.values)]
    if r is not None:
        down, up = (f"{i.local}{transpose if t else ''}" for i, t in ((r.down, r.down_transposed), (r.up, r.up_transposed)))
        lines.append(f"{r.value.local} = ({m.a.local} @ {down}) @ {up}")
    return lines


KIND = Gemm()
