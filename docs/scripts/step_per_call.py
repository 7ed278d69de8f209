"""Per-step host and GPU time of forward+backward at small shapes: fusegen vs eager.

    PYTHONPATH=. python docs/scripts/step_per_call.py 1,128,1024

"host": enqueueing 1000 steps; "wall": the same with the GPU work, to a final synchronize;
"GPU": kernel time per step (torch.profiler) and the largest kernels."""
import sys, time, torch
import torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
from generated import bias_gelu_dropout_add as seed_op, swiglu
shape = tuple(int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,128,1024").split(","))
H = shape[-1]
x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
r = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
a = torch.randn(*shape[:-1], 2 * H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.ones_like(r)
steps = {
    "fusegen seed": lambda: seed_op.bias_gelu_dropout_add(x, b, r, p=0.1).backward(g),
    "eager seed": lambda: (F.dropout(F.gelu(x + b, approximate="tanh"), 0.1) + r).backward(g),
    "fusegen seed p0": lambda: seed_op.bias_gelu_dropout_add(x, b, r, p=0.0).backward(g),
    "fusegen swiglu": lambda: swiglu.swiglu(a).backward(g),
    "eager swiglu": lambda: (F.silu(a[..., :H]) * a[..., H:]).backward(g),
}
for name, fn in steps.items():
    for _ in range(300): fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(1000): fn()
        host = (time.perf_counter() - t) / 1000 * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 1000 * 1e6
        best = min(best, host)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(100): fn()
        torch.cuda.synchronize()
    gpu = sum(e.device_time_total for e in prof.key_averages()) / 100
    kernels = sorted(((e.device_time_total / 100, e.key[:60]) for e in prof.key_averages() if e.device_time_total > 0), reverse=True)[:6]
    print(f"{shape} {name:18s} host {best:7.1f} us/step, wall {wall:7.1f}, GPU {gpu:6.1f} us/step; " + "; ".join(f"{k} {v:.1f}" for v, k in kernels), flush=True)
