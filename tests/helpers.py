"""Shared machinery for tests over every spec in specs/: discovery, inputs, params, errors.

Everything here is derived from the spec (fusegen.spec.load_spec) and the generated
module (generated.<name>), so that a spec added to specs/ is tested without new code.
Import this module only after conftest has set TRITON_INTERPRET (pytest does that).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from fusegen import ir, runtime
from fusegen.spec import ChoiceParam, OpSpec, ScalarParam, load_spec

ROOT = Path(__file__).resolve().parent.parent
SPEC_DIR = ROOT / "specs"

LOW_PRECISION = (torch.float16, torch.bfloat16)
# Bounds for fp32/fp64 results against the float64 truth (relative error, in norm).
TIGHT = {torch.float32: 1e-5, torch.float64: 1e-12}
# The floor added to 2x the low-precision reference's error: a tenth of the dtype's eps.
FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-3}


# ---------------------------------------------------------------------------
# Discovery


@dataclass(frozen=True)
class Op:
    """One spec and its generated module."""

    spec: OpSpec
    module: object
    dropout_params: tuple[str, ...]  # float params that are some dropout's p

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def fn(self):
        return getattr(self.module, self.name)

    @property
    def reference(self):
        return self.module.reference

    @property
    def has_dropout(self) -> bool:
        return bool(self.dropout_params)

    @property
    def differentiable(self) -> bool:
        """Some output has a gradient: not a forward-only op (the fp8 library's quantized outputs)."""
        return any(b.differentiable for b in self.spec.outputs)

    @property
    def own_dtypes(self) -> bool:
        """Some output has a dtype of its own (float8, int8: not the inputs')."""
        return any(b.dtype is not None for b in self.spec.outputs)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.spec.inputs)

    @property
    def float_input_names(self) -> tuple[str, ...]:
        """The inputs that take gradients: integer and bool inputs never do."""
        return tuple(i.name for i in self.spec.inputs if i.dtype == "float")

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.spec.outputs)

    @property
    def forward_kernel(self):
        return getattr(self.module, f"{self.name}_kernel")

    @property
    def backward_kernel(self):
        return getattr(self.module, f"{self.name}_backward_kernel")

    def __repr__(self) -> str:  # pytest ids
        return self.name


@functools.lru_cache(maxsize=None)
def _discover() -> tuple[tuple[Op, ...], tuple[tuple[str, str], ...]]:
    ops, broken = [], []
    for path in sorted(SPEC_DIR.glob("*.yaml")) + sorted(SPEC_DIR.glob("*.yml")):
        try:
            spec = load_spec(path)
            module = importlib.import_module(f"generated.{spec.name}")
            dropouts = tuple(sorted({d.p for d in ir.build_ir(spec).dropouts}))
        except Exception as exc:  # noqa: BLE001 - reported by test_every_spec_loads
            broken.append((path.name, f"{type(exc).__name__}: {exc}"))
            continue
        ops.append(Op(spec, module, dropouts))
    return tuple(ops), tuple(broken)


def all_ops() -> tuple[Op, ...]:
    """Every spec in specs/ that loads, with its generated module."""
    return _discover()[0]


def broken_specs() -> tuple[tuple[str, str], ...]:
    """(file, error) for each spec that does not load or has no importable generated module."""
    return _discover()[1]


def op_by_name(name: str) -> Op:
    return next(op for op in all_ops() if op.name == name)


def build_and_import(folder: Path, spec_text: str, backend: str | None = None):
    """Build a spec given as YAML text into `folder` and import its module (a new spec's op,
    for a test that needs one specs/ does not have); `backend` as `fusegen build --backend`."""
    import importlib.util

    from fusegen import cli

    name = re.search(r"^name: *(\w+)", spec_text, re.M).group(1)
    spec_path = folder / f"{name}.yaml"
    spec_path.write_text(spec_text, encoding="utf-8")
    for file, text in cli.build_op(spec_path, backend).files.items():  # the module, and any file beside it
        (folder / file).write_text(text, encoding="utf-8")
    module_spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# Params


def shipped_as(name: str, new_name: str) -> str:
    """The shipped spec `name`'s text under another op name (its library ops beside the shipped
    op's, not in their place)."""
    return re.sub(r"^name: *\w+", f"name: {new_name}", (ROOT / "specs" / f"{name}.yaml").read_text(), flags=re.M)


