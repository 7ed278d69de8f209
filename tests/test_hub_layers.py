"""fusegen's ops as layers of Hugging Face's `kernels` (`fusegen kernels-repo`,
fusegen.integrations.hub_layers): the repository follows the output folder's rules, and
`kernelize` under its mapping swaps transformers' layers for ones that compute the same values
and gradients.

The layers are written and kernelized for this machine's device: on a GPU "cuda"; off CUDA
"cpu", which `kernels` maps as it maps CUDA, fusegen's kernels running on Triton's
interpreter. kernels and transformers come with the `hub` extra, which `test` includes: in CI
(CI set) a missing one fails these tests, elsewhere it skips them.
"""
import copy
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

from fusegen import cli
from fusegen.integrations import hub_layers, kernels_layers

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:\\s*No kernel mapping found")  # layers fusegen has none for


@pytest.fixture(scope="module")
def hub():
    """(kernels, transformers), transformers taking this kernels (its decorators are no-ops
    with another)."""
    if os.environ.get("CI"):  # installed by .ci/run: missing, fail
        modules = importlib.import_module("kernels"), importlib.import_module("transformers")
    else:
        modules = pytest.importorskip("kernels"), pytest.importorskip("transformers")
    from transformers.utils.import_utils import is_kernels_available

    assert is_kernels_available(), "transformers does not take this kernels version: pip install -e '.[hub]'"
    return modules


def _write(folder: Path, *backends: str) -> None:
    argv = ["kernels-repo", str(folder)] + [word for b in backends for word in ("--backend", b)]
    assert cli.main(argv) == 0


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(folder.rglob("*"))}


def _kernelize(model, folder: Path, **options):
    from kernels import Mode, kernelize, use_kernel_mapping

    with use_kernel_mapping(hub_layers.kernel_mapping(folder, **options)):
        return kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, device=DEVICE)


