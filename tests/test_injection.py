"""Names and doc strings that try to break out into the generated code.

Hostile strings go into the positions a spec has (op name, input name, scalar and choice
param names, choice values, let and output names, dim names, doc, spec file name). By
default a fixed pairwise sample runs (_pairwise_sample: every name, every position, every
(name class, position) pair; about 200 cases); FUSEGEN_FULL_INJECTION=1 runs every name in
every position (about 1,100).
It is rejected with one line `specs/<file>:<line>: message`, or, if accepted, the module
built from it must hold only what the spec asks for:

- it passes `write.check_module`;
- every call is to an allowlisted callee (tl.*, torch.*, triton.*, runtime.*, libdevice.*,
  the module's own functions, a few builtins, public methods of a function's own locals);
  no builtin such as eval, exec, getattr or __import__ is even read;
- it imports nothing but the fixed header imports;
- a hostile doc, dim or file name appears only inside string literals and comments, and
  the docstrings (and the package __init__'s) hold the doc word for word;
- a name is the user's: the op's public signature holds it as written, and inside the
  generated functions (where fusegen.plan's namer may have renamed it, rows → rows_)
  every scope reads the same module-level and builtin names as the module built from the
  same spec with a neutral name in that position: nothing the spec names shadows or
  captures one of the generated code's own names. Data (doc, dims, file name) leaves the
  module the neutral module with the text substituted: the same syntax tree (up to the
  order of the terms of + and *, which sympy sorts by name), every name bound the same way.

Bugs found here are pinned as strict xfails, with the reason (see KNOWN BUGS below).
"""
from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import io
import keyword
import os
import re
import symtable
import tokenize
from pathlib import Path

import pytest
import torch
import yaml

from fusegen import cli, write
from fusegen.backends.triton.codegen import MODULE_IMPORTS, RESERVED_NAMES, module_class_name
from fusegen.errors import SpecError
from fusegen.names import PYTHON_BUILTINS
from fusegen.spec import SIGNATURE_NAMES, load_spec

NEUTRAL = "qzneutral"  # a name no template uses, in any position

# The hostile names, by class: the classes are what the generated code could collide with
# (fusegen.backends.triton.codegen: MODULE_IMPORTS, RESERVED_NAMES; fusegen.names:
# PYTHON_BUILTINS and Python's keywords; the names plan.py and TritonNames derive) or what
# could break out of a string or a name. test_the_name_classes_match_the_code checks the
# classes against those sets. Every position gets the CORE classes; names that the
# generated code spells as identifiers also get the NAMES classes; choice params (whose
# helpers are named after them) also get the HELPERS classes. Line breaks in a name are
# echoed into the error message as is: KNOWN BUG 1 of test_fuzz.py, pinned there; here
# they would only repeat it.
CORE_CLASSES = {
    "quoting": ["'", '"', '"""', "'''", "\\", "\\n", "x'y", 'x"y', "a\\", "{{ op }}", "{% raw %}", "${x}", "%s"],
    "code": ["__import__('os').system('x')", "os.system('x')", "x); import os; (y", "lambda: 0"],
    "forbidden_builtin": ["exec", "getattr", "globals", "__import__"],
    "dunder": ["__class__", "__init__", "__builtins__", "__name__", "__all__"],
    "keyword": ["class", "import", "lambda", "None", "True", "match", "case", "type", "_"],
    "import": ["tl", "torch", "triton", "runtime", "libdevice", "F"],
    "module_own": ["reference", "eager", "_OP", "op_kernel", "op_backward_kernel"],
    "foreign_module": ["Optional", "fusegen", "os"],
    "odd": ["é", "ｘ", "x\u0301", "\U0001d465", "x\u200by", "", " ", "x y", "x-y", "x.y", "1x", "x\x00"],
}
NAMES_CLASSES = {
    # the op's own arguments (spec.SIGNATURE_NAMES, self), which spec.py refuses for inputs and params
    "signature": ["seed", "training", "self", "out"],
    # RESERVED_NAMES: the kernels' arguments and constexprs as they are spelled, which the namer renames
    "reserved": ["M", "N", "BLOCK_M", "K"],  # K: the gemm kind's reduced dim
    # other kernel and module names, lower-case or unreserved: ctx, x, y, ...
    "kernel_local": ["ctx", "x", "y", "z", "t", "g", "chunks", "meta", "ACT", "ACT_CHOICES", "act_choices"],
    # reserved constexprs lower-cased, which a choice param's upper-cased constexpr could hit
    "constexpr_lower": ["block_m", "block_n", "index_64", "compute_fp64", "has_dropout", "rows_per_program"],
    # names plan.py and TritonNames derive from the spec's (x_ptr, grad_x, NEEDS_GRAD_X, t0, ...)
    "derived": ["needs_grad_inp", "sum_grad_inp", "t0", "grad_inp", "inp_ptr", "inp_stride_m", "dropout_mask0",
                "inp_chunk0"],
    # builtins the generated code reads, or might (PYTHON_BUILTINS)
    "builtin": ["print", "staticmethod", "isinstance", "super", "object", "sum", "len", "zip", "iter", "next",
                "Exception", "RuntimeError"],
    # functions of the expression language
    "language": ["gelu", "where", "dropout", "chunk"],
    # the module class of op `op`, and torch.nn.Module attributes (the class keeps params as attributes)
    "module_class": ["Op", "to", "half", "train", "extra_repr", "parameters"],
}
HELPERS_CLASSES = {
    # the module's own functions, which a choice param's helper `_<name>` could replace
    "module_function": ["forward", "backward", "arguments", "problem", "forward_op", "forward_fake", "setup_context",
                        "backward_autograd", "backward_op", "backward_fake", "no_double_backward", "Autograd",
                        "autograd"],
    # the helpers of the spec's other choice param, act
    "sibling_helper": ["act_grad", "act_grad0", "act_torch", "act_eager"],
}
# Harmless outside a choice param: a sample of HELPERS there.
HELPERS_ELSEWHERE = {"helper_elsewhere": ["forward", "Autograd", "act_grad"]}
CORE = [n for names in CORE_CLASSES.values() for n in names]
NAMES = [n for names in NAMES_CLASSES.values() for n in names]
HELPERS = [n for names in HELPERS_CLASSES.values() for n in names]


