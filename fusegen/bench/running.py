"""Running the cases of `fusegen bench`: the providers, and each case timed on each of them.

For every case (op × dtype × shape × p) three providers run the same computation:

- fusegen: the generated Triton op,
- eager:   the generated `eager`: the spec as a PyTorch user writes it (F.gelu, F.silu,
  torch's own F.dropout), independent of the kernel and of sympy,
- compile: torch.compile(eager, dynamic=False), compiled afresh for each case;

and for an op with a matmul, compile-max-autotune (Inductor's matmul templates, the epilogue
fused in) and matmul (the matmul alone, forward only).

With dropout the baselines draw torch's own masks (the same distribution, other values),
so they do the work a user's code does.

Peers (fusegen.bench.peers: Liger-Kernel) run after them, timed the same way, for the ops
they have a counterpart of; each peer's first call is checked against fusegen's outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .arguments import DTYPE_NAMES
from .cases import BenchOp, Case, bench_output_shapes, make_inputs, op_kwargs, rank_dim
from .peers import Peer, check_first_call, fusegen_outputs, peer_providers
from .timing import (
    Measurement,
    describe_error,
    host_overhead_us,
    is_timeout,
    measure,
    peak_memory_bytes,
    release_memory,
    time_fn_device,
    time_limit,
)

PROVIDERS = ("fusegen", "eager", "compile")
HOST_OVERHEAD_SHAPE = (1, 1, 8)  # (B, S, H): a launch whose GPU work is negligible
HOST_OVERHEAD_RANK = 4  # and the rank of an op with a low-rank product: (B, S, K, H, R) = (1, 1, 8, 8, 4)


def host_overhead_shape(spec) -> tuple[int, ...]:
    if rank_dim(spec) is None:
        return HOST_OVERHEAD_SHAPE
    return (*HOST_OVERHEAD_SHAPE, HOST_OVERHEAD_SHAPE[-1], HOST_OVERHEAD_RANK)


@dataclass
class ProviderResult:
    provider: str
    forward: Measurement
    forward_backward: Measurement | None = None  # None when --backward was not asked for


class TimeoutMemo:
    """Providers whose first call timed out, so that later cases skip them instead of waiting again.

    Keyed by (op, dropout on, provider, phase): with dynamic=False every shape and dtype
    compiles afresh, and what made one compile run away (e.g. the Philox graph of the
    eager dropout) is there in the next. A forward timeout skips fwd+bwd too.
    """

    def __init__(self):
        self.reasons: dict[tuple, str] = {}

    @staticmethod
    def _key(op: str, p: float | None, provider: str, phase: str) -> tuple:
        return (op, bool(p), provider, phase)

    def skip_reason(self, op: str, p: float | None, provider: str, phase: str) -> str | None:
        return self.reasons.get(self._key(op, p, provider, phase))

    def record(self, op: str, p: float | None, provider: str, phase: str, measurement: Measurement) -> None:
        if not measurement.timed_out:
            return
        reason = "skipped: its first call timed out on an earlier case"
        for skipped_phase in (("forward", "forward_backward") if phase == "forward" else (phase,)):
            self.reasons.setdefault(self._key(op, p, provider, skipped_phase), reason)


def make_providers(bench_op: BenchOp) -> dict[str, Callable]:
    """The three providers, and the op's twins by other backends after fusegen's own (--backend);
    compile is a fresh torch.compile, with dynamo state reset first. An op with a matmul has two
    more (MATMUL_PROVIDERS)."""
    torch._dynamo.reset()  # no guards or recompile counts carried over from earlier cases
    # The baselines are the op as a PyTorch user writes it (the generated `eager`: F.gelu,
    # torch's own dropout), not `reference`, whose bit-exact host Philox is a test oracle:
    # ~290 small kernels eagerly, and a graph inductor does not finish compiling.
    providers = {
        "fusegen": bench_op.op,
        **dict(bench_op.twins),  # the op built by other backends (--backend), beside it
        "eager": bench_op.eager,
        "compile": torch.compile(bench_op.eager, dynamic=False),
    }
    matmul = bench_op.module._OP.matmul
    if matmul is not None:
        providers["compile-max-autotune"] = torch.compile(bench_op.eager, mode="max-autotune-no-cudagraphs",
                                                          dynamic=False)
        providers["matmul"] = _bare_matmul(bench_op, matmul)
    return providers


# With a matmul: Inductor's autotuned matmul templates with the epilogue fused in, and the
# matmul alone (cuBLAS through torch.matmul: the floor a fused epilogue is judged against,
# forward only: its output is the product, not the op's).
MATMUL_PROVIDERS = ("compile-max-autotune", "matmul")
FORWARD_ONLY = frozenset({"matmul"})


def provider_names(bench_op: BenchOp) -> tuple[str, ...]:
    matmul = MATMUL_PROVIDERS if bench_op.module._OP.matmul is not None else ()
    return PROVIDERS[:1] + tuple(name for name, _ in bench_op.twins) + PROVIDERS[1:] + matmul


def _bare_matmul(bench_op: BenchOp, matmul) -> Callable:
    """The product alone; with a hidden layer, its two matmuls (the layer's function left out)."""
    names = [i.name for i in bench_op.spec.inputs]
    a, b = names.index(matmul.a), names.index(matmul.b)
    hidden = matmul.hidden
    first = names.index(hidden.weight) if hidden else None

    def product(*inputs, **kwargs):
        left = inputs[a]
        if hidden is not None:
            left = left @ (inputs[first].mT if hidden.transposed else inputs[first])
        return left @ (inputs[b].mT if matmul.transposed else inputs[b])

    return product


def _as_tuple(outputs) -> tuple[torch.Tensor, ...]:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def forward_fn(provider: Callable, inputs: Sequence[torch.Tensor], kwargs: dict) -> Callable[[], Any]:
    return lambda: provider(*inputs, **kwargs)


def forward_backward_fn(provider: Callable, inputs: Sequence[torch.Tensor], kwargs: dict,
                        grad_outputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        outputs = _as_tuple(provider(*inputs, **kwargs))
        torch.autograd.backward(outputs, grad_tensors=list(grad_outputs))

    return step


def check_peers(bench_op: BenchOp, peers: dict[str, Callable], inputs: Sequence[torch.Tensor], kwargs: dict,
                first_call_timeout_s: float = 0.0) -> dict[str, Measurement]:
    """The peers whose first call fails or disagrees with fusegen's outputs, with the error
    that stands in for their timings. fusegen's outputs are held only while checking."""
    if not peers:
        return {}
    expected = fusegen_outputs(bench_op, inputs, kwargs)
    output_names = [binding.name for binding in bench_op.spec.outputs]
    failed = {}
    for name, fn in peers.items():
        failure = check_first_call(forward_fn(fn, inputs, kwargs), expected, output_names, first_call_timeout_s)
        if failure is not None:
            failed[name] = failure
    del expected
    return failed


def run_case(bench_op: BenchOp, case: Case, backward: bool, device="cuda",
             timer: Callable = time_fn_device, peak: Callable = peak_memory_bytes,
             first_call_timeout_s: float = 0.0, memo: TimeoutMemo | None = None,
             peers: Sequence[Peer] = ()) -> list[ProviderResult]:
    """All providers on one case: forward for each, then (with backward) forward+backward for each.

    Peers come after the three; one that fails its first-call check gets that error as both
    its forward and its forward+backward result, and is not timed.
    """
    memo = memo if memo is not None else TimeoutMemo()
    inputs = make_inputs(bench_op.spec, case.bsh, case.dtype, device)
    kwargs = op_kwargs(bench_op, case.p)
    providers = make_providers(bench_op)
    failed: dict[str, Measurement] = {}  # peers that failed their first-call check

    def run(name: str, phase: str, fn: Callable, grad_to_none=None) -> Measurement:
        if name in failed:
            return failed[name]
        reason = memo.skip_reason(case.op, case.p, name, phase)
        if reason:
            return Measurement(error=reason)
        measurement = measure(fn, grad_to_none, timer=timer, peak=peak, first_call_timeout_s=first_call_timeout_s)
        memo.record(case.op, case.p, name, phase, measurement)
        return measurement

    results = {
        name: ProviderResult(name, run(name, "forward", forward_fn(fn, inputs, kwargs)))
        for name, fn in providers.items()
    }
    peer_fns = peer_providers(bench_op, peers)
    if peer_fns:  # checked after the three, so that fusegen's first call ran under its time limit
        failed.update(check_peers(bench_op, {name: fn for name, fn in peer_fns.items()
                                             if not memo.skip_reason(case.op, case.p, name, "forward")},
                                  inputs, kwargs, first_call_timeout_s))
        for name, failure in failed.items():
            memo.record(case.op, case.p, name, "forward", failure)
        for name, fn in peer_fns.items():
            results[name] = ProviderResult(name, run(name, "forward", forward_fn(fn, inputs, kwargs)))
        providers = {**providers, **peer_fns}
    if backward and bench_op.differentiable:  # a forward-only op's fwd+bwd cells stay empty
        for tensor in inputs:
            tensor.requires_grad_(tensor.is_floating_point())  # an integer input (a target) takes none
        # A mean loss's backward starts from 1.0, as loss.backward() does (peers skip a multiply then).
        make = torch.ones if bench_op.mean_loss else torch.randn
        grad_outputs = [make(shape, dtype=case.dtype, device=device) for shape in bench_output_shapes(bench_op, case.bsh)]
        for name, fn in providers.items():
            if name in FORWARD_ONLY:
                results[name].forward_backward = Measurement(error="forward only (the matmul alone)")
                continue
            step = forward_backward_fn(fn, inputs, kwargs, grad_outputs)
            results[name].forward_backward = run(name, "forward_backward", step, grad_to_none=inputs)
        del grad_outputs
    del inputs, providers
    release_memory()
    return list(results.values())


def measure_host_overhead(bench_op: BenchOp, dtype: torch.dtype, p: float | None, device="cuda",
                          synchronize: Callable[[], None] = torch.cuda.synchronize,
                          first_call_timeout_s: float = 0.0, memo: TimeoutMemo | None = None,
                          peers: Sequence[Peer] = ()) -> list[dict[str, Any]]:
    """One row per provider (peers included): µs per call on a tiny input, or why there is none."""
    memo = memo if memo is not None else TimeoutMemo()
    inputs = make_inputs(bench_op.spec, host_overhead_shape(bench_op.spec), dtype, device)
    kwargs = op_kwargs(bench_op, p)
    peer_fns = {name: fn for name, fn in peer_providers(bench_op, peers).items()
                if not memo.skip_reason(bench_op.name, p, name, "forward")}
    failed = check_peers(bench_op, peer_fns, inputs, kwargs, first_call_timeout_s)
    rows = []
    for name, provider in {**make_providers(bench_op), **peer_providers(bench_op, peers)}.items():
        row: dict[str, Any] = {"op": bench_op.name, "dtype": DTYPE_NAMES.get(dtype, str(dtype)), "p": p,
                               "provider": name, "us_per_call": None, "error": None}
        fn = forward_fn(provider, inputs, kwargs)
        row["error"] = failed[name].error if name in failed else memo.skip_reason(bench_op.name, p, name, "forward")
        if row["error"] is None:
            try:
                with time_limit(first_call_timeout_s, "the first call"):
                    fn()
                row["us_per_call"] = host_overhead_us(fn, synchronize=synchronize)
            except Exception as exc:
                row["error"] = "timed out" if is_timeout(exc) else describe_error(exc)
        rows.append(row)
    return rows
