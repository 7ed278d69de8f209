"""The functions added for issue 31 (round, floor, sign, clamp, softplus, log1p, expm1, sin, cos),
through one spec that uses them all: their values and gradients at the places where their
definitions matter (steps, bounds, torch's softplus threshold), NaN and ±inf as eager PyTorch,
and fp64 gradcheck. Their numerics contract on random inputs is in test_numerics.py
(LANGUAGE_CASES), their spellings in test_printers.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import build_and_import

SPEC = """\
name: language_functions
doc: every function of issue 31, one output each
inputs:
  x: [..., N]
  lo: [..., N]
outputs:
  r: round(x)
  f: floor(x)
  s: sign(x)
  c: clamp(x, lo, 1.5)
  sp: softplus(x)
  l1: log1p(x * x)
  e1: expm1(x)
  si: sin(x)
  co: cos(x)
"""


def eager(x, lo):
    """The same outputs as a PyTorch user computes them."""
    return (torch.round(x), torch.floor(x), torch.sign(x), torch.clamp(x, lo, torch.tensor(1.5, dtype=x.dtype)),
            F.softplus(x), torch.log1p(x * x), torch.expm1(x), torch.sin(x), torch.cos(x))


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("functions"), SPEC)


def _outputs_and_grads(fn, x, lo, device="cpu"):
    leaves = [t.detach().clone().to(device).requires_grad_(True) for t in (x, lo)]
    outs = fn(*leaves)
    g = torch.Generator().manual_seed(3)
    grads_out = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype).to(device) for o in outs]
    grads = torch.autograd.grad(outs, leaves, grads_out, allow_unused=True)
    grads = [torch.zeros_like(leaf) if gr is None else gr for gr, leaf in zip(grads, leaves)]
    return [o.detach().cpu() for o in outs], [gr.cpu() for gr in grads]


# Where the definitions are decided: halves (round to even), integers (floor), 0 (sign), the
# clamp bounds hit exactly (gradient 1 there, as torch.clamp), softplus's threshold 20.
X = [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -1.0, 0.0, 1.0, 1.5, -0.75, 19.5, 20.0, 20.5, 30.0, -30.0]
LO = [-3.0, -1.5, -1.0, 0.0, 2.0, -1.0, -1.0, 0.0, 1.0, 0.0, -0.75, 0.0, 0.0, 0.0, 0.0, -1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_values_and_gradients_at_the_decisive_points_are_torchs(module, dtype, device):
    x = torch.tensor([X], dtype=dtype)
    lo = torch.tensor([LO], dtype=dtype)
    got = _outputs_and_grads(module.language_functions, x, lo, device)
    want = _outputs_and_grads(eager, x, lo)
    ref = _outputs_and_grads(module.reference, x, lo)
    names = ("r", "f", "s", "c", "sp", "l1", "e1", "si", "co")
    for name, g, w, r in zip(names, got[0], want[0], ref[0]):
        torch.testing.assert_close(g, w, rtol=2e-7 if dtype == torch.float32 else 1e-15, atol=0, msg=name)
        torch.testing.assert_close(r, w, rtol=2e-7 if dtype == torch.float32 else 1e-15, atol=0, msg=name)
    for name, g, w, r in zip(("x", "lo"), got[1], want[1], ref[1]):
        torch.testing.assert_close(g, w, rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=1e-30,
                                   msg=f"grad of {name}")
        torch.testing.assert_close(r, w, rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=1e-30,
                                   msg=f"reference's grad of {name}")


def test_round_is_half_to_even_and_clamp_gradient_is_one_at_the_bounds(module, device):
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -1.0, 1.5, 1.2]], requires_grad=True)
    lo = torch.full_like(x, -1.0).requires_grad_(True)
    outs = module.language_functions(x.detach().to(device).requires_grad_(True), lo.detach().to(device))
    assert outs[0].cpu().tolist() == [[0.0, 2.0, 2.0, -0.0, -2.0, -1.0, 2.0, 1.0]]
    xd = x.detach().to(device).requires_grad_(True)
    (grad,) = torch.autograd.grad(module.language_functions(xd, lo.detach().to(device))[3].sum(), xd)
    # x = -1.0 is lo, x = 1.5 is hi: inside, as torch.clamp's [lo, hi]; 0.5 * (two ties) from min(max()).
    assert grad.cpu().tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]]


SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e30, -1e30, 1e-30]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_nan_inf_and_extreme_magnitudes_as_eager_pytorch(module, device):
    x = torch.tensor([SPECIAL])
    lo = torch.full_like(x, -2.0)
    got = _outputs_and_grads(module.language_functions, x, lo, device)
    want = _outputs_and_grads(eager, x, lo)
    for label, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        for index, (g, w) in enumerate(zip(got[0] + got[1], want[0] + want[1])):
            assert torch.equal(test(g), test(w)), f"{label} differs in result {index}: {g.tolist()} vs {w.tolist()}"
    for index, (g, w) in enumerate(zip(got[0] + got[1], want[0] + want[1])):
        finite = torch.isfinite(w)
        # sin and cos of 1e30 in fp32: both sides reduce the argument exactly; 1 ulp apart at most.
        torch.testing.assert_close(g[finite], w[finite], rtol=2.5e-7, atol=0, msg=f"result {index}")


def test_gradcheck_fp64(module, device):
    # Away from the steps and bounds, where finite differences see the derivative.
    x = torch.tensor([[-1.2, 0.3, 1.3, 1.7, 19.7, 21.3]], dtype=torch.float64)
    lo = x + torch.tensor([0.3, -0.3] * 3, dtype=torch.float64)
    leaves = [t.to(device).requires_grad_(True) for t in (x, lo)]
    assert torch.autograd.gradcheck(module.language_functions, leaves, eps=1e-6, atol=1e-7, rtol=1e-5,
                                    # Nine outputs: slow mode runs a backward per output element; the
                                    # undefined-gradient probes (None handling) are the library's tests'.
                                    fast_mode=True, check_undefined_grad=False)
