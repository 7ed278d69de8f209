"""`fusegen bench`'s peers (fusegen.bench.peers): the registry, the adapters' values, the
first-call check, and a peer that is not installed.

Tests that call Liger-Kernel skip where it is not installed (`pip install 'fusegen[peers]'`);
the rest run without it. Under the CPU interpreter Liger's softmax, squared ReLU, SwiGLU and
GEGLU kernels run; its RMSNorm, LayerNorm and fused add+RMSNorm do not (the interpreter hands
their float eps to `eps.to(...)` as a Python float, and has no libdevice rsqrt), so on the
CPU those three are checked by their wiring into Liger's Functions, and by value on a GPU.
"""
import importlib.metadata
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICE
from fusegen.bench import cases, peers, reporting, running, timing

ROOT = Path(__file__).resolve().parents[1]
LIGER_OPS = {"rmsnorm", "add_rmsnorm", "layernorm", "softmax", "squared_relu", "swiglu", "geglu", "cross_entropy_mean"}
# Liger kernels that run on Triton's CPU interpreter (see the module doc).
INTERPRETABLE = ("softmax", "squared_relu", "swiglu", "geglu")


def bench_op(name):
    return cases.load_bench_op(name, ROOT / "specs", ROOT / "generated")


def small_inputs(op, dtype=torch.float32, device="cpu", bsh=(2, 3, 16)):
    return cases.make_inputs(op.spec, bsh, dtype, device, torch.Generator(device).manual_seed(0))


# ---------------------------------------------------------------------------
# The registry (no Liger needed)


def test_liger_maps_the_ops_it_has():
    assert set(peers.LIGER.adapters) == LIGER_OPS
    assert peers.LIGER.checked_version == "0.8.5" and peers.LIGER in peers.PEERS


@pytest.mark.parametrize("name", sorted(LIGER_OPS))
def test_adapters_take_the_specs_inputs_and_params(name):
    """Inputs positional in spec order, every param by keyword: what peer_provider passes."""
    op = bench_op(name)
    parameters = inspect.signature(peers.LIGER.adapters[name]).parameters.values()
    positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert positional == [inp.name for inp in op.spec.inputs]
    assert keyword == {param.name for param in op.spec.params}
    assert not op.has_dropout  # the bench would pass training= and seed=


def test_peer_provider_fills_the_specs_defaults():
    calls = []
    peer = peers.Peer("fake", "fake", "fake", "1", {"rmsnorm": lambda x, weight, *, eps: calls.append(eps)})
    provider = peers.peer_provider(peer, bench_op("rmsnorm"))
    provider("x", "w")
    provider("x", "w", eps=0.5)
    assert calls == [1e-6, 0.5]  # specs/rmsnorm.yaml's default, then what the caller gave
    assert peers.peer_provider(peer, bench_op("gelu")) is None
    assert peers.peer_providers(bench_op("gelu"), [peer]) == {}


def test_exact_gelu_has_no_liger_counterpart():
    with pytest.raises(peers.NoCounterpart, match="tanh approximation only"):
        peers.LIGER.adapters["geglu"](torch.zeros(2, 4), activation="gelu")


