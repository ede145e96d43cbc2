// Softmax of MLA's attention scores in one pass over the two score products: for row r of
// query q of sequence s (rows = [seqs, queries, heads], token-major: mask row r / heads),
//   probs[r, j] = softmax_j((latent[r, j] + rope[r, j]) * scale + mask[s, q, j]),
// latent = q_latent . c^T and rope = q_pe . k_pe^T as the batched GEMMs leave them, mask the
// additive [seqs, queries, len] mask shared by every head. Sums, scale, mask and softmax in
// f32, one rounding to bf16; a row masked everywhere to -inf gives zeros. Launcher and host
// twin: src/attention/cuda/scores_softmax.rs, src/attention/softmax.rs (`scores_softmax`).
//
// One warp a row, in a grid-stride loop over rows: an online max and sum over the row, lanes
// combined by shuffles, then the row again for the probabilities (from L2). Rows of a multiple
// of 8 keys on 16-byte aligned tensors (the launcher's `vec`) move 8 values a lane a load (the
// scalar loop's 2-byte loads left the pass at a third of the copy bandwidth).

#include "common.cuh"

// Mirrors `ScoresSoftmaxParams` in src/attention/cuda/scores_softmax.rs.
struct ScoresSoftmaxParams {
    const __nv_bfloat16* latent;  // [seqs, queries * heads, len]
    const __nv_bfloat16* rope;    // [seqs, queries * heads, len]
    const __nv_bfloat16* mask;    // [seqs, queries, len]
    __nv_bfloat16* probs;         // [seqs, queries * heads, len]
    int64_t seqs;
    int64_t heads;
    int64_t queries;
    int64_t len;
    float scale;
    int32_t vec;                  // 1: len % 8 == 0 and every tensor 16-byte aligned
};
EP_CHECK_PARAMS_SIZE(ScoresSoftmaxParams, 72);

namespace {

__device__ __forceinline__ float score(const ScoresSoftmaxParams& p, const __nv_bfloat16* a,
                                       const __nv_bfloat16* b, const __nv_bfloat16* m,
                                       int64_t j) {
    return (ep::bf16_to_f32(a[j]) + ep::bf16_to_f32(b[j])) * p.scale + ep::bf16_to_f32(m[j]);
}

constexpr int kVec = 8;

// The 8 scores of keys j0..j0 + 8 (as `score`).
__device__ __forceinline__ void scores8(const ScoresSoftmaxParams& p, const __nv_bfloat16* a,
                                        const __nv_bfloat16* b, const __nv_bfloat16* m,
                                        int64_t j0, float (&x)[kVec]) {
    float va[kVec];
    float vb[kVec];
    float vm[kVec];
    ep::load_bf16x8(a + j0, va);
    ep::load_bf16x8(b + j0, vb);
    ep::load_bf16x8(m + j0, vm);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
        x[i] = (va[i] + vb[i]) * p.scale + vm[i];
    }
}

// One row by 8-value loads (`p.vec`): the same max, sum and probabilities as the scalar loop,
// the sum taken chunk by chunk.
__device__ __forceinline__ void softmax_row_vec(const ScoresSoftmaxParams& p,
                                                const __nv_bfloat16* a, const __nv_bfloat16* b,
                                                const __nv_bfloat16* m, __nv_bfloat16* out,
                                                int lane) {
    const int64_t chunks = p.len / kVec;
    float mx = -INFINITY;
    float sum = 0.0f;
    for (int64_t c = lane; c < chunks; c += ep::kWarpSize) {
        float x[kVec];
        scores8(p, a, b, m, c * kVec, x);
        float cmax = -INFINITY;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
            cmax = fmaxf(cmax, x[i]);
        }
        if (cmax == -INFINITY) {
            continue;
        }
        const float nm = fmaxf(mx, cmax);
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
            part += expf(x[i] - nm);  // 0 for a key masked to -inf
        }
        sum = sum * expf(mx - nm) + part;
        mx = nm;
    }
    const float row_max = ep::warp_reduce_max(mx);
    const float mine = mx == -INFINITY ? 0.0f : sum * expf(mx - row_max);
    const float row_sum = ep::warp_reduce_sum(mine);
    const float inv = row_max == -INFINITY ? 0.0f : 1.0f / row_sum;
    for (int64_t c = lane; c < chunks; c += ep::kWarpSize) {
        float x[kVec];
        scores8(p, a, b, m, c * kVec, x);
        uint32_t words[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float lo = x[2 * i] == -INFINITY ? 0.0f : expf(x[2 * i] - row_max) * inv;
            const float hi =
                x[2 * i + 1] == -INFINITY ? 0.0f : expf(x[2 * i + 1] - row_max) * inv;
            const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
            words[i] = *reinterpret_cast<const uint32_t*>(&pair);
        }
        *reinterpret_cast<uint4*>(out + c * kVec) =
            make_uint4(words[0], words[1], words[2], words[3]);
    }
}

}  // namespace

EP_KERNEL void mla_scores_softmax_bf16(const __grid_constant__ ScoresSoftmaxParams p) {
    const int64_t rows = p.seqs * p.heads * p.queries;
    const int64_t warps_per_block = blockDim.x / ep::kWarpSize;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * warps_per_block;
    const int lane = ep::lane_id();
    for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps_per_block + ep::warp_id();
         row < rows; row += warps) {
        const __nv_bfloat16* a = p.latent + row * p.len;
        const __nv_bfloat16* b = p.rope + row * p.len;
        const __nv_bfloat16* m = p.mask + row / p.heads * p.len;
        if (p.vec != 0) {
            softmax_row_vec(p, a, b, m, p.probs + row * p.len, lane);
            continue;
        }
        float mx = -INFINITY;
        float sum = 0.0f;
        for (int64_t j = lane; j < p.len; j += ep::kWarpSize) {
            const float x = score(p, a, b, m, j);
            if (x == -INFINITY) {
                continue;
            }
            const float nm = fmaxf(mx, x);
            sum = sum * expf(mx - nm) + expf(x - nm);
            mx = nm;
        }
        const float row_max = ep::warp_reduce_max(mx);
        const float part = mx == -INFINITY ? 0.0f : sum * expf(mx - row_max);
        const float row_sum = ep::warp_reduce_sum(part);
        const float inv = row_max == -INFINITY ? 0.0f : 1.0f / row_sum;
        __nv_bfloat16* out = p.probs + row * p.len;
        for (int64_t j = lane; j < p.len; j += ep::kWarpSize) {
            const float x = score(p, a, b, m, j);
            out[j] = ep::f32_to_bf16(x == -INFINITY ? 0.0f : expf(x - row_max) * inv);
        }
    }
}
