"""A generated op's plumbing, written once: argument checks, out=, the torch.library ops
(forward and backward, with fake implementations for meta tensors and torch.compile),
autograd, and the eager reference's set-up.

A generated module declares its op as data (inputs, params, outputs, which gradients its
backward kernel computes) and hands over its kernels, wrapped by its backend, and its
reference body; `FusedOp` does the rest. Arguments arrive in the op's public order:
inputs, then params, then (ops with dropout only) training and seed.
"""
from __future__ import annotations

import hashlib
import inspect
import sys
import typing
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import forward_ad

from .arguments import (FusegenArgumentError, Problem, any_requires_grad, broadcast_problem, check_choice, check_scalar,
                        check_training)
from .dropout import check_seed, dropout_mask_reference, seed_result, seed_tensor
from .gradients import sum_to_input
from .out import check_out_targets, check_out_without_grad, output_buffer, write_out
from .backend import BackendKernels, BoundKernels
from .prepared import CACHE_SIZE, PreparedCall, call_key
from . import native, sharding
from ..layout import Choice, Input, MatMul, Scalar

_SCHEMA_TYPES = {"float": "float", "int": "int"}


class Call:
    """One call's checked arguments."""

    __slots__ = ("problem", "params", "has_dropout", "seed", "shard")

    def __init__(self, problem: Problem, params: tuple, has_dropout: bool, seed: int | None, shard=None):
        self.problem = problem
        self.params = params  # checked values, in the spec's order
        self.has_dropout = has_dropout
        self.seed = seed  # an explicit seed, or None: draw one
        # A DTensor's local part: where it sits in the global problem (runtime.sharding.Shard),
        # which dropout masks are keyed by; None for a whole problem.
        self.shard = shard


