"""The model-level benchmark (fusegen.bench.model), at a tiny size: each block stack trains with
plain PyTorch ops and with generated ones, from the same weights, to the same losses."""
import math

import pytest
import torch

from fusegen.bench import model


@pytest.mark.parametrize("swap", model.SWAPS)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generated_ops_train_to_the_losses_of_plain_pytorch(name, swap, device):
    kwargs = dict(steps=2, warmup=1, p=0.0, dtype=torch.float32, device=device, swap=swap)
    results = [model.run_variant(name, "tiny", variant, **kwargs) for variant in ("eager", "fusegen")]
    model.compare_losses(results)
    eager, fusegen = results
    assert len(eager.losses) == 3
    # Untrained, the loss is about that of a uniform guess over the vocabulary.
    assert all(abs(loss - math.log(model.SIZES["tiny"]["vocab"])) < 1.0 for loss in eager.losses)
    assert fusegen.max_loss_difference < 1e-4, (eager.losses, fusegen.losses)
    assert eager.max_loss_difference == 0.0
    assert fusegen.swap == swap


def _counting(ops, calls):
    return type(ops)(**{n: (lambda f, n=n: lambda *a: calls.append(n) or f(*a))(f) for n, f in vars(ops).items()})


def test_the_blocks_use_the_ops_they_are_given():
    calls = []
    counted = _counting(model.eager_ops(), calls)
    size = model.SIZES["tiny"]
    tokens = torch.randint(0, size["vocab"], (2, size["seq"]))
    for block, expected in ((model.GPT2Block, {"layer_norm", "bias_dropout_add_layer_norm", "bias_gelu"}),
                            (model.LlamaBlock, {"rms_norm", "add_rms_norm", "swiglu"})):
        calls.clear()
        model.Model(block, size, 0.0, counted)(tokens, tokens)
        assert set(calls) == expected


def test_swap_all_takes_the_generated_norms_and_elementwise_leaves_them_to_pytorch():
    generated, eager = model.Path("generated"), model.eager_ops()
    every, elementwise = model.fusegen_ops(generated), model.fusegen_ops(generated, "elementwise")
    for name in ("layer_norm", "rms_norm", "add_rms_norm", "bias_dropout_add_layer_norm"):
        ours, theirs = getattr(every, name), getattr(eager, name)
        assert ours.__code__ is not theirs.__code__, name  # a generated op, not PyTorch's
        if name != "bias_dropout_add_layer_norm":  # elementwise: the generated add, PyTorch's norm
            assert getattr(elementwise, name).__code__ is theirs.__code__, name
    generated_swiglu = model.import_generated("swiglu", generated).swiglu
    for ops in (every, elementwise):
        assert ops.swiglu is generated_swiglu and ops.bias_gelu.__code__ is not eager.bias_gelu.__code__
    with pytest.raises(ValueError, match="swap"):
        model.fusegen_ops(generated, "norms")


@pytest.mark.parametrize("name, p", [("llama", 0.0), ("gpt2", 0.3)])
def test_round_robin_variants_train_as_one_after_another(name, p, device):
    """The same batches in the same order and each variant's own random state (dropout):
    interleaving changes no loss. One untimed round-robin step each comes before timing."""
    kwargs = dict(steps=3, warmup=1, p=p, dtype=torch.float32, device=device)
    variants = ["eager", "fusegen"]
    apart = model.run_variants(name, "tiny", variants, **kwargs)
    together = model.run_variants(name, "tiny", variants, rounds=3, **kwargs)
    for a, b in zip(apart, together):
        assert a.error is None and b.error is None
        assert a.variant == b.variant and len(a.losses) == 4 and len(b.losses) == 5
        assert b.losses[:4] == a.losses
        assert b.step_ms > 0
    with pytest.raises(ValueError, match="rounds must be between 1 and steps"):
        model.run_variants(name, "tiny", variants, rounds=4, **kwargs)
    with pytest.raises(ValueError, match="variants must be distinct"):
        model.run_variants(name, "tiny", ["eager", "eager"], **kwargs)


def test_a_failing_variant_is_reported_and_the_others_still_run(device, monkeypatch):
    original = model._Run.step

    def step(self):
        if self.variant == "fusegen" and len(self.losses) >= 2:
            raise RuntimeError("boom")
        original(self)

    monkeypatch.setattr(model._Run, "step", step)
    for rounds in (1, 2):
        eager, fusegen = model.run_variants("gpt2", "tiny", ["eager", "fusegen"], steps=2, warmup=1, p=0.0,
                                            dtype=torch.float32, device=device, rounds=rounds)
        assert eager.error is None and len(eager.losses) == 3 + (rounds > 1)  # rounds > 1: an untimed step first
        assert fusegen.error == "RuntimeError: boom" and fusegen.step_ms is None
