"""Row reductions: the row program simplify makes (passes, the derived backward), and the
library's row ops against independent oracles (torch.nn.functional), in both of the row
kernels' layouts (the whole row in one tile, and a loop along it), with ties, NaN, broadcast
inputs of every kind and dropout inside a reduction.

Every generated op is also covered by test_ops.py against its own reference.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusegen.ir import build_ir
from fusegen.simplify import simplify
from fusegen.spec import load_spec
from tests.helpers import ROOT, build_and_import, check_against_truth, op_by_name

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's inf - inf in masked lanes


def _program(text: str, tmp_path):
    path = tmp_path / "op.yaml"
    path.write_text(text, encoding="utf-8")
    return simplify(build_ir(load_spec(path)))


# ---------------------------------------------------------------------------
# simplify: passes and the backward's structure


@pytest.mark.parametrize(
    "name,forward_passes,backward_passes",
    [("layernorm", 2, 1), ("rmsnorm", 1, 1), ("softmax", 1, 1), ("log_softmax", 1, 1), ("add_rmsnorm", 1, 1)],
)
def test_passes_follow_the_nesting_of_reductions(name, forward_passes, backward_passes):
    """A pass per level of nesting in the forward, which keeps each reduction per row, but
    for online sums (softmax's: one pass); the backward reads those and needs one pass for
    all its adjoints' row sums, however deep the forward nests (the adjoints are linear in
    each other)."""
    op = simplify(build_ir(load_spec(ROOT / "specs" / f"{name}.yaml")))
    assert len(op.forward.passes) == forward_passes
    assert len(op.backward.passes) == backward_passes
    assert [s for s, _ in op.backward.loaded] == [r.symbol for r in op.forward.reductions]


@pytest.mark.parametrize("output,online", [
    ("exp(x - max(x)) / sum(exp(x - max(x)))", True),
    ("x - max(x) - log(sum(exp(x - max(x))))", True),
    ("exp(2 * x - max(2 * x)) / sum(exp(2 * x - max(2 * x)))", True),
    ("exp(min(x) - x) / sum(exp(min(x) - x))", True),  # a min, its sum rescaled the other way
    ("x * exp(x - max(x)) / sum(x * exp(x - max(x)))", True),  # the factor needs not be exp alone
    ("x / sum(exp(max(x) - x))", False),  # the factor would grow past 1 as the max grows
    ("x / sum(x - max(x))", False),  # not a rescale: a shift
    ("x / sum(x * max(x))", False),  # a rescale by new / old: 0 / 0 before the first element
    ("exp(x - max(x)) / sum(exp(x - max(x)) + max(x))", False),
])
def test_sums_of_exp_of_a_max_are_online(output, online, tmp_path):
    """A sum that reads a max only through exp(c·(x - max)) joins the max's pass."""
    op = _program(f"name: op\ndoc: d\ninputs: {{x: [..., N]}}\noutputs:\n  y: {output}\n", tmp_path)
    assert len(op.forward.passes) == (1 if online else 2)
    assert any(r.running is not None for r in op.forward.reductions) == online


def test_a_reduction_written_twice_is_computed_once(tmp_path):
    op = _program(
        "name: op\ndoc: d\ninputs: {x: [..., N]}\noutputs:\n  y: exp(x - max(x)) / sum(exp(x - max(x)))\n", tmp_path
    )
    assert [r.op for r in op.forward.reductions] == ["max", "sum"]


def test_max_backward_counts_ties_where_its_adjoint_survives(tmp_path):
    centre = _program("name: op\ndoc: d\ninputs: {x: [..., N]}\noutputs:\n  y: x * 2 - max(x)\n", tmp_path)
    assert any(r.symbol.name.startswith("%c") for r in centre.backward.reductions)


def test_shift_invariance_cancels_the_max_adjoint():
    """softmax(x) does not depend on the max it subtracts: the derived backward finds that
    adjoint exactly zero (no tie count, no extra row sum), and layer norm's Σ(x - mean) = 0."""
    softmax = simplify(build_ir(load_spec(ROOT / "specs" / "softmax.yaml")))
    assert [r.op for r in softmax.backward.reductions] == ["sum"]
    layernorm = simplify(build_ir(load_spec(ROOT / "specs" / "layernorm.yaml")))
    assert [r.op for r in layernorm.backward.reductions] == ["sum", "sum"]


