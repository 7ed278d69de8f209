"""torch.compile(fullgraph=True) over a module that calls a generated op: no graph breaks,
same values and gradients as eager (the op is an opaque torch.library op both ways)."""
import torch

from generated.bias_gelu_dropout_add import bias_gelu_dropout_add


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