def _spec(position: str, name: str) -> tuple[dict, str]:
    """A spec (as data) with `name` in `position`, and the file name it goes in."""
    spec = {"name": "op", "doc": "d", "inputs": {"inp": ["...", "N"]}, "outputs": {"res": "act(inp)"}}
    spec["params"] = {"act": {"choices": ["relu", "gelu"], "default": "relu"}}
    file_name = "x"
    if position == "op":
        spec["name"] = name
    elif position == "input":
        spec["inputs"] = {"inp": ["...", "N"], name: ["...", "N"]}
        spec["outputs"] = {"res": f"act(inp) * {name}"}
    elif position == "scalar_param":
        spec["params"][name] = {"type": "float", "default": 1.5}
        spec["outputs"] = {"res": f"act(inp) * {name}"}
    elif position == "dropout_param":
        spec["params"][name] = {"type": "float", "default": 0.1, "min": 0.0, "max": 1.0}
        spec["outputs"] = {"res": f"dropout(act(inp), {name})"}
    elif position == "choice_param":
        spec["params"][name] = {"choices": ["sigmoid", "silu"], "default": "silu"}
        spec["outputs"] = {"res": f"act(inp) + {name}(inp)"}
    elif position == "choice_param_2":
        spec["params"][name] = {"choices": ["min", "max"], "default": "max"}
        spec["outputs"] = {"res": f"act(inp) + {name}(inp, 2 * inp)"}
    elif position == "choice_value":
        spec["params"]["act"] = {"choices": ["relu", name], "default": "relu"}
    elif position == "let":
        spec["let"] = {name: "act(inp) * 2"}
        spec["outputs"] = {"res": f"{name} + inp"}
    elif position == "output":
        spec["outputs"] = {"res": "act(inp)", name: "inp * 2"}
    elif position == "dim":
        spec["inputs"] = {"inp": ["...", name], "bias": [name]}
        spec["outputs"] = {"res": "act(inp + bias)"}
    elif position == "doc":
        spec["doc"] = name
    elif position == "file":
        file_name = name
    else:
        raise ValueError(position)
    return spec, file_name


POSITIONS = [
    "op", "input", "scalar_param", "dropout_param", "choice_param", "choice_param_2", "choice_value", "let",
    "output", "dim", "doc", "file",
]
# Positions whose text is data (it lands in docstrings, comments and string literals);
# elsewhere it is a name, which the generated code spells as code.
DATA_POSITIONS = {"doc", "dim", "file"}

