"""The pointwise kind's kernels in CUDA C++ (issue 33, step 2 of docs/design/cuda-backend-plan.md).

The forward: the plan's forward body at one element (`<op>_element`: the outputs from the inputs'
values there, FUSEGEN_HD, so the tests can run it on the host) and a `__global__` kernel around
it of Pack adjacent elements of a row a thread. The backward: each gradient the backward body
computes at one element (`<op>_backward_element`) and a kernel of Pack adjacent columns a thread
over a block of rows, which writes each gradient or sums it over the block where its input is
broadcast along rows. compiler.py compiles them at run time, launch.py launches them and picks
Pack.

Each input is read as the Triton kernels read it, through an [M, k·N] view's two strides (0 where
broadcast; k chunks side by side), converted to the compute type T: with Pack > 1 a vector load
a pack (fusegen::load), with Pack 1 an element at a time at any strides. A choice param's
functions are templates on the choice's index; dropout's multipliers are drawn at the elements'
flat indices, as the Triton kernels' (fusegen_cuda.cuh; one Philox call for four elements). What
this backend does not render raises CudaUnsupported, one line naming it."""
from __future__ import annotations

import re

from fusegen.backends import Unsupported
from fusegen.functions import COL
from fusegen import outdir
from fusegen.names import Namer
from fusegen.plan import Body, OpPlan

from .printer import CudaPrinter


class CudaUnsupported(Unsupported):
    """A plan the CUDA backend cannot render yet."""


# Names the C++ source holds for itself or gets from CUDA and its headers (built-in variables,
# fixed-width types), and C++'s keywords: a spec name may be any of them, and is refused here,
# one line, until the backend renames its locals. So is a name written as a macro is (NAN,
# M_PI, INT32_MAX: all capitals, digits and underscores, two or more characters).
OWN_NAMES = frozenset({"T", "Index", "Pack", "Packs", "Threads", "Items", "Cluster", "Registers", "Whole", "Narrow", "fusegen", "std",
                       "blockIdx", "blockDim", "threadIdx", "gridDim", "warpSize",
                       "int8_t", "int16_t", "int32_t", "int64_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t",
                       "size_t", "ptrdiff_t", "__half", "__nv_bfloat16"})
_MACRO = re.compile(r"[A-Z_][A-Z0-9_]+")
CPP_KEYWORDS = frozenset("""alignas alignof and and_eq asm auto bitand bitor bool break case catch char char16_t
char32_t class compl const constexpr const_cast continue decltype default delete do double dynamic_cast else enum
explicit export extern false float for friend goto if inline int long mutable namespace new noexcept not not_eq
nullptr operator or or_eq private protected public register reinterpret_cast return short signed sizeof static
static_assert static_cast struct switch template this thread_local throw true try typedef typeid typename union
unsigned using virtual void volatile wchar_t while xor xor_eq""".split())


