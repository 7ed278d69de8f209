"""Matmul kernels with an epilogue, written by hand over gemm_lib's helpers, as the GEMM
kind will generate one (issue 32): y = tanh(a @ b + bias) + residual. `tanh_epilogue_kernel`
over the pointer mainloop (`matmul_tile`), `tanh_epilogue_kernel_tma` over the descriptor one
(`matmul_tile_tma`), persistent when launched on fewer programs than tiles. Imported by
test_gemm_lib.py (through the interpreter, and on a GPU) and compiled for sm_90 there (no
interpreter)."""
import triton
import triton.language as tl

from fusegen.backends.triton import launch as _launch  # noqa: F401 - as a generated module: the interpreter's patches
from fusegen.backends.triton import gemm_lib
from fusegen.backends.triton.gemm_lib import (column_halves, grouped_tile, matmul_tile, matmul_tile_tma, tile_of,
                                              tma_operands)
from fusegen.backends.triton.kernel_lib import store_tile


@triton.jit
def tanh_inputs(rows, cols, bias_ptr, residual_ptr, residual_stride_m, residual_stride_n, M, N):
    """The epilogue's loads on the tile rows x cols: bias and residual, in their dtype."""
    bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
    residual = tl.load(residual_ptr + rows[:, None] * residual_stride_m + cols[None, :] * residual_stride_n,
                       mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
    return bias, residual


@triton.jit
def tanh_of(z, bias, residual):
    """tanh(z + bias) + residual, in fp32."""
    z = z + bias.to(tl.float32)[None, :]
    e = tl.exp(-2.0 * tl.abs(z))
    return tl.where(z >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e) + residual.to(tl.float32)


@triton.jit
def tanh_epilogue(z, rows, cols, bias_ptr, residual_ptr, residual_stride_m, residual_stride_n, y_ptr, M, N):
    """y = tanh(z + bias) + residual on the tile rows x cols, stored."""
    bias, residual = tanh_inputs(rows, cols, bias_ptr, residual_ptr, residual_stride_m, residual_stride_n, M, N)
    store_tile(y_ptr, tanh_of(z, bias, residual), rows, cols, N, (rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def tanh_epilogue_kernel(
    a_ptr, a_stride_m, a_stride_k, b_ptr, b_stride_k, b_stride_n, bias_ptr,
    residual_ptr, residual_stride_m, residual_stride_n, y_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    tile_m, tile_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows, cols, z = matmul_tile(a_ptr, a_stride_m, a_stride_k, b_ptr, b_stride_k, b_stride_n, tile_m, tile_n,
                                M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, INDEX_64, INPUT_PRECISION)
    tanh_epilogue(z, rows, cols, bias_ptr, residual_ptr, residual_stride_m, residual_stride_n, y_ptr, M, N)


@triton.jit
def tanh_epilogue_kernel_tma(
    a_ptr, a_stride_m, a_stride_k, b_ptr, b_stride_k, b_stride_n, bias_ptr,
    residual_ptr, residual_stride_m, residual_stride_n, y_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr, A_K_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr,
    FLATTEN: tl.constexpr = True, SUBTILE: tl.constexpr = False, EPILOGUE_TMA: tl.constexpr = False,
):
    """Each program takes tiles program_id, program_id + programs, ... (one tile a program when
    launched on as many programs as tiles; persistent on fewer), its descriptors built once.
    FLATTEN: the tile loop and the K loop pipelined as one. SUBTILE: the epilogue a half tile at
    a time. EPILOGUE_TMA (for residual and y row-major with 16-byte rows): residual and y
    through descriptors, not pointers (an experiment: what a descriptor epilogue buys)."""
    a_desc, b_desc = tma_operands(a_ptr, a_stride_m, a_stride_k, b_ptr, b_stride_k, b_stride_n, M, N, K,
                                  BLOCK_M, BLOCK_N, BLOCK_K, A_K_MAJOR, B_K_MAJOR)
    HALF_N: tl.constexpr = BLOCK_N // 2
    if EPILOGUE_TMA:
        EPILOGUE_N: tl.constexpr = HALF_N if SUBTILE else BLOCK_N
        residual_desc = tl.make_tensor_descriptor(residual_ptr, shape=[M, N], strides=[residual_stride_m, 1],
                                                  block_shape=[BLOCK_M, EPILOGUE_N])
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, EPILOGUE_N])
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        tile_m, tile_n = tile_of(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        first_m, first_n = tile_m * BLOCK_M, tile_n * BLOCK_N
        rows, cols, z = matmul_tile_tma(a_desc, b_desc, tile_m, tile_n, K, BLOCK_M, BLOCK_N, BLOCK_K, INDEX_64,
                                        INPUT_PRECISION, A_K_MAJOR, B_K_MAJOR)
        if SUBTILE:
            cols0, z0, cols1, z1 = column_halves(tile_n, z, BLOCK_N, INDEX_64)
            if EPILOGUE_TMA:
                residual0 = residual_desc.load([first_m, first_n])
                residual1 = residual_desc.load([first_m, first_n + HALF_N])
                bias0 = tl.load(bias_ptr + cols0, mask=cols0 < N, other=0.0)
                bias1 = tl.load(bias_ptr + cols1, mask=cols1 < N, other=0.0)
            else:
                bias0, residual0 = tanh_inputs(rows, cols0, bias_ptr, residual_ptr, residual_stride_m,
                                               residual_stride_n, M, N)
                bias1, residual1 = tanh_inputs(rows, cols1, bias_ptr, residual_ptr, residual_stride_m,
                                               residual_stride_n, M, N)
            y0, y1 = tanh_of(z0, bias0, residual0), tanh_of(z1, bias1, residual1)
            if EPILOGUE_TMA:
                y_desc.store([first_m, first_n], y0.to(y_ptr.dtype.element_ty))
                y_desc.store([first_m, first_n + HALF_N], y1.to(y_ptr.dtype.element_ty))
            else:
                store_tile(y_ptr, y0, rows, cols0, N, (rows[:, None] < M) & (cols0[None, :] < N))
                store_tile(y_ptr, y1, rows, cols1, N, (rows[:, None] < M) & (cols1[None, :] < N))
        else:
            if EPILOGUE_TMA:
                residual = residual_desc.load([first_m, first_n])
                bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
            else:
                bias, residual = tanh_inputs(rows, cols, bias_ptr, residual_ptr, residual_stride_m,
                                             residual_stride_n, M, N)
            y = tanh_of(z, bias, residual)
            if EPILOGUE_TMA:
                y_desc.store([first_m, first_n], y.to(y_ptr.dtype.element_ty))
            else:
                store_tile(y_ptr, y, rows, cols, N, (rows[:, None] < M) & (cols[None, :] < N))


def launch(a, b, bias, residual, y, block=(32, 32, 16), group_m=2, index_64=False, input_precision="ieee"):
    """y = tanh(a @ b + bias) + residual over [M, K] @ [K, N] (b's strides give its layout)."""
    (m, k), n = a.shape, b.shape[1]
    block_m, block_n, block_k = block
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    tanh_epilogue_kernel[grid](a, *a.stride(), b, *b.stride(), bias, residual, *residual.stride(), y, m, n, k,
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                               INDEX_64=index_64, INPUT_PRECISION=input_precision)
    return y


def launch_tma(a, b, bias, residual, y, block=(32, 32, 16), group_m=2, index_64=False, input_precision="ieee",
               programs=None, flatten=True, subtile=False, epilogue_tma=False, num_warps=4, num_stages=3):
    """`launch` through the descriptor mainloop where `gemm_lib.tma_layouts` accepts a and b
    (else `launch`, the pointer kernel, at the same block). programs: how many programs (the
    persistent kernel's, at most the tiles' count); None: one a tile. flatten, subtile,
    epilogue_tma (where TMA can take residual and y: row-major, 16-byte rows): the kernel's
    FLATTEN, SUBTILE, EPILOGUE_TMA."""
    layouts = gemm_lib.tma_layouts(a, b)
    if layouts is None:
        return launch(a, b, bias, residual, y, block, group_m, index_64, input_precision)
    epilogue_tma = epilogue_tma and gemm_lib._tma_major(residual, 1) is True and gemm_lib._tma_major(y, 1) is True
    (m, k), n = a.shape, b.shape[1]
    block_m, block_n, block_k = block
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    gemm_lib.set_tma_allocator()
    tanh_epilogue_kernel_tma[(min(programs or tiles, tiles),)](
        a, *a.stride(), b, *b.stride(), bias, residual, *residual.stride(), y, m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, INDEX_64=index_64,
        INPUT_PRECISION=input_precision, A_K_MAJOR=layouts[0], B_K_MAJOR=layouts[1], FLATTEN=flatten,
        SUBTILE=subtile, EPILOGUE_TMA=epilogue_tma, num_warps=num_warps, num_stages=num_stages)
    return y


if __name__ == "__main__":  # compile for an H100, without a GPU (run without TRITON_INTERPRET)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_for_sm90(kernel, pointer, constexprs, **options):
        signature = {name: f"*{pointer}" if name.endswith("_ptr") else "i32" for name in kernel.arg_names}
        signature.update({name: "constexpr" for name in constexprs})
        return triton.compile(ASTSource(kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)

    for pointer in ("fp32", "bf16", "fp16"):
        for index_64 in (False, True):
            compile_for_sm90(tanh_epilogue_kernel, pointer, dict(
                BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, INDEX_64=index_64,
                INPUT_PRECISION="ieee" if pointer == "fp32" else "tf32"))
    # the descriptor kernel at the config measured best (bf16, nn.Linear's weight: b K-major,
    # persistent and flattened, half-tiles); the shared memory it asks for fits an H100's. (One
    # variant: each costs 20-30 s of CI's CPU; the others run on the GPU suite.)
    for pointer, a_k_major, b_k_major, subtile, epilogue_tma in (("bf16", True, True, True, False),):
        compiled = compile_for_sm90(tanh_epilogue_kernel_tma, pointer, dict(
            BLOCK_M=128, BLOCK_N=128 if pointer == "fp32" else 256, BLOCK_K=64 if pointer != "fp32" else 32,
            GROUP_M=8, INDEX_64=subtile, INPUT_PRECISION="tf32", A_K_MAJOR=a_k_major, B_K_MAJOR=b_k_major,
            FLATTEN=True, SUBTILE=subtile, EPILOGUE_TMA=epilogue_tma),
            num_warps=8, num_stages=3)
        assert compiled.metadata.shared <= 232448, (pointer, compiled.metadata.shared)
    print("compiled for sm_90")
