"""The CUDA backend's first pieces (issue 33): every expression-language function and its
derivative printed in CUDA C++ (fusegen.backends.cuda.printer) and the device functions they
call (csrc/fusegen_cuda.cuh), compiled here as host C++ (g++) and checked against torch in
fp64 and fp32; dropout's words bit for bit the host reference's (the Triton kernels' rule).
Where nvcc is installed, the same code compiles as sm_90 device code too."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import sympy
import torch

from fusegen.backends.cuda.printer import CudaPrinter
from fusegen.calculus import derivative
from fusegen.functions import FUNCTIONS
from fusegen.printers import TorchPrinter
from fusegen.runtime.dropout import dropout_keep, dropout_threshold

HEADER = Path(__file__).resolve().parent.parent / "fusegen" / "backends" / "cuda" / "csrc"
X, Y, Z = sympy.symbols("x y z", real=True)


def _cases() -> list[tuple[str, sympy.Expr]]:
    """(label, expression of x, y, z): each function of the language, and its derivative in x."""
    cases = []
    for name, f in FUNCTIONS.items():
        expr = f.sympy_form(*(X, Y, Z)[:f.arity])
        cases += [(name, expr), (f"d {name}/dx", derivative(expr, X))]
    return cases


CASES = _cases()


def _source() -> str:
    printer = CudaPrinter()
    functions = "\n".join(
        f"template <typename T> FUSEGEN_HD T case{k}(T x, T y, T z) {{ (void)y; (void)z; return {printer.doprint(e)}; }}"
        for k, (_, e) in enumerate(CASES))
    dispatch = "\n".join(f"    case {k}: out[i] = case{k}<T>(x[i], y[i], z[i]); break;" for k in range(len(CASES)))
    return f"""#include "fusegen_cuda.cuh"
{functions}

template <typename T>
void evaluate(int which, const T* x, const T* y, const T* z, T* out, int64_t n) {{
  for (int64_t i = 0; i < n; ++i) {{
    switch (which) {{
{dispatch}
    }}
  }}
}}

extern "C" {{
void evaluate_double(int which, const double* x, const double* y, const double* z, double* out, int64_t n) {{
  evaluate<double>(which, x, y, z, out, n);
}}
void evaluate_float(int which, const float* x, const float* y, const float* z, float* out, int64_t n) {{
  evaluate<float>(which, x, y, z, out, n);
}}
void dropout_words(uint64_t seed, const int64_t* index, int64_t n, uint32_t stream, uint32_t* out) {{
  for (int64_t i = 0; i < n; ++i) out[i] = fusegen::dropout_word(seed, index[i], stream);
}}
void dropout_multipliers(uint64_t seed, const int64_t* index, int64_t n, uint32_t stream, int32_t threshold,
                         float scale, float* out) {{
  for (int64_t i = 0; i < n; ++i) out[i] = fusegen::dropout_multiplier<float>(fusegen::dropout_word(seed, index[i], stream),
                                                                             threshold, scale);
}}
// The kernels' packs: eight elements from a multiple of 8 on (two Philox calls), or one (a call each).
void dropout_packs(uint64_t seed, int64_t first, int64_t packs, int pack, uint32_t stream, int32_t threshold,
                   float scale, float* out) {{
  for (int64_t i = 0; i < packs; ++i) {{
    if (pack == 8) {{
      float m[8];
      fusegen::dropout_multipliers<8>(m, true, seed, first + 8 * i, stream, threshold, scale);
      for (int k = 0; k < 8; ++k) out[8 * i + k] = m[k];
    }} else {{
      float m[1];
      fusegen::dropout_multipliers<1>(m, true, seed, first + i, stream, threshold, scale);
      out[i] = m[0];
    }}
  }}
}}
}}
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++: the host build of the CUDA printer's code needs a C++ compiler")
    folder = tmp_path_factory.mktemp("cuda_printer")
    source = folder / "cases.cpp"
    source.write_text(_source())
    built = folder / "cases.so"
    # -ffp-contract=off: no fused multiply-adds, which would round differently from torch's
    # separate operations; -O1 for a fast build.
    subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-I", str(HEADER),
                    str(source), "-o", str(built)], check=True, capture_output=True)
    return ctypes.CDLL(str(built))


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, generator=g, dtype=torch.float64) * 3
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0, 20.5, -30.0, 0.5, 2.5, -2.5])]).to(dtype)
    y = (torch.randn(x.numel(), generator=g, dtype=torch.float64) * 3).to(dtype)
    z = (y + torch.rand(x.numel(), generator=g, dtype=torch.float64) * 4).to(dtype)  # clamp's hi above its lo
    return x, y, z