def scalar_value(param: ScalarParam, is_dropout_p: bool):
    """A value strictly inside [min, max] (never exactly 0 for a dropout p), not the default."""
    low, high = param.min, param.max
    if is_dropout_p:
        low = 0.0 if low is None else low
        high = 1.0 if high is None else high
        value = low + 0.3 * (high - low)
    elif low is not None and high is not None:
        value = low + 0.37 * (high - low)
    elif low is not None:
        value = low + 0.7310585786
    elif high is not None:
        value = high - 0.7310585786
    else:
        # Not a short binary fraction: multiplier * inp then never cancels another
        # low-precision input exactly (which would land on relu's kink).
        value = 0.7310585786
    if param.type == "int":
        value = int(round(value))
        if low is not None:
            value = max(value, int(low))
        if high is not None:
            value = min(value, int(high))
    return value


def params_for(op: Op, choices: dict | None = None, p: float | None = None, **overrides) -> dict:
    """Keyword params: every choice param at its default (or `choices`), scalars drawn inside
    their range; every dropout p set to `p` when given."""
    params = {}
    for param in op.spec.params:
        if isinstance(param, ChoiceParam):
            params[param.name] = (choices or {}).get(param.name, param.default)
        else:
            is_p = param.name in op.dropout_params
            params[param.name] = p if (is_p and p is not None) else scalar_value(param, is_p)
    params.update(overrides)
    return params


def choice_cases(op: Op) -> list[dict]:
    """Every choice of every choice param, the others at their defaults; [{}] without any."""
    cases = []
    for param in op.spec.choice_params:
        for choice in param.choices:
            cases.append({param.name: choice})
    return cases or [{}]


def choice_id(choices: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in choices.items()) or "-"


def with_seed(op: Op, kwargs: dict, seed=None, training=None) -> dict:
    """Add training/seed only for ops that take them."""
    kwargs = dict(kwargs)
    if op.has_dropout:
        if seed is not None:
            kwargs["seed"] = seed
        if training is not None:
            kwargs["training"] = training
    return kwargs


# ---------------------------------------------------------------------------
# Shapes and inputs


@dataclass(frozen=True)
class ShapeCase:
    """Leading dims for '...', the size of the output's last named dim, and of other named dims."""

    id: str
    lead: tuple[int, ...]
    n: int | None
    other: int = 3
    # "full": each '...' input gets all leading dims; "bcast": the first gets all, the
    # others leading 1s or none (so they broadcast against it).
    layout: str = "full"


def chunks_of(spec_input) -> int:
    return spec_input.chunks


def _named_sizes(spec: OpSpec, case: ShapeCase) -> dict[str, int]:
    out_explicit = [d for d in spec.out_dims if d != "..."]
    sizes = {}
    last_named = next((d for d in reversed(out_explicit) if d != "1"), None)
    for inp in spec.inputs:
        for d in inp.dims:
            if d not in ("...", "1") and d not in sizes:
                sizes[d] = case.n if d == last_named else case.other
    return sizes


def _size(dim: str, sizes: dict[str, int]) -> int:
    return 1 if dim == "1" else sizes[dim]


def _lead(spec: OpSpec, case: ShapeCase) -> tuple[int, ...]:
    """What '...' stands for in the output. An output that is all '...' (x: [...]) takes the
    case's N as its last dim too, unless N is None (then it is 0-d when lead is empty)."""
    if not (spec.out_dims and spec.out_dims[0] == "..."):
        return ()
    if len(spec.out_dims) == 1:
        return tuple(case.lead) + (() if case.n is None else (case.n,))
    return tuple(case.lead)


def applies(spec: OpSpec, case: ShapeCase) -> bool:
    """A case with n=None (0-d) only makes sense for specs whose output is all '...'."""
    return case.n is not None or tuple(spec.out_dims) == ("...",)


def output_shape(spec: OpSpec, case: ShapeCase, output: str | None = None) -> tuple[int, ...]:
    """The problem's shape; `output`'s, where it is concatenated from parts ([..., kN])."""
    sizes = _named_sizes(spec, case)
    shape = _lead(spec, case) + tuple(_size(d, sizes) for d in spec.out_dims if d != "...")
    parts = next((len(b.parts) for b in spec.outputs if b.name == output and b.parts), 1)
    return shape[:-1] + (shape[-1] * parts,) if parts > 1 else shape


def output_shapes(spec: OpSpec, case: ShapeCase) -> list[tuple[int, ...]]:
    """Each output's shape: one with a value per row (a per-row loss) is [..., 1]."""
    rows = ir.build_ir(spec).row_outputs
    return [output_shape(spec, case)[:-1] + (1,) if b.name in rows else output_shape(spec, case, b.name)
            for b in spec.outputs]


