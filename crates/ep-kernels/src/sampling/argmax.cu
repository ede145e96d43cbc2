// Greedy sampling: the index of the largest logit of each row, the first one on ties, without
// reading the logits back. Each row is cut into `chunks` runs, one block a run; a block reduces
// its run to (value, index) by shuffles and shared memory and folds it into the row's 64-bit
// key with one atomicMax: the value in order-preserving bits above, the complement of the index
// below (so the smaller index wins a tie). Keys start at 0 (below every value's key). f32 or
// bf16 logits (read as they lie, compared in f32: a model's bf16 logits need no cast first).
// Launcher and host twin: src/sampling/cuda/argmax.rs, src/sampling/mod.rs (`argmax_rows`).

#include "common.cuh"

// Mirrors `ArgmaxParams` in src/sampling/cuda/argmax.rs.
struct ArgmaxParams {
    const void* logits;   // [rows, vocab], f32 or bf16 (the entry point's)
    unsigned long long* keys;  // [rows], zeroed
    int64_t rows;
    int64_t vocab;
    int64_t chunk;  // values of a run (the last run may be shorter); a multiple of 8 with `vec`
    int32_t vec;    // bf16 only: 8 values a load (vocab % 8 == 0, logits 16-byte aligned)
    int32_t pad_;
};
EP_CHECK_PARAMS_SIZE(ArgmaxParams, 48);

namespace {

// Larger value first, then the smaller index. NaN never wins a comparison.
__device__ __forceinline__ bool better(float v, int64_t i, float bv, int64_t bi) {
    return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return ep::bf16_to_f32(v); }

template <typename T>
__device__ __forceinline__ void argmax_rows(const ArgmaxParams& p) {
    __shared__ float s_val[32];
    __shared__ int64_t s_idx[32];
    const int64_t row = blockIdx.y;
    const int64_t begin = static_cast<int64_t>(blockIdx.x) * p.chunk;
    const int64_t end = begin + p.chunk < p.vocab ? begin + p.chunk : p.vocab;
    const T* x = static_cast<const T*>(p.logits) + row * p.vocab;
    float bv = -INFINITY;
    int64_t bi = begin + threadIdx.x < end ? begin + threadIdx.x : begin;
    if constexpr (sizeof(T) == 2) {
        if (p.vec != 0) {
            // 8 values a load, in index order within the load (the first largest wins).
            for (int64_t i = begin + 8 * static_cast<int64_t>(threadIdx.x); i < end;
                 i += 8 * static_cast<int64_t>(blockDim.x)) {
                const uint4 raw = *reinterpret_cast<const uint4*>(x + i);
                const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(&words[w]);
                    const float lo = __low2float(pair);
                    const float hi = __high2float(pair);
                    if (lo > bv) {
                        bv = lo;
                        bi = i + 2 * w;
                    }
                    if (hi > bv) {
                        bv = hi;
                        bi = i + 2 * w + 1;
                    }
                }
            }
        }
    }
    if (p.vec == 0) {
        for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const float v = to_f32(x[i]);
            if (v > bv) {
                bv = v;
                bi = i;
            }
        }
    }
#pragma unroll
    for (int offset = ep::kWarpSize / 2; offset > 0; offset >>= 1) {
        const float ov = __shfl_xor_sync(ep::kFullMask, bv, offset);
        const int64_t oi = __shfl_xor_sync(ep::kFullMask, bi, offset);
        if (better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    const int warp = ep::warp_id();
    const int warps = static_cast<int>(blockDim.x) / ep::kWarpSize;
    if (ep::lane_id() == 0) {
        s_val[warp] = bv;
        s_idx[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < warps; ++w) {
            if (better(s_val[w], s_idx[w], bv, bi)) {
                bv = s_val[w];
                bi = s_idx[w];
            }
        }
        // -0 as +0 (they compare equal); then sign-magnitude to an unsigned order.
        const unsigned bits = __float_as_uint(bv + 0.0f);
        const unsigned ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
        const unsigned long long key = (static_cast<unsigned long long>(ordered) << 32) |
                                       (0xffffffffull - static_cast<unsigned long long>(bi));
        atomicMax(p.keys + row, key);
    }
}

}  // namespace

EP_KERNEL void argmax_rows_f32(const __grid_constant__ ArgmaxParams p) { argmax_rows<float>(p); }

EP_KERNEL void argmax_rows_bf16(const __grid_constant__ ArgmaxParams p) {
    argmax_rows<__nv_bfloat16>(p);
}