@pytest.fixture
def calls(monkeypatch):
    """How often each of fusegen's ops ran from a layer: a forward that falls back to the
    module's own computes the same and would pass unnoticed otherwise."""
    counts = {}
    for name in ("rmsnorm", "gelu", "gelu_tanh", "quick_gelu"):
        op = getattr(kernels_layers, name)

        def counted(*args, op=op, name=name, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return op(*args, **kwargs)

        monkeypatch.setattr(kernels_layers, name, counted)
    return counts


# -- the repository, as a folder


def test_the_repository_is_written_removed_and_left_as_it_is(tmp_path, capsys):
    repo = tmp_path / "layers"
    _write(repo, "cuda", "cpu")
    assert sorted(_snapshot(repo)) == ["build", "build/torch-cpu", "build/torch-cpu/__init__.py",
                                       "build/torch-cpu/metadata.json", "build/torch-cuda",
                                       "build/torch-cuda/__init__.py", "build/torch-cuda/metadata.json"]
    metadata = json.loads((repo / "build/torch-cuda/metadata.json").read_text())
    assert metadata["backend"] == {"type": "cuda"} and metadata["name"] == "fusegen-layers"
    assert hub_layers.repo_backends(repo) == ("cpu", "cuda")
    (repo / "build/torch-cpu/notes.txt").write_text("mine\n")  # a file of the user's in fusegen's folder
    capsys.readouterr()
    _write(repo, "cuda")  # cpu's files are fusegen's: removed; the user's file and its folder stay
    out = capsys.readouterr().out
    assert f"removed {repo / 'build/torch-cpu/__init__.py'}" in out and "0 files written, 2 unchanged" in out
    assert sorted(p for p in _snapshot(repo) if "torch-cpu" in p) == ["build/torch-cpu", "build/torch-cpu/notes.txt"]
    assert hub_layers.repo_backends(repo) == ("cuda",)


@pytest.mark.parametrize("foreign", ["build/torch-cpu/metadata.json", "build/torch-cpu/__init__.py", "build"])
def test_a_file_fusegen_did_not_write_is_refused_and_nothing_written(tmp_path, capsys, foreign):
    repo = tmp_path / "layers"
    (repo / foreign).parent.mkdir(parents=True, exist_ok=True)
    (repo / foreign).write_text('{"name": "mine"}\n')
    before = _snapshot(repo)
    assert cli.main(["kernels-repo", str(repo), "--backend", "cuda", "--backend", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"{repo / foreign}: not ")
    assert _snapshot(repo) == before  # not even the cuda files, which nothing stood in the way of


def test_a_write_cut_short_after_staging_is_finished_by_the_next(tmp_path, monkeypatch, capsys):
    """The staged files wait at the top of the folder; the journal's renames make the variant
    folders they go into, whichever write does them."""
    from fusegen import outdir

    finish, calls = outdir._finish_swap, []

    def cut_short(out):  # the lock's finish of an earlier swap runs; the write's own fails
        calls.append(out)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        finish(out)

    monkeypatch.setattr(outdir, "_finish_swap", cut_short)
    repo = tmp_path / "layers"
    assert cli.main(["kernels-repo", str(repo), "--backend", "cpu"]) == 2
    assert "build cut short" in capsys.readouterr().err
    assert (repo / outdir.JOURNAL).is_file() and not (repo / "build").exists()
    monkeypatch.setattr(outdir, "_finish_swap", finish)
    _write(repo, "cpu")  # finishes the first write's swap, then finds nothing to change
    assert "0 files written, 2 unchanged" in capsys.readouterr().out
    assert sorted(_snapshot(repo)) == ["build", "build/torch-cpu", "build/torch-cpu/__init__.py",
                                       "build/torch-cpu/metadata.json"]


def test_kernel_mapping_refuses_what_it_cannot_map(hub, tmp_path):
    with pytest.raises(ValueError, match="no layer repository of fusegen's"):
        hub_layers.kernel_mapping(tmp_path)
    _write(tmp_path, "cpu")
    with pytest.raises(ValueError, match="fusegen has RMSNorm"):
        hub_layers.kernel_mapping(tmp_path, layers=["LayerNorm"])
    init = tmp_path / "build/torch-cpu/__init__.py"
    init.write_text(init.read_text().replace("LAYERS = (", "LAYERS = ('Old', "))
    with pytest.raises(ValueError, match="another version of fusegen .*fusegen kernels-repo"):
        hub_layers.kernel_mapping(tmp_path)


def test_a_transformers_that_takes_another_kernels_is_said(hub, tmp_path, monkeypatch):
    """With a kernels outside the versions it was released for, transformers' decorator does
    nothing and kernelize would change no layer, silently: kernel_mapping says so."""
    from transformers.utils import import_utils

    _write(tmp_path, "cpu")
    monkeypatch.setattr(import_utils, "is_kernels_available", lambda *args, **kwargs: False)
    with pytest.raises(RuntimeError, match=r"transformers .* takes kernels >= .*install 'transformers\[kernels\]=="):
        hub_layers.kernel_mapping(tmp_path)


def test_the_command_and_the_helper_import_neither_torch_kernels_nor_transformers(tmp_path):
    code = (
        "import sys; from fusegen import cli; import fusegen.integrations.hub_layers\n"
        f"assert cli.main(['kernels-repo', {str(tmp_path)!r}]) == 0\n"
        "print([m for m in ('torch', 'kernels', 'transformers') if m in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


# -- the layers, in transformers models


def test_transformers_decorates_every_layer_name_fusegen_maps(hub):
    from transformers import activations
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    named = {cls.kernel_layer_name for cls in vars(activations).values() if hasattr(cls, "kernel_layer_name")}
    named.add(LlamaRMSNorm.kernel_layer_name)
    assert {layer.name for layer in hub_layers.LAYERS} <= named
    assert all(isinstance(getattr(kernels_layers, layer.name), type) for layer in hub_layers.LAYERS)


def test_a_kernelized_llama_computes_the_same_loss_and_gradients(hub, tmp_path, calls):
    from transformers import LlamaConfig, LlamaForCausalLM

    _write(tmp_path, DEVICE)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config).to(DEVICE)
    with torch.no_grad():  # weights other than 1, so that a wrong weight gradient shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    original = copy.deepcopy(model)
    assert _kernelize(model, tmp_path) is model
    assert hub_layers.kernelized(model) == {"model.layers.0.input_layernorm": "RMSNorm",
                                            "model.layers.0.post_attention_layernorm": "RMSNorm",
                                            "model.norm": "RMSNorm"}
    assert hub_layers.kernelized(original) == {}
    ids = torch.randint(0, 64, (2, 5), device=DEVICE)
    results = []
    for each in (model, original):
        output = each(input_ids=ids, labels=ids)
        output.loss.backward()
        results.append((output.logits, {n: p.grad for n, p in each.named_parameters()}))
    assert calls == {"rmsnorm": 3}  # fusegen's kernel ran for every norm
    (logits, grads), (want_logits, want_grads) = results
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def _norms():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    return LlamaRMSNorm, Olmo2RMSNorm  # the two forms: round, then weight; weight, then round


@pytest.mark.parametrize("form", [0, 1], ids=["llama", "olmo2"])
def test_rmsnorm_in_bf16_is_within_a_rounding(hub, tmp_path, calls, form):
    norm = _norms()[form](16, eps=1e-5).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    original = copy.deepcopy(norm)
    _write(tmp_path, DEVICE)
    _kernelize(norm, tmp_path)
    x = torch.randn(4, 16, dtype=torch.bfloat16, device=DEVICE)
    y, want = norm(x), original(x)
    assert y.dtype == want.dtype == torch.bfloat16 and calls == {"rmsnorm": 1}
    # fusegen rounds once; Llama's form rounds the normalized x, then its product with weight
    assert ((y.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()
    if form == 1:  # the same single rounding: equal but where fp32's op order crosses a tie
        assert (y == want).float().mean() > 0.9


def test_rmsnorm_of_mixed_dtypes_or_fp64_runs_the_modules_own_forward(hub, tmp_path, calls):
    """With fp32 weights the two forms return fp32 and bf16: the layer cannot tell which
    the module has, and falls back to the module's forward; fp64 the modules compute in fp32."""
    _write(tmp_path, DEVICE)
    for cls in _norms():
        norm = cls(16).to(DEVICE)
        _kernelize(norm, tmp_path)
        for dtype in (torch.bfloat16, torch.float64):
            x = torch.randn(2, 16, dtype=dtype, device=DEVICE)
            assert torch.equal(norm(x), cls.forward(norm, x))
    assert calls == {}


def test_activations_compute_the_same_values_and_gradients(hub, tmp_path, calls):
    from transformers import activations

    _write(tmp_path, DEVICE)
    modules = torch.nn.ModuleDict({
        "gelu": activations.GELUActivation(),
        "gelu_python": activations.GELUActivation(use_gelu_python=True),
        "gelu_pytorch_tanh": activations.GELUTanh(),
        "gelu_new": activations.NewGELUActivation(),
        "quick_gelu": activations.QuickGELUActivation(),
    })
    original = copy.deepcopy(modules)
    _kernelize(modules, tmp_path, layers=hub_layers.LAYER_NAMES)
    assert hub_layers.kernelized(modules) == {"gelu": "GeLU", "gelu_python": "GeLU", "gelu_pytorch_tanh": "GeluTanh",
                                              "gelu_new": "NewGELU", "quick_gelu": "QuickGELU"}
    x = torch.linspace(-6, 6, 24, device=DEVICE).reshape(3, 8)
    for name in modules:
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [modules[name](xs[0]), original[name](xs[1])]
        grad = torch.rand_like(x)
        for each in ys:
            each.backward(grad)
        torch.testing.assert_close(ys[0], ys[1], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6, msg=name)
    assert calls == {"gelu": 2, "gelu_tanh": 2, "quick_gelu": 1}


def test_the_norms_are_mapped_unless_more_is_asked_for(hub, tmp_path, calls):
    from transformers import activations
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    _write(tmp_path, DEVICE)
    model = torch.nn.Sequential(LlamaRMSNorm(8), activations.GELUActivation(), activations.QuickGELUActivation())
    _kernelize(model.to(DEVICE), tmp_path)
    assert hub_layers.kernelized(model) == {"0": "RMSNorm"}
    _kernelize(model, tmp_path, layers=["RMSNorm", "QuickGELU"])
    assert hub_layers.kernelized(model) == {"0": "RMSNorm", "2": "QuickGELU"}


def test_a_kernelized_norm_compiles_whole(hub, tmp_path):
    """can_torch_compile: the layer's forward and fusegen's op are one graph (fullgraph);
    aot_eager traces the forward and the backward without generating code."""
    LlamaRMSNorm = _norms()[0]
    _write(tmp_path, DEVICE)
    norm = LlamaRMSNorm(16).to(DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    _kernelize(norm, tmp_path)
    traced = []

    def backend(graph, inputs):
        traced.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(graph, inputs)

    compiled = torch.compile(norm, backend=backend, fullgraph=True)
    x = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    assert any("fusegen" in target and "rmsnorm" in target for target in traced), traced
    want_x = x.detach().clone().requires_grad_()
    want = LlamaRMSNorm.forward(norm, want_x)
    want.sum().backward()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, want_x.grad, rtol=1e-5, atol=1e-6)
