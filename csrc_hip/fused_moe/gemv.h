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
// fastest in the grid), so the second read mostly hits L2. Dropped pairs (moe_pair_kept) cost a
// block that exits at once and nothing in the down sum.
// Variant "gemv_mma" (16-bit types) replaces the gated kernel with gemv_gated_mma_kernel (below): the
// pairs of one expert in one block, on matrix cores; the down kernel is the same.
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
  int num_tokens, topk, num_experts, dim, inter_dim, activation;
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

// The pair's local expert, or -1 when the pair is dropped.
HK_DEVICE int gemv_local_expert(const GemvArgs& a, int pair) {
  const int e = a.ids[pair];
  if (!moe_pair_kept(e, a.num_experts, a.expert_map)) return -1;
  return a.expert_map != nullptr ? a.expert_map[e] : e;
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

template <typename T>
__global__ HK_LAUNCH_BOUNDS(GemvCfg<T>::kGatedThreads, GemvCfg<T>::kGatedMinBlocks) void gemv_gated_kernel(GemvArgs a) {
  typedef GemvCfg<T> C;
  constexpr int kThreads = C::kGatedThreads, kLoads = C::kGatedLoads, kVec = C::kVec;
  constexpr int kWaves = kThreads / kWaveSize;
  __shared__ float part[kWaves][2];
  griddep_launch_dependents();  // the down kernel may launch once every gated block has started
  const GemvRowPair rp = gemv_row_pair(a);
  const int i = rp.i, p = rp.p;
  const int le = gemv_local_expert(a, p);
  if (le < 0) return;  // the whole block: no barrier is reached
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

// Variant "gemv_mma" (16-bit types): the gated products on matrix cores. The grid is
// gemv_gated_kernel's (a block per (row i, pair p), pair fastest), but the block of the first pair
// routed to an expert computes every pair on that expert (kTileTokens at a pass) and the other pairs'
// blocks exit, so under skewed routing an expert's rows are streamed once and an extra pair costs a few
// matrix instructions, not a token row's conversions and FMAs on CUDA cores (what bounds gemv there:
// NOTES.md, 2026-11-27 (8)). H100 (NOTES.md, 2026-11-27 (10)): skewed DeepSeek-like 4 tokens 64 -> 55
// us; under uniform routing slower (DeepSeek-like 1-4 tokens by 1.5-3 us, Mixtral 8x7B 1 token by 7-9 %;
// three blocks an SM at 80 registers, against gemv's four), so the tuner chooses per shape.
// One product covers the block's two rows (gate i, up i) against kTileTokens pairs: the reduction is
// cut into S = N / 2 segments, B's column n is (row n / S, segment n % S) and A's row m (pair m / S,
// segment m % S). MmaTile's direct layout gives each lane operands of a single segment, so the entries
// of C with equal segments, C[(t, s)][(r, s)] summed over s and over the block's waves, are row r's
// product with pair t (the other entries mix segments and are dropped). Segment s is runs s, s + S,
// s + 2S, ... of a row (a run: kDirectK reduction indices), so a wave's load covers S adjacent runs of
// each row; contiguous quarter rows as segments left the kernel 20 % slower. A lane's weights are
// 16-byte loads, a batch requested before the first is used; the token chunks are L1 hits after the
// first block.
template <typename T>
struct GemvMmaCfg {
  typedef MmaTile<T> MT;
  static constexpr int kThreads = 256, kWaves = kThreads / kWaveSize;
  static constexpr int kSegs = MT::N / 2;             // S: 4 on NVIDIA, 8 on CDNA
  static constexpr int kTileTokens = MT::M / kSegs;   // pairs a product covers: 4 on NVIDIA, 2 on CDNA
  static constexpr int kLoads = 8;  // runs of a lane's weights in flight (D = 7168 on NVIDIA: 7, one batch)
  // 80 registers, no spills; bounded for 4 blocks (64) it spilled and was slower (NOTES.md).
  static constexpr int kMinBlocks = 3;
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
  if (threadIdx.x < kWaveSize && lane_e == le) pair_s[popc(group & lanemask_lt())] = lane;

  const int D = a.dim, I = a.inter_dim;
  const int runs = (D + S * kRun - 1) / (S * kRun);  // a segment's runs
  const int wave = threadIdx.x / kWaveSize, col = MT::direct_col();
  const T* w = static_cast<const T*>(a.w1) + ((int64_t)le * 2 * I + (int64_t)(col / S) * I + i) * D;
  const int k_lane = col % S * kRun + MT::direct_k();  // + run * S * kRun: a 16-byte chunk, whole or past D
  const T* x = static_cast<const T*>(a.x);
  __syncthreads();  // pair_s
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
      uint4 wv[kLoads];
#pragma unroll
      for (int b = 0; b < kLoads; ++b) {
        const int k = k_lane + (u0 + b * kWaves) * S * kRun;
        wv[b] = u0 + b * kWaves < runs && k < D ? load_once16(w + k) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int b = 0; b < kLoads; ++b) {
        if (u0 + b * kWaves >= runs) break;  // uniform over the wave: mma is a wave's instruction
        const int k = k_lane + (u0 + b * kWaves) * S * kRun;
        uint4 xv[kR];
#pragma unroll
        for (int j = 0; j < kR; ++j)
          xv[j] = k < D && tok[j] >= 0 ? *reinterpret_cast<const uint4*>(x + (int64_t)tok[j] * D + k)
                                       : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int st = 0; st < 2; ++st) {
          typename MT::A fa;
          typename MT::B fb;
          MT::a_direct(fa, xv, st);
          MT::b_direct(fb, wv[b], st);
          MT::mma(c, fa, fb);
        }
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

// mma: the gated products on matrix cores (gemv_gated_mma_kernel, 16-bit types only).
template <typename T>
int launch_gemv(const GemvArgs& a, bool mma, hipStream_t stream) {
  typedef GemvCfg<T> C;
  const int64_t pairs = (int64_t)a.num_tokens * a.topk;
  const int64_t gated = pairs * a.inter_dim, units = (int64_t)a.num_tokens * a.dim;
  constexpr int kWaves = C::kDownThreads / kWaveSize;
  HK_REQUIRE(pairs >= 1 && pairs <= kGemvPairs && gated < (1ll << 27) && units / kWaves < (1ll << 30));
  GemvArgs g = a;
  g.inv_pairs = pairs > 1 ? (uint32_t)(((1ull << 32) + pairs - 1) / pairs) : 0u;  // unused for one pair
  HK_REQUIRE(!mma || sizeof(T) == 2);
  if (mma) {
    if constexpr (sizeof(T) == 2) {
      hipLaunchKernelGGL(gemv_gated_mma_kernel<T>, dim3((unsigned)gated), dim3(GemvMmaCfg<T>::kThreads), 0, stream, g);
      HK_CHECK_LAUNCH("fused_moe gemv_gated_mma_kernel");
    }
  } else {
    hipLaunchKernelGGL(gemv_gated_kernel<T>, dim3((unsigned)gated), dim3(C::kGatedThreads), 0, stream, g);
    HK_CHECK_LAUNCH("fused_moe gemv_gated_kernel");
  }
  HK_CHECK(launch_dependent(gemv_down_kernel<T>, dim3((unsigned)((units + kWaves - 1) / kWaves)),
                            dim3(C::kDownThreads), 0, stream, a));
  return 0;
}

}  // namespace fused_moe
}  // namespace hk
