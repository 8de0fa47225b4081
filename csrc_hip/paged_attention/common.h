// Shared by the paged-attention decode kernels: the launch parameters, the clamps that keep invalid
// metadata in bounds, the end of a block (merge its waves' softmax states, write the output or a
// split-K partial) and the kernel that merges partials.
#pragma once

#include "hipkern/error.h"
#include "hipkern/launch.h"
#include "hipkern/online_softmax.h"
#include "hipkern/reduce.h"
#include "hipkern/tma.h"
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
  int num_seqs;
  // Per-sequence split (v5), when split_target > 0: the launch has num_seqs + split_target items per
  // KV-head group (grid y); every block derives the same plan from the context lengths (see
  // per_sequence_plan; partition_size is then the smallest partition), partials are
  // [item][num_q_heads][D], and seq_parts[seq] = (first item, items).
  int split_target;
  int32_t* seq_parts;
  // > 1 (set by launch_decode, uniform split only): the partitions of each (sequence, head group) are
  // the blocks of one thread-block cluster of this many, merged inside it (cluster_merge): part_o and
  // part_ml are not used and no merge kernel runs.
  int cluster;
  // Set by the matrix-core kernels' launcher where they copy K and V tiles as tensor-map boxes
  // (decode_mma.h, Cfg::kBoxes): the caches as rank-5 maps.
  TensorMap k_map, v_map;
};

constexpr int kMaxCluster = 8;  // the portable cluster size

// HK_PA_TRACE (a diagnostic build, NVIDIA only; hipkern/bench/pa_trace.py): thread 0 of each block
// records %globaltimer at the points of the matrix-core kernel into hk_pa_trace[block][point] (the
// block numbered x fastest, then y, then z); hk_paged_attention_trace() reads the table and clears
// it. Points: 0 start, 1 context length known, 2 first tile in shared memory, 3 loop done, 4 the
// waves' states merged (output or partial written, or the cluster merge's state ready),
// 5 cluster barrier passed (cluster merge only), 6 end.
constexpr int kTraceBlocks = 4096, kTracePoints = 8;
#if defined(HK_PA_TRACE) && defined(HK_PLATFORM_CUDA)
__device__ unsigned long long hk_pa_trace[kTraceBlocks][kTracePoints];
HK_DEVICE void trace_point(int i) {
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x != 0 || b >= (unsigned)kTraceBlocks) return;
  hk_pa_trace[b][i] = globaltimer();
}
#else
HK_DEVICE void trace_point(int) {}
#endif

// A sequence's context length, clamped to what its block-table row can address (never negative).
HK_DEVICE int context_len(const Params& p, int seq) {
  const int64_t cap = (int64_t)p.max_blocks_per_seq << p.block_size_log2;
  const int64_t len = p.context_lens[seq];
  return (int)(len < 0 ? 0 : len > cap ? cap : len);
}

// What one decode block takes: grid x = (KV head, group of kHeads of its query heads); uniform split:
// y = sequence, z = partition of partition_size tokens; per-sequence split (v5): y = item (below).
// `skip`: an empty partition of a split launch (merge_kernel never reads its partial). `partial`:
// the block writes an unnormalised partial (its sequence has several partitions) at the rows of
// part_o that partial_row() gives, else the output rows themselves.
struct BlockWork {
  int kvh, seq, part, start, end;
  int head0, nh;  // first query head of the block, real heads in it (<= kHeads)
  bool skip, partial;
};

// The part_o (and part_ml) row of head h of the block's partial: uniform split [seq][head][part],
// per-sequence split [item][head] (item: grid y).
HK_DEVICE int64_t partial_row(const Params& p, const BlockWork& w, int h) {
  const int64_t sh = (int64_t)w.seq * p.num_q_heads + w.head0 + h;
  return p.split_target > 0 ? (int64_t)blockIdx.y * p.num_q_heads + w.head0 + h : sh * p.num_partitions + w.part;
}

