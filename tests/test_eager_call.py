"""The eager call in C++ (fusegen/runtime/csrc/eager_call.cpp) against the Python path.

A call whose call key the Python path has launched once (same shapes, strides, dtypes, device,
alignment and params) is keyed, allocated and launched in C++. Its key must tell apart
every pair of calls the Python key (runtime.prepared.call_key) tells apart, and its launch
must pack each kernel parameter as Triton's own launcher does: both are checked here on
any machine. On a GPU every op's outputs and gradients through it are compared bit for bit
with the Python path's, under CUDA graphs too, and the calls it must leave to Python
(launch hooks, transforms, forward AD, out=, seeds Python checks) are checked to get there.
"""
from __future__ import annotations

import itertools
import struct
from types import SimpleNamespace

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from fusegen.backends.triton.cached_launcher import Binary, _packed
from fusegen.runtime import FusegenArgumentError
from fusegen.runtime.prepared import PreparedCall, call_key
from helpers import ShapeCase, all_ops, as_tuple, make_inputs, op_by_name, params_for, with_seed


@pytest.fixture
def calls_of(use_node):
    """`calls_of(op)`: the op's eager call in C++, with the extension in use for the test."""
    module = use_node("native")

    def make(fused):
        calls = fused.native_calls()
        assert calls is not None
        return calls

    make.module = module
    return make


# -- the key, on any machine ---------------------------------------------------------------


def _variants(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g).to(device)
    b = torch.randn(8, generator=g).to(device)
    r = torch.randn(4, 8, generator=g).to(device)
    wide = torch.randn(4, 16, generator=g).to(device)
    base = (x, b, r, 0.1, "gelu", True, None)

    def but(**changes):
        names = ["x", "bias", "residual", "p", "activation", "training", "seed"]
        return tuple(changes.get(name, value) for name, value in zip(names, base))

    return [
        base,
        but(x=torch.randn(4, 8, generator=g).to(device)),  # new data, the same call key
        but(seed=5), but(seed=7), but(seed=torch.tensor(3)),  # explicit seeds: one key (checked per call)
        but(p=0.2), but(p=1), but(p=True), but(training=False), but(training=1),
        but(activation="gelu_tanh"), but(activation="relu"), but(activation="gelu_tanh_but_longer"),
        but(x=x.t().contiguous().t()), but(x=x[1:], residual=r[1:]), but(x=wide[:, :8]), but(x=wide[:, 1:9]),
        but(x=x.double()), but(x=x.view(2, 2, 8), residual=r.view(2, 2, 8)), but(bias=b[None]),
        but(x=torch.nn.Parameter(x.clone())),
    ]


def test_the_key_tells_calls_apart_as_the_python_key_does(calls_of, device):
    fused = op_by_name("bias_gelu_dropout_add").module._OP
    calls = calls_of(fused)
    variants = _variants(device)
    python = [call_key(v, fused._n_inputs, fused._seed_position) for v in variants]
    native_keys = [calls_of.module.call_key(calls, v) for v in variants]
    assert all(k is not None for k in python + native_keys)
    for i, j in itertools.combinations(range(len(variants)), 2):
        assert (python[i] == python[j]) == (native_keys[i] == native_keys[j]), (i, j)
    assert native_keys[0] == native_keys[1] and native_keys[2] == native_keys[3] == native_keys[4]


def test_calls_it_does_not_take(calls_of, device):
    fused = op_by_name("bias_gelu").module._OP
    calls = calls_of(fused)
    x, b = torch.randn(4, 8, device=device), torch.randn(8, device=device)

    class Sub(torch.Tensor):
        pass

    for args in [(x.as_subclass(Sub), b, "gelu"), (x, b), (x, b, "gelu", 1), (x, b, 2**70), [x, b, "gelu"],
                 (x, b, torch.tensor(1.0)), (x.to_sparse(), b, "gelu")]:
        assert calls_of.module.call_key(calls, args) is None, args


def test_off_cuda_nothing_registers_and_calls_take_the_python_path(calls_of, device):
    """Off CUDA (the interpreter: no binary) nothing registers and every call takes the
    Python path; on a GPU the same calls stay right through the C++ path."""
    op = op_by_name("bias_gelu")
    calls = calls_of(op.module._OP)
    x, b = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    before = calls_of.module.counts(calls)
    for _ in range(3):
        torch.testing.assert_close(op.fn(x, b), op.reference(x, b))
    if device == "cpu":
        assert calls_of.module.counts(calls) == before == (0, 0, 0, 0)
        assert calls((x, b, "gelu"), False) is None


