// Internode normal-mode combine, after the op barrier (`internode_notify` without counts):
//
//   1. `internode_combine_send` (every rank): each received row goes back over NVLink into
//      the buffer of the forwarder it came from (`comb_in`, at (this local rank, node, k)),
//      except the rows of its own blocks, which the rank reads from `x` when it forwards;
//      `internode_signal` then tells the node's forwarders (`comb_sig`);
//   2. `internode_combine_forward` (forwarder): for each token of its own blocks, the f32 sum
//      of the rows of the node's GPUs that got it (local rank order), one bf16 row (and the
//      summed weights) per token, written in place for this node's home (this rank) and put
//      with NVSHMEM to the other nodes' homes; `internode_signal` releases them (`rdma_sig`);
//   3. `internode_combine_recv` (home): for each token, the f32 sum of the rows of its
//      destination nodes in node order, so the whole sum runs in rank order as the host
//      backend's (with one bf16 rounding per node partial).
//
// A combine row is [bf16 x[H] | padding to 16 bytes | f32 w[K]] (stride `comb_bytes`).
// Buffer and ordering: `internode.cuh`; launchers: `src/internode/cuda/combine.rs`.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "internode.cuh"

namespace {

constexpr int kCombineThreads = 512;

struct CombineSendParams {
    InBuffer b;
    const __nv_bfloat16* x;     // [n, H]
    const float* topk_weights;  // [n, K] or null
    const int* origin;          // [n] block * M + k
    int num_recv;
    int hidden;
    int num_topk;
    int off_w;  // byte offset of the weights in a combine row
};
EP_CHECK_PARAMS_SIZE(CombineSendParams, 168);

struct ForwardParams {
    InBuffer b;
    uint64_t seq;
    const int* block_count;     // [P, N]
    const uint8_t* fwd_mask;    // [N, M]
    const __nv_bfloat16* x;     // [n, H] this rank's combine input (rows of its own blocks)
    const float* topk_weights;  // [n, K] or null
    const int* dest;            // [P, N, M] the dispatch plan: row of each block message
    int hidden;
    int num_topk;
    int off_w;
    int row_bytes;  // bytes of a combine row that carry data (off_w + 4K)
};
EP_CHECK_PARAMS_SIZE(ForwardParams, 192);

struct CombineRecvParams {
    InBuffer b;
    uint64_t seq;
    const int* node_send_index;  // [T, N]
    __nv_bfloat16* combined_x;   // [T, H]
    float* combined_w;           // [T, K] or null
    int num_tokens;
    int hidden;
    int num_topk;
    int off_w;
    const __nv_bfloat16* bias;   // [T, H] added to every combined row, or null
};
EP_CHECK_PARAMS_SIZE(CombineRecvParams, 184);

// acc[0..8) += the 8 bf16 of `v`.
EP_DEVICE void add_bf16x8(float* acc, int4 v) {
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        acc[2 * i] += f.x;
        acc[2 * i + 1] += f.y;
    }
}

EP_DEVICE int4 to_bf16x8(const float* acc) {
    int4 v;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    }
    return v;
}

// Block-wide: waits until every word `word(i)`, i < count, holds `seq`, naming `rank(i)` on
// a timeout; every thread returns the same value.
template <typename Word, typename Rank>
EP_DEVICE bool wait_all(const InBuffer& b, uint64_t seq, int count, Word word, Rank rank,
                        int kernel) {
    __shared__ int s_ok;
    if (threadIdx.x == 0) {
        s_ok = 1;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        if (!wait_seq(b, word(i), seq, kernel, rank(i), 0)) {
            s_ok = 0;
        }
    }
    __syncthreads();
    return s_ok != 0;
}

}  // namespace

EP_KERNEL void __launch_bounds__(kCombineThreads) internode_combine_send(CombineSendParams p) {
    const InBuffer& b = p.b;
    const int N = b.num_nodes, P = b.gpus_per_node, M = b.max_tokens;
    const int me_node = node_of(b, b.rank), me_local = local_of(b, b.rank);
    const int lane = ep::lane_id();
    const int warps = blockDim.x / ep::kWarpSize;
    for (int i = blockIdx.x * warps + ep::warp_id(); i < p.num_recv; i += gridDim.x * warps) {
        const int o = p.origin[i];
        const int blk = o / M, k = o % M;
        const int j = blk / N, n = blk % N;
        if (j == me_local) {
            continue;  // this rank forwards the token itself and reads the row from `x`
        }
        uint8_t* dst = comb_in_row(b, peer_base(b, me_node * P + j), me_local, n, k);
        const auto* src = reinterpret_cast<const int4*>(p.x + static_cast<size_t>(i) * p.hidden);
        auto* out = reinterpret_cast<int4*>(dst);
        for (int v = lane; v < p.hidden / 8; v += ep::kWarpSize) {
            ep::st_no_alloc(out + v, ep::ld_nc_no_alloc(src + v));
        }
        if (p.topk_weights != nullptr) {
            for (int w = lane; w < p.num_topk; w += ep::kWarpSize) {
                reinterpret_cast<float*>(dst + p.off_w)[w] =
                    p.topk_weights[static_cast<size_t>(i) * p.num_topk + w];
            }
        }
    }
}

