// hipkern portability layer: kernels are written in HIP; this header maps what they use onto CUDA
// when compiled by nvcc. Every target-specific #if of the project lives in this directory.
//
//   HK_WAVE_SIZE   lanes per wave/warp: a compile-time constant set per target by the JIT builder
//                  (64 on CDNA gfx9xx, 32 on NVIDIA and RDNA). Kernels never write 32 or 64.
//   hk::lanemask_t 64-bit on HIP, 32-bit on CUDA (the ballot result type).
//   HK_EXPORT      marks the extern "C" launchers a module exports (all else is hidden).
#pragma once

#include <stdint.h>

#if defined(__HIPCC__) || defined(__HIP__)
#define HK_PLATFORM_HIP 1
#include <hip/hip_runtime.h>
#elif defined(__CUDACC__)
#define HK_PLATFORM_CUDA 1
#include <cuda_runtime.h>
#else
#error "hipkern kernels are compiled by a HIP compiler or by nvcc"
#endif

#ifndef HK_WAVE_SIZE
#error "HK_WAVE_SIZE must be defined by the build (the JIT builder sets it per target)"
#endif

// The target's wave size against the build's. Newer clangs deprecate the macros (generic targets choose it late):
// without them, GFX9 (CDNA, gfx942) has 64-lane waves only.
#if defined(HK_PLATFORM_HIP) && defined(__HIP_DEVICE_COMPILE__)
#if defined(__AMDGCN_WAVEFRONT_SIZE)
static_assert(__AMDGCN_WAVEFRONT_SIZE == HK_WAVE_SIZE, "HK_WAVE_SIZE disagrees with the target");
#elif defined(__AMDGCN_WAVEFRONT_SIZE__)
static_assert(__AMDGCN_WAVEFRONT_SIZE__ == HK_WAVE_SIZE, "HK_WAVE_SIZE disagrees with the target");
#elif defined(__GFX9__)
static_assert(HK_WAVE_SIZE == 64, "HK_WAVE_SIZE disagrees with the target (GFX9 waves have 64 lanes)");
#endif
#endif

#define HK_EXPORT extern "C" __attribute__((visibility("default")))

// __launch_bounds__ with a minimum of resident blocks per SM on CUDA (it caps registers there). On
// HIP the second argument means minimum waves per EU, a different promise: only the first is kept.
#if defined(HK_PLATFORM_CUDA)
#define HK_LAUNCH_BOUNDS(threads, min_blocks_per_sm) __launch_bounds__(threads, min_blocks_per_sm)
#else
#define HK_LAUNCH_BOUNDS(threads, min_blocks_per_sm) __launch_bounds__(threads)
#endif
#define HK_DEVICE __device__ __forceinline__
#define HK_HOST_DEVICE __host__ __device__ __forceinline__

// ---------------------------------------------------------------------------------------------
// CUDA spelling of the HIP runtime API used by hipkern modules.
// ---------------------------------------------------------------------------------------------
#if defined(HK_PLATFORM_CUDA)
typedef cudaError_t hipError_t;
typedef cudaStream_t hipStream_t;
#define hipSuccess cudaSuccess
#define hipErrorInvalidValue cudaErrorInvalidValue
#define hipErrorNotSupported cudaErrorNotSupported
#define hipGetLastError cudaGetLastError
#define hipPeekAtLastError cudaPeekAtLastError
#define hipGetErrorName cudaGetErrorName
#define hipGetErrorString cudaGetErrorString
#define hipGetDevice cudaGetDevice
#define hipSetDevice cudaSetDevice
#define hipMalloc cudaMalloc
#define hipFree cudaFree
#define hipMemsetAsync cudaMemsetAsync
#define hipFuncSetAttribute(f, a, v) cudaFuncSetAttribute(f, a, v)
#define hipFuncGetAttributes(attr, f) cudaFuncGetAttributes(attr, f)
#define hipFuncAttributes cudaFuncAttributes
#define hipFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define hipOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define hipDeviceGetAttribute cudaDeviceGetAttribute
#define hipDeviceAttributeMultiprocessorCount cudaDevAttrMultiProcessorCount
#define HIP_KERNEL_NAME(...) __VA_ARGS__
#define hipLaunchKernelGGL(kernel, grid, block, shmem, stream, ...) \
  kernel<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__)
#endif