def forward_source(plan: OpPlan) -> str:
    """The text of <op>.cu: its element function and forward kernel."""
    if plan.kind != "pointwise":
        raise CudaUnsupported(f"{plan.op}: the {plan.kind} kind is not supported by the CUDA backend yet")
    kernel = plan.forward
    locals_ = _locals(plan)
    _check(plan, locals_)
    helpers, choices = choice_names(plan)
    functions = {f"{plan.op}_element", f"{plan.op}_forward", *helpers.values(), *choices.values()}
    namer = Namer(frozenset(locals_) | OWN_NAMES | CPP_KEYWORDS | functions)
    pointer = {i.name: namer.claim(f"{i.local}_ptr") for i in kernel.inputs}
    stride = {i.name: (namer.claim(f"{i.local}_stride_m"), namer.claim(f"{i.local}_stride_n")) for i in kernel.inputs}
    element_type = {i.name: namer.claim(f"{i.local.capitalize()}Type") for i in kernel.inputs}
    out_pointer = {local: namer.claim(f"{local}_ptr") for local in kernel.outputs}
    out_type = {local: namer.claim(f"{local.capitalize()}Type") for local in kernel.outputs}
    threshold = {m.p.name: namer.claim(f"{m.p.local}_threshold") for m in kernel.masks}
    scale = {m.p.name: namer.claim(f"{m.p.local}_scale") for m in kernel.masks}
    row, col, n, m, seed, dropout, pack, packs, step, seed_pointer, shard = (namer.claim(w) for w in (
        "row", "col", "N", "M", "seed", "has_dropout", "pack", "packs", "k", "seed_ptr", "shard_ptr"))
    chosen = [choices[p.name] for p in kernel.choices]  # each choice param's index: a template argument
    parts = _parts(plan)  # each output's values: itself, or its parts side by side ([..., k·N])
    results = [v for o in kernel.outputs for v in parts[o]]
    printer = CudaPrinter(helpers, choices)
    printer.integers = integer_names(plan)
    printer.column = f"{col}"  # a T in the element function (never integer arithmetic)
    column = uses_col(kernel.body, kernel.body_no_dropout)

    element = _element_parameters(kernel, [v.local for i in kernel.inputs for v in i.values], "the inputs' values",
                                  col if column else None, dropout, results)

    parameters = [f"const {element_type[i.name]}* __restrict__ {pointer[i.name]}, Index {stride[i.name][0]}, "
                  f"Index {stride[i.name][1]},  // {i.name} {i.layout.declared}, as [M, {_shown(len(i.values))}]"
                  for i in kernel.inputs]
    parameters += [f"{out_type[o]}* __restrict__ {out_pointer[o]},  // {name}, contiguous [M, {_shown(len(parts[o]))}]"
                   + (", its parts side by side" if len(parts[o]) > 1 else "")
                   for (name, _), o in zip(plan.outputs, kernel.outputs)]
    parameters += [f"{scalar_type(p)} {p.local},  // param {p.name}" for p in kernel.scalars]
    # The kernel reads the seed from the one-element int64 tensor the runtime draws on the device
    # (no host sync; a CUDA graph replays the draw), as the Triton kernels do.
    parameters += _dropout_parameters(kernel, seed_pointer, dropout, threshold, scale, shard)

    loads = [f"T {', '.join(f'{v.local}[Pack]' for i in kernel.inputs for v in i.values)};"]
    loads += [f"fusegen::load<Pack>({v.local}, {pointer[i.name]} + {row} * {stride[i.name][0]} + "
              f"{_column(col, k, n)} * {stride[i.name][1]}, {stride[i.name][1]});"
              for i in kernel.inputs for k, v in enumerate(i.values)]
    loads += _mask_lines(kernel, row, col, n, seed, dropout, threshold, scale, shard)
    arguments = [f"{v.local}[{step}]" for i in kernel.inputs for v in i.values]
    arguments += [f"T({col} + {step})"] if column else []
    arguments += [p.local for p in kernel.scalars]
    arguments += [dropout, *(f"{mask.local}[{step}]" for mask in kernel.masks)] if kernel.masks else []
    arguments += [f"{v}[{step}]" for v in results]
    stores = [f"fusegen::store<Pack>({out_pointer[o]} + {row} * {_width(len(parts[o]), n)} + {_column(col, k, n)}, {v});"
              for o in kernel.outputs for k, v in enumerate(parts[o])]

    template = ", ".join(["typename T", *(f"int {c}" for c in chosen)])
    kernel_template = ", ".join(["typename T", "typename Index", *(f"int {c}" for c in chosen), "int Pack",
                                 *(f"typename {t}" for t in (*element_type.values(), *out_type.values()))])
    lines = [
        *outdir.header_lines(plan.op, plan.spec_path, "//"),
        f"// spec sha256: {plan.spec_sha256}",
        f"// {plan.doc}",
        '#include "fusegen_cuda.cuh"',
        "",
        *helper_source(plan),
        "// The outputs at one element from the inputs' values there, in the compute type T (float, or",
        "// double for fp64 inputs).",
        f"template <{template}>",
        f"FUSEGEN_HD void {plan.op}_element(",
        *(f"    {p}" for p in element[:-1]),
        f"    {element[-1]}) {{",
        *_indent(_body(kernel, printer, dropout)),
        "}",
        "",
        "#ifdef __CUDACC__",
        "// A thread: Pack adjacent elements of a row. Pack > 1 where every input's column stride is 1",
        "// (read a vector at a time) or 0 (one value for the row), N a multiple of Pack and every row",
        "// aligned to it (the launcher checks); Pack 1 for any strides.",
        f"template <{kernel_template}>",
        f"__global__ void {plan.op}_forward(",
        *(f"    {p}" for p in parameters),
        f"    Index {m}, Index {n}) {{",
        f"  const Index {packs} = {n} / Pack;  // a row's",
        f"  const Index {pack} = Index(blockIdx.x) * blockDim.x + threadIdx.x;",
        f"  if ({pack} >= {m} * {packs}) return;",
        f"  const Index {row} = {pack} / {packs}, {col} = ({pack} - {row} * {packs}) * Pack;",
        *([f"  const uint64_t {seed} = {dropout} ? uint64_t(*{seed_pointer}) : 0u;"] if kernel.masks else []),
        *_indent(loads),
        f"  T {', '.join(f'{v}[Pack]' for v in results)};",
        "#pragma unroll",
        f"  for (int {step} = 0; {step} < Pack; ++{step}) {{",
        f"    {plan.op}_element<{', '.join(['T', *chosen])}>({', '.join(arguments)});",
        "  }",
        *_indent(stores),
        "}",
        "#endif",
    ]
    return "\n".join(lines) + "\n"


