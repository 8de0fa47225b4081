// Paged-attention decode: one query token per sequence against its paged K/V cache.
//
// One block per (KV head, group of HPB query heads of it, sequence, partition of the context).
// All query heads of the group are computed together, so each K/V byte is read once per group.
// The block's waves take the partition's tokens in tiles of one token per lane:
//   QK^T: lane t reads token t's K row with 16-byte loads and dots it with the (scaled) queries,
//         which every lane reads from shared memory as broadcasts;
//   softmax: online, in the log2 domain, per head (wave max; per-lane partial sums);
//   PV:   the lanes split the head dimension; each token's V row is weighted by the probabilities
//         the QK step left in shared memory.
// Where the target copies asynchronously (sm_80+) and the head size is at most 128, each wave
// double-buffers its K and V tiles in shared memory: coalesced async copies of tile i + 1 fly while
// tile i is computed. Elsewhere K and V rows are read from global memory as the steps need them.
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

// Shared memory, in floats. The merge area reuses the tile area once every wave is done.
template <typename T, int D, int HPB>
struct Smem {
  // Double-buffered K and V tiles per wave, filled by async copies (sm_80+, head size <= 128:
  // larger tiles would leave too few waves per SM); otherwise K and V are read from global memory.
  static constexpr bool staged = kAsyncCopy && D <= 128;
  static constexpr int k_row = D + 16 / (int)sizeof(T);  // K rows padded 16 bytes: lanes read rows conflict-free
  static constexpr int k_tile = kWaveSize * k_row;       // elements of T
  static constexpr int v_tile = kWaveSize * D;
  static constexpr int q = HPB * D;
  static constexpr int p = kWaves * kWaveSize * HPB;
  static constexpr int off = 2 * 2 * kWaves * kWaveSize;  // int64 row offsets, two stages, as float pairs
  static constexpr int kv = staged ? 2 * kWaves * (k_tile + v_tile) * (int)sizeof(T) / 4 : 0;
  static constexpr int tile = q + p + off + kv;
  static constexpr int merge = 2 * kWaves * HPB + kWaves * HPB * D;
  static constexpr int bytes = 4 * (tile > merge ? tile : merge);
};

// A sequence's context length, clamped to what its block-table row can address (never negative).
HK_DEVICE int context_len(const Params& p, int seq) {
  const int64_t cap = (int64_t)p.max_blocks_per_seq << p.block_size_log2;
  const int64_t len = p.context_lens[seq];
  return (int)(len < 0 ? 0 : len > cap ? cap : len);
}

// Offset of token t's K/V row given its block id, or -1 when the id lies outside the cache.
HK_DEVICE int64_t row_offset(const Params& p, int blk, int t) {
  if (blk < 0 || blk >= p.num_blocks) return -1;
  return (int64_t)blk * p.kv_stride_block + (int64_t)(t & ((1 << p.block_size_log2) - 1)) * p.kv_stride_tok;
}

// One wave's attention state over the tokens it has seen: per head the running max m and the
// lane's share of the sum l (log2 domain), and the lane's head dims of the unnormalised output.
template <typename T, int D, int HPB>
struct WaveAttention {
  static constexpr int W = kWaveSize;
  static constexpr int KV = 16 / sizeof(T);  // K elements per 16-byte load
  static constexpr int DPL = D / W;          // head dims per lane in PV
  static_assert(D % KV == 0 && D % W == 0, "head size");
  float m[HPB], l[HPB], acc[HPB][DPL];

  HK_DEVICE WaveAttention() {
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
      m[h] = -INFINITY;
      l[h] = 0.f;
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[h][j] = 0.f;
    }
  }

  // s[h] = (scaled q_h) . K row, the row in global or shared memory; -inf for no row.
  static HK_DEVICE void qk(const T* krow, const float* q_s, float (&s)[HPB]) {
#pragma unroll
    for (int h = 0; h < HPB; ++h) s[h] = krow ? 0.f : -INFINITY;
    if (!krow) return;
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
  }

  // Online-softmax step over a tile (one token per lane); this lane's probabilities go to p_row.
  HK_DEVICE void softmax(const float (&s)[HPB], float* p_row) {
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
      const float mn = fmaxf(m[h], group_max<W>(s[h]));
      const float alpha = merge_weight(m[h], mn);
      const float pr = merge_weight(s[h], mn);
      l[h] = l[h] * alpha + pr;
#pragma unroll
      for (int j = 0; j < DPL; ++j) acc[h][j] *= alpha;
      m[h] = mn;
      p_row[h] = pr;
    }
  }

  // acc += p[i] * V row i for the tile's rows i < n; vrow(i) is the row or null (skipped).
  template <typename RowOf>
  HK_DEVICE void pv(int n, const float* p, RowOf vrow, int lane) {
#pragma unroll 4
    for (int i = 0; i < n; ++i) {
      const T* row = vrow(i);
      if (!row) continue;
      float vf[DPL];
      load_as_float<T, DPL>(row + lane * DPL, vf);
#pragma unroll
      for (int h = 0; h < HPB; ++h) {
        const float pr = p[i * HPB + h];
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[h][j] = fmaf(pr, vf[j], acc[h][j]);
      }
    }
  }
};

