// Paged-attention decode: one query token per sequence against its paged K/V cache.
//
// One block per (KV head, group of HPB query heads of it, sequence, partition of the context).
// All query heads of the group are computed together, so each K/V byte is read once per group.
// The block's waves take the partition's tokens in tiles of one token per lane:
//   QK^T: lane t reads token t's K row with 16-byte loads and dots it with the (scaled) queries,
//         which every lane reads from shared memory as broadcasts;
//   softmax: online, in the log2 domain, per head (wave max; per-lane partial sums);
//   PV:   the lanes split the head dimension; each token's V row is weighted by the probabilities
//         the QK step left in shared memory. Where the target copies asynchronously (sm_80+), the
//         tile's V rows are staged into shared memory by coalesced copies issued before the K loads,
//         so their latency hides behind QK^T; elsewhere PV reads them from global memory.
// The waves' states merge through shared memory. With one partition the block writes the output;
// with several (flash-decoding split-K) it writes an unnormalised partial and its (m, l), and
// merge_kernel combines the partials of each (sequence, head). All cache offsets are 64-bit.
// Invalid metadata never reads out of bounds: context lengths are clamped to [0, what the block
// table row addresses] and tokens whose block id lies outside the cache are skipped.
#include "hipkern/error.h"
#include "hipkern/online_softmax.h"
#include "hipkern/reduce.h"
#include "hipkern/vec.h"

#ifndef HK_DTYPE
#error "build with -DHK_DTYPE=<hk::DType> and -DHK_HEAD_SIZE=<64|128|256>"
#endif

namespace hk {
namespace paged_attention {

constexpr int kWaves = 4;
constexpr int kThreads = kWaves * kWaveSize;

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

template <typename T, int D, int HPB>
struct Smem {  // floats; the merge area reuses the tile area once every wave is done
  static constexpr bool stage_v = kAsyncCopy;
  static constexpr int q = HPB * D;
  static constexpr int p = kWaves * kWaveSize * HPB;
  static constexpr int off = 2 * kWaves * kWaveSize;  // int64 row offsets, as pairs of floats
  static constexpr int v = stage_v ? kWaves * kWaveSize * D * (int)sizeof(T) / 4 : 0;  // V tiles
  static constexpr int tile = q + p + off + v;
  static constexpr int merge = 2 * kWaves * HPB + kWaves * HPB * D;
  static constexpr int bytes = 4 * (tile > merge ? tile : merge);
};

// A sequence's context length, clamped to what its block-table row can address (never negative).
HK_DEVICE int context_len(const Params& p, int seq) {
  const int64_t cap = (int64_t)p.max_blocks_per_seq << p.block_size_log2;
  const int64_t len = p.context_lens[seq];
  return (int)(len < 0 ? 0 : len > cap ? cap : len);
}

// Blocks that must fit on one SM at once (CUDA): caps registers at 128 per thread for head <= 128
// so that enough waves keep loads in flight; head 256 needs more registers.
template <int D> constexpr int min_blocks() { return D <= 128 ? 4 : 2; }

template <typename T, int D, int HPB>
__global__ HK_LAUNCH_BOUNDS(kThreads, min_blocks<D>()) void decode_kernel(Params p) {
  constexpr int W = kWaveSize;
  constexpr int KV = 16 / sizeof(T);  // K elements per 16-byte load
  constexpr int DPL = D / W;          // head dims per lane in PV
  static_assert(D % KV == 0 && D % W == 0, "head size");
  typedef Smem<T, D, HPB> S;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* p_s = q_s + S::q;
  int64_t* off_s = reinterpret_cast<int64_t*>(p_s + S::p);
  T* v_s = reinterpret_cast<T*>(off_s + kWaves * kWaveSize);

  const int hgroups = (p.group + HPB - 1) / HPB;
  const int kvh = blockIdx.x / hgroups;
  const int hg = blockIdx.x % hgroups;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int len = context_len(p, seq);
  const int start = part * p.partition_size;
  if (p.num_partitions > 1 && start >= len) return;  // merge_kernel never reads this partial
  const int end = min(len, start + p.partition_size);
  const int head0 = kvh * p.group + hg * HPB;
  const int nh = min(HPB, p.group - hg * HPB);  // real heads in this group

  const T* q = static_cast<const T*>(p.q) + (int64_t)seq * p.q_stride_s;
  for (int i = threadIdx.x; i < HPB * D; i += kThreads) {
    const int h = i / D;
    q_s[i] = h < nh ? to_float(q[(int64_t)(head0 + h) * p.q_stride_h + i % D]) * p.scale_log2 : 0.f;
  }
  __syncthreads();

  const int wave = threadIdx.x / W;
  const int lane = threadIdx.x % W;
  const T* kbase = static_cast<const T*>(p.k) + (int64_t)kvh * p.kv_stride_head;
  const T* vbase = static_cast<const T*>(p.v) + (int64_t)kvh * p.kv_stride_head;
  const int32_t* bt = p.block_tables + (int64_t)seq * p.bt_stride;
  const int bs_mask = (1 << p.block_size_log2) - 1;
  float* my_p = p_s + wave * W * HPB;
  int64_t* my_off = off_s + wave * W;
  T* my_v = v_s + wave * W * D;
  constexpr int kChunks = D / KV;            // 16-byte chunks of a row
  constexpr int kRowsPerStep = W / kChunks;  // rows a wave copies per step (D <= 8 * W)
  static_assert(kChunks <= W, "one row per wave step at most");

  float m[HPB], l[HPB], acc[HPB][DPL];
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int j = 0; j < DPL; ++j) acc[h][j] = 0.f;
  }

