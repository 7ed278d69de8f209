"""YAML spec → validated, frozen dataclasses.

Each mapping's keys are checked first (unknown keys, then missing ones), then each value's
type, so that every mistake is reported once, as `file:line: message`. Expressions stay text here; `ir`
parses them.
"""
from __future__ import annotations

import ast
import hashlib
import keyword
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import SpecError
from .functions import BUILTIN_NAMES, BUILTINS, FUNCTIONS, LITERALS, REDUCTIONS
from .layout import INTEGER_DTYPES, OUTPUT_DTYPES, QUANTIZED_DTYPES, Input

ELLIPSIS = "..."
# "2N" as an input's last dim: two chunks of N side by side (swiglu's [..., 2N] input).
CHUNKED_DIM = re.compile(r"([2-9]|[1-9][0-9])([A-Za-z_][A-Za-z0-9_]*)")  # 2 to 99 chunks
MAX_PARTS = 99  # a concatenated output's parts, as a chunked input's chunks


# Names the op's public signature uses: out= and inplace_backward= on every op, training and
# seed on ops with dropout (refused for all, so that adding a dropout never renames an argument).
SIGNATURE_NAMES = frozenset({"out", "inplace_backward", "training", "seed"})
# Names a generated module defines beside the op itself, whatever its backend.
MODULE_NAMES = frozenset({"reference", "eager"})

