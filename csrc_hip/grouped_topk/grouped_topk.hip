// MoE router of DeepSeek-V3: grouped top-k over sigmoid (or softmax) scores with a selection bias.
//
// Per token (row of E logits): s = sigmoid(x) (or softmax over the row), b = s + bias (selection
// only). The E experts form G groups of S = E / G consecutive experts; a group scores the sum of
// its top-2 b (its only b when S == 1), or its largest b (kGroupMax: DeepSeek-V2, vLLM without a
// bias); the topk_group best groups are kept; the topk best b of the
// kept experts are chosen; their weights are s, renormalised to sum 1 (optional), times `scale`.
//
// Mapping: like topk_softmax, one row per group of TPR lanes (a power of two <= the wave size);
// lane g holds chunks g, g + TPR, ... of VEC consecutive experts (16-byte loads when the row
// allows). Each lane turns its b into unique rank keys (b's order-preserving bits, then the
// inverted expert index: larger key = larger b, or equal b and lower expert).
//   Group stage (skipped when every group is kept): the row's b go to shared memory; LPG lanes per
//   group (the largest power of two with G * LPG <= TPR, else 1 lane looping over groups) scan
//   the group's b, merge their top-2 by butterfly, and store the group's key; each group's rank
//   (groups with a larger score, or an equal score and a lower index, come first) decides whether
//   it is kept, as a 64-bit mask every lane of the row holds.
//   Expert stage: keys of experts outside kept groups become 0 ("none"); each lane sorts its keys
//   once; a round is one max over the row's lanes, the lane holding the winner pops it.
// Weights re-read the chosen experts' logits (cached) and recompute s exactly as the key did.
#include "hipkern/error.h"
#include "hipkern/launch.h"
#include "hipkern/moe.h"
#include "hipkern/reduce.h"
#include "hipkern/sort.h"
#include "hipkern/vec.h"

