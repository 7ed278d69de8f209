"""The model-level benchmark: small GPT-2- and LLaMA-style block stacks trained for a few
steps, their elementwise ops and norms written in plain PyTorch or swapped for generated ops.

Step times (ms, forward + backward + AdamW) for eager, fusegen, torch.compile, fusegen
inside torch.compile, and both compiled with CUDA graphs (mode="reduce-overhead"), at a
host-bound size (hidden 1024, 8×512 tokens) and a GPU-bound one (hidden 4096, 16k tokens).
Every variant starts from the same weights and data; the largest difference of its losses
from eager's is reported (with dropout p > 0 the masks differ, so compare at --p 0).

    python -m fusegen.bench.model --model gpt2 --size host --json gpt2_host.json

At the host-bound size, run-to-run drift on the H100 host (±20%) exceeds most of the
differences measured: --rounds 10 builds every variant at once and steps them round-robin,
so that each ratio comes from interleaved steps of one run.

The ops swapped in (--swap all, the default): in GPT-2, bias_gelu (tanh GELU) in the MLP and
bias_dropout_add_layernorm at each seam (the sublayer's bias, dropout, the residual add and
the next layer norm); in LLaMA, swiglu in the MLP and add_rmsnorm at each seam. --swap
elementwise swaps bias_gelu, bias_dropout_add and swiglu only and leaves the norms to
PyTorch. Plain PyTorch otherwise (attention, matmuls, embedding, loss).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .cases import import_generated

SIZES = {
    # The host-bound case: small matmuls, so each op's host time shows.
    "host": dict(hidden=1024, mlp=2816, heads=8, layers=4, batch=8, seq=512, vocab=8192),
    # GPU-bound: large enough that the elementwise traffic matters.
    "gpu": dict(hidden=4096, mlp=11008, heads=32, layers=2, batch=4, seq=4096, vocab=8192),
    # For tests on the CPU (the interpreter runs the kernels).
    "tiny": dict(hidden=32, mlp=48, heads=2, layers=1, batch=2, seq=8, vocab=64),
}
VARIANTS = ("eager", "fusegen", "compile", "fusegen+compile", "compile+graphs", "fusegen+compile+graphs")


SWAPS = ("all", "elementwise")  # what the fusegen variants swap in: every op, or the elementwise ones


def eager_ops() -> SimpleNamespace:
    """The ops as a PyTorch user writes them. A `(h, y)` pair is the new residual stream and
    its normalized value: a pre-norm block's seam between one sublayer and the next."""
    return SimpleNamespace(
        bias_gelu=lambda x, bias: F.gelu(x + bias, approximate="tanh"),
        swiglu=lambda x: _silu_mul(*x.chunk(2, dim=-1)),
        layer_norm=_layer_norm,
        bias_dropout_add_layer_norm=lambda x, bias, residual, weight, norm_bias, p, training: _then_layer_norm(
            _bias_dropout_add(x, bias, residual, p, training), weight, norm_bias),
        rms_norm=_rms_norm,
        add_rms_norm=lambda x, residual, weight: _then_rms_norm(x + residual, weight),
    )


LAYER_NORM_EPS, RMS_NORM_EPS = 1e-5, 1e-6  # nn.LayerNorm's default; LLaMA's


def _bias_dropout_add(x, bias, residual, p, training):
    return F.dropout(x + bias, p, training) + residual


def _silu_mul(a, b):
    return F.silu(a) * b


def _layer_norm(x, weight, bias):
    return F.layer_norm(x, weight.shape, weight, bias, LAYER_NORM_EPS)


def _rms_norm(x, weight):
    return F.rms_norm(x, weight.shape, weight, RMS_NORM_EPS)


def _then_layer_norm(h, weight, bias):
    return h, _layer_norm(h, weight, bias)


def _then_rms_norm(h, weight):
    return h, _rms_norm(h, weight)


_NORM_OPS = ("layernorm", "bias_dropout_add_layernorm", "rmsnorm", "add_rmsnorm")