// The per-sequence plan (v5), the same in every block: sequence s has tiles_s = ceil(len_s / kTile)
// tiles; the target partition holds c = ceil(sum tiles_s / split_target) tiles, and at least
// partition_size tokens (rounded up to whole tiles), so s has n_s = max(1, round(tiles_s / c)) <=
// tiles_s partitions, partition j its tiles [j tiles_s / n_s, (j + 1) tiles_s / n_s) (none empty;
// rounded to the nearest count, not up: a batch of equal lengths just over c stays one partition
// each, as v16 plans it, instead of c tiles and a sliver), and
// sum n_s <= num_seqs + split_target items; item i is partition i - first_s of the sequence s with
// first_s <= i < first_s + n_s (first_s: the exclusive prefix sum of n). Every thread of the block
// calls it (barriers). Sets seq (-1: past the last item), part and nparts (the block holding
// partition 0 of its sequence, KV group 0, records (first_s, n_s)). The tile sum and c are 64-bit:
// 4096 sequences of up to 2^24 tiles each exceed 2^31.
template <int kTile, int kThreads>
HK_DEVICE void per_sequence_plan(const Params& p, int item, int& seq, int& part, int& nparts) {
  __shared__ int scratch[kThreads / kWaveSize];
  __shared__ int64_t wide[kThreads / kWaveSize];
  __shared__ int found[3];
  const int per = (p.num_seqs + kThreads - 1) / kThreads;  // sequences per thread, in order
  const int s0 = threadIdx.x * per, s1 = min(p.num_seqs, s0 + per);
  auto tiles_of = [&](int s) { return (context_len(p, s) + kTile - 1) / kTile; };
  int64_t tiles = 0, all_tiles;
  for (int s = s0; s < s1; ++s) tiles += tiles_of(s);
  block_exclusive_sum<kThreads>(tiles, wide, all_tiles);
  const int64_t fair = (all_tiles + p.split_target - 1) / p.split_target;
  const int64_t least = (p.partition_size + kTile - 1) / kTile, c = fair > least ? fair : least;
  auto parts_of = [&](int s) {
    const int64_t n_s = (2 * (int64_t)tiles_of(s) + c) / (2 * c);
    return n_s > 1 ? (int)n_s : 1;  // <= tiles_s
  };
  int n = 0, total;
  for (int s = s0; s < s1; ++s) n += parts_of(s);
  int first = block_exclusive_sum<kThreads>(n, scratch, total);
  if (threadIdx.x == 0) found[0] = -1;
  __syncthreads();
  if (item >= first && item < first + n) {  // this thread's sequences hold the item
    for (int s = s0; s < s1; ++s) {
      const int ns = parts_of(s);
      if (item < first + ns) {
        found[0] = s;
        found[1] = item - first;
        found[2] = ns;
        break;
      }
      first += ns;
    }
  }
  __syncthreads();
  seq = found[0];
  part = found[1];
  nparts = found[2];
}

template <int kHeads, int kTile, int kThreads, bool kPerSequence>
HK_DEVICE BlockWork block_work(const Params& p) {
  BlockWork w;
  w.seq = -1;
  w.part = w.start = w.end = 0;
  w.skip = w.partial = false;
  const int hgroups = (p.group + kHeads - 1) / kHeads;
  const int hg = blockIdx.x % hgroups;
  w.kvh = blockIdx.x / hgroups;
  w.head0 = w.kvh * p.group + hg * kHeads;
  w.nh = min(kHeads, p.group - hg * kHeads);
  if (kPerSequence && p.split_target > 0) {
    int nparts;
    per_sequence_plan<kTile, kThreads>(p, blockIdx.y, w.seq, w.part, nparts);
    w.skip = w.seq < 0;  // an item past the last one
    if (w.skip) return w;
    const int len = context_len(p, w.seq), tiles = (len + kTile - 1) / kTile;
    w.start = (int)((int64_t)w.part * tiles / nparts) * kTile;  // part x tiles may exceed 2^31
    w.end = min(len, (int)((int64_t)(w.part + 1) * tiles / nparts) * kTile);
    w.partial = nparts > 1;
    if (w.part == 0 && blockIdx.x == 0 && threadIdx.x == 0) {
      p.seq_parts[2 * w.seq] = blockIdx.y;
      p.seq_parts[2 * w.seq + 1] = nparts;
    }
    return w;
  }
  w.seq = blockIdx.y;
  w.part = blockIdx.z;
  const int len = context_len(p, w.seq);
  w.start = w.part * p.partition_size;
  w.skip = w.part > 0 && w.start >= len;  // partition 0 always runs: it writes an empty context's zeros
  w.end = min(len, w.start + p.partition_size);
  w.partial = p.num_partitions > 1 && len > p.partition_size;  // one partition: the output itself
  return w;
}

