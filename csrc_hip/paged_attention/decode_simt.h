// Paged-attention decode on CUDA cores (variants v3, v9): lane-per-token QK^T.
//
// One block per (KV head, group of HPB query heads of it, sequence, partition of the context).
// The block's waves take the partition's tokens in tiles of one token per lane:
//   QK^T: lane t reads token t's K row with 16-byte loads and dots it with the (scaled) queries,
//         which every lane reads from shared memory as broadcasts;
//   softmax: online, in the log2 domain, per head (wave max; per-lane partial sums);
//   PV:   the lanes split the head dimension; each token's V row is weighted by the probabilities
//         the QK step left in shared memory. Where the target copies asynchronously (sm_80+), the
//         tile's V rows are staged into shared memory by coalesced copies issued before the K loads,
//         so their latency hides behind QK^T (rows of masked tokens are zero-filled); elsewhere PV
//         reads them from global memory.
// The waves' states merge through shared memory (finish() in common.h).
#pragma once

#include "common.h"

namespace hk {
namespace paged_attention {
namespace simt {

constexpr int kWaves = 4;
constexpr int kThreads = kWaves * kWaveSize;

template <typename T, int D, int HPB>
struct Smem {  // floats; the merge area reuses the tile area once every wave is done
  static constexpr bool stage_v = kAsyncCopy;
  static constexpr int q = HPB * D;
  static constexpr int p = kWaves * kWaveSize * HPB;
  static constexpr int off = 2 * kWaves * kWaveSize;  // int64 row offsets, as pairs of floats
  static constexpr int v = stage_v ? kWaves * kWaveSize * D * (int)sizeof(T) / 4 : 0;  // V tiles
  static constexpr int tile = q + p + off + v;
  static constexpr int merge = 2 * kWaves * HPB + kWaves * HPB * D;
  static constexpr int bytes = 4 * (tile > merge ? tile : merge);
  static_assert(kAsyncCopy || bytes <= 63 * 1024, "CDNA: fits a workgroup's 64 KB of LDS with 1 KB of static");
};

// Blocks that must fit on one SM at once (CUDA): caps registers at 128 per thread for head <= 128
// so that enough waves keep loads in flight; head 256 needs more registers. (8 heads of 128 spill 28
// bytes at that cap; 3 blocks at 159 registers measured up to 8-33 % slower on the H100 at batch >= 32,
// 10 % faster only at batch 1: NOTES.md, 2026-11-25 (20).)
template <int D> constexpr int min_blocks() { return D <= 128 ? 4 : 2; }

template <typename T, int D, int HPB>
__global__ HK_LAUNCH_BOUNDS(kThreads, min_blocks<D>()) void decode_kernel(Params p) {
  constexpr int W = kWaveSize;
  constexpr int KV = 16 / sizeof(T);  // K elements per 16-byte load
  constexpr int DPL = D / W;          // head dims per lane in PV
  static_assert(D % KV == 0 && D % W == 0, "head size");
  typedef Smem<T, D, HPB> S;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* p_s = q_s + S::q;
  int64_t* off_s = reinterpret_cast<int64_t*>(p_s + S::p);
  T* v_s = reinterpret_cast<T*>(off_s + kWaves * kWaveSize);

  griddep_launch_dependents();  // the merge kernel (split launches) may be scheduled once all blocks run
  const BlockWork work = block_work<HPB, kWaves * kWaveSize, kThreads, false>(p);
  if (work.skip) return;
  const int kvh = work.kvh, seq = work.seq, start = work.start, end = work.end;
  const int head0 = work.head0, nh = work.nh;

  const T* q = static_cast<const T*>(p.q) + (int64_t)seq * p.q_stride_s;
  for (int i = threadIdx.x; i < HPB * D; i += kThreads) {
    const int h = i / D;
    q_s[i] = h < nh ? to_float(q[(int64_t)(head0 + h) * p.q_stride_h + i % D]) * p.scale_log2 : 0.f;
  }
  __syncthreads();

  const int wave = threadIdx.x / W;
  const int lane = threadIdx.x % W;
  const T* kbase = static_cast<const T*>(p.k) + (int64_t)kvh * p.kv_stride_head;
  const T* vbase = static_cast<const T*>(p.v) + (int64_t)kvh * p.kv_stride_head;
  const int32_t* bt = p.block_tables + (int64_t)seq * p.bt_stride;
  float* my_p = p_s + wave * W * HPB;
  int64_t* my_off = off_s + wave * W;
  T* my_v = v_s + wave * W * D;
  constexpr int kChunks = D / KV;            // 16-byte chunks of a row
  constexpr int kRowsPerStep = W / kChunks;  // rows a wave copies per step (D <= 8 * W)
  static_assert(kChunks <= W, "one row per wave step at most");

  float m[HPB], l[HPB], acc[HPB][DPL];
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int j = 0; j < DPL; ++j) acc[h][j] = 0.f;
  }

