"""Plan → the text of a generated Triton module: the kernels, the op's declaration for
fusegen.runtime, its reference body and its public functions.

Everything is computed here (the kernels' text in kernel_text.py, the module's docstrings
and declaration in module_text.py, its names in naming.py) and handed to
templates/op.py.jinja as ready strings and lists of lines; the template holds layout only.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from importlib import resources

import jinja2

from fusegen import outdir, templating
from fusegen.plan import Body, HelperPlan, OpPlan
from fusegen.printers import ElementwisePrinter, TorchPrinter
from fusegen.pyformat import format_module

from fusegen.body_text import statements
from fusegen.kinds import KINDS

from .kernel_text import backward_kernel, forward_kernel, kernel_lines, with_argument_comments
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
    kind = KINDS[plan.kind]
    rows = plan.kind == "row"
    row_values = kind.row_values(plan)
    triton = TritonPrinter(names.triton_helpers, names.constexprs, row_values)
    torch_printer = TorchPrinter(names.torch_helpers, {p.name: p.local for p in plan.params}, row_values)
    forward = (row_kernel if rows else forward_kernel)(plan, names, triton)
    backward = (row_backward_kernel if rows else backward_kernel)(plan, names, triton)
    triton_helpers = [h for helper in plan.helpers for h in _triton_helpers(helper, names, triton)]
    torch_helpers = [_torch_helper(helper, names, torch_printer) for helper in plan.helpers]
    reference = kind.reference(plan, torch_printer)
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
