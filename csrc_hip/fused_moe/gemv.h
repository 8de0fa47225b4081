// The gemv variant of fused MoE: a few routed pairs (T * k <= kGemvPairs) as matrix-vector
// products on CUDA cores / vector ALUs, with no routing table, no padding rows and no shared-memory
// staging.
//
// At one or two tokens per expert every weight element is used once or twice, so the op is two
// streams of weights. Here each weight byte is read by one 16-byte load straight into registers, a
// thread issues all of its loads of a batch before it uses the first, and the blocks are short, so
// the hardware's block scheduler balances them over the SMs (the other variants hand out fixed items
// to resident blocks, and their slowest block sets the phase's end). Two launches:
//   gemv_gated_kernel  a block per (row i of I, pair p):
//                      inter[p][i] = act(w1[e][i] . x_t) * (w1[e][I + i] . x_t), rounded to T
//   gemv_down_kernel   a wave per (token t, output column d):
//                      out[t][d] = sum over t's kept slots j of w[t][j] * (w2[e_j][d] . inter[t k + j])
// The down kernel sums the slots in registers in a fixed order (the combine, deterministic). It is
// a programmatic dependent launch (sm_90): its blocks start while the gated kernel's last blocks run,
// request their first weights (which depend on the routing only) and only then wait for the gated
// kernel (griddep_wait) before they read inter.
//
// Pairs that share an expert read its rows once each: the blocks doing so run side by side (pair
// fastest in the grid), so the second read mostly hits L2. Dropped pairs (moe_local_expert) cost a
// block that exits at once and nothing in the down sum.
// Variant "gemv_mma" (16-bit types) runs both phases on matrix cores with the pairs of one expert
// together, so an expert's rows are streamed once however many pairs it serves: gemv_gated_mma_kernel
// and gemv_down_mma_kernel (below).
#pragma once

#include "gemm.h"  // activate()
#include "hipkern/mma.h"
#include "hipkern/moe.h"
#include "hipkern/reduce.h"
#include "hipkern/vec.h"

