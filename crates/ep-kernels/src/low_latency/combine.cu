// Low-latency combine (protocol: `protocol.cuh`): per expert (DeepEP's, one row per (token, k)
// back to the home) or per rank (one partial sum per (token, rank) from the dispatch's records),
// the flags, and the home's weighted reduction. Host twins: `host.rs` (`combine`,
// `combine_per_rank`); launcher: `cuda/combine.rs` (`combine_cuda`).
#include "protocol.cuh"

namespace {

// ------------------------------------------------------------------------------------------
// Combine
// ------------------------------------------------------------------------------------------

// Staging offset (NVSHMEM build) of row `row` (t * max_topk + k or j) bound for home `s`.
EP_DEVICE uint64_t rows_stage(const LlBuffer& b, int s, uint64_t row) {
    return (static_cast<uint64_t>(s) * b.max_tokens * b.max_topk + row) * 2 *
           static_cast<uint64_t>(b.hidden);
}

// Where the lanes write combine row `row` (`row_bytes` long) of home `s`: its peer memory over
// NVLink, or the staging region for a home on another node (then `put_row_vectors` sends it).
EP_DEVICE uint8_t* row_target(const LlBuffer& b, int s, uint32_t set, uint64_t row,
                              int64_t row_bytes) {
    return write_target(b, s, set, b.off_rows + row * row_bytes, rows_stage(b, s, row));
}

// Called by the whole warp after it wrote vectors [first, first + n) of row `row` at
// `row_target`: puts them to a home on another node (nothing over NVLink).
EP_DEVICE void put_row_vectors(const LlBuffer& b, int s, uint32_t set, uint64_t row,
                               int64_t row_bytes, int first, int n) {
    put_staged(b, s, set, b.off_rows + row * row_bytes, rows_stage(b, s, row),
               static_cast<uint64_t>(first) * 16, static_cast<uint64_t>(n) * 16);
}

// Shared memory of the combine send phase: [E] chunks per unit, prefix [E + 1], row offset per
// unit [E], mask snapshot [R].
struct CombineSendSmem {
    int* items;
    int* pre;
    int* off;
    int* active;
    __device__ explicit CombineSendSmem(uint8_t* smem, int E)
        : items(reinterpret_cast<int*>(smem)), pre(items + E), off(pre + E + 1), active(off + E) {}
};

// The combine send phase's first loads, into shared memory (no barrier: the caller's next one
// makes them visible): the units' ranges and the mask.
__device__ void combine_stage(const CombineParams& p, uint8_t* smem) {
    const LlBuffer& b = p.buf;
    const int H = b.hidden, R = b.num_ranks, E = b.num_experts;
    const int tid = threadIdx.x;
    const int* active = reinterpret_cast<const int*>(b.local + b.off_active);
    const int chunks = ep::ceil_div(H / 8, ep::kWarpSize * kSendUnroll);
    const CombineSendSmem sm(smem, E);
    // Units are numbered u = l * R + s, as layout_range.
    for (int u = tid; u < E; u += kThreads) {
        const int2 range = *reinterpret_cast<const int2*>(p.layout_range + static_cast<int64_t>(u) * 2);
        sm.off[u] = range.x;
        sm.items[u] = range.y * chunks;
        sm.pre[u + 1] = range.y * chunks;
    }
    for (int r = tid; r < R; r += kThreads) {
        sm.active[r] = ld_vol(active + r);
    }
}

// Rows of all units (local expert l, home rank s) are spread over the whole grid in chunks of
// 32 lanes x kSendUnroll vectors. The units' row offsets and the mask are staged in shared
// memory first, so a chunk's loads (the rows and their source token and top-k slot) go out
// together, with no dependent global load before them. Each finished chunk counts in
// `unit_done[u]` (local); the warp that finishes a unit's last chunk flags the home, and units
// without rows are flagged at once.
// Called after `combine_stage` and a barrier.
__device__ void combine_send(const CombineParams& p, uint8_t* smem, uint32_t set, uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int H = b.hidden, R = b.num_ranks, E = b.num_experts, L = E / R, M = b.max_tokens;
    const int tid = threadIdx.x, lane = ep::lane_id(), warp = ep::warp_id();
    // unit_done [L*R] follows send_done [E] (L * R == E).
    int* unit_done = reinterpret_cast<int*>(b.local + b.off_send_done) + E;
    const int vpr = H / 8;  // 16-byte vectors per bf16 row
    const int64_t row_bytes = 2 * static_cast<int64_t>(H);
    constexpr int kChunkVecs = ep::kWarpSize * kSendUnroll;
    const int chunks = ep::ceil_div(vpr, kChunkVecs);
    const CombineSendSmem sm(smem, E);
    const int* s_items = sm.items;
    int* s_pre = sm.pre;
    const int* s_off = sm.off;
    const int* s_active = sm.active;
    block_prefix_sum(s_pre, E);
    __syncthreads();

    // Units without rows: their flag goes out now (one thread per unit, over the blocks).
    for (int u = blockIdx.x + tid * static_cast<int>(gridDim.x); u < E;
         u += kThreads * static_cast<int>(gridDim.x)) {
        const int s = u % R;
        if (s_items[u] == 0 && s_active[s] != 0) {
            flag_peer(b, s, set, b.off_flags + static_cast<uint64_t>(b.rank * L + u / R) * 4,
                      static_cast<int>(tag));
        }
    }

    // Items fit in an int: s_pre is an int prefix sum.
    const int items = s_pre[E];
    const int warps = static_cast<int>(gridDim.x) * kWarps;
    for (int j = static_cast<int>(blockIdx.x) * kWarps + warp; j < items; j += warps) {
        const int u = last_at_or_below(s_pre, E, j);
        const int s = u % R;
        if (s_active[s] != 0) {
            const int r = (j - s_pre[u]) / chunks;
            const int chunk = (j - s_pre[u]) - r * chunks;
            const int64_t src_row = static_cast<int64_t>(u / R) * R * M + s_off[u] + r;
            const int4* src = reinterpret_cast<const int4*>(p.x + src_row * H);
            // The row's loads and its (t, k) are in flight together.
            const int t = p.src_info[src_row];
            const int k = p.src_topk[src_row];
            int4 v[kSendUnroll];
#pragma unroll
            for (int q = 0; q < kSendUnroll; ++q) {
                const int i = chunk * kChunkVecs + q * ep::kWarpSize + lane;
                if (i < vpr) {
                    v[q] = ep::ld_nc_no_alloc(src + i);
                }
            }
            if (t >= 0 && t < M && k >= 0 && k < b.max_topk) {
                const uint64_t row = static_cast<uint64_t>(t) * b.max_topk + k;
                uint8_t* dst = row_target(b, s, set, row, row_bytes);
#pragma unroll
                for (int q = 0; q < kSendUnroll; ++q) {
                    const int i = chunk * kChunkVecs + q * ep::kWarpSize + lane;
                    if (i < vpr) {
                        put_v4(dst + static_cast<int64_t>(i) * 16, v[q]);
                    }
                }
                if (is_remote(b, s)) {
                    // Completed before the chunk counts (the unit's flag may follow at once).
                    const int first = chunk * kChunkVecs;
                    put_row_vectors(b, s, set, row, row_bytes, first, min(kChunkVecs, vpr - first));
                    remote_quiet();
                }
            }
        }
        __syncwarp();
        if (lane == 0 && ep::atomic_add_release_gpu(unit_done + u, 1) == s_items[u] - 1) {
            // The unit's last chunk (the atomics form a release sequence, so every chunk's
            // stores precede this one's read): reset the counter for the next op, then fence
            // and flag the home (fence + relaxed store form a release pattern).
            atomicExch(unit_done + u, 0);
            if (s_active[s] != 0) {
                ep::fence_acq_rel_sys();
                flag_peer(b, s, set, b.off_flags + static_cast<uint64_t>(b.rank * L + u / R) * 4,
                          static_cast<int>(tag));
            }
        }
    }
}

// Per-rank combine, send phase. Items are (home s, token t, chunk of 32 lanes x kRankVecs vectors)
// over all R x M (s, t), homes in the order rank + 1, rank + 2, ..., rank. An item reads the
// token's record in the handle (`rank_records`): one whose header is -1 (the token sent nothing
// here) is skipped; the others sum, in k order and in f32, the weighted rows of the token's
// experts on this rank (the record's packed rows, loaded kRankBatch rows at a time) and write
// the bf16 partial into row (t, j) of the home's combine region. Every item of a home counts in `rank_done[s]`
// (local, the first R counters of `unit_done`), a block at a time: the block's warps count their
// items per home in shared memory, and after the block's last item one thread per home adds the
// block's count (about 130 global atomics per home instead of one per item, all of which hit R
// neighbouring words); the thread whose addition completes a home (M x chunks items) flags it
// (`flags[rank]`). Shared memory: the mask snapshot [R], this block's items per home [R].
__device__ void combine_send_ranks(const CombineParams& p, uint8_t* smem, uint32_t set,
                                   uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int H = b.hidden, R = b.num_ranks, E = b.num_experts, M = b.max_tokens;
    const int K = p.num_topk;
    const int tid = threadIdx.x, lane = ep::lane_id(), warp = ep::warp_id();
    int* rank_done = reinterpret_cast<int*>(b.local + b.off_send_done) + E;
    const int vpr = H / 8;
    const int64_t row_bytes = 2 * static_cast<int64_t>(H);
    constexpr int kChunkVecs = ep::kWarpSize * kRankVecs;
    const int chunks = ep::ceil_div(vpr, kChunkVecs);
    const int* s_active = reinterpret_cast<const int*>(smem);
    int* s_done = reinterpret_cast<int*>(smem) + R;

    const int64_t items = static_cast<int64_t>(R) * M * chunks;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * kWarps + warp; j < items; j += warps) {
        // Home-major, each rank starting at the next rank's home and ending at its own: at any
        // moment the ranks write to different homes. (Every rank starting at home 0 makes homes 0
        // and 1 take every rank's stores while the last home's links idle; this order measured
        // faster than that and than a token-major order at EP2 and EP4.)
        const int64_t q = j / chunks;
        const int chunk = static_cast<int>(j - q * chunks);
        const int h = static_cast<int>(q / M);
        const int t = static_cast<int>(q - static_cast<int64_t>(h) * M);
        const int s = (h + b.rank + 1) % R;
        // The record's header, and lane k's packed row and weight, load together.
        const int* rec = p.rank_records + (static_cast<int64_t>(s) * M + t) * kRecordWords;
        const int home_row = rec[0];
        const uint32_t mask = static_cast<uint32_t>(rec[1]);
        const int placed = lane < K ? rec[4 + lane] : -1;
        const float w = lane < K ? __int_as_float(rec[4 + kMaxTopk + lane]) : 0.0f;
        // Rows of k outside the mask were not written by this op (the bound keeps the loads in
        // `x` whatever the memory holds, e.g. after a peer timed out mid-op).
        const int row = (mask >> lane) & 1u && placed >= 0 && placed < E * M ? placed : -1;
        if (home_row >= 0 && s_active[s] != 0) {
            float acc[kRankVecs][8];
#pragma unroll
            for (int q = 0; q < kRankVecs; ++q) {
#pragma unroll
                for (int c = 0; c < 8; ++c) {
                    acc[q][c] = 0.0f;
                }
            }
            // In k order (the host twin `partial_row`), kRankBatch rows in flight at a time.
            uint32_t have = __ballot_sync(ep::kFullMask, row >= 0);
            while (have != 0) {
                int4 v[kRankBatch][kRankVecs];
                float wq[kRankBatch];
                bool used[kRankBatch];
#pragma unroll
                for (int u = 0; u < kRankBatch; ++u) {
                    used[u] = have != 0;
                    const int k = used[u] ? __ffs(have) - 1 : 0;
                    have &= have - 1;
                    const int r_u = __shfl_sync(ep::kFullMask, row, k);
                    wq[u] = __shfl_sync(ep::kFullMask, w, k);
                    const int4* src = reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(r_u) * H);
#pragma unroll
                    for (int q = 0; q < kRankVecs; ++q) {
                        const int i = chunk * kChunkVecs + q * ep::kWarpSize + lane;
                        if (used[u] && i < vpr) {
                            v[u][q] = ep::ld_nc_no_alloc(src + i);
                        }
                    }
                }
#pragma unroll
                for (int u = 0; u < kRankBatch; ++u) {
#pragma unroll
                    for (int q = 0; q < kRankVecs; ++q) {
                        const int i = chunk * kChunkVecs + q * ep::kWarpSize + lane;
                        if (used[u] && i < vpr) {
                            ep::ll::accumulate_bf16x8(acc[q], v[u][q], wq[u]);
                        }
                    }
                }
            }
            const uint64_t out_row = static_cast<uint64_t>(t) * b.max_topk + home_row;
            uint8_t* dst = row_target(b, s, set, out_row, row_bytes);
#pragma unroll
            for (int q = 0; q < kRankVecs; ++q) {
                const int i = chunk * kChunkVecs + q * ep::kWarpSize + lane;
                if (i < vpr) {
                    put_v4(dst + static_cast<int64_t>(i) * 16, ep::ll::pack_bf16x8(acc[q]));
                }
            }
            if (is_remote(b, s)) {
                const int first = chunk * kChunkVecs;
                put_row_vectors(b, s, set, out_row, row_bytes, first,
                                min(kChunkVecs, vpr - first));
            }
        }
        if (lane == 0) {
            atomicAdd(s_done + s, 1);
        }
    }
    // Every item of this block is stored (the barrier orders its warps' stores before the
    // counting thread's release), then its counts go out; the addition that completes a home
    // (the atomics form a release sequence, so every block's stores precede its read) resets
    // the counter for the next op, fences and flags the home (fence + relaxed store form a
    // release pattern), as `combine_send`'s last chunk of a unit does. (NVSHMEM build: every
    // thread first completes its puts to remote homes.)
    remote_quiet();
    __syncthreads();
    const int per_home = M * chunks;
    for (int s = tid; s < R; s += kThreads) {
        const int n = s_done[s];
        if (n > 0 && ep::atomic_add_release_gpu(rank_done + s, n) == per_home - n) {
            atomicExch(rank_done + s, 0);
            if (s_active[s] != 0) {
                ep::fence_acq_rel_sys();
                flag_peer(b, s, set, b.off_flags + static_cast<uint64_t>(b.rank) * 4,
                          static_cast<int>(tag));
            }
        }
    }
}

