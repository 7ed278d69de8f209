"""torch.func transforms and forward-mode AD: a generated op runs its reference there (torch's
own ops, generated from the same spec, with the kernels' dropout masks), so vmap, grad,
jacrev, jvp, jacfwd, hessian and forward_ad's dual numbers give what they give for torch.

Each transform of an op is compared with the same transform of the op as torch code
(`eager`, float64), or, for dropout, of its `reference` with the same explicit seed.
Shapes are small: the interpreter runs the plain calls.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vmap

from conftest import DEVICE
from fusegen.runtime import FusegenArgumentError
from fusegen.runtime.prepared import PreparedCall

gelu = importlib.import_module("generated.gelu")
swiglu = importlib.import_module("generated.swiglu")
layernorm = importlib.import_module("generated.layernorm")
softmax = importlib.import_module("generated.softmax")
dropout_op = importlib.import_module("generated.bias_gelu_dropout_add")

SEED, P = 7, 0.5


def _randn(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(DEVICE, dtype)


def _dropout(module):
    return lambda x, bias, residual: module(x, bias, residual, P, "gelu_tanh", True, SEED)


# name: (the generated op, the same op as torch code, its inputs' shapes). Every input is
# differentiated.
CASES = {
    "gelu": (gelu.gelu, gelu.eager, [(2, 3, 8)]),
    "swiglu": (swiglu.swiglu, swiglu.eager, [(2, 3, 16)]),
    "layernorm": (layernorm.layernorm, layernorm.eager, [(2, 3, 8), (8,), (8,)]),
    "softmax": (softmax.softmax, softmax.eager, [(2, 3, 8)]),
    "bias_gelu_dropout_add": (_dropout(dropout_op.bias_gelu_dropout_add), _dropout(dropout_op.reference),
                              [(2, 3, 8), (8,), (2, 3, 8)]),
}


def _inputs(shapes, seed=0):
    return [_randn(*shape, seed=seed + i) for i, shape in enumerate(shapes)]


def _close(actual, expected):
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _close(a, e)
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.fixture(params=sorted(CASES))
def case(request):
    return CASES[request.param]


def test_vmap(case):
    op, torch_op, shapes = case
    inputs = _inputs(shapes)
    batched = [_randn(3, *inputs[0].shape, seed=9), *inputs[1:]]
    dims = (0,) + (None,) * (len(inputs) - 1)
    _close(vmap(op, in_dims=dims)(*batched), vmap(torch_op, in_dims=dims)(*batched))


def test_grad(case):
    op, torch_op, shapes = case
    inputs = _inputs(shapes)
    weights = _randn(*torch_op(*inputs).shape, seed=5)  # not every gradient of a sum is trivial (softmax's is 0)
    argnums = tuple(range(len(inputs)))
    _close(grad(lambda *a: (op(*a) * weights).sum(), argnums=argnums)(*inputs),
           grad(lambda *a: (torch_op(*a) * weights).sum(), argnums=argnums)(*inputs))


@pytest.mark.parametrize("jacobian", [jacrev, jacfwd])
def test_jacobians(case, jacobian):
    op, torch_op, shapes = case
    inputs = _inputs(shapes)
    argnums = tuple(range(len(inputs)))
    _close(jacobian(op, argnums=argnums)(*inputs), jacobian(torch_op, argnums=argnums)(*inputs))


def test_jvp(case):
    op, torch_op, shapes = case
    inputs, tangents = _inputs(shapes), _inputs(shapes, seed=20)
    _close(jvp(op, tuple(inputs), tuple(tangents)), jvp(torch_op, tuple(inputs), tuple(tangents)))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_forward_ad_dual_numbers(case, requires_grad):
    """Plain inputs with tangents (whose tangent was dropped), and inputs that also require
    grad (refused for want of a jvp): the tangent is torch's, and the backward still runs."""
    op, torch_op, shapes = case
    inputs, tangents = _inputs(shapes), _inputs(shapes, seed=20)
    expected = jvp(torch_op, tuple(inputs), tuple(tangents))
    inputs = [x.requires_grad_(requires_grad) for x in inputs]
    with fwAD.dual_level():
        y = op(*(fwAD.make_dual(x, t) for x, t in zip(inputs, tangents)))
        primal, tangent = fwAD.unpack_dual(y)
        assert tangent is not None
        _close((primal.detach(), tangent.detach()), expected)
    if requires_grad:
        y.sum().backward()
        assert all(x.grad is not None for x in inputs)


def test_hessian():
    x = _randn(2, 8)
    _close(hessian(lambda x: gelu.gelu(x).sum())(x), hessian(lambda x: gelu.eager(x).sum())(x))
    w, b = _randn(8, seed=1), _randn(8, seed=2)
    _close(hessian(lambda x: (layernorm.layernorm(x, w, b) ** 2).sum())(x),
           hessian(lambda x: (layernorm.eager(x, w, b) ** 2).sum())(x))


