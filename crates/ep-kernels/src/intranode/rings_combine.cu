// SM-ring combine of the intranode normal mode (protocol and shared pieces: `rings.cuh`): the
// dispatch's path in reverse; the home rank sums the returned rows in rank order. Kernels
// `intranode_combine_<R>` (one by-value params struct mirrored by its launcher).

#include "rings.cuh"

namespace {

constexpr int kCombineThreads = 768;
constexpr int kCombineWarps = kCombineThreads / ep::kWarpSize;

}  // namespace

// Mirrors `CombineParams` in src/intranode/cuda/rings_combine.rs.
struct CombineParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int4* x;                    // [N, hidden_int4] bf16 rows in receive order
    const float* topk_weights;        // [N, K] or null (K == 0)
    const int* rank_prefix_matrix;    // [R, R]
    const int* recv_channel_offset;   // [R, C]
    const int* send_head;             // [T, R]
    int4* combined_x;                 // [T, hidden_int4] out
    float* combined_topk_weights;     // [T, K] out, or null
    int* error_info;                  // [4]
    uint64_t timeout_ns;
    int rank;
    int num_ranks;
    int num_tokens;
    int num_recv_tokens;
    int hidden_int4;
    int num_topk;
    int num_channels;
    int num_max_send_tokens;
    int num_max_recv_tokens;
    int pad;
    const int4* bias;                 // [T, hidden_int4] bf16 added to every combined row, or null
};
EP_CHECK_PARAMS_SIZE(CombineParams, 184);

