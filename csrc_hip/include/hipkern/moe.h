// Shared by the MoE modules (moe_sorting, fused_moe; the routers topk_softmax, grouped_topk): which routed
// pairs are computed at all; a router's launch over its rows.
#pragma once

#include "hipkern/error.h"
#include "hipkern/launch.h"
#include "hipkern/platform.h"

namespace hk {

// A routed pair is kept when its expert id lies in [0, num_experts) and, given an expert-parallel
// map, the expert is local (expert_map[e] >= 0); every other pair is dropped (never read through).
HK_DEVICE bool moe_pair_kept(int e, int num_experts, const int32_t* expert_map) {
  return (unsigned)e < (unsigned)num_experts && (expert_map == nullptr || expert_map[e] >= 0);
}

// fused_moe: the pair's local expert (w1's index: expert_map[e], or e without a map) if it is kept and
// that index lies inside w1's num_local experts, else -1 (dropped, as a remote pair: a map value past
// w1 is one only validate=True rejects).
HK_DEVICE int moe_local_expert(int e, int num_experts, const int32_t* expert_map, int num_local) {
  if (!moe_pair_kept(e, num_experts, expert_map)) return -1;
  const int le = expert_map != nullptr ? expert_map[e] : e;
  return (unsigned)le < (unsigned)num_local ? le : -1;
}

// The pair's expert e if it is kept, else num_experts (the "no expert" key of the sorting paths).
HK_DEVICE int moe_kept_expert(int e, int num_experts, const int32_t* expert_map) {
  return moe_pair_kept(e, num_experts, expert_map) ? e : num_experts;
}

// A router's arguments (topk_softmax, grouped_topk: logits of element type T, weights, ids) over its rows
// [r0, r0 + n) alone, for one piece of launch_rows_in_pieces (launch.h).
template <typename T, typename RouterArgs>
inline RouterArgs router_rows(RouterArgs a, int64_t r0, int64_t n) {
  a.logits = static_cast<const T*>(a.logits) + r0 * a.num_experts;
  a.weights += r0 * a.topk;
  a.ids += r0 * a.topk;
  a.num_tokens = n;
  return a;
}

// A router's launch: `kernel` (taking RouterArgs) over a's rows at rows_per_block rows a block of `threads`,
// in pieces of at most kMaxLaunchBlocks blocks, each over its own rows (any number of tokens on HIP, which
// runs a grid of 2^32 threads or more wrongly). `what` names the launch in an error.
template <typename T, typename RouterArgs>
int launch_router(void (*kernel)(RouterArgs), const RouterArgs& a, int64_t rows_per_block, unsigned threads,
                  hipStream_t stream, const char* what) {
  return launch_rows_in_pieces(a.num_tokens, rows_per_block, [&](int64_t r0, int64_t n, unsigned blocks) {
    hipLaunchKernelGGL(kernel, dim3(blocks), dim3(threads), 0, stream, router_rows<T>(a, r0, n));
    const hipError_t err = hipGetLastError();
    return err == hipSuccess ? 0 : set_error((int)err, what, __FILE__, __LINE__);
  });
}

}  // namespace hk
