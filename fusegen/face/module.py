"""The backend-neutral part of a generated module: what it says and does in Python around
its kernels. Its docstring, the reference's helpers and body (in torch), the
`_OP = runtime.FusedOp(...)` declaration, the op function, its torch.nn.Module, `reference`,
and the eager twin. A backend renders its kernels and places `Face.text` after them;
templates/face.py.jinja holds the layout, computed here as ready strings."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

import jinja2

from fusegen import templating
from fusegen.body_text import statements
from fusegen.kinds import KINDS
from fusegen.names import PYTHON_BUILTINS
from fusegen.plan import Body, HelperPlan, OpPlan
from fusegen.printers import ElementwisePrinter, TorchPrinter

from .module_text import class_doc, docstring, op_declaration


@dataclass(frozen=True)
class Face:
    docstring: tuple[str, ...]  # the module docstring's lines
    uses_functional: bool  # whether the face's code reads F (torch.nn.functional): the module imports it
    exports: str  # __all__'s items
    text: str  # the module's code after its kernels


@dataclass
class Helper:
    """A choice param's helper function: one branch a choice, as the templates lay it out."""

    name: str
    param: str
    arguments: str
    selector: str
    branches: list[dict]


def module_class_name(op_name: str, imports: frozenset[str]) -> str:
    """The op's torch.nn.Module class: its name in CamelCase (bias_gelu_dropout_add →
    BiasGeluDropoutAdd), with "Module" added where that is the op's own name or a name the
    module already uses (`imports`, the backend's; op Gelu → GeluModule, op f → FModule)."""
    name = "".join(word[:1].upper() + word[1:] for word in op_name.split("_"))
    taken = name == op_name or name in imports or name in PYTHON_BUILTINS
    return f"{name}Module" if taken else name


def branches(choices: tuple[tuple[str, Body], ...], printer: ElementwisePrinter) -> list[dict]:
    return [
        dict(keyword="if" if k == 0 else "elif", choice=repr(choice), lines=statements(body, printer, None, set()))
        for k, (choice, body) in enumerate(choices)
    ]


def face(plan: OpPlan, *, backend: str, class_name: str, binding: str, kernel_names: tuple[str, str],
         kernels_doc: str, kernel_keywords: tuple[str, ...] = ()) -> Face:
    """The face of `plan`'s module. `backend`: its name as the op's docstring says it;
    `class_name`: the module class's (the backend knows the names it imports);
    `binding(kernel_names..., ...)`: how the module declares its kernels to FusedOp, with
    `kernel_keywords` ("name=value") last;
    `kernels_doc`: the module docstring's words on what the kernels do."""
    op, params = plan.op, plan.params
    row_values = KINDS[plan.kind].row_values(plan)
    printer = TorchPrinter({(h.param.name, None): h.torch_name for h in plan.helpers},
                           {p.name: p.local for p in params}, row_values,
                           {p.local for kernel in (plan.forward, plan.backward) for p in kernel.scalars})
    torch_helpers = [_torch_helper(helper, printer) for helper in plan.helpers]
    eager_helpers = [_eager_helper(helper) for helper in plan.helpers]
    public = [i.name for i in plan.inputs] + [p.name for p in params] + (["training", "seed"] if plan.has_dropout else [])
    twin = (f"Eager PyTorch twin of {op}: same arguments, same values" + (", same dropout mask" if plan.has_dropout else "")
            + ("; differentiable, the oracle for the generated backward." if not plan.forward_only
               else "."))
    context = dict(
        backend=backend,
        op=op,
        doc=plan.doc,
        reference_doc=textwrap.wrap(twin, width=92),
        runs_doc=textwrap.wrap(
            f"The fused {backend} kernels (module docstring), "
            f"{'differentiable' if not plan.forward_only else 'forward only'}; under torch.compile, the "
            f"torch.library op fusegen::{op}.", width=92),
        torch_helpers=torch_helpers,
        reference=KINDS[plan.kind].reference(plan, printer),
        op_declaration=op_declaration(plan, binding, kernel_names, kernel_keywords),
        public_signature=plan.public_signature,
        op_signature=plan.op_signature,
        public_arguments=", ".join(public),
        class_name=class_name,
        class_doc=class_doc(plan),
        # The class's methods take the spec's names and read nothing global but _OP (spec
        # names never start with '_'), so those names need no renaming there.
        # A forward-only op has no backward, so no inplace_backward either.
        inplace_argument="" if plan.forward_only else ", inplace_backward=inplace_backward",
        init_signature=", ".join(["self"] + [f"{p.name}={p.default!r}" for p in params]
                                 + ([] if plan.forward_only else ["*", "inplace_backward=False"])),
        init_arguments=", ".join([p.name for p in params]
                                 + ([] if plan.forward_only else ["inplace_backward=inplace_backward"])),
        forward_signature=", ".join(["self"] + [i.name for i in plan.inputs]),
        module_call=", ".join(
            [i.name for i in plan.inputs] + [f"self.{p.name}" for p in params]
            + (["self.training", "None"] if plan.has_dropout else [])
            + ([] if plan.forward_only else ["inplace_backward=self.inplace_backward"])
        ),
        eager_doc=textwrap.wrap(
            "The op as a PyTorch user writes it, with torch.nn.functional ops"
            + (" and torch's own dropout (its own random mask: the same distribution, not the same values; seed "
               "is unused)" if plan.has_dropout else "")
            + ": the baseline that `fusegen bench` times, eagerly and under torch.compile.", width=92),
        eager_helpers=eager_helpers,
        eager_signature=", ".join(
            [i.local for i in plan.inputs] + [f"{p.local}={p.default!r}" for p in params]
            + (["training=True", "seed=None"] if plan.has_dropout else [])
        ),
        eager_lines=list(plan.eager),
    )
    eager_code = "\n".join([*plan.eager, *(line for h in eager_helpers for b in h.branches for line in b["lines"])])
    return Face(
        docstring=tuple(docstring(plan, class_name, kernels_doc)),
        uses_functional="F." in eager_code,
        exports=", ".join(f'"{n}"' for n in (op, class_name, "reference", "eager")),
        text=_environment().get_template("face.py.jinja").render(**context),
    )


def _torch_helper(helper: HelperPlan, printer: TorchPrinter) -> Helper:
    arguments = ", ".join([*helper.args, "choice"])
    return Helper(helper.torch_name, helper.param.name, arguments, "choice", branches(helper.forward, printer))


def _eager_helper(helper: HelperPlan) -> Helper:
    param = helper.param
    choices = [
        dict(keyword="if" if k == 0 else "elif", choice=repr(c), lines=[text])
        for k, (c, text) in enumerate(helper.eager)
    ]
    return Helper(helper.eager_name, param.name, ", ".join([*helper.args, "choice"]), "choice", choices)


def _environment() -> jinja2.Environment:
    return templating.package_environment("fusegen.face", "templates")
