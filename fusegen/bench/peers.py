"""Peers of `fusegen bench`: other kernel libraries timed beside eager and torch.compile.

A peer is one registry entry (Peer): its package, the version its adapters were checked
against, and per fusegen op name an adapter. An adapter takes the op's inputs as the bench
makes them (spec order, chunked inputs whole) and every spec param as a keyword (the
spec's defaults filled in by peer_provider), and calls the peer's own autograd Function.
An op is mapped only where the peer computes the spec's math: same eps, no weight offset,
the same outputs in the same order. A peer that is not installed is skipped with a note.

Before a peer is timed on a case its first call's outputs are compared with fusegen's
(check_first_call): a mapping that computes something else is an error row, not a time.

Liger-Kernel and peft are the peers now; another (QuACK, Hugging Face `kernels`) is one more
Peer in PEERS.
"""
from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from .arguments import DTYPE_NAMES
from .timing import Measurement, describe_error, is_timeout, time_limit


class NoCounterpart(Exception):
    """The peer has no kernel for these param values (e.g. exact GELU where it has tanh only)."""


@dataclass(frozen=True)
class Peer:
    name: str  # the provider's name in rows, tables and JSON
    package: str  # what is imported
    distribution: str  # what pip installs, and whose version is recorded
    checked_version: str  # the version whose source the adapters were checked against
    adapters: Mapping[str, Callable[..., Any]] = field(default_factory=dict)  # fusegen op name → adapter


@dataclass(frozen=True)
class PeerStatus:
    """A peer as found in this environment, for one run's ops."""

    peer: Peer
    version: str | None  # None: not importable
    ops: tuple[str, ...]  # the run's ops that the peer has an adapter for
    note: str | None  # why it is skipped, or what to keep in mind; None when all is as checked

    @property
    def available(self) -> bool:
        return self.version is not None

    def metadata(self) -> dict[str, Any]:
        return {"name": self.peer.name, "package": self.peer.distribution, "version": self.version,
                "checked_version": self.peer.checked_version, "ops": list(self.ops), "note": self.note}

    def line(self) -> str:
        """One line for the printed report."""
        if self.note and not self.available:
            return f"peer {self.peer.name}: {self.note}"
        ops = ", ".join(self.ops) if self.ops else "no counterpart of these ops"
        text = f"peer {self.peer.name} {self.version}: {ops}"
        return f"{text} ({self.note})" if self.note else text


# ---------------------------------------------------------------------------
# Liger-Kernel (pip install liger-kernel), checked against 0.8.5's source.
#
# fusegen's ops load every input in fp32, compute in fp32 and round once on store. Liger's
# RMSNorm casting_mode "gemma" does the same ("llama" would round x * rstd to the input
# dtype before the weight), offset 0.0 is the spec's plain weight. in_place=False: the
# backward leaves the incoming gradient alone, as fusegen's default (inplace_backward=False)
# does, and the bench reuses that gradient on every run.


def _liger_rmsnorm(x, weight, *, eps):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "gemma", False)


def _liger_add_rmsnorm(x, residual, weight, *, eps):
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    y, h = LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, 0.0, "gemma", False)
    return h, y  # Liger returns (normed, sum); the spec's outputs are (h, y)


def _liger_layernorm(x, weight, bias, *, eps):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return LigerLayerNormFunction.apply(x, weight, bias, eps)


def _liger_softmax(x):
    from liger_kernel.ops.softmax import LigerSoftmaxFunction

    return LigerSoftmaxFunction.apply(x)


def _liger_squared_relu(x):
    from liger_kernel.ops.relu_squared import LigerReLUSquaredFunction

    return LigerReLUSquaredFunction.apply(x)


