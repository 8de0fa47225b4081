// The grouped expert GEMM of fused MoE, persistent and load-balanced, used twice per call:
//   gated (Gated = true):  inter[p][i] = act(w1[e][i] . x[p / k]) * (w1[e][I + i] . x[p / k])
//   down  (Gated = false): y[p][d]     = topk_weight[p] * (w2[e][d] . inter[p])
// for every routed (token, slot) pair p = t * k + j, e its (local) expert.
//
// Work items. moe_sorting groups the pairs by expert into m-blocks of BM rows (one expert each,
// valid rows first, then padding), or, for at most kRoutePairs pairs, every block groups them itself
// (route.h: the same m-blocks, compact, in shared memory; GemmParams::route_ids). An item is one
// m-block x one n-tile of M::kRows weight rows over the whole reduction: every item moves the same
// weight bytes, so items are the unit of balance.
// The item count is read on the GPU (num_tokens_post_padded / BM m-blocks x n-tiles), so the
// launch depends on shapes only (CUDA-graph capturable), and a grid of the resident-block count
// walks the items block-cyclically, m-block fastest: the blocks running at one time share n-tiles,
// so an expert's m-blocks read its weights from HBM about once when routing piles tokens onto it.
//
// Pipeline. A block's items and their kBK-wide reduction stages form one stream of stages, loaded
// kStages deep with 16-byte asynchronous copies (and a 4-byte one per token row of split rows;
// synchronous, one stage, on CDNA; on sm_90a 16-bit weight stages of 64 columns are one tensor-map
// box, GemmCfg::kTmaW, and block_m 128 counts its copies on an mbarrier a stage, kFullBars): the next
// item's weights are in flight while this item finishes, so small items (the down GEMM at I = 256)
// keep HBM busy. Weight rows past the end, columns past K and invalid experts are zero-filled and
// never read; padding token rows are not loaded at all (their columns of the product are never
// stored). After an item's last stage, the k-groups'
// partial tiles meet in shared memory (summed in a fixed order: deterministic) and the epilogue
// writes the item's outputs.
#pragma once

#include "math.h"
#include "route.h"
#include "hipkern/launch.h"
#include "hipkern/reduce.h"
#include "hipkern/tma.h"