namespace hk {
namespace fused_moe {

constexpr int kGemvPairs = 32;  // the domain (pairs T * k); the down kernel keeps a slot per lane

struct GemvArgs {
  const void* x;      // [T][D]
  const void* w1;     // [E_local][2I][D]
  const void* w2;     // [E_local][D][I]
  const float* topk_weights;
  const int32_t* ids;  // [T][k], global expert ids
  const int32_t* expert_map;
  void* inter;  // [T k][I] (T)
  void* out;    // [T][D]
  int num_tokens, topk, num_experts, num_local_experts, dim, inter_dim, activation;  // experts: ids', w1's
  uint32_t inv_pairs;  // ceil(2^32 / (num_tokens * topk)) for two pairs or more, set by launch_gemv
};

// Launch shapes, measured on the H100 (NOTES.md, "The gemv variant" and 2026-11-27 (8)): the gated
// kernel's 256 threads a block with 4 chunks of each row in flight a thread (DeepSeek-like D = 7168: one
// pass); the down kernel's 4 loads a lane, which keeps more of its waves resident, so more of them
// request their weights before the gated kernel ends, than 8 loads. For 16-bit types the gated kernel's
// registers are bounded for 4 blocks an SM (<= 64), with no spills: skewed 4 tokens 11 % and 2 tokens
// 5 % faster, the uniform shapes level; float32 keeps 1 (80 registers), which it ran 1.5-3 % faster.
// The down kernel is bounded for 4 blocks (<= 64): its batch's four intermediate loads in flight at once
// need them (at 5 blocks, <= 48, they spilled; 2026-11-27 (9)). HIP ignores the bounds (HK_LAUNCH_BOUNDS).
template <typename T>
struct GemvCfg {
  static constexpr int kVec = 16 / (int)sizeof(T);  // elements per 16-byte load
  static constexpr int kGatedThreads = 256;
  static constexpr int kGatedLoads = 4;  // 16-byte chunks of each of the two rows a thread has in flight
  static constexpr int kGatedMinBlocks = sizeof(T) == 2 ? 4 : 1;
  static constexpr int kDownThreads = 256;
  static constexpr int kDownLoads = 4;  // (slot, chunk) loads a lane has in flight
  static constexpr int kDownMinBlocks = 4;
};

// The pair's local expert, or -1 when the pair is dropped: its id outside [0, num_experts), remote, or
// mapped past w1's experts (a map value only validate=True rejects: the grouped GEMMs read zeros there,
// and these kernels must not read past w1 / w2 either).
HK_DEVICE int gemv_local_expert(const GemvArgs& a, int pair) {
  return moe_local_expert(a.ids[pair], a.num_experts, a.expert_map, a.num_local_experts);
}

// The gated kernels' block b = i * pairs + p (pair fastest): row i of I and pair p. b / pairs as a
// multiply-high by inv_pairs = ceil(2^32 / pairs) (exact for b < 2^27 and 2 <= pairs <= 32: the
// launcher's bounds), ~20 instructions less than a division; one pair (inv_pairs would be 2^32) is b
// itself.
struct GemvRowPair {
  int i, p;
};
HK_DEVICE GemvRowPair gemv_row_pair(const GemvArgs& a) {
  const int num_pairs = a.num_tokens * a.topk;
  const int i = num_pairs == 1 ? (int)blockIdx.x : (int)__umulhi(blockIdx.x, a.inv_pairs);
  return {i, (int)blockIdx.x - i * num_pairs};
}

// Row i of pair p (on local expert le) on CUDA cores / vector ALUs, by a whole block of kGatedThreads:
// gemv_gated_kernel's block, and gemv_gated_mma_kernel's for a pair alone on its expert.
template <typename T>
HK_DEVICE void gemv_gated_row(const GemvArgs& a, int i, int p, int le) {
  typedef GemvCfg<T> C;
  constexpr int kThreads = C::kGatedThreads, kLoads = C::kGatedLoads, kVec = C::kVec;
  constexpr int kWaves = kThreads / kWaveSize;
  __shared__ float part[kWaves][2];
  const int D = a.dim, nch = D / kVec;
  const T* gate = static_cast<const T*>(a.w1) + ((int64_t)le * 2 * a.inter_dim + i) * D;
  const T* up = gate + (int64_t)a.inter_dim * D;
  const T* x = static_cast<const T*>(a.x) + (int64_t)(p / a.topk) * D;
  float g = 0.f, u = 0.f;
  for (int c0 = threadIdx.x; c0 < nch; c0 += kThreads * kLoads) {
    uint4 wg[kLoads], wu[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int c = c0 + j * kThreads;
      if (c < nch) {
        wg[j] = load_once16(gate + c * kVec);
        wu[j] = load_once16(up + c * kVec);
      }
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int c = c0 + j * kThreads;
      if (c < nch) {
        float xv[kVec], gv[kVec], uv[kVec];
        load_as_float<T, kVec>(x + c * kVec, xv);  // the token row: L1 hits after the first block
        raw_as_float<T, kVec>(wg[j], gv);
        raw_as_float<T, kVec>(wu[j], uv);
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
          g = fmaf(gv[v], xv[v], g);
          u = fmaf(uv[v], xv[v], u);
        }
      }
    }
  }
  g = group_sum(g);
  u = group_sum(u);
  const int wave = threadIdx.x / kWaveSize;
  if (lane_id() == 0) {
    part[wave][0] = g;
    part[wave][1] = u;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int w = 0; w < kWaves; ++w) {
      gs += part[w][0];
      us += part[w][1];
    }
    static_cast<T*>(a.inter)[(int64_t)p * a.inter_dim + i] = from_float<T>(activate(gs, a.activation) * us);
  }
}

template <typename T>
__global__ HK_LAUNCH_BOUNDS(GemvCfg<T>::kGatedThreads, GemvCfg<T>::kGatedMinBlocks) void gemv_gated_kernel(GemvArgs a) {
  griddep_launch_dependents();  // the down kernel may launch once every gated block has started
  const GemvRowPair rp = gemv_row_pair(a);
  const int le = gemv_local_expert(a, rp.p);
  if (le < 0) return;  // the whole block: no barrier is reached
  gemv_gated_row<T>(a, rp.i, rp.p, le);
}