# ---------------------------------------------------------------------------
# KNOWN BUGS (strict xfails): a spec name that collides with a name the generated code
# derives for itself, which neither RESERVED_NAMES nor the reserved patterns cover.
#
# A. A choice param named like a helper's own argument (x; y for a two-argument choice):
#    the torch helper is `def _x_torch(x, x)`: duplicate argument, the build fails with
#    "internal error" (exit 3), not a one-line spec error.
# B. A choice param whose upper-cased name is one of the kernels' constexprs (block_m,
#    block_n, index_64, compute_fp64, needs_grad_<input>, sum_grad_<input>): duplicate
#    kernel argument, exit 3.
# C. A choice param named after another choice param's helper (act_grad, act_torch,
#    act_eager next to act): its helper `_act_grad` replaces act's derivative helper of
#    the same name; the build succeeds and the op fails at run time or, worse, computes
#    silently wrong gradients (see test_choice_helper_collision_gives_wrong_gradients).
#    (Choice params named after the module's own functions, forward, backward, ... and
#    Autograd, collided the same way until spec.py refused names whose `_<name>` the
#    module defines; builtins such as super and type, until it refused builtins.)
_KNOWN: dict = {}  # bugs A (helper argument names), B (constexpr names) and C (helper names) are fixed


_REASONS = {
    "A": "KNOWN BUG A: a choice param named like the helpers' argument gives a duplicate argument (exit 3)",
    "B": "KNOWN BUG B: a choice param whose upper-cased name is a kernel constexpr gives a duplicate argument (exit 3)",
    "C": "KNOWN BUG C: a choice param's helper _<name> replaces another choice param's helper (accepted, broken)",
}


NAME_POSITIONS = {"op", "input", "scalar_param", "choice_param", "choice_param_2", "output"}


def _classes_for(position: str) -> dict[str, list[str]]:
    """The name classes that go into `position`, each with its names that can."""
    classes = dict(CORE_CLASSES)
    if position in NAME_POSITIONS:
        classes.update(NAMES_CLASSES)
    classes.update(HELPERS_CLASSES if position.startswith("choice_param") else HELPERS_ELSEWHERE)
    if position == "file":  # not a file name
        classes = {c: [n for n in names if not ("/" in n or "\x00" in n or n in ("", ".", ".."))]
                   for c, names in classes.items()}
    return {c: names for c, names in classes.items() if names}


def _names_for(position: str) -> list[str]:
    return [n for names in _classes_for(position).values() for n in names]


def _full_product() -> list[tuple[str, str]]:
    return [(position, name) for position in POSITIONS for name in _names_for(position)]


def _pairwise_sample() -> list[tuple[str, str]]:
    """A fixed covering sample of the full product (no randomness): every (class, position)
    pair where the class goes into the position, every name in at least one position it goes
    into, and so every position and every name. Per class, the positions take the class's
    names in turn, the ones not yet covered first; rounds over the positions repeat until
    every name of the class is covered. The known bugs are always in."""
    chosen = set(_KNOWN)
    classes = {c: None for p in POSITIONS for c in _classes_for(p)}  # in first-seen order
    for klass in classes:
        positions = [p for p in POSITIONS if klass in _classes_for(p)]
        uncovered = [n for p in positions for n in _classes_for(p)[klass]]
        uncovered = list(dict.fromkeys(uncovered))
        first_round = True
        while first_round or uncovered:
            for i, position in enumerate(positions):
                names = _classes_for(position)[klass]
                fresh = [n for n in uncovered if n in names]
                if fresh:
                    name = fresh[0]
                    uncovered.remove(name)
                elif first_round:
                    name = names[i % len(names)]
                else:
                    continue
                chosen.add((position, name))
            first_round = False
    return [case for case in _full_product() if case in chosen]  # in the full product's order


# FUSEGEN_FULL_INJECTION=1 runs every name in every position (the full product, about 1,100
# cases, minutes on CPU); by default the pairwise sample above runs.
FULL_INJECTION = os.environ.get("FUSEGEN_FULL_INJECTION", "") not in ("", "0")


def _cases():
    cases = []
    for position, name in _full_product() if FULL_INJECTION else _pairwise_sample():
        marks = []
        if (position, name) in _KNOWN:
            marks.append(pytest.mark.xfail(strict=True, reason=_REASONS[_KNOWN[(position, name)]]))
        cases.append(pytest.param(position, name, marks=marks, id=f"{position}-{ascii(name)[1:-1] or 'empty'}"))
    return cases