def test_module_through_functional_call():
    """The nn.Module path: torch.func.functional_call, under vmap and grad."""
    module = layernorm.Layernorm(eps=1e-5)
    x, w, b = _inputs([(2, 3, 8), (8,), (8,)])
    xs = _randn(4, 2, 3, 8, seed=9)
    _close(vmap(lambda x: functional_call(module, {}, (x, w, b)))(xs), vmap(lambda x: layernorm.eager(x, w, b))(xs))
    _close(grad(lambda x: functional_call(module, {}, (x, w, b)).pow(2).sum())(x),
           grad(lambda x: layernorm.eager(x, w, b).pow(2).sum())(x))
    dropout = dropout_op.BiasGeluDropoutAdd(p=0.0).eval()
    x, bias, residual = _inputs([(2, 3, 8), (8,), (2, 3, 8)])
    _close(jvp(lambda x: functional_call(dropout, {}, (x, bias, residual)), (x,), (residual,)),
           jvp(lambda x: dropout_op.reference(x, bias, residual, 0.0), (x,), (residual,)))


# -- dropout: the kernels' masks, vmap's randomness -------------------------------------


def _dropout_inputs(dtype=torch.float32):
    # x + bias well above 0, so that gelu's output is nonzero: a zero output is a dropped element.
    x, bias, residual = _randn(2, 3, 8, dtype=dtype).abs() + 1, _randn(8, seed=1, dtype=dtype).abs(), torch.zeros(2, 3, 8, dtype=dtype, device=DEVICE)
    return x, bias, residual


def test_forward_ad_draws_the_kernels_mask():
    """seed=None draws the seed as the kernel call draws it: the same generator state gives
    the same mask; the tangent carries it too."""
    x, bias, residual = _dropout_inputs()
    torch.manual_seed(3)
    kernel = dropout_op.bias_gelu_dropout_add(x, bias, residual, P)
    torch.manual_seed(3)
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(dropout_op.bias_gelu_dropout_add(fwAD.make_dual(x, torch.ones_like(x)), bias, residual, P))
    assert 0 < int((kernel == 0).sum()) < kernel.numel()
    assert torch.equal(primal == 0, kernel == 0) and torch.equal(tangent == 0, kernel == 0)
    torch.testing.assert_close(primal, kernel)


def test_vmap_with_an_explicit_seed_gives_each_element_that_seeds_mask():
    x, bias, residual = _dropout_inputs()
    kernel = dropout_op.bias_gelu_dropout_add(x, bias, residual, P, seed=SEED)
    ys = vmap(lambda x: dropout_op.bias_gelu_dropout_add(x, bias, residual, P, seed=SEED))(x.expand(3, *x.shape))
    for y in ys:
        assert torch.equal(y == 0, kernel == 0)
        torch.testing.assert_close(y, kernel)


def test_vmap_randomness():
    """seed=None draws with torch's RNG: vmap's default randomness='error' refuses it in one
    line; 'same' gives every element one mask, 'different' each its own."""
    x, bias, residual = _dropout_inputs()
    xs = x.expand(4, *x.shape)

    def f(x):
        return dropout_op.bias_gelu_dropout_add(x, bias, residual, P)

    with pytest.raises(RuntimeError, match="randomness") as error:
        vmap(f)(xs)
    assert "\n" not in str(error.value)
    same = vmap(f, randomness="same")(xs)
    assert all(torch.equal(y == 0, same[0] == 0) for y in same)
    different = vmap(f, randomness="different")(xs)
    assert not all(torch.equal(y == 0, different[0] == 0) for y in different)
    # Dropout off (eval, or p == 0) draws nothing: any randomness.
    torch.testing.assert_close(vmap(lambda x: dropout_op.bias_gelu_dropout_add(x, bias, residual, P, training=False))(xs),
                               dropout_op.reference(xs, bias, residual, P, training=False))


# -- dtypes, out=, inplace_backward ---------------------------------------------------------


def test_dtypes_as_the_kernels():
    """The reference computes in fp32 for bf16 and returns bf16, as the kernels do."""
    x, t = _randn(2, 8, dtype=torch.bfloat16), _randn(2, 8, seed=1, dtype=torch.bfloat16)
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(gelu.gelu(fwAD.make_dual(x, t)))
    assert primal.dtype == tangent.dtype == torch.bfloat16
    assert torch.equal(primal, gelu.reference(x))
    ys = vmap(gelu.gelu)(x.expand(3, 2, 8))
    assert ys.dtype == torch.bfloat16 and torch.equal(ys[1], gelu.reference(x))


