"""The text of a generated module's public face, whatever its backend: its docstring, its
module class's, and the `_OP = runtime.FusedOp(...)` declaration."""
from __future__ import annotations

import textwrap

from fusegen.kinds import KINDS
from fusegen.layout import Choice, Scalar, range_text
from fusegen.plan import OpPlan


def op_declaration(plan: OpPlan, binding: str, kernel_names: tuple[str, str],
                   kernel_keywords: tuple[str, ...] = ()) -> list[str]:
    """The arguments of `_OP = runtime.FusedOp(...)`, one a line (a long one over several):
    the kernels as `binding(forward, backward, ...)` (the backend's class for the plan's kind),
    with the backend's own `kernel_keywords` ("name=value") last."""
    inputs = []
    for i in plan.inputs:
        chunks = f", chunks={i.layout.chunks}" if i.layout.chunks > 1 else ""
        chunks += f", chunk_dim={i.layout.chunk_dim}" if i.layout.chunk_dim != -1 else ""
        dtype = "" if i.layout.differentiable else f', dtype="{i.layout.dtype}"'
        inputs.append(f'runtime.Input("{i.name}", {_strings(i.layout.dims)}{chunks}{dtype})')
    lines = [f'"{plan.op}",', *_argument("inputs", inputs, tuple_=True)]
    params = []
    for p in plan.params:
        d = p.declaration
        if isinstance(d, Scalar):
            opened = "".join(f", {key}=True" for key in ("low_open", "high_open") if getattr(d, key))
            params.append(f'runtime.Scalar("{d.name}", "{d.type}", {d.low!r}, {d.high!r}{opened})')
        else:
            params.append(f'runtime.Choice("{d.name}", {_strings(d.choices)})')
    if params:
        lines += _argument("params", params, tuple_=True)
    lines.append(f"outputs={_strings([name for name, _ in plan.outputs])},")
    if plan.row_outputs:
        row_outputs = [name for name, _ in plan.outputs if name in plan.row_outputs]
        lines.append(f"row_outputs={_strings(row_outputs)},  # one value per row: [..., 1]")
    if plan.output_parts:
        pairs = ", ".join(f'"{p.name}": {len(p.values)}' for p in plan.output_parts)
        lines.append(f"output_parts={{{pairs}}},  # parts side by side along the last dim: [..., k * N]")
    if plan.output_dtypes:
        pairs = ", ".join(f'"{o}": "{d}"' for o, d in plan.output_dtypes)
        lines.append("# Converted as tensor.to(dtype) converts; the other outputs take the inputs' dtype.")
        lines.append(f"output_dtypes={{{pairs}}},")
    if plan.no_gradient:
        no_gradient = [name for name, _ in plan.outputs if name in plan.no_gradient]
        lines.append(f"no_gradient={_strings(no_gradient)},  # outputs without a gradient")
    if plan.matmul:
        m = plan.matmul
        if m.hidden is not None:
            h = m.hidden
            inputs = "(" + ", ".join(f'"{i.name}"' for i in h.inputs) + "," * (len(h.inputs) == 1) + ")"
            lines += [f'matmul=runtime.MatMul("{m.a.name}", "{m.b.name}", transposed={m.transposed}, hidden=runtime.Hidden(',
                      f'    "{h.weight.name}", transposed={h.transposed}, inputs={inputs}, text="{h.text}",',
                      ')),  # the product of the hidden layer [..., H]: [..., N]']
        elif m.lowrank is None:
            lines.append(f'matmul=runtime.MatMul("{m.a.name}", "{m.b.name}", transposed={m.transposed}),  '
                         '# its product: [..., N]')
        else:
            r = m.lowrank
            lines += [f'matmul=runtime.MatMul("{m.a.name}", "{m.b.name}", transposed={m.transposed}, lowrank=runtime.LowRank(',
                      f'    "{m.a.name}", "{r.down.name}", "{r.up.name}", down_transposed={r.down_transposed}, '
                      f'up_transposed={r.up_transposed},',
                      ')),  # its product and the low-rank one: [..., N]']
    if plan.masks:
        lines.append(f"masks={_strings([m.p.name for m in plan.masks])},  # each dropout's p, by Philox stream")
    if plan.passthrough:
        pairs = ", ".join(f'"{i}": "{o}"' for i, o in plan.passthrough)
        lines.append(f"passthrough={{{pairs}}},  # these inputs' gradients are those outputs' own")
    if plan.same_gradient:
        pairs = ", ".join(f'"{i}": "{o}"' for i, o in plan.same_gradient)
        lines.append(f"same_gradient={{{pairs}}},  # one gradient, one tensor, where shapes and dtypes agree")
    if plan.gradient_reads:
        pairs = ", ".join(f'"{i}": {_strings(o)}' for i, o in plan.gradient_reads)
        lines.append("# These inputs' gradients read only these outputs' gradients: without them, None.")
        lines.append(f"gradient_reads={{{pairs}}},")
    kernel = plan.backward
    kernels = list(kernel_names)
    if plan.forward.scalars:
        kernels.append(f"scalars={_strings([p.name for p in plan.forward.scalars])}")
    kernels += [
        f"backward_reads={_strings([i.name for i in kernel.inputs])}",
        f"gradients={_strings([g.input.name for g in kernel.gradients])}",
    ]
    statistics = KINDS[plan.kind].statistics(plan)
    if statistics:
        kernels.append(f"statistics={statistics}")
    kernels += kernel_keywords
    return lines + _argument("kernels", kernels, call=binding) + ["reference=_reference,"]