def _torch_value(expr: sympy.Expr, x, y, z) -> torch.Tensor:
    """The expression as the reference evaluates it (fusegen's TorchPrinter), in x's dtype."""
    text = TorchPrinter().doprint(expr)
    value = eval(text, {"torch": torch}, {"x": x, "y": y, "z": z})  # noqa: S307 - our printer's text
    return torch.as_tensor(value, dtype=x.dtype).expand(x.shape)


def _evaluate(library, which: int, x, y, z) -> torch.Tensor:
    out = torch.empty_like(x)
    kind, ctype = ("double", ctypes.c_double) if x.dtype == torch.float64 else ("float", ctypes.c_float)
    pointer = lambda t: t.numpy().ctypes.data_as(ctypes.POINTER(ctype))  # noqa: E731
    getattr(library, f"evaluate_{kind}")(which, pointer(x), pointer(y), pointer(z), pointer(out),
                                         ctypes.c_int64(x.numel()))
    return out


@pytest.mark.parametrize("which", range(len(CASES)), ids=[label for label, _ in CASES])
def test_each_function_and_derivative_in_cuda_cpp_matches_torch(library, which):
    label, expr = CASES[which]
    x, y, z = _inputs(torch.float64)
    truth = _torch_value(expr, x, y, z)
    got = _evaluate(library, which, x, y, z)
    torch.testing.assert_close(got, truth, rtol=1e-12, atol=1e-300, equal_nan=True, msg=f"{label} (fp64)")
    # fp32: the float build's arithmetic (T(...) literals, float math), against the fp64 truth.
    x32, y32, z32 = (t.float() for t in (x, y, z))
    got32 = _evaluate(library, which, x32, y32, z32)
    truth32 = _torch_value(expr, x32.double(), y32.double(), z32.double())
    torch.testing.assert_close(got32.double(), truth32, rtol=2e-5, atol=1e-6, equal_nan=True, msg=f"{label} (fp32)")


def test_nan_passes_through_max_min_and_relu(library):
    """fusegen::maximum and minimum propagate NaN, as torch.maximum does (fmax drops it)."""
    labels = [label for label, _ in CASES]
    x = torch.tensor([float("nan"), 1.0, -1.0], dtype=torch.float64)
    y = torch.tensor([0.0, float("nan"), 0.0], dtype=torch.float64)
    for name in ("max", "min", "relu"):
        got = _evaluate(library, labels.index(name), x, y, y)
        want = {"max": torch.maximum(x, y), "min": torch.minimum(x, y), "relu": torch.relu(x)}[name]
        torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("seed", [0, 1234, 2**32 + 7, 2**63 - 1])
