// The host side of the grouped expert GEMM (gemm.h): the persistent grid's size, whether a GEMM routes in
// its blocks or runs in cluster pairs on a device, its partials workspace, and its launch.
#pragma once

#include "gemm.h"

namespace hk {
namespace fused_moe {

template <auto Kernel>
unsigned long long& raised() {  // per kernel: devices with the shared limit raised
  static unsigned long long r = 0;
  return r;
}

// Resident blocks of Kernel on the whole device (a persistent grid), into *out.
template <auto Kernel>
int resident_grid(int threads, int bytes, int device, int* out) {
  static int cache[64] = {0};  // per device (0: not asked yet)
  int grid = device < 64 ? __atomic_load_n(&cache[device], __ATOMIC_RELAXED) : 0;
  if (grid == 0) {
    int per_sm = 0, sms = 0;
    HK_TRY(resident_blocks(Kernel, raised<Kernel>(), threads, bytes, device, &per_sm));
    HK_CHECK(hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, device));
    if (per_sm < 1) return set_invalid("fused_moe: the GEMM kernel does not fit on this device", __FILE__, __LINE__);
    grid = per_sm * sms;
    if (device < 64) __atomic_store_n(&cache[device], grid, __ATOMIC_RELAXED);
  }
  *out = grid;
  return 0;
}

// Whether the GEMM can route in its blocks on `device`: room for the table in the tile (GemmCfg::kCanRoute)
// and in the device's shared memory per block (asked of the driver once per device: max_block_shared).
template <typename T, typename M, int BM, bool Gated>
bool routes_on(int device) {
  if constexpr (!GemmCfg<T, M, BM, Gated>::kCanRoute) {
    return false;
  } else {
    int most = 0;
    return max_block_shared(device, &most) == 0 && GemmCfg<T, M, BM, Gated>::kRoutedBytes <= most;
  }
}

// The GEMM kernel of kRows and its dynamic shared memory.
template <typename T, typename M, int BM, bool Gated, int kRows>
struct GemmLaunch {
  static constexpr auto kernel = &gemm_kernel<T, M, BM, Gated, kRows>;
  static constexpr int bytes = kRows == kOwnRoute ? GemmCfg<T, M, BM, Gated>::kRoutedBytes
                                                  : GemmCfg<T, M, BM, Gated>::bytes;
};

template <typename T, typename M, int BM, bool Gated, int kRows = kSortedRows>
int device_slots(int device, int* out) {
  typedef GemmLaunch<T, M, BM, Gated, kRows> L;
  return resident_grid<L::kernel>(GemmCfg<T, M, BM, Gated>::kThreads, L::bytes, device, out);
}

// Whether launch_gemm runs a grid of `grid` blocks in clusters of 2 (GemmParams::pair_cluster), into
// *out: where GemmCfg::kPairSum and all the clusters can be resident at once (for blocks of one SM
// each, a GPC with an odd number of SMs leaves one of them out). HIPKERN_NO_CLUSTERS (set to any value) in the
// environment says no, for comparisons.
template <typename T, typename M, int BM, bool Gated, int kRows = kSortedRows>
int pairs_fit(int device, int grid, bool* out) {
  typedef GemmCfg<T, M, BM, Gated> C;
  typedef GemmLaunch<T, M, BM, Gated, kRows> L;
  static const bool off = std::getenv("HIPKERN_NO_CLUSTERS") != nullptr;
  static int cache[64] = {0};  // per device: resident clusters + 1 (0: not asked yet)
  *out = false;
  if (!C::kPairSum || off || grid % 2 != 0) return 0;
  int clusters = device < 64 ? __atomic_load_n(&cache[device], __ATOMIC_RELAXED) - 1 : -1;
  if (clusters < 0) {
    HK_TRY(allow_shared(L::kernel, raised<L::kernel>(), L::bytes, device));
    HK_TRY(max_clusters(L::kernel, C::kThreads, L::bytes, dim3(2, 1, 1), &clusters));
    if (device < 64) __atomic_store_n(&cache[device], clusters + 1, __ATOMIC_RELAXED);
  }
  *out = 2 * clusters >= grid;
  return 0;
}

// What launch_gemm does on `device` with a grid of more than enough items (kRows kOwnRoute: with
// GemmParams::route_ids set): out[0] its grid, out[1]
// the output columns of an item, out[2] whether a split of 2 sums in cluster pairs (for tests).
template <typename T, typename M, int BM, bool Gated, int kRows = kSortedRows>
int gemm_layout(int device, int32_t* out) {
  int grid = 0;
  bool pairs = false;
  HK_TRY((device_slots<T, M, BM, Gated, kRows>(device, &grid)));
  HK_TRY((pairs_fit<T, M, BM, Gated, kRows>(device, grid, &pairs)));
  out[0] = grid;
  out[1] = GemmCfg<T, M, BM, Gated>::kCols;
  out[2] = pairs;
  return 0;
}

// Floats of partials and ints of counters a launch of this GEMM may use.
template <typename T, typename M, int BM, bool Gated>
int workspace(int device, int64_t* partial_floats, int64_t* counter_ints) {
  int grid = 0;
  HK_TRY((device_slots<T, M, BM, Gated>(device, &grid)));
  if constexpr (GemmCfg<T, M, BM, Gated>::kCanRoute) {  // the larger of the two kernels' grids
    if (routes_on<T, M, BM, Gated>(device)) {
      int routed = 0;
      HK_TRY((device_slots<T, M, BM, Gated, kOwnRoute>(device, &routed)));
      if (routed > grid) grid = routed;
    }
  }
  *partial_floats = split_items(grid) * kSplitFloats<M>;
  *counter_ints = split_items(grid);
  return 0;
}

// Launch over min(items that can exist, resident blocks on the device).
template <typename T, typename M, int BM, bool Gated, int kRows>
int launch_gemm_rows(const GemmParams& p, int device, hipStream_t stream) {
  typedef GemmCfg<T, M, BM, Gated> C;
  typedef GemmLaunch<T, M, BM, Gated, kRows> L;
  int grid = 0;
  HK_TRY((device_slots<T, M, BM, Gated, kRows>(device, &grid)));
  GemmParams q = p;
  q.max_split_items = split_items(grid);
  q.w_tma = 0;
  if constexpr (C::kTmaW) {  // GemmParams::w_map's boxes
    static const bool off = std::getenv("HIPKERN_NO_TMA") != nullptr;  // for comparisons only
    const uint64_t e = (uint64_t)p.w_stride_e * sizeof(T), k = (uint64_t)p.K * sizeof(T);
    const uint32_t box_k = 128 / sizeof(T);
    if (Gated && !off && p.N % 8 == 0) {  // K, 8 rows, gate / up, N / 8 groups, experts
      const uint64_t dims[5] = {(uint64_t)p.K, 8, 2, (uint64_t)p.N / 8, (uint64_t)p.num_experts};
      const uint64_t strides[4] = {k, (uint64_t)p.N * k, 8 * k, e};
      const uint32_t box[5] = {box_k, 8, 2, (uint32_t)C::kCols / 8, 1};
      HK_TRY(encode_tensor_map(&q.w_map, p.w, (int)sizeof(T), 5, dims, strides, box));
      q.w_tma = 1;
    } else if (!Gated && !off) {  // K, N rows, experts
      const uint64_t dims[3] = {(uint64_t)p.K, (uint64_t)p.N, (uint64_t)p.num_experts};
      const uint64_t strides[2] = {k, e};
      const uint32_t box[3] = {box_k, (uint32_t)M::kRows, 1};
      HK_TRY(encode_tensor_map(&q.w_map, p.w, (int)sizeof(T), 3, dims, strides, box));
      q.w_tma = 1;
    }
  }
  const int64_t items = (int64_t)p.max_mblocks * p.n_tiles * kMaxSplit;
  if (items < grid) grid = (int)items;
  if (grid < 1) return 0;
  HK_TRY(allow_shared(L::kernel, raised<L::kernel>(), L::bytes, device));
  bool pairs = false;
  HK_TRY((pairs_fit<T, M, BM, Gated, kRows>(device, grid, &pairs)));
  q.pair_cluster = pairs;
  HK_CHECK(launch_dependent_clusters(L::kernel, dim3((unsigned)grid), dim3(C::kThreads), L::bytes, stream,
                                     dim3(pairs ? 2 : 1, 1, 1), q));
  return 0;
}

// The GEMM after moe_sorting, or routing in its blocks where p.route_ids is set (at most kRoutePairs
// pairs, on tiles with room for the table: GemmCfg::kCanRoute).
template <typename T, typename M, int BM, bool Gated>
int launch_gemm(const GemmParams& p, int device, hipStream_t stream) {
  if (p.route_ids == nullptr) return launch_gemm_rows<T, M, BM, Gated, kSortedRows>(p, device, stream);
  if constexpr (GemmCfg<T, M, BM, Gated>::kCanRoute) {
    if (p.num_pairs <= kRoutePairs) return launch_gemm_rows<T, M, BM, Gated, kOwnRoute>(p, device, stream);
  }
  return set_invalid("fused_moe: routing in the GEMM blocks takes at most kRoutePairs pairs, on a tile with room for "
                     "its table", __FILE__, __LINE__);
}

}  // namespace fused_moe
}  // namespace hk