  for (int t0 = start + wave * W; t0 < end; t0 += kWaves * W) {
    const int t = t0 + lane;
    float s[HPB];
#pragma unroll
    for (int h = 0; h < HPB; ++h) s[h] = 0.f;
    const int64_t off = t < end ? token_offset(p, bt, t) : -1;  // -1: masked
    const int n = min(W, end - t0);
    if constexpr (S::stage_v) {  // start this tile's V rows on their way to shared memory
      my_off[lane] = off;
      wave_sync();
      for (int r = lane / kChunks; r < n; r += kRowsPerStep) {
        const int c = lane % kChunks;
        const int64_t o = my_off[r];
        async_copy16_or_zero(my_v + r * D + c * KV, vbase + (o < 0 ? 0 : o) + c * KV, o >= 0);
      }
    }
    if (off >= 0) {
      const T* krow = kbase + off;
#pragma unroll
      for (int c = 0; c < D / KV; ++c) {
        float kf[KV];
        load_as_float<T, KV>(krow + c * KV, kf);
#pragma unroll
        for (int h = 0; h < HPB; ++h) {
#pragma unroll
          for (int j = 0; j < KV; ++j) s[h] = fmaf(q_s[h * D + c * KV + j], kf[j], s[h]);
        }
      }
    } else {
#pragma unroll
      for (int h = 0; h < HPB; ++h) s[h] = -INFINITY;
    }
    if constexpr (!S::stage_v) my_off[lane] = off;
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
      const float mn = fmaxf(m[h], group_max<W>(s[h]));
      const float alpha = merge_weight(m[h], mn);
      const float pr = merge_weight(s[h], mn);
      l[h] = l[h] * alpha + pr;
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[h][j] *= alpha;
      m[h] = mn;
      my_p[lane * HPB + h] = pr;
    }
    if constexpr (S::stage_v) async_copy_wait();
    wave_sync();
#pragma unroll 4
    for (int i = 0; i < n; ++i) {
      float vf[DPL];
      if constexpr (S::stage_v) {
        load_as_float<T, DPL>(my_v + i * D + lane * DPL, vf);  // zeros for a masked token
      } else {
        if (my_off[i] < 0) continue;  // masked token: nothing to read (uniform across the wave)
        load_as_float<T, DPL>(vbase + my_off[i] + lane * DPL, vf);
      }
#pragma unroll
      for (int h = 0; h < HPB; ++h) {
        const float pr = my_p[i * HPB + h];
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[h][j] = fmaf(pr, vf[j], acc[h][j]);
      }
    }
    wave_sync();  // the next tile overwrites my_p / my_off / my_v
  }
#pragma unroll
  for (int h = 0; h < HPB; ++h) l[h] = group_sum<W>(l[h]);

  // Merge the waves' states.
  __syncthreads();
  float* m_w = smem;                 // [kWaves][HPB]
  float* l_w = m_w + kWaves * HPB;   // [kWaves][HPB]
  float* a_w = l_w + kWaves * HPB;   // [kWaves][HPB][D]
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    if (lane == 0) {
      m_w[wave * HPB + h] = m[h];
      l_w[wave * HPB + h] = l[h];
    }
#pragma unroll
    for (int j = 0; j < DPL; ++j) a_w[(wave * HPB + h) * D + lane * DPL + j] = acc[h][j];
  }
  __syncthreads();
  finish<T, D, kWaves, HPB, kThreads>(p, m_w, l_w, a_w, work);
}

template <typename T, int D, int HPB> unsigned long long& raised() {  // devices with the shared limit raised
  static unsigned long long r = 0;
  return r;
}

template <typename T, int D, int HPB>
int launch(const Params& p, int num_seqs, int num_kv_heads, int device, hipStream_t stream) {
  return launch_decode<T, D>(&decode_kernel<T, D, HPB>, raised<T, D, HPB>(), p, HPB, num_kv_heads, num_seqs,
                             kThreads, Smem<T, D, HPB>::bytes, device, stream,
                             "launch of paged_attention simt::decode_kernel");
}

template <typename T, int D, int HPB>
int resident(int device, int* out) {
  return resident_blocks(&decode_kernel<T, D, HPB>, raised<T, D, HPB>(), kThreads, Smem<T, D, HPB>::bytes, device,
                         out);
}

}  // namespace simt
}  // namespace paged_attention
}  // namespace hk
