"""The gemm kind (issue 32): `x @ T(weight)` (nn.Linear's [N, K] weight) or `x @ weight`
([K, N]) with an elementwise epilogue, one forward kernel; the backward's g kernel (the
epilogue's pointwise backward over the saved product) and torch.matmul for the operands.
Through the interpreter at small sizes: values and gradients against float64 truth, fp64
gradcheck, the reference and eager twins, layouts, meta tensors, out=, torch.compile,
torch.func, and the errors a caller can meet."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusegen.runtime import FusegenArgumentError
from tests.conftest import DEVICE
from tests.helpers import build_and_import, check_against_truth, check_no_gradient_keeps_nothing

GELU = """\
name: linear_gelu_add
doc: y = gelu_tanh(x @ T(weight) + bias) + residual
inputs: {x: [..., K], weight: [N, K], bias: [N], residual: [..., N]}
outputs: {y: gelu_tanh(x @ T(weight) + bias) + residual}
"""
# The product passes through to y: no g kernel forms it, the incoming gradient is g.
LINEAR = """\
name: linear_bias
doc: y = x @ T(weight) + bias
inputs: {x: [..., K], weight: [N, K], bias: [N]}
outputs: {y: x @ T(weight) + bias}
"""
# weight as [K, N], a scalar param, two outputs.
KN = """\
name: matmul_tanh
doc: y = tanh(x @ weight) * scale, z = x @ weight
inputs: {x: [..., K], weight: [K, N]}
params: {scale: {type: float, default: 1.0}}
outputs: {y: tanh(x @ weight) * scale, z: x @ weight}
"""


def _truth(name, x, w, *rest, scale=1.0):
    if name == "linear_gelu_add":
        b, r = rest
        return (F.gelu(F.linear(x, w, b), approximate="tanh") + r,)
    if name == "linear_bias":
        return (F.linear(x, w, rest[0]),)
    z = x @ w
    return torch.tanh(z) * scale, z


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemm")
    return {name: build_and_import(folder, text) for name, text in
            (("linear_gelu_add", GELU), ("linear_bias", LINEAR), ("matmul_tanh", KN))}


def _inputs(name, k, dtype, lead=(2, 3), n=7, scale=1.0):
    weight = (n, k) if name != "matmul_tanh" else (k, n)
    shapes = {"linear_gelu_add": [(*lead, k), weight, (n,), (*lead, n)], "linear_bias": [(*lead, k), weight, (n,)],
              "matmul_tanh": [(*lead, k), weight]}[name]
    return [(torch.randn(s, dtype=torch.float64) * scale).to(DEVICE, dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("name", ["linear_gelu_add", "linear_bias", "matmul_tanh"])
@pytest.mark.parametrize("k", [5, 40])  # a masked tail of K; three BLOCK_K steps
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_values_and_gradients_against_float64_truth(ops, name, k, dtype):
    torch.manual_seed(k)
    op = getattr(ops[name], name)
    inputs = _inputs(name, k, dtype)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    truth = _truth(name, *exact)
    got = op(*inputs)
    got = got if isinstance(got, tuple) else (got,)
    # bf16: against the error of the same computation in bf16 (the reference, in the compute dtype
    # after bf16 inputs, and torch's own bf16 ops).
    low = _truth(name, *[t.detach() for t in inputs]) if dtype == torch.bfloat16 else (None,) * len(truth)
    for g, t, lo in zip(got, truth, low):
        check_against_truth(g, t.detach(), lo, what=f"{name} {dtype}")
    grads = [torch.randn_like(t) for t in truth]
    torch.autograd.backward(got, [g.to(dtype) for g in grads])
    torch.autograd.backward(truth, grads)
    if dtype == torch.bfloat16:
        low_inputs = [t.detach().clone().requires_grad_() for t in inputs]
        torch.autograd.backward(_truth(name, *low_inputs), [g.to(dtype) for g in grads])
    for i, (t, e) in enumerate(zip(inputs, exact)):
        check_against_truth(t.grad, e.grad, low_inputs[i].grad if dtype == torch.bfloat16 else None,
                            what=f"{name} {dtype} gradient {i}")


@pytest.mark.parametrize("name", ["linear_gelu_add", "linear_bias", "matmul_tanh"])
def test_reference_and_eager_are_the_truth(ops, name):
    torch.manual_seed(1)
    module = ops[name]
    inputs = _inputs(name, 9, torch.float64)
    truth = _truth(name, *inputs)
    for twin in (module.reference, module.eager):
        got = twin(*inputs)
        for g, t in zip(got if isinstance(got, tuple) else (got,), truth):
            torch.testing.assert_close(g, t)


@pytest.mark.parametrize("name", ["linear_gelu_add", "linear_bias", "matmul_tanh"])
def test_fp64_gradcheck(ops, name):
    torch.manual_seed(2)
    op = getattr(ops[name], name)
    assert torch.autograd.gradcheck(op, tuple(_inputs(name, 6, torch.float64, lead=(3,), n=5)))


@pytest.mark.parametrize("wanted", [(1,), (2,), (0,), (0, 3)])
def test_only_some_gradients(ops, wanted):
    """Only weight, only bias, only x, x and residual: the others stay None, the asked-for are right."""
    torch.manual_seed(3)
    x, w, b, r = _inputs("linear_gelu_add", 8, torch.float64)
    inputs = [t.detach().requires_grad_(i in wanted) for i, t in enumerate((x, w, b, r))]
    y = ops["linear_gelu_add"].linear_gelu_add(*inputs)
    g = torch.randn_like(y)
    y.backward(g)
    exact = [t.detach().requires_grad_() for t in inputs]
    _truth("linear_gelu_add", *exact)[0].backward(g)
    for i, (t, e) in enumerate(zip(inputs, exact)):
        if i in wanted:
            torch.testing.assert_close(t.grad, e.grad)
        else:
            assert t.grad is None


def test_layouts(ops):
    """weight as a transposed view, x whose rows are no view (a permute: copied per call),
    a non-contiguous residual, and the [K, N] weight as a transposed view too."""
    torch.manual_seed(4)
    op = ops["linear_gelu_add"].linear_gelu_add
    f64 = dict(dtype=torch.float64, device=DEVICE)
    x = torch.randn(3, 4, 2, **f64).permute(2, 0, 1)  # [2, 3, K=4]: no [M, K] view
    w = torch.randn(4, 7, **f64).t()  # [N, K], strides (1, 7)
    b = torch.randn(7, **f64)
    r = torch.randn(7, 2, 3, **f64).permute(1, 2, 0)
    for _ in range(2):  # the second call takes the prepared launch, with its per-call copy
        got = op(x, w, b, r)
        torch.testing.assert_close(got, _truth("linear_gelu_add", x, w, b, r)[0])
    kn = ops["matmul_tanh"].matmul_tanh
    w_kn = torch.randn(7, 4, **f64).t()
    y, z = kn(x.detach(), w_kn, scale=0.5)
    torch.testing.assert_close(z, x.detach() @ w_kn)
    torch.testing.assert_close(y, torch.tanh(x.detach() @ w_kn) * 0.5)


def test_tuned_tiles_are_kept_per_operand_layout(ops):
    """The forward's tuned tile is kept per M's bucket, N, K and each operand's stride along K
    (1 for a row-major x and nn.Linear's weight, not for their transposes), as well as the
    dtypes Triton's autotuner adds: a weight given transposed gets its own tuning; and the
    mainloop (TMA's descriptors or pointers), whose best tiles differ."""
    module = ops["linear_gelu_add"]
    forward = module.linear_gelu_add_kernel
    assert forward.keys[:3] == ["M_BUCKET", "N", "K"] and forward.keys[-1] == "TMA"
    strides = forward.keys[3:-1]
    assert len(strides) == 2 and all(k.endswith("stride_k") for k in strides)
    assert {k.split("_stride")[0] for k in strides} == {"x", "weight"}


@pytest.mark.parametrize("name", ["linear_gelu_add", "matmul_tanh"])  # both keep the product
def test_a_call_no_gradient_follows_keeps_nothing(ops, name):
    torch.manual_seed(6)
    check_no_gradient_keeps_nothing(ops[name], name, _inputs(name, 12, torch.float32), (0.5,) * (name == "matmul_tanh"))


def test_empty_and_one_row(ops):
    op = ops["linear_gelu_add"].linear_gelu_add
    x, w, b, r = _inputs("linear_gelu_add", 5, torch.float32, lead=(0, 3))
    y = op(x, w, b, r)
    assert y.shape == (0, 3, 7)
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.abs().sum() == 0
    x, w, b, r = _inputs("linear_gelu_add", 5, torch.float64, lead=(1,))
    torch.testing.assert_close(op(x, w, b, r), _truth("linear_gelu_add", x, w, b, r)[0])


def test_operands_of_two_dtypes(ops):
    """Promoted as torch promotes the other inputs (F.linear itself refuses two dtypes): x bf16 and
    weight fp32 multiply in fp32; an fp64 bias makes the product fp64, as the reference forms it."""
    torch.manual_seed(6)
    op = ops["linear_gelu_add"].linear_gelu_add
    x, w, b, r = _inputs("linear_gelu_add", 12, torch.float32)
    for inputs in ((x.bfloat16(), w, b, r), (x, w, b.double(), r)):
        inputs = [t.detach().requires_grad_() for t in inputs]
        got = op(*inputs)
        exact = [t.detach().double().requires_grad_() for t in inputs]
        truth = _truth("linear_gelu_add", *exact)[0]
        assert got.dtype == torch.promote_types(torch.promote_types(inputs[0].dtype, inputs[1].dtype), inputs[2].dtype)
        check_against_truth(got, truth.detach(), op(*[t.detach() for t in inputs]), what=str(got.dtype))
        got.sum().backward()
        truth.sum().backward()
        for t, e in zip(inputs, exact):
            assert t.grad.dtype == t.dtype
            torch.testing.assert_close(t.grad.double(), e.grad, rtol=1e-2 if t.dtype == torch.bfloat16 else 1e-5,
                                       atol=1e-2 if t.dtype == torch.bfloat16 else 1e-5)


def test_meta_and_out(ops):
    op = ops["linear_gelu_add"].linear_gelu_add
    x, w, b, r = [t.detach().to("meta") for t in _inputs("linear_gelu_add", 5, torch.bfloat16)]
    y = op(x, w, b.float(), r)
    assert y.shape == (2, 3, 7) and y.dtype == torch.float32 and y.device.type == "meta"
    x, w, b, r = [t.detach() for t in _inputs("linear_gelu_add", 5, torch.float64)]
    out = torch.empty(2, 3, 7, dtype=torch.float64, device=DEVICE)
    assert op(x, w, b, r, out=out) is out
    torch.testing.assert_close(out, _truth("linear_gelu_add", x, w, b, r)[0])


def test_torch_compile_and_func(ops):
    torch.manual_seed(5)
    op = ops["linear_gelu_add"].linear_gelu_add
    inputs = _inputs("linear_gelu_add", 6, torch.float32)
    compiled = torch.compile(op, fullgraph=True)
    got = compiled(*inputs)
    want = op(*[t.detach() for t in inputs])
    torch.testing.assert_close(got, want)
    got.sum().backward()
    grads = [t.grad for t in inputs]
    exact = [t.detach().double().requires_grad_() for t in inputs]
    _truth("linear_gelu_add", *exact)[0].sum().backward()
    for g, e in zip(grads, exact):
        torch.testing.assert_close(g.double(), e.grad, rtol=1e-4, atol=1e-5)
    x, w, b, r = [t.detach().double() for t in inputs]
    dw = torch.func.grad(lambda w_: op(x, w_, b, r).sum())(w)
    torch.testing.assert_close(dw, torch.func.grad(lambda w_: _truth("linear_gelu_add", x, w_, b, r)[0].sum())(w))


def test_errors_name_the_arguments(ops):
    op = ops["linear_gelu_add"].linear_gelu_add
    x, w, b, r = [t.detach() for t in _inputs("linear_gelu_add", 5, torch.float32)]
    with pytest.raises(FusegenArgumentError) as error:
        op(x, torch.randn(7, 6, device=DEVICE), b, r)
    assert str(error.value) == "linear_gelu_add(): x [2, 3, 5] and weight [7, 6] disagree on dim K (5 vs 6)"
    with pytest.raises(FusegenArgumentError) as error:
        op(x, w, b, torch.randn(4, 2, 3, 7, device=DEVICE))
    assert str(error.value) == ("linear_gelu_add(): residual [4, 2, 3, 7] broadcasts the product x @ T(weight) "
                                "[2, 3, 7] to [4, 2, 3, 7]")


GATED = """\
name: linear_gated
doc: y = (x @ T(weight)) * sigmoid(gate[0]) + gate[1], gate [..., 2N] in two chunks
inputs: {gate: [..., 2N], x: [..., K], weight: [N, K]}
outputs:
  y: x @ T(weight) * sigmoid(chunk(gate, 0)) + chunk(gate, 1)
"""


def test_a_chunked_input_beside_the_product(tmp_path):
    """Chunks are read beside the product, and a chunked input that broadcasts the product is
    named in one line by its own shape."""
    op = build_and_import(tmp_path, GATED).linear_gated
    torch.manual_seed(7)
    f64 = dict(dtype=torch.float64, device=DEVICE)
    gate, x, w = torch.randn(2, 3, 14, **f64), torch.randn(2, 3, 5, **f64), torch.randn(7, 5, **f64)
    want = F.linear(x, w) * torch.sigmoid(gate[..., :7]) + gate[..., 7:]
    torch.testing.assert_close(op(gate, x, w), want)
    with pytest.raises(FusegenArgumentError) as error:
        op(torch.randn(4, 2, 3, 14, **f64), x, w)
    assert str(error.value) == ("linear_gated(): gate [4, 2, 3, 14] broadcasts the product x @ T(weight) [2, 3, 7] "
                                "to [4, 2, 3, 7]")



# The product in two chunks (gate and up projections as one weight), never written whole by the
# forward's epilogue: nn.Linear's [2N, K] under T, and [K, 2N] without.
SWIGLU = """\
name: linear_swiglu_t
doc: y = silu(a) * b, [a, b] = x @ T(weight), weight [2N, K]
inputs: {x: [..., K], weight: [2N, K]}
outputs:
  y: silu(chunk(x @ T(weight), 0)) * chunk(x @ T(weight), 1)
"""
SWIGLU_KN = """\
name: linear_swiglu_kn
doc: y = silu(a) * b + bias, [a, b] = x @ weight, weight [K, 2N]
inputs: {x: [..., K], weight: [K, 2N], bias: [N]}
outputs:
  y: silu(chunk(x @ weight, 0)) * chunk(x @ weight, 1) + bias
"""


def _swiglu_truth(transposed, x, w, *bias):
    a, b = (F.linear(x, w) if transposed else x @ w).chunk(2, dim=-1)
    return F.silu(a) * b + (bias[0] if bias else 0)


@pytest.fixture(scope="module")
def swiglu_modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("swiglu")
    return {True: build_and_import(folder, SWIGLU), False: build_and_import(folder, SWIGLU_KN)}


@pytest.fixture(scope="module")
def swiglu_ops(swiglu_modules):
    return {True: swiglu_modules[True].linear_swiglu_t, False: swiglu_modules[False].linear_swiglu_kn}


def _swiglu_inputs(transposed, k, n, dtype, lead=(2, 3)):
    shapes = [(*lead, k), (2 * n, k)] if transposed else [(*lead, k), (k, 2 * n), (n,)]
    return [torch.randn(s, dtype=torch.float64).to(DEVICE, dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("k, n", [(5, 7), (40, 8)])  # masked tails of K and N; several K steps, N whole
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunked_product_against_float64_truth(swiglu_ops, transposed, k, n, dtype):
    """Each chunk's product from its own rows (columns) of the weight, both in one tile; the
    backward's g for both chunks side by side, and the weight's gradient [2N, K] ([K, 2N])."""
    torch.manual_seed(k + n)
    inputs = _swiglu_inputs(transposed, k, n, dtype)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    truth = _swiglu_truth(transposed, *exact)
    got = swiglu_ops[transposed](*inputs)
    low = _swiglu_truth(transposed, *[t.detach() for t in inputs]) if dtype == torch.bfloat16 else None
    check_against_truth(got, truth.detach(), low, what=f"chunked product {dtype}")
    grad = torch.randn_like(truth)
    got.backward(grad.to(dtype))
    truth.backward(grad)
    if dtype == torch.bfloat16:
        low_inputs = [t.detach().clone().requires_grad_() for t in inputs]
        _swiglu_truth(transposed, *low_inputs).backward(grad.to(dtype))
    for i, (t, e) in enumerate(zip(inputs, exact)):
        check_against_truth(t.grad, e.grad, low_inputs[i].grad if dtype == torch.bfloat16 else None,
                            what=f"chunked product {dtype} gradient {i}")


@pytest.mark.parametrize("transposed", [True, False])
def test_a_chunked_product_gradcheck_and_twins(swiglu_modules, swiglu_ops, transposed):
    torch.manual_seed(11)
    inputs = _swiglu_inputs(transposed, 6, 5, torch.float64, lead=(3,))
    assert torch.autograd.gradcheck(swiglu_ops[transposed], tuple(inputs))
    truth = _swiglu_truth(transposed, *inputs)
    for twin in (swiglu_modules[transposed].reference, swiglu_modules[transposed].eager):
        torch.testing.assert_close(twin(*inputs), truth)


def test_a_chunked_product_pointer_and_tma_mainloops_agree(tmp_path, swiglu_ops, monkeypatch):
    """The descriptor mainloop where gemm_lib.tma_layouts allows it (bf16, K a multiple of 8; the
    interpreter emulates descriptors): each chunk's descriptor starts at its own rows of the
    weight. The pointer mainloop (a second build of the op, its launches made with TMA refused)
    gives the same bits, in fp32 accumulation both."""
    from fusegen.backends.triton import gemm_lib

    torch.manual_seed(12)
    x, w = [t.detach() for t in _swiglu_inputs(True, 16, 8, torch.bfloat16)]
    assert gemm_lib.tma_layouts(x.reshape(-1, 16), w.mT) is not None
    tma = swiglu_ops[True](x, w)
    pointer_op = build_and_import(tmp_path, SWIGLU.replace("linear_swiglu_t", "linear_swiglu_p")).linear_swiglu_p
    monkeypatch.setattr(gemm_lib, "tma_layouts", lambda a, b: None)
    torch.testing.assert_close(tma, pointer_op(x, w), rtol=0, atol=0)


def test_chunked_operand_errors(tmp_path):
    """The language's rules for a product in chunks, each a one-line error at the spec's line."""
    from fusegen.errors import SpecError

    cases = {
        "y: silu(x @ T(weight))": "holds 2 chunks along its last dim, as weight does: use chunk(x @ T(weight), 0)",
        "y: silu(chunk(weight, 0)) * chunk(x @ T(weight), 1)": "'weight' holds its chunks along its first dim",
        "y: silu(chunk(x @ weight, 0))": "'weight' [2N, K] holds its chunks along its first dim: read it as "
                                         "chunk(x @ T(weight), k), or declare it [K, 2N]",
    }
    for k, (output, message) in enumerate(cases.items()):
        text = f"name: chunked_{k}\ndoc: d\ninputs: {{x: [..., K], weight: [2N, K]}}\noutputs:\n  {output}\n"
        with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                           .replace("]", r"\]")):
            build_and_import(tmp_path, text)
    text = "name: chunked_3\ndoc: d\ninputs: {x: [..., K], weight: [K, 2N, 3]}\noutputs: {y: x}\n"
    with pytest.raises(SpecError, match="may only be the last dim, or the first of two"):
        build_and_import(tmp_path, text)
    # A [K, 2N] weight (its chunks along its last dim) read elementwise beside its matmul.
    text = ("name: chunked_4\ndoc: d\ninputs: {x: [..., K], weight: [K, 2N]}\noutputs:\n"
            "  y: chunk(x @ weight, 0) + chunk(weight, 1)\n")
    with pytest.raises(SpecError, match="'weight' is an operand of x @ weight and cannot also be read elementwise"):
        build_and_import(tmp_path, text)


def test_a_chunked_weight_of_the_wrong_size_is_named(swiglu_ops):
    x = torch.randn(2, 5, device=DEVICE)
    with pytest.raises(FusegenArgumentError) as error:
        swiglu_ops[True](x, torch.randn(7, 5, device=DEVICE))
    assert str(error.value) == "linear_swiglu_t(): weight must have shape [2N, K], got [7, 5] (7 is not a multiple of 2)"


DROPOUT = """\
name: linear_halves_{parts}
doc: y = dropout(gelu_tanh(x @ T(weight) + bias), p) + residual
inputs: {{x: [..., K], weight: [N, K], bias: [N], residual: [..., N]}}
params: {{p: {{type: float, default: 0.1, min: 0.0, max: 1.0}}}}
outputs:
  y: dropout(gelu_tanh(x @ T(weight) + bias), p) + residual
"""


@pytest.mark.parametrize("parts", [1, 2])
def test_the_epilogue_in_halves_draws_the_same_masks(tmp_path, parts, monkeypatch):
    """PARTS 2 runs the epilogue on each half of a tile's columns (its own inputs, its own columns
    of the dropout mask): the values, the masks (the reference's, bit for bit where p drops) and
    the gradients are the whole tile's. A fresh op each: its autotuner has no tile kept."""
    from fusegen.backends.triton import gemm_tuning

    monkeypatch.setattr(gemm_tuning, "PINNED_PARTS", parts)
    module = build_and_import(tmp_path, DROPOUT.format(parts=parts))
    op = getattr(module, f"linear_halves_{parts}")
    torch.manual_seed(13)
    f64 = dict(dtype=torch.float64, device=DEVICE)
    inputs = [torch.randn(s, **f64).requires_grad_() for s in ((2, 9, 12), (40, 12), (40,), (2, 9, 40))]
    got = op(*inputs, p=0.3, seed=2**40 + 5)
    want = module.reference(*[t.detach().requires_grad_() for t in inputs], p=0.3, seed=2**40 + 5)
    torch.testing.assert_close(got, want)
    assert torch.equal(got == inputs[3], want == inputs[3])  # dropped where the reference drops
    grad = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(
        module.reference(*inputs, p=0.3, seed=2**40 + 5), inputs, grad))
    config = getattr(module, f"linear_halves_{parts}_kernel").best_config
    assert config.kwargs["PARTS"] == parts  # the tile the op ran with


def test_a_chunked_weight_as_a_view(swiglu_ops):
    """A [2N, K] weight whose rows are strided (a slice of a wider one) or stored transposed:
    each chunk starts at its own rows through the weight's strides."""
    torch.manual_seed(14)
    f64 = dict(dtype=torch.float64, device=DEVICE)
    x = torch.randn(2, 3, 6, **f64)
    for w in (torch.randn(10, 9, **f64)[:, :6], torch.randn(6, 10, **f64).t()):
        assert not w.is_contiguous()
        torch.testing.assert_close(swiglu_ops[True](x, w), _swiglu_truth(True, x, w))


def test_64_bit_offsets_count_the_saved_product_in_chunks(swiglu_modules, monkeypatch):
    """The saved product [M, 2N] and the g kernel's gradient of it reach twice as far as y: with
    M·N under the 32-bit limit and M·2N at it, both kernels take 64-bit offsets (the limit
    lowered here to M·2N)."""
    from fusegen.backends.triton import gemm_launch, launch

    torch.manual_seed(15)
    # M 4, K 2, N 8: y and the operands reach at most 32 elements, the product 64.
    x, w = [t.detach().requires_grad_() for t in _swiglu_inputs(True, 2, 8, torch.float32, lead=(4,))]
    monkeypatch.setattr(gemm_launch, "INT32_LIMIT", 4 * 2 * 8)
    monkeypatch.setattr(launch, "INT32_LIMIT", 4 * 2 * 8)
    op = swiglu_modules[True]._OP
    bound, call = op.kernels, op.check((x, w), needs_kernel=True)
    forward = bound.prepare_forward(call, (x, w))
    names = bound._signatures[0].parameters
    assert forward._template[names.index("INDEX_64")] is True
    y = swiglu_modules[True].linear_swiglu_t(x, w)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(y, _swiglu_truth(True, x.detach(), w.detach()))


def test_a_product_in_chunks_tunes_tiles_that_hold_every_chunk(swiglu_modules):
    """An accumulator a chunk: a product of two chunks tunes tiles of at most half the largest
    one-chunk tile's values (no 128 x 256 tile, two of which would spill)."""
    from fusegen.backends.triton import gemm_tuning

    largest = max(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] for c in gemm_tuning.FORWARD.configs)
    configs = swiglu_modules[True].linear_swiglu_t_kernel.configs
    assert configs and all(2 * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= largest for c in configs)
    assert gemm_tuning.forward_space(1) is gemm_tuning.FORWARD
