// Routing: each token's top-k experts and weights from its expert scores (one warp per token).
// Launcher and host twin: src/routing/cuda.rs (`route_topk_cuda`), src/routing/host.rs
// (`route_topk`); the rule is in src/routing/mod.rs.
//
// The warp keeps the token's selection keys in shared memory. Group scores: each lane reduces
// its members (top-2 or max), then the lanes merge. Groups and experts are picked by repeated
// warp arg-max under the total order of f32 (`f32::total_cmp`), ties to the lower id, which
// picks exactly what the host twin's sort does. Lane 0 computes the weights with the host's
// f32 operations in the host's order.

#include <climits>

#include "common.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * ep::kWarpSize;
constexpr int kMaxExperts = 1024;

enum GroupScore : int32_t { kNone = 0, kTop2Sum = 1, kMax = 2 };

// Maps f32 bits to an i32 whose order is `f32::total_cmp`'s.
EP_DEVICE int32_t total_order(float f) {
    const int32_t i = __float_as_int(f);
    return i ^ static_cast<int32_t>(static_cast<uint32_t>(i >> 31) >> 1);
}

// (order, id) of the better of two candidates: higher order, then lower id; id < 0 = none.
EP_DEVICE void better_of(int32_t& ord, int32_t& id, int32_t o2, int32_t i2) {
    if (i2 >= 0 && (id < 0 || o2 > ord || (o2 == ord && i2 < id))) {
        ord = o2;
        id = i2;
    }
}

// Warp-wide best (order, id); every lane gets it.
EP_DEVICE void warp_best(int32_t& ord, int32_t& id) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const int32_t o2 = __shfl_xor_sync(ep::kFullMask, ord, off);
        const int32_t i2 = __shfl_xor_sync(ep::kFullMask, id, off);
        better_of(ord, id, o2, i2);
    }
}

// Pushes `x` into a running top-2 (the host's `top2_sum` rule).
EP_DEVICE void top2_push(float& first, float& second, float x) {
    if (total_order(x) > total_order(first)) {
        second = first;
        first = x;
    } else if (total_order(x) > total_order(second)) {
        second = x;
    }
}

}  // namespace

// Mirrors `RouteTopkParams` in src/routing/cuda.rs.
struct RouteTopkParams {
    const float* scores;  // [T, E]
    const float* bias;    // [E] or null
    int64_t* topk_idx;    // [T, K]
    float* topk_weights;  // [T, K]
    int64_t num_tokens;
    int32_t num_experts;
    int32_t top_k;
    int32_t n_group;
    int32_t topk_group;
    int32_t group_score;  // GroupScore
    int32_t norm_topk_prob;
    float scaling;
    int32_t reserved;
};
EP_CHECK_PARAMS_SIZE(RouteTopkParams, 72);

EP_KERNEL void __launch_bounds__(kThreads) route_topk(const __grid_constant__ RouteTopkParams p) {
    __shared__ float keys[kWarps][kMaxExperts];
    __shared__ uint8_t taken[kWarps][kMaxExperts];
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const int e = p.num_experts;
    const bool grouped = p.group_score != kNone && p.n_group > 1;
    const int per_group = grouped ? e / p.n_group : e;
    float* key = keys[warp];
    uint8_t* used = taken[warp];
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < p.num_tokens;
         t += static_cast<int64_t>(gridDim.x) * kWarps) {
        const float* s = p.scores + t * e;
        for (int j = lane; j < e; j += ep::kWarpSize) {
            key[j] = p.bias != nullptr ? s[j] + p.bias[j] : s[j];
            used[j] = 0;
        }
        __syncwarp();

        // Groups: lane g ends with group g's score; then the topk_group best are allowed.
        uint32_t allowed = 0xffffffffu;
        if (grouped) {
            float mine = -INFINITY;
            for (int g = 0; g < p.n_group; ++g) {
                const float* m = key + g * per_group;
                float score;
                if (p.group_score == kTop2Sum) {
                    float first = -INFINITY;
                    float second = -INFINITY;
                    for (int j = lane; j < per_group; j += ep::kWarpSize) {
                        top2_push(first, second, m[j]);
                    }
#pragma unroll
                    for (int off = 16; off > 0; off >>= 1) {
                        const float f2 = __shfl_xor_sync(ep::kFullMask, first, off);
                        const float s2 = __shfl_xor_sync(ep::kFullMask, second, off);
                        top2_push(first, second, f2);
                        top2_push(first, second, s2);
                    }
                    score = per_group < 2 ? first : first + second;
                } else {
                    float best = -INFINITY;
                    for (int j = lane; j < per_group; j += ep::kWarpSize) {
                        best = fmaxf(best, m[j]);
                    }
                    score = ep::warp_reduce_max(best);
                }
                if (lane == g) {
                    mine = score;
                }
            }
            allowed = 0;
            bool picked = false;
            for (int i = 0; i < p.topk_group; ++i) {
                int32_t ord = total_order(mine);
                int32_t id = (lane < p.n_group && !picked) ? lane : -1;
                warp_best(ord, id);
                allowed |= 1u << id;
                picked |= lane == id;
            }
        }

        // Top-k experts among the allowed groups.
        int64_t chosen = -1;  // lane i < K holds the i-th choice
        for (int i = 0; i < p.top_k; ++i) {
            int32_t ord = 0;
            int32_t id = -1;
            for (int j = lane; j < e; j += ep::kWarpSize) {
                if (!used[j] && (allowed >> (j / per_group)) & 1u) {
                    better_of(ord, id, total_order(key[j]), j);
                }
            }
            warp_best(ord, id);
            if (lane == 0) {
                used[id] = 1;
            }
            if (lane == i) {
                chosen = id;
            }
            __syncwarp();
        }

        // Weights, in the host's order of f32 operations.
        float w = lane < p.top_k ? s[chosen] : 0.0f;
        if (p.norm_topk_prob) {
            float sum = 0.0f;
            for (int i = 0; i < p.top_k; ++i) {
                sum = __fadd_rn(sum, __shfl_sync(ep::kFullMask, w, i));
            }
            sum = __fadd_rn(sum, 1e-20f);
            w = __fdiv_rn(w, sum);
        }
        w = __fmul_rn(w, p.scaling);
        if (lane < p.top_k) {
            p.topk_idx[t * p.top_k + lane] = chosen;
            p.topk_weights[t * p.top_k + lane] = w;
        }
        __syncwarp();
    }
}
