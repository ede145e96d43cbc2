// SwiGLU between the two grouped GEMMs of the experts: out[r, j] = silu(h[r, j]) * h[r, I + j]
// for every valid row r of a grouped layout, h = [rows, 2I] (gate then up, the output of the
// stacked gate_up GEMM), out = [rows, I]. Launcher and host twin: src/gemm/cuda.rs
// (`swiglu_cuda`) and src/gemm/host.rs (`swiglu`).
//
// Valid rows follow the grouped GEMM's layouts (csrc/grouped_gemm_sm90.cuh): contiguous
// (group g starts at the prefix sum of align_up(counts, alignment)) or masked (group g starts at
// g * m_max). Each block recomputes the group starts from `counts` in shared memory, then its
// warps take rows in a grid-stride loop: one warp per row, 16-byte vectors. Rows outside every
// group's count are neither read nor written. silu(x) = x / (1 + exp(-x)) in f32; the product
// is rounded to bf16 once.

#include <cub/block/block_scan.cuh>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / ep::kWarpSize;
constexpr int kMaxGroups = 1024;
constexpr int kGroupsPerThread = kMaxGroups / kThreads;
constexpr int kContiguous = 0;

}  // namespace

// Mirrors `SwigluParams` in src/gemm/cuda.rs.
struct SwigluParams {
    const __nv_bfloat16* h;  // [rows, 2 * inter]
    const int32_t* counts;   // [groups]
    __nv_bfloat16* out;      // [rows, inter]
    int64_t rows;
    int32_t groups;
    int32_t inter;      // I, a multiple of 8
    int32_t layout;     // 0 contiguous, 1 masked
    int32_t m_max;      // masked: rows per group
    int32_t alignment;  // contiguous: group starts are multiples of it
    int32_t reserved;
};
EP_CHECK_PARAMS_SIZE(SwigluParams, 56);

EP_DEVICE float silu(float x) { return x / (1.0f + expf(-x)); }

EP_KERNEL void __launch_bounds__(kThreads) swiglu_grouped(const __grid_constant__ SwigluParams p) {
    using Scan = cub::BlockScan<int64_t, kThreads>;
    __shared__ typename Scan::TempStorage scan;
    __shared__ int64_t starts[kMaxGroups];
    __shared__ int32_t counts[kMaxGroups];
    {
        int64_t v[kGroupsPerThread];
#pragma unroll
        for (int i = 0; i < kGroupsPerThread; ++i) {
            const int g = threadIdx.x * kGroupsPerThread + i;
            const int32_t c = g < p.groups ? p.counts[g] : 0;
            if (g < p.groups) {
                counts[g] = c;
            }
            v[i] = p.layout == kContiguous
                       ? (static_cast<int64_t>(c) + p.alignment - 1) / p.alignment * p.alignment
                       : static_cast<int64_t>(g) * p.m_max;
        }
        if (p.layout == kContiguous) {
            Scan(scan).ExclusiveSum(v, v);
        }
#pragma unroll
        for (int i = 0; i < kGroupsPerThread; ++i) {
            const int g = threadIdx.x * kGroupsPerThread + i;
            if (g < p.groups) {
                starts[g] = v[i];
            }
        }
    }
    __syncthreads();

    const int lane = ep::lane_id();
    const int64_t vectors = p.inter / 8;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + ep::warp_id();
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
    for (int64_t row = first; row < p.rows; row += stride) {
        // The group holding `row`: the last one starting at or before it.
        int lo = 0;
        int hi = p.groups - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (starts[mid] <= row) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        if (row - starts[lo] >= counts[lo] || row < starts[lo]) {
            continue;
        }
        const int4* gate = reinterpret_cast<const int4*>(p.h + row * 2 * p.inter);
        const int4* up = gate + vectors;
        int4* dst = reinterpret_cast<int4*>(p.out + row * p.inter);
        for (int64_t i = lane; i < vectors; i += ep::kWarpSize) {
            const int4 gv = ep::ld_nc_no_alloc(gate + i);
            const int4 uv = ep::ld_nc_no_alloc(up + i);
            const __nv_bfloat16* g8 = reinterpret_cast<const __nv_bfloat16*>(&gv);
            const __nv_bfloat16* u8 = reinterpret_cast<const __nv_bfloat16*>(&uv);
            int4 ov;
            __nv_bfloat16* o8 = reinterpret_cast<__nv_bfloat16*>(&ov);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                o8[j] = ep::f32_to_bf16(silu(ep::bf16_to_f32(g8[j])) * ep::bf16_to_f32(u8[j]));
            }
            dst[i] = ov;
        }
    }
}
