"""Spec names are the user's: names the generated code also uses for itself build, keep
their spelling in the op's signature, and compute what reference computes, forward and
backward (fusegen.plan's namer renames them inside the generated functions only)."""
from __future__ import annotations

import inspect

import pytest
import torch

from helpers import build_and_import

# The names the codegen issue lists, and more of the generated code's own: kernel locals
# (rows, in_bounds), pointers (x_ptr), gradients (grad_y), CSE temporaries (t0), constexprs
# (M, BLOCK_M), the module's imports (tl, torch) and Python builtins (input, range, super).
SPECS = {
    "dropout_add": """\
name: dropout_add
doc: every name here is one the generated code also uses
inputs:
  x_ptr: [..., N]
  grad_y: [..., N]
  shape: [N]
params:
  M: {type: float, default: 1.5}
  dropout_p: {type: float, default: 0.25, min: 0.0, max: 1.0}
  ACT: {choices: [gelu_tanh, silu], default: silu}
let:
  t0: ACT(x_ptr + shape) * M
outputs:
  rows: dropout(t0, dropout_p) + grad_y
  grad_x_ptr: t0 * grad_y
""",
    "grid": """\
name: grid
doc: an op named grid, with the kernels' and the module's own names as its names
inputs:
  tl: [..., N]
  in_bounds: [..., 1]
  input: [N]
  torch: [..., N]
params:
  BLOCK_M: {type: float, default: 0.5}
  range: {type: float, default: 0.1, min: 0.0, max: 1.0}
  super: {choices: [relu, sigmoid], default: sigmoid}
outputs:
  problem: dropout(super(tl * in_bounds + input), range) * BLOCK_M + torch
  masks: tl * torch
""",
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def op(request, tmp_path_factory):
    name = request.param
    return name, build_and_import(tmp_path_factory.mktemp(name), SPECS[name])


def _inputs(name: str, device):
    g = torch.Generator().manual_seed(7)

    def randn(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(device).requires_grad_(True)

    if name == "dropout_add":
        return {"x_ptr": randn(4, 12), "grad_y": randn(4, 12), "shape": randn(12)}
    return {"tl": randn(3, 8), "in_bounds": randn(3, 1), "input": randn(8), "torch": randn(3, 8)}


def test_the_signature_keeps_the_spec_names(op):
    name, module = op
    parameters = list(inspect.signature(getattr(module, name)).parameters)
    if name == "dropout_add":
        expected = ["x_ptr", "grad_y", "shape", "M", "dropout_p", "ACT", "training", "seed", "out"]
    else:
        expected = ["tl", "in_bounds", "input", "torch", "BLOCK_M", "range", "super", "training", "seed", "out"]
    assert parameters == expected + ["inplace_backward"]
    assert list(inspect.signature(module.reference).parameters) == expected


@pytest.mark.parametrize("training", [True, False])
def test_forward_and_backward_match_reference(op, device, training):
    name, module = op
    fn = getattr(module, name)
    choices = ["gelu_tanh", "silu"] if name == "dropout_add" else ["relu", "sigmoid"]
    choice_param = "ACT" if name == "dropout_add" else "super"
    for choice in choices:
        kwargs = {choice_param: choice, "training": training, "seed": 11}
        tensors = _inputs(name, device)
        got = fn(**tensors, **kwargs)
        got_grads = torch.autograd.grad(sum((o * o).sum() for o in got), list(tensors.values()))
        tensors = _inputs(name, device)
        want = module.reference(**tensors, **kwargs)
        want_grads = torch.autograd.grad(sum((o * o).sum() for o in want), list(tensors.values()))
        for g, w in zip((*got, *got_grads), (*want, *want_grads)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_the_module_class_takes_the_names(op, device):
    name, module = op
    tensors = _inputs(name, device)
    if name == "dropout_add":
        layer = module.DropoutAdd(M=2.0, dropout_p=0.0, ACT="gelu_tanh")
        want = module.reference(*tensors.values(), M=2.0, dropout_p=0.0, ACT="gelu_tanh")
        assert repr(layer) == "DropoutAdd(M=2.0, dropout_p=0.0, ACT='gelu_tanh')"
    else:
        layer = module.Grid(BLOCK_M=2.0, range=0.0, super="relu")
        want = module.reference(*tensors.values(), BLOCK_M=2.0, range=0.0, super="relu")
    for g, w in zip(layer(*tensors.values()), want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
