// Launch helpers every op shares: the dynamic shared-memory opt-in and the occupancy query.
#pragma once

#include <cstdlib>
#include <type_traits>

#include "hipkern/error.h"

namespace hk {

// The most dynamic shared memory a block may opt into on `device`, into *out: asked of the driver once
// per device (devices outside 0..63 ask every time).
inline int max_block_shared(int device, int* out) {
  static int cache[64] = {0};  // 0: not asked yet
  const bool cached = device >= 0 && device < 64;
  int most = cached ? __atomic_load_n(&cache[device], __ATOMIC_RELAXED) : 0;
  if (most == 0) {
    HK_CHECK(hipDeviceGetAttribute(&most, HK_ATTR_MAX_BLOCK_SHARED, device));
    if (cached && most > 0) __atomic_store_n(&cache[device], most, __ATOMIC_RELAXED);
  }
  *out = most;
  return 0;
}

// A kernel's shared memory, its static __shared__ and `smem_bytes` of dynamic, is checked against the
// device's limit and, above the default 48 KB, the dynamic part opted into: once per kernel and device
// (a kernel's dynamic size is fixed), `raised` being the kernel's own set of devices done (devices >= 64
// check every time). (HIP's launch checks the dynamic part alone: a static part that pushes the total past
// the LDS would fail there without this error.)
template <typename Kernel>
int allow_shared(Kernel kernel, unsigned long long& raised, int smem_bytes, int device) {
  const unsigned long long bit = device < 64 ? 1ull << device : 0;
  if (__atomic_load_n(&raised, __ATOMIC_RELAXED) & bit) return 0;
  hipFuncAttributes attr;
  HK_CHECK(hipFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel)));
  const int64_t total = (int64_t)smem_bytes + (int64_t)attr.sharedSizeBytes;
  if (total > 48 * 1024) {
    int most = 0;
    HK_TRY(max_block_shared(device, &most));
    if (total > most)
      return set_invalid("this kernel's shared memory per block (static and dynamic) exceeds the device's (choose "
                         "another variant or tile size)", __FILE__, __LINE__);
    HK_CHECK(hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), hipFuncAttributeMaxDynamicSharedMemorySize,
                                 smem_bytes));
  }
  __atomic_fetch_or(&raised, bit, __ATOMIC_RELAXED);
  return 0;
}

// Whether `blocks` blocks of `threads` threads make a grid the platform runs by its total: on HIP fewer than
// 2^32 threads (HIP runs a larger grid, each dimension within its limit, wrongly and reports no error);
// CUDA's limits are per dimension only.
inline bool threads_fit(int64_t blocks, int threads) {
#if defined(HK_PLATFORM_HIP)
  return blocks * threads < (int64_t(1) << 32);
#else
  (void)blocks, (void)threads;
  return true;
#endif
}

// A grid that grows with the work (a block per block of rows) is launched in pieces of at most this many
// blocks, each over its own rows: 2^16 blocks of up to 1024 threads stay far under HIP's 2^32 threads
// (threads_fit), and each piece still fills the largest GPUs many times over.
constexpr int64_t kMaxLaunchBlocks = int64_t(1) << 16;

// `rows` rows at `rows_per_block` a block, launched in pieces of at most kMaxLaunchBlocks blocks:
// piece(first_row, piece_rows, blocks) launches one (and returns 0 or an error code). The caller offsets
// its pointers by first_row, so the kernel indexes rows from 0 (fewer than 2^24 a piece at <= 256 rows a block).
template <typename Piece>
int launch_rows_in_pieces(int64_t rows, int64_t rows_per_block, Piece piece) {
  const int64_t per_piece = kMaxLaunchBlocks * rows_per_block;
  for (int64_t r0 = 0; r0 < rows; r0 += per_piece) {
    const int64_t n = rows - r0 < per_piece ? rows - r0 : per_piece;
    HK_TRY(piece(r0, n, (unsigned)((n + rows_per_block - 1) / rows_per_block)));
  }
  return 0;
}

// How many blocks of `kernel` fit on one SM/CU at once, into *out.
template <typename Kernel>
int resident_blocks(Kernel kernel, unsigned long long& raised, int threads, int smem_bytes, int device, int* out) {
  HK_TRY(allow_shared(kernel, raised, smem_bytes, device));
  HK_CHECK(hipOccupancyMaxActiveBlocksPerMultiprocessor(out, kernel, threads, smem_bytes));
  return 0;
}

#if defined(HK_PLATFORM_CUDA)
// A cudaLaunchKernelEx configuration with n attributes (attrs, which must outlive it).
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, unsigned smem, hipStream_t stream,
                                        cudaLaunchAttribute* attrs, unsigned n) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cfg;
}

// The attribute of clusters of cluster.x x cluster.y x cluster.z consecutive blocks.
inline cudaLaunchAttribute cluster_attr(dim3 cluster) {
  cudaLaunchAttribute a;
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = cluster.x;
  a.val.clusterDim.y = cluster.y;
  a.val.clusterDim.z = cluster.z;
  return a;
}
#endif

