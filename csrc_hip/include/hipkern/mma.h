// Matrix-core tiles behind one interface: mma.sync m16n8k16 on NVIDIA (sm_80+) and MFMA 16x16x16 on
// CDNA (gfx90a/gfx94x), for fp16/bf16 inputs with fp32 accumulation, one wave per product.
//
//   MmaTile<T>::M, N, K    the product is C[M x N] += A[M x K] * B[K x N] (M = K = 16; N = 8 / 16)
//   A, B, C                per-lane fragments (C is kC floats)
//   load_a(a, s, ld)       A from shared memory, row-major, row stride ld elements
//   load_b_nk(b, s, ld)    B from shared memory holding B^T row-major ([N][K], k contiguous)
//   load_b_nk2(b0, b1, s, ld)  the same for two adjacent n tiles (rows 0..N-1 and N..2N-1) at once
//   load_b_kn(b, s, ld)    B from shared memory holding B row-major ([K][N], n contiguous)
//   load_b_nk_at(b, row), load_b_kn_at(b, row)   the same two from any layout (NVIDIA only): lane l
//                          (< 16) passes the address of its 8 elements: load_b_nk_at row l % 8 at k
//                          8 * (l / 8); load_b_kn_at row k = l at the tile's first n
//   mma(c, a, b)           c += a * b
//   c_row(i), c_col(i)     where the lane's accumulator element i sits in C
//   row_slot(i)            which of the lane's kRowSlots distinct rows element i belongs to
//   store_c(s, ld, c)      the tile C into shared memory, row-major floats, row stride ld (even)
//   kRowLanes              the aligned group of lanes that together hold one row of C
//   a_from_c(a, c, tmp)    the A operand [M x 16] made of the accumulator tiles c[0 .. 16 / N),
//                          rounded to T (flash attention's P); tmp: M x K elements of this wave's
//                          shared memory, used where the layouts differ (CDNA), unused on NVIDIA.
//   Operands straight from 16-byte loads (no shared-memory staging), the reduction order permuted:
//   over each run of kDirectK = 32 reduction indices the lane's A loads r < kDirectRows hold row
//   direct_row(r) and its B load column direct_col(), all at indices direct_k() .. direct_k() + 7;
//   a_direct / b_direct(x, v, s) give step s (0 or 1) of the run's two 16-deep products. A and B
//   see the same permutation, so C is the plain product (a sum's terms taken in another order).
//   mma_direct_run<MT>(c, x, v)  both steps of a run: c += the run's product.
//
// Shared-memory rows handed to the loads must be 16-byte aligned (ld a multiple of 8 elements).
// On NVIDIA, a row stride of (a multiple of 128 bytes) + 16 bytes keeps ldmatrix free of bank
// conflicts. The CDNA lane layouts are those of the CDNA3 ISA guide; they are built and loaded for
// gfx942 here but have never run on an AMD GPU.
#pragma once

#include "hipkern/dtype.h"
#include "hipkern/vec.h"

