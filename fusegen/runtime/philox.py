"""Pure-PyTorch Philox4x32, bit-for-bit identical to Triton's ``tl.philox``.

Used to reproduce on the host the random streams that generated kernels draw
(e.g. dropout masks), so results can be checked or replayed without a GPU.

All uint32 values are held in int64 tensors: torch has no general-purpose
uint32 arithmetic, and int64 leaves room to compute carries exactly.
"""

from __future__ import annotations

import torch

__all__ = ["philox4x32", "umulhi32"]

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF

# Constants of the 32-bit path in triton/language/random.py.
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57

N_ROUNDS_DEFAULT = 10


def _split16(x):
    """Split a uint32 (int or int64 tensor) into its high and low 16-bit halves."""
    return x >> 16, x & 0xFFFF


def umulhi32(a, b) -> torch.Tensor:
    """High 32 bits of the 64-bit product of two uint32 values held in int64.

    Either operand may be a Python int. The full product can reach 2**64 and
    would overflow int64, so ``b`` is split into 16-bit halves and every
    partial product stays below 2**49.
    """
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        a = torch.tensor(a, dtype=torch.int64)
    b_hi, b_lo = _split16(b)
    # a*b = (a*b_hi) * 2**16 + a*b_lo; carry the top of a*b_lo into the high part.
    t = a * b_hi + ((a * b_lo) >> 16)
    return t >> 16


def _mullo32(a, b) -> torch.Tensor:
    """Low 32 bits of the product of two uint32 values held in int64, without overflow."""
    b_hi, b_lo = _split16(b)
    return ((((a * b_hi) & 0xFFFF) << 16) + a * b_lo) & MASK32


def _as_u32(c: torch.Tensor) -> torch.Tensor:
    # Masking also maps int32 bit patterns (negative values) to their uint32 value.
    return c.to(torch.int64) & MASK32


def philox4x32(
    seed: "int | torch.Tensor",
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
    n_rounds: int = N_ROUNDS_DEFAULT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 with ``n_rounds`` rounds, matching ``tl.philox(seed, c0, c1, c2, c3, n_rounds)``.

    The counters are int64 tensors (any device, same shape or broadcastable)
    holding values in [0, 2**32). Returns four int64 tensors of the broadcast
    shape holding the uint32 outputs.
    """
    # Triton casts the int64 seed to uint64 and uses its two 32-bit words as
    # the key, so negative seeds act through their two's complement. A seed tensor (one
    # int64 element, e.g. the kernels' seed on the GPU) stays a tensor: no host sync.
    if isinstance(seed, torch.Tensor):
        seed = seed.to(device=c0.device, dtype=torch.int64).reshape(())
        k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    else:
        seed = int(seed) & MASK64
        k0, k1 = seed & MASK32, seed >> 32

    c0, c1, c2, c3 = torch.broadcast_tensors(
        _as_u32(c0), _as_u32(c1), _as_u32(c2), _as_u32(c3)
    )
    # The round constants go second so that they, not the tensors, get split.
    for _ in range(n_rounds):
        c0, c1, c2, c3 = (
            umulhi32(c2, PHILOX_ROUND_B) ^ c1 ^ k0,
            _mullo32(c2, PHILOX_ROUND_B),
            umulhi32(c0, PHILOX_ROUND_A) ^ c3 ^ k1,
            _mullo32(c0, PHILOX_ROUND_A),
        )
        k0 = (k0 + PHILOX_KEY_A) & MASK32
        k1 = (k1 + PHILOX_KEY_B) & MASK32
    return c0, c1, c2, c3
