"""The Hugging Face model benchmark (fusegen.bench.hf_model) at --size tiny, from its command
line: one step of every variant the device can run, the losses compared with eager's, the JSON."""
import json
import math

import pytest

from fusegen.bench import hf_model
from fusegen.bench.model import VARIANTS

ONE_STEP = ["--size", "tiny", "--steps", "1", "--warmup", "0", "--rounds", "1", "--dtype", "fp32"]


@pytest.mark.full_lane  # on a GPU it compiles four tiny models with inductor: minutes, not the fast lane's
def test_llama_runs_every_variant_the_device_can(tmp_path, device, capsys):
    """On the CPU the CUDA-graph variants cannot run (main leaves them out, saying why) and
    torch.compile takes the aot_eager backend: inductor would compile each variant to C++,
    tens of seconds apiece; the compiled variants still trace the patched model."""
    out = tmp_path / "llama.json"
    assert hf_model.main(["--model", "llama", *ONE_STEP, "--p", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    meta, results = data["metadata"], {r["variant"]: r for r in data["results"]}
    assert {"torch", "triton", "transformers", "device"} <= meta.keys()
    ran = [v for v in VARIANTS if device == "cuda" or "graphs" not in v]
    assert list(results) == ran
    assert meta["variants_left_out"] == {v: "CUDA graphs need a CUDA device" for v in VARIANTS if v not in ran}
    assert meta["compile_backend"] == ("inductor" if device == "cuda" else "aot_eager")
    assert "linear_swiglu" in meta["patches"]["llama"] and "left as they were" not in meta["patches"]["llama"]
    for variant, r in results.items():
        assert r["error"] is None and r["step_ms"] > 0 and len(r["losses"]) == 1, variant
        assert abs(r["losses"][0] - math.log(64)) < 1.0  # untrained: about a uniform guess over the vocabulary
        assert r["max_loss_difference"] < 1e-4, (variant, r["losses"], results["eager"]["losses"])
    assert "compile+graphs: left out" in capsys.readouterr().out or device == "cuda"


def test_gpt2_runs_with_its_dropout_on(tmp_path, capsys):
    """GPT-2 at its default dropout (0.1): the fused ops draw their own masks, so the loss
    difference is not compared, and the output says so. The compiled variants' path is the
    one the LLaMA test runs; GPT-2 under torch.compile is tests/test_huggingface.py's."""
    out = tmp_path / "gpt2.json"
    assert hf_model.main(["--model", "gpt2", *ONE_STEP, "--variants", "eager,fusegen", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["metadata"]["gpt2_dropout"] == 0.1
    summary = data["metadata"]["patches"]["gpt2"]
    assert all(op in summary for op in ("bias_dropout_add_layernorm", "linear_bias_dropout_add", "linear_bias_gelu"))
    assert [r["variant"] for r in data["results"]] == ["eager", "fusegen"]
    assert all(r["error"] is None and abs(r["losses"][0] - math.log(64)) < 1.0 for r in data["results"])
    assert "GPT-2 ran with dropout 0.1" in capsys.readouterr().out


def test_the_sizes_the_gpu_runs_need_a_gpu(device, capsys):
    if device == "cuda":
        pytest.skip("on a GPU every size runs")  # the refusal is the CPU's
    assert hf_model.main(["--size", "host"]) == 2
    assert "--size host needs a CUDA device" in capsys.readouterr().err