namespace hk {

#if defined(HK_PLATFORM_CUDA)

// Two floats rounded to one register of T pairs, the first in the low half.
HK_DEVICE uint32_t pack2(float lo, float hi, bf16_t) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
HK_DEVICE uint32_t pack2(float lo, float hi, half_t) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <typename T> struct mma_ptx;
template <> struct mma_ptx<bf16_t> {
  static HK_DEVICE void run(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};
template <> struct mma_ptx<half_t> {
  static HK_DEVICE void run(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// Lane l, g = l / 4, t = l % 4. A: a[0..3] = (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..);
// B: b[0..1] = (k 2t..2t+1, n g), (k 2t+8.., n g); C: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
template <typename T>
struct MmaTile {
  static constexpr int M = 16, N = 8, K = 16, kC = 4, kRowLanes = 4, kRowSlots = 2;
  struct A { uint32_t r[4]; };
  struct B { uint32_t r[2]; };
  typedef float C[kC];

  static HK_DEVICE int c_row(int i) { return lane_id() / 4 + 8 * (i / 2); }
  static HK_DEVICE int c_col(int i) { return 2 * (lane_id() % 4) + i % 2; }
  static HK_DEVICE int row_slot(int i) { return i / 2; }
  // Each row's two adjacent columns as one 8-byte store; with ld = 8 (mod 32) the warp's 8 rows fill
  // all 32 banks twice (no conflict beyond the two wavefronts 256 bytes need).
  static HK_DEVICE void store_c(float* s, int ld, const C& c) {
    const int l = lane_id();
    float* r = s + (l / 4) * ld + 2 * (l % 4);
    *reinterpret_cast<float2*>(r) = make_float2(c[0], c[1]);
    *reinterpret_cast<float2*>(r + 8 * ld) = make_float2(c[2], c[3]);
  }

  static HK_DEVICE void load_a(A& a, const T* s, int ld) {  // matrices (rows 0-7|8-15) x (k 0-7|8-15)
    const int l = lane_id();
    const T* row = s + (l % 16) * ld + 8 * (l / 16);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a.r[0]), "=r"(a.r[1]), "=r"(a.r[2]), "=r"(a.r[3])
                 : "r"(smem_addr(row))
                 : "memory");
  }
  static HK_DEVICE void load_b_nk(B& b, const T* s, int ld) {  // matrices n 0-7 x (k 0-7 | 8-15)
    const int l = lane_id() % 16;
    load_b_nk_at(b, s + (l % 8) * ld + 8 * (l / 8));
  }
  static HK_DEVICE void load_b_nk_at(B& b, const T* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(b.r[0]), "=r"(b.r[1])
                 : "r"(smem_addr(row))
                 : "memory");
  }
  static HK_DEVICE void load_b_nk2(B& b0, B& b1, const T* s, int ld) {  // two n tiles: rows 0-7, 8-15
    const int l = lane_id();
    const T* row = s + ((l % 8) + 8 * (l / 16)) * ld + 8 * ((l / 8) % 2);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b0.r[0]), "=r"(b0.r[1]), "=r"(b1.r[0]), "=r"(b1.r[1])
                 : "r"(smem_addr(row))
                 : "memory");
  }
  static HK_DEVICE void load_b_kn(B& b, const T* s, int ld) {  // rows k 0-7 | 8-15, transposed
    load_b_kn_at(b, s + (lane_id() % 16) * ld);
  }
  static HK_DEVICE void load_b_kn_at(B& b, const T* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(b.r[0]), "=r"(b.r[1])
                 : "r"(smem_addr(row))
                 : "memory");
  }
  static HK_DEVICE void mma(C& c, const A& a, const B& b) { mma_ptx<T>::run(c, a.r, b.r); }
  // Step s takes elements 4s .. 4s + 3 of each load: logical k 2t, 2t + 1 <- 4s, 4s + 1 and
  // 2t + 8, 2t + 9 <- 4s + 2, 4s + 3 (t = lane % 4 owns indices 8t .. 8t + 7 of the run).
  static constexpr int kDirectK = 32, kDirectRows = 2;
  static HK_DEVICE int direct_row(int r) { return lane_id() / 4 + 8 * r; }
  static HK_DEVICE int direct_col() { return lane_id() / 4; }
  static HK_DEVICE int direct_k() { return 8 * (lane_id() % 4); }
  static HK_DEVICE void a_direct(A& a, const uint4 (&v)[kDirectRows], int s) {
    a.r[0] = s ? v[0].z : v[0].x;
    a.r[1] = s ? v[1].z : v[1].x;
    a.r[2] = s ? v[0].w : v[0].y;
    a.r[3] = s ? v[1].w : v[1].y;
  }
  static HK_DEVICE void b_direct(B& b, const uint4& v, int s) {
    b.r[0] = s ? v.z : v.x;
    b.r[1] = s ? v.w : v.y;
  }
  static HK_DEVICE void a_from_c(A& a, const C* c, T* /*tmp*/) {  // C tiles of columns 0-7 and 8-15
    a.r[0] = pack2(c[0][0], c[0][1], T());
    a.r[1] = pack2(c[0][2], c[0][3], T());
    a.r[2] = pack2(c[1][0], c[1][1], T());
    a.r[3] = pack2(c[1][2], c[1][3], T());
  }
};

#else  // CDNA

typedef short v4i16_t __attribute__((ext_vector_type(4)));
typedef _Float16 v4f16_t __attribute__((ext_vector_type(4)));
typedef float v4f32_t __attribute__((ext_vector_type(4)));

template <typename T> struct mfma_op;
template <> struct mfma_op<bf16_t> {
  static HK_DEVICE v4f32_t run(const bf16_t (&a)[4], const bf16_t (&b)[4], v4f32_t c) {
#if defined(__HIP_DEVICE_COMPILE__)
    v4i16_t av, bv;
    __builtin_memcpy(&av, a, 8);
    __builtin_memcpy(&bv, b, 8);
    return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(av, bv, c, 0, 0, 0);
#else
    return c;  // host pass: never called
#endif
  }
};
template <> struct mfma_op<half_t> {
  static HK_DEVICE v4f32_t run(const half_t (&a)[4], const half_t (&b)[4], v4f32_t c) {
#if defined(__HIP_DEVICE_COMPILE__)
    v4f16_t av, bv;
    __builtin_memcpy(&av, a, 8);
    __builtin_memcpy(&bv, b, 8);
    return __builtin_amdgcn_mfma_f32_16x16x16f16(av, bv, c, 0, 0, 0);
#else
    return c;
#endif
  }
};