namespace {

// Vectors per lane the home side of combine loads at once (times up to 4 rows each): the home
// is latency-bound, 2 measured faster than 1 at EP4 (3 spills registers).
constexpr int kHomeUnroll = 2;

// The home side of combine for channel c with R == kR ranks (compile-time, so the per-rank
// slots and loads stay in registers).
template <int kR>
__device__ void combine_home(const CombineParams& p, int c, int* s_abort) {
    const int R = kR;
    const int C = p.num_channels;
    const int Q = p.num_max_recv_tokens;
    const int K = p.num_topk;
    const int hi = p.hidden_int4;
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const RingLayout lay = RingLayout::combine(Q, hi * 16, K);
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    int t_begin, t_end;
    channel_range(p.num_tokens, C, c, &t_begin, &t_end);
    for (int round = t_begin; round < t_end; round += kCombineWarps) {
        __syncthreads();
        if (*s_abort) {
            break;
        }
        const int t = round + warp;
        if (t < t_end) {
            const int my_slot = lane < R ? p.send_head[static_cast<int64_t>(t) * R + lane] : -1;
            bool timed_out = false;
            if (my_slot >= 0) {
                ep::wait_flag_sys(counter(my_buf, kTail, c, lane), [&](int v) { return v > my_slot; },
                                  ep::Deadline::after(p.timeout_ns), &timed_out);
                if (timed_out) {
                    report_timeout(p.error_info, kCombineKernel, p.rank, lane, kSiteCombineRecvTail);
                    *s_abort = 1;
                }
            }
            if (!__any_sync(ep::kFullMask, timed_out)) {
                // Per rank: the int4 offset of this token's row in ring (c, d), or -1.
                int row[kR];
#pragma unroll
                for (int d = 0; d < kR; ++d) {
                    const int sl = __shfl_sync(ep::kFullMask, my_slot, d);
                    row[d] = sl >= 0 ? (sl % Q) * hi : -1;
                }
                const char* ring0 = ring(my_buf, lay.bytes, c, R, 0);
                int4* out = p.combined_x + static_cast<int64_t>(t) * hi;
                // kHomeUnroll vectors per lane at a time, up to 4 rows each in flight, summed in
                // rank order.
                constexpr int kBatch = kR < 4 ? kR : 4;
                const int4* bias_row = p.bias != nullptr ? p.bias + static_cast<int64_t>(t) * hi : nullptr;
                for (int i0 = lane; i0 < hi; i0 += ep::kWarpSize * kHomeUnroll) {
                    // The sum starts from the bias (zero without one), then adds the ranks' rows.
                    float acc[kHomeUnroll][8];
#pragma unroll
                    for (int u = 0; u < kHomeUnroll; ++u) {
                        const int i = i0 + u * ep::kWarpSize;
                        int4 b = make_int4(0, 0, 0, 0);
                        if (bias_row != nullptr && i < hi) {
                            b = ep::ld_nc_no_alloc(bias_row + i);
                        }
                        const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float2 f = __bfloat1622float2(bh[e]);
                            acc[u][2 * e] = f.x;
                            acc[u][2 * e + 1] = f.y;
                        }
                    }
#pragma unroll
                    for (int d0 = 0; d0 < kR; d0 += kBatch) {
                        int4 v[kHomeUnroll][kBatch];
#pragma unroll
                        for (int u = 0; u < kHomeUnroll; ++u) {
                            const int i = i0 + u * ep::kWarpSize;
#pragma unroll
                            for (int b = 0; b < kBatch; ++b) {
                                if (i < hi && d0 + b < kR && row[d0 + b] >= 0) {
                                    v[u][b] = ep::ld_peer_no_alloc(
                                        reinterpret_cast<const int4*>(ring0 + (d0 + b) * lay.bytes) +
                                        row[d0 + b] + i);
                                }
                            }
                        }
#pragma unroll
                        for (int u = 0; u < kHomeUnroll; ++u) {
#pragma unroll
                            for (int b = 0; b < kBatch; ++b) {
                                if (i0 + u * ep::kWarpSize < hi && d0 + b < kR && row[d0 + b] >= 0) {
                                    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[u][b]);
#pragma unroll
                                    for (int e = 0; e < 4; ++e) {
                                        const float2 f = __bfloat1622float2(h[e]);
                                        acc[u][2 * e] += f.x;
                                        acc[u][2 * e + 1] += f.y;
                                    }
                                }
                            }
                        }
                    }
#pragma unroll
                    for (int u = 0; u < kHomeUnroll; ++u) {
                        const int i = i0 + u * ep::kWarpSize;
                        if (i < hi) {
                            int4 o;
                            __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                oh[e] = __floats2bfloat162_rn(acc[u][2 * e], acc[u][2 * e + 1]);
                            }
                            ep::st_no_alloc(out + i, o);
                        }
                    }
                }
                if (p.combined_topk_weights != nullptr) {
                    for (int kk = lane; kk < K; kk += ep::kWarpSize) {
                        float acc = 0.0f;
#pragma unroll
                        for (int d = 0; d < kR; ++d) {
                            if (row[d] >= 0) {
                                const float* w = reinterpret_cast<const float*>(
                                    ring0 + d * lay.bytes + lay.topk_weights);
                                acc += w[static_cast<int64_t>(row[d] / hi) * K + kk];
                            }
                        }
                        p.combined_topk_weights[static_cast<int64_t>(t) * K + kk] = acc;
                    }
                }
            }
        }
        __syncthreads();
        // Free the slots this round consumed.
        if (warp == 0 && lane < R && !*s_abort) {
            int last = -1;
            for (int w = 0; w < kCombineWarps && round + w < t_end; ++w) {
                last = max(last, p.send_head[static_cast<int64_t>(round + w) * R + lane]);
            }
            if (last >= 0) {
                ep::st_release_sys(counter(buf(p.buffer_ptrs, lane), kHead, c, p.rank), last + 1);
            }
        }
    }
}

}  // namespace

