// Masked grouped GEMM for blocks of a few valid rows (decode): D[g, r, :] = A[g, r, :] x B[g]^T
// for r < counts[g], the same function as the CUTLASS grouped GEMMs (and the host twin
// `grouped_gemm_extra` in src/gemm/host.rs), shaped for the case where reading each active
// group's weight once is the whole cost. Launcher: `grouped_gemm_bf16_extra_cuda` in
// src/gemm/cuda.rs with `GemmTiles::Gemv`.
//
// At one decode token per rank a block holds one row, and a 64-row WGMMA tile spends its
// time waiting for the weights it streams through shared memory. Here there is no tile, only
// the stream: one block per SM, whose producer warp copies weight rows global -> shared with
// 1-D bulk copies (TMA) into a ring of `kStages` stages of `kRowsPerItem` rows x `kChunk`
// columns, each stage completing on its own mbarrier (transaction bytes), while
// `kConsumerWarps` warps multiply the stages with the group's valid input rows (read through
// L1: every warp reads the same rows) and release them on a second mbarrier. The ring keeps
// `kStages x 16 KB` of weights in flight per SM whatever the consumers do, which register
// loads (a warp's vectors in flight, then a pause while it multiplies and reduces) did not:
// they streamed at 73 % of an H200's copy bandwidth. Work items are (active group, block of
// 16 weight rows), a contiguous range of them per block; groups with no rows are skipped
// without reading their weights (every block builds the ordered list of the active groups from
// `counts` first). A warp owns two weight rows of an item and accumulates them over the item's
// chunks; more than `kRowsPerPass` valid rows are taken in passes over the same weights (the
// second pass mostly from L2); the launcher picks this kernel only when few rows are expected.
//
// `grouped_gemv_swiglu_bf16` is the experts' first GEMM with SwiGLU fused: B is the gate_up
// weight ([n = 2I, k] per group) in the blocked layout of the CUTLASS SwiGLU epilogue
// (csrc/swiglu_epilogue_sm90.cuh: gate rows 8b..8b+7 at rows 16b..16b+7, the matching up rows
// right after them), so an item is 8 gate rows and their 8 up rows, a warp takes the gate and
// the up row of one output column j, and the block writes act[r, j] = bf16(silu(gate) * up)
// ([rows, I], gate and up in f32, one rounding, as the CUTLASS epilogue) instead of
// [gate | up]: one launch and no [rows, 2I] round trip.
//
// Counts are checked like the CUTLASS path's setup kernel does: a negative count, one above
// m_max, or an extra group's count above the rows of extra_a prints the entry and traps.

#include "common.cuh"

namespace {

constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 1) * ep::kWarpSize;  // + the producer warp
constexpr int kWarps = kThreads / ep::kWarpSize;
constexpr int kRowsPerItem = 2 * kConsumerWarps;  // weight rows of one work item
constexpr int kChunk = 512;                       // columns (k) of a stage: 1 KB per row
constexpr int kStageBytes = kRowsPerItem * kChunk * 2;
constexpr int kStages = 12;                       // 192 KB of weights in flight per SM
constexpr int kRowsPerPass = 2;
constexpr int kMaxGroups = 1024;
constexpr int kVec = 8;  // bf16 per 16-byte vector
constexpr int kVecsPerLane = kChunk / kVec / ep::kWarpSize;

}  // namespace

// Mirrors `GemvParams` in src/gemm/cuda.rs.
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

// The ring of stages: stage s holds rows [0, 16) of the current item, `kChunk` columns each
// (row r at byte r * kChunk * 2), full[s] completes when its bulk copies land, empty[s] when
// the consumer warps are done with it. Producer and consumers walk the same sequence of
// (item, pass, chunk) stages, so both derive the stage and its phase from a running count.
struct Ring {
    uint32_t base;  // shared address of stage 0
    uint32_t full;  // shared address of full[0] (8 bytes each)
    uint32_t empty;
    EP_DEVICE uint32_t stage(int s) const { return base + s * kStageBytes; }
    EP_DEVICE uint32_t full_bar(int s) const { return full + s * 8; }
    EP_DEVICE uint32_t empty_bar(int s) const { return empty + s * 8; }
};

// What one work item covers: group g's weight rows [row0, row0 + rows).
struct Item {
    int g;
    int row0;
    int rows;   // weight rows copied (16, fewer in a plain GEMM's last block)
    int count;  // valid input rows of the group
    const __nv_bfloat16* w;  // the group's weight, [n, k]
    const __nv_bfloat16* x;  // the group's input rows, [count, k]
};

EP_DEVICE Item item_at(const GemvParams& p, const int* active, int64_t item, int blocks_per_group) {
    Item it;
    it.g = active[item / blocks_per_group];
    it.row0 = static_cast<int>(item % blocks_per_group) * kRowsPerItem;
    it.rows = min(kRowsPerItem, p.n - it.row0);
    it.count = p.counts[it.g];
    const bool extra = it.g >= p.first_extra;
    it.w = extra ? p.extra_b + static_cast<int64_t>(it.g - p.first_extra) * p.n * p.k
                 : p.b + static_cast<int64_t>(it.g) * p.n * p.k;
    it.x = (extra && p.extra_a != nullptr) ? p.extra_a
                                           : p.a + static_cast<int64_t>(it.g) * p.m_max * p.k;
    return it;
}