def _argument(name: str, items: list[str], tuple_: bool = False, call: str = "") -> list[str]:
    """`name=(a, b),` or `name=call(a, b),` on one line where it fits, else the items on the
    lines after, as many to a line as fit (a tuple's an item a line: each is a declaration)."""
    opening = f"{name}={call}("
    one_line = opening + ", ".join(items) + ("," if tuple_ and len(items) == 1 else "") + "),"
    if len(one_line) <= 92:  # inside FusedOp(...), indented 4
        return [one_line]
    if tuple_:
        return [opening, *(f"    {item}," for item in items), "),"]
    lines = [f"    {items[0]},"]
    for item in items[1:]:
        if len(lines[-1]) + len(item) + 2 <= 92:
            lines[-1] += f" {item},"
        else:
            lines.append(f"    {item},")
    return [opening, *lines, "),"]


def _strings(items) -> str:
    items = list(items)
    return "(" + ", ".join(f'"{s}"' for s in items) + ("," if len(items) == 1 else "") + ")"


def class_doc(plan: OpPlan) -> list[str]:
    """Lines not wrapped: where a spec's names fall must not move the line breaks."""
    lines = [f"The op as a torch.nn.Module: forward({', '.join(i.name for i in plan.inputs)})", f"calls {plan.op}."]
    if plan.params:
        lines.append("Its params are fixed at construction, and checked then.")
    if plan.has_dropout:
        lines.append("Dropout is on in train() mode and off in eval(); seeds come from torch's generator.")
    if not plan.forward_only:
        lines.append("inplace_backward=True: the eager backward may write gradients into inputs (module docstring).")
    return lines


def docstring(plan: OpPlan, class_name: str, kernels_doc: str) -> list[str]:
    """The module's docstring; `kernels_doc`: the backend's words on what its kernels do."""
    wrap = lambda text, indent="": textwrap.wrap(text, width=92, subsequent_indent=indent)  # noqa: E731
    class_arguments = ", ".join(f"{p.name}={p.default!r}" for p in plan.params)
    tensors = ", ".join(i.name for i in plan.inputs)
    lines = [plan.doc.replace("\\", "\\\\").replace('"', '\\"'), ""]
    lines += ["    " + line for line in wrap(f"{plan.op}({plan.op_signature})", "    ")]
    lines += ["    " + line for line in wrap(f"{class_name}({class_arguments})({tensors}): the same, as a torch.nn.Module", "    ")]
    lines.append("")
    lines += wrap("Inputs (broadcast as torch broadcasts): " + ", ".join(
        f"{i.name} {i.layout.declared}" + ("" if i.layout.differentiable else f" {i.layout.dtype}") for i in plan.inputs))
    dims = dict(plan.output_dims)
    dtypes = dict(plan.output_dtypes)
    lines += wrap("Outputs: " + ", ".join(f"{name} [{', '.join(dims[name])}]" + (f" {dtypes[name]}" if name in dtypes else "")
                                          for name, _ in plan.outputs))
    if plan.no_gradient and not plan.forward_only:
        lines += wrap("Without a gradient: " + ", ".join(name for name, _ in plan.outputs if name in plan.no_gradient))
    for p in plan.params:
        d = p.declaration
        if isinstance(d, Scalar):
            bounds = range_text(d.low, d.high, d.low_open, d.high_open)
            bounds = f" {bounds}" if bounds else ""
            lines += wrap(f"Param {p.name}: {d.type}{bounds}, default {p.default!r} (runtime: no recompilation).", "    ")
        elif isinstance(d, Choice):
            choices = ", ".join(d.choices)
            lines += wrap(f"Param {p.name}: one of {choices}; default {p.default!r} (compile-time: one kernel each).", "    ")
    if plan.has_dropout:
        lines += wrap("training=False, or every dropout p == 0, takes a kernel with no random numbers.", "    ")
        lines += wrap("seed=None draws the dropout seed from torch's default generator (torch.manual_seed).", "    ")
    lines += [""] + wrap(kernels_doc)
    if plan.forward_only:
        lines += wrap("Forward only: no output has a gradient, and the op puts no autograd node behind them.")
    else:
        lines += wrap(KINDS[plan.kind].backward_doc(plan))
    lines += wrap(
        " ".join(
            f"The gradient of {i} is the gradient of {o}, passed on without a copy (summed only where {i} was broadcast)."
            for i, o in plan.passthrough
        )
    )
    lines += wrap(
        " ".join(
            f"The gradient of {i} is that of {o}: where the two agree in shape and dtype, the kernel writes it "
            f"once and both get the same tensor (as torch's add does)."
            for i, o in plan.same_gradient
        )
    )
    # What every generated module would say alike is said once, in the README.
    lines += [""] + wrap(
        "As every generated op (README, \"The generated op\"): dtypes, dropout's masks and seeds, gradient sums, "
        "inplace_backward, `reference` and `eager`."
    )
    return lines