def _element_parameters(kernel, values: list[str], what: str, col: str | None, dropout: str,
                        results: list[str]) -> list[str]:
    """An element function's parameter lines: the values (`what` they are), the element's column
    where the body reads it, the params, dropout's flag and multipliers, the results by reference."""
    element = [", ".join(f"T {v}" for v in values) + f",  // {what}"]
    element += [f"T {col},  // the element's column"] if col is not None else []
    element += [f"{scalar_type(p)} {p.local},  // param {p.name}" for p in kernel.scalars]
    if kernel.masks:
        element.append(f"bool {dropout}, {', '.join(f'T {mask.local}' for mask in kernel.masks)},  // dropout on "
                       "(training, p above 0); its multipliers at the element")
    element.append(", ".join(f"T& {v}" for v in results))
    return element


def _dropout_parameters(kernel, seed_pointer: str, dropout: str, threshold: dict, scale: dict,
                        shard_pointer: str) -> list[str]:
    if not kernel.masks:
        return []
    ps = dict.fromkeys(mask.p.name for mask in kernel.masks)
    return [f"const int64_t* {seed_pointer}, bool {dropout},  // the seed tensor's one element; off: training False or p 0",
            f"const int64_t* {shard_pointer},  // a DTensor's local part: where it sits in the global problem "
            "(fusegen::flat_index); else null",
            *(f"int32_t {threshold[p]}, T {scale[p]},  // dropout's p as its 24-bit threshold and scale" for p in ps)]


def _mask_lines(kernel, row: str, col: str, n: str, seed: str, dropout: str, threshold: dict, scale: dict,
                shard: str) -> list[str]:
    """Each mask's multipliers at the pack's elements, drawn at their flat indices (1 with dropout off)."""
    if not kernel.masks:
        return []
    lines = [f"T {', '.join(f'{mask.local}[Pack]' for mask in kernel.masks)};"]
    lines += [f"fusegen::dropout_multipliers<Pack>({mask.local}, {dropout}, {seed}, "
              f"fusegen::flat_index({shard}, {row}, {col}, {n}), "
              f"{mask.stream}u, {threshold[mask.p.name]}, {scale[mask.p.name]});" for mask in kernel.masks]
    return lines


