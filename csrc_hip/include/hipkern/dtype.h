// Element types shared by kernels and by the Python side (DTYPE_CODES in hipkern/jit/modules.py
// mirrors DType).
// fp16 and bf16 are carried as raw 16-bit storage with explicit conversions, so nothing here
// depends on hip_bf16.h (missing from the Debian ROCm headers) or on cuda_bf16.h operator sets.
#pragma once

#include "hipkern/platform.h"

namespace hk {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct half_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };
static_assert(sizeof(half_t) == 2 && sizeof(bf16_t) == 2, "16-bit storage types");

HK_DEVICE float bits_to_float(uint32_t u) { return __uint_as_float(u); }
HK_DEVICE uint32_t float_to_bits(float f) { return __float_as_uint(f); }

// IEEE half <-> float through the hardware conversion of each target.
HK_DEVICE float to_float(half_t h) {
#if defined(HK_PLATFORM_HIP)
  _Float16 v;
  __builtin_memcpy(&v, &h.bits, 2);
  return static_cast<float>(v);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  return f;
#endif
}

HK_DEVICE half_t to_half(float f) {  // round to nearest even
  half_t h;
#if defined(HK_PLATFORM_HIP)
  _Float16 v = static_cast<_Float16>(f);
  __builtin_memcpy(&h.bits, &v, 2);
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#endif
  return h;
}

// bf16 is the upper half of a float32.
HK_DEVICE float to_float(bf16_t b) { return bits_to_float(static_cast<uint32_t>(b.bits) << 16); }

HK_DEVICE bf16_t to_bf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u = float_to_bits(f);
  bf16_t b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = static_cast<uint16_t>((u >> 16) | 0x40u);
  } else {
    b.bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return b;
}

HK_DEVICE float to_float(float f) { return f; }

// The element type of a module built for one dtype (-DHK_DTYPE=<DType value>).
template <int D> struct elem_of;
template <> struct elem_of<(int)DType::kFloat32> { typedef float type; };
template <> struct elem_of<(int)DType::kFloat16> { typedef half_t type; };
template <> struct elem_of<(int)DType::kBFloat16> { typedef bf16_t type; };

template <typename T> HK_DEVICE T from_float(float f);
template <> HK_DEVICE float from_float<float>(float f) { return f; }
template <> HK_DEVICE half_t from_float<half_t>(float f) { return to_half(f); }
template <> HK_DEVICE bf16_t from_float<bf16_t>(float f) { return to_bf16(f); }

}  // namespace hk
