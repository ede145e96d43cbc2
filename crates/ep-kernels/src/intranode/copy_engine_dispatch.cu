// Dispatch of the copy-engine path (pack + SM pulls, and the copy streams' wait kernel);
// shared pieces and the protocol: `copy_engine.cuh`. Launchers:
// `src/intranode/cuda/copy_engine_dispatch.rs`.

#include "copy_engine.cuh"

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
    int push_first_chunk_rows;  // chunking of the blocks pushed over NVLink (sm_push_mask)
    int push_max_chunk_rows;
    int pad;
};
EP_CHECK_PARAMS_SIZE(CePackParams, 256);

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
            const bool pushed = (p.sm_push_mask >> lane) & 1;
            const CeChunk c = ce_chunk(m_lane, my_idx, pushed ? p.push_first_chunk_rows : p.first_chunk_rows,
                                       pushed ? p.push_max_chunk_rows : p.max_chunk_rows);
            ce_count_and_publish(ce_count(my_buf, lane, c.index), 1, c.end - c.begin,
                                 ce_flag(buf(p.buffer_ptrs, lane), p.rank, c.index));
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
    int push_first_chunk_rows;  // chunking of the blocks of the sources in local_mask
    int push_max_chunk_rows;
    int pad;
};
EP_CHECK_PARAMS_SIZE(CeSmPullParams, 272);

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
            const bool pushed = (p.local_mask >> s) & 1;
            const CeChunk ch = ce_chunk_at(p.rows[s], c, pushed ? p.push_first_chunk_rows : p.first_chunk_rows,
                                           pushed ? p.push_max_chunk_rows : p.max_chunk_rows);
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
EP_CHECK_PARAMS_SIZE(CeDispatchParams, 536);

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
