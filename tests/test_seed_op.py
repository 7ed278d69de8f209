"""bias_gelu_dropout_add against oracles that owe nothing to fusegen's generated code:
torch.nn.functional for the activations, hand-computed golden numbers, and dropout
statistics; plus its seeds, its p range and its error without a GPU or interpreter."""
from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from fusegen import runtime
from fusegen.backends.triton import interpreter

mod = importlib.import_module("generated.bias_gelu_dropout_add")
op = mod.bias_gelu_dropout_add
reference = mod.reference
INPUTS = (runtime.Input("x", ("...", "N")), runtime.Input("bias", ("N",)), runtime.Input("residual", ("...", "N")))

ORACLES = {
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "gelu": lambda z: F.gelu(z, approximate="none"),
    "relu": F.relu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "identity": lambda z: z,
}
ACTIVATIONS = list(next(p for p in mod._OP.params if p.name == "activation").choices)


def _inputs(shape=(6, 33), dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*s):
        return torch.randn(s, generator=g, dtype=torch.float64).to(dtype).to(device)

    return randn(*shape), randn(shape[-1]), randn(*shape)


def _problem(x, bias, residual):
    return runtime.broadcast_problem("bias_gelu_dropout_add", INPUTS, (x, bias, residual))


def _mask(seed, x, bias, residual, p):
    return runtime.dropout_mask_reference(seed, _problem(x, bias, residual), 0, p)


def _oracle(x, bias, residual, activation, mask=None):
    """In float64: activation(x + bias) * mask + residual, by torch.nn.functional."""
    z = ORACLES[activation](x.double() + bias.double())
    if mask is not None:
        z = z * mask.double()
    return z + residual.double()


def _rel(a, b):
    return (torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double())).item()


def test_every_activation_has_an_oracle():
    assert set(ACTIVATIONS) <= set(ORACLES), f"no oracle for {set(ACTIVATIONS) - set(ORACLES)}"


