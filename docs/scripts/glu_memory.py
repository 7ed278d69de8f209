"""GLU forward+backward: peak extra memory (MiB above the inputs) and time, fusegen (new
gradient buffer, and inplace_backward=True) vs Liger-Kernel (writes gradients into its
inputs) vs eager; the gradient taken with respect to the op's input only."""
import torch, triton
import torch.nn.functional as F
from liger_kernel.ops.geglu import LigerGELUMulFunction
from liger_kernel.ops.swiglu import LigerSiLUMulFunction
from generated import geglu, swiglu
OPS = {"swiglu": (swiglu.swiglu, LigerSiLUMulFunction.apply, lambda a, b: F.silu(a) * b),
       "geglu": (geglu.geglu, LigerGELUMulFunction.apply, lambda a, b: F.gelu(a, approximate="tanh") * b)}
for name, (ours, liger, eager) in OPS.items():
    for dtype, m, n in [(torch.bfloat16, 16384, 8192), (torch.float32, 16384, 4096)]:
        base_x = torch.randn(m, 2 * n, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn(m, n, device="cuda", dtype=dtype)
        def fusegen(in_place):
            h = base_x * 1.0  # a producer's output: no leaf, no view
            return lambda: torch.autograd.grad(ours(h, inplace_backward=in_place), h, g)
        a = base_x.detach()[:, :n].contiguous().requires_grad_(True)
        b = base_x.detach()[:, n:].contiguous().requires_grad_(True)
        cases = {"fusegen": fusegen(False), "fusegen inplace": fusegen(True),
                 "liger": lambda: torch.autograd.grad(liger(a, b), (a, b), g),
                 "eager": lambda: torch.autograd.grad(eager(a, b), (a, b), g)}
        row = []
        for label, fn in cases.items():
            fn(); fn(); torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
            out = fn(); torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            del out
            ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            row.append(f"{label} {peak:.0f} MiB {ms:.4f} ms")
        print(f"{name} {str(dtype)[6:]} ({m}, {n}): " + " | ".join(row), flush=True)
