"""inplace_backward=True: the backward writes an input's gradient into the input's own memory
where that is safe, and nowhere else; values are the same either way."""
from __future__ import annotations

import pytest
import torch

from fusegen import runtime
from helpers import op_by_name

SWIGLU = op_by_name("swiglu").module
SEED_OP = op_by_name("bias_gelu_dropout_add").module


def _randn(*shape, seed, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)


def _step(device, in_place: bool, dtype=torch.float32, module: bool = False):
    """A Linear-like producer (x0 * w, not a leaf) feeding swiglu alone; the gradient
    arriving at the producer, the gradients of its inputs, and the producer's output.
    `module`: swiglu as its torch.nn.Module."""
    x0 = _randn(4, 6, 32, seed=1, device=device, dtype=dtype).requires_grad_(True)
    w = _randn(32, seed=2, device=device, dtype=dtype).requires_grad_(True)
    h = x0 * w
    seen = []
    h.register_hook(seen.append)
    y = SWIGLU.Swiglu(inplace_backward=in_place)(h) if module else SWIGLU.swiglu(h, inplace_backward=in_place)
    y.backward(_randn(4, 6, 16, seed=3, device=device, dtype=dtype))
    return seen[0], x0.grad, w.grad, h


@pytest.mark.parametrize("module", [False, True], ids=["function", "module"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_gradients_and_the_inputs_memory_reused(device, dtype, module):
    _step(device, True, dtype, module)  # on a GPU the first call with a call key tunes: never in place
    grad_h, grad_x0, grad_w, h = _step(device, True, dtype, module)
    expected_h, expected_x0, expected_w, _ = _step(device, False, dtype, module)
    assert grad_h.data_ptr() == h.data_ptr()  # the gradient lives where h was
    assert expected_h.data_ptr() != h.data_ptr()
    for got, want in ((grad_h, expected_h), (grad_x0, expected_x0), (grad_w, expected_w)):
        assert torch.equal(got, want)


def test_leaves_and_shared_memory_are_never_written(device):
    x = _randn(3, 16, seed=4, device=device).requires_grad_(True)  # a leaf: a user's tensor
    before = x.detach().clone()
    SWIGLU.swiglu(x, inplace_backward=True).sum().backward()
    assert torch.equal(x.detach(), before) and x.grad.data_ptr() != x.data_ptr()
    # A view of a leaf is no leaf, but its memory is the leaf's.
    x.grad = None
    SWIGLU.swiglu(x.view(3, 16), inplace_backward=True).sum().backward()
    assert torch.equal(x.detach(), before)
    # The same tensor as two inputs: neither takes its gradient in place.
    base = _randn(8, 24, seed=5, device=device).requires_grad_(True)
    h = base * 1.5
    bias = _randn(24, seed=7, device=device)
    kept = h.detach().clone()
    out = SEED_OP.bias_gelu_dropout_add(h, bias, h, p=0.0, inplace_backward=True)
    out.backward(torch.ones_like(out))
    expected = base.detach().clone().requires_grad_(True)
    SEED_OP.bias_gelu_dropout_add(expected * 1.5, bias, expected * 1.5, p=0.0).backward(torch.ones_like(out))
    torch.testing.assert_close(base.grad, expected.grad)
    assert torch.equal(h.detach(), kept)


def test_a_later_use_of_the_overwritten_input_fails_loudly(device):
    """exp saves its output for its backward, which runs after swiglu's: with the output's
    memory holding swiglu's gradient, autograd must refuse rather than compute with it."""
    x0 = _randn(4, 32, seed=8, device=device).requires_grad_(True)
    SWIGLU.swiglu(torch.exp(x0)).sum().backward()  # on a GPU the first call with a call key tunes
    x0.grad = None
    h = torch.exp(x0)
    y = SWIGLU.swiglu(h, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    x0.grad = None  # the same graph without in place works
    h = torch.exp(x0)
    SWIGLU.swiglu(h).sum().backward()
    assert x0.grad is not None


def test_inplace_backward_takes_only_a_bool(device):
    x = _randn(2, 8, seed=9, device=device)
    with pytest.raises(runtime.FusegenArgumentError, match="inplace_backward must be True or False"):
        SWIGLU.swiglu(x, inplace_backward="yes")


@pytest.mark.gpu
def test_no_write_in_place_while_tuning_and_less_memory_after():
    """The first call with a call key tunes: several runs on the same buffers, so nothing in place
    then; later calls take no new buffer for the gradient."""
    module = SWIGLU
    module.swiglu_backward_kernel.cache.clear()
    module._OP.kernels._backward._entries.clear()
    module._OP._prepared.clear()
    shape = (8, 509, 2 * 1024)  # an M no other test tunes

    def run(in_place):
        x0 = torch.randn(shape, device="cuda", requires_grad=True)
        h = x0 * 2.0
        y = module.swiglu(h, inplace_backward=in_place)
        grad = torch.randn(y.shape, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y.backward(grad)
        torch.cuda.synchronize()
        return x0.grad, torch.cuda.max_memory_allocated() - base

    torch.manual_seed(0)
    first, _ = run(True)  # tunes
    torch.manual_seed(0)
    expected, copy_peak = run(False)
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    torch.manual_seed(0)
    again, in_place_peak = run(True)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    gradient_bytes = torch.Size(shape).numel() * 4
    assert in_place_peak <= copy_peak - gradient_bytes + 2**20, (in_place_peak, copy_peak)


def test_the_module_classes_take_it_at_construction():
    module = SEED_OP.BiasGeluDropoutAdd(p=0.2, inplace_backward=True)
    assert module.inplace_backward and repr(module) == "BiasGeluDropoutAdd(p=0.2, activation='gelu_tanh', inplace_backward=True)"
    assert repr(SWIGLU.Swiglu()) == "Swiglu()"
    with pytest.raises(runtime.FusegenArgumentError, match=r"^swiglu\(\): inplace_backward must be True or False, got int$"):
        SWIGLU.Swiglu(inplace_backward=1)


@pytest.mark.parametrize("node", ["python", "native"])
def test_an_input_whose_gradient_is_not_asked_for_keeps_its_values(device, node, use_node):
    """autograd.grad of x alone: inp's gradient is not computed, so inp's memory is not
    written, though inp requires grad and inplace_backward allows it (either autograd node)."""
    use_node(node)
    op = op_by_name("add_mul_activation").module
    x0 = _randn(4, 32, seed=1, device=device).requires_grad_(True)
    inp0 = _randn(4, 32, seed=2, device=device).requires_grad_(True)
    bias = _randn(32, seed=3, device=device)
    g = _randn(4, 32, seed=4, device=device)
    for _ in range(3):  # the first call with a call key tunes (never in place); later ones may write
        x, inp = x0 * 1, inp0 * 1  # no leaves: either may take its gradient in place
        y = op.add_mul_activation(x, inp, bias, 2.0, "silu", inplace_backward=True)
        (gx,) = torch.autograd.grad(y, x, g)
        assert torch.equal(inp.detach(), inp0.detach())
    assert gx.data_ptr() == x.data_ptr() and gx.grad_fn is None  # x's memory, detached
    truth = x0.detach().double().requires_grad_(True)  # x itself may hold its gradient now
    expected = torch.autograd.grad(torch.nn.functional.silu(truth + 2.0 * inp0.detach().double() + bias.double()),
                                   truth, g.double())[0]
    assert torch.allclose(gx.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("node", ["python", "native"])
@pytest.mark.parametrize("name", ["layernorm", "add_mul_activation"])
def test_autograd_grad_of_a_leaf_alone_keeps_the_other_inputs_values(device, node, name, use_node):
    """autograd.grad of the weight (a leaf) alone: torch cannot say inside autograd.grad
    whether a leaf's gradient is wanted, and that must not make every input writable; x, an
    activation whose gradient nobody asked for, keeps its values."""
    use_node(node)
    op = op_by_name(name).module
    x0 = _randn(4, 32, seed=1, device=device).requires_grad_(True)
    w = _randn(32, seed=2, device=device).requires_grad_(True)
    b = _randn(32, seed=3, device=device).requires_grad_(True)
    for _ in range(3):  # the first call with a call key tunes (never in place); later ones may write
        x = x0 * 1
        kept = x.detach().clone()
        if name == "layernorm":
            y = op.layernorm(x, w, b, inplace_backward=True)
        else:  # w as the second input: x + 2 * w + b, then silu
            y = op.add_mul_activation(x, w, b, 2.0, "silu", inplace_backward=True)
        (gw,) = torch.autograd.grad(y.sum(), [w])
        assert torch.equal(x.detach(), kept)
    ref_w = w.detach().clone().requires_grad_(True)
    ref_args = (x0.detach(), ref_w, b.detach()) + (() if name == "layernorm" else (2.0, "silu"))
    (expected,) = torch.autograd.grad(op.reference(*ref_args).sum(), [ref_w])
    torch.testing.assert_close(gw, expected)
    # Both asked for: x (no leaf) may take its gradient in place, w's is still computed.
    x = x0 * 1
    y = op.layernorm(x, w, b, inplace_backward=True) if name == "layernorm" else \
        op.add_mul_activation(x, w, b, 2.0, "silu", inplace_backward=True)
    gx, gw = torch.autograd.grad(y.sum(), [x, w])
    torch.testing.assert_close(gw, expected)


@pytest.mark.parametrize("node", ["python", "native"])
def test_a_backward_called_outside_the_engine_writes_nothing_in_place(device, node, use_node):
    """The node's backward called directly: nothing says which gradients are wanted, so all
    are computed, and none into an input's memory."""
    use_node(node)
    x0 = _randn(4, 32, seed=1, device=device).requires_grad_(True)
    for _ in range(3):
        h = x0 * 1
        kept = h.detach().clone()
        y = SWIGLU.swiglu(h, inplace_backward=True)
        with torch.no_grad():  # as the engine runs a backward
            gh = [g for g in _call_node(y.grad_fn, torch.ones_like(y)) if g is not None][0]
        assert torch.equal(h.detach(), kept) and gh.data_ptr() != h.data_ptr()


def _call_node(node, grad):
    """A node's backward, called as a user may call it (the Python Function's apply, the C++ node's __call__)."""
    return node.apply(grad) if hasattr(node, "apply") else node(grad)