# torch.nn.Module's public attributes (torch 2.13; tests/test_module_class.py compares them
# with the installed torch's): the op's module class keeps each param as an attribute of
# its name, which must not replace one of these.
NN_MODULE_ATTRIBUTES = frozenset(
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

MAX_EXPRESSION_CHARS = 2000
# Numbers a spec may write (param bounds and defaults, expression constants): floats far
# inside float32's range, integers exact in a float64.
MAX_FLOAT_MAGNITUDE = 1e30
MAX_INT_MAGNITUDE = 2**53


@dataclass(frozen=True)
class InputSpec:
    name: str
    dims: tuple[str, ...]  # one chunk's dims: "...", a dim name, or "1"
    line: int
    chunks: int = 1  # the last dim written kN: the input holds k chunks of N along it
    dtype: str = "float"  # or one of layout.INTEGER_DTYPES: `x: {dims: [...], dtype: int64}`
    chunk_dim: int = -1  # or 0: a two-dim input's first dim written kN (a matmul's [2N, K] weight)

    @property
    def layout(self) -> Input:
        """The input as the runtime checks it (fusegen.layout)."""
        return Input(self.name, self.dims, self.chunks, self.dtype, self.chunk_dim)

    @property
    def has_ellipsis(self) -> bool:
        return bool(self.dims) and self.dims[0] == ELLIPSIS

    @property
    def shape_text(self) -> str:
        """As the spec writes it: [..., 2N]."""
        return self.layout.declared


@dataclass(frozen=True)
class ScalarParam:
    """A runtime scalar: passed to the kernel as an argument on every call."""

    name: str
    type: str  # "float" or "int"
    default: float | int
    min: float | int | None
    max: float | int | None
    line: int
    # min or max given as gt: or lt:, an exclusive bound (a divisor's `gt: 0.0`).
    min_open: bool = False
    max_open: bool = False


@dataclass(frozen=True)
class ChoiceParam:
    """A compile-time choice between functions of the same arity (a tl.constexpr)."""

    name: str
    choices: tuple[str, ...]
    default: str
    line: int


@dataclass(frozen=True)
class Binding:
    """`name: expression`, from `let` (an intermediate) or `outputs`."""

    name: str
    text: str
    line: int
    # Outputs only, from the long form `q: {expr: ..., dtype: float8_e4m3fn, differentiable: false}`:
    # its dtype (None: the float inputs'), and whether it has a gradient (never a quantized one).
    dtype: str | None = None
    differentiable: bool = True
    # An output concatenated along its last dim (`y: [a, b]`, [..., 2N]): each part's
    # expression and line, in order; `text` then shows them as the spec writes the list.
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def part_bindings(self) -> tuple["Binding", ...]:
        """Each part as a binding of the output's name (one: the binding itself)."""
        return tuple(Binding(self.name, text, line, dtype=self.dtype, differentiable=self.differentiable)
                     for text, line in self.parts) or (self,)


@dataclass(frozen=True)
class OpSpec:
    name: str
    doc: str
    inputs: tuple[InputSpec, ...]
    params: tuple[ScalarParam | ChoiceParam, ...]
    lets: tuple[Binding, ...]
    outputs: tuple[Binding, ...]
    path: str  # as shown in messages and headers: "<dir>/<file>"
    sha256: str
    out_dims: tuple[str, ...]
    name_line: int = 1  # where `name:` is written
    backend: str | None = None  # `backend:`, the kernels' language where the spec names one (fusegen.backends)
    backend_line: int = 1

    @property
    def scalar_params(self) -> tuple[ScalarParam, ...]:
        return tuple(p for p in self.params if isinstance(p, ScalarParam))

    @property
    def choice_params(self) -> tuple[ChoiceParam, ...]:
        return tuple(p for p in self.params if isinstance(p, ChoiceParam))


# ---------------------------------------------------------------------------
# A YAML loader that remembers where each key and value came from.


class _Located(Exception):
    """An error with a line but not yet a file; `load_spec` adds the file."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


class _LineDict(dict):
    line: int = 0

    def __init__(self):
        super().__init__()
        self.key_lines: dict[str, int] = {}
        self.value_lines: dict[str, int] = {}
        # Each scalar value as written, for names and expressions: YAML 1.1 would read
        # `on` as True and `1e5` as a string, `1.50` as 1.5.
        self.texts: dict[str, str] = {}


class _LineList(list):
    line: int = 0
    item_lines: list[int]
    item_texts: list[str | None]  # as written, None where an item is not a scalar


# Deeper than any spec needs (spec → params → p → choices is 4), and far below Python's
# recursion limit, which PyYAML's recursive composer would otherwise hit.
MAX_YAML_DEPTH = 16

_YAML_TAG_PREFIX = "tag:yaml.org,2002:"


def _shown_tag(tag: str) -> str:
    return "!!" + tag[len(_YAML_TAG_PREFIX):] if tag.startswith(_YAML_TAG_PREFIX) else tag


class _LineLoader(yaml.SafeLoader):
    """SafeLoader for plain YAML only: strings, numbers, booleans, lists and mappings.

    Mappings and lists carry their source lines; duplicate keys are errors. Anchors,
    aliases and explicit tags are refused: a spec never needs them, and refusing them
    rules out shared (aliased) objects, `<<` merges and constructors that raise plain
    Python exceptions (`!!int abc`).
    """

    _depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise _Located(line, f"YAML alias '*{event.anchor}' is not supported in a spec: write the value out")
        if event.anchor is not None:
            raise _Located(line, f"YAML anchor '&{event.anchor}' is not supported in a spec")
        if getattr(event, "tag", None) is not None:
            tag = _shown_tag(event.tag)
            raise _Located(line, f"YAML tag '{tag}' is not supported in a spec (quote a value to make it a string)")
        if self._depth >= MAX_YAML_DEPTH:
            raise _Located(line, f"YAML is nested more than {MAX_YAML_DEPTH} levels deep")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> _LineDict:
    mapping = _LineDict()
    mapping.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode):
            raise _Located(line, "mapping keys must be plain names, not lists or mappings")
        if key_node.tag == _YAML_TAG_PREFIX + "merge":
            raise _Located(line, "YAML merge keys '<<' are not supported in a spec")
        # Every key in a spec is a name: take it as written, so that `on:` or `null:` stay
        # names instead of becoming True or None, as YAML 1.1 would have them.
        key = key_node.value
        if key in mapping:
            raise _Located(line, f"duplicate key '{key}' (first at line {mapping.key_lines[key]})")
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = line
        mapping.value_lines[key] = value_node.start_mark.line + 1
        if isinstance(value_node, yaml.ScalarNode):
            mapping.texts[key] = value_node.value
    return mapping


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> _LineList:
    items = _LineList(loader.construct_object(child, deep=True) for child in node.value)
    items.line = node.start_mark.line + 1
    items.item_lines = [child.start_mark.line + 1 for child in node.value]
    items.item_texts = [child.value if isinstance(child, yaml.ScalarNode) else None for child in node.value]
    return items


def _construct_as_string(loader: _LineLoader, node: yaml.ScalarNode) -> str:
    return loader.construct_scalar(node)


def _construct_int(loader: _LineLoader, node: yaml.ScalarNode) -> int:
    # Python refuses to convert ints of over 4300 digits from or to text, with a ValueError
    # that PyYAML lets through; no spec needs a number anywhere near that.
    try:
        value = loader.construct_yaml_int(node)
    except ValueError:
        value = None
    if value is None or value.bit_length() > 256:
        raise _Located(node.start_mark.line + 1, f"integer {_describe(node.value)} is too large")
    return value


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)
_LineLoader.add_constructor(_YAML_TAG_PREFIX + "int", _construct_int)
# Plain scalars that YAML 1.1 resolves to dates, `=` or `<<` stay the strings they look like.
for _tag in ("timestamp", "value", "merge"):
    _LineLoader.add_constructor(_YAML_TAG_PREFIX + _tag, _construct_as_string)
# YAML 1.1 reads `1e-5` and `1.0e5` as strings (its floats need a dot and a signed
# exponent); a spec author means numbers, as YAML 1.2 and Python have them.
_LineLoader.add_implicit_resolver(
    _YAML_TAG_PREFIX + "float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)

# Numbers only YAML 1.1 reads so (a YAML 1.2 reader reads `1:30` as a string and `010` as
# 10): a spec author writing them most likely means neither 90 nor 8, so they are refused.
_BASE_60 = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")
_OCTAL = re.compile(r"[-+]?0[0-7_]+")


def _check_yaml_1_2_number(text: str, value: float | int, what: str, line: int) -> None:
    if _BASE_60.fullmatch(text):
        raise _Located(line, f"{what} {text} would be read as {value} (YAML 1.1 base 60): write the number plainly")
    if _OCTAL.fullmatch(text) and value != int(text.replace("_", "")):  # not 00
        raise _Located(line, f"{what} {text} would be read as {value} (YAML 1.1 octal): write it without a leading 0")


# ---------------------------------------------------------------------------
# Field helpers in torchgen's style: reject unknown keys, require the required ones.


_TYPE_NAMES = {str: "a string", dict: "a mapping", list: "a list", float: "a number", int: "an integer"}


def _expect(value: Any, expected: type, what: str, line: int) -> Any:
    ok = isinstance(value, expected) and not (expected in (int, float) and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise _Located(line, f"{what} must be {_TYPE_NAMES[expected]}, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"boolean {value}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_keys(mapping: _LineDict, known: list[str], required: list[str], where: str, line: int) -> None:
    """Unknown keys first: `output:` is a typo for `outputs:`, better named than missing."""
    for key in mapping:
        if key not in known:
            raise _Located(mapping.key_lines[key], f"unknown key '{key}' in {where} (known: {', '.join(known)})")
    for key in required:
        if key not in mapping:
            raise _Located(line, f"missing required key '{key}' in {where}")


def _as_written(mapping: _LineDict, key: str) -> Any:
    """A value: a scalar as the text written, anything else as YAML built it."""
    return mapping.texts.get(key, mapping.get(key))


def check_op_name(name: str, shown: str) -> None:
    """The rules a spec's `name:` must follow, for names that come from elsewhere (fusegen new)."""
    try:
        _check_identifier(name, 0, "op")
    except _Located as exc:
        raise SpecError(shown, None, exc.message) from None


def _check_identifier(name: Any, line: int, what: str) -> str:
    if not isinstance(name, str):
        raise _Located(line, f"{what} name must be a string, got {_describe(name)}")
    if not name:
        raise _Located(line, f"{what} name is empty")
    if not name.isidentifier():
        raise _Located(line, f"{what} name '{name}' is not a Python identifier")
    if not name.isascii():
        raise _Located(line, f"{what} name '{name}' must be ASCII")
    # Soft keywords (match, case, type) are valid names, and differ between Python versions.
    if keyword.iskeyword(name):
        raise _Located(line, f"{what} name '{name}' is a Python keyword")
    if name.startswith("_"):
        raise _Located(line, f"{what} name '{name}' must not start with '_' (reserved for generated code)")
    # An op may share a function's name (op `gelu`): its module never calls that function.
    if what != "op" and (name in FUNCTIONS or name in BUILTINS or name in REDUCTIONS):
        raise _Located(line, f"{what} name '{name}' is the name of the function '{name}' of the expression language")
    if what != "op" and name in LITERALS:
        raise _Located(line, f"{what} name '{name}' is a literal of the expression language")
    if what != "op" and name in BUILTIN_NAMES:
        raise _Located(line, f"{what} name '{name}' is a built-in name of the expression language")
    if what == "op" and name in MODULE_NAMES:
        raise _Located(line, f"op name '{name}' is the name of the generated module's function {name}()")
    if what in ("input", "param") and name in SIGNATURE_NAMES:
        raise _Located(line, f"{what} name '{name}' is an argument of the generated op ({_SIGNATURE_USE[name]})")
    if what in ("input", "param") and name == "self":
        raise _Located(line, f"{what} name 'self' is the first argument of the op's torch.nn.Module methods")
    if what == "param" and name in NN_MODULE_ATTRIBUTES:
        raise _Located(
            line,
            f"param name '{name}' is an attribute of torch.nn.Module: the op's module class keeps each param "
            "as an attribute of its name",
        )
    return name


_SIGNATURE_USE = {
    "out": "out=", "inplace_backward": "inplace_backward=", "training": "dropout's training=", "seed": "dropout's seed="
}


class _Names:
    """Every name a spec declares (inputs, params, intermediates, outputs) is unique."""

    def __init__(self):
        self._seen: dict[str, tuple[str, int]] = {}  # name → (what it names, line)

    def claim(self, name: str, what: str, line: int) -> None:
        if name in self._seen:
            other, other_line = self._seen[name]
            raise _Located(line, f"duplicate name '{name}' (already {other} at line {other_line})")
        self._seen[name] = (what, line)


# ---------------------------------------------------------------------------


def load_spec(path: str | Path) -> OpSpec:
    """Read and validate one spec file; raise SpecError naming file and line."""
    path = Path(path)
    shown = f"{path.parent.name}/{path.name}" if path.parent.name else path.name
    if not shown.isprintable():
        # The path is written into the generated module's header comment.
        raise SpecError(ascii(shown), None, "spec path must be printable")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError(shown, None, f"cannot read spec: {exc.strerror}") from None
    try:
        return _parse(data, shown)
    except _Located as exc:
        raise SpecError(shown, exc.line, exc.message) from None


def find_spec(spec_or_name: str, specs_dir: Path) -> Path:
    """A spec path as given, or the spec in `specs_dir` whose op is named `spec_or_name`."""
    given = Path(spec_or_name)
    if given.suffix in (".yaml", ".yml") or given.is_file():
        if not given.is_file():
            raise SpecError(str(given), None, "no such spec file")
        return given
    for suffix in (".yaml", ".yml"):
        candidate = specs_dir / f"{spec_or_name}{suffix}"
        if candidate.is_file():
            return candidate
    # A file may be named differently from its op: look inside the others.
    if specs_dir.is_dir():
        for candidate in sorted(specs_dir.iterdir()):
            if candidate.suffix not in (".yaml", ".yml"):
                continue
            try:
                if load_spec(candidate).name == spec_or_name:
                    return candidate
            except SpecError:
                continue
    raise SpecError(str(specs_dir), None, f"no spec for op '{spec_or_name}' (give a spec path, or --specs DIR)")


def _load_yaml(data: bytes) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise _Located(line, f"spec is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        return yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise _Located(line, f"YAML cannot hold the character {chr(exc.character)!r}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        # PyYAML splits some messages in two: "expected a single document in the stream",
        # "but found another document".
        if exc.context and problem.startswith("but "):
            problem = f"{exc.context}, {problem}"
        line = mark.line + 1 if mark else 1
        raise _Located(line, "YAML syntax error: " + " ".join(problem.split())) from None
    except yaml.YAMLError as exc:
        raise _Located(1, "YAML error: " + " ".join(str(exc).split())) from None


def _parse(data: bytes, shown: str) -> OpSpec:
    doc = _load_yaml(data)
    if not isinstance(doc, _LineDict):
        raise _Located(1, f"a spec must be a mapping with keys name, doc, inputs, outputs; got {_describe(doc)}")

    known = ["name", "doc", "inputs", "params", "let", "outputs", "backend"]
    _check_keys(doc, known, ["name", "doc", "inputs", "outputs"], "the spec", doc.line)
    lines = doc.value_lines
    name = _check_identifier(_as_written(doc, "name"), lines["name"], "op")
    doc_text = _parse_doc(_as_written(doc, "doc"), lines["doc"])
    names = _Names()
    inputs = _parse_inputs(doc["inputs"], lines["inputs"], names)
    params = _parse_params(doc.get("params"), lines.get("params", doc.line), names)
    lets = _parse_bindings(doc.get("let"), lines.get("let", doc.line), "let", "intermediate", names, required=False)
    outputs = _parse_bindings(doc["outputs"], lines["outputs"], "outputs", "output", names, required=True)
    out_dims = _output_dims(inputs, (*lets, *outputs))
    backend = _parse_backend(doc.get("backend"), lines.get("backend", doc.line)) if "backend" in doc else None
    for binding in outputs:
        if binding.parts and not out_dims:
            raise _Located(binding.line, f"output '{binding.name}': a concatenated output needs a last dim, and the inputs have none")
    return OpSpec(
        name=name,
        doc=doc_text,
        inputs=inputs,
        params=params,
        lets=lets,
        outputs=outputs,
        path=shown,
        sha256=hashlib.sha256(data).hexdigest(),
        out_dims=out_dims,
        name_line=lines["name"],
        backend=backend,
        backend_line=lines.get("backend", 1),
    )


def _parse_backend(raw: Any, line: int) -> str:
    from fusegen.backends import BACKENDS

    value = _expect(raw, str, "'backend'", line)
    if value not in BACKENDS:
        raise _Located(line, f"'backend' must be one of {', '.join(BACKENDS)}; got {value!r}")
    return value


def _parse_doc(raw: Any, line: int) -> str:
    text = _expect(raw, str, "'doc'", line).strip()
    if not text or "\n" in text:
        raise _Located(line, "'doc' must be one non-empty line")
    if not text.isprintable():
        raise _Located(line, "'doc' must be printable text")
    # It is written into docstrings as is: a backslash would be an escape, '"""' would end them.
    if "\\" in text or '"""' in text:
        raise _Located(line, """'doc' must not contain a backslash or '\"\"\"'""")
    return text


def _parse_inputs(raw: Any, line: int, names: _Names) -> tuple[InputSpec, ...]:
    _expect(raw, dict, "'inputs'", line)
    if not raw:
        raise _Located(line, "'inputs' must name at least one input")
    inputs = []
    for name in raw:
        key_line = raw.key_lines[name]
        _check_identifier(name, key_line, "input")
        names.claim(name, "an input", key_line)
        value_line = raw.value_lines[name]
        dims, dtype = _as_written(raw, name), "float"
        if isinstance(dims, dict):  # the long form: {dims: [..., 1], dtype: int64}
            body = dims
            _check_keys(body, ["dims", "dtype"], ["dims"], f"input '{name}'", value_line)
            dims, value_line = body["dims"], body.value_lines["dims"]
            dtype = _as_written(body, "dtype") if "dtype" in body else "float"
            if dtype not in ("float", *INTEGER_DTYPES):
                known = ", ".join(("float", *INTEGER_DTYPES))
                raise _Located(body.value_lines["dtype"], f"input '{name}': unknown dtype {_describe(dtype)} (known: {known})")
        dims = _expect(dims, list, f"the shape of input '{name}'", value_line)
        checked, chunks, chunk_dim = [], 1, -1
        for i, (dim, text) in enumerate(zip(dims, dims.item_texts)):
            if text == ELLIPSIS:
                if i != 0:
                    raise _Located(value_line, f"input '{name}': '...' may only be the first dim")
                checked.append(ELLIPSIS)
            elif text == "1" or (text and text.isidentifier() and text.isascii() and not keyword.iskeyword(text)):
                checked.append(text)
            elif text and CHUNKED_DIM.fullmatch(text) and text.isascii():
                # The last dim; or the first of two (a matmul's weight [2N, K]: nn.Linear's
                # layout of two projections side by side, read by chunk(x @ T(weight), k)).
                if i == 0 and len(dims) == 2 and dims.item_texts[1] != ELLIPSIS:
                    chunk_dim = 0
                elif i != len(dims) - 1 or chunks > 1:
                    raise _Located(value_line, f"input '{name}': a chunked dim such as {text} may only be the last "
                                   "dim, or the first of two ([2N, K], a matmul's weight)")
                chunked = CHUNKED_DIM.fullmatch(text)
                chunks = int(chunked.group(1))
                checked.append(chunked.group(2))
            else:
                shown = _describe(dim) if text is None else repr(text)
                raise _Located(
                    value_line, f"input '{name}': dim {shown} must be '...', a dim name such as N, 1, or (last) 2N"
                )
        if chunks > 1 and dtype != "float":
            raise _Located(value_line, f"input '{name}': a {dtype} input cannot hold chunks ({dims.item_texts[chunk_dim]}); "
                           "declare one input per chunk")
        inputs.append(InputSpec(name, tuple(checked), key_line, chunks, dtype, chunk_dim))
    if all(i.dtype != "float" for i in inputs):
        # The outputs take the float inputs' dtype (and the kernels compute in it).
        raise _Located(line, "'inputs' must have at least one float input: the outputs take its dtype")
    return tuple(inputs)


def _parse_params(raw: Any, line: int, names: _Names) -> tuple[ScalarParam | ChoiceParam, ...]:
    if raw is None:
        return ()
    _expect(raw, dict, "'params'", line)
    params: list[ScalarParam | ChoiceParam] = []
    for name, body in raw.items():
        key_line = raw.key_lines[name]
        _check_identifier(name, key_line, "param")
        names.claim(name, "a param", key_line)
        _expect(body, dict, f"param '{name}'", raw.value_lines[name])
        if "choices" in body:
            params.append(_parse_choice_param(name, body, key_line))
        else:
            params.append(_parse_scalar_param(name, body, key_line))
    return tuple(params)


def _parse_choice_param(name: str, body: _LineDict, line: int) -> ChoiceParam:
    _check_keys(body, ["choices", "default"], ["choices", "default"], f"param '{name}'", line)
    lines = body.value_lines
    choices = _expect(body["choices"], list, f"param '{name}': 'choices'", lines["choices"])
    if not choices:
        raise _Located(lines["choices"], f"param '{name}': 'choices' must not be empty")
    for i, (choice, choice_line) in enumerate(zip(choices.item_texts, choices.item_lines)):
        if choice is None:
            raise _Located(choice_line, f"param '{name}': choices must be function names, got {_describe(choices[i])}")
        if choice not in FUNCTIONS:
            raise _Located(
                choice_line,
                f"param '{name}': unknown function '{choice}' in choices (known: {', '.join(sorted(FUNCTIONS))})",
            )
    if len(set(choices)) != len(choices):
        raise _Located(lines["choices"], f"param '{name}': duplicate entries in 'choices'")
    arities = {FUNCTIONS[c].arity for c in choices}
    if len(arities) != 1:
        raise _Located(lines["choices"], f"param '{name}': all choices must take the same number of arguments")
    choices = choices.item_texts
    default = _as_written(body, "default")
    if default not in choices:
        raise _Located(lines["default"], f"param '{name}': default {_describe(default)} is not one of its choices")
    return ChoiceParam(name, tuple(choices), default, line)


def _parse_scalar_param(name: str, body: _LineDict, line: int) -> ScalarParam:
    _check_keys(body, ["type", "default", "min", "max", "gt", "lt"], ["default"], f"param '{name}'", line)
    for inclusive, exclusive in (("min", "gt"), ("max", "lt")):
        if inclusive in body and exclusive in body:
            raise _Located(
                body.key_lines[exclusive], f"param '{name}': give '{inclusive}' (inclusive) or '{exclusive}' (exclusive), not both"
            )
    if "type" not in body:
        raise _Located(line, f"missing required key 'type' in param '{name}' (float or int; or 'choices' instead)")
    lines = body.value_lines
    type_name = _as_written(body, "type")
    if type_name not in ("float", "int"):
        raise _Located(lines["type"], f"param '{name}': type must be float or int, got {_describe(type_name)}")
    number = float if type_name == "float" else int
    limit, limit_text = (MAX_FLOAT_MAGNITUDE, "1e30") if type_name == "float" else (MAX_INT_MAGNITUDE, "2**53")
    values = {}
    for key in ("default", "min", "max", "gt", "lt"):
        if key not in body:
            values[key] = None
            continue
        value = _expect(body[key], number, f"param '{name}': '{key}'", lines[key])
        _check_yaml_1_2_number(body.texts[key], value, f"param '{name}': '{key}'", lines[key])
        if isinstance(value, float) and not math.isfinite(value):  # isfinite(10**400) would overflow
            raise _Located(lines[key], f"param '{name}': '{key}' must be a finite number, got {value}")
        if abs(value) > limit:
            message = f"'{key}' {_describe(value)} is out of range (at most {limit_text} in magnitude)"
            raise _Located(lines[key], f"param '{name}': {message}")
        values[key] = float(value) if type_name == "float" else value
    low_open, high_open = values["gt"] is not None, values["lt"] is not None
    low_key, high_key = "gt" if low_open else "min", "lt" if high_open else "max"
    low, high, default = values[low_key], values[high_key], values["default"]
    if low is not None and high is not None:
        if not (low_open or high_open) and low > high:
            raise _Located(lines["min"], f"param '{name}': min {low} is greater than max {high}")
        if (low_open or high_open) and low >= high:
            raise _Located(lines[low_key], f"param '{name}': {low_key} {low} is not less than {high_key} {high}")
    if low is not None and (default <= low if low_open else default < low):
        message = f"is not greater than gt {low}" if low_open else f"is less than min {low}"
        raise _Located(lines["default"], f"param '{name}': default {default} {message}")
    if high is not None and (default >= high if high_open else default > high):
        message = f"is not less than lt {high}" if high_open else f"is greater than max {high}"
        raise _Located(lines["default"], f"param '{name}': default {default} {message}")
    return ScalarParam(name, type_name, default, low, high, line, low_open, high_open)


def _parse_bindings(raw: Any, line: int, section: str, what: str, names: _Names, required: bool) -> tuple[Binding, ...]:
    if raw is None and not required:
        return ()
    _expect(raw, dict, f"'{section}'", line)
    if required and not raw:
        raise _Located(line, f"'{section}' must name at least one expression")
    bindings = []
    for name in raw:
        key_line = raw.key_lines[name]
        _check_identifier(name, key_line, what)
        names.claim(name, "an intermediate" if what == "intermediate" else "an output", key_line)
        value_line = raw.value_lines[name]
        text = _as_written(raw, name)
        if what == "output" and isinstance(text, list):
            bindings.append(_concatenated(name, text, value_line))
            continue
        if what == "output" and isinstance(text, dict):
            bindings.append(_long_output(name, text, value_line))
            continue
        bindings.append(Binding(name, _expression_text(name, text, what, value_line), value_line))
    return tuple(bindings)


def _concatenated(name: str, items: _LineList, line: int) -> Binding:
    """`y: [a, b]`: an output of parts side by side along its last dim, the mirror of a
    chunked input (`x: [..., 2N]`, read as chunk(x, 0), chunk(x, 1))."""
    if not 2 <= len(items) <= MAX_PARTS:
        raise _Located(line, f"output '{name}': a concatenated output has 2 to {MAX_PARTS} parts, got {len(items)}")
    parts = []
    for item, text, item_line in zip(items, items.item_texts, items.item_lines):
        if text is None:
            raise _Located(item_line, f"output '{name}': each part must be an expression (a string), got {_describe(item)}")
        parts.append((_expression_text(name, text, "output", item_line), item_line))
    return Binding(name, "[" + ", ".join(t for t, _ in parts) + "]", line, parts=tuple(parts))


def _long_output(name: str, body: _LineDict, line: int) -> Binding:
    """`q: {expr: "x / s", dtype: float8_e4m3fn}`: an output in a dtype of its own, converted
    as torch's `tensor.to(dtype)` converts; `differentiable: false` drops a float one's gradient."""
    _check_keys(body, ["expr", "dtype", "differentiable"], ["expr"], f"output '{name}'", line)
    lines = body.value_lines
    text = _expression_text(name, _as_written(body, "expr"), "output", lines["expr"])
    dtype = None
    if "dtype" in body:
        dtype = _as_written(body, "dtype")
        if dtype not in OUTPUT_DTYPES:
            raise _Located(lines["dtype"], f"output '{name}': unknown dtype {_describe(dtype)} "
                                           f"(known: {', '.join(OUTPUT_DTYPES)})")
    differentiable = dtype not in QUANTIZED_DTYPES
    if "differentiable" in body:
        given = body["differentiable"]
        if not isinstance(given, bool):
            raise _Located(lines["differentiable"], f"output '{name}': differentiable must be true or false, "
                                                    f"got {_describe(_as_written(body, 'differentiable'))}")
        if given and not differentiable:
            raise _Located(lines["differentiable"], f"output '{name}': a {dtype} output has no gradient; "
                                                    "drop 'differentiable: true'")
        differentiable = given
    return Binding(name, text, lines["expr"], dtype=dtype, differentiable=differentiable)


def _expression_text(name: str, text: Any, what: str, line: int) -> str:
    if not isinstance(text, str):
        raise _Located(line, f"{what} '{name}' must be an expression (a string), got {_describe(text)}")
    text = text.strip()
    if not text:
        raise _Located(line, f"{what} '{name}' has an empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise _Located(line, f"expression for '{name}' is longer than {MAX_EXPRESSION_CHARS} characters")
    # Python would read a full-width 'ｘ' as x (NFKC) and stop at a NUL: spell expressions in ASCII.
    odd = next((c for c in text if not (c.isascii() and (c.isprintable() or c in "\n\t"))), None)
    if odd is not None:
        raise _Located(line, f"expression for '{name}' contains the character {odd!r}: expressions are plain ASCII")
    # A '#' would silently comment out the rest of a (possibly multi-line) expression.
    if "#" in text:
        raise _Located(line, f"expression for '{name}' contains '#': comments are not allowed inside an expression")
    return text


def _output_dims(inputs: tuple[InputSpec, ...], bindings) -> tuple[str, ...]:
    """The output's dims: the inputs' broadcast, a matmul's product ([..., N]) standing for its
    operands. A matmul written other than `a @ b` or `a @ T(b)` of inputs is ir's to refuse, with
    its own message: the dims wait for it (none here)."""
    products = [matmul_operands(b.text) for b in bindings]
    if any(p is None for p in products):
        return ()
    by_name = {i.name: i for i in inputs}
    # A product of an intermediate (a hidden layer, `h @ T(w2)`): of the input its one product multiplies.
    layers = {b.name: found[0] for b, found in zip(bindings, products) if len(found) == 1}
    texts = {b.name: b.text for b in bindings}
    found = [m for p in products for m in p]
    consumed = {id(layers[n]) for a, _, _, inner, _ in found for n in ((a,) if a else inner) if n in layers}
    operands, shapes = set(), []
    for a, b, transposed, inner, text in (m for m in found if id(m) not in consumed):
        if not a:  # a hidden layer whose matmul is an intermediate's it reads: that intermediate's a
            a = next((n for n in inner if n in layers), "")
        if a in layers:  # its weight and what its function reads are the layer's
            read = (n.id for n in ast.walk(ast.parse(" ".join(texts[a].split()), mode="eval")) if isinstance(n, ast.Name))
            a, inner = layers[a][0], (*inner, layers[a][1], *read)
        left, right = by_name.get(a), by_name.get(b)
        if left is None or right is None or not left.dims or len(right.dims) != 2:
            return ()
        n = right.dims[0] if transposed else right.dims[1]
        operands |= {a, b, *inner}
        shapes.append(InputSpec(text, (*left.dims[:-1], n), left.line))
    return _broadcast_dims(tuple(i for i in inputs if i.name not in operands) + tuple(shapes))


def matmul_operands(text: str) -> list[tuple[str, str, bool, tuple[str, ...], str]] | None:
    """Each product of an expression, `a @ b` / `a @ T(b)`, as (a, b, transposed, (), its text); a
    low-rank `(a @ T(down)) @ T(up)` as (a, up, transposed, (down,), its text): [..., N] as
    a @ T(up) would be; a hidden layer's `f(a @ T(w1), ...) @ T(b)` as (a, b, transposed, (w1,
    and the names f reads), its text). None where some `@` has other operands (or the text does
    not parse: ir says why)."""
    if "@" not in text:
        return []
    try:
        tree = ast.parse(" ".join(text.split("\n")), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    found, inner = [], set()
    for node in ast.walk(tree):  # parents before children: an outer product before its inner one
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult) and id(node) not in inner:
            operands = _operands(node)
            if operands is None and not isinstance(node.left, (ast.Name, ast.BinOp)) or (
                    isinstance(node.left, ast.BinOp) and not isinstance(node.left.op, ast.MatMult)):
                layer = [n for n in ast.walk(node.left) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult)]
                one = len({ast.unparse(n) for n in layer}) == 1  # one matmul, read once or more
                right = _right(node)
                names = tuple(n.id for n in ast.walk(node.left) if isinstance(n, ast.Name))
                text = f"{ast.unparse(node.left)} @ {_operand_text(*right)}" if right else ""
                if right is not None and not layer:  # its matmul in an intermediate it reads: a is "" until resolved
                    found.append(("", *right, names, text))
                    continue
                first = _operands(layer[0]) if one else None
                if first is None or right is None:
                    return None
                inner.update(id(n) for n in layer)
                found.append((first[0], *right, (first[1], *names), text))
            elif operands is None:
                if not (isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.MatMult)):
                    return None
                first = _operands(node.left)
                right = _right(node)
                if first is None or right is None:
                    return None
                inner.add(id(node.left))
                found.append((first[0], *right, (first[1],), f"({_text(*first)}) @ {_operand_text(*right)}"))
            else:
                found.append((*operands, (), _text(*operands)))
    return found


def _right(node: ast.BinOp) -> tuple[str, bool] | None:
    right, transposed = node.right, False
    if (isinstance(right, ast.Call) and isinstance(right.func, ast.Name) and right.func.id == "T"
            and len(right.args) == 1 and not right.keywords):
        right, transposed = right.args[0], True
    return (right.id, transposed) if isinstance(right, ast.Name) else None


def _operand_text(b: str, transposed: bool) -> str:
    return f"T({b})" if transposed else b


def _text(a: str, b: str, transposed: bool) -> str:
    return f"{a} @ {_operand_text(b, transposed)}"


def _operands(node: ast.BinOp) -> tuple[str, str, bool] | None:
    right = _right(node)
    if right is None or not isinstance(node.left, ast.Name):
        return None
    return (node.left.id, *right)


def _broadcast_dims(inputs: tuple[InputSpec, ...]) -> tuple[str, ...]:
    """The output's dims: the inputs' dims aligned right, as torch broadcasts them."""
    explicit = {i.name: [d for d in i.dims if d != ELLIPSIS] for i in inputs}
    rank = max(len(d) for d in explicit.values())
    out: list[str] = []
    for pos in range(1, rank + 1):
        merged, owner = "1", None
        for spec in inputs:
            dims = explicit[spec.name]
            if pos > len(dims):
                continue
            dim = dims[-pos]
            if dim == "1":
                continue
            if merged != "1" and dim != merged:
                raise _Located(
                    spec.line,
                    f"inputs '{owner.name}' {owner.shape_text} and '{spec.name}' {spec.shape_text} "
                    f"cannot broadcast: dim {-pos} is {merged} in one and {dim} in the other",
                )
            merged, owner = dim, spec
        out.append(merged)
    prefix = (ELLIPSIS,) if any(i.has_ellipsis for i in inputs) else ()
    return prefix + tuple(reversed(out))