def test_the_sample_covers_every_name_position_and_class():
    """The sample's promise, checked: it is a subset of the full product holding every name,
    every position and every (class, position) pair the full product has."""
    full, sample = _full_product(), _pairwise_sample()
    assert set(sample) <= set(full) and len(set(sample)) == len(sample)
    assert {n for _, n in sample} == {n for _, n in full}
    assert {p for p, _ in sample} == set(POSITIONS)
    pairs = {(c, p) for p in POSITIONS for c in _classes_for(p)}
    assert {(c, p) for p, n in sample for c, names in _classes_for(p).items() if n in names} == pairs


def test_the_name_classes_match_the_code():
    """The classes say what they are by the sets the code collides with."""
    every = [*CORE, *NAMES, *HELPERS]
    assert len(set(every)) == len(every)
    assert set(NAMES_CLASSES["reserved"]) <= RESERVED_NAMES - PYTHON_BUILTINS - MODULE_IMPORTS
    assert set(NAMES_CLASSES["signature"]) <= SIGNATURE_NAMES | {"self"}
    assert set(CORE_CLASSES["import"]) <= MODULE_IMPORTS
    assert set(CORE_CLASSES["forbidden_builtin"]) <= PYTHON_BUILTINS & FORBIDDEN_NAMES
    assert set(NAMES_CLASSES["builtin"]) <= PYTHON_BUILTINS
    # "type" is a soft keyword from Python 3.12
    assert all(keyword.iskeyword(n) or keyword.issoftkeyword(n) or n == "type" for n in CORE_CLASSES["keyword"])
    assert all(n.startswith("__") and n.endswith("__") for n in CORE_CLASSES["dunder"])
    assert {n.upper() for n in NAMES_CLASSES["constexpr_lower"]} <= RESERVED_NAMES
    for klass in ("quoting", "code", "odd"):
        assert not any(n.isidentifier() and n.isascii() for n in CORE_CLASSES[klass]), klass
    for klass in ("kernel_local", "derived", "language", "module_class"):
        assert not set(NAMES_CLASSES[klass]) & (RESERVED_NAMES | PYTHON_BUILTINS), klass


# ---------------------------------------------------------------------------
# Building


def _write(folder: Path, spec: dict, file_name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{file_name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True, width=10**6), encoding="utf-8")
    return path


@functools.lru_cache(maxsize=None)
def _neutral_text(position: str, root: str) -> str:
    spec, file_name = _spec(position, NEUTRAL)
    return cli.build_op(_write(Path(root) / f"neutral_{position}" / "specs", spec, file_name)).text


def _substitute(text: str, name: str) -> str:
    # The op's module class is named after it: Qzneutral for the neutral op.
    text = text.replace(module_class_name(NEUTRAL), module_class_name(name))
    return text.replace(NEUTRAL, name).replace(NEUTRAL.upper(), name.upper())


_NAME_FIELDS = {ast.Name: ("id",), ast.arg: ("arg",), ast.FunctionDef: ("name",), ast.ClassDef: ("name",),
                ast.Attribute: ("attr",), ast.keyword: ("arg",), ast.alias: ("name", "asname"),
                ast.Global: ("names",), ast.Nonlocal: ("names",)}


def _rename(tree: ast.AST, name: str) -> ast.AST:
    """NEUTRAL → name in every identifier and string constant of a tree, in place."""
    for node in ast.walk(tree):
        for field in _NAME_FIELDS.get(type(node), ()):
            value = getattr(node, field)
            if isinstance(value, str):
                setattr(node, field, _substitute(value, name))
            elif isinstance(value, list):
                setattr(node, field, [_substitute(v, name) for v in value])
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = _substitute(node.value, name)
    return tree


# ---------------------------------------------------------------------------
# The checks on an accepted module

HEADER_IMPORTS = {
    "import torch",
    "import torch.nn.functional as F",
    "import triton",
    "import triton.language as tl",
    "from triton.language.extra import libdevice",
    "from fusegen import runtime",
    "from fusegen.backends.triton import launch, tuning",
}
KERNEL_LIB = "from fusegen.backends.triton.kernel_lib import "
KERNEL_LIB_NAMES = {
    "add_gradient_partials", "column_tile", "dropout_mask", "dropout_or_ones", "indices", "load_per_row", "load_tile", "maximum",
    "minimum", "row_max", "row_min", "row_sum", "rsqrt_rn", "sqrt_rn", "store_column_sums", "store_gradient", "store_tile",
}
LIBRARIES = {"tl", "torch", "triton", "runtime", "libdevice", "F", "launch", "tuning"}
BUILTIN_CALLEES = {
    "zip", "range", "len", "any", "all", "int", "float", "bool", "iter", "next", "tuple", "list", "dict", "isinstance",
    "staticmethod", "type", "min", "max", "sum", "abs", "enumerate", "str", "repr", "RuntimeError", "ValueError", "TypeError",
    "super",
}
FORBIDDEN_NAMES = {"eval", "exec", "compile", "__import__", "open", "getattr", "setattr", "delattr", "globals",
                   "locals", "vars", "breakpoint", "input", "importlib", "os", "sys", "subprocess", "builtins"}


