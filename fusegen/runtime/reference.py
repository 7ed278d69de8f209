"""What a generated module's `reference` calls beside torch.

`decided_where(cond, a, b)` is torch.where for a condition of params alone (the same for every
element of a call, as the kernels decide it once), whose gradient goes only to the side taken.
torch.where sends zeros back through the side not taken, and that side's own derivative may be
inf or NaN there (x / c where c > 0 else x, at c = 0): 0 · inf is NaN. The kernels compute the
side taken only, so the reference (the oracle, and what the op runs under torch.func) must not
differ from them there.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["decided_where"]


def decided_where(cond: torch.Tensor, if_true, if_false):
    """torch.where(cond, if_true, if_false), differentiated only along the side `cond` takes.
    Traced by torch.compile, torch.where itself: Dynamo takes no autograd.Function with a jvp,
    and under fake tensors the side is not known anyway (there a side not taken whose
    derivative is infinite still gives NaN, as before)."""
    if torch.compiler.is_compiling():
        return torch.where(cond, if_true, if_false)
    return _DecidedWhere.apply(cond, if_true, if_false)


def _taken(cond: torch.Tensor) -> bool | None:
    """The side a 0-d condition takes; None where its value is not known (meta, fake)."""
    if cond.device.type == "meta" or is_fake(cond):
        return None
    return bool(cond)


def _shape(value):
    return value.shape if isinstance(value, torch.Tensor) else None


class _DecidedWhere(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(cond, if_true, if_false):
        return torch.where(cond, if_true, if_false)

    @staticmethod
    def setup_context(ctx, inputs, output):
        cond, if_true, if_false = inputs
        ctx.save_for_backward(cond)
        ctx.save_for_forward(cond)
        ctx.shapes = (_shape(if_true), _shape(if_false))

    @staticmethod
    def backward(ctx, grad):
        (cond,) = ctx.saved_tensors
        taken = _taken(cond)
        grads = []
        for side, (shape, needs) in enumerate(zip(ctx.shapes, ctx.needs_input_grad[1:])):
            if not needs or taken is (side == 1):  # no gradient: none asked, or the side not taken
                grads.append(None)
                continue
            chosen = grad if taken is not None else torch.where(cond if side == 0 else ~cond, grad, 0.0)
            grads.append(chosen.sum_to_size(shape))
        return None, *grads

    @staticmethod
    def jvp(ctx, cond_tangent, true_tangent, false_tangent):
        # torch.where selects, so a NaN tangent on the side not taken does not leak forward.
        (cond,) = ctx.saved_tensors
        zero = torch.zeros((), dtype=next(t.dtype for t in (true_tangent, false_tangent) if t is not None),
                           device=cond.device)
        return torch.where(cond, zero if true_tangent is None else true_tangent,
                           zero if false_tangent is None else false_tangent)
