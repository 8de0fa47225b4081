// Fused MoE: out[t] = sum_j w[t, j] * w2[e] (act(w1[e, :I] x_t) * (w1[e, I:] x_t)), e = ids[t, j].
//
// Variant "grouped": after moe_sorting (its own module, called first by the op) three launches, four
// with split-row tiles (for at most kRoutePairs pairs no moe_sorting: each block of both GEMMs groups the
// pairs by expert itself, route.h, where the tiles leave room for its table):
//   split_rows_kernel   (float32 tiles with kPreSplit only) hidden states as split rows (math.h)
//   gemm_kernel<Gated>  inter[p] = act(gate) * up for every routed pair p (rounded to T; split rows
//                       with kPreSplit)
//   gemm_kernel<down>   y[p] = w[p] * (w2[e] inter[p]), fp32
//   combine_kernel      out[t] = sum over t's routed pairs of y, in slot order (deterministic: no
//                       float atomics anywhere)
// Variant "decode" (decode.h): the same work, routing and combine included, in one launch.
// Variant "gemv" (gemv.h): for a few pairs, matrix-vector products streaming the weights into
// registers, the combine in the down kernel; two launches, no sorting.
// Variant "gemv_mma" (gemv.h, fp16/bf16): "gemv" with the pairs of one expert computed together on
// matrix cores in both launches, for routings that pile pairs onto experts.
// gemm.h has the work plan and pipeline (gemm_launch.h its launch), math.h the arithmetic: matrix cores
// for fp16/bf16, FMAs for fp32. One module per (dtype, block_m).
#include <type_traits>

#include "decode.h"
#include "gemv.h"

#ifndef HK_DTYPE
#error "build with -DHK_DTYPE=<hk::DType> and -DHK_BLOCK_M=<8|16|32|64|128>"
#endif

