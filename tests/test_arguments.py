"""Runtime argument checks of a generated op: each bad call gets one clear message."""
import re

import pytest
import torch

from fusegen.layout import range_text
from fusegen.runtime import FusegenArgumentError
from generated.bias_gelu_dropout_add import bias_gelu_dropout_add
from helpers import build_and_import

OP = "bias_gelu_dropout_add()"


def _good(device):
    return torch.randn(2, 8, device=device), torch.randn(8, device=device), torch.randn(2, 8, device=device)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, b, r: (x.long(), b, r), f"{OP}: x has dtype torch.int64; supported: float16, bfloat16, float32, float64"),
        (lambda x, b, r: (x.tolist(), b, r), f"{OP}: x must be a torch.Tensor, got list"),
        (lambda x, b, r: (x, torch.randn(7, device=b.device), r), f"{OP}: x [2, 8] and bias [7] disagree on dim N (8 vs 7)"),
        (lambda x, b, r: (x, b, torch.randn(3, 8, device=r.device)), f"{OP}: shapes do not broadcast: x [2, 8] and bias [8] and residual [3, 8]"),
        (lambda x, b, r: (x, b.to("meta"), r), f"{OP}: all tensors must be on one device; got x on {{device}}, bias on meta, residual on {{device}}"),
        (lambda x, b, r: (x, b[None, None], r), f"{OP}: bias must have shape [N], got [1, 1, 8]"),
    ],
    ids=["dtype", "non-tensor", "named-dim", "broadcast", "device", "rank"],
)
def test_bad_tensors(change, message, device):
    good = _good(device)
    x, bias, residual = change(*good)
    expected = message.replace("{device}", str(good[0].device))  # "cuda:0", where the fixture says "cuda"
    with pytest.raises(FusegenArgumentError, match=re.escape(expected)):
        bias_gelu_dropout_add(x, bias, residual)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"p": 1.5}, f"{OP}: p must be in [0.0, 1.0], got 1.5"),
        ({"p": -0.1}, f"{OP}: p must be in [0.0, 1.0], got -0.1"),
        ({"p": float("nan")}, f"{OP}: p must not be NaN"),
        ({"p": "0.1"}, f"{OP}: p must be a number, got str"),
        ({"activation": "gelux"}, f"{OP}: activation must be one of gelu_tanh, gelu, relu, silu, sigmoid, identity; got 'gelux'"),
    ],
    ids=["p-above", "p-below", "p-nan", "p-str", "choice"],
)
def test_bad_params(kwargs, message, device):
    with pytest.raises(FusegenArgumentError, match=re.escape(message)):
        bias_gelu_dropout_add(*_good(device), **kwargs)


# ---------------------------------------------------------------------------
# Param ranges: `≥ low`, `≤ high` or `in [low, high]`, the same in errors and docstrings

RANGES_SPEC = """\
name: ranges_op
doc: y = where(x > thresh, x, 0.0) * cap + x * scale * p
inputs:
  x: [..., N]
params:
  thresh: {type: float, default: 0.5, min: 0.0}
  cap: {type: int, default: 3, max: 10}
  scale: {type: float, default: 2.0, min: -1.5, max: 1e+20}
  p: {type: float, default: 0.1, min: 0.0, max: 1.0}
outputs:
  y: where(x > thresh, x, 0.0) * cap + x * scale * p
"""


@pytest.fixture(scope="module")
def ranges_module(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("ranges"), RANGES_SPEC)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"thresh": -1.0}, "ranges_op(): thresh must be ≥ 0.0, got -1.0"),
        ({"cap": 11}, "ranges_op(): cap must be ≤ 10, got 11"),
        ({"scale": -2}, "ranges_op(): scale must be in [-1.5, 1e+20], got -2"),
        ({"p": 1.5}, "ranges_op(): p must be in [0.0, 1.0], got 1.5"),
    ],
    ids=["min-only", "max-only", "closed", "closed-p"],
)
def test_range_errors(ranges_module, kwargs, message, device):
    x = torch.randn(2, 8, device=device)
    for call in (ranges_module.ranges_op, ranges_module.reference, ranges_module.RangesOp):
        with pytest.raises(FusegenArgumentError) as error:
            call(**kwargs) if call is ranges_module.RangesOp else call(x, **kwargs)
        assert str(error.value) == message