// kSwiglu: the warp's weight rows are (w, w + 8) of the item (gate and up of output column
// row0 / 2 + w), output act [rows, n / 2]; else rows (2w, 2w + 1), output d [rows, n].
template <bool kSwiglu>
__device__ __forceinline__ void gemv_body(const GemvParams& p) {
    extern __shared__ __align__(128) uint8_t ring_smem[];
    __shared__ __align__(8) uint64_t bars[2 * kStages];
    __shared__ int active[kMaxGroups];
    __shared__ int warp_totals[kWarps];
    const int num_active = active_groups(p, active, warp_totals);

    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const Ring ring{ep::smem_addr(ring_smem), ep::smem_addr(&bars[0]), ep::smem_addr(&bars[kStages])};
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            ep::mbarrier_init(ring.full_bar(s), 1);
            ep::mbarrier_init(ring.empty_bar(s), kConsumerWarps);
        }
        ep::fence_mbarrier_init();
    }
    __syncthreads();

    // A contiguous range of items per block.
    const int blocks_per_group = (p.n + kRowsPerItem - 1) / kRowsPerItem;
    const int64_t items = static_cast<int64_t>(num_active) * blocks_per_group;
    const int64_t per_block = (items + gridDim.x - 1) / gridDim.x;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * per_block;
    const int64_t last = min(items, first + per_block);
    const int chunks = (p.k + kChunk - 1) / kChunk;

    if (warp == kConsumerWarps) {
        // Producer: lane r copies weight row r of each stage.
        uint32_t n_stage = 0;
        for (int64_t item = first; item < last; ++item) {
            const Item it = item_at(p, active, item, blocks_per_group);
            const int passes = (it.count + kRowsPerPass - 1) / kRowsPerPass;
            for (int pass = 0; pass < passes; ++pass) {
                for (int c = 0; c < chunks; ++c, ++n_stage) {
                    const int s = static_cast<int>(n_stage % kStages);
                    const uint32_t phase = (n_stage / kStages) & 1u;
                    const int k0 = c * kChunk;
                    const int cols = min(kChunk, p.k - k0);
                    if (lane == 0) {
                        // The first lap finds every stage free (parity of the phase before).
                        ep::mbarrier_wait_parity(ring.empty_bar(s), phase ^ 1u);
                        ep::mbarrier_arrive_expect_tx(ring.full_bar(s), it.rows * cols * 2);
                    }
                    __syncwarp();
                    if (lane < it.rows) {
                        ep::bulk_load(ring.stage(s) + lane * kChunk * 2,
                                      it.w + static_cast<int64_t>(it.row0 + lane) * p.k + k0,
                                      cols * 2, ring.full_bar(s));
                    }
                }
            }
        }
        return;
    }

    // Consumers.
    const int rows_of_warp[2] = {kSwiglu ? warp : 2 * warp, kSwiglu ? warp + 8 : 2 * warp + 1};
    const int out_cols = kSwiglu ? p.n / 2 : p.n;
    uint32_t n_stage = 0;
    for (int64_t item = first; item < last; ++item) {
        const Item it = item_at(p, active, item, blocks_per_group);
        for (int r0 = 0; r0 < it.count; r0 += kRowsPerPass) {
            const int rows = min(kRowsPerPass, it.count - r0);
            const int4* x[kRowsPerPass];
#pragma unroll
            for (int r = 0; r < kRowsPerPass; ++r) {
                // Rows past `rows` point at the first one (read, never stored).
                x[r] = reinterpret_cast<const int4*>(it.x + static_cast<int64_t>(r0 + (r < rows ? r : 0)) * p.k);
            }
            float acc[2][kRowsPerPass] = {};
            for (int c = 0; c < chunks; ++c, ++n_stage) {
                const int s = static_cast<int>(n_stage % kStages);
                const uint32_t phase = (n_stage / kStages) & 1u;
                const int vec0 = c * (kChunk / kVec);
                const int vecs = (min(kChunk, p.k - c * kChunk)) / kVec;
                ep::mbarrier_wait_parity(ring.full_bar(s), phase);
                const int4* st = reinterpret_cast<const int4*>(ring_smem + s * kStageBytes);
#pragma unroll
                for (int u = 0; u < kVecsPerLane; ++u) {
                    const int v = lane + u * ep::kWarpSize;
                    if (v < vecs) {
                        const int4 w0 = st[rows_of_warp[0] * (kChunk / kVec) + v];
                        const int4 w1 = st[rows_of_warp[1] * (kChunk / kVec) + v];
#pragma unroll
                        for (int r = 0; r < kRowsPerPass; ++r) {
                            if (r < rows) {
                                const int4 xv = __ldg(x[r] + vec0 + v);
                                acc[0][r] += dot8(w0, xv);
                                acc[1][r] += dot8(w1, xv);
                            }
                        }
                    }
                }
                __syncwarp();
                if (lane == 0) {
                    ep::mbarrier_arrive(ring.empty_bar(s));
                }
            }
#pragma unroll
            for (int r = 0; r < kRowsPerPass; ++r) {
                const float s0 = warp_sum(acc[0][r]);
                const float s1 = warp_sum(acc[1][r]);
                if (lane != 0 || r >= rows) {
                    continue;
                }
                const int64_t row = static_cast<int64_t>(it.g) * p.m_max + r0 + r;
                if (kSwiglu) {
                    p.d[row * out_cols + it.row0 / 2 + warp] = ep::f32_to_bf16(silu(s0) * s1);
                } else {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int col = it.row0 + rows_of_warp[c];
                        if (col < p.n) {
                            p.d[row * p.n + col] = ep::f32_to_bf16(c == 0 ? s0 : s1);
                        }
                    }
                }
            }
        }
    }
}

EP_KERNEL void __launch_bounds__(kThreads, 1) grouped_gemv_bf16(const __grid_constant__ GemvParams p) {
    gemv_body<false>(p);
}

EP_KERNEL void __launch_bounds__(kThreads, 1)
    grouped_gemv_swiglu_bf16(const __grid_constant__ GemvParams p) {
    gemv_body<true>(p);
}
