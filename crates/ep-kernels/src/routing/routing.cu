// Routing: each token's top-k experts and weights from its expert scores, or from its gate logits
// scored here first (sigmoid or softmax), one warp per token. Launcher and host twin:
// src/routing/cuda/routing.rs (`route_topk_cuda`), src/routing/host.rs (`route_topk`); the rule is
// in src/routing/mod.rs, the scoring functions in src/routing/scoring.rs, which the device
// functions below mirror operation for operation (explicitly rounded intrinsics, so that no
// multiply-add is contracted differently): the same bits on both sides.
//
// Layout: lane l of the token's warp owns the experts [l * R, l * R + R), R = ceil(E / 32)
// (the last lanes may own fewer or none), in registers: all loads are issued first, then the
// scores and keys are computed lane-locally (softmax sums its terms in the host's order through
// shared memory). Keys are compared as u32 images of `f32::total_cmp` order.
// - Groups: when they are made of whole lanes (E % 32 == 0 and n_group divides 32), each lane
//   reduces its run (top-2 or max), then log2(32 / n_group) shuffle steps give every group's
//   score at once; otherwise lanes read the keys back from shared memory, a stride per group,
//   and merge with a segmented shuffle tree. The top-2 of a multiset does not depend on the
//   order (keys equal in the total order have the same bits). Lane g then ranks group g against
//   all groups (higher score, or equal and lower id, as the host's sort), and the ranks below
//   topk_group are allowed; each lane keeps its eligible experts as a bit mask.
// - Experts: each lane keeps its best eligible key and the lowest slot holding it; a round is a
//   `redux.sync` max, a ballot of the lanes holding it and the lowest of them (lanes own runs in
//   order, so it holds the lowest such id), which drops that expert and rescans its registers.
// - Weights: lane i < K reads its choice's score back from shared memory and applies the host's
//   f32 operations in the host's order.
// One kernel per bound kR on R (`route_topk_r{kR}`), so each size has its own registers.

#include "common.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * ep::kWarpSize;

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

// Maps f32 bits to an i32 whose order is `f32::total_cmp`'s.
EP_DEVICE int32_t total_order(float f) {
    const int32_t i = __float_as_int(f);
    return i ^ static_cast<int32_t>(static_cast<uint32_t>(i >> 31) >> 1);
}

// The same order on u32 (the sign bit of `total_order` flipped), for `redux.sync` and
// integer min / max; `from_ukey` inverts it.
EP_DEVICE uint32_t ukey(float f) { return static_cast<uint32_t>(total_order(f)) ^ 0x80000000u; }
EP_DEVICE float from_ukey(uint32_t u) {
    const int32_t i = static_cast<int32_t>(u ^ 0x80000000u);
    return __int_as_float(i ^ static_cast<int32_t>(static_cast<uint32_t>(i >> 31) >> 1));
}
// `ukey(-inf)`: the start of the host's top-2 (only negative NaNs order below it).
constexpr uint32_t kUkeyNegInf = 0x007fffffu;

EP_HOST_DEVICE constexpr int log2_of(int n) { return n <= 1 ? 0 : 1 + log2_of(n / 2); }

EP_DEVICE uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }
EP_DEVICE uint32_t umin(uint32_t a, uint32_t b) { return a < b ? a : b; }

// Top-2 (first >= second) of the union of two multisets given by their top-2: the host's
// `top2_sum` pushes give the top-2 of the multiset of keys plus two -inf, whatever the order
// (keys equal in the total order have the same bits).
EP_DEVICE void top2_merge(uint32_t& f, uint32_t& s, uint32_t f2, uint32_t s2) {
    s = umax(umin(f, f2), umax(s, s2));
    f = umax(f, f2);
}

// The best of a lane's eligible keys (bit r of `m`): its key `v` (0 when none, which a NaN's
// key can also be: callers test `m != 0`) and the lowest slot holding it (-1 when none).
template <int kR>
EP_DEVICE void lane_best(const uint32_t (&uk)[kR], uint32_t m, uint32_t& v, int& slot) {
    uint32_t t[kR];
#pragma unroll
    for (int r = 0; r < kR; ++r) {
        t[r] = ((m >> r) & 1u) ? uk[r] : 0u;
    }
#pragma unroll
    for (int level = 1; level <= log2_of(kR); ++level) {
        const int w = kR >> level;
#pragma unroll
        for (int r = 0; r < kR / 2; ++r) {
            if (r < w) {
                t[r] = umax(t[r], t[r + w]);
            }
        }
    }
    v = t[0];
    uint32_t eq = 0;
#pragma unroll
    for (int r = 0; r < kR; ++r) {
        eq |= (((m >> r) & 1u) != 0u && uk[r] == v) ? (1u << r) : 0u;
    }
    slot = __ffs(static_cast<int>(eq)) - 1;
}