def test_range_docstrings(ranges_module):
    lines = ranges_module.__doc__.splitlines()
    for line in [
        "Param thresh: float ≥ 0.0, default 0.5 (runtime: no recompilation).",
        "Param cap: int ≤ 10, default 3 (runtime: no recompilation).",
        "Param scale: float in [-1.5, 1e+20], default 2.0 (runtime: no recompilation).",
        "Param p: float in [0.0, 1.0], default 0.1 (runtime: no recompilation).",
    ]:
        assert line in lines


@pytest.mark.parametrize(
    "low, high, text",
    [(None, None, ""), (0.0, None, "≥ 0.0"), (None, 10, "≤ 10"), (-1.5, 1e20, "in [-1.5, 1e+20]"), (2, 2, "in [2, 2]")],
)
def test_ranges_print_one_way(low, high, text):
    # One function prints a range for docstrings (at build) and errors (at run time).
    assert range_text(low, high) == text


def test_numpy_numbers_are_params_as_python_numbers_are(ranges_module, device):
    """numpy's scalars are numbers.Real and Integral: np.float32(0.1) as 0.1 (rounded to
    float32 either way), np.int64(3) as 3; a numpy float is no int."""
    np = pytest.importorskip("numpy")
    x = torch.randn(2, 8, device=device)
    expected = bias_gelu_dropout_add(x, x[0], x, p=0.25, training=False)
    assert torch.equal(bias_gelu_dropout_add(x, x[0], x, p=np.float32(0.25), training=False), expected)
    assert torch.equal(bias_gelu_dropout_add(x, x[0], x, p=np.float64(0.25), training=np.bool_(False)), expected)
    f = ranges_module.ranges_op
    assert torch.equal(f(x, cap=np.int64(3), thresh=np.float32(0.5)), f(x, cap=3, thresh=0.5))
    with pytest.raises(FusegenArgumentError, match=re.escape("ranges_op(): cap must be an int, got np.float64(3.0)")):
        f(x, cap=np.float64(3.0))
    with pytest.raises(FusegenArgumentError, match=re.escape("ranges_op(): thresh must be a number, got bool")):
        f(x, thresh=np.bool_(True))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cap": -(2**70)}, f"ranges_op(): cap={-(2**70)} is out of the int64 range"),
        ({"cap": -(2**63) - 1}, f"ranges_op(): cap={-(2**63) - 1} is out of the int64 range"),
        ({"thresh": torch.tensor(0.5, device="meta")}, "ranges_op(): thresh is a tensor without data (meta); pass a number"),
    ],
    ids=["int-2**70", "int64-min-1", "meta-tensor"],
)
def test_params_the_kernel_cannot_take_are_one_line(ranges_module, kwargs, message, device):
    x = torch.randn(2, 8, device=device)
    for call in (ranges_module.ranges_op, ranges_module.reference):
        with pytest.raises(FusegenArgumentError) as error:
            call(x, **kwargs)
        assert str(error.value) == message
    assert ranges_module.ranges_op(x, cap=-(2**63)).shape == x.shape  # the int64 range's end is taken


@pytest.mark.parametrize("training", ["no", None, [], 1, torch.tensor(True)], ids=["str", "None", "list", "int", "tensor"])
def test_training_is_a_bool(training, device):
    """Not truthiness: training='no' would turn dropout on."""
    x, b, r = _good(device)
    name = type(training).__name__
    with pytest.raises(FusegenArgumentError, match=re.escape(f"{OP}: training must be True or False, got {name}")):
        bias_gelu_dropout_add(x, b, r, p=0.5, training=training)
