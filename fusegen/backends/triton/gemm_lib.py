"""Triton helpers for matmul kernels (issue 32's GEMM kind): which output tile a program
owns, and that tile of a @ b accumulated in fp32, its epilogue left to the caller.

Two mainloops, one contract: each returns (rows, cols, acc), the tile's row and column
indices and its fp32 accumulator, for an elementwise epilogue with pointer loads and stores.
- `matmul_tile`: pointer loads, the shape of Triton's matmul tutorials (03, 09). Any strides
  (a weight in nn.Linear's [N, K] layout is b with b_stride_k = 1), every tail masked, any
  dtype (fp64 too); runs under the interpreter.
- `matmul_tile_tma`: loads through tensor descriptors (TMA on sm_90+), the operands' tails
  zero-filled by the hardware. Descriptors from `tma_operands` (built in the kernel, once per
  program: a persistent kernel builds them once for all its tiles). Only for operands
  `tma_layouts` accepts; the others take the pointer path. Triton's interpreter emulates
  descriptors, so it runs there too.
A persistent kernel loops `for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0),
flatten=True)`, takes `tile_of(tile, ...)` and runs the mainloop and epilogue per tile
(tests/gemm_kernels.py's `tanh_epilogue_kernel_tma`). On an H100, bf16, nn.Linear's layout,
tanh(a @ b + bias) + residual at 16384 x 4096 x 4096 (docs/scripts/gemm_tile.py, medians of
interleaved rounds): persistent 128 x 256 x 64, 8 warps, 3 stages, flattened, 1.10x torch.mm
(1.12x at N = 11008), the pointer kernel 1.21-1.28x in the same runs; the descriptor mainloop
alone (no epilogue) 1.00-1.04x torch.mm.
"""
import triton
import triton.language as tl

from .kernel_lib import indices

__all__ = ["grouped_tile", "tile_of", "matmul_tile", "matmul_lowrank_tile", "matmul_lowrank_tile_tma", "inner_matmul", "chunk_start", "tma_operands", "tma_b", "matmul_tile_tma",
           "column_halves", "column_part", "tma_layouts", "set_tma_allocator", "hidden_gradient_kernel"]


