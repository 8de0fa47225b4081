// Paged-attention decode: one query token per sequence against its paged K/V cache.
//
// Two kernels over the same parameters and the same split-K merge (common.h):
//   kernel 0, decode_simt.h: CUDA cores, lane-per-token QK^T, 1-8 query heads per block (v3, v9);
//   kernel 1, decode_mma.h: matrix cores, the GQA group as 16-row tiles, K/V pipelined through
//             shared memory (v16, v5);
//   kernel 2, decode_mma.h with its small configuration: 2 waves, 32-token tiles (v6).
// A block takes one partition of one sequence's context; with several partitions (flash-decoding
// split-K) blocks write unnormalised partials and (m, l), merged by merge_kernel (which drops partials of
// 4 MB or more from L2 once read, on NVIDIA); on sm_90 the matrix-core kernels merge up to 8 partitions
// inside a thread-block cluster instead (common.h). All cache offsets
// are 64-bit. Invalid metadata never reads out of bounds: context lengths are clamped to [0, what the
// block table row addresses] and tokens whose block id lies outside the cache are masked.
#include "decode_mma.h"
#include "decode_simt.h"

#ifndef HK_DTYPE
#error "build with -DHK_DTYPE=<hk::DType> and -DHK_HEAD_SIZE=<64|128|256>"
#endif

namespace {
typedef typename hk::elem_of<HK_DTYPE>::type T;
constexpr int D = HK_HEAD_SIZE;
using hk::paged_attention::Params;

template <int Kernel, int Heads> struct Pick;  // one kernel instantiation: its launch, occupancy, merge
template <int H> struct Pick<0, H> {
  static int launch(const Params& p, int s, int kv, int dev, hipStream_t st) {
    return hk::paged_attention::simt::launch<T, D, H>(p, s, kv, dev, st);
  }
  static int resident(int dev, int* out) { return hk::paged_attention::simt::resident<T, D, H>(dev, out); }
  static int clusters(int, int64_t, int, bool* out) { return *out = false, 0; }  // merges through partials
};
template <int H> struct Pick<1, H> {
  static int launch(const Params& p, int s, int kv, int dev, hipStream_t st) {
    return hk::paged_attention::mma::launch<T, D, H / 16, false>(p, s, kv, dev, st);
  }
  static int resident(int dev, int* out) { return hk::paged_attention::mma::resident<T, D, H / 16, false>(dev, out); }
  static int clusters(int parts, int64_t blocks, int dev, bool* out) {
    return hk::paged_attention::mma::clusters<T, D, H / 16, false>(parts, blocks, dev, out);
  }
};
template <> struct Pick<2, 16> {
  static int launch(const Params& p, int s, int kv, int dev, hipStream_t st) {
    return hk::paged_attention::mma::launch<T, D, 1, true>(p, s, kv, dev, st);
  }
  static int resident(int dev, int* out) { return hk::paged_attention::mma::resident<T, D, 1, true>(dev, out); }
  static int clusters(int parts, int64_t blocks, int dev, bool* out) {
    return hk::paged_attention::mma::clusters<T, D, 1, true>(parts, blocks, dev, out);
  }
};

// Calls fn(Pick<kernel, heads_per_block>()) for the instantiations that exist.
template <typename Fn>
int dispatch(int kernel, int heads_per_block, Fn fn) {
  if (kernel == 0) {
    switch (heads_per_block) {
      case 1: return fn(Pick<0, 1>());
      case 2: return fn(Pick<0, 2>());
      case 4: return fn(Pick<0, 4>());
      case 8: return fn(Pick<0, 8>());
    }
    return hk::set_invalid("kernel 0 takes heads_per_block 1, 2, 4 or 8", __FILE__, __LINE__);
  }
  if (kernel == 1) {
    switch (heads_per_block) {
      case 16: return fn(Pick<1, 16>());
      case 32: return fn(Pick<1, 32>());
      case 64: return fn(Pick<1, 64>());
    }
    return hk::set_invalid("kernel 1 takes heads_per_block 16, 32 or 64", __FILE__, __LINE__);
  }
  if (kernel == 2) {
    if (heads_per_block == 16) return fn(Pick<2, 16>());
    return hk::set_invalid("kernel 2 takes heads_per_block 16", __FILE__, __LINE__);
  }
  return hk::set_invalid("kernel is 0 (CUDA cores), 1 (matrix cores) or 2 (matrix cores, small blocks)", __FILE__,
                         __LINE__);
}
}  // namespace

