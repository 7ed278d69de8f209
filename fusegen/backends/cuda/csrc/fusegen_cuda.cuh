// fusegen's device functions for CUDA C++ kernels (fusegen/backends/cuda): what the printed
// expressions call (printer.py), and dropout's random words, bit for bit those of the Triton
// kernels (kernel_lib.dropout_mask) and of the host reference (runtime/philox.py).
//
// Every function is FUSEGEN_HD: __host__ __device__ under nvcc, plain inline C++ elsewhere, so
// that the tests compile and check them on a machine without a GPU. T is the compute type,
// float or double, as the Triton kernels' `compute`.
#pragma once

#ifdef __CUDACC_RTC__
// NVRTC (the run-time compiler) has no system headers: its built-in CUDA math, float and double
// overloads in the global namespace, stands in for <cmath> under the std:: names the printed
// expressions use, and the fixed-width integers are LP64's, as <cstdint> has them on Linux.
namespace std {
using ::cos;
using ::erf;
using ::exp;
using ::expm1;
using ::fabs;
using ::floor;
using ::log;
using ::log1p;
using ::nearbyint;
using ::pow;
using ::sin;
using ::sqrt;
using ::tanh;
}  // namespace std
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
#else
#include <cmath>
#include <cstdint>
#include <limits>
#endif

#ifdef __CUDACC__
#define FUSEGEN_HD __host__ __device__ __forceinline__
#else
#define FUSEGEN_HD inline
#endif

namespace fusegen {

// Float arithmetic as the Triton kernels' (so that the two backends agree bit for bit): in device
// code, float division is div.full.f32 (within 2 ulp: Triton's lowering of '/'), max and min
// propagate NaN in one instruction (tl.maximum's PropagateNan.ALL), and sigmoid is tl.sigmoid,
// 1 / (1 + 2^(-x·log2(e))) by ex2.approx. Double, and the host (the tests), compute exactly.

// a / b.
FUSEGEN_HD double divide(double a, double b) {
  return a / b;
}

FUSEGEN_HD float divide(float a, float b) {
#ifdef __CUDA_ARCH__
  float quotient;
  asm("div.full.f32 %0, %1, %2;" : "=f"(quotient) : "f"(a), "f"(b));
  return quotient;
#else
  return a / b;
#endif
}

// Whether T is float (the compute type is float or double): the GPU's float instructions below.
template <typename T>
constexpr bool is_float = false;
template <>
constexpr bool is_float<float> = true;

// The larger (Larger) or smaller of a and b, NaN if either is (fmax and fmin drop a NaN), as
// torch; a float on the GPU in one instruction (tl.maximum's PropagateNan.ALL).
template <bool Larger, typename T>
FUSEGEN_HD T extreme(T a, T b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (is_float<T>) {
    float chosen;
    if constexpr (Larger) {
      asm("max.NaN.f32 %0, %1, %2;" : "=f"(chosen) : "f"(a), "f"(b));
    } else {
      asm("min.NaN.f32 %0, %1, %2;" : "=f"(chosen) : "f"(a), "f"(b));
    }
    return chosen;
  }
#endif
  return (a != a || b != b) ? a + b : (Larger ? (a > b ? a : b) : (a < b ? a : b));
}

template <typename T>
FUSEGEN_HD T maximum(T a, T b) {
  return extreme<true>(a, b);
}

template <typename T>
FUSEGEN_HD T minimum(T a, T b) {
  return extreme<false>(a, b);
}

// exp(x) in a kernel whose results are all 16-bit or narrower (Narrow: `narrow`): in float on the
// GPU 2^(x·log2 e) by ex2.approx, as torch.compile's kernels compute it; its error (2 ulp and the
// product's rounding, about 1e-6 relative where |x| is near 20) is far below the result's rounding,
// and it takes a third of the instructions of the correctly rounded expf, which wide rows of
// 16-bit softmax were bound by. Else, in double and on the host: std::exp.
template <bool Narrow, typename T>
FUSEGEN_HD T exp(T x) {
#ifdef __CUDA_ARCH__
  if constexpr (Narrow && is_float<T>) {
    float power;
    asm("ex2.approx.f32 %0, %1;" : "=f"(power) : "f"(x * 1.44269504088896340736f));
    return power;
  }
#endif
  return std::exp(x);
}

// Whether every element type E is 16-bit or narrower (a kernel's results: `exp`).
template <typename... E>
FUSEGEN_HD constexpr bool narrow() {
  return ((sizeof(E) <= 2) && ...);
}

// 1 / (1 + exp(-x)) (exp(-x) = inf for x far below 0 gives 0); a float on the GPU as tl.sigmoid:
// exp by ex2.approx whatever the results (exp<true>), divided by div.full.
template <typename T>
FUSEGEN_HD T sigmoid(T x) {
  return divide(T(1), T(1) + exp<true>(-x));
}

// 1 / sqrt(x), a correctly rounded division of the correctly rounded root (CUDA's rsqrtf is
// approximate, as Triton's tl.rsqrt is; kernel_lib.rsqrt_rn says why that matters).
template <typename T>
FUSEGEN_HD T rsqrt_rn(T x) {
  return T(1) / std::sqrt(x);
}

#ifdef __CUDACC_RTC__
template <typename T>
FUSEGEN_HD T infinity();

template <>
FUSEGEN_HD float infinity<float>() {
  return __int_as_float(0x7f800000);
}

template <>
FUSEGEN_HD double infinity<double>() {
  return __longlong_as_double(0x7ff0000000000000LL);
}
#else
template <typename T>
FUSEGEN_HD T infinity() {
  return std::numeric_limits<T>::infinity();
}
#endif

// A value of the compute type as an output's element type, rounded to nearest even as torch's
// tensor.to(dtype): float and double by a cast; fp16 and bf16 (device code, where nvcc has
// cuda_fp16.h and cuda_bf16.h) by their _rn conversions. Loads convert the other way by T(x):
// both 16-bit types convert to float exactly.
template <typename Out, typename T>
FUSEGEN_HD Out to(T value) {
  return static_cast<Out>(value);
}

}  // namespace fusegen

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fusegen {

template <>
FUSEGEN_HD __half to<__half, float>(float value) {
  return __float2half_rn(value);
}

template <>
FUSEGEN_HD __nv_bfloat16 to<__nv_bfloat16, float>(float value) {
  return __float2bfloat16_rn(value);
}

}  // namespace fusegen
#endif

