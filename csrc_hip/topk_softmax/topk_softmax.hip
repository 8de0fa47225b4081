// MoE router: softmax over each row of gating logits, then its top-k, in float32.
//
// One row per group of TPR lanes (a power of two <= the wave size). The row's logits are split in
// chunks of VEC consecutive elements (one 16-byte load when the row allows it, else VEC = 1);
// lane g of the group holds chunks g, g + TPR, ... (CPL of them) in registers, as order-preserving
// 32-bit keys. Each of the k selection rounds is two group reductions (the largest key, then the
// lowest expert index holding it), after which only the lane that held the winner rescans its own
// logits. Round r's result is kept by lane r % TPR, which writes it at the end. Ties: of equal
// logits the lower expert index ranks first (a stable descending sort), so ids and weights equal
// softmax-then-topk in float32 with that rule.
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
__global__ __launch_bounds__(kBlockThreads) void topk_softmax_kernel(Args a) {
  constexpr int N = VEC * CPL;                            // logits per lane
  constexpr int kSlots = (kMaxTopK + TPR - 1) / TPR;      // results kept per lane
  const int g = threadIdx.x % TPR;
  const int64_t row = (int64_t)blockIdx.x * (kBlockThreads / TPR) + threadIdx.x / TPR;
  // Groups past the last row stay to the end: the reductions need every lane of the wave.
  const bool live = row < a.num_tokens;
  const T* src = static_cast<const T*>(a.logits) + (live ? row : 0) * a.num_experts;

  uint32_t key[N];  // ordered_key(logit); 0 = padding or already selected
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    const int first = (c * TPR + g) * VEC;  // expert index of key[c * VEC]
    float v[VEC];
    const bool present = live && first < a.num_experts;
    if (present) load_as_float<T, VEC>(src + first, v);
#pragma unroll
    for (int j = 0; j < VEC; ++j) key[c * VEC + j] = present ? ordered_key(v[j]) : 0u;
  }
  auto expert_of = [&](int i) { return ((i / VEC) * TPR + g) * VEC + i % VEC; };

  uint32_t top = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) top = top > key[i] ? top : key[i];
  const float m = key_to_float(group_max_u32<TPR>(top));
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) s += key[i] ? expf(key_to_float(key[i]) - m) : 0.f;
  s = group_sum<TPR>(s);

  // This lane's best remaining logit: largest key, lowest position (= lowest expert) on ties.
  uint32_t best = 0;
  int pos = 0;
  auto rescan = [&]() {
    best = 0;
#pragma unroll
    for (int i = N - 1; i >= 0; --i) {
      if (key[i] >= best) { best = key[i]; pos = i; }
    }
  };
  rescan();

  uint32_t sel_key[kSlots];
  int sel_id[kSlots];
#pragma unroll 1
  for (int r = 0; r < a.topk; ++r) {
    const uint32_t win_key = group_max_u32<TPR>(best);
    const int mine = best == win_key ? expert_of(pos) : 0x7fffffff;
    const int win_id = (int)group_min_u32<TPR>((uint32_t)mine);
    if (mine == win_id) {  // this lane held the winner: drop it and rescan
#pragma unroll
      for (int i = 0; i < N; ++i) key[i] = i == pos ? 0u : key[i];
      rescan();
    }
    if (r % TPR == g) {
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        if (j == r / TPR) { sel_key[j] = win_key; sel_id[j] = win_id; }
      }
    }
  }

  // Lane g holds rounds g, g + TPR, ...: exponentiate, normalise, write.
  float e[kSlots];
  float kept = 0.f;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int r = j * TPR + g;
    e[j] = r < a.topk && sel_key[j] ? expf(key_to_float(sel_key[j]) - m) : 0.f;
    kept += e[j];
  }
  const float denom = a.renormalize ? group_sum<TPR>(kept) : s;
  if (!live) return;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int r = j * TPR + g;
    if (r < a.topk) {
      a.weights[row * a.topk + r] = e[j] / denom;
      a.ids[row * a.topk + r] = sel_id[j];
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