def test_out_and_inplace_backward():
    x, t = _randn(2, 8), _randn(2, 8, seed=1)
    with pytest.raises(FusegenArgumentError, match=r"^gelu\(\): out= is not supported under torch.func transforms"):
        vmap(lambda x: gelu.gelu(x, out=torch.empty(8, dtype=torch.float64, device=DEVICE)))(x)
    # Forward-mode AD writes out= with its tangent, as torch's ops do.
    out, expected = torch.empty(2, 8, dtype=torch.float64, device=DEVICE), jvp(gelu.eager, (x,), (t,))
    with fwAD.dual_level():
        gelu.gelu(fwAD.make_dual(x, t), out=out)
        _close(fwAD.unpack_dual(out), expected)
    # inplace_backward only allows writing in place: the reference's backward does not.
    _close(grad(lambda x: swiglu.swiglu(x, inplace_backward=True).sum())(_randn(2, 16)),
           grad(lambda x: swiglu.eager(x).sum())(_randn(2, 16)))


# -- the paths around the transforms --------------------------------------------------------


def test_plain_calls_after_transforms_take_the_kernel_path(monkeypatch, use_node):
    """The checks leave ordinary calls alone: after transforms, and inside dual_level without
    a tangent, a call launches the kernel through its call key's prepared launch."""
    use_node("python")  # counted in Python: the C++ eager call would launch known call keys itself
    x, t = _randn(2, 8, dtype=torch.float32), _randn(2, 8, seed=1, dtype=torch.float32)
    vmap(gelu.gelu)(x.expand(2, 2, 8))
    jvp(gelu.gelu, (x,), (t,))
    launches = []
    forward = PreparedCall.forward
    monkeypatch.setattr(PreparedCall, "forward", lambda self, *a, **k: launches.append(1) or forward(self, *a, **k))
    monkeypatch.setattr(type(gelu._OP), "reference", lambda *a, **k: pytest.fail("the reference ran"))
    y = gelu.gelu(x)
    with fwAD.dual_level():
        gelu.gelu(x)
        gelu.gelu(x.requires_grad_()).sum().backward()
    assert len(launches) == 3
    torch.testing.assert_close(y, gelu.eager(x))


def test_library_op_refuses_a_tangent():
    """torch's custom_op passes a tangent by where the input does not require grad (no jvp
    formula): the library op (torch.compile's, DTensor's) refuses it in one line."""
    x, t = _randn(2, 8), _randn(2, 8, seed=1)
    with fwAD.dual_level():
        with pytest.raises(FusegenArgumentError, match=r"^fusegen::gelu: x has a forward-mode tangent"):
            torch.ops.fusegen.gelu(fwAD.make_dual(x, t))
        with pytest.raises(NotImplementedError, match="jvp"):  # torch's own refusal
            torch.ops.fusegen.gelu(fwAD.make_dual(x.clone().requires_grad_(), t))


def test_compile_of_transforms():
    """torch.compile of a function that applies jvp or vmap to an op traces the reference
    there (the library op would lose the tangent)."""
    x, t = _randn(2, 8), _randn(2, 8, seed=1)
    torch._dynamo.reset()
    _close(torch.compile(lambda x, t: jvp(gelu.gelu, (x,), (t,)), backend="eager")(x, t), jvp(gelu.eager, (x,), (t,)))
    _close(torch.compile(vmap(gelu.gelu), backend="eager")(x), gelu.eager(x))


def test_a_param_given_as_a_tensor_with_a_derivative_is_refused():
    """A param reaches the kernel as a number (.item()): a tangent or a transform's batch on
    it would be dropped, so such a tensor is refused in one line."""
    leaky = importlib.import_module("generated.leaky_relu")
    x, slope, t = -_randn(8).abs(), torch.tensor(0.1, dtype=torch.float64, device=DEVICE), torch.tensor(1.0, dtype=torch.float64, device=DEVICE)
    with fwAD.dual_level(), pytest.raises(FusegenArgumentError, match=r"^leaky_relu\(\): slope is a tensor under") as error:
        leaky.leaky_relu(x, fwAD.make_dual(slope, t))
    assert "\n" not in str(error.value)
    with pytest.raises(FusegenArgumentError, match="slope is a tensor under"):
        jvp(lambda s: leaky.leaky_relu(x, s), (slope,), (t,))
    with pytest.raises(FusegenArgumentError, match="slope is a tensor under"):
        vmap(lambda s: leaky.leaky_relu(x, s))(slope.expand(3))
    _close(leaky.leaky_relu(x, slope), leaky.leaky_relu(x, 0.1))  # a plain tensor is a number
