"""Dropout's seed and mask contract, for every way people run PyTorch.

- The mask is a function of (seed, flat logical index) only: reshaping the inputs, or any
  tile the autotuner picks (tests/test_ops.py), leaves it unchanged; N % 4 != 0 included.
- The seed is a one-element int64 tensor on the inputs' device, drawn there by torch's
  generator (no host sync), so eager calls, torch.compile, CUDA graph replays and
  torch.compile's reduce-overhead mode all draw a new mask per call, and torch.manual_seed
  reproduces each sequence. The backward draws the forward's mask again from that tensor.
- An explicit seed is an int in [0, 2**63); anything else is a one-line error.

The CUDA graph tests need a GPU (marker `gpu`); the rest run on the interpreter too.
"""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

from fusegen import runtime

seed_op = importlib.import_module("generated.bias_gelu_dropout_add")
bias_dropout_add = importlib.import_module("generated.bias_dropout_add")
gelu = importlib.import_module("generated.gelu")
OPS = {
    "bias_gelu_dropout_add": lambda x, b, r, **kw: seed_op.bias_gelu_dropout_add(x, b, r, activation="identity", **kw),
    "bias_dropout_add": bias_dropout_add.bias_dropout_add,
}
P = 0.5
linear_dropout = importlib.import_module("generated.linear_bias_dropout_add")


def _linear_bias_dropout_add(x, bias, residual, **kw):
    """The gemm kind's dropout (its mask keyed by the product's flat index, as the elementwise
    kinds' by theirs) as the elementwise ops above: x @ I.T is x exactly (fp32, one term a sum)."""
    eye = torch.eye(x.shape[-1], device=x.device, dtype=x.dtype)
    return linear_dropout.linear_bias_dropout_add(x, eye, bias, residual, **kw)


# The CUDA graph replays cover the gemm kind too.
GRAPH_OPS = {**OPS, "linear_bias_dropout_add": _linear_bias_dropout_add}


def _randn(*shape, device, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)


def _within_sigmas(count: int, total: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - total * p) <= sigmas * math.sqrt(total * p * (1 - p))


def _dropped(y, x, residual):
    """Where dropout dropped, for bias = 0 and the identity: y = mask * x + residual."""
    return y == residual


# ---------------------------------------------------------------------------
# The mask is keyed by the flat index


@pytest.mark.parametrize("op_name", sorted(OPS))
@pytest.mark.parametrize("shape,other", [
    ((64, 256), (128, 128)),
    ((6, 10), (15, 4)),        # N % 4 != 0 on one side only
    ((5, 7), (7, 5)),          # on both
    ((2, 3, 12), (72, 1)),     # one column per row
    ((1, 100), (4, 25)),
])
def test_same_seed_same_mask_for_any_2d_layout(op_name, shape, other, device):
    fn = OPS[op_name]
    x = _randn(*shape, device=device, seed=1)
    residual = _randn(*shape, device=device, seed=2)
    # bias = 0 (x and residual are random): then y = mask * x + residual in both layouts,
    # the same arithmetic on the same values, and equal outputs mean equal masks.
    y = fn(x, torch.zeros(shape[-1], device=device), residual, p=P, seed=2**40 + 17)
    y_other = fn(x.reshape(other), torch.zeros(other[-1], device=device), residual.reshape(other), p=P, seed=2**40 + 17)
    assert torch.equal(y.reshape(other), y_other), f"{shape} and {other} drew different masks"
    dropped = int(_dropped(y, x, residual).sum())
    assert 0 < dropped < y.numel()
    if y.numel() >= 1000:
        assert _within_sigmas(dropped, y.numel(), P), f"{dropped} of {y.numel()} dropped at p={P}"


@pytest.mark.parametrize("shape,other", [((6, 10), (15, 4)), ((8, 12), (4, 24))])
def test_backward_follows_the_flat_index_too(shape, other, device):
    grads = []
    for s in (shape, other):
        x = _randn(*shape, device=device, seed=3).reshape(s).requires_grad_(True)
        bias = torch.zeros(s[-1], device=device, requires_grad=True)
        residual = _randn(*shape, device=device, seed=4).reshape(s)
        y = OPS["bias_gelu_dropout_add"](x, bias, residual, p=P, seed=123)
        (gx,) = torch.autograd.grad(y, (x,), _randn(*shape, device=device, seed=5).reshape(s))
        grads.append(gx.reshape(other))
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("n", [1, 3, 5, 6, 7, 41, 64])
@pytest.mark.parametrize("seed", [0, 2**31 + 5, 2**62 + 2**33 + 1, 2**63 - 1])
def test_kernel_mask_is_the_reference_mask_bit_for_bit(n, seed, device):
    x = _randn(9, n, device=device, seed=6)
    bias, residual = _randn(n, device=device, seed=7), _randn(9, n, device=device, seed=8)
    y = seed_op.bias_gelu_dropout_add(x, bias, residual, p=P, seed=seed)
    want = seed_op.reference(x, bias, residual, p=P, seed=seed)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    problem = runtime.broadcast_problem("t", (runtime.Input("x", ("...", "N")),), (x,))
    mask = runtime.dropout_mask_reference(seed, problem, 0, P)
    activation = seed_op.bias_gelu_dropout_add(x, bias, torch.zeros_like(residual), p=0.0)
    assert torch.equal((y - residual) == 0, (mask == 0) | (activation == 0))


