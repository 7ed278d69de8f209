"""gemm_lib's matmul helpers (issue 32's GEMM kind, before the kind itself), through a
hand-written kernel with an epilogue (tests/gemm_kernels.py): values against float64 torch
within 2x torch's own error in the same dtype, every tail masked, nn.Linear's [N, K] weight
layout and a non-contiguous a, 64-bit indexing; and the kernel compiles for sm_90."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import gemm_kernels
from tests.helpers import check_against_truth

ROOT = Path(__file__).resolve().parent.parent


def _case(dtype, m, n, k, linear_layout, strided, device):
    g = torch.Generator().manual_seed(m * 31 + n * 7 + k)
    a = torch.randn(m, 2 * k if strided else k, generator=g)[:, ::2 if strided else 1]
    weight = torch.randn(n, k, generator=g) / k ** 0.5
    b = weight.t() if linear_layout else weight.t().contiguous()  # [K, N] either way; strides differ
    bias, residual = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    return [t.to(dtype).to(device) for t in (a, b, bias, residual)]


def _expected(a, b, bias, residual):
    return torch.tanh(a @ b + bias) + residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,k", [(40, 50, 70), (64, 32, 16), (1, 3, 5)])
@pytest.mark.parametrize("linear_layout", [True, False], ids=["linear_weight", "k_by_n"])
def test_a_matmul_tile_with_an_epilogue_matches_torch(dtype, m, n, k, linear_layout, device):
    a, b, bias, residual = _case(dtype, m, n, k, linear_layout, strided=(m == 40), device=device)
    y = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # poisoned: every element written
    gemm_kernels.launch(a, b, bias, residual, y, index_64=(k == 70))
    truth = _expected(*(t.double() for t in (a, b, bias, residual)))
    low = _expected(a, b, bias, residual) if dtype != torch.float32 else None
    check_against_truth(y, truth.to(y.device), None if low is None else low, what=f"{dtype} {m}x{n}x{k}")


def test_the_helpers_compile_for_sm90():
    """Through Triton's real compiler (no GPU needed), fp32, bf16 and fp16, 32- and 64-bit indices."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "gemm_kernels.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiled for sm_90" in done.stdout