template <typename T, int D, int HPB>
__global__ __launch_bounds__(kThreads, 1) void decode_kernel(Params p) {
  constexpr int W = kWaveSize;
  constexpr int KV = 16 / sizeof(T);
  typedef Smem<T, D, HPB> S;
  typedef WaveAttention<T, D, HPB> WA;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* p_s = q_s + S::q;
  int64_t* off_s = reinterpret_cast<int64_t*>(p_s + S::p);
  T* kv_s = reinterpret_cast<T*>(off_s + 2 * kWaves * W);

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
  float* my_p = p_s + wave * W * HPB;
  int64_t* my_off = off_s + wave * 2 * W;  // [stage][lane]
  constexpr int kStride = kWaves * W;      // tokens between a wave's consecutive tiles
  auto block_of = [&](int t) { return t < end ? bt[t >> p.block_size_log2] : -1; };
  WA wa;

  if constexpr (S::staged) {
    // Tile i + 1's K/V rows are copied into the other stage while tile i is computed; its block
    // ids were loaded during tile i - 1.
    T* my_kv = kv_s + wave * 2 * (S::k_tile + S::v_tile);  // [stage][K tile | V tile]
    constexpr int kChunks = D / KV;            // 16-byte chunks of a row
    constexpr int kRowsPerStep = W / kChunks;  // rows the wave copies per step
    static_assert(kChunks <= W, "a row per wave step at most");
    auto k_tile = [&](int st) { return my_kv + st * (S::k_tile + S::v_tile); };
    auto v_tile = [&](int st) { return my_kv + st * (S::k_tile + S::v_tile) + S::k_tile; };
    auto issue = [&](int t0, int blk, int st) {
      int64_t* offs = my_off + st * W;
      offs[lane] = row_offset(p, blk, t0 + lane);
      wave_sync();
      const int n = min(W, end - t0);
      const int c = lane % kChunks;
      for (int r = lane / kChunks; r < n; r += kRowsPerStep) {
        const int64_t o = offs[r];
        if (o >= 0) {
          async_copy16(k_tile(st) + r * S::k_row + c * KV, kbase + o + c * KV);
          async_copy16(v_tile(st) + r * D + c * KV, vbase + o + c * KV);
        }
      }
      async_copy_commit();
    };
    int t0 = start + wave * W;
    if (t0 < end) issue(t0, block_of(t0 + lane), 0);
    int blk_next = block_of(t0 + kStride + lane);
    for (int st = 0; t0 < end; t0 += kStride, st ^= 1) {
      if (t0 + kStride < end) {
        issue(t0 + kStride, blk_next, st ^ 1);
        blk_next = block_of(t0 + 2 * kStride + lane);
        async_copy_wait_pending<1>();
      } else {
        async_copy_wait_pending<0>();
      }
      wave_sync();
      const int64_t* offs = my_off + st * W;
      float s[HPB];
      WA::qk(offs[lane] >= 0 ? k_tile(st) + lane * S::k_row : nullptr, q_s, s);
      wa.softmax(s, my_p + lane * HPB);
      wave_sync();
      wa.pv(min(W, end - t0), my_p, [&](int i) -> const T* { return offs[i] >= 0 ? v_tile(st) + i * D : nullptr; },
            lane);
      wave_sync();  // before this stage is refilled
    }
  } else {
    for (int t0 = start + wave * W; t0 < end; t0 += kStride) {
      const int64_t off = row_offset(p, block_of(t0 + lane), t0 + lane);
      my_off[lane] = off;
      float s[HPB];
      WA::qk(off >= 0 ? kbase + off : nullptr, q_s, s);
      wa.softmax(s, my_p + lane * HPB);
      wave_sync();
      wa.pv(min(W, end - t0), my_p, [&](int i) -> const T* { return my_off[i] >= 0 ? vbase + my_off[i] : nullptr; },
            lane);
      wave_sync();  // the next tile overwrites my_p / my_off
    }
  }
#pragma unroll
  for (int h = 0; h < HPB; ++h) wa.l[h] = group_sum<W>(wa.l[h]);

  // Merge the waves' states.
  __syncthreads();
  float* m_w = smem;                 // [kWaves][HPB]
  float* l_w = m_w + kWaves * HPB;   // [kWaves][HPB]
  float* a_w = l_w + kWaves * HPB;   // [kWaves][HPB][D]
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    if (lane == 0) {
      m_w[wave * HPB + h] = wa.m[h];
      l_w[wave * HPB + h] = wa.l[h];
    }
#pragma unroll
    for (int j = 0; j < WA::DPL; ++j) a_w[(wave * HPB + h) * D + lane * WA::DPL + j] = wa.acc[h][j];
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