// Variant "gemv_mma" (16-bit types): the gated products on matrix cores. The grid is
// gemv_gated_kernel's (a block per (row i, pair p), pair fastest), but the block of the first pair
// routed to an expert computes every pair on that expert (kTileTokens at a pass) and the other pairs'
// blocks exit; a pair alone on its expert runs gemv_gated_kernel's row instead. So under skewed
// routing an expert's rows are streamed once and an extra pair costs a few matrix instructions, not a
// token row's conversions and FMAs on CUDA cores (what bounds gemv there: NOTES.md, 2026-11-27 (8)).
// H100 (NOTES.md, 2026-11-27 (10), (12) and (13)), with gemv_down_mma_kernel after it: skewed DeepSeek-like
// 4 tokens 64 -> 40 us against gemv; under uniform routing slower (DeepSeek-like 1-4 tokens by 2-4 us,
// Mixtral 8x7B 1 token by 3 %), so the tuner chooses per shape.
// One product covers the block's two rows (gate i, up i) against kTileTokens pairs: the reduction is
// cut into S = N / 2 segments, B's column n is (row n / S, segment n % S) and A's row m (pair m / S,
// segment m % S). MmaTile's direct layout gives each lane operands of a single segment, so the entries
// of C with equal segments, C[(t, s)][(r, s)] summed over s and over the block's waves, are row r's
// product with pair t (the other entries mix segments and are dropped). Segment s is runs s, s + S,
// s + 2S, ... of a row (a run: kDirectK reduction indices), so a wave's load covers S adjacent runs of
// each row; contiguous quarter rows as segments left the kernel 20 % slower. A lane's weights are
// 16-byte loads, a batch requested before the first is used: the first batch before the block's barrier
// (it needs the expert only), each next one as soon as the last is used. The token chunks are L1 hits
// after the first block.
template <typename T>
struct GemvMmaCfg {
  static_assert(GemvCfg<T>::kGatedThreads == 256, "a lone pair's block runs gemv_gated_row");
  typedef MmaTile<T> MT;
  static constexpr int kThreads = 256, kWaves = kThreads / kWaveSize;
  static_assert(kThreads == GemvCfg<T>::kGatedThreads, "launch_gemv's grid check counts gemv's gated blocks");
  static constexpr int kSegs = MT::N / 2;             // S: 4 on NVIDIA, 8 on CDNA
  static constexpr int kTileTokens = MT::M / kSegs;   // pairs a product covers: 4 on NVIDIA, 2 on CDNA
  // Runs of a lane's weights in flight: D = 7168 is one batch (8 waves x 7 runs of 128 on NVIDIA, 4 x 7 of
  // 256 on CDNA). 7, not 8, is what fits bf16 in 64 registers without spills, so 4 blocks an SM: at 3
  // (80 registers) skewed DeepSeek-like 4 tokens took 1.9 us longer (H100, NOTES.md, 2026-11-27 (13)).
  // fp16 still spills 68 bytes at 64 registers, so it keeps 3 blocks.
  static constexpr int kLoads = 7;
  static constexpr int kMinBlocks = std::is_same<T, half_t>::value ? 3 : 4;
};

