// A plain streaming read: every 16-byte vector of a buffer read once, as fast as the memory system
// gives it, with nothing else in the kernel. Its time in a benchmark's own harness is the floor of any
// kernel that must read that many bytes there (hipkern.bench.floor.read_floor_us): the harness's per-call
// cost, the ramp and the tail included.
//
// Block b reads the contiguous tile of vectors [b T, (b + 1) T), T = kUnroll x 256 (4-32 KB): lane t
// reads vectors b T + u 256 + t, all kUnroll issued before any is used. One short block per tile, as
// many as the buffer needs, left to the hardware's block scheduler: on the H100 this read was 2-3.5 %
// faster at 67 MB-1 GB than a persistent grid striding over the buffer, and level with a Triton
// kernel of the same shape (paged_attention/NOTES.md, 2026-11-27 (7)). Each block XORs what it read
// into one word, sink[block], so the loads are live; the tests check those words.
#include "hipkern/error.h"
#include "hipkern/reduce.h"

namespace hk {
namespace stream_read {

constexpr int kBlockThreads = 256;

HK_DEVICE uint32_t fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

template <int kUnroll>
__global__ void __launch_bounds__(kBlockThreads) stream_read_kernel(const uint4* __restrict__ src, int64_t n,
                                                                    uint32_t* __restrict__ sink) {
  const int64_t first = (int64_t)blockIdx.x * (kUnroll * kBlockThreads) + threadIdx.x;
  uint32_t acc = 0;
  if (first + (kUnroll - 1) * kBlockThreads < n) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[first + u * kBlockThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= fold(v[u]);
  } else {  // the buffer's last, partial tile
    for (int64_t i = first; i < n; i += kBlockThreads) acc ^= fold(src[i]);
  }

  __shared__ uint32_t waves[kBlockThreads / kWaveSize];
  acc = block_reduce<kBlockThreads>(acc, waves, XorOp(), 0u);
  if (threadIdx.x == 0) sink[blockIdx.x] = acc;
}

template <int kUnroll>
int launch(const uint4* src, int64_t n, uint32_t* sink, int64_t grid, hipStream_t stream) {
  HK_REQUIRE(grid == (n + kUnroll * kBlockThreads - 1) / (kUnroll * kBlockThreads));
  if (grid == 0) return 0;
  hipLaunchKernelGGL(HIP_KERNEL_NAME(stream_read_kernel<kUnroll>), dim3(grid), dim3(kBlockThreads), 0, stream,
                     src, n, sink);
  HK_CHECK_LAUNCH("stream_read_kernel");
  return 0;
}

}  // namespace stream_read
}  // namespace hk

// Reads the `bytes` at src (16-byte aligned, a multiple of 16) in tiles of `unroll` (1, 2, 4 or 8) x 4 KB,
// one block of 256 threads a tile; sink: `grid` uint32 words, grid = the number of tiles (each one's XOR).
HK_EXPORT int hk_stream_read(const void* src, int64_t bytes, uint32_t* sink, int64_t grid, int unroll, int device,
                             void* stream) {
  using namespace hk::stream_read;
  HK_REQUIRE(bytes >= 0 && bytes % 16 == 0);
  HK_REQUIRE(((uintptr_t)src & 15) == 0);
  HK_REQUIRE(grid >= 0 && grid < (int64_t(1) << 31));
  HK_TRY(hk::use_device(device));
  const uint4* p = static_cast<const uint4*>(src);
  const int64_t n = bytes / 16;
  hipStream_t s = static_cast<hipStream_t>(stream);
  switch (unroll) {
    case 1: return launch<1>(p, n, sink, grid, s);
    case 2: return launch<2>(p, n, sink, grid, s);
    case 4: return launch<4>(p, n, sink, grid, s);
    case 8: return launch<8>(p, n, sink, grid, s);
    default: return hk::set_invalid("requirement unroll in {1, 2, 4, 8}", __FILE__, __LINE__);
  }
}

