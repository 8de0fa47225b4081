// MoE sorting: group the routed (token, slot) pairs by expert for block-tiled expert GEMMs.
//
// Input ids [num_pairs] (topk_ids flattened: pair p = t * k + j). Output: sorted[max_padded], each
// expert's pair indices in ascending order, segments in expert order, each padded with the
// sentinel num_pairs to a multiple of block_m, the tail past the last segment also the sentinel;
// expert_ids[max_padded / block_m], the expert of each block_m rows (expert_map[e] when a map is
// given; -1 past the last segment); num_post[0], the padded total. Pairs whose id is outside
// [0, E) (never read through) or whose expert is remote (expert_map[e] < 0) are dropped.
//
// Stable counting sort with wave-ordered ranks (see NOTES.md for the choice of paths):
//   a range of pairs is split into one contiguous sub-range per wave; a wave loads its experts
//   into registers at once (loads overlap), then walks them a wave-width step at a time, and
//   match_any gives each lane the lanes of the step with the same
//   expert, so its rank among them and the step's count per expert (added by the lowest such lane
//   to the wave's row of per-expert counters in shared memory: no atomics, no races).
//   Counts -> per-wave exclusive prefixes -> cursors; a second walk writes each pair at its
//   expert's cursor plus its rank and advances the cursor. Order within an expert is thus the
//   pair order: waves in order, steps in order, lanes in order.
// Single block (num_pairs <= kOneBlockMaxPairs): count, layout and scatter in one kernel (instances of
// one step a wave for at most kThreads pairs, and of one expert a thread for at most kThreads experts).
// Larger: count (a histogram per chunk of kChunk pairs) -> scan (one block per expert, the
// chunks' exclusive prefixes) -> scatter (one block per chunk: layout, per-wave ranks, writes).
#include "hipkern/error.h"
#include "hipkern/moe.h"
#include "hipkern/reduce.h"

namespace hk {
namespace moe_sorting {

constexpr int kThreads = 256;
constexpr int kWaves = kThreads / kWaveSize;
constexpr int kMaxExperts = 1024;
constexpr int kMaxBlockM = 1024;
// Above this many pairs the multi-block path. H100, CUDA-graph replay (NOTES.md, 2026-11-27 (17)): one block
// took 20.2 / 24.2 us for 6144 / 8192 pairs over 256 experts against 15.2 / 14.7 in three kernels, and 11.4
// against 10.0 for 8192 over 8; at 4096 pairs one block is level (256 experts) or faster (8: 7.4 against 10.1).
constexpr int kOneBlockMaxPairs = 4096;
constexpr int kChunk = 2048;  // pairs per block of the multi-block path
static_assert(kMaxExperts % kThreads == 0, "experts per thread in the layout scan");
static_assert(kOneBlockMaxPairs % kThreads == 0 && kChunk % kThreads == 0, "whole steps per lane");

struct Args {
  const int32_t* ids;
  const int32_t* expert_map;  // [E] or null
  int32_t* sorted;
  int32_t* expert_ids;
  int32_t* num_post;
  int32_t* hist;    // workspace [E][num_chunks]: chunk counts, then their exclusive prefixes
  int32_t* totals;  // workspace [E]
  int num_pairs;
  int num_experts;
  int block_m;
  int max_padded;
  int num_chunks;
  int expert_bits;  // bits of the values 0..E (E is "no expert")
};

// Shared memory of the kernels that rank pairs: per-wave counters, then cursors.
struct RankSmem {
  int cnt[kWaves][kMaxExperts];
  int tot[kMaxExperts];       // pairs per expert
  int base[kMaxExperts + 1];  // segment starts; base[E] = the padded total
  int scan[kWaves];
};

// The expert of pair begin + off, or E when it is dropped (off >= len, id outside [0, E), remote).
HK_DEVICE int expert_at(const Args& a, int begin, int off, int len) {
  if (off >= len) return a.num_experts;
  const int e = a.ids[begin + off];
  return moe_kept_expert(e, a.num_experts, a.expert_map);
}

// One wave's pairs [lo, lo + len), len <= kSteps * wave size, with their experts in registers
// (all loads issued up front, then checked): lane l holds pairs lo + s * wave size + l. Steps past len
// are neither loaded nor walked (e[s] unset there).
template <int kSteps>
struct WavePairs {
  int e[kSteps];
  int lo, len;

  HK_DEVICE void load(const Args& a, int lo_, int len_) {
    lo = lo_;
    len = len_;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if (s * kWaveSize >= len) break;  // the same on every lane
      const int off = s * kWaveSize + lane_id();
      e[s] = off < len ? a.ids[lo + off] : a.num_experts;
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {  // (a check in the loop above would wait for each load in turn)
      if (s * kWaveSize >= len) break;
      e[s] = moe_kept_expert(e[s], a.num_experts, a.expert_map);
    }
  }