// Lane-local top-2 of the first `count` keys (the others count as -inf).
template <int kR>
EP_DEVICE void lane_top2(const uint32_t (&uk)[kR], int count, uint32_t& f, uint32_t& s) {
    uint32_t a[kR / 2];
    uint32_t b[kR / 2];
#pragma unroll
    for (int r = 0; r < kR / 2; ++r) {
        const uint32_t x0 = 2 * r < count ? uk[2 * r] : kUkeyNegInf;
        const uint32_t x1 = 2 * r + 1 < count ? uk[2 * r + 1] : kUkeyNegInf;
        a[r] = umax(x0, x1);
        b[r] = umin(x0, x1);
    }
#pragma unroll
    for (int level = 2; level <= log2_of(kR); ++level) {
        const int w = kR >> level;
#pragma unroll
        for (int r = 0; r < kR / 4; ++r) {
            if (r < w) {
                top2_merge(a[r], b[r], a[r + w], b[r + w]);
            }
        }
    }
    f = a[0];
    s = b[0];
}

// Number of groups h < n_group better than `mine` (group `lane`): higher key, or the same key
// and a lower id. Group h's key is at lane h * lpg.
template <int kG>
EP_DEVICE int groups_better(uint32_t gkey, uint32_t mine, int n_group, int lpg, int lane) {
    int c = 0;
#pragma unroll
    for (int h = 0; h < kG; ++h) {
        const uint32_t o = __shfl_sync(ep::kFullMask, gkey, (h < n_group ? h : 0) * lpg);
        c += (h < n_group && (o > mine || (o == mine && h < lane))) ? 1 : 0;
    }
    return c;
}

// Sum of the values of lanes 0 .. k-1 in lane order, from 0.0f (the host's `sum`).
template <int kK>
EP_DEVICE float sum_in_order(float w, int k) {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kK; ++i) {
        const float x = __shfl_sync(ep::kFullMask, w, i);
        if (i < k) {
            sum = __fadd_rn(sum, x);
        }
    }
    return sum;
}

}  // namespace

// Mirrors `RouteTopkParams` in src/routing/cuda/routing.rs.
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

