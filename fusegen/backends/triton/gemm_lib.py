"""Triton helpers for matmul kernels (issue 32's GEMM kind): which output tile a program
owns, and that tile of a @ b accumulated in fp32, its epilogue left to the caller.

A pointer kernel, the shape of Triton's matmul tutorials (03, 09): it takes any strides
(a weight in nn.Linear's [N, K] layout is b with b_stride_k = 1), masks every tail, and runs
under the interpreter. Tensor descriptors (TMA) are a later, measured second path
(docs/design/gemm-research.md says why not first).
"""
import triton
import triton.language as tl

from .kernel_lib import indices

__all__ = ["grouped_tile", "matmul_tile"]


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (tile row, tile column) of the [M, N] output. Programs walk GROUP_M
    tile rows down one tile column before the next column, so the programs running at once
    share their b tiles (and a's) in L2."""
    program = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (program // per_group) * GROUP_M
    rows_in_group = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    tile_m = first_m + (program % per_group) % rows_in_group
    tile_n = (program % per_group) // rows_in_group
    return tile_m, tile_n


@triton.jit
def matmul_tile(a_ptr, a_stride_m, a_stride_k, b_ptr, b_stride_k, b_stride_n, tile_m, tile_n, M, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INDEX_64: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, FP64: tl.constexpr = False):
    """(rows, cols, acc): the output tile's row and column indices and a @ b there, in fp32
    (in fp64 with FP64: the operands converted), along K in BLOCK_K steps (the last masked:
    zeros add nothing). Operands of two dtypes are multiplied in fp32; INPUT_PRECISION as
    tl.dot's ("ieee" for fp32 as torch.mm computes it by default)."""
    rows = indices(tile_m * BLOCK_M, BLOCK_M, INDEX_64)
    cols = indices(tile_n * BLOCK_N, BLOCK_N, INDEX_64)
    acc_dtype: tl.constexpr = tl.float64 if FP64 else tl.float32
    acc = tl.zeros((BLOCK_M, BLOCK_N), acc_dtype)
    for first_k in range(0, K, BLOCK_K):
        ks = indices(first_k, BLOCK_K, INDEX_64)
        a = tl.load(a_ptr + rows[:, None] * a_stride_m + ks[None, :] * a_stride_k,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + ks[:, None] * b_stride_k + cols[None, :] * b_stride_n,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        if FP64:
            a, b = a.to(tl.float64), b.to(tl.float64)
        elif a.dtype != b.dtype:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=acc_dtype)
    return rows, cols, acc
