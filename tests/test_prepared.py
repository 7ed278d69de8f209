"""The prepared path (fusegen.runtime.prepared): a call key's checks and launches are
worked out once; later calls with that key launch with new data, and stay as correct and as
strict as the first."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fusegen import runtime
from fusegen.runtime.prepared import call_key
from helpers import op_by_name

SEED_OP = op_by_name("bias_gelu_dropout_add").module
SWIGLU = op_by_name("swiglu").module
LAYERNORM = op_by_name("layernorm").module


def _randn(*shape, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)


def test_a_call_key_is_prepared_once_and_new_data_flows_through(device):
    op = SEED_OP._OP
    op._prepared.clear()
    for step in range(4):
        x, residual = _randn(3, 5, 40, seed=step, device=device), _randn(3, 5, 40, seed=10 + step, device=device)
        bias = _randn(40, seed=20 + step, device=device)
        y = SEED_OP.bias_gelu_dropout_add(x, bias, residual, p=0.25, seed=step)
        truth = SEED_OP.reference(x.double(), bias.double(), residual.double(), p=0.25, seed=step)
        torch.testing.assert_close(y.double(), truth, rtol=1e-5, atol=1e-5)
    assert len(op._prepared) == 1  # explicit seeds are checked per call, not keyed


def test_what_the_kernels_depend_on_makes_a_new_call_key(device):
    x = _randn(4, 32, seed=1, device=device)
    base = call_key((x,), 1, None)
    storage = _randn(4 * 32 + 4, seed=2, device=device)
    assert call_key((storage[:128].view(4, 32),), 1, None) == base
    for other in (x.double(), x.t().contiguous().t(), x[:, :16], storage[1:129].view(4, 32), x.view(2, 2, 32)):
        assert call_key((other,), 1, None) != base
    assert call_key((x, 1.0), 1, None) != call_key((x, 1), 1, None) != call_key((x, True), 1, None)
    # What the prepared path does not take: subclasses, params given as tensors.
    assert call_key((torch.nn.Parameter(x),), 1, None) is not None
    assert call_key((x, torch.tensor(0.5)), 1, None) is None

    class Sub(torch.Tensor):
        pass

    assert call_key((x.as_subclass(Sub),), 1, None) is None


def test_bad_arguments_fail_on_a_prepared_call_key_too(device):
    x, bias, residual = _randn(2, 8, seed=1, device=device), _randn(8, seed=2, device=device), _randn(2, 8, seed=3, device=device)
    SEED_OP.bias_gelu_dropout_add(x, bias, residual, p=0.1, seed=5)
    with pytest.raises(runtime.FusegenArgumentError, match="seed must be"):
        SEED_OP.bias_gelu_dropout_add(x, bias, residual, p=0.1, seed=-1)
    with pytest.raises(runtime.FusegenArgumentError, match="seed must be"):
        SEED_OP.bias_gelu_dropout_add(x, bias, residual, p=0.1, seed=2.5)
    # Without dropout the seed is never read, and still checked, as the full path checks it.
    SEED_OP.bias_gelu_dropout_add(x, bias, residual, p=0.1, training=False, seed=5)
    for bad in (-1, 2.5):
        with pytest.raises(runtime.FusegenArgumentError, match="seed must be"):
            SEED_OP.bias_gelu_dropout_add(x, bias, residual, p=0.1, training=False, seed=bad)
    SEED_OP.bias_gelu_dropout_add(x, bias, residual, p=1, seed=5)
    with pytest.raises(runtime.FusegenArgumentError, match="p must be a number"):
        SEED_OP.bias_gelu_dropout_add(x, bias, residual, p=True, seed=5)
    # A param given as a tensor takes the full path, and its value is read every call.
    for p in (0.0, 1.0):
        y = SEED_OP.bias_gelu_dropout_add(x, bias, residual, p=torch.tensor(p), seed=5)
        expected = residual if p == 1.0 else SEED_OP.reference(x, bias, residual, p=0.0, seed=5)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_prepared_launches_keep_no_tensor_alive(device):
    x = _randn(3, 16, seed=4, device=device).requires_grad_(True)
    weight, bias = _randn(16, seed=5, device=device), _randn(16, seed=6, device=device)
    y = LAYERNORM.layernorm(x, weight, bias)
    y.sum().backward()
    probes = [weakref.ref(t) for t in (x, weight, bias, y, x.grad)]
    del x, weight, bias, y
    gc.collect()
    assert all(probe() is None for probe in probes)


def test_broadcasts_copied_per_call_take_each_calls_data(device):
    """[B, 1, N] against [B, S, N] cannot merge into one row stride: the [M, N] view is a
    copy, made per call from that call's tensor."""
    op = op_by_name("scale_add").module
    for step in range(3):
        x = _randn(2, 3, 8, seed=step, device=device)
        scale = _randn(2, 1, 1, seed=5 + step, device=device)
        residual = _randn(2, 1, 8, seed=9 + step, device=device)
        torch.testing.assert_close(op.scale_add(x, scale, residual), op.reference(x, scale, residual))


