"""Dropout's seed and random mask: drawn on the device for the kernels, reproduced on the
host bit for bit (see fusegen.backends.triton.kernel_lib.dropout_mask)."""
from __future__ import annotations

import operator
import threading

import torch

from . import native
from .philox import MASK32, philox4x32
from .seeds import SEED_BATCH, SEED_LIMIT

THRESHOLD_BITS = 24


def dropout_threshold(p: float) -> int:
    """p as the 24-bit threshold that a kept element's random word must reach."""
    return round(p * (1 << THRESHOLD_BITS))


def dropout_scale(p: float) -> float:
    """What kept elements are multiplied by; p == 1 drops everything, so any value works."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def check_seed(op: str, seed) -> int | None:
    """An explicit seed as an int in [0, 2**63), or None (draw one)."""
    if seed is None:
        return None
    if isinstance(seed, bool):
        raise _seed_error(op, seed)
    try:
        value = operator.index(seed)  # ints, numpy ints, 0-d integer tensors; not 1.5 or "abc"
    except TypeError:
        raise _seed_error(op, seed) from None
    if not 0 <= value < SEED_LIMIT:
        raise _seed_error(op, seed)
    return value


def _seed_error(op: str, seed) -> ValueError:
    from .arguments import FusegenArgumentError

    shown = repr(seed) if isinstance(seed, (int, float, str)) else type(seed).__name__
    return FusegenArgumentError(f"{op}(): seed must be None or an int in [0, 2**63), got {shown}")


def seed_tensor(seed: int | None, device: torch.device, eager: bool = False) -> torch.Tensor:
    """The one-element int64 tensor on `device` that the kernels read the seed from.

    seed=None draws it from the device's own generator with a torch RNG op on the current
    stream: no host synchronisation, torch.manual_seed reproduces it, and a CUDA graph (or
    torch.compile's reduce-overhead mode) that captured the draw draws anew on each replay.
    An explicit seed is written there by a fill, which a graph replays as it is.

    `eager` (an eager call on a CUDA device, not being captured): seeds come from a batch
    drawn ahead and explicit seeds from a cache, so most calls launch no kernel for them
    (13 µs of host time and a small kernel per call otherwise). Compiled graphs always draw
    per call: they may be captured later.
    """
    if eager and device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        return _EAGER_SEEDS.take(seed, device)
    if seed is None:
        return torch.randint(0, SEED_LIMIT - 1, (1,), dtype=torch.int64, device=device)
    return torch.full((1,), seed, dtype=torch.int64, device=device)


def seed_result(seed: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The seed tensor as the library op returns it: without dropout the seed is never read,
    and an unfilled tensor keeps the op's outputs fixed."""
    return torch.empty((1,), dtype=torch.int64, device=device) if seed is None else seed


_FIXED_SEEDS_KEPT = 1024


class _EagerSeeds:
    """Seed tensors for eager CUDA calls: drawn SEED_BATCH at a time, or kept per explicit seed.

    A batch stands only while the device's generator is where the batch left it (same
    seed, same Philox offset): torch.manual_seed, or any other random op in between,
    starts a new batch from the generator's new state, so a program draws the same seeds
    run after run, and `reference`, which draws the same way, the same masks. Nothing here
    is written twice: a backward reads its forward's seed after later calls moved on.

    Where fusegen's C++ extension is loaded it owns the batches (csrc/eager_call.cpp,
    next_seed: its eager call takes seeds there without Python), and `take` calls in; the
    batches here serve only a process without it. A switch between the two cannot hand out
    a seed twice: each draw moves the generator on, so the other side's batch no longer stands.
    """

    def __init__(self):
        self.batches: dict[int, list] = {}  # device index: [generator seed, offset, drawn, taken]
        self._fixed: dict[tuple[int, torch.device], torch.Tensor] = {}
        # Threads calling ops at once must not take one seed twice (one mask for two calls).
        self.lock = threading.Lock()

    def take(self, seed: int | None, device: torch.device) -> torch.Tensor:
        if seed is not None:
            tensor = self._fixed.get((seed, device))
            if tensor is None:
                if len(self._fixed) >= _FIXED_SEEDS_KEPT:
                    self._fixed.clear()
                tensor = self._fixed[(seed, device)] = torch.full((1,), seed, dtype=torch.int64, device=device)
            return tensor
        index = device.index if device.index is not None else torch.cuda.current_device()
        owner = native.seed_owner()
        if owner is not None:
            return owner.take_seed(index)
        generator = torch.cuda.default_generators[index]
        with self.lock:
            batch = self.batches.get(index)
            if (batch is None or batch[0] != generator.initial_seed() or batch[1] != generator.get_offset()
                    or batch[3] == SEED_BATCH):
                # Every other element, so that each seed is 16-byte aligned as the kernels
                # expect. (Not unbound into 256 tensors ahead: where other random ops run
                # between calls, as dropout elsewhere in a model does, every call redraws.)
                drawn = torch.randint(0, SEED_LIMIT - 1, (SEED_BATCH, 2), dtype=torch.int64, device=device)
                batch = self.batches[index] = [generator.initial_seed(), generator.get_offset(), drawn, 0]
            taken = batch[3]
            batch[3] = taken + 1
        return batch[2][taken, :1]

    def standing(self, index: int) -> tuple[torch.Tensor, int] | None:
        """The device's standing batch and how many of its seeds are taken, whichever side
        owns it (for tests)."""
        owner = native.seed_owner()
        if owner is not None:
            return owner.standing_seeds(index)
        batch = self.batches.get(index)
        return None if batch is None else (batch[2], batch[3])


_EAGER_SEEDS = _EagerSeeds()


def eager_seeds() -> _EagerSeeds:
    """The process's eager seeds, which the C++ eager call shares (runtime.native)."""
    return _EAGER_SEEDS


def dropout_keep(seed, index: torch.Tensor, stream: int, p: float) -> torch.Tensor:
    """Whether the elements at flat indices `index` (int64) are kept: the kernel's rule."""
    groups = index >> 2
    words = philox4x32(seed, groups & MASK32, groups >> 32, torch.full_like(groups, stream), torch.zeros_like(groups))
    word = torch.stack(torch.broadcast_tensors(*words), dim=-1).gather(-1, (index & 3).unsqueeze(-1)).squeeze(-1)
    return (word >> 8) >= dropout_threshold(p)


def dropout_mask_reference(seed, problem, stream: int, p: float) -> torch.Tensor:
    """The multiplier (scale or 0) that the kernel's dropout_mask draws, in the problem's shape.

    `seed` is an int or the kernels' one-element seed tensor (read on its device, no sync)."""
    device, dtype = problem.device, problem.compute_dtype
    index = torch.arange(problem.m * problem.n, device=device, dtype=torch.int64)
    keep = dropout_keep(seed, index, stream, p)
    scale = torch.tensor(dropout_scale(p), dtype=dtype)  # as the kernel: the double, in the compute type
    mask = torch.where(keep, scale.to(device), torch.zeros((), dtype=dtype, device=device))
    return mask.reshape(problem.shape)
