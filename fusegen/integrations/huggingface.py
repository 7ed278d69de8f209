"""fusegen's generated ops in a Hugging Face transformers model that is already built, without
editing the model's code:

    from fusegen.integrations.huggingface import patch
    p = patch(model)          # LLaMA, Mistral, Qwen2, Qwen3 or GPT-2
    print(p.summary())        # what was replaced, and what was left as it was and why
    p.undo()                  # the model as it was (or: `with patch(model): ...`)

What is replaced, by kind (`ops="all"`, or a subset of OPS):

- "norms": each LLaMA-style RMSNorm (a module whose forward is LlamaRMSNorm's: MistralRMSNorm,
  Qwen2RMSNorm, Qwen3RMSNorm and their copies) → `rmsnorm`; each torch.nn.LayerNorm → `layernorm`.
- "mlps": each SwiGLU MLP (LlamaMLP's forward, gate_proj/up_proj/down_proj without bias,
  act_fn SiLU) → `down_proj(linear_swiglu(x, [W_gate; W_up]))`: gate_proj's and up_proj's
  matmul and the SwiGLU in one kernel. GPT-2's MLP with a tanh GELU (gelu_new,
  gelu_pytorch_tanh) → `linear_bias_gelu(x, c_fc.weight.T, c_fc.bias)`: c_fc's matmul, bias
  and GELU in one kernel; with the exact GELU (gelu), which no gemm op takes, c_fc's matmul
  without its bias, then `bias_gelu`. c_proj and dropout stay the model's (unless "residuals").
- "residuals": in each LLaMA-style decoder layer, the attention's residual add and
  post_attention_layernorm → `add_rmsnorm`; in each GPT-2 block, the attention's c_proj bias,
  resid_dropout, residual add and ln_2 → `bias_dropout_add_layernorm`, and the MLP's c_proj
  (matmul and bias), dropout and residual add → `linear_bias_dropout_add`. The block then
  runs its MLP's parts itself, not the MLP: c_fc and the GELU as "mlps" replaces them where it
  does (the MLP also gets that forward, for direct calls), else the model's own modules, then
  the fused c_proj. Dropout follows the Dropout modules' p and train()/eval(), as torch's
  does (its masks are fusegen's, not torch's).

How: each module replaced gets a `forward` of its own, an instance attribute that reads the
module's own parameters at every call. Nothing is copied or re-registered: the parameters,
their names in state_dict and the module tree stay as they were, so an optimizer built before
or after the patch keeps working, and undo() deletes those attributes again. A decoder
layer's new forward calls its attention module exactly as transformers does (same arguments,
**kwargs passed on); a GPT-2 block's attention keeps its forward, only its c_proj runs without
the bias and its resid_dropout passes its input on, while the block is patched, so that the
block adds both in the fused op. GPT-2's Conv1D holds its weight as [in, out] and the gemm ops
take nn.Linear's [out, in]: they get its transpose, a view, which the kernels read through its
strides, so the forward copies nothing. The weight's gradient comes back [out, in], reaching
the parameter transposed; autograd lays it out as the parameter when it stores it (a copy of
the weight's size).

What is not replaced, and why:

- A model with no LLaMA-style decoder layer and no GPT-2 block is not a family this module
  knows: patch() raises UnsupportedModelError, one line, and changes nothing.
- In a family it knows, a module that does not fit (a forward that is not the one transformers
  5.17 writes, an activation other than SiLU in a SwiGLU MLP or GELU in GPT-2's, biases on
  gate_proj/up_proj, a LayerNorm without bias, a GPT-2 block with cross-attention, a module
  carrying forward hooks that would see other values (transformers' own, recording an
  attention's weights, pass) or a forward of its own, such as accelerate's) is left as it
  was: it computes what it computed, only unfused. Each is listed with its reason in
  Patch.summary() and in one warning. `strict=True` raises instead, on the first. Nothing
  fitting at all raises.
- Fusing a layer's MLP residual add with the next layer's input norm would need a new
  LlamaModel.forward: out of scope (fusegen.bench.model's synthetic stack measures it).
- linear_bias_gelu_dropout_add (a GELU's output added to a residual) fits none of these
  models: their GELU feeds a down-projection.

Patch the model before torch.compile (a compiled model is refused); under torch.compile the
generated ops are torch.library ops, and the patched forwards trace like the originals.

The matched forwards are checked by their code (its AST, annotations and docstrings aside)
against the transformers 5.17 source quoted at the end of this module, so a later transformers
that changes one is left unpatched and reported rather than patched wrongly.
"""
from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
import textwrap
import types
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from .loading import load_ops as _load_ops

