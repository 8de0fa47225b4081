// Sorting small register arrays: bitonic networks whose indices are all compile-time constants
// after unrolling, so the arrays stay in registers.
#pragma once

#include "hipkern/platform.h"

namespace hk {

// Sort a[0..N) in descending order (N a power of two).
template <int N, typename K>
HK_DEVICE void bitonic_sort_desc(K (&a)[N]) {
  static_assert((N & (N - 1)) == 0, "power-of-two length");
#pragma unroll
  for (int k = 2; k <= N; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int l = i ^ j;
        if (l > i) {
          const bool desc = (i & k) == 0;  // this run's direction; the last run is descending
          const K hi = a[i] > a[l] ? a[i] : a[l];
          const K lo = a[i] > a[l] ? a[l] : a[i];
          a[i] = desc ? hi : lo;
          a[l] = desc ? lo : hi;
        }
      }
    }
  }
}

// Drop a[0] and shift the rest up; `fill` enters at the end.
template <int N, typename K>
HK_DEVICE void pop_front(K (&a)[N], K fill) {
#pragma unroll
  for (int i = 0; i + 1 < N; ++i) a[i] = a[i + 1];
  a[N - 1] = fill;
}

}  // namespace hk
