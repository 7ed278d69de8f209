"""An eager call's path, worked out once per call key.

A training loop makes the same few calls to an op over and over: the same shapes,
strides, dtypes and params, new data. Everything the checks, views and launch arguments
decide depends on those alone, so `FusedOp.prepare` keys a `PreparedCall` on them
(`call_key`) and a call with a known key goes straight to allocating its outputs and
launching (docs/benchmarks.md has what that saves).

What the key does not see takes the full path every time: tensor subclasses (torch.compile's
fake and functional tensors, DTensor), params given as tensors or numpy numbers, out=.
"""
from __future__ import annotations

import functools

import torch

from . import native
from .backend import PreparedBackward, PreparedForward
from .arguments import PLAIN_TENSOR_TYPES
from .dropout import check_seed, seed_tensor

CACHE_SIZE = 1024


def call_key(args: tuple, tensors: int, seed_position: int | None) -> tuple | None:
    """What a call's checks and launches depend on: each tensor's shape, strides, dtype,
    device and 16-byte alignment (the compiled kernels specialize on it); each param's type
    and value, except an explicit seed's value (checked per call). None: a call the prepared
    path does not take. Where the C++ extension is in use its key takes this one's place
    (runtime.native.call_key), so a process keys its calls one way."""
    key = []
    for t in args[:tensors]:
        if type(t) not in PLAIN_TENSOR_TYPES:
            return None
        key.append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15))
    for position in range(tensors, len(args)):
        value = args[position]
        if position == seed_position:
            key.append(value is None)
            continue
        value_type = type(value)
        if value_type is float or value_type is int or value_type is str or value_type is bool or value is None:
            key.append((value_type, value))  # the type too: True == 1, and a bool p is refused
        else:
            return None
    return tuple(key)


def _draw_seed(name: str, device: torch.device, seed, eager: bool = True) -> torch.Tensor:
    """A call's seed tensor from its seed argument (checked): PreparedCall.forward's, and the
    C++ eager call's where it does not take one itself."""
    return seed_tensor(None if seed is None else check_seed(name, seed), device, eager)