OPS = ("norms", "mlps", "residuals")

__all__ = ["OPS", "Patch", "UnsupportedModelError", "patch"]


class UnsupportedModelError(ValueError):
    """A model, or with strict=True a module of it, that patch() cannot take: one line."""


def patch(model: nn.Module, *, ops: str | Iterable[str] = "all", strict: bool = False,
          generated: str | Path | None = None) -> "Patch":
    """Swap fusegen's generated ops into `model` (a transformers model, built) in place.

    ops: "all" or some of OPS ("norms", "mlps", "residuals"). strict: raise on the first
    module that does not fit instead of leaving it as it was (which warns, once). generated:
    a folder of generated modules to take the ops from (default: a checkout's generated/, else
    the installed `fusegen.ops`). Returns a Patch: summary(), undo(), and a context manager
    that undoes on exit.
    """
    wanted = _wanted(ops)
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch() takes a torch.nn.Module, got {type(model).__name__}")
    described = f"patch({type(model).__name__})"
    if _is_compiled(model):
        raise UnsupportedModelError(f"{described}: the model is compiled already; patch the model first, then "
                                    "torch.compile it")
    for module in model.modules():
        if module in _PATCHED:
            raise UnsupportedModelError(f"{described}: already patched by fusegen; undo() that patch first")
    plan = _Planner(model, wanted)
    if not plan.families:
        raise UnsupportedModelError(
            f"{described}: not a model family fusegen knows: it has no LLaMA-style decoder layer "
            "(input_layernorm, self_attn, post_attention_layernorm, mlp) and no GPT-2 block (ln_1, attn, ln_2, mlp)")
    if plan.skipped and strict:
        raise UnsupportedModelError(f"{described}, strict: {_refusal(plan.skipped[0])}")
    if not plan.units:
        first = _refusal(plan.skipped[0]) if plan.skipped else "no module of the kinds asked for"
        more = f" (and {len(plan.skipped) - 1} more)" if len(plan.skipped) > 1 else ""
        raise UnsupportedModelError(f"{described}: nothing to replace: {first}{more}")
    ops_by_name = _load_ops({op for unit in plan.units for op in unit.fit.ops}, generated)
    result = Patch(model, plan.units, plan.skipped, ops_by_name)
    if plan.skipped:
        more = f" (and {len(plan.skipped) - 1} more)" if len(plan.skipped) > 1 else ""
        warnings.warn(f"fusegen {described} left modules as they were: {_refusal(plan.skipped[0])}{more}; "
                      "see Patch.summary()", stacklevel=2)
    return result