template <typename T>
__global__ HK_LAUNCH_BOUNDS(GemvMmaCfg<T>::kThreads, GemvMmaCfg<T>::kMinBlocks) void gemv_gated_mma_kernel(GemvArgs a) {
  typedef GemvMmaCfg<T> C;
  typedef typename C::MT MT;
  constexpr int S = C::kSegs, TT = C::kTileTokens, kRun = MT::kDirectK, kR = MT::kDirectRows;
  constexpr int kLoads = C::kLoads, kWaves = C::kWaves;
  __shared__ int pair_s[kGemvPairs];              // the group's pairs, in pair order
  __shared__ float tile_s[kWaves][MT::M][MT::N];  // each wave's product of a pass
  griddep_launch_dependents();  // the down kernel may launch once every gated block has started
  const GemvRowPair rp = gemv_row_pair(a);
  const int i = rp.i, p = rp.p, num_pairs = a.num_tokens * a.topk;
  const int lane = lane_id();
  const int lane_e = lane < num_pairs ? gemv_local_expert(a, lane) : -1;  // pairs <= kGemvPairs <= a wave
  const int le = shfl(lane_e, p);
  const lanemask_t group = ballot(lane_e == le);  // the pairs on p's expert (le < 0: the block exits)
  if (le < 0 || (group & (((lanemask_t)1 << p) - 1)) != 0) return;  // the whole block: no barrier is reached
  const int np = popc(group);
  if (np == 1) {  // alone on its expert: nothing to share, so gemv's CUDA-core row (faster there)
    gemv_gated_row<T>(a, i, p, le);
    return;
  }
  if (threadIdx.x < kWaveSize && lane_e == le) pair_s[popc(group & lanemask_lt())] = lane;

  const int D = a.dim, I = a.inter_dim;
  const int runs = (D + S * kRun - 1) / (S * kRun);  // a segment's runs
  const int wave = threadIdx.x / kWaveSize, col = MT::direct_col();
  const T* w = static_cast<const T*>(a.w1) + ((int64_t)le * 2 * I + (int64_t)(col / S) * I + i) * D;
  const int k_lane = col % S * kRun + MT::direct_k();  // + run * S * kRun: a 16-byte chunk, whole or past D
  const T* x = static_cast<const T*>(a.x);
  uint4 wv[kLoads];
  auto load_weights = [&](int u0) {
#pragma unroll
    for (int b = 0; b < kLoads; ++b) {
      const int k = k_lane + (u0 + b * kWaves) * S * kRun;
      wv[b] = u0 + b * kWaves < runs && k < D ? load_once16(w + k) : make_uint4(0, 0, 0, 0);
    }
  };
  load_weights(wave);  // the first batch depends on the expert only: requested before the barrier
  __syncthreads();     // pair_s
  for (int pass = 0; pass < np; pass += TT) {
    int tok[kR];  // the token of each A row's pair (-1: none)
#pragma unroll
    for (int j = 0; j < kR; ++j) {
      const int slot = pass + MT::direct_row(j) / S;
      tok[j] = slot < np ? pair_s[slot] / a.topk : -1;
    }
    typename MT::C c;
#pragma unroll
    for (int e = 0; e < MT::kC; ++e) c[e] = 0.f;
    for (int u0 = wave; u0 < runs; u0 += kWaves * kLoads) {
#pragma unroll
      for (int b = 0; b < kLoads; ++b) {
        if (u0 + b * kWaves >= runs) break;  // uniform over the wave: mma is a wave's instruction
        const int k = k_lane + (u0 + b * kWaves) * S * kRun;
        uint4 xv[kR];
#pragma unroll
        for (int j = 0; j < kR; ++j)
          xv[j] = k < D && tok[j] >= 0 ? *reinterpret_cast<const uint4*>(x + (int64_t)tok[j] * D + k)
                                       : make_uint4(0, 0, 0, 0);
        mma_direct_run<MT>(c, xv, wv[b]);
      }
      // The next batch, this pass's or the next pass's first, requested once this one is used.
      if (u0 + kWaves * kLoads < runs) {
        load_weights(u0 + kWaves * kLoads);
      } else if (pass + TT < np) {
        load_weights(wave);
      }
    }
#pragma unroll
    for (int e = 0; e < MT::kC; ++e) tile_s[wave][MT::c_row(e)][MT::c_col(e)] = c[e];
    __syncthreads();
    if (wave < min(np - pass, TT)) {  // wave v sums pair pass + v over the waves and segments (fixed order)
      float g = 0.f, u = 0.f;
      for (int e = lane; e < kWaves * S; e += kWaveSize) {
        const int v = e / S, s = e % S;
        g += tile_s[v][wave * S + s][s];
        u += tile_s[v][wave * S + s][S + s];
      }
      g = group_sum(g);
      u = group_sum(u);
      if (lane == 0)
        static_cast<T*>(a.inter)[(int64_t)pair_s[pass + wave] * I + i] = from_float<T>(activate(g, a.activation) * u);
    }
    if (pass + TT < np) __syncthreads();  // tile_s is rewritten
  }
}

