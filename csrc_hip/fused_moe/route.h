// A few routed pairs grouped by expert inside one block, in shared memory: the layout moe_sorting
// builds (each expert's pairs in pair order, experts in order, m-blocks of at most BM pairs), kept
// compact (no padding rows), so that a GEMM launch needs no sorting launch before it. The grouped
// chain uses it for at most kRoutePairs pairs (every block of both GEMMs routes for itself); the decode
// variant always (it has at most kDecodePairs).
#pragma once

#include "hipkern/moe.h"
#include "hipkern/platform.h"
#include "hipkern/reduce.h"
#include "hipkern/wgmma.h"

namespace hk {
namespace fused_moe {

constexpr int kRoutePairs = 256;
constexpr int kRouteMaxExperts = 1024;  // moe_sorting's kMaxExperts

// M-block mb is the local expert expert[mb] (any index into w1: expert_map's values are not bounded by E)
// with the pairs list[lo[mb] .. hi[mb]).
struct RouteTable {
  int n_mblocks;
  int32_t expert[kRoutePairs];
  int16_t list[kRoutePairs];
  int16_t lo[kRoutePairs], hi[kRoutePairs];
};

// Scratch route_pairs needs with `rank_waves` ranking waves (the caller's free shared memory until
// route_pairs returns): per expert its count, then its starts; per pair its expert and rank; one int per
// wave for the scan; per ranking wave and expert a 16-bit count.
constexpr int route_scratch_bytes(int rank_waves) {
  return (2 * kRouteMaxExperts + 2 * kRoutePairs + 32) * 4 + rank_waves * kRouteMaxExperts * 2;
}
// The most of a block's `waves` that can rank with `bytes` of scratch (0: not even one).
constexpr int route_rank_waves(int waves, int bytes) {
  for (int w = waves; w >= 1; --w)
    if (route_scratch_bytes(w) <= bytes) return w;
  return 0;
}

// Pairs [0, n) of ids (n <= kRoutePairs; a pair is kept as moe_sorting keeps it) into t, by all kThreads
// threads of the block, with route_scratch_bytes(kRankWaves) of scratch. Each of the first kRankWaves
// waves ranks a contiguous share of the pairs within their experts (one wave for all of them left the
// down GEMM's start 1.3 us later at 256 pairs on the H100: NOTES.md, 2026-11-28), a wave-width
// step at a time (match_any: the step's lanes of the same expert; the lowest adds their count to the
// wave's counter of the expert); then per expert the waves' counts become prefixes, and one block scan of
// (pairs | m-blocks << 16) gives the experts' starts. Ends with a barrier: t is complete, scratch free
// (kAsyncAfter: also for tensor-map copies, async-proxy writes, into it).
template <int kThreads, int kRankWaves, bool kAsyncAfter = false>
HK_DEVICE void route_pairs(const int32_t* ids, const int32_t* expert_map, int n, int num_experts, int bm,
                           int* scratch, RouteTable& t) {
  constexpr int kPairsPer = (kRoutePairs + kThreads - 1) / kThreads;
  static_assert(kRankWaves >= 1 && kRankWaves * kWaveSize <= kThreads, "ranking waves of the block");
  int* cnt = scratch;                            // [E]: pairs of the expert
  int* start = cnt + kRouteMaxExperts;           // [E]: first list slot | first m-block << 16
  int* key = start + kRouteMaxExperts;           // [n]: the pair's expert, E when dropped
  int* rank = key + kRoutePairs;                 // [n]: the pair's place among its wave's of its expert
  int* scan = rank + kRoutePairs;                // [waves]
  int16_t* wcnt = reinterpret_cast<int16_t*>(scan + 32);  // [waves][E]: counts, then prefixes over waves
  const int E = num_experts, wave = threadIdx.x / kWaveSize;
  const int share = (n + kRankWaves - 1) / kRankWaves;  // wave w ranks the pairs [w * share, (w + 1) * share)
  int e[kPairsPer];
#pragma unroll
  for (int i = 0; i < kPairsPer; ++i) {  // every id load issued before any is checked
    const int p = threadIdx.x + i * kThreads;
    e[i] = p < n ? ids[p] : E;
  }
#pragma unroll
  for (int i = 0; i < kPairsPer; ++i) {
    const int p = threadIdx.x + i * kThreads;
    if (p < n) key[p] = moe_kept_expert(e[i], E, expert_map);
  }
  for (int x = threadIdx.x; x < kRankWaves * E; x += kThreads) wcnt[x] = 0;
  __syncthreads();
  if (wave < kRankWaves) {
    const int bits = 32 - __clz(E), end = min(n, (wave + 1) * share);  // bits: of the values 0 .. E
    int16_t* mine = wcnt + wave * E;
    for (int c = wave * share; c < end; c += kWaveSize) {  // the same steps on every lane of the wave
      const int p = c + lane_id();
      const int x = p < end ? key[p] : E;
      const lanemask_t peers = match_any((uint32_t)x, bits);
      const lanemask_t below = peers & lanemask_lt();
      const int base = x < E ? mine[x] : 0;
      wave_sync();  // every lane has read its counter before the lowest lane advances it
      if (x < E) {
        rank[p] = base + popc(below);
        if (below == 0) mine[x] = (int16_t)(base + popc(peers));
      }
      wave_sync();
    }
  }
  __syncthreads();
  // Thread i takes the experts [i * per, (i + 1) * per): the waves' counts become prefixes, then the scan.
  const int per = (E + kThreads - 1) / kThreads, e0 = min((int)threadIdx.x * per, E), e1 = min(e0 + per, E);
  int sum = 0;
  for (int x = e0; x < e1; ++x) {
    int c = 0;
#pragma unroll
    for (int w = 0; w < kRankWaves; ++w) {
      const int v = wcnt[w * E + x];
      wcnt[w * E + x] = (int16_t)c;
      c += v;
    }
    cnt[x] = c;
    start[x] = c + ((c + bm - 1) / bm << 16);  // packed (pairs | m-blocks << 16), each <= 256: no carry
    sum += start[x];
  }
  int total;
  int run = block_exclusive_sum<kThreads>(sum, scan, total);
  for (int x = e0; x < e1; ++x) {
    const int packed = start[x];
    start[x] = run;
    run += packed;
  }
  if (threadIdx.x == 0) t.n_mblocks = total >> 16;
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += kThreads) {
    const int x = key[p];
    if (x < E) t.list[(start[x] & 0xffff) + wcnt[p / share * E + x] + rank[p]] = (int16_t)p;
  }
  for (int x = e0; x < e1; ++x) {
    const int c = cnt[x];
    if (c == 0) continue;
    const int s = start[x] & 0xffff, mb0 = start[x] >> 16, local = expert_map != nullptr ? expert_map[x] : x;
    for (int b = 0; b * bm < c; ++b) {
      t.expert[mb0 + b] = local;
      t.lo[mb0 + b] = (int16_t)(s + b * bm);
      t.hi[mb0 + b] = (int16_t)(s + min(c, (b + 1) * bm));
    }
  }
  if constexpr (kAsyncAfter) fence_async_shared();  // this thread's scratch accesses before the copies' writes
  __syncthreads();
}

}  // namespace fused_moe
}  // namespace hk