__device__ void combine_recv(const CombineParams& p, uint8_t* smem, uint32_t set, uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int T = p.num_tokens, K = p.num_topk, H = b.hidden, R = b.num_ranks;
    const int E = b.num_experts, L = E / R;
    const int tid = threadIdx.x;
    int* active = reinterpret_cast<int*>(b.local + b.off_active);
    uint8_t* my_set = set_base(b, b.local, set);
    const int* flags = reinterpret_cast<const int*>(my_set + b.off_flags);
    float* s_w = reinterpret_cast<float*>(smem);
    int* s_valid = reinterpret_cast<int*>(smem + kMaxTopk * 4);
    int* s_active = reinterpret_cast<int*>(smem + kMaxTopk * 8);
    // Per rank: the token's expert ranks (-1: no expert) in k order.
    __shared__ int s_erank[kMaxTopk];
    const bool per_rank = p.reduce != 0;

    // The first token's routing (a local input) is read while the flags are awaited.
    const int t_first = blockIdx.x;
    int64_t pre_e = -1;
    float pre_w = 0.0f;
    if (t_first < T && tid < K) {
        pre_e = p.topk_idx[static_cast<int64_t>(t_first) * K + tid];
        pre_w = p.topk_weights[static_cast<int64_t>(t_first) * K + tid];
    }
    // Every expert (per rank: every rank) of every active rank flags every home, also with
    // zero rows: waiting for all of them is what makes reusing the buffer set two ops later
    // safe.
    if (per_rank) {
        for (int r = tid; r < R; r += kThreads) {
            wait_flag(flags + r, tag, active + r, b.timeout_ns);
        }
    } else {
        for (int e = tid; e < E; e += kThreads) {
            wait_flag(flags + e, tag, active + e / L, b.timeout_ns);
        }
    }
    __syncthreads();
    // One snapshot of the mask for the whole block.
    for (int r = tid; r < R; r += kThreads) {
        s_active[r] = ld_vol(active + r);
    }
    __syncthreads();

    const int vpr = H / 8;
    const int64_t row_bytes = 2 * static_cast<int64_t>(H);
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        if (tid < K) {
            const bool first = t == t_first;
            const int64_t e = first ? pre_e : p.topk_idx[static_cast<int64_t>(t) * K + tid];
            const bool valid = e >= 0 && e < E && s_active[static_cast<int>(e) / L] != 0;
            s_valid[tid] = valid ? 1 : 0;
            const float w = first ? pre_w : p.topk_weights[static_cast<int64_t>(t) * K + tid];
            s_w[tid] = valid ? w : 0.0f;
            s_erank[tid] = e >= 0 && e < E ? static_cast<int>(e) / L : -1;
        }
        __syncthreads();
        if (per_rank) {
            // Row j of the token is the partial sum of its j-th distinct rank (k order, as
            // the host twin `rank_order`), added with weight 1 (exact: 1 * v == v).
            if (tid < K) {
                int n = 0, rank_j = -1;
                for (int k = 0; k < K && rank_j < 0; ++k) {
                    const int r = s_erank[k];
                    bool seen = r < 0;
                    for (int k2 = 0; k2 < k && !seen; ++k2) {
                        seen = s_erank[k2] == r;
                    }
                    if (!seen) {
                        rank_j = n == tid ? r : -1;
                        ++n;
                    }
                }
                s_valid[tid] = rank_j >= 0 && s_active[rank_j] != 0 ? 1 : 0;
                s_w[tid] = 1.0f;
            }
            __syncthreads();
        }
        const uint8_t* rows = my_set + b.off_rows + static_cast<int64_t>(t) * b.max_topk * row_bytes;
        for (int i = tid; i < vpr; i += kThreads) {
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                acc[j] = 0.0f;
            }
            // In k order, as the host twin; loads batched for memory parallelism.
            for (int k0 = 0; k0 < K; k0 += 4) {
                int4 v[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int k = k0 + q;
                    if (k < K && s_valid[k] != 0) {
                        v[q] = ep::ld_cg_v4(rows + k * row_bytes + static_cast<int64_t>(i) * 16);
                    }
                }
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int k = k0 + q;
                    if (k < K && s_valid[k] != 0) {
                        // Separate multiply and add (no FMA), as the host twin.
                        ep::ll::accumulate_bf16x8(acc, v[q], s_w[k]);
                    }
                }
            }
            *reinterpret_cast<int4*>(p.out + static_cast<int64_t>(t) * H + i * 8) =
                ep::ll::pack_bf16x8(acc);
        }
        __syncthreads();
    }
}

}  // namespace

