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
#pragma once

#include "gemm.h"  // activate()
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

template <typename T>
__global__ HK_LAUNCH_BOUNDS(GemvCfg<T>::kGatedThreads, GemvCfg<T>::kGatedMinBlocks) void gemv_gated_kernel(GemvArgs a) {
  typedef GemvCfg<T> C;
  constexpr int kThreads = C::kGatedThreads, kLoads = C::kGatedLoads, kVec = C::kVec;
  constexpr int kWaves = kThreads / kWaveSize;
  __shared__ float part[kWaves][2];
  griddep_launch_dependents();  // the down kernel may launch once every gated block has started
  // Block b = i * pairs + p (pair fastest). b / pairs as a multiply-high by inv_pairs = ceil(2^32 /
  // pairs) (exact for b < 2^27 and 2 <= pairs <= 32: the launcher's bounds), ~20 instructions less
  // than a division; one pair (inv_pairs would be 2^32) is b itself.
  const int num_pairs = a.num_tokens * a.topk;
  const int i = num_pairs == 1 ? (int)blockIdx.x : (int)__umulhi(blockIdx.x, a.inv_pairs);
  const int p = (int)blockIdx.x - i * num_pairs;
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

template <typename T>
int launch_gemv(const GemvArgs& a, hipStream_t stream) {
  typedef GemvCfg<T> C;
  const int64_t pairs = (int64_t)a.num_tokens * a.topk;
  const int64_t gated = pairs * a.inter_dim, units = (int64_t)a.num_tokens * a.dim;
  constexpr int kWaves = C::kDownThreads / kWaveSize;
  HK_REQUIRE(pairs >= 1 && pairs <= kGemvPairs && gated < (1ll << 27) && units / kWaves < (1ll << 30));
  GemvArgs g = a;
  g.inv_pairs = pairs > 1 ? (uint32_t)(((1ull << 32) + pairs - 1) / pairs) : 0u;  // unused for one pair
  hipLaunchKernelGGL(gemv_gated_kernel<T>, dim3((unsigned)gated), dim3(C::kGatedThreads), 0, stream, g);
  HK_CHECK_LAUNCH("fused_moe gemv_gated_kernel");
  HK_CHECK(launch_dependent(gemv_down_kernel<T>, dim3((unsigned)((units + kWaves - 1) / kWaves)),
                            dim3(C::kDownThreads), 0, stream, a));
  return 0;
}

}  // namespace fused_moe
}  // namespace hk
