// The decode variant of fused MoE: the whole op in one launch for a few routed pairs (T * k <=
// kDecodePairs), where the standalone chain (moe_sorting, two GEMM launches, the combine) spends as
// long starting and draining its four kernels as streaming the weights.
//
// One persistent grid (every block resident at once: the grid is the device's resident-block
// count, which the waits below rely on):
//   1. every block groups the pairs by expert itself, in shared memory (route_pairs(), route.h: the
//      m-blocks moe_sorting would build, so no sorting kernel);
//   2. the gated GEMM (gemm_phase, as the standalone launch), each finished item counted per m-block
//      in `ready`;
//   3. the down GEMM, whose blocks request their first weight stages at once and wait, per item,
//      only for the gated items of that item's m-block (its rows of the intermediate);
//   4. a grid barrier, then the deterministic combine over the grid; the last block to leave resets
//      the counters for the next call.
// A block finishes all its gated items before it waits for any: no wait can be on a block that is
// itself waiting, so the grid cannot deadlock while all its blocks are resident.
#pragma once

#include "gemm_launch.h"
#include "hipkern/moe.h"

namespace hk {
namespace fused_moe {

constexpr int kDecodePairs = 32;     // DownHooks' `seen`: a bit per m-block
constexpr int kDecodeMaxBlockM = 64;  // both GEMMs' tiles and the table in one block's shared memory

// out[t][4c .. 4c + 3] = the sum of y over t's kept pairs in slot order (no float atomics), over a
// grid-stride loop of this grid. kSlots slots at a time: their ids, then their y rows (L2 hits), each
// group of loads issued together before any is used; one slot at a time they ran as an ids, a map and
// a y round trip in series. wait_y() runs once per thread with work, before its first y load and after
// its first ids (which the GEMMs do not write): the standalone combine waits there for the down GEMM.
template <typename T, int kThreads, typename WaitY>
HK_DEVICE void combine_rows(const float* y, const int32_t* ids, const int32_t* expert_map, int num_experts,
                            int num_local, T* out, int64_t num_tokens, int topk, int dim, WaitY wait_y) {
  constexpr int kSlots = 8;
  const int quads = dim / 4;
  const int64_t n = num_tokens * quads;
  bool waited = false;
  for (int64_t i = blockIdx.x * (int64_t)kThreads + threadIdx.x; i < n; i += (int64_t)gridDim.x * kThreads) {
    const int64_t t = i / quads;
    const int c = (int)(i % quads) * 4;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j0 = 0; j0 < topk; j0 += kSlots) {
      int e[kSlots];
#pragma unroll
      for (int b = 0; b < kSlots; ++b) e[b] = j0 + b < topk ? ids[t * topk + j0 + b] : -1;
      bool kept[kSlots];
#pragma unroll
      for (int b = 0; b < kSlots; ++b) kept[b] = moe_local_expert(e[b], num_experts, expert_map, num_local) >= 0;
      if (!waited) {
        wait_y();
        waited = true;
      }
      float4 v[kSlots];
#pragma unroll
      for (int b = 0; b < kSlots; ++b)
        if (kept[b]) v[b] = *reinterpret_cast<const float4*>(y + (t * topk + j0 + b) * dim + c);
#pragma unroll
      for (int b = 0; b < kSlots; ++b) {
        if (!kept[b]) continue;
        acc[0] += v[b].x;
        acc[1] += v[b].y;
        acc[2] += v[b].z;
        acc[3] += v[b].w;
      }
    }
    store_from_float<T, 4>(out + t * dim + c, acc);
  }
}

// The gated phase counts each finished item of m-block mb in ready[mb]; the down phase waits for all
// `items` of them (the gated GEMM's n-tiles) before it reads the m-block's intermediate rows.
struct GatedHooks {
  static constexpr bool kPairs = false;  // a plain launch
  int* ready;
  HK_DEVICE void wait_input() const {}
  HK_DEVICE void wait_item(int) const {}
  HK_DEVICE void item_done(int mb) const {
    fence_before_publish();
    __syncthreads();  // every thread's outputs are written
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(ready + mb, 1);
    }
  }
};
// The m-blocks a block has seen complete (`seen`, a bit each) need no second wait. A wait polls every
// m-block's counter at once (a lane of the first wave each) and records all the complete ones, not
// only the one it waits for: a block's consecutive down items mostly belong to different m-blocks
// (item b + j G has m-block (b + j G) % n_mblocks), and once the gated phase is over its first wait
// marks them all, so the later items skip the L2 round trip and the barrier. Every thread makes the
// same calls and reads the same word (double-buffered: consecutive waits of the prologue have no
// barrier between them), so every thread's copy of `seen` is the same. kPollAll = false (float32)
// waits for the one m-block (thread 0): float32's kernels sit at the register limit on CDNA (256
// VGPRs at block_m 64, where the wave-wide poll spilled), and its decode variant runs at one token,
// one m-block per block, where the two waits are the same.
template <bool kPollAll>
struct DownHooks {
  static constexpr bool kPairs = false;
  const int* ready;
  int items;
  unsigned* done_s;  // [2] in shared memory
  mutable unsigned seen = 0u;
  mutable int parity = 0;
  static_assert(kDecodePairs <= 32 && kDecodePairs <= kWaveSize, "seen: a bit per m-block, a lane each");
  HK_DEVICE void wait_input() const {}
  HK_DEVICE void wait_item(int mb) const {  // every thread calls it (from the loader)
    if (seen >> mb & 1u) return;
    if constexpr (!kPollAll) {
      if (threadIdx.x == 0) spin_until_at_least(ready + mb, items);
    } else if (threadIdx.x < kWaveSize) {  // the first wave, converged
      const int lane = threadIdx.x;
      unsigned done;
      for (;;) {
        const bool complete =
            lane < kDecodePairs && *reinterpret_cast<const volatile int*>(ready + lane) >= items;
        done = (unsigned)ballot(complete);
        if (done >> mb & 1u) break;
        spin_pause();
      }
      __threadfence();  // the m-blocks' intermediate rows are read after this
      if (lane == 0) done_s[parity] = done;
    }
    __syncthreads();
    if constexpr (kPollAll) {
      seen |= done_s[parity];
      parity ^= 1;
    } else {
      seen |= 1u << mb;
    }
    trace_point(3);  // the last release is the one kept
  }
  HK_DEVICE void item_done(int) const {}
};

