// Warpgroup matrix multiply-accumulate (wgmma, sm_90a) with B (and A, or A from registers) in shared
// memory, for fp16/bf16 inputs and fp32 accumulators:
//
//   kWgmma                      whether this build has it (the JIT builds sm_90 as sm_90a and says so
//                               with -DHK_WGMMA=1); elsewhere false: the helpers are no-ops and
//                               Wgmma has no specialisations, so only code that is never
//                               instantiated there may name them
//   Wgmma<T, N>::mma(d, a, b)   d[N / 2] += A[64 x 16] B[16 x N] for the calling warpgroup (4 warps,
//                               128 threads); a, b: descriptors of K-major operands in shared memory
//   Wgmma<T, N>::mma_rt(d, a, b)  the same with A from registers (a[4]: mma.sync's m16n8k16 A fragment
//                               of the warp's 16 rows, mma.h) and B MN-major (b: a descriptor with lbo)
//   Wgmma<T, N>::mma_rk(d, a, b, add)  A from registers, B K-major (b as for mma); add = 0: d = A B
//                               (d's values unread: the first product of a fresh accumulator)
//   Wgmma<T, N>::mma_t(d, a, b)   A K-major in shared memory (a as for mma), B MN-major (b as for mma_rt)
//   Sw128<T, K>                 rows of K elements in 128-byte-swizzled atoms: 8 rows x 128 bytes
//                               (1024 B, 1024-byte aligned), the 16-byte chunk c of row r stored at
//                               chunk c ^ (r % 8), a row group's K / 64 (16-bit) atoms adjacent;
//                               at(r, c): element offset of chunk c of row r; k16(s): of k step s of
//                               row 0; kSbo: bytes between 8-row groups; kLbo: bytes between the
//                               atoms of one row group (adjacent), an MN-major operand's lbo
//   wgmma_desc_sw128(p, sbo, lbo)  the descriptor of an operand in such atoms: p the first row's
//                               address (K-major: + k16(s) per k step), sbo the bytes between 8-row
//                               groups; MN-major operands (rows along K, 64 elements of M or N per
//                               atom) also lbo, the bytes between atoms along M / N
//   wgmma_desc_add(desc, bytes)   the same operand `bytes` further on (a k step: k16(s) elements)
//   wgmma_fence() / wgmma_commit() / wgmma_wait<N>()   around a batch of mma (the accumulators are
//                               not touched between the fence and the wait)
//   fence_async_shared()        orders the shared-memory writes this thread has made or observed
//                               (stores, cp.async) before wgmma's reads (the async proxy): by the
//                               writer before a barrier, or by the reader after it waited for them
//                               (fused_moe's per-stage mbarriers)
//
// d's layout is mma.sync's C layout per warp (mma.h, NVIDIA): warp w of the warpgroup holds rows 16w
// + lane / 4 (+ 8) and, per 8-column tile j, elements d[4j .. 4j + 3] at columns 8j + 2 (lane % 4) (+ 1).
#pragma once

#include <type_traits>

#include "hipkern/dtype.h"
#include "hipkern/platform.h"

