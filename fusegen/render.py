"""Simplified op → generated Python module text, through Jinja.

Everything is computed here and handed to the template as ready-printed strings; the
template holds layout only. Files are checked (they parse and compile) before they are
written, written atomically, and only when their bytes changed.
"""
from __future__ import annotations

import ast
import builtins
import os
import symtable
import tempfile
import textwrap
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2
import sympy

from .errors import SpecError
from .functions import FUNCTIONS
from .printers import (
    TRITON_COMPUTE_DTYPE,
    EagerPrinter,
    TorchPrinter,
    TritonPrinter,
    _ElementwisePrinter,
    uses_libdevice,
)
from .simplify import HELPER_ARGS, Block, ChoiceHelper, SimplifiedOp, choice_function, value_names
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


# torch.nn.Module's public attributes (torch 2.13; tests/test_module_class.py compares them
# with the installed torch's): the op's module class keeps each param as an attribute of
# its name, which must not replace one of these.
_NN_MODULE_ATTRIBUTES = frozenset(
    {
        "T_destination", "add_module", "apply", "bfloat16", "buffers", "call_super_init", "children", "compile",
        "cpu", "cuda", "double", "dump_patches", "eval", "extra_repr", "float", "forward", "get_buffer",
        "get_extra_state", "get_parameter", "get_submodule", "half", "ipu", "load_state_dict", "modules", "mtia",
        "named_buffers", "named_children", "named_modules", "named_parameters", "parameters",
        "register_backward_hook", "register_buffer", "register_forward_hook", "register_forward_pre_hook",
        "register_full_backward_hook", "register_full_backward_pre_hook", "register_load_state_dict_post_hook",
        "register_load_state_dict_pre_hook", "register_module", "register_parameter",
        "register_state_dict_post_hook", "register_state_dict_pre_hook", "requires_grad_", "set_extra_state",
        "set_submodule", "share_memory", "state_dict", "to", "to_empty", "train", "training", "type", "xpu",
        "zero_grad",
    }
)
# Module-level names of a generated module that a class name could shadow: its imports, and
# the builtins its functions use (all builtins, to be safe).
_MODULE_LEVEL_NAMES = frozenset({"F", "Optional"}) | frozenset(dir(builtins))


def module_class_name(op_name: str) -> str:
    """The op's torch.nn.Module class: its name in CamelCase (bias_gelu_dropout_add →
    BiasGeluDropoutAdd), with "Module" added where that is the op's own name or a name the
    module already uses (op Gelu → GeluModule, op f → FModule)."""
    name = "".join(word[:1].upper() + word[1:] for word in op_name.split("_"))
    return f"{name}Module" if name == op_name or name in _MODULE_LEVEL_NAMES else name


def _check_module_class_names(spec: OpSpec, class_name: str) -> None:
    """The spec's names against the module class: its name, and the attributes it keeps.
    (spec.py checks every other name the generated code derives.)"""
    for kind, items in (("input", spec.inputs), ("param", spec.params), ("let", spec.lets), ("output", spec.outputs)):
        for item in items:
            if item.name == class_name:
                raise SpecError(
                    spec.path, item.line,
                    f"{kind} name '{item.name}' is reserved by the generated code for op '{spec.name}' (its module class)",
                )
    for param in spec.params:
        if param.name in _NN_MODULE_ATTRIBUTES:
            raise SpecError(
                spec.path, param.line,
                f"param name '{param.name}' is reserved by the generated code: the op's module class keeps params "
                f"as attributes, and torch.nn.Module has one named '{param.name}'",
            )