class FusedOp:
    """One generated op. `kernels` is the backend's run-time kernels, a
    runtime.backend.BackendKernels (the Triton backend's: fusegen.backends.triton.launch.Kernels);
    `self.kernels` is them bound to this op (runtime.backend.BoundKernels), and those
    Protocols are all the op uses of them. `kernels.statistics` is how many values per row
    the forward keeps for the backward (each row's statistics: the `statistics` buffer, [M, statistics]
    in the compute dtype), 0 for none."""

    def __init__(
        self,
        name: str,
        *,
        inputs: tuple[Input, ...],
        params: tuple[Scalar | Choice, ...] = (),
        outputs: tuple[str, ...],
        row_outputs: tuple[str, ...] = (),
        output_parts: dict[str, int] | None = None,
        masks: tuple[str, ...] = (),
        passthrough: dict[str, str] | None = None,
        same_gradient: dict[str, str] | None = None,
        gradient_reads: dict[str, tuple[str, ...]] | None = None,
        output_dtypes: dict[str, str] | None = None,
        no_gradient: tuple[str, ...] = (),
        matmul: MatMul | None = None,
        kernels: BackendKernels,
        reference,
    ):
        self.name = name
        # The op's matmul (the gemm kind): its product [..., N] is the problem, its operands
        # are not broadcast; the product is what the forward keeps for the backward.
        self.matmul = matmul
        self.inputs = inputs
        # The product's chunks: its right operand's ([2N, K]: two side by side), else 1.
        self.product_chunks = next(i.chunks for i in inputs if i.name == matmul.b) if matmul else 1
        self.params = params
        self.outputs = outputs
        # Outputs with one value per row ([..., 1]: a row reduction's, e.g. a log-sum-exp).
        self._row_outputs = tuple(name in row_outputs for name in outputs)
        # Outputs of k parts side by side along the last dim ([..., k * N]); 1: a whole output.
        self.output_parts = tuple((output_parts or {}).get(name, 1) for name in outputs)
        self._has_parts = any(p > 1 for p in self.output_parts)
        # An output's own dtype (a torch.dtype, converted as tensor.to converts), or None: the
        # float inputs' (Problem.out_dtype).
        output_dtypes = output_dtypes or {}
        self._output_dtypes = tuple(getattr(torch, output_dtypes[o]) if o in output_dtypes else None for o in outputs)
        # Outputs without a gradient (quantized): never differentiable. Without any other, the
        # op is forward only: no autograd node at all.
        self._no_gradient = tuple(outputs.index(o) for o in no_gradient)
        self._forward_only = len(self._no_gradient) == len(outputs)
        self.has_dropout = bool(masks)
        names = [p.name for p in params]
        # masks: each dropout mask's p, by stream; the kernels take each such p once, in order.
        self._mask_params = tuple(names.index(p) for p in masks)
        self._dropout_indices = tuple(i for i, name in enumerate(names) if name in masks)
        # An input whose gradient is one output's incoming gradient passes it on, no kernel.
        passthrough = passthrough or {}
        self._passthrough = tuple(
            outputs.index(passthrough[i.name]) if i.name in passthrough else None for i in inputs
        )
        # An input whose gradient is an earlier input's (x + residual): the index of that input.
        names_in = [i.name for i in inputs]
        same_gradient = same_gradient or {}
        self._same_as = tuple(names_in.index(same_gradient[i.name]) if i.name in same_gradient else None
                              for i in inputs)
        self._has_same = any(s is not None for s in self._same_as)
        # An input whose gradient reads only some outputs' incoming gradients: the indices of
        # those (None: every output's). Without any of them it has no gradient (None, as in torch).
        gradient_reads = gradient_reads or {}
        self._reads = tuple(tuple(outputs.index(o) for o in gradient_reads[i.name]) if i.name in gradient_reads
                            else None for i in inputs)
        self._some_reads = any(r is not None for r in self._reads)
        # Every gradient is the backward kernel's own: the C++ node's backward may go straight
        # to the prepared launch (_native_backward).
        self._kernel_only_backward = not self._has_same and all(p is None for p in self._passthrough)
        computed = set(kernels.gradients) | set(passthrough) | set(same_gradient)
        computed |= set(matmul.operands) if matmul else set()  # from the products' gradients
        # Integer and bool inputs have none: they cannot require grad, so none is ever asked for.
        missing = [i.name for i in inputs if i.name not in computed and i.differentiable and not self._forward_only]
        if missing:  # a generated module out of step with its runtime
            raise ValueError(f"{name}: inputs without a gradient: {missing}")
        # What check() does per call, worked out once: it runs on every launch.
        self._n_inputs, self._n_params, self._n_outputs = len(inputs), len(params), len(outputs)
        self._choice_checks = tuple((i, p.name, p.choices) for i, p in enumerate(params) if isinstance(p, Choice))
        self._scalar_checks = tuple(
            (i, p.name, p.type, p.low, p.high, p.low_open, p.high_open) for i, p in enumerate(params)
            if isinstance(p, Scalar)
        )
        self._problems: dict = {}  # checked problems by the tensors' shapes, dtypes and devices
        self._prepared: dict = {}  # PreparedCall by call_key
        self._seed_position = self._n_inputs + self._n_params + 1 if self.has_dropout else None
        # Its C++ autograd node's name (grad_fn.name(), profiles): unlike the library ops' names.
        self._node_name = "Fusegen" + "".join(part.capitalize() for part in name.split("_")) + "Backward"
        # The eager call in C++ (runtime.native.eager_calls), made when the first call key
        # is offered to it (PreparedCall.offer_native); None before, or without the extension.
        self._native_calls = None
        self._reference_body = reference
        self.statistics = kernels.statistics
        self.kernels: BoundKernels = kernels.bind(self)
        self._forward_op, self._backward_op = _register_library_ops(self)
        sharding.register_if_loaded(self)

    # -- the public op --------------------------------------------------------------

    def __call__(self, *args, out=None, inplace_backward: bool = False):
        """The op. `inplace_backward`: the eager backward may write an input's gradient into
        that input's memory (fusegen.backends.triton.launch.PreparedBackward says when)."""
        compiling = torch.compiler.is_compiling()
        # forward_ad's level: the C++ eager call sees a tangent only where gradients are on.
        if not compiling and out is None and forward_ad._current_level < 0:
            fast = self._native_calls
            attaches = fast is not None and self._no_gradient and torch.is_grad_enabled() and any_requires_grad(
                args[:self._n_inputs])
            if attaches and self._forward_only:  # no output has a gradient: C++ attaches no node
                with torch.no_grad():
                    outputs = fast(args, inplace_backward)
                if outputs is not None:
                    return outputs
            elif not attaches and fast is not None:  # a call with a key it knows: outputs (and node) from C++
                outputs = fast(args, inplace_backward)
                if outputs is not None:
                    return outputs
            # else the C++ call would put its node behind every output, also those without a gradient
        if not compiling and _is_tracing():  # a trace would keep the kernel's outputs as constants
            raise FusegenArgumentError(f"{self.name}(): torch.jit.trace is not supported; use torch.compile")
        _check_inplace_backward(self.name, inplace_backward)
        # Two global reads decide it for most calls (no Python call): see _runs_reference.
        if (_functorch_active() or forward_ad._current_level >= 0) and _runs_reference(args[:self._n_inputs]):
            return self._transformed(args, out)
        if out is not None:
            check_out_without_grad(self.name, args[:self._n_inputs])
            if sharding.takes_dtensors(self, args[:self._n_inputs]):
                raise FusegenArgumentError(f"{self.name}(): out= does not take DTensor inputs; drop out=")
            outputs = self.forward(args, out=out, keep=False)[0]
        elif compiling or sharding.takes_dtensors(self, args[:self._n_inputs]) or _tracing_graph(args[:self._n_inputs]):
            # The library op: a traced graph records it (and its kernels, where it can: _library_op),
            # DTensor runs its rule (runtime.sharding).
            outputs = self._forward_op(*args)
            if self._n_outputs + self.has_dropout + bool(self.statistics) == 1:
                outputs = (outputs,)  # the schema returns one Tensor, not a tuple of one
            else:
                outputs = outputs[:self._n_outputs]  # then the seed and statistics, kept for the backward
        elif torch.is_grad_enabled() and not self._forward_only and any_requires_grad(args[:self._n_inputs]):
            outputs = _autograd_apply(self, self.prepare(args), bool(inplace_backward), *args)
        else:
            prepared = self.prepare(args)
            # No gradient follows: the forward keeps nothing for a backward where it can leave it out.
            outputs = (self.forward(args, keep=False) if prepared is None else prepared.forward(args, keep=False))[0]
        return outputs[0] if self._n_outputs == 1 else tuple(outputs)

    def _transformed(self, args: tuple, out):
        """The call under a torch.func transform or with a forward-mode tangent: the reference,
        torch's own ops, which every transform and forward-mode AD go through (the kernels
        have no jvp, and functorch's wrapper tensors have no memory to launch on)."""
        if out is not None and torch._C._are_functorch_transforms_active():
            raise FusegenArgumentError(f"{self.name}(): out= is not supported under torch.func transforms; drop out=")
        return self.reference(*args, out=out)

    def prepare(self, args: tuple) -> PreparedCall | None:
        """The checks, views and launches of `args`' call key, worked out on its first call
        (fusegen.runtime.prepared); None for arguments that take the full path every call."""
        # One key per process: the C++ eager call's where the extension is in use (so the
        # call keys prepared here are the keys it registers), else Python's.
        calls = self._native_calls
        if calls is None and not native.settled_off():
            calls = self.native_calls()
        key = native.call_key(calls, args) if calls is not None else call_key(args, self._n_inputs, self._seed_position)
        if key is None:
            return None
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = PreparedCall(self, self.check(args, needs_kernel=True), args[:self._n_inputs])
            if len(self._prepared) >= CACHE_SIZE:
                self._prepared.clear()
            self._prepared[key] = prepared
        return prepared

    def native_calls(self):
        """The op's eager call in C++, made on first use; None where the extension is not in use."""
        if self._native_calls is None:
            self._native_calls = native.eager_calls(
                inputs=self._n_inputs, arguments=self._n_inputs + self._n_params + 2 * self.has_dropout,
                seed_position=self._seed_position, outputs=self._n_outputs,
                name=self._node_name, op=self, backward=_native_backward)
        return self._native_calls

    def forget_native_calls(self) -> None:
        """Drop the eager call in C++ and the call keys prepared so far (which were offered
        to it): for a process that turns the extension off or on (tests)."""
        self._native_calls = None
        self._prepared.clear()

    def check_params(self, *values) -> tuple:
        """The params checked as a call checks them (the module class checks at construction)."""
        return tuple(
            check_scalar(self.name, p.name, value, p.type, p.low, p.high, p.low_open, p.high_open)
            if isinstance(p, Scalar)
            else check_choice(self.name, p.name, value, p.choices)
            for p, value in zip(self.params, values)
        )

    def init_module(self, module: torch.nn.Module, *values, inplace_backward: bool = False) -> None:
        """The op's torch.nn.Module, constructed: its params checked, kept by their names."""
        torch.nn.Module.__init__(module)
        self.check_params(*values)
        _check_inplace_backward(self.name, inplace_backward)
        for param, value in zip(self.params, values):
            setattr(module, param.name, value)
        module.inplace_backward = inplace_backward

    def module_repr(self, module: torch.nn.Module) -> str:
        """The module's extra_repr: its params, and inplace_backward where it is on."""
        shown = [f"{param.name}={getattr(module, param.name)!r}" for param in self.params]
        return ", ".join(shown + (["inplace_backward=True"] if module.inplace_backward else []))

    def check(self, args: tuple, needs_kernel: bool, shard=None) -> Call:
        """Checks and defaults shared by the kernels and reference (the seed is drawn by the
        caller). `shard`: the tensors are a DTensor's local parts (runtime.sharding)."""
        n, name = self._n_inputs, self.name
        params = list(args[n:n + self._n_params])
        for i, param, choices in self._choice_checks:
            if params[i] not in choices:
                check_choice(name, param, params[i], choices)
        problem = broadcast_problem(name, self.inputs, args[:n], self._problems, self.matmul)
        if problem.n == 0 and True in self._row_outputs:
            raise FusegenArgumentError(
                f"{name}(): the last dim is empty, and an output with one value per row of an empty row is not defined"
            )
        if len(problem.shape) == 0 and self._has_parts:
            raise FusegenArgumentError(f"{name}(): an output of parts side by side along the last dim needs "
                                       "inputs with a last dim, not 0-d tensors")
        if needs_kernel and problem.has_data and problem.device.type != "cuda":
            self.kernels.check_device(problem.device)
        for i, param, *declared in self._scalar_checks:
            params[i] = check_scalar(name, param, params[i], *declared)
        if not self.has_dropout:
            return Call(problem, tuple(params), False, None, shard)
        training, seed = args[n + self._n_params:]
        has_dropout = False
        if check_training(name, training):
            for i in self._dropout_indices:
                if params[i] > 0:
                    has_dropout = True
        return Call(problem, tuple(params), has_dropout, check_seed(name, seed), shard)

    def forward(self, args: tuple, out=None, eager: bool = True, shard=None, traced: bool = False,
                keep: bool = True):
        """Launch the forward kernel; returns the outputs, the seed tensor it used (None
        without dropout) and the statistics it kept for the backward (None without, or with
        `keep` off where the kernels can then leave them out: no gradient follows the call).
        `eager`: not inside a compiled graph, which may be captured. `shard`: the tensors
        are a DTensor's local parts, placed so in the global problem (runtime.sharding).
        `traced`: the tensors are a traced graph's, which records the launch (the library op's
        body while torch.compile or torch.export traces it)."""
        if out is None and shard is None and not traced:
            prepared = self.prepare(args)
            if prepared is not None:
                return prepared.forward(args, eager, keep)
        call = self.check(args, needs_kernel=True, shard=shard)
        problem = call.problem
        tensors = args[:self._n_inputs]
        seed = seed_tensor(call.seed, problem.device, eager) if call.has_dropout else None
        count = self._n_outputs
        if out is None:
            device = problem.device
            outputs = [torch.empty(self.output_shape(problem, i), dtype=self.output_dtype(problem, i), device=device)
                       for i in range(count)]
        else:
            outputs = [output_buffer(self.name, out, i, count, problem, tensors, self.output_shape(problem, i),
                                     self.output_dtype(problem, i)) for i in range(count)]
        statistics = None
        keep = self.keeps(problem, keep)
        if self.statistics and keep:
            statistics = torch.empty(self.statistics_shape(problem), dtype=self.statistics_dtype(problem),
                                     device=problem.device)
        if traced:
            self.kernels.forward(call, tensors, outputs, seed, statistics=statistics, traced=True)
        elif problem.launches:  # not without elements, nor without data (meta or fake tensors)
            self.kernels.forward(call, tensors, outputs, seed, statistics=statistics, keep=keep)
        return (outputs if out is None else write_out(out, tuple(outputs))), seed, statistics

    def keeps(self, problem: Problem, keep: bool) -> bool:
        """Whether a forward keeps its statistics: always where a gradient may follow (`keep`);
        else where the kernels cannot leave them out (a row's few statistics)."""
        return keep or not self.leaves_out(problem)

    def leaves_out(self, problem: Problem) -> bool:
        """Whether a forward that no gradient follows has a launch of its own, which keeps nothing:
        where there is something to leave out (a gemm's product and hidden values, not a row's
        statistics: BoundKernels.statistics_width)."""
        return bool(self.statistics) and self.kernels.statistics_width(problem, keep=False) == 0

    def statistics_shape(self, problem: Problem) -> tuple:
        """The row statistics kept for the backward: [..., statistics], one row per output row
        (laid out as [M, statistics]; shaped so that a DTensor shard of the rows is one too);
        with a matmul, what its forward keeps, laid out by the backend (its product, all its chunks
        side by side; a hidden layer's values)."""
        return (*problem.shape[:-1], self.kernels.statistics_width(problem))

    def statistics_dtype(self, problem: Problem) -> torch.dtype:
        """Statistics in the compute dtype; a matmul's product in the outputs' (as autograd keeps
        F.linear's output for the ops after it)."""
        return problem.out_dtype if self.matmul is not None else problem.compute_dtype

    def output_shape(self, problem: Problem, index: int) -> tuple:
        """The problem's shape; for an output with one value per row, its last dim is 1; for one
        of k parts, k times the problem's."""
        if self._row_outputs[index] and len(problem.shape):
            return (*problem.shape[:-1], 1)
        parts = self.output_parts[index]
        if parts > 1:
            return (*problem.shape[:-1], problem.shape[-1] * parts)
        return problem.shape

    def output_dtype(self, problem: Problem, index: int) -> torch.dtype:
        """The output's declared dtype, else the float inputs' (problem.out_dtype)."""
        return self._output_dtypes[index] or problem.out_dtype

    def backward(self, grads: tuple, args: tuple, seed, needs: tuple[bool, ...], statistics=None,
                 prepared: PreparedCall | None = None, in_place: bool = False) -> list:
        """Every input's gradient (None where not needed) from the outputs' gradients.
        `prepared`: the PreparedCall of the forward's call key, when it had one; `in_place`:
        inputs' memory may take their gradients."""
        tensors = args[: len(self.inputs)]
        kernel_needs, sources = self.gradient_sources(needs, tensors)
        kernel_grads = iter(())
        if any(kernel_needs):
            # The library op only where it is needed: while torch.compile traces (its fake
            # and functional tensors are Tensor subclasses), and under create_graph, where
            # its autograd (which refuses double backward) must be recorded.
            if type(grads[0]) is torch.Tensor and not torch.is_grad_enabled():
                kernel_grads = iter(self.backward_kernels(grads, args, seed, kernel_needs, statistics, prepared,
                                                          in_place))
            else:
                count = len(self.inputs) + len(self.params)
                # The forward's seed tensor replaces its seed argument; training stays.
                extra = (args[count], seed) if self.has_dropout else ()
                extra += (statistics,) if self.statistics else ()
                params = args[len(self.inputs):count]
                kernel_grads = iter(self._backward_op(list(grads), list(tensors), *params, *extra, kernel_needs))
        results = []
        for source, tensor in zip(sources, tensors):
            if source is None:
                results.append(None)
            elif source[0] == "kernel":
                results.append(next(kernel_grads))
            elif source[0] == "output":
                results.append(sum_to_input(grads[source[1]], tensor))
            else:
                results.append(results[source[1]])
        return results

    def gradient_sources(self, needs, tensors) -> tuple[list[bool], list]:
        """Where the gradient of each input flagged in `needs` comes from: the gradients the
        backward kernel computes (flagged in the first list), and per input None (not
        needed), ("kernel",), ("output", j) (output j's gradient passes through, summed to
        the input's shape) or ("input", s) (the gradient of input s, computed once for both
        where both need it and agree in shape and dtype: x + residual)."""
        kernel_needs = [need and through is None for need, through in zip(needs, self._passthrough)]
        sources = [None if not need else ("kernel",) if through is None else ("output", through)
                   for need, through in zip(needs, self._passthrough)]
        if self._has_same:
            for i, source in enumerate(self._same_as):
                if (source is not None and kernel_needs[i] and kernel_needs[source]
                        and tensors[i].shape == tensors[source].shape and tensors[i].dtype == tensors[source].dtype):
                    kernel_needs[i], sources[i] = False, ("input", source)
        return kernel_needs, sources

    def backward_kernels(self, grads, args, seed, needs, statistics=None, prepared: PreparedCall | None = None,
                         in_place: bool = False, shard=None, traced: bool = False) -> list:
        """Launch the backward kernel: the gradients of the inputs flagged in `needs`.
        `traced`: as for forward."""
        tensors = args[: len(self.inputs)]
        if traced:
            call = self.check(args, needs_kernel=True, shard=shard)
            return self.kernels.backward(call, tensors, grads, needs, seed, statistics=statistics, traced=True)
        if shard is not None:
            call = self.check(args, needs_kernel=True, shard=shard)
            return self.kernels.backward(call, tensors, grads, needs, seed, statistics=statistics)
        if prepared is None:
            prepared = self.prepare(args)
        if prepared is not None:
            for g in grads:
                if type(g) is not torch.Tensor:  # e.g. a tensor subclass: the full path
                    break
            else:
                return prepared.backward(grads, tensors, seed, needs, statistics, in_place)
        call = self.check(args, needs_kernel=True)
        return self.kernels.backward(call, tensors, grads, needs, seed, statistics=statistics)

    # -- the eager reference ----------------------------------------------------------

    def reference(self, *args, out=None):
        """The reference body run on the inputs in the compute dtype, with the kernels' masks."""
        tensors = args[: len(self.inputs)]
        if out is not None:
            check_out_without_grad(self.name, tensors)
        call = self.check(args, needs_kernel=False)
        problem = call.problem
        if out is not None:  # before anything runs, as the op checks it
            check_out_targets(self.name, out, self._n_outputs, problem.has_data)
        values = []
        for spec, tensor in zip(self.inputs, tensors):
            if spec.differentiable:  # integer and bool inputs are read as they are, as the kernels do
                tensor = tensor.to(problem.compute_dtype)
            values.extend(tensor.chunk(spec.chunks, dim=spec.chunk_dim) if spec.chunks > 1 else (tensor,))
        params = [
            # A tensor in the compute dtype, as the kernel converts a float param on entry.
            torch.tensor(value, dtype=problem.compute_dtype, device=problem.device)
            if isinstance(p, Scalar) else value
            for p, value in zip(self.params, call.params)
        ]
        masks = []
        if self.has_dropout:
            masks = [None]  # dropout off: the body's other branch
            if call.has_dropout:
                # Drawn as the op draws it; under a torch.func transform by torch's RNG ops, to
                # which vmap's randomness applies (nothing it makes is kept for later calls).
                seed = seed_tensor(call.seed, problem.device, eager=not torch._C._are_functorch_transforms_active())
                masks = [[dropout_mask_reference(seed, problem, stream, p) for stream, p in enumerate(call.params[i] for i in self._mask_params)]]
        if problem.n == 0 and self.statistics:
            # Empty rows: nothing to compute, and no row has a max to take. Zeros that depend
            # on the inputs, so that the reference stays differentiable.
            nothing = sum(v.sum() for v in values) * 0
            results = tuple(torch.zeros(self.output_shape(problem, i), dtype=problem.compute_dtype,
                                        device=problem.device) + nothing for i in range(self._n_outputs))
        else:
            results = self._reference_body(problem, *values, *params, *masks)
        # As the kernels convert (tensor.to); an output without a gradient is cut from the graph.
        results = tuple((r.detach() if i in self._no_gradient else r).to(self.output_dtype(problem, i))
                        for i, r in enumerate(results))
        results = write_out(out, results, copy=True)
        return results[0] if len(self.outputs) == 1 else tuple(results)