def uses_col(*bodies) -> bool:
    return any(expr.has(COL) for body in bodies if body is not None for _, expr in (*body.temps, *body.results))


def _locals(plan: OpPlan) -> set[str]:
    """Every name the forward body and its loads and stores use."""
    kernel = plan.forward
    names = {v.local for i in kernel.inputs for v in i.values} | set(kernel.outputs)
    names |= {p.local for p in kernel.scalars} | {m.local for m in kernel.masks}
    for body in (kernel.body, kernel.body_no_dropout):
        if body is not None:
            names |= {name for name, _ in (*body.temps, *body.results)}
    return names


def scalar_type(p) -> str:
    """A param's C++ type in the kernels: int64_t for an int param (compared exactly), else T."""
    return "int64_t" if getattr(p.declaration, "type", None) == "int" else "T"


def integer_names(plan: OpPlan) -> frozenset[str]:
    """The locals of the op's int params and integer inputs' values (CudaPrinter.integers)."""
    names = {p.local for p in plan.params if scalar_type(p) == "int64_t"}
    return frozenset(names | {v.local for i in plan.inputs if not i.layout.differentiable for v in i.values})


def _check(plan: OpPlan, locals_: set[str], row_kind: bool = False) -> None:
    """Refuse what the kernels cannot take; the row kind's take integer inputs of one value a row
    and outputs of their own dtype."""
    kernel = plan.forward
    helpers, choices = choice_names(plan)
    functions = {f"{plan.op}_element", f"{plan.op}_forward", f"{plan.op}_backward_element", f"{plan.op}_backward",
                 *helpers.values(), *choices.values()}
    clash = sorted((locals_ & (OWN_NAMES | CPP_KEYWORDS | functions)) | {n for n in locals_ if _MACRO.fullmatch(n)})
    what = (
        f"the name '{clash[0]}' (C++'s or the source's own)" if clash else
        "an input in chunks along a dim other than the last" if any(i.layout.chunk_dim != -1 for i in plan.inputs) else
        "an integer or bool input" + (" other than one value a row" if row_kind else "")
        if any(not i.layout.differentiable and not (row_kind and i.layout.one_per_row) for i in kernel.inputs) else
        "an output of its own dtype" if plan.output_dtypes and not row_kind else None
    )
    if what is not None:
        raise CudaUnsupported(f"{plan.op}: {what} is not supported by the CUDA backend yet")


def _body(kernel, printer: CudaPrinter, dropout: str) -> list[str]:
    """The kernel's body at one element, its results assigned: with dropout on, the body with
    the masks' multipliers, else the body without dropout."""
    if not kernel.masks:
        return _statements(kernel.body, printer, assign=True)
    return [f"if ({dropout}) {{", *_indent(_statements(kernel.body, printer, assign=True)), "} else {",
            *_indent(_statements(kernel.body_no_dropout, printer, assign=True)), "}"]


def _statements(body: Body, printer: CudaPrinter, assign: bool) -> list[str]:
    """`const T t0 = ...;` for each temporary; each result declared (or, `assign`, assigned:
    declared before a dropout branch)."""
    lines = [f"const T {name} = {printer.doprint(expr)};" for name, expr in body.temps]
    lines += [f"{name} = {printer.doprint(expr)};" if assign else f"const T {name} = {printer.doprint(expr)};"
              for name, expr in body.results]
    return lines


def _parts(plan: OpPlan) -> dict[str, tuple[str, ...]]:
    """Each forward output's values by its local: its parts where it has some (rope's y), else itself."""
    parts = {p.name: p.values for p in plan.output_parts}
    return {o: parts.get(name, (o,)) for (name, _), o in zip(plan.outputs, plan.forward.outputs)}


def _column(col: str, k: int, n: str) -> str:
    """Chunk k's column of the element at `col`."""
    return col if k == 0 else f"({col} + {n})" if k == 1 else f"({col} + {k} * {n})"


