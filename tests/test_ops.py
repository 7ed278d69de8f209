"""Every generated op (one per specs/*.yaml) against its own `reference`, run in float64.

Forward: values, shapes, dtypes, layouts, empty tensors and the no-dropout paths.
Backward: gradients against autograd through `reference`, gradcheck, double backward,
determinism, and dropout masks drawn again in backward under other tile shapes.
Shapes stay small: without a GPU the kernels run on Triton's CPU interpreter.
"""
from __future__ import annotations


import pytest
import torch

from fusegen import runtime
from fusegen.runtime import FusegenArgumentError
from fusegen.backends.triton import interpreter, row_launch, tuning

from tests.helpers import (
    LOW_PRECISION,
    ROOT,
    Poison,
    ShapeCase,
    all_ops,
    applies,
    as_tuple,
    broken_specs,
    check_against_truth,
    choice_cases,
    choice_id,
    expected_out_dtype,
    float64_copies,
    call_of,
    launch_backward,
    launch_forward,
    make_inputs,
    non_contiguous,
    op_by_name,
    output_shape,
    output_shapes,
    params_for,
    with_seed,
)

# Ops with outputs in a dtype of their own (float8: quantized, forward only, so no backward
# to test) are held to that dtype's precision against float64, and their shapes, in
# test_language_output_dtypes.py.
OPS = tuple(op for op in all_ops() if not op.own_dtypes)
DROPOUT_OPS = [op for op in OPS if op.has_dropout]
SEED = 20240611
P = 0.3  # dropout probability where dropout is on

# Forward shapes (numel <= ~4k): 1-D, 3-D, M = 1, N in {1, 17, 1000}.
SHAPE_3D = ShapeCase("3d", lead=(2, 3), n=17)
SHAPE_3D_BCAST = ShapeCase("3d-bcast", lead=(2, 3), n=17, layout="bcast")
SHAPE_TALL = ShapeCase("tall", lead=(300,), n=3, other=2)  # several row tiles / backward programs
FORWARD_SHAPES = [
    ShapeCase("1d", lead=(), n=17),
    SHAPE_3D,
    ShapeCase("m1-n1000", lead=(1,), n=1000, other=1),
    ShapeCase("n1", lead=(7,), n=1),
    ShapeCase("m1-n1", lead=(1,), n=1, other=1),
    ShapeCase("n1000", lead=(2,), n=1000, other=2),
    SHAPE_3D_BCAST,
    SHAPE_TALL,
    ShapeCase("0d", lead=(), n=None),  # only for specs whose output is all '...'
]
# "tall" for a row op: a row program takes at most 16 rows (forward, and backward below
# 16384 rows), so 40 rows are three programs, the last one partly masked (300 would be 19,
# each a Python step on the interpreter, where a pointwise program takes up to 256 rows: 300
# rows are two of those).
SHAPE_TALL_ROWS = ShapeCase("tall", lead=(40,), n=3, other=2)


def _is_row_op(op) -> bool:
    """Of the row kind: its kernels (programs that own whole rows) are row_launch's."""
    return type(op.module._OP.kernels).__module__ == row_launch.__name__


def _for_op(op, case):
    """The case as `op` runs it: "tall" is SHAPE_TALL_ROWS for a row op."""
    return SHAPE_TALL_ROWS if case is SHAPE_TALL and _is_row_op(op) else case


EMPTY_SHAPES = [
    ShapeCase("m0", lead=(0,), n=5, other=0),
    ShapeCase("n0", lead=(3,), n=0),
    ShapeCase("3d-m0", lead=(2, 0), n=4, other=0),
]


def _ids(op, choices=None, case=None, *rest):
    parts = [op.name]
    if choices is not None:
        parts.append(choice_id(choices))
    if case is not None:
        parts.append(case.id)
    return "-".join(parts + [str(r) for r in rest])


def _kwargs(op, p=P, choices=None, seed=SEED, training=None):
    params = params_for(op, choices, p=p)
    return params, with_seed(op, params, seed=seed, training=training)


def _run(fn, tensors, kwargs):
    return as_tuple(fn(**tensors, **kwargs))


def _truth(op, tensors, kwargs, requires_grad=None):
    copies = float64_copies(tensors, requires_grad)
    return copies, _run(op.reference, copies, kwargs)


# Every choice on the 3-D shape, and every shape with default choices.
FORWARD_CASES = [(op, c, SHAPE_3D) for op in OPS for c in choice_cases(op)] + [
    (op, {}, _for_op(op, case)) for op in OPS for case in FORWARD_SHAPES
    if case is not SHAPE_3D and applies(op.spec, _for_op(op, case))
]


def test_every_spec_loads():
    """A spec that fails to load (or whose module is missing) is otherwise silently untested."""
    assert OPS, "no spec found in specs/"
    assert not broken_specs(), "\n".join(f"{f}: {e}" for f, e in broken_specs())


# ---------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("op,choices,case", FORWARD_CASES, ids=[_ids(*c) for c in FORWARD_CASES])
def test_forward_fp32(op, choices, case, device, monkeypatch):
    tensors = make_inputs(op, case, torch.float32, device)
    params, kwargs = _kwargs(op, choices=choices)
    before = {n: t.clone() for n, t in tensors.items()}
    poison = Poison().install(monkeypatch)
    outs = _run(op.fn, tensors, kwargs)
    monkeypatch.undo()
    for name, t in tensors.items():
        assert torch.equal(t, before[name]), f"{op.name} wrote into its input {name}"
    assert poison.count >= len(op.output_names), "the launcher no longer allocates its outputs with torch.empty"
    _, truths = _truth(op, tensors, kwargs)
    assert len(outs) == len(op.output_names)
    for name, out, truth, shape in zip(op.output_names, outs, truths, output_shapes(op.spec, case)):
        assert out.shape == truth.shape == shape, f"{op.name}.{name}: shape {tuple(out.shape)}, want {shape}"
        assert out.dtype == torch.float32 and out.device.type == torch.device(device).type
        assert out.is_contiguous()
        check_against_truth(out, truth, what=f"{op.name}.{name}")