def render_op_module(op: SimplifiedOp) -> str:
    """The text of generated/<op>.py."""
    spec = op.ir.spec
    class_name = module_class_name(spec.name)
    _check_module_class_names(spec, class_name)
    triton, torch_printer = TritonPrinter(), TorchPrinter()
    outputs = [b.name for b in spec.outputs]
    inputs = [i.name for i in spec.inputs]
    has_dropout = bool(op.ir.dropouts)
    kernel_params = [s.name for s in op.scalar_params]
    dropout_params = sorted({d.p for d in op.ir.dropouts})
    tensors = {*op.inputs, *op.masks, *op.grad_outputs}
    grad_names = [g.name for g in op.grad_outputs]
    kernel_values = {g.input for g in op.gradients if g.passthrough_of is None}
    kernel_grad_inputs = [i for i in spec.inputs if kernel_values & set(value_names(i))]
    kernel_grads = [i.name for i in kernel_grad_inputs]
    backward_symbols = _free_symbols(op.backward) | _free_symbols(op.backward_no_dropout)
    backward_inputs = [
        i for i in spec.inputs if any(sympy.Symbol(n, real=True) in backward_symbols for n in value_names(i))
    ]
    mask_lines = [
        f"dropout_mask{d.stream} = dropout_mask(seed, rows, tl.program_id(1) * BLOCK_N, N, BLOCK_N, {d.stream}, "
        f"dropout_threshold_{d.p}, dropout_scale_{d.p}, DROPOUT_WHOLE_GROUPS)"
        for d in op.ir.dropouts
    ]

    def lines(block: Block, printer, names, constant, with_masks: bool) -> list[str]:
        return (mask_lines if with_masks else []) + _print_block(block, printer, names, constant, tensors)

    grad_results = [f"grad_{g.input}" for g in op.gradients if g.passthrough_of is None]
    kernel_dropout = lines(op.forward, triton, outputs, _triton_constant, True)
    kernel_plain = lines(op.forward_no_dropout, triton, outputs, _triton_constant, False)
    backward_dropout = lines(op.backward, triton, grad_results, _triton_constant, True)
    backward_plain = lines(op.backward_no_dropout, triton, grad_results, _triton_constant, False)
    triton_helpers = [f for h in op.helpers for f in _helper_functions(h, triton, with_grads=True)]
    torch_helpers = [f for h in op.helpers for f in _helper_functions(h, torch_printer, with_grads=False)]
    triton_code = kernel_dropout + kernel_plain + backward_dropout + backward_plain
    triton_code += [line for h in triton_helpers for b in h.branches for line in b.lines]

    params = [p.name for p in spec.params]
    non_tensor_gradients = ["None"] * (len(params) + 2)  # params, training, seed
    arguments = inputs + params + ["training", "seed"]
    internal = inputs + params + (["training", "seed"] if has_dropout else ["False", "None"])
    typed = [f"{n}: torch.Tensor" for n in inputs]
    typed += [f"{p.name}: {'str' if isinstance(p, ChoiceParam) else p.type}" for p in spec.params]
    passthroughs = [g for g in op.gradients if g.passthrough_of]
    passthrough = {g.input: g.passthrough_of for g in passthroughs}  # chunks never pass through
    context = dict(
        op=spec.name,
        doc=_docstring_text(spec.doc),
        spec_path=spec.path,
        spec_sha256=spec.sha256,
        public_signature=public_signature(spec, has_dropout),
        eager_signature=public_signature(spec, has_dropout, with_out=False),
        eager_chunks=[f"{i.name}_chunks = {i.name}.chunk({i.chunks}, dim=-1)" for i in spec.inputs if i.chunks > 1],
        eager_returns=", ".join(EagerPrinter().doprint(expr) for _, expr in op.ir.outputs),
        eager_helpers=[_eager_helper(c) for c in spec.choice_params],
        arguments=", ".join(arguments),
        internal_arguments=", ".join(internal),
        arguments_without_seed=", ".join(inputs + params + ["training", "None"]),
        # Ops with dropout pass their seed tensor along with the outputs; others have none.
        forward_results="outputs, _" if has_dropout else "outputs",
        op_results="*outputs, _" if has_dropout else "outputs",
        seed_result=", seed" if has_dropout else "",
        backward_seed="seed" if has_dropout else "None",
        backward_op_seed="seed, " if has_dropout else "",
        typed_arguments=", ".join(typed + ["training: bool", "seed: Optional[int]"]),
        typed_grad_names=", ".join(f"{g}: torch.Tensor" for g in grad_names),
        typed_tensor_arguments=", ".join(typed),
        tensor_and_param_names=", ".join(inputs + params + ["training"]),
        problem_arguments=", ".join(inputs + [c.name for c in spec.choice_params]),
        tensor_names=", ".join(inputs),
        tensor_tuple=_tuple(inputs),
        param_tuple=_tuple(params + ["training"]),
        grad_names=", ".join(grad_names),
        grad_name_list=grad_names,
        no_gradients=", ".join(["None"] * len(inputs) + non_tensor_gradients),
        grad_tuple=_tuple(grad_names),
        kernel_grad_names=", ".join(kernel_grads) or "no input",
        kernel_grad_tuple=_tuple(kernel_grads),
        kernel_grad_needs=", ".join(f"needs[{inputs.index(n)}]" for n in kernel_grads),
        backward_views=", ".join(_view_call(i) for i in backward_inputs),
        output_names=", ".join(outputs),
        output_tuple=_tuple(outputs),
        public_returns="outputs[0]" if len(outputs) == 1 else "tuple(outputs)",
        forward_op_returns=", ".join(["torch.Tensor"] * (len(outputs) + has_dropout)),
        reference_returns=", ".join(f"{name}.to(problem.out_dtype)" for name in outputs),
        autograd_returns=", ".join([f"grad_{n}" for n in inputs] + non_tensor_gradients),
        inputs_doc=", ".join(f"{i.name} {i.shape_text}" for i in spec.inputs),
        outputs_doc=", ".join(f"{name} [{', '.join(spec.out_dims)}]" for name in outputs),
        params_doc=_params_doc(spec, has_dropout),
        passthrough_doc=textwrap.wrap(
            " ".join(
                f"The gradient of {g.input} is the gradient of {g.passthrough_of}, passed on without a copy"
                f" (summed only where {g.input} was broadcast)." for g in passthroughs
            ),
            width=88,
        ),
        has_dropout=has_dropout,
        uses_libdevice=uses_libdevice("\n".join(triton_code)),
        choices=[
            dict(name=c.name, constant=c.name.upper(), choices=repr(tuple(c.choices)), check=_choice_check(c))
            for c in spec.choice_params
        ],
        triton_helpers=triton_helpers,
        torch_helpers=torch_helpers,
        inputs=[_input_context(i) for i in spec.inputs],
        forward_views=", ".join(_view_call(i) for i in spec.inputs),
        backward_inputs=[_input_context(i) for i in backward_inputs],
        outputs=outputs,
        kernel_grads=[_input_context(i) for i in kernel_grad_inputs],
        column_sum_buffers=", ".join(f'"grad_{i.name}_ptr"' for i in kernel_grad_inputs if _one_per_row(i)),
        grad_target_pairs=_tuple([f"({i.name}, {i.chunks}, {_one_per_row(i)})" for i in kernel_grad_inputs]),
        gradients=[
            dict(input=i.name, passthrough_of=passthrough.get(i.name), index=index) for index, i in enumerate(spec.inputs)
        ],
        kernel_params=kernel_params,
        dropout_params=dropout_params,
        kernel_dropout_lines=kernel_dropout,
        kernel_plain_lines=kernel_plain,
        backward_dropout_lines=backward_dropout,
        backward_plain_lines=backward_plain,
        masks=[dict(name=f"dropout_mask{d.stream}", stream=d.stream, p=d.p) for d in op.ir.dropouts],
        torch_dropout_lines=_print_block(op.forward, torch_printer, outputs, _torch_constant, tensors),
        torch_plain_lines=_print_block(op.forward_no_dropout, torch_printer, outputs, _torch_constant, tensors),
        scalar_params=[dict(name=p.name, check=_scalar_check(p)) for p in spec.scalar_params],
        class_name=class_name,
        class_doc=_class_doc(spec, has_dropout),
        init_signature=", ".join(["self"] + [f"{p.name}={p.default!r}" for p in spec.params]),
        class_arguments=", ".join(f"{p.name}={p.default!r}" for p in spec.params),
        param_names=params,
        param_checks=[_scalar_check(p) if isinstance(p, ScalarParam) else _choice_check(p) for p in spec.params],
        forward_signature=", ".join(["self"] + inputs),
        module_call=", ".join(inputs + [f"{p}=self.{p}" for p in params] + (["training=self.training"] if has_dropout else [])),
        extra_repr="f\"" + ", ".join(f"{p}={{self.{p}!r}}" for p in params) + "\"",
        any_dropout=" or ".join(f"{p} > 0" for p in dropout_params) or "False",
        call_fields=", ".join(f"{p.name}={p.name}" for p in spec.params),
    )
    return _template_environment().get_template("op.py.jinja").render(**context)