def _shown(chunks: int) -> str:
    return "N" if chunks == 1 else f"{chunks}N"


def _width(chunks: int, n: str) -> str:
    return n if chunks == 1 else f"{chunks} * {n}"


def _indent(lines: list[str]) -> list[str]:
    return [line if line.startswith("#") else "  " + line for line in lines]


def backward_source(plan: OpPlan) -> str:
    """The text of the backward in <op>.cu: an element function giving each gradient the kernel
    computes at one element, and a kernel of Pack adjacent columns a thread over a block of rows
    that writes each gradient, or sums it over its rows where its input is broadcast along them
    (a [blocks, N] buffer in T, which torch adds up in order, as the Triton backward's column
    sums)."""
    if plan.kind != "pointwise":
        raise CudaUnsupported(f"{plan.op}: the {plan.kind} kind is not supported by the CUDA backend yet")
    kernel = plan.backward
    locals_ = _locals(plan) | {v.local for i in kernel.inputs for v in i.values} | set(kernel.incoming)
    locals_ |= {v for g in kernel.gradients for v in g.values}
    for body in (kernel.body, kernel.body_no_dropout):
        if body is not None:
            locals_ |= {name for name, _ in body.temps}
    _check(plan, locals_)
    # An input of one value per row ([..., 1]) has its gradient written at every element, in T, and
    # summed along the rows by torch (launch.py: the "whole" form), as any other broadcast input's.
    helpers, choices = choice_names(plan)
    functions = {f"{plan.op}_backward_element", f"{plan.op}_backward", *helpers.values(), *choices.values()}
    namer = Namer(frozenset(locals_) | OWN_NAMES | CPP_KEYWORDS | functions)
    widths = {p.name: len(p.values) for p in plan.output_parts}
    incoming_parts = {g: p.incoming for p in plan.output_parts for (name, _), g in zip(plan.outputs, kernel.incoming)
                      if name == p.name}
    # What the kernel reads: (key, local, its values' locals, the comment's layout)
    read = [(i.name, i.local, tuple(v.local for v in i.values), f"{i.layout.declared}, as [M, {_shown(len(i.values))}]")
            for i in kernel.inputs]
    read += [(f"the incoming gradient of {name}", g, incoming_parts.get(g, (g,)),
              f"as [M, {_shown(widths.get(name, 1))}]" if name in widths else "")
             for (name, _), g in zip(plan.outputs, kernel.incoming)]
    pointer = {key: namer.claim(f"{local}_ptr") for key, local, _, _ in read}
    stride = {key: (namer.claim(f"{local}_stride_m"), namer.claim(f"{local}_stride_n")) for key, local, _, _ in read}
    element_type = {key: namer.claim(f"{local.capitalize()}Type") for key, local, _, _ in read}
    gradients = [v for g in kernel.gradients for v in g.values]
    # One buffer a gradient, all its chunks side by side ([M, k·N]); named for its value where it has one.
    base = {g.input.name: g.values[0] if len(g.values) == 1 else f"grad_{g.input.local}" for g in kernel.gradients}
    grad_pointer = {g.input.name: namer.claim(f"{base[g.input.name]}_ptr") for g in kernel.gradients}
    grad_type = {g.input.name: namer.claim(f"{base[g.input.name].capitalize()}Type") for g in kernel.gradients}
    sums = {g.input.name: namer.claim(f"{base[g.input.name]}_sums") for g in kernel.gradients}
    total = {v: namer.claim(f"{v}_total") for v in gradients}
    threshold = {m.p.name: namer.claim(f"{m.p.local}_threshold") for m in kernel.masks}
    scale = {m.p.name: namer.claim(f"{m.p.local}_scale") for m in kernel.masks}
    row, col, n, m, seed, dropout, rows, first, last, step, seed_pointer, shard = (namer.claim(w) for w in (
        "row", "col", "N", "M", "seed", "has_dropout", "rows", "first_row", "last_row", "k", "seed_ptr", "shard_ptr"))
    printer = CudaPrinter(helpers, choices)
    printer.integers = integer_names(plan)
    printer.column = f"{col}"
    column = uses_col(kernel.body, kernel.body_no_dropout)
    values = [v for _, _, vs, _ in read for v in vs]

    element = _element_parameters(kernel, values, "the inputs' and incoming gradients' values", col if column else None,
                                  dropout, gradients)

    parameters = [f"const {element_type[k]}* __restrict__ {pointer[k]}, Index {stride[k][0]}, Index {stride[k][1]},  "
                  f"// {k}{' ' if shown.startswith('[') else ', '}{shown or 'as [M, N]'}" for k, _, _, shown in read]
    parameters += [f"{scalar_type(p)} {p.local},  // param {p.name}" for p in kernel.scalars]
    parameters += _dropout_parameters(kernel, seed_pointer, dropout, threshold, scale, shard)
    parameters += [f"{grad_type[g.input.name]}* __restrict__ {grad_pointer[g.input.name]}, bool {sums[g.input.name]},"
                   f"  // {base[g.input.name]}: [M, {_shown(len(g.values))}], or with {sums[g.input.name]} its sums "
                   f"over each block of rows, [blocks, {_shown(len(g.values))}] in T; null where not wanted"
                   + (", its chunks side by side" if len(g.values) > 1 else "")
                   for g in kernel.gradients]

    loads = [f"T {', '.join(f'{v}[Pack]' for v in values)};"]
    loads += [f"fusegen::load<Pack>({v}, {pointer[k]} + {row} * {stride[k][0]} + {_column(col, c, n)} * {stride[k][1]}, "
              f"{stride[k][1]});" for k, _, vs, _ in read for c, v in enumerate(vs)]
    loads += _mask_lines(kernel, row, col, n, seed, dropout, threshold, scale, shard)
    arguments = [f"{v}[{step}]" for v in values]
    arguments += [f"T({col} + {step})"] if column else []
    arguments += [p.local for p in kernel.scalars]
    arguments += [dropout, *(f"{mask.local}[{step}]" for mask in kernel.masks)] if kernel.masks else []
    arguments += [f"{v}[{step}]" for v in gradients]
    chosen = [choices[p.name] for p in kernel.choices]
    loop = [*loads, f"T {', '.join(f'{v}[Pack]' for v in gradients)};", "#pragma unroll",
            f"for (int {step} = 0; {step} < Pack; ++{step}) {{",
            f"  {plan.op}_backward_element<{', '.join(['T', *chosen])}>({', '.join(arguments)});", "}"]
    for g in kernel.gradients:
        name, width = g.input.name, _width(len(g.values), n)
        loop += [f"if ({sums[name]}) {{", "#pragma unroll",
                 f"  for (int {step} = 0; {step} < Pack; ++{step}) {{",
                 *(f"    {total[v]}[{step}] += {v}[{step}];" for v in g.values), "  }",
                 f"}} else if ({grad_pointer[name]} != nullptr) {{",
                 *(f"  fusegen::store<Pack>({grad_pointer[name]} + {row} * {width} + {_column(col, k, n)}, {v});"
                   for k, v in enumerate(g.values)), "}"]
    template = ", ".join(["typename T", *(f"int {c}" for c in chosen)])
    kernel_template = ", ".join(["typename T", "typename Index", *(f"int {c}" for c in chosen), "int Pack",
                                 *(f"typename {t}" for t in (*element_type.values(), *grad_type.values()))])
    lines = [
        f"// {plan.op}'s backward: each gradient the kernel computes at one element, from the values there.",
        f"template <{template}>",
        f"FUSEGEN_HD void {plan.op}_backward_element(",
        *(f"    {p}" for p in element[:-1]),
        f"    {element[-1]}) {{",
        *_indent(_body(kernel, printer, dropout)),
        "}",
        "",
        "#ifdef __CUDACC__",
        "// A thread: Pack adjacent columns (as the forward's packs) of the rows of block blockIdx.y.",
        f"template <{kernel_template}>",
        f"__global__ void {plan.op}_backward(",
        *(f"    {p}" for p in parameters),
        f"    Index {m}, Index {n}, Index {rows}) {{  // rows: a block's",
        f"  const Index {col} = (Index(blockIdx.x) * blockDim.x + threadIdx.x) * Pack;",
        f"  if ({col} >= {n}) return;",
        *([f"  const uint64_t {seed} = {dropout} ? uint64_t(*{seed_pointer}) : 0u;"] if kernel.masks else []),
        f"  const Index {first} = Index(blockIdx.y) * {rows};",
        f"  const Index {last} = {first} + {rows} < {m} ? {first} + {rows} : {m};",
        *(f"  T {total[v]}[Pack] = {{}};" for v in gradients),
        f"  for (Index {row} = {first}; {row} < {last}; ++{row}) {{",
        *_indent(_indent(loop)),
        "  }",
        *(f"  if ({sums[g.input.name]}) fusegen::store<Pack>({grad_pointer[g.input.name]} + Index(blockIdx.y) * "
          f"{_width(len(g.values), n)} + {_column(col, k, n)}, {total[v]});"
          for g in kernel.gradients for k, v in enumerate(g.values)),
        "}",
        "#endif",
    ]
    return "\n".join(lines) + "\n"


