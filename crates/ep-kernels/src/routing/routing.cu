// Routing: each token's top-k experts and weights from its expert scores, or from its gate
// logits scored here first (sigmoid or softmax), one warp per token. Launcher and host twin:
// src/routing/cuda.rs (`route_topk_cuda`), src/routing/host.rs (`route_topk`); the rule is in
// src/routing/mod.rs, the scoring functions in src/routing/scoring.rs, which the device
// functions below mirror operation for operation (explicitly rounded intrinsics, so that no
// multiply-add is contracted differently): the same bits on both sides.
//
// The warp keeps the token's scores and selection keys in shared memory. Group scores: each
// lane reduces its members (top-2 or max), then the lanes merge. Groups and experts are picked
// by repeated warp arg-max under the total order of f32 (`f32::total_cmp`), ties to the lower
// id, which picks exactly what the host twin's sort does; for the experts each lane keeps its
// own best candidate between rounds, so a round costs one arg-max and one lane's rescan (a
// serial chain of instructions is this kernel's whole cost at a few tokens). Lane 0 computes
// the weights with the host's f32 operations in the host's order.

#include <climits>

#include "common.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * ep::kWarpSize;
constexpr int kMaxExperts = 1024;

enum GroupScore : int32_t { kNone = 0, kTop2Sum = 1, kMax = 2 };
// What the `scores` rows hold (`TopkInput` on the Rust side).
enum Input : int32_t { kScores = 0, kSigmoidLogits = 1, kSoftmaxLogits = 2 };

// `scoring::exp_f32`: range reduction, Taylor polynomial, exact scaling by 2^k.
EP_DEVICE float exp_f32(float x) {
    if (isnan(x)) {
        return x;
    }
    x = fminf(fmaxf(x, -110.0f), 100.0f);
    // log2(e), ln2 = hi + lo, Taylor coefficients 1/7! .. 1/3!: the bits of scoring.rs.
    const float kf = rintf(__fmul_rn(x, __uint_as_float(0x3fb8aa3bu)));
    float r = __fmaf_rn(-kf, __uint_as_float(0x3f317200u), x);
    r = __fmaf_rn(-kf, __uint_as_float(0x35bfbe8eu), r);
    float q = __uint_as_float(0x39500d01u);
    q = __fmaf_rn(q, r, __uint_as_float(0x3ab60b61u));
    q = __fmaf_rn(q, r, __uint_as_float(0x3c088889u));
    q = __fmaf_rn(q, r, __uint_as_float(0x3d2aaaabu));
    q = __fmaf_rn(q, r, __uint_as_float(0x3e2aaaabu));
    q = __fmaf_rn(q, r, 0.5f);
    q = __fmaf_rn(q, r, 1.0f);
    q = __fmaf_rn(q, r, 1.0f);
    const int k = static_cast<int>(kf);
    const int k1 = k / 2;
    const float s1 = __int_as_float((k1 + 127) << 23);
    const float s2 = __int_as_float((k - k1 + 127) << 23);
    return __fmul_rn(__fmul_rn(q, s1), s2);
}

// `scoring::sigmoid`.
EP_DEVICE float sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-x))); }

// `scoring::softmax` of the `e` logits `l` into `out`, by the whole warp.
EP_DEVICE void softmax(const float* l, float* out, int e, int lane) {
    float max = -INFINITY;
    for (int j = lane; j < e; j += ep::kWarpSize) {
        max = fmaxf(max, l[j]);
    }
    max = ep::warp_reduce_max(max);
    float sum = 0.0f;
    for (int j = lane; j < e; j += ep::kWarpSize) {
        const float ex = exp_f32(__fsub_rn(l[j], max));
        out[j] = ex;
        sum = __fadd_rn(sum, ex);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        sum = __fadd_rn(sum, __shfl_xor_sync(ep::kFullMask, sum, off));
    }
    for (int j = lane; j < e; j += ep::kWarpSize) {
        out[j] = __fdiv_rn(out[j], sum);
    }
}

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
    const float* scores;  // [T, E] scores or logits (`input`)
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
    int32_t input;  // Input
};
EP_CHECK_PARAMS_SIZE(RouteTopkParams, 72);

EP_KERNEL void __launch_bounds__(kThreads) route_topk(const __grid_constant__ RouteTopkParams p) {
    __shared__ float keys[kWarps][kMaxExperts];
    __shared__ float token_scores[kWarps][kMaxExperts];
    __shared__ uint8_t taken[kWarps][kMaxExperts];
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const int e = p.num_experts;
    const bool grouped = p.group_score != kNone && p.n_group > 1;
    const int per_group = grouped ? e / p.n_group : e;
    float* key = keys[warp];
    float* score = token_scores[warp];
    uint8_t* used = taken[warp];
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < p.num_tokens;
         t += static_cast<int64_t>(gridDim.x) * kWarps) {
        const float* s = p.scores + t * e;
        if (p.input == kSoftmaxLogits) {
            softmax(s, score, e, lane);
        } else {
            for (int j = lane; j < e; j += ep::kWarpSize) {
                score[j] = p.input == kSigmoidLogits ? sigmoid(s[j]) : s[j];
            }
        }
        // Each lane reads back only the elements it wrote.
        for (int j = lane; j < e; j += ep::kWarpSize) {
            key[j] = p.bias != nullptr ? __fadd_rn(score[j], p.bias[j]) : score[j];
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

        // Top-k experts among the allowed groups. `used` marks the experts no longer
        // eligible (taken, or in a group not allowed); each lane keeps the best eligible expert
        // among its own (j = lane mod 32), so that a round is one warp arg-max plus a rescan by
        // the lane that owned the winner.
        for (int j = lane; j < e; j += ep::kWarpSize) {
            used[j] = ((allowed >> (j / per_group)) & 1u) ? 0 : 1;
        }
        __syncwarp();
        int32_t mine_ord = 0;
        int32_t mine_id = -1;
        bool rescan = true;  // every lane scans once, then the winner's lane after each round
        int64_t chosen = -1;  // lane i < K holds the i-th choice
        for (int i = 0; i < p.top_k; ++i) {
            if (rescan) {
                mine_ord = 0;
                mine_id = -1;
                for (int j = lane; j < e; j += ep::kWarpSize) {
                    if (!used[j]) {
                        better_of(mine_ord, mine_id, total_order(key[j]), j);
                    }
                }
            }
            int32_t ord = mine_ord;
            int32_t id = mine_id;
            warp_best(ord, id);
            if (lane == i) {
                chosen = id;
            }
            rescan = id >= 0 && (id % ep::kWarpSize) == lane;
            if (rescan) {
                used[id] = 1;
            }
        }

        // Weights, in the host's order of f32 operations.
        float w = lane < p.top_k ? score[chosen] : 0.0f;
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