LOW_PRECISION_CASES = [(op, c, dt) for op in OPS for c in choice_cases(op) for dt in LOW_PRECISION]


@pytest.mark.parametrize(
    "op,choices,dtype", LOW_PRECISION_CASES, ids=[_ids(op, c, None, str(dt)[6:]) for op, c, dt in LOW_PRECISION_CASES]
)
def test_forward_low_precision(op, choices, dtype, device):
    case = ShapeCase("8x129", lead=(8,), n=129)
    tensors = make_inputs(op, case, dtype, device)
    params, kwargs = _kwargs(op, choices=choices)
    outs = _run(op.fn, tensors, kwargs)
    low = _run(op.reference, tensors, kwargs)
    _, truths = _truth(op, tensors, kwargs)
    for name, out, ref, truth in zip(op.output_names, outs, low, truths):
        assert out.dtype == dtype == ref.dtype
        check_against_truth(out, truth, ref, what=f"{op.name}.{name} {dtype}")


def _mixed_dtype_cases():
    cases = []
    for op in OPS:
        names = op.float_input_names
        cases.append((op, {}, torch.float64, "fp64"))
        if len(names) >= 2:
            cases.append((op, {names[0]: torch.bfloat16}, torch.float32, "bf16+fp32"))
            cases.append((op, {names[0]: torch.float16, names[1]: torch.bfloat16}, torch.float16, "fp16+bf16"))
            cases.append((op, {names[-1]: torch.float64}, torch.float32, "fp32+fp64"))
    # fp64 with a float param: the launcher rounds params to float32, as a GPU launch does,
    # so the interpreter agrees with reference there too.
    return [pytest.param(*c, id=f"{c[0].name}-{c[3]}") for c in cases]


MIXED_CASES = _mixed_dtype_cases()


@pytest.mark.parametrize("op,dtypes,rest,label", MIXED_CASES)
def test_forward_mixed_dtypes(op, dtypes, rest, label, device):
    tensors = make_inputs(op, SHAPE_3D, rest, device, dtypes=dtypes)
    params, kwargs = _kwargs(op)
    outs = _run(op.fn, tensors, kwargs)
    _, truths = _truth(op, tensors, kwargs)
    want = expected_out_dtype(tensors)
    for name, out, truth in zip(op.output_names, outs, truths):
        assert out.dtype == want, f"{op.name}.{name}: dtype {out.dtype}, torch.promote_types gives {want}"
        # Every input converts exactly to the compute dtype: the result is as good as fp32's.
        check_against_truth(out, truth, what=f"{op.name}.{name} {label}")


@pytest.mark.parametrize("kind", ["transposed", "sliced", "expanded"])
@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_forward_non_contiguous(op, kind, device):
    case = ShapeCase("4x3x10", lead=(4, 3), n=10)
    g = torch.Generator().manual_seed(7)
    tensors = {n: non_contiguous(t, kind, g) for n, t in make_inputs(op, case, torch.float32, device).items()}
    if kind != "expanded":
        assert any(not t.is_contiguous() for t in tensors.values())
    params, kwargs = _kwargs(op)
    outs = _run(op.fn, tensors, kwargs)
    dense = _run(op.fn, {n: t.contiguous() for n, t in tensors.items()}, kwargs)
    _, truths = _truth(op, tensors, kwargs)
    # Elementwise: the layout of the inputs must not change a single bit on the interpreter.
    # Compiled for a GPU, each layout is its own specialisation (stride 1 or not, aligned or
    # not), and LLVM may fuse a multiply-add into an FMA in one and not the other.
    # (Measured on an H100: scale_add differs by 2.4e-7 absolute, both sides within 1.5e-7
    # of the float64 truth.) An FMA rounds once where mul + add round twice: the difference
    # is an ulp of the product, so it is bounded relative to the output's scale.
    eps = 0.0 if interpreter.is_interpreting() else 4 * torch.finfo(torch.float32).eps
    for name, out, d, truth in zip(op.output_names, outs, dense, truths):
        atol = eps * max(d.abs().max().item(), 1.0) if d.numel() else 0.0
        torch.testing.assert_close(out, d, rtol=eps, atol=atol, msg=f"{op.name}.{name}: {kind} != contiguous")
        check_against_truth(out, truth, what=f"{op.name}.{name} {kind}")


@pytest.mark.parametrize("case", EMPTY_SHAPES, ids=[c.id for c in EMPTY_SHAPES])
@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_empty(op, case, device):
    tensors = make_inputs(op, case, torch.float32, device)
    shapes = output_shapes(op.spec, case)
    assert 0 in output_shape(op.spec, case)
    params, kwargs = _kwargs(op)
    if case.n == 0 and shapes != [output_shape(op.spec, case)] * len(shapes):
        # One value per row of an empty row (a log-sum-exp of nothing) is refused, in one line.
        with pytest.raises(FusegenArgumentError, match="the last dim is empty, and an output with one value per row"):
            _run(op.fn, tensors, kwargs)
        return
    outs = _run(op.fn, tensors, kwargs)
    for out, ref, shape in zip(outs, _run(op.reference, tensors, kwargs), shapes):
        assert out.shape == ref.shape == shape and out.numel() == 0 and out.dtype == torch.float32
    # Backward too: every gradient has its input's shape; broadcast inputs get zeros.
    leaves = {n: t.clone().requires_grad_(t.is_floating_point()) for n, t in tensors.items()}
    outs = _run(op.fn, leaves, kwargs)
    wanted = {n: leaves[n] for n in op.float_input_names}
    grads = torch.autograd.grad(outs, list(wanted.values()), [torch.ones_like(o) for o in outs], allow_unused=True)
    for (name, leaf), grad in zip(wanted.items(), grads):
        assert grad is not None and grad.shape == leaf.shape and grad.dtype == leaf.dtype, name
        assert (grad == 0).all(), f"{op.name}: gradient of {name} of an empty output is not zero"


