// Experiment (not part of any module): the rate of one block's global -> shared copies, alone and
// with 132 / 264 blocks, by primitive: 16-byte cp.async (.cg with a source size, as the decode
// kernels issue it; .cg; .ca) and 16-byte loads then shared stores. Each block streams 32 KB tiles
// (contiguous, in random order over 2 GB) through a 3-stage ring, 128 threads, 16 copies a thread per
// tile. Prints per-block GB/s and ns per tile (best of 5, events). Results: NOTES.md, 2026-11-25 (19).
//   nvcc -std=c++17 -O3 -arch=sm_90a -o /tmp/copy_rate csrc_hip/paged_attention/experiments/copy_rate.cu && /tmp/copy_rate
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <random>
#include <cuda_runtime.h>
constexpr int kT = 128, kTile = 32768, kPer = kTile / 16 / kT, kStages = 3;
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
template <int V>
__global__ void __launch_bounds__(kT) copy_kernel(const uint4* __restrict__ src, const int* order, int tiles, int per_block, unsigned* sink) {
  extern __shared__ uint4 sm[];
  const int first = blockIdx.x * per_block;
  uint4 acc = make_uint4(0, 0, 0, 0);
  auto issue = [&](int t) {
    const uint4* g = src + (size_t)order[first + t] * (kTile / 16);
    uint4* s = sm + (t % kStages) * (kTile / 16);
    if constexpr (V == 3) {
      uint4 r[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) r[j] = __ldcg(g + threadIdx.x + j * kT);
#pragma unroll
      for (int j = 0; j < kPer; ++j) s[threadIdx.x + j * kT] = r[j];
    } else {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int i = threadIdx.x + j * kT;
        if (V == 0) asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa(s + i)), "l"(g + i), "r"(16) : "memory");
        if (V == 1) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa(s + i)), "l"(g + i) : "memory");
        if (V == 2) asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(sa(s + i)), "l"(g + i) : "memory");
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
  };
  for (int t = 0; t < kStages - 1 && t < tiles; ++t) issue(t);
  for (int t = 0; t < tiles; ++t) {
    if (V != 3) asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    __syncthreads();
    if (t + kStages - 1 < tiles) issue(t + kStages - 1);
    else if (V != 3) asm volatile("cp.async.commit_group;\n" ::: "memory");
    const uint4 v = sm[(t % kStages) * (kTile / 16) + threadIdx.x];
    acc.x ^= v.x;
  }
  if (acc.x == 0x12345678) sink[0] = acc.y;
}
int main() {
  const size_t bytes = 2ull << 30, ntile = bytes / kTile;
  uint4* src; int* order; unsigned* sink;
  cudaMalloc(&src, bytes); cudaMemset(src, 1, bytes); cudaMalloc(&sink, 4);
  std::vector<int> h(ntile); for (size_t i = 0; i < ntile; ++i) h[i] = (int)i;
  std::shuffle(h.begin(), h.end(), std::mt19937(1));
  cudaMalloc(&order, ntile * 4); cudaMemcpy(order, h.data(), ntile * 4, cudaMemcpyHostToDevice);
  const int smem = kStages * kTile;
  void (*ks[4])(const uint4*, const int*, int, int, unsigned*) = {copy_kernel<0>, copy_kernel<1>, copy_kernel<2>, copy_kernel<3>};
  const char* names[4] = {"cp.async.cg zfill", "cp.async.cg", "cp.async.ca", "ld.cg+st.shared"};
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int v = 0; v < 4; ++v) {
    cudaFuncSetAttribute(ks[v], cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    for (int grid : {1, 4, 132, 264}) {
      const int tiles = grid == 1 ? 2048 : grid == 4 ? 1024 : (int)(ntile / grid);
      float best = 1e9;
      for (int r = 0; r < 5; ++r) {
        cudaEventRecord(a);
        ks[v]<<<grid, kT, smem>>>(src, order, tiles, tiles, sink);
        cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); best = std::min(best, ms);
      }
      const double gb = (double)grid * tiles * kTile / 1e9;
      printf("%-20s grid %4d: %8.1f us  %7.1f GB/s total  %6.1f GB/s per block  %6.0f ns/tile/block\n", names[v], grid,
             best * 1e3, gb / (best * 1e-3), gb / grid / (best * 1e-3), best * 1e6 / tiles);
    }
  }
  printf("err: %s\n", cudaGetErrorString(cudaGetLastError()));
}