  for (int t0 = start + wave * W; t0 < end; t0 += kWaves * W) {
    const int t = t0 + lane;
    float s[HPB];
#pragma unroll
    for (int h = 0; h < HPB; ++h) s[h] = 0.f;
    int64_t off = 0;  // token t's row; an id outside the cache masks the token instead
    const int blk = t < end ? bt[t >> p.block_size_log2] : -1;
    const bool present = blk >= 0 && blk < p.num_blocks;
    if (present) off = (int64_t)blk * p.kv_stride_block + (int64_t)(t & bs_mask) * p.kv_stride_tok;
    const int n = min(W, end - t0);
    if constexpr (S::stage_v) {  // start this tile's V rows on their way to shared memory
      my_off[lane] = off;
      wave_sync();
      for (int r = lane / kChunks; r < n; r += kRowsPerStep) {
        const int c = lane % kChunks;
        async_copy16(my_v + r * D + c * KV, vbase + my_off[r] + c * KV);
      }
    }
    if (present) {
      const T* krow = kbase + off;
#pragma unroll
      for (int c = 0; c < D / KV; ++c) {
        float kf[KV];
        load_as_float<T, KV>(krow + c * KV, kf);
#pragma unroll
        for (int h = 0; h < HPB; ++h) {
#pragma unroll
          for (int j = 0; j < KV; ++j) s[h] = fmaf(q_s[h * D + c * KV + j], kf[j], s[h]);
        }
      }
    } else {
#pragma unroll
      for (int h = 0; h < HPB; ++h) s[h] = -INFINITY;
    }
    if constexpr (!S::stage_v) my_off[lane] = off;
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
      const float mn = fmaxf(m[h], group_max<W>(s[h]));
      const float alpha = merge_weight(m[h], mn);
      const float pr = merge_weight(s[h], mn);
      l[h] = l[h] * alpha + pr;
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[h][j] *= alpha;
      m[h] = mn;
      my_p[lane * HPB + h] = pr;
    }
    if constexpr (S::stage_v) async_copy_wait();
    wave_sync();
#pragma unroll 4
    for (int i = 0; i < n; ++i) {
      float vf[DPL];
      if constexpr (S::stage_v) {
        load_as_float<T, DPL>(my_v + i * D + lane * DPL, vf);
      } else {
        load_as_float<T, DPL>(vbase + my_off[i] + lane * DPL, vf);
      }
#pragma unroll
      for (int h = 0; h < HPB; ++h) {
        const float pr = my_p[i * HPB + h];
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[h][j] = fmaf(pr, vf[j], acc[h][j]);
      }
    }
    wave_sync();  // the next tile overwrites my_p / my_off / my_v
  }
#pragma unroll
  for (int h = 0; h < HPB; ++h) l[h] = group_sum<W>(l[h]);

  // Merge the waves' states.
  __syncthreads();
  float* m_w = smem;                 // [kWaves][HPB]
  float* l_w = m_w + kWaves * HPB;   // [kWaves][HPB]
  float* a_w = l_w + kWaves * HPB;   // [kWaves][HPB][D]
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    if (lane == 0) {
      m_w[wave * HPB + h] = m[h];
      l_w[wave * HPB + h] = l[h];
    }
