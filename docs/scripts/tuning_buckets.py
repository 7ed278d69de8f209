"""Tuning that follows real shapes (docs/benchmarks.md): a loop over 50 row counts M in
[1k, 64k] vs the same number of calls at one M, each in a fresh process. `warm` fills
Triton's caches first. On a CUDA machine, from a checkout's root (it imports generated.swiglu):

    PYTHONPATH=. python docs/scripts/tuning_buckets.py NAME warm       # once
    PYTHONPATH=. python docs/scripts/tuning_buckets.py NAME varying    # each in a fresh process
    PYTHONPATH=. python docs/scripts/tuning_buckets.py NAME one
"""
import random
import sys
import time

import torch

from generated import swiglu

N = 4096
ms = random.Random(0).sample(range(1024, 65537), 50)
one = [sum(ms) // len(ms)] * len(ms)


def loop(rows):
    start = time.perf_counter()
    for m in rows:
        a = torch.randn(m, 2 * N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        swiglu.swiglu(a).backward(torch.ones(m, N, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    return time.perf_counter() - start


mode = sys.argv[2]
if mode == "warm":
    loop(ms)
    loop(one)
    print(sys.argv[1], "warmed")
else:
    torch.randn(1, device="cuda")  # the CUDA context, outside the timing
    seconds = loop(ms if mode == "varying" else one)
    print(sys.argv[1], mode, f"{seconds:.3f} s for {len(ms)} calls, M in [{min(ms)}, {max(ms)}]" if mode == "varying"
          else f"{seconds:.3f} s for {len(ms)} calls at M = {one[0]}")