# ---------------------------------------------------------------------------
# Autograd: one backward (FusedOp.backward), reached eagerly through _Autograd and under
# torch.compile through the library op's registered autograd.


class _Autograd(torch.autograd.Function):
    """Eager autograd without the library op's dispatch, which costs hundreds of
    microseconds a call. (forward takes ctx itself: a separate setup_context makes apply
    bind arguments through inspect.) Gradients are not materialized: zero gradients for an
    unused output would cost a kernel each."""

    @staticmethod
    def forward(ctx, op: FusedOp, prepared: PreparedCall | None, in_place: bool, *args):
        outputs, seed, statistics = op.forward(args) if prepared is None else prepared.forward(args)
        count = op._n_inputs
        ctx.save_for_backward(*args[:count], *(() if statistics is None else (statistics,)))
        ctx.op, ctx.prepared, ctx.in_place, ctx.params, ctx.seed = op, prepared, in_place, args[count:], seed
        ctx.set_materialize_grads(False)
        if op._no_gradient:
            ctx.mark_non_differentiable(*(outputs[i] for i in op._no_gradient))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        op = ctx.op
        count = op._n_inputs
        needs = ctx.needs_input_grad[3:3 + count]  # after the op, prepared and in_place arguments
        tensors, statistics = ctx.saved_tensors[:count], ctx.saved_tensors[count:]
        in_place = ctx.in_place
        if in_place:
            # Only the gradients this backward asks for (autograd.grad of some inputs): an
            # input whose gradient is not wanted must keep its values.
            needs, known = _wanted(needs, ctx.next_functions[:count])  # one edge per input
            # Where it cannot be known (a leaf inside autograd.grad, a backward called outside
            # the engine) the gradient is computed, into new memory: nothing is written in
            # place unless every such input is a leaf, which is never written in place.
            in_place = all(k or t.is_leaf for k, t in zip(known, tensors))
        statistics = statistics[0] if statistics else None
        gradients = _gradients(op, grads, tensors, ctx.params, ctx.seed, needs, statistics, ctx.prepared, in_place)
        return (None, None, None, *gradients)


