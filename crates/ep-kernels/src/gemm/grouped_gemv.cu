// Masked grouped GEMM for blocks of a few valid rows (decode): D[g, r, :] = A[g, r, :] x B[g]^T
// for r < counts[g], the same function as the CUTLASS grouped GEMMs (and the host twin
// `grouped_gemm_extra` in src/gemm/host.rs), shaped for the case where reading each active
// group's weight once is the whole cost. Launcher: src/gemm/cuda/grouped_gemv.rs, from
// `grouped_gemm_bf16_extra_cuda` (src/gemm/cuda/mod.rs) with `GemmTiles::Gemv`.
//
// At one decode token per rank a block holds one row, and a 64-row WGMMA tile spends its
// time waiting for the weights it streams through shared memory. Here there is no tile: a warp
// owns `kColsPerWarp` output columns (weight rows), its lanes stream those weight rows from
// global memory in 16-byte vectors (`kUnroll` vectors in flight per row), multiply them with
// the group's valid input rows (read through L1: every warp of the block reads the same rows)
// and reduce across the warp. Groups with no rows are skipped without reading their weights:
// every block builds the ordered list of the active groups from `counts` first, then blocks
// take (active group, column slab) items in a grid-stride loop, so the grid is sized to the
// device, not to the groups. More than `kRowsPerPass` valid rows are taken in passes over the
// same weights (the second pass mostly from L2); the launcher picks this kernel only when few
// rows are expected.
//
// `grouped_gemv_swiglu_bf16` is the experts' first GEMM with SwiGLU fused: B is the gate_up
// weight ([n = 2I, k] per group) in the blocked layout of the CUTLASS SwiGLU epilogue
// (swiglu_epilogue_sm90.cuh: gate rows 8b..8b+7 at rows 16b..16b+7, the matching up rows
// right after them), a warp takes the gate and the up row of one output column j, and the block
// writes act[r, j] = bf16(silu(gate) * up) ([rows, I], gate and up in f32, one rounding, as
// the CUTLASS epilogue) instead of [gate | up]: one launch and no [rows, 2I] round trip.
//
// Counts are checked like the CUTLASS path's setup kernel does: a negative count, one above
// m_max, or an extra group's count above the rows of extra_a prints the entry and traps.

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / ep::kWarpSize;
constexpr int kColsPerWarp = 2;
constexpr int kColsPerItem = kWarps * kColsPerWarp;
constexpr int kRowsPerPass = 2;
constexpr int kUnroll = 8;  // 16-byte vectors in flight per weight row and lane
constexpr int kMaxGroups = 1024;
constexpr int kBlocksPerSm = 2;  // 128 registers a thread at most: 2 blocks of 256 per SM
constexpr int kVec = 8;  // bf16 per 16-byte vector

}  // namespace

// Mirrors `GemvParams` in src/gemm/cuda/grouped_gemv.rs.
struct GemvParams {
    const __nv_bfloat16* a;        // [groups (or first_extra), m_max, k]
    const __nv_bfloat16* b;        // [first_extra, n, k]
    __nv_bfloat16* d;              // [groups, m_max, n] (SwiGLU: [groups, m_max, n / 2])
    const int32_t* counts;         // [groups]
    const __nv_bfloat16* extra_a;  // [extra_a_rows, k] or null
    const __nv_bfloat16* extra_b;  // [groups - first_extra, n, k] or null
    int64_t extra_a_rows;
    int32_t groups;
    int32_t n;  // weight rows per group (SwiGLU: 2I, even)
    int32_t k;  // a multiple of 8
    int32_t m_max;
    int32_t first_extra;  // == groups without extra groups
    int32_t reserved;
};
EP_CHECK_PARAMS_SIZE(GemvParams, 80);

namespace {

EP_DEVICE float dot8(const int4& w, const int4& x) {
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
    const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 wf = __bfloat1622float2(w2[j]);
        const float2 xf = __bfloat1622float2(x2[j]);
        acc = fmaf(wf.x, xf.x, acc);
        acc = fmaf(wf.y, xf.y, acc);
    }
    return acc;
}

EP_DEVICE float silu(float x) { return x / (1.0f + expf(-x)); }

EP_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int off = ep::kWarpSize / 2; off > 0; off /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, off);
    }
    return v;
}

// The active groups (count > 0) in group order into `active`; returns how many. Traps on a
// count the layout cannot hold.
EP_DEVICE int active_groups(const GemvParams& p, int* active, int* warp_totals) {
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    int total = 0;
    for (int base = 0; base < p.groups; base += kThreads) {
        const int g = base + static_cast<int>(threadIdx.x);
        int c = 0;
        if (g < p.groups) {
            c = p.counts[g];
            if (c < 0) {
                printf("ep grouped gemv: counts[%d] = %d is negative\n", g, c);
                __trap();
            }
            if (c > p.m_max) {
                printf("ep grouped gemv: counts[%d] = %d exceeds m_max = %d\n", g, c, p.m_max);
                __trap();
            }
            if (g >= p.first_extra && p.extra_a != nullptr && c > p.extra_a_rows) {
                printf("ep grouped gemv: counts[%d] = %d exceeds the %lld rows of extra_a\n", g, c,
                       static_cast<long long>(p.extra_a_rows));
                __trap();
            }
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, c > 0);
        if (lane == 0) {
            warp_totals[warp] = __popc(ballot);
        }
        __syncthreads();
        int before = total;
        for (int w = 0; w < warp; ++w) {
            before += warp_totals[w];
        }
        if (c > 0) {
            active[before + __popc(ballot & ((1u << lane) - 1u))] = g;
        }
        for (int w = 0; w < kWarps; ++w) {
            total += warp_totals[w];
        }
        __syncthreads();
    }
    return total;
}

}  // namespace