// Shapes and strides in elements. kernel 0: heads_per_block 1, 2, 4 or 8; kernel 1: 16, 32 or 64
// (query heads per block, as 16-row tiles); kernel 2: 16. split_target == 0 (uniform split): num_partitions == 1
// is a single pass (part_o/part_ml unused), else partition_size tokens per partition, workspaces as in
// Params. split_target > 0 (per-sequence split, kernels 1 and 2): num_partitions unused, partitions of
// at least partition_size tokens; part_o/part_ml hold num_seqs + split_target items, seq_parts
// num_seqs pairs. Returns 0 or an error
// code (message: hk_last_error()).
HK_EXPORT int hk_paged_attention_decode(
    const void* q, int64_t q_stride_s, int64_t q_stride_h, const void* k, const void* v,
    int64_t kv_stride_block, int64_t kv_stride_tok, int64_t kv_stride_head, const int32_t* block_tables,
    int64_t bt_stride, const int32_t* context_lens, void* out, float* lse, float* part_o, float* part_ml,
    int num_seqs, int num_q_heads, int num_kv_heads, int block_size_log2, int max_blocks_per_seq,
    int num_blocks, int num_partitions, int partition_size, int split_target, int32_t* seq_parts, int kernel,
    int heads_per_block, float scale, int device, void* stream) {
  HK_REQUIRE(num_seqs >= 1 && num_seqs <= 65535);
  HK_REQUIRE(num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0);
  HK_REQUIRE(block_size_log2 >= 0 && block_size_log2 <= 10);
  HK_REQUIRE(max_blocks_per_seq >= 1 && ((int64_t)max_blocks_per_seq << block_size_log2) < (1ll << 31));
  HK_REQUIRE(num_partitions >= 1 && num_partitions <= 65535 && partition_size >= 1);
  HK_REQUIRE(num_partitions == 1 || (part_o && part_ml));
  HK_REQUIRE(split_target >= 0 && num_seqs + split_target <= 65535);
  HK_REQUIRE(split_target == 0 || (kernel >= 1 && part_o && part_ml && seq_parts));
  // a uniform split covers what a table row addresses (the merge reads ceil(length / partition_size) partials)
  HK_REQUIRE(split_target > 0 ||
             (int64_t)num_partitions * partition_size >= ((int64_t)max_blocks_per_seq << block_size_log2));
  HK_TRY(hk::use_device(device));
  const Params p{q, q_stride_s, q_stride_h, k, v, kv_stride_block, kv_stride_tok, kv_stride_head,
                 block_tables, bt_stride, context_lens, out, lse, part_o, part_ml, num_q_heads,
                 num_q_heads / num_kv_heads, block_size_log2, num_partitions, partition_size,
                 max_blocks_per_seq, num_blocks, scale * hk::kLog2e, num_seqs, split_target, seq_parts};
  hipStream_t s = static_cast<hipStream_t>(stream);
  return dispatch(kernel, heads_per_block,
                  [&](auto pick) { return decltype(pick)::launch(p, num_seqs, num_kv_heads, device, s); });
}

// Blocks of a kernel (as chosen by kernel / heads_per_block above) resident per SM/CU at once, into
// *blocks: the slots the Python planner fills. Returns 0 or an error code.
HK_EXPORT int hk_paged_attention_resident_blocks(int kernel, int heads_per_block, int device, int* blocks) {
  HK_TRY(hk::use_device(device));
  return dispatch(kernel, heads_per_block, [&](auto pick) { return decltype(pick)::resident(device, blocks); });
}

// Whether a uniform split of num_partitions partitions over `blocks` blocks of a kernel (as chosen by
// kernel / heads_per_block above) merges inside thread-block clusters (1) or through partials and the
// merge kernel (0), into *out. Returns 0 or an error code.
HK_EXPORT int hk_paged_attention_cluster_merge(int kernel, int heads_per_block, int num_partitions, int64_t blocks,
                                               int device, int* out) {
  HK_TRY(hk::use_device(device));
  bool yes = false;
  HK_TRY(dispatch(kernel, heads_per_block,
                  [&](auto pick) { return decltype(pick)::clusters(num_partitions, blocks, device, &yes); }));
  *out = yes ? 1 : 0;
  return 0;
}

#if defined(HK_PA_TRACE) && defined(HK_PLATFORM_CUDA)
// The trace of the calls since the last read (common.h): n blocks x kTracePoints timestamps into host
// memory; the table is cleared after it is read.
HK_EXPORT int hk_paged_attention_trace(void* host, int n) {
  using hk::paged_attention::hk_pa_trace;
  void* dev = nullptr;
  if (cudaMemcpyFromSymbol(host, hk_pa_trace, (size_t)n * sizeof(hk_pa_trace[0])) != cudaSuccess ||
      cudaGetSymbolAddress(&dev, hk_pa_trace) != cudaSuccess || cudaMemset(dev, 0, sizeof(hk_pa_trace)) != cudaSuccess)
    return 1;
  return 0;
}
#endif
