"""Simplified op → plan (fusegen.plan): every name given, every body renamed to it.

What is the same for every kernel kind is built here: the spec's names and the derived
ones (chunks, masks, gradients, temporaries), inputs, params, masks, what each kernel loads
and stores, the eager twin's body and the choice helpers. What is a kind's own (its
symbols' names, its bodies as the plan holds them) its registered kind builds
(fusegen.kinds, `kind_of(op)`).

Names: a spec name stays as the user wrote it, unless the backend's generated code
already uses it for itself (then it takes a trailing underscore, inside the generated
code only: public signatures keep the spec's names). See fusegen.names.
"""
from __future__ import annotations

from dataclasses import replace

import sympy

from . import ir
from .calculus import TEMPORARY_PREFIX
from .errors import SpecError
from .functions import FUNCTIONS
from .kinds import kind_of
from .layout import Choice, Scalar
from .names import PYTHON_BUILTINS, Namer
from .plan import (Body, GradientPlan, HelperPlan, HiddenPlan, InputPlan, KernelPlan, LowRankPlan, Mask, MatmulPlan, OpPlan, OutputParts,
                   ParamPlan, Value)
from .printers import EagerPrinter
from .rows import WIDTH
from .simplify import Block, ChoiceHelper, SimplifiedOp, grad_output_name, partial_name, value_names
from .spec import ChoiceParam, OpSpec