# -- how a launch is packed, on any machine --------------------------------------------------


def test_params_are_packed_as_tritons_launcher_packs_them():
    assert _packed("fp32", 0.1) == struct.unpack("<I", struct.pack("<f", 0.1))[0]
    assert _packed("fp64", 0.1) == struct.unpack("<Q", struct.pack("<d", 0.1))[0]
    assert _packed("fp16", 1.5) == struct.unpack("<H", struct.pack("<e", 1.5))[0]
    assert _packed("bf16", 1.0) == 0x3F80  # the fp32 bits' top half, as Triton truncates
    assert _packed("i32", -1) == 0xFFFFFFFF and _packed("i64", -2) == 2**64 - 2
    assert _packed("i1", True) == 1 and _packed("i1", False) == 0 and _packed("u64", 2**63) == 2**63
    assert _packed("i32", 7) == 7 and _packed("i64", 2**40) == 2**40
    assert _packed("fp32", 1e300) is None  # Triton's cast gives inf: left to Triton
    assert _packed("*fp32", 0) is None and _packed("i32", 1.5) is None and _packed("fp32", "x") is None


def _binary(signature: dict, tail: tuple, scratch: int = 0):
    """A Binary over a stand-in for Triton's CompiledKernel (the attributes it reads)."""
    run = SimpleNamespace(global_scratch_size=scratch, profile_scratch_size=0, launch=lambda *a: None,
                          launch_cooperative_grid=False, launch_pdl=False)
    compiled = SimpleNamespace(run=run, packed_metadata=(4, 1, 1024), function=0xABC,
                               src=SimpleNamespace(signature=signature))
    return Binary(compiled, (3, 2, 1), tail, 0)


def test_the_launch_form_skips_constexprs_and_fills_slots():
    signature = {"x_ptr": "*bf16", "y_ptr": "*bf16", "seed_ptr": "constexpr", "M": "i32", "N": "constexpr",
                 "p": "fp32", "HAS": "constexpr", "BLOCK": "constexpr"}
    args = ["X", "Y", None, 1000, 1, 0.25, True]
    form = _binary(signature, (64,)).native_form(args, {0: 0, 1: 3, 2: 5})
    assert form is not None
    function, grid, warps, ctas, shared, cooperative, pdl, params = form
    assert (function, grid, warps, ctas, shared, cooperative, pdl) == (0xABC, (3, 2, 1), 4, 1, 1024, False, False)
    assert params == [(0, 0), (3, 0), (-1, 1000), (-1, _packed("fp32", 0.25))]


def test_launches_it_does_not_make():
    signature = {"x_ptr": "*fp32", "M": "i32", "BLOCK": "constexpr"}
    assert _binary(signature, (64,), scratch=128).native_form(["X", 5], {0: 0}) is None  # scratch memory
    assert _binary(signature, (64,)).native_form(["X", 5], {0: 0, 1: 1}) is None  # a slot in a scalar
    assert _binary(signature, (64,)).native_form(["X", 5], {}) is None  # a fixed pointer
    assert _binary(signature, ()).native_form(["X", 5], {0: 0}) is None  # arguments short of the signature
    assert _binary({**signature, "t": ("i32", "i32")}, (64, (1, 2))).native_form(["X", 5], {0: 0}) is None


# -- where each gradient comes from, on any machine ----------------------------------------


def test_gradient_sources_say_where_each_gradient_comes_from():
    """What a registered backward assembles in C++: the kernel's gradients, an output's
    gradient passed through, one gradient shared by two inputs (computed once)."""
    x, r, w, b = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), torch.randn(8)
    bgda = op_by_name("bias_gelu_dropout_add").module._OP
    assert bgda.gradient_sources((True, True, True), (x, b, r)) == (
        [True, True, False], [("kernel",), ("kernel",), ("output", 0)])
    assert bgda.gradient_sources((False, False, True), (x, b, r)) == ([False, False, False], [None, None, ("output", 0)])
    add_rmsnorm = op_by_name("add_rmsnorm").module._OP
    assert add_rmsnorm.gradient_sources((True, True, True), (x, r, w)) == (
        [True, False, True], [("kernel",), ("input", 0), ("kernel",)])
    # Only one of the two asked for, or the two unlike: each is the kernel's own.
    assert add_rmsnorm.gradient_sources((False, True, False), (x, r, w)) == ([False, True, False], [None, ("kernel",), None])
    assert add_rmsnorm.gradient_sources((True, True, False), (x, r.double(), w)) == (
        [True, True, False], [("kernel",), ("kernel",), None])


