"""Generated ops on DTensors (tensor and sequence parallelism), with rules derived from each
input's layout rather than written per op.

The problem's placement P (per device mesh dim) comes from the inputs shaped like the
output: their first `Shard(d)` on that mesh dim, else `Replicate`. It falls back to
`Replicate` (DTensor then gathers, visibly) where a shard cannot be computed locally:
`Shard(last)` for row reductions (a row's values must meet) and for chunked inputs
(`[..., 2N]`: the last dim's shard would split the chunks unevenly), and for ops with
dropout a second sharded leading dim (`Shard` places a part by one leading dim and the
last). Each input takes P where it spans the sharded dim, else `Replicate` (a bias `[N]`
under a row shard, a `[..., 1]` scale under a column shard); `Partial` inputs are reduced by
that redistribution before anything nonlinear. Outputs, row outputs and the row statistics
kept for the backward take P; the seed is replicated. A gradient takes its input's
placement, or `Partial(sum)` on each mesh dim where the input was replicated over a sharded
dim (its gradient is a sum over rows this rank holds part of).

Dropout draws the mask of the global tensor: the kernels get the shard's place in the global
problem (`Shard`), so a sharded run drops exactly what one device would, given the same seed
on every rank (torch.manual_seed on every rank, as DTensor's own random ops require, or an
explicit seed=). Inside torch.compile the library op's last argument carries the shard's
place as sizes (`_shard`), which the graph keeps symbolic where the sizes are.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from .arguments import CACHE_SIZE, PLAIN_TENSOR_TYPES, FusegenArgumentError, broadcast_problem
from .dropout import seed_result

# DTensor is imported only once a call meets one (importing it costs most of a second, and
# a DTensor can only exist once something has imported it).
_DTENSOR_MODULE = "torch.distributed.tensor"


@dataclass(frozen=True)
class Shard:
    """Where a local [M, N] problem sits in the global one, as the kernels' dropout reads it
    (kernel_lib.dropout_mask): one step of the sharded leading dim spans `inner` rows, the
    dim has `local` of its `total` extent here from `offset`; columns start at
    `column_offset` of `n_global`."""

    inner: int
    local: int
    total: int
    offset: int
    column_offset: int
    n_global: int

    @classmethod
    def of(cls, sizes) -> "Shard | None":
        """The Shard of a library op's `_shard` argument (its six sizes), None for None."""
        return None if sizes is None else cls(*sizes)

    def sizes(self) -> list:
        """The six sizes, as the library ops take them (SymInts while torch.compile traces)."""
        return [self.inner, self.local, self.total, self.offset, self.column_offset, self.n_global]

    @property
    def whole_groups(self) -> bool:
        """Rows of whole groups of four dropout words, globally."""
        return self.n_global % 4 == 0 and self.column_offset % 4 == 0

    def buffer(self, device: torch.device, traced: bool = False) -> torch.Tensor:
        """The six sizes as the kernels read them: a cached int64 tensor, or in a traced graph
        one the graph makes (a constant, or from its symbolic sizes, never their example values)."""
        if traced:
            values = self.sizes()
            if all(type(v) is int for v in values):
                return torch.tensor(values, dtype=torch.int64, device=device)
            # torch.tensor would take a SymInt's example value, specializing the graph to it.
            return torch.stack([torch.scalar_tensor(v, dtype=torch.int64, device=device) for v in values])
        key = (self, device)
        buffer = _BUFFERS.get(key)
        if buffer is None:
            if len(_BUFFERS) >= CACHE_SIZE:
                _BUFFERS.clear()
            buffer = _BUFFERS[key] = torch.tensor(self.sizes(), dtype=torch.int64, device=device)
        return buffer


_BUFFERS: dict = {}


def takes_dtensors(op, tensors) -> bool:
    """Whether a call's tensors include a DTensor. Then the call takes the op's library op,
    whose DTensor rules (registered here on the first such call) run it shard by shard."""
    for t in tensors:
        if type(t) is not torch.Tensor:
            module = sys.modules.get(_DTENSOR_MODULE)
            if module is not None and isinstance(t, module.DTensor):
                if op.matmul is not None:
                    raise FusegenArgumentError(f"{op.name}(): DTensor inputs are not supported yet for an op with a "
                                               f"matmul ({op.matmul.text})")
                if op not in _REGISTERED:
                    if torch.compiler.is_compiling():
                        # Registering is a side effect that torch.compile's tracer cannot make.
                        raise FusegenArgumentError(
                            f"{op.name}(): its DTensor rules are registered by its first call with "
                            "DTensor inputs outside torch.compile, or when the generated module is "
                            "imported after torch.distributed.tensor; neither happened before this "
                            "compiled call"
                        )
                    register(op)
                return True
    return False