@pytest.mark.parametrize("op", DROPOUT_OPS, ids=[op.name for op in DROPOUT_OPS])
def test_no_dropout_paths(op, device):
    """training=False, and p = 0, take the kernel with no random numbers: same bits, no RNG use."""
    tensors = make_inputs(op, SHAPE_3D, torch.float32, device)
    params_p0 = params_for(op, p=0.0)
    params_p = params_for(op, p=P)
    state = torch.get_rng_state()
    p0 = _run(op.fn, tensors, with_seed(op, params_p0))  # seed=None: nothing to draw
    off = _run(op.fn, tensors, with_seed(op, params_p, training=False))  # seed=None, p > 0
    off_seeded = _run(op.fn, tensors, with_seed(op, params_p, training=False, seed=SEED))
    ref_off = _run(op.reference, tensors, with_seed(op, params_p, training=False))
    assert torch.equal(torch.get_rng_state(), state), "a run with no dropout drew from torch's generator"
    _, truths = _truth(op, tensors, with_seed(op, params_p0))
    for name, a, b, c, r, truth in zip(op.output_names, p0, off, off_seeded, ref_off, truths):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"{op.name}.{name}: training=False != p=0")
        torch.testing.assert_close(c, a, rtol=0, atol=0, msg=f"{op.name}.{name}: training=False ignores seed")
        check_against_truth(a, truth, what=f"{op.name}.{name} p=0")
        check_against_truth(r, truth, what=f"{op.name}.{name} reference training=False")
    # With dropout on, the output does depend on the draw.
    on = _run(op.fn, tensors, with_seed(op, params_p, seed=SEED))
    assert any(not torch.equal(a, b) for a, b in zip(on, p0))
    # The backward follows the forward: no dropout in it either.
    needs = {n: n in op.float_input_names for n in op.input_names}
    grads_p0, grad_outs = _gradients(op, tensors, with_seed(op, params_p0), needs)
    grads_off, _ = _gradients(op, tensors, with_seed(op, params_p, training=False), needs, grad_outs)
    for name in grads_p0:
        assert torch.equal(grads_off[name], grads_p0[name]), f"{op.name}: grad {name} with training=False != p=0"


# ---------------------------------------------------------------------------
# Backward


def _grad_outputs(outs, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype).to(o.device) for o in outs]


def _gradients(op, tensors, kwargs, needs, grad_outs=None, fn=None):
    leaves = {n: t.detach().clone().requires_grad_(needs[n]) for n, t in tensors.items()}
    outs = _run(fn or op.fn, leaves, kwargs)
    grad_outs = grad_outs if grad_outs is not None else _grad_outputs(outs)
    wanted = [leaves[n] for n in op.input_names if needs[n]]
    grads = torch.autograd.grad(outs, wanted, grad_outs, allow_unused=True)
    return dict(zip([n for n in op.input_names if needs[n]], grads)), grad_outs


