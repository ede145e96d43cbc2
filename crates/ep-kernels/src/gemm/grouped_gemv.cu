// Masked grouped GEMM for blocks of a few valid rows (decode): D[g, r, :] = A[g, r, :] x B[g]^T
// for r < counts[g], the same function as the CUTLASS grouped GEMMs (and the host twin
// `grouped_gemm_extra` in src/gemm/host.rs), shaped for the case where reading each active
// group's weight once is the whole cost. Launcher: `grouped_gemm_bf16_extra_cuda` in
// src/gemm/cuda.rs with `GemmTiles::Gemv`.
//
// At one decode token per rank a block holds one row, and a 64-row WGMMA tile spends its
// time waiting for the weights it streams through shared memory. Here there is no tile, only
// the stream: one block per SM, whose producer warp copies weight rows global -> shared with
// 1-D bulk copies (TMA) into a ring of slots (`kRingBytes` in flight per SM), each slot
// completing on its own mbarrier (transaction bytes), while `kConsumerWarps` warps multiply
// the slots with the group's valid input rows (read through L1: every warp reads the same
// rows) and release them on a second mbarrier. A work item is a pair of weight rows of an
// active group; a block takes a contiguous range of items, and the items' units (one per pass
// of `kRowsPerPass` input rows over the pair's weights) go to the consumer warps in turn, each
// unit `chunks` slots of 2 rows x up to `kMaxChunk` columns, so a warp multiplies a whole row
// pair (14 KB rows at k = 7168) per slot and the ring's bookkeeping is a few instructions per
// slot. Register loads instead (a warp's vectors in flight, then a pause while it multiplies
// and reduces) streamed at 73 % of an H200's copy bandwidth; a ring of 1 KB row chunks shared
// by all warps, at 62 %, spent its time on the per-chunk waits. Groups with no rows are
// skipped without reading their weights (every block builds the ordered list of the active
// groups from `counts` first). More than `kRowsPerPass` valid rows are taken in passes over
// the same weights (the second mostly from L2); the launcher picks this kernel only when few
// rows are expected.
//
// `grouped_gemv_swiglu_bf16` is the experts' first GEMM with SwiGLU fused: B is the gate_up
// weight ([n = 2I, k] per group) in the blocked layout of the CUTLASS SwiGLU epilogue
// (csrc/swiglu_epilogue_sm90.cuh: gate rows 8b..8b+7 at rows 16b..16b+7, the matching up rows
// right after them), an item is the gate and the up row of one output column j, and the block
// writes act[r, j] = bf16(silu(gate) * up) ([rows, I], gate and up in f32, one rounding, as
// the CUTLASS epilogue) instead of [gate | up]: one launch and no [rows, 2I] round trip.
//
// Counts are checked like the CUTLASS path's setup kernel does: a negative count, one above
// m_max, or an extra group's count above the rows of extra_a prints the entry and traps.

#include "common.cuh"

namespace {

constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 1) * ep::kWarpSize;  // + the producer warp
constexpr int kWarps = kThreads / ep::kWarpSize;
constexpr int kRingBytes = 192 * 1024;  // weights in flight per SM (Rust: GEMV_RING_BYTES)
constexpr int kMaxChunk = 8192;         // columns (k) of a stage at most: 2 rows x 16 KB
constexpr int kMaxSlots = 32;
constexpr int kRowsPerPass = 2;
constexpr int kMaxGroups = 1024;
constexpr int kVec = 8;     // bf16 per 16-byte vector
constexpr int kUnroll = 4;  // vectors per lane in flight from shared memory

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

// The ring: `slots` slots of one stage each (2 weight rows x `chunk` columns, row r at byte
// r * chunk * 2 of its slot); full[s] completes when the slot's two bulk copies land, empty[s]
// when its consumer warp is done with it. Producer and consumers walk the same sequence of
// units and stages, so both derive a stage's slot and phase from its running index.
//
// A consumer warp may run ahead of the ring by more than one lap (its next unit's stage can be
// 8 units ahead of the slowest warp's, more than the 6 slots of 14 KB rows), and an mbarrier's
// phase parity alone cannot tell its lap L - 2 from lap L. So the producer also writes the
// stage's index into the slot's tag before arming the slot, and a consumer first waits for its
// stage's tag: the producer arms lap L only after lap L - 1 was consumed, hence landed, so
// once the tag is there the parity names lap L.
struct Ring {
    uint32_t base;  // shared address of slot 0
    uint32_t full;  // shared address of full[0] (8 bytes each)
    uint32_t empty;
    int slots;
    int slot_bytes;
    EP_DEVICE int slot(uint32_t stage) const { return static_cast<int>(stage % slots); }
    EP_DEVICE uint32_t phase(uint32_t stage) const { return (stage / slots) & 1u; }
    EP_DEVICE uint32_t addr(uint32_t stage) const { return base + slot(stage) * slot_bytes; }
    EP_DEVICE uint32_t full_bar(uint32_t stage) const { return full + slot(stage) * 8; }
    EP_DEVICE uint32_t empty_bar(uint32_t stage) const { return empty + slot(stage) * 8; }
};

