"""A hidden layer before the matmul (issue 32's DLRM MLP): `sigmoid(relu(x @ T(w1) + b1) @ T(w2) +
b2)` as one forward kernel (each tile forms its rows' [BLOCK_M, H] hidden values from all of K,
then their product with its columns of w2), its backward derived: the g kernel forms the outer
product's gradient, the hidden layer's are matmuls of the gradient it passes back times the
partial derivatives the forward kept. Through the interpreter at small sizes; fp64 truth,
gradcheck, both operand layouts, masked tails, the spec's errors."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from fusegen.errors import SpecError
from fusegen.runtime import FusegenArgumentError
from tests.conftest import DEVICE
from tests.helpers import build_and_import, check_no_gradient_keeps_nothing, check_op_against_truth

# nn.Linear's layouts, the seed's MLP (specs/dlrm_mlp.yaml's).
MLP = """\
name: mlp_t
doc: y = sigmoid(relu(x @ w1.T + b1) @ w2.T + b2)
inputs: {x: [..., K], w1: [H, K], b1: [H], w2: [N, H], b2: [N]}
outputs: {y: sigmoid(relu(x @ T(w1) + b1) @ T(w2) + b2)}
"""
# Every operand as [K, N]; the hidden layer through an intermediate, with a param and two [H]
# inputs of distinct partials (three kept: the product's, s's, c's); the outer product is not
# kept (y's gradient is its own).
MLP_KN = """\
name: mlp_kn
doc: y = gelu(x @ w1 * s + c) * alpha @ w2 + r
inputs: {x: [..., K], w1: [K, H], s: [H], c: [H], w2: [H, N], r: [..., N]}
params: {alpha: {type: float, default: 1.0}}
let: {h: gelu(x @ w1 * s + c) * alpha}
outputs: {y: h @ w2 + r}
"""
NAMES = ("mlp_t", "mlp_kn")


def _truth(name, *t, alpha=1.0):
    if name == "mlp_t":
        x, w1, b1, w2, b2 = t
        return torch.sigmoid(F.linear(F.relu(F.linear(x, w1, b1)), w2, b2))
    x, w1, s, c, w2, r = t
    return (F.gelu((x @ w1) * s + c) * alpha) @ w2 + r


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hidden")
    return {"mlp_t": build_and_import(folder, MLP), "mlp_kn": build_and_import(folder, MLP_KN)}


def _inputs(name, k, h, n, dtype, lead=(2, 3)):
    if name == "mlp_t":
        shapes, scales = [(*lead, k), (h, k), (h,), (n, h), (n,)], [1.0, k ** -0.5, 1.0, h ** -0.5, 1.0]
    else:
        shapes = [(*lead, k), (k, h), (h,), (h,), (h, n), (*lead, n)]
        scales = [1.0, k ** -0.5, 1.0, 1.0, h ** -0.5, 1.0]
    return [(torch.randn(s, dtype=torch.float64) * c).to(DEVICE, dtype).requires_grad_() for s, c in zip(shapes, scales)]


def _params(name):
    return (0.75,) if name == "mlp_kn" else ()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("k, h, n", [(13, 20, 7), (40, 33, 24)])  # DLRM's 13 features; masked tails of K, H, N
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_values_and_gradients_against_float64_truth(ops, name, k, h, n, dtype):
    torch.manual_seed(k + h)
    alpha = dict(alpha=0.75) if name == "mlp_kn" else {}
    # bf16: against the error of torch's own bf16 ops (two layers, the hidden values rounded).
    check_op_against_truth(getattr(ops[name], name), lambda *t: _truth(name, *t, **alpha), _inputs(name, k, h, n, dtype),
                           _params(name), what=name)


@pytest.mark.parametrize("name", NAMES)
def test_fp64_gradcheck_and_twins(ops, name):
    torch.manual_seed(1)
    module = ops[name]
    op = getattr(module, name)
    inputs = tuple(_inputs(name, 6, 5, 4, torch.float64, lead=(3,)))
    assert torch.autograd.gradcheck(lambda *t: op(*t, *_params(name)), inputs)
    truth = _truth(name, *inputs, alpha=0.75)
    for twin in (module.reference, module.eager):
        torch.testing.assert_close(twin(*inputs, *_params(name)), truth)


@pytest.mark.parametrize("wanted", [w for r in (1, 2) for w in itertools.combinations(range(5), r)])
def test_only_some_gradients(ops, wanted):
    """Each gradient alone and in pairs (frozen layers, inference of x's): the others stay None."""
    torch.manual_seed(3)
    inputs = [t.detach().requires_grad_(i in wanted) for i, t in enumerate(_inputs("mlp_t", 12, 9, 5, torch.float64))]
    y = ops["mlp_t"].mlp_t(*inputs)
    g = torch.randn_like(y)
    y.backward(g)
    exact = [t.detach().requires_grad_() for t in inputs]
    _truth("mlp_t", *exact).backward(g)
    for i, (t, e) in enumerate(zip(inputs, exact)):
        if i in wanted:
            torch.testing.assert_close(t.grad, e.grad)
        else:
            assert t.grad is None


def test_what_the_forward_keeps(ops):
    """mlp_t keeps its product (the g kernel reads it) and its hidden values and one partial
    (relu's, b1's too); mlp_kn no product, and three partials (the product's, s's, c's)."""
    problem = [ops[n]._OP.check((*(t.detach() for t in _inputs(n, 6, 5, 4, torch.float32, lead=(3,))), *_params(n)),
                                False).problem for n in NAMES]
    assert ops["mlp_t"]._OP.statistics_shape(problem[0]) == (3, 4 + 2 * 5)
    assert ops["mlp_kn"]._OP.statistics_shape(problem[1]) == (3, 4 * 5)


@pytest.mark.parametrize("name", NAMES)
def test_a_call_no_gradient_follows_keeps_nothing(ops, name):
    torch.manual_seed(7)
    check_no_gradient_keeps_nothing(ops[name], name, _inputs(name, 13, 20, 7, torch.float32), _params(name))


def test_operand_views_and_tiles_of_several_columns(ops):
    """x with no [M, K] view (copied per call), the weights as transposed views; N past one tile
    (every tile of a row block forms the hidden layer again, the first keeps it)."""
    torch.manual_seed(4)
    f64 = dict(dtype=torch.float64, device=DEVICE)
    x = torch.randn(6, 2, 3, **f64).permute(1, 2, 0).requires_grad_()  # [2, 3, K=6]
    w1 = torch.randn(6, 9, **f64).t().requires_grad_()  # [H, K], strides (1, 9)
    b1 = torch.randn(9, **f64).requires_grad_()
    w2 = torch.randn(9, 70, **f64).t().requires_grad_()  # [N=70, H]
    b2 = torch.randn(70, **f64).requires_grad_()
    inputs = (x, w1, b1, w2, b2)
    y = ops["mlp_t"].mlp_t(*inputs)
    torch.testing.assert_close(y, _truth("mlp_t", *inputs))
    assert torch.autograd.gradcheck(ops["mlp_t"].mlp_t, inputs)


def test_meta_compile_and_func(ops):
    op = ops["mlp_t"].mlp_t
    meta = [t.detach().to("meta") for t in _inputs("mlp_t", 5, 7, 3, torch.bfloat16)]
    y = op(*meta)
    assert y.shape == (2, 3, 3) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    torch.manual_seed(7)
    inputs = _inputs("mlp_t", 6, 7, 3, torch.float32)
    compiled = torch.compile(op, fullgraph=True)
    got = compiled(*inputs)
    torch.testing.assert_close(got, op(*[t.detach() for t in inputs]))
    got.sum().backward()
    exact = [t.detach().double().requires_grad_() for t in inputs]
    _truth("mlp_t", *exact).sum().backward()
    for t, e in zip(inputs, exact):
        torch.testing.assert_close(t.grad.double(), e.grad, rtol=1e-4, atol=1e-5)
    x, w1, b1, w2, b2 = [t.detach().double() for t in inputs]
    dw1 = torch.func.grad(lambda w: op(x, w, b1, w2, b2).sum())(w1)
    torch.testing.assert_close(dw1, torch.func.grad(lambda w: _truth("mlp_t", x, w, b1, w2, b2).sum())(w1))


def test_a_hidden_layer_past_the_tile_is_named(ops):
    x, w1, b1, w2, b2 = [t.detach() for t in _inputs("mlp_t", 4, 257, 5, torch.float32, lead=(2,))]
    with pytest.raises(FusegenArgumentError) as error:
        ops["mlp_t"].mlp_t(x, w1, b1, w2, b2)
    assert str(error.value) == ("mlp_t(): w1 [257, 4] makes a hidden layer 257 wide; it takes at most 256 (a tile "
                                "holds its rows' hidden values)")


@pytest.mark.parametrize("inputs, outputs, message", [
    ("w1: [H, K], w2: [N, H], r: [..., N]", "relu(x @ T(w1) + r) @ T(w2)",
     "'r' [..., N] is read by the hidden layer, whose function takes float inputs of one value per hidden column, [H]"),
    ("w1: [H, K], b1: [H], w2: [N, H]", "dropout(relu(x @ T(w1) + b1), p) @ T(w2)",
     "dropout in a hidden layer is not supported yet"),
    ("w1: [H, K], b1: [H]", "relu(x @ T(w1) + b1) @ T(w1)", "the hidden layer is [..., H] and w1's last dim is K"),
    ("w1: [H, K], b1: [H], w2: [N, H]", "relu(x @ T(w1) + b1) @ T(w2) + b1",
     "'b1' is an operand of (relu(x @ T(w1) + b1)) @ T(w2) and cannot also be read elementwise"),
    ("w1: [H, K], b1: [H], w2: [H, H]", "relu(x @ T(w1) + b1) @ T(w2) + x @ T(w1)", "an op takes one matmul"),
    ("w1: [H, K], m: {dims: [H], dtype: bool}, w2: [N, H]", "where(m, x @ T(w1), 0.0) @ T(w2)",
     "'m' is a bool input; the hidden layer's function takes float inputs only (for now)"),
    ("w1: [H, K], w2: [2N, H]", "chunk(relu(x @ T(w1)) @ T(w2), 0)",
     "the product of a hidden layer holds no chunks (its matmuls take weights without chunks)"),
    ("w1: [2H, K], w2: [N, H]", "relu(chunk(x @ T(w1), 0)) @ T(w2)",
     "a chunk of a product in a hidden layer is not supported yet"),
    ("w1: [H, K], b1: [H], w2: [N, H]", "relu(x @ T(w1) + b1 * (x @ T(w1))) @ T(w2)", None),  # one matmul, read twice
])
def test_spec_errors_name_the_line(tmp_path, inputs, outputs, message):
    params = "params: {p: {type: float, default: 0.1, min: 0.0, max: 1.0}}\n" if "dropout" in outputs else ""
    text = f"name: bad\ndoc: a spec\ninputs: {{x: [..., K], {inputs}}}\n{params}outputs:\n  y: {outputs}\n"
    if "chunk(" in outputs:  # the chunk's own line: one output a chunk
        text = text.replace(f"  y: {outputs}\n", f"  y: {outputs} * 2.0\n")
    if message is None:
        module = build_and_import(tmp_path, text)
        assert "Outputs: y [..., N]" in module.__doc__
        return
    with pytest.raises(SpecError) as error:
        build_and_import(tmp_path, text)
    assert message in str(error.value) and f":{5 + bool(params)}:" in str(error.value), str(error.value)


@pytest.mark.parametrize("outputs", ["let:\n  z: x @ T(w1) + b1\noutputs:\n  y: relu(z) @ T(w2) + b2\n",
                                     "let:\n  h: relu(x @ T(w1) + b1)\noutputs:\n  y: (h + 1.0) @ T(w2) + b2\n"])
def test_a_layer_whose_matmul_is_an_intermediate(tmp_path, outputs):
    """The layer's matmul in a `let` that the layer's function reads: the same op, its output
    [..., N] (the spec's dims, which the docstring and the bench read)."""
    text = "name: layered\ndoc: a spec\ninputs: {x: [..., K], w1: [H, K], b1: [H], w2: [N, H], b2: [N]}\n" + outputs
    module = build_and_import(tmp_path, text)
    assert "Outputs: y [..., N]" in module.__doc__
    torch.manual_seed(8)
    inputs = [t.detach().requires_grad_() for t in _inputs("mlp_t", 5, 6, 4, torch.float64)]
    shift = 1.0 if "h + 1.0" in outputs else 0.0
    x, w1, b1, w2, b2 = inputs
    truth = F.linear(F.relu(F.linear(x, w1, b1)) + shift, w2, b2)
    torch.testing.assert_close(module.layered(*inputs), truth)
    assert torch.autograd.gradcheck(module.layered, tuple(inputs))


def test_nan_before_relu_passes_the_gradient_as_torch(ops, tmp_path):
    """relu's step at a NaN input passes dh on (torch's relu backward, and the op's reference),
    and a zero step gives a zero gradient whatever dh is."""
    text = "name: plain\ndoc: a spec\ninputs: {x: [..., K], w1: [H, K], b1: [H], w2: [N, H], b2: [N]}\n" \
           "outputs:\n  y: relu(x @ T(w1) + b1) @ T(w2) + b2\n"
    module = build_and_import(tmp_path, text)
    torch.manual_seed(9)
    inputs = [t.detach() for t in _inputs("mlp_t", 5, 6, 4, torch.float64)]
    inputs[2][1] = float("nan")  # b1: one hidden column NaN
    got = [t.clone().requires_grad_() for t in inputs]
    want = [t.clone().requires_grad_() for t in inputs]
    module.plain(*got).sum().backward()
    module.reference(*want).sum().backward()
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.grad, w.grad, equal_nan=True, msg=f"gradient {i}")


def test_mixed_dtypes_keep_the_layer_inputs_gradients_precise(ops):
    """bf16 operands, fp32 [H] and [N] inputs: b1's gradient as precise as b2's (dh from g as
    the g kernel wrote it, fp32, not rounded to the operands' bf16 first)."""
    torch.manual_seed(10)
    x, w1, b1, w2, b2 = [t.detach() for t in _inputs("mlp_t", 8, 16, 12, torch.float64)]
    inputs = [x.bfloat16(), w1.bfloat16(), b1.float(), w2.bfloat16(), b2.float()]
    inputs = [t.requires_grad_() for t in inputs]
    ops["mlp_t"].mlp_t(*inputs).sum().backward()
    exact = [t.detach().double().requires_grad_() for t in inputs]
    _truth("mlp_t", *exact).sum().backward()
    error = lambda t, e: ((t.grad.double() - e.grad).norm() / e.grad.norm()).item()  # noqa: E731
    assert error(inputs[2], exact[2]) < 1e-5 and error(inputs[4], exact[4]) < 1e-5
