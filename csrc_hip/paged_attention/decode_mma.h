// Paged-attention decode on matrix cores (variant v16).
//
// One block of 4 waves per (KV head, sequence, partition); the block's query heads (the whole GQA
// group up to 64, as 16-row tiles: WM tiles of 16 heads) are the M side of every product.
//   Pipeline: the partition's tokens go through shared memory in tiles of kTile tokens, kStages
//     deep: all threads issue coalesced 16-byte asynchronous copies of the K and V rows of tile i+S-1
//     (rows of masked tokens zero-filled, never read) while the waves compute tile i. The rows' cache
//     offsets come from shared memory, made one tile earlier from block ids read from the block
//     table a tile before that (one thread per row, into a register), so neither a copy nor the
//     reading thread's wave waits on a block-table load. Where the copies are cp.async (not boxes, below),
//     in long partitions the blocks of up to 32 heads also ask L2 for each tile's rows when its
//     offsets are made (one tile more of DRAM requests in flight than the stages hold: kPrefetch).
//     Where copies are synchronous (CDNA here)
//     one stage is used: 64 KB of LDS holds no more, and it does not fit head size 256 at all (the
//     launcher reports it; the Python op rejects it first).
//   Waves: WM (head tiles) x WN (token slices of each tile); a wave computes, for its 16 heads and
//     its kTile / WN tokens, S = Q K^T (MmaTile, fp32), the online softmax in the log2 domain on the
//     accumulators, and O += P V with P rounded to the cache dtype (as flash attention does): for its
//     slice and all D columns, or (Cfg::kSplitD, head size 256) for D / WN columns over the whole tile,
//     P of every slice coming through shared memory after the slices' row maxima met there.
//   The WN states of each head tile merge through shared memory (finish() in common.h; under kSplitD
//   and kWgCols they share one running max and hold disjoint columns, so only their (m, l) merge); a uniform
//   split of at most kMaxCluster partitions runs, where the build has clusters (sm_90a), as one
//   thread-block cluster per (sequence, head group) that merges its partitions in distributed shared
//   memory (cluster_merge), else through partials and the merge kernel.
// Query rows beyond the group are zero and never written. Row strides in shared memory are padded
// by 16 bytes (conflict-free ldmatrix on NVIDIA).
// On wgmma (sm_90a, hipkern/wgmma.h), 64-head blocks: each token slice's 4 waves are a warpgroup
// that computes S = Q K^T for all 64 heads with both operands read by the tensor cores from shared
// memory, and O += P V with P from registers (the accumulators turned into A fragments, as for
// mma.sync) and V read as an MN-major operand, so no K, V or Q fragment passes through registers.
// Q, K and V then sit in 128-byte-swizzled atoms (Sw128, unpadded rows) and no P goes through shared
// memory, except at head size 256 (Cfg::kWgCols): each warpgroup computes S for its token half, and,
// after a row-max exchange, O += P V for half the columns over the whole tile, the other half's P
// read from shared memory: no outputs to merge at the end.
// Tensor-map boxes (sm_90a, hipkern/tma.h; Cfg::kBoxes): each group of kBoxRows tokens of a K or V
// tile (16; 8 for the 64-head blocks) is one box of a cache block (those tokens, one KV head, all
// columns) issued by the thread of the group's first row, completion counted on the stage's mbarrier,
// so the waves issue no per-chunk copies. The tiles then sit as [group][64-column slab][kBoxRows rows]
// [64 columns] with the boxes' 128-byte swizzle (for groups of 8 rows that is Sw128 itself); a group
// past the end or of an invalid block is a box outside the map (zeros), and the rows past the end
// inside the last group are zeroed after it lands. Block sizes under kBoxRows: a box per (cache block,
// slab), issued by the thread of the block's first row.
#pragma once

#include "common.h"
#include "hipkern/mma.h"
#include "hipkern/tma.h"
#include "hipkern/wgmma.h"

