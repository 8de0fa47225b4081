// Experiment (not part of any module): the compute-only cost of one block_m-64 fused-MoE pipeline
// stage, 128 weight rows x N tokens x k 128 in bf16 with both operands already in shared memory, as
// the production MmaMath::step does it (mma.sync, ldmatrix fragments per warp) against wgmma (sm_90a;
// both operands read by the tensor cores from shared memory, K-major, 128-byte swizzle: the
// layout and descriptors a wgmma policy for math.h would use). 132 blocks of 8 warps (one per SM), a
// barrier per stage in both; wgmma with 0 or 1 commit groups left in flight across stages. Prints ns
// per stage and TFLOP/s, after checking one stage of each against a float64 host product; then both
// again with every thread keeping its own cp.async copies in flight, as the GEMM's loader does.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc_hip/include -DHK_WAVE_SIZE=32 \
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

// d[0 .. N/2) += A (64 x 16, descriptor da) * B (16 x N, descriptor db), fp32 accumulators in the
// mma.sync C layout per warp (warp w of the warpgroup: rows 16w + lane/4 (+8), columns 8j + 2(lane%4) (+1)).
template <int N> struct Wg;
template <int N> struct Wg;
template <> struct Wg<8> {
  static __device__ void run(float (&d)[4], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3"
                 "}, %4, %5, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
};
template <> struct Wg<16> {
  static __device__ void run(float (&d)[8], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7"
                 "}, %8, %9, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
};
template <> struct Wg<32> {
  static __device__ void run(float (&d)[16], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
                 "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
};
template <> struct Wg<64> {
  static __device__ void run(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
                 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
};
template <> struct Wg<128> {
  static __device__ void run(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
                   "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
                   "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
                   "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
};

// Element offset of (row r, k) in the K-major 128-byte-swizzled layout: atoms of 8 rows x 64
// elements (128 bytes a row, 1024 B), 16-byte chunk c of a row stored at chunk c ^ (row % 8); atoms
// of a row group K-adjacent (1024 B apart), row groups 2048 B apart (the descriptor's SBO). Needs
// 1024-byte-aligned atoms (the hardware swizzles on address bits).
__device__ __host__ inline int tiled(int r, int k) {
  const int c = k / 8, a = c / 8;
  return (((r / 8) * (K / 64) + a) * 8 + r % 8) * 64 + ((c % 8) ^ (r % 8)) * 8 + k % 8;
}
// A wgmma shared-memory matrix descriptor: start address and SBO in 16-byte units, LBO unused (1),
// 128-byte swizzle.
__device__ inline uint64_t desc(uint32_t addr, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(sbo >> 4) << 32) | ((uint64_t)1 << 62);
}

// The production step (math.h) over the same stage, again and again.
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
  if (ring) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

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
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int g = threadIdx.x / 128;
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  const uint32_t wa0 = hk::smem_addr(w) + g * 64 * K * 2, xa = hk::smem_addr(x);  // 64 rows further
  unsigned char* scratch = (unsigned char*)(x + N * K);
  for (int it = 0; it < iters; ++it) {
    copies(stream, scratch, it, kRing);
    __syncthreads();
    const uint32_t wa = kRing ? hk::smem_addr(scratch) + it % 3 * 32768 + g * 64 * K * 2 : wa0;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int s = 0; s < K / 16; ++s)  // k 16 s .. 16 s + 15: atom s / 4, bytes 32 (s % 4) of its rows
      Wg<N>::run(d, desc(wa + s / 4 * 1024 + s % 4 * 32, K / 64 * 1024),
                 desc(xa + s / 4 * 1024 + s % 4 * 32, K / 64 * 1024), 1);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kInFlight) : "memory");
    __syncthreads();
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
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