// Grid: at most one block per SM. Dynamic shared memory:
// max(send: 4 * (3 * E + 1 + R) (per rank: 8 * R), receive: kMaxTopk * 8 + 4 * R) bytes.
EP_KERNEL void __launch_bounds__(kThreads, 1) ll_combine(const __grid_constant__ CombineParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    const LlBuffer& b = p.buf;
    __shared__ uint32_t s_seq;
    // The op sequence and the send phase's layout loads are in flight together.
    const uint32_t seq0 =
        threadIdx.x == 0 ? op_begin(reinterpret_cast<const uint32_t*>(b.local), kKindCombine, p.phases) : 0u;
    const bool per_rank = p.reduce != 0;
    if ((p.phases & kPhaseSend) && per_rank) {
        // The mask and this block's finished items per home, for `combine_send_ranks`.
        const int R = b.num_ranks;
        int* s_words = reinterpret_cast<int*>(smem);
        const int* active = reinterpret_cast<const int*>(b.local + b.off_active);
        for (int r = threadIdx.x; r < R; r += kThreads) {
            s_words[r] = ld_vol(active + r);
            s_words[R + r] = 0;
        }
    } else if (p.phases & kPhaseSend) {
        combine_stage(p, smem);
    }
    if (threadIdx.x == 0) {
        s_seq = seq0;
    }
    __syncthreads();
    const uint32_t seq = s_seq;
    const uint32_t set = seq & 1u;
    const uint32_t tag = tag_of(seq);
    if ((p.phases & kPhaseSend) && per_rank) {
        combine_send_ranks(p, smem, set, tag);
    } else if (p.phases & kPhaseSend) {
        combine_send(p, smem, set, tag);
    }
    if (p.phases & kPhaseRecv) {
        __syncthreads();
        combine_recv(p, smem, set, tag);
    }
    op_end(b, kKindCombine, p.phases, seq);
}
