"""Plan → the text of a generated Triton module: the kernels of the plan's kind, its choice
helpers in Triton, and the module's Python face (fusegen.face) after them.

The kind's kernel text comes from its registered TritonKind (kinds.py), the module's names
from naming.py; everything is handed to templates/op.py.jinja as ready strings and lists
of lines, and the template holds layout only.
"""
from __future__ import annotations

import re
import textwrap

import jinja2

from fusegen import face, outdir, templating
from fusegen.kinds import KINDS
from fusegen.plan import HelperPlan, OpPlan
from fusegen.pyformat import format_module

from .kernel_text import per_row_incoming, with_argument_comments
from .kinds import MODULE_IMPORTS, RESERVED_NAMES, TRITON_KINDS
from .naming import GEMM_LIB_NAMES, KERNEL_LIB_NAMES, TritonNames, module_class_name
from .printer import TritonPrinter

__all__ = ["MODULE_IMPORTS", "RESERVED_NAMES", "beside", "module_class_name", "render"]


def beside(plan: OpPlan) -> dict[str, str]:
    """Nothing beside the module: its Triton kernels are in it."""
    return {}


def render(plan: OpPlan) -> str:
    """The text of generated/<op>.py."""
    names = TritonNames(plan)
    kind = TRITON_KINDS[plan.kind]
    scalars = {p.local for kernel in (plan.forward, plan.backward) for p in kernel.scalars}
    tiles = {v.local for i in plan.inputs if i.layout.differentiable and not i.layout.one_per_row for v in i.values}
    tiles |= set(plan.backward.incoming) - per_row_incoming(plan)
    tiles |= {plan.matmul.product.local} if plan.matmul else set()
    triton = TritonPrinter(names.triton_helpers, names.constexprs, KINDS[plan.kind].row_values(plan), scalars, tiles)
    forward = with_argument_comments(kind.forward(plan, names, triton))
    # A forward-only op (every output without a gradient: a float8 q and its scale) has none.
    backward = None if plan.forward_only else with_argument_comments(kind.backward(plan, names, triton))
    kernels = [forward] + ([backward] if backward else [])
    triton_helpers = [h for helper in plan.helpers for h in _triton_helpers(helper, names, triton)]
    kernel_code = "\n".join(
        [line for k in kernels for line in k.lines] + [line for h in triton_helpers for b in h.branches for line in b["lines"]]
    )
    context = dict(
        header=outdir.header_lines(plan.op, plan.spec_path),  # as outdir reads it back
        spec_sha256=plan.spec_sha256,
        face=face.face(plan, backend="Triton", class_name=module_class_name(plan.op), binding=kind.binding,
                       kernel_names=(forward.name, backward.name if backward else "None"), kernels_doc=kind.doc,
                       kernel_keywords=(*kind.keywords(plan), *_renamed(names))),
        kind_modules=kind.modules,
        uses_libdevice="libdevice." in kernel_code,
        kernel_lib_import=[
            line for library, names in (("kernel_lib", KERNEL_LIB_NAMES), ("gemm_lib", GEMM_LIB_NAMES))
            for line in _kernel_lib_import(library, [n for n in names if re.search(rf"(?<![\w.]){n}\(", kernel_code)])
        ],
        triton_helpers=triton_helpers,
        kernels=kernels,
    )
    return format_module(_environment().get_template("op.py.jinja").render(**context))


def _renamed(names: TritonNames) -> tuple[str, ...]:
    """`renamed=...` for launch.Kernels, where a kernel parameter is not named as WANTED makes
    it from the spec's names (launch.py passes values by name: naming.ParameterNames)."""
    renamed = names.renamed()
    if not renamed:
        return ()
    # One entry a line, indented as inside `kernels=...(` in `_OP = runtime.FusedOp(`.
    items = "".join(f'            ("{what}", "{name}"): "{parameter}",\n' for (what, name), parameter in renamed.items())
    return (f"renamed={{\n{items}        }}",)


def _kernel_lib_import(library: str, names: list[str]) -> list[str]:
    """The `library`'s helpers the kernels call (kernel_lib, gemm_lib), imported on one line where they fit."""
    if not names:
        return []
    line = f"from fusegen.backends.triton.{library} import {', '.join(names)}"
    if len(line) <= 100:
        return [line]
    return [f"from fusegen.backends.triton.{library} import ("] + [
        "    " + line.lstrip() for line in textwrap.wrap(", ".join(names) + ",", width=96)
    ] + [")"]


def _triton_helpers(helper: HelperPlan, names: TritonNames, printer: TritonPrinter) -> list[face.Helper]:
    param = helper.param
    selector = names.constexprs[param.name]
    arguments = ", ".join([*helper.args, f"{selector}: tl.constexpr"])
    variants = [(None, helper.forward)] + list(enumerate(helper.derivatives))
    return [
        face.Helper(names.triton_helpers[(param.name, k)], param.name, arguments, selector, face.branches(blocks, printer))
        for k, blocks in variants
    ]


def _environment() -> jinja2.Environment:
    return templating.package_environment("fusegen.backends.triton", "templates")