# ---------------------------------------------------------------------------
# The library against torch.nn.functional


def _forward_backward(op, tensors: dict, params: dict, grads: tuple, layout):
    module = op.module
    args = tuple(tensors.values()) + tuple(params.values())
    if layout == "autotuned":
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in tensors.items()}
        outs = module.__dict__[op.name](*leaves.values(), *params.values())
        outs = outs if isinstance(outs, tuple) else (outs,)
        got = torch.autograd.grad(outs, list(leaves.values()), grads, allow_unused=True)
        return [o.detach() for o in outs], list(got)
    fused = module._OP
    if fused.has_dropout:
        args += (True, 7)
    call = fused.check(args, needs_kernel=True)
    outs = [torch.empty(fused.output_shape(call.problem, i), dtype=call.problem.out_dtype, device=call.problem.device)
            for i in range(len(fused.outputs))]
    fused.kernels.forward(call, tuple(tensors.values()), outs, None, tile=layout)
    needs = [through is None for through in fused._passthrough]
    kernel = iter(fused.kernels.backward(call, tuple(tensors.values()), grads, needs, None, tile=layout,
                                         rows_per_program=16))
    got = [next(kernel) if need else grads[through].sum_to_size(t.shape)
           for need, through, t in zip(needs, fused._passthrough, tensors.values())]
    return outs, got


def _oracle_case(name, m, n, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, n, generator=g, dtype=dtype) * 2 + 0.5
    w = torch.randn(n, generator=g, dtype=dtype)
    b = torch.randn(n, generator=g, dtype=dtype)
    c = torch.randn(n, generator=g, dtype=dtype)
    r = torch.randn(m, n, generator=g, dtype=dtype)
    if name == "layernorm":
        return {"x": x, "weight": w, "bias": b}, {"eps": 1e-5}, lambda x, weight, bias: F.layer_norm(x, (n,), weight, bias, 1e-5)
    if name == "bias_layernorm":
        return ({"x": x, "bias": c, "gamma": w, "beta": b}, {"eps": 1e-6},
                lambda x, bias, gamma, beta: F.layer_norm(x + bias, (n,), gamma, beta, 1e-6))
    if name == "rmsnorm":
        return {"x": x, "weight": w}, {"eps": 1e-6}, lambda x, weight: F.rms_norm(x, (n,), weight, 1e-6)
    if name == "add_rmsnorm":
        return ({"x": x, "residual": r, "weight": w}, {"eps": 1e-6},
                lambda x, residual, weight: (x + residual, F.rms_norm(x + residual, (n,), weight, 1e-6)))
    if name == "softmax":
        return {"x": x}, {}, lambda x: torch.softmax(x, -1)
    if name == "log_softmax":
        return {"x": x}, {}, lambda x: torch.log_softmax(x, -1)
    if name == "scaled_masked_softmax_dropout":
        mask = torch.where(torch.rand(m, n, generator=g) < 0.3, float("-inf"), 0.0).to(dtype)
        mask[:, 0] = 0.0  # no row masked entirely (softmax of an all -inf row is NaN everywhere)
        return ({"x": x, "mask": mask}, {"scale": 0.125, "p": 0.0},
                lambda x, mask: torch.softmax(x * 0.125 + mask, -1))
    if name == "layernorm_dropout_add":
        return ({"x": x, "bias": c, "gamma": w, "beta": b, "residual": r}, {"eps": 1e-5, "p": 0.0},
                lambda x, bias, gamma, beta, residual: F.layer_norm(x + bias, (n,), gamma, beta, 1e-5) + residual)
    if name == "bias_dropout_add_layernorm":
        return ({"x": x, "bias": c, "residual": r, "weight": w, "norm_bias": b}, {"eps": 1e-5, "p": 0.0},
                lambda x, bias, residual, weight, norm_bias: (
                    x + bias + residual, F.layer_norm(x + bias + residual, (n,), weight, norm_bias, 1e-5)))
    raise KeyError(name)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_online_sums_in_the_loop_match_torch_where_the_max_moves(name, device):
    """The looped layout's online max-and-sum (2-column tiles over 37 columns): a max that
    grows tile after tile by far more than exp's range, lanes that see only -inf at first,
    a row all -inf, a +inf, a NaN: as torch, fp32 against fp64."""
    op = op_by_name(name)
    oracle = torch.softmax if name == "softmax" else torch.log_softmax
    n = 37
    x = torch.randn(8, n, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x[0] = torch.arange(n) * 300.0  # the max moves by 300 each column: exp(-300) underflows fp32
    x[1] = -torch.arange(n) * 300.0
    x[2, :20] = float("-inf")  # lanes with nothing but -inf for the first tiles
    x[3] = float("-inf")  # torch: NaN across the row
    x[4, 30] = float("inf")
    x[5, 11] = float("nan")
    x[6] *= 1e4
    x[7] *= 1e-30
    want = oracle(x, -1)
    call = op.module._OP.check((x.float().to(device),), needs_kernel=True)
    got = torch.empty_like(x, dtype=torch.float32, device=device)
    op.module._OP.kernels.forward(call, (x.float().to(device),), [got], None, tile=(2, 2))
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-6, atol=1e-30, equal_nan=True)