// A pair of weight rows of an active group: SwiGLU the gate and the up row of output column
// `col` (blocked layout), else rows 2 col and 2 col + 1.
struct Pair {
    int g;
    int col;
    int64_t rows[2];  // weight rows, in elements of k from `w`
    int count;        // valid input rows of the group
    const __nv_bfloat16* w;  // the group's weight, [n, k]
    const __nv_bfloat16* x;  // the group's input rows, [count, k]
};

template <bool kSwiglu>
EP_DEVICE Pair pair_at(const GemvParams& p, const int* active, int64_t index, int pairs_per_group) {
    Pair q;
    q.g = active[index / pairs_per_group];
    q.col = static_cast<int>(index % pairs_per_group);
    q.rows[0] = kSwiglu ? (q.col / 8) * 16 + q.col % 8 : 2 * q.col;
    q.rows[1] = q.rows[0] + (kSwiglu ? 8 : 1);
    q.count = p.counts[q.g];
    const bool extra = q.g >= p.first_extra;
    q.w = extra ? p.extra_b + static_cast<int64_t>(q.g - p.first_extra) * p.n * p.k
                : p.b + static_cast<int64_t>(q.g) * p.n * p.k;
    q.x = (extra && p.extra_a != nullptr) ? p.extra_a
                                          : p.a + static_cast<int64_t>(q.g) * p.m_max * p.k;
    return q;
}

