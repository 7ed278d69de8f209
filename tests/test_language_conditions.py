"""Issue 31's conditions and literals: `&`, `|`, `~` in where's condition, the literal `inf`
(and `-inf`), and params with exclusive bounds (`gt:` / `lt:`), through built ops: values and
gradients against `reference`, the module's `eager` (PyTorch as a user writes it) and float64;
the bounds checked at call time with one-line errors. Bad spellings: test_bad_specs.py.
"""
from __future__ import annotations

import pytest
import torch

from fusegen.runtime import FusegenArgumentError
from tests.helpers import build_and_import

POINTWISE = """\
name: conditions
doc: where with & | ~, inf, and an exclusive param bound
inputs:
  x: [..., N]
  y: [..., N]
params:
  cap: {type: float, default: 2.0, gt: 0.0, lt: 100.0}
outputs:
  z: where((x > 0) & ~(y > 1) | (x < -1), x * y, -inf)
  w: max(x, -inf) + where(x == inf, 0.0, y / cap)
"""

# A masked softmax with -inf where the mask is off, as torch users write it (masked_fill).
ROWS = """\
name: masked_softmax_inf
doc: softmax of x where m > 0, -inf elsewhere
inputs:
  x: [..., N]
  m: [..., N]
let:
  s: where((m > 0) | (x > 2), x, -inf)
  e: exp(s - max(s))
outputs:
  y: e / sum(e)
"""

# Wheres decided by params alone: a branch in the kernels (one side computed; a number side
# made a tile), nested, in the pointwise and the row kind.
PARAM_BRANCHES = """\
name: param_branches{kind}
doc: wheres whose condition is a param's
inputs:
  x: [..., N]
  s: [..., 1]
params:
  c: {{type: float, default: 0.0}}
outputs:
  y: where(c > 0, tanh(x / c) * c, where(c < -1, 1.0, x * s))
"""


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    folder = tmp_path_factory.mktemp("conditions")
    rows = PARAM_BRANCHES.format(kind="_rows") + "  z: x * sum(where(c > 0, exp(x * c), x))\n" \
        + "  m: x * max(where(c > 0, exp(x * c), x))\n"  # its backward's ties: (max == t) | (c <= 0)
    return {"pointwise": build_and_import(folder, POINTWISE), "rows": build_and_import(folder, ROWS),
            "branches": build_and_import(folder, PARAM_BRANCHES.format(kind="")),
            "branches_rows": build_and_import(folder, rows)}


def _branches_by_hand(x, s, c):
    """The specs' outputs as Python picks a side: only that side computed, in float64."""
    y = torch.tanh(x / c) * c if c > 0 else (x * 0 + 1 if c < -1 else x * s)
    e = torch.exp(x * c) if c > 0 else x
    return y, x * e.sum(-1, keepdim=True), x * e.amax(-1, keepdim=True)


@pytest.mark.parametrize("c", [0.0, 2.0, -3.0])
@pytest.mark.parametrize("name", ["branches", "branches_rows"])
def test_wheres_decided_by_params_take_one_side(ops, name, c, device):
    """Every side taken at some c, values and gradients as float64 torch computes the side; at
    c = 0 the side not taken divides by 0, and no NaN reaches the kernels' results."""
    module = ops[name]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 24, generator=g, dtype=torch.float32)
    s = torch.randn(3, 1, generator=g, dtype=torch.float32)
    got = _run(getattr(module, f"param_{name}"), (x, s), device, c=c)
    outputs = 3 if name == "branches_rows" else 1
    want = _run(lambda a, b: _branches_by_hand(a, b, c)[:outputs], (x.double(), s.double()), "cpu")
    assert len(got) == len(want)
    for index, (g_, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g_).all(), f"result {index}"
        torch.testing.assert_close(g_, w.float(), rtol=1e-5, atol=1e-6, msg=f"result {index}")


@pytest.mark.parametrize("c", [0.0, 2.0, -3.0])
@pytest.mark.parametrize("name", ["branches", "branches_rows"])
def test_the_reference_and_torch_func_differentiate_the_side_taken(ops, name, c, device):
    """The reference (the oracle, and what the op runs under torch.func) differentiates only
    the side a param's where takes: at c = 0, x / c on the other side would send 0 * inf = NaN
    back through torch.where. Gradients (autograd, torch.func.grad and vjp) and tangents (jvp)
    as float64 torch computes the side; meta tensors keep their shapes."""
    module = ops[name]
    op, outputs = getattr(module, f"param_{name}"), 3 if name == "branches_rows" else 1
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 24, generator=g, dtype=torch.float32)
    s = torch.randn(3, 1, generator=g, dtype=torch.float32)
    want = _run(lambda a, b: _branches_by_hand(a, b, c)[:outputs], (x.double(), s.double()), "cpu")
    got = _run(lambda a, b: module.reference(a, b, c=c), (x, s), device)
    for index, (g_, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g_, w.float(), rtol=1e-5, atol=1e-6, msg=f"reference, result {index}")

    def total(a, b):
        outs = op(a, b, c=c)
        return sum(o.sum() for o in (outs if isinstance(outs, tuple) else (outs,)))
    xd, sd = x.to(device), s.to(device)
    grads = torch.func.grad(total, argnums=(0, 1))(xd, sd)
    x64, s64 = x.double().requires_grad_(True), s.double().requires_grad_(True)
    want_grads = torch.autograd.grad(sum(o.sum() for o in _branches_by_hand(x64, s64, c)[:outputs]), (x64, s64),
                                     allow_unused=True, materialize_grads=True)
    for what, gr, w in zip(("x", "s"), grads, want_grads):
        torch.testing.assert_close(gr.cpu(), w.float(), rtol=1e-5, atol=1e-6, msg=f"torch.func.grad, {what}")
    _, pullback = torch.func.vjp(lambda a, b: op(a, b, c=c), xd, sd)
    ones = tuple(torch.ones_like(o) for o in want[:outputs]) if outputs > 1 else torch.ones_like(want[0])
    for what, gr, w in zip(("x", "s"), pullback(_to(ones, device)), want_grads):
        torch.testing.assert_close(gr.cpu(), w.float(), rtol=1e-5, atol=1e-6, msg=f"torch.func.vjp, {what}")
    tangent = torch.randn(3, 24, generator=g).to(device)
    _, jvp = torch.func.jvp(lambda a: op(a, sd, c=c), (xd,), (tangent,))
    jvp = jvp if isinstance(jvp, tuple) else (jvp,)
    _, want_jvp = torch.func.jvp(lambda a: _branches_by_hand(a, s64.detach(), c)[:outputs], (x.double(),),
                                 (tangent.cpu().double(),))
    for index, (t, w) in enumerate(zip(jvp, want_jvp)):
        torch.testing.assert_close(t.cpu(), w.float(), rtol=1e-5, atol=1e-6, msg=f"jvp, result {index}")
    xm, sm = (t.to("meta").requires_grad_(True) for t in (x, s))
    out = module.reference(xm, sm, c=c)
    (out if outputs == 1 else out[0]).sum().backward()
    assert xm.grad.shape == xm.shape and sm.grad.shape == sm.shape


