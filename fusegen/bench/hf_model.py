"""The model benchmark on real Hugging Face models: LLaMA and GPT-2 from transformers, random
weights, trained a few steps as they are and with fusegen's ops patched in
(fusegen.integrations.huggingface.patch).

Step times (ms, forward + backward + AdamW, bf16) for eager, fusegen, torch.compile, fusegen
inside torch.compile, and both compiled with CUDA graphs (mode="reduce-overhead"), at a
host-bound size (hidden 1024 × 4 layers, 8×512 tokens) and a GPU-bound one (hidden 2048 ×
6 layers, 8×2048 tokens). Every variant starts from the same weights and trains on the same
batches; the variants are built at once and stepped round-robin (--rounds) so that the host's
drift falls on all alike. Each variant's largest loss difference from eager's is reported: with
GPT-2's dropout on (its default 0.1, --p) the masks differ (fusegen draws its own), so that
number says little; run with --p 0 to compare losses.

    python -m fusegen.bench.hf_model --model llama --size host --json llama_host.json

--size tiny runs on the CPU too (the kernels in Triton's interpreter; the tests use it): there
torch.compile takes the aot_eager backend and the CUDA-graph variants are left out.

The timing, the round-robin and the loss comparison are fusegen.bench.model's; only the
models differ. What the patch replaces, and what it leaves, is printed and kept in the JSON.

This measures what a transformers user gets. fusegen.bench.model's synthetic stacks still
have a use beside it: they fuse each MLP's residual add with the next layer's norm (across the
layer boundary, which patching transformers' layers cannot do), carry none of transformers'
per-step Python (masks, rotary tables, output classes), and --swap elementwise separates the
norms' share: the most the ops can give, against what they give here.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from . import model as synthetic
from .model import VARIANTS

MODELS = ("llama", "gpt2")
# The models' shapes, as transformers' config arguments. The vocabulary is kept small (as in
# fusegen.bench.model), so that the LM head and the loss do not hide the blocks.
SIZES = {
    "host": dict(batch=8, seq=512, vocab=8192,
                 llama=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8),
                 gpt2=dict(n_embd=1024, n_layer=4, n_head=16)),
    "gpu": dict(batch=8, seq=2048, vocab=8192,
                llama=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=6, num_attention_heads=16),
                gpt2=dict(n_embd=2048, n_layer=6, n_head=16)),
    "tiny": dict(batch=2, seq=8, vocab=64,
                 llama=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2),
                 gpt2=dict(n_embd=32, n_layer=1, n_head=2)),
}
GPT2_DROPOUT = 0.1  # GPT-2's default resid_pdrop, embd_pdrop and attn_pdrop


class CausalLMLoss(nn.Module):
    """A transformers causal LM as the loss of (tokens, targets): what the benchmark steps."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, tokens, targets):
        return self.lm(input_ids=tokens, labels=targets).loss