namespace {
typedef typename hk::elem_of<HK_DTYPE>::type T;
constexpr int BM = HK_BLOCK_M;
static_assert(BM == 8 || BM == 16 || BM == 32 || BM == 64 || BM == 128, "block_m");

// Tiles per block_m and GEMM (see math.h), for NVIDIA; Gate = the gate/up GEMM, Down = the second.
// Each pipeline stage moves >= 16 KB of weights (a stage costs a barrier and a fixed run of
// instructions, so smaller stages leave the loop latency-bound), and the blocks resident on an SM
// keep >= 64 KB in flight. Small blocks are decode: items must stay small so that every SM gets
// some, so the gate GEMM takes 16 or 32 rows and a wide k-stage split over the waves; the down GEMM
// (reduction over I, often 256 there) takes 64 rows instead. Larger blocks give each wave its own
// 16 rows and all token tiles. CDNA (wave64, 64 KB of LDS, one synchronous stage): 4 waves and
// k-stages that fit, fp32 on one wave.
using hk::fused_moe::MmaMath;
using hk::fused_moe::SimtMath;
using hk::fused_moe::SplitMath;
using hk::fused_moe::WgmmaMath;
constexpr bool kNv = hk::kAsyncCopy;
// DownShort: the down GEMM's tile where its reduction (inter_dim) is at most kShortK. There an item
// is only two k-stages of 128, so its fixed costs (epilogue, next item's bind) weigh: 128 rows in
// k-stages of 64 (three deep) make items of twice the weight bytes. Where an m-block's token rows are
// many (skewed routing), that also halves their share of the copies. H100, D 7168, E 256, top-8
// (NOTES.md, 2026-11-25): at I = 256, 32 tokens, block_m 32 2.5 % faster uniform, 8 % skewed; at
// I = 512 and 1024 1.2-2 % slower uniform, hence 256.
constexpr int kShortK = 256;
// Where the build has wgmma (sm_90a), block_m 32 / 64 / 128 run their 64 / 128 / 128 rows as
// warpgroups on it: 2.3-2.9x less compute per stage than mma.sync from 32 tokens up
// (experiments/wgmma_stage.cu), and no operand fragments through the load/store pipe the copies use.
// So does the short down tile at block_m 16 (H100: case 25 441.0 -> 437.1 us against mma.sync).
// Lag 1 (block_m 64 / 128, whose stages carry the most products): a stage's wgmma still runs while the
// next stage starts (math.h), in one stage more than S (mma.sync keeps S). block_m 64 runs 4 (was 3)
// (H100, NOTES.md 2026-11-26: -12..15 % on the skewed 128-token cases). block_m 128 runs 5: its
// epilogue takes the two warpgroups' rows in two passes (Passes), so its partials tile is half as
// large and a fifth stage fits (NOTES.md 2026-11-26 (2): -3..6 % on its 128-token cases, Mixtral 8x7B
// 512 tokens -4 %). block_m 128 also counts its copies on mbarriers (CopyBars, math.h; H100,
// NOTES.md 2026-11-27 (3): 0.1-2.2 % faster on every 128-token case measured); at block_m 64 that
// was 3 % faster skewed but 1-4 % slower on Mixtral 8x7B 512 tokens, so block_m 64 keeps the stage
// barrier. block_m 128's k-stages of 64 (one 128-byte atom a row) also let both GEMMs copy a stage's
// weights as one tensor-map box (gemm.h; the gated one's: -1.5 % on the uniform 128-token cases).
template <typename U, int WG, int B, int BK, int S, int WR, int Lag = 0, int Passes = 1, bool CopyBars = false>
using Matrix = std::conditional_t<hk::kWgmma, WgmmaMath<U, WG, B, BK, S + Lag, Lag, Passes, CopyBars>,
                                  MmaMath<U, WR, 1, B, BK, S>>;
template <typename U, int B> struct Tiles;
template <typename U> struct Tiles<U, 8> {
  typedef MmaMath<U, 1, 4, 8, 512, 4> Gate;
  typedef MmaMath<U, 4, 1, 8, 128, 4> Down, DownShort;
};
template <typename U> struct Tiles<U, 16> {
  typedef MmaMath<U, 2, 2, 16, 256, 4> Gate;
  typedef MmaMath<U, 4, 1, 16, 128, 4> Down;
  typedef std::conditional_t<kNv, Matrix<U, 2, 16, 64, 3, 8>, Down> DownShort;
};
template <typename U> struct Tiles<U, 32> {
  typedef Matrix<U, 1, 32, 128, 3, 4> Gate, Down;
  typedef std::conditional_t<kNv, Matrix<U, 2, 32, 64, 3, 8>, Down> DownShort;
};
template <typename U> struct Tiles<U, 64> { typedef Matrix<U, 2, 64, 128, 3, kNv ? 8 : 4, 1> Gate, Down, DownShort; };
template <typename U> struct Tiles<U, 128> {
  typedef Matrix<U, 2, 128, 64, 4, kNv ? 8 : 4, 1, 2, true> Gate, Down, DownShort;
};
constexpr int kSimtWK = kNv ? 4 : 1, kSimtRPL = kNv ? 2 : 1;
template <> struct Tiles<float, 8> {
  typedef SimtMath<1, kSimtWK, 8, kNv ? 256 : 128, 4> Gate;
  typedef SimtMath<kSimtRPL, kSimtWK, 8, 128, 4> Down, DownShort;
};
template <> struct Tiles<float, 16> {
  typedef SimtMath<1, kSimtWK, 16, kNv ? 256 : 128, 3> Gate;
  typedef SimtMath<kSimtRPL, kSimtWK, 16, 128, 4> Down, DownShort;
};
template <> struct Tiles<float, 32> { typedef SimtMath<kSimtRPL, kSimtWK, 32, 64, 3> Gate, Down, DownShort; };
// float32 at block_m 64 on wgmma where the build has it (SplitMath: scaled fp16 splits, three products
// a k step, float32 accuracy; 128 rows, so that each weight byte brings fewer token bytes through L2):
// 2.3x CUDA cores' speed where the arithmetic dominates (the 128-token and larger cases), with the
// tokens split once per call (split rows). At block_m 32 (splitting per stage then) it was 5-10 %
// slower than SimtMath on the bandwidth-bound shapes, so those keep CUDA cores / VALU, as does every
// target without wgmma.
template <> struct Tiles<float, 64> {  // SimtMath: 2 rows a lane spill
  typedef std::conditional_t<hk::kWgmma, SplitMath<2, 64, 64, 3, true>, SimtMath<1, kSimtWK, 64, 64, 3>> Gate, Down,
      DownShort;
};
typedef typename Tiles<T, BM>::Gate M1;
typedef typename Tiles<T, BM>::Down M2;
typedef typename Tiles<T, BM>::DownShort M2s;  // M2 where inter_dim <= kShortK (grouped variant only)
static_assert(M1::kPreSplit == M2::kPreSplit && M2s::kPreSplit == M2::kPreSplit,
              "the gated GEMM writes what the down GEMM reads");
constexpr bool kPreSplit = M1::kPreSplit;
// The decode variant has no pass before its GEMMs: SplitMath splits its tokens per stage there. Its
// blocks also hold the routing table, for which the lagged wgmma's extra stage leaves no room.
template <typename M> struct InStep { typedef M type; };
template <int WG, int B, int BK, int S> struct InStep<SplitMath<WG, B, BK, S, true>> {
  typedef SplitMath<WG, B, BK, S, false> type;
};
template <typename U, int WG, int B, int BK, int S, int Lag, int P, bool CB>
struct InStep<WgmmaMath<U, WG, B, BK, S, Lag, P, CB>> {
  typedef WgmmaMath<U, WG, B, BK, S - Lag, 0, P> type;
};
typedef typename InStep<M1>::type D1;
typedef typename InStep<M2>::type D2;
// The host sizes both variants' plans (n_tiles) from M1's and M2's columns per item (M2s' for the
// grouped variant's short down GEMM).
template <typename D, typename M, bool Gated>
constexpr bool kSameCols =
    hk::fused_moe::GemmCfg<T, D, BM, Gated>::kCols == hk::fused_moe::GemmCfg<T, M, BM, Gated>::kCols;
static_assert(kSameCols<D1, M1, true> && kSameCols<D2, M2, false>,
              "the decode variant's tiles cover the grouped ones' columns");
constexpr bool kHasDecode = BM <= hk::fused_moe::kDecodeMaxBlockM;

// The decode variant where this block_m has one (templates, so that the other branch is never
// instantiated).
template <bool kOn = kHasDecode>
int decode_workspace_here(int device, int64_t* partial_floats, int64_t* counter_ints) {
  *partial_floats = *counter_ints = 0;
  if constexpr (kOn) return hk::fused_moe::decode_workspace<T, D1, D2, BM>(device, partial_floats, counter_ints);
  return 0;
}
template <bool kOn = kHasDecode>
int launch_decode_here(const hk::fused_moe::GemmParams& g1, const hk::fused_moe::GemmParams& g2,
                       const hk::fused_moe::DecodeArgs& d, float* partials, int* counters, int device, hipStream_t s) {
  if constexpr (kOn) return hk::fused_moe::launch_decode<T, D1, D2, BM>(g1, g2, d, partials, counters, device, s);
  return hk::set_invalid("fused_moe: the decode variant takes block_m up to 64", __FILE__, __LINE__);
}

constexpr int kCombineThreads = 256, kSplitThreads = 256;

// A grid for n items of `per` a block, at most `most` blocks (the kernels' grid-stride loops take the rest).
dim3 capped_grid(int64_t n, int64_t per, int64_t most) {
  const int64_t want = (n + per - 1) / per;
  return dim3((unsigned)(want < most ? want : most));
}

// hidden [rows][dim] (float) as split rows xs / scales (math.h), a warp per 64-column block. The gated
// GEMM may be scheduled at once (it waits for this grid's end, which implies the previous kernel's:
// sorting, whose outputs its plan reads, or the caller's, whose ids it routes). This grid waits for the
// previous kernel before its first store: `inter` may reuse memory that sorting's kernels still read
// (its workspace, freed to torch's allocator in stream order).
template <typename U>
__global__ __launch_bounds__(kSplitThreads) void split_rows_kernel(const U* hidden, int64_t rows, int dim,
                                                                   uint32_t* xs, float* scales) {
  hk::griddep_launch_dependents();
  hk::griddep_wait();
  const int blocks = (dim + 63) / 64, c = 2 * hk::lane_id();
  const int64_t n = rows * blocks, warps = (int64_t)gridDim.x * (kSplitThreads / 32);
  for (int64_t i = ((int64_t)blockIdx.x * kSplitThreads + threadIdx.x) / 32; i < n; i += warps) {
    const int64_t r = i / blocks, col = (i % blocks) * 64 + c;
    const float2 v = col < dim ? *reinterpret_cast<const float2*>(hidden + r * dim + col) : make_float2(0.f, 0.f);
    hk::fused_moe::split_block_store(v.x, v.y, xs + i * 64, scales + i);
  }
}

// Its launch where the tiles read split rows (a template: no kernel in the other modules).
template <bool kOn = kPreSplit>
int launch_split_rows(const void* hidden, int64_t rows, int dim, const void* xs, const float* scales, int sms,
                      hipStream_t s) {
  if constexpr (kOn) {
    const dim3 grid = capped_grid(rows * ((dim + 63) / 64), kSplitThreads / 32, 8ll * sms);  // a warp per 64 columns
    HK_CHECK(hk::launch_dependent(split_rows_kernel<T>, grid, dim3(kSplitThreads), 0, s, static_cast<const T*>(hidden),
                                  rows, dim,
                                  static_cast<uint32_t*>(const_cast<void*>(xs)), const_cast<float*>(scales)));
  }
  return 0;
}

// The `inter` buffer of hk_fused_moe: the intermediate [num_pairs][inter_dim] of T; for the grouped
// variant with kPreSplit, the intermediate and the hidden states as split rows (row strides
// inter_stride / x_stride 32-bit slots) with their scales, at these byte offsets (256-byte aligned).
struct InterLayout {
  int inter_stride, x_stride;
  int64_t inter_scale, x, x_scale, bytes;
  InterLayout(int64_t tokens, int64_t pairs, int dim, int inter_dim, bool split)
      : inter_stride(hk::fused_moe::round_up(inter_dim, 64)), x_stride(hk::fused_moe::round_up(dim, 64)) {
    auto up = [](int64_t b) { return (b + 255) / 256 * 256; };
    inter_scale = x = x_scale = bytes = pairs * inter_dim * (int64_t)sizeof(T);
    if (!split) return;
    inter_scale = up(pairs * inter_stride * 4);
    x = up(inter_scale + pairs * (inter_stride / 64) * 4);
    x_scale = up(x + tokens * x_stride * 4);
    bytes = x_scale + tokens * (x_stride / 64) * 4;
  }
};

__global__ __launch_bounds__(kCombineThreads) void combine_kernel(const float* y, const int32_t* ids,
                                                                  const int32_t* expert_map, int num_experts,
                                                                  int num_local, T* out, int64_t num_tokens, int topk,
                                                                  int dim) {
  // y comes from the down GEMM: each thread waits for it once its first ids are in (the routing is the
  // caller's, complete before this call), so their round trip overlaps the GEMM's tail.
  hk::fused_moe::combine_rows<T, kCombineThreads>(y, ids, expert_map, num_experts, num_local, out, num_tokens, topk,
                                                  dim, [] {
    hk::griddep_wait();
    hk::fused_moe::trace_point(6);
  });
  hk::fused_moe::trace_point(7);
}
}  // namespace