namespace hk {

#if defined(HK_WGMMA) && defined(HK_PLATFORM_CUDA)
constexpr bool kWgmma = true;
#if defined(__CUDA_ARCH__)
#define HK_WG_ASM(...) asm volatile(__VA_ARGS__)
#else
#define HK_WG_ASM(...) (void)0
#endif
#else
constexpr bool kWgmma = false;
#define HK_WG_ASM(...) (void)0
#endif

// The helpers exist on every target (so that code naming them compiles everywhere); they do
// something only where kWgmma.
HK_DEVICE uint64_t wgmma_desc_sw128(const void* p, uint32_t sbo, uint32_t lbo = 16) {
#if defined(HK_WGMMA) && defined(HK_PLATFORM_CUDA)
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
         ((uint64_t)1 << 62);
#else
  (void)p, (void)sbo, (void)lbo;
  return 0;
#endif
}

// The descriptor of the operand `bytes` (a multiple of 16) further on: the start-address field is the
// shared address / 16 in the low 14 bits and shared memory ends below 256 KB, so the advance adds to it
// without a carry. A descriptor made once and advanced per k step costs an add where a new one costs
// the address conversion and its masks (sm_90a: ~5 instructions per operand and step).
HK_DEVICE constexpr uint64_t wgmma_desc_add(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

template <typename T, int K>
struct Sw128 {
  static constexpr int kVec = 16 / (int)sizeof(T), kAtomK = 128 / (int)sizeof(T), kAtoms = K / kAtomK;
  static constexpr int kSbo = kAtoms * 1024, kLbo = 1024;
  static_assert(K % kAtomK == 0, "whole 128-byte atoms per row");
  static HK_DEVICE constexpr int at(int r, int c) {
    return ((r / 8 * kAtoms + c / 8) * 8 + r % 8) * kAtomK + (c % 8 ^ r % 8) * kVec;
  }
  static HK_DEVICE constexpr int k16(int s) { return s * 16 / kAtomK * 8 * kAtomK + s * 16 % kAtomK; }
};
HK_DEVICE void wgmma_fence() { HK_WG_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
HK_DEVICE void wgmma_commit() { HK_WG_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
HK_DEVICE void wgmma_wait() { HK_WG_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
HK_DEVICE void fence_async_shared() { HK_WG_ASM("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <typename T, int N> struct Wgmma;  // specialised below where kWgmma

#if defined(HK_WGMMA) && defined(HK_PLATFORM_CUDA)
// One m64nNk16 shape for both input types: P and AB are the operand numbers of scale-d and of the
// two descriptors, REGS the N / 2 accumulators' operand numbers, the rest the accumulators.
// The _RS operand numbers are those of the form with A in registers (four registers, then B).
#define HK_WGMMA_TEXT(N, PT, P, AB, REGS, IMM)                                                         \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT "." PT \
  " {" REGS "}, " AB ", p, 1, 1, " IMM ";\n}\n"
#define HK_WGMMA_SHAPE(N, P, AB, P_RS, AB_RS, REGS, ...)                                                \
  template <typename T>                                                                                \
  struct Wgmma<T, N> {                                                                                 \
    static_assert(std::is_same<T, bf16_t>::value || std::is_same<T, half_t>::value, "fp16 or bf16");   \
    static HK_DEVICE void mma(float (&d)[N / 2], uint64_t a, uint64_t b) {                             \
      if constexpr (std::is_same<T, bf16_t>::value)                                                    \
        HK_WG_ASM(HK_WGMMA_TEXT(N, "bf16", P, AB, REGS, "0, 0") : __VA_ARGS__ : "l"(a), "l"(b), "r"(1)); \
      else                                                                                             \
        HK_WG_ASM(HK_WGMMA_TEXT(N, "f16", P, AB, REGS, "0, 0") : __VA_ARGS__ : "l"(a), "l"(b), "r"(1));  \
    }                                                                                                  \
    static HK_DEVICE void mma_t(float (&d)[N / 2], uint64_t a, uint64_t b) {                           \
      if constexpr (std::is_same<T, bf16_t>::value)                                                    \
        HK_WG_ASM(HK_WGMMA_TEXT(N, "bf16", P, AB, REGS, "0, 1") : __VA_ARGS__ : "l"(a), "l"(b), "r"(1)); \
      else                                                                                             \
        HK_WG_ASM(HK_WGMMA_TEXT(N, "f16", P, AB, REGS, "0, 1") : __VA_ARGS__ : "l"(a), "l"(b), "r"(1));  \
    }                                                                                                  \
    static HK_DEVICE void mma_rt(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {              \
      if constexpr (std::is_same<T, bf16_t>::value)                                                    \
        HK_WG_ASM(HK_WGMMA_TEXT(N, "bf16", P_RS, AB_RS, REGS, "1")                                     \
                  : __VA_ARGS__ : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));         \
      else                                                                                             \
        HK_WG_ASM(HK_WGMMA_TEXT(N, "f16", P_RS, AB_RS, REGS, "1")                                      \
                  : __VA_ARGS__ : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));         \
    }                                                                                                  \
    static HK_DEVICE void mma_rk(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, int add = 1) { \
      if constexpr (std::is_same<T, bf16_t>::value)                                                    \
        HK_WG_ASM(HK_WGMMA_TEXT(N, "bf16", P_RS, AB_RS, REGS, "0")                                     \
                  : __VA_ARGS__ : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(add));       \
      else                                                                                             \
        HK_WG_ASM(HK_WGMMA_TEXT(N, "f16", P_RS, AB_RS, REGS, "0")                                      \
                  : __VA_ARGS__ : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(add));       \
    }                                                                                                  \
  };
HK_WGMMA_SHAPE(8, "%6", "%4, %5", "%9", "{%4, %5, %6, %7}, %8",
              "%0,%1,%2,%3",
                "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]))
HK_WGMMA_SHAPE(16, "%10", "%8, %9", "%13", "{%8, %9, %10, %11}, %12",
              "%0,%1,%2,%3,%4,%5,%6,%7",
                "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]))
HK_WGMMA_SHAPE(32, "%18", "%16, %17", "%21", "{%16, %17, %18, %19}, %20",
              "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15",
                "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]))
HK_WGMMA_SHAPE(64, "%34", "%32, %33", "%37", "{%32, %33, %34, %35}, %36",
              "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15, "
              "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31",
                "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]))
HK_WGMMA_SHAPE(128, "%66", "%64, %65", "%69", "{%64, %65, %66, %67}, %68",
              "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15, "
              "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31, "
              "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47, "
              "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63",
                "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]))
#undef HK_WGMMA_SHAPE
#undef HK_WGMMA_TEXT
#endif  // HK_WGMMA
#undef HK_WG_ASM

}  // namespace hk
