"""The CUDA backend's pointwise forward source (issue 33, fusegen.backends.cuda.pointwise_source),
for shipped ops: its element function compiled as host C++ (g++) and run over every element of
broadcast inputs, against the generated module's `reference` in fp64 and fp32 (dropout's masks
from the same seed, bit for bit); the whole source, kernel included, compiled as sm_90 device
code where nvcc is installed. (tests/test_cuda_backend.py runs the kernels themselves.)"""
from __future__ import annotations

import ctypes
import importlib
import itertools
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fusegen.backends import codegen
from fusegen.backends.cuda.pointwise_source import CudaUnsupported, uses_col, backward_source, forward_source
from fusegen.ir import build_ir
from fusegen.planning import plan as build_plan
from fusegen.runtime import dropout_scale
from fusegen.runtime.dropout import dropout_threshold
from fusegen.simplify import simplify
from fusegen.spec import load_spec
from tests.helpers import build_and_import

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "fusegen" / "backends" / "cuda" / "csrc"
# (op, its params for the call, p where it has dropout)
OPS = [("gelu", {}, None), ("gelu_tanh", {}, None), ("add_relu", {}, None), ("scale_add", {}, None),
       ("softcap", {"cap": 3.0}, None), ("leaky_relu", {"slope": 0.2}, None), ("mish", {}, None),
       ("bias_dropout_add", {}, 0.3), ("bias_dropout_add", {}, 0.0),
       # Choice params: each choice a template argument of the element functions.
       *(("add_mul_activation", {"multiplier": 0.7, "activation": a}, None)
         for a in ("relu", "sigmoid", "silu", "gelu", "gelu_tanh", "identity")),
       ("bias_gelu", {"activation": "gelu_tanh"}, None), ("bias_gelu_dropout_add", {"activation": "gelu"}, 0.3),
       # Inputs in chunks: x [..., 2N] as two N-wide halves (a bias [2N] too).
       ("swiglu", {}, None), ("bias_swiglu", {}, None), ("geglu", {"activation": "gelu_tanh"}, None),
       ("bias_geglu", {"activation": "gelu"}, None),
       ("rope", {}, None)]  # an output in parts: y [..., 2N], each half its own expression
SEED = 123
NO_BACKWARD: set[str] = set()  # ops whose backward the CUDA backend does not render yet


def _chosen(plan, params: dict | None = None) -> list[str]:
    """The template arguments of choice params: each combination of choices' indices (", 3"),
    or the one `params` names; [""] without choice params."""
    choices = [h.param.declaration.choices for h in plan.helpers]
    if params is not None:
        return ["".join(f", {c.index(params[h.param.name])}" for h, c in zip(plan.helpers, choices))]
    return ["".join(f", {k}" for k in ks) for ks in itertools.product(*(range(len(c)) for c in choices))]


def _suffix(chosen: str) -> str:
    return chosen.replace(", ", "_c")


def _element_call(kernel, function: str, t: str, chosen: str, reads: int, results: list[str]) -> list[str]:
    """The C++ lines that read each value at (row, col) through in<k>'s strides (chunk c at col +
    c·N), draw each mask's multiplier as a kernel's pack of one does, and call `function`."""
    values = [f"v{k}_{c}" for k, count in enumerate(reads) for c in range(count)]
    lines = [f"const {t} v{k}_{c} = in{k}[row * in{k}_m + (col + {c} * N) * in{k}_n];"
             for k, count in enumerate(reads) for c in range(count)]
    ps = list(dict.fromkeys(m.p.name for m in kernel.masks))
    masks = [f"m{k}" for k, _ in enumerate(kernel.masks)]
    lines += [f"{t} m{k}[1]; fusegen::dropout_multipliers<1>(m{k}, has_dropout, seed, row * N + col, {mask.stream}u, "
              f"threshold{ps.index(mask.p.name)}, scale{ps.index(mask.p.name)});" for k, mask in enumerate(kernel.masks)]
    arguments = values + (["T_(col)".replace("T_", t)] if uses_col(kernel.body, kernel.body_no_dropout) else [])
    arguments += [f"scalar{k}" for k, _ in enumerate(kernel.scalars)]
    arguments += ["has_dropout", *(f"{m}[0]" for m in masks)] if kernel.masks else []
    lines += [f"{t} {', '.join(results)};", f"{function}<{t}{chosen}>({', '.join(arguments + results)});"]
    return lines


