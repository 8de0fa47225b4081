// Experiment (not part of any module): is a tensor-map bulk copy (TMA) faster than 16-byte cp.async
// for paged K/V tiles? A "cache" [block pairs][K, V][16 tokens][8 heads][128] bf16 (4 GB), each block
// of the grid streaming 64-token tiles of one head from random 16-token blocks (rows of 256 bytes,
// 2 KB apart, as NHD decode reads them) through a 3-stage ring:
//   tma: one producer thread issues 16 copies of {64 dims, 1 head, 16 tokens} (2 KB, 128-byte
//        swizzle) per 32 KB tile, completion on a per-stage mbarrier; 4 consumer warps wait on it and
//        release an empty barrier (the tensor map comes from cuTensorMapEncodeTiled through
//        cudaGetDriverEntryPointByVersion: no link against libcuda);
//   cp.async: all 128 threads, 16 copies of 16 bytes each per tile, as the decode kernels copy;
//   each also with the next tile asked of L2 when a tile's copies are issued (+pf: the producer's
//   cp.async.bulk.prefetch.tensor of the same boxes; prefetch.global.L2 of each row's two lines).
// Grids of 1 and 4 blocks (a block's rate alone) and 256 / 264 blocks of 32 tiles (the bytes of
// batch 32 x 2048 x 8 KV heads). "pieces N": cp.async of the same bytes in contiguous pieces of N
// bytes at random places: 4 KB is a block of one head in HND, 32 KB a 16-token block's K or V for all
// 8 heads in NHD (what a block over every KV head of a sequence would read). "seq NHD" / "seq HND": the
// rows as decode reads them, the 8 neighbouring blocks of a sequence reading the 8 heads of the same
// cache blocks (the plain modes give each block cache blocks of its own, so 7/8 of every cache block is
// never read). Caution for one block alone: the row modes load the block ids (order[]) from global
// memory before each tile's copies, the pieces modes hash them, so only the full grids compare
// patterns. Results: NOTES.md, 2026-11-25 (19) and (20).
//   nvcc -std=c++17 -O3 -arch=sm_90a -o /tmp/tma_rate csrc_hip/paged_attention/experiments/tma_rate.cu && /tmp/tma_rate
// the same rows (256 B each, 2 KB apart).
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <random>
#include <cuda.h>
#include <cuda_runtime.h>
// K/V block pairs: 2 x 16 tokens x 8 heads x 256 B = 64 KB each -> 4 GB
constexpr size_t kPairs = 2 * 32768;
constexpr int kStages = 3, kTileBytes = 32768, kD = 128, kH = 8, kBlk = 16;
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(uint64_t* b, int n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(b)), "r"(n)); }
__device__ __forceinline__ void bar_wait(uint64_t* b, int ph) {
  asm volatile("{\n.reg .pred p;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}\n" ::"r"(sa(b)), "r"(ph) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(b)) : "memory"); }
