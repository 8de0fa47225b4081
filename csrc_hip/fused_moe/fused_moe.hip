// Fused MoE: out[t] = sum_j w[t, j] * w2[e] (act(w1[e, :I] x_t) * (w1[e, I:] x_t)), e = ids[t, j].
//
// After moe_sorting (its own module, called first by the op) three launches:
//   gemm_kernel<Gated>  inter[p] = act(gate) * up for every routed pair p (rounded to T)
//   gemm_kernel<down>   y[p] = w[p] * (w2[e] inter[p]), fp32
//   combine_kernel      out[t] = sum over t's routed pairs of y, in slot order (deterministic: no
//                       float atomics anywhere)
// gemm.h has the work plan and pipeline, math.h the arithmetic: matrix cores for fp16/bf16, FMAs
// for fp32. One module per (dtype, block_m).
#include "gemm.h"

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
constexpr bool kNv = hk::kAsyncCopy;
template <typename U, int B> struct Tiles;
template <typename U> struct Tiles<U, 8> {
  typedef MmaMath<U, 1, 4, 8, 512, 4> Gate;
  typedef MmaMath<U, 4, 1, 8, 128, 4> Down;
};
template <typename U> struct Tiles<U, 16> {
  typedef MmaMath<U, 2, 2, 16, 256, 4> Gate;
  typedef MmaMath<U, 4, 1, 16, 128, 4> Down;
};
template <typename U> struct Tiles<U, 32> { typedef MmaMath<U, 4, 1, 32, 128, 3> Gate, Down; };
template <typename U> struct Tiles<U, 64> { typedef MmaMath<U, kNv ? 8 : 4, 1, 64, 128, 3> Gate, Down; };
template <typename U> struct Tiles<U, 128> { typedef MmaMath<U, kNv ? 8 : 4, 1, 128, 64, 4> Gate, Down; };
constexpr int kSimtWK = kNv ? 4 : 1, kSimtRPL = kNv ? 2 : 1;
template <> struct Tiles<float, 8> {
  typedef SimtMath<1, kSimtWK, 8, kNv ? 256 : 128, 4> Gate;
  typedef SimtMath<kSimtRPL, kSimtWK, 8, 128, 4> Down;
};
template <> struct Tiles<float, 16> {
  typedef SimtMath<1, kSimtWK, 16, kNv ? 256 : 128, 3> Gate;
  typedef SimtMath<kSimtRPL, kSimtWK, 16, 128, 4> Down;
};
template <> struct Tiles<float, 32> { typedef SimtMath<kSimtRPL, kSimtWK, 32, 64, 3> Gate, Down; };
template <> struct Tiles<float, 64> { typedef SimtMath<1, kSimtWK, 64, 64, 3> Gate, Down; };  // 2 rows: spills
typedef typename Tiles<T, BM>::Gate M1;
typedef typename Tiles<T, BM>::Down M2;

constexpr int kCombineThreads = 256;

// out[t][4c .. 4c + 3] over a grid-stride loop; a pair contributes when moe_sorting kept it.
__global__ __launch_bounds__(kCombineThreads) void combine_kernel(const float* y, const int32_t* ids,
                                                                  const int32_t* expert_map, int num_experts,
                                                                  T* out, int64_t num_tokens, int topk, int dim) {
  const int quads = dim / 4;
  const int64_t n = num_tokens * quads;
  for (int64_t i = blockIdx.x * (int64_t)kCombineThreads + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * kCombineThreads) {
    const int64_t t = i / quads;
    const int c = (int)(i % quads) * 4;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < topk; ++j) {
      const int64_t pair = t * topk + j;
      const int e = ids[pair];
      if ((unsigned)e >= (unsigned)num_experts || (expert_map != nullptr && expert_map[e] < 0)) continue;
      const float4 v = *reinterpret_cast<const float4*>(y + pair * dim + c);
      acc[0] += v.x;
      acc[1] += v.y;
      acc[2] += v.z;
      acc[3] += v.w;
    }
    hk::store_from_float<T, 4>(out + t * dim + c, acc);
  }
}
}  // namespace

// Workspace of hk_fused_moe on `device` (the same for any shape): floats of split-K partials and
// ints of counters (which must be zero before the first call; every call leaves them zero).
HK_EXPORT int hk_fused_moe_workspace(int device, int64_t* partial_floats, int64_t* counter_ints) {
  HK_TRY(hk::use_device(device));
  int64_t f1, c1, f2, c2;
  HK_TRY((hk::fused_moe::workspace<T, M1, BM, true>(device, &f1, &c1)));
  HK_TRY((hk::fused_moe::workspace<T, M2, BM, false>(device, &f2, &c2)));
  *partial_floats = f1 > f2 ? f1 : f2;
  *counter_ints = c1 > c2 ? c1 : c2;
  return 0;
}

