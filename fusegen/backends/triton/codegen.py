"""Plan → the text of a generated Triton module: the kernels, the op's declaration for
fusegen.runtime, its reference body and its public functions.

Everything is computed here (the kernels' text in kernel_text.py, the module's docstrings
and declaration in module_text.py, its names in naming.py) and handed to
templates/op.py.jinja as ready strings and lists of lines; the template holds layout only.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from importlib import resources

import jinja2

from fusegen import outdir, templating
from fusegen.plan import Body, HelperPlan, OpPlan, RowBody
from fusegen.printers import ElementwisePrinter, TorchPrinter
from fusegen.pyformat import format_module

from .kernel_text import backward_kernel, forward_kernel, kernel_lines, statements, torch_constant, with_argument_comments
from .module_text import class_doc, docstring, op_declaration
from .row_kernel_text import row_backward_kernel, row_kernel
from .naming import MODULE_IMPORTS, RESERVED_NAMES, TritonNames, module_class_name
from .printer import TritonPrinter

__all__ = ["MODULE_IMPORTS", "RESERVED_NAMES", "module_class_name", "render"]


@dataclass
class _Helper:
    name: str
    param: str
    arguments: str
    selector: str
    branches: list[dict]


def render(plan: OpPlan) -> str:
    """The text of generated/<op>.py."""
    names = TritonNames(plan)
    op = plan.op
    rows = plan.forward.kind.is_row
    row_values = _row_values(plan) if rows else frozenset()
    triton = TritonPrinter(names.triton_helpers, names.constexprs, row_values)
    torch_printer = TorchPrinter(names.torch_helpers, {p.name: p.local for p in plan.params}, row_values)
    forward = (row_kernel if rows else forward_kernel)(plan, names, triton)
    backward = (row_backward_kernel if rows else backward_kernel)(plan, names, triton)
    triton_helpers = [h for helper in plan.helpers for h in _triton_helpers(helper, names, triton)]
    torch_helpers = [_torch_helper(helper, names, torch_printer) for helper in plan.helpers]
    reference = _reference(plan, torch_printer)
    eager_helpers = [_eager_helper(helper) for helper in plan.helpers]
    eager_lines = list(plan.eager)
    kernel_code = "\n".join(
        [*kernel_lines(forward), *kernel_lines(backward)]
        + [line for h in triton_helpers for b in h.branches for line in b["lines"]]
    )
    class_name = module_class_name(op)
    params = plan.params
    public = [i.name for i in plan.inputs] + [p.name for p in params] + (["training", "seed"] if plan.has_dropout else [])
    twin = f"Eager PyTorch twin of {op}: same arguments, same values" + (", same dropout mask." if plan.has_dropout else ".")
    context = dict(
        op=op,
        header=outdir.header_lines(op, plan.spec_path),  # as outdir reads it back
        reference_doc=textwrap.wrap(twin, width=92),
        doc=plan.doc,
        spec_path=plan.spec_path,
        spec_sha256=plan.spec_sha256,
        docstring=docstring(plan, class_name),
        uses_functional="F." in "\n".join(eager_lines + [line for h in eager_helpers for b in h.branches for line in b["lines"]]),
        uses_libdevice="libdevice." in kernel_code,
        kernel_lib_names=", ".join(
            n for n in ("dropout_mask", "row_max", "row_min", "rsqrt_rn", "sqrt_rn") if f"{n}(" in kernel_code
        ),
        exports=", ".join(f'"{n}"' for n in (op, class_name, "reference", "eager")),
        triton_helpers=triton_helpers,
        row_kernels=rows,
        forward=with_argument_comments(forward),
        backward=with_argument_comments(backward),
        column_sum_buffers=", ".join(f'"{names.gradient_pointer[g.input.name]}"' for g in plan.backward.gradients if g.one_per_row),
        torch_helpers=torch_helpers,
        reference=reference,
        op_declaration=op_declaration(plan, forward, backward),
        public_signature=plan.public_signature,
        op_signature=plan.op_signature,
        public_arguments=", ".join(public),
        class_name=class_name,
        class_doc=class_doc(plan),
        # The class's methods take the spec's names and read nothing global but _OP (spec
        # names never start with '_'), so those names need no renaming there.
        init_signature=", ".join(["self"] + [f"{p.name}={p.default!r}" for p in params]
                                 + ["*", "inplace_backward=False"]),
        init_arguments=", ".join([p.name for p in params] + ["inplace_backward=inplace_backward"]),
        forward_signature=", ".join(["self"] + [i.name for i in plan.inputs]),
        module_call=", ".join(
            [i.name for i in plan.inputs] + [f"self.{p.name}" for p in params]
            + (["self.training", "None"] if plan.has_dropout else [])
            + ["inplace_backward=self.inplace_backward"]
        ),
        has_dropout=plan.has_dropout,
        eager_helpers=eager_helpers,
        eager_signature=", ".join(
            [i.local for i in plan.inputs] + [f"{p.local}={p.default!r}" for p in params]
            + (["training=True", "seed=None"] if plan.has_dropout else [])
        ),
        eager_lines=eager_lines,
    )
    return format_module(_environment().get_template("op.py.jinja").render(**context))


@dataclass
class _ReferenceBody:
    arguments: str
    returns: str
    dropout_lines: list[str]
    plain_lines: list[str]
    lines: list[str] = field(default_factory=list)  # after either branch


_TORCH_REDUCTIONS = {"sum": "torch.sum", "mean": "torch.mean", "max": "torch.amax", "min": "torch.amin"}


def _reference(plan: OpPlan, printer: TorchPrinter) -> _ReferenceBody:
    kernel = plan.forward  # the reference computes what the forward kernel does, in torch
    values = [v.local for i in kernel.inputs for v in i.values]
    tensors = set(values) | {m.local for m in kernel.masks}
    arguments = ["problem", *values, *(p.local for p in plan.params)] + (["masks"] if plan.has_dropout else [])
    returns = "(" + ", ".join(kernel.outputs) + ("," if len(kernel.outputs) == 1 else "") + ")"
    if kernel.kind.is_row:
        # One body; with dropout off its masks are 1, as in the kernel.
        masks = "(" + ", ".join(m.local for m in kernel.masks) + ("," if len(kernel.masks) == 1 else "") + ")"
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
                lines += value[:-1] + [f"{r.symbol.name} = {_TORCH_REDUCTIONS[r.kind]}({text}, dim=-1, keepdim=True)"]
            lines += assign(p.row_values)
        lines += assign([t for t in body.final_temps if t[0] not in emitted])
        row_locals = {local for name, local in plan.outputs if name in plan.row_outputs}
        for result in body.results:  # a constant row output is one value per row
            constant = _torch_row_constant if result[0] in row_locals else torch_constant
            lines += statements(Body((), (result,)), printer, constant, elements)
        if not plan.has_dropout:
            return _ReferenceBody(", ".join(arguments), returns, [], [], lines)
        return _ReferenceBody(
            ", ".join(arguments), returns, [f"{masks} = masks"], [f"{m.local} = 1.0" for m in kernel.masks], lines
        )
    if kernel.body_no_dropout is None:
        return _ReferenceBody(", ".join(arguments), returns, [], statements(kernel.body, printer, torch_constant, tensors))
    masks = "(" + ", ".join(m.local for m in kernel.masks) + ("," if len(kernel.masks) == 1 else "") + ")"
    return _ReferenceBody(
        ", ".join(arguments),
        returns,
        [f"{masks} = masks"] + statements(kernel.body, printer, torch_constant, tensors),
        statements(kernel.body_no_dropout, printer, torch_constant, tensors),
    )


def _row_values(plan: OpPlan) -> frozenset[str]:
    """The row programs' reductions (computed or kept by the forward) and row values."""
    found = set()
    for body in (plan.forward.body, plan.backward.body):
        found |= {r.symbol.name for r in body.reductions} | {s.name for s, _ in body.loaded}
        found |= {s.name for s, _ in (*body.row_values, *(v for p in body.passes for v in p.row_values))}
    return frozenset(found)