def _truth_gradients(op, tensors, kwargs, needs, grad_outs):
    copies = float64_copies(tensors, needs)
    outs = _run(op.reference, copies, kwargs)
    wanted = [copies[n] for n in op.input_names if needs[n]]
    # An output that none of the wanted inputs reaches (add_rmsnorm's h, for its weight) has no graph.
    pairs = [(o, g.to(torch.float64)) for o, g in zip(outs, grad_outs) if o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    return {n: (torch.zeros_like(copies[n]) if g is None else g) for n, g in zip([n for n in op.input_names if needs[n]], grads)}


def _check_gradients(op, tensors, got, truth, low=None, what=""):
    for name, grad in got.items():
        t = tensors[name]
        assert grad is not None, f"{what}: no gradient for {name}"
        assert grad.shape == t.shape, f"{what}: grad {name} shape {tuple(grad.shape)} != {tuple(t.shape)}"
        assert grad.dtype == t.dtype, f"{what}: grad {name} dtype {grad.dtype} != {t.dtype}"
        check_against_truth(grad, truth[name], None if low is None else low[name], what=f"{what} grad {name}")


BACKWARD_CASES = (
    [(op, c, SHAPE_3D_BCAST, P) for op in OPS for c in choice_cases(op)]
    + [(op, {}, SHAPE_3D, 0.0) for op in OPS]
    + [(op, {}, _for_op(op, case), P) for op in OPS for case in (
        ShapeCase("1d", lead=(), n=17), SHAPE_TALL, ShapeCase("m1-n1000", lead=(1,), n=1000, other=1))]
)


@pytest.mark.parametrize(
    "op,choices,case,p", BACKWARD_CASES, ids=[_ids(op, c, s, f"p={p}") for op, c, s, p in BACKWARD_CASES]
)
def test_backward_fp32(op, choices, case, p, device, monkeypatch):
    tensors = make_inputs(op, case, torch.float32, device)
    params, kwargs = _kwargs(op, p=p, choices=choices)
    needs = {n: n in op.float_input_names for n in op.input_names}
    Poison().install(monkeypatch)  # gradient buffers, partial sums included, start as NaN
    got, grad_outs = _gradients(op, tensors, kwargs, needs)
    monkeypatch.undo()
    truth = _truth_gradients(op, tensors, kwargs, needs, grad_outs)
    _check_gradients(op, tensors, got, truth, what=f"{op.name} {choice_id(choices)} {case.id} p={p}")


BACKWARD_LOW_CASES = [(op, c, torch.bfloat16) for op in OPS for c in choice_cases(op)] + [
    (op, {}, torch.float16) for op in OPS
]


@pytest.mark.parametrize(
    "op,choices,dtype", BACKWARD_LOW_CASES, ids=[_ids(op, c, None, str(dt)[6:]) for op, c, dt in BACKWARD_LOW_CASES]
)
def test_backward_low_precision(op, choices, dtype, device):
    case = ShapeCase("3d-bcast", lead=(4, 5), n=33, layout="bcast")
    tensors = make_inputs(op, case, dtype, device)
    params, kwargs = _kwargs(op, choices=choices)
    needs = {n: n in op.float_input_names for n in op.input_names}
    got, grad_outs = _gradients(op, tensors, kwargs, needs)
    # Against reference's error (the compute dtype throughout, rounded once); an op with a
    # hidden layer rounds its layer's gradient to the dtype before the matmuls of its
    # operands, as PyTorch's own layers do: against PyTorch's error in the dtype (its eager twin).
    hidden = op.module._OP.matmul is not None and op.module._OP.matmul.hidden is not None
    low, _ = _gradients(op, tensors, kwargs, needs, grad_outs, fn=op.module.eager if hidden else op.reference)
    truth = _truth_gradients(op, tensors, kwargs, needs, grad_outs)
    _check_gradients(op, tensors, got, truth, low, what=f"{op.name} {choice_id(choices)} {dtype}")


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_backward_mixed_dtypes(op, device):
    """bf16 first input, fp32 others: each gradient in its input's dtype, as good as reference's."""
    first = op.input_names[0]
    tensors = make_inputs(op, SHAPE_3D, torch.float32, device, dtypes={first: torch.bfloat16})
    params, kwargs = _kwargs(op)
    needs = {n: n in op.float_input_names for n in op.input_names}
    got, grad_outs = _gradients(op, tensors, kwargs, needs)
    low, _ = _gradients(op, tensors, kwargs, needs, grad_outs, fn=op.reference)
    truth = _truth_gradients(op, tensors, kwargs, needs, grad_outs)
    _check_gradients(op, tensors, got, truth, low, what=f"{op.name} mixed")


SUBSET_CASES = [(op, name) for op in OPS for name in op.float_input_names]


@pytest.mark.parametrize("op,only", SUBSET_CASES, ids=[f"{op.name}-only-{n}" for op, n in SUBSET_CASES])
def test_backward_some_inputs(op, only, device):
    tensors = make_inputs(op, SHAPE_3D_BCAST, torch.float32, device)
    params, kwargs = _kwargs(op)
    needs = {n: n == only for n in op.input_names}
    got, grad_outs = _gradients(op, tensors, kwargs, needs)
    assert set(got) == {only}
    truth = _truth_gradients(op, tensors, kwargs, needs, grad_outs)
    _check_gradients(op, tensors, got, truth, what=f"{op.name} only {only}")


@pytest.mark.parametrize("kind", ["transposed", "sliced", "expanded"])
@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_backward_non_contiguous(op, kind, device):
    """Non-contiguous inputs (views of leaves) and a non-contiguous incoming gradient."""
    case = ShapeCase("4x3x10", lead=(4, 3), n=10)
    g = torch.Generator().manual_seed(8)
    views = {n: non_contiguous(t, kind, g) for n, t in make_inputs(op, case, torch.float32, device).items()}
    params, kwargs = _kwargs(op)
    # Leaves are the views' bases: autograd maps the gradient back through the view.
    bases = {n: (v._base if v._base is not None else v).detach().clone().requires_grad_(v.is_floating_point())
             for n, v in views.items()}
    leaves = {n: bases[n].as_strided(v.shape, v.stride(), v.storage_offset()) for n, v in views.items()}
    outs = _run(op.fn, leaves, kwargs)
    grad_outs = [non_contiguous(o, kind, g) for o in outs]
    names = op.float_input_names
    got = torch.autograd.grad(outs, [bases[n] for n in names], grad_outs)

    bases64 = {n: b.detach().double().requires_grad_(True) if n in names else b for n, b in bases.items()}
    leaves64 = {n: bases64[n].as_strided(v.shape, v.stride(), v.storage_offset()) for n, v in views.items()}
    truth_outs = _run(op.reference, leaves64, kwargs)
    truth = torch.autograd.grad(truth_outs, [bases64[n] for n in names], [g.double() for g in grad_outs])
    scale = max(torch.linalg.vector_norm(g.double()).item() for g in grad_outs)
    for name, grad, want in zip(names, got, truth):
        if kind == "expanded" and bases[name].numel() < views[name].numel() and op.module._OP.statistics:
            # A row op's gradient summed over the expanded dims, where terms cancel (a [N] input
            # expanded from one number shifts every row of a layer norm by a constant: exactly 0
            # but for rounding): the error is bounded by the terms' scale, not the sum's.
            # Pointwise ops keep the relative check.
            error = torch.linalg.vector_norm(grad.double() - want).item()
            bound = 1e-5 * (torch.linalg.vector_norm(want).item() + scale)
            assert error <= bound, f"{op.name} {kind} grad {name}: error {error:.3g} > {bound:.3g}"
            continue
        check_against_truth(grad, want, what=f"{op.name} {kind} grad {name}")


GRADCHECK_CASES = [(op, c) for op in OPS for c in choice_cases(op)]


@pytest.mark.parametrize("op,choices", GRADCHECK_CASES, ids=[_ids(op, c) for op, c in GRADCHECK_CASES])
def test_gradcheck_fp64(op, choices, device):
    # Each output element costs gradcheck two backward launches (it checks reentrance too):
    # rows of 2, of 3 for a row op (a layer norm of 2 is ±1 whatever its inputs); N % 4 != 0
    # either way (dropout's per-element path); two rows, so that an [N] input's gradient is
    # summed over rows.
    case = ShapeCase("tiny", lead=(2,), n=3 if _is_row_op(op) else 2, other=2, layout="bcast")
    tensors = make_inputs(op, case, torch.float64, device, seed=11)
    params, kwargs = _kwargs(op, choices=choices)
    names = op.float_input_names  # integer inputs are held fixed
    leaves = [tensors[n].clone().requires_grad_(True) for n in names]

    def f(*inputs):
        return _run(op.fn, {**tensors, **dict(zip(names, inputs))}, kwargs)

    # The default choice in full; the others in fast mode (one random projection).
    default = not choices or all(
        p.default == choices.get(p.name, p.default) for p in op.spec.choice_params
    )
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=not default)


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_double_backward_raises(op, device):
    tensors = make_inputs(op, SHAPE_3D, torch.float64, device)
    params, kwargs = _kwargs(op)
    leaves = {n: t.clone().requires_grad_(t.is_floating_point()) for n, t in tensors.items()}
    wanted = [leaves[n] for n in op.float_input_names]
    outs = _run(op.fn, leaves, kwargs)
    grads = torch.autograd.grad(outs, wanted, _grad_outputs(outs), create_graph=True, allow_unused=True)
    # Gradients the kernel computes depend on the inputs through the backward op.
    kernel_grads = [g for g in grads if g is not None and g.requires_grad and g.grad_fn is not None]
    if not kernel_grads:
        pytest.skip("no gradient depends on the inputs")
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(sum(g.sum() for g in kernel_grads), wanted, allow_unused=True)


