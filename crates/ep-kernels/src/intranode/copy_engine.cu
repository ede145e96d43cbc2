// Copy-engine path of the intranode (NVLink) normal mode. Launchers:
// `src/intranode/cuda/copy_engine/`; design: docs/design.md; the NVLink buffer (flags, chunk
// counters, slots): `csrc/intranode.cuh`. Run after a notify kernel (`notify.cu`).
//
// The NVLink bytes of `copy_engine_peers` peers move by copy engines (cuMemcpyDtoDAsync), those
// of the others by SM warps (next section); `intranode_ce_dispatch` = pack + SM pulls,
// `intranode_ce_combine` = reduce + SM pushes:
//   * dispatch: the pack (`ce_pack`, SMs, local memory only) writes this rank's rows for each
//     peer d, in d's receive order, into slot d of this rank's own buffer and its local rows
//     straight into recv_x; chunk counters in this rank's header count finished rows and the
//     warp that completes a chunk raises flag [rank][chunk] in d's header. The receiver's copy
//     streams (one per source) wait for each chunk (`intranode_ce_wait`, one thread, with the
//     device timeout) and pull it into recv_x with a copy engine.
//   * combine: each rank's copy streams push its rows for home s (a contiguous block of its
//     combine input) into slot [rank] of s's buffer, chunk by chunk, each followed by a stream
//     write of flag [rank][chunk] in the home's header; the reduce (`ce_reduce`) on the home
//     polls those flags in its own memory and sums the rows in rank order.
//
// Slots start at kRingBase: slot d at kRingBase + d * slot_bytes (offsets in the params).
// Chunk c of a block of m rows: see `ce_chunk`, mirrored by `chunk_bounds` in
// src/intranode/ce_layout.rs.
// ---------------------------------------------------------------------------------------------

#include "intranode.cuh"

namespace {

// Chunking of a block of `m` rows: the first chunk has `first` rows, each next one twice the
// previous, up to `cap` = max(max_rows, ceil(m / 16)) (first is raised to cap / 256 so that
// there are at most kCeMaxChunks chunks). Returns the chunk of row `idx` and its bounds.
struct CeChunk {
    int index;
    int begin;
    int end;
};

EP_DEVICE CeChunk ce_chunk(int m, int idx, int first_rows, int max_rows) {
    const int cap = max(max_rows, (m + 15) / 16);
    int size = min(max(first_rows, cap / 256), cap);
    int begin = 0;
    int j = 0;
    while (idx >= begin + size) {
        begin += size;
        size = min(2 * size, cap);
        ++j;
    }
    return CeChunk{j, begin, min(begin + size, m)};
}

constexpr int kCeThreads = 768;
constexpr int kCePackUnroll = 7;

}  // namespace

// Mirrors `CePackParams` in src/intranode/cuda/copy_engine/params.rs.
struct CePackParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int4* x;                // [T, row_int4]
    const float* x_scales;        // [T, S] or null
    const int64_t* topk_idx;      // [T, K] or null
    const float* topk_weights;    // [T, K] or null
    const int* send_index;        // [T, R]
    const int* rank_prefix_matrix;  // [R, R]
    int4* recv_x;                 // [N, row_int4]
    float* recv_x_scales;         // [N, S] or null
    int* recv_src_idx;            // [N]
    int64_t* recv_topk_idx;       // [N, K] or null
    float* recv_topk_weights;     // [N, K] or null
    int64_t slot_bytes;
    int64_t off_scales;
    int64_t off_src;
    int64_t off_topk_idx;
    int64_t off_topk_weights;
    int rank;
    int num_ranks;
    int num_tokens;
    int row_int4;
    int num_scales;
    int num_topk;
    int experts_per_rank;
    int first_chunk_rows;
    int max_chunk_rows;
    int sm_push_mask;  // bit d: peer d's rows go straight into slot [rank] of d's buffer
    int own_rows_last;  // 1: the peers' rows before this rank's own rows, from the work queues
    int local_warps;    // warps per block that start on the local stores (see `ce_pack`)
    int local_blocks;   // blocks [0, local_blocks) start on the local stores with every warp
    int pad;
};
EP_CHECK_PARAMS_SIZE(CePackParams, 248);

