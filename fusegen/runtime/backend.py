"""The contract between the runtime (`FusedOp`, `PreparedCall`) and a backend's run-time kernels.

A generated module hands its `FusedOp` a `BackendKernels` (the Triton backend's:
fusegen.backends.triton.launch.Kernels and RowKernels); the op binds it to itself once and
from then on calls only what `BoundKernels` lists, and the prepared forms it returns. These
Protocols are exactly what the runtime uses (tests/test_backend_contract.py checks both
ways): a backend may have more (the Triton one takes a `tile` for tests), and the runtime
relies on nothing else.

Tensors are in the op's orders: `tensors` its inputs, `outputs` and `grads` one per output,
`needs` a flag per input. `seed` is the seed tensor (None without dropout); `statistics`
the [M, statistics] buffer the forward writes each row's statistics to and the backward
reads (None where `BackendKernels.statistics` is 0).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from .op import Call, FusedOp


@runtime_checkable
class PreparedForward(Protocol):
    """The forward's launch for one call key (`BoundKernels.prepare_forward`), made once
    and called for each call with that key with new tensors; it holds no tensor between calls."""

    def __call__(self, values: tuple) -> None:
        """Launch on `(*tensors, *outputs, statistics, seed)`, writing the outputs (and `statistics`)."""

    def native_form(self) -> tuple | None:
        """This launch as the C++ eager call takes it (runtime.native, csrc/eager_call.cpp),
        or None: then every call with this key stays in Python."""


@runtime_checkable
class PreparedBackward(Protocol):
    """The backward's launch for one call key and backward key (the gradients asked for, the
    incoming gradients' layout; `BoundKernels.prepare_backward`), made once and called per
    backward with those keys."""

    def __call__(self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], seed: torch.Tensor | None,
                 statistics: torch.Tensor | None, in_place: bool = False) -> list[torch.Tensor]:
        """The gradients of the inputs it was prepared for, in input order; `in_place`: an
        input's own memory may take its gradient where that is safe for the call."""

    def native_form(self) -> tuple | None:
        """(launch form, targets, inputs) for the C++ eager call's backward, or None: such
        backwards stay in Python."""


@runtime_checkable
class BoundKernels(Protocol):
    """A backend's kernels bound to one op (`BackendKernels.bind(op)`): `FusedOp.kernels`."""

    traceable: bool
    """Whether a traced graph (torch.compile, torch.export) can record the launches; if not,
    the library ops stay opaque to it."""

    def check_device(self, device: torch.device) -> None:
        """Raise a FusegenArgumentError if the kernels cannot run on `device` (called off CUDA only)."""

    def forward(self, call: Call, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                seed: torch.Tensor | None, *, statistics: torch.Tensor | None = None, traced: bool = False,
                keep: bool = True) -> None:
        """Launch the forward once for `call`, writing `outputs` (and `statistics`); `traced`: the
        tensors are a traced graph's (fake) and the launch is to be recorded in it; `keep` off:
        no gradient follows (see statistics_width)."""

    def backward(self, call: Call, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 needs: Sequence[bool], seed: torch.Tensor | None, *, statistics: torch.Tensor | None = None,
                 traced: bool = False) -> list[torch.Tensor]:
        """Launch the backward once: the gradients of the inputs flagged in `needs` (all of
        them among `BackendKernels.gradients`), in input order, each in new memory."""

    def statistics_width(self, problem, keep: bool = True) -> int:
        """The width of the [..., width] buffer the forward keeps for the backward: the
        statistics per row; with a matmul, what the backend lays out (its product, all its
        chunks side by side; a hidden layer's values). `keep` off: for a call that no gradient
        follows; 0 where the forward then keeps nothing (the op passes `statistics` None and
        asks for the forward with `keep` off), else the same width."""

    def prepare_forward(self, call: Call, tensors: Sequence[torch.Tensor], *, keep: bool = True) -> PreparedForward:
        """The forward's launch for `call`'s call key (shapes, strides, dtypes, params) with these
        tensors; `keep` off (asked only where statistics_width is then 0): one that writes nothing
        for the backward and reads no `statistics` (passed None)."""

    def prepare_backward(self, call: Call, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                         needs: Sequence[bool]) -> PreparedBackward:
        """The backward's launch for `call`'s call key, these incoming gradients' layout and `needs`."""


@runtime_checkable
class BackendKernels(Protocol):
    """What a generated module passes as `FusedOp(kernels=...)`."""

    gradients: Sequence[str]
    """The inputs (by spec name) whose gradients the backward kernel computes."""

    statistics: int
    """Values per row the forward keeps for the backward (the `statistics` buffer, [M, statistics]
    in the compute dtype); 0 for none."""

    def bind(self, op: FusedOp) -> BoundKernels:
        """These kernels for `op`, whose inputs, params and outputs fix their arguments."""