namespace fusegen {

// -- float8 outputs, converted as torch converts (kernel_lib.to_float8, README) -------------

FUSEGEN_HD uint32_t float_bits(float x) {
  union {
    float value;
    uint32_t bits;
  } both = {x};
  return both.bits;
}

// |x|'s float8 bits (x finite and within range) of Mantissa bits and exponent bias Bias, to
// nearest even: below the smallest normal a multiple of 2^(1 - Bias - Mantissa), else x's
// float32 mantissa rounded at its Mantissa-th bit (a carry moves into the exponent).
template <int Mantissa, int Bias>
FUSEGEN_HD uint8_t float8_magnitude(float x) {
  const uint32_t u = float_bits(x) & 0x7fffffffu;
  if (u < uint32_t(128 - Bias) << 23)
    return uint8_t(std::nearbyint(std::fabs(x) * float(1u << (Bias - 1 + Mantissa))));
  const uint32_t rounded = u + ((1u << (22 - Mantissa)) - 1u) + ((u >> (23 - Mantissa)) & 1u);
  return uint8_t(((rounded >> 23) - 127u + Bias) << Mantissa | ((rounded >> (23 - Mantissa)) & ((1u << Mantissa) - 1u)));
}

// x's float8 bits: NaN (its sign kept) for NaN, `overflow` with x's sign where x `overflows`
// the format, else its sign and magnitude (float8_magnitude).
template <int Mantissa, int Bias>
FUSEGEN_HD uint8_t float8_bits(float x, bool overflows, uint8_t overflow) {
  const uint8_t sign = (float_bits(x) >> 24) & 0x80u;
  return uint8_t(sign | (x != x ? 0x7fu : overflows ? overflow : float8_magnitude<Mantissa, Bias>(x)));
}

// A float8_e4m3fn element: past ±448 (the tie at 464 rounds to 448), ±448 where the installed
// torch saturates (Saturates: runtime.out.E4M3_SATURATES), else NaN. A double is rounded to
// float first, as torch does.
template <bool Saturates>
struct float8_e4m3 {
  uint8_t bits;
  float8_e4m3() = default;
  FUSEGEN_HD explicit float8_e4m3(double x) : float8_e4m3(float(x)) {}
  FUSEGEN_HD explicit float8_e4m3(float x)
      : bits(float8_bits<3, 7>(x, std::fabs(x) > (Saturates ? 448.f : 464.f), Saturates ? 0x7eu : 0x7fu)) {}
};

// A float8_e5m2 element: ±inf from ±61440 (the tie with the next power of two).
struct float8_e5m2 {
  uint8_t bits;
  float8_e5m2() = default;
  FUSEGEN_HD explicit float8_e5m2(double x) : float8_e5m2(float(x)) {}
  FUSEGEN_HD explicit float8_e5m2(float x) : bits(float8_bits<2, 15>(x, std::fabs(x) >= 61440.f, 0x7cu)) {}
};

// -- dropout's random words ----------------------------------------------------------------

struct Words {
  uint32_t w[4];
};

// Philox4x32 with 10 rounds, as Triton's tl.philox: key (seed's low word, seed's high word),
// counter (c0, c1, c2, c3).
FUSEGEN_HD Words philox(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t a = static_cast<uint64_t>(c0) * 0xD2511F53u;
    const uint64_t b = static_cast<uint64_t>(c2) * 0xCD9E8D57u;
    const uint32_t next0 = static_cast<uint32_t>(b >> 32) ^ c1 ^ k0;
    const uint32_t next2 = static_cast<uint32_t>(a >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(b);
    c3 = static_cast<uint32_t>(a);
    c0 = next0;
    c2 = next2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Words{{c0, c1, c2, c3}};
}

// The random word of the element at flat index `index` (row * N + col) of dropout stream
// `stream`: word index % 4 of the Philox call on counter (group low, group high, stream, 0),
// group = index / 4. The same word for any layout of the program's tile (kernel_lib's
// _words_of_each_element and _words_of_whole_groups agree on it).
FUSEGEN_HD uint32_t dropout_word(uint64_t seed, int64_t index, uint32_t stream) {
  const uint64_t group = static_cast<uint64_t>(index) >> 2;
  const Words words = philox(seed, static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32), stream, 0u);
  return words.w[index & 3];
}

// Dropout's multiplier for an element of that word: `scale` where the word's top 24 bits reach
// `threshold` (runtime.dropout_threshold of p), else 0.
template <typename T>
FUSEGEN_HD T dropout_multiplier(uint32_t word, int32_t threshold, T scale) {
  return static_cast<int32_t>(word >> 8) >= threshold ? scale : T(0);
}

// The flat index of element (row, col) of the [M, N] problem: row · N + col, or where `shard` is
// not null, the problem is a DTensor's local part and the index is the global problem's, as the
// Triton kernels compute it (kernel_lib.dropout_mask): `shard` holds runtime.sharding.Shard's six
// sizes (one step of the sharded leading dim spans `inner` rows; the dim has `local` of its
// `total` extent here, from `offset`; columns start at `column_offset` of `n_global`).
template <typename Index>
FUSEGEN_HD int64_t flat_index(const int64_t* shard, Index row, Index col, Index n) {
  if (shard == nullptr) return int64_t(row) * n + col;
  const int64_t inner = shard[0], local = shard[1], total = shard[2], offset = shard[3];
  const int64_t step = int64_t(row) / inner;
  const int64_t global_row = ((step / local) * total + offset + step % local) * inner + int64_t(row) % inner;
  return global_row * shard[5] + shard[4] + col;
}

// The multipliers of Pack elements from flat index `index` on, or 1 with dropout off. Pack a
// multiple of 4 (and `index` one too: the kernels' packs start at a multiple of Pack, and a
// shard's columns at a multiple of 4 of a global row of whole groups, else the launcher takes
// Pack 1): one Philox call gives a group's four words; else a call an element.
template <int Pack, typename T>
FUSEGEN_HD void dropout_multipliers(T (&multipliers)[Pack], bool on, uint64_t seed, int64_t index, uint32_t stream,
                                    int32_t threshold, T scale) {
  if (!on) {
    for (int k = 0; k < Pack; ++k) multipliers[k] = T(1);
  } else if constexpr (Pack % 4 == 0) {
    const uint64_t first = static_cast<uint64_t>(index) >> 2;
#pragma unroll
    for (int g = 0; g < Pack / 4; ++g) {
      const uint64_t group = first + g;
      const Words words = philox(seed, static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32), stream, 0u);
#pragma unroll
      for (int k = 0; k < 4; ++k) multipliers[4 * g + k] = dropout_multiplier<T>(words.w[k], threshold, scale);
    }
  } else {
    for (int k = 0; k < Pack; ++k)
      multipliers[k] = dropout_multiplier<T>(dropout_word(seed, index + k, stream), threshold, scale);
  }
}

