"""The C++ autograd node (fusegen.runtime.native) against the Python Function it replaces.

Every op gives the same gradients bit for bit through either node; the C++ node behaves as
a torch autograd node does: second backwards refused, in-place changes to saved inputs
caught, saved-tensor hooks applied, errors raised in the backward passed on with their
type, only the gradients asked for computed. A build that cannot happen leaves the Python
Function in place with one warning. The node is built here (about half a minute, once per
machine: FUSEGEN_CACHE_DIR), as `fusegen native` builds it.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from fusegen.runtime import native
from helpers import ShapeCase, all_ops, as_tuple, make_inputs, op_by_name, params_for, with_seed

CASE = ShapeCase("native", lead=(2, 3), n=8, layout="bcast")


@pytest.fixture(autouse=True)
def undecided(monkeypatch):
    """Each test starts before its process's first decision (FUSEGEN_NATIVE is read once),
    and its ops without eager calls in C++ (made again as the test sets the extension)."""
    monkeypatch.setattr(native._state, "settled", None)
    native.forget_calls()
    yield
    native.forget_calls()


@pytest.fixture(scope="module")
def built():
    module = native.load(build=True)
    assert module is not None, native.status()
    return module


@pytest.fixture
def use_native(built, monkeypatch):
    """The C++ node for this test; the Python Function again after it."""
    monkeypatch.setattr(native._state, "module", built)
    monkeypatch.setattr(native._state, "failed", None)


@pytest.fixture
def use_python(monkeypatch):
    monkeypatch.setattr(native._state, "module", None)
    monkeypatch.setattr(native._state, "failed", "off in this test")


def _step(op, device, requires=None, p=0.3):
    """Forward and backward with fresh random inputs and output gradients: (outputs, input grads)."""
    tensors = make_inputs(op, CASE, seed=1, device=device)
    for name, t in tensors.items():
        t.requires_grad_(t.is_floating_point() and (requires is None or name in requires))
    kwargs = with_seed(op, params_for(op, p=p), seed=11, training=True)
    outputs = as_tuple(op.fn(*tensors.values(), **kwargs))
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(o.shape, generator=g, dtype=o.dtype).to(device) for o in outputs]
    torch.autograd.backward(outputs, grads)
    return outputs, [t.grad for t in tensors.values()]


# Forward-only ops (no output has a gradient) have no node: test_language_output_dtypes.py.
@pytest.mark.parametrize("op", [op for op in all_ops() if op.differentiable], ids=str)
def test_every_op_has_the_python_functions_gradients_bit_for_bit(op, built, monkeypatch, device):
    monkeypatch.setattr(native._state, "failed", "off")
    monkeypatch.setattr(native._state, "module", None)
    python_outputs, python_grads = _step(op, device)
    monkeypatch.setattr(native._state, "failed", None)
    monkeypatch.setattr(native._state, "module", built)
    native.forget_calls()
    outputs, grads = _step(op, device)
    assert outputs[0].grad_fn.name() == op.module._OP._node_name  # the C++ node ran
    for a, b in zip(python_outputs, outputs):
        assert torch.equal(a, b)
    for name, a, b in zip(op.input_names, python_grads, grads):
        if name in op.float_input_names:  # integer inputs take no gradient
            assert a is not None and torch.equal(a, b), name
        else:
            assert a is None and b is None, name


def test_only_the_gradients_asked_for(use_native, device, monkeypatch):
    op = op_by_name("bias_dropout_add_layernorm")
    from fusegen.runtime import prepared

    asked = []
    backward = prepared.PreparedCall.backward

    def recording(self, grads, tensors, seed, needs, *rest):  # what the kernel is asked for
        asked.append(tuple(needs))
        return backward(self, grads, tensors, seed, needs, *rest)

    monkeypatch.setattr(prepared.PreparedCall, "backward", recording)
    _, grads = _step(op, device, requires={"x", "weight"})
    assert asked == [tuple(name in ("x", "weight") for name in op.input_names)]
    assert [g is not None for g in grads] == list(asked[0])

    def h_and_y():
        tensors = make_inputs(op, CASE, seed=1, device=device)
        for t in tensors.values():
            t.requires_grad_(True)
        return tensors, op.fn(*tensors.values(), **with_seed(op, params_for(op, p=0.3), seed=11, training=True))

    # One output used (h's gradient is absent), one input asked for of several that require
    # grad: only its gradient is computed (the Python Function computes every one).
    asked.clear()
    tensors, (h, y) = h_and_y()
    (gx,) = torch.autograd.grad(y.sum(), tensors["x"])
    assert asked == [tuple(name == "x" for name in op.input_names)]
    tensors, (h, y) = h_and_y()
    y.sum().backward()
    assert torch.equal(gx, tensors["x"].grad)


def test_the_forward_records_nothing(use_native, device, monkeypatch):
    from fusegen.runtime import prepared

    modes = []
    forward = prepared.PreparedCall.forward

    def recording(self, args, eager=True):
        modes.append(torch.is_grad_enabled())
        return forward(self, args, eager)

    monkeypatch.setattr(prepared.PreparedCall, "forward", recording)
    op = op_by_name("bias_dropout_add")
    x = torch.randn(2, 3, 8, device=device, requires_grad=True)
    y = op.fn(x, torch.randn(8, device=device), torch.randn(2, 1, 8, device=device), p=0.0)  # a broadcast residual
    assert modes == [False] and torch.is_grad_enabled()
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_double_backward_is_refused_as_before(use_native, device):
    op = op_by_name("bias_gelu")
    x = torch.randn(4, 8, device=device, requires_grad=True)
    (gx,) = torch.autograd.grad(op.fn(x, torch.randn(8, device=device)).sum(), x, create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="fusegen::bias_gelu: double backward is not supported"):
        gx.sum().backward()


def test_inplace_backward_writes_the_gradient_into_the_input(use_native, device):
    op = op_by_name("swiglu")
    w = torch.randn(4, 16, device=device, requires_grad=True)
    g = torch.randn(4, 8, device=device)
    expected = torch.autograd.grad(op.fn(w * 2.0), w, g)[0]
    a = w * 2.0  # no leaf: its memory may take its gradient
    seen = []
    a.register_hook(seen.append)
    (got,) = torch.autograd.grad(op.fn(a, inplace_backward=True), w, g)
    assert seen[0].data_ptr() == a.data_ptr()
    assert torch.equal(got, expected)


def test_compiled_autograd_gets_the_python_function(use_native, device, monkeypatch):
    import torch._dynamo.config

    op = op_by_name("bias_gelu")
    x = torch.randn(4, 8, device=device, requires_grad=True)
    assert op.fn(x, torch.randn(8, device=device)).grad_fn.name() == op.module._OP._node_name
    monkeypatch.setattr(torch._dynamo.config, "compiled_autograd", True)
    assert "_Autograd" in type(op.fn(x, torch.randn(8, device=device)).grad_fn).__name__


def test_second_backward_is_refused_unless_the_graph_is_kept(use_native, device):
    op = op_by_name("bias_gelu")
    x = torch.randn(4, 8, device=device, requires_grad=True)
    bias = torch.randn(8, device=device, requires_grad=True)
    y = op.fn(x, bias)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    assert torch.equal(x.grad, 2 * first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


def test_saved_input_changed_in_place_is_caught(use_native, device):
    op = op_by_name("bias_gelu")
    x = torch.randn(4, 8, device=device)
    bias = torch.randn(8, device=device, requires_grad=True)
    y = op.fn(x, bias)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_saved_tensor_hooks_and_checkpointing(use_native, device):
    op = op_by_name("add_rmsnorm")
    tensors = make_inputs(op, CASE, seed=3, device=device)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    for t in tensors.values():
        t.requires_grad_(True)
    params = params_for(op)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = as_tuple(op.fn(*tensors.values(), **params))
    assert len(packed) == len(tensors) + 1  # every input, and the row statistics
    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    expected = [t.grad.clone() for t in tensors.values()]
    for t in tensors.values():
        t.grad = None
    outputs = torch.utils.checkpoint.checkpoint(lambda *a: op.fn(*a, **params), *tensors.values(), use_reentrant=False)
    torch.autograd.backward(as_tuple(outputs), [torch.ones_like(o) for o in as_tuple(outputs)])
    for a, t in zip(expected, tensors.values()):
        assert torch.equal(a, t.grad)


def test_an_error_in_the_backward_keeps_its_type(use_native, device, monkeypatch):
    op = op_by_name("bias_gelu")

    class Boom(Exception):
        pass

    def boom(*args, **kwargs):
        raise Boom("from the backward")

    from fusegen.runtime import prepared

    monkeypatch.setattr(prepared.PreparedCall, "backward", boom)
    y = op.fn(torch.randn(4, 8, device=device, requires_grad=True), torch.randn(8, device=device))
    with pytest.raises(Boom, match="from the backward"):
        y.sum().backward()


@pytest.mark.parametrize("requires_grad", [True, False])
def test_forward_mode_ad_runs_the_reference(use_native, device, requires_grad):
    """With the C++ node and eager call in use, a tangent is carried (by the reference), not
    dropped: also for a call key the eager call in C++ already knows."""
    op = op_by_name("bias_gelu")
    x, bias = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    tangent = torch.randn(4, 8, device=device)
    op.fn(x.requires_grad_(requires_grad), bias)  # this call key, known from now on
    expected = torch.func.jvp(lambda x: op.reference(x, bias), (x.detach(),), (tangent,))
    with fwAD.dual_level():
        primal, out_tangent = fwAD.unpack_dual(op.fn(fwAD.make_dual(x, tangent), bias))
        assert out_tangent is not None
        torch.testing.assert_close((primal, out_tangent), expected)


def test_a_failed_build_warns_once_and_keeps_the_python_function(tmp_path, device, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(blocker))  # the build folder cannot be made
    monkeypatch.setattr(native._state, "module", None)
    monkeypatch.setattr(native._state, "failed", None)
    native.build_directory.cache_clear()
    try:
        with pytest.warns(UserWarning, match="C.. autograd node is unavailable"):
            assert native.load(build=True) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert native.attach_for() is None  # no second try, no second warning
        op = op_by_name("bias_gelu")
        y = op.fn(torch.randn(4, 8, device=device, requires_grad=True), torch.randn(8, device=device))
        assert "_Autograd" in type(y.grad_fn).__name__
        assert native.status().startswith("unavailable: ")
    finally:
        native.build_directory.cache_clear()


def test_the_installed_torch_is_one_the_extensions_private_apis_were_checked_on():
    """Fails loudly on a new torch: run this file and tests/test_eager_call.py on a GPU
    with it, then add it to native.CHECKED_TORCH."""
    assert native.unchecked_torch() is None, native.unchecked_torch()


def test_an_unchecked_torch_leaves_the_extension_off_with_one_warning(monkeypatch):
    monkeypatch.setattr(native, "CHECKED_TORCH", ("0.1",))
    monkeypatch.setattr(native._state, "module", None)
    monkeypatch.setattr(native._state, "failed", None)
    with pytest.warns(UserWarning, match=r"torch \d+\.\d+ is not among the versions its private APIs were checked on \(0\.1\)"):
        assert native.load(build=True) is None
    assert native.status().startswith("unavailable: RuntimeError: torch ")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load(build=True) is None  # decided once


def test_a_half_written_build_is_never_loaded(built, tmp_path, monkeypatch):
    """torch links into build/; only a whole library is moved beside it. A link killed
    midway (here: a library cut short) is never imported: importing it can kill the process."""
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native._state, "module", None)
    monkeypatch.setattr(native._state, "failed", None)
    native.build_directory.cache_clear()
    try:
        directory = native.build_directory()
        (directory / "build").mkdir(parents=True)
        whole = Path(built.__file__).read_bytes()
        (directory / "build" / native._library_name(directory)).write_bytes(whole[: len(whole) // 3])
        assert native.load(build=False) is None
        assert native.status() == f"not built: {directory}"
    finally:
        native.build_directory.cache_clear()


def test_a_killed_builds_lock_file_does_not_block_the_next_build(tmp_path, monkeypatch):
    """torch's build lock (cpp_extension's FileBaton, build/lock) outlives a build killed
    midway, and torch would wait on it forever; fusegen's own lock (an flock, let go when
    its process ends) says that no build is running, so the leftover goes. The process that
    built the extension sets it to own the eager seeds, as one that imports it does (it did
    not: that process's dropout calls failed, "the eager seeds were not configured")."""
    from fusegen.runtime.seeds import SEED_BATCH, SEED_LIMIT
    from torch.utils import cpp_extension

    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(tmp_path))
    native.build_directory.cache_clear()
    try:
        directory = native.build_directory()
        work = directory / "build"
        work.mkdir(parents=True)
        (work / "lock").write_text("")  # left by a killed build

        class Built:
            seeds = None

            def configure_seeds(self, batch, high):
                self.seeds = (batch, high)

        built = Built()

        def load(name, sources, build_directory, **kwargs):  # as torch's: waits while the lock is there
            assert not (Path(build_directory) / "lock").exists(), "the build would wait forever"
            (Path(build_directory) / native._library_name(directory)).write_bytes(b"library")
            return built

        monkeypatch.setattr(cpp_extension, "load", load)
        assert native._build(directory) is built
        assert native._built_file(directory).read_bytes() == b"library"
        assert built.seeds == (SEED_BATCH, SEED_LIMIT - 1)
    finally:
        native.build_directory.cache_clear()


