// Experiment (not part of any module): what a warp's 16-byte shared-memory load (LDS.128) costs the
// SM for each pattern of addresses over the lanes, as groundwork for the float32 GEMM's register
// tiles (math.h): whether lanes reading the same address (a broadcast operand) take fewer cycles of
// the shared-memory pipe than lanes reading distinct ones. 132 blocks of 8 warps (one per SM), each
// thread 64 x 16 independent loads; prints SM cycles per warp-level load (the pipe's cost when it is
// the limit: 4 for 32 distinct 16-byte addresses), with 8-byte and 4-byte loads for comparison.
// Each load also costs its warp ~6 issued instructions (the load, its address, the adds that keep it
// live): ~1.8 SM cycles per load over the 4 schedulers, so figures near 2 (every LDS.32 / LDS.64
// pattern) are that floor, not the pipe's. H100 (2026-11-24): LDS.128 4.13 cycles for 32 distinct
// addresses; 2.68 whenever every lane shares its address with lane n ^ 1, or every lane with lane
// n ^ 2 (broadcast, pairs, quads, halves); 4.1 when lanes share addresses only across quarters of
// the warp (n ^ 8, n ^ 16), even 8 addresses in 128 bytes. (The alternating pattern's two addresses
// 256 bytes apart also share banks: its 4.0 does not separate the two causes.)
//   nvcc -std=c++17 -O3 -arch=sm_90 -o /tmp/lds_patterns csrc_hip/fused_moe/experiments/lds_patterns.cu && /tmp/lds_patterns
#include <cstdio>

constexpr int kWarps = 8, kIters = 64, kUnroll = 16, kSlots = 1024;  // slots of 16 bytes

template <int kBytes>
__device__ __forceinline__ void lds(unsigned addr, float& acc) {
  float a, b, c, d;
  if (kBytes == 16) {
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(a), "=f"(b), "=f"(c), "=f"(d) : "r"(addr));
  } else if (kBytes == 8) {
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];" : "=f"(a), "=f"(b) : "r"(addr));
    c = d = 0.f;
  } else {
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(a) : "r"(addr));
    b = c = d = 0.f;
  }
  acc += a + b + c + d;  // the same adds for every pattern of a width
}

// slot(lane): the 16-byte slot a lane reads (pattern p); kBytes-wide loads read its start.
__device__ int slot(int p, int lane) {
  switch (p) {
    case 0: return lane;                          // 32 distinct, consecutive
    case 1: return 0;                             // one address for the warp
    case 2: return lane >> 1;                     // pairs (n, n ^ 1)
    case 3: return (lane >> 2) * 2 + (lane & 1);  // pairs (n, n ^ 2)
    case 4: return lane >> 2;                     // quads of consecutive lanes
    case 5: return lane >> 3;                     // 4 addresses, 8 consecutive lanes each
    case 6: return lane >> 4;                     // 2 addresses (halves)
    case 7: return lane & 15;                     // pairs (n, n ^ 16)
    case 8: return lane & 7;                      // 8 addresses, lanes n, n ^ 8, n ^ 16, n ^ 24
    default: return (lane & 1) * 16;              // 2 addresses, alternating lanes (same banks)
  }
}

template <int kBytes>
__global__ void kernel(int p, long long* cycles, float* sink) {
  __shared__ float4 buf[kSlots];
  for (int i = threadIdx.x; i < kSlots; i += blockDim.x) buf[i] = make_float4(i, i, i, i);
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Each warp and iteration moves to another 512-byte row group (same bank pattern); a lane reads
  // kBytes at kBytes * slot.
  const unsigned base = (unsigned)__cvta_generic_to_shared(buf) + (unsigned)kBytes * slot(p, lane);
  float acc = 0.f;
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < kIters; ++it)
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) lds<kBytes>(base + 512u * ((warp + it * kUnroll + u) % (kSlots / 32)), acc);
  __syncthreads();
  const long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  if (acc == -1.f) sink[threadIdx.x] = acc;  // keeps the loads' results live
}

template <int kBytes>
void run(const char* const* names, int n_patterns) {
  long long* d_cycles;
  float* d_sink;
  cudaMalloc(&d_cycles, 132 * sizeof(long long));
  cudaMalloc(&d_sink, 1024 * sizeof(float));
  for (int p = 0; p < n_patterns; ++p) {
    long long h[132];
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      kernel<kBytes><<<132, kWarps * 32>>>(p, d_cycles, d_sink);
      cudaMemcpy(h, d_cycles, sizeof h, cudaMemcpyDeviceToHost);
      double mean = 0;
      for (long long c : h) mean += (double)c / 132;
      if (mean < best) best = mean;
    }
    printf("LDS.%-3d %-40s %6.2f SM cycles per warp load\n", kBytes * 8, names[p],
           best / ((double)kWarps * kIters * kUnroll));
  }
  cudaFree(d_cycles);
  cudaFree(d_sink);
}

int main() {
  const char* names[] = {"32 distinct consecutive", "1 address (broadcast)", "pairs n, n^1",
                         "pairs n, n^2", "quads of consecutive lanes", "4 addresses x 8 consecutive lanes",
                         "2 addresses (halves)", "pairs n, n^16", "8 addresses (n, n^8, n^16, n^24)",
                         "2 addresses, alternating lanes"};
  run<16>(names, 10);
  run<8>(names, 10);
  run<4>(names, 3);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("error: %s\n", cudaGetErrorString(e)); return 1; }
  return 0;
}
