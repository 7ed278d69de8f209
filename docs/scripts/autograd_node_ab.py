"""The C++ autograd node against the Python Function inside a host-bound training step,
interleaved in one process so that the host's drift (±20% between runs on the H100 host)
falls on every variant alike.

    PYTHONPATH=. python docs/scripts/autograd_node_ab.py [--rounds 15] [--steps 10] [--ops-only]

First single ops, forward + backward at (1, 128, 1024) bf16 (µs of host time per step,
1000 steps a chunk, the GPU idle); then the model benchmark's host-bound GPT-2 and LLaMA stacks (fusegen.bench.model): eager, and
the generated ops with the Python Function and with the C++ node (fusegen.runtime.native),
timed round-robin in chunks of --steps steps; the median chunk per variant, ms per step."""
import argparse
import statistics
import time
from pathlib import Path

import torch

from fusegen.bench import model as mb
from fusegen.runtime import native


def stepper(name, ops):
    size = mb.SIZES["host"]
    net = mb.build_model(name, size, 0.1, ops, torch.bfloat16, "cuda")
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    tokens = torch.randint(0, size["vocab"], (2, size["batch"], size["seq"]), device="cuda")

    def step():
        net(tokens[0], tokens[1]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def op_steps():
    """One forward + backward of a generated op and of its eager spelling, small enough that
    only host time counts."""
    import torch.nn.functional as F

    from fusegen.bench.cases import import_generated

    gen = {name: getattr(import_generated(name, Path("generated")), name)
           for name in ("bias_gelu_dropout_add", "swiglu", "bias_dropout_add_layernorm")}
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 128, 1024, requires_grad=True, **kw)
    bias = torch.randn(1024, requires_grad=True, **kw)
    residual = torch.randn(1, 128, 1024, **kw)
    weight, norm_bias = torch.randn(1024, requires_grad=True, **kw), torch.randn(1024, requires_grad=True, **kw)
    a = torch.randn(1, 128, 2048, requires_grad=True, **kw)
    g = torch.randn(1, 128, 1024, **kw)

    def pair(h, y):
        torch.autograd.backward((h, y), (g, g))

    return {
        "bias_gelu_dropout_add": (
            lambda: gen["bias_gelu_dropout_add"](x, bias, residual, p=0.1).backward(g),
            lambda: (F.dropout(F.gelu(x + bias, approximate="tanh"), 0.1) + residual).backward(g)),
        "swiglu": (lambda: gen["swiglu"](a).backward(g), lambda: (F.silu(a[..., :1024]) * a[..., 1024:]).backward(g)),
        "bias_dropout_add_layernorm": (
            lambda: pair(*gen["bias_dropout_add_layernorm"](x, bias, residual, weight, norm_bias, 1e-5, 0.1)),
            lambda: pair(h := F.dropout(x + bias, 0.1) + residual,
                         F.layer_norm(h, (1024,), weight, norm_bias, 1e-5))),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ops-only", action="store_true")
    args = parser.parse_args()
    module = native.load(build=True)
    assert module is not None, native.status()

    def node(on: bool):
        native._state.module = module if on else None
        native._state.failed = None if on else "off for this variant"

    for name, (fused, eager) in op_steps().items():
        variants = {"eager": (eager, True), "Python Function": (fused, False), "C++ node": (fused, True)}
        times = {k: [] for k in variants}
        for _ in range(args.rounds):
            for key, (step, on) in variants.items():
                node(on)
                for _ in range(100):
                    step()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(1000):
                    step()
                times[key].append((time.perf_counter() - start) * 1e3)  # µs per step
                torch.cuda.synchronize()
        medians = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name} (1, 128, 1024) bf16 fwd+bwd host:",
              "  ".join(f"{k} {v:.1f} us" for k, v in medians.items()), flush=True)
    if args.ops_only:
        node(True)
        return

    for name in ("gpt2", "llama"):
        eager, fused = stepper(name, mb.eager_ops()), stepper(name, mb.fusegen_ops(Path("generated")))
        variants = {"eager": (eager, True), "fusegen, Python Function": (fused, False), "fusegen, C++ node": (fused, True)}
        times = {k: [] for k in variants}
        for key, (step, on) in variants.items():
            node(on)
            for _ in range(5):
                step()
        for _ in range(args.rounds):
            for key, (step, on) in variants.items():
                node(on)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
                times[key].append((time.perf_counter() - start) / args.steps * 1e3)
        medians = {k: statistics.median(v) for k, v in times.items()}
        print(name, "  ".join(f"{k} {v:.2f} ms" for k, v in medians.items()),
              f"  eager/Python {medians['eager'] / medians['fusegen, Python Function']:.3f}"
              f"  eager/C++ {medians['eager'] / medians['fusegen, C++ node']:.3f}", flush=True)
    node(True)


if __name__ == "__main__":
    main()