  // cnt[x] += this wave's pairs of expert x (cnt: the wave's own row).
  HK_DEVICE void count(const Args& a, int* cnt) const {
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if (s * kWaveSize >= len) break;  // the same on every lane
      const lanemask_t peers = match_any((uint32_t)e[s], a.expert_bits);
      if (e[s] < a.num_experts && (peers & lanemask_lt()) == 0) cnt[e[s]] += popc(peers);
      wave_sync();
    }
  }

  // Write each pair at its expert's cursor + its rank among the step's lanes of that expert.
  HK_DEVICE void scatter(const Args& a, int* cur) const {
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if (s * kWaveSize >= len) break;
      const lanemask_t peers = match_any((uint32_t)e[s], a.expert_bits);
      const lanemask_t below = peers & lanemask_lt();
      const bool kept = e[s] < a.num_experts;
      const int at = kept ? cur[e[s]] + popc(below) : 0;
      wave_sync();  // every lane has read its cursor before the lowest lane advances it
      if (kept) {
        a.sorted[at] = lo + s * kWaveSize + lane_id();
        if (below == 0) cur[e[s]] += popc(peers);
      }
      wave_sync();
    }
  }
};

HK_DEVICE void zero_counts(const Args& a, RankSmem& s) {
  for (int w = 0; w < kWaves; ++w)
    for (int e = threadIdx.x; e < a.num_experts; e += kThreads) s.cnt[w][e] = 0;
}

// Per-wave counts -> cursors: expert e of wave w starts at start(e) + the counts of e in earlier
// waves, where start(e) = s.base[e] + chunk_offset(e).
template <typename Offset>
HK_DEVICE void counts_to_cursors(const Args& a, RankSmem& s, Offset chunk_offset) {
  for (int e = threadIdx.x; e < a.num_experts; e += kThreads) {
    int run = s.base[e] + chunk_offset(e);
    for (int w = 0; w < kWaves; ++w) {
      const int c = s.cnt[w][e];
      s.cnt[w][e] = run;
      run += c;
    }
  }
}

// From s.tot: s.base (padded segment sizes scanned in expert order). Then block `blk` of `nblk`
// writes its share of expert_ids, of the segments' padding and of the tail; block 0 num_post.
// kPer: experts a thread scans (E <= kPer * kThreads).
template <int kPer = kMaxExperts / kThreads>
HK_DEVICE void layout(const Args& a, RankSmem& s, int blk, int nblk) {
  const int E = a.num_experts, bm = a.block_m;
  int padded[kPer];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = threadIdx.x * kPer + i;
    padded[i] = e < E ? (s.tot[e] + bm - 1) / bm * bm : 0;
    sum += padded[i];
  }
  int total;
  int off = block_exclusive_sum<kThreads>(sum, s.scan, total);
  __syncthreads();  // racecheck (H100) paired the scan's reads of s.scan with the s.base writes below
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = threadIdx.x * kPer + i;
    if (e < E) s.base[e] = off;
    off += padded[i];
  }
  if (threadIdx.x == 0) s.base[E] = total;
  __syncthreads();

  if (blk == 0 && threadIdx.x == 0) *a.num_post = total;
  // The grid-stride loops over positions count in 64 bits: the multi-block grid's stride is ~pairs / 8,
  // so near the int32 limit of max_padded a 32-bit `total + first` or `j + stride` would wrap negative.
  const int first = blk * kThreads + threadIdx.x, stride = nblk * kThreads;
  for (int64_t j = first; j < a.max_padded / bm; j += stride) {
    const int pos = (int)j * bm;
    int v = -1;
    if (pos < total) {  // the last expert whose segment starts at or before pos
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (s.base[mid] <= pos) lo = mid; else hi = mid - 1;
      }
      v = a.expert_map != nullptr ? a.expert_map[lo] : lo;
    }
    a.expert_ids[j] = v;
  }
  // Each segment's padding, by the thread of its expert, in 16-byte stores where the rows allow: with a
  // 4-byte store a row, each store instruction touched a line per lane (8.7 us against 4.0 for 32 tokens
  // x top-8 over 256 experts at block_m 32, H100). Coalescing them through a wave (an expert at a time)
  // cost more at every other shape than it saved there: a serial chain of shuffles or shared reads.
  const bool vec = reinterpret_cast<uintptr_t>(a.sorted) % 16 == 0;
  const int4 fill = make_int4(a.num_pairs, a.num_pairs, a.num_pairs, a.num_pairs);
  for (int e = first; e < E; e += stride) {
    int q = s.base[e] + s.tot[e];
    const int end = s.base[e + 1];
    if (vec) {
      for (; q < end && q % 4 != 0; ++q) a.sorted[q] = a.num_pairs;
      for (; q + 4 <= end; q += 4) *reinterpret_cast<int4*>(a.sorted + q) = fill;
    }
    for (; q < end; ++q) a.sorted[q] = a.num_pairs;
  }
  for (int64_t q = (int64_t)total + first; q < a.max_padded; q += stride) a.sorted[q] = a.num_pairs;
}