@pytest.mark.parametrize("online", [True, False], ids=["online", "two-loops"])
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "scaled_masked_softmax_dropout"])
def test_both_looped_forms_of_online_sums(name, online, device, monkeypatch):
    """A forward with online sums loops along the row two ways, the autotuner's choice: its
    online sums in their max's pass, or in a loop after it. Both as torch (fp64); on the CPU
    the interpreter's one config takes each in turn (a width of its own: tuned configs are
    kept per width)."""
    from fusegen.backends.triton import row_tuning

    monkeypatch.setattr(row_tuning, "INTERPRETER_ONLINE", online)
    op = op_by_name(name)
    n = (1500 if online else 1700) if device == "cpu" else 40000
    tensors, params, oracle = _oracle_case(name, 3, n, torch.float64)
    tensors = {k: v.to(device) for k, v in tensors.items()}
    outs, _ = _forward_backward(op, tensors, params, (torch.ones(3, n, dtype=torch.float64, device=device),),
                                "autotuned")
    check_against_truth(outs[0], oracle(*tensors.values()), what=f"{name} N={n} online={online}")


ORACLE_OPS = ["layernorm", "bias_layernorm", "rmsnorm", "add_rmsnorm", "softmax", "log_softmax",
              "scaled_masked_softmax_dropout", "layernorm_dropout_add", "bias_dropout_add_layernorm"]


@pytest.mark.parametrize("layout", ["autotuned", (2, 8)], ids=["autotuned", "looped-2x8"])
@pytest.mark.parametrize("name", ORACLE_OPS)
def test_library_matches_torch_functional(name, layout, device):
    """fp64 against torch's own ops, forward and backward, with dropout off (p = 0)."""
    op = op_by_name(name)
    # 21 columns: looped, three 8-wide steps, the last one masked; autotuned, a masked tile of 32.
    tensors, params, oracle = _oracle_case(name, 5, 21, torch.float64)
    tensors = {k: v.to(device) for k, v in tensors.items()}
    leaves = {k: v.clone().requires_grad_(k != "mask") for k, v in tensors.items()}
    truth = oracle(*leaves.values())
    truth = truth if isinstance(truth, tuple) else (truth,)
    g = torch.Generator().manual_seed(4)
    grads = tuple(torch.randn(t.shape, generator=g, dtype=torch.float64).to(device) for t in truth)
    wanted = [v for k, v in leaves.items() if k != "mask"]
    truth_grads = torch.autograd.grad(truth, wanted, grads)
    outs, got = _forward_backward(op, tensors, params, grads, layout)
    for out, ref in zip(outs, truth):
        check_against_truth(out, ref.detach(), what=f"{name} {layout} forward")
    got = [gr for k, gr in zip(tensors, got) if k != "mask"]
    for k, gr, ref in zip([k for k in tensors if k != "mask"], got, truth_grads):
        check_against_truth(gr, ref, what=f"{name} {layout} grad {k}")


