"""Simplified op → generated Python module text, through Jinja.

Everything is computed here and handed to the template as ready-printed strings; the
template holds layout only. Files are checked (they parse and compile) before they are
written, written atomically, and only when their bytes changed.
"""
from __future__ import annotations

import ast
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2
import sympy

from .printers import TorchPrinter, TritonPrinter, _ElementwisePrinter, uses_libdevice
from .simplify import Block, ChoiceHelper, SimplifiedOp
from .spec import ChoiceParam, OpSpec, ScalarParam

_TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"


def _template_environment() -> jinja2.Environment:
    # A checkout has templates/ beside the package; an installed package carries them as
    # fusegen.templates (see pyproject.toml).
    if (_TEMPLATE_DIR / "op.py.jinja").is_file():
        loader: jinja2.BaseLoader = jinja2.FileSystemLoader(str(_TEMPLATE_DIR))
    else:
        loader = jinja2.FunctionLoader(
            lambda name: resources.files("fusegen.templates").joinpath(name).read_text(encoding="utf-8")
        )
    return jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


@dataclass(frozen=True)
class HelperBranch:
    keyword: str  # "if" or "elif"
    choice: str  # a quoted string literal
    lines: tuple[str, ...]


@dataclass(frozen=True)
class HelperFunction:
    name: str
    param: str
    args: str
    selector: str
    returns: str
    branches: tuple[HelperBranch, ...]


def render_op_module(op: SimplifiedOp) -> str:
    """The text of generated/<op>.py."""
    spec = op.ir.spec
    triton, torch_printer = TritonPrinter(), TorchPrinter()
    outputs = [b.name for b in spec.outputs]
    kernel_params = [s.name for s in op.scalar_params]
    dropout_params = sorted({d.p for d in op.ir.dropouts})

    has_dropout = bool(op.ir.dropouts)
    tensors = {*op.inputs, *op.masks, *op.grad_outputs}
    kernel_dropout = _print_block(op.forward, triton, outputs, _triton_constant, tensors)
    kernel_plain = _print_block(op.forward_no_dropout, triton, outputs, _triton_constant, tensors)
    for d in op.ir.dropouts:
        kernel_dropout.insert(
            0,
            f"dropout_mask{d.stream} = dropout_mask(seed, rows, cols, {d.stream}, "
            f"dropout_threshold_{d.p}, dropout_scale_{d.p})",
        )
    triton_helpers = [_helper_function(h, triton, "forward") for h in op.helpers]
    torch_helpers = [_helper_function(h, torch_printer, "forward") for h in op.helpers]

    all_code = "\n".join(kernel_dropout + kernel_plain + [ln for h in triton_helpers for b in h.branches for ln in b.lines])
    context = dict(
        op=spec.name,
        doc=spec.doc,
        spec_path=spec.path,
        spec_sha256=spec.sha256,
        signature=_signature(spec, has_dropout, defaults=True),
        signature_bare=_signature(spec, has_dropout, defaults=False),
        call_arguments=", ".join(_argument_names(spec, has_dropout)),
        inputs_doc=", ".join(f"{i.name} {i.shape_text}" for i in spec.inputs),
        outputs_doc=", ".join(f"{name} [{', '.join(spec.out_dims)}]" for name in outputs),
        params_doc=_params_doc(spec, has_dropout),
        has_dropout=has_dropout,
        uses_libdevice=uses_libdevice(all_code),
        choices=[
            dict(name=c.name, constant=c.name.upper(), choices=repr(tuple(c.choices)))
            for c in spec.choice_params
        ],
        triton_helpers=triton_helpers,
        torch_helpers=torch_helpers,
        inputs=[
            dict(name=i.name, dims=i.shape_text, dims_tuple=repr(tuple(i.dims)))
            for i in spec.inputs
        ],
        input_names=", ".join(i.name for i in spec.inputs) + ("," if len(spec.inputs) == 1 else ""),
        outputs=outputs,
        returns=", ".join(outputs),
        returns_reference=", ".join(f"{name}.to(problem.out_dtype)" for name in outputs),
        kernel_params=kernel_params,
        dropout_params=dropout_params,
        kernel_dropout_lines=kernel_dropout,
        kernel_plain_lines=kernel_plain,
        masks=[dict(name=f"dropout_mask{d.stream}", stream=d.stream, p=d.p) for d in op.ir.dropouts],
        torch_dropout_lines=_print_block(op.forward, torch_printer, outputs, _torch_constant, tensors),
        torch_plain_lines=_print_block(op.forward_no_dropout, torch_printer, outputs, _torch_constant, tensors),
        scalar_params=[
            dict(name=p.name, kind=p.type, low=repr(p.min), high=repr(p.max)) for p in spec.scalar_params
        ],
        any_dropout=" or ".join(f"{p} > 0" for p in dropout_params) or "False",
        call_fields=", ".join(f"{p.name}={p.name}" for p in spec.params),
    )
    return _template_environment().get_template("op.py.jinja").render(**context)