// Counters after the split-K ones: ready[kDecodePairs], then the barrier's arrivals and departures.
constexpr int kDecodeCounters = kDecodePairs + 2;

struct DecodeArgs {
  const int32_t* ids;
  const int32_t* expert_map;
  const float* y;
  void* out;
  int* sync;  // kDecodeCounters ints, zero on entry, left zero
  int num_tokens, topk, num_experts, num_local_experts, dim;
};

template <typename T, typename M1, typename M2, int BM>
struct DecodeCfg {
  typedef GemmCfg<T, M1, BM, true> C1;
  typedef GemmCfg<T, M2, BM, false> C2;
  static_assert(C1::kThreads == C2::kThreads, "both GEMMs' tiles run in the same blocks");
  static constexpr int kThreads = C1::kThreads;
  static constexpr int kRouteAt = round_up(C1::bytes > C2::bytes ? C1::bytes : C2::bytes, 16);
  static constexpr int kDoneAt = kRouteAt + round_up((int)sizeof(RouteTable), 16);  // DownHooks::done_s
  static constexpr int bytes = kDoneAt + 16;
  static_assert(kDecodePairs <= kRoutePairs, "route_pairs() takes them all");
  static_assert(kAsyncCopy || bytes <= 64 * 1024, "CDNA: fits 64 KB of LDS");
  static_assert(bytes <= 227 * 1024, "fits an sm_90 block's shared memory");
};


