"""Issue 32, before the GEMM kind: gemm_lib's two mainloops with an epilogue (tests/gemm_kernels.py:
y = tanh(a @ b + bias) + residual), the pointer kernel (`matmul_tile`) and the descriptor (TMA)
kernel (`matmul_tile_tma`, one tile a program or persistent), against cuBLAS's bare GEMM
(torch.mm), torch.mm plus the epilogue in eager PyTorch, and torch.compile(mode=
"max-autotune-no-cudagraphs") of the same, bf16, nn.Linear's weight layout, ms by
triton.testing.do_bench. Every candidate is timed in each of --rounds rounds, the candidates
interleaved, and its median kept (the H100's clocks drift over a run by up to 15%: a one-shot
sweep ranks by the order it ran in). A "bare" kernel (the descriptor mainloop storing a @ b,
no epilogue) shows the mainloop's own distance to cuBLAS.
`python docs/scripts/gemm_tile.py [--shapes 16384x4096x4096,...] [--json FILE] [--no-compile]
[--precompile PROCESSES]` (M x K x N). A config that fails (out of shared memory, say) is
reported and left out."""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fusegen.backends.triton import gemm_lib  # noqa: E402
from fusegen.backends.triton.gemm_lib import matmul_tile_tma, tile_of, tma_operands  # noqa: E402
from fusegen.backends.triton.kernel_lib import store_tile  # noqa: E402
from tests import gemm_kernels  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the pointer kernel's best of the research note's
# seven (docs/design/gemm-research.md) on the H100
POINTER_CONFIGS = [(128, 256, 64, 8, 3)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, persistent, flatten, subtile, epilogue_tma):
# persistent on as many programs as SMs, else one a tile; flatten: the persistent loop and K's
# flattened into one pipelined loop (the next tile's loads under this one's epilogue); subtile:
# the epilogue a half tile at a time; epilogue_tma: residual and y through descriptors
TMA_CONFIGS = [
    (128, 256, 64, 8, 3, False, True, False, False), (128, 256, 64, 8, 3, True, True, False, False),
    (128, 256, 64, 8, 4, True, True, False, False), (128, 256, 64, 8, 3, True, True, True, False),
    (128, 256, 64, 8, 3, True, True, True, True),
]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, flatten), persistent
BARE_CONFIGS = [(128, 256, 64, 8, 3, True)]
# Left out, measured on the H100 (2026-11-26, 16384 x 4096 x 4096, torch.mm 0.79-0.84 ms in those runs):
# - Triton 3.6's Hopper warp specialization (tl.range(..., warp_specialize=True) on the K loop,
#   num_warps=4: 12 warps run) wrote NaN over about half the output, here and in the bare
#   kernel; on the tile loop it is ignored on sm_90; its pass fails on subtile and epilogue_tma.
# - the epilogue's loads (bias, residual) issued before the mainloop, held through it: right,
#   but 10.8 to 39 ms against 0.87 (the kernel's pipelining breaks down).
# - 256 x 128 and 128 x 128 tiles (4 or 8 warps): slower than 128 x 256 at both shapes;
#   (128, 256, 64, 8, 4) with subtile or epilogue_tma needs more than 227 KB of shared memory.

parser = argparse.ArgumentParser()
parser.add_argument("--shapes", default="16384x4096x4096,16384x4096x11008")
parser.add_argument("--json", default=None)
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
parser.add_argument("--precompile", type=int, default=0, metavar="PROCESSES",
                    help="compile every config first, in that many processes (Triton's disk cache keeps them)")
parser.add_argument("--precompile-only", action="store_true")
options = parser.parse_args()
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


