"""out=: the op writes into given tensors, as torch ops do; reference does the same."""
import pytest
import torch

from generated.bias_gelu_dropout_add import bias_gelu_dropout_add, reference
from fusegen import runtime


def _inputs(device):
    torch.manual_seed(0)
    return torch.randn(4, 33, device=device), torch.randn(33, device=device), torch.randn(4, 33, device=device)


@pytest.mark.parametrize("fn", [bias_gelu_dropout_add, reference], ids=["kernel", "reference"])
def test_out_contiguous_and_strided(fn, device):
    x, bias, residual = _inputs(device)
    want = fn(x, bias, residual, p=0.2, seed=5)
    out = torch.full((4, 33), float("nan"), device=device)
    assert fn(x, bias, residual, p=0.2, seed=5, out=out) is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    strided = torch.full((33, 4), float("nan"), device=device).t()  # not contiguous: written through a copy
    assert fn(x, bias, residual, p=0.2, seed=5, out=strided) is strided
    torch.testing.assert_close(strided, want, rtol=0, atol=0)


def test_out_checks(device):
    x, bias, residual = _inputs(device)
    with pytest.raises(runtime.FusegenArgumentError, match=r"out must be torch.float32 \[4, 33\] on .*, got torch.float16 \[4, 33\]"):
        bias_gelu_dropout_add(x, bias, residual, out=torch.empty(4, 33, dtype=torch.float16, device=device))
    with pytest.raises(runtime.FusegenArgumentError, match=r"out must be torch.float32 \[4, 33\] on .*, got torch.float32 \[4, 32\]"):
        bias_gelu_dropout_add(x, bias, residual, out=torch.empty(4, 32, device=device))
    with pytest.raises(runtime.FusegenArgumentError, match=r"out= does not support autograd"):
        bias_gelu_dropout_add(x.requires_grad_(), bias, residual, out=torch.empty(4, 33, device=device))
