// Internode normal mode: the op barrier (with the count exchange of a fresh dispatch) and the
// signal kernel that releases the blocks of a dispatch or combine step. Buffer and ordering:
// `internode.cuh`; launchers: `src/internode/cuda/notify.rs`; host twins: `src/internode/host.rs`
// (`node_send_index`, `send_rows`) and `src/intranode/host.rs` (`notify`).
#include <nvshmem.h>
#include <nvshmemx.h>

#include "internode.cuh"

namespace {

constexpr int kNotifyThreads = 1024;

struct NotifyParams {
    InBuffer b;
    uint64_t seq;
    // Fresh dispatch only (`with_counts`): inputs from the layout kernel.
    const int* num_tokens_per_rank;  // [R]
    const int* num_tokens_per_node;  // [N]
    const int* num_tokens_per_expert;  // [E]
    const uint8_t* is_token_in_rank;   // [T, R]
    // Outputs.
    int* rank_prefix_matrix;  // [R, R] inclusive prefix over sources
    int* block_count;         // [P, N] tokens of home (n, j) for this node
    int* node_send_index;     // [T, N] index among this rank's tokens for node n, -1
    int* send_head;           // [T, R] row in destination d's recv_x, -1
    int* recv_counter;        // host-mapped: word 1 + s from source s, then word 0 = total
    int* expert_counter;      // host-mapped [L], aligned
    int num_tokens;
    int num_experts;
    int expert_alignment;
    int with_counts;
};
EP_CHECK_PARAMS_SIZE(NotifyParams, 232);

// For every column c in [0, cols) of a [T, cols] 0/1 matrix given by `hit(t, c)`, writes each
// token's index among the tokens with a hit (plus `base(c)`), or -1, to out[t * cols + c].
template <typename Hit, typename Base>
EP_DEVICE void index_columns(int num_tokens, int cols, Hit hit, Base base, int* out) {
    const int per = (num_tokens + blockDim.x - 1) / blockDim.x;
    const int lo = min(num_tokens, static_cast<int>(threadIdx.x) * per);
    const int hi = min(num_tokens, lo + per);
    for (int c = 0; c < cols; ++c) {
        int mine = 0;
        for (int t = lo; t < hi; ++t) {
            mine += hit(t, c) ? 1 : 0;
        }
        int total;
        int idx = block_exclusive_scan(mine, &total) + base(c);
        for (int t = lo; t < hi; ++t) {
            out[static_cast<size_t>(t) * cols + c] = hit(t, c) ? idx++ : -1;
        }
    }
}

}  // namespace