// A pack of dropout's multipliers kept as a byte each, whether the element is kept (a held
// row's, in shared memory), and read back: the same multipliers.
template <int Pack, typename T>
FUSEGEN_HD void store_kept(unsigned char* p, const T (&multipliers)[Pack]) {
#pragma unroll
  for (int k = 0; k < Pack; ++k) p[k] = multipliers[k] != T(0);
}

template <int Pack, typename T>
FUSEGEN_HD void load_kept(T (&multipliers)[Pack], const unsigned char* p, bool on, T scale) {
#pragma unroll
  for (int k = 0; k < Pack; ++k) multipliers[k] = !on ? T(1) : p[k] ? scale : T(0);
}

// -- loads and stores a pack of elements at a time -----------------------------------------

// Pack elements side by side, aligned to their whole size: one vector load or store a pack
// (16-bit elements by 8 or 4-byte ones by 4: 16 bytes; wider packs, two 16-byte accesses).
template <typename E, int Pack>
struct alignas(sizeof(E) * Pack) Packed {
  E v[Pack];
};

// The Pack values of an input from p on, in T: a vector load where its column stride is 1, one
// value for all where it is 0 (broadcast along the row); Pack 1 reads p (any stride).
template <int Pack, typename T, typename E, typename Index>
FUSEGEN_HD void load(T (&values)[Pack], const E* p, Index stride) {
  if (Pack == 1 || stride == 0) {
    const T value = T(*p);
    for (int k = 0; k < Pack; ++k) values[k] = value;
  } else {
    const Packed<E, Pack> packed = *reinterpret_cast<const Packed<E, Pack>*>(p);
#pragma unroll
    for (int k = 0; k < Pack; ++k) values[k] = T(packed.v[k]);
  }
}