namespace hk {
namespace fused_moe {

// HK_MOE_TRACE (a diagnostic build, NVIDIA only): thread 0 of each block records %globaltimer at the
// phase boundaries of the last call into hk_moe_trace[block][point]; hk_fused_moe_trace() reads it.
// Points: the decode kernel's (decode.h), or the grouped chain's: gated GEMM 0-2, down GEMM 3-5 (start,
// input ready, end), combine 6-7 (input ready, end).
#if defined(HK_MOE_TRACE) && defined(HK_PLATFORM_CUDA)
__device__ unsigned long long hk_moe_trace[4096][8];
HK_DEVICE void trace_point(int i) {
  if (threadIdx.x != 0 || blockIdx.x >= 4096) return;
  hk_moe_trace[blockIdx.x][i] = globaltimer();
}
#else
HK_DEVICE void trace_point(int) {}
#endif

enum Activation { kSilu = 0, kGelu = 1 };

struct GemmParams {
  const void* x;  // gated: hidden [T][K]; down: inter [num_pairs][K] (split rows where M::kPreSplit)
  int64_t x_stride;
  const float* x_scale;  // M::kPreSplit: x's block scales, [rows][x_stride / 64]
  int x_div;      // the row of x of pair p is p / x_div (gated: topk; down: 1)
  const void* w;  // [num_experts][N_w][K]; N_w = 2N (gated) or N
  int64_t w_stride_e;
  int num_experts;  // local experts; an m-block's expert outside [0, num_experts) reads zeros
  int K, N;         // reduction length; output columns
  const int32_t* sorted_ids;
  const int32_t* expert_ids;
  const int32_t* num_post;
  // Routed in each block instead (route.h), where route_ids is set (then the three above are unused):
  // topk_ids, expert_map (or null) and its length E, for at most kRoutePairs pairs.
  const int32_t* route_ids;
  const int32_t* route_map;
  int route_experts;
  int num_pairs, max_mblocks, n_tiles;
  void* out;  // gated: T [num_pairs][N] (split rows where M::kPreSplit); down: float [num_pairs][N]
  int64_t out_stride;
  float* out_scale;  // gated, M::kPreSplit: out's block scales, [num_pairs][out_stride / 64]
  const float* topk_weights;  // down: [num_pairs]
  int activation;
  // Split-K (see plan()): partial tiles of up to max_split_items items, and one arrival counter per
  // split item group, zero on entry and left zero.
  float* partials;
  int* counters;
  int max_split_items;
  // The weights as a tensor map (hipkern/tma.h), where GemmCfg::kTmaW and w_tma (set by launch_gemm):
  // each stage's weight tile is then one box copied by thread 0 (rows past N, columns past K and
  // invalid experts come out as zeros), completing on the stage's mbarrier. Down: w [num_experts][N][K]
  // in boxes of M::kRows rows x 64 columns. Gated: w [num_experts][2N][K] seen as [num_experts][N / 8
  // groups][K] of [2 halves (gate, up)][8 rows], in boxes of kCols / 8 groups x 2 x 8 rows x 64 columns:
  // a box lands as the tile's 16-row tiles of 8 gate rows, then the 8 up rows of the same columns.
  int w_tma;
  TensorMap w_map;
  // Launched in clusters of 2 (launch_gemm only, where GemmCfg::kPairSum): a plan that splits K in 2
  // sums each item's parts through distributed shared memory (pair_sum), not partials in global memory.
  int pair_cluster;
};

constexpr int kMaxSplit = 16;

// Split-K items per resident block the partials workspace holds; for a grid of G blocks, a GEMM
// with tiles M keeps split_items(G) partial tiles of kSplitFloats<M> floats and as many counters.
constexpr int kSplitItemsPerSlot = 3;
constexpr int split_items(int grid) { return kSplitItemsPerSlot * grid; }
template <typename M>
constexpr int64_t kSplitFloats = (int64_t)M::kRows * M::kToks;

// The work plan, the same in every block: m-blocks in use (read on the GPU), base items (m-block x
// n-tile), and the K split that best fills the grid: the split S minimising the rounds of work
// per block, ceil(base * S / G) / S, so that a few large items (one expert, or routing piled onto
// few experts) still spread over every SM. Item i is (base item i / S, K part i % S).
struct Plan {
  int n_mblocks, base, split, kss /* stages per part */, items;
};
// Called by every thread, with all the lanes of its wave (they weigh the splits together). kTable: the
// m-blocks are `table` (route.h), else moe_sorting's (p.num_post).
template <bool kTable>
HK_DEVICE Plan plan(const GemmParams& p, const RouteTable* table, int bm, int ks_total, int grid) {
  Plan pl;
  int nm = kTable ? table->n_mblocks : *p.num_post / bm;
  pl.n_mblocks = nm < 0 ? 0 : nm > p.max_mblocks ? p.max_mblocks : nm;
  pl.base = pl.n_mblocks * p.n_tiles;
  // Lane s - 1 weighs the split s: its rounds ceil(base * s / grid), per part as an exact multiple of
  // 1 / 720720 (720720 = lcm(1..16)), with s below it, so that the wave's least key is the least rounds / s
  // and the smallest s among equals (the choice of a loop over s). The plan is on the way to a block's first
  // copy; weighed one split after the other, each a 64-bit division, skewed DeepSeek-like 8 and 32 tokens
  // took 1.3-3.7 us longer (H100, NOTES.md, 2026-11-27 (16)).
  static_assert(kMaxSplit <= 16 && kMaxSplit <= kWaveSize, "a lane per split, 720720 divisible by each");
  const int s = lane_id() + 1;
  const int64_t work = (int64_t)pl.base * s;
  const bool ok = s == 1 || (s <= kMaxSplit && s <= ks_total && work <= p.max_split_items);
  const uint32_t w = ok ? (uint32_t)work : 0u, g = (uint32_t)grid;  // base * s < 2^31 where ok
  const uint32_t rounds = w / g + (w % g != 0);
  const uint64_t key = ok ? ((uint64_t)rounds * (720720u / (uint32_t)s) << 5 | (uint32_t)(s - 1)) : ~0ull;
  const int best = (int)(~group_max_u64(~key) & 31) + 1;
  pl.kss = (ks_total + best - 1) / best;
  pl.split = (ks_total + pl.kss - 1) / pl.kss;
  pl.items = pl.base * pl.split;
  return pl;
}

// A position in a block's stream of stages: the item, the stage within the item's K part and the
// part's first k-stage. Advanced one stage at a time, so that no stage divides (a runtime division
// is ~20 instructions: a few per stage were a large share of the small items' instruction budget).
struct Cursor {
  int item, kp, kc0;
  HK_DEVICE Cursor(const Plan& pl) : item((int)blockIdx.x), kp(0), kc0((int)blockIdx.x % pl.split * pl.kss) {}
  HK_DEVICE void advance(const Plan& pl, int grid) {
    if (++kp < pl.kss) return;
    kp = 0;
    item += grid;
    kc0 = item % pl.split * pl.kss;
  }
};

// silu by the hardware's exp2 and reciprocal (relative error ~1e-6, far inside every dtype's test
// tolerance): expf and an IEEE division, inlined four times a vector with their slow paths, made the
// split-K tail's emit ~300 cold instructions; it took 3-4 us at block_m 32, now ~1 (NOTES.md,
// 2026-11-27 (5)). For g < -88 the sum is inf and the quotient 0 (silu's limit).
HK_DEVICE float silu(float g) { return __fdividef(g, 1.f + __expf(-g)); }
HK_DEVICE float gelu(float g) { return 0.5f * g * (1.f + erff(g * 0.70710678118654752f)); }
HK_DEVICE float activate(float g, int act) { return act == kSilu ? silu(g) : gelu(g); }

template <typename T, typename M, int BM, bool Gated>
struct GemmCfg {
  static constexpr int kThreads = M::kWaves * kWaveSize;
  static constexpr int kStages = !kAsyncCopy ? 1 : M::kStages;
  // M::kCopyBars (lag-1 wgmma): each stage's copies are counted on an mbarrier of their own (every
  // thread's arrival once its copies of the stage have landed), so a stage starts as soon as its bytes
  // are in, with no barrier; the stage's one barrier comes after its products are issued and the
  // previous stage's are done, and the loader then refills that previous stage's buffer: a stage
  // further ahead than with the barrier at the top, and no copy issue waits for other copies to land.
  static constexpr bool kFullBars = kWgmma && kStages > 1 && M::kCopyBars;
  // Stages the loader runs ahead: all but the one being computed and (barrier at the top) those whose
  // products step() leaves in flight.
  static constexpr int kAhead = kStages == 1 ? 0 : kFullBars ? kStages - 1 : kStages - 1 - M::kLag;
  static_assert(kStages == 1 ? M::kLag == 0 : kAhead >= 1, "a stage in flight ahead of the math");
  static constexpr int kVec = 16 / (int)sizeof(T), kChunks = M::kBK / kVec;  // 16-byte chunks per row
  static constexpr int kWCopies = (M::kRows * kChunks + kThreads - 1) / kThreads;
  static constexpr int kXCopies = (M::kToks * kChunks + kThreads - 1) / kThreads;
  // A thread copies one chunk column (threadIdx.x % kChunks) of rows threadIdx.x / kChunks + j * kRowStep.
  static constexpr int kRowStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0, "every thread keeps its chunk column");
  static constexpr int kCols = Gated ? M::kRows / 2 : M::kRows;  // output columns per item
  // The weight stages by tensor map (GemmParams::w_map) where the build and the tile allow it.
  static constexpr bool kTmaW = kTma && M::kWeightBox && kStages > 1;
  static constexpr int kWBytes = M::kRows * M::kLd * (int)sizeof(T);  // one stage's weight tile
  // shared memory (bytes): weights | tokens | wave partials | pair of each token row, per stage | (down)
  // routing weight of each token row, per stage | flag | (kTmaW) an mbarrier per stage for the weight
  // boxes | (kFullBars) an mbarrier per stage for the copies | the math's scratch
  static constexpr int kW = kStages * M::kRows * M::kLd * (int)sizeof(T);
  static constexpr int kX = kStages * M::kToks * M::kLd * (int)sizeof(T);
  // The epilogue's passes over the item's rows (M::kEpiPasses), and the rows the partials tile holds.
  static constexpr int kPasses = M::kEpiPasses, kRedRows = M::kRows / kPasses;
  static_assert(kRedRows % 16 == 0 && kCols % kPasses == 0, "whole 16-row tiles (gate and up rows) a pass");
  static constexpr int kRed = M::kWK * kRedRows * M::kRedLd * 4;
  // The partials reuse the math's scratch where it is large enough (free between items), or the
  // buffers of one synchronous stage (no copies in flight at the epilogue); either way the epilogue
  // first waits for every wave to leave step().
  static constexpr bool kRedInScratch = kRed <= M::kScratch;
  static constexpr bool kAlias = kRedInScratch || (kStages == 1 && kRed <= kW + kX);
  static constexpr int kPairsAt = kAlias ? kW + kX : kW + kX + kRed;
  static constexpr int kTopkAt = kPairsAt + kStages * M::kToks * 4;
  static constexpr int kFlagAt = kTopkAt + (Gated ? 0 : kStages * M::kToks * 4);
  static constexpr int kBarAt = kFlagAt + 16, kFullAt = kBarAt + (kTmaW ? 8 * kStages : 0);
  static constexpr int kBarEnd = kFullAt + (kFullBars ? 8 * kStages : 0);
  static constexpr int kScratchAt = round_up(kBarEnd, 1024);  // M's own (1024-byte aligned)
  static constexpr int kRedAt = kRedInScratch ? kScratchAt : kAlias ? 0 : kW + kX;
  // Split parts summed in pairs of clustered blocks (GemmParams::pair_cluster): each writes half of a
  // pass's output columns (whole vectors of 4), or every other token row where those are split rows.
  static constexpr bool kPairSum = kClusters && (kCols / kPasses) % 8 == 0;
  static constexpr int bytes = M::kScratch ? kScratchAt + M::kScratch : kBarEnd;
  // A launch that routes in its blocks (GemmParams::route_ids) keeps its table past `bytes`, and routes
  // with the stages' memory as scratch. CDNA: only where that still fits its 64 KB.
  static constexpr int kRouteAt = round_up(bytes, 16), kRoutedBytes = kRouteAt + (int)sizeof(RouteTable);
  static constexpr bool kCanRoute = (kAsyncCopy || kRoutedBytes <= 64 * 1024) && kRoutedBytes <= 227 * 1024;
  static constexpr int kRouteWaves = route_rank_waves(kThreads / kWaveSize, kW + kX);  // route_pairs' scratch
  static_assert(kRouteWaves >= 1, "route_pairs' scratch in the stages");
  static_assert(kFlagAt % 8 == 0 && (!kTmaW || M::kLd * (int)sizeof(T) == 128), "mbarriers; 128-byte box rows");
  static_assert(!kFullBars || kRedInScratch || kRedAt >= kW + kX,
                "kFullBars: the loader fills the stages while the epilogue uses red");
  static_assert(M::kToks >= BM, "token rows");
  static_assert(kAsyncCopy || bytes <= 64 * 1024, "CDNA: fits 64 KB of LDS");
  static_assert(bytes <= 227 * 1024, "fits an sm_90 block's shared memory");
  static_assert(M::kRows % 16 == 0 && M::kLd % kVec == 0 && kW % 16 == 0 && kX % 16 == 0, "16-byte rows");
  static_assert(!M::kPreSplit || kW % 1024 == 0, "token stages (split planes) start on 1024-byte atoms");

