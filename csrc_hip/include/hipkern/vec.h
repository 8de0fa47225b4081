// Vector loads and stores: N elements of T moved as one access of N * sizeof(T) bytes
// (16 bytes is the widest a lane issues on both targets), then widened to float.
#pragma once

#include <type_traits>

#include "hipkern/dtype.h"

namespace hk {

template <int Bytes> struct raw_vec;
template <> struct raw_vec<2> { typedef uint16_t type; };
template <> struct raw_vec<4> { typedef uint32_t type; };
template <> struct raw_vec<8> { typedef uint2 type; };
template <> struct raw_vec<16> { typedef uint4 type; };

// N elements of T, aligned as one access.
template <typename T, int N>
struct alignas(sizeof(T) * N) vec_t {
  static_assert((N & (N - 1)) == 0 && sizeof(T) * N <= 16, "a vector is 1..16 bytes, power of two");
  T v[N];
};

// Load N consecutive elements at p (aligned to N * sizeof(T)) as one access, unconverted.
template <typename T, int N>
HK_DEVICE void load_vec(const T* __restrict__ p, T (&out)[N]) {
  typedef typename raw_vec<sizeof(T) * N>::type R;
  vec_t<T, N> x;
  *reinterpret_cast<R*>(&x) = *reinterpret_cast<const R*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = x.v[i];
}

// The N elements of T held in one raw access (as load_vec reads it), widened to float. bf16 pairs
// are widened a 32-bit word at a time: the low element by one shift, the high one by one mask
// (element by element, the high one took an extract and a shift).
template <typename T, int N>
HK_DEVICE void raw_as_float(const typename raw_vec<sizeof(T) * N>::type& r, float (&out)[N]) {
  if constexpr (std::is_same<T, bf16_t>::value && N % 2 == 0) {
    vec_t<uint32_t, N / 2> w;
    *reinterpret_cast<typename raw_vec<sizeof(T) * N>::type*>(&w) = r;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      out[2 * i] = bits_to_float(w.v[i] << 16);
      out[2 * i + 1] = bits_to_float(w.v[i] & 0xffff0000u);
    }
  } else {
    vec_t<T, N> x;
    *reinterpret_cast<typename raw_vec<sizeof(T) * N>::type*>(&x) = r;
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(x.v[i]);
  }
}

// Load N consecutive elements at p (which must be aligned to N * sizeof(T)) and widen to float.
template <typename T, int N>
HK_DEVICE void load_as_float(const T* __restrict__ p, float (&out)[N]) {
  raw_as_float<T, N>(*reinterpret_cast<const typename raw_vec<sizeof(T) * N>::type*>(p), out);
}

// Narrow N floats to T and store them at p (aligned to N * sizeof(T)) as one access.
template <typename T, int N>
HK_DEVICE void store_from_float(T* __restrict__ p, const float (&in)[N]) {
  typedef typename raw_vec<sizeof(T) * N>::type R;
  vec_t<T, N> x;
#pragma unroll
  for (int i = 0; i < N; ++i) x.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<R*>(p) = *reinterpret_cast<const R*>(&x);
}

}  // namespace hk