# ---------------------------------------------------------------------------
# Seeds: drawn on the device, replayed by torch.manual_seed, validated when given


def test_unseeded_calls_draw_new_masks_and_manual_seed_replays_them(device):
    x, bias, residual = _randn(16, 36, device=device), _randn(36, device=device, seed=1), _randn(16, 36, device=device, seed=2)
    torch.manual_seed(31)
    first = [OPS["bias_gelu_dropout_add"](x, bias, residual, p=P) for _ in range(3)]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    torch.manual_seed(31)
    again = [OPS["bias_gelu_dropout_add"](x, bias, residual, p=P) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    torch.manual_seed(31)
    want = seed_op.reference(x, bias, residual, p=P, activation="identity")
    torch.testing.assert_close(want, first[0], rtol=1e-6, atol=1e-6)


def test_seed_tensor_is_one_int64_on_the_inputs_device(device):
    x = _randn(4, 8, device=device)
    outputs, seed, _ = seed_op._OP.forward((x, x[0], x, 0.5, "gelu_tanh", True, None))
    assert seed.shape == (1,) and seed.dtype == torch.int64 and seed.device == x.device
    assert 0 <= int(seed) < 2**63
    outputs, seed, _ = seed_op._OP.forward((x, x[0], x, 0.5, "gelu_tanh", True, 77))
    assert int(seed) == 77
    outputs, seed, _ = seed_op._OP.forward((x, x[0], x, 0.5, "gelu_tanh", True, None), eager=False)
    assert seed.shape == (1,) and seed.dtype == torch.int64 and seed.device == x.device
    # No dropout this call (eval, or p == 0): nothing drawn, no seed.
    assert seed_op._OP.forward((x, x[0], x, 0.5, "gelu_tanh", False, None))[1] is None
    assert seed_op._OP.forward((x, x[0], x, 0.0, "gelu_tanh", True, None))[1] is None


def test_no_host_sync_on_the_launch_path(monkeypatch, device):
    """The seed never comes back to the host: .item(), int() or a copy to the CPU would
    wait for the GPU (and break CUDA graph capture)."""
    x = _randn(8, 20, device=device).requires_grad_(True)
    bias, residual = _randn(20, device=device, seed=1), _randn(8, 20, device=device, seed=2)
    y = seed_op.bias_gelu_dropout_add(x, bias, residual, p=P)  # the first call may tune
    y.sum().backward()

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")

    for name in ("item", "tolist", "__int__", "__index__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    y = seed_op.bias_gelu_dropout_add(x, bias, residual, p=P)
    y.backward(torch.ones_like(y))
    seed_op.bias_gelu_dropout_add(x.detach(), bias, residual, p=P, seed=5)
    monkeypatch.undo()
    assert x.grad is not None


@pytest.mark.parametrize("seed,shown", [
    (2**64, "18446744073709551616"),
    (2**63, "9223372036854775808"),
    ("abc", "'abc'"),
    (1.5, "1.5"),
    (-1, "-1"),
    (True, "True"),
    ([3], "list"),
])
@pytest.mark.parametrize("fn", [seed_op.bias_gelu_dropout_add, seed_op.reference], ids=["op", "reference"])
def test_bad_seeds_get_one_line_errors(fn, seed, shown, device):
    x = _randn(2, 4, device=device)
    message = f"bias_gelu_dropout_add(): seed must be None or an int in [0, 2**63), got {shown}"
    with pytest.raises(runtime.FusegenArgumentError) as info:
        fn(x, x[0], x, p=0.1, seed=seed)
    assert str(info.value) == message


def test_integer_seeds_of_other_types(device):
    x = _randn(4, 8, device=device)
    want = seed_op.bias_gelu_dropout_add(x, x[0], x, p=P, seed=9)
    assert torch.equal(seed_op.bias_gelu_dropout_add(x, x[0], x, p=P, seed=np.int64(9)), want)
    torch.testing.assert_close(seed_op.bias_gelu_dropout_add(x, x[0], x, p=P, seed=2**63 - 1),
                               seed_op.reference(x, x[0], x, p=P, seed=2**63 - 1), rtol=1e-6, atol=1e-6)


def test_library_op_is_tagged_random(device):
    """torch.compile's partitioner may recompute a cheap op in the backward unless it is
    tagged random: recomputing the seed's draw would draw another mask. The interpreter's
    form is a custom op and carries the tag itself; the GPU's form is a triton_op, which
    compile decomposes, so the draw (torch.randint) carries it there: what shows it is a
    compiled backward that keeps the forward's mask."""
    if not bias_dropout_add._OP.kernels.traceable:
        assert torch.Tag.nondeterministic_seeded in torch.ops.fusegen.bias_gelu_dropout_add.default.tags
        assert torch.Tag.nondeterministic_seeded in torch.ops.fusegen.bias_dropout_add.default.tags
        assert torch.Tag.nondeterministic_seeded not in torch.ops.fusegen.gelu.default.tags
        return
    x = _randn(8, 36, device=device).abs().add_(1).requires_grad_(True)  # x + bias > 0: no zero is kept
    bias, residual = _randn(36, device=device, seed=1).abs(), _randn(8, 36, device=device, seed=2)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: bias_dropout_add.bias_dropout_add(*a, p=P), fullgraph=True)
    y = compiled(x, bias, residual)
    (grad,) = torch.autograd.grad(y.sum(), x)
    kept = (y - residual) != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(grad, kept.float() / (1 - P), rtol=0, atol=0)


def test_compiled_calls_draw_new_masks_and_manual_seed_replays_them(device):
    x, bias, residual = _randn(8, 36, device=device), _randn(36, device=device, seed=1), _randn(8, 36, device=device, seed=2)
    compiled = torch.compile(lambda *a: OPS["bias_gelu_dropout_add"](*a, p=P), fullgraph=True)
    torch.manual_seed(5)
    first = [compiled(x, bias, residual) for _ in range(3)]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    torch.manual_seed(5)
    assert all(torch.equal(a, compiled(x, bias, residual)) for a in first)
    # Eager draws its seeds with torch's RNG; Inductor lowers a graph's draw to its own RNG,
    # as it does torch's dropout, unless fallback_random asks for eager's.
    with torch._inductor.config.patch(fallback_random=True):
        torch._dynamo.reset()
        compiled = torch.compile(lambda *a: OPS["bias_gelu_dropout_add"](*a, p=P), fullgraph=True)
        torch.manual_seed(5)
        first = compiled(x, bias, residual)
    torch.manual_seed(5)
    assert torch.equal(OPS["bias_gelu_dropout_add"](x, bias, residual, p=P), first)


# ---------------------------------------------------------------------------
# CUDA graphs and torch.compile(mode="reduce-overhead") (GPU only)


def _graph_inputs(shape=(64, 1000)):
    x = _randn(*shape, device="cuda", seed=11).requires_grad_(True)
    residual = _randn(*shape, device="cuda", seed=12)
    bias = torch.zeros(shape[-1], device="cuda")
    grad_y = _randn(*shape, device="cuda", seed=13)
    return x, bias, residual, grad_y


def _check_masks(ys, x, residual, grads=None, grad_y=None):
    """Each output's mask: dropped at about p, different from every other's; with grads,
    the gradient is exactly grad_y * that output's mask (the identity: dy/dx = mask)."""
    masks = [_dropped(y, x.detach(), residual) for y in ys]
    for mask in masks:
        assert _within_sigmas(int(mask.sum()), mask.numel(), P)
    for i in range(len(masks)):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), f"calls {j} and {i} drew the same mask"
    if grads is not None:
        scale = runtime.dropout_scale(P)
        for mask, grad in zip(masks, grads):
            assert torch.equal(grad, torch.where(mask, 0.0, grad_y * scale))
    return masks