def _one_per_row(spec_input) -> bool:
    """An input declared [..., 1]: one value per row, broadcast along the columns."""
    return spec_input.chunks == 1 and bool(spec_input.dims) and spec_input.dims[-1] == "1"


def _input_context(spec_input) -> dict:
    """An input as the kernels see it: its pointer, and each value it supplies with the
    column expression where that value lives (chunk k of x [..., kN] at cols + k * N)."""
    chunks = spec_input.chunks
    offsets = [""] + [f" + {'' if k == 1 else f'{k} * '}N" for k in range(1, chunks)]
    columns = [f"(cols[None, :]{offset})" if offset else "cols[None, :]" for offset in offsets]
    return dict(
        name=spec_input.name,
        constant=spec_input.name.upper(),
        dims=spec_input.shape_text,
        dims_tuple=repr(tuple(spec_input.dims)),
        row_width="N" if chunks == 1 else f"{chunks} * N",
        one_per_row=_one_per_row(spec_input),
        values=[dict(name=n, column=c) for n, c in zip(value_names(spec_input), columns)],
        sum_columns=[f"cols{offset}" for offset in offsets],
        reference_values=", ".join(value_names(spec_input)),
        reference_split="" if chunks == 1 else f".chunk({chunks}, dim=-1)",
    )


