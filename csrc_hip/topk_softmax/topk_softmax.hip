// MoE router: softmax over each row of gating logits, then its top-k, in float32.
//
// One row per group of TPR lanes (a power of two <= the wave size). The row's logits are split in
// chunks of VEC consecutive elements (one 16-byte load when the row allows it, else VEC = 1);
// lane g of the group holds chunks g, g + TPR, ... (CPL of them) in registers. Each logit becomes
// a unique rank key (its value's order-preserving bits, then the inverted expert index), so "larger
// key" means "larger logit, or equal logit and lower expert". Each lane sorts its keys once; a
// selection round is then one group max over the lanes' first keys, and the lane that held the
// winner pops it. Round r's result is kept by lane r % TPR, which writes it at the end. Ties: of
// equal logits the lower expert ranks first (a stable descending sort), so ids and weights equal
// softmax-then-topk in float32 with that rule.
#include "hipkern/error.h"
#include "hipkern/launch.h"
#include "hipkern/moe.h"
#include "hipkern/reduce.h"
#include "hipkern/sort.h"
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

// Rank key of (logit, expert); 0 (below every key of a real logit) marks "none".
template <typename T> struct RankKey;

template <> struct RankKey<float> {  // 32 value bits + 32 expert bits
  typedef uint64_t type;
  static HK_DEVICE type make(float v, int e) {  // + 0.f: -0 ties with +0, as in a sort
    return ((uint64_t)ordered_key(v + 0.f) << 32) | (0xffffffffu - (uint32_t)e);
  }
  static HK_DEVICE float logit(type k) { return key_to_float((uint32_t)(k >> 32)); }
  static HK_DEVICE int expert(type k) { return (int)(0xffffffffu - (uint32_t)k); }
  template <int W> static HK_DEVICE type group_max(type k) { return group_max_u64<W>(k); }
};

template <typename T16> struct RankKey16 {  // 16 value bits + 16 expert bits
  typedef uint32_t type;
  static HK_DEVICE type make(T16 v, int e) {  // -0 (0x8000) ties with +0, as in a sort
    return (ordered_key16(v.bits == 0x8000u ? 0 : v.bits) << 16) | (0xffffu - (uint32_t)e);
  }
  static HK_DEVICE float logit(type k) { T16 b; b.bits = key16_to_bits(k >> 16); return to_float(b); }
  static HK_DEVICE int expert(type k) { return (int)(0xffffu - (k & 0xffffu)); }
  template <int W> static HK_DEVICE type group_max(type k) { return group_max_u32<W>(k); }
};
template <> struct RankKey<half_t> : RankKey16<half_t> {};
template <> struct RankKey<bf16_t> : RankKey16<bf16_t> {};

template <typename T, int VEC, int TPR, int CPL>
__global__ __launch_bounds__(kBlockThreads) void topk_softmax_kernel(Args a) {
  typedef RankKey<T> RK;
  typedef typename RK::type K;
  constexpr int N = VEC * CPL;                        // logits per lane
  constexpr int kSlots = (kMaxTopK + TPR - 1) / TPR;  // results kept per lane
  const int g = threadIdx.x % TPR;
  const int64_t row = (int64_t)blockIdx.x * (kBlockThreads / TPR) + threadIdx.x / TPR;
  // Groups past the last row stay to the end: the reductions need every lane of the wave.
  const bool live = row < a.num_tokens;
  const T* src = static_cast<const T*>(a.logits) + (live ? row : 0) * a.num_experts;

  K key[N];
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    const int first = (c * TPR + g) * VEC;  // expert of key[c * VEC]
    const bool present = live && first < a.num_experts;
    T v[VEC];
    if (present) load_vec<T, VEC>(src + first, v);
#pragma unroll
    for (int j = 0; j < VEC; ++j) key[c * VEC + j] = present ? RK::make(v[j], first + j) : K(0);
  }
  bitonic_sort_desc(key);
  const float m = RK::logit(RK::template group_max<TPR>(key[0]));  // the row's largest logit

  float denom = 0.f;  // the softmax denominator, needed only without renormalisation
  if (!a.renormalize) {
#pragma unroll
    for (int i = 0; i < N; ++i) denom += key[i] ? expf(RK::logit(key[i]) - m) : 0.f;
    denom = group_sum<TPR>(denom);
  }

  K sel[kSlots];
#pragma unroll
  for (int j = 0; j < kSlots; ++j) sel[j] = K(0);
#pragma unroll 1
  for (int r = 0; r < a.topk; ++r) {
    const K win = RK::template group_max<TPR>(key[0]);
    if (key[0] == win) pop_front(key, K(0));  // keys are unique: one lane held it
    if (r % TPR == g) {
#pragma unroll
      for (int j = 0; j < kSlots; ++j) sel[j] = j == r / TPR ? win : sel[j];
    }
  }

  // Lane g holds rounds g, g + TPR, ...: exponentiate, normalise, write.
  float e[kSlots];
  float kept = 0.f;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    e[j] = sel[j] ? expf(RK::logit(sel[j]) - m) : 0.f;
    kept += e[j];
  }
  if (a.renormalize) denom = group_sum<TPR>(kept);
  if (!live) return;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int r = j * TPR + g;
    if (r < a.topk) {
      a.weights[row * a.topk + r] = e[j] / denom;
      a.ids[row * a.topk + r] = RK::expert(sel[j]);
    }
  }
}

template <typename T, int VEC, int TPR, int CPL>
int launch(const Args& a, hipStream_t stream) {
  return launch_router<T>(&topk_softmax_kernel<T, VEC, TPR, CPL>, a, kBlockThreads / TPR, kBlockThreads, stream,
                          "launch of topk_softmax_kernel");
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