@pytest.mark.parametrize("name", ["layernorm", "softmax", "rmsnorm"])
def test_rows_wider_than_one_tile(name, device):
    """N past the interpreter's one-tile width (1024; on a GPU past 16384 take the same loop):
    the autotuned launch loops along the row."""
    op = op_by_name(name)
    n = 3000 if device == "cpu" else 40000
    tensors, params, oracle = _oracle_case(name, 3, n, torch.float64)
    tensors = {k: v.to(device) for k, v in tensors.items()}
    leaves = {k: v.clone().requires_grad_(True) for k, v in tensors.items()}
    truth = oracle(*leaves.values())
    grad = torch.randn(truth.shape, dtype=torch.float64, device=device)
    truth_grads = torch.autograd.grad(truth, list(leaves.values()), grad)
    outs, got = _forward_backward(op, tensors, params, (grad,), "autotuned")
    check_against_truth(outs[0], truth.detach(), what=f"{name} N={n}")
    for k, gr, ref in zip(tensors, got, truth_grads):
        check_against_truth(gr, ref, what=f"{name} N={n} grad {k}")


@pytest.mark.parametrize("layout", ["autotuned", (2, 4)], ids=["autotuned", "looped"])
def test_max_ties_split_the_gradient_evenly(layout, tmp_path, device):
    """As torch.amax: the row max's gradient is shared by every element equal to it."""
    module = build_and_import(tmp_path, "name: centre\ndoc: d\ninputs: {x: [..., N]}\noutputs:\n  y: x * 2 - max(x)\n")
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64,
                     device=device)
    grad = torch.randn(x.shape, dtype=torch.float64, device=device)
    leaf = x.clone().requires_grad_(True)
    (truth,) = torch.autograd.grad(leaf * 2 - leaf.amax(-1, keepdim=True), leaf, grad)
    outs, (got,) = _forward_backward(_Module(module, "centre"), {"x": x}, {}, (grad,), layout)
    check_against_truth(outs[0], x * 2 - x.amax(-1, keepdim=True), what="forward")
    torch.testing.assert_close(got, truth, rtol=1e-14, atol=1e-14)


def test_nan_in_a_row_spreads_to_that_row_only(device):
    op = op_by_name("softmax")
    x = torch.randn(3, 10, dtype=torch.float32, device=device)
    x[1, 4] = float("nan")
    y = op.fn(x)
    assert torch.isnan(y[1]).all()
    torch.testing.assert_close(y[[0, 2]], torch.softmax(x[[0, 2]], -1))


@pytest.mark.parametrize("layout", ["autotuned", (2, 8)], ids=["autotuned", "looped"])
def test_every_kind_of_broadcast_input(layout, tmp_path, device):
    """[..., 1] (a row sum of its gradient, in the kernel), [N] (column sums across programs)
    and [B, 1, N]-like leading broadcasts (summed by torch) in one row op."""
    module = build_and_import(
        tmp_path,
        "name: tempered\ndoc: d\ninputs:\n  x: [..., N]\n  temperature: [..., 1]\n  bias: [N]\n  shift: [..., N]\n"
        "let:\n  s: x / temperature + bias + shift\n  e: exp(s - max(s))\noutputs:\n  y: e / sum(e)\n",
    )
    g = torch.Generator().manual_seed(9)
    tensors = {
        "x": torch.randn(2, 3, 19, generator=g, dtype=torch.float64),
        "temperature": torch.rand(2, 3, 1, generator=g, dtype=torch.float64) + 0.5,
        "bias": torch.randn(19, generator=g, dtype=torch.float64),
        "shift": torch.randn(2, 1, 19, generator=g, dtype=torch.float64),
    }
    tensors = {k: v.to(device) for k, v in tensors.items()}
    leaves = {k: v.clone().requires_grad_(True) for k, v in tensors.items()}
    truth = torch.softmax(leaves["x"] / leaves["temperature"] + leaves["bias"] + leaves["shift"], -1)
    grad = torch.randn(truth.shape, generator=g, dtype=torch.float64).to(device)
    truth_grads = torch.autograd.grad(truth, list(leaves.values()), grad)
    outs, got = _forward_backward(_Module(module, "tempered"), tensors, {}, (grad,), layout)
    check_against_truth(outs[0], truth.detach(), what="forward")
    for k, gr, ref in zip(tensors, got, truth_grads):
        assert gr.shape == tensors[k].shape
        check_against_truth(gr, ref, what=f"grad {k}")


