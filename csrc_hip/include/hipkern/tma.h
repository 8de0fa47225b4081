// Tensor-map bulk copies (the Hopper TMA unit) where the build has wgmma (sm_90a: kTma), for tiles
// that land in 128-byte-swizzled shared memory (Sw128 in hipkern/wgmma.h, one 64-element atom a row):
// one thread copies a whole box of rows, completion counted in bytes on an mbarrier.
//   TensorMap                   the map as a kernel argument holds it (128 opaque bytes, 64-byte
//                               aligned; pass the kernel's argument by __grid_constant__, HK_GRID_CONSTANT)
//   encode_tensor_map(map, base, elem_bytes, rank, dims, strides, box, l2_bytes = 256)   host: a tiled
//                               map of a rank-dimensional array (dims innermost first, element counts;
//                               strides in bytes of dims 1.., multiples of 16), boxes of box[] elements,
//                               the innermost box dimension 128 bytes, 128-byte swizzle, out-of-bounds
//                               elements read as zeros, L2 fills of l2_bytes (0: no promotion, 64, 128
//                               or 256). Returns 0 or an error code (hk_last_error()).
//   mbar_init(bar, count), mbar_init_fence()   one thread, before the barrier's first use, then a
//                               block barrier
//   mbar_expect(bar, bytes)     this thread's arrival, announcing `bytes` of copies to come
//   mbar_wait(bar, parity)      until the barrier's phase of that parity has completed
//   mbar_arrive_copies(bar)     this thread's arrival, made when all its earlier asynchronous copies
//                               (async_copy16 / async_copy4, hipkern/platform.h) have landed; the
//                               barrier's count includes it (noinc)
//   tma_load_3d(dst, map, c0, c1, c2, bar)     the box at coordinates (c0 innermost) into dst
//                               (1024-byte aligned), its bytes counted on bar; every box element
//                               outside the array (negative coordinates too) becomes zero
//   tma_load_5d(dst, map, c0, .., c4, bar)     the same for a rank-5 map
//   tma_prefetch_map(map)       ask for the map's descriptor ahead of the first copy that uses it
//                               (one thread, at the kernel's start: the fetch then overlaps the loads
//                               the first copy waits for, not the copy itself)
//   bulk_store(dst, src, bytes)  `bytes` (a multiple of 16, both addresses 16-byte aligned) of shared
//                               memory to global memory by the TMA unit, in this thread's bulk group; the
//                               threads that wrote src run fence_async_shared() (hipkern/wgmma.h) before a
//                               block barrier that precedes it
//   bulk_store_commit(); bulk_store_wait_read()   close this thread's group; wait until its sources have
//                               been read (then the shared memory may be rewritten or the block leave)
// Elsewhere the device helpers compile to nothing and encode_tensor_map reports "not supported":
// callers keep their copies there (kTma false).
#pragma once

#include "hipkern/error.h"
#include "hipkern/platform.h"
#include "hipkern/wgmma.h"

#if defined(HK_WGMMA) && defined(HK_PLATFORM_CUDA)
#include <cuda.h>  // CUtensorMap and its enums; the encoder comes through the runtime (no libcuda link)
#endif

#if defined(HK_PLATFORM_CUDA)
#define HK_GRID_CONSTANT __grid_constant__
#else
#define HK_GRID_CONSTANT
#endif

#if defined(HK_WGMMA) && defined(HK_PLATFORM_CUDA) && defined(__CUDA_ARCH__)
#define HK_TMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define HK_TMA_ASM(...) (void)0
#endif