#if defined(__HIP_DEVICE_COMPILE__) && !(defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || \
                                         defined(__gfx942__))
#error "hipkern/mma.h: MFMA 16x16x16 needs a CDNA2/CDNA3 target (gfx90a, gfx94x)"
#endif

// Wave64, lane l: A holds (row l % 16, k 4(l / 16) .. +3); B (k 4(l / 16) .. +3, col l % 16);
// C (row 4(l / 16) + i, col l % 16), i = 0..3.
template <typename T>
struct MmaTile {
  static_assert(kWaveSize == 64, "MFMA tiles are wave64");
  static constexpr int M = 16, N = 16, K = 16, kC = 4, kRowLanes = 16, kRowSlots = 4;
  struct A { T e[4]; };
  struct B { T e[4]; };
  typedef float C[kC];

  static HK_DEVICE int c_row(int i) { return 4 * (lane_id() / 16) + i; }
  static HK_DEVICE int c_col(int) { return lane_id() % 16; }
  static HK_DEVICE int row_slot(int i) { return i; }
  static HK_DEVICE void store_c(float* s, int ld, const C& c) {
#pragma unroll
    for (int i = 0; i < kC; ++i) s[c_row(i) * ld + c_col(i)] = c[i];
  }

  static HK_DEVICE void load_a(A& a, const T* s, int ld) {
    const int l = lane_id();
    load_vec<T, 4>(s + (l % 16) * ld + 4 * (l / 16), a.e);
  }
  static HK_DEVICE void load_b_nk(B& b, const T* s, int ld) {
    const int l = lane_id();
    load_vec<T, 4>(s + (l % 16) * ld + 4 * (l / 16), b.e);
  }
  static HK_DEVICE void load_b_nk2(B& b0, B& b1, const T* s, int ld) {  // two n tiles: rows 0-15, 16-31
    load_b_nk(b0, s, ld);
    load_b_nk(b1, s + N * ld, ld);
  }
  static HK_DEVICE void load_b_kn(B& b, const T* s, int ld) {
    const int l = lane_id();
#pragma unroll
    for (int i = 0; i < 4; ++i) b.e[i] = s[(4 * (l / 16) + i) * ld + l % 16];
  }
  // Lane l owns row / column l % 16 at indices 8(l / 16) .. + 7 of a run; step s takes 4s .. 4s + 3
  // as the product's k 4(l / 16) .. + 3.
  static constexpr int kDirectK = 32, kDirectRows = 1;
  static HK_DEVICE int direct_row(int) { return lane_id() % 16; }
  static HK_DEVICE int direct_col() { return lane_id() % 16; }
  static HK_DEVICE int direct_k() { return 8 * (lane_id() / 16); }
  static HK_DEVICE void a_direct(A& a, const uint4 (&v)[kDirectRows], int s) { half_of(a.e, v[0], s); }
  static HK_DEVICE void b_direct(B& b, const uint4& v, int s) { half_of(b.e, v, s); }
  static HK_DEVICE void half_of(T (&e)[4], const uint4& v, int s) {
    const uint2 h = s ? make_uint2(v.z, v.w) : make_uint2(v.x, v.y);
    __builtin_memcpy(&e[0], &h, 8);
  }
  static HK_DEVICE void mma(C& c, const A& a, const B& b) {
    v4f32_t acc = {c[0], c[1], c[2], c[3]};
    acc = mfma_op<T>::run(a.e, b.e, acc);
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = acc[i];
  }
  static HK_DEVICE void a_from_c(A& a, const C* c, T* tmp) {  // C and A lay rows out differently
    wave_sync();
#pragma unroll
    for (int i = 0; i < kC; ++i) tmp[c_row(i) * K + c_col(i)] = from_float<T>(c[0][i]);
    wave_sync();
    load_a(a, tmp, K);
  }
};

#endif

// Both 16-deep steps of one run of the direct layout (A: the lane's kDirectRows loads, B: its one).
template <typename MT>
HK_DEVICE void mma_direct_run(typename MT::C& c, const uint4 (&x)[MT::kDirectRows], const uint4& v) {
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    typename MT::A a;
    typename MT::B b;
    MT::a_direct(a, x, s);
    MT::b_direct(b, v, s);
    MT::mma(c, a, b);
  }
}

}  // namespace hk