def _module_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _locals_of(function: ast.FunctionDef) -> set[str]:
    names = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
    names |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def check_calls(tree: ast.Module) -> None:
    """Every call's callee is allowlisted: nothing a spec could smuggle in gets called."""
    module = _module_names(tree)

    def check(func: ast.expr, scope: set[str], where: str) -> None:
        if isinstance(func, ast.Name):
            assert func.id in module | BUILTIN_CALLEES or func.id in scope and func.id not in FORBIDDEN_NAMES, (
                f"{where}: call of {func.id!r}"
            )
            return
        if isinstance(func, ast.Subscript):  # kernel[grid](...)
            assert isinstance(func.value, ast.Name) and func.value.id in module, f"{where}: call of {ast.unparse(func)}"
            return
        assert isinstance(func, ast.Attribute), f"{where}: call of {ast.unparse(func)}"
        if ast.unparse(func) == "super().__init__" and where == "__init__":
            return  # the module class's constructor: the one dunder call
        assert not func.attr.startswith("__"), f"{where}: call of a dunder: {ast.unparse(func)}"
        root = func.value
        while isinstance(root, ast.Attribute):
            assert not root.attr.startswith("__"), f"{where}: dunder in {ast.unparse(func)}"
            root = root.value
        if isinstance(root, ast.Name) and (root.id in LIBRARIES or root.id in module):
            return
        if isinstance(root, ast.Name) and root.id in scope:
            # A method of the function's own local (a tensor, ctx): not a private one.
            assert not func.attr.startswith("_") and func.value is root, f"{where}: call of {ast.unparse(func)}"
            return
        if isinstance(root, ast.Call):  # torch.tensor(...).to(...), x.to(...).chunk(...)
            assert not func.attr.startswith("_"), f"{where}: call of {ast.unparse(func)}"
            return  # the inner call is checked on its own
        raise AssertionError(f"{where}: call of {ast.unparse(func)}")

    def visit(node: ast.AST, scope: set[str], where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner, inner_where = scope, where
            if isinstance(child, ast.FunctionDef):
                inner, inner_where = scope | _locals_of(child), child.name
            if isinstance(child, ast.Call):
                check(child.func, inner, inner_where)
            if isinstance(child, ast.Name) and child.id in FORBIDDEN_NAMES:
                # Only the module's own definitions and a function's own locals may bear such a name.
                assert child.id in module or child.id in inner, f"{inner_where}: reads the builtin {child.id!r}"
            visit(child, inner, inner_where)

    visit(tree, set(), "<module>")


def check_imports(tree: ast.Module) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            assert node in tree.body, f"import inside a function: {ast.unparse(node)}"
            line = ast.unparse(node)
            if line.startswith(KERNEL_LIB):
                assert set(line[len(KERNEL_LIB):].split(", ")) <= KERNEL_LIB_NAMES, f"unexpected import: {line}"
            else:
                assert line in HEADER_IMPORTS, f"unexpected import: {line}"
        if isinstance(node, ast.Attribute):
            assert node.attr not in {"__globals__", "__subclasses__", "__builtins__", "__code__", "__dict__"}, ast.unparse(node)


# Since Python 3.12 an f-string is several tokens: its quotes (FSTRING_START, FSTRING_END)
# and its text (FSTRING_MIDDLE) are data, like a STRING token's; its {fields} are code.
_DATA_TOKENS = {tokenize.STRING, tokenize.COMMENT} | {
    getattr(tokenize, name) for name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, name)
}


def check_text_is_data(text: str, hostile: str) -> None:
    """Each occurrence of `hostile` in the module lies inside a string literal or a comment."""
    if not hostile.strip() or re.fullmatch(r"\w+", hostile):
        return  # a plain word also occurs in code by chance ('x', 'op'); the AST checks cover it
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    spans = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in _DATA_TOKENS:
            spans.append((offsets[tok.start[0] - 1] + tok.start[1], offsets[tok.end[0] - 1] + tok.end[1]))
    for match in re.finditer(re.escape(hostile), text):
        assert any(a <= match.start() and match.end() <= b for a, b in spans), (
            f"{hostile!r} appears as code at offset {match.start()}: {text[max(0, match.start() - 60):match.end() + 60]!r}"
        )


