"""Gated units from a chunked input ([..., 2N] → [..., N]) against hand-written torch oracles."""
import pytest
import torch
import torch.nn.functional as F

from generated.bias_geglu import bias_geglu
from generated.bias_swiglu import bias_swiglu
from generated.geglu import geglu
from generated.swiglu import swiglu

GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}


def _oracle(x, bias, act):
    a, b = (x if bias is None else x + bias).chunk(2, dim=-1)
    return act(a) * b


def _cases():
    silu = F.silu
    yield "swiglu", lambda x, b: swiglu(x), lambda x, b: _oracle(x, None, silu), False
    yield "bias_swiglu", bias_swiglu, lambda x, b: _oracle(x, b, silu), True
    for name, approximate in GELU_APPROXIMATE.items():
        gelu = lambda t, a=approximate: F.gelu(t, approximate=a)  # noqa: E731
        yield f"geglu-{name}", lambda x, b, n=name: geglu(x, activation=n), lambda x, b, g=gelu: _oracle(x, None, g), False
        yield (
            f"bias_geglu-{name}",
            lambda x, b, n=name: bias_geglu(x, b, activation=n),
            lambda x, b, g=gelu: _oracle(x, b, g),
            True,
        )


@pytest.mark.parametrize("name, op, oracle, has_bias", list(_cases()), ids=[c[0] for c in _cases()])
@pytest.mark.parametrize("shape", [(3, 34), (2, 5, 2000), (2,)])
def test_gated_unit_matches_oracle_forward_and_backward(name, op, oracle, has_bias, shape, device):
    torch.manual_seed(0)
    x = torch.randn(shape, device=device, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(shape[-1], device=device, dtype=torch.float64, requires_grad=True) if has_bias else None
    inputs = [t for t in (x, bias) if t is not None]
    y = op(x.float().detach().requires_grad_(), None if bias is None else bias.float())
    want = oracle(x, bias)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == torch.float32
    assert (y.double() - want).norm() <= 1e-6 * want.norm()
    # Gradients in float64 (the kernels compute in fp64 for fp64 inputs).
    grad = torch.randn_like(want)
    got = torch.autograd.grad(op(x, bias), inputs, grad)
    expected = torch.autograd.grad(oracle(x, bias), inputs, grad)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        assert (g - e).norm() <= 1e-10 * e.norm()


def test_chunked_input_with_odd_width_is_rejected(device):
    with pytest.raises(ValueError, match=r"swiglu\(\): x must have shape \[\.\.\., 2N\], got \[3, 5\] \(5 is not a multiple of 2\)"):
        swiglu(torch.randn(3, 5, device=device))
