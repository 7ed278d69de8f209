"""`@triton.jit` helpers that generated kernels call.

Kept in a real module (not generated text) because every generated kernel shares them,
and `dropout.py` must reproduce them exactly on the host.
"""
import triton
import triton.language as tl


@triton.jit
def dropout_mask(seed, rows, cols, stream: tl.constexpr, threshold, scale):
    """Per-element dropout multiplier for a [BLOCK_M, BLOCK_N] tile: `scale` where kept, else 0.

    The random number of element (row, col) is Philox4x32-10 keyed by `seed` with counter
    (col, row_lo, row_hi, stream): it depends on the element's logical position only,
    never on the block shape the autotuner picked, so the backward regenerates it exactly.
    An element is kept when the top 24 bits of the random word are >= `threshold`
    (= round(p * 2**24)), so p is honoured to 1/16777216.
    """
    rows64 = rows.to(tl.int64)[:, None]
    c0 = cols.to(tl.uint32)[None, :]
    c1 = rows64.to(tl.uint32)
    c2 = (rows64 >> 32).to(tl.uint32)
    c0, c1 = tl.broadcast(c0, c1)
    c2 = tl.broadcast_to(c2, c0.shape)
    c3 = tl.zeros_like(c0) + stream
    r, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    keep = (r >> 8).to(tl.int32) >= threshold
    return tl.where(keep, scale, 0.0)
