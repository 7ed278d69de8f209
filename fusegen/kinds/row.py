"""The row kind: a program owns whole rows. Reductions along the row (the passes of a
RowProgram, fusegen.rows), then each element of the outputs, or of each input's gradient.
Its body is one RowBody each way; with dropout off its masks are 1. The forward keeps each
row's reductions for the backward: the row's statistics (`RowProgram.statistics`)."""
from __future__ import annotations

from fusegen.body_text import statements
from fusegen.names import Namer
from fusegen.plan import Body, OpPlan, RowBody
from fusegen.printers import TorchPrinter
from fusegen.rows import ADJOINT_PREFIX, ADJOINT_SUM_PREFIX, EXTREME_PREFIX, REDUCTION_PREFIX, TIES_PREFIX, WIDTH
from fusegen.rows import RowProgram
from fusegen.simplify import SimplifiedOp

from .base import ReferenceBody, fused_backward_doc, reference_signature, torch_constant, tuple_text

_TORCH_REDUCTIONS = {"sum": "torch.sum", "mean": "torch.mean", "max": "torch.amax", "min": "torch.amin"}


class Row:
    name = "row"
    def backward_doc(self, plan: OpPlan) -> str:
        return fused_backward_doc(plan, " and the forward's per-row statistics",
                                  " and each row's statistics (fp32, [..., statistics])")

    def matches(self, op: SimplifiedOp) -> bool:
        return isinstance(op.forward, RowProgram)

    def symbol_names(self, namer: Namer, op: SimplifiedOp) -> dict[str, str]:
        """Row symbols as the generated code names them: each forward reduction by its op
        (mean0, max1), the backward's tie counts, row sums and adjoints (ties0, row_sum2,
        grad_mean0), and N in the compute type (row_width)."""
        forward, backward = op.forward, op.backward
        names = {WIDTH.name: namer.claim("row_width")}
        ops = {r.symbol.name: r.op for r in forward.reductions}
        for r in (*forward.reductions, *backward.reductions):
            name = r.symbol.name
            if name in names:
                continue
            if name.startswith(REDUCTION_PREFIX):
                names[name] = namer.claim(f"{ops[name]}{name[len(REDUCTION_PREFIX):]}")
            elif name.startswith(TIES_PREFIX):
                names[name] = namer.claim(f"ties{name[len(TIES_PREFIX):]}")
            elif name.startswith(EXTREME_PREFIX):
                k = name[len(EXTREME_PREFIX):]
                names[name] = namer.claim(f"{ops[REDUCTION_PREFIX + k]}{k}_again")
            elif name.startswith(ADJOINT_SUM_PREFIX):
                names[name] = namer.claim(f"row_sum{name[len(ADJOINT_SUM_PREFIX):]}")
        for item in (*backward.row_values, *(v for p in backward.passes for v in p.row_values)):
            name = item[0].name
            if name.startswith(ADJOINT_PREFIX):
                reduction = REDUCTION_PREFIX + name[len(ADJOINT_PREFIX):]
                names[name] = namer.claim(f"grad_{names[reduction]}")
        return names

    def body(self, block: RowProgram, rename: dict, temps: dict[str, str], results: dict[str, str]) -> RowBody:
        return block.renamed(rename, results)  # temporaries are symbols in `rename` too

    def row_values(self, plan: OpPlan) -> frozenset[str]:
        """The row programs' reductions (computed or kept by the forward) and row values."""
        found = set()
        for body in (plan.forward.body, plan.backward.body):
            found |= {r.symbol.name for r in body.reductions} | {s.name for s, _ in body.loaded}
            found |= {s.name for s, _ in (*body.row_values, *(v for p in body.passes for v in p.row_values))}
        return frozenset(found)

    def statistics(self, plan: OpPlan) -> int:
        return len(plan.forward.body.statistics)

    def reference(self, plan: OpPlan, printer: TorchPrinter) -> ReferenceBody:
        """One body; with dropout off its masks are 1, as in the kernel."""
        arguments, returns, tensors = reference_signature(plan)
        kernel = plan.forward
        body: RowBody = kernel.body
        # What varies along the row: the tensors, and the temporaries computed per element.
        elements = tensors | {t.name for p in body.passes for t, _ in p.temps} | {t.name for t, _ in body.final_temps}
        # and the row values, [..., 1] tensors: an output of them alone is one value a row
        elements |= {r.symbol.name for r in body.reductions}
        elements |= {t.name for t, _ in (*body.row_values, *(v for p in body.passes for v in p.row_values))}

        def assign(items, constant=None) -> list[str]:
            return statements(Body(tuple((t.name, e) for t, e in items), ()), printer, constant, elements)

        lines = [f"{kernel.row_width} = problem.n"] if kernel.row_width else []
        lines += assign(body.row_values)
        emitted: set = set()
        for p in body.passes:
            lines += assign([t for t in p.temps if t[0] not in emitted])
            emitted |= {t for t, _ in p.temps}
            for r in p.reductions:
                value = statements(Body((), (("_", r.value),)), printer, torch_constant, elements)
                text = value[-1][len("_ = "):]
                lines += value[:-1] + [f"{r.symbol.name} = {_TORCH_REDUCTIONS[r.op]}({text}, dim=-1, keepdim=True)"]
            lines += assign(p.row_values)
        lines += assign([t for t in body.final_temps if t[0] not in emitted])
        row_locals = {local for name, local in plan.outputs if name in plan.row_outputs}
        for result in body.results:  # a constant row output is one value per row
            constant = _torch_row_constant if result[0] in row_locals else torch_constant
            lines += statements(Body((), (result,)), printer, constant, elements)
        if not plan.has_dropout:
            return ReferenceBody(arguments, returns, [], [], lines)
        masks = tuple_text(m.local for m in kernel.masks)
        return ReferenceBody(arguments, returns, [f"{masks} = masks"], [f"{m.local} = 1.0" for m in kernel.masks], lines)

    def sections(self, plan: OpPlan) -> list[tuple[str, list[str]]]:
        return [
            (f"{title}, simplified and CSE'd, as passes along each row", list(kernel.body.lines()))
            for title, kernel in (("forward", plan.forward), ("backward", plan.backward))
        ]


def _torch_row_constant(text: str) -> str:
    return f"torch.full(problem.shape[:-1] + (1,), {text}, dtype=problem.compute_dtype, device=problem.device)"


KIND = Row()
