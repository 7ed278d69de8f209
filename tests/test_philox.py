"""Bit-exactness of fusegen.runtime.philox against Triton's tl.philox."""

import os

import torch

# Without a GPU, Triton kernels run on its interpreter, which must be chosen
# before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusegen.runtime.philox import philox4x32, umulhi32  # noqa: E402

MASK32 = 0xFFFFFFFF
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 300
BLOCK = 128

SEEDS = [0, 1, 2**31 + 5, 2**32 + 7, 2**62 + 3, -12345]


@triton.jit
def _philox_kernel(
    c0_ptr, c1_ptr, c2_ptr, c3_ptr,
    o0_ptr, o1_ptr, o2_ptr, o3_ptr,
    seed, n, N_ROUNDS: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # int64 in [0, 2**32) -> uint32 keeps the value.
    c0 = tl.load(c0_ptr + offs, mask=mask).to(tl.uint32)
    c1 = tl.load(c1_ptr + offs, mask=mask).to(tl.uint32)
    c2 = tl.load(c2_ptr + offs, mask=mask).to(tl.uint32)
    c3 = tl.load(c3_ptr + offs, mask=mask).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3, N_ROUNDS)
    # uint32 -> int64 zero-extends.
    tl.store(o0_ptr + offs, r0.to(tl.int64), mask=mask)
    tl.store(o1_ptr + offs, r1.to(tl.int64), mask=mask)
    tl.store(o2_ptr + offs, r2.to(tl.int64), mask=mask)
    tl.store(o3_ptr + offs, r3.to(tl.int64), mask=mask)


def _triton_philox(seed, counters, n_rounds):
    outs = [torch.empty_like(c) for c in counters]
    n = counters[0].numel()
    _philox_kernel[(triton.cdiv(n, BLOCK),)](
        *counters, *outs, seed, n, N_ROUNDS=n_rounds, BLOCK=BLOCK
    )
    return outs


def _random_u32(n, generator):
    """Random uint32 values in int64, covering the full range plus its edges."""
    x = torch.randint(0, 2**32, (n,), dtype=torch.int64, generator=generator)
    x[:4] = torch.tensor([0, 1, 2**31, MASK32])
    return x


@pytest.mark.parametrize("n_rounds", [10, 7])
@pytest.mark.parametrize("seed", SEEDS)
def test_philox_matches_triton(seed, n_rounds):
    g = torch.Generator().manual_seed(1000 + SEEDS.index(seed) * 10 + n_rounds)
    counters = [_random_u32(N, g).to(DEVICE) for _ in range(4)]
    assert any((c >= 2**31).any() for c in counters)

    expected = _triton_philox(seed, counters, n_rounds)
    if n_rounds == 10:
        got = philox4x32(seed, *counters)  # default round count
    else:
        got = philox4x32(seed, *counters, n_rounds=n_rounds)

    for e, r in zip(expected, got):
        assert r.dtype == torch.int64
        assert r.device == counters[0].device
        assert ((r >= 0) & (r <= MASK32)).all()
        torch.testing.assert_close(r, e & MASK32, rtol=0, atol=0)


def test_philox_broadcasts_counters():
    g = torch.Generator().manual_seed(7)
    c0 = _random_u32(N, g)
    zero = torch.zeros((), dtype=torch.int64)
    got = philox4x32(42, c0, zero, zero, zero)
    full = philox4x32(42, c0, *(torch.zeros_like(c0) for _ in range(3)))
    for r, f in zip(got, full):
        assert r.shape == c0.shape
        torch.testing.assert_close(r, f, rtol=0, atol=0)


def test_umulhi32_matches_python():
    g = torch.Generator().manual_seed(3)
    edges = torch.tensor([0, 1, 2**16 - 1, 2**16, 2**31, MASK32], dtype=torch.int64)
    a = torch.cat([edges.repeat_interleave(len(edges)), _random_u32(1000, g)])
    b = torch.cat([edges.repeat(len(edges)), _random_u32(1000, g)])

    expected = torch.tensor(
        [(x * y) >> 32 for x, y in zip(a.tolist(), b.tolist())], dtype=torch.int64
    )
    torch.testing.assert_close(umulhi32(a, b), expected, rtol=0, atol=0)

    # A Python int on either side gives the same result.
    for k in (0, 1, 0xD2511F53, MASK32):
        exact = torch.tensor([(k * y) >> 32 for y in b.tolist()], dtype=torch.int64)
        torch.testing.assert_close(umulhi32(k, b), exact, rtol=0, atol=0)
        torch.testing.assert_close(umulhi32(b, k), exact, rtol=0, atol=0)