def test_absent_peer_is_skipped_with_a_note(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import liger_kernel raises ImportError
    status, = peers.peer_statuses(["rmsnorm", "gelu"], (peers.LIGER,))
    assert not status.available and status.version is None and status.ops == ("rmsnorm",)
    assert "not installed" in status.note and "fusegen[peers]" in status.note
    line = status.line()
    assert "\n" not in line and line.startswith("peer liger_kernel: liger_kernel is not installed")
    path = tmp_path / "bench.json"
    reporting.write_json(path, reporting.run_metadata(None, peers=[status]), [], [])
    recorded, = json.loads(path.read_text())["metadata"]["peers"]
    assert recorded == {"name": "liger_kernel", "package": "liger-kernel", "version": None,
                        "checked_version": "0.8.5", "ops": ["rmsnorm"], "note": status.note}


def test_output_mismatch():
    y = torch.linspace(-1, 1, 12).reshape(3, 4)
    assert peers.output_mismatch((y,), (y + 1e-6,), ["y"]) is None
    assert peers.output_mismatch((y,), (y * 1.01,), ["y"]).startswith("mismatch: output y differs")
    assert peers.output_mismatch((y.bfloat16(),), ((y * 1.01).bfloat16(),), ["y"]) is None  # within bf16's
    assert peers.output_mismatch((y.bfloat16(),), ((y + 0.1).bfloat16(),), ["y"]) is not None
    assert "2 outputs" in peers.output_mismatch((y,), (y, y), ["y"])
    assert "shape (4, 3)" in peers.output_mismatch((y,), (y.T,), ["y"])
    assert peers.output_mismatch((y, -y), (-y, y), ["h", "y"]).startswith("mismatch: output h")  # swapped
    # Small outputs (softmax's ~1/N) are judged at their own scale, not against a fixed atol.
    p = torch.softmax(torch.randn(4, 4096, generator=torch.Generator().manual_seed(0)), -1)
    assert peers.output_mismatch((p.bfloat16(),), (p.bfloat16(),), ["y"]) is None
    assert peers.output_mismatch((p.bfloat16(),), ((p ** 2 / (p ** 2).sum(-1, keepdim=True)).bfloat16(),), ["y"])


def fake_timer(fn, grad_to_none=None):
    fn()
    return timing.Timing(1.0, 1.0, 1.0)


def run_softmax_case(monkeypatch, peer_list, backward=True):
    # fusegen and eager only: torch.compile on the CPU would take a while and test nothing here.
    monkeypatch.setattr(running, "make_providers", lambda op: {"fusegen": op.op, "eager": op.eager})
    case = cases.Case("softmax", torch.float32, (1, 2, 8), None)
    return {result.provider: result for result in running.run_case(
        bench_op("softmax"), case, backward, device=DEVICE, timer=fake_timer, peak=lambda fn: 0, peers=peer_list)}


def test_a_peer_that_disagrees_is_an_error_row_not_a_time(monkeypatch):
    right = peers.Peer("right", "torch", "torch", "0", {"softmax": lambda x: torch.softmax(x, -1)})
    wrong = peers.Peer("wrong", "torch", "torch", "0", {"softmax": lambda x: torch.softmax(2 * x, -1)})
    broken = peers.Peer("broken", "torch", "torch", "0", {"softmax": lambda x: x.no_such_method()})
    results = run_softmax_case(monkeypatch, [right, wrong, broken])
    assert list(results) == ["fusegen", "eager", "right", "wrong", "broken"]
    assert results["right"].forward.timing is not None and results["right"].forward.error is None
    assert results["right"].forward_backward.timing is not None
    for phase in (results["wrong"].forward, results["wrong"].forward_backward):
        assert phase.timing is None and phase.error.startswith("mismatch: output y differs from fusegen's")
    assert results["broken"].forward.error.startswith("AttributeError")
    assert results["broken"].forward_backward.error == results["broken"].forward.error

    monkeypatch.setattr(running, "host_overhead_us", lambda fn, synchronize: 1.0)
    host = running.measure_host_overhead(bench_op("softmax"), torch.float32, None, device=DEVICE,
                                         synchronize=lambda: None, peers=[right, wrong])
    by_provider = {row["provider"]: row for row in host}
    assert by_provider["right"]["us_per_call"] == 1.0 and by_provider["right"]["error"] is None
    assert by_provider["wrong"]["us_per_call"] is None and by_provider["wrong"]["error"].startswith("mismatch")


def test_a_forward_only_op_has_no_forward_backward_cells(monkeypatch):
    """rmsnorm_fp8's outputs have no gradient: --backward times its forward and leaves the
    fwd+bwd cells empty, not an error row per provider."""
    monkeypatch.setattr(running, "make_providers", lambda op: {"fusegen": op.op, "eager": op.eager})
    op = bench_op("rmsnorm_fp8")
    assert not op.differentiable and bench_op("softmax").differentiable
    results = running.run_case(op, cases.Case("rmsnorm_fp8", torch.float32, (1, 2, 8), None), True,
                               device=DEVICE, timer=fake_timer, peak=lambda fn: 0)
    assert [r.provider for r in results] == ["fusegen", "eager"]
    assert all(r.forward.error is None and r.forward.timing is not None for r in results)
    assert all(r.forward_backward is None for r in results)


def test_no_peers_no_peer_rows(monkeypatch):
    assert list(run_softmax_case(monkeypatch, [], backward=False)) == ["fusegen", "eager"]


# ---------------------------------------------------------------------------
# Liger-Kernel itself


def grads_of(fn, inputs, grad_outputs):
    leaves = [tensor.detach().clone().requires_grad_(tensor.is_floating_point()) for tensor in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, grad_outputs)
    return [output.detach() for output in outputs], [leaf.grad for leaf in leaves if leaf.is_floating_point()]


def check_against_reference(name, dtype, device, rtol, atol, peer=peers.LIGER, bsh=(2, 3, 16)):
    op = bench_op(name)
    provider = peers.peer_provider(peer, op)
    inputs = small_inputs(op, dtype, device, bsh)
    grad_outputs = [torch.randn(shape, dtype=dtype, device=device) for shape in cases.bench_output_shapes(op, bsh)]
    got, got_grads = grads_of(provider, inputs, grad_outputs)
    want, want_grads = grads_of(op.reference, inputs, grad_outputs)
    assert len(got) == len(want)
    for have, expected in zip(got + got_grads, want + want_grads):
        torch.testing.assert_close(have.float(), expected.float(), rtol=rtol, atol=atol)
    expected = peers.fusegen_outputs(op, inputs, {})
    assert peers.output_mismatch(expected, tuple(got), [b.name for b in op.spec.outputs]) is None


@pytest.mark.parametrize("name", INTERPRETABLE)
def test_liger_adapters_equal_the_reference_on_cpu(name):
    pytest.importorskip("liger_kernel")
    check_against_reference(name, torch.float32, DEVICE, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(LIGER_OPS))
def test_liger_adapters_equal_the_reference_on_gpu(name, dtype):
    pytest.importorskip("liger_kernel")
    tolerance = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (4e-2, 2e-2)}[dtype]
    check_against_reference(name, dtype, "cuda", *tolerance)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_peft_adapter_is_pefts_lora_layer(dtype):
    """peft's LoRA layer with the bench's tensors as its weights: lora_linear's values, and
    gradients reaching those tensors (peft is on the GPU machine; CI has no peft)."""
    pytest.importorskip("peft")
    assert set(peers.PEFT.adapters) == {"lora_linear"} and peers.PEFT in peers.PEERS
    tolerance = {torch.float64: (1e-7, 1e-9), torch.float32: (1e-4, 1e-5)}[dtype]
    check_against_reference("lora_linear", dtype, DEVICE, *tolerance, peer=peers.PEFT, bsh=(2, 3, 16, 24, 4))