// kSwiglu: weight rows (j, I + j) per warp, output act [rows, I]; else rows (2w, 2w + 1) of a
// 16-column slab, output d [rows, n].
template <bool kSwiglu>
__device__ __forceinline__ void gemv_body(const GemvParams& p) {
    __shared__ int active[kMaxGroups];
    __shared__ int warp_totals[kWarps];
    const int num_active = active_groups(p, active, warp_totals);

    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    // Output columns and columns per item: SwiGLU pairs two weight rows into one column.
    const int out_cols = kSwiglu ? p.n / 2 : p.n;
    const int cols_per_item = kSwiglu ? kWarps : kColsPerItem;
    const int64_t slabs = (out_cols + cols_per_item - 1) / cols_per_item;
    const int64_t items = static_cast<int64_t>(num_active) * slabs;
    const int vectors = p.k / kVec;
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
        const int g = active[item / slabs];
        const int col0 = static_cast<int>(item % slabs) * cols_per_item +
                         warp * (kSwiglu ? 1 : kColsPerWarp);
        if (col0 >= out_cols) {
            continue;
        }
        const int count = p.counts[g];
        const bool extra = g >= p.first_extra;
        const __nv_bfloat16* w_base =
            extra ? p.extra_b + static_cast<int64_t>(g - p.first_extra) * p.n * p.k
                  : p.b + static_cast<int64_t>(g) * p.n * p.k;
        const __nv_bfloat16* x_base = (extra && p.extra_a != nullptr)
                                          ? p.extra_a
                                          : p.a + static_cast<int64_t>(g) * p.m_max * p.k;
        const int4* w[kColsPerWarp];
#pragma unroll
        for (int c = 0; c < kColsPerWarp; ++c) {
            // SwiGLU: the gate and the up row of column j (blocked layout). Else a column past n
            // re-reads the last one and is not stored.
            const int col = kSwiglu ? (col0 / 8) * 16 + col0 % 8 + c * 8 : min(col0 + c, p.n - 1);
            w[c] = reinterpret_cast<const int4*>(w_base + static_cast<int64_t>(col) * p.k);
        }
        for (int r0 = 0; r0 < count; r0 += kRowsPerPass) {
            const int rows = min(kRowsPerPass, count - r0);
            const int4* x[kRowsPerPass];
#pragma unroll
            for (int r = 0; r < kRowsPerPass; ++r) {
                // Rows past `rows` point at the first one (read, never stored).
                x[r] = reinterpret_cast<const int4*>(x_base +
                                                     static_cast<int64_t>(r0 + (r < rows ? r : 0)) * p.k);
            }
            float acc[kColsPerWarp][kRowsPerPass] = {};
            for (int v0 = lane; v0 < vectors; v0 += ep::kWarpSize * kUnroll) {
                int4 wv[kUnroll][kColsPerWarp];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int v = v0 + u * ep::kWarpSize;
#pragma unroll
                    for (int c = 0; c < kColsPerWarp; ++c) {
                        wv[u][c] = v < vectors ? ep::ld_nc_no_alloc(w[c] + v) : make_int4(0, 0, 0, 0);
                    }
                }
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int v = v0 + u * ep::kWarpSize;
                    if (v < vectors) {
#pragma unroll
                        for (int r = 0; r < kRowsPerPass; ++r) {
                            if (r < rows) {
                                const int4 xv = __ldg(x[r] + v);
#pragma unroll
                                for (int c = 0; c < kColsPerWarp; ++c) {
                                    acc[c][r] += dot8(wv[u][c], xv);
                                }
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < kRowsPerPass; ++r) {
                float s[kColsPerWarp];
#pragma unroll
                for (int c = 0; c < kColsPerWarp; ++c) {
                    s[c] = warp_sum(acc[c][r]);
                }
                if (lane != 0 || r >= rows) {
                    continue;
                }
                const int64_t row = static_cast<int64_t>(g) * p.m_max + r0 + r;
                if (kSwiglu) {
                    p.d[row * out_cols + col0] = ep::f32_to_bf16(silu(s[0]) * s[1]);
                } else {
#pragma unroll
                    for (int c = 0; c < kColsPerWarp; ++c) {
                        if (col0 + c < p.n) {
                            p.d[row * p.n + col0 + c] = ep::f32_to_bf16(s[c]);
                        }
                    }
                }
            }
        }
    }
}

EP_KERNEL void __launch_bounds__(kThreads, kBlocksPerSm)
    grouped_gemv_bf16(const __grid_constant__ GemvParams p) {
    gemv_body<false>(p);
}

EP_KERNEL void __launch_bounds__(kThreads, kBlocksPerSm)
    grouped_gemv_swiglu_bf16(const __grid_constant__ GemvParams p) {
    gemv_body<true>(p);
}
