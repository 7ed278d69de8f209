"""Output dtypes (issue 31): `q: {expr: ..., dtype: float8_e4m3fn}` (also float8_e5m2, int8 and
the float dtypes), converted as torch's `tensor.to(dtype)` converts from the compute dtype,
bit for bit; such outputs (and `differentiable: false` ones) have no gradient, and an op with
no other output is forward only. The library's rmsnorm_fp8, layernorm_fp8 and swiglu_fp8.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from fusegen import cli
from fusegen.errors import SpecError
from fusegen.runtime import FusegenArgumentError
from tests.helpers import build_and_import

import generated.layernorm_fp8
import generated.rmsnorm_fp8
import generated.swiglu_fp8

# One output per dtype, plus a differentiable one: the gradient ignores the others.
CASTS = """\
name: casts
doc: x * k in several dtypes, and y = 2 x with a gradient
inputs:
  x: [..., N]
params:
  k: {type: float, default: 1.0}
outputs:
  y: x * 2.0
  e4m3: {expr: x * k, dtype: float8_e4m3fn}
  e5m2: {expr: x * k, dtype: float8_e5m2}
  i8: {expr: x * k, dtype: int8}
  h: {expr: x * k, dtype: float16}
  b: {expr: x * k, dtype: bfloat16}
  d: {expr: x * k, dtype: float64}