// The device attribute: the most dynamic shared memory (LDS) one block may use (opt-in on CUDA).
#if defined(HK_PLATFORM_CUDA)
#define HK_ATTR_MAX_BLOCK_SHARED cudaDevAttrMaxSharedMemoryPerBlockOptin
#else
#define HK_ATTR_MAX_BLOCK_SHARED hipDeviceAttributeMaxSharedMemoryPerBlock
#endif

namespace hk {

constexpr int kWaveSize = HK_WAVE_SIZE;

#if defined(HK_PLATFORM_HIP)
typedef uint64_t lanemask_t;
#else
typedef uint32_t lanemask_t;
constexpr lanemask_t kFullMask = 0xffffffffu;
#endif

HK_DEVICE int lane_id() { return threadIdx.x % kWaveSize; }

// The shared-memory address of a generic pointer into shared memory (PTX's 32-bit shared window).
#if defined(HK_PLATFORM_CUDA)
HK_DEVICE unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
#endif

// Butterfly shuffle inside a wave. `width` (a power of two <= kWaveSize) limits the exchange to
// aligned groups of that many lanes. All lanes of the wave must call it (converged).
template <typename T>
HK_DEVICE T shfl_xor(T v, int lane_mask, int width = kWaveSize) {
#if defined(HK_PLATFORM_HIP)
  return __shfl_xor(v, lane_mask, width);
#else
  return __shfl_xor_sync(kFullMask, v, lane_mask, width);
#endif
}

template <typename T>
HK_DEVICE T shfl(T v, int src_lane, int width = kWaveSize) {
#if defined(HK_PLATFORM_HIP)
  return __shfl(v, src_lane, width);
#else
  return __shfl_sync(kFullMask, v, src_lane, width);
#endif
}

// 2^x in one hardware instruction (ex2.approx.ftz on NVIDIA, v_exp_f32 on AMD): ~2 ulp, results
// below 2^-126 flushed to 0. exp2f() adds a range reduction around it (5-6 more instructions) to
// keep those denormals, which a softmax weight never needs.
HK_DEVICE float fast_exp2(float x) {
#if defined(HK_PLATFORM_HIP)
  return __builtin_amdgcn_exp2f(x);
#elif defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// A short pause in a spin-wait loop, so that waiting blocks leave the memory system to the rest.
HK_DEVICE void spin_pause() {
#if defined(HK_PLATFORM_HIP)
  __builtin_amdgcn_s_sleep(2);
#elif defined(__CUDA_ARCH__)
  __nanosleep(64);
#endif
}

// Wait until *flag >= target (one thread: callers share the result through a barrier); acquire:
// what was written before the matching release is visible after.
HK_DEVICE void spin_until_at_least(const int* flag, int target) {
  while (*reinterpret_cast<const volatile int*>(flag) < target) spin_pause();
  __threadfence();
}

// Every thread, after its stores of what the block then publishes (a barrier, then one thread's fence and
// atomic): on CUDA that thread's fence is cumulative through the barrier, so nothing is needed here; on
// CDNA a barrier does not wait for the other waves' stores (s_barrier waits for LDS counters only) and a
// fence orders only its own wave's, so every wave fences its own stores first.
HK_DEVICE void fence_before_publish() {
#if !(defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__))
  __threadfence();
#endif
}

// Every thread of a block, once its stores of what the block publishes are issued: counts the block's
// arrival on *counter and tells every thread whether it was the n-th, the last (through *slot, shared
// memory). A release of the block's stores; for the last, an acquire of what the others released, so
// that it may read it (load_coherent4). On sm_90: a barrier, then one acq_rel atomic by thread 0 (its
// release is cumulative through the barrier); __threadfence() on every wave before the count and, on
// the last, after it had made fused_moe's split-K tail ~0.5 us longer (fused_moe NOTES, 2026-11-27
// (5)). Elsewhere those fences, as before.
HK_DEVICE bool block_arrive_last(int* counter, int n, int* slot) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__)
  __syncthreads();
  if (threadIdx.x == 0) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    *slot = old == n - 1;
  }
  __syncthreads();
  return *slot;
#else
  fence_before_publish();
  __syncthreads();
  if (threadIdx.x == 0) *slot = atomicAdd(counter, 1) == n - 1;
  __syncthreads();
  if (!*slot) return false;
  __threadfence();
  return true;
#endif
}