def _wanted(needs: tuple, edges: tuple) -> tuple[tuple, tuple]:
    """Per input, whether this backward's engine run wants its gradient, and whether that is
    known: torch cannot say for a leaf's AccumulateGrad inside autograd.grad, nor outside the
    engine (grad_fn.apply called directly); those keep `needs`."""
    wanted, known = [], []
    for need, (node, _) in zip(needs, edges):
        if not need or node is None:
            wanted.append(False)
            known.append(True)
            continue
        try:
            wanted.append(torch._C._will_engine_execute_node(node))
            known.append(True)
        except RuntimeError:
            wanted.append(True)
            known.append(False)
    return tuple(wanted), tuple(known)


try:
    # _Autograd.apply without torch's Python wrapper, which only matters under functorch's
    # transforms (vmap, grad): several microseconds a call.
    _C_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Autograd)
except (AttributeError, KeyError):  # another torch: its own apply
    _C_APPLY = _Autograd.apply


def _autograd_apply(op: FusedOp, prepared: PreparedCall | None, in_place: bool, *args):
    """The forward with its autograd node: fusegen's C++ node (runtime.native) for a call with
    a prepared call key, else the Python Function. (Under torch.func transforms and with
    forward-mode tangents, FusedOp.__call__ runs the reference instead.)"""
    if _compiled_autograd_enabled():
        # The Python Function, which compiled autograd traces; never in place there (what
        # decides it reads the engine's state, which a traced backward has not).
        return _C_APPLY(op, prepared, False, *args)
    if prepared is not None and not op._no_gradient:  # the C++ node differentiates every output
        attach = native.attach_for()
        if attach is not None:
            # As autograd.Function runs its forward: nothing the launch does is recorded
            # (a broadcast input's [M, N] view, for one).
            grad_mode = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                outputs, seed, statistics = prepared.forward(args)
            finally:
                torch._C._set_grad_enabled(grad_mode)
            count = op._n_inputs
            tensors = args[:count]
            state = (op, prepared, in_place, args[count:], seed)
            if attach(_native_backward, state, op._node_name, tensors, outputs,
                      tensors if statistics is None else (*tensors, statistics)):
                return tuple(outputs)
            # An input with a forward-mode gradient (none reach here: __call__ runs the
            # reference for them): the Python Function, which raises for want of a jvp.
    return _C_APPLY(op, prepared, in_place, *args)


