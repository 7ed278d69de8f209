"""Numerics over the whole op library (every spec in specs/), against eager PyTorch.

(a) NaN and ±inf propagate as eager PyTorch would: with NaN, +inf and -inf at a few places
    of one input, the generated op's output holds NaN and ±inf at exactly the places where
    `reference` has them (and reference where eager PyTorch has them); its gradients, where
    eager PyTorch's autograd puts them.
(b) A numerics contract: in fp32, bf16 and fp16, the generated kernel's relative error
    against a float64 truth (`reference` on float64 copies, same seed) is at most twice
    the error of eager PyTorch computing in that same dtype, plus a tiny floor: forward,
    and the gradients of backward; for every op of specs/ on random inputs, for the
    activations on fixed grids of their argument, and for every function of the
    expression language through a one-function spec.

"Eager PyTorch in that dtype" is built here from the spec itself, by walking its IR
(fusegen.ir.build_ir) with torch ops on tensors of that dtype: torch's native op where one
exists (F.gelu, F.silu, torch.sigmoid, torch.relu, F.leaky_relu, torch.erf, ...), dropout
as a multiplication by the op's own mask (fusegen.runtime.dropout_mask_reference) cast to
the dtype, as eager dropout multiplies by a mask in the input's dtype. It is checked
against `reference` in float64 first, so that it is known to compute the spec.
"""
from __future__ import annotations

import math
import re
import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fusegen import ir, runtime
from tests.helpers import (
    ShapeCase,
    _break_ties,
    all_ops,
    as_tuple,
    choice_cases,
    choice_id,
    float64_copies,
    make_inputs,
    params_for,
    rel_error,
    with_seed,
)

# Ops with outputs in a dtype of their own (float8: quantized, forward only) are held to that
# dtype's precision against float64 in test_language_output_dtypes.py.
OPS = tuple(op for op in all_ops() if not op.own_dtypes)
SEED = 20240917
P = 0.3  # dropout probability where dropout is on
SHAPE = ShapeCase("4x256", lead=(4,), n=256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The floor added to 2x eager's error. bf16/fp16: a tenth of the dtype's machine epsilon
# (there the output's own rounding dominates both errors, and their ratio is stable).
# fp32: half an ulp. There both errors are fractions of an ulp, set by the math library
# (under the interpreter numpy's float32 exp, say, against torch's), and a few large
# elements dominate the norm: exp on 2 * randn measured 2.7x eager's 2e-8 for a 1e-8 floor.
FLOOR = {torch.float32: torch.finfo(torch.float32).eps / 2, torch.bfloat16: torch.finfo(torch.bfloat16).eps / 10,
         torch.float16: torch.finfo(torch.float16).eps / 10}


# ---------------------------------------------------------------------------
# Eager PyTorch, from the spec's IR, in any dtype


def _float32(value: float) -> float:
    """As an fp32 kernel takes a float param: rounded to float32."""
    return float(torch.tensor(value, dtype=torch.float32))


def _tensor(value, dtype):
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=dtype)


EAGER_FUNCTIONS = {
    "identity": lambda a: a,
    "abs": torch.abs,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "tanh": torch.tanh,
    "erf": torch.erf,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "squared_relu": lambda a: torch.square(torch.relu(a)),
    "gelu": F.gelu,
    "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"),
    "silu": F.silu,
    "quick_gelu": lambda a: a * torch.sigmoid(1.702 * a),
    "min": torch.minimum,
    "max": torch.maximum,
    "round": torch.round,
    "floor": torch.floor,
    "sign": torch.sign,
    "clamp": torch.clamp,
    "softplus": F.softplus,
    "log1p": torch.log1p,
    "expm1": torch.expm1,
    "sin": torch.sin,
    "cos": torch.cos,
}


def _gelu_element_by_element(a: torch.Tensor) -> torch.Tensor:
    """F.gelu one element at a time. On the CPU, F.gelu's vectorized path gives NaN for +inf
    where its scalar path (and CUDA, and the formula x * Phi(x)) give +inf: torch 2.13 is not
    consistent with itself there, so the special-value test asks the scalar path."""
    flat = a.reshape(-1)
    return torch.stack([F.gelu(flat[i : i + 1])[0] for i in range(flat.numel())]).reshape(a.shape) if flat.numel() else F.gelu(a)


def _call(name: str, args: list, dtype, gelu_by_element: bool = False):
    if name == "gelu" and gelu_by_element:
        return _gelu_element_by_element(_tensor(args[0], dtype))
    if name == "leaky_relu":
        x, slope = args
        if not isinstance(slope, torch.Tensor):
            return F.leaky_relu(_tensor(x, dtype), slope)
        return torch.where(x > 0, x, x * slope)
    return EAGER_FUNCTIONS[name](*(_tensor(a, dtype) for a in args))


_BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "**": lambda a, b: a**b,
}
_COMPARE = {
    "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
}