def _dropout_parameters(kernel, t: str) -> list[str]:
    ps = list(dict.fromkeys(m.p.name for m in kernel.masks))
    return ["uint64_t seed, bool has_dropout"] + [f"int32_t threshold{k}, {t} scale{k}" for k, _ in enumerate(ps)] \
        if kernel.masks else []


def _backward_harness(plan, chosen: str = "") -> str:
    """extern "C" run_backward: the backward's element function over M x N in double, each gradient
    written in full [M, N] (the test sums a broadcast input's, as the kernel's column sums would)."""
    kernel = plan.backward
    parts = {g: p.incoming for p in plan.output_parts for (name, _), g in zip(plan.outputs, kernel.incoming)
             if name == p.name}
    reads = [len(i.values) for i in kernel.inputs] + [len(parts.get(g, (g,))) for g in kernel.incoming]
    gradients = [v for g in kernel.gradients for v in g.values]
    parameters = [f"const double* in{k}, int64_t in{k}_m, int64_t in{k}_n" for k, _ in enumerate(reads)]
    parameters += [f"double scalar{k}" for k, _ in enumerate(kernel.scalars)] + _dropout_parameters(kernel, "double")
    parameters += [f"double* grad{k}" for k, _ in enumerate(gradients)]
    results = [f"g{k}" for k, _ in enumerate(gradients)]
    body = _element_call(kernel, f"{plan.op}_backward_element", "double", chosen, reads, results)
    body += [f"grad{k}[row * N + col] = g{k};" for k, _ in enumerate(gradients)]
    return f"""
extern "C" void run_backward{_suffix(chosen)}({', '.join(parameters)}, int64_t M, int64_t N) {{
  for (int64_t row = 0; row < M; ++row)
    for (int64_t col = 0; col < N; ++col) {{
      {(chr(10) + "      ").join(body)}
    }}
}}
"""


def _plan(name: str):
    backend = codegen()
    return build_plan(simplify(build_ir(load_spec(ROOT / "specs" / f"{name}.yaml"))), backend.RESERVED_NAMES,
                      backend.MODULE_IMPORTS)


