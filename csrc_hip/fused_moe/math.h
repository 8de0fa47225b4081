// The tiling and arithmetic of the expert GEMMs (gemm.h), as policies over one interface:
//   MmaMath<T, WR, WK, BM, BK, Stages>  fp16/bf16 on matrix cores (MmaTile: mma.sync on NVIDIA, MFMA
//                                       on CDNA)
//   WgmmaMath<T, WG, BM, BK, Stages>    fp16/bf16 on wgmma (sm_90a), WG warpgroups of 64 rows
//   SimtMath<RPL, WK, BM, BK, Stages>   fp32 on CUDA cores / VALU (real fp32 FMAs, no TF32)
//
// An item is kRows weight rows x kToks token rows; a pipeline stage (kStages deep) holds kBK of the
// reduction dimension of both in shared memory (R rows span R * kLd elements, at() places each
// 16-byte chunk). The kWaves waves split the rows and/or (kWK groups) the k-slices of a stage:
//   zero(acc)                              acc = 0
//   step(acc, w_s, x_s, pairs, num_pairs)  acc[row][tok] += W[row][k] X[tok][k] over this wave's rows
//                                          and k-slice; token tiles whose first row is padding
//                                          (pairs[row] >= num_pairs; valid rows are a prefix) may be
//                                          skipped. Columns of invalid tokens may hold anything:
//                                          they are never stored.
//   store(acc, red)                        this wave's partial sums into red[wk][row][tok]
//                                          (row stride kRedLd), summed over wk by the epilogue
//   at(row, chunk)                         where 16-byte chunk `chunk` of a stage row lies (elements
//                                          from the stage's start)
//   kAsyncReads                            step() reads the stage through the async proxy (wgmma):
//                                          the copies are fenced for it before the stage's barrier
#pragma once

#include "hipkern/mma.h"
#include "hipkern/wgmma.h"

namespace hk {
namespace fused_moe {

constexpr int round_up(int a, int b) { return (a + b - 1) / b * b; }

// Waves: WR row groups x WK k groups. Wave (wr, wk) owns the 16-row tile wr and the k-slice wk of
// every stage; the WK partial tiles are summed by the epilogue.
template <typename T, int WR, int WK, int BM, int BK, int Stages>
struct MmaMath {
  typedef MmaTile<T> MT;
  static constexpr int kWaves = WR * WK, kWK = WK, kRows = 16 * WR, kToks = round_up(BM, MT::N);
  static constexpr int kBK = BK, kLd = kBK + 8, kRedLd = kToks + 1, kStages = Stages;
  static constexpr int kSlice = kBK / WK, kNT = kToks / MT::N;
  static_assert(kSlice % MT::K == 0, "whole k16 steps per wave");
  struct Acc { float c[kNT][MT::kC]; };
  static constexpr bool kAsyncReads = false;
  static HK_DEVICE int at(int r, int c) { return r * kLd + c * (16 / (int)sizeof(T)); }  // padded rows

  static HK_DEVICE int wr() { return (threadIdx.x / kWaveSize) % WR; }
  static HK_DEVICE int wk() { return (threadIdx.x / kWaveSize) / WR; }

  static HK_DEVICE void zero(Acc& a) {
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int i = 0; i < MT::kC; ++i) a.c[n][i] = 0.f;
  }

  // The wave's A fragments of the whole stage first (kKK x 4 registers), then the token tiles in
  // pairs (one ldmatrix for two tiles), up to the pair holding the last valid row: a uniform branch
  // per pair of tiles, none per mma. The second tile of the last pair may be padding (its columns
  // are never stored); tile 0 always holds a pair (an m-block in use has one).
  static HK_DEVICE void step(Acc& acc, const T* w_s, const T* x_s, const int* pairs, int num_pairs) {
    constexpr int kKK = kSlice / MT::K;
    const T* w = w_s + 16 * wr() * kLd + wk() * kSlice;
    const T* x = x_s + wk() * kSlice;
    typename MT::A a[kKK];
#pragma unroll
    for (int i = 0; i < kKK; ++i) MT::load_a(a[i], w + i * MT::K, kLd);
#pragma unroll
    for (int n = 0; n < kNT; n += 2) {
      if (n > 0 && pairs[n * MT::N] >= num_pairs) break;
      const T* xn = x + n * MT::N * kLd;
#pragma unroll
      for (int i = 0; i < kKK; ++i) {
        typename MT::B b0, b1;
        if (n + 1 < kNT) {
          MT::load_b_nk2(b0, b1, xn + i * MT::K, kLd);
          MT::mma(acc.c[n], a[i], b0);
          MT::mma(acc.c[n + 1], a[i], b1);
        } else {
          MT::load_b_nk(b0, xn + i * MT::K, kLd);
          MT::mma(acc.c[n], a[i], b0);
        }
      }
    }
  }

  static HK_DEVICE void store(const Acc& acc, float* red) {  // red: [WK][kRows][kRedLd]
    float* r = red + (wk() * kRows + 16 * wr()) * kRedLd;
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int i = 0; i < MT::kC; ++i) r[MT::c_row(i) * kRedLd + n * MT::N + MT::c_col(i)] = acc.c[n][i];
  }
};

