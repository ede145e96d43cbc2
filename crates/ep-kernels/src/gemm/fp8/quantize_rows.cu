// The fp8 experts' row quantizations, 1 x 128 as the per-token fp8 cast (fp8/fp8.cu):
//
// quantize_rows_fp8: bf16 rows (a bf16 dispatch's) to e4m3 rows with their scales for the
// gate_up GEMM; in a masked layout only the rows within each block's count (a decode step's
// blocks are mostly empty). Host twin: `gemm::fp8::quantize_rows`, bit for bit.
//
// swiglu_quantize_fp8: SwiGLU of the gate_up products and its quantization for the down
// GEMM, in one pass: for every row r and 128-column group of act,
//   act[c] = silu(gate[c]) * up[c]          (f32, from the bf16 products h: `block` gate
//                                            columns, then `block` up columns, in turn)
//   scale  = max(max |act|, 1e-4) / 448,    q[c] = e4m3_satfinite_rn(act[c] / scale)
// In a masked layout (both kernels) only the first counts[group] rows of each group are
// visited, and the grid's half-warps share the valid rows of all groups evenly: every block
// lays the counts out as a prefix in shared memory and a half-warp's item (valid row, 128-column
// group) finds its group by a binary search, so one hot group (all of a decode step's tokens on
// one expert) is spread over the grid instead of over the few blocks a per-group grid gives it.
// Each item takes 8 columns a lane (16-byte loads), twice the bytes in flight of a warp an item.
// Host twin: `gemm::fp8::swiglu_quantize` (SiLU here takes the hardware exponential and
// reciprocal, a few ulp from the host's, so results agree to one e4m3 step and scales to 1e-5);
// launcher: src/gemm/fp8/cuda/quantize_rows.rs.

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / ep::kWarpSize;
constexpr int kHalfWarp = ep::kWarpSize / 2;
constexpr int kPerLane = ep::kFp8Group / kHalfWarp;  // 8 columns a lane, 16 bytes of bf16

}  // namespace

// Mirrors `RowsParams` in src/gemm/fp8/cuda/quantize_rows.rs (both kernels).
struct RowsParams {
    const __nv_bfloat16* in; // [rows, cols] (quantize_rows) or [rows, 2 * cols] (swiglu: gate
                             // and up columns in blocks of `block`); 16-byte aligned
    uint8_t* q;              // [rows, cols] e4m3, 8-byte aligned
    float* scales;           // [rows, cols / 128]
    const int32_t* counts;   // masked layout: [rows / m_max] valid rows per block; else null
    int64_t rows;
    int32_t cols;            // a multiple of 128
    int32_t m_max;           // masked layout: rows per block; else 0
    int32_t block;           // swiglu: gate / up columns in turn, a multiple of 128 dividing cols
};
EP_CHECK_PARAMS_SIZE(RowsParams, 56);

// The valid rows of a masked layout laid out one group after another: first[g] is the number of
// valid rows of the groups before g (each count clamped to [0, m_max]), first[groups] all of
// them. Every thread of the block calls it; returns the total.
EP_DEVICE int64_t valid_rows_prefix(const RowsParams& p, int groups, int* first, int* warp_sums) {
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    int total = 0;
    for (int base = 0; base < groups; base += kThreads) {
        const int g = base + static_cast<int>(threadIdx.x);
        const int c = g < groups ? min(max(__ldg(p.counts + g), 0), p.m_max) : 0;
        int incl = c;
#pragma unroll
        for (int d = 1; d < ep::kWarpSize; d <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, d);
            incl += lane >= d ? v : 0;
        }
        if (lane == ep::kWarpSize - 1) {
            warp_sums[warp] = incl;
        }
        __syncthreads();
        int before = total;
        for (int w = 0; w < warp; ++w) {
            before += warp_sums[w];
        }
        if (g < groups) {
            first[g] = before + incl - c;
        }
        for (int w = 0; w < kWarpsPerBlock; ++w) {
            total += warp_sums[w];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        first[groups] = total;
    }
    __syncthreads();
    return total;
}

// The input row of the v-th valid row: the last group g with first[g] <= v (empty groups share
// their successor's first entry, so the last one holding v is the group that has it).
EP_DEVICE int64_t valid_row(const RowsParams& p, const int* first, int groups, int v) {
    int lo = 0;
    int hi = groups - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= v) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return static_cast<int64_t>(lo) * p.m_max + (v - first[lo]);
}