@pytest.mark.parametrize("layout", ["autotuned", (2, 8)], ids=["autotuned", "looped"])
def test_dropout_inside_a_reduction_draws_each_mask_once(layout, tmp_path, device):
    """d = dropout(x) used twice, inside and outside a mean: the same mask for both uses, the
    reference's, bit for bit; the backward draws it again."""
    module = build_and_import(
        tmp_path,
        "name: centred_dropout\ndoc: d\ninputs: {x: [..., N]}\nparams:\n  p: {type: float, default: 0.5, min: 0.0, "
        "max: 1.0}\nlet:\n  d: dropout(x, p)\noutputs:\n  y: d - mean(d)\n",
    )
    x = torch.randn(6, 24, dtype=torch.float64, device=device)
    fused = module._OP
    call = fused.check((x, 0.5, True, 11), needs_kernel=True)
    leaf = x.clone().requires_grad_(True)
    truth = module.reference(leaf, 0.5, True, 11)
    grad = torch.randn(x.shape, dtype=torch.float64, device=device)
    (truth_grad,) = torch.autograd.grad(truth, leaf, grad)
    if layout == "autotuned":
        leaf2 = x.clone().requires_grad_(True)
        y = module.centred_dropout(leaf2, 0.5, True, 11)
        (got,) = torch.autograd.grad(y, leaf2, grad)
    else:
        from fusegen.runtime import seed_tensor

        seed = seed_tensor(call.seed, x.device)
        y = torch.empty_like(x)
        fused.kernels.forward(call, (x,), [y], seed, tile=layout)
        (got,) = fused.kernels.backward(call, (x,), (grad,), [True], seed, tile=layout, rows_per_program=16)
    kept = truth.detach() + truth.detach().mean(-1, keepdim=True)  # d itself: 0 where dropped
    assert torch.equal(y.detach() + y.detach().mean(-1, keepdim=True) == 0, kept == 0)
    check_against_truth(y.detach(), truth.detach(), what="forward")
    check_against_truth(got, truth_grad, what="backward")


