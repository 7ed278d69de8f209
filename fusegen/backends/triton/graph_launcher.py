"""Launching a kernel inside a graph that torch.compile or torch.export traces.

The library ops are `torch.library.triton_op`s: while a graph is traced their bodies run on
fake tensors, and each launch made through `torch.library.wrap_triton` is recorded as the
kernel itself (a `triton_kernel_wrapper` node) that Inductor then launches from its own
generated code, forward and backward, with no Python op in between.

Inductor takes an autotuned kernel's configs and tunes them on the first run of the
compiled graph (its own autotuning cache keeps the result); it does not take pre- or
post-hooks, nor Triton's own tuning cache. So the kernel is handed to it as a plain
`triton.autotune` over the same JIT function and configs, with the same pruner, which
runs while tracing on the sizes the graph was traced with (`tuning.size_hint`).
"""
from __future__ import annotations

import torch
import triton

from .interpreter import kernel_is_interpreted


def traceable(kernel) -> bool:
    """Whether launches of `kernel` can be recorded in a traced graph: a compiled Triton
    kernel can; one the CPU interpreter runs cannot (it would run on the fake tensors)."""
    return not kernel_is_interpreted(kernel)


class GraphLauncher:
    """`launch(grid, args, constexprs)` as `CachedLauncher` takes it, recorded by wrap_triton."""

    tunes = True

    def __init__(self, kernel: triton.runtime.Autotuner):
        prune = kernel.early_config_prune
        if kernel.user_defined_pre_hook:
            # Its hook zeroes a buffer the kernel adds into before each trial (tuning.
            # zero_before_trials), which Inductor cannot run: the pruner's first tile, untuned.
            first = prune

            def prune(configs, named_args, **kwargs):
                return first(configs, named_args, **kwargs)[:1]

        self.kernel = triton.autotune(configs=kernel.configs, key=kernel.keys,
                                      prune_configs_by={"early_config_prune": prune})(kernel.fn)

    def launch(self, grid, args: list, constexprs: dict) -> None:
        from torch.library import wrap_triton

        if any(a is None for a in args):
            # A pointer the kernel does not read in this call (its flag is off: no dropout, a
            # gradient not wanted) is None in eager launches; in a graph, which AOTInductor
            # compiles to C++ launches, a one-element tensor stands for it.
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            unused = torch.empty(1, dtype=torch.int64, device=device)
            args = [unused if a is None else a for a in args]
        wrap_triton(self.kernel)[grid](*args, **constexprs)
        return None  # no binary here: Inductor compiles and launches its own
