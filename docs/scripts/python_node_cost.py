"""What a Python autograd node costs inside a host-bound model step, against fusegen's whole
cost there (docs/benchmarks.md, issue 15, fourth session).

    PYTHONPATH=. python docs/scripts/python_node_cost.py

The model benchmark's host-bound GPT-2 and LLaMA stacks, ms per step (best of 3 × 40 steps):
plain PyTorch ops; the same with an identity autograd.Function (no kernel, no allocation)
on each swapped op's output, so a Python node stands where each generated op's would;
generated ops. "1 thread": `torch.autograd.set_multithreading_enabled(False)`, the backward
on the calling thread instead of the engine's device thread.

Variants here run one after another, and the H100 host drifts by ±20% between such runs:
autograd_node_ab.py interleaves them, which is what corrected this script's first reading
(docs/benchmarks.md, issue 15, fifth session)."""
import time
from pathlib import Path

import torch

from autograd_node_ab import stepper  # this folder's: the same model step
from fusegen.bench import model as mb


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def with_python_nodes(ops, names):
    """The ops, each output (the first of a pair) passed through Identity."""
    for name in names:
        def wrapped(*args, f=getattr(ops, name)):
            out = f(*args)
            return (Identity.apply(out[0]), *out[1:]) if isinstance(out, tuple) else Identity.apply(out)
        setattr(ops, name, wrapped)
    return ops


def step_ms(name, ops, multithreaded=True, steps=40):
    torch.autograd.set_multithreading_enabled(multithreaded)
    step = stepper(name, ops)
    for _ in range(5):
        step()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / steps * 1e3)
    torch.autograd.set_multithreading_enabled(True)
    return min(times)


SWAPPED = {"llama": ("add_rms_norm", "rms_norm", "swiglu"),
           "gpt2": ("bias_dropout_add_layer_norm", "layer_norm", "bias_gelu")}


def main(runs: int = 2):
    for _ in range(runs):  # the host's noise between runs is large: compare within a run
        for name, names in SWAPPED.items():
            row = {}
            for threads in (True, False):
                suffix = "" if threads else ", 1 thread"
                row["eager" + suffix] = step_ms(name, mb.eager_ops(), threads)
                row["eager + Python nodes" + suffix] = step_ms(name, with_python_nodes(mb.eager_ops(), names), threads)
                row["fusegen" + suffix] = step_ms(name, mb.fusegen_ops(Path("generated")), threads)
            print(name, "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