namespace hk {
namespace grouped_topk {

constexpr int kBlockThreads = 256;
constexpr int kMaxTopK = 16;
constexpr int kMaxExperts = 512;
constexpr int kMaxGroups = 64;  // the kept-group mask is 64 bits
constexpr int kMagicShift = 20;  // floor(e / S) == (e * magic) >> 20 for e < 1024, S <= 512

enum Scoring : int { kSigmoid = 0, kSoftmax = 1 };
enum GroupScoring : int { kGroupTop2 = 0, kGroupMax = 1 };

struct Args {
  const void* logits;
  const float* bias;  // [E] or null
  float* weights;
  int32_t* ids;
  int64_t num_tokens;
  int num_experts;
  int topk;
  int num_groups;
  int topk_group;
  int group_size;
  uint32_t group_magic;  // ceil(2^20 / group_size)
  int lanes_per_group;   // set per TPR by launch()
  int scoring;
  int group_scoring;
  bool renormalize;
  float scale;
};

// Rank key of (b, expert): 32 value bits, 32 inverted-index bits; 0 is "none" (below every key).
HK_DEVICE uint64_t make_key(float b, int e) {  // + 0.f: -0 ties with +0
  return ((uint64_t)ordered_key(b + 0.f) << 32) | (0xffffffffu - (uint32_t)e);
}
HK_DEVICE int key_expert(uint64_t k) { return (int)(0xffffffffu - (uint32_t)k); }

// The unbiased score of logit x. Softmax: m is the row maximum, denom the row's sum of exp(x - m).
HK_DEVICE float score(float x, int scoring, float m, float denom) {
  return scoring == kSigmoid ? 1.f / (1.f + expf(-x)) : expf(x - m) / denom;
}

// Load VEC fp32 bias values (16-byte loads when VEC is a multiple of 4; the caller checked alignment).
template <int VEC>
HK_DEVICE void load_bias(const float* p, float (&out)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int q = 0; q < VEC; q += 4) {
      float t[4];
      load_vec<float, 4>(p + q, t);
#pragma unroll
      for (int j = 0; j < 4; ++j) out[q + j] = t[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = p[j];
  }
}

// Which groups of the row are kept (bit g of the result), from the row's b in `row_b`. Every lane
// of the row's TPR-lane group gets the mask. Calls shuffles: the whole wave must call it.
template <int TPR>
HK_DEVICE uint64_t kept_groups(const Args& a, const float* row_b, uint32_t* row_g, bool live) {
  const int g = threadIdx.x % TPR;
  const int G = a.num_groups, S = a.group_size, lpg = a.lanes_per_group;
  for (int g0 = 0; g0 < G; g0 += TPR / lpg) {  // same trip count on every lane
    const int gi = g0 + g / lpg, sub = g % lpg;
    float t1 = -INFINITY, t2 = -INFINITY;  // this lane's top-2 of the group
    if (live && gi < G) {
      for (int j = sub; j < S; j += lpg) {
        const float v = row_b[gi * S + j];
        if (v > t1) {
          t2 = t1;
          t1 = v;
        } else if (v > t2) {
          t2 = v;
        }
      }
    }
    for (int off = lpg / 2; off > 0; off /= 2) {  // merge the top-2 pairs of the group's lanes
      const float o1 = shfl_xor(t1, off, TPR), o2 = shfl_xor(t2, off, TPR);
      const float lo = t1 < o1 ? t1 : o1;
      t1 = t1 > o1 ? t1 : o1;
      t2 = t2 > o2 ? t2 : o2;
      t2 = t2 > lo ? t2 : lo;
    }
    if (live && gi < G && sub == 0)
      row_g[gi] = ordered_key((S > 1 && a.group_scoring == kGroupTop2 ? t1 + t2 : t1) + 0.f);
  }
  wave_sync();
  uint64_t mine = 0;  // bits of the groups this lane ranks
  if (live) {
    for (int gi = g; gi < G; gi += TPR) {
      const uint32_t k = row_g[gi];
      int rank = 0;
      for (int j = 0; j < G; ++j) {
        const uint32_t o = row_g[j];
        rank += (o > k || (o == k && j < gi)) ? 1 : 0;
      }
      if (rank < a.topk_group) mine |= (uint64_t)1 << gi;
    }
  }
  return group_reduce<TPR>(mine, SumOp());  // each bit comes from one lane: the sum is the OR
}

template <typename T, int VEC, int TPR, int CPL>
__global__ __launch_bounds__(kBlockThreads) void grouped_topk_kernel(Args a) {
  constexpr int N = VEC * CPL;                        // experts per lane
  constexpr int kRows = kBlockThreads / TPR;          // rows per block
  constexpr int kCap = TPR * N;                       // experts a row can hold
  constexpr int kGroupCap = kCap < kMaxGroups ? kCap : kMaxGroups;
  constexpr int kSlots = (kMaxTopK + TPR - 1) / TPR;  // results kept per lane
  __shared__ float s_b[kRows][kCap];
  __shared__ uint32_t s_g[kRows][kGroupCap];

  const int g = threadIdx.x % TPR, r = threadIdx.x / TPR;
  const int64_t row = (int64_t)blockIdx.x * kRows + r;
  // Groups past the last row stay to the end: the reductions need every lane of the wave.
  const bool live = row < a.num_tokens;
  const T* src = static_cast<const T*>(a.logits) + (live ? row : 0) * a.num_experts;

  float x[N];
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    const int first = (c * TPR + g) * VEC;
    T v[VEC];
    if (live && first < a.num_experts) load_vec<T, VEC>(src + first, v);
#pragma unroll
    for (int j = 0; j < VEC; ++j) x[c * VEC + j] = live && first < a.num_experts ? to_float(v[j]) : -INFINITY;
  }
  float m = 0.f, denom = 1.f;
  if (a.scoring == kSoftmax) {
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < N; ++i) mx = x[i] > mx ? x[i] : mx;
    m = group_max<TPR>(mx);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) sum += x[i] == -INFINITY ? 0.f : expf(x[i] - m);
    denom = group_sum<TPR>(sum);
  }

  const bool grouped = a.topk_group < a.num_groups;  // else every group is kept
  uint64_t key[N];
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    const int first = (c * TPR + g) * VEC;
    const bool present = live && first < a.num_experts;
    float bias[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) bias[j] = 0.f;
    if (present && a.bias) load_bias<VEC>(a.bias + first, bias);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float b = score(x[c * VEC + j], a.scoring, m, denom) + bias[j];
      key[c * VEC + j] = present ? make_key(b, first + j) : 0;
      if (present && grouped) s_b[r][first + j] = b;
    }
  }

  if (grouped) {
    wave_sync();
    const uint64_t kept = kept_groups<TPR>(a, s_b[r], s_g[r], live);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      // (& 63: a none key's "expert" is garbage; a real expert's group is < 64 already)
      const uint32_t grp = (((uint32_t)key_expert(key[i]) * a.group_magic) >> kMagicShift) & 63u;
      key[i] = ((kept >> grp) & 1u) ? key[i] : 0;
    }
  }

  bitonic_sort_desc(key);
  uint64_t sel[kSlots];
