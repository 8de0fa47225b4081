// Experiment (not part of any module): the compute-only cost of one block_m-64 fused-MoE pipeline
// stage, 128 weight rows x N tokens x k 128 in bf16 with both operands already in shared memory, as
// the production MmaMath::step does it (mma.sync, ldmatrix fragments per warp) against wgmma (sm_90a;
// both operands read by the tensor cores from shared memory in the stage layout of math.h's
// WgmmaMath, through hipkern/wgmma.h). 132 blocks of 8 warps (one per SM), a
// barrier per stage in both; wgmma with 0 or 1 commit groups left in flight across stages. Prints ns
// per stage and TFLOP/s, after checking one stage of each against a float64 host product; then both
// again with every thread keeping its own cp.async copies in flight, as the GEMM's loader does.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc_hip/include -DHK_WAVE_SIZE=32 -DHK_WGMMA=1 \
//        -o /tmp/wgmma_stage csrc_hip/fused_moe/experiments/wgmma_stage.cu && /tmp/wgmma_stage
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include "../math.h"
using T = hk::bf16_t;
constexpr int R = 128, K = 128;

// The GEMM's own stage layout (WgmmaMath::at: K-major, 128-byte-swizzled atoms of 8 rows x 64
// elements, 1024-byte aligned) and hipkern/wgmma.h's instructions and descriptors.
typedef hk::fused_moe::WgmmaMath<T, 2, 64, K, 3> Layout;
__device__ inline int tiled(int r, int k) { return Layout::at(r, k / 8) + k % 8; }
constexpr uint32_t kSbo = K / 64 * 1024;  // bytes between 8-row groups

// With `stream` set, every thread also keeps its own 16-byte cp.async copies in flight across stages
// (8 per stage, 2 stages deep, into a scratch area), as the GEMM's loader does.
// ring: the copies land in the weight buffer of the stage two ahead (3 buffers), which wgmma reads
// two stages later, fenced for the async proxy: the GEMM's own pattern.
__device__ inline void copies(const uint4* stream, unsigned char* scratch, int it, bool ring = false) {
  if (stream == nullptr) return;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const size_t i = ((size_t)it * 2048 + blockIdx.x * 2048 * 64 + j * 256 + threadIdx.x) % (size_t(1) << 26);
    const int buf = ring ? (it + 2) % 3 : it % 3;
    hk::async_copy16(scratch + (buf * 8 + j) * 4096 + threadIdx.x * 16, stream + i);
  }
  hk::async_copy_commit();
  hk::async_copy_wait_pending<2>();
  if (ring) hk::fence_async_shared();
}

// The production mma.sync step (math.h) over the same stage, again and again.
template <int N>
__global__ void __launch_bounds__(256, 1) bench_mma(const T* gw, const T* gx, float* out, int iters,
                                                    const uint4* stream) {
  typedef hk::fused_moe::MmaMath<T, 8, 1, N, K, 3> M;
  extern __shared__ __align__(1024) unsigned char sm[];
  T* w = (T*)sm;
  T* x = w + R * M::kLd;
  int* pairs = (int*)(x + N * M::kLd);
  for (int i = threadIdx.x; i < R * K; i += 256) w[(i / K) * M::kLd + i % K] = gw[i];
  for (int i = threadIdx.x; i < N * K; i += 256) x[(i / K) * M::kLd + i % K] = gx[i];
  for (int i = threadIdx.x; i < N; i += 256) pairs[i] = i;  // every token row a pair
  __syncthreads();
  typename M::Acc acc;
  M::zero(acc);
  unsigned char* scratch = (unsigned char*)(pairs + N) + 128;
  for (int it = 0; it < iters; ++it) {
    copies(stream, scratch, it);
    __syncthreads();
    M::step(acc, w, x, pairs, N);
  }
  typedef hk::MmaTile<T> MT;
  if (blockIdx.x == 0)
    for (int n = 0; n < N / 8; ++n)
      for (int i = 0; i < 4; ++i) out[(16 * M::wr() + MT::c_row(i)) * N + 8 * n + MT::c_col(i)] = acc.c[n][i];
}

template <int N, int kInFlight, bool kRing = false>
__global__ void __launch_bounds__(256, 1) bench_wg(const T* gw, const T* gx, float* out, int iters,
                                                   const uint4* stream) {
  extern __shared__ __align__(1024) unsigned char sm[];
  T* w = (T*)sm;
  T* x = w + R * K;
  for (int i = threadIdx.x; i < R * K; i += 256) w[tiled(i / K, i % K)] = gw[i];
  for (int i = threadIdx.x; i < N * K; i += 256) x[tiled(i / K, i % K)] = gx[i];
  hk::fence_async_shared();
  __syncthreads();
  const int g = threadIdx.x / 128;
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  const T* w0 = w + g * 64 * K;  // this warpgroup's 64 rows
  unsigned char* scratch = (unsigned char*)(x + N * K);
  for (int it = 0; it < iters; ++it) {
    copies(stream, scratch, it, kRing);
    __syncthreads();
    const T* wg = kRing ? (const T*)(scratch + it % 3 * 32768) + g * 64 * K : w0;
    hk::wgmma_fence();
#pragma unroll
    for (int s = 0; s < K / 16; ++s) {  // k 16 s .. 16 s + 15: atom s / 4, 32 bytes (s % 4) into its rows
      const int k = s / 4 * 512 + s % 4 * 16;
      hk::Wgmma<T, N>::mma(d, hk::wgmma_desc_sw128(wg + k, kSbo), hk::wgmma_desc_sw128(x + k, kSbo));
    }
    hk::wgmma_commit();
    hk::wgmma_wait<kInFlight>();
    __syncthreads();
  }
  hk::wgmma_wait<0>();
  if (blockIdx.x == 0) {
    const int t = threadIdx.x % 128, wq = t / 32, lane = t % 32;
    for (int j = 0; j < N / 8; ++j)
      for (int i = 0; i < 4; ++i)
        out[(64 * g + 16 * wq + lane / 4 + 8 * (i / 2)) * N + 8 * j + 2 * (lane % 4) + i % 2] = d[4 * j + i];
  }
}

