// Reductions across the lanes of a wave, or across an aligned group of `Width` lanes of it.
// Every lane ends with the result (butterfly), so no broadcast is needed afterwards.
#pragma once

#include "hipkern/platform.h"

namespace hk {

struct MaxOp { template <typename T> HK_DEVICE T operator()(T a, T b) const { return a > b ? a : b; } };
struct MinOp { template <typename T> HK_DEVICE T operator()(T a, T b) const { return a < b ? a : b; } };
struct SumOp { template <typename T> HK_DEVICE T operator()(T a, T b) const { return a + b; } };
struct XorOp { template <typename T> HK_DEVICE T operator()(T a, T b) const { return a ^ b; } };

template <int Width = kWaveSize, typename T, typename Op>
HK_DEVICE T group_reduce(T v, Op op) {
  static_assert(Width >= 1 && Width <= kWaveSize && (Width & (Width - 1)) == 0, "group width");
#pragma unroll
  for (int off = Width / 2; off > 0; off /= 2) v = op(v, shfl_xor(v, off, Width));
  return v;
}

template <int Width = kWaveSize> HK_DEVICE float group_max(float v) { return group_reduce<Width>(v, MaxOp()); }
template <int Width = kWaveSize> HK_DEVICE float group_sum(float v) { return group_reduce<Width>(v, SumOp()); }

// Unsigned max/min: one `redux` instruction for a whole NVIDIA warp (sm_80+), else a butterfly.
template <int Width = kWaveSize>
HK_DEVICE uint32_t group_max_u32(uint32_t v) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Width == 32) return __reduce_max_sync(kFullMask, v);
#endif
  return group_reduce<Width>(v, MaxOp());
}

template <int Width = kWaveSize>
HK_DEVICE uint32_t group_min_u32(uint32_t v) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Width == 32) return __reduce_min_sync(kFullMask, v);
#endif
  return group_reduce<Width>(v, MinOp());
}

// Unsigned 64-bit max: for a full NVIDIA warp two `redux` instructions (high words, then the low
// words of the lanes holding the highest high word), else a butterfly.
template <int Width = kWaveSize>
HK_DEVICE uint64_t group_max_u64(uint64_t v) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Width == 32) {
    const uint32_t hi = __reduce_max_sync(kFullMask, (uint32_t)(v >> 32));
    const uint32_t lo = __reduce_max_sync(kFullMask, (uint32_t)(v >> 32) == hi ? (uint32_t)v : 0u);
    return ((uint64_t)hi << 32) | lo;
  }
#endif
  return group_reduce<Width>(v, MaxOp());
}

// float <-> uint32 key whose unsigned order is the float order (-inf -> 0x007fffff, +inf ->
// 0xff800000); key 0 lies below every float and serves as "nothing".
HK_DEVICE uint32_t ordered_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
HK_DEVICE float key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
// The same for 16-bit floats (fp16, bf16), on their raw bits.
HK_DEVICE uint32_t ordered_key16(uint16_t b) { return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u); }
HK_DEVICE uint16_t key16_to_bits(uint32_t k) { return (uint16_t)((k & 0x8000u) ? (k & 0x7fffu) : (~k & 0xffffu)); }

// `op` over a whole thread block of BlockThreads threads (`identity`: op's neutral value); `scratch`
// holds one T per wave. All threads get the result. Contains barriers: every thread of the block must
// call it.
template <int BlockThreads, typename T, typename Op>
HK_DEVICE T block_reduce(T v, T* scratch, Op op, T identity) {
  constexpr int kWaves = BlockThreads / kWaveSize;
  static_assert(BlockThreads % kWaveSize == 0, "block of whole waves");
  v = group_reduce(v, op);
  if (kWaves == 1) return v;
  const int wave = threadIdx.x / kWaveSize;
  __syncthreads();
  if (lane_id() == 0) scratch[wave] = v;
  __syncthreads();
  const T t = lane_id() < kWaves ? scratch[lane_id()] : identity;
  return group_reduce(t, op);
}

// Sum over a whole thread block (block_reduce).
template <int BlockThreads>
HK_DEVICE float block_sum(float v, float* scratch) {
  return block_reduce<BlockThreads>(v, scratch, SumOp(), 0.f);
}

// Inclusive prefix sum over the lanes of each aligned group of `Width` lanes.
template <int Width = kWaveSize, typename T>
HK_DEVICE T group_inclusive_sum(T v) {
  static_assert(Width >= 1 && Width <= kWaveSize && (Width & (Width - 1)) == 0, "group width");
  const int l = lane_id() % Width;
#pragma unroll
  for (int off = 1; off < Width; off *= 2) {
    const T t = shfl(v, l >= off ? l - off : l, Width);
    if (l >= off) v += t;
  }
  return v;
}

// Exclusive prefix sum over a whole block of BlockThreads threads in thread order; `total` gets the
// block's sum. `scratch` holds one T per wave. Contains barriers: every thread must call it.
template <int BlockThreads, typename T>
HK_DEVICE T block_exclusive_sum(T v, T* scratch, T& total) {
  constexpr int kWaves = BlockThreads / kWaveSize;
  static_assert(BlockThreads % kWaveSize == 0, "block of whole waves");
  const T inc = group_inclusive_sum(v);
  const int wave = threadIdx.x / kWaveSize;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane_id() == kWaveSize - 1) scratch[wave] = inc;
  __syncthreads();
  T before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWaves; ++w) {
    const T s = scratch[w];
    before += w < wave ? s : T(0);
    all += s;
  }
  total = all;
  return before + inc - v;
}

}  // namespace hk
