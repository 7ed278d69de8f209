"""A matmul kernel with an epilogue, written by hand over gemm_lib's helpers, as the GEMM
kind will generate one (issue 32): y = tanh(a @ b + bias) + residual. Imported by
test_gemm_lib.py (through the interpreter) and compiled for sm_90 there (no interpreter)."""
import triton
import triton.language as tl

from fusegen.backends.triton import launch  # noqa: F401 - as a generated module: the interpreter's patches
from fusegen.backends.triton.gemm_lib import grouped_tile, matmul_tile
from fusegen.backends.triton.kernel_lib import store_tile


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
    in_bounds = (rows[:, None] < M) & (cols[None, :] < N)
    bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + rows[:, None] * residual_stride_m + cols[None, :] * residual_stride_n,
                       mask=in_bounds, other=0.0).to(tl.float32)
    z = z + bias[None, :]
    e = tl.exp(-2.0 * tl.abs(z))
    y = tl.where(z >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e) + residual
    store_tile(y_ptr, y, rows, cols, N, in_bounds)


def launch(a, b, bias, residual, y, block=(32, 32, 16), group_m=2, index_64=False, input_precision="ieee"):
    """y = tanh(a @ b + bias) + residual over [M, K] @ [K, N] (b's strides give its layout)."""
    (m, k), n = a.shape, b.shape[1]
    block_m, block_n, block_k = block
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    tanh_epilogue_kernel[grid](a, *a.stride(), b, *b.stride(), bias, residual, *residual.stride(), y, m, n, k,
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                               INDEX_64=index_64, INPUT_PRECISION=input_precision)
    return y


if __name__ == "__main__":  # compile for an H100, without a GPU (run without TRITON_INTERPRET)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for pointer in ("fp32", "bf16", "fp16"):
        for index_64 in (False, True):
            signature = {name: f"*{pointer}" if name.endswith("_ptr") else "i32"
                         for name in tanh_epilogue_kernel.arg_names}
            constexprs = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, INDEX_64=index_64,
                              INPUT_PRECISION="ieee" if pointer == "fp32" else "tf32")
            signature.update({name: "constexpr" for name in constexprs})
            triton.compile(ASTSource(tanh_epilogue_kernel, signature=signature, constexprs=constexprs),
                           target=GPUTarget("cuda", 90, 32))
    print("compiled for sm_90")