def _to(value, device):
    return tuple(t.float().to(device) for t in value) if isinstance(value, tuple) else value.float().to(device)


def _run(fn, tensors, device, **kwargs):
    leaves = [t.detach().clone().to(device).requires_grad_(True) for t in tensors]
    outs = fn(*leaves, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(5)
    grads_out = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype).to(device) for o in outs]
    grads = torch.autograd.grad(outs, leaves, grads_out, allow_unused=True)
    grads = [torch.zeros_like(leaf) if gr is None else gr for gr, leaf in zip(grads, leaves)]
    return [o.detach().cpu() for o in outs] + [gr.cpu() for gr in grads]


def _same(got, want, what, rtol):
    for label, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        assert torch.equal(test(got), test(want)), f"{what}: {label} at different places"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite].to(got.dtype), rtol=rtol, atol=1e-6, msg=what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_conditions_and_inf_as_reference_and_eager(ops, dtype, device):
    module = ops["pointwise"]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=g, dtype=dtype) * 2
    y = torch.randn(4, 32, generator=g, dtype=dtype) * 2
    # ~(NaN > 1) is True, as in torch (sympy's Not would make it NaN <= 1, False); x = ±inf.
    y[0, :4] = float("nan")
    x[0, :4] = torch.tensor([0.5, -0.5, -2.0, 0.5])
    x[1, 0], x[1, 1] = float("inf"), float("-inf")
    got = _run(module.conditions, (x, y), device)
    ref = _run(module.reference, (x, y), "cpu")
    truth = _run(module.reference, (x.double(), y.double()), "cpu")
    eager = module.eager(x, y)
    for name, g_, e in zip(("z", "w"), got, eager):
        _same(g_, e.detach(), f"{name} against eager", rtol=1e-6)
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    for index, (g_, r, t) in enumerate(zip(got, ref, truth)):
        # The op's gradients are 0 where a branch is not taken; autograd through torch.where
        # multiplies that 0 by a NaN y: gradients are compared where y is a number.
        if index >= 2:
            g_, r, t = g_[:, 4:], r[:, 4:], t[:, 4:]
        _same(g_, t, f"result {index} against float64", rtol)
        _same(g_, r, f"result {index} against reference", rtol)
    # x = 0.5, y = NaN: ~(y > 1) holds, so z is x * y, NaN (sympy's Not would have given -inf).
    assert got[0][0, 0].isnan()
    assert got[0][0, 1].item() == float("-inf")  # x = -0.5: neither branch of the condition


def test_masked_softmax_with_minus_inf(ops, device):
    module = ops["rows"]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 40, generator=g, dtype=torch.float64)
    m = torch.randn(3, 40, generator=g, dtype=torch.float64)
    m[:, 0] = 1.0  # every row keeps one element
    got = _run(module.masked_softmax_inf, (x, m), device)
    keep = (m > 0) | (x > 2)
    want = _run(lambda a, b: torch.softmax(a.masked_fill(~keep, float("-inf")), dim=-1), (x, m), "cpu")
    for index, (g_, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g_, w, rtol=1e-12, atol=1e-14, msg=f"result {index}")
    assert (got[0][~keep] == 0).all()


def test_exclusive_bounds_are_checked_at_call_time(ops, device):
    module = ops["pointwise"]
    x = torch.randn(2, 8, device=device)
    for cap, shown in ((0.0, "0.0"), (-1.0, "-1.0"), (100.0, "100.0")):
        with pytest.raises(FusegenArgumentError) as info:
            module.conditions(x, x, cap=cap)
        assert str(info.value) == f"conditions(): cap must be in (0.0, 100.0), got {shown}"
        with pytest.raises(FusegenArgumentError):
            module.Conditions(cap=cap)
    module.conditions(x, x, cap=1e-30)  # just above the bound
    assert "Param cap: float in (0.0, 100.0), default 2.0" in module.__doc__