# Per call: no attribute lookups.
_functorch_active = torch._C._are_functorch_transforms_active
_is_tracing = torch._C._is_tracing
_dispatch_modes = torch._C._len_torch_dispatch_stack


def _tracing_graph(tensors: tuple) -> bool:
    """Whether a graph is being traced outside torch.compile (make_fx, aot_function): fake
    tensors, or a dispatch mode such as make_fx's proxy mode on real ones. A launch there
    would be missing from the graph, so the call goes to the library op, which the graph records."""
    if _dispatch_modes():
        return True
    for t in tensors:
        if type(t) is not torch.Tensor and is_fake(t):
            return True
    return False


def _tangent_input(tensors: tuple) -> int | None:
    """The first input that carries a forward-mode tangent, or None (also outside dual_level)."""
    if forward_ad._current_level < 0:
        return None
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None:
            return i
    return None


def _runs_reference(tensors: tuple) -> bool:
    """Whether a call takes the reference (FusedOp._transformed): under a torch.func transform
    (vmap, grad, jvp, jacrev, ...), or inside forward_ad.dual_level with an input that carries
    a tangent."""
    return _functorch_active() or _tangent_input(tensors) is not None


def _refuse_tangents(op: FusedOp, args: tuple) -> None:
    """The library op has no jvp, and torch's custom_op passes an input's tangent by (its
    output would have none) where the input does not require grad: refused instead."""
    i = _tangent_input(args[:len(op.inputs)])
    if i is not None:
        raise FusegenArgumentError(
            f"fusegen::{op.name}: {op.inputs[i].name} has a forward-mode tangent, which the library op cannot "
            f"carry; call {op.name}() itself, which runs its reference under forward-mode AD")


