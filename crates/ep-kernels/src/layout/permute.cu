// Row gather ("permute"): dst[i, :] = src[index[i], :] for i in [0, num_rows). Launcher:
// `cuda/permute.rs` (`gather_rows_cuda`); host twin: `permute.rs` (`gather_rows`).
//
// Rows are opaque bytes (`row_bytes` each). One warp copies one row per grid-stride step:
//   * vectorised path (row_bytes % 16 == 0 and both bases 16-byte aligned, checked by the
//     launcher): 16-byte loads on the non-coherent path (src is read-only during the kernel)
//     and 16-byte stores, kUnroll loads in flight per lane before their stores;
//   * generic fallback: byte copies.
// An index outside [0, num_src_rows) traps (EP_DEVICE_ASSERT): a misrouted row is never
// silently copied from the wrong place.

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / ep::kWarpSize;
constexpr int kUnroll = 4;

}  // namespace

// Mirrors `GatherRowsParams` in src/layout/permute.rs.
struct GatherRowsParams {
    const uint8_t* src;    // [num_src_rows, row_bytes]
    const int32_t* index;  // [num_rows]
    uint8_t* dst;          // [num_rows, row_bytes]
    int64_t num_rows;
    int64_t row_bytes;
    int32_t num_src_rows;
    int32_t vectorized;  // 1: the 16-byte path may be used (see above)
};
EP_CHECK_PARAMS_SIZE(GatherRowsParams, 48);

EP_KERNEL void __launch_bounds__(kThreads) gather_rows(const __grid_constant__ GatherRowsParams p) {
    const int lane = ep::lane_id();
    const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + ep::warp_id();
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
    for (int64_t row = first; row < p.num_rows; row += stride) {
        const int32_t s = __ldg(p.index + row);
        EP_DEVICE_ASSERT(s >= 0 && s < p.num_src_rows);
        const uint8_t* src_row = p.src + static_cast<int64_t>(s) * p.row_bytes;
        uint8_t* dst_row = p.dst + row * p.row_bytes;
        if (p.vectorized) {
            const int4* src4 = reinterpret_cast<const int4*>(src_row);
            int4* dst4 = reinterpret_cast<int4*>(dst_row);
            const int64_t n = p.row_bytes / 16;
            int64_t i = lane;
            // Full rounds: kUnroll vectors per lane in flight.
            for (; i + (kUnroll - 1) * ep::kWarpSize < n; i += kUnroll * ep::kWarpSize) {
                int4 v[kUnroll];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    v[u] = ep::ld_nc_no_alloc(src4 + i + u * ep::kWarpSize);
                }
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    dst4[i + u * ep::kWarpSize] = v[u];
                }
            }
            // Tail: fewer than kUnroll vectors left for this lane.
            for (; i < n; i += ep::kWarpSize) {
                dst4[i] = ep::ld_nc_no_alloc(src4 + i);
            }
        } else {
            for (int64_t i = lane; i < p.row_bytes; i += ep::kWarpSize) {
                dst_row[i] = src_row[i];
            }
        }
    }
}