def test_off_and_bad_modes(monkeypatch):
    monkeypatch.setattr(native._state, "module", None)
    monkeypatch.setattr(native._state, "failed", None)
    monkeypatch.setenv("FUSEGEN_NATIVE", "off")
    assert native.attach_for() is None
    assert native.status().startswith("off")
    assert native._state.settled == "off"  # read once: later calls ask nothing
    monkeypatch.delenv("FUSEGEN_NATIVE")
    assert native.attach_for() is None and native.status().startswith("off")  # what this process does
    monkeypatch.setattr(native._state, "settled", None)
    monkeypatch.setenv("FUSEGEN_NATIVE", "sometimes")
    with pytest.raises(ValueError, match="FUSEGEN_NATIVE must be one of auto, on, off"):
        native.mode()
    # In an op call: said once, then the Python Function.
    with pytest.warns(UserWarning, match="FUSEGEN_NATIVE must be one of"):
        assert native.attach_for() is None
    assert native.attach_for() is None


def test_fusegen_native_command(built, monkeypatch, capsys):
    from fusegen import cli

    monkeypatch.setattr(native._state, "module", None)
    monkeypatch.setattr(native._state, "failed", None)
    assert cli.main(["native"]) == 0
    assert capsys.readouterr().out.startswith(f"built: {native.build_directory()}")
    assert native._state.module is built  # loaded, not built again
    monkeypatch.setattr(native._state, "module", None)  # as a new process
    monkeypatch.setenv("FUSEGEN_NATIVE", "off")
    assert cli.main(["native"]) == 0
    assert capsys.readouterr().out.startswith("off (FUSEGEN_NATIVE=off)")


