// Experiment (not part of any module): what one launch costs in the benchmarks' protocol
// (hipkern.testing.run_perftest: the stream held by a spin kernel while the host queues every call,
// then device events around each call; median of 300). Empty kernels by launch shape (one block or
// 128 x 256 threads, 200 KB of dynamic shared memory, clusters of 2 / 4, programmatic dependent
// launch), a kernel reading one int a block, and empty kernels by the bytes of their parameter
// (__grid_constant__ or by value, 8 B to 4000 B). Results: paged_attention/NOTES.md, 2026-11-27 (6).
//   nvcc -std=c++17 -O2 -arch=sm_90a -o /tmp/launch_cost csrc_hip/paged_attention/experiments/launch_cost.cu && /tmp/launch_cost
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t err_ = (x);                                                                 \
    if (err_ != cudaSuccess) {                                                              \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));                   \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

template <int B, int A> struct Bytes { alignas(A) unsigned char m[B]; };
__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
__global__ void empty() {}
__global__ void read_one(const int* x, int* y) {
  if (threadIdx.x == 0) y[blockIdx.x] = x[(size_t)blockIdx.x * 4096] + 1;
}
// The parameter is read (so it is passed), never true (so nothing traps).
template <int B, int A> __global__ void param_gc(const __grid_constant__ Bytes<B, A> p) {
  if (p.m[threadIdx.x % B] == 7 && threadIdx.x == 1000) asm volatile("trap;");
}
template <int B, int A> __global__ void param_val(Bytes<B, A> p) {
  if (p.m[threadIdx.x % B] == 7 && threadIdx.x == 1000) asm volatile("trap;");
}

constexpr int kCalls = 300;
template <class F> void timed(const char* name, F launch) {
  std::vector<cudaEvent_t> s(kCalls), e(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    CK(cudaEventCreate(&s[i]));
    CK(cudaEventCreate(&e[i]));
  }
  for (int i = 0; i < 10; ++i) launch();
  CK(cudaDeviceSynchronize());
  spin<<<1, 1>>>(60LL * 1000 * 1000);  // ~30 ms: longer than queueing kCalls launches takes
  for (int i = 0; i < kCalls; ++i) {
    CK(cudaEventRecord(s[i]));
    launch();
    CK(cudaEventRecord(e[i]));
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> t(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    CK(cudaEventElapsedTime(&t[i], s[i], e[i]));
    t[i] *= 1000.f;
  }
  std::sort(t.begin(), t.end());
  printf("%-44s median %6.2f us  p10 %6.2f  p90 %6.2f\n", name, t[kCalls / 2], t[kCalls / 10], t[kCalls * 9 / 10]);
  for (int i = 0; i < kCalls; ++i) {
    CK(cudaEventDestroy(s[i]));
    CK(cudaEventDestroy(e[i]));
  }
}

int main() {
  int *x, *y;
  CK(cudaMalloc(&x, (size_t)512 << 20));
  CK(cudaMalloc(&y, 1 << 20));
  CK(cudaMemset(x, 1, (size_t)512 << 20));
  const int big = 200 * 1024;
  CK(cudaFuncSetAttribute(empty, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  auto ex = [&](unsigned cluster, bool pdl) {
    cudaLaunchAttribute a[2];
    int n = 0;
    if (cluster > 1) {
      a[n].id = cudaLaunchAttributeClusterDimension;
      a[n].val.clusterDim.x = cluster;
      a[n].val.clusterDim.y = a[n].val.clusterDim.z = 1;
      ++n;
    }
    if (pdl) {
      a[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      a[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    cudaLaunchConfig_t c = {};
    c.gridDim = dim3(128);
    c.blockDim = dim3(256);
    c.dynamicSmemBytes = big;
    c.attrs = a;
    c.numAttrs = n;
    CK(cudaLaunchKernelEx(&c, empty));
  };
  timed("empty <<<1, 32>>>", [] { empty<<<1, 32>>>(); });
  timed("empty <<<128, 256>>>", [] { empty<<<128, 256>>>(); });
  timed("empty <<<128, 256, 200 KB>>>", [&] { empty<<<128, 256, big>>>(); });
  timed("empty, 200 KB, programmatic dependent", [&] { ex(1, true); });
  timed("empty, 200 KB, clusters of 2", [&] { ex(2, false); });
  timed("empty, 200 KB, clusters of 4", [&] { ex(4, false); });
  timed("one int read a block <<<128, 256>>>", [&] { read_one<<<128, 256>>>(x, y); });
#define PARAM(B, A) \
  timed("empty, " #B " B parameter (grid constant)", [] { param_gc<B, A><<<128, 256>>>(Bytes<B, A>{}); });
  PARAM(8, 8)
  PARAM(64, 8)
  PARAM(128, 64)
  PARAM(192, 8)
  PARAM(256, 64)
  PARAM(448, 64)
  PARAM(1024, 64)
  PARAM(4000, 64)
  timed("empty, 448 B parameter (by value)", [] { param_val<448, 64><<<128, 256>>>(Bytes<448, 64>{}); });
  return 0;
}