// Grid: 2 * C blocks of kCombineThreads. Block 2c: warp group g returns to home rank g the rows
// of channel c it received from g. Block 2c + 1: the home side of channel c, one token per warp
// per round, summing the rows of every rank in rank order.
template <int kR>
__device__ __forceinline__ void combine_impl(const CombineParams& p) {
    __shared__ int s_abort_group[kMaxRanks];
    __shared__ int s_abort;

    const int R = kR;
    const int C = p.num_channels;
    const int Q = p.num_max_recv_tokens;
    const int K = p.num_topk;
    const int hi = p.hidden_int4;
    const int c = static_cast<int>(blockIdx.x) / 2;
    const bool is_sender = (blockIdx.x % 2) == 0;
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const RingLayout lay = RingLayout::combine(Q, hi * 16, K);
    char* my_buf = buf(p.buffer_ptrs, p.rank);

    if (is_sender) {
        const int warps_per_group = kCombineWarps / R;
        const int g = warp / warps_per_group;
        if (g >= R) {
            return;
        }
        const int gw = warp % warps_per_group;
        const int group_threads = warps_per_group * ep::kWarpSize;
        const int bar_id = g + 1;
        const bool leader = gw == 0 && lane == 0;
        const int s = g;
        char* home_buf = buf(p.buffer_ptrs, s);
        const int off = p.recv_channel_offset[s * C + c];
        const int end = c + 1 < C ? p.recv_channel_offset[s * C + c + 1] : p.rank_prefix_matrix[s * R + p.rank];
        const int n = end - off;
        char* ring_base = ring(home_buf, lay.bytes, c, R, p.rank);
        int4* ring_x = reinterpret_cast<int4*>(ring_base);
        float* ring_w = reinterpret_cast<float*>(ring_base + lay.topk_weights);
        int* tail_ptr = counter(home_buf, kTail, c, p.rank);
        const int* head_ptr = counter(my_buf, kHead, c, s);
        int sent = 0;
        while (sent < n) {
            const int k = min(p.num_max_send_tokens, n - sent);
            if (leader) {
                bool timed_out = false;
                ep::wait_flag_sys(head_ptr, [&](int head) { return Q - (sent - head) >= k; },
                                  ep::Deadline::after(p.timeout_ns), &timed_out);
                if (timed_out) {
                    report_timeout(p.error_info, kCombineKernel, p.rank, s, kSiteCombineSendHead);
                }
                s_abort_group[g] = timed_out;
            }
            named_barrier(bar_id, group_threads);
            if (s_abort_group[g]) {
                return;
            }
            for (int j = sent + gw; j < sent + k; j += warps_per_group) {
                const int slot = j % Q;
                const int64_t row = static_cast<int64_t>(off) + j;
                warp_copy<true>(ring_x + static_cast<int64_t>(slot) * hi, p.x + row * hi, hi, lane);
                for (int kk = lane; kk < K; kk += ep::kWarpSize) {
                    ring_w[static_cast<int64_t>(slot) * K + kk] = __ldg(p.topk_weights + row * K + kk);
                }
            }
            named_barrier(bar_id, group_threads);
            sent += k;
            if (leader) {
                ep::st_release_sys(tail_ptr, sent);
            }
        }
        return;
    }

    // Home side.
    if (threadIdx.x == 0) {
        s_abort = 0;
    }
    combine_home<kR>(p, c, &s_abort);
}

// One kernel per rank count (the home side keeps per-rank state in registers):
// intranode_combine_<R> for R in 1..=8.
#define EP_COMBINE_KERNEL(n)                                                                     \
    EP_KERNEL void __launch_bounds__(kCombineThreads, 1) intranode_combine_##n(const CombineParams p) { \
        combine_impl<n>(p);                                                                      \
    }
EP_COMBINE_KERNEL(1)
EP_COMBINE_KERNEL(2)
EP_COMBINE_KERNEL(3)
EP_COMBINE_KERNEL(4)
EP_COMBINE_KERNEL(5)
EP_COMBINE_KERNEL(6)
EP_COMBINE_KERNEL(7)
EP_COMBINE_KERNEL(8)
#undef EP_COMBINE_KERNEL