class Patch:
    """The changes patch() made to one model: summary(), undo(); a context manager."""

    def __init__(self, model: nn.Module, units: list["_Unit"], skipped: list[tuple[str, str, str]],
                 ops_by_name: dict[str, Callable]):
        self.model_name = type(model).__name__
        self._units = tuple(units)
        #: (module name, the op it would have taken, why not) for each module left as it was.
        self.skipped = tuple(skipped)
        self._changes: list[tuple[nn.Module, Callable]] = []
        for unit in units:
            for module, make_forward in unit.fit.forwards:
                if "forward" in module.__dict__:  # the planner refuses such modules; two units must not share one
                    raise AssertionError(f"{unit.name}: a module given two forwards")
                forward = types.MethodType(make_forward(ops_by_name), module)
                module.forward = forward
                self._changes.append((module, forward))
                _PATCHED.add(module)
        self.active = True

    @property
    def patched(self) -> tuple[tuple[str, str], ...]:
        """(module name, the op or ops that now run there) for each replacement."""
        return tuple((unit.name, unit.label) for unit in self._units)

    def undo(self) -> None:
        """Every patched module's forward as it was (the class's); a second undo does nothing."""
        if not self.active:
            return
        for module, forward in self._changes:
            if module.__dict__.get("forward") is not forward:
                raise RuntimeError(f"fusegen patch of {self.model_name}: a patched module's forward was replaced "
                                   "since; undo() left the model as it is")
        for module, _ in reversed(self._changes):
            del module.forward
            _PATCHED.discard(module)
        self._changes.clear()
        self.active = False

    def __enter__(self) -> "Patch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def summary(self) -> str:
        """What runs where, by kind, with names grouped over layers (`model.layers.*.mlp`)."""
        state = "active" if self.active else "undone"
        lines = [f"fusegen patch of {self.model_name} ({state}):"]
        for (label, pattern), count in _grouped((u.label, u.name) for u in self._units):
            lines.append(f"  {label}: {count}× {pattern}")
        if self.skipped:
            lines.append("  left as they were:")
            for (reason, pattern), count in _grouped((f"{what}: {why}", name) for name, what, why in self.skipped):
                lines.append(f"    {count}× {pattern} ({reason})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<fusegen Patch of {self.model_name}: {len(self._units)} replacements, " \
               f"{len(self.skipped)} left, {'active' if self.active else 'undone'}>"


# Every module that carries a patch's forward, to refuse patching it twice. Weak: a model
# dropped without undo() is freed.
_PATCHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _wanted(ops) -> frozenset[str]:
    chosen = set(OPS) if ops == "all" else {ops} if isinstance(ops, str) else set(ops)
    unknown = sorted(chosen - set(OPS))
    if unknown or not chosen:
        raise ValueError(f"patch(): ops must be 'all' or some of {', '.join(OPS)}; got {ops!r}")
    return frozenset(chosen)


def _refusal(skipped: tuple[str, str, str]) -> str:
    name, what, reason = skipped
    return f"{name or 'the model'} can't take {what}: {reason}"


def _is_compiled(model: nn.Module) -> bool:
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # loaded by the time anything was compiled
    return dynamo is not None and isinstance(model, dynamo.OptimizedModule)


def _grouped(pairs) -> list[tuple[tuple[str, str], int]]:
    """(label, name) pairs counted by label and name with layer numbers as '*', in first-seen order."""
    counts: dict[tuple[str, str], int] = {}
    for label, name in pairs:
        key = (label, re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) or "(the model)")
        counts[key] = counts.get(key, 0) + 1
    return list(counts.items())


# ---------------------------------------------------------------------------------------------
# Which modules take which op


@dataclass(frozen=True)
class _Fit:
    """How a module is replaced: `label` says what runs there now, `ops` the generated ops it
    calls; each module in `forwards` gets the forward its maker returns, given the ops by name."""

    label: str
    ops: tuple[str, ...]
    forwards: tuple[tuple[nn.Module, Callable[[dict], Callable]], ...]


@dataclass(frozen=True)
class _Unit:
    name: str  # the module's path in the model ("model.layers.0.mlp")
    fit: _Fit

    @property
    def label(self) -> str:
        return self.fit.label


_LLAMA_LAYER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_GPT2_BLOCK = ("ln_1", "attn", "ln_2", "mlp")