def _import_as(path, module_name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _double_backward(fn, device):
    x = torch.randn(2, 3, 8, dtype=torch.float64, device=device, requires_grad=True)
    (gx,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    torch.autograd.grad(gx.sum(), x)


def test_one_module_under_two_names_shares_its_library_ops(tmp_path, device):
    """generated.<op> and fusegen.ops.<op> are one file: the second import must not register
    fusegen::<op> again, which would leave the first module's op calling a dispatcher entry
    torch has freed (a crashed process, or another op called: an xdist worker died in
    test_double_backward_raises, after fusegen.integrations.kernels_layers imported its ops)."""
    text = (ROOT / "generated" / "quick_gelu.py").read_text(encoding="utf-8").replace("quick_gelu", "quick_gelu_twice")
    (tmp_path / "quick_gelu_twice.py").write_text(text, encoding="utf-8")
    first = _import_as(tmp_path / "quick_gelu_twice.py", "quick_gelu_twice")
    second = _import_as(tmp_path / "quick_gelu_twice.py", "again.quick_gelu_twice")
    assert second._OP is not first._OP
    assert second._OP._forward_op is first._OP._forward_op and second._OP._backward_op is first._OP._backward_op
    for module in (first, second):
        with pytest.raises(RuntimeError, match="fusegen::quick_gelu_twice: double backward is not supported"):
            _double_backward(module.quick_gelu_twice, device)


def test_an_op_registered_again_with_other_code_refuses_in_one_line(tmp_path, device):
    """An op rebuilt and imported again under its name: torch keeps the new registration only,
    and the earlier module's op says so where it would call the dropped one."""
    text = (ROOT / "generated" / "quick_gelu.py").read_text(encoding="utf-8").replace("quick_gelu", "quick_gelu_edited")
    (tmp_path / "old.py").write_text(text, encoding="utf-8")
    (tmp_path / "new.py").write_text(text + "# rebuilt\n", encoding="utf-8")
    old = _import_as(tmp_path / "old.py", "old_quick_gelu_edited")
    new = _import_as(tmp_path / "new.py", "new_quick_gelu_edited")
    with pytest.raises(RuntimeError, match=r"^fusegen::quick_gelu_edited: this op \(from old_quick_gelu_edited\) was "
                                           r"registered again by new_quick_gelu_edited"):
        _double_backward(old.quick_gelu_edited, device)
    with pytest.raises(RuntimeError, match="fusegen::quick_gelu_edited: double backward is not supported"):
        _double_backward(new.quick_gelu_edited, device)
    x = torch.randn(2, 8, dtype=torch.float64, device=device)
    torch.testing.assert_close(old.quick_gelu_edited(x), new.reference(x))  # eager calls need no library op


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_backward_deterministic(op, device):
    """Two backward runs give the same bits, row-broadcast (summed) gradients included (a
    pointwise op's 300 rows: two programs' partial sums under the interpreter, 256 rows each;
    a row op's 40: three programs' of 16 rows, as SHAPE_TALL_ROWS)."""
    case = ShapeCase("tall-bcast", lead=(40,) if _is_row_op(op) else (300,), n=5, other=2, layout="bcast")
    tensors = make_inputs(op, case, torch.float32, device)
    params, kwargs = _kwargs(op)
    needs = {n: n in op.float_input_names for n in op.input_names}
    first, grad_outs = _gradients(op, tensors, kwargs, needs)
    second, _ = _gradients(op, tensors, kwargs, needs, grad_outs)
    for name in first:
        assert torch.equal(first[name], second[name]), f"{op.name}: grad {name} differs between two runs"


# ---------------------------------------------------------------------------
# Dropout masks across tile shapes, kernels launched directly


def _small(configs, limit=2048):
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= limit]


DROPOUT_ROWS = 13  # test_dropout_masks_independent_of_tiles's problem: 13 rows of 20 or 22


def _one_of_each_path(tiles):
    """The tiles, but under the interpreter only the first of each path through the problem,
    which is all a tile's shape decides there: a program of one row, of some of the rows (the
    last program partly masked) or of all of them (BLOCK_M), and a column tile of that many
    columns, narrower than the row (BLOCK_N: its groups of four), or of the whole row, masked.
    Compiled for a GPU each tile is a kernel of its own: all of them run there."""
    if not interpreter.is_interpreting():
        return tiles
    kept = {}
    for block_m, block_n in tiles:
        rows = "one" if block_m == 1 else "some" if block_m < DROPOUT_ROWS else "all"
        kept.setdefault((rows, block_n if block_n < 20 else "whole"), (block_m, block_n))
    return sorted(kept.values())


def _rows_per_program(block_m: int) -> list[int]:
    """The backward's rows per program: 16 (the runtime's fewest; all 13 rows in one program)
    and twice that. Under the interpreter the second only for BLOCK_M = 16, where it is the one
    that loops; narrower tiles loop over the same rows either way."""
    rows = sorted({max(16, block_m), 2 * max(16, block_m)})
    return rows if block_m >= 16 or not interpreter.is_interpreting() else rows[:1]


FORWARD_TILES = _one_of_each_path(sorted(set(_small(tuning.FORWARD_CONFIGS) + [(2, 16), (8, 8)])))
BACKWARD_TILES = _one_of_each_path(sorted(set(_small(tuning.BACKWARD_CONFIGS) + [(2, 16), (8, 8)])))
# Row kernels: looped along a row of 20 or 22 (two programs of 8 rows forward, two steps of 8
# in the backward's 16), and one tile.
ROW_TILES = [(8, 8), (4, 32)]


@pytest.mark.parametrize("n", [20, 22], ids=["n%4=0", "n%4=2"])
@pytest.mark.parametrize("op", DROPOUT_OPS, ids=[op.name for op in DROPOUT_OPS])
def test_dropout_masks_independent_of_tiles(op, n, device):
    """The forward draws the same masks under every tile shape, and the backward, launched with
    other tiles than the forward, draws them again: gradients vanish exactly where it dropped.
    With N % 4 != 0 groups of four straddle rows (the kernel's per-element path). (Under the
    interpreter, one tile shape of each path through the problem: _one_of_each_path.)"""
    # Small, so that 2048-element tiles stay cheap on the interpreter; still several
    # programs along both dims for the mid-sized tiles.
    case = ShapeCase(f"{DROPOUT_ROWS}x{n}", lead=(DROPOUT_ROWS,), n=n, other=2, layout="bcast")
    tensors = make_inputs(op, case, torch.float32, device)
    params = params_for(op, p=0.5)
    seed = 2**33 + 12345  # above 32 bits: both halves of the Philox key matter

    # A row op's tile decides only whether a row is one tile or a loop, which sums in another
    # order: the same masks (the same zeros), values equal up to that rounding; as a matmul's
    # tile may sum K in another order.
    rows_op = op.module._OP.statistics > 0 or op.module._OP.matmul is not None
    autotuned = _run(op.fn, tensors, with_seed(op, params, seed=seed))
    for block_m, block_n in ROW_TILES if rows_op else FORWARD_TILES:
        outs = launch_forward(op, tensors, params, seed, block_m, block_n)
        for name, out, ref in zip(op.output_names, outs, autotuned):
            what = f"{op.name}.{name}: tile {block_m}x{block_n} changed the forward"
            if rows_op:
                assert torch.equal(out == 0, ref == 0), what
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=what)
            else:
                assert torch.equal(out, ref), what

    kwargs = with_seed(op, params, seed=seed)
    g = torch.Generator().manual_seed(5)
    grads_out = {n: torch.randn(o.shape, generator=g).to(o.dtype).to(o.device) for n, o in zip(op.output_names, autotuned)}
    needs = {n: n in op.float_input_names for n in op.input_names}
    truth = _truth_gradients(op, tensors, kwargs, needs, [grads_out[n] for n in op.output_names])
    first = None
    for block_m, block_n in ROW_TILES if rows_op else BACKWARD_TILES:
        for rows in [16] if rows_op else _rows_per_program(block_m):
            grads = launch_backward(op, grads_out, tensors, params, seed, block_m, block_n, rows)
            assert grads, f"{op.name}: the backward kernel computes no gradient"
            what = f"{op.name} backward tile {block_m}x{block_n} rows/program {rows}"
            for name, grad in grads.items():
                check_against_truth(grad, truth[name], what=f"{what} grad {name}")
                if grad.shape == autotuned[0].shape:
                    # Computed element by element: exactly zero where (and only where) the
                    # reference's gradient, with the host-drawn mask, is exactly zero.
                    zero_ref, zero_got = truth[name] == 0, grad == 0
                    assert torch.equal(zero_got, zero_ref), f"{what}: grad {name} zeros differ from the mask's"
            if first is None:
                first = grads
            elif not rows_op:
                for name, grad in grads.items():
                    if grad.shape == autotuned[0].shape:
                        assert torch.equal(grad, first[name]), f"{what}: grad {name} bits depend on the tile"