  // body(j, r) for each of this thread's rows r = r0 + j * kRowStep (j < kCopies) of a kLimit-row tile.
  template <int kCopies, int kLimit, typename F>
  static HK_DEVICE void for_rows(int r0, const F& body) {
    constexpr bool kAll = kCopies * kRowStep == kLimit;  // every thread has kCopies rows
#pragma unroll
    for (int j = 0; j < kCopies; ++j) {
      const int r = r0 + j * kRowStep;
      if (!kAll && r >= kLimit) break;
      body(j, r);
    }
  }
};

// The m-block, n-tile, expert and (per X copy of this thread) pair of an item.
template <int kXCopies, int kChunks, int kThreads>
struct Item {
  int mb, nt, expert;
  int pair[kXCopies];
  template <bool kTable>  // the m-blocks from `table`, else from moe_sorting's outputs (p)
  HK_DEVICE void fetch(const GemmParams& p, const RouteTable* table, const Plan& pl, int item, int bm) {
    const int b = item / pl.split;
    mb = b % pl.n_mblocks;
    nt = b / pl.n_mblocks;
    expert = kTable ? table->expert[mb] : p.expert_ids[mb];
#pragma unroll
    for (int j = 0; j < kXCopies; ++j) {
      const int m = threadIdx.x / kChunks + j * (kThreads / kChunks);  // load()'s rows: r0 + j * kRowStep
      if constexpr (kTable) {
        const int q = table->lo[mb] + m;
        pair[j] = q < table->hi[mb] ? table->list[q] : p.num_pairs;
      } else {
        pair[j] = m < bm ? p.sorted_ids[(int64_t)mb * bm + m] : p.num_pairs;
      }
    }
  }
};

// Where a stage's chunk c of token row m goes: split rows' chunks into the policy's planes.
template <typename M>
HK_DEVICE int x_at(int m, int c) {
  if constexpr (M::kPreSplit)
    return M::at_split(m, c);
  else
    return M::at(m, c);
}

// What a GEMM phase waits for and announces; the standalone launches (launch_gemm) use PdlHooks,
// the one-launch decode kernel (decode.h) its own:
//   wait_input()       before the first read of what the previous kernel wrote
//   wait_item(mb)      before the first token copy of an item of m-block mb (all threads call it;
//                      it may hold a barrier)
//   item_done(mb)      after an item's outputs are written (every thread calls it)
//   kPairs             whether the launch may be in cluster pairs (GemmParams::pair_cluster): in
//                      pairs, both parts of an item call item_done, each with half its outputs
// Programmatic dependent launch (launch_dependent, sm_90; plain launches elsewhere): the gated
// GEMM's plan reads moe_sorting's outputs (or, routing in its blocks, the caller's ids, which the kernel
// before the call may write), so it waits for the kernel before it first (sorting, the split-rows pass,
// which ends only after sorting has, or the caller's). The down GEMM's plan reads them too, but
// the gated GEMM started only after they were complete (it triggers its dependents after its own
// wait), so the down GEMM routes, plans and streams its first weight stages while the gated GEMM still
// runs, and waits only before it reads the intermediate.
template <int kTrace>  // the launch's first trace point
struct PdlHooks {
  static constexpr bool kPairs = true;
  HK_DEVICE void wait_input() const {
    griddep_wait();
    griddep_launch_dependents();
    trace_point(kTrace + 1);
  }
  HK_DEVICE void wait_item(int) const {}
  HK_DEVICE void item_done(int) const {}
};

// The last part of a split item group to arrive sums the group's `split` partial tiles (parts: rows
// from the pass's first, M::kRows a token row) over the R rows of an epilogue pass into red's first
// k-group (free: its own part is published) as [token row][row], for the token rows whose pair exists,
// in part order (deterministic whichever part is last). Each thread sums kU float4s of rows a pass
// with kP parts' loads of each in flight: a handful of L2 round trips per item, where one element at a
// time had been one per element (H100, block_m 128: ~35 us per split item, and the block that was last
// fell behind on every item: NOTES.md, 2026-11-26 (2)). Loads in flight: 16 floats a thread, 32 where a
// thread has 8 float4s or more (more raised the registers of the small tiles' GEMMs).
template <typename M, int BM, int KT, int R>
HK_DEVICE void sum_parts(const float* parts, int split, const int* pairs, int num_pairs, float* red) {
  constexpr int kQ = R / 4;                      // float4s per token row
  constexpr int kPer = (kQ * BM + KT - 1) / KT;  // float4s per thread
  constexpr int kU = kPer >= 8 ? 4 : kPer >= 2 ? 2 : 1, kP = kU == 4 ? 2 : 4 / kU;
  static_assert(R % 4 == 0 && BM * R <= R * M::kRedLd, "red holds the sums");
#pragma unroll 1
  for (int q0 = threadIdx.x; q0 < kQ * BM; q0 += kU * KT) {
    bool ok[kU];
    int at[kU];  // the float4's offset in a part's tile
    float4 s[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int q = q0 + u * KT;
      ok[u] = q < kQ * BM && pairs[q / kQ] < num_pairs;
      at[u] = q / kQ * M::kRows + 4 * (q % kQ);
      s[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const float* src = parts;
#pragma unroll 1
    for (int k0 = 0; k0 < split; k0 += kP, src += kP * kSplitFloats<M>) {
      float4 v[kP][kU];
#pragma unroll
      for (int k = 0; k < kP; ++k)
#pragma unroll
        for (int u = 0; u < kU; ++u)
          v[k][u] = ok[u] && k0 + k < split ? load_coherent4(src + k * kSplitFloats<M> + at[u])
                                               : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int k = 0; k < kP; ++k)
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          s[u].x += v[k][u].x;
          s[u].y += v[k][u].y;
          s[u].z += v[k][u].z;
          s[u].w += v[k][u].w;
        }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (ok[u]) reinterpret_cast<float4*>(red)[q0 + u * KT] = s[u];
  }
}

// Where a GEMM's m-blocks come from: moe_sorting's outputs (GemmParams::sorted_ids ...), the block's own
// routing of GemmParams::route_ids into its table at C::kRouteAt, just before the plan (route.h), or a
// table the caller routed (the decode kernel).
enum Rows { kSortedRows = 0, kOwnRoute = 1, kGivenTable = 2 };

// One GEMM over the grid (both GEMMs of the op are this function): routing (kOwnRoute), plan, pipeline,
// epilogues. `given`: the table of kGivenTable.
template <typename T, typename M, int BM, bool Gated, int kRows, typename Hooks>
HK_DEVICE void gemm_phase(const GemmParams& p, unsigned char* smem_raw, const Hooks& hooks,
                          const RouteTable* given = nullptr) {
  typedef GemmCfg<T, M, BM, Gated> C;
  constexpr int S = C::kStages, A = C::kAhead, KT = C::kThreads;
  T* w_s = reinterpret_cast<T*>(smem_raw);                        // [S][kRows][kLd]
  T* x_s = reinterpret_cast<T*>(smem_raw + C::kW);                // [S][kToks][kLd]
  float* red = reinterpret_cast<float*>(smem_raw + C::kRedAt);  // [kWK][kRows][kRedLd]
  int* pair_s = reinterpret_cast<int*>(smem_raw + C::kPairsAt);  // [S][kToks]
  float* topk_s = reinterpret_cast<float*>(smem_raw + C::kTopkAt);  // down: [S][kToks]
  int* last_s = reinterpret_cast<int*>(smem_raw + C::kFlagAt);     // split: this block's part was the last
  uint64_t* bar_s = reinterpret_cast<uint64_t*>(smem_raw + C::kBarAt);  // kTmaW: [S] weight stages landed
  uint64_t* full_s = reinterpret_cast<uint64_t*>(smem_raw + C::kFullAt);  // kFullBars: [S] copies landed
  const bool tma = C::kTmaW && p.w_tma;
  if (tma || C::kFullBars) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < S; ++s) {
        if (tma) mbar_init(bar_s + s, 1);
        if (C::kFullBars) mbar_init(full_s + s, KT);
      }
      mbar_init_fence();
    }
    __syncthreads();
  }

  // The down GEMM's weights never depend on the GEMM before it: its first stages are requested
  // before waiting for it (with asynchronous copies; CDNA's single synchronous stage cannot).
  constexpr bool kEarlyWeights = !Gated && S > 1;
  if (!kEarlyWeights) hooks.wait_input();
  const int G = gridDim.x, KS = (p.K + M::kBK - 1) / M::kBK;  // k-stages of a whole item
  constexpr bool kTable = kRows != kSortedRows;
  const RouteTable* table = given;
  if constexpr (kRows == kOwnRoute) {  // the ids are the caller's: complete once the gated GEMM has waited
    static_assert(C::kCanRoute, "room for the table");
    RouteTable* t = reinterpret_cast<RouteTable*>(smem_raw + C::kRouteAt);
    route_pairs<KT, C::kRouteWaves, C::kTmaW>(p.route_ids, p.route_map, p.num_pairs, p.route_experts, BM,
                                               reinterpret_cast<int*>(smem_raw), *t);
    table = t;
  }
  const Plan pl = plan<kTable>(p, table, BM, KS, G);
  // K split in 2 in a grid of clusters of 2 (G even): blocks 2c and 2c + 1 run the two parts of the
  // same items, and sum them through each other's red.
  const bool pair_sum = C::kPairSum && Hooks::kPairs && p.pair_cluster && pl.split == 2;
  bool pair_read = false;  // the other part was let read red: wait for it before red is reused
  if ((int)blockIdx.x >= pl.items) {
    if (kEarlyWeights) hooks.wait_input();  // every block waits: this grid's end implies the previous one's
    return;
  }
  const int total = ((pl.items - 1 - (int)blockIdx.x) / G + 1) * pl.kss;  // this block's stages

  // The loader runs kAhead stages ahead; it fetches an item's metadata one item ahead too.
  typedef Item<C::kXCopies, C::kChunks, KT> It;
  It cur, nxt;
  cur.template fetch<kTable>(p, table, pl, blockIdx.x, BM);
  int cur_item = -1;
  Cursor ld(pl);  // the loader's stage
  const T* w = static_cast<const T*>(p.w);
  const T* x = static_cast<const T*>(p.x);
  // This thread's copy sources for the current item (its chunk of each row; null: the row is not
  // loaded), set once per item. An item whose weight rows all exist (a local expert, a whole n-tile)
  // copies its whole k-stages with no check at all: an address and a copy per chunk.
  const int c0 = threadIdx.x % C::kChunks, r0 = threadIdx.x / C::kChunks;
  const T* wsrc[C::kWCopies];
  const T* xsrc[C::kXCopies];
  const float* ssrc[M::kPreSplit ? C::kXCopies : 1];  // split rows: the row's block scales
  bool whole = false;  // the current item's weight rows all exist
  auto bind = [&]() {
    const bool expert_ok = (unsigned)cur.expert < (unsigned)p.num_experts;
    whole = expert_ok && (cur.nt + 1) * C::kCols <= p.N;
    const T* we = w + (expert_ok ? (int64_t)cur.expert * p.w_stride_e : 0) + c0 * C::kVec;
#pragma unroll
    for (int j = 0; j < C::kWCopies; ++j) {
      const int r = r0 + j * C::kRowStep;
      int row, col;
      if (Gated) {  // each 16-row tile: 8 gate rows, then the 8 up rows of the same columns
        col = cur.nt * C::kCols + 8 * (r / 16) + r % 8;
        row = (r % 16) / 8 * p.N + col;
      } else {
        col = cur.nt * C::kCols + r;
        row = col;
      }
      wsrc[j] = expert_ok && col < p.N && r < M::kRows ? we + (int64_t)row * p.K : nullptr;
    }
#pragma unroll
    for (int j = 0; j < C::kXCopies; ++j) {
      const int pair = cur.pair[j];
      const bool ok = (unsigned)pair < (unsigned)p.num_pairs;
      const int64_t row = pair / p.x_div;
      xsrc[j] = ok ? x + row * p.x_stride + c0 * C::kVec : nullptr;
      if constexpr (M::kPreSplit) ssrc[j] = ok ? p.x_scale + row * (p.x_stride / M::kBK) : nullptr;
    }
  };

  // Every thread: its share of stage g's weight chunks (wgt) and token chunks (tok); g: ld's stage.
  // M::kPrefetch: where the plan does not split K, the loader also asks L2 for the weights of the stage
  // after the one it copies (one 128-byte line per row and line, by the thread of its first chunk),
  // so that more DRAM requests are in flight than the stages hold. H100, bf16, D 7168, I 256, E 256,
  // top-8, block_m 16 (NOTES.md, 2026-11-26 (5)): 16 tokens -2.2 %, 8 tokens -0.4 %; on split plans
  // (routing piled onto few experts: a part or two a block) it cost 5-8 %, hence unsplit only.
  const bool prefetch = M::kPrefetch && pl.split == 1;
  auto load = [&](int g, bool wgt, bool tok) {
    const int item = ld.item, slot = g % S, kc = ld.kc0 + ld.kp;  // kc: k-stage within the whole item
    const bool part_goes_on = ld.kp + 1 < pl.kss;  // the next stage is this item's (and part's) too
    ld.advance(pl, G);
    if (item != cur_item) {
      if (cur_item >= 0) cur = nxt;
      cur_item = item;
      if (item + G < pl.items) nxt.template fetch<kTable>(p, table, pl, item + G, BM);
      bind();
      if (tok) hooks.wait_item(cur.mb);
    }
    const auto wrows = [&](auto body) { C::template for_rows<C::kWCopies, M::kRows>(r0, body); };
    const auto xrows = [&](auto body) { C::template for_rows<C::kXCopies, M::kToks>(r0, body); };
    // The stage's token rows' pairs, for the mma step and the epilogue, even for a stage past the end
    // of a short last part (split K): its item's epilogue runs on this slot. The down epilogue's
    // routing weights travel with the stage, so that no item ends on a global load. Where step()
    // does not read the pairs (M::kStepPairs), only the part's last stage, the epilogue's slot, gets
    // them (NOTES.md, 2026-11-27).
    if (tok && c0 == 0 && (M::kStepPairs || !part_goes_on)) xrows([&](int j, int m) {
      pair_s[slot * M::kToks + m] = xsrc[j] ? cur.pair[j] : p.num_pairs;
      if (!Gated && xsrc[j]) async_copy4(topk_s + slot * M::kToks + m, p.topk_weights + cur.pair[j]);
    });
    if (kc >= KS) return;  // past the end of the last part: nothing to load (or compute)
    const int k0 = kc * M::kBK;
    T* ws = w_s + slot * M::kRows * M::kLd;  // + M::at(row, c0)
    T* xs = x_s + slot * M::kToks * M::kLd;
    if (tma) {  // the weight tile as one box; the threads copy the token rows
      if (wgt && threadIdx.x == 0) {
        mbar_expect(bar_s + slot, C::kWBytes);
        if constexpr (Gated)
          tma_load_5d(ws, &p.w_map, k0, 0, 0, cur.nt * (C::kCols / 8), cur.expert, bar_s + slot);
        else
          tma_load_3d(ws, &p.w_map, k0, cur.nt * C::kCols, cur.expert, bar_s + slot);
      }
      wgt = false;
    }
    if (whole && k0 + M::kBK <= p.K) {
      if (wgt) wrows([&](int j, int r) { async_copy16(ws + M::at(r, c0), wsrc[j] + k0); });
      if (prefetch && wgt && part_goes_on && k0 + 2 * M::kBK <= p.K && c0 % (128 / 16) == 0)
        wrows([&](int j, int) { prefetch_l2<128>(wsrc[j] + k0 + M::kBK); });
      if (tok) xrows([&](int j, int m) {
        if (xsrc[j]) async_copy16(xs + x_at<M>(m, c0), xsrc[j] + k0);
      });
    } else {  // rows past N or an invalid expert (zeros: they contribute 0), columns past K (zeros;
              // split rows have them: whole 64-column blocks)
      const bool k_ok = k0 + c0 * C::kVec < p.K, xk_ok = M::kPreSplit || k_ok;
      if (wgt) wrows([&](int j, int r) {
        const bool ok = wsrc[j] != nullptr && k_ok;
        async_copy16_or_zero(ws + M::at(r, c0), ok ? wsrc[j] + k0 : w, ok);
      });
      if (tok) xrows([&](int j, int m) {
        if (xsrc[j])  // padding rows are left as they are: only their own (never stored) columns see them
          async_copy16_or_zero(xs + x_at<M>(m, c0), xk_ok ? xsrc[j] + k0 : x, xk_ok);
      });
    }
    if constexpr (M::kPreSplit)
      if (tok && c0 == 0) xrows([&](int j, int m) {
        if (xsrc[j]) async_copy4(xs + M::at_scale(m), ssrc[j] + kc);
      });
  };

  // The prologue loops stay loops: each inlined load() is a few hundred instructions, and cold code
  // (run once per block) costs instruction-fetch stalls.
  if constexpr (kEarlyWeights) {
#pragma unroll 1
    for (int s = 0; s < A; ++s)
      if (s < total) load(s, true, false);
    // Rewind the loader; the weights join the first group committed below.
    cur.template fetch<kTable>(p, table, pl, blockIdx.x, BM);
    cur_item = -1;
    ld = Cursor(pl);
    hooks.wait_input();
  }
  // A stage's copies are issued: kFullBars counts them on the stage's mbarrier, else they form a group.
  auto issued = [&](int g) {
    if constexpr (C::kFullBars)
      mbar_arrive_copies(full_s + g % S);
    else
      async_copy_commit();
  };