// 16 bytes (a float4, 16-byte aligned) that other blocks of this grid wrote and published (their
// release, then an atomic this block observed with acquire: block_arrive_last), read where the device
// is coherent (L2), never from a line this SM's L1 may hold. On CDNA four relaxed agent-scope atomic loads
// (gfx942: global_load_dword sc1, all in flight at once); the volatile loads they replace were each
// followed by a wait for all of the wave's loads (s_waitcnt vmcnt(0)), so a thread's loads ran in series.
HK_DEVICE float4 load_coherent4(const float* p) {
#if defined(HK_PLATFORM_CUDA)
  return __ldcg(reinterpret_cast<const float4*>(p));
#else
  return make_float4(__hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT),
                     __hip_atomic_load(p + 1, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT),
                     __hip_atomic_load(p + 2, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT),
                     __hip_atomic_load(p + 3, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT));
#endif
}

// Orders memory among the lanes of one wave (shared-memory handoff inside a wave).
HK_DEVICE void wave_sync() {
#if defined(HK_PLATFORM_HIP)
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#else
  __syncwarp();
#endif
}

// 16-byte global -> shared copies that complete asynchronously where the target has them (cp.async
// on sm_80+): issue, do other work, then async_copy_wait() (this thread's copies) and a barrier
// before other threads read them. kAsyncCopy says whether they really overlap.
#if defined(HK_PLATFORM_CUDA) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
constexpr bool kAsyncCopy = true;
#else
constexpr bool kAsyncCopy = false;
#endif

HK_DEVICE void async_copy16(void* smem, const void* gmem) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
  *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}

// As async_copy16, but when `valid` is false the 16 shared bytes are zeroed and gmem is not read.
HK_DEVICE void async_copy16_or_zero(void* smem, const void* gmem, bool valid) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
#else
  *reinterpret_cast<uint4*>(smem) = valid ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
#endif
}

// A 4-byte copy the same way (a float beside the 16-byte chunks of a stage).
HK_DEVICE void async_copy4(void* smem, const void* gmem) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
#else
  *reinterpret_cast<uint32_t*>(smem) = *reinterpret_cast<const uint32_t*>(gmem);
#endif
}

HK_DEVICE void async_copy_wait() {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Pipelines: async_copy_commit() closes this thread's group of copies issued since the last one;
// async_copy_wait_pending<N>() waits until at most N of its groups are still in flight.
HK_DEVICE void async_copy_commit() {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
HK_DEVICE void async_copy_wait_pending() {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Ask L2 for the kBytes (a multiple of 128) at gmem ahead of a later read, without waiting or taking
// registers: prefetch.global.L2 of the line holding each gmem + 128 i on NVIDIA (exactly those bytes
// where gmem is 128-byte aligned; a hint, so an unaligned row only misses its tail), nothing
// elsewhere. Every such address must lie in the allocation. More DRAM requests in flight than the
// shared memory of a copy pipeline holds.
template <int kBytes>
HK_DEVICE void prefetch_l2(const void* gmem) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__)
#pragma unroll
  for (int i = 0; i < kBytes; i += 128)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(static_cast<const char*>(gmem) + i));
#else
  (void)gmem;
#endif
}

// Drop the 128-byte line at gmem (128-byte aligned, inside a scratch allocation) from L2 without
// writing it back: discard.global.L2 on NVIDIA (sm_80 on), nothing elsewhere. The line's contents are
// undefined until it is written again, so only for data no one reads again before rewriting it (a
// workspace consumed once), and only after every thread that reads the line has used what it read
// (a barrier between). Dirty scratch lines otherwise go back to DRAM when the next kernel's traffic
// evicts them, and that kernel pays for the writes.
HK_DEVICE void discard_l2(const void* gmem) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(gmem) : "memory");
#else
  (void)gmem;
#endif
}

// A 16-byte global load of data read once (expert weights streamed past): on NVIDIA it bypasses
// L1 (`ld.global.nc.L1::no_allocate`), leaving L1 to the data that is read again; elsewhere a
// plain load. p must be 16-byte aligned and the memory unchanged while the kernel runs.
HK_DEVICE uint4 load_once16(const void* p) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__)
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}