def test_dropout_masks_identity_seed_op(device):
    """bias_gelu_dropout_add with the identity activation: grad_x = grad_y * mask, exactly,
    with the forward and the backward kernels run under different tiles."""
    op = next((o for o in OPS if o.name == "bias_gelu_dropout_add"), None)
    if op is None:
        pytest.skip("specs/bias_gelu_dropout_add.yaml is gone")
    case = ShapeCase("37x45", lead=(37,), n=45)
    tensors = make_inputs(op, case, torch.float32, device)
    params = params_for(op, {"activation": "identity"}, p=0.5)
    seed = 99
    call = call_of(op, tensors, params, True, seed)
    mask = runtime.dropout_mask_reference(seed, call.problem, 0, 0.5)
    assert 0.3 < (mask == 0).float().mean().item() < 0.7
    (y,) = launch_forward(op, tensors, params, seed, 16, 256)
    torch.testing.assert_close(y, mask * (tensors["x"] + tensors["bias"]) + tensors["residual"], rtol=0, atol=0)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device)
    for block_m, block_n, rows in [(1, 2048, 16), (4, 512, 16), (16, 16, 32)]:
        grads = launch_backward(op, {"y": grad_y}, tensors, params, seed, block_m, block_n, rows)
        assert torch.equal(grads["x"], grad_y * mask)
        torch.testing.assert_close(grads["bias"], (grad_y * mask).sum(0), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Gradients exactly at a kink (relu's argument == 0): the kernel must agree with reference


def _kink_cases():
    cases = []
    for op in OPS:
        text = " ".join(b.text for b in op.spec.outputs)
        relu_choices = [c for c in choice_cases(op) if any("relu" in v for v in c.values())]
        if relu_choices:
            cases += [(op, c) for c in relu_choices]
        elif "relu" in text:
            cases.append((op, {}))
    # relu is its own sympy function whose derivative at 0 is 0, as torch.relu's is.
    return [pytest.param(op, c, id=_ids(op, c)) for op, c in cases]


def _put_on_kink(op, tensors):
    """Row 0 of the first input made minus its partner (a [N] input, else the second input),
    the other row-indexed inputs' row 0 zeroed: relu's argument is exactly 0 there."""
    names = list(op.input_names)
    x = tensors[names[0]]
    if len(names) == 1:
        x.view(-1, x.shape[-1])[0] = 0.0
        return
    n = x.shape[-1]
    partner = next((m for m in names[1:] if tuple(tensors[m].shape) == (n,)), names[1])
    rows = x.view(-1, n)
    rows[0] = -tensors[partner].expand(x.shape).reshape(-1, n)[0]
    for m in names[1:]:
        if m != partner and tensors[m].shape == x.shape:
            tensors[m].view(-1, n)[0] = 0.0


@pytest.mark.parametrize("op,choices", _kink_cases())
def test_gradient_at_kink_matches_reference(op, choices, device):
    tensors = make_inputs(op, SHAPE_3D, torch.float32, device)
    _put_on_kink(op, tensors)
    params, kwargs = _kwargs(op, choices=choices)
    needs = {n: n in op.float_input_names for n in op.input_names}
    got, grad_outs = _gradients(op, tensors, kwargs, needs)
    truth = _truth_gradients(op, tensors, kwargs, needs, grad_outs)
    _check_gradients(op, tensors, got, truth, what=f"{op.name} {choice_id(choices)} at the kink")


@pytest.mark.parametrize("used", [("y",), ("z",), ("y", "z")])
def test_outputs_left_out_of_the_loss_have_zero_gradient(tmp_path, used, device):
    """Eager autograd leaves gradients unmaterialized (None for an output not in the loss):
    the backward treats None as zeros. (All None: gradcheck's zero-gradient probes.)"""
    import importlib.util

    from fusegen import cli

    name = "two_outputs_op"
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\ndoc: d\ninputs:\n  x: [..., N]\n  b: [N]\noutputs:\n  y: gelu(x + b)\n  z: (x + b) * x\n",
        encoding="utf-8",
    )
    (tmp_path / f"{name}.py").write_text(cli.build_op(path).text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    g = torch.Generator().manual_seed(3)
    x, b = torch.randn(3, 8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)

    def gradients(fn, dev):
        leaves = [x.to(dev).requires_grad_(True), b.to(dev).requires_grad_(True)]
        outputs = dict(zip(("y", "z"), fn(*leaves)))
        loss = sum((outputs[n] * outputs[n]).sum() for n in used)
        return [t.cpu() for t in torch.autograd.grad(loss, leaves)]

    for got, want in zip(gradients(getattr(module, name), device), gradients(module.reference, "cpu")):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


MULTI_OUTPUT = [op for op in OPS if len(op.spec.outputs) > 1]


@pytest.mark.parametrize("node", ["python", "native"])
@pytest.mark.parametrize("used", [0, 1], ids=["first", "second"])
@pytest.mark.parametrize("op", MULTI_OUTPUT, ids=[op.name for op in MULTI_OUTPUT])
def test_an_input_that_feeds_only_unused_outputs_gets_no_gradient(op, used, node, device, use_node):
    """One output used, the other not: an input reaching only the unused one (add_rmsnorm's
    weight, when only h is used) has no gradient (None, as in torch: an optimizer skips it,
    where zeros would decay it); the others as the reference's. Through either autograd node."""
    use_node(node)
    kwargs = with_seed(op, params_for(op, p=0.3), seed=11, training=True)
    tensors = make_inputs(op, ShapeCase("unused", lead=(2, 3), n=16), seed=1, device=device)
    grads = {}
    for fn in (op.fn, op.module.reference):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors.values()]
        for _ in range(2):  # the second call with a call key may take the eager call in C++
            for leaf in leaves:
                leaf.grad = None
            outputs = as_tuple(fn(*leaves, **kwargs))
            outputs[used].backward(_grad_outputs(outputs)[used])
        grads[fn] = [leaf.grad for leaf in leaves]
    for name, got, want in zip(op.input_names, grads[op.fn], grads[op.module.reference]):
        assert (got is None) == (want is None), f"{name}: {got} vs {want}"
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # None exactly where the input's gradient reads only other outputs' (and for integer inputs).
    reads = op.module._OP._reads
    expected = [not t.is_floating_point() or (r is not None and used not in r) for t, r in zip(tensors.values(), reads)]
    assert [g is None for g in grads[op.fn]] == expected


@pytest.mark.parametrize("op", MULTI_OUTPUT, ids=[op.name for op in MULTI_OUTPUT])
def test_the_library_op_gives_an_input_of_unused_outputs_no_gradient(op, device):
    """The library op (DTensor's rule, torch.compile's graph) too: its autograd does not fill
    the unused output's gradient with zeros, so the weight's gradient stays None."""
    kwargs = with_seed(op, params_for(op, p=0.3), seed=11, training=True)
    tensors = make_inputs(op, ShapeCase("unused", lead=(2, 3), n=16), seed=1, device=device)
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors.values()]
    fused = op.module._OP
    args = [*leaves, *(kwargs[p.name] for p in fused.params)]
    if fused.has_dropout:
        args += [kwargs["training"], kwargs["seed"]]
    outputs = fused._forward_op(*args)
    outputs[0].backward(torch.ones_like(outputs[0]))
    # Only the first output used: an input whose gradient reads only others' gets None.
    for spec, leaf, reads in zip(fused.inputs, leaves, fused._reads):
        assert (leaf.grad is None) == (not leaf.is_floating_point() or (reads is not None and 0 not in reads)), spec.name