def plan(op: SimplifiedOp, reserved: frozenset[str], module_names: frozenset[str] = frozenset()) -> OpPlan:
    """`reserved`: the names the backend's generated code uses for itself; `module_names`:
    the module-level names its modules import, which the op (a module-level function) must
    not hide (check_op_name)."""
    spec = op.ir.spec
    check_op_name(spec.name, spec.path, spec.name_line, module_names)
    namer = Namer(reserved)
    # The spec's own names first: each keeps its name wherever the backend does not use it.
    names = {}
    for item in (*spec.inputs, *spec.params, *spec.outputs):
        names[item.name] = namer.claim(item.name)
    symbols: dict[str, str] = {}  # simplify's symbol names → local names
    matmul = op.ir.matmul
    products = ()  # the product, a value of the kernels' bodies as an input is, and the low-rank one
    if matmul is not None:
        products = op.ir.epilogue_inputs[:1 + (matmul.lowrank is not None)]
        names[ir.PRODUCT] = namer.claim("product")
        if matmul.lowrank is not None:
            names[ir.LOWRANK] = namer.claim("lowrank")
    if op.hidden is not None:  # the hidden layer's product, value and partials: names of the bodies
        symbols[ir.HIDDEN_PRODUCT] = namer.claim("hidden_product")
        symbols[ir.HIDDEN] = namer.claim("hidden")
        symbols.update({partial_name(k): namer.claim(f"hidden_partial{k}") for k in range(op.hidden.count)})
    planned = {}  # InputPlan of each input, and of the products
    for spec_input in (*spec.inputs, *products):
        local = names[spec_input.name]
        values = []
        for k, value in enumerate(value_names(spec_input)):
            symbols[value] = local if spec_input.chunks == 1 else namer.claim(f"{local}_chunk{k}")
            values.append(Value(symbols[value], k))
        # A product is named by its local: a declaration's name (gemm_launch's), never a spec name.
        name = local if spec_input.name in (ir.PRODUCT, ir.LOWRANK) else spec_input.name
        layout = spec_input.layout if name == spec_input.name else replace(spec_input.layout, name=name)
        planned[spec_input.name] = InputPlan(name, local, layout, tuple(values))
    inputs = [planned[i.name] for i in spec.inputs]
    # What the bodies read: the inputs, a matmul's operands replaced by its product.
    epilogue = [planned[i.name] for i in op.ir.epilogue_inputs]
    dropout_ps = {d.p for d in op.ir.dropouts}
    params = []
    for p in spec.params:
        symbols[p.name] = names[p.name]
        if isinstance(p, ChoiceParam):
            declaration: Scalar | Choice = Choice(p.name, p.choices)
        else:
            declaration = Scalar(p.name, p.type, p.min, p.max, p.min_open, p.max_open)
        params.append(ParamPlan(p.name, names[p.name], declaration, p.default, p.name in dropout_ps))
    by_name = {p.name: p for p in params}
    masks = []
    for symbol, dropout in zip(op.masks, op.ir.dropouts):
        symbols[symbol.name] = namer.claim(f"dropout_mask{dropout.stream}")
        masks.append(Mask(symbols[symbol.name], dropout.stream, by_name[dropout.p]))
    # Each part of a concatenated output is a value of the bodies (y_part0), as a chunk is.
    values = dict(names)
    for output, count in op.ir.output_parts:
        values.update({ir.part_name(output, k): namer.claim(f"{names[output]}_part{k}") for k in range(count)})
    for symbol, (value, _) in zip(op.grad_outputs, op.ir.outputs):
        symbols[symbol.name] = namer.claim(f"grad_{values[value]}")
    # A concatenated output's incoming gradient, read part by part.
    incoming = {output: namer.claim(f"grad_{names[output]}") for output, _ in op.ir.output_parts}
    incoming.update({value: symbols[g.name] for g, (value, _) in zip(op.grad_outputs, op.ir.outputs)})
    # Gradients the backward kernel computes (the others pass an output's gradient on).
    kernel_values = {g.input for g in op.gradients if g.passthrough_of is None}
    grad_locals = {
        value: namer.claim(f"grad_{symbols[value]}")
        for spec_input in op.ir.epilogue_inputs
        for value in value_names(spec_input)
        if value in kernel_values
    }
    kind = kind_of(op)
    symbols.update(kind.symbol_names(namer, op))
    blocks = (op.forward, op.forward_no_dropout, op.backward, op.backward_no_dropout,
              *((op.hidden.forward, op.hidden.value) if op.hidden else ()))
    temps = _temporary_names(namer, [b for b in blocks if b is not None])
    rename = {sympy.Symbol(k, real=True): sympy.Symbol(v, real=True) for k, v in {**symbols, **temps}.items()}
    outputs = tuple((b.name, names[b.name]) for b in spec.outputs)
    parts = {output: count for output, count in op.ir.output_parts}
    has_dropout = bool(masks)

    def body(block, result_names: dict[str, str]):
        return kind.body(block, rename, temps, result_names)

    def plain_body(block, result_names: dict[str, str]):
        """The body with dropout off, for a kind that has one apart (rows' masks are 1)."""
        return body(block, result_names) if has_dropout and block is not None else None

    scalars = tuple(by_name[s.name] for s in op.scalar_params)
    choices = tuple(p for p in params if isinstance(p.declaration, Choice))
    width = symbols.get(WIDTH.name)  # a kind with rows names N
    forward = KernelPlan(
        inputs=tuple(i for i in epilogue if i.name not in {planned[p.name].name for p in products}),  # formed by it
        incoming=(),
        outputs=tuple(local for _, local in outputs),
        gradients=(),
        scalars=scalars,
        masks=tuple(masks),
        choices=choices,
        body=body(op.forward, values),
        body_no_dropout=plain_body(op.forward_no_dropout, values),
        row_width=width if width and WIDTH in op.forward.free_symbols() else None,
    )
    backward_symbols = op.backward.free_symbols()
    if op.backward_no_dropout is not None:
        backward_symbols |= op.backward_no_dropout.free_symbols()
    read = list(zip(epilogue, op.ir.epilogue_inputs))  # (InputPlan, its spec input)
    gradients = tuple(
        GradientPlan(i, tuple(grad_locals[n] for n in value_names(spec_input)), i.layout.one_per_row)
        for i, spec_input in read
        if any(n in kernel_values for n in value_names(spec_input))
    )
    backward = KernelPlan(
        inputs=tuple(
            i for i, spec_input in read
            if any(sympy.Symbol(n, real=True) in backward_symbols for n in value_names(spec_input))
        ),
        incoming=tuple(incoming[name] for name, _ in outputs),
        outputs=(),
        gradients=gradients,
        scalars=scalars,
        masks=tuple(masks),
        choices=choices,
        body=body(op.backward, grad_locals),
        body_no_dropout=plain_body(op.backward_no_dropout, grad_locals),
        row_width=width if width and WIDTH in backward_symbols else None,
    )
    hidden = None
    if op.hidden is not None:
        layer, results = matmul.hidden, {n: n for n in (ir.HIDDEN, *map(partial_name, range(op.hidden.count)))}
        hidden = HiddenPlan(planned[layer.weight], layer.transposed, layer.text, tuple(planned[n] for n in layer.inputs),
                            symbols[ir.HIDDEN_PRODUCT], symbols[ir.HIDDEN],
                            tuple(symbols[partial_name(k)] for k in range(op.hidden.count)), op.hidden.partial_of,
                            body(op.hidden.forward, {n: symbols[n] for n in results}),
                            body(op.hidden.value, {ir.HIDDEN: symbols[ir.HIDDEN]}))
    eager_lets = tuple((namer.claim(name), expr) for name, expr in op.ir.lets)
    # The eager function's own names: the tuple of each chunked input's chunks, each choice
    # param's helper.
    eager_helpers = {h.param: namer.claim(f"_{by_name[h.param].local}_eager") for h in op.helpers}
    torch_helpers = {h.param: namer.claim(f"_{by_name[h.param].local}_torch") for h in op.helpers}
    # A matmul's weight holding chunks along its first dim is read whole, by the matmul's chunks.
    chunk_tuples = {i.name: namer.claim(f"{i.local}_chunks") for i in inputs
                    if i.layout.chunks > 1 and i.layout.chunk_dim == -1}
    # An output converted to a dtype of its own is computed into a local first (`q = ...`,
    # then `q.to(...)` in the return), so that a long expression breaks as an assignment does.
    converted = tuple((namer.claim(b.name), b.dtype) if b.dtype else None for b in spec.outputs)
    exprs = dict(op.ir.outputs)
    eager = _eager_lines(
        tuple(tuple(exprs[v] for v in ir.output_values(name, parts.get(name, 0))) for name, _ in outputs),
        eager_lets, tuple(inputs), names, chunk_tuples, eager_helpers, converted, op.ir.hidden,
    )
    return OpPlan(
        op=spec.name,
        kind=kind.name,
        doc=spec.doc,
        spec_path=spec.path,
        spec_sha256=spec.sha256,
        public_signature=public_signature(spec, has_dropout),
        op_signature=op_signature(spec, has_dropout),
        inputs=tuple(inputs),
        params=tuple(params),
        outputs=outputs,
        row_outputs=op.ir.row_outputs,
        output_dims=tuple(
            (name, (*spec.out_dims[:-1], "1") if name in op.ir.row_outputs else _parts_dims(spec.out_dims, parts.get(name)))
            for name, _ in outputs
        ),
        masks=tuple(masks),
        forward=forward,
        backward=backward,
        passthrough=tuple((g.input, g.passthrough_of) for g in op.gradients
                          if g.passthrough_of is not None and g.input not in (ir.PRODUCT, ir.LOWRANK)),
        same_gradient=tuple((g.input, g.same_as) for g in op.gradients if g.same_as is not None),
        gradient_reads=_gradient_reads(spec, op),
        eager=eager,
        helpers=tuple(_helper(h, by_name[h.param], torch_helpers[h.param], eager_helpers[h.param]) for h in op.helpers),
        taken=namer.all_taken(),
        output_parts=tuple(
            OutputParts(
                output,
                tuple(values[ir.part_name(output, k)] for k in range(count)),
                tuple(symbols[grad_output_name(ir.part_name(output, k))] for k in range(count)),
            )
            for output, count in op.ir.output_parts
        ),
        output_dtypes=tuple((b.name, b.dtype) for b in spec.outputs if b.dtype is not None),
        no_gradient=frozenset(b.name for b in spec.outputs if not b.differentiable),
        matmul=None if matmul is None else _matmul_plan(op, planned, backward_symbols, hidden),
    )


