"""The low-rank product beside a matmul (issue 32's LoRA): `x @ T(weight) + bias + scale *
((x @ T(lora_a)) @ T(lora_b))` as one forward kernel (each tile forms its rows' [BLOCK_M, R]
inner product and its columns of the low-rank product), its backward derived: the g kernel
forms both products' gradients elementwise, the operands' are matmuls of them. Through the
interpreter at small sizes; fp64 truth, gradcheck, both operand layouts, masked tails."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from fusegen.errors import SpecError
from fusegen.runtime import FusegenArgumentError
from tests.conftest import DEVICE
from tests.helpers import build_and_import, check_op_against_truth

# nn.Linear's layouts throughout, a scale: the low-rank product's gradient is formed by the g kernel.
LORA = """\
name: lora_t
doc: y = x @ weight.T + bias + scale * (x @ lora_a.T) @ lora_b.T
inputs: {x: [..., K], weight: [N, K], bias: [N], lora_a: [R, K], lora_b: [N, R]}
params: {scale: {type: float, default: 1.0}}
outputs: {y: x @ T(weight) + bias + scale * ((x @ T(lora_a)) @ T(lora_b))}
"""
# Every operand as [K, N]; the low-rank product passes through to y (its gradient is y's), and
# an epilogue that is a function of the product.
LORA_KN = """\
name: lora_kn
doc: y = tanh(x @ weight) + (x @ lora_a) @ lora_b
inputs: {x: [..., K], weight: [K, N], lora_a: [K, R], lora_b: [R, N]}
outputs: {y: tanh(x @ weight) + (x @ lora_a) @ lora_b}
"""
LAYOUTS = ("lora_t", "lora_kn")


def _truth(name, x, w, *rest, scale=1.0):
    if name == "lora_t":
        b, a, up = rest
        return F.linear(x, w, b) + scale * F.linear(F.linear(x, a), up)
    a, up = rest
    return torch.tanh(x @ w) + (x @ a) @ up


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lowrank")
    return {"lora_t": build_and_import(folder, LORA), "lora_kn": build_and_import(folder, LORA_KN)}


def _inputs(name, k, n, r, dtype, lead=(2, 3)):
    if name == "lora_t":
        shapes = [(*lead, k), (n, k), (n,), (r, k), (n, r)]
    else:
        shapes = [(*lead, k), (k, n), (k, r), (r, n)]
    # Products of sums of k (and r) terms near 1 in size: each operand scaled down so.
    scales = [1.0, k ** -0.5, 1.0, k ** -0.5, r ** -0.5] if name == "lora_t" else [1.0, k ** -0.5, k ** -0.5, r ** -0.5]
    return [(torch.randn(s, dtype=torch.float64) * c).to(DEVICE, dtype).requires_grad_() for s, c in zip(shapes, scales)]


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("k, n, r", [(5, 7, 3), (40, 33, 20)])  # masked tails of K, N and R; several K steps
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_values_and_gradients_against_float64_truth(ops, name, k, n, r, dtype):
    torch.manual_seed(k + r)
    params = (0.5,) if name == "lora_t" else ()
    # bf16: against the error of torch's own bf16 ops (two matmuls, the inner product rounded).
    check_op_against_truth(getattr(ops[name], name), lambda *t: _truth(name, *t, scale=0.5), _inputs(name, k, n, r, dtype),
                           params, what=name)


@pytest.mark.parametrize("name", LAYOUTS)
def test_fp64_gradcheck_and_twins(ops, name):
    torch.manual_seed(1)
    module = ops[name]
    op = getattr(module, name)
    inputs = tuple(_inputs(name, 6, 5, 3, torch.float64, lead=(3,)))
    params = (0.75,) if name == "lora_t" else ()
    assert torch.autograd.gradcheck(lambda *t: op(*t, *params), inputs)
    truth = _truth(name, *inputs, scale=0.75)
    for twin in (module.reference, module.eager):
        torch.testing.assert_close(twin(*inputs, *params), truth)


@pytest.mark.parametrize("wanted", [(3, 4), (0,), (4,), (1, 2)])
def test_only_some_gradients(ops, wanted):
    """peft's training (only lora_a and lora_b), only x, only lora_b, only the base layer: the
    others stay None, the asked-for are right."""
    torch.manual_seed(3)
    inputs = [t.detach().requires_grad_(i in wanted) for i, t in enumerate(_inputs("lora_t", 12, 9, 4, torch.float64))]
    y = ops["lora_t"].lora_t(*inputs, 2.0)
    g = torch.randn_like(y)
    y.backward(g)
    exact = [t.detach().requires_grad_() for t in inputs]
    _truth("lora_t", *exact, scale=2.0).backward(g)
    for i, (t, e) in enumerate(zip(inputs, exact)):
        if i in wanted:
            torch.testing.assert_close(t.grad, e.grad)
        else:
            assert t.grad is None


def test_operand_views_and_a_rank_of_one(ops):
    """x with no [M, K] view (copied per call), the weights as transposed views, rank 1."""
    torch.manual_seed(4)
    f64 = dict(dtype=torch.float64, device=DEVICE)
    x = torch.randn(6, 2, 3, **f64).permute(1, 2, 0)  # [2, 3, K=6]
    w = torch.randn(6, 7, **f64).t()  # [N, K], strides (1, 7)
    b = torch.randn(7, **f64)
    a = torch.randn(6, 1, **f64).t()  # [R=1, K]
    up = torch.randn(1, 7, **f64).t()  # [N, R=1]
    torch.testing.assert_close(ops["lora_t"].lora_t(x, w, b, a, up, 1.5), _truth("lora_t", x, w, b, a, up, scale=1.5))


@pytest.mark.parametrize("parts", [1, 2])
def test_the_epilogue_in_halves(ops, parts, monkeypatch):
    """PARTS 2: the low-rank product's tile is halved with the product's, column for column."""
    from fusegen.backends.triton import gemm_tuning

    monkeypatch.setattr(gemm_tuning, "PINNED_PARTS", parts)
    torch.manual_seed(5)
    # Rows of a bucket of their own each (M_BUCKET 32, 64): the autotuner prunes afresh with the pinned parts.
    inputs = [t.detach() for t in _inputs("lora_t", 10, 40, 5, torch.float64, lead=(20 * parts,))]
    torch.testing.assert_close(ops["lora_t"].lora_t(*inputs, 0.5), _truth("lora_t", *inputs, scale=0.5))
    assert ops["lora_t"].lora_t_kernel.best_config.kwargs["PARTS"] == parts  # the tile the op ran with


def test_pointer_and_tma_mainloops_agree(tmp_path, ops, monkeypatch):
    """The main product through descriptors (bf16, K a multiple of 8) or pointers: the same bits."""
    from fusegen.backends.triton import gemm_lib

    torch.manual_seed(6)
    inputs = [t.detach() for t in _inputs("lora_t", 16, 24, 8, torch.bfloat16)]
    assert gemm_lib.tma_layouts(inputs[0].reshape(-1, 16), inputs[1].mT) is not None
    tma = ops["lora_t"].lora_t(*inputs, 0.5)
    pointer_op = build_and_import(tmp_path, LORA.replace("lora_t", "lora_p")).lora_p
    monkeypatch.setattr(gemm_lib, "tma_layouts", lambda a, b: None)
    torch.testing.assert_close(tma, pointer_op(*inputs, 0.5), rtol=0, atol=0)


def test_meta_compile_and_func(ops):
    op = ops["lora_t"].lora_t
    meta = [t.detach().to("meta") for t in _inputs("lora_t", 5, 7, 3, torch.bfloat16)]
    y = op(*meta)
    assert y.shape == (2, 3, 7) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    torch.manual_seed(7)
    inputs = _inputs("lora_t", 6, 7, 3, torch.float32)
    compiled = torch.compile(op, fullgraph=True)
    got = compiled(*inputs, 0.5)
    torch.testing.assert_close(got, op(*[t.detach() for t in inputs], 0.5))
    got.sum().backward()
    exact = [t.detach().double().requires_grad_() for t in inputs]
    _truth("lora_t", *exact, scale=0.5).sum().backward()
    for t, e in zip(inputs, exact):
        torch.testing.assert_close(t.grad.double(), e.grad, rtol=1e-4, atol=1e-5)
    x, w, b, a, up = [t.detach().double() for t in inputs]
    da = torch.func.grad(lambda a_: op(x, w, b, a_, up, 0.5).sum())(a)
    torch.testing.assert_close(da, torch.func.grad(lambda a_: _truth("lora_t", x, w, b, a_, up, scale=0.5).sum())(a))


def test_a_rank_past_the_tile_is_named(ops):
    x, w, b, a, up = [t.detach() for t in _inputs("lora_t", 4, 5, 129, torch.float32, lead=(2,))]
    with pytest.raises(FusegenArgumentError) as error:
        ops["lora_t"].lora_t(x, w, b, a, up)
    assert str(error.value) == ("lora_t(): lora_a [129, 4] has rank 129; the low-rank product takes at most 128 (a "
                                "tile holds its [rows, rank] product)")


def test_the_library_op_is_pefts_layer(ops):
    """generated/lora_linear.py against peft's computation, base(x) + lora_B(lora_A(x)) * scaling."""
    from generated.lora_linear import lora_linear

    torch.manual_seed(8)
    f64 = dict(dtype=torch.float64, device=DEVICE)
    base, down, up = torch.nn.Linear(12, 9, **f64), torch.nn.Linear(12, 4, bias=False, **f64), \
        torch.nn.Linear(4, 9, bias=False, **f64)
    x = torch.randn(2, 5, 12, **f64, requires_grad=True)
    y = lora_linear(x, base.weight, base.bias, down.weight, up.weight, 0.25)
    want = base(x) + up(down(x)) * 0.25
    torch.testing.assert_close(y, want)
    g = torch.randn_like(y)
    params = (x, base.weight, base.bias, down.weight, up.weight)
    for got, expected in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(want, params, g)):
        torch.testing.assert_close(got, expected)