// Pack values stored from p on, each rounded to E: one vector store.
template <int Pack, typename E, typename T>
FUSEGEN_HD void store(E* p, const T (&values)[Pack]) {
  Packed<E, Pack> packed;
#pragma unroll
  for (int k = 0; k < Pack; ++k) packed.v[k] = to<E>(values[k]);
  *reinterpret_cast<Packed<E, Pack>*>(p) = packed;
}

// Pack elements copied from p (as load reads them) to `to`, as they are: one vector load and
// store where the column stride is 1.
template <int Pack, typename E, typename Index>
FUSEGEN_HD void copy(E* to, const E* p, Index stride) {
  if (Pack == 1 || stride == 0) {
    const E value = *p;
    for (int k = 0; k < Pack; ++k) to[k] = value;
  } else {
    *reinterpret_cast<Packed<E, Pack>*>(to) = *reinterpret_cast<const Packed<E, Pack>*>(p);
  }
}

// The next `count` elements of a block's shared memory from `next` on, which moves past them
// (to 128 bytes: any pack's alignment).
template <typename E>
FUSEGEN_HD E* take(unsigned char*& next, int count) {
  E* array = reinterpret_cast<E*>(next);
  next += (count * int(sizeof(E)) + 127) / 128 * 128;
  return array;
}

