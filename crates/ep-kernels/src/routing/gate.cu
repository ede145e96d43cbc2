// Gate logits for a few tokens: logits[T, E] = x[T, H] . W[E, H]^T, f32 accumulation, x in
// bf16 / f16 / f32 converted in registers, W in f32. Launcher and host twin:
// src/routing/cuda/gate.rs (`gate_logits_cuda`), src/routing/gate.rs (`gate_logits`).
//
// Memory-bound design for decode batches. The work is split into tiles of TC tokens x EB
// experts; a block of 256 threads owns one tile at a time (grid-stride over the tiles). Its
// threads split the hidden dimension: thread i reads columns [V*i, V*i + V) of every
// 256*V-column step (V = 4: one 16-byte load of W per expert and a 4-element load of x per
// token; V = 1: scalar loads for any H and alignment), U steps at once so that several loads
// are in flight, and keeps TC*EB partial sums. Each W load serves the TC tokens and each x
// load the EB experts. The partial sums are reduced by warp shuffles, then across the 8 warps
// through shared memory, and written once: no atomics, the same result on every run.

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / ep::kWarpSize;

EP_DEVICE float to_f32(float v) { return v; }
EP_DEVICE float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
EP_DEVICE float to_f32(__half v) { return __half2float(v); }

// V consecutive elements of x at `p` (aligned to V elements when V = 4), as f32.
template <typename T, int V>
EP_DEVICE void load_x(const T* p, float (&out)[V]) {
    if constexpr (V == 4 && sizeof(T) == 4) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(p));
        out[0] = v.x;
        out[1] = v.y;
        out[2] = v.z;
        out[3] = v.w;
    } else if constexpr (V == 4 && sizeof(T) == 2) {
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
        T v[4];
        memcpy(v, &raw, sizeof(raw));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = to_f32(v[i]);
        }
    } else {
        static_assert(V == 1, "V is 1 or 4");
        out[0] = to_f32(p[0]);
    }
}

// V consecutive f32 of W at `p` (16-byte aligned when V = 4).
template <int V>
EP_DEVICE void load_w(const float* p, float (&out)[V]) {
    if constexpr (V == 4) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(p));
        out[0] = v.x;
        out[1] = v.y;
        out[2] = v.z;
        out[3] = v.w;
    } else {
        out[0] = __ldg(p);
    }
}

}  // namespace

// Mirrors `GateLogitsParams` in src/routing/cuda/gate.rs.
struct GateLogitsParams {
    const void* x;        // [T, H], the instance's element type
    const float* weight;  // [E, H]
    float* logits;        // [T, E]
    int64_t num_tokens;
    int32_t num_experts;
    int32_t hidden;
};
EP_CHECK_PARAMS_SIZE(GateLogitsParams, 40);

namespace {

template <typename T, int V, int TC, int EB>
EP_DEVICE void gate_logits(const GateLogitsParams& p) {
    // Column steps in flight per thread: 16 W values in registers per step batch.
    constexpr int U = V == 4 ? (EB >= 4 ? 1 : 4 / EB) : 4;
    constexpr int kStep = kThreads * V;
    __shared__ float partial[kWarps][TC * EB];
    const T* x = static_cast<const T*>(p.x);
    const int e = p.num_experts;
    const int64_t h = p.hidden;
    const int64_t n = p.num_tokens;
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const int64_t e_blocks = ep::ceil_div<int64_t>(e, EB);
    const int64_t tiles = e_blocks * ep::ceil_div<int64_t>(n, TC);
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int e0 = static_cast<int>(tile % e_blocks) * EB;
        const int64_t t0 = (tile / e_blocks) * TC;
        float acc[EB][TC];
#pragma unroll
        for (int j = 0; j < EB; ++j) {
#pragma unroll
            for (int t = 0; t < TC; ++t) {
                acc[j][t] = 0.0f;
            }
        }
        for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * V; c0 < h; c0 += kStep * U) {
            float w[U][EB][V];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int64_t col = c0 + u * kStep;
#pragma unroll
                for (int j = 0; j < EB; ++j) {
                    if (col < h && e0 + j < e) {
                        load_w<V>(p.weight + (e0 + j) * h + col, w[u][j]);
                    } else {
#pragma unroll
                        for (int v = 0; v < V; ++v) {
                            w[u][j][v] = 0.0f;
                        }
                    }
                }
            }
#pragma unroll
            for (int t = 0; t < TC; ++t) {
                if (t0 + t >= n) {
                    break;
                }
                // All of the token's loads first, then the products (zeros past H).
                float xv[U][V];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int64_t col = c0 + u * kStep;
                    if (col < h) {
                        load_x<T, V>(x + (t0 + t) * h + col, xv[u]);
                    } else {
#pragma unroll
                        for (int v = 0; v < V; ++v) {
                            xv[u][v] = 0.0f;
                        }
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
#pragma unroll
                    for (int j = 0; j < EB; ++j) {
#pragma unroll
                        for (int v = 0; v < V; ++v) {
                            acc[j][t] = fmaf(w[u][j][v], xv[u][v], acc[j][t]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < EB; ++j) {
#pragma unroll
            for (int t = 0; t < TC; ++t) {
                const float s = ep::warp_reduce_sum(acc[j][t]);
                if (lane == 0) {
                    partial[warp][j * TC + t] = s;
                }
            }
        }
        __syncthreads();
        if (threadIdx.x < TC * EB) {
            const int j = threadIdx.x / TC;
            const int t = threadIdx.x % TC;
            if (e0 + j < e && t0 + t < n) {
                float s = partial[0][threadIdx.x];
#pragma unroll
                for (int w = 1; w < kWarps; ++w) {
                    s += partial[w][threadIdx.x];
                }
                p.logits[(t0 + t) * e + e0 + j] = s;
            }
        }
        __syncthreads();
    }
}

}  // namespace

// One entry point per (element type, V, TC, EB); the launcher picks by name
// (`gate_logits_<type>_v<V>_t<TC>e<EB>`).
#define EP_GATE_KERNEL(NAME, T, V, TC, EB)                                                      \
    EP_KERNEL void __launch_bounds__(kThreads) NAME(const __grid_constant__ GateLogitsParams p) { \
        gate_logits<T, V, TC, EB>(p);                                                            \
    }

#define EP_GATE_KERNELS(TN, T)                               \
    EP_GATE_KERNEL(gate_logits_##TN##_v4_t1e1, T, 4, 1, 1) \
    EP_GATE_KERNEL(gate_logits_##TN##_v4_t2e1, T, 4, 2, 1) \
    EP_GATE_KERNEL(gate_logits_##TN##_v4_t4e1, T, 4, 4, 1) \
    EP_GATE_KERNEL(gate_logits_##TN##_v4_t8e1, T, 4, 8, 1) \
    EP_GATE_KERNEL(gate_logits_##TN##_v4_t8e2, T, 4, 8, 2) \
    EP_GATE_KERNEL(gate_logits_##TN##_v4_t8e4, T, 4, 8, 4) \
    EP_GATE_KERNEL(gate_logits_##TN##_v1_t1e1, T, 1, 1, 1) \
    EP_GATE_KERNEL(gate_logits_##TN##_v1_t8e1, T, 1, 8, 1)

EP_GATE_KERNELS(bf16, __nv_bfloat16)
EP_GATE_KERNELS(f16, __half)
EP_GATE_KERNELS(f32, float)