def _matmul_plan(op: SimplifiedOp, planned: dict, backward_symbols: set, hidden: HiddenPlan | None) -> MatmulPlan:
    """The matmul's plan: its product saved where the backward reads it; the low-rank product's
    never (its [..., N] would be written beside the product's, for an epilogue that adds it)."""
    matmul = op.ir.matmul
    incoming = {g.input: g.passthrough_of for g in op.gradients if g.passthrough_of}
    lowrank = None
    if matmul.lowrank is not None:
        r = matmul.lowrank
        if sympy.Symbol(ir.LOWRANK, real=True) in backward_symbols:
            binding = op.ir.spec.outputs[0]
            raise SpecError(op.ir.spec.path, binding.line, f"the backward reads the low-rank product {r.text}: an "
                            "epilogue that adds it (times params) is supported, not yet one whose gradients read it")
        lowrank = LowRankPlan(planned[r.down], planned[r.up], r.down_transposed, r.up_transposed,
                              planned[ir.LOWRANK], incoming.get(ir.LOWRANK))
    product = {sympy.Symbol(n, real=True) for n in value_names(op.ir.epilogue_inputs[0])}
    return MatmulPlan(planned[matmul.a], planned[matmul.b], matmul.transposed, planned[ir.PRODUCT],
                      saved=bool(product & backward_symbols), incoming=incoming.get(ir.PRODUCT), lowrank=lowrank,
                      hidden=hidden)


