// Reductions across the lanes of a wave, or across an aligned group of `Width` lanes of it.
// Every lane ends with the result (butterfly), so no broadcast is needed afterwards.
#pragma once

#include "hipkern/platform.h"

namespace hk {

struct MaxOp { template <typename T> HK_DEVICE T operator()(T a, T b) const { return a > b ? a : b; } };
struct MinOp { template <typename T> HK_DEVICE T operator()(T a, T b) const { return a < b ? a : b; } };
struct SumOp { template <typename T> HK_DEVICE T operator()(T a, T b) const { return a + b; } };

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

// float <-> uint32 key whose unsigned order is the float order (-inf -> 0x007fffff, +inf ->
// 0xff800000); key 0 lies below every float and serves as "nothing".
HK_DEVICE uint32_t ordered_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
HK_DEVICE float key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Sum over a whole thread block of BlockThreads threads; `scratch` holds one float per wave.
// All threads get the result. Contains barriers: every thread of the block must call it.
template <int BlockThreads>
HK_DEVICE float block_sum(float v, float* scratch) {
  constexpr int kWaves = BlockThreads / kWaveSize;
  static_assert(BlockThreads % kWaveSize == 0, "block of whole waves");
  v = group_sum(v);
  if (kWaves == 1) return v;
  const int wave = threadIdx.x / kWaveSize;
  __syncthreads();
  if (lane_id() == 0) scratch[wave] = v;
  __syncthreads();
  float t = lane_id() < kWaves ? scratch[lane_id()] : 0.f;
  return group_sum(t);
}

}  // namespace hk