def _harness(plan, dtype: str, chosen: str = "") -> str:
    """extern "C" run_<dtype>: the element function over M x N, each output [M, parts·N]."""
    kernel = plan.forward
    parts = {p.name: p.values for p in plan.output_parts}
    outputs = [parts.get(name, (o,)) for (name, _), o in zip(plan.outputs, kernel.outputs)]
    parameters = [f"const {dtype}* in{k}, int64_t in{k}_m, int64_t in{k}_n" for k, _ in enumerate(kernel.inputs)]
    parameters += [f"{dtype}* out{k}" for k, _ in enumerate(kernel.outputs)]
    parameters += [f"{dtype} scalar{k}" for k, _ in enumerate(kernel.scalars)] + _dropout_parameters(kernel, dtype)
    results = [f"o{k}_{c}" for k, values in enumerate(outputs) for c, _ in enumerate(values)]
    body = _element_call(kernel, f"{plan.op}_element", dtype, chosen, [len(i.values) for i in kernel.inputs], results)
    body += [f"out{k}[row * {len(values)} * N + col + {c} * N] = o{k}_{c};"
             for k, values in enumerate(outputs) for c, _ in enumerate(values)]
    return f"""
extern "C" void run_{dtype}{_suffix(chosen)}({', '.join(parameters)}, int64_t M, int64_t N) {{
  for (int64_t row = 0; row < M; ++row)
    for (int64_t col = 0; col < N; ++col) {{
      {(chr(10) + "      ").join(body)}
    }}
}}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++: the host build of the CUDA backend's source needs a C++ compiler")
    folder, libraries = tmp_path_factory.mktemp("cuda_pointwise"), {}
    for name in dict.fromkeys(op for op, _, _ in OPS):
        plan = _plan(name)
        backward = name not in NO_BACKWARD
        (folder / f"{name}.cu").write_text(forward_source(plan) + ("\n" + backward_source(plan) if backward else ""))
        source = folder / f"{name}_host.cpp"
        source.write_text(f'#include "{name}.cu"\n' + "".join(
            _harness(plan, "double", c) + _harness(plan, "float", c) + (_backward_harness(plan, c) if backward else "")
            for c in _chosen(plan)))
        library = folder / f"{name}.so"
        subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-I", str(HEADER),
                        "-I", str(folder), str(source), "-o", str(library)], check=True, capture_output=True)
        libraries[name] = (plan, ctypes.CDLL(str(library)), folder / f"{name}.cu")
    return libraries


def _run(plan, library, tensors: list[torch.Tensor], params: dict, p: float | None, shape) -> torch.Tensor:
    """The element function over the problem: each input as an [M, N] view (its strides, 0 where
    broadcast), as the Triton launcher lays it out."""
    dtype = tensors[0].dtype
    n = shape[-1]
    m = 1
    for d in shape[:-1]:
        m *= d
    pointer = ctypes.c_double if dtype == torch.float64 else ctypes.c_float
    args, keep = [], []
    for t, i in zip(tensors, plan.inputs):
        width = n * i.layout.chunks  # the chunks side by side: [M, chunks·N]
        view = torch.broadcast_to(t, (*shape[:-1], width)).reshape(m, width)  # a view with stride 0 where broadcast
        keep.append(view)
        args += [ctypes.cast(view.data_ptr(), ctypes.POINTER(pointer)), ctypes.c_int64(view.stride(0)),
                 ctypes.c_int64(view.stride(1))]
    parts = plan.output_parts[0].values if plan.output_parts else ("",)  # an output in parts: side by side
    out = torch.empty((m, n * len(parts)), dtype=dtype)
    args.append(ctypes.cast(out.data_ptr(), ctypes.POINTER(pointer)))
    args += [pointer(params[s.name]) for s in plan.forward.scalars]
    if plan.forward.masks:
        args += [ctypes.c_uint64(SEED), ctypes.c_bool(bool(p)), ctypes.c_int32(dropout_threshold(p)),
                 pointer(dropout_scale(p))]
    function = f"run_{'double' if dtype == torch.float64 else 'float'}{_suffix(_chosen(plan, params)[0])}"
    getattr(library, function)(*args, ctypes.c_int64(m), ctypes.c_int64(n))
    return out.reshape(*shape[:-1], -1)


def _inputs(plan, dtype):
    g = torch.Generator().manual_seed(0)
    lead, n = (3, 5), 37
    shapes = {"...": lead}
    tensors = []
    for i in plan.inputs:
        dims = i.layout.dims
        shape = [*lead, n] if dims == ("...",) else [s for d in dims for s in (shapes[d] if d == "..." else
                                                                                (1,) if d == "1" else (n,))]
        shape[-1] *= i.layout.chunks  # x [..., 2N]: two N-wide chunks
        tensors.append((torch.randn(shape, generator=g, dtype=torch.float64) * 2).to(dtype))
    return tensors, (*lead, n)


@pytest.mark.parametrize("name, params, p", OPS, ids=[f"{n}-p{p}" if p is not None else n for n, _, p in OPS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_element_function_computes_the_reference(built, name, params, p, dtype):
    plan, library, _ = built[name]
    module = importlib.import_module(f"generated.{name}")
    tensors, shape = _inputs(plan, dtype)
    got = _run(plan, library, [t.contiguous() for t in tensors], params, p, shape)
    kwargs = dict(params, **({"p": p, "seed": SEED} if p is not None else {}))
    want = module.reference(*tensors, **kwargs)
    tolerance = {} if dtype == torch.float64 else dict(rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("expression", ["x + col / (col + 1)", "x * sigmoid(where(x > 0, 1, -1))", "x * exp(col - 1)",
                                        "x ** 5 + 2 ** x"])
def test_integers_and_col_compute_in_the_compute_type(tmp_path, expression):
    """Integer literals and `col` are T in the source: no integer division, no integer overloads."""
    text = f"name: ints\ndoc: a spec\ninputs: {{x: [..., N]}}\noutputs:\n  y: {expression}\n"
    module = build_and_import(tmp_path, text)
    backend = codegen()
    spec = load_spec(tmp_path / "ints.yaml")
    plan = build_plan(simplify(build_ir(spec)), backend.RESERVED_NAMES, backend.MODULE_IMPORTS)
    (tmp_path / "ints.cu").write_text(forward_source(plan))
    (tmp_path / "host.cpp").write_text('#include "ints.cu"\n' + _harness(plan, "double"))
    subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-I", str(HEADER), "-I",
                    str(tmp_path), str(tmp_path / "host.cpp"), "-o", str(tmp_path / "ints.so")], check=True,
                   capture_output=True)
    library = ctypes.CDLL(str(tmp_path / "ints.so"))
    x = (torch.randn(4, 6, dtype=torch.float64) * 0.5)
    torch.testing.assert_close(_run(plan, library, [x], {}, None, (4, 6)), module.reference(x))


@pytest.mark.parametrize("name, params, p", [o for o in OPS if o[0] not in NO_BACKWARD],
                         ids=[f"{n}-p{p}" if p is not None else n for n, _, p in OPS if n not in NO_BACKWARD])
def test_the_backward_element_function_computes_the_references_gradients(built, name, params, p):
    """Each gradient the backward kernel computes, at every element (fp64), against autograd
    through the module's reference; an input broadcast along rows summed over them, as the
    kernel's column sums are."""
    plan, library, _ = built[name]
    module = importlib.import_module(f"generated.{name}")
    tensors, shape = _inputs(plan, torch.float64)
    kwargs = dict(params, **({"p": p, "seed": SEED} if p is not None else {}))
    leaves = [t.clone().requires_grad_() for t in tensors]
    outputs = module.reference(*leaves, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    g = torch.Generator().manual_seed(1)
    incoming = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outputs]
    torch.autograd.backward(outputs, incoming)
    kernel = plan.backward
    m, n = math.prod(shape[:-1]), shape[-1]
    names = [i.name for i in plan.inputs]
    reads = [torch.broadcast_to(tensors[names.index(i.name)], (*shape[:-1], n * i.layout.chunks)).reshape(
        m, n * i.layout.chunks) for i in kernel.inputs]
    reads += [gr.reshape(m, -1) for gr in incoming]  # [M, k·N] for an output in parts
    args = []
    for view in reads:
        args += [ctypes.cast(view.data_ptr(), ctypes.POINTER(ctypes.c_double)), ctypes.c_int64(view.stride(0)),
                 ctypes.c_int64(view.stride(1))]
    args += [ctypes.c_double(params[s.name]) for s in kernel.scalars]
    if kernel.masks:
        args += [ctypes.c_uint64(SEED), ctypes.c_bool(bool(p)), ctypes.c_int32(dropout_threshold(p)),
                 ctypes.c_double(dropout_scale(p))]
    grads = [torch.empty((m, n), dtype=torch.float64) for g in kernel.gradients for _ in g.values]
    args += [ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_double)) for t in grads]
    getattr(library, f"run_backward{_suffix(_chosen(plan, params)[0])}")(*args, ctypes.c_int64(m), ctypes.c_int64(n))
    values = iter(grads)
    for gradient in kernel.gradients:
        leaf = leaves[names.index(gradient.input.name)]
        want = leaf.grad
        got = torch.cat([next(values) for _ in gradient.values], dim=-1).reshape(*shape[:-1], -1)  # chunks side by side
        if want.shape != got.shape:  # broadcast along rows (or, [..., 1], along columns): summed over them
            got = got.sum_to_size(want.shape)
        torch.testing.assert_close(got, want, msg=f"{name}: gradient of {gradient.input.name}")