template <typename T>
__global__ HK_LAUNCH_BOUNDS(GemvCfg<T>::kDownThreads, GemvCfg<T>::kDownMinBlocks) void gemv_down_kernel(GemvArgs a) {
  typedef GemvCfg<T> C;
  constexpr int kLoads = C::kDownLoads, kVec = C::kVec, kWaves = C::kDownThreads / kWaveSize;
  const int64_t unit = (int64_t)blockIdx.x * kWaves + threadIdx.x / kWaveSize;  // one per wave
  if (unit >= (int64_t)a.num_tokens * a.dim) return;  // the whole wave
  const int t = (int)(unit % a.num_tokens), d = (int)(unit / a.num_tokens);  // tokens fastest: shared rows
  const int lane = lane_id(), k = a.topk, I = a.inter_dim, nch = I / kVec;
  // Lane j < k holds slot j's weight and where its w2 row d starts (elements; -1: dropped), so an
  // item's address is a shuffle and an add.
  int64_t slot_row = -1;
  float slot_w = 0.f;
  if (lane < k) {
    const int e = gemv_local_expert(a, t * k + lane);
    if (e >= 0) {
      slot_row = ((int64_t)e * a.dim + d) * I;
      slot_w = a.topk_weights[(int64_t)t * k + lane];
    }
  }
  const T* w2 = static_cast<const T*>(a.w2);
  const T* inter = static_cast<const T*>(a.inter) + (int64_t)t * k * I;
  // A lane's items: (slot j, chunk lane + q * wave) for q < ceil(nch / wave), slot fastest.
  const int n = k * ((nch + kWaveSize - 1) / kWaveSize);
  float acc = 0.f;
  int j0 = 0, q0 = 0;
  for (int f0 = 0; f0 < n; f0 += kLoads) {
    uint4 wv[kLoads];
    int js[kLoads], cs[kLoads];
    bool ok[kLoads];
    int j = j0, q = q0;
#pragma unroll
    for (int s = 0; s < kLoads; ++s) {
      const int64_t row = shfl(slot_row, j);
      const int c = lane + q * kWaveSize;
      ok[s] = f0 + s < n && row >= 0 && c < nch;
      js[s] = j;
      cs[s] = c;
      if (ok[s]) wv[s] = load_once16(w2 + row + c * kVec);
      if (++j == k) {
        j = 0;
        ++q;
      }
    }
    j0 = j;
    q0 = q;
    if (f0 == 0) griddep_wait();  // inter is the gated kernel's output
    // The batch's intermediate chunks (L2 hits) requested together before the first is used: one L2
    // round trip a batch. Loaded item by item, the compiler issued each load after the previous item's
    // products, four round trips in series (1 token: down kernel 15.7 -> 14.4 us).
    uint4 iraw[kLoads];
#pragma unroll
    for (int s = 0; s < kLoads; ++s)
      if (ok[s]) iraw[s] = *reinterpret_cast<const uint4*>(inter + (js[s] * I + cs[s] * kVec));  // < T k I < 2^31
#pragma unroll
    for (int s = 0; s < kLoads; ++s) {
      const float w = shfl(slot_w, js[s]);
      if (ok[s]) {
        float iv[kVec], wf[kVec];
        raw_as_float<T, kVec>(iraw[s], iv);
        raw_as_float<T, kVec>(wv[s], wf);
        float dot = 0.f;
#pragma unroll
        for (int v = 0; v < kVec; ++v) dot = fmaf(wf[v], iv[v], dot);
        acc = fmaf(w, dot, acc);
      }
    }
  }
  acc = group_sum(acc);
  if (lane == 0) static_cast<T*>(a.out)[(int64_t)t * a.dim + d] = from_float<T>(acc);
}

