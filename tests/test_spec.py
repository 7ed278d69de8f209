"""spec: YAML → frozen dataclasses, for good specs. Bad specs: tests/test_bad_specs.py."""
import dataclasses
import hashlib
from pathlib import Path

import pytest

from fusegen.errors import SpecError
from fusegen.spec import (
    Binding,
    ChoiceParam,
    InputSpec,
    ScalarParam,
    load_spec,
)

ROOT = Path(__file__).resolve().parent.parent

FULL = """\
# A comment, so that lines are not just indices.
name: full_op
doc: "  y, z = everything a spec can say  "
inputs:
  x: [..., N]
  bias: [N]
  gate: [..., 1]
  temperature: []
params:
  p: {type: float, default: 0.1, min: 0.0, max: 1.0}
  steps: {type: int, default: 3, min: 1}
  alpha: {type: float, default: 1}
  act: {choices: [gelu_tanh, relu, silu], default: relu}
let:
  h: x + bias
outputs:
  y: dropout(act(h), p) * gate + alpha * steps
  z: |
    h / temperature
    + 1
"""


def _write(tmp_path: Path, text: str, name: str = "x.yaml") -> Path:
    path = tmp_path / "specs" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _spec_with_inputs(tmp_path: Path, inputs: dict[str, str]):
    lines = "".join(f"  {name}: {dims}\n" for name, dims in inputs.items())
    return load_spec(_write(tmp_path, f"name: op\ndoc: d\ninputs:\n{lines}outputs:\n  y: {' + '.join(inputs)}\n"))


def test_full_spec_parses_into_dataclasses(tmp_path):
    spec = load_spec(_write(tmp_path, FULL))
    assert spec.name == "full_op"
    assert spec.doc == "y, z = everything a spec can say"  # stripped
    assert spec.inputs == (
        InputSpec("x", ("...", "N"), 5),
        InputSpec("bias", ("N",), 6),
        InputSpec("gate", ("...", "1"), 7),
        InputSpec("temperature", (), 8),
    )
    assert spec.params == (
        ScalarParam("p", "float", 0.1, 0.0, 1.0, 10),
        ScalarParam("steps", "int", 3, 1, None, 11),
        ScalarParam("alpha", "float", 1.0, None, None, 12),
        ChoiceParam("act", ("gelu_tanh", "relu", "silu"), "relu", 13),
    )
    assert spec.scalar_params == spec.params[:3]
    assert spec.choice_params == spec.params[3:]
    assert spec.lets == (Binding("h", "x + bias", 15),)
    assert spec.outputs == (
        Binding("y", "dropout(act(h), p) * gate + alpha * steps", 17),
        Binding("z", "h / temperature\n+ 1", 18),  # a block scalar, as written, stripped
    )
    assert spec.out_dims == ("...", "N")


def test_numbers_keep_their_types(tmp_path):
    spec = load_spec(_write(tmp_path, FULL))
    p, steps, alpha, _ = spec.params
    assert type(p.default) is float and type(p.min) is float
    assert type(steps.default) is int and type(steps.min) is int
    assert type(alpha.default) is float  # `default: 1` for a float param is 1.0


def test_dataclasses_are_frozen(tmp_path):
    spec = load_spec(_write(tmp_path, FULL))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.inputs[0].dims = ()  # type: ignore[misc]


def test_input_properties(tmp_path):
    x, bias, gate, temperature = load_spec(_write(tmp_path, FULL)).inputs
    assert x.has_ellipsis and gate.has_ellipsis
    assert not bias.has_ellipsis and not temperature.has_ellipsis
    assert x.shape_text == "[..., N]"
    assert temperature.shape_text == "[]"


@pytest.mark.parametrize(
    "inputs, out_dims",
    [
        ({"x": "[..., N]", "bias": "[N]"}, ("...", "N")),
        ({"x": "[M, N]", "b": "[M, 1]"}, ("M", "N")),
        ({"x": "[1, N]", "b": "[M, 1]"}, ("M", "N")),
        ({"x": "[..., N]", "scale": "[..., 1]"}, ("...", "N")),
        ({"x": "[...]", "s": "[]"}, ("...",)),
        ({"x": "[N]", "s": "[]"}, ("N",)),
        ({"s": "[]"}, ()),
        ({"x": "[B, 1, N]", "b": "[H, 1]"}, ("B", "H", "N")),
        ({"x": "[N, N]"}, ("N", "N")),
    ],
    ids=lambda v: " + ".join(v.values()) if isinstance(v, dict) else None,
)
def test_out_dims_broadcast_as_torch_does(tmp_path, inputs, out_dims):
    assert _spec_with_inputs(tmp_path, inputs).out_dims == out_dims