@triton.jit
def tile_of(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (tile row, tile column) of the [M, N] output's tile number `tile`. Tiles go
    GROUP_M tile rows down one tile column before the next column, so the tiles computed at
    once share their b tiles (and a's) in L2."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    tile_m = first_m + (tile % per_group) % rows_in_group
    tile_n = (tile % per_group) // rows_in_group
    return tile_m, tile_n


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (tile row, tile column) of the [M, N] output, one tile a program
    (`tile_of` its program id)."""
    return tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)


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


@triton.jit
def matmul_lowrank_tile(a_ptr, a_stride_m, a_stride_k, b_ptr, b_stride_k, b_stride_n, down_ptr, down_stride_k,
                        down_stride_r, tile_m, tile_n, M, N, K, R, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, INDEX_64: tl.constexpr,
                        INPUT_PRECISION: tl.constexpr, FP64: tl.constexpr = False):
    """`matmul_tile`'s (rows, cols, acc), and from the same tiles of a the rows' inner product
    of a low-rank product, a @ down (down [K, R], R at most BLOCK_R; `inner_matmul` finishes
    it): [BLOCK_M, BLOCK_R] more accumulated a K step, R / BLOCK_N of the tile's work."""
    rows = indices(tile_m * BLOCK_M, BLOCK_M, INDEX_64)
    cols = indices(tile_n * BLOCK_N, BLOCK_N, INDEX_64)
    ranks = indices(0, BLOCK_R, INDEX_64)
    acc_dtype: tl.constexpr = tl.float64 if FP64 else tl.float32
    acc = tl.zeros((BLOCK_M, BLOCK_N), acc_dtype)
    inner = tl.zeros((BLOCK_M, BLOCK_R), acc_dtype)
    for first_k in range(0, K, BLOCK_K):
        ks = indices(first_k, BLOCK_K, INDEX_64)
        a = tl.load(a_ptr + rows[:, None] * a_stride_m + ks[None, :] * a_stride_k,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + ks[:, None] * b_stride_k + cols[None, :] * b_stride_n,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        down = tl.load(down_ptr + ks[:, None] * down_stride_k + ranks[None, :] * down_stride_r,
                       mask=(ks[:, None] < K) & (ranks[None, :] < R), other=0.0)
        if FP64:
            a, b, down = a.to(tl.float64), b.to(tl.float64), down.to(tl.float64)
        elif a.dtype != b.dtype or a.dtype != down.dtype:
            a, b, down = a.to(tl.float32), b.to(tl.float32), down.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=acc_dtype)
        inner = tl.dot(a, down, inner, input_precision=INPUT_PRECISION, out_dtype=acc_dtype)
    return rows, cols, acc, inner


@triton.jit
def matmul_lowrank_tile_tma(a_desc, b_desc, down_desc, tile_m, tile_n, K, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                            INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr, A_K_MAJOR: tl.constexpr,
                            B_K_MAJOR: tl.constexpr):
    """`matmul_tile_tma`'s (rows, cols, acc), and `matmul_lowrank_tile`'s inner product from the
    same tiles of a; down ([K, R], stored [R, K] as LoRA's lora_a) through its descriptor too,
    `tma_b(down_ptr, 1, down_stride_r, R, K, BLOCK_R, BLOCK_K, True)` (its rank's tail zero-filled)."""
    first_m = tl.cast(tile_m * BLOCK_M, tl.int32)
    first_n = tl.cast(tile_n * BLOCK_N, tl.int32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    inner = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    for first_k in range(0, K, BLOCK_K):
        k = tl.cast(first_k, tl.int32)
        if A_K_MAJOR:
            a = a_desc.load([first_m, k])
        else:
            a = a_desc.load([k, first_m]).T
        if B_K_MAJOR:
            b = b_desc.load([first_n, k]).T
        else:
            b = b_desc.load([k, first_n])
        down = down_desc.load([0, k]).T
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        inner = tl.dot(a, down, inner, input_precision=INPUT_PRECISION)
    rows = indices(first_m, BLOCK_M, INDEX_64)
    cols = indices(first_n, BLOCK_N, INDEX_64)
    return rows, cols, acc, inner


@triton.jit
def inner_matmul(inner, up_ptr, up_stride_r, up_stride_n, cols, N, R, BLOCK_R: tl.constexpr,
                 INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr, FP64: tl.constexpr,
                 INNER: tl.constexpr):
    """inner @ up at the columns `cols` (a tile's, or a part's), fp32 (fp64 with FP64): the
    rows' [BLOCK_M, R] inner values (a low-rank product's inner product, `matmul_lowrank_tile`'s;
    a hidden layer's values), R at most BLOCK_R, rounded to INNER, the outputs' dtype (torch's
    two matmuls round them so, in the operands' dtype once promoted), times up's [R, cols]
    (up [R, N])."""
    ranks = indices(0, BLOCK_R, INDEX_64)
    # The tail past R is zero, not 0 * a: an inf in a would make it NaN, and NaN times up's zeros too.
    inner = tl.where(ranks[None, :] < R, inner, 0.0).to(INNER)
    up = tl.load(up_ptr + ranks[:, None] * up_stride_r + cols[None, :] * up_stride_n,
                 mask=(ranks[:, None] < R) & (cols[None, :] < N), other=0.0)
    return tl.dot(inner, up.to(INNER), input_precision=INPUT_PRECISION, out_dtype=tl.float64 if FP64 else tl.float32)


@triton.jit
def chunk_start(b_ptr, k, N, b_stride_n, INDEX_64: tl.constexpr):
    """Where b's k-th chunk of N columns starts (b holding the product's chunks side by side:
    nn.Linear's [2N, K] weight of two projections, read as [K, 2N])."""
    if INDEX_64:
        return b_ptr + tl.cast(N, tl.int64) * k * b_stride_n
    return b_ptr + N * k * b_stride_n


@triton.jit
def tma_operands(a_ptr, a_stride_m, a_stride_k, b_ptr, b_stride_k, b_stride_n, M, N, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 A_K_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr):
    """(a_desc, b_desc): tensor descriptors of a [M, K] and b [K, N] over their memory as it
    lies, for `matmul_tile_tma`. A_K_MAJOR: a_stride_k is 1 (a row-major; else a_stride_m is 1,
    a stored as [K, M]); B_K_MAJOR: b_stride_k is 1 (nn.Linear's weight, stored [N, K]; else
    b_stride_n is 1, b stored [K, N]). `tma_layouts` gives both flags, or None where TMA can't
    read an operand. On a GPU the kernel's launch needs an allocator (`set_tma_allocator`)."""
    if A_K_MAJOR:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[a_stride_m, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[a_stride_k, 1],
                                           block_shape=[BLOCK_K, BLOCK_M])
    return a_desc, tma_b(b_ptr, b_stride_k, b_stride_n, N, K, BLOCK_N, BLOCK_K, B_K_MAJOR)


@triton.jit
def tma_b(b_ptr, b_stride_k, b_stride_n, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          B_K_MAJOR: tl.constexpr):
    """`tma_operands`' descriptor of b alone (a chunk of b after the first: its own N columns)."""
    if B_K_MAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[b_stride_n, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[b_stride_k, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    return b_desc


@triton.jit
def matmul_tile_tma(a_desc, b_desc, tile_m, tile_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    A_K_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr):
    """`matmul_tile`'s (rows, cols, acc), its operands read through `tma_operands`'s descriptors
    (any descriptors of those block shapes would do; host-side ones are untried): TMA copies
    to shared memory, the tails (M, N and K) zero-filled, so no masks. fp32 accumulation;
    operands of two dtypes multiplied in fp32. rows and cols are int64 with INDEX_64 (the
    epilogue's offsets); the descriptors' coordinates are int32 (`tma_layouts` keeps each dim
    below 2**31). Not fp64 (`tma_layouts` sends it to `matmul_tile`). The loop is a plain
    range: Triton 3.6's Hopper warp specialization of it wrote NaN (docs/scripts/gemm_tile.py)."""
    # int32 coordinates, as descriptors take them, even where M, N or K arrive as int64
    first_m = tl.cast(tile_m * BLOCK_M, tl.int32)
    first_n = tl.cast(tile_n * BLOCK_N, tl.int32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for first_k in range(0, K, BLOCK_K):
        k = tl.cast(first_k, tl.int32)
        if A_K_MAJOR:
            a = a_desc.load([first_m, k])
        else:
            a = a_desc.load([k, first_m]).T
        if B_K_MAJOR:
            b = b_desc.load([first_n, k]).T
        else:
            b = b_desc.load([k, first_n])
        if a.dtype != b.dtype:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    rows = indices(first_m, BLOCK_M, INDEX_64)
    cols = indices(first_n, BLOCK_N, INDEX_64)
    return rows, cols, acc


@triton.jit
def column_halves(tile_n, acc, BLOCK_N: tl.constexpr, INDEX_64: tl.constexpr):
    """(cols0, acc0, cols1, acc1): the left and right halves of a tile (tile column tile_n)
    and their columns, for an epilogue run once a half (Triton tutorial 09's epilogue
    subtiling): half the live values at once, half-size shared memory for descriptor stores.
    The columns are made afresh (not split from the tile's): Triton then still knows them
    contiguous, and pointer loads and stores of a half stay vectorized along the row."""
    halves = tl.permute(tl.reshape(acc, (acc.shape[0], 2, BLOCK_N // 2)), (0, 2, 1))
    acc0, acc1 = tl.split(halves)
    cols0 = indices(tile_n * BLOCK_N, BLOCK_N // 2, INDEX_64)
    cols1 = indices(tile_n * BLOCK_N + BLOCK_N // 2, BLOCK_N // 2, INDEX_64)
    return cols0, acc0, cols1, acc1


@triton.jit
def column_part(tile_n, acc, part: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
                INDEX_64: tl.constexpr):
    """(cols, values): part `part` of PARTS of the tile's columns (tile column tile_n): the
    whole tile (PARTS 1), or one half of it (PARTS 2, `column_halves`)."""
    if PARTS == 1:
        cols = indices(tile_n * BLOCK_N, BLOCK_N, INDEX_64)
        values = acc
    else:
        cols0, acc0, cols1, acc1 = column_halves(tile_n, acc, BLOCK_N, INDEX_64)
        if part == 0:
            cols, values = cols0, acc0
        else:
            cols, values = cols1, acc1
    return cols, values


_TMA_DTYPES = ("torch.float16", "torch.bfloat16", "torch.float32")


def _tma_major(tensor, k_dim):
    """True where `tensor` (2-D, K its dim k_dim) is K-major as TMA reads it, False where the
    other dim is the unit-stride one, None where TMA can't read it."""
    if tensor.dim() != 2 or tensor.data_ptr() % 16 or max(tensor.shape) >= 2**31:
        return None
    size = tensor.element_size()
    k_stride, other_stride = tensor.stride(k_dim), tensor.stride(1 - k_dim)
    if k_stride == 1 and other_stride > 0 and other_stride * size % 16 == 0:
        return True
    if other_stride == 1 and k_stride > 0 and k_stride * size % 16 == 0:
        return False
    return None


def tma_layouts(a, b):
    """(A_K_MAJOR, B_K_MAJOR) for `tma_operands` where the descriptor mainloop can read
    a [M, K] and b [K, N] as they lie, else None (take `matmul_tile`). The rules: a CUDA device
    of compute capability 9.0 or more; a and b of one dtype, fp16, bf16 or fp32 (fp64 and mixed
    dtypes: pointer path); each operand 2-D, its base 16-byte aligned, one of its strides 1 and
    the other a positive multiple of 16 bytes (so bf16/fp16 need the row length, K or N, a
    multiple of 8, fp32 a multiple of 4; a sliced or transposed view qualifies when its strides
    do), each dim below 2**31. Size-1 dims are not special-cased: [M, 1] or [1, 1] with unit
    strides falls back. Under the interpreter the device check is skipped (it emulates TMA)."""
    import os

    import torch

    if a.dtype != b.dtype or str(a.dtype) not in _TMA_DTYPES:
        return None
    if os.environ.get("TRITON_INTERPRET") != "1":
        if a.device.type != "cuda" or b.device != a.device or torch.cuda.get_device_capability(a.device)[0] < 9:
            return None
    a_major, b_major = _tma_major(a, 1), _tma_major(b, 0)
    if a_major is None or b_major is None:
        return None
    return a_major, b_major


def _torch_scratch(size, alignment, stream):
    import torch

    return torch.empty(size, device="cuda", dtype=torch.int8)


def set_tma_allocator():
    """Give Triton an allocator for the global scratch that in-kernel descriptors are written to
    (a launch of a kernel that calls `tma_operands` fails without one): torch's caching
    allocator, on the current device. Keeps an allocator already set. Such a kernel has global
    scratch, so fusegen's CachedLauncher hands it to Triton's own launcher (more host time)."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


@triton.jit
def hidden_gradient_kernel(dh_ptr, partial_ptr, partial_stride, g_ptr, sums_ptr, M, H, WRITE_G: tl.constexpr,
                           SUMS: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """A hidden layer's gradient step (gemm_launch._hidden_gradients): g = dh x partial, 0
    where the partial is 0 (whatever dh is there, as torch's relu backward), in dh's dtype (the
    compute dtype); dh [M, H] contiguous, the partial [M, H] with rows `partial_stride` apart
    (a column block of what the forward kept). WRITE_G: g into g_ptr ([M, H], its dtype); SUMS:
    its column sums over this program's ROWS rows into sums_ptr ([programs, H], dh's dtype),
    for torch to sum in a fixed order."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    compute: tl.constexpr = dh_ptr.dtype.element_ty
    sums = tl.zeros((BLOCK_H,), compute)
    for offset in range(0, ROWS, BLOCK_M):
        rows = (program * ROWS + offset + tl.arange(0, BLOCK_M)).to(tl.int64)
        in_bounds = (rows[:, None] < M) & (cols[None, :] < H)
        dh = tl.load(dh_ptr + rows[:, None] * H + cols[None, :], mask=in_bounds, other=0.0)
        partial = tl.load(partial_ptr + rows[:, None] * partial_stride + cols[None, :], mask=in_bounds,
                          other=0.0).to(compute)
        g = tl.where(partial == 0, 0.0, dh * partial)
        if WRITE_G:
            tl.store(g_ptr + rows[:, None] * H + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=in_bounds)
        if SUMS:
            sums += tl.sum(g, axis=0)
    if SUMS:
        tl.store(sums_ptr + program * H + cols, sums, mask=cols < H)