def test_backward_keys_follow_the_incoming_gradient(device):
    """The backward is prepared per backward key, here the incoming gradient's layout: contiguous, then expanded
    (y.sum().backward() gives a stride-0 gradient), then transposed."""
    for grad_layout in ("contiguous", "expanded", "transposed", "contiguous"):
        x = _randn(6, 10, seed=7, device=device).requires_grad_(True)
        weight = _randn(10, seed=8, device=device).requires_grad_(True)
        bias = _randn(10, seed=9, device=device).requires_grad_(True)
        y = LAYERNORM.layernorm(x, weight, bias)
        grad = {
            "contiguous": _randn(6, 10, seed=11, device=device),
            "expanded": torch.ones((), device=device).expand(6, 10),
            "transposed": _randn(10, 6, seed=12, device=device).t(),
        }[grad_layout]
        got = torch.autograd.grad(y, (x, weight, bias), grad)
        leaves = [t.detach().double().requires_grad_(True) for t in (x, weight, bias)]
        truth = torch.autograd.grad(LAYERNORM.reference(*leaves), leaves, grad.double())
        for g, t in zip(got, truth):
            torch.testing.assert_close(g.double(), t, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_prepared_cuda_launches_across_alignments_dtypes_and_shapes():
    """On a GPU later calls launch the remembered binary directly: inputs at other
    alignments, dtypes and shapes must each get their own, and every call stays right."""
    module, op = SEED_OP, SEED_OP._OP
    op._prepared.clear()
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((3, 5), (2, 7, 33), (1, 128, 1024), (2, 64, 4099)):
            n, count = shape[-1], torch.Size(shape).numel()
            storage = torch.randn(2 * count + 8, device="cuda", dtype=dtype)
            for offset in (0, 1, 0, 1):  # aligned, misaligned, and again: each a prepared call key
                x = storage[offset:offset + count].view(shape)
                bias = torch.randn(n, device="cuda", dtype=dtype)
                residual = torch.randn(shape, device="cuda", dtype=dtype)
                for seed in (1, 2**31 + 5):
                    y = module.bias_gelu_dropout_add(x, bias, residual, p=0.3, seed=seed)
                    expected = module.reference(x.double(), bias.double(), residual.double(), p=0.3, seed=seed)
                    error = ((y.double() - expected).norm() / expected.norm()).item()
                    assert error < (1e-6 if dtype == torch.float32 else 1e-2), (dtype, shape, offset, seed, error)
    launches = [prepared._launch for prepared in op._prepared.values()]
    assert all(launch._binary is not None for launch in launches), "a prepared call key never launched its binary"


@pytest.mark.parametrize("limit", [0, 2**18])
def test_row_summed_gradients_by_either_finisher(monkeypatch, device, limit):
    """Partial column sums are finished by sum_partials_kernel when small, by torch when large
    (limit 0 forces torch's here): the same gradients in the input's dtype, either way."""
    from fusegen.backends.triton import launch

    monkeypatch.setattr(launch, "SUM_PARTIALS_LIMIT", limit)
    module = op_by_name("bias_gelu").module
    module._OP._prepared.clear()
    for dtype in (torch.float32, torch.float16):
        x = _randn(4, 33, 24, seed=3, device=device, dtype=dtype).requires_grad_(True)
        bias = _randn(24, seed=4, device=device, dtype=dtype).requires_grad_(True)
        grad = _randn(4, 33, 24, seed=5, device=device, dtype=dtype)
        got = torch.autograd.grad(module.bias_gelu(x, bias), (x, bias), grad)
        leaves = [t.detach().double().requires_grad_(True) for t in (x, bias)]
        truth = torch.autograd.grad(module.reference(*leaves), leaves, grad.double())
        assert got[1].dtype == dtype and got[1].shape == bias.shape
        tolerance = 1e-5 if dtype == torch.float32 else 2e-3
        for g, t in zip(got, truth):
            torch.testing.assert_close(g.double(), t, rtol=tolerance, atol=tolerance)
    module._OP._prepared.clear()