#pragma unroll 1
  for (int s = 0; s < A; ++s) {
    if (s < total) load(s, !kEarlyWeights, true);
    if (!C::kFullBars || s < total) issued(s);
  }
  typename M::Acc acc;
  M::zero(acc);  // and again after each item's partials are stored
  uint32_t phase = 0;  // tma: bit s, the parity of slot s's next weight box
  uint32_t full_phase = 0;  // kFullBars: bit s, the parity of slot s's next stage
  // Stage g's top: its copies (and weight box) have landed; without kFullBars, every wave is also done
  // with the buffer the loader refills next, which then requests stage g + A. Returns g's slot.
  auto begin_stage = [&](int g, bool computes) {
    const int slot = g % S;
    if (tma && computes) {  // every stage that computes had its weight box issued
      mbar_wait(bar_s + slot, phase >> slot & 1);
      phase ^= 1u << slot;
    }
    if constexpr (C::kFullBars) {
      mbar_wait(full_s + slot, full_phase >> slot & 1);
      full_phase ^= 1u << slot;
      fence_async_shared();  // the tensor cores read the stage through the async proxy
      return slot;
    }
    if constexpr (S == 1) {
      __syncthreads();  // every wave is done with the previous stage
      load(g, true, true);
    } else {
      async_copy_wait_pending<A - 1>();
      if constexpr (M::kAsyncReads) fence_async_shared();  // the math reads the stage through the async proxy
    }
    __syncthreads();  // stage g is in shared memory; stage g - 1 - kLag's buffer is free
    if constexpr (S > 1) {
      if (g + A < total) load(g + A, true, true);
      issued(g + A);
    }
    return slot;
  };
  // kFullBars, after stage g's step: every wave is done with stage g - 1 (step() waited for its own
  // products of it), whose buffer the loader refills with stage g + A.
  auto end_stage = [&](int g) {
    if constexpr (C::kFullBars) {
      __syncthreads();
      if (g + A < total) {
        load(g + A, true, true);
        issued(g + A);
      }
    }
  };
  // An item (one K part) is kss stages, of which those past K (the end of a short last part) only
  // keep the stream regular. The math's stages form a loop of their own, drained after it: the
  // tensor cores' accumulators are then never touched while a product may still be writing them.
  int g = 0;
  for (int item = blockIdx.x; item < pl.items; item += G) {
    const int kc0 = item % pl.split * pl.kss, computes = min(pl.kss, KS - kc0);
    int slot = 0;
    for (int kp = 0; kp < computes; ++kp, ++g) {
      slot = begin_stage(g, true);
      M::step(acc, w_s + slot * M::kRows * M::kLd, x_s + slot * M::kToks * M::kLd, pair_s + slot * M::kToks,
              p.num_pairs, smem_raw + C::kScratchAt);
      end_stage(g);
    }
    M::drain(acc);
    for (int kp = computes; kp < pl.kss; ++kp, ++g) {
      slot = begin_stage(g, false);
      end_stage(g);
    }
    const int* pairs = pair_s + slot * M::kToks;  // the item's last stage's
    const float* topk = topk_s + slot * M::kToks;

    // Epilogue, in C::kPasses passes over the item's rows (red holds C::kRedRows of them at a time):
    // the waves' partials meet in shared memory (free again two barriers later).
    constexpr int R = C::kRedRows, CP = C::kCols / C::kPasses;  // rows / output columns a pass
    constexpr int kV = 4;  // adjacent output columns a thread writes at once
    const int b = item / pl.split, nt = b / pl.n_mblocks;
    // value(row of pass h, token): the item's finished sums. Part `part` of `parts` (an
    // std::integral_constant, so that no index divides at run time) writes its share: a range of the
    // pass's columns, or every parts-th token row where the columns are one block of split rows.
    auto emit = [&](int h, auto value, int part, auto parts) {
      constexpr int P = decltype(parts)::value, NV = CP / kV / P;  // vectors of columns a part
      if constexpr (Gated && M::kPreSplit) {  // the item's columns are one block of split rows
        static_assert(C::kCols == M::kBK && C::kCols == 2 * kWaveSize, "a warp per token row, 2 columns a lane");
        static_assert(C::kPasses == 1, "one pass");
        for (int m = part + P * (threadIdx.x / kWaveSize); m < BM; m += P * (KT / kWaveSize)) {
          const int pair = pairs[m];
          if (pair >= p.num_pairs) continue;
          float gate[2], up[2], v[2];  // every sum read before any is used (see below)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int c = 2 * lane_id() + i, r = 16 * (c / 8) + c % 8;
            gate[i] = value(r, m);
            up[i] = value(r + 8, m);
          }
#pragma unroll
          for (int i = 0; i < 2; ++i)
            v[i] = nt * C::kCols + 2 * lane_id() + i < p.N ? activate(gate[i], p.activation) * up[i] : 0.f;
          split_block_store(v[0], v[1], static_cast<uint32_t*>(p.out) + (int64_t)pair * p.out_stride + nt * C::kCols,
                            p.out_scale + (int64_t)pair * (p.out_stride / C::kCols) + nt);
        }
        return;
      }
      // kV adjacent columns a thread, one store: scalar stores queue behind the next item's copies, a
      // request each (H100: ~5 us an item at block_m 64, NOTES.md 2026-11-26 (2)). p.N and p.out_stride
      // are multiples of kV (hk_fused_moe takes D and I in 16-byte multiples), so every vector is whole
      // and aligned.
      typedef std::conditional_t<Gated, T, float> O;
      struct alignas(kV * sizeof(O)) Vec { O e[kV]; };
      static_assert(CP % kV == 0 && 8 % kV == 0, "whole vectors a pass, inside a gate row group");
#pragma unroll 1  // unrolled, the loop raised the GEMMs' registers by up to 18 (sm_90a)
      for (int q = threadIdx.x; q < NV * BM; q += KT) {
        const int c0 = h * CP + kV * (part * NV + q % NV), m = q / NV, pair = pairs[m], col = nt * C::kCols + c0;
        if (pair >= p.num_pairs || col >= p.N) continue;
        // Every sum the vector needs is read first, then used. Read one at a time between the
        // activation's branches, each was a shared (in cluster pairs, distributed shared) memory round
        // trip of its own: a pass of block_m 128 took 2.5-4 us, ~1 us more (NOTES.md, 2026-11-27 (4)).
        float a[kV], u[kV];  // the row's sums; gated: the gate rows', and the up rows'
#pragma unroll
        for (int i = 0; i < kV; ++i) {
          const int c = c0 + i, r = (Gated ? 16 * (c / 8) + c % 8 : c) - h * R;
          a[i] = value(r, m);
          if constexpr (Gated) u[i] = value(r + 8, m);
        }
        Vec o;
        if constexpr (Gated) {  // the activation chosen once a vector: each path one run of code
          if (p.activation == kSilu) {
#pragma unroll
            for (int i = 0; i < kV; ++i) o.e[i] = from_float<T>(silu(a[i]) * u[i]);
          } else {
#pragma unroll
            for (int i = 0; i < kV; ++i) o.e[i] = from_float<T>(gelu(a[i]) * u[i]);
          }
        } else {
#pragma unroll
          for (int i = 0; i < kV; ++i) o.e[i] = topk[m] * a[i];
        }
        *reinterpret_cast<Vec*>(static_cast<O*>(p.out) + (int64_t)pair * p.out_stride + col) = o;
      }
    };
    auto wave_sum = [&](int r, int m) {
      float v = 0.f;
#pragma unroll
      for (int k = 0; k < M::kWK; ++k) v += red[(k * R + r) * M::kRedLd + m];
      return v;
    };
    // Split: each pass publishes this part's sums (the token rows that exist: no other is read); the
    // last part of the group to arrive adds all parts in part order (deterministic whichever arrives
    // last) and writes the outputs. In pairs (pair_sum), each part writes half the outputs instead.
    float* part = p.partials + item * kSplitFloats<M>;
    for (int h = 0; h < C::kPasses; ++h) {
      if (C::kAlias || h > 0) __syncthreads();  // every wave is done with what red reuses / the last pass's rows
      if (pair_read) cluster_wait();  // the other part has read red
      pair_read = false;
      if constexpr (C::kPasses == 1)
        M::store(acc, red);
      else
        M::store(acc, red, h);
      __syncthreads();
      if (pl.split == 1) {
        emit(h, wave_sum, 0, std::integral_constant<int, 1>());
        continue;
      }
      if (pair_sum) {  // both parts' red complete; this part writes its half of the columns
        cluster_sync();
        const int k = (int)blockIdx.x & 1;  // the part, and the cluster rank
        const uint32_t other = cluster_map(red, k ^ 1);
        emit(h, [&](int r, int m) {
          float v = 0.f;
#pragma unroll
          for (int j = 0; j < M::kWK; ++j) v += cluster_load(other + 4u * (uint32_t)((j * R + r) * M::kRedLd + m));
          return wave_sum(r, m) + v;  // a + b == b + a: the same sums in either part
        }, k, std::integral_constant<int, 2>());
        cluster_arrive_relaxed();  // relaxed: every value read from the other's red is already stored
        if constexpr (C::kAlias)
          cluster_wait();  // red is the math's scratch, which the next item's steps write
        else
          pair_read = true;
        continue;
      }
      for (int q = threadIdx.x; q < R / 4 * BM; q += KT) {  // a float4 of rows a store: 4x fewer requests
        const int r = 4 * (q % (R / 4)), m = q / (R / 4);
        if (pairs[m] < p.num_pairs)
          *reinterpret_cast<float4*>(part + m * M::kRows + h * R + r) =
              make_float4(wave_sum(r, m), wave_sum(r + 1, m), wave_sum(r + 2, m), wave_sum(r + 3, m));
      }
    }
    M::zero(acc);
    if (pl.split == 1 || pair_sum) {
      hooks.item_done(b % pl.n_mblocks);
      continue;
    }
    if (!block_arrive_last(p.counters + b, pl.split, last_s)) continue;  // not the group's last part
    for (int h = 0; h < C::kPasses; ++h) {
      if (h > 0) __syncthreads();  // the previous pass's outputs are written
      sum_parts<M, BM, KT, R>(p.partials + (int64_t)b * pl.split * kSplitFloats<M> + h * R, pl.split, pairs,
                              p.num_pairs, red);
      __syncthreads();
      emit(h, [&](int r, int m) { return red[m * R + r]; }, 0, std::integral_constant<int, 1>());
    }
    if (threadIdx.x == 0) p.counters[b] = 0;  // ready for the next call
    hooks.item_done(b % pl.n_mblocks);
  }
  if (pair_read) cluster_wait();  // no block leaves while the other still reads its red
  async_copy_wait();
}

// kRows: kSortedRows, or kOwnRoute (GemmParams::route_ids; launched with C::kRoutedBytes).
template <typename T, typename M, int BM, bool Gated, int kRows>
__global__ HK_LAUNCH_BOUNDS(M::kWaves * kWaveSize, 1) void gemm_kernel(const HK_GRID_CONSTANT GemmParams p) {
  extern __shared__ __align__(kWgmma ? 1024 : 16) unsigned char smem_raw[];  // wgmma atoms
  constexpr int kTrace = Gated ? 0 : 3;
  trace_point(kTrace);
  gemm_phase<T, M, BM, Gated, kRows>(p, smem_raw, PdlHooks<kTrace>());
  trace_point(kTrace + 2);
}

}  // namespace fused_moe
}  // namespace hk