class _Planner:
    """Every module of a model that fits a replacement, as _Units, and every one of a kind it
    knows that does not, as (name, op, reason); nothing is changed while planning."""

    def __init__(self, model: nn.Module, wanted: frozenset[str]):
        from transformers import activations, pytorch_utils  # only now: importing fusegen never imports transformers

        self._conv1d = pytorch_utils.Conv1D
        self._silu = (activations.SiLUActivation, nn.SiLU)
        self._gelu = {activations.NewGELUActivation: "gelu_tanh", activations.GELUTanh: "gelu_tanh",
                      activations.GELUActivation: "gelu"}
        self.names = {module: name for name, module in model.named_modules()}
        self.units: list[_Unit] = []
        self.skipped: list[tuple[str, str, str]] = []
        self.families: set[str] = set()
        for name, module in model.named_modules():
            if _has_modules(module, _LLAMA_LAYER):
                self.families.add("llama")
                if "residuals" in wanted:
                    self._decide(name, "add_rmsnorm", self._llama_layer(module))
            elif _has_modules(module, _GPT2_BLOCK):
                self.families.add("gpt2")
                if "residuals" in wanted:
                    self._decide(name, "bias_dropout_add_layernorm", self._gpt2_block(module, "mlps" in wanted))
            elif "norms" in wanted and isinstance(module, nn.LayerNorm):
                self._decide(name, "layernorm", self._layer_norm(module))
            elif "norms" in wanted and hasattr(module, "variance_epsilon") and hasattr(module, "weight"):
                self._decide(name, "rmsnorm", self._rms_norm(module))
            elif "mlps" in wanted and _has_modules(module, ("gate_proj", "up_proj", "down_proj")):
                self._decide(name, "linear_swiglu", self._swiglu_mlp(module))
            elif "mlps" in wanted and _has_modules(module, ("c_fc", "c_proj", "act", "dropout")):
                self._decide(name, "linear_bias_gelu", self._gpt2_mlp(module))

    def _decide(self, name: str, op: str, outcome: "_Fit | str") -> None:
        """outcome: the fit, or why the module keeps its forward (it would have taken `op`)."""
        if isinstance(outcome, str):
            self.skipped.append((name, op, outcome))
        else:
            self.units.append(_Unit(name, outcome))

    def _name(self, module: nn.Module) -> str:
        return self.names.get(module, type(module).__name__)

    def _untouched(self, *modules: nn.Module, bypassed: tuple[nn.Module, ...] = (),
                   observed: tuple[nn.Module, ...] = ()) -> str | None:
        """Why a module given a forward (`modules`), one no longer called or returning
        something else while patched (`bypassed`), or one still called whose first output
        changes (`observed`: GPT-2's attention) cannot be: a forward of its own would be lost
        or skipped, hooks would see other values or none."""
        for module in (*modules, *bypassed, *observed):
            if "forward" in module.__dict__:
                return f"{self._name(module)} has a forward of its own (set by another library?)"
        for module, allowed in (*((m, None) for m in bypassed), *((m, _records_a_later_output) for m in observed)):
            hooks = (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
            if any(allowed is None or not allowed(hook) for hook in hooks):
                return f"{self._name(module)} has forward hooks, which would see other values, or none, when fused"
        return None

    # -- norms -------------------------------------------------------------------------------

    def _rms_norm(self, module):
        if not _same_code(type(module).forward, _LLAMA_RMS_NORM):
            return f"{type(module).__name__}.forward is not LlamaRMSNorm's"
        if not (isinstance(module.weight, nn.Parameter) and module.weight.dim() == 1):
            return "its weight is not a 1-d parameter"
        return self._untouched(module) or _Fit("rmsnorm", ("rmsnorm",), ((module, _rms_norm_forward),))

    def _layer_norm(self, module: nn.LayerNorm):
        if type(module) is not nn.LayerNorm:
            return f"{type(module).__name__} is a subclass of torch.nn.LayerNorm"
        if module.weight is None or module.bias is None or len(module.normalized_shape) != 1:
            return "layernorm needs a weight and a bias over the last dim"
        return self._untouched(module) or _Fit("layernorm", ("layernorm",), ((module, _layer_norm_forward),))

    # -- MLPs --------------------------------------------------------------------------------

    def _swiglu_mlp(self, module):
        if not _same_code(type(module).forward, _LLAMA_MLP):
            return f"{type(module).__name__}.forward is not LlamaMLP's"
        gate, up = module.gate_proj, module.up_proj
        for part in (gate, up):
            if type(part) is not nn.Linear:
                return f"{self._name(part)} is a {type(part).__name__}, not a torch.nn.Linear"
        if gate.bias is not None or up.bias is not None:
            return "gate_proj and up_proj have biases (mlp_bias=True)"
        if type(getattr(module, "act_fn", None)) not in self._silu:
            return f"act_fn is {type(getattr(module, 'act_fn', None)).__name__}; linear_swiglu needs SiLU"
        return self._untouched(module, bypassed=(gate, up, module.act_fn)) or _Fit(
            "linear_swiglu (gate_proj's and up_proj's matmul and SwiGLU in one kernel)", ("linear_swiglu",),
            ((module, _swiglu_mlp_forward),))

    def _gpt2_mlp(self, module):
        if not _same_code(type(module).forward, _GPT2_MLP):
            return f"{type(module).__name__}.forward is not GPT2MLP's"
        if type(module.c_fc) is not self._conv1d:
            return f"{self._name(module.c_fc)} is a {type(module.c_fc).__name__}, not transformers' Conv1D"
        activation = self._gelu.get(type(module.act))
        if activation is None:
            return (f"act is {type(module.act).__name__}; linear_bias_gelu takes gelu_new or gelu_pytorch_tanh, "
                    "bias_gelu gelu")
        if activation == "gelu_tanh":
            label, op = "linear_bias_gelu (c_fc's matmul, bias and tanh GELU in one kernel)", "linear_bias_gelu"
        else:
            label, op = "bias_gelu (c_fc's bias and exact GELU: no gemm op takes the exact GELU)", "bias_gelu"
        forward = functools.partial(_gpt2_mlp_forward, activation=activation)
        return self._untouched(module, bypassed=(module.c_fc, module.act)) or _Fit(label, (op,), ((module, forward),))

    # -- residual adds fused with what follows them -------------------------------------------

    def _llama_layer(self, layer):
        if not _same_code(type(layer).forward, _LLAMA_DECODER_LAYER):
            return f"{type(layer).__name__}.forward is not LlamaDecoderLayer's (as of transformers 5.17)"
        norm = layer.post_attention_layernorm
        if not _same_code(type(norm).forward, _LLAMA_RMS_NORM):
            return f"post_attention_layernorm is a {type(norm).__name__}, whose forward is not LlamaRMSNorm's"
        return self._untouched(layer, bypassed=(norm,)) or _Fit(
            "add_rmsnorm (attention's residual add + post_attention_layernorm)", ("add_rmsnorm",),
            ((layer, _llama_layer_forward),))

    def _gpt2_block(self, block, fuse_mlp: bool):
        """fuse_mlp: the MLP's c_fc and GELU run as "mlps" replaces them, where their module fits."""
        if not _same_code(type(block).forward, _GPT2_BLOCK_FORWARD):
            return f"{type(block).__name__}.forward is not GPT2Block's (as of transformers 5.17)"
        if hasattr(block, "crossattention"):
            return "a block with cross-attention (add_cross_attention=True)"
        attn, mlp, ln = block.attn, block.mlp, block.ln_2
        if not _ends_with(type(attn).forward, _GPT2_ATTENTION_TAIL, ("c_proj", "resid_dropout")):
            return f"{type(attn).__name__}.forward does not end as GPT2Attention's (c_proj, resid_dropout, return)"
        if not _same_code(type(mlp).forward, _GPT2_MLP):
            return f"{type(mlp).__name__}.forward is not GPT2MLP's"
        for part, kind in ((attn.c_proj, self._conv1d), (mlp.c_proj, self._conv1d),
                           (attn.resid_dropout, nn.Dropout), (mlp.dropout, nn.Dropout), (ln, nn.LayerNorm)):
            if type(part) is not kind:
                return f"{self._name(part)} is a {type(part).__name__}, not a {kind.__name__}"
        if ln.weight is None or ln.bias is None:
            return "ln_2 has no weight or bias"
        # The MLP's own fit decides its first half (and has checked c_fc's and act's hooks);
        # where it has none, the block calls c_fc and act as the MLP would.
        up = self._gpt2_mlp(mlp) if fuse_mlp else None
        activation = self._gelu[type(mlp.act)] if isinstance(up, _Fit) else None
        label = "bias_dropout_add_layernorm (attention's c_proj bias, dropout, residual add, ln_2) + " \
                "linear_bias_dropout_add (the MLP's c_proj, its bias, dropout, residual add)"
        ops = ("bias_dropout_add_layernorm", "linear_bias_dropout_add", *(up.ops if activation else ()))
        # Hooks on attn would see its output without bias and dropout (but for transformers' own,
        # which record its attention weights); mlp, its c_proj and its dropout are not called.
        bypassed = (ln, mlp, attn.c_proj, attn.resid_dropout, mlp.c_proj, mlp.dropout)
        forward = functools.partial(_gpt2_block_forward, activation=activation)
        return self._untouched(block, bypassed=bypassed, observed=(attn,)) or _Fit(label, ops, (
            (block, forward), (attn.c_proj, _conv1d_without_bias), (attn.resid_dropout, _passes_through)))


def _records_a_later_output(hook) -> bool:
    """Whether `hook` is transformers' output-capturing hook (installed by a call with
    output_attentions or output_hidden_states) recording element `index` ≥ 1 of a tuple output:
    an attention's weights, which the patch leaves as they are. Anything else: False."""
    code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None)
    if getattr(hook, "__module__", None) != "transformers.utils.output_capturing" or code is None or not cells:
        return False
    index = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells))).get("index")
    return type(index) is int and index >= 1


