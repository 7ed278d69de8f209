"""Issue 33: the seeds' hand-written CUDA kernels against the same ops built by both backends.

The seed documents write fused kernels as CUDA C++ compiled by `torch.utils.cpp_extension.load_inline`
(nvcc + ninja), one thread an element, fp32 only, forward only: the lecture's tanh GELU, the DLRM
add+ReLU and add-multiply-activation. This script writes kernels in that style (its own code, the
seeds' approach), builds them with load_inline, and times each forward beside the op the CUDA backend
builds from the spec, the Triton backend's op and eager PyTorch, in one run, by
triton.testing.do_bench (ms, medians), after checking each against the spec's reference.
`python docs/scripts/seed_kernels.py [--shape 16384x4096] [--build-directory DIR [--build-only]]` (needs a GPU, nvcc and ninja;
docs/benchmarks.md, "The CUDA backend")."""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers import build_and_import, op_by_name, shipped_as  # noqa: E402

# One thread an element, as the seeds write them; each function checks what it assumes.
CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

__global__ void add_relu_kernel(const float* x, const float* other, float* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fmaxf(x[i] + other[i], 0.0f);
}

__global__ void add_mul_relu_kernel(const float* x, const float* inp, const float* bias, float* y,
                                    float multiplier, int64_t n, int64_t width) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fmaxf(x[i] + multiplier * inp[i] + bias[i % width], 0.0f);
}

__global__ void gelu_tanh_kernel(const float* x, float* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    const float v = x[i];
    y[i] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
  }
}

static void check(const torch::Tensor& t) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == torch::kFloat, "contiguous fp32 CUDA tensors");
}

static dim3 blocks(int64_t n) { return dim3((n + 1023) / 1024); }

torch::Tensor add_relu(torch::Tensor x, torch::Tensor other) {
  check(x); check(other);
  auto y = torch::empty_like(x);
  const int64_t n = x.numel();
  add_relu_kernel<<<blocks(n), 1024, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), other.data_ptr<float>(), y.data_ptr<float>(), n);
  return y;
}

torch::Tensor add_mul_relu(torch::Tensor x, torch::Tensor inp, torch::Tensor bias, double multiplier) {
  check(x); check(inp); check(bias);
  auto y = torch::empty_like(x);
  const int64_t n = x.numel();
  add_mul_relu_kernel<<<blocks(n), 1024, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), inp.data_ptr<float>(), bias.data_ptr<float>(), y.data_ptr<float>(), float(multiplier), n,
      bias.numel());
  return y;
}

torch::Tensor gelu_tanh(torch::Tensor x) {
  check(x);
  auto y = torch::empty_like(x);
  const int64_t n = x.numel();
  gelu_tanh_kernel<<<blocks(n), 1024, 0, c10::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
  return y;
}
"""
DECLARATIONS = """
torch::Tensor add_relu(torch::Tensor x, torch::Tensor other);
torch::Tensor add_mul_relu(torch::Tensor x, torch::Tensor inp, torch::Tensor bias, double multiplier);
torch::Tensor gelu_tanh(torch::Tensor x);
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="16384x4096")
    parser.add_argument("--build-directory", default=None,
                        help="load_inline's folder (kept: a second run loads the built module)")
    parser.add_argument("--build-only", action="store_true", help="build the seeds' kernels and stop")
    args = parser.parse_args()
    m, n = (int(s) for s in args.shape.split("x"))
    from torch.utils.cpp_extension import load_inline

    os.environ["FUSEGEN_CACHE_DIR"] = tempfile.mkdtemp()
    folder = Path(tempfile.mkdtemp())
    start = time.perf_counter()
    seeds = load_inline(name="seed_kernels", cpp_sources=[DECLARATIONS], cuda_sources=[CUDA],
                        functions=["add_relu", "add_mul_relu", "gelu_tanh"], extra_cuda_cflags=["-O2"],
                        build_directory=args.build_directory or tempfile.mkdtemp())
    print(f"{torch.__version__} {torch.cuda.get_device_name()}; load_inline built (or loaded) the seeds' kernels "
          f"in {time.perf_counter() - start:.1f}s")
    if args.build_only:
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.randn(m, n, device="cuda", generator=g) for _ in range(2))
    bias = torch.randn(n, device="cuda", generator=g)
    cases = [("add_relu", (x, y), {}, lambda: seeds.add_relu(x, y)),
             ("add_mul_activation", (x, y, bias), {"multiplier": 0.5, "activation": "relu"},
              lambda: seeds.add_mul_relu(x, y, bias, 0.5)),
             ("gelu_tanh", (x,), {}, lambda: seeds.gelu_tanh(x))]
    for name, tensors, kwargs, seed in cases:
        cuda_op = getattr(build_and_import(folder, shipped_as(name, f"{name}_cuda"), "cuda"), f"{name}_cuda")
        op = op_by_name(name)
        module = op.module
        want = module.reference(*(t.double() for t in tensors), **kwargs).float()
        row = [f"{name:19s} fp32 {m}x{n}"]
        for label, fn in (("seed load_inline", seed), ("cuda backend", lambda: cuda_op(*tensors, **kwargs)),
                          ("triton backend", lambda: op.fn(*tensors, **kwargs)),
                          ("eager", lambda: module.eager(*tensors, **kwargs))):
            error = ((fn() - want).abs().max() / want.abs().max()).item()
            row.append(f"{label} {do_bench(fn, rep=100):.4f} (max rel err {error:.1e})")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