// The down products on matrix cores (16-bit types): gemv_down_mma_kernel. A block computes kCols
// output columns d for every token: each pass is one expert's w2 rows d0 .. d0 + kCols - 1 (B, straight
// from 16-byte loads in MmaTile's direct layout) against up to kPass of that expert's pairs (A: their
// intermediate rows, L2 hits), so an expert's rows are read once however many pairs it serves, and a
// pass of one pair costs the same loads as gemv_down_kernel's wave. When there are fewer passes than
// waves, each pass is cut into `slices` interleaved sets of runs along I, so every wave streams.
// Each (pair, column) product lands in shared memory (a pass's slices summed there in slice order);
// the block then sums each token's kept slots in slot order (the combine, deterministic).
template <typename T>
struct GemvDownMmaCfg {
  typedef MmaTile<T> MT;
  static constexpr int kThreads = 256, kWaves = kThreads / kWaveSize;
  static constexpr int kCols = MT::N;  // output columns a block computes: w2 rows as B's columns
  // A's rows a lane loads: on NVIDIA only the first of its two (rows 0-7), so a pass covers 8 pairs and
  // the other row's operands are constant zeros (no registers; 16 rows cost 8 bytes of spills).
  static constexpr int kARows = MT::kDirectRows == 2 ? 1 : MT::kDirectRows;
  static constexpr int kPass = MT::M / MT::kDirectRows * kARows;  // pairs a pass covers
  // Runs of a lane's w2 row in flight, and the register bound: 4 runs at 4 blocks an SM (64 registers,
  // no spills); 8 runs at 2 blocks (108 registers) was 4 us slower at skewed 4 tokens and 2.5 us at one
  // token (H100, NOTES.md, 2026-11-27 (12)). Skewed DeepSeek-like 4 tokens: 29.6 -> 16.1 us of kernel
  // against gemv_down_kernel.
  static constexpr int kLoads = 4;
  static constexpr int kMinBlocks = 4;
};

// The passes of gemv_down_mma_kernel, built by one wave in parallel over its lanes (lane p: pair p's
// local expert pe, -1 when p is dropped or not a pair): the pairs on one expert in pair order, kPass at
// a time, the experts in the order of their first pairs. Pass s's expert goes to pass_e[s] and its r-th
// pair to pass_p[s][r] (-1 past the pass's pairs). A lane finds the lanes on its expert (match_any) and
// its rank among them; a group's first lane counts its passes, and their prefix over the lanes places
// each group. Returns the number of passes (<= kGemvPairs).
template <int kPass>
HK_DEVICE int gemv_down_passes(int pe, int* pass_e, int8_t (*pass_p)[kPass]) {
  const int lane = lane_id();
  const uint32_t key = (uint32_t)(pe + 1);  // 0: dropped, or no pair
  const lanemask_t group = match_any(key, 32 - __clz((int)group_max_u32(key)));
  const int rank = popc(group & lanemask_lt());
  const int lead = pe >= 0 && rank == 0 ? (popc(group) + kPass - 1) / kPass : 0;
  const int incl = group_inclusive_sum(lead);
  const int npass = shfl(incl, kWaveSize - 1);
  const int s = shfl(incl - lead, lowest_lane(group)) + rank / kPass;
  for (int j = lane; j < npass * kPass; j += kWaveSize) pass_p[j / kPass][j % kPass] = -1;
  wave_sync();
  if (pe >= 0) {
    pass_p[s][rank % kPass] = (int8_t)lane;
    if (rank % kPass == 0) pass_e[s] = pe;
  }
  return npass;
}