namespace hk {
namespace paged_attention {
namespace mma {

// Partitions of at least this many tiles prefetch (shorter ones are bounded by their first tiles).
constexpr int kPrefetchTiles = 16;

// Waves per block: 4, or 8 for 64 heads (4 head tiles) where shared memory allows (not on CDNA:
// the merge area of 8 waves would not fit 64 KB of LDS). 8 waves halve each wave's share of the
// 64-head products, which otherwise leave the block waiting on its matrix units. kSmall (variant
// v6, one head tile): 2 waves on 32-token tiles, 2 stages: a third of the shared memory, so 2-3x the
// blocks per SM.
template <int WM, bool kSmall> constexpr int waves() { return kSmall ? 2 : WM == 4 && kAsyncCopy ? 8 : 4; }

template <typename T, int D, int WM, bool kSmall = false>
struct Cfg {
  typedef MmaTile<T> MT;
  static constexpr int kWaves = waves<WM, kSmall>(), kThreads = kWaves * kWaveSize;
  static constexpr int WN = kWaves / WM;  // waves sharing a head tile, each on a token slice
  static constexpr bool kWg = kWgmma && WM == 4 && !kSmall;  // two warpgroups: 64 heads x 32 tokens each
  static constexpr bool kBoxes = kTma && kAsyncCopy;  // K/V tiles as tensor-map boxes (see top)
  static constexpr int kTile = kSmall ? 32 : 64;  // tokens per pipeline stage
  static constexpr int kStages = !kAsyncCopy ? 1 : kSmall || D > 128 ? 2 : 3;  // (wgmma, head 256: 3 fit, no faster)
  // L2 prefetch of the tile after the copies' (in long partitions): v16's blocks of up to 32 heads
  // with cp.async copies; the 64-head (wgmma) and v6 blocks measured slower with it (NOTES.md,
  // 2026-11-25), and so did the boxes (2.5-3 % at 64-128 x 4096 on the H100; 2026-11-26).
  static constexpr bool kPrefetch = !kWg && !kSmall && !kBoxes;
  static constexpr int kSlice = kTile / WN;  // tokens per wave per tile (S = Q K^T)
  // kSplitD: O += P V by each of a head tile's WN waves for D / WN of the output columns over the whole
  // tile, P of every slice through shared memory (kLdP: its row stride) after the slices' row maxima
  // met there, so that the block's end merges no outputs (4 x 16 KB of them: 16 heads of 256): two
  // barriers more a tile for a lighter end. H100 (NOTES.md, 2026-11-27): 1 x 256 x 64:1 x 256 10.4 ->
  // 9.8 us; head size 128's small and mid shapes lost up to 3 %, the 32-head blocks at head size 256
  // (two states) 2.3 % at 16 x 2048 x 64:1: hence 4 waves a head tile at head size 256 only.
  // (On CDNA head size 256 does not fit the LDS: the split compiles there but never runs. The
  // exchanges are block barriers: with WM > 1 they would couple the head tiles.)
  static constexpr bool kSplitD = !kWg && D >= 256 && WN >= 4;
  // kWgCols (the 64-head wgmma blocks at head size 256): each warpgroup computes S = Q K^T for its
  // 32-token half of the tile, and, once the halves' row maxima met in shared memory, O += P V for
  // its D / 2 columns over the whole tile: its own half's P from its registers, the other's from
  // shared memory (written there as a K-major wgmma operand). The block's end merges no outputs (64
  // KB of them a warpgroup otherwise) and sends a partial by bulk stores (finish()). Its first form
  // computed S for the whole tile in both warpgroups (no exchange; twice the QK^T and exponentials):
  // H200 graph replay (NOTES.md, 2026-11-28 (14)), 64:1 x 256: 64 x 4096 79.3-79.5 -> 78.3-78.5 us, 1 x
  // 32768 26.0 -> 25.4, 8-32 x 2048 0.1-0.3 faster; 161 -> 159 registers. Not measured on an H100.
  static constexpr bool kWgCols = kWg && D >= 256;
  static constexpr bool kSharedP = kSplitD || kWgCols;  // P through shared memory after a max exchange
  static constexpr int kSTok = kSlice;                        // tokens of a wave's S
  static constexpr int kOCols = kSharedP ? D / WN : D;        // output columns a wave holds
  static constexpr int kOStates = kSharedP ? 1 : WN;          // output states the block's end merges
  static constexpr int kLdP = kTile + 8;
  // kSharedP's scratch: P of the tile (kSplitD: [16 * WM][kLdP]; kWgCols: [kRows][kTile] in Sw128 atoms),
  // then the slices' row maxima [WN][kRows] (floats)
  static constexpr int kPElems = (kWgCols ? kTile : kLdP) * 16 * WM;
  static constexpr int kRows = 16 * WM;      // query heads per block
  typedef Sw128<T, D> L;                     // the layout of Q, K and V rows where kWg
  static constexpr int kLd = kWg ? D : D + 8;  // Q's shared row stride, elements (and K/V's unless kBoxes)
  static constexpr int kLdKV = kBoxes ? D : kLd;
  static constexpr int kVec = 16 / (int)sizeof(T);
  static HK_DEVICE int at(int r, int c) { return kWg ? L::at(r, c) : r * kLd + c * kVec; }  // Q: chunk c of row r
  static constexpr int kBoxRows = kWg ? 8 : 16, kAtomK = 128 / (int)sizeof(T), kSlabs = D / kAtomK;
  // kBoxes: where row r of 64-column slab sl of a K or V tile starts.
  static HK_DEVICE int kv_row(int r, int sl) { return ((r / kBoxRows * kSlabs + sl) * kBoxRows + r % kBoxRows) * kAtomK; }
  // Chunk c of row r of a K or V tile.
  static HK_DEVICE int kv_at(int r, int c) {
    if constexpr (kBoxes)
      return kv_row(r, c / 8) + (c % 8 ^ r % 8) * kVec;
    else
      return at(r, c);
  }
  static constexpr int kChunks = D / kVec;   // 16-byte chunks per row
  // shared memory (bytes): Q | P scratch (per wave; kSharedP: P of the tile and the row maxima) |
  // pipeline (reused by the merge) | row offsets of two tiles | token flags | (kBoxes) an mbarrier per
  // stage; kBoxes puts the pipeline first (its boxes 1024-byte aligned)
  static constexpr int kQ = kRows * kLd * (int)sizeof(T);
  static constexpr int kScratch = kWgCols  ? (kPElems * (int)sizeof(T) + WN * kRows * 4 + 1023) / 1024 * 1024
                                  : kWg     ? 0
                                  : kSplitD ? (kPElems * (int)sizeof(T) + WN * kRows * 4 + 15) / 16 * 16
                                            : kWaves * MT::M * MT::K * (int)sizeof(T);
  static constexpr int kStage = kTile * kLdKV * (int)sizeof(T);  // one K or V tile
  static constexpr int kPipe = 2 * kStages * kStage;
  static constexpr int kLdA = merge_ld<D>();  // merge area row stride, floats
  static constexpr int kMerge = (2 * WN + kOStates * kLdA) * kRows * 4;  // (m, l) per state, outputs
  static constexpr int kPipeBytes = ((kPipe > kMerge ? kPipe : kMerge) + 1023) / 1024 * 1024;
  static constexpr int kPipeAt = kBoxes ? 0 : kQ + kScratch, kQAt = kBoxes ? kPipeBytes : 0;
  static constexpr int kOffAt = kQ + kScratch + kPipeBytes;
  static constexpr int kOffsets = kBoxes ? 0 : 2 * kTile * 8;
  static constexpr int kFlags = kStages * kTile;
  static constexpr int kBarAt = kOffAt + kOffsets + kFlags;
  static constexpr int bytes = kBarAt + (kBoxes ? 8 * kStages : 0);
  static constexpr int kCopies = kTile * kChunks / kThreads;  // 16-byte K (and V) copies per thread per tile
  static_assert(WM * WN == kWaves && kSlice % MT::K == 0 && kSTok % MT::N == 0 && kOCols % MT::N == 0,
                "wave layout");
  static_assert(bytes <= 227 * 1024 - 1024, "fits an sm_90 block's shared memory with 1 KB of static");
  // CDNA (no asynchronous copies; 64 KB of LDS a workgroup): every configuration the op may launch there fits
  // with 1 KB of static. Head 256's 16- to 64-head blocks do not, and are refused before launch (runs_here in
  // hipkern/ops/paged_attention.py); its small (v6) block does.
  static_assert(kAsyncCopy || (D > 128 && !kSmall) || bytes <= 63 * 1024, "fits a CDNA workgroup's 64 KB of LDS");
  static_assert(!kWg || (kRows == 64 && kWaves == 8 && kQAt % 1024 == 0 && kPipeAt % 1024 == 0 &&
                         kStage % 1024 == 0 && (kBoxes || (kQ + kScratch) % 1024 == 0) &&
                         (!kWgCols || (kQAt + kQ) % 1024 == 0)),
                "a warpgroup per token slice; 1024-byte aligned atoms (kWgCols: P's too)");
  static_assert(kThreads >= kTile, "a thread per row reads the block table");
  static_assert(kCopies * kThreads == kTile * kChunks, "whole copies per thread");
  static_assert(kLd % 8 == 0 && kQ % 16 == 0 && kScratch % 16 == 0 && kStage % 16 == 0, "16-byte rows");
  static_assert(kClusterFloats<kRows> * 4 <= kQ, "a cluster merge's (m, l) fit where Q was");
  static_assert(!kBoxes || (kStage % 1024 == 0 && kTile % kBoxRows == 0 && kQAt % 16 == 0 && kBarAt % 8 == 0),
                "whole 1024-byte aligned boxes");
};

template <typename T, int D, int WM, bool kSmall>
__global__ HK_LAUNCH_BOUNDS((Cfg<T, D, WM, kSmall>::kThreads), 1) void decode_kernel(const HK_GRID_CONSTANT Params p) {
  typedef Cfg<T, D, WM, kSmall> C;
  typedef typename C::MT MT;
  constexpr int kNS = C::kSTok / MT::N;   // score tiles per wave
  constexpr int kND = C::kOCols / MT::N;  // output tiles per wave
  extern __shared__ __align__(kWgmma ? 1024 : 16) unsigned char smem_raw[];  // wgmma atoms (where kWg)
  T* q_s = reinterpret_cast<T*>(smem_raw + C::kQAt);
  T* scratch = q_s + C::kQ / (int)sizeof(T);
  unsigned char* pipe = smem_raw + C::kPipeAt;
  T* k_s = reinterpret_cast<T*>(pipe);    // [kStages][kTile rows] (kv_at)
  T* v_s = k_s + C::kStages * C::kTile * C::kLdKV;
  int64_t* off_s = reinterpret_cast<int64_t*>(smem_raw + C::kOffAt);  // [2][kTile] (none where kBoxes)
  uint8_t* ok_s = smem_raw + C::kOffAt + C::kOffsets;                   // [kStages][kTile]
  uint64_t* bar_s = reinterpret_cast<uint64_t*>(smem_raw + C::kBarAt);  // kBoxes: [kStages]
  constexpr bool tma = C::kBoxes;

  trace_point(0);
  griddep_launch_dependents();  // the merge kernel (split launches) may be scheduled once all blocks run
  if (tma && threadIdx.x == 0) {  // the maps' descriptors come while the block table is read
    tma_prefetch_map(&p.k_map);
    tma_prefetch_map(&p.v_map);
  }
  const BlockWork work = block_work<C::kRows, C::kTile, C::kThreads, true>(p);
  const int seq = max(work.seq, 0), start = work.start, end = work.end;  // seq < 0 only when skipped
  const int kvh = work.kvh, head0 = work.head0, nh = work.nh;

  // Query rows: 16-byte copies (in the first pipeline group) where aligned, else element by element.
  // With a pipeline, the copies go after the first tile's K/V copies (below): issued here, a 64-head
  // block's 32 KB of them were in the memory system's queues ahead of the context length and block
  // table reads that the first K/V copies wait for.
  const T* q = static_cast<const T*>(p.q) + (int64_t)seq * p.q_stride_s + (int64_t)head0 * p.q_stride_h;
  const bool q_async = reinterpret_cast<uintptr_t>(q) % 16 == 0 && p.q_stride_h % C::kVec == 0;
  auto copy_q_rows = [&] {
    if (q_async) {
      for (int i = threadIdx.x; i < C::kRows * C::kChunks; i += C::kThreads) {
        const int h = i / C::kChunks, c = i % C::kChunks;
        async_copy16_or_zero(q_s + C::at(h, c), q + (h < nh ? h * p.q_stride_h : 0) + c * C::kVec, h < nh);
      }
    }
  };
  constexpr bool kQLate = C::kStages > 1;  // the copies in the prologue's first group
  if constexpr (!kQLate) copy_q_rows();
  const int32_t* bt = p.block_tables + (int64_t)seq * p.bt_stride;
  // Each thread's j-th 16-byte K (and V) copy of a tile is chunk copy_chunk(j) of row copy_row(j).
  auto copy_row = [](int j) { return (int)(threadIdx.x + j * C::kThreads) / C::kChunks; };
  auto copy_chunk = [](int j) { return (int)(threadIdx.x + j * C::kThreads) % C::kChunks; };
  // The first tiles' row offsets, read before the context length is known (masked by it below).
  // (Boxes: thread r < kTile's block id of row r of those tiles.)
  constexpr int kAhead = C::kStages > 1 ? C::kStages - 1 : 1;
  int64_t ahead[tma ? 1 : kAhead][C::kCopies];
  int ahead_blk[kAhead];
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if constexpr (tma) {
      ahead_blk[s] = threadIdx.x < C::kTile ? token_block(p, bt, start + s * C::kTile + (int)threadIdx.x) : -1;
    } else {
#pragma unroll
      for (int j = 0; j < C::kCopies; ++j) ahead[s][j] = token_offset(p, bt, start + s * C::kTile + copy_row(j));
    }
  }
  // The merge area (after the loop): the WN states' (m, l) and their kOStates output states (WN, or
  // one whose columns the waves hold under kSharedP), over the pipeline; a cluster merge's per-head
  // states and weights where the query rows were.
  float* m_w = reinterpret_cast<float*>(pipe);  // [WN][kRows]
  float* l_w = m_w + C::WN * C::kRows;          // [WN][kRows]
  float* a_w = l_w + C::WN * C::kRows;          // [kOStates][kRows][kLdA]
  float* ml_s = reinterpret_cast<float*>(q_s);
  // A skipped block (an empty partition) leaves, unless it is one of a merged cluster: it then runs no
  // tile and joins the merge with an empty state (the same code path, not a second copy of the merge).
  if (work.skip && !cluster_merged(p, work)) {
    async_copy_wait();
    return;
  }
  if (!q_async) {
    for (int i = threadIdx.x; i < C::kRows * D; i += C::kThreads) {
      const int h = i / D, d = i % D;
      q_s[C::at(h, d / C::kVec) + d % C::kVec] = h < nh ? q[h * p.q_stride_h + d] : T();
    }
  }

