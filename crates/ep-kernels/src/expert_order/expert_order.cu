// Expert-major order (see src/expert_order/mod.rs): count the (token, slot) pairs per local expert,
// place every pair at a row of its expert's group (atomics) and copy the token's row there, and the
// weighted sum back per token. Launchers: src/expert_order/cuda/expert_order.rs; host twins:
// src/expert_order/host.rs.
//
// Rows are bf16 vectors of a multiple of 16 bytes, copied with 16-byte accesses. A local
// expert id outside [-1, num_local), or a placement past the rows of `a` / `y`, traps.

#include <cub/block/block_scan.cuh>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / ep::kWarpSize;
constexpr int kMaxLocal = 1024;
constexpr int kPerThread = kMaxLocal / kThreads;

}  // namespace

// Mirrors `PermuteParams` in src/expert_order/cuda/expert_order.rs.
struct PermuteParams {
    const int4* x;           // [num_tokens, row_vectors]
    const int64_t* topk_idx; // [num_tokens, top_k]
    int4* a;                 // [a_rows, row_vectors]
    int32_t* counts;         // [num_local], zeroed before expert_count
    int32_t* fill;           // [num_local], zeroed before expert_permute
    int32_t* positions;      // [num_tokens, top_k]
    int64_t num_tokens;
    int64_t row_vectors;     // 16-byte vectors per row
    int64_t a_rows;
    int32_t top_k;
    int32_t num_local;
    int32_t alignment;
    int32_t reserved;
};
EP_CHECK_PARAMS_SIZE(PermuteParams, 88);

EP_KERNEL void __launch_bounds__(kThreads) expert_count(const __grid_constant__ PermuteParams p) {
    __shared__ int32_t hist[kMaxLocal];
    for (int i = threadIdx.x; i < p.num_local; i += kThreads) {
        hist[i] = 0;
    }
    __syncthreads();
    const int64_t pairs = p.num_tokens * p.top_k;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < pairs;
         i += static_cast<int64_t>(gridDim.x) * kThreads) {
        const int64_t e = p.topk_idx[i];
        if (e < -1 || e >= p.num_local) {
            printf("ep expert order: topk_idx[%lld] = %lld is not -1 or a local expert below %d\n",
                   static_cast<long long>(i), static_cast<long long>(e), p.num_local);
            asm volatile("trap;");
        }
        if (e >= 0) {
            atomicAdd(&hist[e], 1);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < p.num_local; i += kThreads) {
        if (hist[i] != 0) {
            atomicAdd(&p.counts[i], hist[i]);
        }
    }
}

EP_KERNEL void __launch_bounds__(kThreads) expert_permute(const __grid_constant__ PermuteParams p) {
    using Scan = cub::BlockScan<int64_t, kThreads>;
    __shared__ typename Scan::TempStorage scan;
    __shared__ int64_t starts[kMaxLocal];
    {
        int64_t v[kPerThread];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int g = threadIdx.x * kPerThread + i;
            const int64_t c = g < p.num_local ? p.counts[g] : 0;
            v[i] = (c + p.alignment - 1) / p.alignment * p.alignment;
        }
        Scan(scan).ExclusiveSum(v, v);
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int g = threadIdx.x * kPerThread + i;
            if (g < p.num_local) {
                starts[g] = v[i];
            }
        }
    }
    __syncthreads();
    const int lane = ep::lane_id();
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + ep::warp_id();
         t < p.num_tokens; t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
        // Lane s < top_k places slot s.
        int64_t pos = -1;
        if (lane < p.top_k) {
            const int64_t e = p.topk_idx[t * p.top_k + lane];
            if (e >= 0) {
                pos = starts[e] + atomicAdd(&p.fill[e], 1);
                if (pos >= p.a_rows) {
                    printf("ep expert order: row %lld is past the %lld rows of a\n",
                           static_cast<long long>(pos), static_cast<long long>(p.a_rows));
                    asm volatile("trap;");
                }
            }
            p.positions[t * p.top_k + lane] = static_cast<int32_t>(pos);
        }
        const int4* src = p.x + t * p.row_vectors;
        // Every lane runs every round (the shuffles need the whole warp).
        for (int64_t base = 0; base < p.row_vectors; base += ep::kWarpSize) {
            const int64_t i = base + lane;
            int4 v;
            if (i < p.row_vectors) {
                v = ep::ld_nc_no_alloc(src + i);
            }
            for (int s = 0; s < p.top_k; ++s) {
                const int64_t dst = __shfl_sync(ep::kFullMask, pos, s);
                if (dst >= 0 && i < p.row_vectors) {
                    p.a[dst * p.row_vectors + i] = v;
                }
            }
        }
    }
}