#pragma unroll
    for (int j = 0; j < DPL; ++j) a_w[(wave * HPB + h) * D + lane * DPL + j] = acc[h][j];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nh * D; i += kThreads) {
    const int h = i / D, d = i % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWaves; ++w) M = fmaxf(M, m_w[w * HPB + h]);
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < kWaves; ++w) {
      const float c = merge_weight(m_w[w * HPB + h], M);
      L += l_w[w * HPB + h] * c;
      O += a_w[(w * HPB + h) * D + d] * c;
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

template <typename T, int D, int HPB>
int launch(const Params& p, int num_seqs, int num_kv_heads, hipStream_t stream) {
  const int hgroups = (p.group + HPB - 1) / HPB;
  const dim3 grid((unsigned)(num_kv_heads * hgroups), (unsigned)num_seqs, (unsigned)p.num_partitions);
  constexpr int kSmemBytes = Smem<T, D, HPB>::bytes;
  if (kSmemBytes > 48 * 1024) {  // above the default dynamic limit: opt in (once per kernel)
    static bool raised = false;
    if (!raised) {
      HK_CHECK(hipFuncSetAttribute(reinterpret_cast<const void*>(&decode_kernel<T, D, HPB>),
                                   hipFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
      raised = true;
    }
  }
  hipLaunchKernelGGL(HIP_KERNEL_NAME(decode_kernel<T, D, HPB>), grid, dim3(kThreads), kSmemBytes, stream, p);
  HK_CHECK_LAUNCH("paged_attention decode_kernel");
  if (p.num_partitions > 1) {
    hipLaunchKernelGGL(HIP_KERNEL_NAME(merge_kernel<T, D>), dim3((unsigned)p.num_q_heads, (unsigned)num_seqs),
                       dim3(D), 0, stream, p);
    HK_CHECK_LAUNCH("paged_attention merge_kernel");
  }
  return 0;
}

}  // namespace paged_attention
}  // namespace hk

// Shapes and strides in elements. heads_per_block: 1, 2, 4 or 8 (query heads of one KV head per
// block). num_partitions == 1: single pass (part_o/part_ml unused); else partition_size tokens per
// partition, workspaces as in Params. Returns 0 or an error code (message: hk_last_error()).
HK_EXPORT int hk_paged_attention_decode(
    const void* q, int64_t q_stride_s, int64_t q_stride_h, const void* k, const void* v,
    int64_t kv_stride_block, int64_t kv_stride_tok, int64_t kv_stride_head, const int32_t* block_tables,
    int64_t bt_stride, const int32_t* context_lens, void* out, float* lse, float* part_o, float* part_ml,
    int num_seqs, int num_q_heads, int num_kv_heads, int block_size_log2, int max_blocks_per_seq,
    int num_blocks, int num_partitions, int partition_size, int heads_per_block, float scale, int device,
    void* stream) {
  using namespace hk::paged_attention;
  typedef typename hk::elem_of<HK_DTYPE>::type T;
  constexpr int D = HK_HEAD_SIZE;
  HK_REQUIRE(num_seqs >= 1 && num_seqs <= 65535);
  HK_REQUIRE(num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0);
  HK_REQUIRE(block_size_log2 >= 0 && block_size_log2 <= 10);
  HK_REQUIRE(max_blocks_per_seq >= 1 && ((int64_t)max_blocks_per_seq << block_size_log2) < (1ll << 31));
  HK_REQUIRE(num_partitions >= 1 && num_partitions <= 65535 && partition_size >= 1);
  HK_REQUIRE(num_partitions == 1 || (part_o && part_ml));
  HK_TRY(hk::use_device(device));
  const Params p{q, q_stride_s, q_stride_h, k, v, kv_stride_block, kv_stride_tok, kv_stride_head,
                 block_tables, bt_stride, context_lens, out, lse, part_o, part_ml, num_q_heads,
                 num_q_heads / num_kv_heads, block_size_log2, num_partitions, partition_size,
                 max_blocks_per_seq, num_blocks, scale * hk::kLog2e};
  hipStream_t s = static_cast<hipStream_t>(stream);
  switch (heads_per_block) {
    case 1: return launch<T, D, 1>(p, num_seqs, num_kv_heads, s);
    case 2: return launch<T, D, 2>(p, num_seqs, num_kv_heads, s);
    case 4: return launch<T, D, 4>(p, num_seqs, num_kv_heads, s);
    case 8: return launch<T, D, 8>(p, num_seqs, num_kv_heads, s);
  }
  return hk::set_invalid("heads_per_block is 1, 2, 4 or 8", __FILE__, __LINE__);
}

// Streaming multiprocessors / compute units of the current device (for the split heuristic).
HK_EXPORT int hk_device_sm_count(int device) {
  int n = 0;
  if (hipDeviceGetAttribute(&n, hipDeviceAttributeMultiprocessorCount, device) != hipSuccess) return -1;
  return n;
}