def _has_modules(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Module) for name in names)


# ---------------------------------------------------------------------------------------------
# The replacement forwards. Each maker takes the loaded ops by name and returns the function
# bound to the module as its forward; parameters are read from the modules at every call.


def _rms_norm_forward(ops):
    rmsnorm = ops["rmsnorm"]

    def forward(self, hidden_states):
        return rmsnorm(hidden_states, self.weight, self.variance_epsilon)

    return forward


def _layer_norm_forward(ops):
    layernorm = ops["layernorm"]

    def forward(self, input):
        return layernorm(input, self.weight, self.bias, self.eps)

    return forward


def _swiglu_mlp_forward(ops):
    linear_swiglu = ops["linear_swiglu"]

    def forward(self, x):
        # linear_swiglu takes one weight, nn.Linear's [2N, K] with the gate's rows first. The
        # model keeps gate_proj's and up_proj's apart (the patch re-registers nothing), so they
        # are stacked at every call: a copy of 2 × intermediate × hidden elements, as many as
        # the matmul reads of them (its backward splits the gradient as views, no copy).
        weight = torch.cat((self.gate_proj.weight, self.up_proj.weight))
        return self.down_proj(linear_swiglu(x, weight))

    return forward


def _gpt2_up(ops, activation):
    """GPT-2's c_fc and GELU, fused: a function of (the MLP, its input)."""
    if activation == "gelu_tanh":
        linear_bias_gelu = ops["linear_bias_gelu"]
        # Conv1D's weight is [in, out]; its transpose is the op's nn.Linear layout, as a view.
        return lambda mlp, x: linear_bias_gelu(x, mlp.c_fc.weight.T, mlp.c_fc.bias)
    bias_gelu = ops["bias_gelu"]
    # No gemm op takes the exact GELU: c_fc's matmul without its bias (Conv1D adds it inside
    # addmm), then bias_gelu adds it.
    return lambda mlp, x: bias_gelu(torch.matmul(x, mlp.c_fc.weight), mlp.c_fc.bias, activation)