# -- on a GPU -------------------------------------------------------------------------------

FULL = ShapeCase("eager", lead=(4, 33), n=256, layout="full")


def _step(op, seed_inputs: int, device, grad: bool = True):
    tensors = make_inputs(op, FULL, seed=seed_inputs, device=device)
    leaves = [t for t in tensors.values() if t.is_floating_point()]  # a class index has no gradient
    for t in leaves:
        t.requires_grad_(grad)
    kwargs = with_seed(op, params_for(op, p=0.3), seed=11, training=True)
    outputs = as_tuple(op.fn(*tensors.values(), **kwargs))
    differentiable = [o for o in outputs if o.requires_grad]  # none for a forward-only op (float8 q)
    if not grad or not differentiable:
        return [o.detach() for o in outputs]
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(o.shape, generator=g, dtype=o.dtype).to(device) for o in differentiable]
    torch.autograd.backward(differentiable, grads)
    return [o.detach() for o in outputs] + [t.grad for t in leaves]


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("op", all_ops(), ids=str)
def test_every_op_bit_for_bit_with_the_python_path(op, grad, calls_of, device, monkeypatch):
    fused = op.module._OP
    with monkeypatch.context() as patch:
        patch.setattr(PreparedCall, "offer_native", lambda self, args: None)
        python = [_step(op, s, device, grad) for s in (1, 2)]
    fused.forget_native_calls()
    _step(op, 1, device, grad)  # the Python path launches this call key once, then offers it
    calls = calls_of(fused)
    before = calls_of.module.counts(calls)
    assert before[0] == 1, "the call key was not registered"
    ours = [_step(op, s, device, grad) for s in (1, 2)]
    after = calls_of.module.counts(calls)
    assert after[1] == before[1] + 2  # both forwards took the C++ path
    if grad and not fused._forward_only and not any(i.one_per_row for i in fused.inputs) and fused.matmul is None:
        # No gradient summed by torch (a [..., 1] input's), no operands' matmuls (torch's, after
        # the g kernel: that backward stays in Python): the first call's backward (through
        # Python) registered its backward key, and both later ones ran in C++.
        assert after[2] == before[2] + 2
    for a, b in zip(python, ours):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.gpu
def test_dropout_seeds_taken_in_cpp_are_the_python_paths(calls_of, device, monkeypatch):
    """Without an explicit seed, a dropout call with a registered call key takes its seed from the
    standing batch in C++, which the Python path's calls take theirs from too, so its masks
    are the Python path's: across a batch's end, another random op in between and
    torch.manual_seed, and in the backward, which reads the forward's seed long after."""
    from fusegen.runtime.dropout import SEED_BATCH

    op = op_by_name("bias_gelu_dropout_add")
    fused = op.module._OP
    gen = torch.Generator().manual_seed(6)
    x, r = (torch.randn(16, 128, generator=gen).to(device) for _ in range(2))
    b = torch.randn(128, generator=gen).to(device)
    count = SEED_BATCH + 10

    def run():
        leaf = x.clone().requires_grad_(True)
        torch.manual_seed(5)
        outputs = []
        for i in range(count):
            outputs.append(op.fn(leaf, b, r, 0.3))
            if i == 3:
                torch.rand(3, device=device)  # moves the generator on: a new batch
        torch.stack(outputs).sum().backward()
        return torch.stack(outputs).detach(), leaf.grad

    with monkeypatch.context() as patch:
        patch.setattr(PreparedCall, "offer_native", lambda self, args: None)
        python = run()
    fused.forget_native_calls()
    op.fn(x.clone().requires_grad_(True), b, r, 0.3).sum().backward()  # registers the call key and its backward
    calls = calls_of(fused)
    before = calls_of.module.counts(calls)
    ours = run()
    after = calls_of.module.counts(calls)
    assert after[1] - before[1] == count and after[2] - before[2] == count
    assert after[3] - before[3] == count  # every seed taken by the eager call, new batches drawn there too
    assert torch.equal(python[0], ours[0]) and torch.equal(python[1], ours[1])
    assert len({tuple(o.flatten()[:64].tolist()) for o in ours[0]}) == count  # each call its own mask


