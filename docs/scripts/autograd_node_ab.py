"""The C++ autograd node against the Python Function inside a host-bound training step,
interleaved in one process so that the host's drift (±20% between runs on the H100 host)
falls on every variant alike.

    PYTHONPATH=. python docs/scripts/autograd_node_ab.py [--rounds 15] [--steps 10]

The model benchmark's host-bound GPT-2 and LLaMA stacks (fusegen.bench.model): eager, and
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    module = native.load(build=True)
    assert module is not None, native.status()

    def node(on: bool):
        native._state.module = module if on else None
        native._state.failed = None if on else "off for this variant"

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