def _symbol_view(table: symtable.SymbolTable, module_names: set[str], rename) -> list:
    """Every scope (depth first), each with its symbols: how each is bound and what a global
    reference resolves to (the module's own object, or a builtin)."""
    view = []

    def visit(scope: symtable.SymbolTable) -> None:
        symbols = {}
        for s in scope.get_symbols():
            name = rename(s.get_name())
            assert name not in symbols, (
                f"two names of the neutral module become one, {name!r}, in scope {rename(scope.get_name())!r}"
            )
            resolves = None
            if s.is_referenced() and (s.is_global() or scope is table):
                resolves = "module" if name in module_names else "builtin" if hasattr(builtins, name) else "undefined"
            symbols[name] = (
                s.is_parameter(), s.is_global(), s.is_declared_global(), s.is_local(), s.is_free(), s.is_imported(),
                s.is_assigned(), s.is_referenced(), s.is_namespace(), resolves,
            )
        view.append((rename(scope.get_name()), scope.get_type(), symbols))
        for child in scope.get_children():
            visit(child)

    visit(table)
    return view


def _bound_at_module_level(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [(a.asname or a.name).split(".")[0] for a in node.names]
    return names


COMMUTATIVE_CALLS = {"tl.maximum", "tl.minimum", "torch.maximum", "torch.minimum"}


def _canonical(tree: ast.AST) -> ast.AST:
    """Operands of + and * (and of maximum/minimum) in a fixed order, in place: sympy orders
    the terms of an expression by their names, so a renamed input may print as `g * y` for
    `y * g`."""
    order = []

    def post(node):
        for child in ast.iter_child_nodes(node):
            post(child)
        order.append(node)

    post(tree)
    for node in order:  # children before parents: operands are canonical when their parent sorts them
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            operands, pending = [], [node.left, node.right]
            while pending:
                item = pending.pop()
                if isinstance(item, ast.BinOp) and type(item.op) is type(node.op):
                    pending += [item.left, item.right]
                else:
                    operands.append(item)
            operands.sort(key=ast.dump)
            left = operands[0]
            for operand in operands[1:-1]:
                left = ast.BinOp(left=left, op=type(node.op)(), right=operand)
            node.left, node.right = left, operands[-1]
        elif isinstance(node, ast.Call) and len(node.args) == 2 and not node.keywords:
            if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
                if f"{node.func.value.id}.{node.func.attr}" in COMMUTATIVE_CALLS:
                    node.args.sort(key=ast.dump)
    return tree


def _words_of_strings(tree: ast.AST) -> ast.AST:
    """String constants as their words, in place: docstrings wrap where the text falls."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = " ".join(node.value.split())
    return tree


def check_same_as_neutral(text: str, neutral: str, name: str) -> None:
    """`text` is `neutral` with NEUTRAL replaced by `name`: same tree, same bindings."""
    tree = _canonical(_words_of_strings(ast.parse(text)))
    expected = _canonical(_words_of_strings(_rename(ast.parse(neutral), name)))
    assert ast.dump(tree) == ast.dump(expected), "the module is not the neutral module with the name substituted"
    # Every name bound once at module level, as in the neutral module.
    bound = _bound_at_module_level(tree)
    twice = sorted({n for n in bound if bound.count(n) > 1})
    neutral_bound = [_substitute(n, name) for n in _bound_at_module_level(ast.parse(neutral))]
    assert sorted(bound) == sorted(neutral_bound) and not twice, f"bound more than once at module level: {twice}"
    got = _symbol_view(symtable.symtable(text, "op.py", "exec"), set(bound), lambda n: n)
    want = _symbol_view(
        symtable.symtable(neutral, "op.py", "exec"), set(neutral_bound), lambda n: _substitute(n, name)
    )
    assert got == want, _first_difference(got, want)


def _first_difference(got, want) -> str:
    for (scope, kind, symbols), (scope2, kind2, symbols2) in zip(got, want):
        if (scope, kind) != (scope2, kind2):
            return f"scopes differ: {scope} vs {scope2}"
        for key in sorted(set(symbols) | set(symbols2)):
            if symbols.get(key) != symbols2.get(key):
                return f"in {scope!r}, {key!r} is bound differently: {symbols.get(key)} vs {symbols2.get(key)}"
    return f"{len(got)} scopes vs {len(want)}"


def _globals_by_scope(text: str) -> list[tuple[str, list[str]]]:
    """Each scope (depth first) with the names it reads from the module or the builtins."""
    found = []

    def visit(scope: symtable.SymbolTable, top: bool) -> None:
        # A name `super` in a function (the op's input super) adds an implicit __class__.
        names = sorted(
            s.get_name() for s in scope.get_symbols()
            if s.is_referenced() and (top or s.is_global()) and s.get_name() != "__class__"
        )
        found.append((scope.get_name(), names))
        for child in scope.get_children():
            visit(child, False)

    visit(symtable.symtable(text, "op.py", "exec"), True)
    return found


def check_no_capture(text: str, neutral: str) -> None:
    """Renamed or not, the spec's name captures nothing: every scope reads the same module
    and builtin names as the neutral module's, the module's own names matched up by where
    they are bound (the namer may have renamed one: _act_grad_ beside _act_grad), and the
    module binds each name once."""
    bound = _bound_at_module_level(ast.parse(text))
    twice = sorted({n for n in bound if bound.count(n) > 1})
    neutral_bound = _bound_at_module_level(ast.parse(neutral))
    assert len(bound) == len(neutral_bound) and not twice, (bound, neutral_bound, twice)
    same = dict(zip(neutral_bound, bound))
    want = [(same.get(scope, scope), sorted(same.get(n, n) for n in names)) for scope, names in _globals_by_scope(neutral)]
    assert _globals_by_scope(text) == want


def check_public_names(text: str, position: str, name: str) -> None:
    """The op's and reference's signatures hold the spec's name as the user wrote it."""
    if position not in ("input", "scalar_param", "choice_param", "choice_param_2"):
        return
    tree = ast.parse(text)
    for function in tree.body:
        if isinstance(function, ast.FunctionDef) and function.name in ("op", "reference"):
            assert name in [a.arg for a in function.args.args], (function.name, name)


def _words(text: str) -> str:
    return " ".join(text.split())


def check_docstrings(text: str, doc: str) -> None:
    """The module's and the op's docstrings start with the doc, word for word (they may wrap it)."""
    tree = ast.parse(text)
    assert _words(ast.get_docstring(tree, clean=False)).startswith(_words(doc))
    public = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "op")
    assert _words(ast.get_docstring(public, clean=False)).startswith(_words(doc))