// Blocks [0, nblocks) of kCeThreads; each warp stores one token's rows per work item, items in
// token order within each pass (so early chunks complete first; see the work items below).
__device__ void ce_pack(const CePackParams& p, int block, int nblocks) {
    const int R = p.num_ranks, K = p.num_topk, S = p.num_scales, L = p.experts_per_rank;
    const int lane = ep::lane_id();
    const int warps = nblocks * (kCeThreads / ep::kWarpSize);
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    char* ce_base = my_buf + kRingBase;
    // Where the rows for peer d go: slot d of this rank's buffer (a copy engine or the peer's
    // SM pull blocks fetch them), or slot [rank] of d's buffer (pushed here over NVLink; the
    // peer copies them out locally).
    auto slot_of = [&](int d) -> char* {
        return (p.sm_push_mask >> d) & 1 ? buf(p.buffer_ptrs, d) + kRingBase + p.rank * p.slot_bytes
                                         : ce_base + d * p.slot_bytes;
    };
    // Rows this rank sends to peer `lane` (block size there) and where its own block starts.
    int m_lane = 0;
    if (lane < R) {
        const int prev = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + lane] : 0;
        m_lane = p.rank_prefix_matrix[p.rank * R + lane] - prev;
    }
    const int own_base = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + p.rank] : 0;

    // Work items are (pass, token); a pass is the set of destinations whose rows it stores.
    // One pass over the tokens stores every destination's row (`own_rows_last == 0`, each row
    // read once, items handed out statically). Otherwise the items come from three queues in
    // this rank's header, one token at a time in token order, so that the chunks complete in
    // order whatever the warps' speeds (handed out statically, the slowest warps held the first
    // chunks back by two rounds, measured on a timeline):
    //   queue 0: the rows of the peers that fetch them from this rank's slots (the copy
    //            engines' peers), which the copy engines wait for;
    //   queue 1: the rows pushed over NVLink into the peers' slots;
    //   queue 2: this rank's own rows, which nobody waits for.
    // Warps of the local role (blocks [0, local_blocks), and warps [0, local_warps) of the
    // others) take queues 0, 1, 2 in turn, the others 1, 0, 2: each moves to its next queue once
    // the current one is empty.
    const uint32_t all = (1u << R) - 1u;
    const uint32_t own_mask = 1u << p.rank;
    const uint32_t push_mask = static_cast<uint32_t>(p.sm_push_mask) & all & ~own_mask;
    const uint32_t local_mask = all & ~own_mask & ~push_mask;
    const int T = p.num_tokens;
    const bool queued = p.own_rows_last != 0;
    const bool local_role = block < p.local_blocks || ep::warp_id() < p.local_warps;
    // This warp's queue order, two bits per queue.
    const int order = local_role ? (0 | 1 << 2 | 2 << 4) : (1 | 0 << 2 | 2 << 4);
    int qi = 0;
    int next_static = block * (kCeThreads / ep::kWarpSize) + ep::warp_id();
    for (;;) {
        uint32_t pass_mask;
        int t;
        if (!queued) {
            if (next_static >= T) {
                break;
            }
            t = next_static;
            next_static += warps;
            pass_mask = all;
        } else {
            if (qi == 3) {
                break;
            }
            const int q = (order >> (2 * qi)) & 3;
            pass_mask = q == 0 ? local_mask : (q == 1 ? push_mask : own_mask);
            if (pass_mask == 0) {
                ++qi;
                continue;
            }
            int item = 0;
            if (lane == 0) {
                item = atomicAdd(ce_work(my_buf, q), 1);
            }
            item = __shfl_sync(ep::kFullMask, item, 0);
            if (item >= T) {
                ++qi;
                continue;
            }
            t = item;
        }
        const int my_idx = lane < R ? p.send_index[static_cast<int64_t>(t) * R + lane] : -1;
        int idx[kMaxRanks];
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            idx[d] = (pass_mask >> d) & 1u ? __shfl_sync(ep::kFullMask, my_idx, d) : -1;
        }
        bool any = false;
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            any |= d < R && idx[d] >= 0;
        }
        if (!any) {
            continue;
        }
        // Row: loaded once, stored to every destination.
        const int4* src = p.x + static_cast<int64_t>(t) * p.row_int4;
        for (int base = 0; base < p.row_int4; base += ep::kWarpSize * kCePackUnroll) {
            int4 v[kCePackUnroll];
#pragma unroll
            for (int u = 0; u < kCePackUnroll; ++u) {
                const int i = base + u * ep::kWarpSize + lane;
                if (i < p.row_int4) {
                    v[u] = ep::ld_nc_no_alloc(src + i);
                }
            }
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d) {
                if (d < R && idx[d] >= 0) {
                    int4* dst = d == p.rank
                                    ? p.recv_x + static_cast<int64_t>(own_base + idx[d]) * p.row_int4
                                    : reinterpret_cast<int4*>(slot_of(d)) +
                                          static_cast<int64_t>(idx[d]) * p.row_int4;
#pragma unroll
                    for (int u = 0; u < kCePackUnroll; ++u) {
                        const int i = base + u * ep::kWarpSize + lane;
                        if (i < p.row_int4) {
                            dst[i] = v[u];
                        }
                    }
                }
            }
        }
        // Source index, localised routing, scales.
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            if (d >= R || idx[d] < 0) {
                continue;
            }
            const bool own = d == p.rank;
            const int64_t row = own ? own_base + idx[d] : idx[d];
            char* slot = own ? ce_base : slot_of(d);
            if (lane == 0) {
                (own ? p.recv_src_idx : reinterpret_cast<int*>(slot + p.off_src))[row] = t;
            }
            if (p.topk_idx != nullptr) {
                int64_t* out_idx = own ? p.recv_topk_idx : reinterpret_cast<int64_t*>(slot + p.off_topk_idx);
                float* out_w = own ? p.recv_topk_weights : reinterpret_cast<float*>(slot + p.off_topk_weights);
                for (int k = lane; k < K; k += ep::kWarpSize) {
                    const int64_t e = p.topk_idx[static_cast<int64_t>(t) * K + k];
                    const bool here = e >= static_cast<int64_t>(d) * L && e < static_cast<int64_t>(d + 1) * L;
                    out_idx[row * K + k] = here ? e - static_cast<int64_t>(d) * L : -1;
                    out_w[row * K + k] = here ? p.topk_weights[static_cast<int64_t>(t) * K + k] : 0.0f;
                }
            }
            if (S > 0) {
                float* out_s = own ? p.recv_x_scales : reinterpret_cast<float*>(slot + p.off_scales);
                for (int j = lane; j < S; j += ep::kWarpSize) {
                    out_s[row * S + j] = p.x_scales[static_cast<int64_t>(t) * S + j];
                }
            }
        }
        // Count the rows into their chunks; the warp that completes a chunk raises the flag in
        // the destination's header. No system fence per token, also for rows pushed over
        // NVLink: the warp barrier orders every lane's stores before the counting lane's
        // release (gpu scope); the completing lane's add reads the end of that release
        // sequence and its `fence.acq_rel.sys` makes it an acquire, so every counted row
        // precedes, in causality order, the system-scope release of the flag, which the
        // reader acquires (the PTX model's cumulativity; docs/design.md, normal mode through
        // the copy engines).
        __syncwarp();
        if (lane < R && lane != p.rank && ((pass_mask >> lane) & 1u) && my_idx >= 0) {
            const CeChunk c = ce_chunk(m_lane, my_idx, p.first_chunk_rows, p.max_chunk_rows);
            const int done = ep::atomic_add_release_gpu(ce_count(my_buf, lane, c.index), 1) + 1;
            if (done == c.end - c.begin) {
                ep::fence_acq_rel_sys();
                ep::st_release_sys(ce_flag(buf(p.buffer_ptrs, lane), p.rank, c.index), 1);
            }
        }
    }
}