// Row offset (elements) of token t of sequence `seq`'s block-table row `bt`, or -1 when its block id
// lies outside the cache (the token is then masked, never read).
// Any t >= 0 may be asked (the block-table index is clamped to the row, so callers may read it
// before they know the context length, and mask by it afterwards). In two halves, so that a caller
// can hold the loaded block id and make the offset later: a load's latency is paid at its first use.
HK_DEVICE int token_block(const Params& p, const int32_t* bt, int t) {
  return bt[min(t >> p.block_size_log2, p.max_blocks_per_seq - 1)];
}
HK_DEVICE int64_t block_offset(const Params& p, int blk, int t) {
  if (blk < 0 || blk >= p.num_blocks) return -1;
  return (int64_t)blk * p.kv_stride_block + (int64_t)(t & ((1 << p.block_size_log2) - 1)) * p.kv_stride_tok;
}
HK_DEVICE int64_t token_offset(const Params& p, const int32_t* bt, int t) {
  return block_offset(p, token_block(p, bt, t), t);
}

// Whether a block of a cluster launch merges its partition inside the cluster (else, when its
// sequence has a single partition, it writes the output itself and the other blocks are skipped).
HK_DEVICE bool cluster_merged(const Params& p, const BlockWork& w) { return kClusters && p.cluster > 1 && w.partial; }

// Row stride (floats) of the merge area's outputs (a_w in finish): padded so that a matrix-core
// wave's accumulator stores (MmaTile::store_c: 8 rows a store on NVIDIA, 4 groups of rows on CDNA)
// spread over all banks instead of landing D floats (a multiple of the banks) apart.
template <int D> HK_HOST_DEVICE constexpr int merge_ld() { return D + (kWaveSize == 32 ? 8 : 4); }

// Shared memory a cluster merge needs besides the blocks' outputs (floats): (m, l) per head.
template <int kRows> constexpr int kClusterFloats = 2 * kRows;

// The merge of a cluster launch (cluster_merged): the blocks of one cluster are the partitions of one
// (sequence, head group), rank = partition. Each has left its state in its shared memory, at the same
// offsets in every block: ml_s[2h], ml_s[2h + 1] = (m, l) of head h (m = -inf and zero outputs: an
// empty partition) and o_s[h * kLd ..][0..D) its output relative to m. Every block then writes its
// 1 / cluster share of the (head, 4 columns) outputs, each thread reading every state's (m, l) and
// columns through distributed shared memory at once (one round trip): no partial leaves the SMs and
// no merge kernel runs. All threads of every block of the cluster call it. One output at a time per
// thread: two at once (twice the DSMEM loads in flight) measured 1.7 us slower at 1 x 256 x 64:1
// (NOTES.md, session 2026-11-24 (6)); in 2-block clusters 2 or 4 at once were no faster and the block's
// own state read as plain shared memory was slower (H200, 2026-11-28 (15)). The loop is compiled for
// kN >= cluster ranks (2, 4 or 8; ranks past the cluster's are empty states, not read), instead of one
// loop for 8 ranks in every cluster: 64 x 4096 x 64:1 2.5 % and 8 x 256 x 64:1 8.5 % faster.
template <typename T, int D, int kRows, int kThreads, int kLd, int kN>
HK_DEVICE void cluster_merge_ranks(const Params& p, const float* ml_s, const float* o_s, const BlockWork& w) {
  const int n = p.cluster;
  uint32_t ml_r[kN], o_r[kN];  // this block's ml_s / o_s in each rank (addresses are linear within a rank)
#pragma unroll
  for (int r = 0; r < kN; ++r) {
    ml_r[r] = r < n ? cluster_map(ml_s, r) : 0u;
    o_r[r] = r < n ? cluster_map(o_s, r) : 0u;
  }
  constexpr int kPerRow = D / 4;
  const int total = w.nh * kPerRow, share = (total + n - 1) / n, hi = min(total, (w.part + 1) * share);
  for (int i = w.part * share + (int)threadIdx.x; i < hi; i += kThreads) {
    const int h = i / kPerRow, d = i % kPerRow * 4;
    float2 ml[kN];
    float4 o[kN];
#pragma unroll
    for (int r = 0; r < kN; ++r) {
      if (r < n) {
        ml[r] = cluster_load2(ml_r[r] + 8u * h);
        o[r] = cluster_load4(o_r[r] + 4u * (h * kLd + d));
      } else {
        ml[r] = make_float2(-INFINITY, 0.f);
        o[r] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    float M = -INFINITY, L = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < kN; ++r) M = fmaxf(M, ml[r].x);
#pragma unroll
    for (int r = 0; r < kN; ++r) {  // every value read is used (an empty state with weight 0)
      const float c = merge_weight(ml[r].x, M);
      L += ml[r].y * c;
      acc[0] += o[r].x * c;
      acc[1] += o[r].y * c;
      acc[2] += o[r].z * c;
      acc[3] += o[r].w * c;
    }
    const float f = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] *= f;
    const int64_t sh = (int64_t)w.seq * p.num_q_heads + w.head0 + h;
    store_from_float<T, 4>(static_cast<T*>(p.out) + sh * D + d, acc);
    if (p.lse && d == 0) p.lse[sh] = lse_of(M, L);
  }
}

