// Dispatch layout on the device: per-rank, per-node and per-expert token counts and the
// `is_token_in_rank` matrix, from `topk_idx`. Host twin: `src/layout/host.rs`; launcher:
// `src/layout/cuda/layout.rs` (`get_dispatch_layout_cuda`).
//
// One thread per token, as many blocks as the tokens need: each thread reads its token's K
// expert ids once, writes its `is_token_in_rank` row (every byte: zeros, then its ranks' ones)
// and counts its experts, and its ranks and nodes once each, in the block's shared counters;
// each block then adds its non-zero counters to the global ones, which the launcher zeroes
// first. Integer additions commute, so the counts are the same whatever the order.
//
// (Giving each block a slice of the experts or ranks, each reading every (token, k) entry,
// leaves few blocks with long chains of dependent loads and measured slower, the more so the
// more ranks; this kernel is on the critical path of every normal-mode step.)
//
// Entries equal to -1 (and, defensively, any entry outside [0, num_experts)) are skipped.

#include "common.cuh"

namespace {

constexpr int kThreads = 256;

}  // namespace

// Mirrors `LayoutParams` in src/layout/cuda/layout.rs.
struct LayoutParams {
    const int64_t* topk_idx;         // [num_tokens, num_topk]
    int32_t* num_tokens_per_rank;    // [num_ranks], zeroed by the launcher
    int32_t* num_tokens_per_node;    // [num_ranks / gpus_per_node], zeroed by the launcher
    int32_t* num_tokens_per_expert;  // [num_experts], zeroed by the launcher
    uint8_t* is_token_in_rank;       // [num_tokens, num_ranks], 0 or 1
    int32_t num_tokens;
    int32_t num_topk;
    int32_t num_experts;
    int32_t num_ranks;
    int32_t num_nodes;
    int32_t experts_per_rank;
};
EP_CHECK_PARAMS_SIZE(LayoutParams, 64);

namespace {

// Whether expert id `e` is one of the [0, num_experts) the layout counts.
EP_DEVICE bool counted(int64_t e, int num_experts) { return e >= 0 && e < num_experts; }

// Adds the block's non-zero shared counters `from[0, n)` to the global ones `to`.
EP_DEVICE void flush(const int* from, int32_t* to, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        if (from[i] != 0) {
            atomicAdd(to + i, from[i]);
        }
    }
}

}  // namespace

// Dynamic shared memory: (num_experts + num_ranks + num_nodes) ints.
EP_KERNEL void __launch_bounds__(kThreads) get_dispatch_layout(const __grid_constant__ LayoutParams p) {
    extern __shared__ int s_counts[];
    int* s_expert = s_counts;
    int* s_rank = s_expert + p.num_experts;
    int* s_node = s_rank + p.num_ranks;
    const int total = p.num_experts + p.num_ranks + p.num_nodes;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        s_counts[i] = 0;
    }
    __syncthreads();
    // 32-bit divisions: ids below num_experts fit in an int (a 64-bit one is a slow call).
    const int per_rank = p.experts_per_rank;
    const int per_node = per_rank * (p.num_ranks / p.num_nodes);
    const int stride = static_cast<int>(gridDim.x * blockDim.x);
    for (int t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); t < p.num_tokens;
         t += stride) {
        const int64_t* row = p.topk_idx + static_cast<int64_t>(t) * p.num_topk;
        uint8_t* in_rank = p.is_token_in_rank + static_cast<int64_t>(t) * p.num_ranks;
        for (int j = 0; j < p.num_ranks; ++j) {
            in_rank[j] = 0;
        }
        for (int k = 0; k < p.num_topk; ++k) {
            const int64_t e = __ldg(row + k);
            if (!counted(e, p.num_experts)) {
                continue;
            }
            const int rank = static_cast<int>(e) / per_rank;
            const int node = static_cast<int>(e) / per_node;
            atomicAdd(&s_expert[e], 1);
            // A rank (node) counts once per token: at its first entry in the row.
            bool first_rank = true;
            bool first_node = true;
            for (int j = 0; j < k; ++j) {
                const int64_t f = __ldg(row + j);
                if (counted(f, p.num_experts)) {
                    first_rank = first_rank && static_cast<int>(f) / per_rank != rank;
                    first_node = first_node && static_cast<int>(f) / per_node != node;
                }
            }
            if (first_rank) {
                atomicAdd(&s_rank[rank], 1);
                in_rank[rank] = 1;
            }
            if (first_node) {
                atomicAdd(&s_node[node], 1);
            }
        }
    }
    __syncthreads();
    flush(s_expert, p.num_tokens_per_expert, p.num_experts);
    flush(s_rank, p.num_tokens_per_rank, p.num_ranks);
    flush(s_node, p.num_tokens_per_node, p.num_nodes);
}