def _parts_dims(dims: tuple[str, ...], parts: int | None) -> tuple[str, ...]:
    """An output's dims: the problem's, with k parts of its last dim side by side ([..., 2N])."""
    if not parts or not dims or dims[-1] == "...":
        return tuple(dims)
    return (*dims[:-1], str(parts) if dims[-1] == "1" else f"{parts}{dims[-1]}")


def _gradient_reads(spec: OpSpec, op: SimplifiedOp) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per input (all its chunks), the outputs whose incoming gradients its gradient reads,
    where that is not all of them."""
    # A part's incoming gradient is read from its output's.
    whole = {ir.part_name(name, k): name for name, count in op.ir.output_parts for k in range(count)}
    reads = {g.input: {whole.get(r, r) for r in g.reads} for g in op.gradients}
    matmul = op.ir.matmul
    if matmul is not None:  # the operands' gradients are the products' (all their chunks'), multiplied
        product = set().union(*(reads[n] for n in value_names(op.ir.epilogue_inputs[0])))
        lowrank = reads[ir.LOWRANK] if matmul.lowrank else set()
        by_name = {i.name: i for i in spec.inputs}
        reads.update({n: product for n in value_names(by_name[matmul.b])})
        reads.update({n: product | lowrank for n in value_names(by_name[matmul.a])})
        if matmul.lowrank:
            reads.update({matmul.lowrank.down: lowrank, matmul.lowrank.up: lowrank})
        if matmul.hidden:  # the hidden layer's gradients are all from the product's
            reads.update({n: product for n in (matmul.hidden.weight, *matmul.hidden.inputs)})
    every = [b.name for b in spec.outputs]
    result = []
    for spec_input in spec.inputs:
        if spec_input.dtype != "float" or not op.gradients:  # no gradient at all (a forward-only op)
            continue
        read = set().union(*(reads[n] for n in value_names(spec_input)))
        if len(read) < len(every):
            result.append((spec_input.name, tuple(name for name in every if name in read)))
    return tuple(result)


def _temporary_names(namer: Namer | None, blocks) -> dict[str, str]:
    """simplify's %t0, %t1, ... as t0, t1, ...: claimed for the whole module (the backend's
    own names, given out later, must not take them); a helper (namer None) has no others."""
    defined = [pair for b in blocks for pair in b.definitions]
    used = sorted(
        {t.name for t, _ in defined if t.name.startswith(TEMPORARY_PREFIX)},  # not a row program's row values
        key=lambda n: int(n[len(TEMPORARY_PREFIX):]),
    )
    plain = {name: "t" + name[len(TEMPORARY_PREFIX):] for name in used}
    return plain if namer is None else {name: namer.claim(local) for name, local in plain.items()}


def _eager_lines(outputs: tuple[tuple[ir.Expr, ...], ...], lets: tuple[tuple[str, ir.Expr], ...], inputs: tuple[InputPlan, ...],
                 names: dict[str, str], chunk_tuples: dict[str, str], helpers: dict[str, str],
                 converted: tuple[tuple[str, str] | None, ...] = (), hidden: ir.Expr | None = None) -> tuple[str, ...]:
    """The eager function's body: the spec's IR printed as a PyTorch user writes it; an output
    with a dtype of its own (`converted`: its local and dtype, None for none) converted to it
    with `.to`."""
    # `col` counts along the last dim of an input that has it (one chunk's, for a chunked input).
    along = next((i for i in inputs if i.layout.dims and i.layout.dims[-1] != "1"), None)
    column = ""
    if along is not None:
        width = f"{along.local}.shape[-1]" + (f" // {along.layout.chunks}" if along.layout.chunks > 1 else "")
        column = f"torch.arange({width}, device={along.local}.device)"
    printer = EagerPrinter(names, chunk_tuples, helpers, {id(expr): local for local, expr in lets}, column, hidden)
    lines = [
        f"{chunk_tuples[i.name]} = {i.local}.chunk({i.layout.chunks}, dim=-1)" for i in inputs if i.name in chunk_tuples
    ]
    lines += [f"{local} = {printer.doprint(expr, defining=True)}" for local, expr in lets]
    returned = [
        printer.doprint(parts[0]) if len(parts) == 1
        else "torch.cat((" + ", ".join(printer.doprint(expr) for expr in parts) + "), dim=-1)"
        for parts in outputs
    ]
    for k, conversion in enumerate(converted):
        if conversion is not None:
            local, dtype = conversion
            lines.append(f"{local} = {returned[k]}")
            returned[k] = f"{local}.to(torch.{dtype})"
    return tuple(lines + ["return " + ", ".join(returned)])


def _helper(helper: ChoiceHelper, param: ParamPlan, torch_name: str, eager_name: str) -> HelperPlan:
    """A helper's scope holds no spec names: its temporaries are simply t0, t1, ..."""
    temps = _temporary_names(None, [b for _, b in (*helper.forward, *(pair for g in helper.grads for pair in g))])
    rename = {sympy.Symbol(k, real=True): sympy.Symbol(v, real=True) for k, v in temps.items()}

    def body(block: Block) -> Body:
        return Body(
            tuple((temps[t.name], e.xreplace(rename)) for t, e in block.temps),
            tuple((n, e.xreplace(rename)) for n, e in block.results),
        )

    return HelperPlan(
        param=param,
        args=tuple(a.name for a in helper.args),
        forward=tuple((choice, body(b)) for choice, b in helper.forward),
        derivatives=tuple(tuple((choice, body(b)) for choice, b in g) for g in helper.grads),
        torch_name=torch_name,
        eager_name=eager_name,
        eager=tuple(
            (c, FUNCTIONS[c].torch_idiom.format(*(a.name for a in helper.args))) for c in param.declaration.choices
        ),
    )


def check_op_name(name: str, path: str, line: int | None, module_names: frozenset[str]) -> None:
    """The op function is module-level: it must not hide what the module's code reads there
    (`module_names`, the backend's imports) or a Python builtin. (Also asked by `fusegen new`,
    before it writes a spec.)"""
    if name in module_names:
        raise SpecError(path, line, f"op name '{name}' would hide the module's import of {name}")
    if name in PYTHON_BUILTINS:
        raise SpecError(path, line, f"op name '{name}' would hide Python's builtin {name}")


def public_signature(spec: OpSpec, has_dropout: bool) -> str:
    """The generated op's parameters, as its `def` line writes them: the spec's names."""
    parts = [i.name for i in spec.inputs] + [f"{p.name}={p.default!r}" for p in spec.params]
    parts += ["training=True", "seed=None"] if has_dropout else []
    return ", ".join(parts + ["*", "out=None"])


def op_signature(spec: OpSpec, has_dropout: bool) -> str:
    """The op's own parameters: `reference`'s, and the backward's memory choice (none for a
    forward-only op: no output has a gradient)."""
    differentiable = any(b.differentiable for b in spec.outputs)
    return public_signature(spec, has_dropout) + (", inplace_backward=False" if differentiable else "")