def test_unsupported_plans_are_one_line_errors(tmp_path):
    with pytest.raises(CudaUnsupported) as error:
        forward_source(_plan("rmsnorm_fp8"))
    assert str(error.value) == "rmsnorm_fp8: the row kind is not supported by the CUDA backend yet"
    with pytest.raises(CudaUnsupported) as error:
        forward_source(_plan("layernorm"))
    assert str(error.value) == "layernorm: the row kind is not supported by the CUDA backend yet"
    backend = codegen()
    for name in ("blockDim", "NAN", "uint64_t"):  # spec names reach the plan as they are
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(f"name: named\ndoc: a spec\ninputs: {{{name}: [..., N]}}\noutputs:\n  y: {name} * 2.0\n")
        plan = build_plan(simplify(build_ir(load_spec(spec))), backend.RESERVED_NAMES, backend.MODULE_IMPORTS)
        with pytest.raises(CudaUnsupported) as error:
            forward_source(plan)
        assert f"the name '{name}'" in str(error.value)


def test_the_source_compiles_as_sm90_device_code(built, tmp_path):
    """Each op's .cu with its kernels instantiated for float and double, and for bf16 and fp16
    elements computed in float, by packs of 1, 4 and 8, with nvcc's warnings as errors."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here: the device build is checked where the CUDA toolkit is installed")
    for name, (plan, _, source) in built.items():
        forward_types = len(plan.forward.inputs) + len(plan.forward.outputs)
        backward_types = len(plan.backward.inputs) + len(plan.backward.incoming) + len(plan.backward.gradients)
        kernels = [f"{name}_forward<{t}, {index}{c}, {pack}, {', '.join([e] * forward_types)}>"
                   for t, e in (("float", "float"), ("double", "double"), ("float", "__nv_bfloat16"), ("float", "__half"))
                   for c in _chosen(plan) for pack, index in ((1, "int64_t"), (4, "int32_t"), (8, "int64_t"))]
        if name not in NO_BACKWARD and plan.backward.gradients:
            kernels += [f"{name}_backward<{t}, {index}{c}, {pack}, {', '.join([e] * backward_types)}>"
                        for t, e in (("float", "float"), ("double", "double"), ("float", "__nv_bfloat16"))
                        for c in _chosen(plan) for pack, index in ((1, "int64_t"), (8, "int32_t"))]
        unit = tmp_path / f"{name}_device.cu"
        unit.write_text(f'#include "{source.name}"\nvoid* instances[] = {{\n' +
                        "".join(f"    (void*)&{k},\n" for k in kernels) + "};\n")
        result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-c", "--Werror", "all-warnings", "-I", str(HEADER),
                                 "-I", str(source.parent), str(unit), "-o", str(tmp_path / f"{name}.o")],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"


_FLOAT8 = r"""
#include "fusegen_cuda.cuh"
extern "C" void e4m3(const float* x, unsigned char* bits, long n) {
  for (long i = 0; i < n; ++i) bits[i] = fusegen::float8_e4m3<SATURATES>(x[i]).bits;
}
extern "C" void e5m2(const float* x, unsigned char* bits, long n) {
  for (long i = 0; i < n; ++i) bits[i] = fusegen::float8_e5m2(x[i]).bits;
}
"""


def test_float8_outputs_convert_as_torch(tmp_path):
    """The header's float8 elements, bit for bit torch's tensor.to: every float16 value (each
    float8 value, tie and boundary among them), random floats across 2^-40..2^30, the ends of the
    range, ±inf, NaN of both signs; float8_e4m3fn as the installed torch treats its overflow."""
    from fusegen.runtime.out import E4M3_SATURATES

    if shutil.which("g++") is None:
        pytest.skip("no g++: the host build of the CUDA backend's header needs a C++ compiler")
    (tmp_path / "float8.cpp").write_text(_FLOAT8.replace("SATURATES", "true" if E4M3_SATURATES else "false"))
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(HEADER), str(tmp_path / "float8.cpp"),
                    "-o", str(tmp_path / "float8.so")], check=True, capture_output=True)
    library = ctypes.CDLL(str(tmp_path / "float8.so"))
    g = torch.Generator().manual_seed(8)
    x = torch.cat([torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float(),
                   torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-40, 30, (200_000,), generator=g).float()),
                   torch.tensor([448.0, 464.0, 464.00003, 480.0, 57344.0, 61439.996, 61440.0, 1e30, float("inf"),
                                 -float("inf"), float("nan"), -float("nan"), 2.0**-6, 2.0**-9, 2.0**-10, 3 * 2.0**-11,
                                 2.0**-16, 2.0**-17, 3 * 2.0**-18, -0.0])])
    for function, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        bits = torch.empty(x.numel(), dtype=torch.uint8)
        getattr(library, function)(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(bits.data_ptr()), ctypes.c_long(x.numel()))
        want = x.to(dtype).view(torch.uint8)
        wrong = (bits != want).nonzero().flatten()
        assert wrong.numel() == 0, f"{dtype}: {[(x[i].item(), hex(bits[i]), hex(want[i])) for i in wrong[:5]]}"