// One block. Signals this op's barrier word to every rank (a fresh dispatch puts its counts
// along: put-with-signal), waits for every rank's, then (fresh dispatch) writes the prefix
// matrix, the block counts, the per-node and per-rank send indices and the receive totals.
EP_KERNEL void __launch_bounds__(kNotifyThreads) internode_notify(NotifyParams p) {
    const InBuffer& b = p.b;
    const int R = b.num_ranks, P = b.gpus_per_node, N = b.num_nodes;
    const int me = b.rank, me_node = node_of(b, me);
    const int words = R + N + p.num_experts;
    int* own = counts_row(b, b.local, p.seq, me);
    if (p.with_counts) {
        for (int i = threadIdx.x; i < words; i += blockDim.x) {
            own[i] = i < R ? p.num_tokens_per_rank[i]
                     : i < R + N ? p.num_tokens_per_node[i - R]
                                 : p.num_tokens_per_expert[i - R - N];
        }
    }
    __syncthreads();
    if (threadIdx.x < R) {
        const int r = threadIdx.x;
        uint64_t* word = sync_word(b, b.local, me);
        if (r == me) {
            ep::fence_acq_rel_sys();
            ep::st_relaxed_sys_u64(word, p.seq);
        } else if (p.with_counts) {
            nvshmem_putmem_signal_nbi(own, own, static_cast<size_t>(words) * sizeof(int), word,
                                      p.seq, NVSHMEM_SIGNAL_SET, r);
        } else {
            nvshmemx_signal_op(word, p.seq, NVSHMEM_SIGNAL_SET, r);
        }
    }
    const int T = p.num_tokens;
    if (p.with_counts) {
        // Per-node send index (needs no peer): token t's place among this rank's tokens
        // for node n.
        index_columns(
            T, N,
            [&](int t, int n) {
                const uint8_t* row = p.is_token_in_rank + static_cast<size_t>(t) * R + n * P;
                bool any = false;
                for (int j = 0; j < P; ++j) {
                    any |= row[j] != 0;
                }
                return any;
            },
            [](int) { return 0; }, p.node_send_index);
    }
    __shared__ int s_failed;
    if (threadIdx.x == 0) {
        s_failed = 0;
    }
    __syncthreads();
    if (threadIdx.x < R) {
        const int s = threadIdx.x;
        if (!wait_seq(b, sync_word(b, b.local, s), p.seq, kInNotify, s, 0)) {
            s_failed = 1;
        }
    }
    __syncthreads();
    if (s_failed || !p.with_counts) {
        return;
    }
    // Every rank's counts are here.
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
        int acc = 0;
        for (int s = 0; s < R; ++s) {
            acc += counts_row(b, b.local, p.seq, s)[d];
            p.rank_prefix_matrix[s * R + d] = acc;
        }
    }
    for (int i = threadIdx.x; i < P * N; i += blockDim.x) {
        const int j = i / N, n = i % N;
        p.block_count[i] = counts_row(b, b.local, p.seq, n * P + j)[R + me_node];
    }
    // Row of each token in each destination's recv_x: the rows of sources before this rank,
    // then this rank's tokens in order.
    index_columns(
        T, R,
        [&](int t, int d) { return p.is_token_in_rank[static_cast<size_t>(t) * R + d] != 0; },
        [&](int d) {
            int before = 0;
            for (int s = 0; s < me; ++s) {
                before += counts_row(b, b.local, p.seq, s)[d];
            }
            return before;
        },
        p.send_head);
    const int L = p.num_experts / R;
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
        int acc = 0;
        for (int s = 0; s < R; ++s) {
            acc += counts_row(b, b.local, p.seq, s)[R + N + me * L + e];
        }
        const int a = p.expert_alignment;
        p.expert_counter[e] = (acc + a - 1) / a * a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        for (int s = 0; s < R; ++s) {
            const int n = counts_row(b, b.local, p.seq, s)[me];
            p.recv_counter[1 + s] = n;
            total += n;
        }
        __threadfence_system();
        ep::st_relaxed_sys(p.recv_counter, total);
    }
}

struct SignalParams {
    InBuffer b;
    uint64_t seq;
    uint64_t word_offset;  // byte offset of the signal word, the same in every buffer
    int first;             // ranks first, first + stride, ... (count of them)
    int stride;
    int count;
    int pad;
};
EP_CHECK_PARAMS_SIZE(SignalParams, 160);

// One warp: writes `seq` into the word at `word_offset` of `count` ranks' buffers, after
// everything the stream ran before (stores and completed puts) is visible to them.
EP_KERNEL void internode_signal(SignalParams p) {
    const InBuffer& b = p.b;
    ep::fence_acq_rel_sys();
    for (int i = threadIdx.x; i < p.count; i += blockDim.x) {
        const int r = p.first + i * p.stride;
        auto* word = reinterpret_cast<uint64_t*>(b.local + p.word_offset);
        if (b.peers[r] != 0) {
            ep::st_relaxed_sys_u64(
                reinterpret_cast<uint64_t*>(peer_base(b, r) + p.word_offset), p.seq);
        } else {
            nvshmemx_signal_op(word, p.seq, NVSHMEM_SIGNAL_SET, r);
        }
    }
}
