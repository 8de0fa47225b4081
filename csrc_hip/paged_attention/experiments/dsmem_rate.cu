// Experiment (not part of any module): what the paged-attention cluster merge's reads of distributed shared
// memory cost (common.h cluster_merge_ranks, 2-block clusters of the 64-head head-256 blocks: each block merges
// half of the 64 x 256 fp32 outputs, reading that half of its partner's state and of its own). Here 132 blocks of
// 256 threads in clusters of 2, 64 KB of shared memory each; each block reads 32 KB of its partner's (float4 a
// load, 8 a thread) and 32 KB of its own, sums them and stores 32 KB; clock64 around the loop, median block of the
// median of 5 runs. Modes: both through the cluster window (mapa + ld.shared::cluster, as the kernel does); own
// half by plain ld.shared; partner only; own only (window / plain). U = independent loads a thread in flight.
// Results: paged_attention/NOTES.md, 2026-11-29 (16).
//   nvcc -O3 -arch=sm_90a -o /tmp/dsmem_rate csrc_hip/paged_attention/experiments/dsmem_rate.cu && /tmp/dsmem_rate
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
__device__ __forceinline__ unsigned mapa(const void* p, int r) {
  unsigned a = (unsigned)__cvta_generic_to_shared(p), o;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(r));
  return o;
}
__device__ __forceinline__ float4 ldc(unsigned a) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ void csync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
template <int MODE, int U>
__global__ void __cluster_dims__(2, 1, 1) k(float* out, long long* cyc) {
  extern __shared__ float4 s[];  // 4096 float4 = 64 KB: [0, 2048) half A, [2048, 4096) half B
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) s[i] = make_float4(i, 1, 2, 3);
  csync();
  const int me = rank(), other = me ^ 1;
  const unsigned own = mapa(s, me), par = mapa(s, other);
  const int base = me * 2048;  // this block merges half `me`
  long long t0 = clock64();
  float4 acc = make_float4(0, 0, 0, 0);
  for (int i0 = threadIdx.x; i0 < 2048; i0 += 256 * U) {
    float4 a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + i0 + u * 256;
      if (MODE == 0) { a[u] = ldc(own + 16u * i); b[u] = ldc(par + 16u * i); }
      if (MODE == 1) { a[u] = s[i]; b[u] = ldc(par + 16u * i); }
      if (MODE == 2) { a[u] = make_float4(0, 0, 0, 0); b[u] = ldc(par + 16u * i); }
      if (MODE == 3) { a[u] = ldc(own + 16u * i); b[u] = make_float4(0, 0, 0, 0); }
      if (MODE == 4) { a[u] = s[i]; b[u] = make_float4(0, 0, 0, 0); }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      acc.x += a[u].x * 0.5f + b[u].x; acc.y += a[u].y + b[u].y; acc.z += a[u].z + b[u].z; acc.w += a[u].w * b[u].w;
      reinterpret_cast<float4*>(out)[(size_t)blockIdx.x * 2048 + i0 + u * 256] = acc;
    }
  }
  __syncthreads();
  long long t1 = clock64();
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
  csync();
}
template <int MODE, int U> void run(float* out, long long* cyc, const char* name) {
  cudaFuncSetAttribute(k<MODE, U>, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
  std::vector<long long> h(132);
  std::vector<double> meds;
  for (int rep = 0; rep < 5; ++rep) {
    k<MODE, U><<<132, 256, 65536>>>(out, cyc);
    cudaDeviceSynchronize();
    cudaMemcpy(h.data(), cyc, 132 * 8, cudaMemcpyDeviceToHost);
    std::sort(h.begin(), h.end());
    meds.push_back(h[66]);
  }
  std::sort(meds.begin(), meds.end());
  printf("%-34s U=%d  median cycles %7.0f  (%.1f B/clk of DSMEM+smem reads)  err=%s\n", name, U, meds[2],
         (MODE == 2 || MODE >= 3 ? 32768.0 : 65536.0) / meds[2], cudaGetErrorString(cudaGetLastError()));
}
int main() {
  float* out; long long* cyc;
  cudaMalloc(&out, 132ull * 2048 * 16); cudaMalloc(&cyc, 132 * 8);
  run<0, 1>(out, cyc, "both via cluster window"); run<0, 2>(out, cyc, "both via cluster window");
  run<0, 4>(out, cyc, "both via cluster window"); run<0, 8>(out, cyc, "both via cluster window");
  run<1, 1>(out, cyc, "own plain, partner cluster"); run<1, 2>(out, cyc, "own plain, partner cluster");
  run<1, 4>(out, cyc, "own plain, partner cluster"); run<1, 8>(out, cyc, "own plain, partner cluster");
  run<2, 1>(out, cyc, "partner only"); run<2, 4>(out, cyc, "partner only"); run<2, 8>(out, cyc, "partner only");
  run<3, 1>(out, cyc, "own only via cluster window"); run<3, 4>(out, cyc, "own only via cluster window");
  run<4, 1>(out, cyc, "own only plain"); run<4, 4>(out, cyc, "own only plain");
  return 0;
}