  const T* kbase = static_cast<const T*>(p.k) + (int64_t)kvh * p.kv_stride_head;
  const T* vbase = static_cast<const T*>(p.v) + (int64_t)kvh * p.kv_stride_head;
  const int ntiles = work.skip ? 0 : (end - start + C::kTile - 1) / C::kTile;
#if defined(HK_PA_TRACE)
  if (ntiles >= 0) trace_point(1);  // (waits for the context length)
#endif
  // Row threadIdx.x (< kTile) of a tile: its block id (-1 past the end), read a tile before its cache
  // offset (-1: masked, past the end or an invalid block) is made, so no wave waits on the read.
  auto row_block = [&](int tile) -> int {
    const int t = start + tile * C::kTile + (int)threadIdx.x;
    return t < end ? token_block(p, bt, t) : -1;
  };
  auto row_offset = [&](int tile, int blk) { return block_offset(p, blk, start + tile * C::kTile + (int)threadIdx.x); };
  // Every thread: its share of a tile's K and V chunks; offset(j, r): the cache offset of its j-th
  // copy's row r of the tile.
  auto load_tile = [&](int tile, auto offset) {
    const int buf = tile % C::kStages;
    T* ks = k_s + buf * C::kTile * C::kLdKV;
    T* vs = v_s + buf * C::kTile * C::kLdKV;
    int64_t off[C::kCopies];  // all offsets first: one latency, not kCopies
#pragma unroll
    for (int j = 0; j < C::kCopies; ++j) off[j] = offset(j, copy_row(j));
#pragma unroll
    for (int j = 0; j < C::kCopies; ++j) {
      const int r = copy_row(j), c = copy_chunk(j);
      const int64_t src = (off[j] < 0 ? 0 : off[j]) + c * C::kVec;
      async_copy16_or_zero(ks + C::kv_at(r, c), kbase + src, off[j] >= 0);
      async_copy16_or_zero(vs + C::kv_at(r, c), vbase + src, off[j] >= 0);
      if (c == 0) ok_s[buf * C::kTile + r] = off[j] >= 0;
    }
  };
  // Boxes of box_rows = min(kBoxRows, block size) rows (every slab at once; one slab a box for smaller
  // blocks): the thread of row r (< kTile) of a tile sets its flag, and where r starts a box, issues
  // its K and V boxes (block id -1, outside the map: zeros) on the stage's mbarrier.
  const int bs_mask = (1 << p.block_size_log2) - 1, box_rows = min(C::kBoxRows, bs_mask + 1);
  const int box_slabs = box_rows == C::kBoxRows ? 1 : C::kSlabs;  // boxes per row start, of K and of V
  auto load_boxes = [&](int tile, int blk, int64_t off) {
    const int buf = tile % C::kStages, r = (int)threadIdx.x;
    ok_s[buf * C::kTile + r] = off >= 0;
    if ((r & (box_rows - 1)) == 0) {
      const int tb = (start + tile * C::kTile + r) & bs_mask, b = off >= 0 ? blk : -1;
      mbar_expect(bar_s + buf, (uint32_t)(2 * box_rows * D * sizeof(T)));
      for (int sl = 0; sl < box_slabs; ++sl) {
        const int at = buf * C::kTile * C::kLdKV + C::kv_row(r, sl);
        tma_load_5d(k_s + at, &p.k_map, 0, tb, sl, kvh, b, bar_s + buf);
        tma_load_5d(v_s + at, &p.v_map, 0, tb, sl, kvh, b, bar_s + buf);
      }
    }
  };
  if constexpr (tma) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < C::kStages; ++s) mbar_init(bar_s + s, C::kTile / box_rows);
      mbar_init_fence();
    }
    __syncthreads();
  }
  // The first kStages - 1 tiles take their offsets from `ahead`; then tile i's row offsets are in
  // off_s[i % 2] at the top of iteration i - kStages + 1, and `pending` holds the next tile's.
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {  // the query rows travel with the first group
    if (s < ntiles) {
      const int t0 = start + s * C::kTile;
      if constexpr (tma) {
        if (threadIdx.x < C::kTile)
          load_boxes(s, ahead_blk[s], t0 + (int)threadIdx.x < end ? row_offset(s, ahead_blk[s]) : -1);
      } else {
        load_tile(s, [&](int j, int r) -> int64_t { return t0 + r < end ? ahead[s][j] : -1; });
      }
      if (kQLate && s == 0) copy_q_rows();
    }
    async_copy_commit();
  }
  int pending = -1;  // the block id of this thread's row of the tile whose offsets go to off_s next
  int next_blk = -1;  // (boxes) the block id and offset of this thread's row of the next tile to load
  int64_t next_off = -1;
  if (threadIdx.x < C::kTile) {
    next_blk = row_block(C::kStages - 1);
    next_off = row_offset(C::kStages - 1, next_blk);
    if constexpr (!tma) off_s[(C::kStages - 1) % 2 * C::kTile + threadIdx.x] = next_off;
    pending = row_block(C::kStages);
  }
  const bool prefetch = C::kPrefetch && ntiles >= kPrefetchTiles;
  // Iteration `tile`, after a barrier: copy tile + kStages - 1 from off_s, then make the offsets of
  // the tile after it into off_s (that half was last read before the barrier) from the block ids read
  // an iteration ago (and, where `prefetch`, ask L2 for that tile's rows), and read the block ids of
  // the tile after that.
  auto load_ahead = [&](int tile) {
    const int next = tile + C::kStages - 1;
    if (next < ntiles) {
      if constexpr (tma) {
        if (threadIdx.x < C::kTile) load_boxes(next, next_blk, next_off);
      } else {
        const int64_t* o = off_s + next % 2 * C::kTile;
        load_tile(next, [&](int, int r) { return o[r]; });
      }
    }
    if (threadIdx.x < C::kTile) {
      const int64_t o = row_offset(next + 1, pending);
      if constexpr (!tma) off_s[(next + 1) % 2 * C::kTile + threadIdx.x] = o;
      next_blk = pending;
      next_off = o;
      if (prefetch && o >= 0 && next + 1 < ntiles) {
        prefetch_l2<D * (int)sizeof(T)>(kbase + o);
        prefetch_l2<D * (int)sizeof(T)>(vbase + o);
      }
      if (next + 2 < ntiles) pending = row_block(next + 2);
    }
  };

  const int wave = threadIdx.x / kWaveSize;
  const int wm = wave % WM, wn = wave / WM;
  const T* q_w = q_s + wm * MT::M * C::kLd;
  T* tmp = scratch + wave * MT::M * MT::K;  // a_from_c's (neither kWg nor kSplitD)
  T* p_w = scratch + wm * MT::M * C::kLdP;  // kSplitD: P of the head tile, [16][kTile] (kLdP)
  float* mx_s = reinterpret_cast<float*>(scratch + C::kPElems);  // kSharedP: [WN][kRows] row maxima
  float o[kND][MT::kC], m[MT::kRowSlots], l[MT::kRowSlots];