def _eager_helper(param: ChoiceParam) -> dict:
    arity = FUNCTIONS[param.choices[0]].arity
    args = HELPER_ARGS[:arity]
    return dict(
        name=f"_{param.name}__eager",
        param="choice",
        args=", ".join(args),
        branches=[
            dict(keyword="if" if i == 0 else "elif", choice=repr(c), line=FUNCTIONS[c].torch_idiom.format(*args))
            for i, c in enumerate(param.choices)
        ],
    )


def _view_call(spec_input) -> str:
    chunks = f", chunks={spec_input.chunks}" if spec_input.chunks > 1 else ""
    return f"runtime.view_2d({spec_input.name}, problem{chunks})"


def public_signature(spec: OpSpec, has_dropout: bool, with_out: bool = True) -> str:
    """The generated op's parameters, as its `def` line writes them."""
    parts = [i.name for i in spec.inputs] + [f"{p.name}={p.default!r}" for p in spec.params]
    parts += ["training=True", "seed=None"] if has_dropout else []
    return ", ".join(parts + (["*", "out=None"] if with_out else []))


def _tuple(names: list[str]) -> str:
    """Python tuple syntax for names: `a, b` or `a,` (one) or `()` (none)."""
    if not names:
        return "()"
    return ", ".join(names) + ("," if len(names) == 1 else "")


def _free_symbols(block: Block) -> set:
    found = set()
    for _, expr in (*block.temps, *block.results):
        found |= expr.free_symbols
    return found


def _docstring_text(text: str) -> str:
    """Text safe inside a triple-quoted docstring: backslashes and quotes escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def render_starter_spec(name: str) -> str:
    """A commented spec for `fusegen new NAME` that builds as it is."""
    return _template_environment().get_template("new_spec.yaml.jinja").render(name=name)


def render_package_init(specs: list[OpSpec]) -> str:
    return _template_environment().get_template("init.py.jinja").render(
        ops=[dict(name=s.name, doc=s.doc) for s in sorted(specs, key=lambda s: s.name)]
    )


def _class_doc(spec: OpSpec, has_dropout: bool) -> list[str]:
    """Lines not wrapped: where a spec's names fall must not move the line breaks."""
    lines = [f"The op as a torch.nn.Module: forward({', '.join(i.name for i in spec.inputs)}) calls {spec.name}."]
    if spec.params:
        lines.append("Its params are fixed at construction, and checked then.")
    if has_dropout:
        lines.append("Dropout is on in train() mode and off in eval(); seeds come from torch's generator.")
    return lines