// Variants: kGrouped, the chain moe_sorting (its own module, called first; or, given no sorting outputs,
// routing in the GEMM blocks) -> [split rows] -> gated GEMM -> down GEMM -> combine; kDecode, one launch
// that also routes and combines (decode.h), for at most kDecodePairs pairs (T * topk) and block_m <=
// kDecodeMaxBlockM; kGemv, two matrix-vector launches (gemv.h) for at most kGemvPairs pairs, any block_m;
// kGemvMma, the same with an expert's pairs computed together on matrix cores in both launches (16-bit
// types). kDecode and the gemv variants read no sorting output and use neither y nor the workspace (they
// may be null).
enum Variant { kGrouped = 0, kDecode = 1, kGemv = 2, kGemvMma = 3 };

// Bytes of hk_fused_moe's `inter` for this shape and variant (InterLayout).
HK_EXPORT int hk_fused_moe_inter_bytes(int num_tokens, int topk, int dim, int inter_dim, int variant,
                                       int64_t* bytes) {
  HK_REQUIRE(num_tokens >= 0 && topk >= 1 && dim >= 1 && inter_dim >= 1 && dim < (1 << 30) && inter_dim < (1 << 30));
  *bytes = InterLayout(num_tokens, (int64_t)num_tokens * topk, dim, inter_dim, kPreSplit && variant == kGrouped).bytes;
  return 0;
}