def _compiled_autograd_enabled() -> bool:
    """Whether a backward may be traced by compiled autograd (torch._dynamo.config's
    compiled_autograd, or its _enable context), which takes Python Functions but not C++
    nodes without a tracing rule, such as fusegen's."""
    config = sys.modules.get("torch._dynamo.config")
    if config is not None and getattr(config, "compiled_autograd", False):
        return True
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled is not None and bool(getattr(compiled, "compiled_autograd_enabled", False))


def _native_backward(state: tuple, needs: tuple, saved: tuple, grads: tuple) -> tuple:
    """The C++ node's backward (runtime.native): one gradient or None per input. The first
    with each backward key is offered to the C++ eager call, which then runs the later ones."""
    op, prepared, in_place, params, seed = state
    if in_place and torch._C._current_graph_task_id() == -1:
        # Called outside the engine (the node called directly): `needs` are the node's edges,
        # not what a backward asked for, so nothing in place. Inside it they are exact.
        in_place = False
    count = op._n_inputs
    tensors = saved[:count]
    statistics = saved[count] if len(saved) > count else None
    if op._kernel_only_backward and not torch.is_grad_enabled():
        # What FusedOp.backward does for plain tensors, every gradient given and every
        # gradient the kernel's, without its general bookkeeping (a few µs a call).
        for g in grads:
            if type(g) is not torch.Tensor:
                break
        else:
            if any(needs):
                kernel = iter(prepared.backward(grads, tensors, seed, needs, statistics, in_place))
                gradients = [next(kernel) if need else None for need in needs]
                if not in_place:
                    prepared.offer_backward(needs, grads, tensors)
                return gradients
            return [None] * count
    gradients = _gradients(op, grads, tensors, params, seed, needs, statistics, prepared, in_place)[:count]
    if prepared is not None and not in_place:
        prepared.offer_backward(needs, grads, tensors)
    return gradients


def _gradients(op: FusedOp, grads: tuple, tensors: tuple, params: tuple, seed, needs, statistics=None,
               prepared: PreparedCall | None = None, in_place: bool = False) -> tuple:
    """The backward shared by both autograd paths, one gradient per argument of the op: None
    stands for an output's zero gradient, and for every argument that is not a tensor."""
    given = [g for g in grads if g is not None]
    nothing = (None,) * (len(tensors) + len(params))
    if not given:
        return nothing
    if op._some_reads and len(given) < len(grads):
        # An unused output's gradient is zero: an input whose gradient reads only such ones has none.
        needs = tuple(need and (reads is None or any(grads[j] is not None for j in reads))
                      for need, reads in zip(needs, op._reads))
        if not any(needs):
            return nothing
    if op._has_parts:  # an output of k parts is k times as wide as the others: zeros of its width
        parts = op.output_parts
        first = next(j for j, g in enumerate(grads) if g is not None)
        lead, width = given[0].shape[:-1], given[0].shape[-1] // parts[first]
        grads = tuple(given[0].new_zeros((*lead, width * parts[j])) if g is None else g for j, g in enumerate(grads))
    grads = tuple(torch.zeros_like(given[0]) if g is None else g for g in grads)
    input_grads = op.backward(grads, (*tensors, *params), seed, needs, statistics, prepared, in_place)
    return (*input_grads, *nothing[len(tensors):])