def eager(op, tensors: dict, params: dict, seed: int, training: bool = True, gelu_by_element: bool = False):
    """The op's outputs as eager PyTorch computes them in the inputs' dtype, op by op."""
    spec = op.spec
    op_ir = ir.build_ir(spec)
    dtype = next(t for t in tensors.values() if t.is_floating_point()).dtype
    chunks = {i.name: i.chunks for i in spec.inputs}
    along = {i.name: i.chunk_dim for i in spec.inputs}  # a matmul's [2N, K] weight: its first dim
    values = {name: (t.chunk(chunks[name], dim=along[name]) if chunks[name] > 1 else t) for name, t in tensors.items()}
    scalars = {
        # fp64 kernels take a float param's double, the others round it to fp32.
        p.name: (_float32(params[p.name]) if p.type == "float" and dtype != torch.float64 else params[p.name])
        for p in spec.scalar_params
    }
    matmul = op_ir.matmul  # as eager code writes it: x @ weight.mT, in the inputs' dtype
    hidden = None
    if matmul is not None and matmul.hidden is not None:  # f(a @ w1) @ b: the layer after `value` below
        h = matmul.hidden
        hidden = {"a": values.pop(matmul.a), "w1": values.pop(h.weight), "b": values.pop(matmul.b),
                  "inputs": {n: values.pop(n) for n in h.inputs}}
        width = hidden["b"].shape[0] if matmul.transposed else hidden["b"].shape[1]
        values["@"] = torch.empty(hidden["a"].shape[:-1] + (width,), dtype=dtype)  # its shape, for now
    elif matmul is not None:  # each chunk's product of its chunk of b, where b holds chunks
        a, b = values.pop(matmul.a), values.pop(matmul.b)
        values["@"] = tuple(a @ (c.mT if matmul.transposed else c) for c in b) if isinstance(b, tuple) else \
            a @ (b.mT if matmul.transposed else b)
        r = matmul.lowrank  # (x @ lora_a.mT) @ lora_b.mT, two matmuls in the inputs' dtype
        if r is not None:
            down, up = values.pop(r.down), values.pop(r.up)
            values["@lowrank"] = (a @ (down.mT if r.down_transposed else down)) @ (up.mT if r.up_transposed else up)
    shapes = [v.shape for value in values.values() for v in (value if isinstance(value, tuple) else (value,))]
    shape = torch.broadcast_shapes(*shapes)
    problem = SimpleNamespace(
        shape=shape, m=math.prod(shape[:-1]), n=shape[-1] if shape else 1, device=torch.device("cpu"),
        # The kernels' compute dtype, which dropout's scale is in: fp64 for fp64, else fp32.
        compute_dtype=torch.float64 if dtype == torch.float64 else torch.float32,
    )
    has_dropout = training and any(scalars[d.p] > 0 for d in op_ir.dropouts)

    def value(expr):
        if isinstance(expr, ir.Const):
            return expr.value
        if isinstance(expr, ir.InputRef):
            return values[expr.name]
        if isinstance(expr, ir.ChunkRef):
            return values[expr.name][expr.index]
        if isinstance(expr, ir.MatMul):
            return values["@"]
        if isinstance(expr, ir.ProductChunk):
            return values["@"][expr.index]
        if isinstance(expr, ir.LowRank):
            return values["@lowrank"]
        if isinstance(expr, ir.ParamRef):
            return scalars[expr.name]
        if isinstance(expr, ir.Unary):
            return -value(expr.operand)
        if isinstance(expr, ir.Binary):
            return _BINARY[expr.op](value(expr.left), value(expr.right))
        if isinstance(expr, ir.Compare):
            return _COMPARE[expr.op](value(expr.left), value(expr.right))
        if isinstance(expr, ir.Logic):
            args = [value(a) for a in expr.args]
            return ~args[0] if expr.op == "~" else args[0] & args[1] if expr.op == "&" else args[0] | args[1]
        if isinstance(expr, ir.Col):
            return torch.arange(problem.n)
        if isinstance(expr, ir.Call):
            return _call(expr.func, [value(a) for a in expr.args], dtype, gelu_by_element)
        if isinstance(expr, ir.ChoiceCall):
            return _call(params[expr.param], [value(a) for a in expr.args], dtype, gelu_by_element)
        if isinstance(expr, ir.Where):
            cond = value(expr.cond)
            if isinstance(cond, bool):  # of params and numbers only: as eager code writes it, one branch
                return value(expr.if_true) if cond else value(expr.if_false)
            return torch.where(cond, _tensor(value(expr.if_true), dtype), _tensor(value(expr.if_false), dtype))
        if isinstance(expr, ir.Dropout):
            inner = value(expr.value)
            if not has_dropout:
                return inner
            mask = runtime.dropout_mask_reference(seed, problem, expr.stream, params[expr.p])
            return inner * mask.to(dtype)
        if isinstance(expr, ir.Reduce):  # as eager code writes it: x.sum(-1, keepdim=True), ...
            reduce = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}[expr.op]
            return reduce(_tensor(value(expr.value), dtype), dim=-1, keepdim=True)
        raise TypeError(f"unknown IR node {expr!r}")

    if hidden is not None:  # the layer's product, function and product with b, in the inputs' dtype
        h, b = matmul.hidden, hidden["b"]
        values.update(hidden["inputs"], **{"@": hidden["a"] @ (hidden["w1"].mT if h.transposed else hidden["w1"])})
        layer = _tensor(value(op_ir.hidden), dtype)
        values["@"] = layer @ (b.mT if matmul.transposed else b)
    results = {}
    for name, expr in op_ir.outputs:
        out = _tensor(value(expr), dtype)
        # An output with one value per row (a per-row loss) is [..., 1].
        results[name] = torch.broadcast_to(out, shape[:-1] + (1,) if name in op_ir.row_outputs else shape).to(dtype)
    # A concatenated output (y: [a, b]): its parts side by side along the last dim.
    parts = dict(op_ir.output_parts)
    return tuple(torch.cat([results[v] for v in ir.output_values(b.name, parts.get(b.name, 0))], dim=-1)
                 for b in spec.outputs)