// The most routed pairs (T * topk) for which the grouped variant's GEMMs route in their own blocks on
// `device` (route.h; hk_fused_moe with no sorting outputs), or 0 where this module's tiles, or the
// device's shared memory per block, have no room for the routing table.
constexpr bool kCanRoute = hk::fused_moe::GemmCfg<T, M1, BM, true>::kCanRoute &&
                           hk::fused_moe::GemmCfg<T, M2, BM, false>::kCanRoute &&
                           hk::fused_moe::GemmCfg<T, M2s, BM, false>::kCanRoute;
int route_pairs_on(int device) {
  using hk::fused_moe::routes_on;
  const bool ok = routes_on<T, M1, BM, true>(device) && routes_on<T, M2, BM, false>(device) &&
                  routes_on<T, M2s, BM, false>(device);
  return ok ? hk::fused_moe::kRoutePairs : 0;
}
HK_EXPORT int hk_fused_moe_route_pairs(int device) { return route_pairs_on(device); }

// Workspace of hk_fused_moe on `device` (the same for any shape and variant): floats of split-K
// partials and ints of counters (which must be zero before the first call; every call leaves them zero).
HK_EXPORT int hk_fused_moe_workspace(int device, int64_t* partial_floats, int64_t* counter_ints) {
  HK_TRY(hk::use_device(device));
  int64_t f[4], c[4];
  HK_TRY((hk::fused_moe::workspace<T, M1, BM, true>(device, &f[0], &c[0])));
  HK_TRY((hk::fused_moe::workspace<T, M2, BM, false>(device, &f[1], &c[1])));
  HK_TRY((hk::fused_moe::workspace<T, M2s, BM, false>(device, &f[2], &c[2])));
  HK_TRY(decode_workspace_here(device, &f[3], &c[3]));
  *partial_floats = *counter_ints = 0;
  for (int i = 0; i < 4; ++i) {
    if (f[i] > *partial_floats) *partial_floats = f[i];
    if (c[i] > *counter_ints) *counter_ints = c[i];
  }
  return 0;
}