template <typename T, int D, int kRows, int kThreads, int kLd>
HK_DEVICE void cluster_merge(const Params& p, float* ml_s, const float* o_s, const BlockWork& w) {
  cluster_sync();  // every block's state is written
  trace_point(5);
  if (p.cluster <= 2)
    cluster_merge_ranks<T, D, kRows, kThreads, kLd, 2>(p, ml_s, o_s, w);
  else if (p.cluster <= 4)
    cluster_merge_ranks<T, D, kRows, kThreads, kLd, 4>(p, ml_s, o_s, w);
  else
    cluster_merge_ranks<T, D, kRows, kThreads, kLd, kMaxCluster>(p, ml_s, o_s, w);
  // No block leaves (its shared memory) while another still reads it. This thread's reads are done
  // (their values went into the sums above) and nothing else needs ordering: no fence.
  cluster_sync_relaxed();
}

// The end of a block: merge kStates softmax states of its nh query heads (m_w, l_w: [kStates][kRows];
// a_w: [kOStates][kRows][kLd] with outputs in [0, D), 16-byte aligned, in shared memory) and write the
// output rows, or the unnormalised partials and (m, l) when w.partial. kOStates 1: every state has
// the same m (one running max; -inf in all of them when nothing was read) and a_w holds their summed
// outputs. m_w and l_w are overwritten
// (per-head weights). In a merged cluster (cluster_merged; ml_s: kClusterFloats<kRows> floats of
// shared memory) the partial stays in shared memory (a_w's first state, ml_s) for cluster_merge
// instead.
template <typename T, int D, int kStates, int kRows, int kThreads, int kLd = D, int kOStates = kStates,
          bool kBulk = false>