class PreparedCall:
    """One call key of one op: its checked `Call`, output shapes, the forward kernel's
    launch and the backward's, by backward key (`_backward_key`)."""

    __slots__ = ("op", "call", "_tensors", "_outputs", "_statistics_shape", "_statistics_dtype", "_launch", "_bare",
                 "_pending", "_backwards", "_offered", "_native_prepared", "_offered_backwards", "__weakref__")

    def __init__(self, op, call, tensors: tuple):
        problem = call.problem
        self.op, self.call = op, call
        self._tensors = len(tensors)
        self._outputs = [(op.output_shape(problem, i), op.output_dtype(problem, i)) for i in range(len(op.outputs))]
        self._statistics_shape = op.statistics_shape(problem) if op.statistics else None
        self._statistics_dtype = op.statistics_dtype(problem)
        self._launch: PreparedForward | None = op.kernels.prepare_forward(call, tensors) if problem.launches else None
        # The launch for calls that no gradient follows, where it keeps nothing (FusedOp.leaves_out);
        # else the keeping one.
        self._bare = self._launch
        if self._launch is not None and op.leaves_out(problem):
            self._bare = op.kernels.prepare_forward(call, tensors, keep=False)
        self._pending = ()  # launches registered with the C++ call before their first launch (offer_native)
        self._backwards: dict[tuple, PreparedBackward] = {}
        self._offered = False  # to the op's eager call in C++ (offer_native)
        self._native_prepared = None  # its C++ half there (csrc/eager_call.cpp Prepared), once registered (held weakly)
        self._offered_backwards: set = set()  # keys of backwards offered to it

    def forward(self, args: tuple, eager: bool = True, keep: bool = True):
        """What FusedOp.forward returns: the outputs, the seed tensor (None without dropout)
        and the statistics kept for the backward (None without, or with `keep` off where the
        kernels leave them out)."""
        call = self.call
        problem = call.problem
        device = problem.device
        seed = None
        if call.has_dropout:
            seed = _draw_seed(self.op.name, device, args[-1], eager)
        elif self.op.has_dropout and args[-1] is not None:
            check_seed(self.op.name, args[-1])  # never read without dropout, but checked as the full path does
        outputs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self._outputs]
        statistics = None
        launch = self._launch if keep else self._bare
        if self._statistics_shape is not None and launch is self._launch:
            statistics = torch.empty(self._statistics_shape, dtype=self._statistics_dtype, device=device)
        if launch is not None:
            launch((*args[:self._tensors], *outputs, statistics, seed))
            if not self._offered and eager:
                self.offer_native(args)
            elif launch in self._pending and self._native_prepared is not None:
                self._offer_pending(launch)
        return outputs, seed, statistics

    def offer_native(self, args: tuple) -> None:
        """Hand this call key, once launched, to the op's eager call in C++ (runtime.native,
        csrc/eager_call.cpp), which then takes the later calls with this key. Offered once:
        a launch it cannot make (a broadcast view copied per call, scratch memory) stays here."""
        self._offered = True
        calls = self.op.native_calls()
        if calls is None:
            return
        # Each launch as the C++ call takes it; one not launched yet has no form: registered as
        # pending, its calls stay here until it has launched (_offer_pending).
        form = self._launch.native_form()
        bare = None  # the C++ call's launch where no gradient follows: None (the keeping one), its form, True
        if self._bare is not self._launch:
            bare = self._bare.native_form()
            if form is None and bare is None:
                return  # neither it takes: a launch it cannot make (a copied view, scratch memory)
            if form is None:
                self._pending = (self._launch,)
            elif bare is None:
                bare, self._pending = True, (self._bare,)
        elif form is None:
            return
        problem = self.call.problem
        draw = functools.partial(_draw_seed, self.op.name, problem.device) if self.call.has_dropout else None
        outputs = self._outputs  # (shape, dtype) each: the C++ call allocates them so
        statistics = None if self._statistics_shape is None else (self._statistics_shape, self._statistics_dtype)
        self._native_prepared = native.register_call(calls, args, problem.device.index, outputs, statistics, form, self,
                                                     draw, bare)

    def _offer_pending(self, launch) -> None:
        """A launch registered as pending, once launched, to the C++ call (which took the calls of
        the other meanwhile, and left this one's here)."""
        self._pending = ()
        native.register_pending(self._native_prepared, launch.native_form(), launch is self._bare)

    def backward(self, grads: tuple, tensors: tuple, seed, needs, statistics, in_place: bool = False) -> list:
        """The backward kernel's gradients (inputs flagged in `needs`, in input order);
        `in_place`: into the inputs' own memory where that is safe."""
        key = _backward_key(needs, grads)
        prepared: PreparedBackward | None = self._backwards.get(key)
        if prepared is None:
            if len(self._backwards) >= CACHE_SIZE:
                self._backwards.clear()
            prepared = self._backwards[key] = self.op.kernels.prepare_backward(self.call, tensors, grads, needs)
        return prepared(tensors, grads, seed, statistics, in_place)

    def offer_backward(self, needs, grads: tuple, tensors: tuple) -> None:
        """After a backward of this call key (not in place) ran through Python, hand its
        backward key to the C++ eager call, whose nodes then run the later backwards with
        that key (csrc/eager_call.cpp). Offered once; one it cannot run stays in Python: a
        gradient summed by torch, an output's gradient summed to a broadcast input."""
        if self._native_prepared is None or torch.is_grad_enabled():
            return
        for g in grads:
            if type(g) is not torch.Tensor:  # None (an unused output), a subclass
                return
        key = _backward_key(needs, grads)
        if key in self._offered_backwards:
            return
        self._offered_backwards.add(key)
        kernel_needs, sources = self.op.gradient_sources(needs, tensors)
        launch, targets, kernel_inputs = None, [], []
        if any(kernel_needs):
            kernel = self._backwards.get(_backward_key(kernel_needs, grads))
            form = None if kernel is None else kernel.native_form()
            if form is None:
                return
            launch, targets, kernel_inputs = form
        native_sources = []
        for i, source in enumerate(sources):
            if source is not None and source[0] == "kernel":
                source = ("kernel", kernel_inputs.index(i))
            elif source is not None and source[0] == "output" and grads[source[1]].shape != tensors[i].shape:
                return  # summed to the input's shape by torch
            native_sources.append(source)
        native.register_backward(self._native_prepared, needs, grads, launch, targets, native_sources)


def _backward_key(needs, grads: tuple) -> tuple:
    """A backward's key: the gradients asked for and the incoming gradients' layout."""
    key = [tuple(needs)]
    for g in grads:
        key.append((g.shape, g.stride(), g.dtype, g.data_ptr() & 15))
    return tuple(key)
