// The tiling and arithmetic of the expert GEMMs (gemm.h), as policies over one interface:
//   MmaMath<T, WR, WK, BM, BK, Stages>  fp16/bf16 on matrix cores (MmaTile: mma.sync on NVIDIA, MFMA
//                                       on CDNA)
//   WgmmaMath<T, WG, BM, BK, Stages>    fp16/bf16 on wgmma (sm_90a), WG warpgroups of 64 rows
//   SimtMath<RPL, WK, BM, BK, Stages>   fp32 on CUDA cores / VALU (real fp32 FMAs, no TF32)
//   SplitMath<WG, BM, BK, Stages, Pre>  fp32 on wgmma (sm_90a) through exact power-of-two scaling and
//                                       two-term fp16 splits (float32 accuracy, no TF32); Pre: the
//                                       tokens arrive split (split rows, below)
//
// An item is kRows weight rows x kToks token rows; a pipeline stage (kStages deep) holds kBK of the
// reduction dimension of both in shared memory (R rows span R * kLd elements, at() places each
// 16-byte chunk). The kWaves waves split the rows and/or (kWK groups) the k-slices of a stage:
//   zero(acc)                              acc = 0
//   step(acc, w_s, x_s, pairs, num_pairs, scratch)  acc[row][tok] += W[row][k] X[tok][k] over this
//                                          wave's rows and k-slice; token tiles whose first row is
//                                          padding (pairs[row] >= num_pairs; valid rows are a prefix)
//                                          may be skipped. Columns of invalid tokens may hold anything:
//                                          they are never stored. Every thread of the block calls it.
//                                          scratch: the policy's own kScratch bytes of shared memory
//                                          (1024-byte aligned; none where kScratch is 0)
//   store(acc, red)                        this wave's partial sums into red[wk][row][tok]
//                                          (row stride kRedLd), summed over wk by the epilogue
//   kEpiPasses, store(acc, red, pass)      (kEpiPasses > 1) the epilogue takes the rows in that many
//                                          passes, red holding kRows / kEpiPasses rows: the waves whose
//                                          rows are pass `pass`'s store them there (row 0: the pass's
//                                          first), the others nothing
//   at(row, chunk)                         where 16-byte chunk `chunk` of a stage row lies (elements
//                                          from the stage's start)
//   kAsyncReads                            step() reads the stage through the async proxy (wgmma):
//                                          the copies are fenced for it (before the stage's barrier,
//                                          or after its mbarrier wait: kCopyBars)
//   kScratch                               bytes of shared memory step() needs beside the stages
//   kLag                                   stages whose products step() may leave in flight when it
//                                          returns (wgmma groups): their buffers stay in use until
//                                          kLag more steps have returned, and drain(acc) must run
//                                          before store(acc)
//   drain(acc)                             waits until acc holds every step's products
//   kWeightBox                             a stage's weight rows are 128-byte-swizzled rows of one
//                                          64-element atom (Sw128, kBK = 64 at 16 bits): where the
//                                          build has tensor maps (hipkern/tma.h) the down GEMM copies
//                                          them as one box
//   kPrefetch                              the loader also asks L2 for the next stage's weight rows
//                                          where the plan does not split K (gemm.h): MmaMath's
//                                          blocks of <= 16 token rows only (wgmma's and fp32's
//                                          measured slower with it, 2026-11-25)
//   kCopyBars                              (kLag 1 only) the loader counts each stage's copies on an
//                                          mbarrier and refills a stage's buffer once every wave's
//                                          products of it are done (gemm.h, GemmCfg::kFullBars)
//   kStepPairs                             step() reads `pairs` (MmaMath, SimtMath: to skip padding
//                                          token tiles); where it does not, the loader stages the
//                                          pairs (and the down GEMM's routing weights) with an item's
//                                          last stage only, which is all the epilogue reads
//   kPreSplit                              the token rows are split rows (SplitMath<..., true>):
//                                          a stage's token chunk c of row m goes to at_split(m, c),
//                                          the row's scale for the stage to at_scale(m); the gated
//                                          GEMM writes its output as split rows too
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
  static constexpr bool kAsyncReads = false, kPreSplit = false, kWeightBox = false, kPrefetch = BM <= 16;
  static constexpr bool kStepPairs = true, kCopyBars = false;
  static constexpr int kScratch = 0, kLag = 0, kEpiPasses = 1;
  static HK_DEVICE int at(int r, int c) { return r * kLd + c * (16 / (int)sizeof(T)); }  // padded rows
  static HK_DEVICE void drain(Acc&) {}

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
  static HK_DEVICE void step(Acc& acc, const T* w_s, const T* x_s, const int* pairs, int num_pairs,
                             unsigned char*) {
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
// Lag 1: step() returns with its own products still running (it waits only for the previous
// stage's), so the tensor cores work through the loop's barrier and the next stage's copies; the
// pipeline then keeps one stage fewer in flight for the copies (gemm.h), hence a deeper one.
// Passes > 1: the epilogue takes the warpgroups' rows in that many passes (a smaller partials tile,
// room for a stage more). CopyBars: kCopyBars.
template <typename T, int WG, int BM, int BK, int Stages, int Lag = 0, int Passes = 1, bool CopyBars = false>
struct WgmmaMath : MmaMath<T, 4 * WG, 1, BM, BK, Stages> {
  typedef MmaMath<T, 4 * WG, 1, BM, BK, Stages> Base;
  using typename Base::Acc;
  typedef Sw128<T, BK> L;
  static constexpr int kLd = BK;  // a stage of R rows spans R * kLd elements (1024-byte atoms)
  static constexpr int kLag = Lag, kEpiPasses = Passes;
  static constexpr bool kCopyBars = CopyBars;
  static_assert(Lag == 0 || Lag == 1, "wgmma groups left in flight");
  static_assert(!CopyBars || Lag == 1, "copy barriers refill the buffer of the stage before");
  static_assert(WG % Passes == 0, "whole warpgroups a pass");
  static constexpr bool kAsyncReads = true;  // the tensor cores read the stages
  static constexpr bool kWeightBox = BK * sizeof(T) == 128;  // one atom a row: a stage's rows are one box
  static constexpr bool kPrefetch = false, kStepPairs = false;
  static HK_DEVICE int at(int r, int c) { return L::at(r, c); }

  // All kToks token rows, padding included (zeros or stale rows whose columns are never stored): one
  // instruction shape, so that the accumulators are never touched between the fence and the wait (a
  // shape chosen at run time made ptxas serialise every wgmma).
  static HK_DEVICE void step(Acc& acc, const T* w_s, const T* x_s, const int*, int, unsigned char*) {
    constexpr int N = Base::kToks;
    const T* w = w_s + 64 * (Base::wr() / 4) * BK;  // at(64 g, 0)
    float(&d)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(&acc.c[0][0]);
    const uint64_t dw = wgmma_desc_sw128(w, L::kSbo), dx = wgmma_desc_sw128(x_s, L::kSbo);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < BK / 16; ++s)
      Wgmma<T, N>::mma(d, wgmma_desc_add(dw, L::k16(s) * sizeof(T)), wgmma_desc_add(dx, L::k16(s) * sizeof(T)));
    wgmma_commit();
    wgmma_wait<Lag>();  // the buffers of the stage Lag steps back are free at the loop's next barrier
  }
  static HK_DEVICE void drain(Acc&) { wgmma_wait<0>(); }
  static HK_DEVICE void store(const Acc& acc, float* red) { Base::store(acc, red); }
  static HK_DEVICE void store(const Acc& acc, float* red, int pass) {
    constexpr int kRowsPerPass = Base::kRows / Passes;
    if (Base::wr() / 4 / (WG / Passes) == pass) Base::store(acc, red - pass * kRowsPerPass * Base::kRedLd);
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
  static constexpr bool kAsyncReads = false, kPreSplit = false, kWeightBox = false, kPrefetch = false;
  static constexpr bool kStepPairs = true, kCopyBars = false;
  static constexpr int kScratch = 0, kLag = 0, kEpiPasses = 1;
  static HK_DEVICE int at(int r, int c) { return r * kLd + c * 4; }
  static HK_DEVICE void drain(Acc&) {}

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

  static HK_DEVICE void step(Acc& acc, const float* w_s, const float* x_s, const int* pairs, int num_pairs,
                             unsigned char*) {
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

// The power-of-two exponent k that brings a block's largest magnitude amax (>= 0) into [2^14, 2^15),
// fp16's top binade but one (k <= 126 keeps 2^k and 2^-k normal; NaN / inf give k = -114), and 2^k.
HK_DEVICE int fp16_scale_exp(float amax) {
  const int k = 141 - (int)(float_to_bits(amax) >> 23);
  return k > 126 ? 126 : k;
}
HK_DEVICE float pow2(int k) { return bits_to_float((uint32_t)(k + 127) << 23); }  // k in [-126, 127]

// a = a0 + a1 + ra and b = b0 + b1 + rb, a0 / a1 / b0 / b1 fp16 rounded to nearest (the first rounding
// of a float, then of its exact remainder: 22 significand bits, |ra| <= 2^-23 |a| while |a| stays
// within fp16's normal range); p[i] packs (a_i, b_i), a_i in the low half, as mma fragments hold two
// adjacent k.
HK_DEVICE void split2(float a, float b, uint32_t (&p)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const half_t ha = to_half(a), hb = to_half(b);
    p[i] = ha.bits | (uint32_t)hb.bits << 16;
    a -= to_float(ha);
    b -= to_float(hb);
  }
}

// Split rows: a float32 matrix [R][K] as R rows of round_up(K, 64) 32-bit slots. Each 64-slot block
// (256 bytes) holds its 64 values scaled by 2^k (fp16_scale_exp of their largest magnitude) as two
// fp16 terms (split2): plane 0's 64 halves, then plane 1's; zeros past K. Beside them, each block's
// 2^-k: [R][round_up(K, 64) / 64] floats. SplitMath<..., true> reads its tokens so, split once per
// call instead of once per stage of every item that reads them. One 32-lane warp writes a block,
// lane l values 2l and 2l + 1 (wgmma builds only, where warps have 32 lanes).
template <int kLanes = kWaveSize>
HK_DEVICE void split_block_store(float a, float b, uint32_t* block, float* scale) {
  static_assert(kLanes == 32, "a block is 32 lanes x 2 values");
  float amax = fmaxf(fabsf(a), fabsf(b));
#pragma unroll
  for (int o = 1; o < kLanes; o *= 2) amax = fmaxf(amax, shfl_xor(amax, o));
  const int k = fp16_scale_exp(amax);
  const float sc = pow2(k);
  uint32_t q[2];
  split2(a * sc, b * sc, q);
  const int l = lane_id();
  block[l] = q[0];
  block[kLanes + l] = q[1];
  if (l == 0) *scale = pow2(-k);
}

// fp32 on wgmma (hipkern/wgmma.h; only where kWgmma), float32-accurate through exact scaling and
// fp16 splits. Per stage, each weight row and each token row is scaled by a power of two (exact) that
// brings its largest magnitude in the stage's kBK values to [2^14, 2^15), then split into two fp16
// terms (split2); W X is then W0 X0 + W0 X1 + W1 X0 on the tensor cores (fp16 x fp16 products are
// exact in their fp32 accumulators). What is dropped (W1 X1 and the remainders) is ~2^-22 of |W| |X|
// per product, and values far below their row's largest lose only what is far below its products
// (fp16 subnormals). The tensor cores' fp32 sums truncate, so a stage's products build up in fresh
// accumulators, W0 X0 in one and the two smaller ones in another, which are then unscaled and added
// to acc in round-to-nearest: the error grows as fp32 FMAs' does, not with the number of wgmma
// (measured against float64: smaller than the float32 FMA path's).
// Weight stages hold float rows as SimtMath's (kLd = BK + 8 floats: each warp's 8-byte A-fragment
// loads hit every bank twice, the minimum). Warp w loads the A fragments of rows 16w .. 16w + 15 of
// the whole stage, finds each row's largest magnitude with the 3 other lanes holding the row, and
// splits them in registers, k step s + 1 while step s's products run. The tensor cores read B from
// two fp16 planes of 128-byte-swizzled atoms followed by each token row's 2^-k: with PreSplit, the
// stage itself (the loader puts split rows' chunks and scales there: at_split(), at_scale());
// otherwise scratch, where the block first scales and splits the stage's float token rows (and a
// barrier, every stage of every item: a quarter of the time at 128 tokens of the Mixtral-like
// shapes, hence PreSplit). Warpgroup g (4 warps) owns rows 64g .. 64g + 63 against all kToks token
// rows. The accumulators have mma.sync's C layout per warp, as WgmmaMath's, so Acc, zero() and
// store() are MmaMath's.
template <int WG, int BM, int BK, int Stages, bool PreSplit>
struct SplitMath : MmaMath<half_t, 4 * WG, 1, BM, BK, Stages> {
  typedef MmaMath<half_t, 4 * WG, 1, BM, BK, Stages> Base;
  using typename Base::Acc;
  using Base::kWaves, Base::kRows, Base::kToks, Base::kRedLd;
  static constexpr int kLd = BK + 8;  // floats
  typedef Sw128<half_t, BK> L;
  static constexpr int kPlane = kToks * BK;         // fp16 elements of one plane
  static constexpr int kScaleAt = 2 * kPlane * 2;   // bytes: the token rows' 2^-k after the planes
  static constexpr int kSplitBytes = kScaleAt + kToks * 4;
  // The split planes (without PreSplit); at least as large as the partials tile, which gemm.h then
  // keeps here (between items).
  static constexpr int kScratch =
      round_up(!PreSplit && kSplitBytes > kRows * kRedLd * 4 ? kSplitBytes : kRows * kRedLd * 4, 1024);
  static_assert(BK == 64 && kPlane * 2 % 1024 == 0, "one 128-byte atom per token row and plane");
  static_assert(PreSplit || kToks * (BK / 8) % (kWaves * kWaveSize) == 0,
                "every lane in every round of the token split");
  static_assert(!PreSplit || (kSplitBytes <= kToks * kLd * 4 && kToks * kLd * 4 % 1024 == 0),
                "a token stage holds the planes and scales, in whole 1024-byte atoms");
  // The weight stages are read by ordinary loads, the planes through the async proxy: those built
  // here are fenced here, the loader's copies (PreSplit) by gemm.h.
  static constexpr bool kAsyncReads = PreSplit, kPreSplit = PreSplit, kPrefetch = false, kStepPairs = false;
  static HK_DEVICE int at(int r, int c) { return r * kLd + c * 4; }
  // Floats from a token stage's start: chunk c (plane c / 8) of split row r, and the row's scale.
  static HK_DEVICE int at_split(int r, int c) { return (c / 8 * kPlane + L::at(r, c % 8)) / 2; }
  static HK_DEVICE int at_scale(int r) { return kScaleAt / 4 + r; }

  // The stage's float token rows into planes and tscale (every thread; ends with a barrier).
  static HK_DEVICE void split_tokens(const float* x_s, half_t* planes, float* tscale) {
    // Padding rows too (only their own columns see them), 8 values a thread; a row's
    // BK / 8 = 8 chunks are 8 adjacent lanes.
    for (int i = threadIdx.x; i < kToks * (BK / 8); i += kWaves * kWaveSize) {
      const int m = i / (BK / 8), c = i % (BK / 8);
      const float4 u = *reinterpret_cast<const float4*>(x_s + m * kLd + 8 * c);
      const float4 v = *reinterpret_cast<const float4*>(x_s + m * kLd + 8 * c + 4);
      float amax = fmaxf(fmaxf(fmaxf(fabsf(u.x), fabsf(u.y)), fmaxf(fabsf(u.z), fabsf(u.w))),
                         fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
#pragma unroll
      for (int o = 1; o < BK / 8; o *= 2) amax = fmaxf(amax, shfl_xor(amax, o));
      const int k = fp16_scale_exp(amax);
      const float sc = pow2(k);
      if (c == 0) tscale[m] = pow2(-k);
      uint32_t q[4][2];
      split2(u.x * sc, u.y * sc, q[0]);
      split2(u.z * sc, u.w * sc, q[1]);
      split2(v.x * sc, v.y * sc, q[2]);
      split2(v.z * sc, v.w * sc, q[3]);
#pragma unroll
      for (int t = 0; t < 2; ++t)
        *reinterpret_cast<uint4*>(planes + t * kPlane + L::at(m, c)) = make_uint4(q[0][t], q[1][t], q[2][t], q[3][t]);
    }
    fence_async_shared();
    __syncthreads();
  }

  static HK_DEVICE void step(Acc& acc, const float* w_s, const float* x_s, const int*, int, unsigned char* scratch) {
    unsigned char* split = PreSplit ? reinterpret_cast<unsigned char*>(const_cast<float*>(x_s)) : scratch;
    half_t* planes = reinterpret_cast<half_t*>(split);
    const float* tscale = reinterpret_cast<const float*>(split + kScaleAt);
    if constexpr (!PreSplit) split_tokens(x_s, planes, reinterpret_cast<float*>(split + kScaleAt));

    // This warp's A values of the whole stage (mma.h's m16n8k16 layout: q = 0..3 at row + 8 (q % 2),
    // k + 8 (q / 2)) and its two rows' scales; the 4 lanes l / 4 hold the same two rows.
    constexpr int kS = BK / 16;
    const int l = lane_id();
    const float* w = w_s + (16 * (int)(threadIdx.x / kWaveSize) + l / 4) * kLd + 2 * (l % 4);
    float2 f[kS][4];
    float rmax[2] = {0.f, 0.f};
#pragma unroll
    for (int s = 0; s < kS; ++s)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        f[s][q] = *reinterpret_cast<const float2*>(w + (q % 2) * 8 * kLd + (q / 2) * 8 + 16 * s);
        rmax[q % 2] = fmaxf(rmax[q % 2], fmaxf(fabsf(f[s][q].x), fabsf(f[s][q].y)));
      }
    int rk[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rmax[h] = fmaxf(rmax[h], shfl_xor(rmax[h], 1));
      rmax[h] = fmaxf(rmax[h], shfl_xor(rmax[h], 2));
      rk[h] = fp16_scale_exp(rmax[h]);
    }
    const float rs[2] = {pow2(rk[0]), pow2(rk[1])};
    auto frag = [&](uint32_t (&a)[2][4], int s) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint32_t t[2];
        split2(f[s][q].x * rs[q % 2], f[s][q].y * rs[q % 2], t);
        a[0][q] = t[0];
        a[1][q] = t[1];
      }
    };
    // W0 X0 into d, W0 X1 + W1 X0 into e: fresh accumulators, set by their first products (add = 0).
    float d[kToks / 2], e[kToks / 2];
    const uint64_t p0 = wgmma_desc_sw128(planes, L::kSbo), p1 = wgmma_desc_add(p0, kPlane * sizeof(half_t));
    auto mma = [&](const uint32_t (&a)[2][4], int s) {
      const uint64_t b0 = wgmma_desc_add(p0, L::k16(s) * sizeof(half_t));
      const uint64_t b1 = wgmma_desc_add(p1, L::k16(s) * sizeof(half_t));
      Wgmma<half_t, kToks>::mma_rk(d, a[0], b0, s > 0);
      Wgmma<half_t, kToks>::mma_rk(e, a[0], b1, s > 0);
      Wgmma<half_t, kToks>::mma_rk(e, a[1], b0);
    };
    uint32_t a[2][2][4];  // k step s + 1's fragments are split while step s's products run
    frag(a[0], 0);
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      wgmma_fence();
      mma(a[s % 2], s);
      wgmma_commit();
      if (s + 1 < kS) {
        wgmma_wait<1>();  // step s - 1, which read the other set, is done
        frag(a[(s + 1) % 2], s + 1);
      }
    }
    wgmma_wait<0>();  // the planes and the stage are free again at the loop's next barrier
    const float ru[2] = {pow2(-rk[0]), pow2(-rk[1])};
#pragma unroll
    for (int j = 0; j < kToks / 8; ++j) {
      const float2 ts = *reinterpret_cast<const float2*>(tscale + 8 * j + 2 * (l % 4));
#pragma unroll
      for (int i = 0; i < 4; ++i)
        acc.c[j][i] += (d[4 * j + i] + e[4 * j + i]) * ru[i / 2] * (i % 2 ? ts.y : ts.x);
    }
  }
};

}  // namespace fused_moe
}  // namespace hk