HK_DEVICE void finish(const Params& p, float* m_w, float* l_w, float* a_w, const BlockWork& w,
                      float* ml_s = nullptr) {
  static_assert(D % 4 == 0 && kLd % 4 == 0 && (2 * kStates * kRows) % 4 == 0, "16-byte rows of a_w");
  static_assert(kOStates == kStates || kOStates == 1, "an output per state, or one for all");
  static_assert(!kBulk || (kOStates == 1 && kTma), "bulk stores of one output state (sm_90a)");
  const bool in_cluster = ml_s != nullptr && cluster_merged(p, w);
  // kBulk (the caller fenced a_w for the async proxy before its barrier): a partial outside a cluster is
  // a_w's rows as they are, so head h's thread sends its row by one bulk store after its (m, l): no
  // second barrier and no loop of loads and stores (H100, NOTES.md, 2026-11-28: 32 x 2048 x 64:1's blocks
  // end 1.8 us after their loops, 2.6 through that loop).
  const bool bulk = kBulk && w.partial && !in_cluster;
  if (threadIdx.x < w.nh) {  // per head: each state's weight (into m_w), and the output scale (l_w[h])
    const int h = threadIdx.x;
    float M = -INFINITY, L = 0.f;
#pragma unroll
    for (int s = 0; s < kStates; ++s) M = fmaxf(M, m_w[s * kRows + h]);
#pragma unroll
    for (int s = 0; s < kStates; ++s) {
      const float c = merge_weight(m_w[s * kRows + h], M);
      L += l_w[s * kRows + h] * c;
      m_w[s * kRows + h] = c;
    }
    const int64_t sh = (int64_t)w.seq * p.num_q_heads + w.head0 + h;
    if (in_cluster) {
      ml_s[2 * h] = M;
      ml_s[2 * h + 1] = L;
    } else if (w.partial) {
      const int64_t r = partial_row(p, w, h);
      p.part_ml[2 * r] = M;
      p.part_ml[2 * r + 1] = L;
      if (bulk) {
        bulk_store(p.part_o + r * D, a_w + h * kLd, D * sizeof(float));
        bulk_store_commit();
        bulk_store_wait_read();  // (the shared memory stays the block's until then)
      }
    } else if (p.lse) {
      p.lse[sh] = lse_of(M, L);
    }
    l_w[h] = w.partial ? 1.f : L > 0.f ? 1.f / L : 0.f;
  }
  if (bulk) {
    trace_point(4);
    return;
  }
  if constexpr (kOStates == 1) {  // a_w holds the cluster merge's outputs as they are (its barrier orders ml_s)
    if (in_cluster) {
      trace_point(4);
      cluster_merge<T, D, kRows, kThreads, kLd>(p, ml_s, a_w, w);
      return;
    }
  }
  __syncthreads();
  constexpr int kV = 4, kPerRow = D / kV;
  for (int i = threadIdx.x; i < w.nh * kPerRow; i += kThreads) {
    const int h = i / kPerRow, d = i % kPerRow * kV;
    float o[kV] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < kOStates; ++s) {
      const float c = kOStates == 1 ? 1.f : m_w[s * kRows + h];
      const float4 a = *reinterpret_cast<const float4*>(a_w + (s * kRows + h) * kLd + d);
      o[0] += a.x * c;
      o[1] += a.y * c;
      o[2] += a.z * c;
      o[3] += a.w * c;
    }
    const float f = l_w[h];
#pragma unroll
    for (int j = 0; j < kV; ++j) o[j] *= f;
    if (in_cluster) {  // in place: this thread alone reads and writes these 4 columns of head h
      *reinterpret_cast<float4*>(a_w + h * kLd + d) = make_float4(o[0], o[1], o[2], o[3]);
    } else if (w.partial) {
      *reinterpret_cast<float4*>(p.part_o + partial_row(p, w, h) * D + d) = make_float4(o[0], o[1], o[2], o[3]);
    } else {
      store_from_float<T, kV>(static_cast<T*>(p.out) + ((int64_t)w.seq * p.num_q_heads + w.head0 + h) * D + d, o);
    }
  }
  trace_point(4);
  if (in_cluster) cluster_merge<T, D, kRows, kThreads, kLd>(p, ml_s, a_w, w);
}

// Combine the partials of each (sequence, head) that has several: grid (ceil(num_q_heads / heads), num_seqs),
// 128 threads, merge_heads<D, G>() heads a block; a head's threads are D / 4 dimension groups (4 dimensions a
// thread) times G partition groups. Group g takes partials g, g + G, g + 2G, ... kBatch at a time, rescaling
// to its running max; with G > 1 the groups' states then meet in shared memory and group 0 merges them in
// group order (deterministic). G = 1 where a sequence has at most kBatch partials (one batch of loads);
// longer splits take merge_groups<D>(), so a thread's loads in series are G times fewer (H100, NOTES.md,
// 2026-11-27 (14): 16 / 32 / 64 partitions at head size 128 had 3.0 / 4.5 / 9.9 us of merge after the decode
// kernel). With programmatic dependent launch (sm_90) it may start before the decode kernel ends: it reads
// the partials only after griddep_wait().
constexpr int kMergeBatch = 4;
template <int D> HK_HOST_DEVICE constexpr int merge_groups() { return D >= 256 ? 2 : 4; }
template <int D, int G> HK_HOST_DEVICE constexpr int merge_heads() { return 512 / (D * G); }