def render_package_init(specs: list[OpSpec]) -> str:
    return _template_environment().get_template("init.py.jinja").render(
        ops=[dict(name=s.name, doc=s.doc) for s in sorted(specs, key=lambda s: s.name)]
    )


def _signature(spec: OpSpec, has_dropout: bool, defaults: bool) -> str:
    parts = [i.name for i in spec.inputs]
    for p in spec.params:
        parts.append(f"{p.name}={p.default!r}" if defaults else p.name)
    if has_dropout:
        parts += ["training=True", "seed=None"] if defaults else ["training", "seed"]
    return ", ".join(parts)


def _argument_names(spec: OpSpec, has_dropout: bool) -> list[str]:
    names = [i.name for i in spec.inputs] + [p.name for p in spec.params]
    return names + (["training", "seed"] if has_dropout else [])


def _params_doc(spec: OpSpec, has_dropout: bool) -> list[str]:
    lines = []
    for p in spec.params:
        if isinstance(p, ScalarParam):
            bounds = f" in [{p.min}, {p.max}]" if p.min is not None or p.max is not None else ""
            lines.append(f"Param {p.name}: {p.type}{bounds}, default {p.default!r} (runtime: no recompilation).")
        elif isinstance(p, ChoiceParam):
            lines.append(
                f"Param {p.name}: one of {', '.join(p.choices)}; default {p.default!r} (compile-time: one kernel each)."
            )
    if has_dropout:
        lines.append("training=False, or every dropout p == 0, takes a kernel with no random numbers.")
        lines.append("seed=None draws the dropout seed from torch's default generator (torch.manual_seed).")
    return lines


def _helper_function(helper: ChoiceHelper, printer: _ElementwisePrinter, kind: str) -> HelperFunction:
    blocks = helper.forward if kind == "forward" else helper.grads
    results = ["out"] if kind == "forward" else [f"d{k}" for k in range(len(helper.args))]
    is_triton = isinstance(printer, TritonPrinter)
    name = f"_{helper.param}" + ("_grad" if kind == "grad" else "") + ("" if is_triton else "_torch")
    branches = []
    for index, (choice, block) in enumerate(blocks):
        lines = tuple(_print_block(block, printer, results, None, set()))
        branches.append(HelperBranch("if" if index == 0 else "elif", repr(choice), lines))
    return HelperFunction(
        name=name,
        param=helper.param,
        args=", ".join(a.name for a in helper.args),
        selector=helper.param.upper() if is_triton else helper.param,
        returns=", ".join(results),
        branches=tuple(branches),
    )


def _print_block(block: Block, printer: _ElementwisePrinter, names: list[str], constant, tensors: set) -> list[str]:
    """`t0 = ...` lines then `name = ...` lines; a result that reaches no tensor is broadcast."""
    lines = [f"{symbol.name} = {printer.doprint(expr)}" for symbol, expr in block.temps]
    results = dict(block.results)
    for name in names:
        expr = results[name]
        text = printer.doprint(expr)
        if constant is not None and not _depends_on(expr, block, tensors):
            text = constant(text)
        lines.append(f"{name} = {text}")
    return lines


def _depends_on(expr: sympy.Expr, block: Block, tensors: set) -> bool:
    """Whether a result reaches one of `tensors`, directly or through temporaries."""
    temps = dict(block.temps)
    pending, seen = list(expr.free_symbols), set()
    while pending:
        symbol = pending.pop()
        if symbol in seen:
            continue
        seen.add(symbol)
        if symbol in temps:
            pending.extend(temps[symbol].free_symbols)
        elif symbol in tensors:
            return True
    return False


def _triton_constant(text: str) -> str:
    return f"tl.full((BLOCK_M, BLOCK_N), {text}, tl.float64 if COMPUTE_FP64 else tl.float32)"


def _torch_constant(text: str) -> str:
    return f"torch.full(problem.shape, {text}, dtype=problem.compute_dtype, device=problem.device)"


# ---------------------------------------------------------------------------
# Checking and writing


class GeneratedCodeError(Exception):
    """The generator produced a module that does not parse or compile: a fusegen bug."""


def check_module(text: str, filename: str) -> None:
    try:
        tree = ast.parse(text, filename=filename)
        compile(tree, filename, "exec")
    except SyntaxError as exc:
        raise GeneratedCodeError(f"{filename}:{exc.lineno}: generated code does not parse: {exc.msg}") from None


def write_if_changed(path: Path, text: str) -> bool:
    """Write atomically (temp file + rename) and only when the bytes differ; True if written."""
    data = text.encode("utf-8")
    if path.is_file() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True
