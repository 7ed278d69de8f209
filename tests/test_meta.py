"""Meta tensors, and FakeTensors outside torch.compile: tensors with a shape but no data.

A generated op on them does what torch's own ops do: outputs of the right shape, dtype and
device, no kernel; with inputs that require grad, outputs that require grad and a backward
that gives gradients of the inputs' shapes, on the same kind of tensor; out= is checked and
returned. `reference` (plain torch ops) is the oracle.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from helpers import ShapeCase, all_ops, as_tuple, build_and_import, make_inputs, op_by_name, params_for, with_seed

# Broadcast inputs: bias-like gradients are summed over rows, scale-like over columns.
CASE = ShapeCase("3d-bcast", lead=(2, 3), n=8, layout="bcast")

MULTI_OUTPUT_SPEC = """\
name: meta_two_outputs
doc: y = dropout(gelu(x + b), p), z = (x + b) * s
inputs:
  x: [..., N]
  b: [N]
  s: [..., 1]
params:
  p: {type: float, default: 0.1, min: 0.0, max: 1.0}
outputs:
  y: dropout(gelu(x + b), p)
  z: (x + b) * s
"""


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("meta"), MULTI_OUTPUT_SPEC)


def _no_launches(monkeypatch, module):
    def launch(*args, **kwargs):
        raise AssertionError("a kernel was launched on tensors without data")

    monkeypatch.setattr(module._OP.kernels._forward, "launch", launch)
    if module._OP.kernels._backward is not None:  # None: a forward-only op
        monkeypatch.setattr(module._OP.kernels._backward, "launch", launch)


def _inputs(op_spec_inputs, device="meta", requires_grad=False):
    """Meta copies of `op_spec_inputs` (name → tensor), the first in bf16: mixed dtypes."""
    tensors = {}
    for index, (name, t) in enumerate(op_spec_inputs.items()):
        if not t.is_floating_point():  # an integer or bool input keeps its dtype, takes no gradient
            tensors[name] = t.to(device=device)
            continue
        t = t.to(device=device, dtype=torch.bfloat16 if index == 0 else torch.float32)
        tensors[name] = t.requires_grad_(requires_grad)
    return tensors


def _check_like(got, want, kind=torch.Tensor):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, kind)
        assert (g.shape, g.dtype, g.device) == (w.shape, w.dtype, w.device)


def _forward_and_backward(fn, tensors, kwargs):
    """Outputs, and the gradients of every input from a backward of all outputs."""
    outputs = as_tuple(fn(*tensors.values(), **kwargs))
    assert all(o.requires_grad and o.grad_fn is not None for o in outputs)
    grads = torch.autograd.grad(sum(o.float().sum() for o in outputs), [t for t in tensors.values() if t.requires_grad])
    return outputs, grads


def _cases():
    ops = {op.name: op for op in all_ops()}
    # One with dropout, a chunked one ([..., 2N]), one with a per-row input ([..., 1]), and the rest.
    first = ["bias_gelu_dropout_add", "swiglu", "bias_geglu", "scale_add"]
    return [ops[n] for n in first] + [op for name, op in sorted(ops.items()) if name not in first]


@pytest.mark.parametrize("op", _cases(), ids=str)
def test_meta_forward_gives_the_shapes_dtypes_and_device(monkeypatch, op):
    _no_launches(monkeypatch, op.module)
    tensors = _inputs(make_inputs(op, CASE))
    kwargs = with_seed(op, params_for(op), seed=3)
    got = as_tuple(op.fn(*tensors.values(), **kwargs))
    _check_like(got, as_tuple(op.reference(*tensors.values(), **kwargs)))
    assert all(t.device.type == "meta" for t in got)


@pytest.mark.parametrize("op", [op for op in _cases() if op.differentiable], ids=str)  # forward-only ops: no backward
def test_meta_backward_gives_meta_gradients_of_the_inputs_shapes(monkeypatch, op):
    _no_launches(monkeypatch, op.module)
    kwargs = with_seed(op, params_for(op), seed=3)
    got, got_grads = _forward_and_backward(op.fn, _inputs(make_inputs(op, CASE), requires_grad=True), kwargs)
    want, want_grads = _forward_and_backward(op.reference, _inputs(make_inputs(op, CASE), requires_grad=True), kwargs)
    _check_like(got, want)
    _check_like(got_grads, want_grads)


def test_meta_multi_output_forward_backward_and_out(monkeypatch, two_outputs):
    _no_launches(monkeypatch, two_outputs)
    shapes = {"x": (2, 3, 8), "b": (8,), "s": (2, 3, 1)}
    make = lambda requires_grad: _inputs({n: torch.empty(s) for n, s in shapes.items()}, requires_grad=requires_grad)  # noqa: E731
    for training in (True, False):
        got, got_grads = _forward_and_backward(two_outputs.meta_two_outputs, make(True), dict(p=0.5, training=training))
        want, want_grads = _forward_and_backward(two_outputs.reference, make(True), dict(p=0.5, training=training))
        _check_like(got, want)
        _check_like(got_grads, want_grads)
    out = (torch.empty(2, 3, 8, device="meta"), torch.empty(2, 3, 8, device="meta"))
    result = two_outputs.meta_two_outputs(*make(False).values(), out=out)
    assert result[0] is out[0] and result[1] is out[1]


def test_meta_out_is_checked_and_returned(monkeypatch):
    op = op_by_name("bias_gelu_dropout_add")
    _no_launches(monkeypatch, op.module)
    x, bias, residual = (torch.empty(s, device="meta") for s in [(4, 8), (8,), (4, 8)])
    out = torch.empty(4, 8, device="meta")
    assert op.fn(x, bias, residual, out=out) is out
    assert op.fn(x, bias, residual, out=out.t().contiguous().t()).shape == (4, 8)  # non-contiguous: fine too
    with pytest.raises(ValueError, match=r"^bias_gelu_dropout_add\(\): out must be torch.float32 \[4, 8\] on meta, got"):
        op.fn(x, bias, residual, out=torch.empty(4, 7, device="meta"))


def test_meta_checks_arguments_as_on_real_tensors():
    op = op_by_name("bias_gelu_dropout_add")
    x, bias, residual = (torch.empty(s, device="meta") for s in [(4, 8), (7,), (4, 8)])
    with pytest.raises(ValueError, match=r"^bias_gelu_dropout_add\(\): x \[4, 8\] and bias \[7\] disagree on dim N"):
        op.fn(x, bias, residual)
    with pytest.raises(ValueError, match=r"p must be in \[0.0, 1.0\], got 2"):
        op.fn(x, torch.empty(8, device="meta"), residual, p=2)


@pytest.mark.parametrize("name", ["bias_gelu_dropout_add", "swiglu", "scale_add"])
def test_fake_tensors_outside_compile(monkeypatch, name):
    op = op_by_name(name)
    _no_launches(monkeypatch, op.module)
    kwargs = with_seed(op, params_for(op), seed=3)
    real = make_inputs(op, CASE)
    with FakeTensorMode() as mode:
        tensors = {n: mode.from_tensor(t).requires_grad_(True) for n, t in real.items()}
        got, got_grads = _forward_and_backward(op.fn, tensors, kwargs)
        want, want_grads = _forward_and_backward(op.reference, tensors, kwargs)
    _check_like(got, want, FakeTensor)
    _check_like(got_grads, want_grads, FakeTensor)