template <typename T, int D, int G, bool kDrop>
__global__ __launch_bounds__(128) void merge_kernel(Params p) {
  constexpr int kPerHead = D / 4, kBatch = kMergeBatch;
  static_assert(kPerHead * G * merge_heads<D, G>() == 128, "128 threads: heads x groups x dimension groups");
  const int head = blockIdx.x * merge_heads<D, G>() + threadIdx.x / (kPerHead * G), seq = blockIdx.y;
  const int g = threadIdx.x / kPerHead % G, d = threadIdx.x % kPerHead * 4;
  int n;
  // Partial j of this sequence's head h: row base + h * hstride + j * stride; first: this thread's head's
  // partial 0 (the same row, kept in this form for the merge).
  int64_t base, hstride, stride, first;
  if (p.split_target > 0) {
    griddep_wait();  // seq_parts comes from the decode kernel
    n = p.seq_parts[2 * seq + 1];
    base = (int64_t)p.seq_parts[2 * seq] * p.num_q_heads;
    hstride = 1;
    stride = p.num_q_heads;
    first = base + head;
  } else {
    const int len = context_len(p, seq);
    n = (len + p.partition_size - 1) / p.partition_size;  // partials that were written
    base = (int64_t)seq * p.num_q_heads * p.num_partitions;
    hstride = p.num_partitions;
    stride = 1;
    first = ((int64_t)seq * p.num_q_heads + head) * p.num_partitions;
    griddep_wait();
  }
  if (n <= 1) return;  // (the whole block: one sequence) one partition: the decode kernel wrote the output
  const bool active = head < p.num_q_heads;  // (with G > 1 every thread reaches the barrier below)
  float M = -INFINITY, L = 0.f, O[4] = {0.f, 0.f, 0.f, 0.f};
  // Merge a state (m, l, o) into the running one; an empty state (m = -inf) adds nothing.
  auto merge = [&](float m, float l, float4 o) {
    if (m == -INFINITY) return;
    const float mn = fmaxf(M, m), a = merge_weight(M, mn), c = fast_exp2(m - mn);
    L = L * a + l * c;
    O[0] = O[0] * a + o.x * c;
    O[1] = O[1] * a + o.y * c;
    O[2] = O[2] * a + o.z * c;
    O[3] = O[3] * a + o.w * c;
    M = mn;
  };
  // kBatch partials' loads (L2 hits) issued together before any is used: one round trip a batch.
  // Loaded one partial at a time, (m, l) then o behind a branch on m, they ran as two round trips a
  // partial, in series.
  for (int j0 = g; j0 < n; j0 += G * kBatch) {
    float2 ml[kBatch];
    float4 o[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (active && j0 + b * G < n) {  // every partial below n was written
        const int64_t r = first + (int64_t)(j0 + b * G) * stride;
        ml[b] = *reinterpret_cast<const float2*>(p.part_ml + 2 * r);
        o[b] = *reinterpret_cast<const float4*>(p.part_o + r * D + d);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (active && j0 + b * G < n) merge(ml[b].x, ml[b].y, o[b]);
  }
  // kDrop (launch_merge): the block's partial outputs are dead once merged, so after a barrier (every
  // value read has been used) their L2 lines are dropped rather than written back to DRAM while the next
  // kernel streams (discard_l2). A row is D floats, a whole number of 128-byte lines.
  auto drop_partials = [&] {
    constexpr int kLines = D * 4 / 128, kHeads = merge_heads<D, G>();
    const int h0 = blockIdx.x * kHeads, h1 = min(h0 + kHeads, p.num_q_heads);
    const int line = threadIdx.x % kLines;
    for (int h = h0; h < h1; ++h)
      for (int j = threadIdx.x / kLines; j < n; j += 128 / kLines)
        discard_l2(p.part_o + (base + h * hstride + (int64_t)j * stride) * D + line * 32);
  };
  static_assert(D * 4 % 128 == 0, "partial rows of whole lines");
  if constexpr (G > 1) {  // the groups' states, then group 0 merges groups 1 .. G - 1 in order
    __shared__ float st_s[6][128];
    const float mine[6] = {M, L, O[0], O[1], O[2], O[3]};
#pragma unroll
    for (int i = 0; i < 6; ++i) st_s[i][threadIdx.x] = mine[i];
    __syncthreads();
    if constexpr (kDrop) drop_partials();
    if (g != 0) return;
    for (int q = 1; q < G; ++q) {
      const int t = threadIdx.x + q * kPerHead;
      merge(st_s[0][t], st_s[1][t], make_float4(st_s[2][t], st_s[3][t], st_s[4][t], st_s[5][t]));
    }
  } else if constexpr (kDrop) {
    __syncthreads();
    drop_partials();
  }
  if (!active) return;
  const float f = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) O[j] *= f;
  const int64_t sh = (int64_t)seq * p.num_q_heads + head;
  store_from_float<T, 4>(static_cast<T*>(p.out) + sh * D + d, O);
  if (p.lse && d == 0) p.lse[sh] = lse_of(M, L);
}

// Partial outputs of at least this many bytes are dropped from L2 once merged (merge_kernel's kDrop).
// Dirty, they would be written back to DRAM while the next kernel streams; the drop costs the merge
// some tail. H100 (NOTES.md, 2026-11-27 (15)), with the next call streaming behind / with L2 flushed
// between calls: 8.4 MB of them (32 x 2048 x 64:1) 40.6 -> 38.1 us / 0.3-1.0 us slower; 4 MB (1 x 32768
// x 64:1, 64 partitions) 0.7-0.9 us faster / 0.4-0.5 slower; 0.5 MB (1 x 16384 x 8 kv, dropped in a
// trial) 0.2-0.4 faster / 0.4-1.1 slower. Hence none below 4 MB.
constexpr int64_t kDropPartialsBytes = 4 << 20;

// The merge kernel with G partition groups, a programmatic dependent launch after the decode kernel.
template <typename T, int D, int G>
int launch_merge(const Params& p, int num_seqs, hipStream_t stream) {
  constexpr int h = merge_heads<D, G>();
  const dim3 grid((unsigned)((p.num_q_heads + h - 1) / h), (unsigned)num_seqs);
  const int64_t rows = p.split_target > 0 ? (int64_t)(num_seqs + p.split_target) * p.num_q_heads
                                          : (int64_t)num_seqs * p.num_q_heads * p.num_partitions;
  void (*kernel)(Params) =
      rows * D * 4 >= kDropPartialsBytes ? merge_kernel<T, D, G, true> : merge_kernel<T, D, G, false>;
  HK_CHECK(launch_dependent(kernel, grid, dim3(128), 0, stream, p));
  return 0;
}

// Whether a uniform split of `parts` partitions runs as clusters (cluster_merge) for a kernel that
// can: where the build has clusters, parts <= kMaxCluster, and clusters of `parts` blocks need no
// more rounds over the device than the blocks alone (a cluster's blocks must fit one GPC at once).
// `cache`: the kernel's per device (< 64): [0] its resident blocks, [parts] its resident clusters of
// `parts` blocks, each plus one (0: not asked yet). HIPKERN_NO_CLUSTERS set (to any value) in the environment turns
// clusters off (the merge kernel), for comparisons.
typedef int ClusterCache[64][kMaxCluster + 1];
template <typename Kernel>
int use_clusters(Kernel kernel, unsigned long long& raised, ClusterCache& cache, int threads, int smem_bytes, int parts,
                 int64_t blocks, int device, bool* out) {
  static const bool off = getenv("HIPKERN_NO_CLUSTERS") != nullptr;  // diagnostic, as HIPKERN_NO_PDL
  *out = false;
  if (!kClusters || off || parts < 2 || parts > kMaxCluster) return 0;
  int* c = device < 64 ? cache[device] : nullptr;
  int slots = c ? __atomic_load_n(&c[0], __ATOMIC_RELAXED) - 1 : -1;
  int clusters = c ? __atomic_load_n(&c[parts], __ATOMIC_RELAXED) - 1 : -1;
  if (slots < 0) {
    int per_sm = 0, sms = 0;
    HK_TRY(resident_blocks(kernel, raised, threads, smem_bytes, device, &per_sm));
    HK_CHECK(hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, device));
    slots = per_sm * sms;
    if (c) __atomic_store_n(&c[0], slots + 1, __ATOMIC_RELAXED);
  }
  if (clusters < 0) {
    HK_TRY(max_clusters(kernel, threads, smem_bytes, dim3(1, 1, (unsigned)parts), &clusters));
    if (c) __atomic_store_n(&c[parts], clusters + 1, __ATOMIC_RELAXED);
  }
  const int64_t cluster_slots = (int64_t)clusters * parts;
  *out = cluster_slots > 0 && slots > 0 && (blocks + cluster_slots - 1) / cluster_slots <= (blocks + slots - 1) / slots;
  return 0;
}

