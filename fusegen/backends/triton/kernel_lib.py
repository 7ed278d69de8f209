"""`@triton.jit` helpers that generated kernels call.

Kept in a real module (not generated text) because every generated kernel shares them,
and `dropout.py` must reproduce them exactly on the host. Triton inlines a jit function
into its caller, so a helper costs nothing: the kernel does the same operations it would
spelled out in place.

The tile helpers take a tile as its `rows` and `cols` (index vectors) and `in_bounds` (the
[rows, cols] mask of the elements inside the problem); `width` is a contiguous buffer's row
length (N, or k * N for an input of k chunks).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def indices(start, SIZE: tl.constexpr, INDEX_64: tl.constexpr):
    """start, start + 1, ..., start + SIZE - 1: a tile's rows or columns; int64 when some
    offset reaches 2**31 (INDEX_64), which is rare and costs registers."""
    index = start + tl.arange(0, SIZE)
    if INDEX_64:
        index = index.to(tl.int64)
    return index


@triton.jit
def column_tile(rows, first_col, M, N, BLOCK_N: tl.constexpr, INDEX_64: tl.constexpr):
    """The columns [first_col, first_col + BLOCK_N), and which elements of rows x cols lie
    inside the [M, N] problem."""
    cols = indices(first_col, BLOCK_N, INDEX_64)
    return cols, (rows[:, None] < M) & (cols[None, :] < N)


@triton.jit
def load_tile(ptr, stride_m, stride_n, rows, cols, in_bounds, dtype):
    """The tile rows x cols of a strided [M, N] view, in `dtype` (the kernel's compute type;
    masked-out elements are undefined: every use masks them again)."""
    return tl.load(ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=in_bounds).to(dtype)


@triton.jit
def load_per_row(ptr, stride_m, rows, M, dtype):
    """An input declared [..., 1]: its rows' values as a [rows, 1] column, which broadcasts along
    the tile (a tile of loads from one address per row would cost as much as a tile of x: a
    class index in int64 four times a bf16 row's bytes through the load units)."""
    return tl.load(ptr + rows[:, None] * stride_m, mask=rows[:, None] < M).to(dtype)


@triton.jit
def store_tile(ptr, value, rows, cols, width, in_bounds):
    """`value` into the tile rows x cols of a contiguous [M, width] buffer, in its element type."""
    tl.store(ptr + rows[:, None] * width + cols[None, :], to_element(value, ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def to_element(value, dtype: tl.constexpr):
    """`value` (the compute type) in an output's element type, as torch's `tensor.to(dtype)`
    converts it: float8 by to_float8; the others as Triton converts, which is torch's (floats
    round to nearest even; int8 truncates toward zero, out of its range undefined in both)."""
    if dtype == tl.float8e4nv or dtype == tl.float8e5:
        return to_float8(value, dtype)
    else:
        return value.to(dtype)


# torch's float32 → float8_e4m3fn past ±448: NaN up to torch 2.11 (inf too), ±448 in later
# versions (2.13: c10's fp8e4m3fn_from_fp32_value saturates). The kernels follow the torch
# they run with, asked once here (the same conversion code serves CPU and CUDA).
E4M3_SATURATES = tl.constexpr(bool(torch.tensor(1e4).to(torch.float8_e4m3fn).float().isfinite()))


@triton.jit
def to_float8(value, dtype: tl.constexpr):
    """float8_e4m3fn (tl.float8e4nv) or float8_e5m2 (tl.float8e5) as torch converts to them:
    through float32 (an fp64 value is rounded twice, as torch does), to nearest even; beyond
    the range e4m3fn gives NaN or saturates to ±448 as the installed torch does
    (E4M3_SATURATES), e5m2 overflows to ±inf (from ±61440, the tie with the next power of
    two); NaN keeps its sign. The hardware's conversion (cvt.rn.satfinite) saturates both and
    drops NaN's sign: those cases are set by their bits (checked against torch 2.11 on an H200)."""
    value = value.to(tl.float32)
    bits = value.to(dtype, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    sign = ((value.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    if dtype == tl.float8e4nv:
        if E4M3_SATURATES:
            bits = tl.where(tl.abs(value) > 448.0, sign | 0x7E, bits)
        else:  # past 464, the tie that rounds to 448, NaN
            bits = tl.where(tl.abs(value) > 464.0, sign | 0x7F, bits)
    else:
        bits = tl.where(tl.abs(value) >= 61440.0, sign | 0x7C, bits)
    bits = tl.where(value != value, sign | 0x7F, bits)
    return bits.to(dtype, bitcast=True)


@triton.jit
def store_gradient(ptr, value, sums, rows, cols, width, in_bounds, NEEDS: tl.constexpr, SUM: tl.constexpr):
    """An input's gradient on one tile, when it is wanted (NEEDS): stored, or, where the input
    is broadcast along rows (SUM), added to the program's [BLOCK_M, BLOCK_N] sums, which are
    returned (and reduced once, by store_column_sums)."""
    if NEEDS:
        if SUM:
            sums += tl.where(in_bounds, value, 0.0)
        else:
            store_tile(ptr, value, rows, cols, width, in_bounds)
    return sums


@triton.jit
def store_column_sums(ptr, sums, row, cols, end, width, NEEDS: tl.constexpr, SUM: tl.constexpr):
    """With NEEDS and SUM, the program's sums reduced across rows into its `row` of a
    [programs, width] buffer of partial sums (summed across programs after the kernel, in a
    fixed order: no atomics); the columns before `end` (N, or chunk k's (k + 1) * N)."""
    if NEEDS and SUM:
        tl.store(ptr + row * width + cols, tl.sum(sums, axis=0), mask=cols < end)


@triton.jit
def add_gradient_partials(ptr, value, rows, cols, end, width, in_bounds, first, NEEDS: tl.constexpr,
                          SUM: tl.constexpr):
    """store_gradient for a row swept in column steps, where the program's sums cannot stay in
    registers: with SUM, the tile's column sums are added to the program's row of the partial
    sums in memory (written by its `first` row block, read back and added to by the others);
    `end` as in store_column_sums."""
    if NEEDS:
        if SUM:
            partial = ptr + tl.program_id(0) * width + cols
            tile_sum = tl.sum(tl.where(in_bounds, value, 0.0), axis=0)
            if first:
                tl.store(partial, tile_sum, mask=cols < end)
            else:
                tl.store(partial, tl.load(partial, mask=cols < end) + tile_sum, mask=cols < end)
        else:
            store_tile(ptr, value, rows, cols, width, in_bounds)


@triton.jit
def dropout_mask(seed, rows, first_col, N, BLOCK_N: tl.constexpr, stream: tl.constexpr, threshold, scale,
                 WHOLE_GROUPS: tl.constexpr, shard_ptr, SHARDED: tl.constexpr):
    """Dropout multiplier for the tile of `rows` × [first_col, first_col + BLOCK_N) of an
    [M, N] problem: `scale` where kept, else 0.

    The element at flat index i = row * N + col takes word `i % 4` of Philox4x32-10 keyed
    by `seed` with counter (g_lo, g_hi, stream, 0), g = i // 4: the mask depends on the
    seed and the element's flat logical index only, never on the problem's 2-D shape or
    the tile the autotuner picked, so the backward (and a reshaped input) draws it again
    exactly. An element is kept when the top 24 bits of its word are >= `threshold`
    (= round(p * 2**24)). BLOCK_N must be a multiple of 4.

    WHOLE_GROUPS (N % 4 == 0): a row holds whole groups of four, and one Philox call serves
    four neighbouring columns. Otherwise groups straddle rows, and each element makes its
    own call (four times the random-number work, the same mask). A constexpr, not a branch:
    the per-element path's registers would weigh on the common one. `rows` is int64 when
    flat indices can reach 2**31, else int32 (the high counter word is then a constant 0).

    SHARDED: the [M, N] problem is one shard of a larger one (a DTensor's local part), and
    the flat index is the global one. `shard_ptr` holds six int64s (fusegen.runtime.sharding):
    one step of the sharded leading dim spans `inner` rows; the dim has `local` of its `total`
    extent here, from `offset`; columns start at `column_offset` of `n_global`.
    """
    if SHARDED:
        inner = tl.load(shard_ptr)
        local = tl.load(shard_ptr + 1)
        total = tl.load(shard_ptr + 2)
        offset = tl.load(shard_ptr + 3)
        step = rows // inner
        rows = ((step // local) * total + offset + step % local) * inner + rows % inner
        first_col = first_col + tl.load(shard_ptr + 4)
        N = tl.load(shard_ptr + 5)
    if WHOLE_GROUPS:
        words = _words_of_whole_groups(seed, rows[:, None], first_col, N, BLOCK_N, stream)
    else:
        words = _words_of_each_element(seed, rows[:, None], first_col, N, BLOCK_N, stream)
    keep = (words >> 8).to(tl.int32) >= threshold
    return tl.where(keep, scale, 0.0)


@triton.jit
def dropout_or_ones(seed, rows, first_col, N, BLOCK_N: tl.constexpr, stream: tl.constexpr, threshold, scale,
                    HAS_DROPOUT: tl.constexpr, WHOLE_GROUPS: tl.constexpr, shard_ptr, SHARDED: tl.constexpr):
    """dropout_mask's multiplier for the tile with HAS_DROPOUT; without, ones in the compute
    type (scale's), which the compiler folds away: a row kernel's body is one either way."""
    if HAS_DROPOUT:
        return dropout_mask(seed, rows, first_col, N, BLOCK_N, stream, threshold, scale, WHOLE_GROUPS, shard_ptr, SHARDED)
    else:
        return tl.full((rows.shape[0], BLOCK_N), 1.0, scale.dtype)


@triton.jit
def _words_of_whole_groups(seed, rows, first_col, N, BLOCK_N: tl.constexpr, stream: tl.constexpr):
    """N % 4 == 0: group g = row * N/4 + col // 4, one Philox call for four columns."""
    BLOCK_M: tl.constexpr = rows.shape[0]
    groups = rows * (N // 4) + (first_col // 4 + tl.arange(0, BLOCK_N // 4))[None, :]
    r0, r1, r2, r3 = _philox_groups(seed, groups, stream)
    # Interleave so that column 4g + k gets word k of group g. join adds a new last axis,
    # so the outer join picks the low bit of k and the inner one the high bit.
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_M, BLOCK_N))


@triton.jit
def _words_of_each_element(seed, rows, first_col, N, BLOCK_N: tl.constexpr, stream: tl.constexpr):
    """Any N: each element's own call, of which it keeps word i % 4."""
    index = rows * N + (first_col + tl.arange(0, BLOCK_N))[None, :]
    r0, r1, r2, r3 = _philox_groups(seed, index >> 2, stream)
    word = index & 3
    return tl.where(word < 2, tl.where(word == 0, r0, r1), tl.where(word == 2, r2, r3))


@triton.jit
def _philox_groups(seed, groups, stream: tl.constexpr):
    """Philox4x32-10 of the group numbers `groups`, counter (g_lo, g_hi, stream, 0)."""
    c0 = groups.to(tl.uint32)
    if groups.dtype == tl.int64:
        c1 = (groups >> 32).to(tl.uint32)
    else:
        c1 = tl.zeros(groups.shape, tl.uint32)
    c2 = tl.full(groups.shape, stream, tl.uint32)
    c3 = tl.zeros(groups.shape, tl.uint32)
    return tl.philox(seed, c0, c1, c2, c3)


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


@triton.jit
def maximum(a, b):
    """The larger of a and b, NaN if either is (tl.maximum's default drops NaN), as torch."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def minimum(a, b):
    """The smaller of a and b, NaN as in maximum."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_shifts(before, after):
    """A running max before and after it takes in more elements, as the shifts its online
    sums are taken at (Σ exp(x - shift)), the new one first: while a max is still -inf (no
    element yet), its shift is 0, and the old shift is the new one (its sum is still 0, and
    exp(old - new) could overflow to inf: 0 · inf is NaN)."""
    new = tl.where(after == -float("inf"), 0.0, after)
    return new, tl.where(before == -float("inf"), new, before)


@triton.jit
def min_shifts(before, after):
    """A running min's shifts, as max_shifts' with inf for -inf."""
    new = tl.where(after == float("inf"), 0.0, after)
    return new, tl.where(before == float("inf"), new, before)


@triton.jit
def row_max(tile):
    """The largest element of each row of a tile, as [rows, 1]; NaN if the row holds one, as
    torch.amax (tl.max's maximum drops NaN)."""
    return tl.reduce(tile, 1, maximum, keep_dims=True)


@triton.jit
def row_min(tile):
    """The smallest element of each row of a tile, as [rows, 1]; NaN as in row_max."""
    return tl.reduce(tile, 1, minimum, keep_dims=True)


@triton.jit
def row_sum(tile):
    """The sum of each row of a tile, as [rows, 1]."""
    return tl.sum(tile, axis=1, keep_dims=True)


# -- a row split across programs ---------------------------------------------------------
# A row too wide for one program's registers is split across SPLITS programs (a row group),
# each holding its BLOCK_N columns on chip: each pass's reductions are combined through a
# small zeroed buffer (`exchange_ptr`: a ticket, a counter per group, then each round's
# shares), so the row is read once, as one tile is. The programs of a group wait for each
# other, so a group must be on the GPU at once: tickets hand out groups in the order the
# programs start (a started program is resident), and the launcher keeps SPLITS within the
# GPU's multiprocessors. Both counters are left at 0, for the next launch (the autotuner's
# reruns). Shares are stored per row, [rows, 2 rounds, shares a round, SPLITS]; a round's
# buffer is reused two rounds on, when every program of the group has read it.


@triton.jit
def split_program(exchange_ptr, SPLITS: tl.constexpr):
    """This program's row group (rows group * BLOCK_M, ...) and its split (columns
    split * BLOCK_N, ...): program_id(0) and 0 where a row is one program's."""
    # (Triton compiles what follows a return in an `if`: each case in its own branch.)
    if SPLITS == 1:  # exchange_ptr is None
        group, split = tl.program_id(0), 0
    else:
        counters = exchange_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        ticket = tl.atomic_add(counters, 1, sem="relaxed", scope="gpu")
        if ticket == tl.num_programs(0) - 1:  # the launch's last ticket taken
            tl.atomic_xchg(counters, 0, sem="relaxed", scope="gpu")
        group, split = ticket // SPLITS, ticket % SPLITS
    return group, split


@triton.jit
def _shares_of(exchange_ptr, rows, M, ROUND, SHARES: tl.constexpr, k: tl.constexpr, SPLITS: tl.constexpr):
    """Where share k of each row's round ROUND starts: SPLITS values, one per split."""
    base = exchange_ptr + (M + 1)  # past the ticket and the groups' counters
    return base + ((rows[:, None] * 2 + ROUND % 2) * SHARES + k) * SPLITS


@triton.jit
def split_share(value, exchange_ptr, rows, M, split, ROUND, SHARES: tl.constexpr, k: tl.constexpr,
                SPLITS: tl.constexpr):
    """This split's value ([rows, 1]) of a round's reduction k, for the group to combine."""
    tl.store(_shares_of(exchange_ptr, rows, M, ROUND, SHARES, k, SPLITS) + split, value, mask=rows[:, None] < M)


@triton.jit
def split_wait(exchange_ptr, group, ROUND, SPLITS: tl.constexpr):
    """Waits until every program of the group has shared round ROUND's values (rounds count
    from 0 across the launch: a backward's row blocks go on counting)."""
    counter = exchange_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + 1 + group
    tl.debug_barrier()  # every thread's shares stored before the release
    seen = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") + 1
    while seen < (ROUND + 1) * SPLITS:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def split_shares(exchange_ptr, rows, M, ROUND, SHARES: tl.constexpr, k: tl.constexpr, SPLITS: tl.constexpr,
                 BLOCK_N: tl.constexpr, OP: tl.constexpr):
    """A round's reduction k as every split shared it, read past the caches: the first SPLITS
    columns of a [rows, BLOCK_N] tile, the rest the neutral element of OP ("max", "min",
    "sum"). A tile's shape, so that what is combined from it has the tile's layout: from
    [rows, SPLITS] the compiler would move the whole tile to another layout (H100: 6x slower)."""
    parts = tl.arange(0, BLOCK_N)[None, :]
    first = _shares_of(exchange_ptr, rows, M, ROUND, SHARES, k, SPLITS)
    neutral = -float("inf") if OP == "max" else float("inf") if OP == "min" else 0.0
    return tl.load(first + parts, mask=(rows[:, None] < M) & (parts < SPLITS), other=neutral, volatile=True)


@triton.jit
def split_leave(exchange_ptr, group, ROUNDS, SPLITS: tl.constexpr):
    """After the last round: the group's last program out sets its counter back to 0."""
    if SPLITS > 1:
        counter = exchange_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + 1 + group
        if tl.atomic_add(counter, 1, sem="relaxed", scope="gpu") == (ROUNDS + 1) * SPLITS - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


# One config (nothing to tune: a few microseconds' work); autotuned only so that the
# cached launcher, which launches autotuned kernels, can launch it without Triton's dispatch.
@triton.autotune(configs=[triton.Config({"BLOCK_R": 32, "BLOCK_N": 128}, num_warps=4)], key=[])
@triton.jit
def sum_partials_kernel(partials_ptr, out_ptr, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n] = Σ_r partials[r, n], for a contiguous [R, N] buffer of partial sums (a
    backward's per-program column sums); out in its own dtype. The order of the sum is
    fixed by R and the tile, so the result is the same bits run after run."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros((BLOCK_R, BLOCK_N), partials_ptr.dtype.element_ty)
    for first in range(0, R, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (rows[:, None] < R) & (cols[None, :] < N)
        total += tl.load(partials_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(total, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)
