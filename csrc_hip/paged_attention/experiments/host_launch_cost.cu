// Experiment (not part of any module): host time of the pieces of an eager launch (us a call, host clock, after
// 100 warm-up calls): cuTensorMapEncodeTiled (a 5-D map as the paged-attention launcher encodes two a call),
// cudaGetDevice, cudaGetLastError, a 128-block launch with 448 B / 16 B of parameters, cudaLaunchKernelEx with
// programmatic dependent launch and with clusters of 2. Launch loops of 400 calls, so that the queue does not
// fill (the GPU's time would show instead). Results: paged_attention/NOTES.md, 2026-11-29 (16).
//   nvcc -O2 -arch=sm_90 -o /tmp/host_launch_cost csrc_hip/paged_attention/experiments/host_launch_cost.cu -lcuda
//   && /tmp/host_launch_cost
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
struct P448 { char b[448]; };
__global__ void k448(P448 p) { if (p.b[0] == 123 && threadIdx.x == 999) printf("x"); }
__global__ void k64(long long a, long long b) { if (a == 123 && threadIdx.x == 999) printf("x"); }
template <class F> double us(F f, int n = 20000) {
  for (int i = 0; i < 100; ++i) f();
  cudaDeviceSynchronize();
  auto t = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  double r = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count() / n;
  cudaDeviceSynchronize();
  return r;
}
int main() {
  cudaFree(0);
  void* fn = nullptr; cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
  auto enc = (PFN_cuTensorMapEncodeTiled_v12000)fn;
  void* buf; cudaMalloc(&buf, 1 << 30);
  CUtensorMap m;
  cuuint64_t d[5] = {64, 8, 2, 16, 4096}, s[4] = {256, 2048, 4096, 65536};
  cuuint32_t b[5] = {64, 1, 2, 16, 1}, e[5] = {1, 1, 1, 1, 1};
  printf("encode        %.3f us\n", us([&] { enc(&m, CU_TENSOR_MAP_DATA_TYPE_UINT16, 5, buf, d, s, b, e,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE); }));
  int dev; printf("getdevice     %.3f us\n", us([&] { cudaGetDevice(&dev); }));
  printf("getlasterror  %.3f us\n", us([&] { (void)cudaGetLastError(); }));
  cudaStream_t st; cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  P448 p{};
  printf("launch 448 B  %.3f us\n", us([&] { k448<<<128, 128, 0, st>>>(p); }, 400));
  printf("launch 16 B   %.3f us\n", us([&] { k64<<<128, 128, 0, st>>>(1, 2); }, 400));
  cudaLaunchAttribute a[1]; a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{};
  c.gridDim = dim3(128);
  c.blockDim = dim3(128);
  c.stream = st;
  c.attrs = a;
  c.numAttrs = 1;
  printf("launchEx PDL  %.3f us\n", us([&] { cudaLaunchKernelEx(&c, k448, p); }, 400));
  cudaLaunchAttribute a2[1]; a2[0].id = cudaLaunchAttributeClusterDimension; a2[0].val.clusterDim.x = 1;
  a2[0].val.clusterDim.y = 1; a2[0].val.clusterDim.z = 2;
  cudaLaunchConfig_t c2{};
  c2.gridDim = dim3(8, 16, 2);
  c2.blockDim = dim3(128);
  c2.stream = st;
  c2.attrs = a2;
  c2.numAttrs = 1;
  printf("launchEx clu  %.3f us\n", us([&] { cudaLaunchKernelEx(&c2, k448, p); }, 400));
  return 0;
}