@pytest.mark.parametrize("stream", [0, 1, 3])
def test_dropout_words_are_the_references_bit_for_bit(library, seed, stream):
    """fusegen::dropout_word and dropout_multiplier: the kernels' (and runtime.dropout_keep's)
    keep rule for each flat index, including indices past 2**32 (a group's high word)."""
    index = torch.cat([torch.arange(4099, dtype=torch.int64), torch.arange(2**34 - 5, 2**34 + 11, dtype=torch.int64)])
    words = np.empty(index.numel(), dtype=np.uint32)
    library.dropout_words(ctypes.c_uint64(seed), index.numpy().ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                          ctypes.c_int64(index.numel()), ctypes.c_uint32(stream),
                          words.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)))
    p = 0.3
    keep = torch.from_numpy(words.astype(np.int64) >> 8) >= dropout_threshold(p)
    assert torch.equal(keep, dropout_keep(seed, index, stream, p))
    multipliers = np.empty(index.numel(), dtype=np.float32)
    library.dropout_multipliers(ctypes.c_uint64(seed), index.numpy().ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                                ctypes.c_int64(index.numel()), ctypes.c_uint32(stream),
                                ctypes.c_int32(dropout_threshold(p)), ctypes.c_float(1 / (1 - p)),
                                multipliers.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    assert torch.equal(torch.from_numpy(multipliers) != 0, keep)
    for first in (0, 2**34 - 8):  # a kernel's packs of 8 and of 1 from there on
        for pack in (8, 1):
            packs = np.empty(4096, dtype=np.float32)
            library.dropout_packs(ctypes.c_uint64(seed), ctypes.c_int64(first), ctypes.c_int64(4096 // pack),
                                  ctypes.c_int(pack), ctypes.c_uint32(stream), ctypes.c_int32(dropout_threshold(p)),
                                  ctypes.c_float(1 / (1 - p)), packs.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
            keep = dropout_keep(seed, torch.arange(first, first + 4096, dtype=torch.int64), stream, p)
            assert torch.equal(torch.from_numpy(packs) != 0, keep), (first, pack)


def test_the_code_compiles_as_sm90_device_code(tmp_path):
    """Every printed expression and the header in a __global__ kernel, float and double: nvcc
    accepts them for the H100 (run on the GPU machine by the CUDA backend's own tests, once it
    launches kernels)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here: the device build is checked where the CUDA toolkit is installed")
    source = tmp_path / "cases.cu"
    calls = "\n".join(f"  out[i] += case{k}<T>(x[i], y[i], y[i]);" for k in range(len(CASES)))
    source.write_text(_source() + f"""
template <typename T>
__global__ void all_cases(const T* x, const T* y, T* out, int64_t n) {{
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  out[i] = T(0);
{calls}
  out[i] *= fusegen::dropout_multiplier<T>(fusegen::dropout_word(1234u, i, 0u), 1 << 23, T(2));
}}
template __global__ void all_cases<float>(const float*, const float*, float*, int64_t);
template __global__ void all_cases<double>(const double*, const double*, double*, int64_t);
""")
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-c", "--Werror", "all-warnings", "-I", str(HEADER),
                             str(source), "-o", str(tmp_path / "cases.o")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    # In float, float arithmetic: no fp64 instruction in the float kernel's PTX but in sin's and
    # cos's own slow path for huge arguments (their cases are left out here).
    floats = [k for k, (label, _) in enumerate(CASES) if "sin" not in label and "cos" not in label]
    calls = "\n".join(f"  out[i] += case{k}<float>(x[i], y[i], y[i]);" for k in floats)
    (tmp_path / "floats.cu").write_text(_source() + f"""
extern "C" __global__ void float_cases(const float* x, const float* y, float* out, int64_t n) {{
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  out[i] = 0.0f;
{calls}
}}
""")
    ptx = tmp_path / "floats.ptx"
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "--ptx", "-I", str(HEADER), str(tmp_path / "floats.cu"),
                             "-o", str(ptx)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    kernel = ptx.read_text().split(".entry float_cases")[1]
    assert ".f64" not in kernel, "a float case computes in double"


def test_narrow_results_take_the_faster_exp(tmp_path):
    """A row kernel's exp is fusegen::exp<Narrow>: ex2.approx in float on the GPU where every
    result is 16-bit or narrower, std::exp otherwise and on the host (checked here); a kernel
    defines Narrow only where its body reads it."""
    from tests.helpers import build_and_import, shipped_as

    printer = CudaPrinter()
    printer.narrow_results("Narrow")
    assert printer.doprint(sympy.exp(X) + 1) == "fusegen::exp<Narrow>(x) + T(1)"
    assert CudaPrinter().doprint(sympy.exp(X)) == "std::exp(x)"  # the pointwise kind's
    for name in ("softmax", "rmsnorm"):  # names of their own: a library op is registered once a name
        build_and_import(tmp_path, shipped_as(name, f"{name}_narrow"), "cuda")
    softmax = (tmp_path / "softmax_narrow.cu").read_text()
    assert softmax.count("constexpr bool Narrow = fusegen::narrow<YType>();") == 1
    assert softmax.count("constexpr bool Narrow = fusegen::narrow<Grad_xType>();") == 1
    assert "Narrow" not in (tmp_path / "rmsnorm_narrow.cu").read_text()
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    source = tmp_path / "narrow.cpp"
    source.write_text("""#include "fusegen_cuda.cuh"
static_assert(fusegen::narrow<uint16_t, uint8_t>() && !fusegen::narrow<uint16_t, float>(), "narrow");
extern "C" float narrow_exp(float x) { return fusegen::exp<true>(x); }
""")
    built = tmp_path / "narrow.so"
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(HEADER), str(source), "-o", str(built)],
                   check=True, capture_output=True)
    narrow_exp = ctypes.CDLL(str(built)).narrow_exp
    narrow_exp.restype, narrow_exp.argtypes = ctypes.c_float, [ctypes.c_float]
    for x in (-30.0, -1.5, 0.0, 2.25, 20.5):  # the host's expf: correctly rounded here
        assert narrow_exp(x) == np.float32(np.exp(np.float64(x)))