@pytest.mark.gpu
def test_threads_take_seeds_in_cpp_and_python_without_sharing_one(calls_of, device):
    """Threads calling a dropout op with a registered call key at once (seeds taken in C++, under its lock;
    each thread's first call sets its driver context up) and one calling through the
    Python path (out=): every call drops its own elements."""
    import threading

    op = op_by_name("bias_gelu_dropout_add")
    fused = op.module._OP
    gen = torch.Generator().manual_seed(8)
    x, r = (torch.randn(8, 64, generator=gen).to(device) for _ in range(2))
    b = torch.zeros(64, device=device)
    op.fn(x, b, r, 0.3)  # launched and registered here: the threads only call
    calls = calls_of(fused)
    before = calls_of.module.counts(calls)
    count, threads = 100, 6
    dropped: list[list[torch.Tensor]] = [[] for _ in range(threads)]
    errors = []

    def call(k: int) -> None:
        try:
            for _ in range(count):
                if k == 0:
                    y = torch.empty_like(x)
                    op.fn(x, b, r, 0.3, out=y)  # the Python path
                else:
                    y = op.fn(x, b, r, 0.3)
                dropped[k].append((y == r).flatten())
        except Exception as error:  # raised in the main thread, below
            errors.append(error)

    workers = [threading.Thread(target=call, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    after = calls_of.module.counts(calls)
    assert after[1] - before[1] == count * (threads - 1)
    assert after[3] > before[3]  # seeds taken in C++
    masks = {tuple(m.tolist()) for per_thread in dropped for m in per_thread}
    assert len(masks) == count * threads


@pytest.mark.gpu
@pytest.mark.parametrize("name, shapes, wants, in_cpp", [
    # Nothing launched: the residual's gradient is the output's.
    ("bias_gelu_dropout_add", [(32, 128), (128,), (32, 128)], (False, False, True), True),
    ("add_rmsnorm", [(32, 128), (32, 128), (128,)], (True, True, True), True),  # x and residual share one
    ("add_rmsnorm", [(32, 128), (32, 128), (128,)], (False, True, False), True),  # one of the pair: the kernel's
    # A broadcast residual's gradient is summed by torch: the backward stays in Python.
    ("bias_dropout_add", [(32, 128), (128,), (1, 128)], (True, True, True), False),
], ids=["passthrough-only", "shared", "shared-one", "passthrough-summed"])
def test_backwards_assembled_in_cpp_match_the_python_path(name, shapes, wants, in_cpp, calls_of, device,
                                                          monkeypatch):
    op = op_by_name(name)
    fused = op.module._OP

    def step():
        g = torch.Generator().manual_seed(1)
        tensors = [torch.randn(s, generator=g).to(device).requires_grad_(w) for s, w in zip(shapes, wants)]
        outputs = as_tuple(op.fn(*tensors, **with_seed(op, params_for(op, p=0.3), seed=11, training=True)))
        grads = [torch.randn(o.shape, generator=g).to(device) for o in outputs]
        torch.autograd.backward(outputs, grads)
        return [o.detach() for o in outputs] + [t.grad for t in tensors if t.requires_grad]

    with monkeypatch.context() as patch:
        patch.setattr(PreparedCall, "offer_native", lambda self, args: None)
        python = step()
    fused.forget_native_calls()
    step()  # the Python path: registers the forward, then its backward
    calls = calls_of(fused)
    before = calls_of.module.counts(calls)
    ours = step()
    after = calls_of.module.counts(calls)
    assert after[1] == before[1] + 1
    assert after[2] == before[2] + in_cpp
    assert len(ours) == len(python)
    for a, b in zip(python, ours):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_graphs_capture_and_replay_it(calls_of, device):
    """Captured through the C++ path: an op without dropout replays its values; one with
    dropout and no seed draws a new mask on each replay, as the Python path does."""
    bgda, bg = op_by_name("bias_gelu_dropout_add").module, op_by_name("bias_gelu").module
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(64, 512, generator=g).to(device) for _ in range(2))
    b = torch.randn(512, generator=g).to(device)
    bgda.bias_gelu_dropout_add(x, b, r, 0.3)
    bg.bias_gelu(x, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture, as torch's docs ask
        bgda.bias_gelu_dropout_add(x, b, r, 0.3)
        bg.bias_gelu(x, b)
    torch.cuda.current_stream().wait_stream(side)
    counts = [calls_of.module.counts(calls_of(m._OP))[1] for m in (bgda, bg)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dropped = bgda.bias_gelu_dropout_add(x, b, r, 0.3)
        plain = bg.bias_gelu(x, b)
    assert [calls_of.module.counts(calls_of(m._OP))[1] for m in (bgda, bg)] == [c + 1 for c in counts]
    x.copy_(torch.randn(64, 512, generator=g).to(device))
    graph.replay()
    first = dropped.clone()
    torch.testing.assert_close(plain, bg.reference(x, b))
    graph.replay()
    assert not torch.equal(first, dropped)
    undropped = bgda.reference(x, b, r, 0.0)  # gelu(x + b) + r
    for out in (first, dropped.clone()):  # each a valid draw: kept elements scaled by 1 / (1 - p)
        kept = out != r
        torch.testing.assert_close(out[kept], ((undropped - r) / 0.7 + r)[kept], rtol=1e-4, atol=1e-5)
        assert 0.6 < kept.float().mean().item() < 0.8


class _Recording(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
def test_calls_left_to_the_python_path(calls_of, device):
    """A launch hook (a profiler), a dispatch mode, forward-mode AD, out=, an explicit seed
    without dropout and a bad seed: none of them goes through C++, each as before."""
    from triton import knobs

    op = op_by_name("bias_gelu")
    fused = op.module._OP
    g = torch.Generator().manual_seed(4)
    x, b = torch.randn(16, 64, generator=g).to(device), torch.randn(64, generator=g).to(device)
    op.fn(x, b)
    calls = calls_of(fused)
    module = calls_of.module

    def hits():
        return module.counts(calls)[1]

    start = hits()
    op.fn(x, b)
    assert hits() == start + 1
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        torch.testing.assert_close(op.fn(x, b), op.reference(x, b))
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert hits() == start + 1 and seen
    with _Recording() as mode:  # a dispatch mode sees the library op, as make_fx records it
        torch.testing.assert_close(op.fn(x, b), op.reference(x, b))
    assert any(str(f).startswith("fusegen.bias_gelu.") for f in mode.seen)
    for grad in (True, False):  # forward-mode AD runs the reference, tangent and all
        x.requires_grad_(grad)
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(op.fn(fwAD.make_dual(x, torch.ones_like(x)), b))
        assert tangent is not None
        torch.testing.assert_close(primal, op.reference(x.detach(), b))
    x.requires_grad_(False)
    out = torch.empty_like(x)
    op.fn(x, b, out=out)
    torch.testing.assert_close(out, op.reference(x, b))
    assert hits() == start + 1

    bda = op_by_name("bias_dropout_add")
    fused = bda.module._OP
    residual = torch.randn(16, 64, generator=g).to(device)
    bda.fn(x, b, residual, 0.3, training=False)
    calls = calls_of(fused)
    count = module.counts(calls)[1]
    torch.testing.assert_close(bda.fn(x, b, residual, 0.3, training=False, seed=5), x + b + residual)
    assert module.counts(calls)[1] == count  # an explicit seed without dropout: Python checks it
    with pytest.raises(FusegenArgumentError, match="seed"):
        bda.fn(x, b, residual, 0.3, training=False, seed=-1)  # checked though never read
    bda.fn(x, b, residual, 0.3, seed=5)
    with pytest.raises(FusegenArgumentError, match="seed"):
        bda.fn(x, b, residual, 0.3, seed=-1)  # with dropout: the C++ path asks Python, which checks it
    assert module.counts(calls)[1] == count + 1


@pytest.mark.gpu
def test_a_call_through_cpp_keeps_no_tensor_alive(calls_of, device):
    """Once a call and its backward are done, nothing of theirs stays alive in C++: not its
    inputs (a thread-local key once held the last call's), outputs or gradients."""
    import gc
    import weakref

    op = op_by_name("layernorm")
    fused = op.module._OP
    probes = []
    for _ in range(2):  # the second through C++
        x = torch.randn(3, 16, device=device, requires_grad=True)
        weight, bias = torch.randn(16, device=device), torch.randn(16, device=device)
        y = op.fn(x, weight, bias)
        y.sum().backward()
        probes = [weakref.ref(t) for t in (x, weight, bias, y, x.grad)]
        del x, weight, bias, y
    assert calls_of.module.counts(calls_of(fused))[1] >= 1
    gc.collect()
    assert all(probe() is None for probe in probes)


@pytest.mark.gpu
def test_a_forgotten_call_key_is_freed(calls_of, device):
    """The plan in C++ holds its PreparedCall, which holds the plan only weakly: once the op
    forgets its call keys (as a full cache does), nothing keeps either alive."""
    import gc
    import weakref

    op = op_by_name("bias_gelu")
    fused = op.module._OP
    x = torch.randn(8, 64, device=device, requires_grad=True)
    b = torch.randn(64, device=device, requires_grad=True)
    op.fn(x, b).sum().backward()  # registers the forward and its backward
    assert calls_of.module.counts(calls_of(fused))[0] == 1
    prepared = weakref.ref(next(iter(fused._prepared.values())))
    fused.forget_native_calls()
    gc.collect()
    assert prepared() is None