def input_shapes(spec: OpSpec, case: ShapeCase) -> dict[str, tuple[int, ...]]:
    sizes = _named_sizes(spec, case)
    out = output_shape(spec, case)
    shapes = {}
    ellipsis_index = 0
    for inp in spec.inputs:
        explicit = [d for d in inp.dims if d != "..."]
        own = tuple(_size(d, sizes) for d in explicit)
        if inp.chunks > 1:  # [..., 2N]: the chunks side by side along the last dim (a weight's [2N, K]: the first)
            along = len(own) - 1 if inp.chunk_dim == -1 else inp.chunk_dim
            own = own[:along] + (own[along] * inp.chunks,) + own[along + 1:]
        if inp.has_ellipsis:
            prefix = out[: len(out) - len(explicit)]
            if case.layout == "bcast" and ellipsis_index > 0 and prefix:
                prefix = (1,) * (len(prefix) - 1) + prefix[-1:] if ellipsis_index % 2 else ()
            ellipsis_index += 1
            shapes[inp.name] = tuple(prefix) + own
        else:
            shapes[inp.name] = own
    return shapes


def _break_ties(t: torch.Tensor, odd: bool) -> torch.Tensor:
    """16-bit values with the last mantissa bit forced to 1 (odd) or 0: a value of one input
    then never equals minus a value of another, so x + bias never lands exactly on a kink
    (relu at 0). A tie at the kink has its own test: here it would only add noise."""
    bits = t.view(torch.int16)
    bits = (bits | 1) if odd else (bits & ~1)
    return bits.view(t.dtype)


def make_inputs(op: Op, case: ShapeCase, dtype=torch.float32, device="cpu", seed=0, dtypes: dict | None = None):
    """Random inputs (torch.randn, never zeros) in the case's shapes; `dtypes` overrides per input."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    kinds = {i.name: i.dtype for i in op.spec.inputs}
    for index, (name, shape) in enumerate(input_shapes(op.spec, case).items()):
        if kinds[name] != "float":  # integer and bool inputs keep their own dtype
            tensors[name] = integer_values(kinds[name], shape, case.n, g).to(device)
            continue
        t = torch.randn(shape, generator=g, dtype=torch.float64).to((dtypes or {}).get(name, dtype))
        if t.dtype in LOW_PRECISION:
            t = _break_ties(t, odd=index == 0)
        tensors[name] = t.to(device)
    return tensors


def integer_values(kind: str, shape, n: int | None, generator: torch.Generator) -> torch.Tensor:
    """An integer input's values: class indices in [-1, n], a few out of [0, n) at each end
    (a spec handles those: take() picks nothing there); a bool input's, a random mask."""
    if kind == "bool":
        return torch.rand(shape, generator=generator) > 0.5
    return torch.randint(-1, (n or 1) + 1, shape, generator=generator).to(getattr(torch, kind))


def float64_copies(tensors: dict, requires_grad: dict | None = None) -> dict:
    out = {}
    for name, t in tensors.items():
        if not t.is_floating_point():  # an integer or bool input: as it is, never differentiated
            out[name] = t.detach()
            continue
        c = t.detach().to(torch.float64)
        if requires_grad and requires_grad.get(name):
            c.requires_grad_(True)
        out[name] = c
    return out


def as_tuple(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def expected_out_dtype(tensors: dict) -> torch.dtype:
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors.values() if t.is_floating_point()))


def rel_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    """‖out − truth‖ / ‖truth‖ over every element, in float64 (0 when both are empty)."""
    out, truth = out.to(torch.float64), truth.to(torch.float64)
    diff = torch.linalg.vector_norm(out - truth).item()
    norm = torch.linalg.vector_norm(truth).item()
    if norm == 0.0:
        return diff
    return diff / norm