// Mirrors `CeWaitParams` in src/intranode/cuda/copy_engine/params.rs.
struct CeWaitParams {
    const int* flag;
    int* error_info;
    uint64_t timeout_ns;
    int rank;
    int awaited;
};
EP_CHECK_PARAMS_SIZE(CeWaitParams, 32);

// One thread: returns once `*flag` is set (a chunk arrived), or records a timeout naming the
// source and returns (the copy after it then moves stale bytes; the host reports the error).
EP_KERNEL void intranode_ce_wait(const CeWaitParams p) {
    const ep::Deadline deadline = ep::Deadline::after(p.timeout_ns);
    bool timed_out = false;
    ep::wait_flag_sys(p.flag, [](int v) { return v != 0; }, deadline, &timed_out);
    if (timed_out) {
        report_timeout(p.error_info, kCeWaitKernel, p.rank, p.awaited, kSiteCeWait);
    }
}

// Mirrors `CeReduceParams` in src/intranode/cuda/copy_engine/params.rs.
struct CeReduceParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int4* x;                  // [N, row_int4] this rank's combine input
    const float* topk_weights;      // [N, K] or null
    const int* send_index;          // [T, R] from the dispatch
    const int* rank_prefix_matrix;  // [R, R]
    int4* combined_x;               // [T, row_int4]
    float* combined_topk_weights;   // [T, K] or null
    int* error_info;
    uint64_t timeout_ns;
    int64_t slot_bytes;
    int64_t off_weights;
    int rank;
    int num_ranks;
    int num_tokens;
    int row_int4;
    int num_topk;
    int first_chunk_rows;
    int max_chunk_rows;
    int pad;
    const int4* bias;               // [T, row_int4] bf16 added to every combined row, or null
};
EP_CHECK_PARAMS_SIZE(CeReduceParams, 184);