def test_row_sums_of_gradients_are_deterministic_in_the_loop(device):
    op = op_by_name("layernorm")
    # 20 rows: two backward programs of 16 rows (partial sums of weight's and bias's gradients,
    # the second program's partly masked); 20 columns: a loop of 16-wide steps, the last masked.
    tensors, params, _ = _oracle_case("layernorm", 20, 20, torch.float32)
    tensors = {k: v.to(device) for k, v in tensors.items()}
    grad = torch.randn(20, 20, device=device)
    first = _forward_backward(op, tensors, params, (grad,), (4, 16))[1]
    second = _forward_backward(op, tensors, params, (grad,), (4, 16))[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


LOG_SOFTMAX_LSE = (
    "name: log_softmax_lse\ndoc: d\ninputs: {x: [..., N], temperature: [..., 1]}\nlet:\n  s: x / temperature\n"
    "  lse: max(s) + log(sum(exp(s - max(s))))\noutputs:\n  y: s - lse\n  lse_out: lse\n"
)


@pytest.mark.parametrize("layout", ["autotuned", (2, 8)], ids=["autotuned", "looped"])
def test_an_output_constant_along_the_row_has_one_value_per_row(layout, tmp_path, device):
    """A log-sum-exp output is [..., 1]: forward, gradients through both outputs (a row's
    lse gradient counted once, also in the [..., 1] input's row sum), out= and meta."""
    module = build_and_import(tmp_path, LOG_SOFTMAX_LSE)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 21, generator=g, dtype=torch.float64).to(device)
    t = (torch.rand(3, 4, 1, generator=g, dtype=torch.float64) + 0.5).to(device)
    leaves = [x.clone().requires_grad_(True), t.clone().requires_grad_(True)]
    s = leaves[0] / leaves[1]
    truth = (torch.log_softmax(s, -1), torch.logsumexp(s, -1, keepdim=True))
    grads = (torch.randn(3, 4, 21, generator=g, dtype=torch.float64).to(device),
             torch.randn(3, 4, 1, generator=g, dtype=torch.float64).to(device))
    truth_grads = torch.autograd.grad(truth, leaves, grads)
    outs, got = _forward_backward(_Module(module, "log_softmax_lse"), {"x": x, "temperature": t}, {}, grads, layout)
    assert outs[1].shape == (3, 4, 1)
    for out, ref in zip(outs, truth):
        check_against_truth(out, ref.detach(), what="forward")
    for name, gr, ref in zip(("x", "temperature"), got, truth_grads):
        check_against_truth(gr, ref, what=f"grad {name}")
    # Only the lse's gradient given: the y output's is zero.
    leaf = x.clone().requires_grad_(True)
    (only,) = torch.autograd.grad(module.log_softmax_lse(leaf, t)[1], leaf, grads[1])
    (want,) = torch.autograd.grad(torch.logsumexp(leaves[0] / t, -1, keepdim=True), leaves[0], grads[1])
    check_against_truth(only, want, what="grad x through lse alone")
    out = (torch.empty_like(x), torch.empty(3, 4, 1, dtype=torch.float64, device=device))
    module.log_softmax_lse(x, t, out=out)
    check_against_truth(out[1], truth[1].detach(), what="out=")
    meta = module.log_softmax_lse(x.to("meta"), t.to("meta"))
    assert meta[0].shape == (3, 4, 21) and meta[1].shape == (3, 4, 1)
    assert module.reference(x, t)[1].shape == (3, 4, 1)


@pytest.mark.parametrize("layout", ["autotuned", (2, 8)], ids=["autotuned", "looped"])
@pytest.mark.parametrize(
    "spec",
    [
        # dropout inside nested reductions: a mask is not constant along the row
        "name: op\ndoc: d\ninputs: {x: [..., N]}\nparams:\n  p: {type: float, default: 0.5, min: 0.0, max: 1.0}\n"
        "let:\n  hc: dropout(x - mean(x), p)\noutputs:\n  y: hc * rsqrt(mean(hc * hc) + 1.0e-5)\n",
        # a max of x / t, which a backward may round otherwise (x * (1 / t)): ties found again
        "name: op\ndoc: d\ninputs: {x: [..., N], t: [..., 1]}\noutputs:\n  y: x * 2 - max(x / t)\n",
        # reductions of what is constant along the row, once simplified: sum(t) = N t
        "name: op\ndoc: d\ninputs: {x: [..., N], t: [..., 1]}\noutputs:\n  y: x - sum(x - x + t) - mean(x * 0 + sum(x))\n"
        "  z: sum(x - x + 2) * t\n",
    ],
    ids=["dropout-nested", "max-recomputed", "folded"],
)
def test_derived_backward_against_autograd_of_the_reference(spec, layout, tmp_path, device):
    module = build_and_import(tmp_path, spec)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(12, 21, generator=g, dtype=torch.float64).to(device)
    tensors = {"x": x}
    if "t: [..., 1]" in spec:
        tensors["t"] = (torch.rand(12, 1, generator=g, dtype=torch.float64) + 0.5).to(device)
    extra = (0.5, True, 3) if "dropout" in spec else ()
    leaves = [t.clone().requires_grad_(True) for t in tensors.values()]
    truth = module.reference(*leaves, *extra)
    truth = truth if isinstance(truth, tuple) else (truth,)
    grads = tuple(torch.randn(t.shape, generator=g, dtype=torch.float64).to(device) for t in truth)
    truth_grads = torch.autograd.grad(truth, leaves, grads)
    fused = module._OP
    call = fused.check((*tensors.values(), *extra), needs_kernel=True)
    from fusegen.runtime import seed_tensor

    seed = seed_tensor(call.seed, x.device) if call.has_dropout else None
    outs = [torch.empty(fused.output_shape(call.problem, i), dtype=x.dtype, device=device)
            for i in range(len(fused.outputs))]
    tile = None if layout == "autotuned" else layout
    fused.kernels.forward(call, tuple(tensors.values()), outs, seed, tile=tile)
    got = fused.kernels.backward(call, tuple(tensors.values()), grads, [True] * len(tensors), seed, tile=tile,
                                 rows_per_program=16)
    for out, ref in zip(outs, truth):
        assert out.shape == ref.shape
        check_against_truth(out, ref.detach(), what="forward")
    for name, gr, ref in zip(tensors, got, truth_grads):
        assert not torch.isnan(gr).any(), f"grad {name}: NaN"
        check_against_truth(gr, ref, what=f"grad {name}")