def _schema_arguments(op: FusedOp) -> list[str]:
    params = [f"{_SCHEMA_TYPES[p.type] if isinstance(p, Scalar) else 'str'} {p.name}" for p in op.params]
    return [f"Tensor {i.name}" for i in op.inputs] + params


_ANNOTATIONS = {"Tensor": torch.Tensor, "float": float, "int": int, "str": str, "bool": bool,
                "int?": typing.Optional[int], "Tensor[]": list[torch.Tensor], "bool[]": list[bool],
                "SymInt[]?": typing.Optional[typing.Sequence[int]]}

# The library ops' last argument: a DTensor shard's place in the global problem
# (runtime.sharding.Shard's six sizes), which dropout's masks are keyed by. Only the DTensor
# rules pass it, on a shard's local tensors; as sizes (SymInts while traced) it is data that a
# compiled graph carries, so a sharded graph draws the global mask.
_SHARD_ARGUMENT = "SymInt[]? _shard=None"


def _split_shard(args: tuple, count: int) -> tuple[tuple, object]:
    """A library op's arguments without the trailing shard sizes, and the Shard they give
    (None: a whole problem). `count`: how many arguments come before them."""
    if len(args) > count:
        return args[:count], sharding.Shard.of(args[count])
    return args, None


def _library_op(name: str, impl, arguments: list[str], returns: str, traced: bool, tags=()):
    """fusegen::<name> with this schema. `traced` (kernels a traced graph can record): a
    torch.library.triton_op, whose body torch.compile and torch.export trace into, so that
    Inductor launches its kernels itself; else (the CPU interpreter) an opaque custom op."""
    if not traced:
        schema = f"({', '.join(arguments)}) -> {returns}"
        return torch.library.custom_op(f"fusegen::{name}", impl, mutates_args=(), schema=schema, tags=tags)
    # triton_op takes its schema from the function's signature.
    parameters = []
    for argument in arguments:
        argument, _, default = argument.partition("=")
        schema_type, parameter = argument.rsplit(" ", 1)
        parameters.append(inspect.Parameter(parameter, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            annotation=_ANNOTATIONS[schema_type],
                                            default=None if default == "None" else inspect.Parameter.empty))
    results = returns.strip("()").split(", ")
    returned = _ANNOTATIONS[returns] if len(results) == 1 else tuple[tuple(_ANNOTATIONS[r] for r in results)]

    def body(*args):
        return impl(*args)

    body.__signature__ = inspect.Signature(parameters, return_annotation=returned)
    # triton_op takes no tags: inside torch.compile the op is decomposed and its seed's draw
    # (torch.randint) carries the tag; a torch.export graph keeps the op whole, untagged.
    return torch.library.triton_op(f"fusegen::{name}", body, mutates_args=())


def _traced(op: FusedOp, tensors) -> bool:
    """Whether a library op's body is being traced into a graph (its tensors are fake)."""
    return op.kernels.traceable and any(is_fake(t) for t in tensors)


def _check_inplace_backward(name: str, value) -> None:
    if type(value) is not bool:
        raise FusegenArgumentError(f"{name}(): inplace_backward must be True or False, got {type(value).__name__}")


class _Registration:
    """One op name's library ops, and the ops that call them."""

    def __init__(self, source: str | None, module: str, forward_op, backward_op):
        self.source = source  # the generated module's text, hashed (None: not read from a file)
        self.module = module  # the module that registered them
        self.forward_op, self.backward_op = forward_op, backward_op
        self.ops: weakref.WeakSet = weakref.WeakSet()


# The library ops of this process, by op name. torch keeps one op a name: registering
# fusegen::<op> again (the same generated module imported under a second name, generated.<op>
# and fusegen.ops.<op>; an op rebuilt and imported again) destroys the first registration, and
# the first module's op objects would still call it: a freed dispatcher entry (a crash, or
# another op called).
_LIBRARY: dict[str, _Registration] = {}