// Wave w's part [lo, lo + len) of the pairs [begin, end): contiguous, in wave order.
HK_DEVICE void wave_range(int begin, int end, int& lo, int& len) {
  const int per = (end - begin + kWaves - 1) / kWaves;
  lo = min(begin + (int)(threadIdx.x / kWaveSize) * per, end);
  len = min(per, end - lo);
}

struct NoOffset { HK_DEVICE int operator()(int) const { return 0; } };
struct ChunkOffset {
  const int32_t* hist;
  int num_chunks, chunk;
  HK_DEVICE int operator()(int e) const { return hist[(int64_t)e * num_chunks + chunk]; }
};

// kSteps: a wave's steps of pairs (num_pairs <= kSteps * kThreads); kPer: layout()'s experts a thread.
template <int kSteps, int kPer>
__global__ __launch_bounds__(kThreads) void one_block_kernel(Args a) {
  __shared__ RankSmem s;
  griddep_launch_dependents();  // a consumer launched with launch_dependent (fused_moe) may be scheduled now
  const int w = threadIdx.x / kWaveSize;
  int lo, len;
  wave_range(0, a.num_pairs, lo, len);
  WavePairs<kSteps> pairs;
  pairs.load(a, lo, len);
  zero_counts(a, s);
  __syncthreads();
  pairs.count(a, s.cnt[w]);
  __syncthreads();
  for (int e = threadIdx.x; e < a.num_experts; e += kThreads) {
    int t = 0;
    for (int v = 0; v < kWaves; ++v) t += s.cnt[v][e];
    s.tot[e] = t;
  }
  __syncthreads();
  layout<kPer>(a, s, 0, 1);
  counts_to_cursors(a, s, NoOffset());
  __syncthreads();
  pairs.scatter(a, s.cnt[w]);
}

// Multi-block 1/3: hist[e][c] = pairs of expert e in chunk c.
__global__ __launch_bounds__(kThreads) void count_kernel(Args a) {
  constexpr int kPer = kChunk / kThreads;
  __shared__ int h[kMaxExperts];
  const int begin = blockIdx.x * kChunk, len = min(kChunk, a.num_pairs - begin);
  int e[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) e[i] = expert_at(a, begin, i * kThreads + threadIdx.x, len);
  for (int x = threadIdx.x; x < a.num_experts; x += kThreads) h[x] = 0;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (e[i] < a.num_experts) atomicAdd(&h[e[i]], 1);  // integer: the count is order-independent
  __syncthreads();
  for (int x = threadIdx.x; x < a.num_experts; x += kThreads) a.hist[(int64_t)x * a.num_chunks + blockIdx.x] = h[x];
}

// Multi-block 2/3, one block per expert: its chunk counts -> exclusive prefixes; totals[e].
__global__ __launch_bounds__(kThreads) void scan_kernel(Args a) {
  __shared__ int scan[kWaves];
  int32_t* row = a.hist + (int64_t)blockIdx.x * a.num_chunks;
  int carry = 0;
  for (int base = 0; base < a.num_chunks; base += kThreads) {
    const int i = base + threadIdx.x;
    const int v = i < a.num_chunks ? row[i] : 0;
    int total;
    const int ex = block_exclusive_sum<kThreads>(v, scan, total);
    if (i < a.num_chunks) row[i] = carry + ex;
    carry += total;
  }
  if (threadIdx.x == 0) a.totals[blockIdx.x] = carry;
}

// Multi-block 3/3, one block per chunk: layout (each block its share), then rank and write.
__global__ __launch_bounds__(kThreads) void scatter_kernel(Args a) {
  __shared__ RankSmem s;
  griddep_launch_dependents();
  const int w = threadIdx.x / kWaveSize;
  const int begin = blockIdx.x * kChunk;
  int lo, len;
  wave_range(begin, min(begin + kChunk, a.num_pairs), lo, len);
  WavePairs<kChunk / kThreads> pairs;
  pairs.load(a, lo, len);
  for (int e = threadIdx.x; e < a.num_experts; e += kThreads) s.tot[e] = a.totals[e];
  zero_counts(a, s);
  __syncthreads();
  layout(a, s, blockIdx.x, gridDim.x);
  pairs.count(a, s.cnt[w]);
  __syncthreads();
  counts_to_cursors(a, s, ChunkOffset{a.hist, a.num_chunks, (int)blockIdx.x});
  __syncthreads();
  pairs.scatter(a, s.cnt[w]);
}