namespace {

// The tokens of this warp, with up to kR experts per lane: lane l owns the experts
// [l * R, l * R + R) (R = ceil(E / 32) <= kR; the last lanes may own fewer or none), in
// registers. `score_sh` (the token's scores, for the weights) and `key_sh` are this warp's.
template <int kR>
EP_DEVICE void route_tokens(const RouteTopkParams& p, float* score_sh, float* key_sh) {
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const int e = p.num_experts;
    const int run = (e + ep::kWarpSize - 1) / ep::kWarpSize;  // R
    const int base = lane * run;
    const int count = max(0, min(run, e - base));
    const uint32_t valid = count >= 32 ? 0xffffffffu : (1u << count) - 1u;
    const bool has_bias = p.bias != nullptr;
    const bool grouped = p.group_score != kNone && p.n_group > 1;
    const int n_group = grouped ? p.n_group : 1;
    const int per_group = e / n_group;
    const int lpg = ep::kWarpSize / n_group;  // lanes per group
    // Groups made of whole lanes: lane l is in group l / lpg.
    const bool aligned = e % ep::kWarpSize == 0 && ep::kWarpSize % n_group == 0;
    const int k = p.top_k;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < p.num_tokens;
         t += static_cast<int64_t>(gridDim.x) * kWarps) {
        const float* row = p.scores + t * e;
        // All loads first.
        float x[kR];
        float b[kR];
        const bool vec = kR % 4 == 0 && e == ep::kWarpSize * kR &&
                         ((reinterpret_cast<uintptr_t>(row) | reinterpret_cast<uintptr_t>(p.bias)) &
                          15u) == 0;
        if (vec) {
#pragma unroll
            for (int q = 0; q < kR / 4; ++q) {
                const float4 v = __ldg(reinterpret_cast<const float4*>(row + base) + q);
                x[4 * q] = v.x;
                x[4 * q + 1] = v.y;
                x[4 * q + 2] = v.z;
                x[4 * q + 3] = v.w;
                if (has_bias) {
                    const float4 c = __ldg(reinterpret_cast<const float4*>(p.bias + base) + q);
                    b[4 * q] = c.x;
                    b[4 * q + 1] = c.y;
                    b[4 * q + 2] = c.z;
                    b[4 * q + 3] = c.w;
                } else {
                    b[4 * q] = b[4 * q + 1] = b[4 * q + 2] = b[4 * q + 3] = 0.0f;
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < kR; ++r) {
                x[r] = r < count ? __ldg(row + base + r) : 0.0f;
                b[r] = has_bias && r < count ? __ldg(p.bias + base + r) : 0.0f;
            }
        }

        // Scores (kept in `score_sh` for the weights).
        float sc[kR];
        if (p.input == kSoftmaxLogits) {
            // `scoring::softmax`: the max, then each lane sums the terms j = lane, lane + 32,
            // ... in order (through shared memory), then the butterfly.
            float mx = -INFINITY;
#pragma unroll
            for (int r = 0; r < kR; ++r) {
                if (r < count) {
                    mx = fmaxf(mx, x[r]);
                }
            }
            mx = ep::warp_reduce_max(mx);
#pragma unroll
            for (int r = 0; r < kR; ++r) {
                sc[r] = exp_f32(__fsub_rn(x[r], mx));
                if (r < count) {
                    score_sh[base + r] = sc[r];
                }
            }
            __syncwarp();
            float part[kR];
#pragma unroll
            for (int m = 0; m < kR; ++m) {
                const int j = lane + m * ep::kWarpSize;
                part[m] = j < e ? score_sh[j] : 0.0f;
            }
            float sum = 0.0f;
#pragma unroll
            for (int m = 0; m < kR; ++m) {
                if (lane + m * ep::kWarpSize < e) {
                    sum = __fadd_rn(sum, part[m]);
                }
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                sum = __fadd_rn(sum, __shfl_xor_sync(ep::kFullMask, sum, off));
            }
            __syncwarp();  // every lane has read the terms before they are overwritten
#pragma unroll
            for (int r = 0; r < kR; ++r) {
                sc[r] = __fdiv_rn(sc[r], sum);
            }
        } else if (p.input == kSigmoidLogits) {
#pragma unroll
            for (int r = 0; r < kR; ++r) {
                sc[r] = sigmoid(x[r]);
            }
        } else {
#pragma unroll
            for (int r = 0; r < kR; ++r) {
                sc[r] = x[r];
            }
        }
        uint32_t uk[kR];
        float key[kR];
#pragma unroll
        for (int r = 0; r < kR; ++r) {
            key[r] = has_bias ? __fadd_rn(sc[r], b[r]) : sc[r];
            uk[r] = ukey(key[r]);
            if (r < count) {
                score_sh[base + r] = sc[r];
            }
        }

        // Groups: the key of group g ends at lane g * lpg; the topk_group best are allowed.
        uint32_t m = valid;  // this lane's eligible experts
        if (grouped) {
            float gs;
            if (aligned) {
                // Lane-local, then log2(lpg) shuffle steps for all groups at once.
                if (p.group_score == kTop2Sum) {
                    uint32_t f;
                    uint32_t s;
                    lane_top2<kR>(uk, count, f, s);
                    for (int off = 1; off < lpg; off <<= 1) {
                        const uint32_t f2 = __shfl_xor_sync(ep::kFullMask, f, off);
                        const uint32_t s2 = __shfl_xor_sync(ep::kFullMask, s, off);
                        top2_merge(f, s, f2, s2);
                    }
                    f = umax(f, kUkeyNegInf);
                    s = umax(s, kUkeyNegInf);
                    gs = per_group < 2 ? from_ukey(f) : __fadd_rn(from_ukey(f), from_ukey(s));
                } else {
                    gs = -INFINITY;
#pragma unroll
                    for (int r = 0; r < kR; ++r) {
                        if (r < count) {
                            gs = fmaxf(gs, key[r]);
                        }
                    }
                    for (int off = 1; off < lpg; off <<= 1) {
                        gs = fmaxf(gs, __shfl_xor_sync(ep::kFullMask, gs, off));
                    }
                }
            } else {
                // Groups across lanes: lpg lanes per group read its keys back from shared
                // memory (a stride of lpg), then a segmented shuffle-down tree.
#pragma unroll
                for (int r = 0; r < kR; ++r) {
                    if (r < count) {
                        key_sh[base + r] = key[r];
                    }
                }
                __syncwarp();
                const int g = lane / lpg;
                const int sub = lane - g * lpg;
                const int lo = g * per_group;
                const int hi = g < n_group ? lo + per_group : lo;
                if (p.group_score == kTop2Sum) {
                    uint32_t f = kUkeyNegInf;
                    uint32_t s = kUkeyNegInf;
                    for (int j = lo + sub; j < hi; j += lpg) {
                        const uint32_t u = ukey(key_sh[j]);
                        s = umax(s, umin(f, u));
                        f = umax(f, u);
                    }
                    for (int off = 1; off < lpg; off <<= 1) {
                        const uint32_t f2 = __shfl_down_sync(ep::kFullMask, f, off);
                        const uint32_t s2 = __shfl_down_sync(ep::kFullMask, s, off);
                        if (sub + off < lpg) {
                            top2_merge(f, s, f2, s2);
                        }
                    }
                    gs = per_group < 2 ? from_ukey(f) : __fadd_rn(from_ukey(f), from_ukey(s));
                } else {
                    gs = -INFINITY;
                    for (int j = lo + sub; j < hi; j += lpg) {
                        gs = fmaxf(gs, key_sh[j]);
                    }
                    for (int off = 1; off < lpg; off <<= 1) {
                        const float o = __shfl_down_sync(ep::kFullMask, gs, off);
                        if (sub + off < lpg) {
                            gs = fmaxf(gs, o);
                        }
                    }
                }
            }
            // Lane g < n_group ranks group g against all groups (the host's sort).
            const uint32_t gkey = ukey(gs);
            const uint32_t mine =
                __shfl_sync(ep::kFullMask, gkey, (lane < n_group ? lane : 0) * lpg);
            const int better = n_group <= 8
                                   ? groups_better<8>(gkey, mine, n_group, lpg, lane)
                                   : groups_better<32>(gkey, mine, n_group, lpg, lane);
            const uint32_t allowed =
                __ballot_sync(ep::kFullMask, lane < n_group && better < p.topk_group);
            if (aligned) {
                m = ((allowed >> (lane / lpg)) & 1u) ? valid : 0u;
            } else {
                // Expert j is in group j / per_group; a run crosses a boundary at most once
                // per expert.
                m = 0;
                int gj = base / per_group;
                int next = (gj + 1) * per_group;
#pragma unroll
                for (int r = 0; r < kR; ++r) {
                    if (base + r == next) {
                        ++gj;
                        next += per_group;
                    }
                    if (r < count && ((allowed >> (gj & 31)) & 1u) != 0u) {
                        m |= 1u << r;
                    }
                }
            }
        }

        // Top-k experts: per round, the warp's best key (redux.sync), the lowest lane holding
        // it (that lane's lowest such slot is the lowest such expert, since lanes own runs in
        // order), which gives up that expert and finds its next best.
        uint32_t v;
        int slot;
        lane_best<kR>(uk, m, v, slot);
        int chosen = 0;  // lane i < K: the i-th choice
        for (int i = 0; i < k; ++i) {
            const bool has = m != 0u;
            const uint32_t best = __reduce_max_sync(ep::kFullMask, has ? v : 0u);
            const uint32_t holders = __ballot_sync(ep::kFullMask, has && v == best);
            const int w = __ffs(static_cast<int>(holders)) - 1;
            const int id = __shfl_sync(ep::kFullMask, base + slot, w);
            chosen = lane == i ? id : chosen;
            if (lane == w) {
                m &= ~(1u << (slot & 31));
                lane_best<kR>(uk, m, v, slot);
            }
        }

        // Weights, in the host's order of f32 operations.
        __syncwarp();  // the scores of every lane are in `score_sh`
        float wt = lane < k ? score_sh[chosen] : 0.0f;
        if (p.norm_topk_prob) {
            float sum = k <= 8 ? sum_in_order<8>(wt, k) : sum_in_order<32>(wt, k);
            sum = __fadd_rn(sum, 1e-20f);
            wt = __fdiv_rn(wt, sum);
        }
        wt = __fmul_rn(wt, p.scaling);
        if (lane < k) {
            p.topk_idx[t * k + lane] = chosen;
            p.topk_weights[t * k + lane] = wt;
        }
        __syncwarp();  // shared memory is reused by the next token
    }
}

}  // namespace

// One kernel per bound on the experts per lane (`route_topk_r{kR}` for ceil(E / 32) <= kR;
// the launcher picks it), so that each has the registers and shared memory of its size.
template <int kR>
EP_DEVICE void route_kernel(const RouteTopkParams& p) {
    __shared__ __align__(16) float scores[kWarps][ep::kWarpSize * kR];
    __shared__ __align__(16) float keys[kWarps][ep::kWarpSize * kR];
    const int warp = ep::warp_id();
    route_tokens<kR>(p, scores[warp], keys[warp]);
}

#define EP_ROUTE_TOPK(R, MIN_BLOCKS)                                                            \
    EP_KERNEL void __launch_bounds__(kThreads, MIN_BLOCKS)                                     \
        route_topk_r##R(const __grid_constant__ RouteTopkParams p) {                           \
        route_kernel<R>(p);                                                                      \
    }
EP_ROUTE_TOPK(2, 8)
EP_ROUTE_TOPK(4, 8)
EP_ROUTE_TOPK(8, 8)
EP_ROUTE_TOPK(16, 6)
EP_ROUTE_TOPK(32, 4)