def register_if_loaded(op) -> None:
    """Register the op's DTensor rules now if DTensor is loaded already (so that a first call
    inside torch.compile finds them); otherwise its first DTensor call will."""
    if _DTENSOR_MODULE in sys.modules:
        register(op)


def register(op) -> None:
    if op not in _REGISTERED:
        _register(op)
        _REGISTERED.add(op)


_REGISTERED: set = set()  # the ops whose library ops carry DTensor rules


@dataclass(frozen=True)
class _ShardedCall:
    """How the DTensor calls with one DTensor call key run: their placements and their shard's place."""

    mesh: object
    placements: tuple  # P: the output's, one per mesh dim
    inputs: tuple  # each input's target placements
    shape: torch.Size  # the global output shape
    shard: Shard | None  # None when not sharded or without dropout; symbolic sizes while traced
    traced: bool  # torch.compile traces the call: its local tensors are fake ones


def _sharded_call(op, tensors) -> _ShardedCall:
    """A DTensor call worked out (placements, the shard's place), kept per DTensor call
    key (shapes, placements, mesh): working it out anew took about a third of a DTensor call's
    host time."""
    from torch.distributed.tensor import DTensor

    if _traced([_waited(t._local_tensor) for t in tensors if isinstance(t, DTensor)]):
        # torch.compile's tracing: shapes may be symbolic, and nothing is kept.
        return _new_sharded_call(op, tensors, traced=True)
    key = (op, *((t.shape, t.placements, t.device_mesh) if isinstance(t, DTensor) else (t.shape,)
                 for t in tensors))
    call = _SHARDED_CALLS.get(key)
    if call is None:
        if len(_SHARDED_CALLS) >= CACHE_SIZE:
            _SHARDED_CALLS.clear()
        call = _SHARDED_CALLS[key] = _new_sharded_call(op, tensors)
    return call


_SHARDED_CALLS: dict = {}


def _new_sharded_call(op, tensors, traced: bool = False) -> _ShardedCall:
    """`traced`: torch.compile traces the call; the shard's place is worked out from the
    traced sizes (symbolic ones stay symbolic) and this rank's mesh coordinate."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as ShardPlacement

    dtensors = [t for t in tensors if isinstance(t, DTensor)]
    mesh = dtensors[0].device_mesh
    if any(t.device_mesh != mesh for t in dtensors):
        raise FusegenArgumentError(f"{op.name}(): all DTensor inputs must be on one device mesh")
    # The global problem, checked as the op checks plain tensors (shapes only: meta stand-ins).
    stand_ins = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors]
    shape = broadcast_problem(op.name, op.inputs, stand_ins).shape
    ndim, last = len(shape), len(shape) - 1
    placements = []
    for i in range(mesh.ndim):  # each mesh dim: the first shard among inputs shaped like the output
        placement = Replicate()
        for t in tensors:
            if isinstance(t, DTensor) and t.dim() == ndim and t.placements[i].is_shard():
                placement = ShardPlacement(t.placements[i].dim % ndim)
                break
        if placement.is_shard() and placement.dim == last and (
            op.statistics or any(spec.chunks > 1 for spec in op.inputs)
        ):
            placement = Replicate()  # rows must stay whole, chunks unsplit: gathered first
        placements.append(placement)
    if op.has_dropout:
        # The kernels place a shard in the global mask by one leading dim and the last dim
        # (Shard): a second sharded leading dim is gathered first.
        leading = None
        for i, placement in enumerate(placements):
            if placement.is_shard() and placement.dim != last:
                if leading is None:
                    leading = placement.dim
                elif placement.dim != leading:
                    placements[i] = Replicate()
    targets = tuple(tuple(_input_placement(p, t, shape) for p in placements) for t in tensors)
    # Only dropout reads the shard's place: without it the local call is a whole problem's
    # (and takes the prepared path of plain calls).
    shard = _shard(placements, shape, mesh) if op.has_dropout else None
    return _ShardedCall(mesh, tuple(placements), targets, shape, shard, traced)


def _input_placement(placement, tensor, shape):
    """P where the input spans the sharded dim (its own dim aligned from the right), else Replicate."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as ShardPlacement

    if not placement.is_shard():
        return Replicate()
    own = placement.dim - (len(shape) - tensor.dim())
    if own < 0 or tensor.shape[own] != shape[placement.dim]:
        return Replicate()
    return ShardPlacement(own)


