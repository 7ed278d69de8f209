"""torch.compile(fullgraph=True) over a module that calls a generated op: no graph breaks,
same values and gradients as eager (the op is an opaque torch.library op both ways)."""
import pytest
import torch

from generated.bias_gelu_dropout_add import bias_gelu_dropout_add
from helpers import ShapeCase, as_tuple, make_inputs, op_by_name, params_for, with_seed


class _Block(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.linear = torch.nn.Linear(n, n)

    def forward(self, x, residual, seed):
        h = torch.nn.functional.linear(x, self.linear.weight)
        return bias_gelu_dropout_add(h, self.linear.bias, residual, p=0.1, seed=seed)


def _step(model, x, residual, seed):
    for t in (*model.parameters(), x, residual):
        t.grad = None
    y = model(x, residual, seed)
    (y * y).sum().backward()
    return y.detach(), [t.grad.clone() for t in (*model.parameters(), x, residual)]


def test_compile_fullgraph_matches_eager(device):
    torch.manual_seed(0)
    model = _Block(16).to(device)
    x = torch.randn(4, 3, 16, device=device, requires_grad=True)
    residual = torch.randn(4, 3, 16, device=device, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: any graph break is an error
    for seed in (1234, 99):
        y_eager, grads_eager = _step(model, x, residual, seed)
        y_compiled, grads_compiled = _step(compiled, x, residual, seed)
        torch.testing.assert_close(y_compiled, y_eager, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads_compiled, grads_eager):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # p > 0 really dropped something, so the compiled graph carried the seed through.
    assert (y_eager == residual.detach()).any()


def test_compile_draws_seed_inside_the_op(device):
    # seed=None must not break the graph (the seed is drawn inside the opaque op).
    x = torch.randn(8, 32, device=device)
    bias = torch.randn(32, device=device)
    residual = torch.randn(8, 32, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: bias_gelu_dropout_add(a, b, c, p=0.5), fullgraph=True)
    torch.manual_seed(7)
    first = compiled(x, bias, residual)
    torch.manual_seed(7)
    second = compiled(x, bias, residual)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


@pytest.mark.parametrize(
    "name",
    ["gelu", "swiglu", "scale_add", "add_mul_activation", "bias_dropout_add", "layernorm", "add_rmsnorm",
     "scaled_masked_softmax_dropout", "bias_dropout_add_layernorm"],
)
def test_every_kind_of_op_compiles_fullgraph_forward_and_backward(name, device):
    """One output or several, chunked inputs, [..., 1] inputs, choices, dropout, row reductions
    (whose forward also returns the statistics it keeps for the backward): the library
    op's schema, fake function and autograd hold under torch.compile(fullgraph=True)."""
    op = op_by_name(name)
    kwargs = with_seed(op, params_for(op, p=0.0))  # p = 0: eager and compiled compute the same

    def step(fn):
        inputs = make_inputs(op, ShapeCase("c", lead=(3, 4), n=8), torch.float64, device)
        tensors = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
        outputs = as_tuple(fn(*tensors.values(), **kwargs))
        sum((o * o).sum() for o in outputs).backward()
        return [o.detach() for o in outputs] + [t.grad for t in tensors.values()]

    torch._dynamo.reset()
    for got, want in zip(step(torch.compile(op.fn, fullgraph=True)), step(op.fn)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