// The device's nanosecond clock, comparable across blocks (%globaltimer; NVIDIA only, 0 elsewhere):
// the timestamps of the timeline diagnostics (fused_moe's HK_MOE_TRACE, paged attention's HK_PA_TRACE).
HK_DEVICE unsigned long long globaltimer() {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__)
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return 0;
#endif
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere): a kernel launched by launch_dependent()
// (launch.h) may start while the kernel before it in the stream still runs; griddep_wait() blocks
// until that kernel has finished and its writes are visible. A kernel may call
// griddep_launch_dependents() to let the next one start before it ends.
HK_DEVICE void griddep_wait() {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
HK_DEVICE void griddep_launch_dependents() {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Thread-block clusters (sm_90a builds, which the JIT marks with -DHK_WGMMA=1; every compute-
// capability-9.0 GPU runs them): the blocks of a cluster are resident at once on one GPC and read
// each other's shared memory. kClusters says whether the build has them; elsewhere no launcher forms
// a cluster and these compile to nothing.
#if defined(HK_PLATFORM_CUDA) && defined(HK_WGMMA)
constexpr bool kClusters = true;
#else
constexpr bool kClusters = false;
#endif
#if defined(HK_PLATFORM_CUDA) && defined(HK_WGMMA) && defined(__CUDA_ARCH__)
#define HK_CLUSTER_DEVICE 1
#endif

// Every thread of every block of the cluster: a barrier that also makes each block's shared-memory
// writes before it visible to the others' reads after it.
HK_DEVICE void cluster_sync() {
#if defined(HK_CLUSTER_DEVICE)
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The same barrier without the memory ordering (no fence: cluster_sync's release costs a GPU-scope
// memory barrier, which waits for every earlier global store): for "no block leaves while another
// still reads its shared memory", once every value this thread read from the others has been used.
// Its two halves also stand alone, for work between them: cluster_arrive_relaxed() says "done reading
// the others' shared memory", and the matching cluster_wait() waits until every thread of the cluster
// has said so.
HK_DEVICE void cluster_arrive_relaxed() {
#if defined(HK_CLUSTER_DEVICE)
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
HK_DEVICE void cluster_wait() {
#if defined(HK_CLUSTER_DEVICE)
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#endif
}
HK_DEVICE void cluster_sync_relaxed() {
  cluster_arrive_relaxed();
  cluster_wait();
}

// The address of this block's shared-memory location p in the block of cluster rank `rank`, for
// cluster_load / cluster_load2 / cluster_load4 (p 4- / 8- / 16-byte aligned).
HK_DEVICE uint32_t cluster_map(const void* p, int rank) {
  uint32_t r = 0;
#if defined(HK_CLUSTER_DEVICE)
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
#else
  (void)p, (void)rank;
#endif
  return r;
}
HK_DEVICE float cluster_load(uint32_t a) {
  float v = 0.f;
#if defined(HK_CLUSTER_DEVICE)
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(a));
#else
  (void)a;
#endif
  return v;
}
HK_DEVICE float2 cluster_load2(uint32_t a) {
  float2 v = make_float2(0.f, 0.f);
#if defined(HK_CLUSTER_DEVICE)
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(a));
#else
  (void)a;
#endif
  return v;
}
HK_DEVICE float4 cluster_load4(uint32_t a) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(HK_CLUSTER_DEVICE)
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
#else
  (void)a;
#endif
  return v;
}

HK_DEVICE lanemask_t ballot(bool pred) {
#if defined(HK_PLATFORM_HIP)
  return __ballot(pred);
#else
  return __ballot_sync(kFullMask, pred);
#endif
}

// Lanes below this one, as a mask; and the number of lanes set in a mask.
HK_DEVICE lanemask_t lanemask_lt() { return ((lanemask_t)1 << lane_id()) - 1; }
HK_DEVICE int popc(lanemask_t m) { return __popcll((unsigned long long)m); }
// The lowest lane set in a mask that is not empty.
HK_DEVICE int lowest_lane(lanemask_t m) { return __ffsll((unsigned long long)m) - 1; }

// Lanes of the wave whose `v` equals this lane's, as a mask (v < 2^bits). All lanes must call it.
// One match.any on NVIDIA (sm_70+); elsewhere one ballot per bit of v.
HK_DEVICE lanemask_t match_any(uint32_t v, int bits) {
#if defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  (void)bits;
  return __match_any_sync(kFullMask, v);
#else
  lanemask_t m = ballot(true);  // the wave's lanes (32 of the 64 bits on a wave32 HIP target)
  for (int b = 0; b < bits; ++b) {
    const bool set = (v >> b) & 1u;
    const lanemask_t on = ballot(set);
    m &= set ? on : ~on;
  }
  return m;
#endif
}

}  // namespace hk
