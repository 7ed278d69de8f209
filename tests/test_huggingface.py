"""fusegen.integrations.huggingface: generated ops patched into tiny transformers models (fp32,
random weights) give the unpatched model's loss and the gradients of every parameter; undo()
gives back the model as it was; what the patch cannot take is left as it was and reported, or
refused in one line."""
import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fusegen.integrations import huggingface as hf

# One layer, hidden 32, two heads of 16 (Qwen3's default head_dim is 128: given for every family).
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, head_dim=16, vocab_size=64)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
LLAMA_PATCHED = {"rmsnorm": 3, "linear_swiglu": 1, "add_rmsnorm": 1}  # per one-layer model: by each label's op
GPT2_PATCHED = {"layernorm": 3, "linear_bias_gelu": 1, "bias_dropout_add_layernorm": 1}
# A patched GPT-2 block's own forward and those its attention's tail runs while it is patched.
GPT2_BLOCK = {"transformer.h.0", "transformer.h.0.attn.c_proj", "transformer.h.0.attn.resid_dropout"}
GPT2_NORMS = {"transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.ln_f"}
GPT2_BLOCK_LABEL = ("bias_dropout_add_layernorm (attention's c_proj bias, dropout, residual add, ln_2) + "
                    "linear_bias_dropout_add (the MLP's c_proj, its bias, dropout, residual add)")


def llama_like(family: str, device, **config) -> nn.Module:
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    return model_class(config_class(**{**SMALL, **config})).to(device)


def gpt2(device, **config) -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0, **config)).to(device)


def tokens(device):
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)