#pragma unroll
  for (int n = 0; n < kND; ++n)
#pragma unroll
    for (int i = 0; i < MT::kC; ++i) o[n][i] = 0.f;
#pragma unroll
  for (int r = 0; r < MT::kRowSlots; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }

  for (int tile = 0; tile < ntiles; ++tile) {
    if constexpr (C::kStages == 1) {
      __syncthreads();  // every wave is done with the previous tile
      load_ahead(tile);
    } else {
      async_copy_wait_pending<C::kStages - 2>();
      if constexpr (tma) {
        const int buf = tile % C::kStages;
        mbar_wait(bar_s + buf, (uint32_t)(tile / C::kStages) & 1);
        if (tile == ntiles - 1) {  // the last group's rows past the end came with its box: zeros (P is 0 there)
          const int r0 = end - (start + tile * C::kTile), r1 = min(C::kTile, (r0 + 15) / 16 * 16);  // (>= its box's end)
          T* vs = v_s + buf * C::kTile * C::kLdKV;
          for (int i = (int)threadIdx.x; i < (r1 - r0) * C::kChunks; i += C::kThreads)
            *reinterpret_cast<uint4*>(vs + C::kv_at(r0 + i / C::kChunks, i % C::kChunks)) = make_uint4(0, 0, 0, 0);
        }
      }
      if constexpr (C::kWg) fence_async_shared();  // the tensor cores read the tile (and Q) directly
    }
    __syncthreads();  // tile is in shared memory; every wave is done with tile - 1's buffer
    if (tile == 0) trace_point(2);
    if constexpr (C::kStages > 1) {
      load_ahead(tile);
      async_copy_commit();
    }

    const int buf = tile % C::kStages;
    const int s0 = wn * C::kSlice;  // the wave's first token of S
    const T* ks = k_s + (buf * C::kTile + s0) * C::kLdKV;  // (boxes: kb + kv_at(row, chunk))
    const T* vs = v_s + (buf * C::kTile + s0) * C::kLdKV;
    const T* kb = k_s + buf * C::kTile * C::kLdKV;
    const T* vb = v_s + buf * C::kTile * C::kLdKV;
    const int lr = lane_id() % 16;  // the row (of 16) whose address this lane gives ldmatrix
    const uint8_t* ok = ok_s + buf * C::kTile + s0;

    typename MT::C s[kNS];  // S = Q K^T, this wave's heads x tokens
#pragma unroll
    for (int j = 0; j < kNS; ++j)
#pragma unroll
      for (int i = 0; i < MT::kC; ++i) s[j][i] = 0.f;
    if constexpr (C::kWg) {  // the warpgroup's 64 heads x kSTok tokens (ks: the first row, atom-aligned)
      float(&d)[kNS * MT::kC] = *reinterpret_cast<float(*)[kNS * MT::kC]>(&s[0][0]);
      const uint64_t dq = wgmma_desc_sw128(q_s, C::L::kSbo), dk = wgmma_desc_sw128(ks, C::L::kSbo);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        Wgmma<T, C::kSTok>::mma(d, wgmma_desc_add(dq, C::L::k16(kk) * sizeof(T)),
                                 wgmma_desc_add(dk, C::L::k16(kk) * sizeof(T)));
      wgmma_commit();
      wgmma_wait<0>();
    } else
#pragma unroll
    for (int kk = 0; kk < D / MT::K; ++kk) {
      typename MT::A a;
      MT::load_a(a, q_w + kk * MT::K, C::kLd);
#pragma unroll
      for (int j = 0; j < kNS; ++j) {
        typename MT::B b;
        if constexpr (tma)
          MT::load_b_nk_at(b, kb + C::kv_at(wn * C::kSlice + j * MT::N + lr % 8, kk * MT::K / C::kVec + lr / 8));
        else
          MT::load_b_nk(b, ks + j * MT::N * C::kLd + kk * MT::K, C::kLd);
        MT::mma(s[j], a, b);
      }
    }

    float mx[MT::kRowSlots];  // online softmax, log2 domain
#pragma unroll
    for (int r = 0; r < MT::kRowSlots; ++r) mx[r] = -INFINITY;
#pragma unroll
    for (int j = 0; j < kNS; ++j)
#pragma unroll
      for (int i = 0; i < MT::kC; ++i) {
        s[j][i] = ok[j * MT::N + MT::c_col(i)] ? s[j][i] * p.scale_log2 : -INFINITY;
        mx[MT::row_slot(i)] = fmaxf(mx[MT::row_slot(i)], s[j][i]);
      }
#pragma unroll
    for (int r = 0; r < MT::kRowSlots; ++r) mx[r] = group_max<MT::kRowLanes>(mx[r]);
    if constexpr (C::kSharedP) {  // every slice's row maxima: one running max for the head tile
#pragma unroll
      for (int i = 0; i < MT::kC; ++i)
        if (MT::c_col(i) == 0) mx_s[wn * C::kRows + wm * MT::M + MT::c_row(i)] = mx[MT::row_slot(i)];
      __syncthreads();
#pragma unroll
      for (int i = 0; i < MT::kC; ++i) {
        float v = -INFINITY;
#pragma unroll
        for (int w = 0; w < C::WN; ++w) v = fmaxf(v, mx_s[w * C::kRows + wm * MT::M + MT::c_row(i)]);
        mx[MT::row_slot(i)] = v;
      }
    }
    // Where a thread holds 128 output accumulators or more (kLazy: on NVIDIA the 32-head blocks and v6 at
    // head size 256; nothing on CDNA, whose 16-column tiles leave at most 64), the state moves to the
    // new max only when one of the wave's rows rose more than kRescaleSlack above its m (always on the first
    // tile: m is -inf), so most tiles skip the output's rescale. The test is uniform over the wave, and each
    // lazy configuration keeps a state per wave (its rows, P and outputs), or under kWgCols the two waves
    // that hold the same rows decide alike (same rows, m and exchanged maxima); so would kSplitD's waves of a
    // head tile, never lazy. H100 (NOTES.md, 2026-11-27
    // (14)): 64:1 x 256 shapes 0.1-0.9 us faster. With 64 (16-head blocks at head size 128) or 32 (the column
    // split) it measured level or 0.2-0.4 us slower: a short rescale is cheaper than the test in each tile's
    // chain, so those rescale every tile. kWgCols (64 a thread, with twice the exponentials in the chain)
    // is lazy: up to 0.35 us faster than rescaling every tile on four of five 64:1 shapes (NOTES.md, 2026-11-28,
    // when its warpgroups computed S for the whole tile).
    constexpr bool kLazy = kND * MT::kC >= 128 || C::kWgCols;
    bool grow = true;
    if constexpr (kLazy) {
      grow = false;
#pragma unroll
      for (int r = 0; r < MT::kRowSlots; ++r) grow |= mx[r] > m[r] + kRescaleSlack;
      grow = ballot(grow) != 0;
    }
    float alpha[MT::kRowSlots];
    auto rescale_o = [&] {
#pragma unroll
      for (int n = 0; n < kND; ++n)
#pragma unroll
        for (int i = 0; i < MT::kC; ++i) o[n][i] *= alpha[MT::row_slot(i)];
    };
    if (grow) {
#pragma unroll
      for (int r = 0; r < MT::kRowSlots; ++r) {
        const float mn = fmaxf(m[r], mx[r]);
        alpha[r] = merge_weight(m[r], mn);
        m[r] = mn;
        l[r] *= alpha[r];
      }
      if constexpr (kLazy) rescale_o();  // (here, not after the weights below: measured faster)
    }
#pragma unroll
    for (int j = 0; j < kNS; ++j)
#pragma unroll
      for (int i = 0; i < MT::kC; ++i) {
        s[j][i] = merge_weight(s[j][i], m[MT::row_slot(i)]);
        l[MT::row_slot(i)] += s[j][i];
      }
    if constexpr (!kLazy) rescale_o();

    if constexpr (C::kWg) {  // O += P V: per 16 tokens, the wave's kOCols columns in instructions of kN
      constexpr int kN = C::kOCols < 128 ? C::kOCols : 128;
      const int c0 = C::kWgCols ? wn * C::kOCols : 0;  // the wave's first output column
      typename MT::A a[C::kSTok / 16];  // made before the fence: registers wgmma reads
#pragma unroll
      for (int kk = 0; kk < C::kSTok / 16; ++kk) MT::a_from_c(a[kk], &s[kk * 16 / MT::N], tmp);
      const uint64_t dv = wgmma_desc_sw128(vs, C::L::kSbo, C::L::kLbo);
      typedef Sw128<T, C::kTile> PL;  // kWgCols: P of the tile in shared memory
      if constexpr (C::kWgCols) {  // this half's P for the other warpgroup: A's words (mma.h) as they are
        const int g = lane_id() / 4, t = lane_id() % 4, r0 = wm * MT::M + g;
#pragma unroll
        for (int kk = 0; kk < C::kSTok / 16; ++kk)
#pragma unroll
          for (int w = 0; w < 4; ++w) {  // (row g | g + 8) x (tokens 2t, 2t + 1 | + 8) of the 16-token step
            const int r = r0 + 8 * (w % 2), tok = s0 + 16 * kk + 8 * (w / 2) + 2 * t;
            *reinterpret_cast<uint32_t*>(scratch + PL::at(r, tok / C::kVec) + tok % C::kVec) = a[kk].r[w];
          }
        fence_async_shared();  // (for the other warpgroup's wgmma, after the barrier below)
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < C::kSTok / 16; ++kk)
#pragma unroll
        for (int h = 0; h < C::kOCols / kN; ++h) {
          float(&d)[kN / 2] = *reinterpret_cast<float(*)[kN / 2]>(&o[h * kN / MT::N][0]);
          Wgmma<T, kN>::mma_rt(d, a[kk].r,
                               wgmma_desc_add(dv, C::kv_at(16 * kk, (c0 + h * kN) / C::kVec) * sizeof(T)));
        }
      if constexpr (C::kWgCols) {  // the other half's tokens, P from shared memory (its writes are before this barrier;
        __syncthreads();           // they are rewritten after the next tile's first one, past every wave's wait)
        const int o0 = (1 - wn) * C::kSlice;
        const uint64_t dp = wgmma_desc_sw128(scratch, PL::kSbo), dvb = wgmma_desc_sw128(vb, C::L::kSbo, C::L::kLbo);
#pragma unroll
        for (int kk = 0; kk < C::kSlice / 16; ++kk)
#pragma unroll
          for (int h = 0; h < C::kOCols / kN; ++h) {
            float(&d)[kN / 2] = *reinterpret_cast<float(*)[kN / 2]>(&o[h * kN / MT::N][0]);
            Wgmma<T, kN>::mma_t(d, wgmma_desc_add(dp, PL::k16(o0 / 16 + kk) * sizeof(T)),
                                wgmma_desc_add(dvb, C::kv_at(o0 + 16 * kk, (c0 + h * kN) / C::kVec) * sizeof(T)));
          }
      }
      wgmma_commit();
      wgmma_wait<0>();  // the tile's buffers are refilled after the next barrier
    } else if constexpr (C::kSplitD) {  // O += P V: P of every slice, then this wave's columns over the tile
#pragma unroll
      for (int j = 0; j < kNS; ++j)
#pragma unroll
        for (int i = 0; i < MT::kC; ++i)
          p_w[MT::c_row(i) * C::kLdP + wn * C::kSlice + j * MT::N + MT::c_col(i)] = from_float<T>(s[j][i]);
      __syncthreads();  // (P is rewritten after the next tile's first barrier: every wave has read it)
#pragma unroll
      for (int kk = 0; kk < C::kTile / MT::K; ++kk) {
        typename MT::A a;
        MT::load_a(a, p_w + kk * MT::K, C::kLdP);
#pragma unroll
        for (int n = 0; n < kND; ++n) {
          typename MT::B b;
          const int col = wn * C::kOCols + n * MT::N;
          if constexpr (tma)
            MT::load_b_kn_at(b, vb + C::kv_at(kk * MT::K + lr, col / C::kVec));
          else
            MT::load_b_kn(b, vb + kk * MT::K * C::kLd + col, C::kLd);
          MT::mma(o[n], a, b);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < C::kSlice / MT::K; ++kk) {  // O += P V
        typename MT::A a;
        MT::a_from_c(a, &s[kk * MT::K / MT::N], tmp);
#pragma unroll
        for (int n = 0; n < kND; ++n) {
          typename MT::B b;
          if constexpr (tma)
            MT::load_b_kn_at(b, vb + C::kv_at(wn * C::kSlice + kk * MT::K + lr, n * MT::N / C::kVec));
          else
            MT::load_b_kn(b, vs + kk * MT::K * C::kLd + n * MT::N, C::kLd);
          MT::mma(o[n], a, b);
        }
      }
    }
  }
  trace_point(3);
#pragma unroll
  for (int r = 0; r < MT::kRowSlots; ++r) l[r] = group_sum<MT::kRowLanes>(l[r]);

  // Merge the WN states of each head tile: (m, l) each, and each its outputs, or (kSharedP) one output
  // state whose columns the WN waves hold.
  async_copy_wait();
  __syncthreads();
  const int row0 = wn * C::kRows + wm * MT::M;
#pragma unroll
  for (int i = 0; i < MT::kC; ++i) {
    if (MT::c_col(i) == 0) {
      m_w[row0 + MT::c_row(i)] = m[MT::row_slot(i)];
      l_w[row0 + MT::c_row(i)] = l[MT::row_slot(i)];
    }
  }
  float* o_w = C::kOStates == 1 ? a_w + wm * MT::M * C::kLdA + wn * C::kOCols : a_w + row0 * C::kLdA;
#pragma unroll
  for (int n = 0; n < kND; ++n) MT::store_c(o_w + n * MT::N, C::kLdA, o[n]);
  constexpr bool kBulk = C::kOStates == 1 && C::kBoxes;  // a partial leaves by bulk stores (finish())
  if constexpr (kBulk) fence_async_shared();
  __syncthreads();
  finish<T, D, C::WN, C::kRows, C::kThreads, C::kLdA, C::kOStates, kBulk>(p, m_w, l_w, a_w, work, ml_s);
  trace_point(6);
}