def _torch_row_constant(text: str) -> str:
    return f"torch.full(problem.shape[:-1] + (1,), {text}, dtype=problem.compute_dtype, device=problem.device)"


# ---------------------------------------------------------------------------
# Choice helpers


def _branches(choices: tuple[tuple[str, Body], ...], printer: ElementwisePrinter) -> list[dict]:
    return [
        dict(keyword="if" if k == 0 else "elif", choice=repr(choice), lines=statements(body, printer, None, set()))
        for k, (choice, body) in enumerate(choices)
    ]


def _triton_helpers(helper: HelperPlan, names: TritonNames, printer: TritonPrinter) -> list[_Helper]:
    param = helper.param
    selector = names.constexprs[param.name]
    arguments = ", ".join([*helper.args, f"{selector}: tl.constexpr"])
    variants = [(None, helper.forward)] + list(enumerate(helper.derivatives))
    return [
        _Helper(names.triton_helpers[(param.name, k)], param.name, arguments, selector, _branches(blocks, printer))
        for k, blocks in variants
    ]


def _torch_helper(helper: HelperPlan, names: TritonNames, printer: TorchPrinter) -> _Helper:
    arguments = ", ".join([*helper.args, "choice"])
    name = names.torch_helpers[(helper.param.name, None)]
    return _Helper(name, helper.param.name, arguments, "choice", _branches(helper.forward, printer))


def _eager_helper(helper: HelperPlan) -> _Helper:
    param = helper.param
    branches = [
        dict(keyword="if" if k == 0 else "elif", choice=repr(c), lines=[text])
        for k, (c, text) in enumerate(helper.eager)
    ]
    return _Helper(helper.eager_name, param.name, ", ".join([*helper.args, "choice"]), "choice", branches)


def _environment() -> jinja2.Environment:
    loader = jinja2.FunctionLoader(
        lambda name: resources.files("fusegen.backends.triton").joinpath("templates", name).read_text(encoding="utf-8")
    )
    return templating.environment(loader)