def fusegen_ops(generated_dir: Path, swap: str = "all") -> SimpleNamespace:
    """The same ops, generated. swap="all": the norms too, each fused with the residual add
    before it (bias_dropout_add_layernorm, add_rmsnorm, layernorm, rmsnorm); "elementwise":
    bias_gelu, bias_dropout_add and swiglu only, the norms left to PyTorch."""
    if swap not in SWAPS:
        raise ValueError(f"swap: expected one of {SWAPS}, got {swap!r}")
    gen = {name: getattr(import_generated(name, generated_dir), name)
           for name in ("bias_gelu", "swiglu", *(_NORM_OPS if swap == "all" else ("bias_dropout_add",)))}
    ops = eager_ops()
    ops.bias_gelu = lambda x, bias: gen["bias_gelu"](x, bias, activation="gelu_tanh")
    ops.swiglu = gen["swiglu"]
    if swap == "elementwise":
        ops.bias_dropout_add_layer_norm = lambda x, bias, residual, weight, norm_bias, p, training: _then_layer_norm(
            gen["bias_dropout_add"](x, bias, residual, p, training), weight, norm_bias)
        return ops
    ops.layer_norm = lambda x, weight, bias: gen["layernorm"](x, weight, bias, LAYER_NORM_EPS)
    ops.bias_dropout_add_layer_norm = lambda x, bias, residual, weight, norm_bias, p, training: gen[
        "bias_dropout_add_layernorm"](x, bias, residual, weight, norm_bias, LAYER_NORM_EPS, p, training)
    ops.rms_norm = lambda x, weight: gen["rmsnorm"](x, weight, RMS_NORM_EPS)
    ops.add_rms_norm = lambda x, residual, weight: gen["add_rmsnorm"](x, residual, weight, RMS_NORM_EPS)
    return ops


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.proj = nn.Linear(hidden, hidden, bias=False)  # its bias, if any, is the block's to fuse

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).transpose(1, 3).unbind(2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, h))


# A block takes the residual stream x and what its predecessor has yet to add to it
# (`pending`, None for the first block), and returns the same pair: the add then meets the
# next norm in one op, as a fused pre-norm stack runs it. Each module uses only its own
# parameters (FSDP gathers a block's for its forward alone), so the bias of a GPT-2 block's
# MLP output belongs to the next block, or to the final norm, where the seam applies it.


class GPT2Block(nn.Module):
    """Pre-norm block: attention and a tanh-GELU MLP, each ending in bias + dropout + residual."""

    def __init__(self, hidden: int, mlp: int, heads: int, p: float, ops, first: bool = False):
        super().__init__()
        self.ops, self.p = ops, p
        self.seam = None if first else _GPT2Seam(hidden, p, ops)  # the previous block's output bias, norm1
        self.norm1 = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS) if first else None
        self.attention = _Attention(hidden, heads, bias=True)
        self.attention_bias = nn.Parameter(torch.zeros(hidden))
        self.norm2 = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)
        self.fc = nn.Linear(hidden, mlp, bias=False)
        self.fc_bias = nn.Parameter(torch.zeros(mlp))
        self.out = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x, pending):
        ops, p, training = self.ops, self.p, self.training
        if pending is None:
            y = ops.layer_norm(x, self.norm1.weight, self.norm1.bias)
        else:
            x, y = self.seam(x, pending)
        x, y = ops.bias_dropout_add_layer_norm(self.attention(y), self.attention_bias, x,
                                               self.norm2.weight, self.norm2.bias, p, training)
        h = ops.bias_gelu(self.fc(y), self.fc_bias)
        return x, self.out(h)

    @staticmethod
    def final_norm(hidden: int, p: float, ops) -> nn.Module:
        return _GPT2Seam(hidden, p, ops)