DECLARED = {"x": "[..., K]", "z": "[..., K]", "weight": "[N, K]", "lora_a": "[R, K]", "lora_b": "[N, R]",
            "other": "[M, R]", "bias": "[N]"}
ERRORS = {
    "(x @ T(lora_a)) @ T(lora_b) + bias": "(x @ T(lora_a)) @ T(lora_b) is a low-rank product, which an op adds to a "
                                          "matmul of x, as x @ T(weight) + ...; this op has none",
    "x @ T(weight) + (z @ T(lora_a)) @ T(lora_b)": "(z @ T(lora_a)) @ T(lora_b) multiplies z, and the op's matmul "
                                                   "x @ T(weight) multiplies x: a low-rank product takes the matmul's "
                                                   "left operand",
    "gelu_tanh(x @ T(weight) + (x @ T(lora_a)) @ T(lora_b))": "the backward reads the low-rank product "
                                                              "(x @ T(lora_a)) @ T(lora_b)",
    # Caught where the spec's dims are worked out, before the expression is parsed.
    "x @ T(weight) + (x @ T(lora_a)) @ T(other)": "inputs 'x @ T(weight)' [..., N] and '(x @ T(lora_a)) @ T(other)' "
                                                  "[..., M] cannot broadcast",
    "x @ T(weight) + (x @ T(lora_a)) @ lora_b": "inputs 'x @ T(weight)' [..., N] and '(x @ T(lora_a)) @ lora_b' "
                                                "[..., R] cannot broadcast",
    "x @ T(weight) + (x @ T(lora_a)) @ T(lora_b) + lora_b": "'lora_b' is an operand of (x @ T(lora_a)) @ T(lora_b) "
                                                           "and cannot also be read elementwise",
    "x @ T(weight) + (x @ T(lora_a)) @ T(weight)": "'x @ T(lora_a) @ T(weight)': weight's last dim K is not the "
                                                   "inner product's last dim R",
    "x @ T(weight) + ((x @ T(lora_a)) @ T(lora_b)) ** 2": "the backward reads the low-rank product",
    "x @ T(weight) + bias * ((x @ T(lora_a)) @ T(lora_b))": "the backward reads the low-rank product",
    "x @ T(weight) + chunk((x @ T(lora_a)) @ T(lora_b), 0)": "a low-rank product holds no chunks",
    "x @ T(weight) + (x @ T(lora_a)) @ (lora_b * 2)": "a low-rank product's outer operand is an input",
    "x @ T(weight) + (x @ T(lora_a)) @ T(lora_b) + (x @ T(lora_a)) @ T(lora_b) * 0 + (z @ T(lora_a)) @ T(lora_b)":
        "an op takes one low-rank product",
    "x @ T(weight) + ((x @ T(lora_a)) @ T(lora_b)) @ T(weight)": "@ multiplies two inputs",
}


@pytest.mark.parametrize("k", range(len(ERRORS)))
def test_spec_errors_name_the_rule(tmp_path, k):
    """The language's rules for a low-rank product, each a one-line error at the spec's line."""
    output, message = list(ERRORS.items())[k]
    inputs = ", ".join(f"{name}: {dims}" for name, dims in DECLARED.items() if re.search(rf"\b{name}\b", output))
    text = f"name: lowrank_{k}\ndoc: d\ninputs: {{{inputs}}}\noutputs:\n  y: {output}\n"
    with pytest.raises(SpecError, match=re.escape(message)) as error:
        build_and_import(tmp_path, text)
    assert "\n" not in str(error.value)