def test_settled_on_the_python_function_a_build_still_turns_the_node_on(built, monkeypatch, device):
    monkeypatch.setattr(native._state, "module", None)
    monkeypatch.setattr(native._state, "failed", None)
    monkeypatch.setenv("FUSEGEN_NATIVE", "off")
    assert native.attach_for() is None and native._state.settled == "off"
    assert native.load(build=True) is built
    op = op_by_name("bias_gelu")
    y = op.fn(torch.randn(4, 8, device=device, requires_grad=True), torch.randn(8, device=device))
    assert y.grad_fn.name() == op.module._OP._node_name


def test_an_unused_output_through_either_node(built, monkeypatch, device):
    """bias_dropout_add_layernorm with y alone used: h's gradient is None in the C++ node's
    backward, which then takes the general path; the same gradients as the Python Function."""
    op = op_by_name("bias_dropout_add_layernorm")
    got = {}
    for node in ("python", "native"):
        monkeypatch.setattr(native._state, "module", built if node == "native" else None)
        monkeypatch.setattr(native._state, "failed", None if node == "native" else "off")
        tensors = make_inputs(op, CASE, seed=1, device=device)
        for t in tensors.values():
            t.requires_grad_(True)
        h, y = op.fn(*tensors.values(), **with_seed(op, params_for(op, p=0.3), seed=11, training=True))
        assert (y.grad_fn.name() == op.module._OP._node_name) == (node == "native")
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(device))
        got[node] = [t.grad for t in tensors.values()]
    for name, a, b in zip(op.input_names, got["python"], got["native"]):
        assert torch.equal(a, b), name
