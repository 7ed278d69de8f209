"""Issue 32, before the GEMM kind: gemm_lib's pointer kernel with an epilogue (tests/gemm_kernels.py:
y = tanh(a @ b + bias) + residual) against cuBLAS's bare GEMM (torch.mm), torch.mm plus the
epilogue in eager PyTorch, and torch.compile(mode="max-autotune-no-cudagraphs") of the same,
bf16, nn.Linear's weight layout, ms by triton.testing.do_bench; the kernel's tiles swept over
the configs the research note names (docs/design/gemm-research.md), the best kept.
`python docs/scripts/gemm_tile.py [--shapes 16384x4096x4096,...] [--json FILE]` (M x K x N)."""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import gemm_kernels  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3), (64, 256, 64, 4, 4),
           (128, 128, 128, 8, 3), (64, 128, 64, 4, 4), (64, 64, 64, 4, 3)]

parser = argparse.ArgumentParser()
parser.add_argument("--shapes", default="16384x4096x4096,16384x4096x11008")
parser.add_argument("--json", default=None)
options = parser.parse_args()


def eager(a, weight, bias, residual):
    return torch.tanh(a @ weight.t() + bias) + residual


def kernel(a, weight, bias, residual, y, config):
    block_m, block_n, block_k, warps, stages = config
    m, k = a.shape
    n = weight.shape[0]
    b = weight.t()  # [K, N] by strides: nn.Linear's layout
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    gemm_kernels.tanh_epilogue_kernel[grid](
        a, *a.stride(), b, *b.stride(), bias, residual, *residual.stride(), y, m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        INDEX_64=max(t.numel() for t in (a, weight, residual, y)) >= 2**31,
        INPUT_PRECISION="ieee", num_warps=warps, num_stages=stages)
    return y


rows = []
for shape in options.shapes.split(","):
    m, k, n = map(int, shape.split("x"))
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    want = eager(*(t.float() for t in (a, weight, bias, residual)))
    row = {"shape": [m, k, n], "mm": triton.testing.do_bench(lambda: a @ weight.t()),
           "eager": triton.testing.do_bench(lambda: eager(a, weight, bias, residual))}
    compiled = torch.compile(eager, mode="max-autotune-no-cudagraphs")
    compiled(a, weight, bias, residual)
    row["compile"] = triton.testing.do_bench(lambda: compiled(a, weight, bias, residual))
    timed = {}
    for config in CONFIGS:
        try:
            kernel(a, weight, bias, residual, y, config)
            error = ((y.float() - want).abs().max() / want.abs().max()).item()
            timed[config] = (triton.testing.do_bench(lambda: kernel(a, weight, bias, residual, y, config)), error)
        except Exception as exc:  # out of shared memory, say: reported, not fatal
            print(f"{shape} {config}: {type(exc).__name__}: {str(exc)[:120]}")
    if not timed:
        print(f"{shape}: no config ran")
        continue
    best = min(timed, key=lambda c: timed[c][0])
    row.update(fused=timed[best][0], fused_error=timed[best][1], fused_config=list(best),
               configs={str(c): t for c, (t, _) in timed.items()})
    rows.append(row)
    print(f"M K N {m} {k} {n}: mm {row['mm']:.4f} | eager mm+epilogue {row['eager']:.4f} | compile "
          f"{row['compile']:.4f} | fused {row['fused']:.4f} {best} (err {row['fused_error']:.2e}) | "
          f"fused / mm {row['fused'] / row['mm']:.2f} | eager / fused {row['eager'] / row['fused']:.2f}", flush=True)
if options.json:
    Path(options.json).write_text(json.dumps(rows, indent=1))