// A thread's part of a held row of one value (Items packs): in registers (Registers: its packs
// as they are in memory, indexed by the unrolled item, so every index is a constant) or in the
// block's shared memory (`count` elements taken from `next`; a pack at its offset from the
// block's first column).
template <typename E, int Pack, int Items, bool Registers>
struct Held {
  Packed<E, Pack> packs[Registers ? Items : 1];
  E* shared;

  FUSEGEN_HD Held(unsigned char*& next, int count) : shared(Registers ? nullptr : take<E>(next, count)) {}

  template <typename Index>
  FUSEGEN_HD E* at(int item, Index offset) {
    if constexpr (Registers) {
      return packs[item].v;
    } else {
      return shared + offset;
    }
  }
};

}  // namespace fusegen

namespace fusegen {

// A pack of sums at p: `values` written (`first`), else added to what p holds (its sums so far).
template <int Pack, typename E, typename T>
FUSEGEN_HD void accumulate(E* p, const T (&values)[Pack], bool first) {
  T total[Pack];
  if (first) {
#pragma unroll
    for (int k = 0; k < Pack; ++k) total[k] = values[k];
  } else {
    load<Pack>(total, p, 1);
#pragma unroll
    for (int k = 0; k < Pack; ++k) total[k] += values[k];
  }
  store<Pack>(p, total);
}

// A pack of sums a thread keeps (registers: its own columns over a block's rows): `values` added.
template <int Pack, typename T>
FUSEGEN_HD void add(T (&total)[Pack], const T (&values)[Pack]) {
#pragma unroll
  for (int k = 0; k < Pack; ++k) total[k] += values[k];
}

}  // namespace fusegen

#ifndef __CUDACC__
namespace fusegen {

// On the host, a block's dynamic shared memory is the test's (FUSEGEN_HOST_DYNAMIC_SHARED).
#ifndef FUSEGEN_HOST_DYNAMIC_SHARED
inline unsigned char* dynamic_shared() {
  return nullptr;
}
#endif

// On the host (tests/cuda_host.py): a block of one thread, whose reduction is its own value; a
// test that runs a block's threads as host threads defines its own block_reduce, and
// FUSEGEN_HOST_BLOCK_REDUCE.
#ifndef FUSEGEN_HOST_BLOCK_REDUCE
template <typename T, typename Op>
inline T block_reduce(T value, T*, T, Op) {
  return value;
}
#endif

inline void cluster_sync() {}  // a cluster of one block on the host

template <typename T>
inline T block_sum(T value, T* shared) {
  return block_reduce(value, shared, T(0), [](T a, T b) { return a + b; });
}

template <typename T>
inline T block_max(T value, T* shared) {
  return block_reduce(value, shared, -infinity<T>(), [](T a, T b) { return maximum<T>(a, b); });
}

template <typename T>
inline T block_min(T value, T* shared) {
  return block_reduce(value, shared, infinity<T>(), [](T a, T b) { return minimum<T>(a, b); });
}

// A row's reduction on the host: its block's (clusters are the GPU's).
template <int Cluster, typename T>
inline T row_sum(T value, T* shared, T*, unsigned&) {
  static_assert(Cluster == 1, "clusters run on the GPU only");
  return block_sum(value, shared);
}

template <int Cluster, typename T>
inline T row_max(T value, T* shared, T*, unsigned&) {
  static_assert(Cluster == 1, "clusters run on the GPU only");
  return block_max(value, shared);
}

template <int Cluster, typename T>
inline T row_min(T value, T* shared, T*, unsigned&) {
  static_assert(Cluster == 1, "clusters run on the GPU only");
  return block_min(value, shared);
}

}  // namespace fusegen
#else
namespace fusegen {

// -- a block's reductions (the row kind) ---------------------------------------------------

// The block's dynamic shared memory (the launch's size), 128-byte aligned.
__device__ __forceinline__ unsigned char* dynamic_shared() {
  extern __shared__ __align__(128) unsigned char fusegen_dynamic_shared[];
  return fusegen_dynamic_shared;
}

// `value` of every thread of the block combined by `op`: each warp's by shuffles, then the warps'
// (one value each in `shared`, 32 values) by the first; every thread gets the result. The same
// order on every call: deterministic. Every thread of the block calls it (blockDim.x a multiple of
// 32); `shared` is free again when it returns.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T value, T* shared, T neutral, Op op) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = lane < warps ? shared[lane] : neutral;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  __syncthreads();  // every warp has read `shared`: the next reduction may write it
  return value;
}

