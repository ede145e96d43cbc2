// Combine of the copy-engine path (reduce + SM pushes, or both roles in every block); shared
// pieces and the protocol: `copy_engine.cuh`. Launchers:
// `src/intranode/cuda/copy_engine_combine.rs`.

#include "copy_engine.cuh"

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

// A warp's state across the tokens it reduces (in increasing token order): lane d tracks peer
// d, the rows it returns (its block for this rank), the chunks seen ready and whether it timed
// out.
struct CeReduceWarp {
    int m_lane;
    int own_base;
    int ready;
    bool dead;
};

EP_DEVICE CeReduceWarp ce_reduce_warp(const CeReduceParams& p) {
    const int R = p.num_ranks;
    const int lane = ep::lane_id();
    CeReduceWarp w{0, 0, 0, false};
    if (lane < R) {
        const int prev = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + lane] : 0;
        w.m_lane = p.rank_prefix_matrix[p.rank * R + lane] - prev;
    }
    w.own_base = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + p.rank] : 0;
    return w;
}

// Reduces token t with one warp: waits for the chunks holding its rows, then sums them in rank
// order. kR bounds the ranks (R <= kR); each lane keeps kR * kU = 8 row loads in flight (kU =
// 8 / kR consecutive int4 of every source), which is what bounds a reduce that is
// latency-bound. The tokens one warp reduces must increase (`st.ready` only moves forward).
template <int kR>
__device__ void ce_reduce_token(const CeReduceParams& p, int t, CeReduceWarp& st) {
    constexpr int kU = 8 / kR;
    const int R = p.num_ranks, K = p.num_topk;
    const int lane = ep::lane_id();
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    char* ce_base = my_buf + kRingBase;
    const int m_lane = st.m_lane;
    const int own_base = st.own_base;
    int& ready = st.ready;
    bool& dead = st.dead;
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

// Blocks [0, nblocks) of kCeThreads; one warp per token, tokens in order over the blocks.
template <int kR>
__device__ void ce_reduce(const CeReduceParams& p, int block, int nblocks) {
    const int warps = nblocks * (kCeThreads / ep::kWarpSize);
    CeReduceWarp st = ce_reduce_warp(p);
    for (int t = block * (kCeThreads / ep::kWarpSize) + ep::warp_id(); t < p.num_tokens; t += warps) {
        ce_reduce_token<kR>(p, t, st);
    }
}

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
    int combine_ce_tail_chunks;  // the last chunks of each home that the copy engines push instead
    int pad;
};
EP_CHECK_PARAMS_SIZE(CeSmPushParams, 192);

// Chunks the SM warps push to home `d`: all of its block but the last `combine_ce_tail_chunks`.
EP_DEVICE int ce_sm_chunks(const CeSmPushParams& p, int d) {
    return max(0, ce_num_chunks(p.rows[d], p.first_chunk_rows, p.max_chunk_rows) - p.combine_ce_tail_chunks);
}

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
            if (ch.begin >= ch.end || c >= ce_sm_chunks(p, d)) {
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
                ce_count_and_publish(ce_count(my_buf, d, c), 1, warps,
                                     ce_flag(buf(p.buffer_ptrs, d), p.rank, c));
            }
        }
        if (!any) {
            break;
        }
    }
}

// Mirrors `CeCombineParams` in src/intranode/cuda/copy_engine/params.rs.
struct CeCombineParams {
    CeReduceParams reduce;
    CeSmPushParams push;
    int reduce_blocks;  // intranode_ce_combine: blocks [0, reduce_blocks) reduce, the rest push
    int push_warps;     // intranode_ce_combine_roles: every block's warps [0, push_warps) push,
                        // then reduce; the others reduce
};
EP_CHECK_PARAMS_SIZE(CeCombineParams, 384);