namespace hk {

constexpr bool kTma = kWgmma;

struct alignas(64) TensorMap {
  uint64_t v[16];
};

HK_DEVICE void mbar_init(uint64_t* bar, int count) {
  HK_TMA_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
  (void)bar, (void)count;
}
HK_DEVICE void mbar_init_fence() { HK_TMA_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
HK_DEVICE void mbar_expect(uint64_t* bar, uint32_t bytes) {
  HK_TMA_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  (void)bar, (void)bytes;
}
HK_DEVICE void mbar_wait(uint64_t* bar, uint32_t parity) {
  HK_TMA_ASM(
      "{\n.reg .pred done;\nwait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
  (void)bar, (void)parity;
}
HK_DEVICE void mbar_arrive_copies(uint64_t* bar) {
  HK_TMA_ASM("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
  (void)bar;
}
HK_DEVICE void tma_load_3d(void* dst, const TensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  HK_TMA_ASM(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
  (void)dst, (void)map, (void)c0, (void)c1, (void)c2, (void)bar;
}

HK_DEVICE void tma_load_5d(void* dst, const TensorMap* map, int c0, int c1, int c2, int c3, int c4, uint64_t* bar) {
  HK_TMA_ASM(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], "
      "[%7];\n" ::"r"(smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(smem_addr(bar))
      : "memory");
  (void)dst, (void)map, (void)c0, (void)c1, (void)c2, (void)c3, (void)c4, (void)bar;
}

HK_DEVICE void bulk_store(void* dst, const void* src, uint32_t bytes) {
  HK_TMA_ASM("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(smem_addr(src)), "r"(bytes)
             : "memory");
  (void)dst, (void)src, (void)bytes;
}
HK_DEVICE void bulk_store_commit() { HK_TMA_ASM("cp.async.bulk.commit_group;\n" ::: "memory"); }
HK_DEVICE void bulk_store_wait_read() { HK_TMA_ASM("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

HK_DEVICE void tma_prefetch_map(const TensorMap* map) {
  HK_TMA_ASM("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
  (void)map;
}

inline int encode_tensor_map(TensorMap* map, const void* base, int elem_bytes, int rank, const uint64_t* dims,
                             const uint64_t* strides, const uint32_t* box, int l2_bytes = 256) {
#if defined(HK_WGMMA) && defined(HK_PLATFORM_CUDA)
  static_assert(sizeof(TensorMap) == sizeof(CUtensorMap), "an opaque CUtensorMap");
  typedef CUresult (*Encode)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                             const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                             CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (!encode) return set_invalid("tensor maps: the driver has no cuTensorMapEncodeTiled", __FILE__, __LINE__);
  if (rank < 1 || rank > 5 || (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) ||
      box[0] * (uint32_t)elem_bytes != 128 || (l2_bytes != 0 && l2_bytes != 64 && l2_bytes != 128 && l2_bytes != 256))
    return set_invalid("tensor maps: rank 1-5, 1/2/4-byte elements, 128-byte box rows, L2 fills of 0/64/128/256 bytes",
                       __FILE__, __LINE__);
  const CUtensorMapL2promotion promotion = l2_bytes == 0    ? CU_TENSOR_MAP_L2_PROMOTION_NONE
                                           : l2_bytes == 64  ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
                                           : l2_bytes == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                             : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  const CUtensorMapDataType type = elem_bytes == 1   ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : elem_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16
                                                     : CU_TENSOR_MAP_DATA_TYPE_UINT32;
  cuuint64_t d[5], s[4];
  cuuint32_t b[5], e[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    e[i] = 1;
    if (i > 0) s[i - 1] = strides[i - 1];
  }
  const CUresult r = encode(reinterpret_cast<CUtensorMap*>(map), type, (cuuint32_t)rank, const_cast<void*>(base), d, s,
                            b, e, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return set_invalid("tensor maps: cuTensorMapEncodeTiled rejected the array (base 16-byte aligned, strides "
                       "multiples of 16 bytes below 2^40, dimensions at most 2^32)", __FILE__, __LINE__);
  return 0;
#else
  (void)map, (void)base, (void)elem_bytes, (void)rank, (void)dims, (void)strides, (void)box, (void)l2_bytes;
  return set_invalid("tensor maps need an sm_90a build", __FILE__, __LINE__);
#endif
}

}  // namespace hk

#undef HK_TMA_ASM