@pytest.mark.parametrize("node", ["python", "native"])
@pytest.mark.parametrize("name", ["add_rmsnorm", "add_relu"])
def test_inputs_with_the_same_gradient_share_one_tensor(name, node, device, use_node):
    """x and residual in x + residual: one gradient, written once, given to both (as torch's add
    gives it), where they agree in shape and dtype; each its own where they do not. Leaves'
    .grad never alias, over several backwards; with inplace_backward the one gradient is
    x's own memory. Through either autograd node."""
    use_node(node)
    op = op_by_name(name)
    assert op.module._OP._same_as[1] == 0
    params = params_for(op)
    g = torch.Generator().manual_seed(5)

    def step(shapes, dtypes, in_place=False, backwards=1):
        leaves = [torch.randn(s, generator=g, dtype=torch.float64).to(d).to(device).requires_grad_(True)
                  for s, d in zip(shapes, dtypes)]
        inner = [leaf * 1 for leaf in leaves]  # not leaves: hooks see the gradients as the op returns them
        seen = {}
        for i, t in enumerate(inner[:2]):
            t.register_hook(lambda grad, i=i: seen.setdefault(i, grad))
        upstream = None
        for _ in range(backwards):
            outputs = as_tuple(op.fn(*(inner if in_place else leaves), **params, inplace_backward=in_place))
            if upstream is None:
                upstream = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype).to(device)
                            for o in outputs]
            torch.autograd.backward(outputs, upstream)
            inner = [leaf * 1 for leaf in leaves]
        truth = [leaf.detach().double().requires_grad_(True) for leaf in leaves]
        torch.autograd.backward(as_tuple(op.reference(*truth, **params)), [u.double() * backwards for u in upstream])
        low = [leaf.detach().clone().requires_grad_(True) for leaf in leaves]  # the reference in the inputs' dtypes
        torch.autograd.backward(as_tuple(op.reference(*low, **params)), [u * backwards for u in upstream])
        for input_name, leaf, t, r in zip(op.input_names, leaves, truth, low):
            check_against_truth(leaf.grad, t.grad.to(leaf.dtype), r.grad, what=input_name)
        return seen, leaves

    n = 16
    shapes = [(3, 4, n), (3, 4, n)] + ([(n,)] if len(op.input_names) == 3 else [])
    fp32 = [torch.float32] * len(shapes)
    _, leaves = step(shapes, fp32, backwards=2)  # the op on the leaves themselves, two backwards
    assert leaves[0].grad.data_ptr() != leaves[1].grad.data_ptr()
    for _ in range(2):  # the first call with a call key tunes: no write in place
        seen, _ = step(shapes, fp32, in_place=True)
    assert seen[0] is seen[1]  # one tensor
    seen, _ = step(shapes, [torch.float32, torch.bfloat16] + fp32[2:], in_place=True)
    assert seen[0] is not seen[1] and seen[1].dtype == torch.bfloat16
    seen, _ = step([shapes[0], (1, n)] + shapes[2:], fp32, in_place=True)
    assert seen[0] is not seen[1] and seen[1].shape == (1, n)