// Calls f(r, g, valid) for every row r the layout makes valid and every 128-column group g of
// it, one half-warp per (r, g) (8 columns a lane, 16-byte loads), the items shared evenly by
// the grid's half-warps (see the file comment). Both halves of a warp always call f together
// (its shuffles span the warp); a half without an item (the last of an odd count) gets
// `valid` false and must not store. Dynamic shared memory: 4 * (groups + 1) bytes in a masked
// layout (the prefix), none otherwise.
template <class F>
EP_DEVICE void for_each_group(const RowsParams& p, F&& f) {
    extern __shared__ int first[];
    __shared__ int warp_sums[kWarpsPerBlock];
    const int64_t groups_per_row = p.cols / ep::kFp8Group;
    const int masked_groups = p.counts == nullptr ? 0 : static_cast<int>(p.rows / p.m_max);
    const int64_t rows =
        p.counts == nullptr ? p.rows : valid_rows_prefix(p, masked_groups, first, warp_sums);
    const int64_t items = rows * groups_per_row;
    const int64_t halves = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock * 2;
    const int half = ep::lane_id() / kHalfWarp;
    for (int64_t pair = (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + ep::warp_id()) * 2;
         pair < items; pair += halves) {
        const int64_t item = pair + half;
        const bool valid = item < items;
        const int64_t v = valid ? item / groups_per_row : 0;
        const int64_t r =
            p.counts == nullptr ? v : valid_row(p, first, masked_groups, static_cast<int>(v));
        f(r, valid ? item % groups_per_row : 0, valid);
    }
}

// One half-warp per (row, 128-column group): 8 values per lane, the group's amax by a
// half-warp reduction, then scale and e4m3 values as the per-token cast computes them.
EP_DEVICE void quantize_group(const float (&v)[kPerLane], uint8_t* q, float* scale, int sublane,
                              bool valid) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int d = kHalfWarp / 2; d > 0; d >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    }
    const float s = __fdiv_rn(fmaxf(amax, ep::kAmaxMin), ep::kE4m3Max);
    uint2 packed = make_uint2(0, 0);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const uint32_t byte = ep::f32_to_e4m3(__fdiv_rn(v[i], s));
        if (i < 4) {
            packed.x |= byte << (8 * i);
        } else {
            packed.y |= byte << (8 * (i - 4));
        }
    }
    if (valid) {
        *reinterpret_cast<uint2*>(q + sublane * kPerLane) = packed;
        if (sublane == 0) {
            *scale = s;
        }
    }
}

EP_KERNEL void __launch_bounds__(kThreads)
    quantize_rows_fp8(const __grid_constant__ RowsParams p) {
    const int sublane = ep::lane_id() % kHalfWarp;
    const int64_t groups_per_row = p.cols / ep::kFp8Group;
    for_each_group(p, [&](int64_t r, int64_t g, bool valid) {
        const int64_t at = r * p.cols + g * ep::kFp8Group;
        float v[kPerLane] = {};
        if (valid) {
            ep::load_bf16x8(p.in + at + sublane * kPerLane, v);
        }
        quantize_group(v, p.q + at, p.scales + r * groups_per_row + g, sublane, valid);
    });
}

EP_KERNEL void __launch_bounds__(kThreads)
    swiglu_quantize_fp8(const __grid_constant__ RowsParams p) {
    const int sublane = ep::lane_id() % kHalfWarp;
    const int64_t groups_per_row = p.cols / ep::kFp8Group;
    for_each_group(p, [&](int64_t r, int64_t g, bool valid) {
        const int64_t col = g * ep::kFp8Group + sublane * kPerLane;
        const __nv_bfloat16* row = p.in + r * 2 * static_cast<int64_t>(p.cols);
        // A 128-column group lies in one block (block a multiple of 128).
        const int64_t at = col / p.block * 2 * p.block + col % p.block;
        float gate[kPerLane] = {};
        float up[kPerLane] = {};
        if (valid) {
            ep::load_bf16x8(row + at, gate);
            ep::load_bf16x8(row + at + p.block, up);
        }
        float act[kPerLane];
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            // The hardware exponential and reciprocal (a few ulp; the pass is otherwise bound
            // by these instructions, not by its bytes). silu(x) -> -0 for very negative x as
            // the reciprocal of an infinite denominator is 0.
            const float silu = __fdividef(gate[i], 1.0f + __expf(-gate[i]));
            act[i] = __fmul_rn(silu, up[i]);
        }
        quantize_group(act, p.q + r * p.cols + g * ep::kFp8Group,
                       p.scales + r * groups_per_row + g, sublane, valid);
    });
}
