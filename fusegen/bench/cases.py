"""What `fusegen bench` runs: the op (its spec and generated module), shapes, the bytes model, cases.

Bandwidth is judged against a bytes model derived from the spec: each input read once at
its own size (broadcast inputs counted once), each output written once. The ceiling is
a device-to-device copy measured in the same run (bytes read + written).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from ..errors import SpecError
from ..spec import ELLIPSIS, InputSpec, OpSpec, find_spec, load_spec
from .arguments import DTYPE_NAMES

DROPOUT_SEED = 20240607  # one fixed seed, so all three providers draw the same mask


# ---------------------------------------------------------------------------
# Finding the op: its spec (for dims and params) and its generated module


@dataclass(frozen=True)
class BenchOp:
    name: str
    spec: OpSpec
    module: Any
    op: Callable
    reference: Callable
    eager: Callable
    dropout_params: tuple[str, ...]  # the scalar params that are dropout probabilities
    has_dropout: bool  # the op takes training= and seed=
    mean_loss: bool = False  # one output, the mean of a per-row loss: a 0-d tensor (MEAN_LOSSES)
    # The op built by other backends (`fusegen bench --backend cuda`), each its provider's name
    # ("fusegen-cuda") → its function, timed beside the generated module's.
    twins: tuple[tuple[str, Callable], ...] = ()

    @property
    def differentiable(self) -> bool:
        """Some output has a gradient: not a forward-only op (a float8 q and its scale)."""
        return any(output.differentiable for output in self.spec.outputs)


def import_generated(name: str, generated_dir: Path):
    """Import `<generated_dir>.<name>` (normally `generated.<name>`) with its parent on sys.path."""
    package_dir = generated_dir.resolve()
    if not (package_dir / f"{name}.py").is_file():
        raise SpecError(str(generated_dir / f"{name}.py"), None, "no generated module: run `fusegen build` first")
    parent = str(package_dir.parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    return importlib.import_module(f"{package_dir.name}.{name}")


def _generated_spec_sha(module) -> str | None:
    header = Path(module.__file__).read_text(encoding="utf-8").splitlines()[:5]
    for line in header:
        if line.startswith("# spec sha256:"):
            return line.split(":", 1)[1].strip()
    return None


@functools.lru_cache(maxsize=64)
def _ir_of(spec: OpSpec):
    """The spec's IR, parsed once per spec (shapes, flops and outputs all ask it)."""
    from .. import ir  # the IR parse is the one authority on what the spec names

    return ir.build_ir(spec)


def dropout_param_names(spec: OpSpec) -> tuple[str, ...]:
    """The params that some dropout(...) in the spec takes as its probability."""
    names: list[str] = []
    for dropout in _ir_of(spec).dropouts:
        if dropout.p not in names:
            names.append(dropout.p)
    return tuple(names)


def _mean_cross_entropy(x, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0):
    """The mean loss as a PyTorch user writes it (what torch.compile gets): F.cross_entropy's
    default reduction, with Gemma 2's capping before it and PaLM's z-loss beside it."""
    import torch.nn.functional as F

    logits = x.reshape(-1, x.shape[-1])
    target = target.reshape(-1)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing)
    if z_loss:
        lse = torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        loss = loss + z_loss * torch.where(target == ignore_index, 0.0, lse * lse).sum() / (target != ignore_index).sum()
    return loss


# Loss ops also benched as their peers return them by default (Liger's LigerCrossEntropyLoss,
# F.cross_entropy): `<op>_mean` is the per-row loss (the op's first output) averaged over the
# rows whose target is not ignore_index, a 0-d tensor; its backward starts from 1.0, as
# loss.backward() does. The value: the eager baseline of that mean.
MEAN_LOSSES: dict[str, Callable] = {"cross_entropy": _mean_cross_entropy}


def _mean_of(per_row: Callable) -> Callable:
    def mean(x, target, *args, **kwargs):
        ignore_index = kwargs.get("ignore_index", args[0] if args else -100)
        loss = per_row(x, target, *args, **kwargs)[0]
        return loss.sum() / (target != ignore_index).sum()

    return mean