// fp16/bf16 on wgmma (hipkern/wgmma.h; only where kWgmma): warpgroup g (4 warps) owns weight rows
// 64g .. 64g + 63 against all token rows over the whole k-stage, both operands read by the tensor
// cores from shared memory, so no fragment goes through registers. Stages hold 128-byte-swizzled
// K-major atoms (at(): 8 rows x 128 bytes, chunk c of row r at c ^ (r % 8), a row group's atoms
// K-adjacent): the copies' coalesced order (a row's consecutive chunks per lanes) then writes whole
// 128-byte rows of shared memory, which cp.async needs to fetch each sector once (a core-matrix
// layout without swizzle doubled the L2 sectors and ran 1.6x slower). The accumulators have
// mma.sync's C layout per warp, so Acc, zero() and store() are MmaMath's (warp w: rows 16w ..).
template <typename T, int WG, int BM, int BK, int Stages>
struct WgmmaMath : MmaMath<T, 4 * WG, 1, BM, BK, Stages> {
  typedef MmaMath<T, 4 * WG, 1, BM, BK, Stages> Base;
  using typename Base::Acc;
  typedef Sw128<T, BK> L;
  static constexpr int kLd = BK;  // a stage of R rows spans R * kLd elements (1024-byte atoms)
  static constexpr bool kAsyncReads = true;  // the tensor cores read the stages
  static HK_DEVICE int at(int r, int c) { return L::at(r, c); }

  // All kToks token rows, padding included (zeros or stale rows whose columns are never stored): one
  // instruction shape, so that the accumulators are never touched between the fence and the wait (a
  // shape chosen at run time made ptxas serialise every wgmma).
  static HK_DEVICE void step(Acc& acc, const T* w_s, const T* x_s, const int*, int) {
    constexpr int N = Base::kToks;
    const T* w = w_s + 64 * (Base::wr() / 4) * BK;  // at(64 g, 0)
    float(&d)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(&acc.c[0][0]);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < BK / 16; ++s)
      Wgmma<T, N>::mma(d, wgmma_desc_sw128(w + L::k16(s), L::kSbo), wgmma_desc_sw128(x_s + L::k16(s), L::kSbo));
    wgmma_commit();
    wgmma_wait<0>();  // the stage's buffers are free again at the loop's next barrier
  }
};

// fp32: WK waves over the k-slices; lane l owns weight rows l + j * wave size (j < RPL) against every
// token row: per 4 k, RPL 16-byte weight loads (conflict-free: kLd = 4 mod 32 words) and one
// broadcast load per token feed 4 RPL FMAs per token.
template <int RPL, int WK, int BM, int BK, int Stages>
struct SimtMath {
  static constexpr int kWaves = WK, kWK = WK, kRows = RPL * kWaveSize, kToks = round_up(BM, 8);
  static constexpr int kBK = BK, kLd = kBK + 4, kRedLd = kToks + 1, kStages = Stages;
  static constexpr int kSlice = kBK / WK;
  static_assert(kSlice % 16 == 0, "whole 16-k steps per wave");
  struct Acc { float c[RPL][kToks]; };
  static constexpr bool kAsyncReads = false;
  static HK_DEVICE int at(int r, int c) { return r * kLd + c * 4; }

  static HK_DEVICE void zero(Acc& a) {
#pragma unroll
    for (int r = 0; r < RPL; ++r)
#pragma unroll
      for (int m = 0; m < kToks; ++m) a.c[r][m] = 0.f;
  }

  static HK_DEVICE void fma4(float& acc, const float4& w, const float4& x) {
    acc = fmaf(w.x, x.x, acc);
    acc = fmaf(w.y, x.y, acc);
    acc = fmaf(w.z, x.z, acc);
    acc = fmaf(w.w, x.w, acc);
  }

  static HK_DEVICE void step(Acc& acc, const float* w_s, const float* x_s, const int* pairs, int num_pairs) {
    const int k0 = (threadIdx.x / kWaveSize) * kSlice, l = lane_id();
    bool on[kToks / 8];  // 8-token groups with a pair (the rest of the block is padding)
#pragma unroll
    for (int g = 0; g < kToks / 8; ++g) on[g] = pairs[8 * g] < num_pairs;
#pragma unroll 1  // unrolled 16 k at a time: enough to batch the loads, and it keeps compile times sane
    for (int k1 = 0; k1 < kSlice; k1 += 16)
#pragma unroll
    for (int kk = k1; kk < k1 + 16; kk += 4) {
      float4 w[RPL];
#pragma unroll
      for (int r = 0; r < RPL; ++r) w[r] = *reinterpret_cast<const float4*>(w_s + (l + r * kWaveSize) * kLd + k0 + kk);
#pragma unroll
      for (int m0 = 0; m0 < kToks; m0 += 8) {
        if (!on[m0 / 8]) break;
#pragma unroll
        for (int m = m0; m < m0 + 8; ++m) {
          const float4 x = *reinterpret_cast<const float4*>(x_s + m * kLd + k0 + kk);
#pragma unroll
          for (int r = 0; r < RPL; ++r) fma4(acc.c[r][m], w[r], x);
        }
      }
    }
  }

  static HK_DEVICE void store(const Acc& acc, float* red) {  // red: [WK][kRows][kRedLd]
    float* rd = red + (threadIdx.x / kWaveSize) * kRows * kRedLd;
    const int l = lane_id();
#pragma unroll
    for (int r = 0; r < RPL; ++r)
#pragma unroll
      for (int m = 0; m < kToks; ++m) rd[(l + r * kWaveSize) * kRedLd + m] = acc.c[r][m];
  }
};

}  // namespace fused_moe
}  // namespace hk