def _source_of(op: FusedOp) -> tuple[str | None, str]:
    """The text of the module that declares `op`, hashed (None where it was not read from a
    file), and that module's name."""
    code = getattr(op._reference_body, "__code__", None)
    module = getattr(op._reference_body, "__module__", None) or "?"
    try:
        with open(code.co_filename, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest(), module
    except (AttributeError, OSError, TypeError):
        return None, module


class _Superseded:
    """In place of the library ops of an op whose name a later module registered again
    with other code: any use says so in one line (torch dropped these ops' registration)."""

    def __init__(self, name: str, module: str, by: str):
        self._message = (f"fusegen::{name}: this op (from {module}) was registered again by {by}, with other "
                         f"code; its library ops (torch.compile, create_graph, DTensor) are gone: use {by}'s "
                         "op, or import each generated op under one module name")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(self._message)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(self._message)


def _register_library_ops(op: FusedOp):
    """fusegen::<op> and fusegen::<op>_backward: autograd and torch.compile each see one
    opaque op. Saved for backward: the inputs (the seed tensor, the row statistics), nothing else.
    An op of the same name registered before from the same code (the same generated module under
    another module name): its library ops, shared (they compute what this op's would)."""
    source, module = _source_of(op)
    registered = _LIBRARY.get(op.name)
    if registered is not None and source is not None and registered.source == source:
        registered.ops.add(op)
        return registered.forward_op, registered.backward_op
    forward_op, backward_op = _new_library_ops(op)
    if registered is not None:
        # torch has dropped the earlier registration: the ops that called it may no longer.
        for earlier in list(registered.ops):
            earlier._forward_op = _Superseded(op.name, registered.module, module)
            if earlier._backward_op is not None:
                earlier._backward_op = _Superseded(op.name, registered.module, module)
    _LIBRARY[op.name] = registration = _Registration(source, module, forward_op, backward_op)
    registration.ops.add(op)
    return forward_op, backward_op


def _new_library_ops(op: FusedOp):
    arguments = _schema_arguments(op)
    # The forward's results: the outputs, then the seed tensor and the statistics kept for backward.
    extras = op.has_dropout + bool(op.statistics)
    # One result is `-> Tensor`: a schema's `(Tensor)` is not a tuple of one.
    single = len(op.outputs) + extras == 1
    returns = "Tensor" if single else "(" + ", ".join(["Tensor"] * (len(op.outputs) + extras)) + ")"
    traceable = op.kernels.traceable
    if op.has_dropout:
        # It draws random numbers: tagged so (as a custom op), never recomputed in the backward.
        arguments, tags = arguments + ["bool training", "int? seed"], (torch.Tag.nondeterministic_seeded,)
    else:
        tags = ()

    count = len(arguments)  # before the shard's sizes

    def forward_impl(*args):
        _refuse_tangents(op, args)
        args, shard = _split_shard(args, count)
        # eager=False: a compiled graph may be captured.
        outputs, seed, statistics = op.forward(args, eager=False, shard=shard,
                                               traced=_traced(op, args[:len(op.inputs)]))
        if single:
            return outputs[0]
        results = list(outputs)
        if op.has_dropout:
            results.append(seed_result(seed, outputs[0].device))
        if op.statistics:
            results.append(statistics)
        return tuple(results)

    forward_op = _library_op(op.name, forward_impl, [*arguments, _SHARD_ARGUMENT], returns, traceable, tags)

    @forward_op.register_fake
    def _(*args):
        _refuse_tangents(op, args)
        problem = broadcast_problem(op.name, op.inputs, args[: len(op.inputs)], op._problems, op.matmul)
        outputs = [torch.empty(op.output_shape(problem, i), dtype=op.output_dtype(problem, i), device=problem.device)
                   for i in range(len(op.outputs))]
        seed = [torch.empty((1,), dtype=torch.int64, device=problem.device)] if op.has_dropout else []
        statistics = [torch.empty(op.statistics_shape(problem), dtype=op.statistics_dtype(problem), device=problem.device)
                      ] if op.statistics else []
        return outputs[0] if single else (*outputs, *seed, *statistics)

    def setup_context(ctx, inputs, output):
        # An unused output's gradient stays None (not zeros): an input whose gradient reads
        # only such outputs gets None, as on the eager path (FusedOp._reads).
        ctx.set_materialize_grads(False)
        count = len(op.inputs)
        outputs = (output,) if single else output
        if op._no_gradient:
            ctx.mark_non_differentiable(*(outputs[i] for i in op._no_gradient))
        ctx.save_for_backward(*inputs[:count], *outputs[len(op.outputs):])
        # Without the shard's sizes: autograd sees the whole (DTensor) call, whose shards'
        # places the DTensor rule of the backward op works out again.
        ctx.params = inputs[count:len(arguments)]

    def backward(ctx, *grads):
        count = len(op.inputs)
        tensors, extras = ctx.saved_tensors[:count], list(ctx.saved_tensors[count:])
        seed = extras.pop(0) if op.has_dropout else None
        statistics = extras.pop(0) if op.statistics else None
        return _gradients(op, grads[: len(op.outputs)], tensors, ctx.params, seed, ctx.needs_input_grad[:count],
                          statistics)

    forward_op.register_autograd(backward, setup_context=setup_context)
    if op._forward_only:  # no output has a gradient: no backward op (nor kernel)
        return forward_op, None

    # The backward op's own arguments start with '_', as spec names never do.
    extra = ((["bool training", "Tensor _seed"] if op.has_dropout else [])
             + (["Tensor _statistics"] if op.statistics else []))
    params = _schema_arguments(op)[len(op.inputs):]
    backward_arguments = ["Tensor[] _grads", "Tensor[] _inputs", *params, *extra, "bool[] _needs_grad"]
    backward_count = len(backward_arguments)

    def backward_impl(*args):
        args, shard = _split_shard(args, backward_count)
        grads, tensors, *params, needs = args
        seed = statistics = None
        if op.statistics:
            *params, statistics = params
        if op.has_dropout:
            *params, training, seed = params
            params = (*params, training, None)  # the seed argument: the tensor is passed on its own
        return op.backward_kernels(tuple(grads), (*tensors, *params), seed, needs, statistics, shard=shard,
                                   traced=_traced(op, (*grads, *tensors)))

    backward_op = _library_op(f"{op.name}_backward", backward_impl, [*backward_arguments, _SHARD_ARGUMENT],
                              "Tensor[]", traceable)

    @backward_op.register_fake
    def _(*args):
        _, tensors, *_, needs = args[:backward_count]
        return [torch.empty_like(t) for t, need in zip(tensors, needs) if need]

    def no_double_backward(ctx, *grads):
        raise RuntimeError(f"fusegen::{op.name}: double backward is not supported")

    backward_op.register_autograd(no_double_backward, setup_context=lambda ctx, inputs, output: None)
    return forward_op, backward_op


__all__ = ["Call", "FusedOp", "FusegenArgumentError"]