// Blocks [0, nblocks) of kCeThreads; one warp per token, tokens in order over the blocks. kR
// bounds the ranks (R <= kR); each lane keeps kR * kU = 8 row loads in flight (kU = 8 / kR
// consecutive int4 of every source), which is what bounds a reduce that is latency-bound.
template <int kR>
__device__ void ce_reduce(const CeReduceParams& p, int block, int nblocks) {
    constexpr int kU = 8 / kR;
    const int R = p.num_ranks, K = p.num_topk;
    const int lane = ep::lane_id();
    const int warps = nblocks * (kCeThreads / ep::kWarpSize);
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    char* ce_base = my_buf + kRingBase;
    // Lane d tracks peer d: rows it returns (its block for this rank), chunks seen ready, and
    // whether it timed out.
    int m_lane = 0;
    if (lane < R) {
        const int prev = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + lane] : 0;
        m_lane = p.rank_prefix_matrix[p.rank * R + lane] - prev;
    }
    const int own_base = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + p.rank] : 0;
    int ready = 0;
    bool dead = false;

    for (int t = block * (kCeThreads / ep::kWarpSize) + ep::warp_id(); t < p.num_tokens; t += warps) {
        int my_idx = lane < R ? p.send_index[static_cast<int64_t>(t) * R + lane] : -1;
        if (lane < R && lane != p.rank && my_idx >= 0) {
            const CeChunk c = ce_chunk(m_lane, my_idx, p.first_chunk_rows, p.max_chunk_rows);
            while (!dead && ready <= c.index) {
                const ep::Deadline deadline = ep::Deadline::after(p.timeout_ns);
                bool timed_out = false;
                ep::wait_flag_sys(ce_flag(my_buf, lane, ready),
                                  [](int v) { return v != 0; }, deadline, &timed_out);
                if (timed_out) {
                    report_timeout(p.error_info, kCeReduceKernel, p.rank, lane, kSiteCeReduce);
                    dead = true;
                } else {
                    ++ready;
                }
            }
            if (dead) {
                my_idx = -1;
            }
        }
        // Source d's row index (-1 when d sends none; d >= R never sends).
        int idx[kR];
#pragma unroll
        for (int d = 0; d < kR; ++d) {
            idx[d] = d < R ? __shfl_sync(ep::kFullMask, my_idx, d) : -1;
        }
        const int4* const slots = reinterpret_cast<const int4*>(ce_base);
        const int64_t slot_int4 = p.slot_bytes / 16;
        for (int base = lane; base < p.row_int4; base += ep::kWarpSize * kU) {
            int4 v[kR][kU];
#pragma unroll
            for (int d = 0; d < kR; ++d) {
                const int4* row = d == p.rank ? p.x + static_cast<int64_t>(own_base + idx[d]) * p.row_int4
                                              : slots + d * slot_int4 + static_cast<int64_t>(idx[d]) * p.row_int4;
#pragma unroll
                for (int u = 0; u < kU; ++u) {
                    const int i = base + u * ep::kWarpSize;
                    if (idx[d] >= 0 && i < p.row_int4) {
                        v[d][u] = d == p.rank ? __ldg(row + i) : __ldcg(row + i);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                const int i = base + u * ep::kWarpSize;
                if (i >= p.row_int4) {
                    break;
                }
                // The sum starts from the bias (zero without one), then adds the ranks' rows.
                int4 b = make_int4(0, 0, 0, 0);
                if (p.bias != nullptr) {
                    b = ep::ld_nc_no_alloc(p.bias + static_cast<int64_t>(t) * p.row_int4 + i);
                }
                const __nv_bfloat16* bh = reinterpret_cast<const __nv_bfloat16*>(&b);
                float acc[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    acc[j] = ep::bf16_to_f32(bh[j]);
                }
#pragma unroll
                for (int d = 0; d < kR; ++d) {
                    if (idx[d] >= 0) {
                        const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v[d][u]);
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            acc[j] = __fadd_rn(acc[j], ep::bf16_to_f32(h[j]));
                        }
                    }
                }
                int4 o;
                __nv_bfloat16* oh = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    oh[j] = ep::f32_to_bf16(acc[j]);
                }
                p.combined_x[static_cast<int64_t>(t) * p.row_int4 + i] = o;
            }
        }
        if (p.combined_topk_weights != nullptr) {
            for (int k = lane; k < K; k += ep::kWarpSize) {
                float acc = 0.0f;
#pragma unroll
                for (int d = 0; d < kR; ++d) {
                    if (idx[d] >= 0) {
                        const float w =
                            d == p.rank
                                ? p.topk_weights[static_cast<int64_t>(own_base + idx[d]) * K + k]
                                : reinterpret_cast<const float*>(ce_base + d * p.slot_bytes + p.off_weights)
                                      [static_cast<int64_t>(idx[d]) * K + k];
                        acc = __fadd_rn(acc, w);
                    }
                }
                p.combined_topk_weights[static_cast<int64_t>(t) * K + k] = acc;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Copy-engine path, SM peers. The copy engines of one GPU do not add up over peers (measured:
// docs/benchmarks.md, "What NVLink carries"), so beyond 2 ranks the copy engines serve
// `copy_engine_peers` peers and SM warps move the bytes of the others, with the same slots,
// chunks and flags, so the receive side cannot tell which engine moved a chunk:
//   * dispatch: the SM pull blocks (`ce_sm_pull`) on the receiver wait for each chunk's flag
//     (raised by the source's pack) and copy the chunk's rows and metadata into recv_x and the
//     metadata outputs: from the source's slot over NVLink, or, between peers that both use
//     SM copies (`sm_push_mask` / `local_mask`), from the receiver's own slot [source], into
//     which the source's pack stored the rows directly over NVLink;
//   * combine: the SM push blocks (`ce_sm_push`) copy this rank's rows for each home (a
//     contiguous block of its combine input) into slot [rank] of the home's buffer (NVLink
//     stores), count them into the chunk counters of their own header, and the warp that
//     completes a chunk raises flag [rank][chunk] in the home's header, which the home's reduce
//     polls.
// All warps stream each (chunk, peer) block side by side, chunk-major, so early chunks complete
// first, and peers in rotated order (rank + 1, rank + 2, ... for pushes, rank - 1, ... for
// pulls), so that each GPU talks to one SM peer at a time and no GPU is hit by two while
// another idles; in the push a warp fences and counts itself once per (chunk, peer).
//
// Both run as extra blocks of the pack and reduce kernels, not as kernels of their own on
// another stream: the reduce waits for peers' pushes, and two streams may share one hardware
// queue, where a push kernel queued behind its own rank's reduce would never start.
// ---------------------------------------------------------------------------------------------

namespace {


constexpr int kCeSmUnroll = 7;

// Bounds of chunk `c` of a block of `m` rows (`ce_chunk`'s schedule); begin >= m past the end.
EP_DEVICE CeChunk ce_chunk_at(int m, int c, int first_rows, int max_rows) {
    const int cap = max(max_rows, (m + 15) / 16);
    int size = min(max(first_rows, cap / 256), cap);
    int begin = 0;
    for (int j = 0; j < c; ++j) {
        begin += size;
        size = min(2 * size, cap);
    }
    return CeChunk{c, min(begin, m), min(begin + size, m)};
}

// This warp's share (warp `gw` of `warps`) of copying `n` elements of T from `src` to `dst`:
// elements gw * 32 + lane + k * warps * 32, kCeSmUnroll independent loads in flight per lane,
// so that every warp of the kernel streams the same contiguous block side by side.
template <typename T, bool kRemoteSrc>
EP_DEVICE void warp_share_copy(T* dst, const T* src, int64_t n, int gw, int warps, int lane) {
    const int64_t stride = static_cast<int64_t>(warps) * ep::kWarpSize;
    int64_t i = static_cast<int64_t>(gw) * ep::kWarpSize + lane;
    for (; i + (kCeSmUnroll - 1) * stride < n; i += kCeSmUnroll * stride) {
        T v[kCeSmUnroll];
#pragma unroll
        for (int u = 0; u < kCeSmUnroll; ++u) {
            v[u] = kRemoteSrc ? __ldcg(src + i + u * stride) : __ldg(src + i + u * stride);
        }
#pragma unroll
        for (int u = 0; u < kCeSmUnroll; ++u) {
            dst[i + u * stride] = v[u];
        }
    }
    for (; i < n; i += stride) {
        dst[i] = kRemoteSrc ? __ldcg(src + i) : __ldg(src + i);
    }
}

}  // namespace

// Mirrors `CeSmPushParams` in src/intranode/cuda/copy_engine/params.rs.
struct CeSmPushParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int4* x;              // [N, row_int4] this rank's combine input
    const float* topk_weights;  // [N, K] or null
    int64_t slot_bytes;
    int64_t off_weights;
    int row_begin[kMaxRanks];  // first row of x returned to home d
    int rows[kMaxRanks];       // rows returned to home d by this kernel (0: not by SMs)
    int rank;
    int num_ranks;
    int row_int4;
    int num_topk;
    int first_chunk_rows;
    int max_chunk_rows;
    int pad[2];
};
EP_CHECK_PARAMS_SIZE(CeSmPushParams, 192);

// Blocks [0, nblocks) of kCeThreads.
__device__ void ce_sm_push(const CeSmPushParams& p, int block, int nblocks) {
    const int lane = ep::lane_id();
    const int warps = nblocks * (kCeThreads / ep::kWarpSize);
    const int gw = block * (kCeThreads / ep::kWarpSize) + ep::warp_id();
    const int K = p.num_topk;
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    for (int c = 0; c < kCeMaxChunks; ++c) {
        bool any = false;
        // Homes in the order rank + 1, rank + 2, ...: at any moment every GPU receives from
        // one pusher, instead of several pushing into the same GPU while others idle.
        for (int k = 1; k < p.num_ranks; ++k) {
            const int d = (p.rank + k) % p.num_ranks;
            const CeChunk ch = ce_chunk_at(p.rows[d], c, p.first_chunk_rows, p.max_chunk_rows);
            if (ch.begin >= ch.end) {
                continue;
            }
            any = true;
            // Rows [begin, end) are contiguous in x (from row_begin[d]) and in the slot.
            char* slot = buf(p.buffer_ptrs, d) + kRingBase + p.rank * p.slot_bytes;
            const int64_t src_row = p.row_begin[d] + ch.begin;
            const int64_t rows = ch.end - ch.begin;
            warp_share_copy<int4, false>(reinterpret_cast<int4*>(slot) + ch.begin * static_cast<int64_t>(p.row_int4),
                                         p.x + src_row * p.row_int4, rows * p.row_int4, gw, warps, lane);
            if (p.topk_weights != nullptr) {
                warp_share_copy<float, false>(reinterpret_cast<float*>(slot + p.off_weights) + ch.begin * static_cast<int64_t>(K),
                                              p.topk_weights + src_row * K, rows * K, gw, warps, lane);
            }
            // This warp's NVLink stores reach the system before it counts itself in; the warp
            // completing the count (every warp of the kernel counts once) publishes the chunk.
            ep::fence_acq_rel_sys();
            __syncwarp();
            if (lane == 0) {
                const int done = ep::atomic_add_release_gpu(ce_count(my_buf, d, c), 1) + 1;
                if (done == warps) {
                    ep::fence_acq_rel_sys();
                    ep::st_release_sys(ce_flag(buf(p.buffer_ptrs, d), p.rank, c), 1);
                }
            }
        }
        if (!any) {
            break;
        }
    }
}

// Mirrors `CeSmPullParams` in src/intranode/cuda/copy_engine/params.rs.
struct CeSmPullParams {
    uint64_t buffer_ptrs[kMaxRanks];
    int4* recv_x;               // [N, row_int4]
    float* recv_x_scales;       // [N, S] or null
    int* recv_src_idx;          // [N]
    int64_t* recv_topk_idx;     // [N, K] or null
    float* recv_topk_weights;   // [N, K] or null
    int* error_info;
    uint64_t timeout_ns;
    int64_t slot_bytes;
    int64_t off_scales;
    int64_t off_src;
    int64_t off_topk_idx;
    int64_t off_topk_weights;
    int row_begin[kMaxRanks];  // first receive row of source s
    int rows[kMaxRanks];       // rows from source s pulled by this kernel (0: not by SMs)
    int rank;
    int num_ranks;
    int row_int4;
    int num_scales;
    int num_topk;
    int first_chunk_rows;
    int max_chunk_rows;
    int sm_rows_mask;  // bit s: rows of source s move here (else only its metadata)
    int local_mask;    // bit s: source s pushed its rows into slot [s] of this rank's buffer
    int pad;
};
EP_CHECK_PARAMS_SIZE(CeSmPullParams, 264);

// Blocks [0, nblocks) of kCeThreads. Copies every source's metadata (src index,
// localised routing, scales) and the rows of the sources in `sm_rows_mask` (the others' rows
// move by copy engines). A source whose flag does not come within the timeout is recorded
// (naming it) and skipped; its rows stay unwritten.
__device__ void ce_sm_pull(const CeSmPullParams& p, int block, int nblocks) {
    const int lane = ep::lane_id();
    const int warps = nblocks * (kCeThreads / ep::kWarpSize);
    const int gw = block * (kCeThreads / ep::kWarpSize) + ep::warp_id();
    const int K = p.num_topk, S = p.num_scales;
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    unsigned dead = 0;  // bit s: source s timed out
    for (int c = 0; c < kCeMaxChunks; ++c) {
        bool any = false;
        // Sources in the order rank - 1, rank - 2, ...: at any moment every GPU is pulled from
        // by one receiver, instead of several pulling from the same GPU while others idle.
        for (int k = 1; k < p.num_ranks; ++k) {
            const int s = (p.rank + p.num_ranks - k) % p.num_ranks;
            const CeChunk ch = ce_chunk_at(p.rows[s], c, p.first_chunk_rows, p.max_chunk_rows);
            if (ch.begin >= ch.end) {
                continue;
            }
            any = true;
            if ((dead >> s) & 1u) {
                continue;
            }
            int ok = 1;
            if (lane == 0) {
                const ep::Deadline deadline = ep::Deadline::after(p.timeout_ns);
                bool timed_out = false;
                ep::wait_flag_sys(ce_flag(my_buf, s, c), [](int v) { return v != 0; }, deadline, &timed_out);
                if (timed_out) {
                    report_timeout(p.error_info, kCeSmPullKernel, p.rank, s, kSiteCeSmPull);
                    ok = 0;
                }
            }
            if (!__shfl_sync(ep::kFullMask, ok, 0)) {
                dead |= 1u << s;
                continue;
            }
            // Rows [begin, end) of the slot and their metadata are contiguous, and so are
            // receive rows row_begin[s] + [begin, end) of each output.
            const char* slot = (p.local_mask >> s) & 1 ? my_buf + kRingBase + s * p.slot_bytes
                                                       : buf(p.buffer_ptrs, s) + kRingBase + p.rank * p.slot_bytes;
            const int64_t dst_row = p.row_begin[s] + ch.begin;
            const int64_t rows = ch.end - ch.begin;
            if ((p.sm_rows_mask >> s) & 1) {
                warp_share_copy<int4, true>(p.recv_x + dst_row * p.row_int4,
                                            reinterpret_cast<const int4*>(slot) + ch.begin * static_cast<int64_t>(p.row_int4),
                                            rows * p.row_int4, gw, warps, lane);
            }
            warp_share_copy<int, true>(p.recv_src_idx + dst_row,
                                       reinterpret_cast<const int*>(slot + p.off_src) + ch.begin, rows, gw, warps, lane);
            if (K > 0) {
                warp_share_copy<long long, true>(
                    reinterpret_cast<long long*>(p.recv_topk_idx) + dst_row * K,
                    reinterpret_cast<const long long*>(slot + p.off_topk_idx) + ch.begin * static_cast<int64_t>(K), rows * K,
                    gw, warps, lane);
                warp_share_copy<float, true>(p.recv_topk_weights + dst_row * K,
                                             reinterpret_cast<const float*>(slot + p.off_topk_weights) + ch.begin * static_cast<int64_t>(K),
                                             rows * K, gw, warps, lane);
            }
            if (S > 0) {
                warp_share_copy<float, true>(p.recv_x_scales + dst_row * S,
                                             reinterpret_cast<const float*>(slot + p.off_scales) + ch.begin * static_cast<int64_t>(S),
                                             rows * S, gw, warps, lane);
            }
        }
        if (!any) {
            break;
        }
    }
}

// Mirrors `CeDispatchParams` in src/intranode/cuda/copy_engine/params.rs.
struct CeDispatchParams {
    CePackParams pack;
    CeSmPullParams pull;
    int pack_blocks;  // blocks [0, pack_blocks) pack, the rest pull
    int pad;
};
EP_CHECK_PARAMS_SIZE(CeDispatchParams, 520);

// Grid: pack_blocks + any number of pull blocks (none when no peer sends rows), all of
// kCeThreads and resident at once (the pull waits only for peers' packs).
EP_KERNEL void __launch_bounds__(kCeThreads, 1) intranode_ce_dispatch(const CeDispatchParams p) {
    const int b = static_cast<int>(blockIdx.x);
    if (b < p.pack_blocks) {
        ce_pack(p.pack, b, p.pack_blocks);
    } else {
        ce_sm_pull(p.pull, b - p.pack_blocks, static_cast<int>(gridDim.x) - p.pack_blocks);
    }
}

// Mirrors `CeCombineParams` in src/intranode/cuda/copy_engine/params.rs.
struct CeCombineParams {
    CeReduceParams reduce;
    CeSmPushParams push;
    int reduce_blocks;  // blocks [0, reduce_blocks) reduce, the rest push
    int pad;
};
EP_CHECK_PARAMS_SIZE(CeCombineParams, 384);

// Grid: reduce_blocks + any number of push blocks (none when the copy engines serve every
// home), all of kCeThreads and resident at once: the reduce waits for every peer's pushes,
// which wait for nothing.
EP_KERNEL void __launch_bounds__(kCeThreads, 1) intranode_ce_combine(const CeCombineParams p) {
    const int b = static_cast<int>(blockIdx.x);
    if (b < p.reduce_blocks) {
        if (p.reduce.num_ranks <= 2) {
            ce_reduce<2>(p.reduce, b, p.reduce_blocks);
        } else if (p.reduce.num_ranks <= 4) {
            ce_reduce<4>(p.reduce, b, p.reduce_blocks);
        } else {
            ce_reduce<8>(p.reduce, b, p.reduce_blocks);
        }
    } else {
        ce_sm_push(p.push, b - p.reduce_blocks, static_cast<int>(gridDim.x) - p.reduce_blocks);
    }
}
