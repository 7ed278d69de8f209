"""Host time of one op inside a compiled graph: a generated kernel that Inductor launches
(fusegen's library op, a torch.library.triton_op) against Inductor's own kernel for the same
math, at a size where the GPU waits for the host. Forward, and forward + backward.

    python docs/scripts/compiled_launch_cost.py [--json out.json]

Each step is timed on the host only (no synchronisation inside the loop), so the time per
call is what the host spends: Python wrapper, argument handling, the launch itself."""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from fusegen.ops.gelu_tanh import gelu_tanh
from fusegen.ops.rmsnorm import rmsnorm


def host_us(fn, *args, calls=2000):
    for _ in range(50):
        fn(*args)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    options = parser.parse_args()
    x = torch.randn(8, 256, device="cuda", requires_grad=True)
    weight = torch.ones(256, device="cuda", requires_grad=True)
    cases = {
        "gelu_tanh": (lambda t, w: gelu_tanh(t), lambda t, w: F.gelu(t, approximate="tanh")),
        "rmsnorm": (lambda t, w: rmsnorm(t, w, 1e-6),
                    lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w),
    }
    results = []
    for name, (ours, theirs) in cases.items():
        for what in ("forward", "forward+backward"):
            row = {"op": name, "what": what}
            for label, fn in (("fusegen", ours), ("inductor", theirs)):
                torch._dynamo.reset()
                compiled = torch.compile(fn, fullgraph=True)
                if what == "forward":
                    with torch.no_grad():
                        row[label] = host_us(compiled, x, weight)
                else:
                    row[label] = host_us(lambda t, w: compiled(t, w).sum().backward(), x, weight, calls=500)
            row["ratio"] = row["fusegen"] / row["inductor"]
            results.append(row)
            print(f"{name:10s} {what:17s} fusegen {row['fusegen']:7.1f} µs  inductor {row['inductor']:7.1f} µs  "
                  f"ratio {row['ratio']:.2f}")
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