class Recorder:
    """Stands in for a Liger autograd Function: records apply's arguments."""

    def __init__(self, result):
        self.calls, self.result = [], result

    def apply(self, *args):
        self.calls.append(args)
        return self.result


@pytest.mark.parametrize("name, module, function, expected_args, forward_params", [
    ("rmsnorm", "rms_norm", "LigerRMSNormFunction", (1e-6, 0.0, "gemma", False),
     ["ctx", "X", "W", "eps", "offset", "casting_mode", "in_place"]),
    ("add_rmsnorm", "fused_add_rms_norm", "LigerFusedAddRMSNormFunction", (1e-6, 0.0, "gemma", False),
     ["ctx", "X", "R", "W", "eps", "offset", "casting_mode", "in_place"]),
    ("layernorm", "layer_norm", "LigerLayerNormFunction", (1e-5,), ["ctx", "X", "W", "B", "eps"]),
])
def test_liger_norms_are_wired_as_the_spec_computes(name, module, function, expected_args, forward_params,
                                                    monkeypatch):
    """The norms Liger cannot run on the interpreter: eps from the spec, no weight offset,
    fp32 compute (casting_mode gemma), the incoming gradient left alone, outputs in spec order."""
    pytest.importorskip("liger_kernel")
    liger_module = __import__(f"liger_kernel.ops.{module}", fromlist=[function])
    real = getattr(liger_module, function)
    assert list(inspect.signature(real.forward).parameters)[:len(forward_params)] == forward_params
    normed, summed = torch.full((2,), 1.0), torch.full((2,), 2.0)
    recorder = Recorder((normed, summed) if name == "add_rmsnorm" else normed)
    monkeypatch.setattr(liger_module, function, recorder)
    op = bench_op(name)
    inputs = small_inputs(op)
    result = peers.peer_provider(peers.LIGER, op)(*inputs)
    args, = recorder.calls
    assert all(a is b for a, b in zip(args, inputs)) and args[len(inputs):] == expected_args
    if name == "add_rmsnorm":  # Liger returns (normed, sum); the spec's outputs are (h, y)
        assert [b.name for b in op.spec.outputs] == ["h", "y"] and result == (summed, normed)