template <typename T>
__device__ __forceinline__ T block_sum(T value, T* shared) {
  return block_reduce(value, shared, T(0), [](T a, T b) { return a + b; });
}

template <typename T>
__device__ __forceinline__ T block_max(T value, T* shared) {
  return block_reduce(value, shared, -infinity<T>(), [](T a, T b) { return maximum<T>(a, b); });
}

template <typename T>
__device__ __forceinline__ T block_min(T value, T* shared) {
  return block_reduce(value, shared, infinity<T>(), [](T a, T b) { return minimum<T>(a, b); });
}

// -- a cluster's reductions (the row kind's wide rows, sm_90) ------------------------------

// Every block of the cluster past this point once all have reached it; shared memory written
// before it (the cluster's too) is visible to every block after it.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();  // the launcher asks for clusters on sm_90 and later only
#endif
}

// `value` stored at `slot` of block `rank` of the cluster (the same place in its shared memory).
template <typename T>
__device__ __forceinline__ void store_in_block(T* slot, unsigned rank, T value) {
#if __CUDA_ARCH__ >= 900
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(slot));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  if constexpr (sizeof(T) == 8) {
    asm volatile("st.shared::cluster.f64 [%0], %1;" ::"r"(remote), "d"(value) : "memory");
  } else {
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(value) : "memory");
  }
#else
  __trap();
#endif
}

// A row's reduction: its block's, then, with a cluster of blocks a row, the blocks' values
// combined: each block's sent to every block's `slots` (two sets, taken in turn: a block
// writes a set again only after every block has passed the next reduction's barrier, so after
// all have read it), and every block combining them in rank order: the same value, deterministic.
template <int Cluster, typename T, typename Op>
__device__ __forceinline__ T row_reduce(T value, T* shared, T* slots, unsigned& phase, T neutral, Op op) {
  value = block_reduce(value, shared, neutral, op);
  if constexpr (Cluster > 1) {
    T* set = slots + (phase++ & 1u) * Cluster;
    if (threadIdx.x < Cluster) store_in_block(set + blockIdx.x % Cluster, threadIdx.x, value);
    cluster_sync();
    value = set[0];
#pragma unroll
    for (int rank = 1; rank < Cluster; ++rank) value = op(value, set[rank]);
  }
  return value;
}

template <int Cluster, typename T>
__device__ __forceinline__ T row_sum(T value, T* shared, T* slots, unsigned& phase) {
  return row_reduce<Cluster>(value, shared, slots, phase, T(0), [](T a, T b) { return a + b; });
}

template <int Cluster, typename T>
__device__ __forceinline__ T row_max(T value, T* shared, T* slots, unsigned& phase) {
  return row_reduce<Cluster>(value, shared, slots, phase, -infinity<T>(), [](T a, T b) { return maximum<T>(a, b); });
}

template <int Cluster, typename T>
__device__ __forceinline__ T row_min(T value, T* shared, T* slots, unsigned& phase) {
  return row_reduce<Cluster>(value, shared, slots, phase, infinity<T>(), [](T a, T b) { return minimum<T>(a, b); });
}

}  // namespace fusegen
#endif