def build_twin(spec_path: Path, backend: str, folder: Path) -> Callable:
    """The spec's op built by `backend` as `<op>_<backend>` in `folder` (its library ops beside the
    generated module's), imported: its function."""
    from .. import cli

    built = cli.build_op(spec_path, backend, name=f"{load_spec(spec_path).name}_{backend}")
    for file, text in built.files.items():
        (folder / file).write_text(text, encoding="utf-8")
    module_spec = importlib.util.spec_from_file_location(built.spec.name, folder / f"{built.spec.name}.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, built.spec.name)


def load_bench_op(spec_or_name: str, specs_dir: Path, generated_dir: Path, command: str = "bench",
                  backends: Sequence[str] = (), twins_dir: Path | None = None) -> BenchOp:
    """The op of the generated module, and (`backends`) its twins built by those backends into
    `twins_dir`."""
    base = spec_or_name.removesuffix("_mean")
    if base != spec_or_name and base in MEAN_LOSSES:
        op = load_bench_op(base, specs_dir, generated_dir, command, backends, twins_dir)
        spec = replace(op.spec, name=spec_or_name, outputs=op.spec.outputs[:1])
        return replace(op, name=spec_or_name, spec=spec, op=_mean_of(op.op), reference=_mean_of(op.reference),
                       eager=MEAN_LOSSES[base], mean_loss=True,
                       twins=tuple((name, _mean_of(twin)) for name, twin in op.twins))
    spec_path = find_spec(spec_or_name, specs_dir)
    op_spec = load_spec(spec_path)
    module = import_generated(op_spec.name, generated_dir)
    if _generated_spec_sha(module) not in (None, op_spec.sha256):
        # Benchmarking a module built from another version of the spec measures the wrong op.
        print(f"fusegen {command}: warning: {module.__file__} was built from another version of "
              f"{spec_path}; run `fusegen build`", file=sys.stderr)
    op = getattr(module, op_spec.name)
    return BenchOp(
        name=op_spec.name,
        spec=op_spec,
        module=module,
        op=op,
        reference=module.reference,
        eager=module.eager,
        dropout_params=dropout_param_names(op_spec),
        has_dropout="training" in inspect.signature(op).parameters,
        twins=tuple((f"fusegen-{backend}", build_twin(spec_path, backend, twins_dir)) for backend in backends),
    )


# ---------------------------------------------------------------------------
# Shapes and the bytes model


def hidden_dim_name(out_dims: Sequence[str]) -> str | None:
    """The output's last named dim: the one that becomes H.

    The output's dims are the inputs' value dims broadcast (OpSpec.out_dims), so none is chunked.
    """
    for dim in reversed(out_dims):
        if dim not in (ELLIPSIS, "1"):
            return dim
    return None


def shape_for_dims(dims: Sequence[str], bsh: tuple[int, ...], hidden: str | None,
                   contraction: str | None = None, rank: str | None = None) -> tuple[int, ...]:
    """Map spec dims to sizes: '...' → (B, S), the hidden dim → H, a matmul's dim summed over
    (`contraction`) → K (bsh (B, S, K, H); K is H in (B, S, H)), a low-rank product's inner dim
    (`rank`) → R (bsh (B, S, K, H, R)), other names → B·S, '1' → 1. An op with no named dim
    (gelu's x: [...]) has '...' stand for all of (B, S, H)."""
    b, s = bsh[0], bsh[1]
    h = bsh[3] if len(bsh) > 3 else bsh[2]
    k = bsh[2] if len(bsh) > 3 else h
    r = bsh[4] if len(bsh) > 4 else None
    shape: list[int] = []
    for dim in dims:
        if dim == ELLIPSIS:
            shape += [b, s] if hidden is not None else [b, s, h]
        elif dim == "1":
            shape.append(1)
        else:
            shape.append(h if dim == hidden else k if dim == contraction else r if dim == rank and r else b * s)
    return tuple(shape)


def contraction_dim(spec: OpSpec) -> str | None:
    """The dim an op's matmul sums over (x [..., K]'s K), or None without a matmul."""
    matmul = _ir_of(spec).matmul
    return None if matmul is None else next(i.dims[-1] for i in spec.inputs if i.name == matmul.a)


def rank_dim(spec: OpSpec) -> str | None:
    """The inner dim of a chain of two matmuls, R of BxSxKxHxR: a low-rank product's (lora_a
    [R, K]'s R) or a hidden layer's width (w1 [H, K]'s H); None without one."""
    matmul = _ir_of(spec).matmul
    if matmul is None or (matmul.lowrank is None and matmul.hidden is None):
        return None
    if matmul.hidden is not None:
        first, transposed = matmul.hidden.weight, matmul.hidden.transposed
    else:
        first, transposed = matmul.lowrank.down, matmul.lowrank.down_transposed
    return next(i for i in spec.inputs if i.name == first).dims[0 if transposed else 1]


def input_shape(inp: InputSpec, bsh: tuple[int, ...], hidden: str | None,
                contraction: str | None = None, rank: str | None = None) -> tuple[int, ...]:
    """An input's sizes: its value dims mapped, the last one times its chunks ([..., 2N] → (B, S, 2·H);
    a matmul's weight [2N, K], the first)."""
    shape = shape_for_dims(inp.dims, bsh, hidden, contraction, rank)
    if inp.chunks == 1:
        return shape
    along = len(shape) - 1 if inp.chunk_dim == -1 else inp.chunk_dim
    return shape[:along] + (inp.chunks * shape[along],) + shape[along + 1:]


def input_shapes(spec: OpSpec, bsh: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
    problem = shape_problem(spec, bsh)
    if problem:  # command.run_bench refuses such a run first
        raise ValueError(problem)
    hidden, contraction, rank = hidden_dim_name(spec.out_dims), contraction_dim(spec), rank_dim(spec)
    return {inp.name: input_shape(inp, bsh, hidden, contraction, rank) for inp in spec.inputs}


def shape_problem(spec: OpSpec, bsh: tuple[int, ...]) -> str | None:
    """Why `bsh` cannot be this op's shape (one line), or None: BxSxKxH needs a matmul whose K
    is a dim of its own (a [N, N] weight's K is H); BxSxKxHxR, a low-rank product, which needs it."""
    shown = "x".join(map(str, bsh))
    rank = rank_dim(spec)
    if rank is not None and len(bsh) != 5:
        return (f"shape {shown}: {spec.name} has a chain of two matmuls; give its inner dim too (a low-rank "
                "product's rank, a hidden layer's width), as BxSxKxHxR")
    if len(bsh) == 5 and rank is None:
        return (f"shape {shown} is BxSxKxHxR, for ops with a low-rank product or a hidden layer; {spec.name} "
                "has neither")
    if len(bsh) < 4:
        return None
    contraction = contraction_dim(spec)
    if contraction is None:
        return f"shape {shown} is BxSxKxH, for ops with a matmul; {spec.name} has none"
    if contraction == hidden_dim_name(spec.out_dims) and bsh[2] != bsh[3]:
        return f"shape {shown}: {spec.name}'s matmul sums over its output's dim {contraction}, so K must be H"
    return None


def output_shape(spec: OpSpec, bsh: tuple[int, int, int], output: str | None = None) -> tuple[int, ...]:
    """The problem's shape; `output`'s, where it is concatenated from parts ([..., kN])."""
    shape = shape_for_dims(spec.out_dims, bsh, hidden_dim_name(spec.out_dims))
    parts = next((len(b.parts) for b in spec.outputs if b.name == output and b.parts), 1)
    return shape[:-1] + (shape[-1] * parts,) if parts > 1 else shape


def output_shapes(spec: OpSpec, bsh: tuple[int, int, int]) -> list[tuple[int, ...]]:
    """Each output's shape: an output with one value per row (a per-row loss) is [..., 1]."""
    rows = _ir_of(spec).row_outputs
    return [output_shape(spec, bsh)[:-1] + (1,) if b.name in rows else output_shape(spec, bsh, b.name)
            for b in spec.outputs]


def bench_output_shapes(bench_op: BenchOp, bsh: tuple[int, int, int]) -> list[tuple[int, ...]]:
    """Each output's shape as the bench's providers return it: a mean loss is 0-d."""
    return [()] if bench_op.mean_loss else output_shapes(bench_op.spec, bsh)


@dataclass(frozen=True)
class BytesModel:
    """The least traffic the op needs: inputs read once, outputs written once."""

    read: int
    written: int
    output_elements: int  # over all outputs
    matmul_flops: int = 0  # an op with a matmul: the forward's 2·M·K·(the product's width), and a low-rank product's

    @property
    def total(self) -> int:
        return self.read + self.written


def bytes_model(spec: OpSpec, bsh: tuple[int, int, int], dtype: torch.dtype) -> BytesModel:
    """All float inputs share `dtype`, so every output has it too (torch's promotion of equal
    dtypes) unless it declares its own (an fp8 `q`, an fp32 `scale`); an integer input is
    read in its own."""
    itemsize = dtype.itemsize
    sizes = {i.name: itemsize if i.dtype == "float" else getattr(torch, i.dtype).itemsize for i in spec.inputs}
    read = sum(math.prod(shape) * sizes[name] for name, shape in input_shapes(spec, bsh).items())
    elements = [math.prod(shape) for shape in output_shapes(spec, bsh)]
    out_sizes = [getattr(torch, b.dtype).itemsize if b.dtype else itemsize for b in spec.outputs]
    flops = 0
    contraction = contraction_dim(spec)
    if contraction is not None:  # the product [M, width]: the matmul's right operand's other dim, all its chunks
        matmul, shapes = _ir_of(spec).matmul, input_shapes(spec, bsh)
        a, b = shapes[matmul.a], shapes[matmul.b]
        width = b[0] if matmul.transposed else b[1]
        flops = 2 * math.prod(a[:-1]) * a[-1] * width
        if matmul.hidden is not None:  # f(x @ w1) @ b: M·K·H, then M·H·N multiply-adds
            first = shapes[matmul.hidden.weight]
            hidden = first[0] if matmul.hidden.transposed else first[1]
            flops = 2 * math.prod(a[:-1]) * hidden * (a[-1] + width)
        if matmul.lowrank is not None:  # (x @ down) @ up: M·K·R, then M·R·N multiply-adds
            down = shapes[matmul.lowrank.down]
            rank = down[0] if matmul.lowrank.down_transposed else down[1]
            flops += 2 * math.prod(a[:-1]) * rank * (a[-1] + width)
    return BytesModel(read=read, written=sum(e * size for e, size in zip(elements, out_sizes)),
                      output_elements=sum(elements), matmul_flops=flops)


def op_kwargs(bench_op: BenchOp, p: float | None) -> dict[str, Any]:
    """Params beyond the tensors: dropout probabilities set to p, a fixed seed; the rest keep their defaults."""
    if not bench_op.has_dropout:
        return {}
    kwargs: dict[str, Any] = {name: p for name in bench_op.dropout_params}
    kwargs.update(training=True, seed=DROPOUT_SEED)  # p > 0 needs training; p == 0 runs no RNG anyway
    return kwargs


def make_inputs(spec: OpSpec, bsh, dtype: torch.dtype, device, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Random normal inputs (never zeros: a kernel must not get to skip work on them); an
    integer input holds class indices along the last dim of the output (a target), a bool one
    a random mask."""
    hidden = shape_for_dims(spec.out_dims, bsh, hidden_dim_name(spec.out_dims))[-1:] or (1,)
    kinds = {i.name: i.dtype for i in spec.inputs}
    tensors = []
    for name, shape in input_shapes(spec, bsh).items():
        if kinds[name] == "bool":
            tensors.append(torch.rand(shape, device=device, generator=generator) > 0.5)
        elif kinds[name] != "float":
            tensors.append(torch.randint(0, hidden[0], shape, dtype=getattr(torch, kinds[name]), device=device,
                                         generator=generator))
        else:
            tensors.append(torch.randn(shape, dtype=dtype, device=device, generator=generator))
    return tensors


# ---------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    op: str
    dtype: torch.dtype
    bsh: tuple[int, int, int]
    p: float | None  # None: the op has no dropout

    @property
    def label(self) -> str:
        p = "" if self.p is None else f" p={self.p:g}"
        return f"{self.op} {DTYPE_NAMES.get(self.dtype, str(self.dtype))} {'x'.join(map(str, self.bsh))}{p}"


def plan_cases(ops: Iterable[BenchOp], dtypes, shapes, ps) -> list[Case]:
    """op × dtype × shape × p; an op without dropout runs once per shape, with p None."""
    cases = []
    for bench_op in ops:
        op_ps = list(ps) if bench_op.has_dropout else [None]
        for dtype in dtypes:
            for p in op_ps:
                for bsh in shapes:
                    cases.append(Case(bench_op.name, dtype, tuple(bsh), p))
    return cases