template <typename T>
__global__ HK_LAUNCH_BOUNDS(GemvDownMmaCfg<T>::kThreads, GemvDownMmaCfg<T>::kMinBlocks) void gemv_down_mma_kernel(GemvArgs a) {
  typedef GemvDownMmaCfg<T> C;
  typedef typename C::MT MT;
  constexpr int kRun = MT::kDirectK, kR = MT::kDirectRows, kLoads = C::kLoads, kWaves = C::kWaves;
  constexpr int kCols = C::kCols, kPass = C::kPass, kAR = C::kARows;
  __shared__ int pass_e_s[kGemvPairs];
  __shared__ int8_t pass_p_s[kGemvPairs][kPass];
  __shared__ float w_s[kGemvPairs];  // a kept pair's routing weight
  __shared__ uint32_t kept_s;        // bit p: pair p is kept
  __shared__ int npass_s;
  // (pair, column) products, 1 KB on NVIDIA: little enough that the blocks fit beside the gated kernel's
  // last blocks on an SM (with a slice of the products each, 8 KB, one token took ~0.9 us longer).
  __shared__ float part_s[kGemvPairs][kCols];
  const int num_pairs = a.num_tokens * a.topk, wave = (int)threadIdx.x / kWaveSize, lane = lane_id();
  // Wave 0's lane p: pair p's routing weight, requested with its expert id and stored at the end, so
  // that the weights' round trip is not on the way to the first w2 loads.
  const float pw = wave == 0 && lane < num_pairs ? a.topk_weights[lane] : 0.f;
  if (wave == 0) {  // the passes depend on the routing only: built before the gated kernel ends
    const int pe = lane < num_pairs ? gemv_local_expert(a, lane) : -1;
    const int n = gemv_down_passes<kPass>(pe, pass_e_s, pass_p_s);
    const uint32_t kept = (uint32_t)ballot(pe >= 0);  // pairs <= kGemvPairs = 32
    if (lane == 0) {
      npass_s = n;
      kept_s = kept;
    }
  }
  __syncthreads();
  const int npass = npass_s, I = a.inter_dim, D = a.dim;
  const int slices = npass > 0 && npass < kWaves ? kWaves / npass : 1, units = npass * slices;
  const int runs = (I + kRun - 1) / kRun, d0 = (int)blockIdx.x * kCols, d = d0 + MT::direct_col();
  const int k_lane = MT::direct_k();  // + run * kRun: a 16-byte chunk, whole or past I
  const T* inter = static_cast<const T*>(a.inter);
  bool waited = false;
  // The wave's products. With slices (npass <= kWaves / 2) a wave has one unit at most: its products
  // wait here and join part_s in slice order, a round each.
  typename MT::C c;
  int unit_s = -1, unit_sl = 0;
  for (int u = wave; u < units; u += kWaves) {  // uniform over the wave
    const int s = u / slices, sl = u % slices;
    const T* w = static_cast<const T*>(a.w2) + ((int64_t)pass_e_s[s] * D + d) * I;
    int pr[kR];  // the pair of each of the lane's A rows (-1: none)
#pragma unroll
    for (int r = 0; r < kR; ++r) pr[r] = r < kAR ? pass_p_s[s][MT::direct_row(r)] : -1;
#pragma unroll
    for (int e = 0; e < MT::kC; ++e) c[e] = 0.f;
    for (int q0 = sl; q0 < runs; q0 += slices * kLoads) {
      uint4 wv[kLoads];
#pragma unroll
      for (int b = 0; b < kLoads; ++b) {
        const int run = q0 + b * slices, k = run * kRun + k_lane;
        wv[b] = run < runs && k < I && d < D ? load_once16(w + k) : make_uint4(0, 0, 0, 0);
      }
      if (!waited) {
        griddep_wait();  // inter is the gated kernel's output
        waited = true;
      }
      uint4 xv[kLoads][kR];  // the batch's intermediate chunks requested together: one L2 round trip
#pragma unroll
      for (int b = 0; b < kLoads; ++b) {
        const int run = q0 + b * slices, k = run * kRun + k_lane;
#pragma unroll
        for (int r = 0; r < kR; ++r)
          xv[b][r] = r < kAR && run < runs && k < I && pr[r] >= 0 ? *reinterpret_cast<const uint4*>(inter + pr[r] * I + k)
                                                        : make_uint4(0, 0, 0, 0);  // < T k I < 2^31
      }
#pragma unroll
      for (int b = 0; b < kLoads; ++b) {
        if (q0 + b * slices >= runs) break;  // uniform over the wave: mma is a wave's instruction
        mma_direct_run<MT>(c, xv[b], wv[b]);
      }
    }
#pragma unroll
    for (int e = 0; e < MT::kC; ++e) {
      const int p = MT::c_row(e) < kPass ? pass_p_s[s][MT::c_row(e)] : -1;
      if (slices == 1 && p >= 0) part_s[p][MT::c_col(e)] = c[e];  // each pair in one pass
    }
    unit_s = s;
    unit_sl = sl;
  }
  if (wave == 0 && lane < num_pairs) w_s[lane] = pw;  // read for kept pairs only
  griddep_wait();  // no output is written before the gated kernel is done with its inputs (out may be x)
  __syncthreads();
  for (int round = 0; slices > 1 && round < slices; ++round) {  // uniform over the block
    if (unit_s >= 0 && unit_sl == round) {
#pragma unroll
      for (int e = 0; e < MT::kC; ++e) {
        const int p = MT::c_row(e) < kPass ? pass_p_s[unit_s][MT::c_row(e)] : -1;
        if (p >= 0) part_s[p][MT::c_col(e)] = round == 0 ? c[e] : part_s[p][MT::c_col(e)] + c[e];
      }
    }
    __syncthreads();
  }
  const uint32_t kept = kept_s;
  for (int x = (int)threadIdx.x; x < a.num_tokens * kCols; x += C::kThreads) {
    const int t = x / kCols, col = x % kCols;
    if (d0 + col >= D) continue;
    float o = 0.f;
    for (int j = 0; j < a.topk; ++j) {
      const int p = t * a.topk + j;
      if (!((kept >> p) & 1u)) continue;
      o = fmaf(w_s[p], part_s[p][col], o);
    }
    static_cast<T*>(a.out)[(int64_t)t * D + d0 + col] = from_float<T>(o);
  }
}

