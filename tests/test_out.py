"""out=: the op writes into given tensors, as torch ops do; reference does the same."""
import pytest
import torch

import generated.bias_gelu_dropout_add as module
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


@pytest.mark.parametrize("fn", [bias_gelu_dropout_add, reference], ids=["kernel", "reference"])
@pytest.mark.parametrize("alias", ["x", "residual", "shifted_x"])
def test_out_may_share_memory_with_an_input(fn, alias, device):
    """out=x, as torch.add(x, y, out=x) allows. The autotuner runs the kernel several times on
    a shape's first call: were it to write into x, later runs would read their own output."""
    n = 37
    base = torch.randn(5 * n, device=device)
    x, bias, residual = base[: 4 * n].view(4, n), torch.randn(n, device=device), torch.randn(4, n, device=device)
    want = reference(x.clone(), bias, residual.clone(), p=0.2, seed=5)
    out = {"x": x, "residual": residual, "shifted_x": base[n:].view(4, n)}[alias]
    # A new tuning on this call (on the GPU; the interpreter has one config).
    module.bias_gelu_dropout_add_kernel.cache.clear()
    module._OP.kernels._forward._entries.clear()
    assert fn(x, bias, residual, p=0.2, seed=5, out=out) is out
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_output_buffer_is_out_only_when_no_input_shares_its_memory():
    problem = runtime.Problem(torch.Size([4, 8]), 4, 8, torch.float32, torch.float32, torch.device("cpu"))
    base = torch.randn(64)
    out = base[:32].view(4, 8)
    disjoint = (base[32:].view(4, 8), torch.randn(8), base[32:40])
    assert runtime.output_buffer("op", out, 0, 1, problem, disjoint) is out
    for sharing in (out, base[:32].view(4, 8), base[8:40].view(4, 8), base[31:32], base[::2][:8]):
        buffer = runtime.output_buffer("op", out, 0, 1, problem, (*disjoint, sharing))
        assert buffer is not out and buffer.shape == out.shape
    assert runtime.output_buffer("op", out, 0, 1, problem, (base[32:].view(4, 8).expand(2, 4, 8),)) is out


@pytest.mark.parametrize("fn_name", ["add_rmsnorm", "reference"], ids=["kernel", "reference"])
def test_out_targets_torch_refuses_are_refused_before_anything_runs(fn_name, device):
    """A target that requires grad (torch: out= does not support autograd), one whose elements
    share memory (expanded: the copy into it would fail after the kernel ran), and two
    targets that share memory (out=(h, h): h would end up holding y). Under no_grad a
    parameter may be written, as torch allows."""
    import generated.add_rmsnorm as rms
    fn = getattr(rms, fn_name)
    prefix = "add_rmsnorm(): "  # the reference's errors name the op too
    x, r, w = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device), torch.randn(8, device=device)
    h, y = torch.full((4, 8), 7.0, device=device), torch.full((4, 8), 7.0, device=device)
    param = torch.nn.Parameter(torch.full((4, 8), 7.0, device=device))
    both = torch.full((8, 8), 7.0, device=device)
    cases = [
        ((h, h), "out[0] and out[1] share memory"),
        ((both[:5], both[4:]), "out[0] and out[1] share memory"),
        ((torch.zeros(8, device=device).expand(4, 8), y), "out[0] has elements that share memory (an expanded tensor)"),
        ((h, param), "out= does not support autograd (out[1] requires grad)"),
    ]
    for out, message in cases:
        with pytest.raises(runtime.FusegenArgumentError) as error:
            fn(x, r, w, out=out)
        assert str(error.value) == prefix + message
        assert torch.equal(h, torch.full_like(h, 7.0)) and torch.equal(param.detach(), h)  # nothing written
    with torch.no_grad():
        assert fn(x, r, w, out=(h, param))[1] is param
    want = rms.reference(x, r, w)
    torch.testing.assert_close((h, param.detach()), want)
    assert fn(x, r, w, out=(both[:4], both[4:]))[0] is not None  # disjoint parts of one tensor
    torch.testing.assert_close((both[:4], both[4:]), want)