// Launch a decode kernel of `heads` query heads per block over the grid block_work() reads, then
// the merge if split. A kernel that calls finish() with shared memory for the cluster merge
// (`cluster_cache` non-null) runs a uniform split as clusters where use_clusters() says so.
template <typename T, int D, typename Kernel>
int launch_decode(Kernel kernel, unsigned long long& raised, const Params& p, int heads, int num_kv_heads,
                  int num_seqs, int threads, int smem_bytes, int device, hipStream_t stream,
                  const char* name /* "launch of ..." */, ClusterCache* cluster_cache = nullptr) {
  HK_TRY(allow_shared(kernel, raised, smem_bytes, device));
  const unsigned hgroups = (unsigned)((p.group + heads - 1) / heads);
  const unsigned items = p.split_target > 0 ? (unsigned)(num_seqs + p.split_target) : (unsigned)num_seqs;
  const dim3 grid((unsigned)num_kv_heads * hgroups, items, p.split_target > 0 ? 1u : (unsigned)p.num_partitions);
  // e.g. v3 on CDNA at 1024 sequences x 16 KV heads x 1024 partitions
  // A split's merge grid (launch_merge: 128 threads a block of merge_heads) may be the larger: checked
  // here too, before anything is launched.
  const bool split = p.num_partitions > 1 || p.split_target > 0;
  const int most = p.split_target > 0 ? p.split_target : p.num_partitions;
  const int merge_h = most <= kMergeBatch ? merge_heads<D, 1>() : merge_heads<D, merge_groups<D>()>();
  const int64_t merge_blocks = (int64_t)((p.num_q_heads + merge_h - 1) / merge_h) * num_seqs;
  if (!threads_fit((int64_t)grid.x * grid.y * grid.z, threads) || (split && !threads_fit(merge_blocks, 128)))
    return set_invalid("paged_attention: this launch needs 2^32 threads or more, more than HIP runs (fewer "
                       "sequences or KV heads a call, or a shorter block table)", __FILE__, __LINE__);
  bool clusters = false;
  if (cluster_cache != nullptr && p.split_target == 0)
    HK_TRY(use_clusters(kernel, raised, *cluster_cache, threads, smem_bytes, p.num_partitions,
                        (int64_t)grid.x * grid.y * grid.z, device, &clusters));
  if (clusters) {
    Params q = p;
    q.cluster = p.num_partitions;
    const hipError_t err =
        launch_clusters(kernel, grid, dim3(threads), smem_bytes, stream, dim3(1, 1, (unsigned)q.cluster), q);
    if (err != hipSuccess) return set_error((int)err, name, __FILE__, __LINE__);
    return 0;
  }
  hipLaunchKernelGGL(kernel, grid, dim3(threads), smem_bytes, stream, p);
  const hipError_t err = hipGetLastError();
  if (err != hipSuccess) return set_error((int)err, name, __FILE__, __LINE__);
  if (split) {
    // A sequence's partials: at most num_partitions, or (per-sequence split) split_target (block_work's
    // plan gives a sequence round(tiles / c) partitions with c >= all tiles / split_target).
    return most <= kMergeBatch ? launch_merge<T, D, 1>(p, num_seqs, stream)
                               : launch_merge<T, D, merge_groups<D>()>(p, num_seqs, stream);
  }
  return 0;
}

}  // namespace paged_attention
}  // namespace hk