class _GPT2Seam(nn.Module):
    """dropout(pending + bias) + x, then a layer norm: returns the new x and its norm."""

    def __init__(self, hidden: int, p: float, ops):
        super().__init__()
        self.ops, self.p = ops, p
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.norm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)

    def forward(self, x, pending):
        return self.ops.bias_dropout_add_layer_norm(pending, self.bias, x, self.norm.weight, self.norm.bias,
                                                    self.p, self.training)


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: attention and a SwiGLU MLP (gate and up in one matmul), residuals."""

    # `first` and `p` (no dropout here) only keep the blocks' signatures alike.
    def __init__(self, hidden: int, mlp: int, heads: int, p: float, ops, first: bool = False):
        super().__init__()
        self.ops = ops
        self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=RMS_NORM_EPS), nn.RMSNorm(hidden, eps=RMS_NORM_EPS)
        self.attention = _Attention(hidden, heads, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x, pending):
        ops = self.ops
        if pending is None:
            y = ops.rms_norm(x, self.norm1.weight)
        else:
            x, y = ops.add_rms_norm(pending, x, self.norm1.weight)
        x, y = ops.add_rms_norm(self.attention(y), x, self.norm2.weight)
        return x, self.down(ops.swiglu(self.gate_up(y)))

    @staticmethod
    def final_norm(hidden: int, p: float, ops) -> nn.Module:
        return _LlamaSeam(hidden, ops)


class _LlamaSeam(nn.Module):
    """pending + x, then an RMS norm: returns the new x and its norm."""

    def __init__(self, hidden: int, ops):
        super().__init__()
        self.ops = ops
        self.norm = nn.RMSNorm(hidden, eps=RMS_NORM_EPS)

    def forward(self, x, pending):
        return self.ops.add_rms_norm(pending, x, self.norm.weight)


class Model(nn.Module):
    def __init__(self, block, size: dict, p: float, ops):
        super().__init__()
        self.embed = nn.Embedding(size["vocab"], size["hidden"])
        self.blocks = nn.ModuleList(
            block(size["hidden"], size["mlp"], size["heads"], p, ops, first=i == 0) for i in range(size["layers"])
        )
        self.final = block.final_norm(size["hidden"], p, ops)  # the last block's pending add and the norm
        self.head = nn.Linear(size["hidden"], size["vocab"], bias=False)

    def forward(self, tokens, targets):
        x, pending = self.embed(tokens), None
        for block in self.blocks:
            x, pending = block(x, pending)
        logits = self.head(self.final(x, pending)[1]).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


@dataclass
class Result:
    model: str
    size: str
    variant: str
    swap: str  # what the fusegen variants swapped in (SWAPS)
    step_ms: float | None  # mean over the timed steps (wall time, one synchronize at the end)
    losses: list[float]
    max_loss_difference: float | None  # against eager's, step by step
    error: str | None = None
    # The median step, from CUDA events recorded as each step is issued: robust to a few
    # slow steps (a busy host), which can move the mean of a host-bound run by tens of percent.
    median_step_ms: float | None = None


def build_model(model: str, size: dict, p: float, ops, dtype, device) -> nn.Module:
    torch.manual_seed(0)  # the same weights for every variant
    block = GPT2Block if model == "gpt2" else LlamaBlock
    return Model(block, size, p, ops).to(device=device, dtype=dtype)


class _Run:
    """One variant built and warmed up, stepped in timed chunks: its model, optimizer and
    batches (the same for every variant), its losses and its timings so far.

    `net(tokens, targets)` returns the loss; "compile" variants step it through torch.compile
    (`backend`; CUDA graphs for "graphs" variants, inductor only). `size` gives the batches'
    vocab, batch and seq."""

    def __init__(self, model: str, size_name: str, variant: str, steps: int, warmup: int, net: nn.Module,
                 size: dict, device, swap: str, backend: str = "inductor"):
        self.model, self.size_name, self.variant, self.swap = model, size_name, variant, swap
        self.net = net
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=1e-4)
        self.forward = self.net
        if "compile" in variant:
            if "graphs" in variant and backend != "inductor":
                raise ValueError(f"{variant}: CUDA graphs (mode='reduce-overhead') need the inductor backend, "
                                 f"not {backend!r}")
            self.forward = torch.compile(self.net, backend=backend,
                                         mode="reduce-overhead" if "graphs" in variant else None)
        g = torch.Generator(device="cpu").manual_seed(1)
        self.batches = [
            torch.randint(0, size["vocab"], (2, size["batch"], size["seq"]), generator=g).to(device)
            for _ in range(min(steps + warmup, 8))
        ]
        self.on_cuda = str(device).startswith("cuda")
        self.losses: list[torch.Tensor] = []
        self.seconds, self.timed_steps, self.step_ms = 0.0, 0, []  # step_ms: each timed step's, from CUDA events
        for _ in range(warmup):
            self.step()
        # Its own random state (dropout's draws), so that interleaving with other variants
        # changes nothing it computes.
        self._random = _random_state(self.on_cuda)

    def step(self) -> None:
        tokens, targets = self.batches[len(self.losses) % len(self.batches)]
        if "graphs" in self.variant:
            torch.compiler.cudagraph_mark_step_begin()
        loss = self.forward(tokens, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.detach().clone())  # a CUDA graph's output is overwritten by its next replay

    def timed(self, steps: int, timed: bool = True) -> None:
        """`steps` steps issued back to back, one synchronize at the end (`timed`: counted)."""
        outer = _random_state(self.on_cuda)
        _set_random_state(self._random, self.on_cuda)
        try:
            self._steps(steps, timed)
        finally:
            self._random = _random_state(self.on_cuda)
            _set_random_state(outer, self.on_cuda)

    def _steps(self, steps: int, timed: bool) -> None:
        synchronize = torch.cuda.synchronize if self.on_cuda else (lambda: None)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if self.on_cuda else []
        synchronize()
        start = time.perf_counter()
        for i in range(steps):
            if marks:
                marks[i].record()
            self.step()
        if marks:
            marks[steps].record()
        synchronize()
        if timed:
            self.seconds += time.perf_counter() - start
            self.timed_steps += steps
            self.step_ms.extend(a.elapsed_time(b) for a, b in zip(marks, marks[1:]))

    def result(self) -> Result:
        median = statistics.median(self.step_ms) if self.step_ms else None
        return Result(self.model, self.size_name, self.variant, self.swap, self.seconds / self.timed_steps * 1e3,
                      [float(v) for v in self.losses], None, median_step_ms=median)


def _random_state(on_cuda: bool) -> tuple:
    return torch.random.get_rng_state(), torch.cuda.get_rng_state() if on_cuda else None


def _set_random_state(state: tuple, on_cuda: bool) -> None:
    torch.random.set_rng_state(state[0])
    if on_cuda:
        torch.cuda.set_rng_state(state[1])


def synthetic_net(model: str, size_name: str, variant: str, p: float, dtype, device, generated_dir: Path,
                  swap: str) -> nn.Module:
    """The block stack a variant of this benchmark trains: generated ops for "fusegen" variants."""
    ops = fusegen_ops(generated_dir, swap) if variant.startswith("fusegen") else eager_ops()
    return build_model(model, SIZES[size_name], p, ops, dtype, device)


def run_variants(model: str, size_name: str, variants: list[str], steps: int, warmup: int, p: float,
                 dtype=torch.bfloat16, device="cuda", generated_dir: Path = Path("generated"),
                 swap: str = "all", rounds: int = 1, build: Callable[[str], nn.Module] | None = None,
                 size: dict | None = None, backend: str = "inductor") -> list[Result]:
    """Each variant's Result. rounds=1: one variant after another, each freed before the
    next is built. rounds > 1: all built at once (more memory), then stepped round-robin,
    `steps / rounds` steps each per round, so that the host's drift over the run falls on
    every variant alike (on the H100 host, ±20% between sequential runs).

    build(variant) -> the loss module, seeded alike for every variant (default: this
    benchmark's block stacks, `synthetic_net`); size: its vocab, batch and seq (default
    SIZES[size_name]); backend: torch.compile's, for the "compile" variants."""
    if rounds < 1 or rounds > steps:
        raise ValueError(f"rounds must be between 1 and steps ({steps}), got {rounds}")
    if len(set(variants)) != len(variants):
        raise ValueError(f"variants must be distinct, got {variants}")
    if build is None:
        def build(variant: str) -> nn.Module:
            return synthetic_net(model, size_name, variant, p, dtype, device, generated_dir, swap)
    size = SIZES[size_name] if size is None else size
    results: dict[str, Result] = {}
    runs: dict[str, _Run] = {}

    def failed(variant: str, exc: Exception) -> None:
        results[variant] = Result(model, size_name, variant, swap, None, [], None, f"{type(exc).__name__}: {exc}"[:300])
        runs.pop(variant, None)

    for variant in variants:
        try:
            runs[variant] = _Run(model, size_name, variant, steps, warmup, build(variant), size, device, swap, backend)
            if rounds == 1:
                runs[variant].timed(steps)
                results[variant] = runs.pop(variant).result()
        except Exception as exc:  # noqa: BLE001 - a failed variant is reported, the others still run
            failed(variant, exc)
        if rounds == 1 and str(device).startswith("cuda"):
            torch.cuda.empty_cache()
    for r in range(-1, rounds if rounds > 1 else -1):
        # Round -1, untimed: each variant once after the others, so that whatever switching
        # costs the first time (CUDA-graph trees, caches) is not timed. Each round starts
        # with the next variant, so that no variant always follows the same one.
        chunk = 1 if r < 0 else steps // rounds + (r < steps % rounds)
        order = list(runs.items())
        for variant, run in order[r % len(order):] + order[:r % len(order)] if order else ():
            try:
                run.timed(chunk, timed=r >= 0)
            except Exception as exc:  # noqa: BLE001
                failed(variant, exc)
    results.update((variant, run.result()) for variant, run in runs.items())
    return [results[v] for v in variants]