// Mirrors `UnpermuteParams` in src/expert_order/cuda/expert_order.rs.
struct UnpermuteParams {
    const int4* y;           // [y_rows, row_vectors] bf16
    const int32_t* positions;// [num_tokens, top_k]
    const float* weights;    // [num_tokens, top_k]
    int4* out;               // [num_tokens, row_vectors] bf16
    int64_t num_tokens;
    int64_t row_vectors;
    int64_t y_rows;
    int32_t top_k;
    int32_t reserved;
};
EP_CHECK_PARAMS_SIZE(UnpermuteParams, 64);

EP_KERNEL void __launch_bounds__(kThreads) expert_unpermute(const __grid_constant__ UnpermuteParams p) {
    const int lane = ep::lane_id();
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + ep::warp_id();
         t < p.num_tokens; t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
        int32_t pos = -1;
        float w = 0.0f;
        if (lane < p.top_k) {
            pos = p.positions[t * p.top_k + lane];
            w = p.weights[t * p.top_k + lane];
            if (pos >= p.y_rows) {
                printf("ep expert order: positions[%lld] = %d is past the %lld rows of y\n",
                       static_cast<long long>(t * p.top_k + lane), pos,
                       static_cast<long long>(p.y_rows));
                asm volatile("trap;");
            }
        }
        for (int64_t base = 0; base < p.row_vectors; base += ep::kWarpSize) {
            const int64_t i = base + lane;
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                acc[j] = 0.0f;
            }
            for (int s = 0; s < p.top_k; ++s) {
                const int32_t r = __shfl_sync(ep::kFullMask, pos, s);
                const float ws = __shfl_sync(ep::kFullMask, w, s);
                if (r >= 0 && i < p.row_vectors) {
                    const int4 v = ep::ld_nc_no_alloc(p.y + static_cast<int64_t>(r) * p.row_vectors + i);
                    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        acc[j] = __fmaf_rn(ws, ep::bf16_to_f32(h[j]), acc[j]);
                    }
                }
            }
            if (i < p.row_vectors) {
                int4 o;
                __nv_bfloat16* oh = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    oh[j] = ep::f32_to_bf16(acc[j]);
                }
                p.out[t * p.row_vectors + i] = o;
            }
        }
    }
}

// Mirrors `ScatterParams` in src/expert_order/cuda/expert_order.rs.
struct ScatterParams {
    const uint32_t* src;      // [num_tokens, row_words]
    const int32_t* positions; // [num_tokens, top_k] (from expert_permute)
    uint32_t* dst;            // [dst_rows, row_words]
    int64_t num_tokens;
    int64_t row_words;        // 4-byte words per row
    int64_t dst_rows;
    int32_t top_k;
    int32_t reserved;
};
EP_CHECK_PARAMS_SIZE(ScatterParams, 56);

// A second payload of each token (e.g. the fp8 rows' scales) to the rows `expert_permute`
// placed its first payload at: dst[positions[t, s]] = src[t] for every valid slot. One warp per
// token, 4-byte words.
EP_KERNEL void __launch_bounds__(kThreads) expert_scatter(const __grid_constant__ ScatterParams p) {
    const int lane = ep::lane_id();
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + ep::warp_id();
         t < p.num_tokens; t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
        for (int s = 0; s < p.top_k; ++s) {
            const int64_t dst = p.positions[t * p.top_k + s];
            if (dst < 0) {
                continue;
            }
            if (dst >= p.dst_rows) {
                printf("ep expert order: position %lld is past the %lld rows of dst\n",
                       static_cast<long long>(dst), static_cast<long long>(p.dst_rows));
                asm volatile("trap;");
            }
            for (int64_t i = lane; i < p.row_words; i += ep::kWarpSize) {
                p.dst[dst * p.row_words + i] = p.src[t * p.row_words + i];
            }
        }
    }
}
