"""gemm_lib's matmul helpers (issue 32's GEMM kind, before the kind itself), through
hand-written kernels with an epilogue (tests/gemm_kernels.py): values against float64 torch
within 2x torch's own error in the same dtype, every tail masked, nn.Linear's [N, K] weight
layout and a non-contiguous a, 64-bit indexing; and the kernels compile for sm_90. The
descriptor (TMA) mainloop: which operands it takes (`tma_layouts`, the rest fall back to the
pointer kernel), its values against torch and the pointer kernel's, on the interpreter (which
emulates descriptors) and, at the H100 configs, on a GPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusegen.backends.triton import gemm_lib
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


def _tma_case(dtype, m, n, k, layout, device):
    """a [M, K] and b [K, N] that TMA reads: b as nn.Linear's weight.t() ("linear_weight"),
    row-major [K, N] ("k_by_n"), or a column-major a with the weight ("a_transposed")."""
    a, b, bias, residual = _case(dtype, m, n, k, linear_layout=layout != "k_by_n", strided=False, device=device)
    if layout == "a_transposed":
        a = a.t().contiguous().t()
    return a, b, bias, residual


@pytest.mark.parametrize("layout,flags", [("linear_weight", (True, True)), ("k_by_n", (True, False)),
                                          ("a_transposed", (False, True))])
def test_tma_layouts_takes_aligned_unit_stride_operands(layout, flags, device):
    a, b, _, _ = _tma_case(torch.bfloat16, 64, 48, 32, layout, device)
    assert gemm_lib.tma_layouts(a, b) == flags
    assert gemm_lib.tma_layouts(a.float(), b.float()) == flags


def test_tma_layouts_leaves_the_rest_to_the_pointer_kernel(device):
    a, b, _, _ = _tma_case(torch.bfloat16, 64, 48, 32, "linear_weight", device)
    odd_k = torch.randn(64, 70, dtype=torch.bfloat16, device=device)  # rows of 140 bytes
    assert gemm_lib.tma_layouts(odd_k, torch.randn(70, 48, dtype=torch.bfloat16, device=device)) is None
    assert gemm_lib.tma_layouts(torch.randn(64, 64, dtype=torch.bfloat16, device=device)[:, ::2], b) is None
    unaligned = torch.randn(64 * 32 + 1, dtype=torch.bfloat16, device=device)[1:].view(64, 32)
    assert gemm_lib.tma_layouts(unaligned, b) is None
    assert gemm_lib.tma_layouts(a, b.float()) is None  # two dtypes
    assert gemm_lib.tma_layouts(a.double(), b.double()) is None  # fp64: pointer path
    column = torch.randn(64, 1, dtype=torch.bfloat16, device=device)  # strides (1, 1): no 16-byte stride
    assert gemm_lib.tma_layouts(column, b[:1]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["linear_weight", "k_by_n", "a_transposed"])
@pytest.mark.parametrize("programs,subtile,epilogue_tma", [(None, False, False), (3, True, False), (4, True, True),
                                                         (2, False, True)],
                         ids=["tile_a_program", "persistent_halves", "descriptor_epilogue_halves",
                              "descriptor_epilogue"])
def test_the_tma_kernel_matches_torch_and_the_pointer_kernel(dtype, layout, programs, subtile, epilogue_tma, device):
    """Tails in M, N and K (72 x 56 x 40 in 32 x 32 x 16 blocks, 6 tiles): zero-filled by the
    descriptors; persistent: 3 programs of 2 tiles each (4 programs: 2, 2, 1, 1), the epilogue a
    half tile at a time; the residual and y through descriptors (stores clipped at the tails)."""
    m, n, k = 72, 56, 40
    a, b, bias, residual = _tma_case(dtype, m, n, k, layout, device)
    y = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    gemm_kernels.launch_tma(a, b, bias, residual, y, programs=programs, subtile=subtile, epilogue_tma=epilogue_tma)
    pointer = gemm_kernels.launch(a, b, bias, residual, torch.empty_like(y))
    truth = _expected(*(t.double() for t in (a, b, bias, residual)))
    low = _expected(a, b, bias, residual) if dtype != torch.float32 else None
    check_against_truth(y, truth.to(y.device), low, what=f"tma {dtype} {layout}")
    torch.testing.assert_close(y, pointer, rtol=0, atol=0 if device == "cpu" else 2e-2)


def test_the_tma_launch_falls_back_where_tma_cannot_read(device):
    a, b, bias, residual = _case(torch.bfloat16, 40, 50, 70, linear_layout=True, strided=True, device=device)
    y = gemm_kernels.launch_tma(a, b, bias, residual, torch.full((40, 50), float("nan"), dtype=a.dtype, device=device))
    truth = _expected(*(t.double() for t in (a, b, bias, residual)))
    check_against_truth(y, truth.to(y.device), _expected(a, b, bias, residual), what="fallback")


@pytest.mark.gpu
@pytest.mark.parametrize("config,layout", [
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, persistent, flatten, subtile, epilogue_tma):
    # the H100 sweep's (docs/scripts/gemm_tile.py)
    ((128, 256, 64, 8, 3, True, True, False, False), "linear_weight"),
    ((128, 256, 64, 8, 3, False, True, False, False), "linear_weight"),
    ((128, 256, 64, 8, 3, True, True, False, False), "k_by_n"),
    ((128, 256, 64, 8, 3, True, True, True, False), "linear_weight"),
    ((128, 256, 64, 8, 3, True, True, True, True), "linear_weight"),
], ids=str)
def test_the_tma_kernel_at_gpu_configs(config, layout):
    """bf16 at the configs the H100 sweep (docs/scripts/gemm_tile.py) times, tails in every dim
    (1000 x 776 x 520), against float64 torch and the pointer kernel."""
    block_m, block_n, block_k, warps, stages, persistent, flatten, subtile, epilogue_tma = config
    m, n, k = 1000, 776, 520
    a, b, bias, residual = _tma_case(torch.bfloat16, m, n, k, layout, "cuda")
    assert gemm_lib.tma_layouts(a, b) is not None
    y = torch.full((m, n), float("nan"), dtype=a.dtype, device="cuda")
    programs = 7 if persistent else None  # 32 tiles: 4 or 5 a program
    gemm_kernels.launch_tma(a, b, bias, residual, y, block=config[:3], group_m=8, programs=programs,
                            flatten=flatten, subtile=subtile, epilogue_tma=epilogue_tma, num_warps=warps,
                            num_stages=stages)
    pointer = gemm_kernels.launch(a, b, bias, residual, torch.empty_like(y), block=(128, 128, 64), group_m=8)
    truth = _expected(*(t.double() for t in (a, b, bias, residual)))
    check_against_truth(y, truth, _expected(a, b, bias, residual), what=f"tma {config} {layout}")
    # both accumulate in fp32, in K order: they differ by bf16 rounding of nearly equal sums
    torch.testing.assert_close(y.float(), pointer.float(), rtol=0, atol=2e-2)
