// MoE router: softmax over each row of gating logits, then its top-k, in float32.
//
// One row per group of TPR lanes (a power of two <= the wave size). The row's logits are split in
// chunks of VEC consecutive elements (one 16-byte load when the row allows it, else VEC = 1);
// lane g of the group holds chunks g, g + TPR, ... (CPL of them) in registers. Softmax statistics
// and each of the k argmax rounds are butterfly reductions inside the group, so every lane knows
// every result. Ties: of equal logits the lower expert index ranks first (a stable descending
// sort), so ids and weights equal softmax-then-topk in float32 with that rule.
#include "hipkern/error.h"
#include "hipkern/reduce.h"
#include "hipkern/vec.h"

namespace hk {
namespace topk_softmax {

constexpr int kBlockThreads = 256;
constexpr int kMaxTopK = 16;
constexpr int kMaxExperts = 512;

struct Args {
  const void* logits;
  float* weights;
  int32_t* ids;
  int64_t num_tokens;
  int num_experts;
  int topk;
  bool renormalize;
};

template <typename T, int VEC, int TPR, int CPL>
__global__ __launch_bounds__(kBlockThreads, 1) void topk_softmax_kernel(Args a) {
  constexpr int N = VEC * CPL;  // logits per lane
  static_assert(N <= 32, "taken-mask is 32 bits");
  const int g = threadIdx.x % TPR;
  const int64_t row = (int64_t)blockIdx.x * (kBlockThreads / TPR) + threadIdx.x / TPR;
  // Groups past the last row stay to the end: the shuffles need every lane of the wave.
  const bool live = row < a.num_tokens;
  const T* src = static_cast<const T*>(a.logits) + (live ? row : 0) * a.num_experts;

  float x[N];
  uint32_t taken = 0;  // bit i: x[i] is padding or already selected
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    const int first = (c * TPR + g) * VEC;  // expert index of x[c * VEC]
    float v[VEC];
    if (live && first < a.num_experts) {
      load_as_float<T, VEC>(src + first, v);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = -INFINITY;
      taken |= ((1u << VEC) - 1u) << (c * VEC);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) x[c * VEC + j] = v[j];
  }

  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < N; ++i) m = fmaxf(m, x[i]);
  m = group_max<TPR>(m);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) s += (taken >> i) & 1u ? 0.f : expf(x[i] - m);
  s = group_sum<TPR>(s);

  auto expert_of = [&](int i) { return ((i / VEC) * TPR + g) * VEC + i % VEC; };
  auto local_best = [&]() {
    ArgMax b{0.f, -1};
#pragma unroll
    for (int i = 0; i < N; ++i)  // ascending expert order: strict > keeps the lower index on ties
      if (!((taken >> i) & 1u) && (b.index < 0 || x[i] > b.value)) b = ArgMax{x[i], expert_of(i)};
    return b;
  };

  // The rounds loop stays rolled (compact code, fast builds); round r's result goes to register
  // slot r through compile-time indices, so nothing spills to scratch.
  float sel_logit[kMaxTopK];
  int sel_id[kMaxTopK];
  ArgMax mine = local_best();
#pragma unroll 1
  for (int r = 0; r < a.topk; ++r) {
    const ArgMax best = group_argmax<TPR>(mine);
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      if (j == r) {
        sel_logit[j] = best.value;
        sel_id[j] = best.index;
      }
    }
    if (best.index >= 0 && (best.index / VEC) % TPR == g) {  // this lane held it
      const int chunk = best.index / VEC / TPR;
      taken |= 1u << (chunk * VEC + best.index % VEC);
      mine = local_best();
    }
  }

  float e[kMaxTopK];
  float kept = 0.f;
#pragma unroll
  for (int r = 0; r < kMaxTopK; ++r) {
    e[r] = r < a.topk && sel_id[r] >= 0 ? expf(sel_logit[r] - m) : 0.f;
    kept += e[r];
  }
  const float denom = a.renormalize ? kept : s;
  if (!live) return;
  float* w_out = a.weights + row * a.topk;
  int32_t* i_out = a.ids + row * a.topk;
#pragma unroll
  for (int r = 0; r < kMaxTopK; ++r) {
    if (r < a.topk && r % TPR == g) {
      w_out[r] = e[r] / denom;
      i_out[r] = sel_id[r];
    }
  }
}

template <typename T, int VEC, int TPR, int CPL>
int launch(const Args& a, hipStream_t stream) {
  const int64_t rows_per_block = kBlockThreads / TPR;
  const int64_t blocks = (a.num_tokens + rows_per_block - 1) / rows_per_block;
  HK_REQUIRE(blocks <= 0x7fffffff);
  hipLaunchKernelGGL(HIP_KERNEL_NAME(topk_softmax_kernel<T, VEC, TPR, CPL>), dim3((unsigned)blocks),
                     dim3(kBlockThreads), 0, stream, a);
  HK_CHECK_LAUNCH("topk_softmax_kernel");
  return 0;
}

// Smallest (TPR, CPL) whose TPR * CPL chunks cover the row: widen the group to a full wave first,
// then give each lane more chunks.
template <typename T, int VEC, int TPR = 1, int CPL = 1>
int dispatch(const Args& a, int chunks, hipStream_t stream) {
  if (chunks <= TPR * CPL) return launch<T, VEC, TPR, CPL>(a, stream);
  if constexpr (TPR < kWaveSize) {
    return dispatch<T, VEC, TPR * 2, 1>(a, chunks, stream);
  } else if constexpr (TPR * CPL * VEC < kMaxExperts) {
    return dispatch<T, VEC, TPR, CPL * 2>(a, chunks, stream);
  } else {
    return set_invalid("num_experts <= 512", __FILE__, __LINE__);
  }
}

// Rows of a multiple of 16 bytes at a 16-byte aligned base take 16-byte loads; other rows (odd
// expert counts) load one element at a time, a full wave per row.
template <typename T>
int dispatch_elem(const Args& a, hipStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vector_rows = a.num_experts % kVec == 0 && reinterpret_cast<uintptr_t>(a.logits) % 16 == 0;
  if (vector_rows) return dispatch<T, kVec>(a, a.num_experts / kVec, stream);
  return dispatch<T, 1, kWaveSize>(a, a.num_experts, stream);
}

}  // namespace topk_softmax
}  // namespace hk

#ifndef HK_DTYPE
#error "build with -DHK_DTYPE=<hk::DType> (one module per logits dtype)"
#endif

// logits [num_tokens, num_experts] (row-major, contiguous, of this module's dtype) -> weights fp32
// and ids int32 [num_tokens, topk]. Returns 0 or an error code (message: hk_last_error()).
HK_EXPORT int hk_topk_softmax(const void* logits, float* weights, int32_t* ids,
                              int64_t num_tokens, int num_experts, int topk, int renormalize,
                              int device, void* stream) {
  using namespace hk::topk_softmax;
  HK_REQUIRE(num_tokens >= 0);
  HK_REQUIRE(num_experts >= 1 && num_experts <= kMaxExperts);
  HK_REQUIRE(topk >= 1 && topk <= kMaxTopK && topk <= num_experts);
  if (num_tokens == 0) return 0;
  HK_TRY(hk::use_device(device));
  const Args a{logits, weights, ids, num_tokens, num_experts, topk, renormalize != 0};
  return dispatch_elem<typename hk::elem_of<HK_DTYPE>::type>(a, static_cast<hipStream_t>(stream));
}