template <typename T, int D, int WM, bool kSmall>
unsigned long long& raised() {  // devices with the shared limit raised
  static unsigned long long r = 0;
  return r;
}

template <typename T, int D, int WM, bool kSmall>
ClusterCache& cluster_cache() {  // this kernel's resident blocks and clusters (use_clusters)
  static ClusterCache c = {};
  return c;
}

template <typename T, int D, int WM, bool kSmall>
int launch(const Params& p, int num_seqs, int num_kv_heads, int device, hipStream_t stream) {
  typedef Cfg<T, D, WM, kSmall> C;
  Params q = p;
  if constexpr (C::kBoxes) {  // the caches as [block][token][64-column slab][KV head][64 columns] (innermost last)
    const uint64_t sz = sizeof(T), bs = 1ull << p.block_size_log2;
    const uint64_t dims[5] = {(uint64_t)C::kAtomK, bs, (uint64_t)C::kSlabs, (uint64_t)num_kv_heads,
                              (uint64_t)p.num_blocks};
    const uint64_t strides[4] = {(uint64_t)p.kv_stride_tok * sz, 128, (uint64_t)p.kv_stride_head * sz,
                                 (uint64_t)p.kv_stride_block * sz};
    const bool whole = bs >= (uint64_t)C::kBoxRows;  // boxes of kBoxRows rows and every slab, else of a block's rows and one slab
    const uint32_t box[5] = {(uint32_t)C::kAtomK, whole ? (uint32_t)C::kBoxRows : (uint32_t)bs,
                             whole ? (uint32_t)C::kSlabs : 1u, 1, 1};
    // L2 fills of 128 bytes: 256 cost 6-10 % on the streaming shapes on an H200 (level on the H100), no
    // promotion within 0.5 % of 128 (NOTES.md, 2026-11-26)
    HK_TRY(encode_tensor_map(&q.k_map, p.k, (int)sz, 5, dims, strides, box, 128));
    HK_TRY(encode_tensor_map(&q.v_map, p.v, (int)sz, 5, dims, strides, box, 128));
  }
  return launch_decode<T, D>(&decode_kernel<T, D, WM, kSmall>, raised<T, D, WM, kSmall>(), q, C::kRows, num_kv_heads,
                             num_seqs, C::kThreads, C::bytes, device, stream,
                             "launch of paged_attention mma::decode_kernel", &cluster_cache<T, D, WM, kSmall>());
}

// Whether launch() runs a uniform split of `parts` partitions over `blocks` blocks as clusters.
template <typename T, int D, int WM, bool kSmall>
int clusters(int parts, int64_t blocks, int device, bool* out) {
  typedef Cfg<T, D, WM, kSmall> C;
  return use_clusters(&decode_kernel<T, D, WM, kSmall>, raised<T, D, WM, kSmall>(), cluster_cache<T, D, WM, kSmall>(),
                      C::kThreads, C::bytes, parts, blocks, device, out);
}

template <typename T, int D, int WM, bool kSmall>
int resident(int device, int* out) {
  typedef Cfg<T, D, WM, kSmall> C;
  return resident_blocks(&decode_kernel<T, D, WM, kSmall>, raised<T, D, WM, kSmall>(), C::kThreads, C::bytes, device,
                         out);
}

}  // namespace mma
}  // namespace paged_attention
}  // namespace hk