#define CK(x)                                                  \
  do {                                                         \
    cudaError_t e = (x);                                       \
    if (e != cudaSuccess) {                                    \
      printf("%s: %s\n", #x, cudaGetErrorString(e));           \
      exit(1);                                                 \
    }                                                          \
  } while (0)

template <typename F>
float timeit(F launch) {
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  launch();
  CK(cudaDeviceSynchronize());
  cudaEventRecord(a);
  launch();
  cudaEventRecord(b);
  CK(cudaEventSynchronize(b));
  float ms; cudaEventElapsedTime(&ms, a, b);
  return ms;
}

template <int N>
void run() {
  std::vector<uint16_t> hw(R * K), hx(N * K);
  std::vector<float> fw(R * K), fx(N * K);
  auto bf = [](float f, float& back) {  // truncated to bf16; back: the value it stands for
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t h = u >> 16;
    u = (uint32_t)h << 16;
    memcpy(&back, &u, 4);
    return h;
  };
  for (int i = 0; i < R * K; ++i) hw[i] = bf((rand() / (float)RAND_MAX - 0.5f), fw[i]);
  for (int i = 0; i < N * K; ++i) hx[i] = bf((rand() / (float)RAND_MAX - 0.5f), fx[i]);
  std::vector<double> ref(R * N, 0.0);
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < K; ++k) acc += (double)fw[r * K + k] * fx[n * K + k];
      ref[r * N + n] = acc;
    }
  T *dw, *dx; float *o1, *o2;
  CK(cudaMalloc(&dw, R * K * 2));
  CK(cudaMalloc(&dx, N * K * 2));
  CK(cudaMalloc(&o1, R * N * 4));
  CK(cudaMalloc(&o2, R * N * 4));
  CK(cudaMemcpy(dw, hw.data(), R * K * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dx, hx.data(), N * K * 2, cudaMemcpyHostToDevice));
  constexpr int kScratch = 3 * 8 * 4096 + 256;  // copies()'s destinations
  const int sm1 = (R + N) * (K + 8) * 2 + N * 4 + kScratch, sm2 = (R + N) * K * 2 + kScratch;
  CK(cudaFuncSetAttribute(bench_mma<N>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm1));
  CK(cudaFuncSetAttribute(bench_wg<N, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm2));
  CK(cudaFuncSetAttribute(bench_wg<N, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm2));
  // correctness: one stage
  bench_mma<N><<<1, 256, sm1>>>(dw, dx, o1, 1, nullptr);
  bench_wg<N, 0><<<1, 256, sm2>>>(dw, dx, o2, 1, nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<float> r1(R * N), r2(R * N);
  CK(cudaMemcpy(r1.data(), o1, R * N * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(r2.data(), o2, R * N * 4, cudaMemcpyDeviceToHost));
  double e1 = 0, e2 = 0;
  for (int i = 0; i < R * N; ++i) {
    e1 = fmax(e1, fabs(r1[i] - ref[i]));
    e2 = fmax(e2, fabs(r2[i] - ref[i]));
  }
  const int iters = 20000, G = 132;
  float t1 = timeit([&] { bench_mma<N><<<G, 256, sm1>>>(dw, dx, o1, iters, nullptr); });
  float t2 = timeit([&] { bench_wg<N, 0><<<G, 256, sm2>>>(dw, dx, o2, iters, nullptr); });
  float t3 = timeit([&] { bench_wg<N, 1><<<G, 256, sm2>>>(dw, dx, o2, iters, nullptr); });
  // the same with each thread's copies in flight (32 KB per stage and block from a 1 GB stream)
  static uint4* stream = nullptr;
  if (!stream) CK(cudaMalloc(&stream, sizeof(uint4) << 26));
  const int citers = 2000;
  float c1 = timeit([&] { bench_mma<N><<<G, 256, sm1>>>(dw, dx, o1, citers, stream); });
  float c2 = timeit([&] { bench_wg<N, 0><<<G, 256, sm2>>>(dw, dx, o2, citers, stream); });
  CK(cudaFuncSetAttribute(bench_wg<N, 0, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm2));
  float c3 = timeit([&] { bench_wg<N, 0, true><<<G, 256, sm2>>>(dw, dx, o2, citers, stream); });
  printf("N=%3d tokens, with copies in flight: ns per stage: mma.sync %7.1f  wgmma (wait 0) %7.1f  wgmma reading "
         "the copied buffers %7.1f\n", N, c1 * 1e6 / citers, c2 * 1e6 / citers, c3 * 1e6 / citers);
  const double flop = 2.0 * R * N * K * iters * G;
  printf("N=%3d tokens: max err vs host mma.sync %.2e wgmma %.2e | ns per stage: mma.sync %7.1f  wgmma (wait 0) %7.1f  "
         "(wait 1) %7.1f | TFLOP/s %6.1f %6.1f %6.1f\n",
         N, e1, e2, t1 * 1e6 / iters, t2 * 1e6 / iters, t3 * 1e6 / iters, flop / t1 / 1e9, flop / t2 / 1e9,
         flop / t3 / 1e9);
  cudaFree(dw); cudaFree(dx); cudaFree(o1); cudaFree(o2);
}

int main() {
  run<8>(); run<16>(); run<32>(); run<64>(); run<128>();
  return 0;
}