namespace {

// Rows of x one push work item stores into a home's slot (`ce_push_items`).
constexpr int kCePushItemRows = 8;

// Pushes from a work queue in this rank's header (queue 1), items of kCePushItemRows rows in
// the order (chunk, home in rotated order, rows), so chunks complete in order whatever the
// warps' speeds; each item counts its rows into the (home, chunk) counter and the item
// completing the chunk raises the home's flag. Returns once the queue is empty.
__device__ void ce_push_items(const CeSmPushParams& p) {
    const int lane = ep::lane_id();
    const int K = p.num_topk;
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    for (;;) {
        int item = 0;
        if (lane == 0) {
            item = atomicAdd(ce_work(my_buf, 1), 1);
        }
        item = __shfl_sync(ep::kFullMask, item, 0);
        // Find (chunk c, home d, first row) of the item.
        int d = -1;
        CeChunk ch{0, 0, 0};
        for (int c = 0; c < kCeMaxChunks && d < 0; ++c) {
            bool any = false;
            for (int k = 1; k < p.num_ranks; ++k) {
                const int h = (p.rank + k) % p.num_ranks;
                const CeChunk hc = ce_chunk_at(p.rows[h], c, p.first_chunk_rows, p.max_chunk_rows);
                if (hc.begin >= hc.end || c >= ce_sm_chunks(p, h)) {
                    continue;
                }
                any = true;
                const int items = (hc.end - hc.begin + kCePushItemRows - 1) / kCePushItemRows;
                if (item < items) {
                    d = h;
                    ch = hc;
                    break;
                }
                item -= items;
            }
            if (!any) {
                break;
            }
        }
        if (d < 0) {
            return;
        }
        const int begin = ch.begin + item * kCePushItemRows;
        const int rows = min(kCePushItemRows, ch.end - begin);
        char* slot = buf(p.buffer_ptrs, d) + kRingBase + p.rank * p.slot_bytes;
        const int64_t src_row = p.row_begin[d] + begin;
        warp_share_copy<int4, false>(reinterpret_cast<int4*>(slot) + begin * static_cast<int64_t>(p.row_int4),
                                     p.x + src_row * p.row_int4, static_cast<int64_t>(rows) * p.row_int4, 0, 1,
                                     lane);
        if (p.topk_weights != nullptr) {
            warp_share_copy<float, false>(reinterpret_cast<float*>(slot + p.off_weights) + begin * static_cast<int64_t>(K),
                                          p.topk_weights + src_row * K, static_cast<int64_t>(rows) * K, 0, 1, lane);
        }
        // As in `ce_sm_push`: this warp's NVLink stores reach the system before it counts its
        // rows in; the item completing the chunk publishes it.
        ep::fence_acq_rel_sys();
        __syncwarp();
        if (lane == 0) {
            ce_count_and_publish(ce_count(my_buf, d, ch.index), rows, ch.end - ch.begin,
                                 ce_flag(buf(p.buffer_ptrs, d), p.rank, ch.index));
        }
    }
}

// Every block: warps [0, push_warps) push from the push queue, then reduce; the others reduce
// from the start. Tokens come from a queue in this rank's header (queue 0) in token order.
template <int kR>
__device__ void ce_combine_roles(const CeCombineParams& p) {
    char* my_buf = buf(p.reduce.buffer_ptrs, p.reduce.rank);
    if (ep::warp_id() < p.push_warps) {
        ce_push_items(p.push);
    }
    CeReduceWarp st = ce_reduce_warp(p.reduce);
    for (;;) {
        int t = 0;
        if (ep::lane_id() == 0) {
            t = atomicAdd(ce_work(my_buf, 0), 1);
        }
        t = __shfl_sync(ep::kFullMask, t, 0);
        if (t >= p.reduce.num_tokens) {
            return;
        }
        ce_reduce_token<kR>(p.reduce, t, st);
    }
}

}  // namespace

// Grid: reduce_blocks + any number of push blocks (none when the copy engines serve every
// home), all of kCeThreads and resident at once: the reduce waits for every peer's pushes,
// which wait for nothing.
EP_KERNEL void __launch_bounds__(kCeThreads, 1) intranode_ce_combine(const CeCombineParams p) {
    const int b = static_cast<int>(blockIdx.x);
    const int R = p.reduce.num_ranks;
    if (b < p.reduce_blocks) {
        if (R <= 2) {
            ce_reduce<2>(p.reduce, b, p.reduce_blocks);
        } else if (R <= 4) {
            ce_reduce<4>(p.reduce, b, p.reduce_blocks);
        } else {
            ce_reduce<8>(p.reduce, b, p.reduce_blocks);
        }
    } else {
        ce_sm_push(p.push, b - p.reduce_blocks, static_cast<int>(gridDim.x) - p.reduce_blocks);
    }
}

// Grid: any number of blocks of kCeThreads, resident at once, each with both roles
// (`ce_combine_roles`, push_warps > 0): a pushing warp reduces only once the push queue is
// empty, so no push waits behind a reduce, and the reduce waits only for pushes.
EP_KERNEL void __launch_bounds__(kCeThreads, 1) intranode_ce_combine_roles(const CeCombineParams p) {
    const int R = p.reduce.num_ranks;
    if (R <= 2) {
        ce_combine_roles<2>(p);
    } else if (R <= 4) {
        ce_combine_roles<4>(p);
    } else {
        ce_combine_roles<8>(p);
    }
}