def loss_and_grads(model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    return loss.detach(), grads


def assert_same_training(patched, unpatched) -> None:
    """fp32: the fused kernels round differently from torch's ops, nothing more."""
    (loss, grads), (loss0, grads0) = patched, unpatched
    torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads0.keys()
    for name in grads0:
        torch.testing.assert_close(grads[name], grads0[name], rtol=1e-4, atol=1e-6, msg=name)


def ops_patched(p: hf.Patch) -> dict:
    counts: dict = {}
    for _, label in p.patched:
        op = label.split(" ")[0]
        counts[op] = counts.get(op, 0) + 1
    return counts


def own_forwards(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


class _FusegenOps(TorchDispatchMode):
    """Records the fusegen torch.library ops called under it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusegen":
            self.names.add(func.__name__.removesuffix(".default"))
        return func(*args, **(kwargs or {}))


def fusegen_ops_run(model: nn.Module, batch) -> set[str]:
    """The generated ops a forward of the model runs (each one's torch.library op)."""
    with torch.no_grad(), _FusegenOps() as recorded:
        model(input_ids=batch)
    return recorded.names


def hooked(name: str) -> str:
    """Why a fusion that bypasses the module `name`, which has hooks, is left out."""
    return f"{name} has forward hooks, which would see other values, or none, when fused"


def test_llama_patched_trains_as_unpatched_and_undo_gives_it_back(device):
    model, batch = llama_like("llama", device), tokens(device)
    parameters, keys = list(model.parameters()), list(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters())  # built before the patch: it must still hold the parameters
    before = loss_and_grads(model, batch)
    p = hf.patch(model)
    assert ops_patched(p) == LLAMA_PATCHED and p.skipped == ()
    assert set(own_forwards(model)) == {"model.layers.0", "model.layers.0.mlp", "model.layers.0.input_layernorm",
                                        "model.layers.0.post_attention_layernorm", "model.norm"}
    assert "  linear_swiglu (gate_proj's and up_proj's matmul and SwiGLU in one kernel): 1× model.layers.*.mlp" \
        in p.summary().splitlines()
    assert fusegen_ops_run(model, batch) == {"rmsnorm", "linear_swiglu", "add_rmsnorm"}
    assert_same_training(loss_and_grads(model, batch), before)
    # The parameters are the model's own (shared, not copied): the gradients above landed on them.
    assert all(a is b for a, b in zip(model.parameters(), parameters)) and list(model.state_dict()) == keys
    assert optimizer.param_groups[0]["params"] == parameters
    p.undo()
    assert own_forwards(model) == [] and not p.active
    after = loss_and_grads(model, batch)
    assert torch.equal(after[0], before[0]) and all(torch.equal(after[1][n], g) for n, g in before[1].items())
    p.undo()  # a second undo does nothing
    with hf.patch(model):  # and the model can be patched again
        assert own_forwards(model)
    assert own_forwards(model) == []


def test_qwen3_patched_trains_as_unpatched(device):
    """Qwen3 also normalizes queries and keys per head (q_norm, k_norm: RMSNorms over head_dim)."""
    model, batch = llama_like("qwen3", device), tokens(device)
    before = loss_and_grads(model, batch)
    with hf.patch(model) as p:
        assert ops_patched(p) == {**LLAMA_PATCHED, "rmsnorm": 5}
        assert_same_training(loss_and_grads(model, batch), before)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_mistral_and_qwen2_take_what_llama_takes(family, device):
    """Their norm, MLP and decoder layer have LLaMA's code, which is what the patch checks;
    LLaMA's and Qwen3's tests run the ops."""
    with hf.patch(llama_like(family, device)) as p:
        assert ops_patched(p) == LLAMA_PATCHED and p.skipped == ()


def test_gpt2_patched_trains_as_unpatched_in_eval_mode(device):
    """GPT-2's default dropout (0.1) is off in eval mode, for torch's dropout and the fused ops
    alike. A call with output_hidden_states leaves transformers' output-capturing hooks on the
    blocks and their attention modules: those record what the patch does not change."""
    model, batch = gpt2(device).eval(), tokens(device)
    before = loss_and_grads(model, batch)
    states = model(input_ids=batch, output_hidden_states=True).hidden_states
    assert model.transformer.h[0].attn._forward_hooks
    with hf.patch(model) as p:
        assert ops_patched(p) == GPT2_PATCHED and p.skipped == ()
        assert set(own_forwards(model)) == GPT2_BLOCK | GPT2_NORMS | {"transformer.h.0.mlp"}
        assert dict(p.patched) == {
            **dict.fromkeys(("transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.ln_f"), "layernorm"),
            "transformer.h.0": GPT2_BLOCK_LABEL,
            "transformer.h.0.mlp": "linear_bias_gelu (c_fc's matmul, bias and tanh GELU in one kernel)"}
        # The block runs the MLP's parts itself (its c_fc fused as the MLP's forward would).
        assert fusegen_ops_run(model, batch) == {"layernorm", "bias_dropout_add_layernorm", "linear_bias_gelu",
                                                 "linear_bias_dropout_add"}
        assert_same_training(loss_and_grads(model, batch), before)
        patched_states = model(input_ids=batch, output_hidden_states=True).hidden_states
    assert len(patched_states) == len(states) == 2
    for state, patched_state in zip(states, patched_states):
        torch.testing.assert_close(patched_state, state, rtol=1e-5, atol=1e-5)
    after = loss_and_grads(model, batch)
    assert torch.equal(after[0], before[0]) and all(torch.equal(after[1][n], g) for n, g in before[1].items())


# GPT-2's MLP in each combination that changes how it runs: (activation_function, ops) → the op
# of each label, the modules given forwards, the generated ops a forward runs.
GPT2_MLP_PATHS = {
    "tanh, mlps": ("gelu_pytorch_tanh", "mlps", {"linear_bias_gelu": 1}, {"transformer.h.0.mlp"},
                   {"linear_bias_gelu"}),
    # The block fuses c_proj with the residual and calls the model's c_fc and act.
    "tanh, residuals": ("gelu_new", "residuals", {"bias_dropout_add_layernorm": 1}, GPT2_BLOCK,
                        {"bias_dropout_add_layernorm", "linear_bias_dropout_add"}),
    # No gemm op takes the exact GELU: c_fc's matmul, then bias_gelu, in the block too.
    "exact, mlps and residuals": ("gelu", ("mlps", "residuals"), {"bias_gelu": 1, "bias_dropout_add_layernorm": 1},
                                  GPT2_BLOCK | {"transformer.h.0.mlp"},
                                  {"bias_gelu", "bias_dropout_add_layernorm", "linear_bias_dropout_add"}),
}


@pytest.mark.parametrize("path", GPT2_MLP_PATHS)
def test_gpt2_mlp_paths_train_as_unpatched(path, device):
    activation, ops, patched, forwards, run = GPT2_MLP_PATHS[path]
    model, batch = gpt2(device, activation_function=activation).eval(), tokens(device)
    before = loss_and_grads(model, batch)
    with hf.patch(model, ops=ops) as p:
        assert ops_patched(p) == patched and p.skipped == ()
        assert set(own_forwards(model)) == forwards
        assert fusegen_ops_run(model, batch) == run
        assert_same_training(loss_and_grads(model, batch), before)
    assert own_forwards(model) == []


@pytest.mark.parametrize("ops", ["all", "residuals"])
def test_gpt2_dropout_in_training_is_the_fused_ops(ops, device, monkeypatch):
    """In train() mode, the patched model gives what the same patch gives with each generated
    op's `reference` in its place (eager PyTorch, the kernels' masks drawn from the same
    seeds): the Dropout modules' p and train() reach the fused ops, whose masks are fusegen's."""
    model, batch = gpt2(device, resid_pdrop=0.5, embd_pdrop=0.0, attn_pdrop=0.0), tokens(device)
    with torch.no_grad():
        without_dropout = model.eval()(input_ids=batch, labels=batch).loss
    model.train()

    def trained():
        torch.manual_seed(3)  # fusegen draws its seeds from torch's generator, and so do the references
        return loss_and_grads(model, batch)

    with hf.patch(model, ops=ops):
        fused = trained()

    def references(names, generated):
        return {name: importlib.import_module(f"generated.{name}").reference for name in names}

    monkeypatch.setattr(hf, "_load_ops", references)
    with hf.patch(model, ops=ops):
        assert_same_training(fused, trained())
    assert abs(fused[0] - without_dropout) > 1e-4  # well beyond rounding: the masks dropped something


def test_gpt2_dropout_follows_the_modules_p_in_training(device):
    """p = 1 drops each sublayer's whole output in both models, whatever the masks: the same
    losses and gradients show that the fused ops drop in train() mode with the modules' p."""
    model, batch = gpt2(device, resid_pdrop=1.0, embd_pdrop=0.0, attn_pdrop=0.0).train(), tokens(device)
    before = loss_and_grads(model, batch)
    with hf.patch(model):
        assert_same_training(loss_and_grads(model, batch), before)


def test_gpt2_with_dropout_trains_and_undo_gives_torchs_dropout_back(device):
    model, batch = gpt2(device).train(), tokens(device)  # resid, embd and attn dropout 0.1
    torch.manual_seed(5)
    before = model(input_ids=batch, labels=batch).loss
    with hf.patch(model):
        losses = []
        for seed in (5, 5, 6):
            torch.manual_seed(seed)  # fusegen draws its seeds from torch's generator
            losses.append(model(input_ids=batch, labels=batch).loss)
        losses[-1].backward()
        assert torch.isfinite(torch.stack(losses)).all()
        assert losses[0].item() == losses[1].item() and losses[1].item() != losses[2].item()
        assert all(p.grad is not None for p in model.parameters())
    torch.manual_seed(5)
    assert model(input_ids=batch, labels=batch).loss.item() == before.item()


def test_gpt2_patched_inside_torch_compile(device):
    """torch.compile traces a patched block's forwards (instance attributes: the block's, its
    norms', the attention's c_proj's and dropout's) with the fused ops as torch.library ops, and
    gives the eager patched output. One block, not the model: transformers' masks and
    embeddings would only make the trace longer. The backend records the graph and runs it."""
    model = gpt2(device, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    block, hidden = model.transformer.h[0], torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    called = set()

    def recording(graph_module, example_inputs):
        called.update(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module

    with hf.patch(model):
        eager = block(hidden.to(device))
        compiled = torch.compile(block, backend=recording)(hidden.to(device))
    assert {"fusegen.layernorm.default", "fusegen.linear_bias_gelu.default",
            "fusegen.bias_dropout_add_layernorm.default", "fusegen.linear_bias_dropout_add.default"} <= called
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_ops_chooses_the_kinds_replaced(device):
    with hf.patch(llama_like("llama", device), ops="norms") as p:
        assert ops_patched(p) == {"rmsnorm": 3}
    with hf.patch(llama_like("llama", device), ops="mlps") as p:
        assert ops_patched(p) == {"linear_swiglu": 1}
    with hf.patch(gpt2(device), ops=["mlps", "residuals"]) as p:
        assert ops_patched(p) == {"linear_bias_gelu": 1, "bias_dropout_add_layernorm": 1}
    with pytest.raises(ValueError, match="ops must be 'all' or some of norms, mlps, residuals; got 'norm'"):
        hf.patch(llama_like("llama", device), ops="norm")


def _hooked(make, name: str):
    def made(device):
        model = make(device)
        model.get_submodule(name).register_forward_hook(lambda *args: None)
        return model

    return made


# Modules the patch leaves as they were: (model, the module, the op it would have taken, why not).
LEFT = {
    "non-silu act": (lambda d: llama_like("llama", d, hidden_act="gelu"), "model.layers.0.mlp", "linear_swiglu",
                     "act_fn is GELUActivation; linear_swiglu needs SiLU"),
    "mlp bias": (lambda d: llama_like("llama", d, mlp_bias=True), "model.layers.0.mlp", "linear_swiglu",
                 "gate_proj and up_proj have biases (mlp_bias=True)"),
    "hooked norm": (_hooked(lambda d: llama_like("llama", d), "model.layers.0.post_attention_layernorm"),
                    "model.layers.0", "add_rmsnorm", hooked("model.layers.0.post_attention_layernorm")),
    "hooked gate_proj": (_hooked(lambda d: llama_like("llama", d), "model.layers.0.mlp.gate_proj"),
                         "model.layers.0.mlp", "linear_swiglu", hooked("model.layers.0.mlp.gate_proj")),
    "cross-attention": (lambda d: gpt2(d, add_cross_attention=True), "transformer.h.0", "bias_dropout_add_layernorm",
                        "a block with cross-attention (add_cross_attention=True)"),
    # The block is still patched: it calls the model's c_fc and act, whatever the activation.
    "relu act": (lambda d: gpt2(d, activation_function="relu"), "transformer.h.0.mlp", "linear_bias_gelu",
                 "act is ReLU; linear_bias_gelu takes gelu_new or gelu_pytorch_tanh, bias_gelu gelu"),
    "hooked c_fc": (_hooked(gpt2, "transformer.h.0.mlp.c_fc"), "transformer.h.0.mlp", "linear_bias_gelu",
                    hooked("transformer.h.0.mlp.c_fc")),
    # The block no longer calls the MLP's c_proj; the MLP's own forward (linear_bias_gelu) still does.
    "hooked mlp c_proj": (_hooked(gpt2, "transformer.h.0.mlp.c_proj"), "transformer.h.0", "bias_dropout_add_layernorm",
                          hooked("transformer.h.0.mlp.c_proj")),
}


@pytest.mark.parametrize("case", LEFT)
def test_what_does_not_fit_is_left_as_it_was_and_reported(case, device):
    make, name, op, reason = LEFT[case]
    model = make(device)
    with pytest.warns(UserWarning, match="left modules as they were") as caught:
        p = hf.patch(model)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert p.skipped == ((name, op, reason),) and p.patched
    assert f"({op}: {reason})" in p.summary()
    assert name not in own_forwards(model)  # its own class's forward
    p.undo()
    with pytest.raises(hf.UnsupportedModelError) as refused:
        hf.patch(make(device), strict=True)
    assert str(refused.value) == f"patch({type(model).__name__}), strict: {name} can't take {op}: {reason}"


def test_a_hooked_c_fc_runs_as_the_models_own_in_the_patched_block(device):
    """The block still fuses the MLP's c_proj with the residual, calling c_fc and act as
    GPT2MLP does: c_fc's hook sees what it saw unpatched."""
    model, batch = gpt2(device).eval(), tokens(device)
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda module, args, output: seen.append(output.detach()))
    before = loss_and_grads(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the MLP left as it was: the case above
        p = hf.patch(model)
    with p:
        assert ops_patched(p) == {"layernorm": 3, "bias_dropout_add_layernorm": 1}
        assert_same_training(loss_and_grads(model, batch), before)
    assert len(seen) == 2
    torch.testing.assert_close(seen[1], seen[0])


def test_a_llama_with_gelu_still_trains_as_unpatched(device):
    """The MLP left as it was runs its own forward between patched modules."""
    model, batch = llama_like("llama", device, hidden_act="gelu"), tokens(device)
    before = loss_and_grads(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = hf.patch(model)
    assert_same_training(loss_and_grads(model, batch), before)
    p.undo()


def test_models_it_cannot_take_are_refused_in_one_line(device):
    unknown = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                             intermediate_size=48, vocab_size=64))
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL))  # LLaMA's layout, other norms and MLP
    patched = llama_like("llama", device)
    hf.patch(patched)
    expected = [
        (unknown, "patch(BertModel): not a model family fusegen knows: it has no LLaMA-style decoder layer"),
        (gemma, "patch(GemmaForCausalLM): nothing to replace: model.layers.0 can't take add_rmsnorm: "
                "post_attention_layernorm is a GemmaRMSNorm, whose forward is not LlamaRMSNorm's (and 1 more)"),
        (patched, "patch(LlamaForCausalLM): already patched by fusegen; undo() that patch first"),
        (torch.compile(llama_like("llama", device)), "patch(OptimizedModule): the model is compiled already"),
    ]
    for model, message in expected:
        forwards = own_forwards(model)
        with pytest.raises(hf.UnsupportedModelError) as refused:
            hf.patch(model)
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
        assert own_forwards(model) == forwards  # nothing changed
    with pytest.raises(TypeError, match="patch\\(\\) takes a torch.nn.Module, got str"):
        hf.patch("gpt2")


def test_ops_from_a_folder_without_them_are_refused_before_any_change(tmp_path, device):
    model = llama_like("llama", device)
    missing = "no generated module add_rmsnorm, linear_swiglu, rmsnorm in .*; run `fusegen build`"
    with pytest.raises(FileNotFoundError, match=missing):
        hf.patch(model, generated=tmp_path)
    assert own_forwards(model) == []


def test_importing_fusegen_does_not_import_transformers():
    """`import fusegen` in a fresh process (cheap: it imports no torch either), and no fusegen
    module imports transformers at its top level: only patch() and the benchmark's functions do."""
    root = Path(__file__).resolve().parent.parent
    code = "import sys, fusegen, fusegen.integrations; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60).returncode == 0
    for path in sorted((root / "fusegen").rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] == "transformers"], path
