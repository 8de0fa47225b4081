// Reductions across the lanes of a wave, or across an aligned group of `Width` lanes of it.
// Every lane ends with the result (butterfly), so no broadcast is needed afterwards.
#pragma once

#include "hipkern/platform.h"

namespace hk {

struct MaxOp { HK_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); } };
struct SumOp { HK_DEVICE float operator()(float a, float b) const { return a + b; } };

template <int Width = kWaveSize, typename Op>
HK_DEVICE float group_reduce(float v, Op op) {
  static_assert(Width >= 1 && Width <= kWaveSize && (Width & (Width - 1)) == 0, "group width");
#pragma unroll
  for (int off = Width / 2; off > 0; off /= 2) v = op(v, shfl_xor(v, off, Width));
  return v;
}

template <int Width = kWaveSize> HK_DEVICE float group_max(float v) { return group_reduce<Width>(v, MaxOp()); }
template <int Width = kWaveSize> HK_DEVICE float group_sum(float v) { return group_reduce<Width>(v, SumOp()); }

// (value, index) pair ordered by value descending, then index ascending; index < 0 is "none".
struct ArgMax {
  float value;
  int index;
  HK_DEVICE bool beats(float v, int i) const {  // does (value, index) come before (v, i)?
    return index >= 0 && (i < 0 || value > v || (value == v && index < i));
  }
};

template <int Width = kWaveSize>
HK_DEVICE ArgMax group_argmax(ArgMax a) {
#pragma unroll
  for (int off = Width / 2; off > 0; off /= 2) {
    ArgMax o{shfl_xor(a.value, off, Width), shfl_xor(a.index, off, Width)};
    if (o.beats(a.value, a.index)) a = o;
  }
  return a;
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