def test_a_module_with_an_input_no_gradient_covers_is_refused():
    """Every input's gradient is the kernel's, passed through, or shared: a generated module
    out of step with its runtime is refused at import, not at its first backward."""
    from types import SimpleNamespace

    kernels = SimpleNamespace(gradients=("x",), statistics=0)
    inputs = (runtime.Input("x", ("...", "N")), runtime.Input("residual", ("...", "N")))
    with pytest.raises(ValueError, match=r"out_of_step: inputs without a gradient: \['residual'\]"):
        runtime.FusedOp("out_of_step", inputs=inputs, outputs=("y",), kernels=kernels, reference=None)


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_a_valid_call_prints_nothing(op, device, use_node):
    """No warning from a valid call, forward and backward: on the interpreter, numpy's
    RuntimeWarnings from padded lanes (0/0 past the row's end, softmax(randn(3, 64)))."""
    import warnings

    use_node("python")
    kwargs = with_seed(op, params_for(op, p=0.3), seed=11, training=True)
    for case in (ShapeCase("quiet", lead=(3,), n=64), ShapeCase("quiet-ragged", lead=(2, 3), n=50)):
        tensors = make_inputs(op, case, seed=1, device=device)
        leaves = [t.requires_grad_(t.is_floating_point()) for t in tensors.values()]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            outputs = as_tuple(op.fn(*leaves, **kwargs))
            torch.autograd.backward(outputs, _grad_outputs(outputs))
        assert all(leaf.grad is not None for leaf in leaves if leaf.is_floating_point())