#pragma unroll
  for (int j = 0; j < kSlots; ++j) sel[j] = 0;
#pragma unroll 1
  for (int rd = 0; rd < a.topk; ++rd) {
    const uint64_t win = group_max_u64<TPR>(key[0]);
    if (key[0] == win) pop_front(key, (uint64_t)0);  // keys are unique: one lane held it
    if (rd % TPR == g) {
#pragma unroll
      for (int j = 0; j < kSlots; ++j) sel[j] = j == rd / TPR ? win : sel[j];
    }
  }

  // Lane g holds rounds g, g + TPR, ...: recompute their unbiased scores, normalise, write.
  float w[kSlots];
  float kept_sum = 0.f;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    w[j] = sel[j] ? score(to_float(src[key_expert(sel[j])]), a.scoring, m, denom) : 0.f;
    kept_sum += w[j];
  }
  const float norm = a.renormalize ? group_sum<TPR>(kept_sum) : 1.f;
  if (!live) return;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int rd = j * TPR + g;
    if (rd < a.topk) {
      a.weights[row * a.topk + rd] = (a.renormalize ? w[j] / norm : w[j]) * a.scale;
      a.ids[row * a.topk + rd] = key_expert(sel[j]);
    }
  }
}

template <typename T, int VEC, int TPR, int CPL>
int launch(Args a, hipStream_t stream) {
  int lpg = 1;
  while (lpg * 2 * a.num_groups <= TPR) lpg *= 2;
  a.lanes_per_group = lpg;
  return launch_router<T>(&grouped_topk_kernel<T, VEC, TPR, CPL>, a, kBlockThreads / TPR, kBlockThreads, stream,
                          "launch of grouped_topk_kernel");
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

// Rows of a multiple of 16 bytes at 16-byte aligned logits (and bias) take 16-byte loads; other
// rows load one element at a time, a full wave per row.
template <typename T>
int dispatch_elem(const Args& a, hipStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vector_rows = a.num_experts % kVec == 0 && reinterpret_cast<uintptr_t>(a.logits) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(a.bias) % 16 == 0;
  if (vector_rows) return dispatch<T, kVec>(a, a.num_experts / kVec, stream);
  return dispatch<T, 1, kWaveSize>(a, a.num_experts, stream);
}

}  // namespace grouped_topk
}  // namespace hk

#ifndef HK_DTYPE
#error "build with -DHK_DTYPE=<hk::DType> (one module per logits dtype)"
#endif

// logits [num_tokens, num_experts] (contiguous, this module's dtype), bias fp32 [num_experts] or
// null -> weights fp32 and ids int32 [num_tokens, topk]. scoring: 0 sigmoid, 1 softmax; group_scoring:
// 0 the sum of a group's top-2, 1 its largest.
// Returns 0 or an error code (message: hk_last_error()).
HK_EXPORT int hk_grouped_topk(const void* logits, const float* bias, float* weights, int32_t* ids,
                              int64_t num_tokens, int num_experts, int topk, int num_groups, int topk_group,
                              int scoring, int group_scoring, int renormalize, float scale, int device,
                              void* stream) {
  using namespace hk::grouped_topk;
  HK_REQUIRE(num_tokens >= 0);
  HK_REQUIRE(num_experts >= 1 && num_experts <= kMaxExperts);
  HK_REQUIRE(num_groups >= 1 && num_groups <= kMaxGroups && num_experts % num_groups == 0);
  HK_REQUIRE(topk_group >= 1 && topk_group <= num_groups);
  HK_REQUIRE(topk >= 1 && topk <= kMaxTopK && topk <= topk_group * (num_experts / num_groups));
  HK_REQUIRE(scoring == kSigmoid || scoring == kSoftmax);
  HK_REQUIRE(group_scoring == kGroupTop2 || group_scoring == kGroupMax);
  if (num_tokens == 0) return 0;
  HK_TRY(hk::use_device(device));
  const int S = num_experts / num_groups;
  const Args a{logits, bias, weights, ids, num_tokens, num_experts, topk, num_groups, topk_group, S,
               (uint32_t)(((1u << kMagicShift) + S - 1) / S), 1, scoring, group_scoring, renormalize != 0,
               scale};
  return dispatch_elem<typename hk::elem_of<HK_DTYPE>::type>(a, static_cast<hipStream_t>(stream));
}
