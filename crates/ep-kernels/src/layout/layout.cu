// Dispatch layout on the device: per-rank, per-node and per-expert token counts and the
// `is_token_in_rank` matrix, from `topk_idx`. Host twin: `src/layout/host.rs`; launcher:
// `src/layout/cuda.rs` (`get_dispatch_layout_cuda`).
//
// One launch, three kinds of blocks, each owning a disjoint slice of the outputs so that every
// output element is written exactly once (no pre-zeroing, no global atomics):
//   * expert blocks  [0, num_expert_blocks): block b counts experts
//     [b * kExpertsPerBlock, ...) in shared memory over all (token, k) entries;
//   * rank blocks    next num_rank_blocks: block b owns ranks [b * 64, ...): per token, a 64-bit
//     mask of the owned ranks any of its experts live on; writes those `is_token_in_rank`
//     bytes and counts each set bit once;
//   * node blocks    next num_node_blocks: the same with nodes (a node owns
//     `experts_per_rank * gpus_per_node` consecutive experts).
// Entries equal to -1 (and, defensively, any entry outside [0, num_experts)) are skipped.

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kExpertsPerBlock = 32;
constexpr int kTargetsPerBlock = 64;  // ranks or nodes per block: one bit each in a u64 mask

}  // namespace

// Mirrors `LayoutParams` in src/layout/cuda.rs.
struct LayoutParams {
    const int64_t* topk_idx;         // [num_tokens, num_topk]
    int32_t* num_tokens_per_rank;    // [num_ranks]
    int32_t* num_tokens_per_node;    // [num_ranks / gpus_per_node]
    int32_t* num_tokens_per_expert;  // [num_experts]
    uint8_t* is_token_in_rank;       // [num_tokens, num_ranks], 0 or 1
    int32_t num_tokens;
    int32_t num_topk;
    int32_t num_experts;
    int32_t num_ranks;
    int32_t num_nodes;
    int32_t experts_per_rank;
    int32_t num_expert_blocks;
    int32_t num_rank_blocks;
};
EP_CHECK_PARAMS_SIZE(LayoutParams, 72);

namespace {

// Counts (token, expert) pairs for the experts this block owns.
__device__ void count_experts(const LayoutParams& p, int block) {
    __shared__ int counts[kExpertsPerBlock];
    const int first = block * kExpertsPerBlock;
    const int owned = min(kExpertsPerBlock, p.num_experts - first);
    for (int i = threadIdx.x; i < kExpertsPerBlock; i += blockDim.x) {
        counts[i] = 0;
    }
    __syncthreads();
    const int64_t entries = static_cast<int64_t>(p.num_tokens) * p.num_topk;
    for (int64_t i = threadIdx.x; i < entries; i += blockDim.x) {
        const int64_t e = __ldg(p.topk_idx + i) - first;
        if (e >= 0 && e < owned) {
            atomicAdd(&counts[e], 1);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < owned; i += blockDim.x) {
        p.num_tokens_per_expert[first + i] = counts[i];
    }
}

// Counts tokens once per target (rank or node) for the targets [first, first + owned), where
// target = expert / experts_per_target. With `in_target` non-null (ranks), also writes the
// owned columns of the [num_tokens, num_targets] membership matrix.
__device__ void count_targets(const LayoutParams& p, int first, int owned, int experts_per_target,
                              int num_targets, int32_t* out_counts, uint8_t* in_target) {
    __shared__ int counts[kTargetsPerBlock];
    for (int i = threadIdx.x; i < kTargetsPerBlock; i += blockDim.x) {
        counts[i] = 0;
    }
    __syncthreads();
    const int64_t first_expert = static_cast<int64_t>(first) * experts_per_target;
    const int64_t end_expert = first_expert + static_cast<int64_t>(owned) * experts_per_target;
    for (int t = threadIdx.x; t < p.num_tokens; t += blockDim.x) {
        const int64_t* row = p.topk_idx + static_cast<int64_t>(t) * p.num_topk;
        uint64_t mask = 0;
        for (int k = 0; k < p.num_topk; ++k) {
            const int64_t e = __ldg(row + k);
            if (e >= first_expert && e < end_expert && e < p.num_experts) {
                // 32-bit division: e < num_experts fits in an int (a 64-bit one is a slow call).
                mask |= 1ull << (static_cast<int>(e - first_expert) / experts_per_target);
            }
        }
        if (in_target != nullptr) {
            uint8_t* out = in_target + static_cast<int64_t>(t) * num_targets + first;
            for (int j = 0; j < owned; ++j) {
                out[j] = static_cast<uint8_t>((mask >> j) & 1u);
            }
        }
        while (mask != 0) {
            const int j = __ffsll(static_cast<long long>(mask)) - 1;
            atomicAdd(&counts[j], 1);
            mask &= mask - 1;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < owned; i += blockDim.x) {
        out_counts[first + i] = counts[i];
    }
}

}  // namespace

EP_KERNEL void __launch_bounds__(kThreads) get_dispatch_layout(const __grid_constant__ LayoutParams p) {
    const int block = static_cast<int>(blockIdx.x);
    if (block < p.num_expert_blocks) {
        count_experts(p, block);
        return;
    }
    const int rank_block = block - p.num_expert_blocks;
    if (rank_block < p.num_rank_blocks) {
        const int first = rank_block * kTargetsPerBlock;
        const int owned = min(kTargetsPerBlock, p.num_ranks - first);
        count_targets(p, first, owned, p.experts_per_rank, p.num_ranks, p.num_tokens_per_rank,
                      p.is_token_in_rank);
        return;
    }
    const int node_block = rank_block - p.num_rank_blocks;
    const int first = node_block * kTargetsPerBlock;
    const int owned = min(kTargetsPerBlock, p.num_nodes - first);
    const int experts_per_node = p.experts_per_rank * (p.num_ranks / p.num_nodes);
    count_targets(p, first, owned, experts_per_node, p.num_nodes, p.num_tokens_per_node, nullptr);
}