EP_KERNEL void __launch_bounds__(kCombineThreads) internode_combine_forward(ForwardParams p) {
    const InBuffer& b = p.b;
    const int N = b.num_nodes, P = b.gpus_per_node, M = b.max_tokens;
    const int me_node = node_of(b, b.rank), me_local = local_of(b, b.rank);
    if (!wait_all(
            b, p.seq, P, [&](int j) { return comb_sig(b, b.local, j); },
            [&](int j) { return me_node * P + j; }, kInCombineForward)) {
        return;
    }
    // Token g of this rank's own blocks (home (n, me_local) for every node n, in node order).
    __shared__ int s_start[33];
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int n = 0; n < N; ++n) {
            s_start[n] = acc;
            acc += p.block_count[me_local * N + n];
        }
        s_start[N] = acc;
    }
    __syncthreads();
    const int lane = ep::lane_id();
    const int warps = blockDim.x / ep::kWarpSize;
    bool put = false;
    int n = 0;
    for (int g = blockIdx.x * warps + ep::warp_id(); g < s_start[N]; g += gridDim.x * warps) {
        while (s_start[n + 1] <= g) {
            ++n;
        }
        const int k = g - s_start[n];
        const uint32_t mask = p.fwd_mask[static_cast<size_t>(n) * M + k];
        // This GPU's own row, if it holds the token: straight from `x`.
        const int own = (mask >> me_local & 1u) != 0
                            ? p.dest[(static_cast<size_t>(me_local) * N + n) * M + k]
                            : -1;
        const bool remote = n != me_node;
        uint8_t* out = remote ? stage_slot(b, n, k) : comb_recv_row(b, b.local, me_node, k);
        for (int v = lane; v < p.hidden / 8; v += ep::kWarpSize) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int j = 0; j < P; ++j) {
                if (j == me_local && own >= 0) {
                    const auto* row = reinterpret_cast<const int4*>(p.x + static_cast<size_t>(own) * p.hidden);
                    add_bf16x8(acc, ep::ld_nc_no_alloc(row + v));
                } else if (mask >> j & 1u) {
                    const auto* row = reinterpret_cast<const int4*>(comb_in_row(b, b.local, j, n, k));
                    add_bf16x8(acc, ep::ld_peer_no_alloc(row + v));
                }
            }
            reinterpret_cast<int4*>(out)[v] = to_bf16x8(acc);
        }
        for (int w = lane; w < p.num_topk; w += ep::kWarpSize) {
            float acc = 0.0f;
            for (int j = 0; j < P; ++j) {
                if (j == me_local && own >= 0) {
                    acc += p.topk_weights[static_cast<size_t>(own) * p.num_topk + w];
                } else if (mask >> j & 1u) {
                    acc += reinterpret_cast<const float*>(comb_in_row(b, b.local, j, n, k) + p.off_w)[w];
                }
            }
            reinterpret_cast<float*>(out + p.off_w)[w] = acc;
        }
        if (remote) {
            __syncwarp();
            nvshmemx_putmem_nbi_warp(comb_recv_row(b, b.local, me_node, k), out, p.row_bytes,
                                     n * P + me_local);
            put = true;
        }
    }
    if (put) {
        nvshmem_quiet();
    }
}

EP_KERNEL void __launch_bounds__(kCombineThreads) internode_combine_recv(CombineRecvParams p) {
    const InBuffer& b = p.b;
    const int N = b.num_nodes, P = b.gpus_per_node;
    const int me_local = local_of(b, b.rank);
    if (!wait_all(
            b, p.seq, N, [&](int n) { return rdma_sig(b, b.local, n); },
            [&](int n) { return n * P + me_local; }, kInCombineRecv)) {
        return;
    }
    const int lane = ep::lane_id();
    const int warps = blockDim.x / ep::kWarpSize;
    for (int t = blockIdx.x * warps + ep::warp_id(); t < p.num_tokens; t += gridDim.x * warps) {
        const int* ks = p.node_send_index + static_cast<size_t>(t) * N;
        auto* out = reinterpret_cast<int4*>(p.combined_x + static_cast<size_t>(t) * p.hidden);
        const auto* bias = p.bias != nullptr
                               ? reinterpret_cast<const int4*>(p.bias + static_cast<size_t>(t) * p.hidden)
                               : nullptr;
        for (int v = lane; v < p.hidden / 8; v += ep::kWarpSize) {
            // The sum starts from the bias (zero without one), then adds the nodes' rows.
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (bias != nullptr) {
                add_bf16x8(acc, ep::ld_nc_no_alloc(bias + v));
            }
            for (int n = 0; n < N; ++n) {
                const int k = ks[n];
                if (k >= 0) {
                    const auto* row = reinterpret_cast<const int4*>(comb_recv_row(b, b.local, n, k));
                    add_bf16x8(acc, ep::ld_peer_no_alloc(row + v));
                }
            }
            out[v] = to_bf16x8(acc);
        }
        if (p.combined_w != nullptr) {
            for (int w = lane; w < p.num_topk; w += ep::kWarpSize) {
                float acc = 0.0f;
                for (int n = 0; n < N; ++n) {
                    const int k = ks[n];
                    if (k >= 0) {
                        acc += reinterpret_cast<const float*>(comb_recv_row(b, b.local, n, k) + p.off_w)[w];
                    }
                }
                p.combined_w[static_cast<size_t>(t) * p.num_topk + w] = acc;
            }
        }
    }
}
