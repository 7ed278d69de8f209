"""`@triton.jit` helpers that generated kernels call.

Kept in a real module (not generated text) because every generated kernel shares them,
and `dropout.py` must reproduce them exactly on the host.
"""
import triton
import triton.language as tl


@triton.jit
def dropout_mask(seed, rows, first_col, BLOCK_N: tl.constexpr, stream: tl.constexpr, threshold, scale):
    """Dropout multiplier for the tile of `rows` × [first_col, first_col + BLOCK_N): `scale` where kept, else 0.

    Element (row, col) takes word `col % 4` of Philox4x32-10 keyed by `seed` with counter
    (col // 4, row_lo, row_hi, stream): one Philox call serves four neighbouring columns,
    and the mask depends on the element's logical position only, never on the block
    shape the autotuner picked, so the backward regenerates it exactly. An element is kept
    when the top 24 bits of its word are >= `threshold` (= round(p * 2**24)).
    BLOCK_N must be a multiple of 4 (tiles then never split a group of four).
    """
    BLOCK_M: tl.constexpr = rows.shape[0]
    rows64 = rows.to(tl.int64)[:, None]
    first_group = (first_col // 4).to(tl.uint32)
    groups = (first_group + tl.arange(0, BLOCK_N // 4).to(tl.uint32))[None, :]
    c1 = tl.broadcast_to(rows64.to(tl.uint32), (BLOCK_M, BLOCK_N // 4))
    c2 = tl.broadcast_to((rows64 >> 32).to(tl.uint32), (BLOCK_M, BLOCK_N // 4))
    c0 = tl.broadcast_to(groups, (BLOCK_M, BLOCK_N // 4))
    c3 = tl.zeros_like(c0) + stream
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    # Interleave so that column 4g + k gets word k of group g. join adds a new last axis,
    # so the outer join picks the low bit of k and the inner one the high bit.
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_M, BLOCK_N))
    keep = (words >> 8).to(tl.int32) >= threshold
    return tl.where(keep, scale, 0.0)


@triton.jit
def sqrt_rn(x):
    """Square root, correctly rounded in fp32 and fp64: tl.sqrt is sqrt.approx in fp32, and
    tl.sqrt_rn takes fp32 only."""
    return tl.sqrt(x) if x.dtype == tl.float64 else tl.sqrt_rn(x)


@triton.jit
def rsqrt_rn(x):
    """1 / sqrt(x), a correctly rounded division of the correctly rounded root: tl.rsqrt is
    rsqrt.approx, which flushes fp32 subnormals (rsqrt(1e-40) = inf) and is 2**-40 off in
    fp64; in fp32 `/` is div.full, up to 2 ulp off."""
    root = sqrt_rn(x)
    return 1.0 / root if x.dtype == tl.float64 else tl.div_rn(tl.full((), 1.0, tl.float32), root)