def test_empty_rows(tmp_path, device):
    """N = 0: an op with a one-value-per-row output refuses it (no row to reduce); other
    ops' references stay differentiable."""
    module = build_and_import(tmp_path, LOG_SOFTMAX_LSE)
    x, t = torch.randn(3, 0, device=device), torch.rand(3, 1, device=device)
    with pytest.raises(ValueError, match="one value per row of an empty row"):
        module.log_softmax_lse(x, t)
    for name in ("softmax", "gelu"):
        leaf = torch.randn(3, 0, device=device, requires_grad=True)
        op_by_name(name).reference(leaf).sum().backward()
        assert leaf.grad.shape == (3, 0)


class _Module:
    """A module built in a test, shaped as the helpers' Op for _forward_backward."""

    def __init__(self, module, name):
        self.module, self.name = module, name


@pytest.mark.gpu
# The fast lane keeps one width past a tile (the loop); the full suite takes them all.
@pytest.mark.parametrize("n", [1, 7, *(pytest.param(n, marks=pytest.mark.full_lane) for n in (4096,)), 16385,
                               *(pytest.param(n, marks=pytest.mark.full_lane) for n in (65536, 262144, 1 << 20))])
def test_softmax_and_layernorm_at_any_width_on_gpu(n):
    """Rows from 1 column to a million: one tile up to 16384 (8192 backward), then split across
    programs (row_tuning.row_forward_layout, row_backward_layout) forward and backward."""
    m = 4
    for name in ("softmax", "layernorm"):
        op = op_by_name(name)
        tensors, params, oracle = _oracle_case(name, m, n, torch.float32)
        tensors = {k: v.cuda() for k, v in tensors.items()}
        leaves64 = {k: v.double().requires_grad_(True) for k, v in tensors.items()}
        truth = oracle(*leaves64.values())
        grad = torch.randn(truth.shape, device="cuda")
        truth_grads = torch.autograd.grad(truth, list(leaves64.values()), grad.double())
        outs, got = _forward_backward(op, tensors, params, (grad,), "autotuned")
        check_against_truth(outs[0], truth.detach(), what=f"{name} N={n}")
        for k, gr, ref in zip(tensors, got, truth_grads):
            if ref.abs().max() < 1e-9:
                # Zero but for rounding (N = 1): bounded by the terms that cancel, as large as
                # |grad| |weight| / sqrt(eps) for layer norm.
                scale = grad.abs().max() * (tensors["weight"].abs().max() / 1e-5**0.5 if name == "layernorm" else 1)
                assert gr.abs().max() <= 1e-5 * scale, f"{name} N={n} grad {k}"
            else:
                check_against_truth(gr, ref, what=f"{name} N={n} grad {k}")