def check_no_gradient_keeps_nothing(module, name: str, inputs: list[torch.Tensor], params: tuple = ()) -> None:
    """A call that no gradient follows (its inputs want none, torch.no_grad, out=) runs the forward
    with what it keeps for a backward left out: no buffer is made, one handed to the kernels is
    not written, and the outputs are the keeping forward's, bit for bit."""
    op, fused = getattr(module, name), module._OP
    plain = (*(t.detach() for t in inputs), *params)
    count = len(inputs)
    kept = op(*(t.detach().requires_grad_() for t in inputs), *params)  # a backward may follow it
    outputs, _, statistics = fused.forward(plain, keep=True)
    assert statistics is not None
    bare, _, none = fused.forward(plain, keep=False)
    assert none is None, "a forward no gradient follows kept a buffer"
    prepared = fused.prepare(plain)
    assert prepared is None or prepared._bare is not prepared._launch, "the eager path has no launch that keeps nothing"
    poison = torch.full_like(statistics, float("nan"))
    handed = [torch.empty_like(o) for o in outputs]
    fused.kernels.forward(fused.check(plain, needs_kernel=True), plain[:count], handed, None, statistics=poison,
                          keep=False)
    assert poison.isnan().all(), "the forward with keep off wrote into the buffer it was handed"
    with torch.no_grad():
        quiet = op(*(t.detach().requires_grad_() for t in inputs), *params)
    out = [torch.empty_like(o) for o in outputs]
    op(*plain, out=out[0] if len(out) == 1 else tuple(out))
    plainly = op(*plain)
    # The keeping forward's outputs bit for bit whichever way it is called; the forward that keeps
    # nothing is other compiled code, which may round a last bit otherwise (an H100, a hidden layer in
    # fp32: 6e-8), and bit for bit itself whichever way it is called.
    as_tuple = lambda r: tuple(r) if isinstance(r, (tuple, list)) else (r,)  # noqa: E731
    kept, bare = as_tuple(kept), as_tuple(bare)
    for got, want, keeping in zip(kept, outputs, bare):
        assert torch.equal(got.detach(), want), f"{name}: a call a gradient may follow differs from the keeping forward"
        torch.testing.assert_close(keeping, want, rtol=2 * torch.finfo(want.dtype).eps, atol=0)
    for what, results in dict(handed=handed, no_grad=quiet, out=out, plain=plainly).items():
        for got, want in zip(as_tuple(results), bare):
            difference = (got.detach().double() - want.double()).abs().max().item()
            assert torch.equal(got.detach(), want), f"{name}: the {what} forward differs from the bare one by {difference}"


def check_op_against_truth(op, truth_fn, inputs: list[torch.Tensor], params: tuple = (), what: str = "") -> None:
    """op(*inputs, *params)'s value and every input's gradient against truth_fn on fp64 copies
    (check_against_truth); in bf16, against the error of truth_fn run in bf16 (torch's own ops)."""
    dtype = inputs[0].dtype
    exact = [t.detach().double().requires_grad_() for t in inputs]
    truth = truth_fn(*exact)
    got = op(*inputs, *params)
    low = truth_fn(*[t.detach() for t in inputs]) if dtype == torch.bfloat16 else None
    check_against_truth(got, truth.detach(), low, what=f"{what} {dtype}")
    grad = torch.randn_like(truth)
    got.backward(grad.to(dtype))
    truth.backward(grad)
    low_grads = [None] * len(inputs)
    if dtype == torch.bfloat16:
        low_inputs = [t.detach().clone().requires_grad_() for t in inputs]
        truth_fn(*low_inputs).backward(grad.to(dtype))
        low_grads = [t.grad for t in low_inputs]
    for i, (t, e, lo) in enumerate(zip(inputs, exact, low_grads)):
        check_against_truth(t.grad, e.grad, lo, what=f"{what} {dtype} gradient {i}")


def check_against_truth(got: torch.Tensor, truth: torch.Tensor, low_precision_ref: torch.Tensor | None = None, what=""):
    """fp32/fp64: tight; fp16/bf16: at most 2x the error of the same computation done by
    `reference` in that dtype, plus a small floor."""
    assert got.shape == truth.shape, f"{what}: shape {tuple(got.shape)} != {tuple(truth.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN in the result ({int(torch.isnan(got).sum())} of {got.numel()})"
    err = rel_error(got, truth)
    if got.dtype in TIGHT:
        bound = TIGHT[got.dtype]
        assert err <= bound, f"{what}: relative error {err:.3g} > {bound:g} ({got.dtype})"
        # Element by element too, so that one bad element cannot hide in the norm: each
        # within bound x (its own magnitude + the rms magnitude).
        t64, g64 = truth.to(torch.float64), got.to(torch.float64)
        if t64.numel():
            rms = torch.linalg.vector_norm(t64).item() / t64.numel() ** 0.5
            diff, scale = (g64 - t64).abs(), t64.abs() + rms
            worst = torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff * float("inf")).nan_to_num(0.0).max().item()
            assert worst <= bound, f"{what}: an element is off by {worst:.3g} (relative to |truth| + rms) > {bound:g}"
    else:
        assert low_precision_ref is not None, f"{what}: a {got.dtype} result needs a low-precision reference"
        ref_err = rel_error(low_precision_ref, truth)
        bound = 2 * ref_err + FLOOR[got.dtype]
        assert err <= bound, (
            f"{what}: relative error {err:.3g} > 2 x reference's {ref_err:.3g} + {FLOOR[got.dtype]:g} ({got.dtype})"
        )
    return err