def build_lm(model: str, size: dict, p: float, device, dtype) -> nn.Module:
    """The model with seeded random weights, in train mode, without a KV cache (training)."""
    import transformers

    if model == "llama":
        config = transformers.LlamaConfig(**size["llama"], num_key_value_heads=size["llama"]["num_attention_heads"],
                                          vocab_size=size["vocab"], max_position_embeddings=size["seq"],
                                          use_cache=False)
        cls = transformers.LlamaForCausalLM
    else:
        # p sets every dropout GPT-2 has (residual, embedding, attention), so that p=0 is deterministic.
        config = transformers.GPT2Config(**size["gpt2"], vocab_size=size["vocab"], n_positions=max(size["seq"], 1024),
                                         resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False,
                                         bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(0)  # the same weights for every variant
    with torch.device(device):
        lm = cls(config)
    return lm.to(dtype=dtype).train()


def run(model: str, size_name: str, variants: list[str], steps: int, warmup: int, p: float, rounds: int,
        dtype=torch.bfloat16, device="cuda", generated: Path | None = None,
        backend: str = "inductor") -> tuple[list[synthetic.Result], str | None]:
    """Each variant's Result, the losses compared with eager's, and the patch's summary."""
    from ..integrations.huggingface import patch

    size = SIZES[size_name]
    summaries = []

    def build(variant: str) -> nn.Module:
        lm = build_lm(model, size, p, device, dtype)
        if variant.startswith("fusegen"):
            summaries.append(patch(lm, generated=generated).summary())
        return CausalLMLoss(lm)

    results = synthetic.run_variants(model, size_name, variants, steps, warmup, p, dtype=dtype, device=device,
                                     swap="all", rounds=rounds, build=build, size=size, backend=backend)
    synthetic.compare_losses(results)
    return results, summaries[0] if summaries else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusegen.bench.hf_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, action="append", help="default: both")
    parser.add_argument("--size", choices=tuple(SIZES), default="host")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first (default 5)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="the timed steps come in this many round-robin chunks over the variants (default 10; "
                             "1: one variant after another, each freed before the next)")
    parser.add_argument("--p", type=float, default=GPT2_DROPOUT,
                        help=f"GPT-2's dropout probabilities (default {GPT2_DROPOUT}, its own); 0 to compare losses")
    parser.add_argument("--generated", type=Path, default=None,
                        help="a folder of generated modules (default: the checkout's generated/, else fusegen.ops)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                        help="the models' dtype (default: bf16 on a GPU, fp32 on the CPU, where the interpreter runs)")
    parser.add_argument("--json", help="write the results, the patch summaries and the versions as JSON")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; of: {', '.join(VARIANTS)}")
    on_cuda = torch.cuda.is_available()
    left_out = {}
    if not on_cuda:
        if args.size != "tiny":
            print(f"python -m fusegen.bench.hf_model: --size {args.size} needs a CUDA device (on the CPU, --size tiny)",
                  file=sys.stderr)
            return 2
        for variant in variants:
            if "graphs" in variant:
                left_out[variant] = "CUDA graphs need a CUDA device"
        variants = [v for v in variants if v not in left_out]
    # On the CPU, inductor would compile the whole model to C++ (tens of seconds a variant);
    # aot_eager still traces it, fusegen's ops as library ops, and runs AOTAutograd's graphs.
    backend = "inductor" if on_cuda else "aot_eager"
    device = "cuda" if on_cuda else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if on_cuda else "fp32")]
    results, summaries = [], {}
    for model in args.model or list(MODELS):
        found, summary = run(model, args.size, variants, args.steps, args.warmup, args.p if model == "gpt2" else 0.0,
                             min(args.rounds, args.steps), dtype=dtype, device=device, generated=args.generated,
                             backend=backend)
        results += found
        summaries[model] = summary
        if on_cuda:
            torch.cuda.empty_cache()
    import transformers

    meta = synthetic.versions(on_cuda)
    meta.update(transformers=transformers.__version__, size=SIZES[args.size], size_name=args.size,
                dtype=str(dtype).removeprefix("torch."), gpt2_dropout=args.p, steps=args.steps, warmup=args.warmup,
                rounds=min(args.rounds, args.steps), compile_backend=backend, variants_left_out=left_out,
                patches=summaries)
    for model, summary in summaries.items():
        print(summary or f"{model}: no fusegen variant run")
    print(f"torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, {meta['device']}; "
          f"autograd node: {meta['autograd_node']}")
    for variant, reason in left_out.items():
        print(f"{variant}: left out ({reason})")
    synthetic.print_results(results)
    if args.p > 0 and any(r.model == "gpt2" for r in results):
        print(f"GPT-2 ran with dropout {args.p}: fusegen's masks are not torch's, so its loss differences say "
              "little; --p 0 compares them")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"metadata": meta, "results": [asdict(r) for r in results]}, handle, indent=1)
    return 0 if all(r.error is None and math.isfinite(r.step_ms) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