def check_accepted(position: str, name: str, built: cli.BuiltOp, neutral: str) -> None:
    text = built.text
    write.check_module(text, "op.py")
    tree = ast.parse(text)
    check_imports(tree)
    check_calls(tree)
    if position in DATA_POSITIONS:
        check_text_is_data(text, name)
    if position == "doc":
        check_docstrings(text, name.strip())
        init = write.render_package_init([built.spec])
        init_tree = ast.parse(init)
        assert f"- op: {name.strip()}" in ast.get_docstring(init_tree, clean=False).split("\n")
        assert [ast.literal_eval(n.value) for n in init_tree.body if isinstance(n, ast.Assign)] == [("op",)]
        check_text_is_data(init, name)
    if position == "doc":
        name = name.strip()
    if position in DATA_POSITIONS:
        check_same_as_neutral(text, neutral, name)
    elif position != "choice_value":  # accepted choices are function names: no neutral one to compare with
        check_no_capture(text, neutral)
        check_public_names(text, position, name)


# ---------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("injection"))


@pytest.mark.parametrize("position, name", _cases())
def test_hostile_name_is_rejected_or_harmless(root, tmp_path, position, name):
    spec, file_name = _spec(position, name)
    path = _write(tmp_path / "specs", spec, file_name)
    shown = f"specs/{file_name}.yaml"
    shown = shown if shown.isprintable() else ascii(shown)
    try:
        built = cli.build_op(path)
    except SpecError as exc:
        message = str(exc)
        assert len(message.splitlines()) == 1, message
        assert re.fullmatch(re.escape(shown) + r"(:[0-9]+)?: \S.*", message), message
        return
    check_accepted(position, name, built, "" if position == "choice_value" else _neutral_text(position, root))