# ---------------------------------------------------------------------------
# Non-contiguous inputs with the same shapes


def non_contiguous(t: torch.Tensor, kind: str, generator: torch.Generator) -> torch.Tensor:
    """A tensor of t's shape, dtype and device laid out differently, with fresh random values."""
    shape, dtype, device = tuple(t.shape), t.dtype, t.device

    def randn(*s):
        if not dtype.is_floating_point:  # an integer or bool input: its kind of values
            return integer_values(str(dtype).removeprefix("torch."), s, max(shape[-1:] or [1]), generator).to(device)
        return torch.randn(s, generator=generator, dtype=torch.float64).to(dtype).to(device)

    if kind == "transposed" and len(shape) >= 2:
        return randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    if kind == "sliced" and len(shape) >= 1:
        return randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    if kind == "expanded" and len(shape) >= 1:
        return randn(1, *shape[1:]).expand(shape)
    return randn(*shape)


# ---------------------------------------------------------------------------
# Poisoned allocations: every float buffer the launcher allocates starts as NaN


@dataclass
class Poison:
    count: int = 0

    def install(self, monkeypatch):
        original = torch.empty

        def poisoned_empty(*args, **kwargs):
            t = original(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
                self.count += 1
            return t

        monkeypatch.setattr(torch, "empty", poisoned_empty)
        # The eager call in C++ allocates without torch.empty: none while poisoned.
        from fusegen.runtime import native
        from fusegen.runtime.prepared import PreparedCall

        native.forget_calls()
        monkeypatch.setattr(PreparedCall, "offer_native", lambda self, args: None)
        return self


# ---------------------------------------------------------------------------
# Direct kernel launches (bypassing the autotuner) with a chosen tile


def signature_has(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _arguments(op: Op, tensors: dict, params: dict, training: bool, seed) -> tuple:
    """The op's arguments in its public order (training and seed only for ops with dropout)."""
    args = [tensors[n] for n in op.input_names] + [params[p.name] for p in op.spec.params]
    return tuple(args + ([training, seed] if op.has_dropout else []))


def call_of(op: Op, tensors: dict, params: dict, training: bool = True, seed=None):
    """The op's checked arguments, as its kernels receive them."""
    return op.module._OP.check(_arguments(op, tensors, params, training, seed), needs_kernel=True)


def _seed_of(call):
    """The seed tensor the op's launcher would pass (None without dropout)."""
    return runtime.seed_tensor(call.seed, call.problem.device) if call.has_dropout else None


@contextlib.contextmanager
def _poisoned_empty():
    """Every float buffer torch.empty makes starts as NaN: an element the kernel leaves unwritten shows."""
    original = torch.empty

    def poisoned(*args, **kwargs):
        t = original(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = original


def launch_forward(op: Op, tensors: dict, params: dict, seed: int, block_m: int, block_n: int, training=True):
    """Run the forward kernel itself (not the autotuner) with one tile shape; returns the outputs."""
    call = call_of(op, tensors, params, training, seed)
    problem = call.problem
    outputs = [
        torch.full(problem.shape, float("nan"), dtype=problem.out_dtype, device=problem.device) for _ in op.output_names
    ]
    inputs = tuple(tensors[n] for n in op.input_names)
    op.module._OP.kernels.forward(call, inputs, outputs, _seed_of(call), tile=(block_m, block_n))
    return outputs


def launch_backward(op: Op, grads_out: dict, tensors: dict, params: dict, seed: int, block_m: int, block_n: int,
                    rows_per_program: int, training=True):
    """Run the backward kernel itself with one tile shape; returns {input name: gradient} for the
    inputs whose gradient the kernel computes (pass-through gradients are not the kernel's)."""
    fused = op.module._OP
    call = call_of(op, tensors, params, training, seed)
    needs = [through is None for through in fused._passthrough]
    inputs = tuple(tensors[n] for n in op.input_names)
    grads = tuple(grads_out[n] for n in op.output_names)
    with _poisoned_empty():
        results = fused.kernels.backward(
            call, inputs, grads, needs, _seed_of(call), tile=(block_m, block_n), rows_per_program=rows_per_program
        )
    names = [n for n, need in zip(op.input_names, needs) if need]
    return dict(zip(names, results))
