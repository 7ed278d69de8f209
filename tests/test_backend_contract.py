"""The backend contract (fusegen.runtime.backend) both ways: the Triton backend's kernels,
bound kernels and prepared forms satisfy its Protocols, and the runtime uses nothing
beyond them (a backend exposing only the Protocols' members drives an op's calls)."""
from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import typing

import pytest
import torch

from fusegen.backends.triton import launch, row_launch
from fusegen.runtime import backend, op as op_module

PROTOCOLS = (backend.BackendKernels, backend.BoundKernels, backend.PreparedForward, backend.PreparedBackward)
RUNTIME = pathlib.Path(op_module.__file__).parent


def _args(name: str, device, requires_grad: bool = False) -> tuple:
    """A small call of a generated op on the suite's device."""
    g = torch.Generator().manual_seed(0)
    n = 16

    def t(*shape):
        return torch.randn(*shape, generator=g).to(device).requires_grad_(requires_grad)

    if name == "gelu":
        return (t(3, n),)
    if name == "layernorm":
        return (t(3, n), t(n), t(n), 1e-5)
    raise KeyError(name)


OPS = ("gelu", "layernorm")


def _declaration(name: str) -> tuple[object, dict]:
    """The generated module and its `_OP = runtime.FusedOp(name, **keywords)`'s keywords,
    evaluated in the module (the unbound kernels among them: the op keeps only the bound)."""
    module = importlib.import_module(f"generated.{name}")
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_OP"]:
            keywords = {k.arg: eval(compile(ast.Expression(k.value), module.__file__, "eval"), vars(module))
                        for k in node.value.keywords}
            return module, keywords
    raise AssertionError(f"{name}: no _OP declaration")


def _members(protocol) -> list[str]:
    return sorted(typing.get_protocol_members(protocol)) if hasattr(typing, "get_protocol_members") else sorted(
        protocol.__protocol_attrs__ if hasattr(protocol, "__protocol_attrs__") else _protocol_attrs(protocol))


def _protocol_attrs(protocol) -> set[str]:
    names = set(protocol.__annotations__)
    for name, value in vars(protocol).items():
        if callable(value) and (not name.startswith("_") or name == "__call__"):
            names.add(name)
    return names


def _check_signature(protocol, obj) -> None:
    """Each method the Protocol declares takes its parameters as the runtime passes them:
    positional ones at the same positions and names, keyword-only ones by name; the
    implementation's extra parameters have defaults."""
    for name in _members(protocol):
        assert hasattr(obj, name), f"{type(obj).__name__} lacks {name}"
        declared = vars(protocol).get(name)
        if not inspect.isfunction(declared):
            continue  # an attribute
        want = list(inspect.signature(declared).parameters.values())[1:]  # without self
        have = inspect.signature(getattr(obj, name)).parameters
        positional = [p for p in have.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        where = f"{type(obj).__name__}.{name}"
        used = set()
        for i, p in enumerate(w for w in want if w.kind == w.POSITIONAL_OR_KEYWORD):
            assert i < len(positional) and positional[i].name == p.name, f"{where}: positional {i} is not {p.name}"
            assert (p.default is p.empty) or positional[i].default is not positional[i].empty, \
                f"{where}: {p.name} needs a default"
            used.add(p.name)
        for p in (w for w in want if w.kind == w.KEYWORD_ONLY):
            assert p.name in have and have[p.name].kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY), \
                f"{where}: takes no {p.name}="
            assert have[p.name].default is not p.empty, f"{where}: {p.name} needs a default"
            used.add(p.name)
        for p in have.values():
            if p.name not in used and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                assert p.default is not p.empty, f"{where}: {p.name} is not in the Protocol and has no default"


def test_the_protocols_are_what_the_docs_list():
    assert _members(backend.BackendKernels) == ["bind", "gradients", "statistics"]
    assert _members(backend.BoundKernels) == ["backward", "check_device", "forward", "prepare_backward",
                                              "prepare_forward", "statistics_width", "traceable"]
    assert _members(backend.PreparedForward) == ["__call__", "native_form"]
    assert _members(backend.PreparedBackward) == ["__call__", "native_form"]


@pytest.mark.parametrize("name", OPS)
def test_the_triton_backend_satisfies_the_protocols(name, device):
    module, keywords = _declaration(name)
    kernels = keywords["kernels"]
    assert type(kernels) is (row_launch.RowKernels if name == "layernorm" else launch.Kernels)
    bound = module._OP.kernels
    args = _args(name, device)
    op = module._OP
    call = op.check(args, needs_kernel=True)
    tensors = args[:len(op.inputs)]
    grads = [torch.randn(op.output_shape(call.problem, i), device=device) for i in range(len(op.outputs))]
    forms = [
        (backend.BackendKernels, kernels),
        (backend.BoundKernels, bound),
        (backend.PreparedForward, bound.prepare_forward(call, tensors)),
        (backend.PreparedBackward, bound.prepare_backward(call, tensors, grads, [True] * len(tensors))),
    ]
    for protocol, obj in forms:
        assert isinstance(obj, protocol), f"{type(obj).__name__} is no {protocol.__name__}"
        _check_signature(protocol, obj)