@triton.jit
def bare_kernel(a_ptr, a_stride_m, b_ptr, b_stride_n, z_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    """z = a @ b, a [M, K] and b (nn.Linear's [N, K]) K-major: the descriptor mainloop, persistent,
    its tile stored by pointers as the generated kernels store."""
    a_desc, b_desc = tma_operands(a_ptr, a_stride_m, 1, b_ptr, 1, b_stride_n, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                  True, True)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        tile_m, tile_n = tile_of(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rows, cols, z = matmul_tile_tma(a_desc, b_desc, tile_m, tile_n, K, BLOCK_M, BLOCK_N, BLOCK_K, False, "ieee",
                                        True, True)
        store_tile(z_ptr, z, rows, cols, N, (rows[:, None] < M) & (cols[None, :] < N))


def eager(a, weight, bias, residual):
    return torch.tanh(a @ weight.t() + bias) + residual


def index_64(*tensors):
    return max(t.numel() for t in tensors) >= 2**31


def pointer_kernel(a, weight, bias, residual, y, config):
    block_m, block_n, block_k, warps, stages = config
    m, k = a.shape
    n = weight.shape[0]
    b = weight.t()  # [K, N] by strides: nn.Linear's layout
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    gemm_kernels.tanh_epilogue_kernel[grid](
        a, *a.stride(), b, *b.stride(), bias, residual, *residual.stride(), y, m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        INDEX_64=index_64(a, weight, residual, y), INPUT_PRECISION="ieee", num_warps=warps, num_stages=stages)
    return y


def tma_kernel(a, weight, bias, residual, y, config):
    block_m, block_n, block_k, warps, stages, persistent, flatten, subtile, epilogue_tma = config
    m, k = a.shape
    n = weight.shape[0]
    b = weight.t()
    a_k_major, b_k_major = gemm_lib.tma_layouts(a, b)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    gemm_kernels.tanh_epilogue_kernel_tma[(min(SMS, tiles) if persistent else tiles,)](
        a, *a.stride(), b, *b.stride(), bias, residual, *residual.stride(), y, m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, INDEX_64=index_64(a, weight, residual, y),
        INPUT_PRECISION="ieee", A_K_MAJOR=a_k_major, B_K_MAJOR=b_k_major, FLATTEN=flatten,
        SUBTILE=subtile, EPILOGUE_TMA=epilogue_tma, num_warps=warps, num_stages=stages)
    return y


def bare(a, weight, bias, residual, y, config):
    block_m, block_n, block_k, warps, stages, flatten = config
    (m, k), n = a.shape, weight.shape[0]
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    bare_kernel[(min(SMS, tiles),)](a, a.stride(0), weight, weight.stride(0), y, m, n, k, BLOCK_M=block_m,
                                    BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, FLATTEN=flatten,
                                    num_warps=warps, num_stages=stages)
    return y


KERNELS = {"tma": tma_kernel, "pointer": pointer_kernel, "bare": bare}


def all_configs():
    return ([("tma", c) for c in TMA_CONFIGS] + [("pointer", c) for c in POINTER_CONFIGS]
            + [("bare", c) for c in BARE_CONFIGS])


def warm(job):
    """Compile one config (launched once on [256, 256] tensors: the same specialization as the
    timed shapes, whose sizes are multiples of 16), in a process of its own."""
    gemm_lib.set_tma_allocator()
    kernel, config = job
    t = [torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((256, 256), (256, 256), (256,), (256, 256))]
    try:
        KERNELS[kernel](*t, torch.empty_like(t[0]), config)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{kernel} {config}: {type(exc).__name__}: {str(exc)[:160]}"


def precompile(processes):
    import concurrent.futures
    import multiprocessing
    import time

    start = time.time()
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for failed in pool.map(warm, all_configs()):
            if failed:
                print("precompile:", failed, flush=True)
    print(f"precompiled {len(all_configs())} configs in {time.time() - start:.0f} s", flush=True)


def main():
    if options.precompile or options.precompile_only:
        precompile(max(1, options.precompile))
        if options.precompile_only:
            return
    gemm_lib.set_tma_allocator()
    rows = []
    for shape in options.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        torch.manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        tensors = (a, weight, bias, residual, y)
        want = eager(*(t.float() for t in (a, weight, bias, residual)))
        bare_want = a.float() @ weight.float().t()
        candidates = {"mm": lambda: a @ weight.t(), "eager": lambda: eager(a, weight, bias, residual)}
        if not options.no_compile:
            compiled = torch.compile(eager, mode="max-autotune-no-cudagraphs")
            compiled(a, weight, bias, residual)
            candidates["compile"] = lambda: compiled(a, weight, bias, residual)
        errors = {}
        for kind, config in all_configs():
            try:
                y.fill_(float("nan"))  # a config that leaves elements unwritten shows as an error of nan
                KERNELS[kind](*tensors, config)
                truth = bare_want if kind == "bare" else want
                errors[f"{kind} {config}"] = ((y.float() - truth).abs().max() / truth.abs().max()).item()
                candidates[f"{kind} {config}"] = (lambda kind, config: lambda: KERNELS[kind](*tensors, config))(
                    kind, config)
            except Exception as exc:  # out of shared memory, say: reported, not fatal
                print(f"  {shape} {kind} {config}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        times = {name: [] for name in candidates}
        for _ in range(options.rounds):
            for name, run in candidates.items():
                times[name].append(triton.testing.do_bench(run))
        ms = {name: statistics.median(t) for name, t in times.items()}
        row = {"shape": [m, k, n], "device": torch.cuda.get_device_name(), "ms": ms, "rounds": times,
               "errors": errors}
        print(f"M K N {m} {k} {n}: mm {ms['mm']:.4f} | eager {ms['eager']:.4f} | compile "
              f"{ms.get('compile', float('nan')):.4f}  (median of {options.rounds} interleaved rounds)", flush=True)
        for name in sorted(ms, key=ms.get):
            if name in ("mm", "eager", "compile"):
                continue
            print(f"  {name}: {ms[name]:.4f} ms  / mm {ms[name] / ms['mm']:.3f}  / compile "
                  f"{ms[name] / ms.get('compile', float('nan')):.3f}  err {errors[name]:.1e}  "
                  f"rounds {' '.join(f'{t:.4f}' for t in times[name])}", flush=True)
        print(f"  mm rounds {' '.join(f'{t:.4f}' for t in times['mm'])}", flush=True)
        rows.append(row)
        if options.json:  # after each shape: a later one's crash keeps the earlier
            Path(options.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
