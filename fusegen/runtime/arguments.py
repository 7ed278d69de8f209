"""Checking a generated op's arguments: tensors against the spec's dims, broadcasting them
as torch would, and scalar and choice params against their declarations."""
from __future__ import annotations

import functools
import operator
import numbers
import sys
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import forward_ad

from ..layout import Input, MatMul, in_range, range_text

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# An integer or bool input's dtype, as its declaration names it (layout.INTEGER_DTYPES): exactly that one.
INTEGER_TORCH_DTYPES = {"int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
FLOAT32_MAX = 3.4028234663852886e38
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # an int param reaches the kernel as at most an int64


class FusegenArgumentError(ValueError):
    """A generated op was called with arguments it cannot take."""


def check_choice(op: str, name: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise FusegenArgumentError(f"{op}(): {name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_scalar(op: str, name: str, value, number_type: str, low, high, low_open: bool = False, high_open: bool = False):
    """A runtime scalar param: right type, finite, inside the spec's range."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        if value.device.type == "meta" or is_fake(value):
            raise FusegenArgumentError(f"{op}(): {name} is a tensor without data ({value.device.type}); pass a number")
        if _carries_derivative(value):  # .item() would drop its tangent or its batch
            raise FusegenArgumentError(
                f"{op}(): {name} is a tensor under forward-mode AD or a torch.func transform; a param has no "
                "derivative and no batch dim: pass a number")
        value = value.item()
    if isinstance(value, torch.SymInt):  # a traced graph's int (torch.compile, dynamic=True): specialized
        value = int(value)
    given = value
    if type(value) is not float and type(value) is not int:  # the common case skips the ABC checks
        # numpy's numbers too (np.float32(0.1), np.int64(3)): numbers.Real and Integral.
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise FusegenArgumentError(f"{op}(): {name} must be a number, got {type(value).__name__}")
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
    if number_type == "int" and type(value) is not int:
        raise FusegenArgumentError(f"{op}(): {name} must be an int, got {given!r}")
    if number_type == "int" and not INT64_MIN <= value <= INT64_MAX:
        raise FusegenArgumentError(f"{op}(): {name}={value!r} is out of the int64 range")
    if value != value:
        raise FusegenArgumentError(f"{op}(): {name} must not be NaN")
    if not in_range(value, low, high, low_open, high_open):
        raise FusegenArgumentError(f"{op}(): {name} must be {range_text(low, high, low_open, high_open)}, got {value!r}")
    if number_type == "float" and abs(value) > FLOAT32_MAX:
        raise FusegenArgumentError(f"{op}(): {name}={value!r} does not fit a float32")
    # The double as given: an fp64 kernel (and reference) computes with it, an fp32 one rounds it.
    return float(value) if number_type == "float" else value


def _carries_derivative(value: torch.Tensor) -> bool:
    """A functorch wrapper (vmap's batch, grad's or jvp's level) or a forward-mode dual tensor."""
    if torch._C._functorch.is_functorch_wrapped_tensor(value):
        return True
    return forward_ad._current_level >= 0 and forward_ad.unpack_dual(value).tangent is not None


def check_training(op: str, value) -> bool:
    """Dropout's switch: a bool (numpy's too), never a truthy value such as 'no'."""
    numpy = sys.modules.get("numpy")
    if type(value) is bool or (numpy is not None and isinstance(value, numpy.bool_)):
        return bool(value)
    raise FusegenArgumentError(f"{op}(): training must be True or False, got {type(value).__name__}")


@dataclass(frozen=True)
class Problem:
    """The broadcast output shape, seen as M rows of N columns, and its dtypes."""

    shape: torch.Size
    m: int
    n: int
    out_dtype: torch.dtype
    compute_dtype: torch.dtype
    device: torch.device
    # False for meta tensors and FakeTensors: shapes without memory. An op on them only
    # makes outputs of the right shape, as torch's own ops do, and launches nothing.
    has_data: bool = True
    hidden: int = 0  # a matmul's hidden layer's width H (an MLP's), 0 without one

    @property
    def launches(self) -> bool:
        """Whether a kernel has anything to do."""
        return self.has_data and self.m * self.n > 0


# Fake and functional tensors (torch.compile's) take the uncached path: their shapes may be symbolic.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
CACHE_SIZE = 4096


def broadcast_problem(op: str, inputs: tuple[Input, ...], tensors: tuple, cache: dict | None = None,
                      matmul: MatMul | None = None) -> Problem:
    """Check tensors against the spec's dims and broadcast them as torch would (a matmul's
    product [..., N] standing for its operands). `cache`: the op's problems already checked, by
    what the checks depend on (shapes, dtypes, devices): this runs on every call, and a training
    loop repeats a few shapes."""
    if cache is None:
        return _check_and_broadcast(op, inputs, tensors, matmul)
    key = []
    for t in tensors:
        if type(t) not in PLAIN_TENSOR_TYPES:
            return _check_and_broadcast(op, inputs, tensors, matmul)
        key.append((t.shape, t.dtype, t.device))
    key = tuple(key)
    problem = cache.get(key)
    if problem is None:
        problem = _check_and_broadcast(op, inputs, tensors, matmul)
        if len(cache) >= CACHE_SIZE:
            cache.clear()
        cache[key] = problem
    return problem


def _check_and_broadcast(op: str, inputs: tuple[Input, ...], tensors: tuple, matmul: MatMul | None = None) -> Problem:
    for spec, value in zip(inputs, tensors):
        if not isinstance(value, torch.Tensor):
            raise FusegenArgumentError(f"{op}(): {spec.name} must be a torch.Tensor, got {type(value).__name__}")
        if spec.dtype != "float":
            if value.dtype != INTEGER_TORCH_DTYPES[spec.dtype]:
                raise FusegenArgumentError(f"{op}(): {spec.name} has dtype {value.dtype}; it must be torch.{spec.dtype}")
        elif value.dtype not in SUPPORTED_DTYPES:
            raise FusegenArgumentError(
                f"{op}(): {spec.name} has dtype {value.dtype}; supported: float16, bfloat16, float32, float64"
            )
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        shown = ", ".join(f"{i.name} on {t.device}" for i, t in zip(inputs, tensors))
        raise FusegenArgumentError(f"{op}(): all tensors must be on one device; got {shown}")
    device = devices.pop()
    _check_named_dims(op, inputs, tensors)
    # A chunked input ([..., 2N]) broadcasts as one of its chunks ([..., N]).
    value_shapes = [
        t.shape[:-1] + (t.shape[-1] // i.chunks,) if i.chunks > 1 and i.chunk_dim == -1 else t.shape
        for i, t in zip(inputs, tensors)
    ]
    hidden = 0
    if matmul is not None:
        value_shapes = _with_product(op, inputs, tensors, value_shapes, matmul)
        hidden = _hidden_width(op, inputs, tensors, matmul)
    try:
        shape = _broadcast_shapes(value_shapes)
    except RuntimeError:
        shown = " and ".join(f"{i.name} {list(t.shape)}" for i, t in zip(inputs, tensors))
        raise FusegenArgumentError(f"{op}(): shapes do not broadcast: {shown}") from None
    if matmul is not None and tuple(shape) != tuple(value_shapes[0]):
        product = value_shapes[0]
        others = [(i.name, t) for i, t in zip(inputs, tensors) if i.name not in matmul.operands]
        name, tensor = next((name, t) for (name, t), shape in zip(others, value_shapes[1:])
                            if torch.broadcast_shapes(shape, product) != product)
        raise FusegenArgumentError(f"{op}(): {name} {list(tensor.shape)} broadcasts the product {matmul.text} "
                                   f"{list(product)} to {list(shape)}")
    n = shape[-1] if len(shape) else 1
    # The product, not numel() // n: torch.Size.numel() makes a symbolic size (torch.compile's
    # dynamic shapes) a constant, which would recompile the graph for every sequence length.
    m = functools.reduce(operator.mul, shape[:-1], 1)
    # The float inputs' (a spec has one at least): integer and bool inputs are read, not promoted.
    out_dtype = functools.reduce(torch.promote_types, (t.dtype for i, t in zip(inputs, tensors) if i.dtype == "float"))
    compute_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    has_data = device.type != "meta" and not any(is_fake(t) for t in tensors)
    return Problem(shape, m, n, out_dtype, compute_dtype, device, has_data, hidden)


def _broadcast_shapes(shapes: list) -> torch.Size:
    """torch.broadcast_shapes; for sizes that are all ints, worked out here: torch's imports
    torch.fx's symbolic shapes and sympy on its first call (about half a second of a process
    that runs an op)."""
    if not all(type(d) is int for s in shapes for d in s):  # symbolic sizes (torch.compile)
        return torch.broadcast_shapes(*shapes)
    result = [1] * max((len(s) for s in shapes), default=0)
    for s in shapes:
        for i, d in enumerate(s, len(result) - len(s)):
            if d != 1:
                if result[i] != 1 and result[i] != d:
                    raise RuntimeError(f"shapes {[list(s) for s in shapes]} do not broadcast")
                result[i] = d
    return torch.Size(result)


# A low-rank product's inner dim: each output tile holds its rows' [BLOCK_M, R] inner product.
MAX_RANK = 128
# A hidden layer's width: each output tile holds its rows' [BLOCK_M, H] hidden values.
MAX_HIDDEN = 256


def _with_product(op: str, inputs, tensors, value_shapes: list, matmul: MatMul) -> list:
    """The value shapes with the product's ([..., N]; one chunk's, where b holds chunks) first,
    in place of its operands' (and the low-rank product's, as wide, in place of its own)."""
    names = [i.name for i in inputs]
    a, b = tensors[names.index(matmul.a)], tensors[names.index(matmul.b)]
    n = (b.shape[0] if matmul.transposed else b.shape[1]) // inputs[names.index(matmul.b)].chunks
    if matmul.lowrank is not None:
        down = tensors[names.index(matmul.lowrank.down)]
        rank = down.shape[0] if matmul.lowrank.down_transposed else down.shape[1]
        if rank > MAX_RANK:
            raise FusegenArgumentError(f"{op}(): {matmul.lowrank.down} {list(down.shape)} has rank {rank}; the "
                                       f"low-rank product takes at most {MAX_RANK} (a tile holds its [rows, rank] "
                                       "product)")
    others = [s for name, s in zip(names, value_shapes) if name not in matmul.operands]
    return [a.shape[:-1] + (n,), *others]


def _hidden_width(op: str, inputs, tensors, matmul: MatMul) -> int:
    """The width H of the matmul's hidden layer (0 without one), checked against MAX_HIDDEN."""
    if matmul.hidden is None:
        return 0
    weight = tensors[[i.name for i in inputs].index(matmul.hidden.weight)]
    width = weight.shape[0] if matmul.hidden.transposed else weight.shape[1]
    if width > MAX_HIDDEN:
        raise FusegenArgumentError(f"{op}(): {matmul.hidden.weight} {list(weight.shape)} makes a hidden layer "
                                   f"{width} wide; it takes at most {MAX_HIDDEN} (a tile holds its rows' hidden values)")
    return width


def _check_named_dims(op: str, inputs: tuple[Input, ...], tensors: tuple) -> None:
    bound: dict[str, tuple[int, int]] = {}  # dim name → (size, index of the input that set it)
    for index, (spec, tensor) in enumerate(zip(inputs, tensors)):
        explicit = [d for d in spec.dims if d != "..."]
        has_ellipsis = len(explicit) != len(spec.dims)
        if tensor.dim() < len(explicit) or (not has_ellipsis and tensor.dim() != len(explicit)):
            raise FusegenArgumentError(f"{op}(): {spec.name} must have shape {spec.declared}, got {list(tensor.shape)}")
        sizes = list(tensor.shape[tensor.dim() - len(explicit):])
        if spec.chunks > 1:
            along = spec.chunk_dim
            if sizes[along] % spec.chunks:
                raise FusegenArgumentError(
                    f"{op}(): {spec.name} must have shape {spec.declared}, got {list(tensor.shape)} "
                    f"({sizes[along]} is not a multiple of {spec.chunks})"
                )
            sizes[along] //= spec.chunks
        for dim, size in zip(explicit, sizes):
            if dim == "1":
                if size != 1:
                    raise FusegenArgumentError(
                        f"{op}(): {spec.name} must have shape {spec.declared}, got {list(tensor.shape)}"
                    )
            elif dim in bound and bound[dim][0] != size:
                other_size, other = bound[dim]
                raise FusegenArgumentError(
                    f"{op}(): {inputs[other].name} {list(tensors[other].shape)} and {spec.name} "
                    f"{list(tensor.shape)} disagree on dim {dim} ({other_size} vs {size})"
                )
            else:
                bound.setdefault(dim, (size, index))


def any_requires_grad(tensors) -> bool:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return False