// The grouped variant's three GEMMs on `device` (gated, down, down where inter_dim <= kShortK), 3
// ints each (gemm_layout: grid, output columns per item, split-2 parts summed in cluster pairs), as
// launched with moe_sorting's outputs (routed 0) or routing in their blocks (1), for tests that aim a
// plan at a split of 2.
template <int kRows>
int gemm_layouts(int device, int32_t* out) {
  using hk::fused_moe::gemm_layout;
  HK_TRY((gemm_layout<T, M1, BM, true, kRows>(device, out)));
  HK_TRY((gemm_layout<T, M2, BM, false, kRows>(device, out + 3)));
  return gemm_layout<T, M2s, BM, false, kRows>(device, out + 6);
}
template <bool kOn = kCanRoute>
int routed_layouts(int device, int32_t* out) {
  if constexpr (kOn) return gemm_layouts<hk::fused_moe::kOwnRoute>(device, out);
  return hk::set_invalid("fused_moe: this module's GEMMs do not route in their blocks", __FILE__, __LINE__);
}
HK_EXPORT int hk_fused_moe_gemms(int device, int routed, int32_t* out) {
  HK_TRY(hk::use_device(device));
  if (!routed) return gemm_layouts<hk::fused_moe::kSortedRows>(device, out);
  HK_REQUIRE(route_pairs_on(device) > 0);
  return routed_layouts(device, out);
}

