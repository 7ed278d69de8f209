"""The library's cross_entropy (specs/cross_entropy.yaml), softcap and mish against torch, and
`take(x, target)` (issue 31): values and gradients with each option, an out-of-range target,
large logits, meta tensors, torch.compile, inplace_backward, and take()'s bad uses."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusegen import cli, ir, spec
from fusegen.errors import SpecError
from generated.cross_entropy import CrossEntropy, cross_entropy
from generated.mish import mish
from generated.softcap import softcap

M, N = 6, 37
OPTIONS = {
    "default": {},
    "ignore_index": {"ignore_index": 3},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 5.0},
    "all": {"ignore_index": 3, "label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 4.0},
}


def _inputs(dtype, seed=0, scale=3.0, m=M, n=N, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, n, (m, 1), generator=g)
    target[1 % m] = ignore_index  # torch's default: -100
    target[4 % m] = 3
    return x, target


def _torch_loss(x, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0):
    """F.cross_entropy per row, with Gemma 2's capping first and PaLM's z-loss (Liger's, 0 on
    ignored rows) after; and the log-sum-exp."""
    z = softcap * torch.tanh(x / softcap) if softcap else x
    t = target[:, 0]
    loss = F.cross_entropy(z, t, reduction="none", ignore_index=ignore_index, label_smoothing=label_smoothing)
    lse = torch.logsumexp(z, dim=-1)
    loss = loss + torch.where(t == ignore_index, 0.0, z_loss * lse * lse)
    return loss, lse


CASES = [(o, torch.float64) for o in OPTIONS] + [(o, torch.float32) for o in ("default", "all")]


@pytest.mark.parametrize("option, dtype", CASES, ids=[f"{o}-{str(d)[-2:]}" for o, d in CASES])
def test_cross_entropy_is_torchs(option, dtype, device):
    kwargs = OPTIONS[option]
    x, target = _inputs(dtype, ignore_index=kwargs.get("ignore_index", -100))
    xs = x.to(device).requires_grad_(True)
    loss, lse = cross_entropy(xs, target.to(device), **kwargs)
    assert loss.shape == lse.shape == (M, 1) and loss.dtype == dtype
    x64 = x.double().requires_grad_(True)
    want_loss, want_lse = _torch_loss(x64, target, **kwargs)
    g = torch.Generator().manual_seed(1)
    g_loss, g_lse = torch.randn(M, generator=g, dtype=torch.float64), torch.randn(M, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad((loss[:, 0], lse[:, 0]), xs, (g_loss.to(dtype).to(device), g_lse.to(dtype).to(device)))
    (want,) = torch.autograd.grad((want_loss, want_lse), x64, (g_loss, g_lse))
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(loss[:, 0].detach().cpu().double(), want_loss.detach(), **tol)
    torch.testing.assert_close(lse[:, 0].detach().cpu().double(), want_lse.detach(), **tol)
    torch.testing.assert_close(got.cpu().double(), want, **tol)
    ignored = (target[:, 0] == kwargs.get("ignore_index", -100)).to(device)
    assert ignored.any() and (loss[ignored] == 0).all()
    # An ignored row's gradient is its lse's alone: none from the loss.
    (only_loss,) = torch.autograd.grad(cross_entropy(xs, target.to(device), **kwargs)[0].sum(), xs)
    assert (only_loss[ignored] == 0).all()


def test_mean_loss_as_torch_reduces_it(device):
    """What peers return by default: the mean over the rows that are not ignored."""
    x, target = _inputs(torch.float64, seed=2)
    loss, _ = cross_entropy(x.to(device), target.to(device), label_smoothing=0.1)
    mean = loss.sum() / (target != -100).sum().to(device)
    want = F.cross_entropy(x, target[:, 0], label_smoothing=0.1)
    torch.testing.assert_close(mean.cpu(), want, rtol=1e-12, atol=1e-14)


def test_gradcheck_fp64_every_option(device):
    x, target = _inputs(torch.float64, seed=3, m=4, n=5)
    target[2] = 7  # out of range: picks no logit
    xs = x.to(device).requires_grad_(True)
    kwargs = OPTIONS["all"]
    assert torch.autograd.gradcheck(lambda v: cross_entropy(v, target.to(device), **kwargs), (xs,),
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("option", ["default", "softcap"])
def test_reference_gradient_is_torchs(option, device):
    """The eager reference's own autograd (the oracle of the generated backward): with softcap
    off it takes x as it is, never x / 0's NaN through the side of the where not taken."""
    from generated.cross_entropy import reference

    x, target = _inputs(torch.float64, seed=5)
    x, target = x.to(device), target.to(device)
    ours, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    reference(ours, target, **OPTIONS[option])[0].sum().backward()
    _torch_loss(theirs, target, **OPTIONS[option])[0].sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)