def _liger_swiglu(x):
    # The fused gate-up Function reads both halves of the one [..., 2N] tensor: no split, no
    # copy. It is given x as 2-D (a view): its 0.8.5 backward returns the gradient as
    # [rows, 2N], which autograd refuses for a 3-D input.
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    rows = x.reshape(-1, x.shape[-1])
    return LigerFusedGateUpSiLUMulFunction.apply(rows, False).view(*x.shape[:-1], x.shape[-1] // 2)


def _liger_geglu(x, *, activation):
    if activation != "gelu_tanh":
        raise NoCounterpart(f"liger_kernel's GELU-mul is the tanh approximation only, not activation={activation!r}")
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    # Liger takes the halves as two tensors: the split views are not contiguous, so its
    # ensure_contiguous copies each half (2N read, 2N written) before the kernel, and autograd
    # writes the halves' gradients back into one [..., 2N] gradient after it. Those copies are
    # part of its time: they are what calling it on this layout costs. (With one row the halves
    # are contiguous views, not copies, and its backward writes the gradients into x itself.)
    gate, up = x.chunk(2, dim=-1)
    return LigerGELUMulFunction.apply(gate, up)


def _liger_cross_entropy_mean(x, target, *, ignore_index, label_smoothing, z_loss, softcap):
    # LigerCrossEntropyFunction.apply(input, target, weight, ignore_index, lse_square_scale,
    # label_smoothing, reduction, softcap, return_z_loss, ...): its forward computes the loss
    # and writes the logits' gradient into the logits (Liger's own in-place trick); its backward
    # only scales that by the incoming gradient, and not at all for 1.0. Its first result is the
    # loss (later versions add more results after it). z_loss is lse_square_scale * lse**2
    # added to each non-ignored row's loss, as the spec's.
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    result = LigerCrossEntropyFunction.apply(x.reshape(-1, x.shape[-1]), target.reshape(-1), None, ignore_index,
                                             z_loss, label_smoothing, "mean", softcap or None, False)
    return result[0]


LIGER = Peer(
    name="liger_kernel",
    package="liger_kernel",
    distribution="liger-kernel",
    checked_version="0.8.5",
    adapters={
        "rmsnorm": _liger_rmsnorm,
        "add_rmsnorm": _liger_add_rmsnorm,
        "layernorm": _liger_layernorm,
        "softmax": _liger_softmax,
        "squared_relu": _liger_squared_relu,
        "swiglu": _liger_swiglu,
        "geglu": _liger_geglu,
        "cross_entropy_mean": _liger_cross_entropy_mean,
    },
)


# ---------------------------------------------------------------------------
# peft (pip install peft), checked against 0.21.2's source: its LoRA layer on an nn.Linear,
# base_layer(x) + lora_B(lora_A(dropout(x))) * scaling, lora_dropout 0 (an Identity). The
# layer is made once per set of tensors (peft.inject_adapter_in_model on a meta nn.Linear),
# its weights then replaced by the bench's tensors themselves, so that autograd reaches them
# as it reaches fusegen's inputs; scaling is the spec's scale.

_PEFT_LAYER: list = []  # the last (tensors, scale, layer): one per case, made outside the timed calls


def _peft_layer(weight, bias, lora_a, lora_b, scale):
    tensors = (weight, bias, lora_a, lora_b)
    if _PEFT_LAYER and all(a is b for a, b in zip(_PEFT_LAYER[0][0], tensors)) and _PEFT_LAYER[0][1] == scale:
        return _PEFT_LAYER[0][2]
    import peft

    (n, k), r = weight.shape, lora_a.shape[0]
    holder = torch.nn.Module()
    holder.base = torch.nn.Linear(k, n, device="meta")
    peft.inject_adapter_in_model(peft.LoraConfig(r=r, lora_alpha=r, target_modules=["base"]), holder)
    layer = holder.base
    layer.scaling["default"] = scale
    for module, name, value in ((layer.base_layer, "weight", weight), (layer.base_layer, "bias", bias),
                                (layer.lora_A["default"], "weight", lora_a), (layer.lora_B["default"], "weight", lora_b)):
        delattr(module, name)  # a parameter no more: the tensor itself, as F.linear reads it
        setattr(module, name, value)
    _PEFT_LAYER[:] = [(tensors, scale, layer)]
    return layer


def _peft_lora_linear(x, weight, bias, lora_a, lora_b, *, scale):
    return _peft_layer(weight, bias, lora_a, lora_b, scale)(x)


PEFT = Peer(
    name="peft",
    package="peft",
    distribution="peft",
    checked_version="0.21.2",
    adapters={"lora_linear": _peft_lora_linear},
)

PEERS: tuple[Peer, ...] = (LIGER, PEFT)
INSTALL_HINT = "pip install 'fusegen[peers]'"


# ---------------------------------------------------------------------------
# Finding peers, and a peer as a provider


def peer_status(peer: Peer, op_names: Sequence[str]) -> PeerStatus:
    """Whether the peer imports here, its version, and which of op_names it covers."""
    ops = tuple(name for name in op_names if name in peer.adapters)
    try:
        importlib.import_module(peer.package)
    except ImportError:
        return PeerStatus(peer, None, ops, f"{peer.package} is not installed: skipped ({INSTALL_HINT})")
    except Exception as exc:  # a broken install (e.g. a Triton it does not support) is a skip too
        return PeerStatus(peer, None, ops, f"{peer.package} failed to import: skipped ({describe_error(exc)})")
    try:
        version = importlib.metadata.version(peer.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(importlib.import_module(peer.package), "__version__", "unknown")
    note = None
    if version != peer.checked_version:
        note = f"adapters checked against {peer.checked_version}; outputs still checked against fusegen's"
    return PeerStatus(peer, version, ops, note)


def peer_statuses(op_names: Sequence[str], peers: Sequence[Peer] = PEERS) -> list[PeerStatus]:
    return [peer_status(peer, op_names) for peer in peers]


def peer_provider(peer: Peer, bench_op) -> Callable | None:
    """The peer called as the bench calls a provider (inputs, then the bench's kwargs), or None
    when it has no adapter for the op. Params the bench does not pass take the spec's defaults,
    so the peer computes what fusegen computes."""
    adapter = peer.adapters.get(bench_op.name)
    if adapter is None:
        return None
    defaults = {param.name: param.default for param in bench_op.spec.params}

    def call(*inputs, **kwargs):
        return adapter(*inputs, **{**defaults, **kwargs})

    return call


def peer_providers(bench_op, peers: Sequence[Peer]) -> dict[str, Callable]:
    providers = {}
    for peer in peers:
        provider = peer_provider(peer, bench_op)
        if provider is not None:
            providers[peer.name] = provider
    return providers


# ---------------------------------------------------------------------------
# The first-call check: a peer's outputs against fusegen's

# (rtol, atol) per dtype: loose enough for one rounding more or less in half precision,
# tight enough that another formula (a weight offset, another GELU, swapped outputs) fails.
# atol is relative to the output's largest magnitude: softmax's values are ~1/N, and a fixed
# atol of 1e-2 would pass any softmax-like output at all.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (4e-2, 1e-2),
}


def _as_tuple(outputs) -> tuple:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def output_mismatch(expected: Sequence[torch.Tensor], got: Sequence[torch.Tensor],
                    output_names: Sequence[str]) -> str | None:
    """Why got differs from expected (count, shape, values beyond TOLERANCES), or None."""
    if len(got) != len(expected):
        return f"mismatch: {len(got)} outputs where fusegen has {len(expected)}"
    for name, want, have in zip(output_names, expected, got):
        if not isinstance(have, torch.Tensor) or have.shape != want.shape:
            shape = tuple(have.shape) if isinstance(have, torch.Tensor) else type(have).__name__
            return f"mismatch: output {name} has shape {shape} where fusegen's has {tuple(want.shape)}"
        rtol, atol = TOLERANCES.get(want.dtype, TOLERANCES[torch.float32])
        compute = torch.float64 if want.dtype == torch.float64 else torch.float32
        want, have = want.detach().to(compute), have.detach().to(compute)
        scale = want.abs().nan_to_num(0.0, 0.0, 0.0).max().item() if want.numel() else 0.0
        if not torch.allclose(have, want, rtol=rtol, atol=atol * (scale or 1.0), equal_nan=True):
            worst = (have - want).abs().nan_to_num(float("inf")).max().item()
            dtype = DTYPE_NAMES.get(want.dtype, str(want.dtype))
            return (f"mismatch: output {name} differs from fusegen's by up to {worst:.3g} "
                    f"(rtol {rtol:g}, atol {atol:g} x its largest magnitude for {dtype}); not timed")
    return None


def check_first_call(fn: Callable[[], Any], expected: Sequence[torch.Tensor] | Exception,
                     output_names: Sequence[str], first_call_timeout_s: float = 0.0) -> Measurement | None:
    """Run a peer's first call and compare it with fusegen's outputs (or fusegen's failure).

    None when it agrees; else a Measurement carrying the error, which stands in for the timing.
    """
    if isinstance(expected, Exception):
        return Measurement(error=f"not checked, so not timed: fusegen failed ({describe_error(expected)})")
    try:
        with time_limit(first_call_timeout_s, "the first call"), torch.no_grad():
            got = _as_tuple(fn())
    except Exception as exc:
        if is_timeout(exc):
            return Measurement(error=f"timed out: the first call took longer than {first_call_timeout_s:g} s",
                               timed_out=True)
        return Measurement(error=describe_error(exc))
    reason = output_mismatch(expected, got, output_names)
    return None if reason is None else Measurement(error=reason)


def fusegen_outputs(bench_op, inputs: Sequence[torch.Tensor], kwargs: dict) -> tuple[torch.Tensor, ...] | Exception:
    """What the peers are checked against: the generated op's outputs (or why there are none)."""
    try:
        with torch.no_grad():
            return _as_tuple(bench_op.op(*inputs, **kwargs))
    except Exception as exc:
        return exc
