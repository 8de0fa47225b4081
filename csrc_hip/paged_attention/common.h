// Shared by the paged-attention decode kernels: the launch parameters, the clamps that keep invalid
// metadata in bounds, the end of a block (merge its waves' softmax states, write the output or a
// split-K partial) and the kernel that merges partials.
#pragma once

#include "hipkern/error.h"
#include "hipkern/launch.h"
#include "hipkern/online_softmax.h"
#include "hipkern/reduce.h"
#include "hipkern/vec.h"

namespace hk {
namespace paged_attention {

struct Params {
  const void* q;
  int64_t q_stride_s, q_stride_h;
  const void* k;
  const void* v;
  int64_t kv_stride_block, kv_stride_tok, kv_stride_head;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* context_lens;
  void* out;     // [num_seqs, num_q_heads, D], contiguous
  float* lse;    // [num_seqs, num_q_heads] or null
  float* part_o;   // [num_seqs, num_q_heads, num_partitions, D] (split only)
  float* part_ml;  // [num_seqs, num_q_heads, num_partitions, 2] (split only)
  int num_q_heads, group, block_size_log2, num_partitions, partition_size;
  int max_blocks_per_seq, num_blocks;  // context lengths and block ids are clamped to these
  float scale_log2;  // softmax scale * log2(e)
};

// A sequence's context length, clamped to what its block-table row can address (never negative).
HK_DEVICE int context_len(const Params& p, int seq) {
  const int64_t cap = (int64_t)p.max_blocks_per_seq << p.block_size_log2;
  const int64_t len = p.context_lens[seq];
  return (int)(len < 0 ? 0 : len > cap ? cap : len);
}

// What one decode block takes: grid x = (KV head, group of kHeads of its query heads), y = sequence,
// z = partition. `skip`: an empty partition of a split launch (merge_kernel never reads its partial).
struct BlockWork {
  int kvh, seq, part, start, end;
  int head0, nh;  // first query head of the block, real heads in it (<= kHeads)
  bool skip;
};

template <int kHeads>
HK_DEVICE BlockWork block_work(const Params& p) {
  BlockWork w;
  const int hgroups = (p.group + kHeads - 1) / kHeads;
  const int hg = blockIdx.x % hgroups;
  w.kvh = blockIdx.x / hgroups;
  w.seq = blockIdx.y;
  w.part = blockIdx.z;
  const int len = context_len(p, w.seq);
  w.start = w.part * p.partition_size;
  w.skip = p.num_partitions > 1 && w.start >= len;
  w.end = min(len, w.start + p.partition_size);
  w.head0 = w.kvh * p.group + hg * kHeads;
  w.nh = min(kHeads, p.group - hg * kHeads);
  return w;
}

// Row offset (elements) of token t of sequence `seq`'s block-table row `bt`, or -1 when its block id
// lies outside the cache (the token is then masked, never read).
HK_DEVICE int64_t token_offset(const Params& p, const int32_t* bt, int t) {
  const int blk = bt[t >> p.block_size_log2];
  if (blk < 0 || blk >= p.num_blocks) return -1;
  return (int64_t)blk * p.kv_stride_block + (int64_t)(t & ((1 << p.block_size_log2) - 1)) * p.kv_stride_tok;
}

// The end of a block: merge kStates softmax states of its nh query heads (m_w, l_w: [kStates][kRows];
// a_w: [kStates][kRows][D], in shared memory) and write the output rows (one partition) or this
// partition's unnormalised partial and (m, l).
template <typename T, int D, int kStates, int kRows, int kThreads>
HK_DEVICE void finish(const Params& p, const float* m_w, const float* l_w, const float* a_w, int seq, int head0,
                      int nh, int part) {
  for (int i = threadIdx.x; i < nh * D; i += kThreads) {
    const int h = i / D, d = i % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kStates; ++w) M = fmaxf(M, m_w[w * kRows + h]);
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < kStates; ++w) {
      const float c = merge_weight(m_w[w * kRows + h], M);
      L += l_w[w * kRows + h] * c;
      O += a_w[(w * kRows + h) * D + d] * c;
    }
    const int64_t sh = (int64_t)seq * p.num_q_heads + head0 + h;
    if (p.num_partitions == 1) {
      static_cast<T*>(p.out)[sh * D + d] = from_float<T>(normalise(O, L));
      if (p.lse && d == 0) p.lse[sh] = lse_of(M, L);
    } else {
      const int64_t sp = sh * p.num_partitions + part;
      p.part_o[sp * D + d] = O;
      if (d == 0) {
        p.part_ml[2 * sp] = M;
        p.part_ml[2 * sp + 1] = L;
      }
    }
  }
}

// Combine the partials of one (sequence, head): grid (num_q_heads, num_seqs), D threads.
template <typename T, int D>
__global__ __launch_bounds__(D) void merge_kernel(Params p) {
  const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int len = context_len(p, seq);
  const int n = (len + p.partition_size - 1) / p.partition_size;  // partials that were written
  const int64_t sh = (int64_t)seq * p.num_q_heads + head;
  const float* ml = p.part_ml + sh * p.num_partitions * 2;
  const float* po = p.part_o + sh * p.num_partitions * D;
  float M = -INFINITY;
  for (int i = 0; i < n; ++i) M = fmaxf(M, ml[2 * i]);
  float L = 0.f, O = 0.f;
  for (int i = 0; i < n; ++i) {
    const float c = merge_weight(ml[2 * i], M);
    L += ml[2 * i + 1] * c;
    O += po[(int64_t)i * D + d] * c;
  }
  static_cast<T*>(p.out)[sh * D + d] = from_float<T>(normalise(O, L));
  if (p.lse && d == 0) p.lse[sh] = lse_of(M, L);
}

// Launch a decode kernel of `heads` query heads per block over the grid block_work() reads, then
// the merge if split.
template <typename T, int D, typename Kernel>
int launch_decode(Kernel kernel, unsigned long long& raised, const Params& p, int heads, int num_kv_heads,
                  int num_seqs, int threads, int smem_bytes, int device, hipStream_t stream,
                  const char* name /* "launch of ..." */) {
  HK_TRY(allow_shared(kernel, raised, smem_bytes, device));
  const unsigned hgroups = (unsigned)((p.group + heads - 1) / heads);
  const dim3 grid((unsigned)num_kv_heads * hgroups, (unsigned)num_seqs, (unsigned)p.num_partitions);
  hipLaunchKernelGGL(kernel, grid, dim3(threads), smem_bytes, stream, p);
  const hipError_t err = hipGetLastError();
  if (err != hipSuccess) return set_error((int)err, name, __FILE__, __LINE__);
  if (p.num_partitions > 1) {
    hipLaunchKernelGGL(HIP_KERNEL_NAME(merge_kernel<T, D>), dim3((unsigned)p.num_q_heads, (unsigned)num_seqs),
                       dim3(D), 0, stream, p);
    HK_CHECK_LAUNCH("paged_attention merge_kernel");
  }
  return 0;
}

}  // namespace paged_attention
}  // namespace hk