def run_variant(model: str, size_name: str, variant: str, steps: int, warmup: int, p: float,
                dtype=torch.bfloat16, device="cuda", generated_dir: Path = Path("generated"),
                swap: str = "all") -> Result:
    """One variant on its own (run_variants with one variant; a failure raises)."""
    net = synthetic_net(model, size_name, variant, p, dtype, device, generated_dir, swap)
    run = _Run(model, size_name, variant, steps, warmup, net, SIZES[size_name], device, swap)
    run.timed(steps)
    return run.result()


def compare_losses(results: list[Result]) -> None:
    """Each variant's largest step-by-step loss difference from eager's."""
    eager = next((r for r in results if r.variant == "eager" and r.error is None), None)
    for r in results:
        if eager is not None and r.error is None:
            r.max_loss_difference = max(abs(a - b) for a, b in zip(r.losses, eager.losses))


def versions(on_cuda: bool = True) -> dict:
    """What a result depends on besides the code: library versions, the device, the autograd node."""
    import triton

    from ..runtime import native

    return dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                device=torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu",
                autograd_node=native.status())  # the C++ node or the Python Function (runtime.native)


def print_results(results: list[Result]) -> None:
    for r in results:
        if r.error:
            shown = "failed: " + r.error
        else:
            median = "" if r.median_step_ms is None else f" (median {r.median_step_ms:.2f})"
            shown = f"{r.step_ms:8.2f} ms/step{median}"
        difference = "" if r.max_loss_difference is None else f"  max |loss - eager's| {r.max_loss_difference:.3g}"
        print(f"{r.model:6s} {r.size:5s} {r.variant:24s} {shown}{difference}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusegen.bench.model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), action="append", help="default: both")
    parser.add_argument("--size", choices=tuple(SIZES), default="host")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--p", type=float, default=0.1, help="GPT-2's dropout probability (default 0.1)")
    parser.add_argument("--swap", choices=SWAPS, default="all",
                        help="what the fusegen variants swap in: every op (default) or the elementwise ones")
    parser.add_argument("--rounds", type=int, default=1,
                        help="1: variants one after another; more: all built at once and stepped round-robin in "
                             "this many chunks (same-run ratios robust to the host's drift; more GPU memory)")
    parser.add_argument("--generated", type=Path, default=Path("generated"))
    parser.add_argument("--json", help="write the results and the run's versions as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m fusegen.bench.model: needs a CUDA device", file=sys.stderr)
        return 2
    results = []
    for model in args.model or ["gpt2", "llama"]:
        variants = args.variants.split(",")
        results += run_variants(model, args.size, variants, args.steps, args.warmup, args.p,
                                generated_dir=args.generated, swap=args.swap, rounds=args.rounds)
        compare_losses([r for r in results if r.model == model])
        torch.cuda.empty_cache()
    meta = versions()
    print(f"autograd node: {meta['autograd_node']}")
    print_results(results)
    if args.json:
        meta.update(size=SIZES[args.size], p=args.p, swap=args.swap, steps=args.steps, warmup=args.warmup,
                    rounds=args.rounds)
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"metadata": meta, "results": [asdict(r) for r in results]}, handle, indent=1)
    return 0 if all(r.error is None and math.isfinite(r.step_ms) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
