"""Each generated module's torch.nn.Module class: BiasGeluDropoutAdd(p=0.1, activation=...).

Params fixed (and checked) at construction, forward(tensors...) calls the op, dropout
follows train()/eval(); it trains in a model, compiles with fullgraph=True, and prints its
params. Its name comes from the op's (codegen.module_class_name), never colliding with the
spec's names or the module's own.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from fusegen import cli
from fusegen.backends.triton.codegen import module_class_name
from fusegen.spec import NN_MODULE_ATTRIBUTES
from fusegen.errors import SpecError
from fusegen.runtime import FusegenArgumentError
from generated.bias_gelu_dropout_add import BiasGeluDropoutAdd, bias_gelu_dropout_add
from generated.bias_gelu_dropout_add import reference as bias_gelu_dropout_add_reference
from generated.gelu import Gelu
from generated.leaky_relu import LeakyRelu
from generated.swiglu import Swiglu
from helpers import ShapeCase, all_ops, as_tuple, build_and_import, make_inputs, params_for

CASE = ShapeCase("3d-bcast", lead=(2, 3), n=8, layout="bcast")


def _class_of(op):
    return getattr(op.module, module_class_name(op.name))


@pytest.mark.parametrize("op", all_ops(), ids=str)
def test_every_module_exports_its_class(op):
    cls = _class_of(op)
    assert issubclass(cls, torch.nn.Module) and cls.__name__ in op.module.__all__
    params = list(inspect.signature(cls).parameters.values())
    # The spec's params, then the keyword-only opt-in of the backward's in-place gradients
    # (none for a forward-only op: it has no backward).
    forward_only = op.module._OP._forward_only
    assert [(p.name, p.default) for p in params] == [(p.name, p.default) for p in op.spec.params] + (
        [] if forward_only else [("inplace_backward", False)]
    )
    if not forward_only:
        assert params[-1].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(TypeError):
        cls(*[p.default for p in op.spec.params], False)  # not by position (nor at all, forward only)
    forward = inspect.signature(cls.forward).parameters
    assert list(forward) == ["self", *op.input_names]
    # Ops without dropout have no training plumbing.
    assert ("training" in inspect.getsource(cls.forward)) == op.has_dropout


@pytest.mark.parametrize("op", all_ops(), ids=str)
def test_module_computes_what_the_op_computes(op, device):
    tensors = make_inputs(op, CASE, device=device)
    params = params_for(op)
    module = _class_of(op)(**params)
    torch.manual_seed(5)
    got = as_tuple(module(*tensors.values()))
    torch.manual_seed(5)  # in train() mode, dropout draws its seed as the op does
    want = as_tuple(op.fn(*tensors.values(), **params))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_dropout_follows_train_and_eval(device):
    x, bias, residual = (torch.randn(s, device=device) for s in [(4, 64), (64,), (4, 64)])
    module = BiasGeluDropoutAdd(p=0.5)
    assert module.training
    torch.manual_seed(0)
    trained = module(x, bias, residual)
    no_dropout = bias_gelu_dropout_add(x, bias, residual, p=0.0)
    assert not torch.equal(trained, no_dropout)
    torch.manual_seed(0)
    torch.testing.assert_close(trained, bias_gelu_dropout_add(x, bias, residual, p=0.5), rtol=0, atol=0)
    module.eval()
    torch.testing.assert_close(module(x, bias, residual), no_dropout, rtol=0, atol=0)
    module.train()
    assert not torch.equal(module(x, bias, residual), no_dropout)


class _Block(torch.nn.Module):
    """Linear, then the op with the Linear's bias and a residual, as a transformer block does."""

    def __init__(self, n: int, fused: bool):
        super().__init__()
        self.linear = torch.nn.Linear(n, n)
        self.act = BiasGeluDropoutAdd(p=0.25, activation="gelu")
        self.fused = fused

    def forward(self, x, residual):
        h = torch.nn.functional.linear(x, self.linear.weight)
        if self.fused:
            return self.act(h, self.linear.bias, residual)
        return bias_gelu_dropout_add_reference(h, self.linear.bias, residual, p=self.act.p, activation="gelu",
                                               training=self.training)


def _step(model, x, residual, seed):
    for t in (*model.parameters(), x, residual):
        t.grad = None
    torch.manual_seed(seed)
    y = model(x, residual)
    (y * y).sum().backward()
    return y.detach(), [t.grad.clone() for t in (*model.parameters(), x, residual)]


def _models(device):
    torch.manual_seed(0)
    fused = _Block(16, fused=True).to(device)
    twin = _Block(16, fused=False).to(device)
    twin.load_state_dict(fused.state_dict())
    x = torch.randn(4, 3, 16, device=device, requires_grad=True)
    residual = torch.randn(4, 3, 16, device=device, requires_grad=True)
    return fused, twin, x, residual


def test_gradients_flow_in_a_model(device):
    fused, twin, x, residual = _models(device)
    for train in (True, False):
        fused.train(train)
        twin.train(train)
        y, grads = _step(fused, x, residual, seed=11)
        y_want, grads_want = _step(twin, x, residual, seed=11)  # reference draws the same mask
        torch.testing.assert_close(y, y_want, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, grads_want, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sequential_with_a_linear_trains(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), Swiglu(), torch.nn.Linear(16, 4), LeakyRelu(slope=0.2))
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, target = torch.randn(64, 8, device=device), torch.randn(64, 4, device=device)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_compile_fullgraph_matches_eager(device):
    fused, _, x, residual = _models(device)
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True)  # fullgraph: any graph break is an error
    for train in (True, False):
        fused.train(train)
        y_eager, grads_eager = _step(fused, x, residual, seed=7)
        # The same mask as eager's: Inductor's RNG (its own unless fallback_random) draws the seed.
        with torch._inductor.config.patch(fallback_random=True):
            y_compiled, grads_compiled = _step(compiled, x, residual, seed=7)
        torch.testing.assert_close(y_compiled, y_eager, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads_compiled, grads_eager, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_meta_model():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), Swiglu(), Gelu())
        y = model(torch.empty(5, 8, requires_grad=True))
    assert (y.shape, y.device.type, y.requires_grad) == ((5, 16), "meta", True)