def test_the_checks_catch_an_injection(root):
    """The checks themselves: a module with code smuggled in, or a name captured, fails them."""
    spec, file_name = _spec("doc", NEUTRAL)
    neutral = _neutral_text("doc", root)
    assert "_OP = runtime.FusedOp(" in neutral and "def _reference(problem, inp, act)" in neutral
    smuggled = neutral.replace("_OP = runtime.FusedOp(", '__import__("os").system("x")\n_OP = runtime.FusedOp(')
    with pytest.raises(AssertionError):
        check_calls(ast.parse(smuggled))
    with pytest.raises(AssertionError):
        check_imports(ast.parse(neutral.replace("import torch\n", "import torch\nimport os\n", 1)))
    with pytest.raises(AssertionError):
        check_text_is_data(neutral.replace("_OP = runtime.FusedOp(", "x = (1)\n_OP = runtime.FusedOp("), "x = (1)")
    # A name captured: `torch` read from a parameter instead of the import.
    captured = neutral.replace("def _reference(problem, inp, act)", "def _reference(problem, torch, act)")
    with pytest.raises(AssertionError):
        check_same_as_neutral(captured, neutral, NEUTRAL)
    with pytest.raises(AssertionError):
        check_no_capture(captured, neutral)


def test_unusual_but_legal_names_build_and_run(tmp_path, device):
    """Names at the edge of what the loader allows build, import and compute what reference does."""
    name = "legal_names_op"
    text = (
        f"name: {name}\n"
        "doc: \"y = 'legal' \\\"names\\\" {braces} %s $x <b> -- ok\"\n"
        "inputs:\n"
        "  x_1: [..., N_]\n"
        "  Bias2: [N_]\n"
        "  match: [..., 1]\n"
        "params:\n"
        "  case: {type: float, default: 0.5}\n"
        "  Act_2: {choices: [relu, gelu_tanh], default: gelu_tanh}\n"
        "let:\n"
        "  l: Act_2(x_1 + Bias2) * case\n"
        "outputs:\n"
        "  O: l + match\n"
        "  yy: l * 2\n"
    )
    path = tmp_path / "specs" / f"{name}.yaml"
    path.parent.mkdir()
    path.write_text(text, encoding="utf-8")
    built = cli.build_op(path)
    tree = ast.parse(built.text)
    check_imports(tree)
    check_calls(tree)
    check_docstrings(built.text.replace(f"def {name}(", "def op("), load_spec(path).doc)
    module_path = tmp_path / f"{name}.py"
    module_path.write_text(built.text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.__doc__.split("\n")[0] == "y = 'legal' \"names\" {braces} %s $x <b> -- ok"
    g = torch.Generator().manual_seed(0)
    args = tuple(t.to(device) for t in (torch.randn(3, 8, generator=g), torch.randn(8, generator=g), torch.randn(3, 1, generator=g)))
    for choice in ("relu", "gelu_tanh"):
        got = getattr(module, name)(*args, case=0.25, Act_2=choice)
        want = module.reference(*args, case=0.25, Act_2=choice)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_)


def test_hostile_file_and_dim_names_through_the_cli(tmp_path, capsys):
    """The real CLI: a spec file and dims with quotes and code in their names build, and the
    generated module parses to the neutral one."""
    specs = tmp_path / "specs"
    name = "x'\"; __import__('os').system('touch pwned') #"
    spec, _ = _spec("dim", "__import__")
    spec["doc"] = "'''\"\"  __import__('os').system('touch pwned')"
    _write(specs, spec, name)
    out = tmp_path / "out"
    assert cli.main(["build", str(specs), "-o", str(out)]) == 0, capsys.readouterr().err
    text = (out / "op.py").read_text(encoding="utf-8")
    check_text_is_data(text, name)
    check_text_is_data(text, spec["doc"])
    tree = ast.parse(text)
    check_imports(tree)
    check_calls(tree)
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------------------
# KNOWN BUG C, end to end: the build succeeds and the gradient is silently wrong.


def test_choice_helper_collision_gives_wrong_gradients(tmp_path, device):
    """Was KNOWN BUG C (a_grad's helper replaced a's derivative); helpers now join with '__'."""
    name = "injection_helper_collision"
    text = (
        f"name: {name}\ndoc: d\ninputs:\n  x: [..., N]\n"
        "params:\n  a: {choices: [sigmoid, silu], default: sigmoid}\n"
        "  a_grad: {choices: [sigmoid, silu], default: silu}\n"
        "outputs:\n  y: a(x) + a_grad(x)\n"
    )
    path = tmp_path / "specs" / f"{name}.yaml"
    path.parent.mkdir()
    path.write_text(text, encoding="utf-8")
    try:
        built = cli.build_op(path)
    except SpecError:
        return  # refusing the names is a fine fix
    module_path = tmp_path / f"{name}.py"
    module_path.write_text(built.text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_(True)
    (got,) = torch.autograd.grad(getattr(module, name)(x).sum(), x)
    (want,) = torch.autograd.grad(module.reference(x).sum(), x)
    torch.testing.assert_close(got, want)