__device__ __forceinline__ void bar_expect(uint64_t* b, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(bytes) : "memory");
}
// tiles: per block `tiles` tiles of head (blockIdx % 8); tile t uses blocks order[base + 4t .. +3]
template <bool kPf>
__global__ void __launch_bounds__(160) tma_kernel(const __grid_constant__ CUtensorMap km, const int* order, int tiles, unsigned* sink) {
  extern __shared__ __align__(1024) unsigned char sm[];
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + kStages * kTileBytes);
  uint64_t* empty = full + kStages;
  const int head = blockIdx.x % kH;
  const int* ord = order + (size_t)blockIdx.x * tiles * 4;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) { bar_init(full + s, 1); bar_init(empty + s, 4); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= 128) {
    if (threadIdx.x == 128) {
      for (int t = 0; t < tiles; ++t) {
        const int s = t % kStages;
        if (t >= kStages) bar_wait(empty + s, (t / kStages - 1) & 1);
        bar_expect(full + s, kTileBytes);
        unsigned char* dst = sm + s * kTileBytes;
        if (kPf && t + 1 < tiles) {  // L2 prefetch of the next tile's boxes
#pragma unroll
          for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int kv = 0; kv < 2; ++kv)
#pragma unroll
              for (int half = 0; half < 2; ++half)
                asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global [%0, {%1, %2, %3}];" ::"l"(&km), "r"(half * 64),
                             "r"(head), "r"((ord[4 * (t + 1) + b] * 2 + kv) * kBlk) : "memory");
        }
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const int blk = ord[4 * t + b];
#pragma unroll
          for (int kv = 0; kv < 2; ++kv)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              // box {64 dims, 1 head, 16 tokens}: coords {half*64, head, (blk*2+kv)*16}
              const int c0 = half * 64, c1 = head, c2 = (blk * 2 + kv) * kBlk;
              unsigned char* d = dst + ((kv * 4 + b) * 2 + half) * 2048;
              asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                           ::"r"(sa(d)), "l"(&km), "r"(c0), "r"(c1), "r"(c2), "r"(sa(full + s)) : "memory");
            }
        }
      }
    }
    return;
  }
  unsigned acc = 0;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % kStages;
    bar_wait(full + s, (t / kStages) & 1);
    acc ^= reinterpret_cast<const unsigned*>(sm + s * kTileBytes)[threadIdx.x * 64];
    __syncwarp();
    if (threadIdx.x % 32 == 0) bar_arrive(empty + s);
  }
  if (acc == 0x12345678) sink[0] = acc;
}
// cp.async: all 128 threads, 16 B each, rows of 256 B (token, head) 2 KB apart.
// kSeq: the kH blocks b = kH * s + h read the same cache blocks (the heads of sequence s, as decode reads
// them: every row of a cache block is read, by kH neighbouring blocks), not blocks of their own.
// kHnd: the cache as [pairs][K, V][8 heads][16 tokens][128] (one head of a block is 4 KB in one piece).
template <bool kHnd>
__device__ __forceinline__ size_t row_at(int blk, int kv, int tok, int head) {  // byte offset of a row's start
  return kHnd ? ((((size_t)(blk * 2 + kv) * kH + head) * kBlk + tok % 16) * kD) * 2
              : ((((size_t)(blk * 2 + kv) * kBlk + tok % 16) * kH + head) * kD) * 2;
}
template <bool kPf, int kWhole = 0, bool kSeq = false, bool kHnd = false>
__global__ void __launch_bounds__(128) cpasync_kernel(const unsigned char* cache, const int* order, int tiles, unsigned* sink) {
  extern __shared__ __align__(1024) unsigned char sm[];
  const int head = blockIdx.x % kH;
  const int* ord = order + (size_t)(kSeq ? blockIdx.x / kH : blockIdx.x) * tiles * 4;
  auto issue = [&](int t) {
    unsigned char* dst = sm + (t % kStages) * kTileBytes;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int i = threadIdx.x + j * 128;   // chunk of the tile: kv (1) | token (6) | chunk (4)
      const int kv = i >> 10, tok = (i >> 4) & 63, c = i & 15;
      size_t g;
      if constexpr (kWhole > 0) {  // pieces of kWhole bytes at random kWhole-aligned places (a hash of block, tile, piece)
        const unsigned pc = i * 16 / kWhole;
        unsigned h = (blockIdx.x * 0x9E3779B9u) ^ (t * 0x85EBCA6Bu) ^ (pc * 0xC2B2AE35u);
        h ^= h >> 15; h *= 0x2C1B3C6Du; h ^= h >> 12;
        g = (size_t)(h % (unsigned)(kPairs * 65536 / kWhole)) * kWhole + (i * 16) % kWhole;
      } else {
        g = row_at<kHnd>(ord[4 * t + tok / 16], kv, tok, head) + c * 16;
      }
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa(dst + i * 16)), "l"(cache + g) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    if (kPf && t + 1 < tiles) {  // L2 prefetch of the next tile's rows: thread i, row i % 64 of K or V
      const int kv = threadIdx.x >> 6, tok = threadIdx.x & 63, blk = ord[4 * (t + 1) + tok / 16];
      const unsigned char* row = cache + row_at<kHnd>(blk, kv, tok, head);
      asm volatile("prefetch.global.L2 [%0];\n\tprefetch.global.L2 [%1];" ::"l"(row), "l"(row + 128));
    }
  };
  unsigned acc = 0;
  for (int t = 0; t < kStages - 1 && t < tiles; ++t) issue(t);
  for (int t = 0; t < tiles; ++t) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2) : "memory");
    __syncthreads();
    if (t + kStages - 1 < tiles) issue(t + kStages - 1);
    else asm volatile("cp.async.commit_group;" ::: "memory");
    acc ^= reinterpret_cast<const unsigned*>(sm + (t % kStages) * kTileBytes)[threadIdx.x * 64];
  }
  if (acc == 0x12345678) sink[0] = acc;
}
int main() {
  const size_t bytes = kPairs * 2 * kBlk * kH * kD * 2;
  unsigned char* cache; int* order; unsigned* sink;
  cudaMalloc(&cache, bytes); cudaMemset(cache, 1, bytes); cudaMalloc(&sink, 4);
  typedef CUresult (*Encode)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                             const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                             CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* fn = nullptr; cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
  if (!fn) { printf("no cuTensorMapEncodeTiled\n"); return 1; }
  CUtensorMap km;
  cuuint64_t dims[3] = {kD, kH, kPairs * 2 * kBlk};
  cuuint64_t strides[2] = {kD * 2, (cuuint64_t)kH * kD * 2};
  cuuint32_t box[3] = {64, 1, kBlk}, es[3] = {1, 1, 1};
  CUresult r = ((Encode)fn)(&km, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, cache, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("encode failed %d\n", (int)r); return 1; }
  const int smem = kStages * kTileBytes + 64;
  typedef void (*CpKernel)(const unsigned char*, const int*, int, unsigned*);
  struct Mode { const char* name; CpKernel cp; bool tma_pf; };  // cp null: the TMA kernel (with L2 prefetch: tma_pf)
  const Mode modes[] = {{"tma", nullptr, false}, {"cp.async", cpasync_kernel<false>, false},
                        {"tma+pf", nullptr, true}, {"cp.async+pf", cpasync_kernel<true>, false},
                        {"pieces 1KB", cpasync_kernel<false, 1024>, false},
                        {"pieces 4KB", cpasync_kernel<false, 4096>, false},
                        {"pieces 32KB", cpasync_kernel<false, 32768>, false},
                        {"seq NHD", cpasync_kernel<false, 0, true>, false},
                        {"seq NHD+pf", cpasync_kernel<true, 0, true>, false},
                        {"seq HND", cpasync_kernel<false, 0, true, true>, false},
                        {"HND", cpasync_kernel<false, 0, false, true>, false}};
  for (auto k : {tma_kernel<false>, tma_kernel<true>}) cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (const Mode& m : modes)
    if (m.cp) cudaFuncSetAttribute(m.cp, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int grid : {1, 4, 256, 264}) {
    for (int tiles : {32, 512}) {
      if (grid >= 256 && tiles == 512) continue;
      const size_t need = (size_t)grid * tiles * 4;
      std::vector<int> h(need); std::mt19937 g(grid * 7 + tiles);
      for (auto& x : h) x = (int)(g() % kPairs);
      cudaMalloc(&order, need * 4); cudaMemcpy(order, h.data(), need * 4, cudaMemcpyHostToDevice);
      for (const Mode& m : modes) {
        float best = 1e9;
        for (int rep = 0; rep < 7; ++rep) {
          cudaMemset(sink, 0, 4);  // (between calls: no L2 flush; the order is random over 4 GB)
          cudaEventRecord(a);
          if (m.cp) m.cp<<<grid, 128, smem>>>(cache, order, tiles, sink);
          else if (m.tma_pf) tma_kernel<true><<<grid, 160, smem>>>(km, order, tiles, sink);
          else tma_kernel<false><<<grid, 160, smem>>>(km, order, tiles, sink);
          cudaEventRecord(b); cudaEventSynchronize(b);
          float ms; cudaEventElapsedTime(&ms, a, b); best = std::min(best, ms);
        }
        const double gb = (double)grid * tiles * kTileBytes / 1e9;
        printf("%-11s grid %4d tiles %4d: %8.1f us %7.1f GB/s total %6.1f GB/s per block %6.0f ns/tile/block\n",
               m.name, grid, tiles, best * 1e3, gb / (best * 1e-3), gb / grid / (best * 1e-3),
               best * 1e6 / tiles);
      }
      cudaFree(order);
    }
  }
  printf("err: %s\n", cudaGetErrorString(cudaGetLastError()));
}