def test_out_of_range_target_picks_no_logit(device):
    """A target outside [0, N) other than ignore_index (torch raises there) is the spec's
    business: take() gives 0.0, nothing is read out of bounds, so loss = lse and its
    gradient is the softmax."""
    x, _ = _inputs(torch.float64, seed=4, m=3, n=8)
    target = torch.tensor([[-1], [8], [10**12]])
    xs = x.to(device).requires_grad_(True)
    loss, lse = cross_entropy(xs, target.to(device))
    want = torch.logsumexp(x, -1, keepdim=True)
    torch.testing.assert_close(loss.detach().cpu(), want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lse.detach().cpu(), want, rtol=1e-12, atol=1e-14)
    (grad,) = torch.autograd.grad(loss.sum(), xs)
    torch.testing.assert_close(grad.cpu(), torch.softmax(x, -1), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("scale", [1e4, 1e-6])
def test_large_and_tiny_logits(scale, device):
    x, target = _inputs(torch.float32, seed=5, scale=scale)
    xs = x.to(device).requires_grad_(True)
    loss, lse = cross_entropy(xs, target.to(device), label_smoothing=0.1)
    (grad,) = torch.autograd.grad(loss.sum(), xs)
    assert torch.isfinite(loss).all() and torch.isfinite(lse).all() and torch.isfinite(grad).all()
    x64 = x.double().requires_grad_(True)
    want, _ = _torch_loss(x64, target, label_smoothing=0.1)
    (want_grad,) = torch.autograd.grad(want.sum(), x64)
    torch.testing.assert_close(loss[:, 0].detach().cpu().double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=1e-5, atol=1e-6)


def test_a_looped_row(device):
    """A row wider than one tile (16384): the forward's online max and sum along the loop."""
    x, target = _inputs(torch.float32, seed=6, m=1, n=17000)
    xs = x.to(device).requires_grad_(True)
    loss, lse = cross_entropy(xs, target.to(device), label_smoothing=0.1, z_loss=1e-3)
    (grad,) = torch.autograd.grad(loss.sum(), xs)
    x64 = x.double().requires_grad_(True)
    want, want_lse = _torch_loss(x64, target, label_smoothing=0.1, z_loss=1e-3)
    (want_grad,) = torch.autograd.grad(want.sum(), x64)
    torch.testing.assert_close(loss[:, 0].detach().cpu().double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[:, 0].detach().cpu().double(), want_lse.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=1e-5, atol=1e-8)


def test_inplace_backward_writes_the_gradient_into_the_logits(device):
    """Liger's trick: the logits' gradient where the logits were (they are not read again)."""
    x, target = _inputs(torch.float32, seed=7)
    target = target.to(device)

    def step(in_place):
        x0 = x.to(device).requires_grad_(True)
        logits = x0 * 1.0  # a producer's output: no leaf, so it may be written
        seen = []
        logits.register_hook(seen.append)
        loss, _ = cross_entropy(logits, target, z_loss=1e-3, inplace_backward=in_place)
        loss.sum().backward()
        return seen[0], logits, x0.grad

    step(True)  # on a GPU the first call with a call key tunes: never in place
    grad, logits, grad_x0 = step(True)
    want, _, want_x0 = step(False)
    assert grad.data_ptr() == logits.data_ptr() and want.data_ptr() != logits.data_ptr()
    assert torch.equal(grad, want) and torch.equal(grad_x0, want_x0)


def test_module_and_meta_tensors():
    assert "label_smoothing=0.1" in repr(CrossEntropy(label_smoothing=0.1))
    x = torch.empty(2, 3, N, device="meta", dtype=torch.bfloat16, requires_grad=True)
    loss, lse = CrossEntropy(z_loss=1e-4)(x, torch.empty(2, 3, 1, dtype=torch.int64, device="meta"))
    assert loss.shape == lse.shape == (2, 3, 1) and loss.device.type == "meta" and loss.dtype == torch.bfloat16
    (grad,) = torch.autograd.grad(loss.float().sum(), x)
    assert grad.shape == x.shape and grad.device.type == "meta"


def test_compile_fullgraph(device):
    x, target = _inputs(torch.float64, seed=8)
    target = target.to(device)

    def step(fn):
        xs = x.to(device).requires_grad_(True)
        loss, lse = fn(xs, target, label_smoothing=0.1, softcap=3.0)
        (grad,) = torch.autograd.grad(loss.sum() + lse.sum(), xs)
        return loss.detach(), grad

    torch._dynamo.reset()
    # aot_eager: the graph traced whole, without compiling the CPU code around the op.
    compiled = torch.compile(cross_entropy, fullgraph=True, backend="aot_eager")
    for got, want in zip(step(compiled), step(cross_entropy)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_bad_params_are_one_line(device):
    from fusegen.runtime import FusegenArgumentError

    x, target = (t.to(device) for t in _inputs(torch.float32))
    for kwargs, message in (({"label_smoothing": 1.0}, "label_smoothing must be in [0.0, 1.0)"),
                            ({"softcap": -1.0}, "softcap must be ≥ 0.0")):
        with pytest.raises(FusegenArgumentError, match=message.replace("[", r"\[").replace(")", r"\)")):
            cross_entropy(x, target, **kwargs)


# ---------------------------------------------------------------------------
# softcap and mish


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_softcap_and_mish_are_torchs(dtype, device):
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(3, 41, generator=g, dtype=torch.float64) * 20).to(dtype)
    grad_out = torch.randn(3, 41, generator=g, dtype=torch.float64).to(dtype)
    x64 = x.double().requires_grad_(True)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    for fn, want_fn in ((lambda v: softcap(v, cap=7.5), lambda v: 7.5 * torch.tanh(v / 7.5)), (mish, F.mish)):
        xs = x.to(device).requires_grad_(True)
        y = fn(xs)
        (grad,) = torch.autograd.grad(y, xs, grad_out.to(device))
        want = want_fn(x64)
        (want_grad,) = torch.autograd.grad(want, x64, grad_out.double())
        torch.testing.assert_close(y.detach().cpu().double(), want.detach(), **tol)
        torch.testing.assert_close(grad.cpu().double(), want_grad, **tol)


def test_softcap_cap_must_be_positive(device):
    from fusegen.runtime import FusegenArgumentError

    with pytest.raises(FusegenArgumentError, match="cap must be > 0.0, got 0.0"):
        softcap(torch.randn(4, device=device), cap=0.0)


# ---------------------------------------------------------------------------
# take()


def _ir(tmp_path, expr, inputs="  x: [..., N]\n  t: {dims: [..., 1], dtype: int64}\n"):
    path = tmp_path / "x.yaml"
    path.write_text(f"name: op\ndoc: d\ninputs:\n{inputs}outputs:\n  y: {expr}\n", encoding="utf-8")
    return ir.build_ir(spec.load_spec(path))


def test_take_is_the_sum_of_the_one_hot(tmp_path):
    taken = _ir(tmp_path, "take(x * 2.0, t)").outputs
    summed = _ir(tmp_path, "sum(where(col == t, x * 2.0, 0.0))").outputs
    assert taken == summed
    assert ir.unparse(taken[0][1]) == "sum(where(col == t, x * 2.0, 0.0))"


BAD_TAKES = [
    ("arity", "take(x)", "take() takes 2 arguments, got 1"),
    ("float_target", "take(x, x)", "take's second argument must be the name of an integer input with one index "
                                   "per row, as target: {dims: [..., 1], dtype: int64}; got x"),
    ("expression_target", "take(x, t + 1)", "take's second argument must be the name of an integer input"),
    ("row_wide_target", "take(x, u)", "take's second argument must be the name of an integer input"),
    ("constant_along_row", "take(max(x), t)", "take(max(x), t) picks an element along the last dim, along which its "
                                              "first argument is constant"),
    ("keyword", "take(x, target=t)", "take(...) takes positional arguments only"),
]


@pytest.mark.parametrize("expr, message", [c[1:] for c in BAD_TAKES], ids=[c[0] for c in BAD_TAKES])
def test_bad_takes_are_one_line_file_line_errors(tmp_path, expr, message):
    path = tmp_path / "x.yaml"
    path.write_text(
        "name: op\ndoc: d\ninputs:\n  x: [..., N]\n  t: {dims: [..., 1], dtype: int64}\n"
        "  u: {dims: [..., N], dtype: int64}\noutputs:\n"
        f"  y: {expr} + sum(where(u == 0, x, 0.0)) + sum(where(t == 0, x, 0.0))\n",
        encoding="utf-8",
    )
    with pytest.raises(SpecError) as info:
        cli.build_op(path)
    text = str(info.value)
    assert "x.yaml:8: " in text and message in text and "\n" not in text


def test_one_pass_forward_and_no_row_sum_in_the_backward():
    """The forward reads each row once (the max, the online Σ exp, Σ z and the target's
    logit in one pass); the backward needs no row sum of its own (the loss's adjoints are read
    from one incoming gradient per row, and the max's cancels exactly), so it reads the logits
    once, in the pass that writes their gradient."""
    from pathlib import Path

    simplified = cli.build_op(Path(__file__).resolve().parent.parent / "specs" / "cross_entropy.yaml").simplified
    forward, backward = simplified.forward, simplified.backward
    (only,) = forward.passes
    assert sorted(r.op for r in only.reductions) == ["max", "mean", "sum", "sum"]
    assert [r.running is not None for r in only.reductions if r.op == "sum"].count(True) == 1  # online
    assert backward.passes == () and len(backward.loaded) == 2  # the max and Σ exp, kept by the forward