// x [T][D], w1 [E_local][2I][D], w2 [E_local][D][I], topk_weights / topk_ids [T][topk] (ids index
// E_global experts; expert_map [E_global] or null), sorted_ids [max_padded] / expert_ids
// [max_padded / BM] / num_post [1] from moe_sorting with block_m = BM, inter [T * topk][I] (T),
// y [T * topk][D] (fp32), partials / counters as hk_fused_moe_workspace says, out [T][D]. D and I multiples of 16 bytes' worth of elements, pointers
// 16-byte aligned. activation: 0 silu, 1 gelu. Returns 0 or an error code (hk_last_error()).
HK_EXPORT int hk_fused_moe(const void* x, const void* w1, const void* w2, const float* topk_weights,
                           const int32_t* topk_ids, const int32_t* expert_map, const int32_t* sorted_ids,
                           const int32_t* expert_ids, const int32_t* num_post, void* inter, float* y,
                           float* partials, int* counters, void* out,
                           int num_tokens, int topk, int num_experts, int num_local_experts, int dim, int inter_dim,
                           int max_padded, int activation, int device, void* stream) {
  constexpr int kVec = 16 / (int)sizeof(T);
  HK_REQUIRE(num_tokens >= 0 && topk >= 1 && (int64_t)num_tokens * topk < (1ll << 30));
  HK_REQUIRE(num_experts >= 1 && num_local_experts >= 1);
  HK_REQUIRE(dim >= kVec && dim % kVec == 0 && inter_dim >= kVec && inter_dim % kVec == 0);
  HK_REQUIRE(max_padded >= 0 && max_padded % BM == 0);
  HK_REQUIRE(activation == hk::fused_moe::kSilu || activation == hk::fused_moe::kGelu);
  if (num_tokens == 0) return 0;
  HK_TRY(hk::use_device(device));
  hipStream_t s = static_cast<hipStream_t>(stream);
  const int num_pairs = num_tokens * topk, max_mblocks = max_padded / BM;
  constexpr int kCols1 = hk::fused_moe::GemmCfg<T, M1, BM, true>::kCols;
  constexpr int kCols2 = hk::fused_moe::GemmCfg<T, M2, BM, false>::kCols;
  HK_REQUIRE((int64_t)max_mblocks * ((dim + kCols2 - 1) / kCols2) < (1ll << 31));

  hk::fused_moe::GemmParams g{};
  g.sorted_ids = sorted_ids;
  g.expert_ids = expert_ids;
  g.num_post = num_post;
  g.num_pairs = num_pairs;
  g.max_mblocks = max_mblocks;
  g.num_experts = num_local_experts;
  g.activation = activation;
  g.partials = partials;
  g.counters = counters;

  g.x = x;  // gate/up: inter = act(w1[:I] x) * (w1[I:] x)
  g.x_stride = dim;
  g.x_div = topk;
  g.w = w1;
  g.w_stride_e = 2ll * inter_dim * dim;
  g.K = dim;
  g.N = inter_dim;
  g.n_tiles = (inter_dim + kCols1 - 1) / kCols1;
  g.out = inter;
  g.out_stride = inter_dim;
  HK_TRY((hk::fused_moe::launch_gemm<T, M1, BM, true>(g, device, s)));

  g.x = inter;  // down: y = w * (w2 inter)
  g.x_stride = inter_dim;
  g.x_div = 1;
  g.w = w2;
  g.w_stride_e = (int64_t)dim * inter_dim;
  g.K = inter_dim;
  g.N = dim;
  g.n_tiles = (dim + kCols2 - 1) / kCols2;
  g.out = y;
  g.out_stride = dim;
  g.topk_weights = topk_weights;
  HK_TRY((hk::fused_moe::launch_gemm<T, M2, BM, false>(g, device, s)));

  const int64_t quads = (int64_t)num_tokens * (dim / 4);
  int sms = 0;
  HK_CHECK(hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, device));
  const int64_t want = (quads + kCombineThreads - 1) / kCombineThreads, most = 16ll * sms;
  hipLaunchKernelGGL(combine_kernel, dim3((unsigned)(want < most ? want : most)), dim3(kCombineThreads), 0, s, y,
                     topk_ids, expert_map, num_experts, static_cast<T*>(out), (int64_t)num_tokens, topk, dim);
  HK_CHECK_LAUNCH("fused_moe combine_kernel");
  return 0;
}