inline bool is_cluster(dim3 c) { return c.x * c.y * c.z > 1; }

// Launch `kernel` after the work before it in `stream`, allowed to start early where the build has
// programmatic dependent launch (CUDA builds for sm_90 on, which the JIT marks with -DHK_PDL=1: the kernel
// must call griddep_wait() before it reads what the previous kernel writes); a plain launch elsewhere. An
// sm_80 build running on an sm_90 GPU through its PTX compiles griddep_wait() to nothing, so it must not
// start early there. `cluster` > 1 block: in clusters of that shape
// (kClusters builds only; hipErrorNotSupported elsewhere). Returns the launch's error.
// HIPKERN_NO_PDL set (to any value) in the environment turns the early start off (a plain launch), for comparisons.
template <typename... Params, typename... Args>
hipError_t launch_dependent_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, unsigned smem,
                                     hipStream_t stream, dim3 cluster, Args... args) {
#if defined(HK_PLATFORM_CUDA)
  if (is_cluster(cluster) && !kClusters) return hipErrorNotSupported;
#if defined(HK_PDL)
  static const bool off = getenv("HIPKERN_NO_PDL") != nullptr;  // diagnostic: plain launches, to compare
#else
  constexpr bool off = true;  // the kernels' griddep_wait() is compiled out (sm_80 / 89 device code)
#endif
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = off ? 0 : 1;
  if (is_cluster(cluster)) attrs[1] = cluster_attr(cluster);
  const cudaLaunchConfig_t cfg = launch_config(grid, block, smem, stream, attrs, is_cluster(cluster) ? 2 : 1);
  return cudaLaunchKernelEx(&cfg, kernel, args...);
#else
  if (is_cluster(cluster)) return hipErrorNotSupported;
  hipLaunchKernelGGL(kernel, grid, block, smem, stream, args...);
  return hipGetLastError();
#endif
}

// Launch `kernel` with every block of the grid resident at once, or fail (a cooperative launch), for a
// grid whose blocks wait for each other: under a plain launch, a kernel on another stream holding part
// of the GPU leaves some blocks unscheduled while the resident ones spin on them, for ever. The grid
// may not exceed the blocks the device holds at once (resident_blocks x SMs).
template <typename... Params, typename... Args>
hipError_t launch_cooperative(void (*kernel)(Params...), dim3 grid, dim3 block, unsigned smem, hipStream_t stream,
                              Args... args) {
#if defined(HK_PLATFORM_CUDA)
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  const cudaLaunchConfig_t cfg = launch_config(grid, block, smem, stream, &attr, 1);
  return cudaLaunchKernelEx(&cfg, kernel, args...);
#else
  static_assert((std::is_same_v<Params, std::decay_t<Args>> && ...),
                "each argument of its parameter's type (the runtime copies the parameters' bytes from them)");
  void* params[] = {static_cast<void*>(&args)...};
  return hipLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), grid, block, params, smem, stream);
#endif
}

template <typename... Params, typename... Args>
hipError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, unsigned smem, hipStream_t stream,
                            Args... args) {
  return launch_dependent_clusters(kernel, grid, block, smem, stream, dim3(1, 1, 1), args...);
}

// Clusters (kClusters builds only; hipErrorNotSupported elsewhere): launch `kernel` with its blocks
// in clusters of `cluster` consecutive blocks (each grid dimension a multiple of the cluster's), and
// how many such clusters of it (block threads, smem bytes) can be resident on the device at once.
template <typename... Params, typename... Args>
hipError_t launch_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, unsigned smem, hipStream_t stream,
                           dim3 cluster, Args... args) {
#if defined(HK_PLATFORM_CUDA)
  if (kClusters) {
    cudaLaunchAttribute attr = cluster_attr(cluster);
    const cudaLaunchConfig_t cfg = launch_config(grid, block, smem, stream, &attr, 1);
    return cudaLaunchKernelEx(&cfg, kernel, args...);
  }
#endif
  (void)kernel, (void)grid, (void)block, (void)smem, (void)stream, (void)cluster;
  return hipErrorNotSupported;
}

template <typename Kernel>
int max_clusters(Kernel kernel, int threads, int smem, dim3 cluster, int* out) {
  *out = 0;
#if defined(HK_PLATFORM_CUDA)
  if (kClusters) {
    cudaLaunchAttribute attr = cluster_attr(cluster);
    const cudaLaunchConfig_t cfg = launch_config(cluster, dim3((unsigned)threads), (unsigned)smem, nullptr, &attr, 1);
    HK_CHECK(cudaOccupancyMaxActiveClusters(out, reinterpret_cast<const void*>(kernel), &cfg));
  }
#endif
  (void)kernel, (void)threads, (void)smem, (void)cluster;
  return 0;
}

}  // namespace hk