def _scalar_check(param: ScalarParam) -> str:
    return f'runtime.check_scalar(_OP, "{param.name}", {param.name}, "{param.type}", {param.min!r}, {param.max!r})'


def _choice_check(param: ChoiceParam) -> str:
    return f'runtime.check_choice(_OP, "{param.name}", {param.name}, {param.name.upper()}_CHOICES)'


def _range_text(low, high) -> str:
    """`in [0.0, 1.0]`, `≥ 0.0`, `≤ 1.0` or "": as fusegen.runtime.launch.range_text prints
    a range in errors (tests/test_arguments.py pins that the two agree)."""
    if low is not None and high is not None:
        return f"in [{low!r}, {high!r}]"
    if low is not None:
        return f"≥ {low!r}"
    return "" if high is None else f"≤ {high!r}"


def _params_doc(spec: OpSpec, has_dropout: bool) -> list[str]:
    lines = []
    for p in spec.params:
        if isinstance(p, ScalarParam):
            bounds = _range_text(p.min, p.max)
            bounds = f" {bounds}" if bounds else ""
            lines.append(f"Param {p.name}: {p.type}{bounds}, default {p.default!r} (runtime: no recompilation).")
        elif isinstance(p, ChoiceParam):
            lines.append(
                f"Param {p.name}: one of {', '.join(p.choices)}; default {p.default!r} (compile-time: one kernel each)."
            )
    if has_dropout:
        lines.append("training=False, or every dropout p == 0, takes a kernel with no random numbers.")
        lines.append("seed=None draws the dropout seed from torch's default generator (torch.manual_seed).")
    return [wrapped for line in lines for wrapped in textwrap.wrap(line, width=88, subsequent_indent="    ")]


def _helper_functions(helper: ChoiceHelper, printer: _ElementwisePrinter, with_grads: bool) -> list[HelperFunction]:
    """One function per choice param (and per partial derivative), branching on the choice."""
    is_triton = isinstance(printer, TritonPrinter)
    arity = len(helper.args)
    variants = [(choice_function(helper.param, arity), helper.forward)]
    if with_grads:
        variants += [(choice_function(helper.param, arity, k), blocks) for k, blocks in enumerate(helper.grads)]
    functions = []
    for function, blocks in variants:
        branches = tuple(
            HelperBranch("if" if i == 0 else "elif", repr(choice), tuple(_print_block(block, printer, ["out"], None, set())))
            for i, (choice, block) in enumerate(blocks)
        )
        functions.append(
            HelperFunction(
                name=function.__name__ + printer.helper_suffix,
                param=helper.param,
                args=", ".join(a.name for a in helper.args),
                selector=helper.param.upper() if is_triton else "choice",
                returns="out",
                branches=branches,
            )
        )
    return functions


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
    return f"tl.full((BLOCK_M, BLOCK_N), {text}, {TRITON_COMPUTE_DTYPE})"


def _torch_constant(text: str) -> str:
    return f"torch.full(problem.shape, {text}, dtype=problem.compute_dtype, device=problem.device)"


# ---------------------------------------------------------------------------
# Checking and writing


class GeneratedCodeError(Exception):
    """The generator produced a module that does not parse or compile: a fusegen bug."""


def check_module(text: str, filename: str) -> None:
    """The generated module parses, compiles, and every name it reads is defined: by the
    module, its imports, the enclosing function, or Python's builtins."""
    try:
        tree = ast.parse(text, filename=filename)
        compile(tree, filename, "exec")
        table = symtable.symtable(text, filename, "exec")
    except SyntaxError as exc:
        raise GeneratedCodeError(f"{filename}:{exc.lineno}: generated code does not parse: {exc.msg}") from None
    defined = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    defined |= set(dir(builtins))
    for scope in _scopes(table):
        for symbol in scope.get_symbols():
            if symbol.is_referenced() and (symbol.is_global() or scope is table) and symbol.get_name() not in defined:
                raise GeneratedCodeError(
                    f"{filename}: generated code reads '{symbol.get_name()}', which nothing defines (in {scope.get_name()})"
                )


def _scopes(table: symtable.SymbolTable):
    yield table
    for child in table.get_children():
        yield from _scopes(child)


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