HK_HOST_DEVICE int64_t workspace_ints(int num_pairs, int num_experts) {
  if (num_pairs <= kOneBlockMaxPairs) return 0;
  const int64_t chunks = (num_pairs + kChunk - 1) / kChunk;
  return chunks * num_experts + num_experts;
}

}  // namespace moe_sorting
}  // namespace hk

// int32 elements of workspace hk_moe_sorting needs for these sizes (0: none).
HK_EXPORT int64_t hk_moe_sorting_workspace(int num_pairs, int num_experts) {
  return num_pairs < 0 || num_experts < 1 ? 0 : hk::moe_sorting::workspace_ints(num_pairs, num_experts);
}

// ids int32 [num_pairs], expert_map int32 [num_experts] or null -> sorted [max_padded],
// expert_ids [max_padded / block_m], num_post [1] (all int32). Returns 0 or an error code.
HK_EXPORT int hk_moe_sorting(const int32_t* ids, const int32_t* expert_map, int32_t* sorted, int32_t* expert_ids,
                             int32_t* num_post, int32_t* workspace, int64_t workspace_len, int num_pairs,
                             int num_experts, int block_m, int max_padded, int device, void* stream) {
  using namespace hk::moe_sorting;
  HK_REQUIRE(num_pairs >= 0);
  HK_REQUIRE(num_experts >= 1 && num_experts <= kMaxExperts);
  HK_REQUIRE(block_m >= 1 && block_m <= kMaxBlockM);
  // Room for a wave-width step past the last pair and for every expert's padding, in int32.
  HK_REQUIRE((int64_t)num_pairs + (int64_t)num_experts * block_m + 4096 <= 0x7fffffff);
  const int64_t want = ((int64_t)num_pairs + (int64_t)num_experts * (block_m - 1) + block_m - 1) / block_m * block_m;
  HK_REQUIRE(max_padded == want);
  HK_REQUIRE(workspace_len >= workspace_ints(num_pairs, num_experts));
  HK_TRY(hk::use_device(device));
  int bits = 0;
  while ((1 << bits) <= num_experts) ++bits;
  const int chunks = (num_pairs + kChunk - 1) / kChunk;
  int32_t* totals = workspace != nullptr ? workspace + (int64_t)chunks * num_experts : nullptr;
  Args a{ids, expert_map, sorted, expert_ids, num_post, workspace, totals,
         num_pairs, num_experts, block_m, max_padded, chunks, bits};
  hipStream_t s = static_cast<hipStream_t>(stream);
  if (num_pairs <= kOneBlockMaxPairs) {
    // Up to a step a wave (a decode batch's pairs: DeepSeek-like 32 tokens x top-8) and 256 experts, the
    // kernel of one step and one expert a thread: fewer registers and instructions on fused_moe's path
    // (H100, NOTES.md, 2026-11-27 (16)). Beyond that the kSteps instance, whose waves skip the steps past
    // their share (WavePairs::load), with one expert a thread in the layout up to 256 experts, four above.
    constexpr int kSteps = kOneBlockMaxPairs / kThreads;
    if (num_pairs <= kThreads && num_experts <= kThreads)
      hipLaunchKernelGGL((one_block_kernel<1, 1>), dim3(1), dim3(kThreads), 0, s, a);
    else if (num_experts <= kThreads)
      hipLaunchKernelGGL((one_block_kernel<kSteps, 1>), dim3(1), dim3(kThreads), 0, s, a);
    else
      hipLaunchKernelGGL((one_block_kernel<kSteps, kMaxExperts / kThreads>), dim3(1), dim3(kThreads), 0, s, a);
    HK_CHECK_LAUNCH("moe_sorting one_block_kernel");
    return 0;
  }
  HK_REQUIRE(workspace != nullptr);
  hipLaunchKernelGGL(count_kernel, dim3(chunks), dim3(kThreads), 0, s, a);
  HK_CHECK_LAUNCH("moe_sorting count_kernel");
  hipLaunchKernelGGL(scan_kernel, dim3(num_experts), dim3(kThreads), 0, s, a);
  HK_CHECK_LAUNCH("moe_sorting scan_kernel");
  hipLaunchKernelGGL(scatter_kernel, dim3(chunks), dim3(kThreads), 0, s, a);
  HK_CHECK_LAUNCH("moe_sorting scatter_kernel");
  return 0;
}