def test_installed_liger_is_recorded_with_its_version(tmp_path):
    pytest.importorskip("liger_kernel")
    status, = peers.peer_statuses(["swiglu", "bias_gelu_dropout_add"], (peers.LIGER,))
    assert status.available and status.version == importlib.metadata.version("liger-kernel")
    assert status.ops == ("swiglu",)
    assert (status.note is None) == (status.version == "0.8.5")
    assert status.line().startswith(f"peer liger_kernel {status.version}: swiglu")
    path = tmp_path / "bench.json"
    reporting.write_json(path, reporting.run_metadata(None, peers=[status]), [], [])
    recorded, = json.loads(path.read_text())["metadata"]["peers"]
    assert recorded["version"] == status.version and recorded["ops"] == ["swiglu"]


def test_liger_runs_as_a_provider(monkeypatch):
    pytest.importorskip("liger_kernel")
    results = run_softmax_case(monkeypatch, [peers.LIGER])
    liger = results["liger_kernel"]
    assert liger.forward.error is None and liger.forward.timing is not None
    assert liger.forward_backward.error is None


def test_liger_cross_entropy_is_wired_as_the_spec_computes(monkeypatch):
    """The mean loss, as LigerCrossEntropyLoss computes it by default: rows flattened, the
    spec's ignore_index, z_loss as lse_square_scale, label smoothing, softcap off as None."""
    import sys
    import types

    recorder = Recorder((torch.tensor(1.5), None, None, None))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.cross_entropy",
                        types.SimpleNamespace(LigerCrossEntropyFunction=recorder))
    op = bench_op("cross_entropy_mean")
    x, target = small_inputs(op)
    assert target.dtype == torch.int64 and target.shape == (2, 3, 1) and ((target >= 0) & (target < 16)).all()
    result = peers.peer_provider(peers.LIGER, op)(x, target, z_loss=1e-4)
    args, = recorder.calls
    assert args[0].shape == (6, 16) and torch.equal(args[1], target.reshape(-1))
    assert args[2:] == (None, -100, 1e-4, 0.0, "mean", None, False) and result.item() == 1.5


def test_liger_cross_entropy_forward_takes_these_arguments():
    pytest.importorskip("liger_kernel")
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    assert list(inspect.signature(LigerCrossEntropyFunction.forward).parameters)[:10] == [
        "ctx", "_input", "target", "weight", "ignore_index", "lse_square_scale", "label_smoothing", "reduction",
        "softcap", "return_z_loss"]


def test_cross_entropy_mean_is_torchs_mean():
    """fusegen's, eager's and the reference's mean loss: F.cross_entropy's default reduction,
    ignored rows left out of the count; the bench's backward starts from a 0-d 1.0."""
    op = bench_op("cross_entropy_mean")
    assert op.mean_loss and [b.name for b in op.spec.outputs] == ["loss"] and cases.bench_output_shapes(op, (2, 3, 16)) == [()]
    x, target = small_inputs(op, torch.float64, DEVICE)
    target[0, 1] = -100
    want = torch.nn.functional.cross_entropy(x.reshape(-1, 16), target.reshape(-1), label_smoothing=0.1)
    for fn in (op.op, op.eager, op.reference):
        torch.testing.assert_close(fn(x, target, label_smoothing=0.1), want, rtol=1e-12, atol=1e-14)
    with_z = op.eager(x, target, z_loss=1e-2)
    per_row, lse = op.module.reference(x, target, z_loss=1e-2)
    torch.testing.assert_close(with_z, per_row.sum() / 5, rtol=1e-12, atol=1e-14)
    model = cases.bytes_model(op.spec, (2, 3, 16), torch.bfloat16)
    assert model.read == 6 * 16 * 2 + 6 * 8  # the logits in bf16, the int64 targets
