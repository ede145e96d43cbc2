// Internode normal-mode dispatch, after `internode_notify` (`notify.cu`):
//
//   1. `internode_dispatch_send` (home rank): one message per (token, destination node), at
//      the token's index among this rank's tokens for that node, into the receive region of
//      the node's forwarder (the rank with this rank's local index there): written in place
//      for this node (the forwarder is this rank), staged and put with NVSHMEM for the others;
//      then `internode_signal` releases every forwarder's block (`rdma_sig`);
//   2. `internode_dispatch_plan` (every rank, one block per (local forwarder j, source node
//      n)): waits for the block, picks the tokens whose message header names this GPU (the
//      header carries the source token and the mask of the node's GPUs that hold it) and
//      gives each its row in `recv_x` (source order, then token order); a forwarder also
//      records which GPUs of its node got each token of its own blocks (for combine);
//   3. `internode_dispatch_recv`: copies the picked messages out of the forwarders' buffers
//      over NVLink into the outputs (a cached dispatch runs 1 and 3 with the handle's plan).
//
// Buffer and ordering: `internode.cuh`; launchers: `src/internode/cuda/dispatch.rs`; host twin
// of the plan: `src/internode/host.rs`.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "internode.cuh"

namespace {

constexpr int kSendThreads = 512;
constexpr int kPlanThreads = 512;
constexpr int kRecvThreads = 512;
// Most (forwarder, node) blocks a rank reads: 8 GPUs per node x 32 nodes.
constexpr int kMaxBlocks = 256;

struct SendParams {
    InBuffer b;
    InMessage m;
    const uint8_t* x;            // [T, row_bytes]
    const float* scales;         // [T, S] (fp8) or null
    const int64_t* topk_idx;     // [T, K] or null
    const float* topk_weights;   // [T, K] or null (zeros are sent)
    const int* node_send_index;  // [T, N]
    const uint8_t* is_token_in_rank;  // [T, R]
    int num_tokens;
    int pad;
};
EP_CHECK_PARAMS_SIZE(SendParams, 216);

struct PlanParams {
    InBuffer b;
    InMessage m;
    uint64_t seq;
    const int* block_count;         // [P, N]
    const int* rank_prefix_matrix;  // [R, R]
    int* dest;                      // [P, N, M] row in recv_x, -1
    uint8_t* fwd_mask;              // [N, M] GPUs of this node that got token k of home (n, me)
};
EP_CHECK_PARAMS_SIZE(PlanParams, 200);

struct RecvParams {
    InBuffer b;
    InMessage m;
    uint64_t seq;
    const int* block_count;  // [P, N]
    const int* dest;         // [P, N, M]
    uint8_t* recv_x;         // [n, row_bytes]
    float* recv_scales;      // [n, S] or null
    int* recv_src_idx;       // [n] or null
    int64_t* recv_topk_idx;  // [n, K] or null
    float* recv_topk_weights;  // [n, K] or null
    int* origin;             // [n] block * M + k of each row, or null
    int num_experts;
    int pad;
};
EP_CHECK_PARAMS_SIZE(RecvParams, 240);

}  // namespace

EP_KERNEL void __launch_bounds__(kSendThreads) internode_dispatch_send(SendParams p) {
    const InBuffer& b = p.b;
    const InMessage& m = p.m;
    const int N = b.num_nodes, P = b.gpus_per_node;
    const int me_node = node_of(b, b.rank), me_local = local_of(b, b.rank);
    const int lane = ep::lane_id();
    const int warps = blockDim.x / ep::kWarpSize;
    bool put = false;
    for (int t = blockIdx.x * warps + ep::warp_id(); t < p.num_tokens; t += gridDim.x * warps) {
        for (int n = 0; n < N; ++n) {
            const int k = p.node_send_index[static_cast<size_t>(t) * N + n];
            if (k < 0) {
                continue;
            }
            const bool remote = n != me_node;
            uint8_t* dst = remote ? stage_slot(b, n, k) : recv_slot(b, b.local, me_node, k);
            const auto* src = reinterpret_cast<const int4*>(p.x + static_cast<size_t>(t) * m.row_bytes);
            auto* out = reinterpret_cast<int4*>(dst);
            for (int i = lane; i < m.row_bytes / 16; i += ep::kWarpSize) {
                out[i] = ep::ld_nc_no_alloc(src + i);
            }
            for (int i = lane; i < m.num_scales; i += ep::kWarpSize) {
                reinterpret_cast<float*>(dst + m.off_scales)[i] =
                    p.scales[static_cast<size_t>(t) * m.num_scales + i];
            }
            for (int i = lane; i < m.num_topk; i += ep::kWarpSize) {
                const size_t at = static_cast<size_t>(t) * m.num_topk + i;
                reinterpret_cast<int*>(dst + m.off_idx)[i] =
                    p.topk_idx != nullptr ? static_cast<int>(p.topk_idx[at]) : -1;
                reinterpret_cast<float*>(dst + m.off_weights)[i] =
                    p.topk_weights != nullptr ? p.topk_weights[at] : 0.0f;
            }
            if (lane == 0) {
                // Header: the source token, and the GPUs of node n that hold the token.
                const uint8_t* in_rank = p.is_token_in_rank + static_cast<size_t>(t) * b.num_ranks + n * P;
                int mask = 0;
                for (int j = 0; j < P; ++j) {
                    mask |= in_rank[j] != 0 ? 1 << j : 0;
                }
                *reinterpret_cast<int2*>(dst + m.off_src) = make_int2(t, mask);
            }
            if (remote) {
                __syncwarp();
                nvshmemx_putmem_nbi_warp(recv_slot(b, b.local, me_node, k), dst, m.msg_bytes,
                                         n * P + me_local);
                put = true;
            }
        }
    }
    if (put) {
        nvshmem_quiet();
    }
}