@pytest.mark.gpu
def test_eager_forward_backward_masks(device):
    x, bias, residual, grad_y = _graph_inputs()
    ys, grads = [], []
    torch.manual_seed(0)
    for _ in range(4):
        y = OPS["bias_gelu_dropout_add"](x, bias, residual, p=P)
        grads.append(torch.autograd.grad(y, (x,), grad_y)[0])
        ys.append(y.detach())
    masks = _check_masks(ys, x, residual, grads, grad_y)
    torch.manual_seed(0)
    assert torch.equal(_dropped(OPS["bias_gelu_dropout_add"](x, bias, residual, p=P), x.detach(), residual), masks[0])


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", sorted(GRAPH_OPS))
def test_cuda_graph_replays_draw_new_masks(op_name, device):
    """A captured forward + backward: each replay draws a new mask, its gradient is that
    replay's mask, and torch.manual_seed makes the replays repeat."""
    fn = GRAPH_OPS[op_name]
    x, bias, residual, grad_y = _graph_inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (tune, compile) outside the capture
        for _ in range(3):
            torch.autograd.grad(fn(x, bias, residual, p=P), (x,), grad_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(x, bias, residual, p=P)
        (gx,) = torch.autograd.grad(y, (x,), grad_y)
    # torch 2.11 fills the generator's graph seed and offset on the capture stream before
    # capture begins, unordered with a replay on another stream: on a busy GPU the first
    # replay after torch.manual_seed can then draw from the capture-time seed. Seen on the
    # H100 with torch's own F.dropout and a bare torch.randint as well (docs/benchmarks.md).
    torch.cuda.synchronize()

    def replays(count):
        ys, grads = [], []
        for _ in range(count):
            graph.replay()
            ys.append(y.detach().clone())
            grads.append(gx.clone())
        return ys, grads

    torch.manual_seed(1)
    ys, grads = replays(4)
    masks = _check_masks(ys, x, residual, grads, grad_y)
    torch.manual_seed(1)
    again, _ = replays(4)
    assert all(torch.equal(m, _dropped(a, x.detach(), residual)) for m, a in zip(masks, again))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_forward_backward_draw_new_masks(mode, device):
    x, bias, residual, grad_y = _graph_inputs()

    def step(x, bias, residual):
        return OPS["bias_gelu_dropout_add"](x, bias, residual, p=P)

    compiled = torch.compile(step, mode=mode, fullgraph=True)

    def run(count):
        ys, grads = [], []
        for _ in range(count):
            y = compiled(x, bias, residual)
            (gx,) = torch.autograd.grad(y, (x,), grad_y)
            ys.append(y.detach().clone())
            grads.append(gx.clone())
        return ys, grads

    run(3)  # warm up: under reduce-overhead the first calls record the graph
    torch.manual_seed(2)
    ys, grads = run(4)
    masks = _check_masks(ys, x, residual, grads, grad_y)
    torch.manual_seed(2)
    again, _ = run(4)
    assert all(torch.equal(m, _dropped(a, x.detach(), residual)) for m, a in zip(masks, again))


@pytest.mark.gpu
def test_reduce_overhead_forward_only(device):
    x, bias, residual, _ = _graph_inputs()
    with torch.no_grad():
        compiled = torch.compile(lambda *a: OPS["bias_dropout_add"](*a, p=P), mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            compiled(x, bias, residual)
        ys = [compiled(x, bias, residual).clone() for _ in range(4)]
    _check_masks(ys, x, residual)


@pytest.mark.gpu
def test_eager_seed_batches_stay_reproducible_and_distinct(device):
    """Eager CUDA calls take seeds from batches drawn ahead: across batch ends, with other
    random ops in between and after torch.manual_seed, the seeds are those of a fresh
    run, and a backward long after its forward still drops what its forward dropped."""
    x, bias, residual, grad_y = _graph_inputs((8, 64))
    count = runtime.dropout.SEED_BATCH + 20
    def last_seed():  # the call's seed, as the Python path or the C++ eager call took it
        drawn, taken = runtime.dropout.eager_seeds().standing(x.device.index)
        return drawn[taken - 1, :1].clone()

    def run():
        seeds, first = [], None
        for i in range(count):
            y = OPS["bias_gelu_dropout_add"](x, bias, residual, p=P)
            seeds.append(last_seed())
            if i == 0:
                first = y
            if i % 50 == 7:
                torch.rand(3, device="cuda")  # another random op moves the generator on
        (gx,) = torch.autograd.grad(first, (x,), grad_y)  # its seed was drawn `count` calls ago
        scale = runtime.dropout_scale(P)
        assert torch.equal(gx, torch.where(_dropped(first.detach(), x.detach(), residual), 0.0, grad_y * scale))
        return torch.cat(seeds)

    torch.manual_seed(3)
    seeds = run()
    assert seeds.unique().numel() == count
    torch.manual_seed(3)
    assert torch.equal(run(), seeds)
    torch.manual_seed(3)
    assert torch.equal(runtime.seed_tensor(None, x.device, eager=True), seeds[:1])
    # An explicit seed's tensor is kept, never written again.
    assert runtime.seed_tensor(5, x.device, eager=True) is runtime.seed_tensor(5, x.device, eager=True)


@pytest.mark.gpu
def test_eager_seeds_taken_from_threads_are_all_distinct(device):
    """Threads calling ops at once each get their own seed: none is handed out twice."""
    import threading

    count, threads = 200, 8
    taken: list[list[torch.Tensor]] = [[] for _ in range(threads)]
    device = torch.device("cuda", torch.cuda.current_device())

    def take(k: int) -> None:
        for _ in range(count):
            taken[k].append(runtime.seed_tensor(None, device, eager=True))

    workers = [threading.Thread(target=take, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seeds = torch.cat([t for per_thread in taken for t in per_thread])
    assert seeds.numel() == count * threads
    assert seeds.unique().numel() == count * threads
