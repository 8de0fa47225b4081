// Launch helpers every op shares: the dynamic shared-memory opt-in and the occupancy query.
#pragma once

#include <cstdlib>

#include "hipkern/error.h"

namespace hk {

// Dynamic shared memory above the default 48 KB is checked against the device's limit and opted
// into, once per kernel and device: `raised` is the kernel's own set of devices done (devices >= 64
// check every time).
template <typename Kernel>
int allow_shared(Kernel kernel, unsigned long long& raised, int smem_bytes, int device) {
  const unsigned long long bit = device < 64 ? 1ull << device : 0;
  if (smem_bytes <= 48 * 1024 || (__atomic_load_n(&raised, __ATOMIC_RELAXED) & bit)) return 0;
  int most = 0;
  HK_CHECK(hipDeviceGetAttribute(&most, HK_ATTR_MAX_BLOCK_SHARED, device));
  if (smem_bytes > most)
    return set_invalid("this kernel's shared memory per block exceeds the device's (choose another variant or "
                       "tile size)", __FILE__, __LINE__);
  HK_CHECK(hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), hipFuncAttributeMaxDynamicSharedMemorySize,
                               smem_bytes));
  __atomic_fetch_or(&raised, bit, __ATOMIC_RELAXED);
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
// A cudaLaunchKernelEx configuration with one attribute (*attr, which must outlive it).
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, unsigned smem, hipStream_t stream,
                                        cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// The attribute of clusters of cluster_z consecutive blocks along z.
inline cudaLaunchAttribute cluster_attr(unsigned cluster_z) {
  cudaLaunchAttribute a;
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = 1;
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = cluster_z;
  return a;
}
#endif

// Launch `kernel` after the work before it in `stream`, allowed to start early where the target has
// programmatic dependent launch (CUDA, sm_90: the kernel must call griddep_wait() before it reads what
// the previous kernel writes); a plain launch elsewhere. Returns the launch's error.
// HIPKERN_NO_PDL=1 in the environment turns the early start off (a plain launch), for comparisons.
template <typename... Params, typename... Args>
hipError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, unsigned smem, hipStream_t stream,
                            Args... args) {
#if defined(HK_PLATFORM_CUDA)
  static const bool off = getenv("HIPKERN_NO_PDL") != nullptr;  // diagnostic: plain launches, to compare
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = off ? 0 : 1;
  const cudaLaunchConfig_t cfg = launch_config(grid, block, smem, stream, &attr);
  return cudaLaunchKernelEx(&cfg, kernel, args...);
#else
  hipLaunchKernelGGL(kernel, grid, block, smem, stream, args...);
  return hipGetLastError();
#endif
}

// Clusters (kClusters builds only; hipErrorNotSupported elsewhere): launch `kernel` with its blocks
// in clusters of cluster_z consecutive blocks along z (grid.z a multiple of it), and how many such
// clusters of it (block threads, smem bytes) can be resident on the device at once.
template <typename... Params, typename... Args>
hipError_t launch_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, unsigned smem, hipStream_t stream,
                           unsigned cluster_z, Args... args) {
#if defined(HK_PLATFORM_CUDA)
  if (kClusters) {
    cudaLaunchAttribute attr = cluster_attr(cluster_z);
    const cudaLaunchConfig_t cfg = launch_config(grid, block, smem, stream, &attr);
    return cudaLaunchKernelEx(&cfg, kernel, args...);
  }
#endif
  (void)kernel, (void)grid, (void)block, (void)smem, (void)stream, (void)cluster_z;
  return hipErrorNotSupported;
}

template <typename Kernel>
int max_clusters(Kernel kernel, int threads, int smem, unsigned cluster_z, int* out) {
  *out = 0;
#if defined(HK_PLATFORM_CUDA)
  if (kClusters) {
    cudaLaunchAttribute attr = cluster_attr(cluster_z);
    const cudaLaunchConfig_t cfg =
        launch_config(dim3(1, 1, cluster_z), dim3((unsigned)threads), (unsigned)smem, nullptr, &attr);
    HK_CHECK(cudaOccupancyMaxActiveClusters(out, reinterpret_cast<const void*>(kernel), &cfg));
  }
#endif
  (void)kernel, (void)threads, (void)smem, (void)cluster_z;
  return 0;
}

}  // namespace hk