// Work: the block's contiguous range of (active group, pair) items; each item takes one unit
// per pass over its weights (kRowsPerPass valid input rows each), unit u goes to consumer warp
// u mod 8, and a unit is `chunks` stages.
template <bool kSwiglu>
__device__ __forceinline__ void gemv_body(const GemvParams& p) {
    extern __shared__ __align__(128) uint8_t ring_smem[];
    __shared__ __align__(8) uint64_t bars[2 * kMaxSlots];
    __shared__ uint32_t tags[kMaxSlots];
    __shared__ int active[kMaxGroups];
    __shared__ int warp_totals[kWarps];
    const int num_active = active_groups(p, active, warp_totals);

    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const int chunk = min(p.k, kMaxChunk);
    const int chunks = (p.k + chunk - 1) / chunk;
    Ring ring;
    ring.base = ep::smem_addr(ring_smem);
    ring.full = ep::smem_addr(&bars[0]);
    ring.empty = ep::smem_addr(&bars[kMaxSlots]);
    ring.slot_bytes = 2 * chunk * 2;
    ring.slots = min(kMaxSlots, kRingBytes / ring.slot_bytes);
    if (threadIdx.x == 0) {
        for (int s = 0; s < ring.slots; ++s) {
            ep::mbarrier_init(ring.full + s * 8, 1);
            ep::mbarrier_init(ring.empty + s * 8, 1);
            tags[s] = 0xffffffffu;
        }
        ep::fence_mbarrier_init();
    }
    __syncthreads();

    const int pairs_per_group = p.n / 2;  // n is a multiple of 8 (SwiGLU: of 16)
    const int64_t items = static_cast<int64_t>(num_active) * pairs_per_group;
    const int64_t per_block = (items + gridDim.x - 1) / gridDim.x;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * per_block;
    const int64_t last = min(items, first + per_block);

    if (warp == kConsumerWarps) {
        // Producer: lanes 0 and 1 copy the pair's two rows of each stage.
        uint32_t stage = 0;
        for (int64_t item = first; item < last; ++item) {
            const Pair q = pair_at<kSwiglu>(p, active, item, pairs_per_group);
            const int passes = (q.count + kRowsPerPass - 1) / kRowsPerPass;
            for (int pass = 0; pass < passes; ++pass) {
                for (int c = 0; c < chunks; ++c, ++stage) {
                    const int k0 = c * chunk;
                    const int cols = min(chunk, p.k - k0);
                    if (lane == 0) {
                        // The first lap finds every slot free (parity of the phase before).
                        ep::mbarrier_wait_parity(ring.empty_bar(stage), ring.phase(stage) ^ 1u);
                        // Published by the arrive's release.
                        reinterpret_cast<volatile uint32_t*>(tags)[ring.slot(stage)] = stage;
                        ep::mbarrier_arrive_expect_tx(ring.full_bar(stage), 2 * cols * 2);
                    }
                    __syncwarp();
                    if (lane < 2) {
                        ep::bulk_load(ring.addr(stage) + lane * chunk * 2,
                                      q.w + (lane == 0 ? q.rows[0] : q.rows[1]) * p.k + k0, cols * 2,
                                      ring.full_bar(stage));
                    }
                }
            }
        }
        return;
    }

    // Consumers.
    const int out_cols = kSwiglu ? p.n / 2 : p.n;
    uint32_t stage = 0;
    uint32_t unit = 0;
    for (int64_t item = first; item < last; ++item) {
        const Pair q = pair_at<kSwiglu>(p, active, item, pairs_per_group);
        for (int r0 = 0; r0 < q.count; r0 += kRowsPerPass, ++unit, stage += chunks) {
            if (unit % kConsumerWarps != static_cast<uint32_t>(warp)) {
                continue;
            }
            const int rows = min(kRowsPerPass, q.count - r0);
            const int4* x[kRowsPerPass];
#pragma unroll
            for (int r = 0; r < kRowsPerPass; ++r) {
                // Rows past `rows` point at the first one (read, never stored).
                x[r] = reinterpret_cast<const int4*>(q.x + static_cast<int64_t>(r0 + (r < rows ? r : 0)) * p.k);
            }
            float acc[2][kRowsPerPass] = {};
            for (int c = 0; c < chunks; ++c) {
                const uint32_t st = stage + c;
                const int vec0 = c * chunk / kVec;
                const int vecs = min(chunk, p.k - c * chunk) / kVec;
                while (reinterpret_cast<volatile uint32_t*>(tags)[ring.slot(st)] != st) {
                }
                ep::mbarrier_wait_parity(ring.full_bar(st), ring.phase(st));
                const int4* w0 = reinterpret_cast<const int4*>(ring_smem + ring.slot(st) * ring.slot_bytes);
                const int4* w1 = w0 + chunk / kVec;
                for (int v0 = lane; v0 < vecs; v0 += ep::kWarpSize * kUnroll) {
                    int4 a[kUnroll];
                    int4 b[kUnroll];
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        const int v = v0 + u * ep::kWarpSize;
                        a[u] = v < vecs ? w0[v] : make_int4(0, 0, 0, 0);
                        b[u] = v < vecs ? w1[v] : make_int4(0, 0, 0, 0);
                    }
#pragma unroll
                    for (int r = 0; r < kRowsPerPass; ++r) {
                        if (r < rows) {
#pragma unroll
                            for (int u = 0; u < kUnroll; ++u) {
                                const int v = v0 + u * ep::kWarpSize;
                                if (v < vecs) {
                                    const int4 xv = __ldg(x[r] + vec0 + v);
                                    acc[0][r] += dot8(a[u], xv);
                                    acc[1][r] += dot8(b[u], xv);
                                }
                            }
                        }
                    }
                }
                __syncwarp();
                if (lane == 0) {
                    ep::mbarrier_arrive(ring.empty_bar(st));
                }
            }
#pragma unroll
            for (int r = 0; r < kRowsPerPass; ++r) {
                const float s0 = warp_sum(acc[0][r]);
                const float s1 = warp_sum(acc[1][r]);
                if (lane != 0 || r >= rows) {
                    continue;
                }
                const int64_t row = static_cast<int64_t>(q.g) * p.m_max + r0 + r;
                if (kSwiglu) {
                    p.d[row * out_cols + q.col] = ep::f32_to_bf16(silu(s0) * s1);
                } else {
                    p.d[row * out_cols + q.rows[0]] = ep::f32_to_bf16(s0);
                    p.d[row * out_cols + q.rows[1]] = ep::f32_to_bf16(s1);
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
