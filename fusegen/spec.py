"""YAML spec → validated, frozen dataclasses.

Parsing pops each key it knows, checks its type and rejects leftovers, so that every
mistake is reported once, as `file:line: message`. Expressions stay text here; `ir`
parses them.
"""
from __future__ import annotations

import hashlib
import keyword
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import SpecError
from .functions import BUILTINS, FUNCTIONS

ELLIPSIS = "..."

# Names the generated module uses for itself; a spec name equal to one would shadow it.
RESERVED_NAMES = frozenset(
    {
        "tl", "triton", "torch", "math", "runtime", "reference", "seed", "training", "out",
        "grid", "meta", "M", "N", "pid_m", "pid_n", "rows", "cols", "in_bounds", "offsets",
        "dropout_threshold", "dropout_scale", "dropout_mask", "inputs", "outputs", "self",
        "ctx", "args", "kwargs", "dtype", "device", "shape", "where", "call", "problem", "views",
        "libdevice",
    }
)

# Name shapes the generated code derives for itself: CSE temporaries (t0), dropout masks
# (dropout_mask0), gradients (grad_x), pointers (x_ptr), strides and constexprs (ACTIVATION).
_RESERVED_PATTERN = re.compile(r"t\d+|dropout_\w*|grad_\w*|\w+_ptr|\w+_stride\w*|[A-Z][A-Z0-9_]+")

MAX_EXPRESSION_CHARS = 2000


@dataclass(frozen=True)
class InputSpec:
    name: str
    dims: tuple[str, ...]  # "...", a dim name, or "1"
    line: int

    @property
    def has_ellipsis(self) -> bool:
        return bool(self.dims) and self.dims[0] == ELLIPSIS

    @property
    def shape_text(self) -> str:
        return "[" + ", ".join(self.dims) + "]"


@dataclass(frozen=True)
class ScalarParam:
    """A runtime scalar: passed to the kernel as an argument on every call."""

    name: str
    type: str  # "float" or "int"
    default: float | int
    min: float | int | None
    max: float | int | None
    line: int


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

    @property
    def scalar_params(self) -> tuple[ScalarParam, ...]:
        return tuple(p for p in self.params if isinstance(p, ScalarParam))

    @property
    def choice_params(self) -> tuple[ChoiceParam, ...]:
        return tuple(p for p in self.params if isinstance(p, ChoiceParam))


# ---------------------------------------------------------------------------
# A YAML loader that remembers where each key and value came from.


class _LineDict(dict):
    line: int = 0

    def __init__(self):
        super().__init__()
        self.key_lines: dict[Any, int] = {}
        self.value_lines: dict[Any, int] = {}


class _LineList(list):
    line: int = 0
    item_lines: list[int]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader whose mappings and lists carry their source lines; duplicate keys are errors."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> _LineDict:
    loader.flatten_mapping(node)
    mapping = _LineDict()
    mapping.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise _Located(line, "mapping keys must be plain names")
        if key in mapping:
            raise _Located(line, f"duplicate key '{key}' (first at line {mapping.key_lines[key]})")
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = line
        mapping.value_lines[key] = value_node.start_mark.line + 1
    return mapping


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> _LineList:
    items = _LineList(loader.construct_object(child, deep=True) for child in node.value)
    items.line = node.start_mark.line + 1
    items.item_lines = [child.start_mark.line + 1 for child in node.value]
    return items


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