# ---------------------------------------------------------------------------
# Values against torch.nn.functional


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_functional_oracle_p0(activation, device):
    x, bias, residual = _inputs(device=device)
    y = op(x, bias, residual, p=0.0, activation=activation)
    expected = _oracle(x, bias, residual, activation)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert _rel(y, expected) <= 1e-6
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-6)
    # training=False is the same computation.
    torch.testing.assert_close(op(x, bias, residual, p=0.4, activation=activation, training=False), y, rtol=0, atol=0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_functional_oracle_with_dropout(activation, device):
    """y = oracle(x + b) * M + residual, M drawn by fusegen.runtime.dropout_mask_reference;
    and the gradients are those of that expression (autograd through F.*, in float64)."""
    p, seed = 0.3, 1234
    x, bias, residual = _inputs(device=device)
    mask = _mask(seed, x, bias, residual, p)
    assert set(mask.unique().tolist()) == {0.0, float(torch.tensor(1 / (1 - p), dtype=torch.float32))}

    xl, bl, rl = (t.clone().requires_grad_(True) for t in (x, bias, residual))
    y = op(xl, bl, rl, p=p, activation=activation, seed=seed)
    x64, b64, r64 = (t.detach().double().requires_grad_(True) for t in (x, bias, residual))
    expected = _oracle(x64, b64, r64, activation, mask)
    assert _rel(y, expected) <= 1e-6
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-6)

    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(device)
    got = torch.autograd.grad(y, (xl, bl, rl), grad_y)
    want = torch.autograd.grad(expected, (x64, b64, r64), grad_y.double())
    for name, g, w in zip(("x", "bias", "residual"), got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        assert _rel(g, w) <= 1e-5, f"grad {name}: {_rel(g, w):.3g}"
    assert (got[0][mask == 0] == 0).all(), "gradient flows through dropped elements"


def test_identity_gradient_is_grad_y_times_mask(device):
    p, seed = 0.5, 77
    x, bias, residual = (t.requires_grad_(True) for t in _inputs(device=device))
    y = op(x, bias, residual, p=p, activation="identity", seed=seed)
    mask = _mask(seed, x, bias, residual, p)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(device)
    gx, gb, gr = torch.autograd.grad(y, (x, bias, residual), grad_y)
    assert torch.equal(gx, grad_y * mask)
    torch.testing.assert_close(gb, (grad_y * mask).sum(0), rtol=1e-6, atol=1e-6)
    assert torch.equal(gr, grad_y)


# ---------------------------------------------------------------------------
# Golden values, computed with Python's math module (see the formulas in the comments):
# z = x + bias = [0.6, -0.8, 1.7]; y = f(z) + 1.
#   gelu_tanh: 0.5*z*(1 + tanh(sqrt(2/pi)*(z + 0.044715*z**3)))
#   gelu:      0.5*z*(1 + erf(z/sqrt(2)))
#   silu:      z/(1 + exp(-z));  sigmoid: 1/(1 + exp(-z));  relu: max(z, 0)

GOLDEN_X = [[0.5, -1.0, 2.0]]
GOLDEN_BIAS = [0.1, 0.2, -0.3]
GOLDEN_RESIDUAL = [[1.0, 1.0, 1.0]]
GOLDEN_Y = {
    "gelu_tanh": [1.4354151992308148, 0.8304316914364481, 2.624105895551156],
    "gelu": [1.435448129349956, 0.8305156811332827, 2.6242387133104765],
    "silu": [1.3873937837354773, 0.7519795849020899, 2.437409049357991],
    "sigmoid": [1.6456563062257954, 1.3100255188723875, 1.8455347349164652],
    "relu": [1.6, 1.0, 2.7],
    "identity": [1.6, 0.2, 2.7],
}


def test_golden_literals_follow_their_formulas():
    """The literals above, recomputed from the formulas (guards against a typo)."""
    c = math.sqrt(2 / math.pi)
    formulas = {
        "gelu_tanh": lambda z: 0.5 * z * (1 + math.tanh(c * (z + 0.044715 * z**3))),
        "gelu": lambda z: 0.5 * z * (1 + math.erf(z / math.sqrt(2))),
        "silu": lambda z: z / (1 + math.exp(-z)),
        "sigmoid": lambda z: 1 / (1 + math.exp(-z)),
        "relu": lambda z: max(z, 0.0),
        "identity": lambda z: z,
    }
    zs = [x + b for x, b in zip(GOLDEN_X[0], GOLDEN_BIAS)]
    for name, values in GOLDEN_Y.items():
        for z, v in zip(zs, values):
            assert math.isclose(formulas[name](z) + 1.0, v, rel_tol=1e-15, abs_tol=1e-15), name


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("activation", sorted(GOLDEN_Y))
def test_golden_values(activation, dtype, rtol, device):
    x = torch.tensor(GOLDEN_X, dtype=dtype, device=device)
    bias = torch.tensor(GOLDEN_BIAS, dtype=dtype, device=device)
    residual = torch.tensor(GOLDEN_RESIDUAL, dtype=dtype, device=device)
    y = op(x, bias, residual, p=0.0, activation=activation)
    want = torch.tensor([GOLDEN_Y[activation]], dtype=torch.float64)
    assert y.dtype == dtype and y.shape == (1, 3)
    torch.testing.assert_close(y.cpu().double(), want, rtol=rtol, atol=rtol)


# ---------------------------------------------------------------------------
# Dropout statistics


def _within_sigmas(kept: int, n: int, p: float, sigmas=5.0) -> bool:
    mean, sd = n * (1 - p), math.sqrt(n * p * (1 - p))
    return abs(kept - mean) <= sigmas * sd


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics_reference_mask(p):
    """64k elements of the host mask (bit-identical to the kernel's, tested below)."""
    m, n = 256, 256
    x = torch.empty(m, n)
    b = torch.empty(n)
    for seed in (0, 2**31 + 17):
        mask = _mask(seed, x, b, x, p)
        kept = mask != 0
        assert _within_sigmas(int(kept.sum()), m * n, p), f"kept {int(kept.sum())} of {m * n} at p={p}"
        # Every row and every column drops too, at about the right rate (no striping).
        for part in (kept[: m // 2], kept[m // 2:], kept[:, : n // 2], kept[:, n // 2:]):
            assert _within_sigmas(int(part.sum()), part.numel(), p)
        # Neighbouring rows and columns are independent: they agree at p^2 + (1-p)^2.
        agree = p * p + (1 - p) * (1 - p)
        for a, c in ((kept[1:], kept[:-1]), (kept[:, 1:], kept[:, :-1])):
            same = int((a == c).sum())
            assert _within_sigmas(same, a.numel(), 1 - agree), f"neighbours agree {same / a.numel():.3f}, want {agree:.3f}"
        assert set(mask.unique().tolist()) == {0.0, float(torch.tensor(1 / (1 - p), dtype=torch.float32))}


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics_kernel(p, device):
    x, bias, residual = _inputs((8, 512), device=device, seed=3)
    seed = 4321
    y = op(x, bias, residual, p=p, activation="identity", seed=seed)
    z = x + bias
    dropped = y == residual
    kept_count = int((~dropped).sum())
    assert _within_sigmas(kept_count, y.numel(), p), f"kept {kept_count} of {y.numel()} at p={p}"
    # Kept values are scaled by 1/(1-p); dropped ones contribute exactly nothing.
    scale = (y - residual)[~dropped] / z[~dropped]
    torch.testing.assert_close(scale, torch.full_like(scale, 1 / (1 - p)), rtol=1e-4, atol=0)
    # The kernel's mask is the host's, bit for bit.
    mask = _mask(seed, x, bias, residual, p)
    assert torch.equal(dropped, mask == 0)


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1, 2**31 + 5, 2**32, 2**40 + 3, 2**63 - 1])
def test_kernel_mask_equals_host_mask_for_any_seed(seed, device):
    x, bias, residual = _inputs((5, 40), device=device, seed=4)
    y = op(x, bias, residual, p=0.5, activation="identity", seed=seed)
    mask = _mask(seed, x, bias, residual, 0.5)
    assert torch.equal(y == residual, mask == 0), f"seed {seed}: kernel and host masks differ"


# ---------------------------------------------------------------------------
# Seeds


def test_same_seed_same_output_different_seeds_differ(device):
    x, bias, residual = _inputs(device=device)
    a = op(x, bias, residual, p=0.5, seed=11)
    b = op(x, bias, residual, p=0.5, seed=11)
    c = op(x, bias, residual, p=0.5, seed=12)
    assert torch.equal(a, b)
    dropped_a, dropped_c = a == residual, c == residual
    differ = int((dropped_a != dropped_c).sum())
    # Independent masks at p = 0.5 disagree on about half the elements.
    assert _within_sigmas(differ, a.numel(), 0.5), f"masks of seeds 11 and 12 differ at {differ} of {a.numel()}"


def test_seed_none_draws_from_torch_generator(device):
    x, bias, residual = _inputs(device=device)
    torch.manual_seed(2024)
    first = op(x, bias, residual, p=0.5)
    again = op(x, bias, residual, p=0.5)
    assert not torch.equal(first, again), "two unseeded runs drew the same mask"
    torch.manual_seed(2024)
    replay = op(x, bias, residual, p=0.5)
    assert torch.equal(first, replay)
    torch.manual_seed(2024)
    drawn = runtime.seed_tensor(None, x.device, eager=True)  # the op draws its seed so, on its device
    assert torch.equal(op(x, bias, residual, p=0.5, seed=int(drawn)), first)
    torch.manual_seed(2024)
    torch.testing.assert_close(reference(x, bias, residual, p=0.5), first, rtol=1e-6, atol=1e-6)


def test_seed_none_backward_uses_the_forward_mask(device):
    """The seed drawn in forward is the one the backward draws its mask from again."""
    x, bias, residual = (t.requires_grad_(True) for t in _inputs(device=device))
    torch.manual_seed(5)
    y = op(x, bias, residual, p=0.5, activation="identity")
    torch.manual_seed(5)
    mask = _mask(runtime.seed_tensor(None, x.device, eager=True), x, bias, residual, 0.5)
    torch.manual_seed(99)  # the generator moves on between forward and backward
    grad_y = torch.randn(y.shape).to(device)
    gx, = torch.autograd.grad(y, (x,), grad_y)
    assert torch.equal(gx, grad_y * mask)


# ---------------------------------------------------------------------------
# p's range


@pytest.mark.parametrize("activation", ["gelu_tanh", "identity"])
def test_p_one_gives_residual(activation, device):
    x, bias, residual = (t.requires_grad_(True) for t in _inputs(device=device))
    y = op(x, bias, residual, p=1.0, activation=activation, seed=3)
    assert torch.equal(y, residual.detach())
    assert torch.equal(reference(x, bias, residual, p=1.0, activation=activation, seed=3), residual.detach())
    gx, gb, gr = torch.autograd.grad(y, (x, bias, residual), torch.ones_like(y))
    assert torch.equal(gx, torch.zeros_like(gx)) and torch.equal(gb, torch.zeros_like(gb))
    assert torch.equal(gr, torch.ones_like(gr))


@pytest.mark.parametrize("p", [-0.1, 1.0001, 2.0, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("fn", [op, reference], ids=["op", "reference"])
def test_p_outside_range_raises(fn, p, device):
    x, bias, residual = _inputs((2, 3), device=device)
    with pytest.raises(runtime.FusegenArgumentError, match=r"\bp\b"):
        fn(x, bias, residual, p=p)
    assert issubclass(runtime.FusegenArgumentError, ValueError)


def test_p_as_a_tensor(device):
    x, bias, residual = _inputs(device=device)
    want = op(x, bias, residual, p=0.25, seed=8)
    assert torch.equal(op(x, bias, residual, p=torch.tensor(0.25), seed=8), want)


@pytest.mark.parametrize("p", [True, "0.1", None])
def test_p_of_wrong_type_raises(p, device):
    x, bias, residual = _inputs((2, 3), device=device)
    with pytest.raises(runtime.FusegenArgumentError, match="p must be a number"):
        op(x, bias, residual, p=p)


def test_unknown_activation_raises(device):
    x, bias, residual = _inputs((2, 3), device=device)
    with pytest.raises(runtime.FusegenArgumentError, match="activation must be one of"):
        op(x, bias, residual, activation="tanh")


# ---------------------------------------------------------------------------
# CPU tensors without the interpreter


def test_cpu_without_interpreter_raises_clear_error(monkeypatch):
    x, bias, residual = _inputs((2, 3), device="cpu")
    # As without TRITON_INTERPRET: kernels built for CUDA (tests/test_interpreter_env.py runs that for real).
    monkeypatch.setattr(interpreter, "is_interpreting", lambda: False)
    monkeypatch.setattr(interpreter, "kernel_is_interpreted", lambda kernel: False)
    message = r"tensors are on cpu, but the Triton kernel needs a CUDA device; set TRITON_INTERPRET=1"
    with pytest.raises(runtime.FusegenArgumentError, match=message):
        op(x, bias, residual, seed=1)
    # reference needs no kernel: it still runs.
    assert reference(x, bias, residual, seed=1).shape == x.shape


# ---------------------------------------------------------------------------
# 64-bit offsets (GPU only: the tensors are 4 GiB each)


def _keep_for_rows(seed, rows, cols, n, stream, p):
    """Which elements (rows [R, 1] x cols [1, C], int64) of an [M, n] problem dropout keeps:
    runtime.dropout_keep at their flat indices row * n + col, for any rows, not only those
    a host tensor of all 2**31 elements could hold. Written out here (word i % 4 of
    Philox4x32-10 keyed by seed with counter (i // 4 low, high, stream, 0)) so that the
    formula is pinned independently of fusegen's own."""
    from fusegen.runtime.philox import philox4x32

    index = rows * n + cols
    groups = index >> 2
    zero = torch.zeros_like(groups)
    words = philox4x32(seed, groups & 0xFFFFFFFF, groups >> 32, zero + stream, zero)
    r = torch.stack(words, dim=-1).gather(-1, (index & 3).unsqueeze(-1)).squeeze(-1)
    return (r >> 8) >= runtime.dropout_threshold(p)


@pytest.mark.parametrize("n", [70, 64, 1, 3])
def test_flat_index_mask_formula_matches_reference(n):
    """The GPU test below draws masks for rows past 2**31 / N by _keep_for_rows: it must be
    dropout_mask_reference's formula (checked here, on rows 0..M-1, where both apply)."""
    x = torch.empty(9, n)
    rows = torch.arange(9, dtype=torch.int64)[:, None]
    cols = torch.arange(n, dtype=torch.int64)[None, :]
    for seed, p in [(5, 0.1), (2**33 + 7, 0.5)]:
        assert torch.equal(_keep_for_rows(seed, rows, cols, n, 0, p), _mask(seed, x, x[0], x, p) != 0)


@pytest.mark.gpu
def test_int64_offsets_past_2_31(device):
    """More than 2**31 elements: the launcher must switch to 64-bit index math (INDEX_64),
    and the dropout counter must carry the flat index's high bits, in forward and in backward."""
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs about 30 GiB of GPU memory")
    n = 4096
    m = 2**31 // n + 3
    assert m * n >= 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.float16, generator=g).requires_grad_(True)
    bias = torch.randn(n, device="cuda", dtype=torch.float16, generator=g)
    residual = torch.randn(n, device="cuda", dtype=torch.float16, generator=g)  # broadcast: stride 0
    p, seed = 0.1, 2**33 + 7
    rows = [0, 1, m // 2, m - 3, m - 2, m - 1]  # the last rows start past element 2**31

    def host_mask(selected):
        r_idx = torch.tensor(selected, dtype=torch.int64, device="cuda")[:, None]
        c_idx = torch.arange(n, dtype=torch.int64, device="cuda")[None, :]
        keep = _keep_for_rows(seed, r_idx, c_idx, n, 0, p)
        return torch.where(keep, torch.tensor(runtime.dropout_scale(p), dtype=torch.float32, device="cuda"), 0.0)

    mask = host_mask(rows)
    y = op(x, bias, residual, p=p, activation="identity", seed=seed)
    assert y.shape == (m, n) and not torch.isnan(y).any()
    want = (mask * (x[rows].float() + bias.float()) + residual.float()).half()
    torch.testing.assert_close(y[rows], want, rtol=2e-3, atol=2e-3)
    grad_y = torch.randn(m, n, device="cuda", dtype=torch.float16, generator=g)
    gx, = torch.autograd.grad(y, (x,), grad_y)
    assert torch.equal(gx[rows], (grad_y[rows].float() * mask).half())
    del y, gx
    # Row-broadcast sums over > 2**31 elements (p = 0: grad_bias = grad_y summed over rows).
    b = bias.clone().requires_grad_(True)
    y = op(x.detach(), b, residual, p=0.0, activation="identity")
    gb, = torch.autograd.grad(y, (b,), grad_y)
    torch.testing.assert_close(gb.float(), grad_y.float().sum(0), rtol=2e-3, atol=0.5)