def test_repr_shows_the_params():
    assert repr(BiasGeluDropoutAdd(p=0.1, activation="gelu_tanh")) == "BiasGeluDropoutAdd(p=0.1, activation='gelu_tanh')"
    assert repr(BiasGeluDropoutAdd()) == "BiasGeluDropoutAdd(p=0.1, activation='gelu_tanh')"
    assert repr(LeakyRelu(slope=0.2)) == "LeakyRelu(slope=0.2)"
    assert repr(Gelu()) == "Gelu()"
    assert repr(torch.nn.Sequential(Swiglu())) == "Sequential(\n  (0): Swiglu()\n)"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"p": 1.5}, "bias_gelu_dropout_add(): p must be in [0.0, 1.0], got 1.5"),
        ({"p": "0.1"}, "bias_gelu_dropout_add(): p must be a number, got str"),
        ({"p": float("nan")}, "bias_gelu_dropout_add(): p must not be NaN"),
        ({"activation": "tanh"},
         "bias_gelu_dropout_add(): activation must be one of gelu_tanh, gelu, relu, silu, sigmoid, identity; got 'tanh'"),
    ],
    ids=["p-range", "p-type", "p-nan", "choice"],
)
def test_bad_params_fail_at_construction(kwargs, message):
    with pytest.raises(FusegenArgumentError) as error:
        BiasGeluDropoutAdd(**kwargs)
    assert str(error.value) == message


# ---------------------------------------------------------------------------
# The class's name, and the names it must not collide with


@pytest.mark.parametrize(
    "op, name",
    [
        ("bias_gelu_dropout_add", "BiasGeluDropoutAdd"),
        ("gelu", "Gelu"),
        ("swiglu2", "Swiglu2"),
        ("gelu_", "Gelu"),
        ("myOp", "MyOp"),
        ("Gelu", "GeluModule"),  # the op's own name
        ("K", "KModule"),
        ("f", "FModule"),  # torch.nn.functional, as the module imports it
        ("runtime_error", "RuntimeErrorModule"),  # a builtin the module raises
    ],
)
def test_class_name(op, name):
    assert module_class_name(op) == name


def test_nn_module_attributes_are_all_known():
    """spec's list of what a param must not be named, against the installed torch. Only torch's
    own: another library may add to torch.nn.Module in this process (transformers sets
    `smart_apply` when it builds a model, as tests/test_huggingface.py does)."""
    def torchs(name: str) -> bool:
        return getattr(getattr(torch.nn.Module, name), "__module__", "torch").split(".")[0] == "torch"

    public = {n for n in dir(torch.nn.Module) if not n.startswith("_") and torchs(n)}
    public |= {n for n in vars(torch.nn.Module()) if not n.startswith("_")}
    assert public <= NN_MODULE_ATTRIBUTES, sorted(public - NN_MODULE_ATTRIBUTES)
    assert "forward" in public and "to" in public  # torch's own are still checked


def test_a_param_named_like_a_module_attribute_is_a_spec_error(tmp_path):
    path = tmp_path / "specs" / "gelu.yaml"
    path.parent.mkdir()
    body = "inputs:\n  x: [..., N]\nparams:\n  to: {type: float, default: 1.0}\noutputs:\n  y: x * to\n"
    path.write_text(f"name: gelu\ndoc: d\n{body}", encoding="utf-8")
    with pytest.raises(SpecError) as error:
        cli.build_op(path)
    assert str(error.value) == (
        "specs/gelu.yaml:6: param name 'to' is an attribute of torch.nn.Module: the op's module class keeps each "
        "param as an attribute of its name"
    )


def test_names_like_the_class_are_the_users(tmp_path, device):
    """An input and an output named as the op's module class: the class is module-level,
    the names are the functions' own."""
    # Not named gelu: a second fusegen::gelu would replace the library op of generated/gelu.py.
    spec = (
        "name: gelu_named\ndoc: d\ninputs:\n  x: [..., N]\n  GeluNamed: [..., N]\n"
        "outputs:\n  y: x * GeluNamed\n  GeluNamedModule: x + 1\n"
    )
    module = build_and_import(tmp_path, spec)
    x, g = torch.randn(3, 4, device=device), torch.randn(3, 4, device=device)
    y, z = module.gelu_named(x, GeluNamed=g)
    torch.testing.assert_close(y, x * g)
    torch.testing.assert_close(z, x + 1)
    y, z = module.GeluNamed()(x, g)
    torch.testing.assert_close(y, x * g)


@pytest.mark.parametrize("node", ["python", "native"])
def test_torch_jit_trace_is_refused_in_one_line(node, device, use_node):
    """A trace would keep the kernel's outputs as constants; it is refused, on a call key
    seen before too (the prepared path, the eager call in C++)."""
    use_node(node)
    from generated.bias_gelu import BiasGelu

    module = BiasGelu()
    x, bias = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    for _ in range(2):
        module(x, bias)
    with pytest.raises(FusegenArgumentError) as error:
        torch.jit.trace(module, (x, bias))
    assert str(error.value) == "bias_gelu(): torch.jit.trace is not supported; use torch.compile"