class _Located(Exception):
    """An error with a line but not yet a file; `load_spec` adds the file."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


# ---------------------------------------------------------------------------
# Field helpers in torchgen's style: pop what is known, reject what is left.


_TYPE_NAMES = {str: "a string", dict: "a mapping", list: "a list", float: "a number", int: "an integer"}


def _expect(value: Any, kind: type, what: str, line: int) -> Any:
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise _Located(line, f"{what} must be {_TYPE_NAMES[kind]}, got {_describe(value)}")
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


def _reject_leftovers(mapping: _LineDict, known: list[str], where: str) -> None:
    for key in mapping:
        raise _Located(
            mapping.key_lines[key], f"unknown key '{key}' in {where} (known: {', '.join(known)})"
        )


def _check_identifier(name: Any, line: int, what: str) -> str:
    if not isinstance(name, str):
        raise _Located(line, f"{what} name {_describe(name)} is not a string")
    if not name.isidentifier() or not name.isascii():
        raise _Located(line, f"{what} name '{name}' is not a Python identifier")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        raise _Located(line, f"{what} name '{name}' is a Python keyword")
    if name.startswith("_"):
        raise _Located(line, f"{what} name '{name}' must not start with '_' (reserved for generated code)")
    if name in RESERVED_NAMES or _RESERVED_PATTERN.fullmatch(name):
        raise _Located(line, f"{what} name '{name}' is reserved by the generated code")
    # An op may share a function's name (op `gelu`): its module never calls that function.
    if what != "op" and (name in FUNCTIONS or name in BUILTINS):
        raise _Located(line, f"{what} name '{name}' shadows the function '{name}'")
    return name


# ---------------------------------------------------------------------------


def load_spec(path: str | Path) -> OpSpec:
    """Read and validate one spec file; raise SpecError naming file and line."""
    path = Path(path)
    shown = f"{path.parent.name}/{path.name}" if path.parent.name else path.name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError(shown, None, f"cannot read spec: {exc.strerror}") from None
    try:
        return _parse(data, shown)
    except _Located as exc:
        raise SpecError(shown, exc.line, exc.message) from None


def _parse(data: bytes, shown: str) -> OpSpec:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Located(1, f"spec is not UTF-8 ({exc.reason})") from None
    try:
        doc = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise _Located(line, f"YAML syntax error: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise _Located(1, f"YAML error: {exc}") from None
    except RecursionError:
        raise _Located(1, "YAML nesting is too deep") from None
    if not isinstance(doc, _LineDict):
        raise _Located(1, f"a spec must be a mapping with keys name, doc, inputs, outputs; got {_describe(doc)}")

    known = ["name", "doc", "inputs", "params", "let", "outputs"]
    for key in ("name", "doc", "inputs", "outputs"):
        if key not in doc:
            raise _Located(doc.line, f"missing required key '{key}'")
    lines = dict(doc.value_lines)
    name = _check_identifier(doc.pop("name"), lines["name"], "op")
    doc_text = _expect(doc.pop("doc"), str, "'doc'", lines["doc"]).strip()
    if not doc_text or "\n" in doc_text:
        raise _Located(lines["doc"], "'doc' must be one non-empty line")
    if not doc_text.isprintable():
        raise _Located(lines["doc"], "'doc' must be printable text")
    inputs_raw = doc.pop("inputs")
    params_raw = doc.pop("params", None)
    lets_raw = doc.pop("let", None)
    outputs_raw = doc.pop("outputs")
    _reject_leftovers(doc, known, "the spec")

    seen: dict[str, tuple[str, int]] = {}

    def claim(item_name: str, kind: str, line: int) -> None:
        if item_name in seen:
            other_kind, other_line = seen[item_name]
            raise _Located(line, f"duplicate name '{item_name}' (already {other_kind} at line {other_line})")
        seen[item_name] = (kind, line)

    inputs = _parse_inputs(inputs_raw, lines["inputs"], claim)
    params = _parse_params(params_raw, lines.get("params", doc.line), claim)
    lets = _parse_bindings(lets_raw, lines.get("let", doc.line), "let", "an intermediate", claim, required=False)
    outputs = _parse_bindings(outputs_raw, lines["outputs"], "outputs", "an output", claim, required=True)
    out_dims = _broadcast_dims(inputs)
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
    )


def _parse_inputs(raw: Any, line: int, claim) -> tuple[InputSpec, ...]:
    _expect(raw, dict, "'inputs'", line)
    if not raw:
        raise _Located(line, "'inputs' must name at least one input")
    inputs = []
    for name, dims in raw.items():
        key_line = raw.key_lines[name]
        _check_identifier(name, key_line, "input")
        claim(name, "an input", key_line)
        value_line = raw.value_lines[name]
        _expect(dims, list, f"the shape of input '{name}'", value_line)
        checked = []
        for i, dim in enumerate(dims):
            if dim == ELLIPSIS:
                if i != 0:
                    raise _Located(value_line, f"input '{name}': '...' may only be the first dim")
                checked.append(ELLIPSIS)
            elif dim == 1 and not isinstance(dim, bool):
                checked.append("1")
            elif isinstance(dim, str) and dim.isidentifier() and dim.isascii() and not keyword.iskeyword(dim):
                checked.append(dim)
            else:
                raise _Located(
                    value_line,
                    f"input '{name}': dim {_describe(dim)} must be '...', a dim name such as N, or 1",
                )
        inputs.append(InputSpec(name, tuple(checked), key_line))
    return tuple(inputs)


def _parse_params(raw: Any, line: int, claim) -> tuple[ScalarParam | ChoiceParam, ...]:
    if raw is None:
        return ()
    _expect(raw, dict, "'params'", line)
    params: list[ScalarParam | ChoiceParam] = []
    for name, body in raw.items():
        key_line = raw.key_lines[name]
        _check_identifier(name, key_line, "param")
        claim(name, "a param", key_line)
        _expect(body, dict, f"param '{name}'", raw.value_lines[name])
        if "choices" in body:
            params.append(_parse_choice_param(name, body, key_line))
        else:
            params.append(_parse_scalar_param(name, body, key_line))
    return tuple(params)


def _parse_choice_param(name: str, body: _LineDict, line: int) -> ChoiceParam:
    lines = dict(body.value_lines)
    choices = _expect(body.pop("choices"), list, f"param '{name}': 'choices'", lines["choices"])
    if not choices:
        raise _Located(lines["choices"], f"param '{name}': 'choices' must not be empty")
    for choice, choice_line in zip(choices, choices.item_lines):
        if choice not in FUNCTIONS:
            raise _Located(
                choice_line,
                f"param '{name}': unknown function {_describe(choice)} in choices (known: {', '.join(sorted(FUNCTIONS))})",
            )
    if len(set(choices)) != len(choices):
        raise _Located(lines["choices"], f"param '{name}': duplicate entries in 'choices'")
    arities = {FUNCTIONS[c].arity for c in choices}
    if len(arities) != 1:
        raise _Located(lines["choices"], f"param '{name}': all choices must take the same number of arguments")
    if "default" not in body:
        raise _Located(line, f"param '{name}': missing required key 'default'")
    default = body.pop("default")
    if default not in choices:
        raise _Located(lines["default"], f"param '{name}': default {_describe(default)} is not one of its choices")
    _reject_leftovers(body, ["choices", "default"], f"param '{name}'")
    return ChoiceParam(name, tuple(choices), default, line)


def _parse_scalar_param(name: str, body: _LineDict, line: int) -> ScalarParam:
    lines = dict(body.value_lines)
    if "type" not in body:
        raise _Located(line, f"param '{name}': missing required key 'type' (float or int), or 'choices'")
    kind = body.pop("type")
    if kind not in ("float", "int"):
        raise _Located(lines["type"], f"param '{name}': type must be float or int, got {_describe(kind)}")
    number = float if kind == "float" else int
    if "default" not in body:
        raise _Located(line, f"param '{name}': missing required key 'default'")
    values = {}
    for key in ("default", "min", "max"):
        if key not in body:
            values[key] = None
            continue
        value = _expect(body.pop(key), number, f"param '{name}': '{key}'", lines[key])
        if isinstance(value, float) and value != value:
            raise _Located(lines[key], f"param '{name}': '{key}' must not be NaN")
        if kind == "float" and abs(value) > 1e30:
            raise _Located(lines[key], f"param '{name}': '{key}' {value} is out of range")
        values[key] = float(value) if kind == "float" else value
    _reject_leftovers(body, ["type", "default", "min", "max"], f"param '{name}'")
    low, high, default = values["min"], values["max"], values["default"]
    if low is not None and high is not None and low > high:
        raise _Located(lines["min"], f"param '{name}': min {low} is greater than max {high}")
    if (low is not None and default < low) or (high is not None and default > high):
        raise _Located(lines["default"], f"param '{name}': default {default} is outside [{low}, {high}]")
    return ScalarParam(name, kind, default, low, high, line)


def _parse_bindings(raw: Any, line: int, section: str, kind: str, claim, required: bool) -> tuple[Binding, ...]:
    if raw is None and not required:
        return ()
    _expect(raw, dict, f"'{section}'", line)
    if required and not raw:
        raise _Located(line, f"'{section}' must name at least one expression")
    bindings = []
    for name, text in raw.items():
        key_line = raw.key_lines[name]
        _check_identifier(name, key_line, section.rstrip("s") if section == "outputs" else "intermediate")
        claim(name, kind, key_line)
        value_line = raw.value_lines[name]
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            text = repr(text)
        _expect(text, str, f"'{name}'", value_line)
        if len(text) > MAX_EXPRESSION_CHARS:
            raise _Located(value_line, f"expression for '{name}' is longer than {MAX_EXPRESSION_CHARS} characters")
        bindings.append(Binding(name, text.strip(), value_line))
    return tuple(bindings)


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
