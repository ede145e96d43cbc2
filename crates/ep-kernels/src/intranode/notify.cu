// Notify kernels of the intranode (NVLink) normal mode. Host twins: `src/intranode/host.rs`;
// launchers: `src/intranode/cuda/notify.rs`; the NVLink buffer: `intranode.cuh`.
//
// Kernels (each takes ONE by-value params struct mirrored by its launcher):
//   * intranode_notify_dispatch: exchange per-rank / per-expert counts with every peer, compute
//     `rank_prefix_matrix [R, R]`, the totals (written to host-mapped counters) and this rank's
//     `channel_prefix_matrix [R, C]`; also resets the channel counters for the next kernel;
//   * intranode_cached_notify: barrier + counter reset + barrier (before a cached dispatch, and
//     before every combine);
//
// Ordering between ops: notify_dispatch starts with a barrier (every peer has finished its
// previous kernels, so nothing touches this buffer any more), resets the counters, writes the
// counts, and barriers again; cached_notify does barrier / reset / barrier. The caller runs
// cached_notify before every combine and before a cached (handle-reusing) dispatch.

#include "intranode.cuh"

namespace {

constexpr int kBarrierTag = 1 << 20;

constexpr int kNotifyThreads = 256;

EP_DEVICE int* signals(char* base) { return reinterpret_cast<int*>(base + kSignalOffset); }

EP_DEVICE int* notify_rank_counts(char* base) { return reinterpret_cast<int*>(base + kNotifyOffset); }

EP_DEVICE int* notify_expert_counts(char* base) {
    return reinterpret_cast<int*>(base + kNotifyOffset) + kMaxRanks * kMaxRanks;
}

// Barrier of the whole node, run by one block (threads [0, R) talk to the peers). Every
// write of the block before the call is visible to every peer after it. Returns false (and
// records the error) on timeout; all threads of the block get the same answer.
__device__ bool barrier_block(const uint64_t* buffer_ptrs, int rank, int num_ranks,
                              uint64_t timeout_ns, int* error_info, int kernel) {
    __shared__ int s_failed;
    if (threadIdx.x == 0) {
        s_failed = 0;
    }
    __syncthreads();
    const int i = static_cast<int>(threadIdx.x);
    if (i < num_ranks) {
        ep::fence_acq_rel_sys();
        int* mine = signals(buf(buffer_ptrs, rank)) + i;
        int* theirs = signals(buf(buffer_ptrs, i)) + rank;
        ep::atomic_add_release_sys(mine, kBarrierTag);
        ep::atomic_add_release_sys(theirs, -kBarrierTag);
        const ep::Deadline deadline = ep::Deadline::after(timeout_ns);
        bool timed_out = false;
        ep::wait_flag_sys(mine, [](int v) { return v <= 0; }, deadline, &timed_out);
        if (timed_out) {
            report_timeout(error_info, kernel, rank, i, kSiteBarrier);
            atomicExch(&s_failed, 1);
        }
    }
    __syncthreads();
    const bool ok = s_failed == 0;
    // Every thread has read s_failed before the block can reach the next barrier's reset.
    __syncthreads();
    return ok;
}

// Zeroes this rank's channel counters (start, end, tail, head) and the copy-engine path's
// flags and chunk counters.
__device__ void reset_counters(char* my_buf) {
    int* c = counter(my_buf, kStart, 0, 0);
    constexpr int kWords = static_cast<int>((kNotifyOffset - kCounterOffset) / sizeof(int));
    for (int i = threadIdx.x; i < kWords; i += blockDim.x) {
        c[i] = 0;
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// notify_dispatch
// ---------------------------------------------------------------------------------------------

// Mirrors `NotifyParams` in src/intranode/cuda/notify.rs.
struct NotifyParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int* num_tokens_per_rank;    // [R]
    const int* num_tokens_per_expert;  // [E]
    const uint8_t* is_token_in_rank;   // [T, R]
    int* rank_prefix_matrix;           // [R, R] out
    int* channel_prefix_matrix;        // [R, C] out
    int* moe_recv_counter;             // mapped [1 + R] out: total, then per source; or null
    int* moe_recv_expert_counter;      // mapped [L] out, or null
    int* error_info;                   // [4]
    int* send_index;                   // [T, R] out or null
    uint64_t timeout_ns;
    int rank;
    int num_ranks;
    int num_tokens;
    int num_experts;
    int num_channels;
    int expert_alignment;
};
EP_CHECK_PARAMS_SIZE(NotifyParams, 168);

// Grid: 1 + R blocks of kNotifyThreads. Block 0 exchanges counts; block 1 + d computes row d of
// channel_prefix_matrix and, if `send_index` is given, its column d: the index of each token
// among this rank's tokens sent to d, in token order (-1 if not sent).
EP_KERNEL void __launch_bounds__(kNotifyThreads, 1) intranode_notify_dispatch(const NotifyParams p) {
    const int R = p.num_ranks;
    if (blockIdx.x == 0) {
        const int L = p.num_experts / R;
        char* my_buf = buf(p.buffer_ptrs, p.rank);
        // 1. Everybody has finished with the buffers (previous op).
        if (!barrier_block(p.buffer_ptrs, p.rank, R, p.timeout_ns, p.error_info, kNotifyKernel)) {
            return;
        }
        // 2. Reset our counters; send our counts to every peer (row `rank` of their tables).
        reset_counters(my_buf);
        for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
            const int d = i / R;
            const int j = i % R;
            notify_rank_counts(buf(p.buffer_ptrs, d))[p.rank * kMaxRanks + j] = p.num_tokens_per_rank[j];
        }
        for (int i = threadIdx.x; i < R * L; i += blockDim.x) {
            const int d = i / L;
            const int le = i % L;
            notify_expert_counts(buf(p.buffer_ptrs, d))[p.rank * kMaxLocalExperts + le] =
                p.num_tokens_per_expert[d * L + le];
        }
        // 3. Every count has arrived, every counter is reset.
        if (!barrier_block(p.buffer_ptrs, p.rank, R, p.timeout_ns, p.error_info, kNotifyKernel)) {
            return;
        }
        // 4. Prefix matrix and totals.
        const int* counts = notify_rank_counts(my_buf);
        for (int j = threadIdx.x; j < R; j += blockDim.x) {
            int acc = 0;
            for (int i = 0; i < R; ++i) {
                acc += ep::ld_volatile(counts + i * kMaxRanks + j);
                p.rank_prefix_matrix[i * R + j] = acc;
            }
        }
        const int* ecounts = notify_expert_counts(my_buf);
        for (int le = threadIdx.x; le < L; le += blockDim.x) {
            int n = 0;
            for (int s = 0; s < R; ++s) {
                n += ep::ld_volatile(ecounts + s * kMaxLocalExperts + le);
            }
            const int a = p.expert_alignment;
            if (p.moe_recv_expert_counter != nullptr) {
                ep::st_release_sys(p.moe_recv_expert_counter + le, (n + a - 1) / a * a);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0 && p.moe_recv_counter != nullptr) {
            int total = 0;
            for (int i = 0; i < R; ++i) {
                const int n = ep::ld_volatile(counts + i * kMaxRanks + p.rank);
                ep::st_volatile(p.moe_recv_counter + 1 + i, n);
                total += n;
            }
            ep::fence_acq_rel_sys();
            ep::st_release_sys(p.moe_recv_counter, total);
        }
        return;
    }

    // channel_prefix_matrix row d: warp w counts channels w, w + 8, ...
    __shared__ int s_counts[kMaxChannels];
    const int d = static_cast<int>(blockIdx.x) - 1;
    const int C = p.num_channels;
    const int lane = ep::lane_id();
    for (int c = ep::warp_id(); c < C; c += kNotifyThreads / ep::kWarpSize) {
        int begin, end;
        channel_range(p.num_tokens, C, c, &begin, &end);
        int n = 0;
        for (int t = begin + lane; t < end; t += ep::kWarpSize) {
            n += p.is_token_in_rank[static_cast<int64_t>(t) * R + d] != 0;
        }
        n = ep::warp_reduce_sum(n);
        if (lane == 0) {
            s_counts[c] = n;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int c = 0; c < C; ++c) {
            acc += s_counts[c];
            p.channel_prefix_matrix[d * C + c] = acc;
            s_counts[c] = acc;  // inclusive prefix
        }
    }
    __syncthreads();
    if (p.send_index != nullptr) {
        for (int c = ep::warp_id(); c < C; c += kNotifyThreads / ep::kWarpSize) {
            int begin, end;
            channel_range(p.num_tokens, C, c, &begin, &end);
            int next = c > 0 ? s_counts[c - 1] : 0;
            for (int t0 = begin; t0 < end; t0 += ep::kWarpSize) {
                const int t = t0 + lane;
                const bool in = t < end && p.is_token_in_rank[static_cast<int64_t>(t) * R + d] != 0;
                const unsigned ballot = __ballot_sync(ep::kFullMask, in);
                if (t < end) {
                    p.send_index[static_cast<int64_t>(t) * R + d] =
                        in ? next + __popc(ballot & ((1u << lane) - 1u)) : -1;
                }
                next += __popc(ballot);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// cached_notify: barrier, reset counters, barrier
// ---------------------------------------------------------------------------------------------

// Mirrors `CachedNotifyParams` in src/intranode/cuda/notify.rs.
struct CachedNotifyParams {
    uint64_t buffer_ptrs[kMaxRanks];
    int* error_info;  // [4]
    uint64_t timeout_ns;
    int rank;
    int num_ranks;
};
EP_CHECK_PARAMS_SIZE(CachedNotifyParams, 88);

// Grid: 1 block of kNotifyThreads.
EP_KERNEL void __launch_bounds__(kNotifyThreads, 1) intranode_cached_notify(const CachedNotifyParams p) {
    if (!barrier_block(p.buffer_ptrs, p.rank, p.num_ranks, p.timeout_ns, p.error_info,
                       kCachedNotifyKernel)) {
        return;
    }
    reset_counters(buf(p.buffer_ptrs, p.rank));
    barrier_block(p.buffer_ptrs, p.rank, p.num_ranks, p.timeout_ns, p.error_info,
                  kCachedNotifyKernel);
}