// mma: both phases on matrix cores, an expert's pairs together (gemv_gated_mma_kernel and
// gemv_down_mma_kernel, 16-bit types only).
template <typename T>
int launch_gemv(const GemvArgs& a, bool mma, hipStream_t stream) {
  typedef GemvCfg<T> C;
  const int64_t pairs = (int64_t)a.num_tokens * a.topk;
  const int64_t gated = pairs * a.inter_dim, units = (int64_t)a.num_tokens * a.dim;
  constexpr int kWaves = C::kDownThreads / kWaveSize;
  const int64_t down_blocks = (units + kWaves - 1) / kWaves;
  HK_REQUIRE(pairs >= 1 && pairs <= kGemvPairs && gated < (1ll << 27) && down_blocks < (1ll << 30));
  // HIP runs a grid of 2^32 threads or more wrongly (launch.h); Python's gemv_fits keeps calls under it
  HK_REQUIRE(threads_fit(gated, C::kGatedThreads) &&  // gemv_mma's gated blocks are as large (GemvMmaCfg)
             threads_fit(down_blocks, C::kDownThreads));
  GemvArgs g = a;
  g.inv_pairs = pairs > 1 ? (uint32_t)(((1ull << 32) + pairs - 1) / pairs) : 0u;  // unused for one pair
  HK_REQUIRE(!mma || sizeof(T) == 2);
  if (mma) {
    if constexpr (sizeof(T) == 2) {
      typedef GemvDownMmaCfg<T> DC;
      hipLaunchKernelGGL(gemv_gated_mma_kernel<T>, dim3((unsigned)gated), dim3(GemvMmaCfg<T>::kThreads), 0, stream, g);
      HK_CHECK_LAUNCH("fused_moe gemv_gated_mma_kernel");
      HK_CHECK(launch_dependent(gemv_down_mma_kernel<T>, dim3((unsigned)((a.dim + DC::kCols - 1) / DC::kCols)),
                                dim3(DC::kThreads), 0, stream, a));
    }
  } else {
    hipLaunchKernelGGL(gemv_gated_kernel<T>, dim3((unsigned)gated), dim3(C::kGatedThreads), 0, stream, g);
    HK_CHECK_LAUNCH("fused_moe gemv_gated_kernel");
    HK_CHECK(launch_dependent(gemv_down_kernel<T>, dim3((unsigned)down_blocks),
                              dim3(C::kDownThreads), 0, stream, a));
  }
  return 0;
}

}  // namespace fused_moe
}  // namespace hk