def choice_names(plan: OpPlan) -> tuple[dict, dict]:
    """Each choice param's functions, (param, None) for the function and (param, k) for its k-th
    partial derivative → the C++ function's name, and each param → the template parameter that
    carries the call's choice (its index among the param's choices)."""
    helpers, choices = {}, {}
    for helper in plan.helpers:
        param, arity = helper.param, len(helper.args)
        helpers[(param.name, None)] = f"{plan.op}_{param.local}"
        for k in range(arity):
            helpers[(param.name, k)] = f"{plan.op}_{param.local}_grad" + ("" if arity == 1 else str(k))
        choices[param.name] = f"{param.local.capitalize()}Choice"
    return helpers, choices


def helper_source(plan: OpPlan) -> list[str]:
    """Each choice param's function and partial derivatives, templates on the choice's index:
    the branch of each choice compiled alone (`if constexpr`), as Triton's constexpr selects it."""
    helpers, choices = choice_names(plan)
    printer = CudaPrinter()
    lines = []
    for helper in plan.helpers:
        param, choice = helper.param, choices[helper.param.name]
        names = param.declaration.choices
        arguments = ", ".join(f"T {a}" for a in helper.args)
        for k, bodies in [(None, helper.forward), *enumerate(helper.derivatives)]:
            what = f"{param.name}" if k is None else f"{param.name}'s partial derivative in {helper.args[k]}"
            lines += [f"// {what}, by {choice} (the call's choice, by index):", f"// {', '.join(names)}.",
                      f"template <typename T, int {choice}>",
                      f"FUSEGEN_HD T {helpers[(param.name, k)]}({arguments}) {{",
                      f'  static_assert({choice} >= 0 && {choice} < {len(names)}, "{param.name}: no such choice");']
            for index, (name, body) in enumerate(bodies):
                opening = ("if constexpr" if index == 0 else "} else if constexpr") + f" ({choice} == {index}) {{"
                lines.append(f"  {opening}  // {name}" if index < len(bodies) - 1 else f"  }} else {{  // {name}")
                lines += ["    " + line for line in _statements(body, printer, assign=False)]
                lines.append(f"    return {body.results[0][0]};")
            lines += ["  }", "}", ""]
    return lines


def source(plan: OpPlan) -> str:
    """The whole of <op>.cu: the forward, then the backward."""
    # An op whose every gradient is an output's own (y = x + r) has no backward kernel.
    return forward_source(plan) + ("\n" + backward_source(plan) if plan.backward.gradients else "")