"""
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "i8": torch.int8, "h": torch.float16,
          "b": torch.bfloat16, "d": torch.float64}

# Torch's conversions at the edges, which the kernels set by their bits: e4m3fn past ±448 gives
# NaN (torch 2.11) or ±448 (torch 2.13, the CPU build here), ±inf too; e5m2 rounds to ±inf from
# ±61440; ties go to even, subnormals too; NaN keeps its sign. Compared with x.to(dtype) of the
# torch installed, whichever it is (kernel_lib.E4M3_SATURATES).
EDGES = [0.0, -0.0, 1.0, 1.0625, 1.1875, 447.0, 449.0, 463.9, 464.0, 465.0, 479.0, 480.0, 1e4, 57344.0, 61439.0,
         61440.0, 61441.0, 1e6, -7e4, float("inf"), -float("inf"), float("nan"), -float("nan"), 2.0**-9, 2.0**-10,
         1.5 * 2.0**-10, 3 * 2.0**-11, 1e-30, -3e-5, 2.5, -2.5, 127.9, -128.9, -1.7]
# int8: defined only where truncation toward zero lands in [-128, 127] (torch leaves the rest undefined).
INT8_RANGE = (-128.99, 127.99)


@pytest.fixture(scope="module")
def casts(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("output_dtypes"), CASTS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu()
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _values(dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(EDGES, dtype=torch.float64), torch.randn(60, generator=g, dtype=torch.float64) * 40,
                   torch.randn(40, generator=g, dtype=torch.float64) * 1e-3])
    return x.to(dtype).reshape(2, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_conversions_are_torchs_bit_for_bit(casts, dtype, device):
    x = _values(dtype).to(device)
    outputs = dict(zip(["y", *DTYPES], casts.casts(x, 1.0)))
    references = dict(zip(["y", *DTYPES], casts.reference(x, 1.0)))
    for name, want_dtype in DTYPES.items():
        got, ref = outputs[name], references[name]
        assert got.dtype == ref.dtype == want_dtype, name
        want = x.to(want_dtype)
        keep = torch.ones_like(x, dtype=torch.bool)
        if want_dtype == torch.int8:  # out of range and NaN: undefined in torch, the spec's business
            keep = (x > INT8_RANGE[0]) & (x < INT8_RANGE[1])
        keep = keep.cpu()
        # NaN converts to NaN; its sign and payload are the arithmetic's before the conversion
        # (a GPU's x * k gives the canonical NaN, torch's x.to keeps x's), so NaNs match as NaNs.
        nan = x.isnan().cpu()
        assert torch.equal(_bits(got)[keep & ~nan], _bits(want)[keep & ~nan]), name
        assert torch.equal(_bits(got)[keep & ~nan], _bits(ref)[keep & ~nan]), name
        if want_dtype.is_floating_point:
            assert got.cpu()[nan].isnan().all() and ref.cpu()[nan].isnan().all(), name


def test_quantized_outputs_have_no_gradient(casts, device):
    x = _values(torch.float64).clamp(-100, 100).to(device).requires_grad_(True)
    for fn in (casts.casts, casts.reference):
        y, *others = fn(x, 3.0)
        assert y.requires_grad
        assert [t.requires_grad for t in others] == [False, False, False, True, True, True]  # floats keep theirs
        (grad,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(grad, torch.full_like(x, 2.0))


def test_out_checks_each_outputs_dtype(casts, device):
    x = _values(torch.float32).to(device)
    out = [torch.empty(x.shape, dtype=d, device=device) for d in (torch.float32, *DTYPES.values())]
    results = casts.casts(x, 1.0, out=tuple(out))
    assert all(r is o for r, o in zip(results, out))
    nan = x.isnan().cpu()  # NaN's sign: the arithmetic's (test_conversions_are_torchs_bit_for_bit)
    assert torch.equal(_bits(out[1])[~nan], _bits(x.to(torch.float8_e4m3fn))[~nan]) and out[1].cpu()[nan].float().isnan().all()
    out[1] = torch.empty(x.shape, dtype=torch.float32, device=device)
    with pytest.raises(FusegenArgumentError, match=r"out\[1\] must be torch.float8_e4m3fn \[2, 67\]"):
        casts.casts(x, 1.0, out=tuple(out))


def test_meta_tensors_get_each_outputs_dtype(casts):
    x = torch.empty(3, 16, device="meta", dtype=torch.bfloat16)
    results = casts.casts(x, 1.0)
    assert [r.dtype for r in results] == [torch.bfloat16, *DTYPES.values()]
    assert all(r.device.type == "meta" and r.shape == x.shape for r in results)


# -- the library: norm (or SwiGLU) + per-row float8 quantization -----------------------------

E4M3_MAX = 448.0


def _rows(dtype, device, n=48, special=True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, n, generator=g, dtype=torch.float64) * torch.tensor([[1.0], [1e-3], [30.0], [1.0], [1.0], [5.0]])
    if special:
        x[3] = 0.0  # amax 0: q 0, scale tiny
        x[4, 5] = float("nan")  # a NaN row: NaN throughout
        x[5, 7] = float("inf")  # an inf row
    return x.to(dtype).to(device)


def _library(name):
    module = getattr(generated, name)
    return module, getattr(module, name)


def _y64(name, x, weight, bias):
    x = x.double().cpu()
    if name == "rmsnorm_fp8":
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight.double().cpu()
    if name == "layernorm_fp8":
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight.double().cpu(), bias.double().cpu(), 1e-5)
    a, b = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


def _call(name, fn, x, weight, bias):
    if name == "rmsnorm_fp8":
        return fn(x, weight)
    if name == "layernorm_fp8":
        return fn(x, weight, bias)
    return fn(x)


LIBRARY = ["rmsnorm_fp8", "layernorm_fp8", "swiglu_fp8"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", LIBRARY)
def test_norm_fp8_matches_reference_and_float64(name, dtype, device):
    module, fn = _library(name)
    x = _rows(dtype, device)
    g = torch.Generator().manual_seed(2)
    n = x.shape[-1] // (2 if name == "swiglu_fp8" else 1)
    weight = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(dtype).to(device)
    bias = (torch.randn(n, generator=g, dtype=torch.float64) * 0.1).to(dtype).to(device)
    q, scale = _call(name, fn, x, weight, bias)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (6, n)
    assert scale.dtype == torch.float32 and scale.shape == (6, 1)
    rq, rscale = _call(name, module.reference, x, weight, bias)
    # The row sums and maxima are summed in another order than torch's (an ulp of fp32 apart),
    # so q may sit one e4m3 step (2**-3 of its value) from the reference's where the value before
    # the conversion is that close to a rounding boundary; the conversion itself is torch's,
    # bit for bit (test_conversions_are_torchs_bit_for_bit).
    torch.testing.assert_close(scale, rscale, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=0, equal_nan=True)
    torch.testing.assert_close(q.float(), rq.float(), rtol=2.0**-3, atol=2.0**-9, equal_nan=True)
    same = (_bits(q) == _bits(rq)) | (q.cpu().float().isnan() & rq.cpu().float().isnan())  # NaN's sign: arithmetic's
    assert same.float().mean() > 0.9
    eq, escale = _call(name, module.eager, x, weight, bias)
    assert eq.dtype == torch.float8_e4m3fn and escale.dtype == torch.float32

    # Against float64, from the inputs as the kernel reads them: the scale to fp32's precision,
    # q * scale to e4m3's (3 mantissa bits: half a step is 2**-4 of the value; below 2**-6,
    # subnormals, half a step is 2**-10 of the scale).
    y = _y64(name, x, weight, bias)
    amax = y.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    finite = [0, 1, 2, 3]
    torch.testing.assert_close(scale.cpu().double()[finite], (amax / E4M3_MAX)[finite], rtol=1e-5, atol=0)
    dequantized = (q.cpu().double() * scale.cpu().double())[finite]
    bound = (2.0**-4 + 1e-5) * y[finite].abs() + 2.0**-10 * amax[finite] / E4M3_MAX
    assert ((dequantized - y[finite]).abs() <= bound).all()
    if name != "layernorm_fp8":  # (layer norm's y is the bias there)
        assert (q[3].cpu().float() == 0).all()  # an all-zero row: q 0
    assert q[4].cpu().float().isnan().all() and scale[4].isnan().all()  # a NaN row
    assert not scale[5].isfinite().any()  # an inf row: scale inf (swiglu) or NaN (a norm's inf / inf)


@pytest.mark.parametrize("name", LIBRARY)
def test_norm_fp8_is_forward_only(name, device):
    module, fn = _library(name)
    x = _rows(torch.float32, device, special=False).requires_grad_(True)
    n = x.shape[-1] // (2 if name == "swiglu_fp8" else 1)
    weight = torch.ones(n, device=device, requires_grad=True)
    bias = torch.zeros(n, device=device, requires_grad=True)
    for f in (fn, module.reference):
        q, scale = _call(name, f, x, weight, bias)
        assert not q.requires_grad and not scale.requires_grad and q.grad_fn is None
    # Nothing generated for a backward it cannot have: no kernel, no library op, no option.
    assert not hasattr(module, f"{name}_backward_kernel") and module._OP._backward_op is None
    assert "inplace_backward" not in inspect.signature(fn).parameters
    with pytest.raises(TypeError):
        fn(x, inplace_backward=True)


@pytest.mark.parametrize("name", LIBRARY)
def test_norm_fp8_meta(name):
    _, fn = _library(name)
    x = torch.empty(2, 3, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    n = 32 if name == "swiglu_fp8" else 64
    w = torch.empty(n, device="meta", dtype=torch.bfloat16)
    q, scale = _call(name, fn, x, w, w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 3, n) and q.device.type == "meta"
    assert scale.dtype == torch.float32 and scale.shape == (2, 3, 1) and not q.requires_grad


def test_norm_fp8_compile_fullgraph(device):
    module, fn = _library("rmsnorm_fp8")
    x = _rows(torch.float32, device, special=False).requires_grad_(True)
    weight = torch.rand(48, device=device) + 0.5
    got = torch.compile(fn, fullgraph=True)(x, weight)
    want = fn(x, weight)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and not g.requires_grad
    # Inductor's launch may take another tuned config (another order of the row's sum), so q
    # may sit one e4m3 step away where the value is that close to a rounding boundary.
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2.0**-3, atol=2.0**-9)
    assert ((_bits(got[0]) == _bits(want[0])).float().mean() > 0.9)


BAD = [
    ("unknown_dtype", "outputs:\n  y: {expr: x, dtype: float8}\n",
     "x.yaml:6: output 'y': unknown dtype 'float8' (known: float8_e4m3fn, float8_e5m2, int8, float16, bfloat16, "
     "float32, float64)"),
    ("unknown_key", "outputs:\n  y:\n    expr: x\n    type: int8\n",
     "x.yaml:8: unknown key 'type' in output 'y' (known: expr, dtype, differentiable)"),
    ("missing_expr", "outputs:\n  y: {dtype: int8}\n", "x.yaml:6: missing required key 'expr' in output 'y'"),
    ("quantized_with_gradient", "outputs:\n  y: {expr: x, dtype: int8, differentiable: true}\n",
     "x.yaml:6: output 'y': a int8 output has no gradient; drop 'differentiable: true'"),
    ("differentiable_not_bool", "outputs:\n  y: {expr: x, differentiable: 'no'}\n",
     "x.yaml:6: output 'y': differentiable must be true or false, got 'no'"),
]


@pytest.mark.parametrize("text, message", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_specs_are_one_line_file_line_errors(tmp_path, text, message):
    path = tmp_path / "x.yaml"
    path.write_text("name: op\ndoc: d\ninputs:\n  x: [..., N]\n" + text, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        cli.build_op(path)
    assert str(info.value).endswith(message) and "\n" not in str(info.value)


@pytest.mark.gpu
def test_native_eager_call_allocates_each_outputs_dtype(use_node):
    """The C++ eager call allocates q in float8 and scale in float32 (from the call key's
    registration), and gives a forward-only op's outputs no node even with inputs that require grad."""
    module, fn = _library("rmsnorm_fp8")
    x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(1000, device="cuda", dtype=torch.bfloat16)
    results = {}
    for node in ("python", "native"):
        use_node(node)
        for _ in range(3):  # the first with a call key in Python, the later ones in C++
            q, scale = fn(x, weight)
        assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        results[node] = (q, scale)
        q, scale = fn(x.requires_grad_(True), weight)
        x.requires_grad_(False)
        assert not q.requires_grad and q.dtype == torch.float8_e4m3fn
    for got, want in zip(results["native"], results["python"]):
        assert torch.equal(_bits(got), _bits(want))
    rq, rscale = module.reference(x, weight)  # another order of the row sums: see test_library_ops
    torch.testing.assert_close(results["native"][1], rscale, rtol=1e-2, atol=0)
    torch.testing.assert_close(results["native"][0].float(), rq.float(), rtol=2.0**-3, atol=2.0**-9)