def test_sha256_is_of_the_file_bytes(tmp_path):
    path = _write(tmp_path, FULL)
    assert load_spec(path).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    # Any byte counts, a comment included.
    path.write_text(FULL + "# another comment\n", encoding="utf-8")
    assert load_spec(path).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_path_is_shown_as_dir_and_file(tmp_path):
    path = _write(tmp_path, FULL, name="full.yaml")
    assert load_spec(path).path == "specs/full.yaml"
    assert load_spec(str(path)).path == "specs/full.yaml"


def test_path_in_messages_is_dir_and_file(tmp_path):
    path = _write(tmp_path, FULL.replace("name: full_op", "name: full-op"), name="full.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == "specs/full.yaml:2: op name 'full-op' is not a Python identifier"
    assert (info.value.path, info.value.line) == ("specs/full.yaml", 2)


def test_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "specs" / "nope.yaml")
    assert str(info.value) == "specs/nope.yaml: cannot read spec: No such file or directory"


def test_unprintable_path_is_refused(tmp_path):
    path = _write(tmp_path, FULL, name="a\nb.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == "'specs/a\\nb.yaml': spec path must be printable"


def test_yaml_1_1_surprises_are_avoided(tmp_path):
    """Names, dims, docs and expressions are taken as written; 1e-5 is a number."""
    text = """\
name: op
doc: 2024-01-01
inputs:
  on: [..., N]
  no: [N]
params:
  eps: {type: float, default: 1e-5, min: -1.5E+3, max: 1.0e3}
outputs:
  y: on + no * eps
"""
    spec = load_spec(_write(tmp_path, text))
    assert spec.doc == "2024-01-01"
    assert [i.name for i in spec.inputs] == ["on", "no"]
    assert spec.params[0] == ScalarParam("eps", "float", 1e-5, -1500.0, 1000.0, 7)
    assert spec.outputs[0].text == "on + no * eps"


def test_numbers_yaml_1_1_and_1_2_read_alike_are_kept(tmp_path):
    """Only YAML 1.1's base-60 and octal readings are refused (tests/test_bad_specs.py)."""
    text = "name: op\ndoc: d\ninputs: {x: [N]}\nparams:\n  s: {type: float, default: 00, min: -010.5, max: 0x10}\noutputs:\n  y: x * s\n"
    assert load_spec(_write(tmp_path, text)).params[0] == ScalarParam("s", "float", 0.0, -10.5, 16.0, 5)


def test_numbers_as_expressions_are_kept_as_written(tmp_path):
    text = "name: op\ndoc: d\ninputs: {x: [N]}\noutputs:\n  y: x\n  z: 1.50\n"
    assert load_spec(_write(tmp_path, text)).outputs[1] == Binding("z", "1.50", 6)


def test_flow_and_block_styles_give_the_same_spec(tmp_path):
    block = load_spec(_write(tmp_path, FULL, name="block.yaml"))
    flow = """\
# A comment, so that lines are not just indices.
name: full_op
doc: "  y, z = everything a spec can say  "
inputs: {x: [..., N], bias: [N], gate: [..., 1], temperature: []}
"""
    flow = load_spec(_write(tmp_path, flow + FULL.split("temperature: []\n", 1)[1], name="flow.yaml"))
    assert flow.inputs == tuple(dataclasses.replace(i, line=4) for i in block.inputs)
    # The rest moved up by 4 lines.
    assert flow.params == tuple(dataclasses.replace(p, line=p.line - 4) for p in block.params)
    assert flow.outputs == tuple(dataclasses.replace(o, line=o.line - 4) for o in block.outputs)


def test_crlf_and_bom_are_accepted(tmp_path):
    path = tmp_path / "specs" / "x.yaml"
    path.parent.mkdir()
    path.write_bytes(b"\xef\xbb\xbf" + FULL.replace("\n", "\r\n").encode())
    spec = load_spec(path)
    assert spec.name == "full_op" and spec.outputs[1].line == 18


def test_every_committed_spec_loads():
    paths = sorted((ROOT / "specs").glob("*.yaml"))
    assert paths
    for path in paths:
        assert load_spec(path).path == f"specs/{path.name}"