def _gpt2_mlp_forward(ops, activation):
    up = _gpt2_up(ops, activation)

    def forward(self, hidden_states):
        return self.dropout(self.c_proj(up(self, hidden_states)))

    return forward


def _llama_layer_forward(ops):
    add_rmsnorm = ops["add_rmsnorm"]

    # LlamaDecoderLayer.forward (transformers 5.17), its attention's residual add and
    # post_attention_layernorm in one op.
    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        norm = self.post_attention_layernorm
        # (the new residual stream, its norm): the MLP's input and what its output is added to.
        residual, hidden_states = add_rmsnorm(hidden_states, residual, norm.weight, norm.variance_epsilon)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states

    return forward


def _gpt2_block_forward(ops, activation):
    """activation: the MLP's c_fc and GELU fused as _gpt2_up fuses them; None: its own modules."""
    bias_dropout_add_layernorm = ops["bias_dropout_add_layernorm"]
    linear_bias_dropout_add = ops["linear_bias_dropout_add"]
    up = _gpt2_up(ops, activation) if activation else lambda mlp, x: mlp.act(mlp.c_fc(x))

    # GPT2Block.forward (transformers 5.17) for a block without cross-attention. While the block
    # is patched, attn.c_proj leaves out its bias and attn.resid_dropout passes its input on:
    # the attention's bias, dropout and residual add are the fused op's, with ln_2. The MLP
    # (GPT2MLP's forward) is run here part by part, its c_proj, dropout and residual add fused.
    def forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, **kwargs):
        if encoder_hidden_states is not None:  # as GPT2Block.forward refuses it without cross-attention
            raise ValueError(
                f"If `encoder_hidden_states` are passed, {self} has to be instantiated with "
                "cross-attention layers by setting `config.add_cross_attention=True`"
            )
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, _ = self.attn(
            hidden_states,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            use_cache=use_cache,
            **kwargs,
        )
        attn, ln, mlp = self.attn, self.ln_2, self.mlp
        residual, hidden_states = bias_dropout_add_layernorm(
            attn_output, attn.c_proj.bias, residual, ln.weight, ln.bias, ln.eps,
            attn.resid_dropout.p, attn.resid_dropout.training)
        return linear_bias_dropout_add(up(mlp, hidden_states), mlp.c_proj.weight.T, mlp.c_proj.bias, residual,
                                       mlp.dropout.p, mlp.dropout.training)

    return forward