# ---------------------------------------------------------------------------
# Cases

CHOICE_CASES = [(op, c) for op in OPS for c in choice_cases(op)]


def _leaf(t, dtype, device):
    """A float input in `dtype`, requiring its gradient; an integer or bool one as it is."""
    if not t.is_floating_point():
        return t.to(device)
    return t.to(dtype).to(device).requires_grad_(True)


def _kwargs(op, choices, training=True):
    params = params_for(op, choices, p=P)
    return params, with_seed(op, params, seed=SEED, training=training)


def _run(fn, tensors, kwargs):
    return as_tuple(fn(**tensors, **kwargs))


def test_every_spec_is_covered():
    assert OPS, "no spec found in specs/"
    assert {op.name for op, _ in CHOICE_CASES} == {op.name for op in OPS}


@pytest.mark.parametrize("op,choices", CHOICE_CASES, ids=[f"{op.name}-{choice_id(c)}" for op, c in CHOICE_CASES])
def test_eager_evaluator_computes_the_spec(op, choices):
    """The IR-walking eager evaluator, in float64, is `reference` in float64 (dropout on)."""
    tensors = make_inputs(op, SHAPE, torch.float64, seed=1)
    params, kwargs = _kwargs(op, choices)
    got = eager(op, tensors, params, SEED)
    want = _run(op.reference, tensors, kwargs)
    for name, g, w in zip(op.output_names, got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{op.name}.{name}: {m}")


# ---------------------------------------------------------------------------
# (a) NaN and ±inf

SPECIALS = (float("nan"), float("inf"), float("-inf"), float("nan"))


def _poison(t: torch.Tensor) -> torch.Tensor:
    """t with NaN, +inf, -inf, NaN at four places spread over it (first, a third, two thirds, last)."""
    t = t.detach().clone()
    flat = t.view(-1)
    n = flat.numel()
    for index, special in zip((0, n // 3, (2 * n) // 3, n - 1), SPECIALS):
        flat[index] = special
    return t


def _same_specials(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.detach(), want.detach()
    for label, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        a, b = test(got), test(want)
        assert torch.equal(a, b), (
            f"{what}: {label} at {a.nonzero().flatten().tolist()[:12]} in the op, "
            f"at {b.nonzero().flatten().tolist()[:12]} in the oracle"
        )


SPECIAL_CASES = [(op, c, name) for op, c in CHOICE_CASES for name in op.float_input_names]
SPECIAL_IDS = [f"{op.name}-{choice_id(c)}-{name}" for op, c, name in SPECIAL_CASES]

@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("op,choices,poisoned", SPECIAL_CASES, ids=SPECIAL_IDS)
def test_nan_and_inf_propagate_as_eager_pytorch(op, choices, poisoned, device):
    tensors = make_inputs(op, SHAPE, torch.float32, seed=2)
    tensors[poisoned] = _poison(tensors[poisoned])
    params, kwargs = _kwargs(op, choices)
    outs = _run(op.fn, {n: t.to(device) for n, t in tensors.items()}, kwargs)
    refs = _run(op.reference, tensors, kwargs)
    eagers = eager(op, tensors, params, SEED, gelu_by_element=True)
    for name, out, ref, eag in zip(op.output_names, outs, refs, eagers):
        _same_specials(ref, eag, f"{op.name}.{name} (reference vs eager PyTorch)")
        _same_specials(out.cpu(), ref, f"{op.name}.{name} (op vs reference)")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("op,choices,poisoned", SPECIAL_CASES, ids=SPECIAL_IDS)
def test_nan_and_inf_propagate_through_backward(op, choices, poisoned, device):
    """The gradients of every input, with one input poisoned: NaN/±inf where eager PyTorch's
    autograd puts them. (Not `reference`'s: autograd through its decomposed formulas meets
    inf - inf where the closed-form derivative does not, e.g. geglu's grad of a where b = -inf:
    b * gelu'(a) is -inf, and so it is for F.gelu's backward and the kernel.)"""
    tensors = make_inputs(op, SHAPE, torch.float32, seed=3)
    tensors[poisoned] = _poison(tensors[poisoned])
    params, kwargs = _kwargs(op, choices)
    g = torch.Generator().manual_seed(4)
    grads_out = [torch.randn(t.shape, generator=g) for t in eager(op, tensors, params, SEED)]

    def gradients(fn, dev):
        leaves = {n: t.detach().clone().to(dev).requires_grad_(t.is_floating_point()) for n, t in tensors.items()}
        outs = fn(leaves)
        grads = torch.autograd.grad(outs, [t for t in leaves.values() if t.requires_grad], [gr.to(o.device) for gr, o in zip(grads_out, outs)])
        return dict(zip([n for n, t in leaves.items() if t.requires_grad], (gr.cpu() for gr in grads)))

    got = gradients(lambda ts: _run(op.fn, ts, kwargs), device)
    want = gradients(lambda ts: eager(op, ts, params, SEED, gelu_by_element=True), "cpu")
    for name in op.float_input_names:
        _same_specials(got[name], want[name], f"{op.name}: grad of {name}, {poisoned} poisoned (op vs eager PyTorch)")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name", ["swiglu", "bias_swiglu"])
def test_swiglu_backward_with_infinite_b(name, device):
    """grad a = g * b * silu'(a): -inf for b = -inf, as eager PyTorch gives, not the NaN
    (inf - inf) of the product rule's sum with b distributed over silu''s two terms."""
    op = next(o for o in OPS if o.name == name)
    a = torch.tensor([[-0.5, 0.25, 1.0, 2.0]])
    b = torch.tensor([[float("-inf"), 1.0, 1.0, 1.0]])
    tensors = {"x": torch.cat([a, b], dim=-1)}
    if "bias" in op.input_names:
        tensors["bias"] = torch.zeros(8)
    grads = {}
    for label, fn in (("op", lambda ts: _run(op.fn, ts, {})), ("eager", lambda ts: eager(op, ts, {}, SEED))):
        leaves = {n: t.clone().to(device if label == "op" else "cpu").requires_grad_(t.is_floating_point()) for n, t in tensors.items()}
        (out,) = fn(leaves)
        grads[label] = torch.autograd.grad(out.sum(), leaves["x"])[0].cpu()
    assert grads["eager"][0, 0] == float("-inf")  # F.silu's backward: 1 * b * silu'(-0.5), silu'(-0.5) > 0
    assert grads["op"][0, 0] == float("-inf"), f"the op's gradient is {grads['op'][0, 0].item()}"


# ---------------------------------------------------------------------------
# (b) The numerics contract

CONTRACT_CASES = [(op, c, dt) for op, c in CHOICE_CASES for dt in DTYPES]
CONTRACT_IDS = [f"{op.name}-{choice_id(c)}-{str(dt)[6:]}" for op, c, dt in CONTRACT_CASES]


def _within_contract(got, eager_out, truth, dtype, what) -> None:
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, want {dtype}"
    assert got.shape == truth.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(truth.shape)}"
    err, eager_err = rel_error(got, truth), rel_error(eager_out, truth)
    bound = 2 * eager_err + FLOOR[dtype]
    assert err <= bound, (
        f"{what}: relative error {err:.3g} > 2 x eager PyTorch's {eager_err:.3g} + {FLOOR[dtype]:.2g} ({dtype})"
    )


@pytest.mark.parametrize("op,choices,dtype", CONTRACT_CASES, ids=CONTRACT_IDS)
def test_forward_within_twice_eager_error(op, choices, dtype, device):
    tensors = make_inputs(op, SHAPE, dtype, seed=5)
    params, kwargs = _kwargs(op, choices)
    outs = _run(op.fn, {n: t.to(device) for n, t in tensors.items()}, kwargs)
    eagers = eager(op, tensors, params, SEED)
    truths = _run(op.reference, float64_copies(tensors), kwargs)
    for name, out, eag, truth in zip(op.output_names, outs, eagers, truths):
        _within_contract(out.cpu(), eag, truth, dtype, f"{op.name}.{name}")


@pytest.mark.parametrize("op,choices,dtype", CONTRACT_CASES, ids=CONTRACT_IDS)
def test_backward_within_twice_eager_error(op, choices, dtype, device):
    tensors = make_inputs(op, SHAPE, dtype, seed=6)
    params, kwargs = _kwargs(op, choices)
    g = torch.Generator().manual_seed(7)
    # Incoming gradients in the dtype, so that the op, eager and the truth all start from the same values.
    grads_out = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype) for t in eager(op, tensors, params, SEED)]

    def gradients(fn, leaves, grads):
        outs = fn(leaves)
        return torch.autograd.grad(outs, [t for t in leaves.values() if t.requires_grad], [gr.to(o.dtype).to(o.device) for gr, o in zip(grads, outs)])

    def leaves_of(dt, dev="cpu"):
        return {n: _leaf(t.detach(), dt, dev) for n, t in tensors.items()}

    got = gradients(lambda ts: _run(op.fn, ts, kwargs), leaves_of(dtype, device), grads_out)
    low = gradients(lambda ts: eager(op, ts, params, SEED), leaves_of(dtype), grads_out)
    truth = gradients(lambda ts: _run(op.reference, ts, kwargs), leaves_of(torch.float64), grads_out)
    for name, gr, lo, tr in zip(op.float_input_names, got, low, truth):
        _within_contract(gr.cpu(), lo, tr, dtype, f"{op.name}: grad of {name}")


# ---------------------------------------------------------------------------
# (b) on a grid: the activations and their derivatives over fixed ranges of their argument
#
# Random inputs put few values in an activation's tails; a grid over each range makes the
# comparison deterministic and independent of the input distribution. In fp32, where the
# formulas' own rounding shows (in bf16/fp16 the final rounding dominates, and the random
# cases above cover them).

GRID_CASES = [("gelu", {}), ("gelu_tanh", {}), ("quick_gelu", {}), ("squared_relu", {}), ("leaky_relu", {}), ("mish", {}),
              ("softcap", {})] + [
    ("add_mul_activation", {"activation": a}) for a in ("relu", "sigmoid", "silu")
]
GRID_CASES = [(op, c) for name, c in GRID_CASES for op in OPS if op.name == name]
RANGES = [(-8.0, -2.0), (-2.0, 2.0), (2.0, 8.0)]


def _grid_params():
    return [
        pytest.param(op, c, (lo, hi), id=f"{op.name}-{choice_id(c)}-[{lo:g},{hi:g}]")
        for op, c in GRID_CASES
        for lo, hi in RANGES
    ]


@pytest.mark.parametrize("op,choices,span", _grid_params())
def test_activation_on_a_grid_within_twice_eager_error(op, choices, span, device):
    dtype = torch.float32
    z = torch.linspace(*span, 2001, dtype=torch.float64).to(dtype).reshape(1, -1)
    tensors = {"x": z}
    for name in op.input_names[1:]:  # add_mul_activation: inp and bias are 0, so its argument is x
        tensors[name] = torch.zeros(z.shape[-1:] if name == "bias" else z.shape, dtype=dtype)
    params, kwargs = _kwargs(op, choices)

    def forward_and_gradient(fn, dt, dev):
        leaves = {n: _leaf(t, dt, dev) for n, t in tensors.items()}
        (y,) = fn(leaves)
        (g,) = torch.autograd.grad(y.sum(), leaves["x"])
        return y.detach().cpu(), g.cpu()

    got = forward_and_gradient(lambda ts: _run(op.fn, ts, kwargs), dtype, device)
    low = forward_and_gradient(lambda ts: eager(op, ts, params, SEED), dtype, "cpu")
    truth = forward_and_gradient(lambda ts: _run(op.reference, ts, kwargs), torch.float64, "cpu")
    _within_contract(got[0], low[0], truth[0], dtype, f"{op.name} on {span}")
    _within_contract(got[1], low[1], truth[1], dtype, f"{op.name}'s derivative on {span}")


# ---------------------------------------------------------------------------
# (b) for every function of the expression language, not only those the library uses:
# a one-function spec each, built into a temporary folder.

LANGUAGE_CASES = {
    # name: (expression over x (and y), domain of x: "any" (2 * randn), "positive" (|2 * randn| + 0.1),
    # "wide" (20 * randn) or "small" (1e-4 * randn, where log1p and expm1 are more than log and exp))
    "identity": ("identity(x)", "any"),
    "abs": ("abs(x)", "any"),
    "exp": ("exp(x)", "any"),
    "log": ("log(x)", "positive"),
    "sqrt": ("sqrt(x)", "positive"),
    "rsqrt": ("rsqrt(x)", "positive"),
    "tanh": ("tanh(x)", "any"),
    "erf": ("erf(x)", "any"),
    "sigmoid": ("sigmoid(x)", "any"),
    "min": ("min(x, y)", "any"),
    "max": ("max(x, y)", "any"),
    "relu": ("relu(x)", "any"),
    "squared_relu": ("squared_relu(x)", "any"),
    "leaky_relu": ("leaky_relu(x, 0.2)", "any"),
    "gelu": ("gelu(x)", "any"),
    "gelu_tanh": ("gelu_tanh(x)", "any"),
    "silu": ("silu(x)", "any"),
    "quick_gelu": ("quick_gelu(x)", "any"),
    "round": ("round(x)", "any"),
    "floor": ("floor(x)", "any"),
    "sign": ("sign(x)", "any"),
    "clamp": ("clamp(x, -1.0, 1.5)", "any"),
    "clamp_inputs": ("clamp(x, y, 1.5)", "any"),  # lo an input: its gradient where x < lo
    "softplus": ("softplus(x)", "any"),
    "softplus_wide": ("softplus(x)", "wide"),  # across torch's threshold, 20
    "log1p": ("log1p(x)", "positive"),
    "log1p_small": ("log1p(x)", "small"),
    "expm1": ("expm1(x)", "any"),
    "expm1_small": ("expm1(x)", "small"),
    "sin": ("sin(x)", "any"),
    "sin_wide": ("sin(x)", "wide"),
    "cos": ("cos(x)", "any"),
    "cos_wide": ("cos(x)", "wide"),
    "where": ("where(x > y, x * y, x - y)", "any"),
    "power": ("x ** 1.5", "positive"),
    "division": ("x / y", "positive"),
}
@pytest.fixture(scope="module")
def language_ops(tmp_path_factory):
    """name -> (a minimal Op-like object, its module), built and imported once."""
    import importlib.util

    from fusegen import cli
    from fusegen.spec import load_spec

    folder = tmp_path_factory.mktemp("language")
    built = {}
    for name, (text, _) in LANGUAGE_CASES.items():
        op_name = f"numerics_fn_{name}"
        inputs = "  x: [..., N]\n" + ("  y: [..., N]\n" if re.search(r"\by\b", text) else "")
        path = folder / f"{op_name}.yaml"
        path.write_text(f"name: {op_name}\ndoc: d\ninputs:\n{inputs}outputs:\n  res: {text}\n", encoding="utf-8")
        module_path = folder / f"{op_name}.py"
        module_path.write_text(cli.build_op(path).text, encoding="utf-8")
        spec = importlib.util.spec_from_file_location(op_name, module_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        op_spec = load_spec(path)
        built[name] = (SimpleNamespace(spec=op_spec, name=op_name, input_names=tuple(i.name for i in op_spec.inputs)), module)
    return built


# tanh and x ** 1.5 (and rsqrt's backward) are libdevice calls: without a GPU they run through
# fusegen.runtime.interpreter's numpy stand-ins.
# The fast GPU lane takes each function in fp32 (every dtype runs through the library ops there).
LANGUAGE_PARAMS = [pytest.param(name, dt, id=f"{name}-{str(dt)[6:]}",
                                marks=() if dt is torch.float32 else pytest.mark.full_lane)
                   for name in LANGUAGE_CASES for dt in DTYPES]


# The interpreter also computes the masked-off lanes of a tile (zeros): log(0), 1 / 0 there.
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name,dtype", LANGUAGE_PARAMS)
def test_every_function_within_twice_eager_error(language_ops, name, dtype, device):
    op, module = language_ops[name]
    _, domain = LANGUAGE_CASES[name]
    g = torch.Generator().manual_seed(8)
    tensors = {}
    for index, input_name in enumerate(op.input_names):
        t = torch.randn(4, 256, generator=g, dtype=torch.float64) * 2
        if domain == "positive":
            t = t.abs() + 0.1
        elif domain == "wide":
            t = t * 10
        elif domain == "small":
            t = t * 5e-5
        t = t.to(dtype)
        tensors[input_name] = _break_ties(t, odd=index == 0) if dtype != torch.float32 else t
    grad_out = torch.randn(4, 256, generator=g, dtype=torch.float64).to(dtype)
    fn = getattr(module, op.name)

    def forward_and_gradients(f, dt, dev):
        leaves = {n: _leaf(t, dt, dev) for n, t in tensors.items()}
        (y,) = as_tuple(f(leaves))
        grads = torch.autograd.grad(y, list(leaves.values()), grad_out.to(dt).to(dev))
        return y.detach().cpu(), [gr.cpu() for gr in grads]

    got = forward_and_gradients(lambda ts: fn(**ts), dtype, device)
    low = forward_and_gradients(lambda ts: eager(op, ts, {}, SEED), dtype, "cpu")
    truth = forward_and_gradients(lambda ts: module.reference(**ts), torch.float64, "cpu")
    _within_contract(got[0], low[0], truth[0], dtype, op.name)
    for input_name, gr, lo, tr in zip(op.input_names, got[1], low[1], truth[1]):
        _within_contract(gr, lo, tr, dtype, f"{op.name}: grad of {input_name}")


# libdevice.pow has overloads for (fp32, fp32), (fp64, fp64), (fp32, int32) and (fp64, int32)
# only, picked by its arguments' types: a number exponent or base, and a float param (Triton
# passes it as fp32), must reach it in the compute type. Found by the interpreter's libdevice
# stand-in, which goes through the CUDA backend's own dispatch.
POW_DISPATCH_CASES = {
    "power_fp64": ("x ** 1.5", "", torch.float64),
    "rsqrt_fp64": ("rsqrt(x)", "", torch.float64),
    "number_base": ("2 ** x", "", torch.float32),
    "float_param_exponent_fp64": ("x ** s", "params:\n  s: {type: float, default: 1.5}\n", torch.float64),
}


@pytest.mark.parametrize("case", POW_DISPATCH_CASES.values(), ids=POW_DISPATCH_CASES.keys())
def test_powers_in_every_dtype(tmp_path, case, device):
    import importlib.util

    from fusegen import cli

    text, params, dtype = case
    name = f"numerics_pow_{zlib.crc32(text.encode())}"
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\ndoc: d\ninputs:\n  x: [..., N]\n{params}outputs:\n  y: {text}\n", encoding="utf-8")
    (tmp_path / f"{name}.py").write_text(cli.build_op(path).text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = (torch.rand(2, 8, dtype=dtype, generator=torch.Generator().manual_seed(9)) + 0.5).requires_grad_(True)
    y = getattr(module, name)(x.to(device))
    (grad,) = torch.autograd.grad(y.sum(), x)
    x64 = x.detach().double().requires_grad_(True)
    want = module.reference(x64)
    (want_grad,) = torch.autograd.grad(want.sum(), x64)
    torch.testing.assert_close(y.detach().cpu().double(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# (b) at extreme magnitudes (issue 27): the contract wherever eager PyTorch's fp32 result is
# finite, with the first input scaled from 1e-30 to 1e30. Found: layer norm's d/dx printed
# var**1.5 as var * sqrt(var), inf from a row std of ~1e13 on; gelu_tanh's d/dx met x**3's
# inf with sigmoid's 0 (NaN) from |x| ~ 1e13 on.

MAGNITUDES = (1e-30, 1e-10, 1e13, 1e20, 1e30)
MAGNITUDE_OPS = ("layernorm", "rmsnorm", "add_rmsnorm", "bias_layernorm", "gelu_tanh", "bias_gelu", "geglu")
MAGNITUDE_CASES = [
    pytest.param(op, c, m, id=f"{op.name}-{choice_id(c)}-{m:g}")
    for op, c in CHOICE_CASES if op.name in MAGNITUDE_OPS
    for m in MAGNITUDES
]


def _finite_error(got, eager_out, truth) -> tuple[float, float]:
    """Errors over the elements where eager PyTorch and the truth are finite; there the op must be too."""
    where = torch.isfinite(eager_out) & torch.isfinite(truth)
    assert torch.isfinite(got[where]).all(), "non-finite where eager PyTorch is finite"
    return rel_error(got[where], truth[where]), rel_error(eager_out[where], truth[where])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("op,choices,magnitude", MAGNITUDE_CASES)
def test_extreme_magnitudes_within_twice_eager_error(op, choices, magnitude, device):
    _within_twice_eager_error(op, choices, magnitude, op.input_names[:1], device)


# Every input scaled (issue 27): the order of a printed product's factors. swiglu's a * b *
# sigmoid(a) overflowed to inf * 0 where torch's (a * sigmoid(a)) * b is finite; a norm's
# t * weight * rsqrt(var) likewise; and scaled_masked_softmax_dropout's backward summed
# exp(mask - max + scale * x), rounded past 0 at 1e13, where torch's s - max(s) is <= 0.
SCALED_ALL_CASES = [
    pytest.param(op, c, m, id=f"{op.name}-{choice_id(c)}-{m:g}")
    for names, magnitudes in (
        (("swiglu", "bias_swiglu", "geglu"), (1e20, 1e30)),
        (("layernorm", "rmsnorm", "add_rmsnorm", "bias_layernorm", "layernorm_dropout_add",
          "bias_dropout_add_layernorm"), (1e20,)),
        (("scaled_masked_softmax_dropout",), (1e13,)),
    )
    for op, c in CHOICE_CASES if op.name in names
    for m in magnitudes
]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("op,choices,magnitude", SCALED_ALL_CASES)
def test_every_input_at_extreme_magnitudes_within_twice_eager_error(op, choices, magnitude, device):
    _within_twice_eager_error(op, choices, magnitude, op.input_names, device)


def _within_twice_eager_error(op, choices, magnitude, scaled, device):
    dtype = torch.float32
    tensors = make_inputs(op, ShapeCase("2x64", lead=(2,), n=64), dtype, seed=5)
    for name in scaled:
        tensors[name] = (tensors[name].double() * magnitude).to(dtype)
    params, kwargs = _kwargs(op, choices)

    def run(fn, dt, dev):
        leaves = {n: _leaf(t.detach(), dt, dev) for n, t in tensors.items()}
        outs = fn(leaves)
        grads_out = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + i), dtype=torch.float64)
                     .to(dt).to(dev) for i, o in enumerate(outs)]
        grads = torch.autograd.grad(outs, [t for t in leaves.values() if t.requires_grad], grads_out)
        return [o.detach().cpu() for o in outs], [g.cpu() for g in grads]

    got = run(lambda ts: _run(op.fn, ts, kwargs), dtype, device)
    low = run(lambda ts: eager(op, ts, params, SEED), dtype, "cpu")
    truth = run(lambda ts: _run(op.reference, ts, kwargs), torch.float64, "cpu")
    for kind, names, index in (("output", op.output_names, 0), ("grad of", op.float_input_names, 1)):
        for name, g, lo, tr in zip(names, got[index], low[index], truth[index]):
            err, eager_err = _finite_error(g, lo, tr)
            assert err <= 2 * eager_err + FLOOR[dtype], (
                f"{op.name} at {magnitude:g}, {kind} {name}: relative error {err:.3g} > 2 x eager PyTorch's {eager_err:.3g}"
            )


# ---------------------------------------------------------------------------
# Powers with an exponent that is not a number (issue 27): the derivative as torch's, at a
# base of 0 too (sympy's k*x**k/x was 0/0 there), and relu's step as torch's selection
# (relu(x)**0.5 below 0: 0, not inf * 0).

POWER_SPECS = {
    "param": "inputs:\n  x: [..., N]\nparams:\n  k: {type: float, default: 2.0}\noutputs:\n  y: x ** k\n",
    "relu": "inputs:\n  x: [..., N]\nparams:\n  k: {type: float, default: 2.0}\noutputs:\n  y: relu(x) ** k\n",
    "input": "inputs:\n  x: [..., N]\n  k: [..., N]\noutputs:\n  y: x ** k\n",
}
EXPONENTS = (0.0, 0.5, 1.0, 2.0, 2.5, 3.0)


@pytest.fixture(scope="module")
def power_ops(tmp_path_factory):
    from tests.helpers import build_and_import

    folder = tmp_path_factory.mktemp("powers")
    return {kind: build_and_import(folder, f"name: power_{kind}\ndoc: d\n{text}") for kind, text in POWER_SPECS.items()}


def _same_values(got, want, what):
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN at {got.isnan().tolist()}, torch at {want.isnan().tolist()}"
    torch.testing.assert_close(got.nan_to_num(0.0), want.nan_to_num(0.0), msg=lambda m: f"{what}: {m}")


@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", POWER_SPECS)
def test_power_derivatives_at_zero_as_torch(power_ops, kind, dtype, device):
    module = power_ops[kind]
    fn = getattr(module, f"power_{kind}")
    x = torch.tensor([[0.0, -1.0, 0.5, 1.0, 2.0, 0.0]], dtype=dtype)
    for k in EXPONENTS:
        leaves = [x.clone().requires_grad_(True)]
        if kind == "input":
            leaves.append(torch.full_like(x, k).requires_grad_(True))
        args = [t.detach().to(device).requires_grad_(True) for t in leaves]
        if kind == "input":
            got = torch.autograd.grad(fn(*args).sum(), args)
            want = torch.autograd.grad((leaves[0] ** leaves[1]).sum(), leaves)
            ref = torch.autograd.grad(module.reference(*leaves).sum(), leaves)
        else:
            got = torch.autograd.grad(fn(*args, k=k).sum(), args)
            base = torch.relu(leaves[0]) if kind == "relu" else leaves[0]
            want = torch.autograd.grad((base**k).sum(), leaves)
            ref = torch.autograd.grad(module.reference(*leaves, k=k).sum(), leaves)
        for name, g, w, r in zip(("x", "k"), got, want, ref):
            _same_values(g.cpu(), w, f"{kind}, k = {k}: grad of {name}")
            _same_values(r, w, f"{kind}, k = {k}: reference's grad of {name}")


# ---------------------------------------------------------------------------
# fp64 ops take their float params in fp64 (issue 27: they were rounded to fp32, 1e-8 off).


@pytest.mark.parametrize("name", ["scaled_masked_softmax_dropout", "layernorm"])
def test_fp64_ops_take_fp64_params(name, device):
    op = next(o for o in OPS if o.name == name)
    tensors = make_inputs(op, SHAPE, torch.float64, seed=11)
    if name == "layernorm":  # an eps that matters: rows of tiny variance
        tensors["x"] = tensors["x"] * 1e-3
        kwargs, want = {"eps": 1.1e-6}, None
        want = F.layer_norm(tensors["x"], (SHAPE.n,), tensors["weight"], tensors["bias"], eps=1.1e-6)
    else:
        kwargs = {"scale": 0.3, "p": 0.0}
        want = torch.softmax(tensors["x"] * 0.3 + tensors["mask"], dim=-1)
    got = _run(op.fn, {n: t.to(device) for n, t in tensors.items()}, kwargs)[0].cpu()
    ref = _run(op.reference, tensors, kwargs)[0]
    for label, value in (("op", got), ("reference", ref)):
        assert value.dtype == torch.float64
        err = ((value - want).abs() / want.abs().clamp_min(1e-300)).max().item()
        assert err <= 1e-13, f"{name} ({label}) in fp64: relative error {err:.3g} against float64 torch"


def test_fp64_dropout_scales_kept_values_by_the_double(device):
    """Dropout's 1 / (1 - p) reaches an fp64 kernel as a double too: kept values are torch's
    fp64 dropout's, (x + bias) / (1 - p), to fp64 rounding (an fp32 scale is off by ~1e-8)."""
    op = next(o for o in OPS if o.name == "bias_dropout_add")
    x = torch.rand(4, 64, dtype=torch.float64, device=device) + 1
    bias, residual = torch.zeros(64, dtype=torch.float64, device=device), torch.zeros_like(x)
    for fn in (op.fn, op.reference):
        y = fn(x, bias, residual, 0.3, training=True, seed=5)
        kept = y != 0
        assert 0 < int(kept.sum()) < y.numel()
        err = ((y[kept] - x[kept] / (1 - 0.3)).abs() / (x[kept] / (1 - 0.3))).max().item()
        assert err <= 1e-15, f"{fn.__name__}: relative error {err:.3g} of kept values in fp64"