def _shard(placements, shape, mesh) -> Shard | None:
    """Where this rank's part sits in the global problem, from the placements applied in mesh
    order (torch.chunk's split: a dim sharded on two mesh dims is split within the first's
    part). Plain arithmetic on the sizes and the mesh coordinate, SymInts included: DTensor's
    own helper indexes a tensor of offsets, which a traced graph cannot read back."""
    if not any(p.is_shard() for p in placements):
        return None
    local, offset = list(shape), [0] * len(shape)
    for i, placement in enumerate(placements):
        if placement.is_shard():
            d = placement.dim
            size, start = _chunk(local[d], mesh.size(i), _coordinate(mesh, i))
            local[d], offset[d] = size, offset[d] + start
    last = len(shape) - 1
    leading = [p.dim for p in placements if p.is_shard() and p.dim != last]
    if not leading:
        return Shard(1, 1, 1, 0, offset[last], shape[last])
    d = leading[0]  # the only one where dropout is in play (_new_sharded_call)
    return Shard(math.prod(shape[d + 1:last]), local[d], shape[d], offset[d], offset[last], shape[last])


def _chunk(size, count: int, index):
    """Part `index` of `count` of a dim of `size`, as torch.chunk splits it: (its size, its start)."""
    step = -(-size // count)  # ceil, for SymInts too
    start = torch.sym_min(step * index, size)
    return torch.sym_min(size, start + step) - start, start


def _coordinate(mesh, dim: int):
    """This rank's coordinate on a mesh dim (a SymInt where torch.distributed.config's
    compile_on_one_rank makes graphs rank-agnostic)."""
    coordinate = getattr(mesh, "_sym_get_coordinate", None)
    return coordinate(dim) if coordinate is not None else mesh.get_coordinate()[dim]


def _local(tensor, mesh, placements):
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        if tensor.placements == placements:
            # Below autograd already (a dispatch rule): the local part itself, not to_local().
            return _waited(tensor._local_tensor)
        return _waited(tensor.redistribute(mesh, placements).to_local())
    return tensor  # a plain tensor beside DTensors: taken as the same on every rank


def _waited(local: torch.Tensor) -> torch.Tensor:
    """The tensor itself where a collective's result is still in flight (an
    AsyncCollectiveTensor, which a redistribution or a tensor-parallel layer's backward hands
    on): a kernel reads memory, which only the wait makes final."""
    if type(local) is torch.Tensor:
        return local
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local


def _wrap(local: torch.Tensor, call: _ShardedCall, placements: tuple, shape):
    """A result as a DTensor, made as DTensor's own op rules make theirs (from_local is an
    autograd function, and building its spec each time cost as much again)."""
    from torch.distributed.tensor import DTensor

    if not all(type(d) is int for d in shape):  # symbolic sizes (torch.compile): not kept
        return DTensor(local, _spec(call.mesh, placements, shape, local.dtype), requires_grad=False)
    key = (call.mesh, placements, tuple(shape), local.dtype)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= CACHE_SIZE:
            _SPECS.clear()
        spec = _SPECS[key] = _spec(call.mesh, placements, shape, local.dtype)
    return DTensor(local, spec, requires_grad=False)


def _spec(mesh, placements: tuple, shape, dtype):
    """A contiguous global tensor's spec on the mesh (uneven shards included)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = torch.Size(shape)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, dtype))


_SPECS: dict = {}


def _register(op) -> None:
    """The DTensor rules of the op's two library ops (see the module docstring)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    count = len(op.inputs)
    # The library ops' arguments after the inputs, up to the shard's sizes (which a call
    # from above DTensor leaves out, or passes as None).
    forward_rest = len(op.params) + 2 * op.has_dropout
    backward_rest = len(op.params) + 2 * op.has_dropout + bool(op.statistics) + 1

    def forward_rule(cls, func, types, args, kwargs):
        tensors, rest = args[:count], args[count:count + forward_rest]
        call = _sharded_call(op, tensors)
        local = [_local(t, call.mesh, p) for t, p in zip(tensors, call.inputs)]
        if call.traced:
            # torch.compile traces the DTensor call: the graph records the library op on the
            # local tensors (launching here would only see fake ones), with the shard's place
            # as sizes the graph carries.
            results = func(*local, *rest, _sizes(call.shard))
            results = list(results) if isinstance(results, (tuple, list)) else [results]
            outputs = results[:len(op._row_outputs)]
            seed = results[len(outputs)] if op.has_dropout else None
            statistics = results[-1] if op.statistics else None
        else:
            # Seeds drawn as an eager call on one device draws them (the same seed, given the
            # same generator state on every rank).
            outputs, seed, statistics = op.forward((*local, *rest), eager=True, shard=call.shard)
        lead = call.shape[:-1]
        results = [_wrap(o, call, call.placements, (*lead, 1) if row else call.shape)
                   for o, row in zip(outputs, op._row_outputs)]
        if op.has_dropout:
            replicated = (Replicate(),) * call.mesh.ndim
            results.append(_wrap(seed_result(seed, outputs[0].device), call, replicated, (1,)))
        if op.statistics:
            results.append(_wrap(statistics, call, call.placements, (*lead, op.statistics)))
        return results[0] if len(results) == 1 else tuple(results)

    def backward_rule(cls, func, types, args, kwargs):
        grads, tensors, *rest = args[:2 + backward_rest]
        needs = rest[-1]
        call = _sharded_call(op, tensors)
        local = [_local(t, call.mesh, p) for t, p in zip(tensors, call.inputs)]
        local_grads = [_local(g, call.mesh, call.placements) for g in grads]
        params = rest[:len(op.params)]
        extra = rest[len(op.params):-1]
        seed = statistics = None
        if op.has_dropout:
            training, seed = extra[0], _local(extra[1], call.mesh, (Replicate(),) * call.mesh.ndim)
            params = (*params, training, None)
            extra = extra[2:]
        if op.statistics:
            statistics = _local(extra[0], call.mesh, call.placements)
        if call.traced:
            saved_args = ((training, seed) if op.has_dropout else ()) + ((statistics,) if op.statistics else ())
            gradients = func(list(local_grads), list(local), *rest[:len(op.params)], *saved_args, needs,
                             _sizes(call.shard))
        else:
            gradients = op.backward_kernels(tuple(local_grads), (*local, *params), seed, needs, statistics,
                                            shard=call.shard)
        results = []
        for gradient, t, targets in zip(gradients, [t for t, n in zip(tensors, needs) if n],
                                        [p for p, n in zip(call.inputs, needs) if n]):
            # Summed over the rows this rank holds part of, where the input was replicated
            # over a sharded mesh dim.
            placements = tuple(Partial() if p.is_shard() and not target.is_shard() else target
                               for p, target in zip(call.placements, targets))
            results.append(_wrap(gradient, call, placements, t.shape))
        return results

    op._forward_op.register_torch_dispatch(DTensor, forward_rule)
    if op._backward_op is not None:  # None: a forward-only op
        op._backward_op.register_torch_dispatch(DTensor, backward_rule)
    _detach_in_place_rule(DTensor)


def _traced(local) -> bool:
    """Whether the local tensors are torch.compile's stand-ins (fake or functional ones)."""
    return any(isinstance(t, torch.Tensor) and type(t) not in PLAIN_TENSOR_TYPES for t in local)


def _sizes(shard: Shard | None):
    return None if shard is None else shard.sizes()


def _detach_in_place_rule(DTensor) -> None:
    """torch 2.11's DTensor has no rule for aten.detach_, which autograd applies to a custom
    op's non-differentiable outputs (the seed); torch 2.13 gives it aten.detach's, as here."""
    try:
        propagator = DTensor._op_dispatcher.sharding_propagator
        rules = propagator.op_strategy_funcs
        detach, detach_ = torch.ops.aten.detach.default, torch.ops.aten.detach_.default
        if detach_ not in rules and detach in rules:
            propagator.register_op_strategy(detach_, rules[detach])
    except AttributeError:  # another DTensor: its own rules
        pass