template <typename T, typename M1, typename M2, int BM>
__global__ HK_LAUNCH_BOUNDS(M1::kWaves * kWaveSize, 1) void decode_kernel(GemmParams g1, GemmParams g2, DecodeArgs d) {
  typedef DecodeCfg<T, M1, M2, BM> C;
  // g1 and g2 are not grid constants: no tensor map may be read from them.
  static_assert(!GemmCfg<T, M1, BM, true>::kTmaW && !GemmCfg<T, M2, BM, false>::kTmaW, "copies by the threads");
  extern __shared__ __align__(kWgmma ? 1024 : 16) unsigned char smem_raw[];  // wgmma atoms
  RouteTable& r = *reinterpret_cast<RouteTable*>(smem_raw + C::kRouteAt);
  trace_point(0);
  trace_point(3);  // DownHooks overwrites it at each release; a block with no down item keeps its start
  route_pairs<C::kThreads, C::C1::kRouteWaves>(d.ids, d.expert_map, g1.num_pairs, d.num_experts, BM,
                                               reinterpret_cast<int*>(smem_raw), r);
  trace_point(1);
  int* ready = d.sync;
  gemm_phase<T, M1, BM, true, kGivenTable>(g1, smem_raw, GatedHooks{ready}, &r);
  trace_point(2);
  __syncthreads();  // the down phase reuses the shared memory
  gemm_phase<T, M2, BM, false, kGivenTable>(g2, smem_raw,
                                DownHooks<sizeof(T) == 2>{ready, g1.n_tiles,
                                                          reinterpret_cast<unsigned*>(smem_raw + C::kDoneAt)},
                                &r);
  trace_point(4);

  // Every block's down items are written: a grid barrier, then the combine.
  int* arrived = d.sync + kDecodePairs;
  int* left = arrived + 1;
  const int G = (int)gridDim.x;
  fence_before_publish();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(arrived, 1);
    spin_until_at_least(arrived, G);
  }
  __syncthreads();
  trace_point(5);
  combine_rows<T, C::kThreads>(d.y, d.ids, d.expert_map, d.num_experts, d.num_local_experts, static_cast<T*>(d.out),
                               d.num_tokens, d.topk, d.dim, [] {});  // y is complete: the grid barrier above
  if (threadIdx.x == 0 && atomicAdd(left, 1) == G - 1) {  // everyone is past the barrier: reset
    for (int i = 0; i < kDecodeCounters; ++i) d.sync[i] = 0;
    __threadfence();
  }
  trace_point(6);
}

template <typename T, typename M1, typename M2, int BM>
int decode_grid(int device, int* out) {
  typedef DecodeCfg<T, M1, M2, BM> C;
  return resident_grid<&decode_kernel<T, M1, M2, BM>>(C::kThreads, C::bytes, device, out);
}

// Floats of partials and ints of counters a decode launch uses: a split-K region per phase (phases of
// different blocks overlap in time), then the decode counters.
template <typename T, typename M1, typename M2, int BM>
int decode_workspace(int device, int64_t* partial_floats, int64_t* counter_ints) {
  int grid = 0;
  HK_TRY((decode_grid<T, M1, M2, BM>(device, &grid)));
  const int64_t items = split_items(grid);
  *partial_floats = items * (kSplitFloats<M1> + kSplitFloats<M2>);
  *counter_ints = 2 * items + kDecodeCounters;
  return 0;
}

// g1 / g2 as for the two standalone launches (their sorted_ids, expert_ids, num_post and route_ids unused:
// each block routes in shared memory); partials / counters as decode_workspace says.
template <typename T, typename M1, typename M2, int BM>
int launch_decode(GemmParams g1, GemmParams g2, DecodeArgs d, float* partials, int* counters, int device,
                  hipStream_t stream) {
  typedef DecodeCfg<T, M1, M2, BM> C;
  auto kernel = &decode_kernel<T, M1, M2, BM>;
  int grid = 0;
  HK_TRY((decode_grid<T, M1, M2, BM>(device, &grid)));
  const int items = split_items(grid);
  g1.max_mblocks = g2.max_mblocks = kDecodePairs;
  g1.max_split_items = g2.max_split_items = items;
  g1.partials = partials;
  g2.partials = partials + items * kSplitFloats<M1>;
  g1.counters = counters;
  g2.counters = counters + items;
  d.sync = counters + 2 * items;
  HK_TRY(allow_shared(kernel, raised<&decode_kernel<T, M1, M2, BM>>(), C::bytes, device));
  // Cooperative: the grid barrier and the down items' waits need every block resident.
  HK_CHECK(launch_cooperative(kernel, dim3((unsigned)grid), dim3(C::kThreads), C::bytes, stream, g1, g2, d));
  return 0;
}

}  // namespace fused_moe
}  // namespace hk