def _conv1d_without_bias(ops):
    def forward(self, x):  # Conv1D's forward less its bias, which the patched block adds
        return torch.matmul(x, self.weight)

    return forward


def _passes_through(ops):
    def forward(self, input):  # a Dropout whose dropping the patched block does, fused
        return input

    return forward


# ---------------------------------------------------------------------------------------------
# Recognising a forward by its code


def _function_node(function) -> ast.FunctionDef | None:
    """The function's AST without what does not run (annotations, decorators, its docstring);
    None where its source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    node.decorator_list, node.returns = [], None
    arguments = node.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg,
                     arguments.kwarg):
        if argument is not None:
            argument.annotation = None
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        node.body = node.body[1:]
    return node


@functools.lru_cache(maxsize=None)
def _code(function) -> str | None:
    node = _function_node(function)
    return None if node is None else ast.dump(node)


@functools.lru_cache(maxsize=None)
def _quoted_code(source: str) -> str:
    return ast.dump(ast.parse(textwrap.dedent(source)).body[0])


def _same_code(function, expected: str) -> bool:
    """Whether `function` is the quoted forward, up to annotations, comments and layout."""
    return _code(function) == _quoted_code(expected)


def _ends_with(function, tail: str, attributes: tuple[str, ...]) -> bool:
    """Whether the function's last statements are `tail`'s and each `self.<attribute>` appears
    nowhere else in it."""
    node = _function_node(function)
    if node is None:
        return False
    expected = ast.parse(textwrap.dedent(tail)).body
    if [ast.dump(s) for s in node.body[-len(expected):]] != [ast.dump(s) for s in expected]:
        return False
    uses = [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and n.attr in attributes]
    return all(uses.count(attribute) == 1 for attribute in attributes)


# ---------------------------------------------------------------------------------------------
# The forwards matched, as transformers 5.17 writes them, annotations left out.

_LLAMA_RMS_NORM = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""

_LLAMA_MLP = """
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
"""

_LLAMA_DECODER_LAYER = """
def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
            position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    # Self Attention
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states

    # Fully Connected
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
"""

_GPT2_MLP = """
def forward(self, hidden_states):
    hidden_states = self.c_fc(hidden_states)
    hidden_states = self.act(hidden_states)
    hidden_states = self.c_proj(hidden_states)
    hidden_states = self.dropout(hidden_states)
    return hidden_states
"""

# Only the attention's end matters: c_proj and resid_dropout applied last, and nowhere else.
_GPT2_ATTENTION_TAIL = """
attn_output = self.c_proj(attn_output)
attn_output = self.resid_dropout(attn_output)
return attn_output, attn_weights
"""

_GPT2_BLOCK_FORWARD = """
def forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
            encoder_attention_mask=None, use_cache=False, **kwargs):
    residual = hidden_states
    hidden_states = self.ln_1(hidden_states)
    attn_output, _ = self.attn(
        hidden_states,
        past_key_values=past_key_values,
        attention_mask=attention_mask,
        use_cache=use_cache,
        **kwargs,
    )
    # residual connection
    hidden_states = attn_output + residual

    if encoder_hidden_states is not None:
        # add one self-attention block for cross-attention
        if not hasattr(self, "crossattention"):
            raise ValueError(
                f"If `encoder_hidden_states` are passed, {self} has to be instantiated with "
                "cross-attention layers by setting `config.add_cross_attention=True`"
            )
        residual = hidden_states
        hidden_states = self.ln_cross_attn(hidden_states)
        cross_attn_output, _ = self.crossattention(
            hidden_states,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
        )
        # residual connection
        hidden_states = residual + cross_attn_output

    residual = hidden_states
    hidden_states = self.ln_2(hidden_states)
    feed_forward_hidden_states = self.mlp(hidden_states)
    # residual connection
    hidden_states = residual + feed_forward_hidden_states

    return hidden_states
"""