// x [T][D], w1 [E_local][2I][D], w2 [E_local][D][I], topk_weights / topk_ids [T][topk] (ids index
// E_global experts; expert_map [E_global] or null), sorted_ids [max_padded] / expert_ids
// [max_padded / BM] / num_post [1] from moe_sorting with block_m = BM (kGrouped only; null for
// kDecode and the gemv variants, and for kGrouped where both GEMMs route in their blocks instead: at
// most hk_fused_moe_route_pairs() pairs, max_padded 0), inter of hk_fused_moe_inter_bytes bytes (which
// may exceed [T * topk][I] elements; no memory the previous kernel on the stream still uses), y [T *
// topk][D] (fp32), partials / counters as hk_fused_moe_workspace says, out [T][D]. D and I multiples of
// 16 bytes' worth of elements, pointers 16-byte aligned. activation: 0 silu, 1 gelu. Returns 0 or an
// error code (hk_last_error()).
HK_EXPORT int hk_fused_moe(const void* x, const void* w1, const void* w2, const float* topk_weights,
                           const int32_t* topk_ids, const int32_t* expert_map, const int32_t* sorted_ids,
                           const int32_t* expert_ids, const int32_t* num_post, void* inter, float* y,
                           float* partials, int* counters, void* out,
                           int num_tokens, int topk, int num_experts, int num_local_experts, int dim, int inter_dim,
                           int max_padded, int activation, int variant, int device, void* stream) {
  constexpr int kVec = 16 / (int)sizeof(T);
  HK_REQUIRE(num_tokens >= 0 && topk >= 1 && (int64_t)num_tokens * topk < (1ll << 30));
  HK_REQUIRE(num_experts >= 1 && num_local_experts >= 1);
  HK_REQUIRE(dim >= kVec && dim % kVec == 0 && inter_dim >= kVec && inter_dim % kVec == 0);
  HK_REQUIRE(dim < (1 << 30) && inter_dim < (1 << 30));  // tile counts are rounded up from them in int
  HK_REQUIRE(activation == hk::fused_moe::kSilu || activation == hk::fused_moe::kGelu);
  const bool gemv = variant == kGemv || (variant == kGemvMma && sizeof(T) == 2);
  HK_REQUIRE(variant == kGrouped || (variant == kDecode && kHasDecode) || gemv);
  const bool decode = variant == kDecode;
  const bool routed = variant == kGrouped && sorted_ids == nullptr;  // both GEMMs route in their blocks
  HK_REQUIRE(decode ? (int64_t)num_tokens * topk <= hk::fused_moe::kDecodePairs
             : gemv ? (int64_t)num_tokens * topk <= hk::fused_moe::kGemvPairs
             : routed ? (int64_t)num_tokens * topk <= hk::fused_moe::kRoutePairs && max_padded == 0
                      : max_padded >= 0 && max_padded % BM == 0);
  if (num_tokens == 0) return 0;
  HK_TRY(hk::use_device(device));
  // Routing in the blocks (the decode kernel's, or the grouped GEMMs'): scratch for up to kRouteMaxExperts.
  HK_REQUIRE(!(decode || routed) || num_experts <= hk::fused_moe::kRouteMaxExperts);
  HK_REQUIRE(!routed || num_tokens * topk <= route_pairs_on(device));
  hipStream_t s = static_cast<hipStream_t>(stream);
  if (gemv) {
    const hk::fused_moe::GemvArgs a{x,    w1,         w2,   topk_weights, topk_ids,          expert_map, inter,
                                    out,  num_tokens, topk, num_experts,  num_local_experts, dim,        inter_dim,
                                    activation};
    return hk::fused_moe::launch_gemv<T>(a, variant == kGemvMma, s);
  }
  const int num_pairs = num_tokens * topk;
  const int max_mblocks = decode ? hk::fused_moe::kDecodePairs : routed ? num_pairs : max_padded / BM;
  constexpr int kCols1 = hk::fused_moe::GemmCfg<T, M1, BM, true>::kCols;
  const bool short_down = !decode && inter_dim <= kShortK;  // the down GEMM on M2s
  const int cols2 = short_down ? hk::fused_moe::GemmCfg<T, M2s, BM, false>::kCols
                               : hk::fused_moe::GemmCfg<T, M2, BM, false>::kCols;
  // Both GEMMs' work items (m-blocks x n-tiles), and the item loops' steps past them, in int (gemm.h plan).
  HK_REQUIRE((int64_t)max_mblocks * ((inter_dim + kCols1 - 1) / kCols1) < (1ll << 30));
  HK_REQUIRE((int64_t)max_mblocks * ((dim + cols2 - 1) / cols2) < (1ll << 30));

  hk::fused_moe::GemmParams g1{};
  g1.sorted_ids = sorted_ids;
  g1.expert_ids = expert_ids;
  g1.num_post = num_post;
  if (routed) {
    g1.route_ids = topk_ids;
    g1.route_map = expert_map;
    g1.route_experts = num_experts;
  }
  g1.num_pairs = num_pairs;
  g1.max_mblocks = max_mblocks;
  g1.num_experts = num_local_experts;
  g1.activation = activation;
  g1.partials = partials;
  g1.counters = counters;
  hk::fused_moe::GemmParams g2 = g1;

  g1.x = x;  // gate/up: inter = act(w1[:I] x) * (w1[I:] x)
  g1.x_stride = dim;
  g1.x_div = topk;
  g1.w = w1;
  g1.w_stride_e = 2ll * inter_dim * dim;
  g1.K = dim;
  g1.N = inter_dim;
  g1.n_tiles = (inter_dim + kCols1 - 1) / kCols1;
  g1.out = inter;
  g1.out_stride = inter_dim;

  g2.x = inter;  // down: y = w * (w2 inter)
  g2.x_stride = inter_dim;
  g2.x_div = 1;
  g2.w = w2;
  g2.w_stride_e = (int64_t)dim * inter_dim;
  g2.K = inter_dim;
  g2.N = dim;
  g2.n_tiles = (dim + cols2 - 1) / cols2;
  g2.out = y;
  g2.out_stride = dim;
  g2.topk_weights = topk_weights;
  if (kPreSplit && variant == kGrouped) {  // split rows: blocks of 64 columns, scales beside them
    const InterLayout lay(num_tokens, num_pairs, dim, inter_dim, true);
    unsigned char* base = static_cast<unsigned char*>(inter);
    g1.x = base + lay.x;
    g1.x_stride = lay.x_stride;
    g1.x_scale = reinterpret_cast<const float*>(base + lay.x_scale);
    g1.out_stride = lay.inter_stride;
    g1.out_scale = reinterpret_cast<float*>(base + lay.inter_scale);
    g2.x_stride = lay.inter_stride;
    g2.x_scale = g1.out_scale;
  }

  if (decode) {
    hk::fused_moe::DecodeArgs d{topk_ids, expert_map, y, out, nullptr, num_tokens, topk, num_experts, num_local_experts,
                                dim};
    return launch_decode_here(g1, g2, d, partials, counters, device, s);
  }
  int sms = 0;
  HK_CHECK(hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, device));
  HK_TRY(launch_split_rows(x, num_tokens, dim, g1.x, g1.x_scale, sms, s));
  HK_TRY((hk::fused_moe::launch_gemm<T, M1, BM, true>(g1, device, s)));
  if (short_down)
    HK_TRY((hk::fused_moe::launch_gemm<T, M2s, BM, false>(g2, device, s)));
  else
    HK_TRY((hk::fused_moe::launch_gemm<T, M2, BM, false>(g2, device, s)));
  const int64_t quads = (int64_t)num_tokens * (dim / 4);
  HK_CHECK(hk::launch_dependent(combine_kernel, capped_grid(quads, kCombineThreads, 16ll * sms), dim3(kCombineThreads),
                                0, s, (const float*)y, topk_ids, expert_map, num_experts, num_local_experts,
                                static_cast<T*>(out), (int64_t)num_tokens, topk, dim));
  return 0;
}

#if defined(HK_MOE_TRACE) && defined(HK_PLATFORM_CUDA)
// Diagnostic builds only (see decode.h): the decode kernel's phase times of its last call, n blocks x
// 8 u64 (%globaltimer ns) into host memory.
HK_EXPORT int hk_fused_moe_trace(void* host, int n) {
  return cudaMemcpyFromSymbol(host, hk::fused_moe::hk_moe_trace, (size_t)n * 8 * 8) == cudaSuccess ? 0 : 1;
}
#endif