EP_KERNEL void __launch_bounds__(kPlanThreads) internode_dispatch_plan(PlanParams p) {
    const InBuffer& b = p.b;
    const int R = b.num_ranks, N = b.num_nodes, P = b.gpus_per_node, M = b.max_tokens;
    const int me = b.rank, me_node = node_of(b, me), me_local = local_of(b, me);
    const int blk = blockIdx.x, j = blk / N, n = blk % N;
    const int f = me_node * P + j, src = n * P + j;
    __shared__ int s_ok;
    if (threadIdx.x == 0) {
        s_ok = wait_seq(b, rdma_sig(b, peer_base(b, f), n), p.seq, kInDispatchRecv, src, 1);
    }
    __syncthreads();
    if (!s_ok) {
        return;
    }
    const int c = p.block_count[blk];
    const int base = src == 0 ? 0 : p.rank_prefix_matrix[(src - 1) * R + me];
    const bool own = j == me_local;
    uint8_t* fwd = peer_base(b, f);
    int running = 0;
    for (int chunk = 0; chunk < c; chunk += blockDim.x) {
        const int k = chunk + threadIdx.x;
        int mask = 0;
        if (k < c) {
            mask = ep::ld_volatile(reinterpret_cast<const int*>(recv_slot(b, fwd, n, k) + p.m.off_src) + 1);
        }
        const bool mine = (mask >> me_local & 1) != 0;
        int total;
        const int idx = block_exclusive_scan(mine ? 1 : 0, &total);
        if (k < c) {
            p.dest[static_cast<size_t>(blk) * M + k] = mine ? base + running + idx : -1;
            if (own) {
                p.fwd_mask[static_cast<size_t>(n) * M + k] = static_cast<uint8_t>(mask);
            }
        }
        running += total;
    }
}

EP_KERNEL void __launch_bounds__(kRecvThreads) internode_dispatch_recv(RecvParams p) {
    const InBuffer& b = p.b;
    const InMessage& m = p.m;
    const int R = b.num_ranks, N = b.num_nodes, P = b.gpus_per_node, M = b.max_tokens;
    const int me = b.rank, me_node = node_of(b, me);
    if (!wait_blocks(b, p.seq, kInDispatchRecv)) {
        return;
    }
    __shared__ int s_start[kMaxBlocks + 1];
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int i = 0; i < P * N; ++i) {
            s_start[i] = acc;
            acc += p.block_count[i];
        }
        s_start[P * N] = acc;
    }
    __syncthreads();
    const int total = s_start[P * N];
    const int L = p.num_experts > 0 ? p.num_experts / R : 1;
    const int lane = ep::lane_id();
    const int warps = blockDim.x / ep::kWarpSize;
    int blk = 0;
    for (int g = blockIdx.x * warps + ep::warp_id(); g < total; g += gridDim.x * warps) {
        while (s_start[blk + 1] <= g) {
            ++blk;
        }
        const int k = g - s_start[blk];
        const int d = p.dest[static_cast<size_t>(blk) * M + k];
        if (d < 0) {
            continue;
        }
        const int j = blk / N, n = blk % N;
        const uint8_t* slot = recv_slot(b, peer_base(b, me_node * P + j), n, k);
        warp_copy_bytes(p.recv_x + static_cast<size_t>(d) * m.row_bytes, slot, m.row_bytes, lane);
        const auto* sc = reinterpret_cast<const float*>(slot + m.off_scales);
        for (int i = lane; i < m.num_scales; i += ep::kWarpSize) {
            p.recv_scales[static_cast<size_t>(d) * m.num_scales + i] = sc[i];
        }
        if (p.recv_topk_idx != nullptr) {
            const auto* ids = reinterpret_cast<const int*>(slot + m.off_idx);
            const auto* ws = reinterpret_cast<const float*>(slot + m.off_weights);
            for (int i = lane; i < m.num_topk; i += ep::kWarpSize) {
                const int e = ids[i];
                const bool here = e >= 0 && e / L == me;
                const size_t at = static_cast<size_t>(d) * m.num_topk + i;
                p.recv_topk_idx[at] = here ? e % L : -1;
                p.recv_topk_weights[at] = here ? ws[i] : 0.0f;
            }
        }
        if (lane == 0) {
            if (p.recv_src_idx != nullptr) {
                p.recv_src_idx[d] = *reinterpret_cast<const int*>(slot + m.off_src);
            }
            if (p.origin != nullptr) {
                p.origin[d] = blk * M + k;
            }
        }
    }
}