def test_the_runtime_reads_only_protocol_members_of_its_kernels():
    """Every `.kernels.<name>` / `kernels.<name>` the runtime's modules read is a Protocol member."""
    members = set(_members(backend.BackendKernels)) | set(_members(backend.BoundKernels))
    seen = set()
    for path in RUNTIME.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                base = node.value
                named = (isinstance(base, ast.Attribute) and base.attr == "kernels") or \
                        (isinstance(base, ast.Name) and base.id == "kernels")
                if named:
                    assert node.attr in members, f"{path.name}:{node.lineno}: kernels.{node.attr} is no Protocol member"
                    seen.add(node.attr)
    assert {"bind", "forward", "backward", "prepare_forward", "prepare_backward", "traceable"} <= seen


# -- a backend with only the Protocols' members, delegating to the Triton one --------------


class _Log:
    def __init__(self):
        self.calls: list[str] = []


class _OnlyForward:
    __slots__ = ("_real", "_log")

    def __init__(self, real, log):
        self._real, self._log = real, log

    def __call__(self, values):
        self._log.calls.append("prepared_forward")
        return self._real(values)

    def native_form(self):
        return self._real.native_form()


class _OnlyBackward:
    __slots__ = ("_real", "_log")

    def __init__(self, real, log):
        self._real, self._log = real, log

    def __call__(self, tensors, grads, seed, statistics, in_place=False):
        self._log.calls.append("prepared_backward")
        return self._real(tensors, grads, seed, statistics, in_place)

    def native_form(self):
        return self._real.native_form()


class _OnlyBound:
    __slots__ = ("_real", "_log", "traceable")

    def __init__(self, real, log):
        self._real, self._log, self.traceable = real, log, real.traceable

    def check_device(self, device):
        self._log.calls.append("check_device")
        self._real.check_device(device)

    def forward(self, call, tensors, outputs, seed, *, statistics=None, traced=False, keep=True):
        self._log.calls.append("forward")
        self._real.forward(call, tensors, outputs, seed, statistics=statistics, traced=traced, keep=keep)

    def backward(self, call, tensors, grads, needs, seed, *, statistics=None, traced=False):
        self._log.calls.append("backward")
        return self._real.backward(call, tensors, grads, needs, seed, statistics=statistics, traced=traced)

    def statistics_width(self, problem, keep=True):
        self._log.calls.append("statistics_width")
        return self._real.statistics_width(problem, keep)

    def prepare_forward(self, call, tensors, *, keep=True):
        self._log.calls.append("prepare_forward")
        return _OnlyForward(self._real.prepare_forward(call, tensors, keep=keep), self._log)

    def prepare_backward(self, call, tensors, grads, needs):
        self._log.calls.append("prepare_backward")
        return _OnlyBackward(self._real.prepare_backward(call, tensors, grads, needs), self._log)


class _OnlyKernels:
    __slots__ = ("_real", "log", "gradients", "statistics")

    def __init__(self, real):
        self._real, self.log = real, _Log()
        self.gradients, self.statistics = real.gradients, real.statistics

    def bind(self, op):
        return _OnlyBound(self._real.bind(op), self.log)


_CONTRACT_OPS: dict = {}


def _contract_op(name: str):
    """The generated op declared again (as contract_<name>) over a backend that has only
    the Protocols' members: any other attribute the runtime reads raises AttributeError."""
    if name not in _CONTRACT_OPS:
        module, keywords = _declaration(name)
        keywords["kernels"] = _OnlyKernels(keywords["kernels"])
        from fusegen import runtime
        _CONTRACT_OPS[name] = (module, runtime.FusedOp(f"contract_{name}", **keywords), keywords["kernels"].log)
    return _CONTRACT_OPS[name]


@pytest.mark.parametrize("name", OPS)
def test_only_the_protocols_drive_an_ops_calls(name, monkeypatch, device):
    module, op, log = _contract_op(name)
    for obj, protocol in [(op.kernels, backend.BoundKernels)]:
        assert isinstance(obj, protocol)
    monkeypatch.setattr(op, "_native_calls", None)
    monkeypatch.setattr(op, "native_calls", lambda: None)  # the Python path throughout
    real = module._OP

    # The eager path: prepared forward, then the prepared backward through autograd.
    args = _args(name, device, requires_grad=True)
    y = op(*args)
    y_real = real(*args)
    torch.testing.assert_close(y, y_real)
    grad = torch.randn_like(y)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    got = torch.autograd.grad(y, tensors, grad)
    want = torch.autograd.grad(y_real, tensors, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    # check_device: asked only off CUDA, where a backend may refuse the device.
    assert {"prepare_forward", "prepared_forward", "prepare_backward", "prepared_backward",
            *(["check_device"] if device != "cuda" else [])} <= set(log.calls)

    # The full path: out= launches the bound forward; a tensor subclass's gradient the bound backward.
    log.calls.clear()
    plain = _args(name, device)
    out = torch.empty_like(y)
    outputs, seed, statistics = op.forward(plain, out=out)
    torch.testing.assert_close(out, y_real.detach())

    class Sub(torch.Tensor):
        pass

    needs = [True] * len(op.inputs)
    got = op.backward_kernels((grad.as_subclass(Sub),), plain, seed, needs, statistics)
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.Tensor(g) if isinstance(g, Sub) else g, w)
    assert {"forward", "backward"} <= set(log.calls)