@pytest.mark.gpu
@pytest.mark.full_lane
@pytest.mark.parametrize("n", [32000, 131072])
@pytest.mark.parametrize("name", ["softmax", "rmsnorm", "layernorm"])
def test_wide_16_bit_rows_on_gpu(name, n):
    """bf16 rows past 16384: one tile up to 32768 where a program holds few values (softmax),
    else the loop; within 2x the error of PyTorch's own bf16 computation, gradients too."""
    op = op_by_name(name)
    tensors, params, oracle = _oracle_case(name, 8, n, torch.bfloat16)
    tensors = {k: v.cuda() for k, v in tensors.items()}
    leaves64 = {k: v.double().requires_grad_(True) for k, v in tensors.items()}
    leaves16 = {k: v.clone().requires_grad_(True) for k, v in tensors.items()}
    truth, low = oracle(*leaves64.values()), oracle(*leaves16.values())
    grad = torch.randn(truth.shape, device="cuda", dtype=torch.bfloat16)
    truth_grads = torch.autograd.grad(truth, list(leaves64.values()), grad.double())
    low_grads = torch.autograd.grad(low, list(leaves16.values()), grad)
    outs, got = _forward_backward(op, tensors, params, (grad,), "autotuned")
    check_against_truth(outs[0], truth.detach(), low.detach(), what=f"{name} N={n}")
    for k, gr, ref, lo in zip(tensors, got, truth_grads, low_grads):
        check_against_truth(gr, ref, lo, what=f"{name} N={n} grad {k}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["layernorm_dropout_add", "scaled_masked_softmax_dropout"])
def test_row_ops_with_dropout_under_cuda_graphs(name):
    """A captured forward + backward of a row op with dropout: each replay draws a new mask,
    torch.manual_seed repeats the replays, and each replay's output and gradients are the
    reference's at the seed that replay drew (read back from the captured seed tensor)."""
    op = op_by_name(name)
    fused = op.module._OP
    m, n = 48, 1000
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn((m, n) if spec.dims[0] == "..." else (n,), generator=gen).cuda() for spec in fused.inputs]
    params = tuple(p.default for p in op.spec.params)
    args = (*tensors, *params, True, None)
    grad_y = torch.randn(m, n, generator=gen).cuda()
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    public = op.module.__dict__[name]
    needs = (True,) * len(tensors)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # tune and compile outside the capture
        for _ in range(3):
            torch.autograd.grad(public(*leaves, *params), leaves, grad_y)
            (y0,), seed0, statistics0 = fused.forward(args, eager=False)
            fused.backward_kernels((grad_y,), args, seed0, needs, statistics0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_public = public(*leaves, *params)
        grads_public = torch.autograd.grad(y_public, leaves, grad_y)
        (y,), seed, statistics = fused.forward(args, eager=False)
        grads = fused.backward_kernels((grad_y,), args, seed, needs, statistics)
    torch.cuda.synchronize()

    def replays(count):
        got = []
        for _ in range(count):
            graph.replay()
            got.append((y_public.detach().clone(), [g.clone() for g in grads_public], int(seed.item()),
                        y.clone(), [g.clone() for g in grads]))
        return got

    torch.manual_seed(4)
    first = replays(3)
    for i, (y_pub, _, s, y_int, g_int) in enumerate(first):
        for j in range(i):
            assert not torch.equal(y_pub, first[j][0]) and s != first[j][2], f"replays {j} and {i} drew one mask"
        refs = [t.double().requires_grad_(True) for t in tensors]
        truth = fused.reference(*refs, *params, True, s)
        truth_grads = torch.autograd.grad(truth, refs, grad_y.double())
        check_against_truth(y_int, truth.detach(), what=f"{name} replay {i}")
        for k, (gr, ref) in enumerate(zip(g_int, truth_grads)):
            check_against_truth(gr, ref, what=f"{name} replay {i} grad {k}")
    torch.manual_seed(4)
    again = replays(3)
    for (y_pub, g_pub, s, *_), (y_pub2, g_pub2, s2, *_) in zip(first, again):
        assert s == s2 and torch.equal(y_pub, y_pub2)
        assert all(torch.equal(a, b) for a, b in zip(g_pub, g_pub2))
