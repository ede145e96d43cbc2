// The internode (multi-node) normal mode: the buffer every kernel of `notify.cu`,
// `dispatch.cu` and `combine.cu` shares, its address helpers, waits and signals. Launchers:
// `src/internode/cuda/`; host twins of the plan: `src/internode/host.rs`.
//
// Ranks are `rank = node * P + local`. A token crosses the network once per destination
// node: its home rank puts one message per node into the buffer of the rank with the same
// local index on that node (the node's *forwarder* for this home), and every GPU of the node
// pulls from its forwarders over NVLink the tokens that have one of its experts. Combine
// reverses it: each GPU writes its rows into the forwarder's buffer over NVLink, the forwarder
// sums the rows of its node for each token (f32, one bf16 row per node) and puts that row to
// the home rank, which sums the rows of the nodes.
//
// Buffer of one rank, on NVSHMEM's symmetric heap (byte offsets in `InBuffer`, the same on
// every rank; ranks of this node reach it through `nvshmem_ptr`, the others through puts):
//
//   sync      u64 [R]            the op barrier: rank s writes the op's `seq` into word s
//   counts    i32 [2][R][stride] notify: rank s's counts [R per rank | N per node | E per
//                                expert] for op parity `seq & 1`
//   rdma_sig  u64 [N]            word n: dispatch, the message block of node n's home has
//                                arrived; combine, node n's row block has arrived (`seq`)
//   comb_sig  u64 [P]            word j: local rank j wrote its combine rows here (`seq`)
//   recv      [N][M] slots of `slot_bytes`: dispatch messages of home (n, local) by the
//             token's index among that home's tokens for this node; in combine, the rows
//             node n's forwarder returns ([2H bf16 | f32 w[K]], stride `comb_bytes`)
//   stage     [N][M] slots of `slot_bytes`: what this rank puts to other nodes
//   comb_in   [P][N][M] rows of `comb_bytes`: combine rows that local rank j returns for
//             token k of home (n, this local index)
//
// Ordering: every op starts with a barrier of all ranks (`sync`, with the counts in a fresh
// dispatch). A rank passes op N's barrier only once every rank has started op N, i.e. has
// finished op N-1, so no region is written while a peer still reads it, and nothing needs
// zeroing between ops: every signal carries the op's `seq` (from the host, the same on every
// rank) and waits compare `>= seq`. Counts are double-buffered by parity: a rank's op N+1
// counts may arrive while a slower rank still reads op N's.
//
// Timeouts: every wait gives up after `timeout_ns` (0 = never) and writes the error record
// {1, awaited rank, kernel id, site} (`report_timeout`, `intranode.cuh`); the op's outputs are
// then garbage, and the host reports the rank.

#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "../intranode/intranode.cuh"

namespace {

// Kernel ids in error records (Rust: `KERNEL_NAMES` in src/internode/cuda/buffer.rs).
constexpr int kInNotify = 1;
constexpr int kInDispatchRecv = 2;
constexpr int kInCombineForward = 3;
constexpr int kInCombineRecv = 4;

// Mirrored by `InBuffer` in src/internode/cuda/buffer.rs.
struct InBuffer {
    uint8_t* local;
    const uint64_t* peers;  // [R] NVLink address of each rank of this node's buffer, 0 elsewhere
    int* error_info;
    uint64_t timeout_ns;
    uint64_t off_sync;
    uint64_t off_counts;
    uint64_t off_rdma_sig;
    uint64_t off_comb_sig;
    uint64_t off_recv;
    uint64_t off_stage;
    uint64_t off_comb_in;
    uint64_t slot_bytes;
    uint64_t comb_bytes;
    int rank;
    int num_ranks;
    int gpus_per_node;
    int num_nodes;
    int max_tokens;
    int count_stride;
};
EP_CHECK_PARAMS_SIZE(InBuffer, 128);

// Where the parts of one dispatch message lie in a slot (host: `MessageLayout`).
struct InMessage {
    int row_bytes;
    int num_scales;
    int off_scales;
    int off_idx;
    int off_weights;
    int off_src;
    int msg_bytes;
    int num_topk;
};
EP_CHECK_PARAMS_SIZE(InMessage, 32);

EP_DEVICE int node_of(const InBuffer& b, int r) { return r / b.gpus_per_node; }
EP_DEVICE int local_of(const InBuffer& b, int r) { return r % b.gpus_per_node; }

// Rank `r`'s buffer over NVLink (a rank of this node; the own buffer for `r == rank`).
EP_DEVICE uint8_t* peer_base(const InBuffer& b, int r) {
    return reinterpret_cast<uint8_t*>(b.peers[r]);
}

EP_DEVICE uint64_t* sync_word(const InBuffer& b, uint8_t* base, int s) {
    return reinterpret_cast<uint64_t*>(base + b.off_sync) + s;
}

EP_DEVICE int* counts_row(const InBuffer& b, uint8_t* base, uint64_t seq, int s) {
    return reinterpret_cast<int*>(base + b.off_counts) +
           (static_cast<size_t>(seq & 1) * b.num_ranks + s) * b.count_stride;
}

EP_DEVICE uint64_t* rdma_sig(const InBuffer& b, uint8_t* base, int n) {
    return reinterpret_cast<uint64_t*>(base + b.off_rdma_sig) + n;
}

EP_DEVICE uint64_t* comb_sig(const InBuffer& b, uint8_t* base, int j) {
    return reinterpret_cast<uint64_t*>(base + b.off_comb_sig) + j;
}

// Slot k of node n's block in the receive region of the buffer at `base`.
EP_DEVICE uint8_t* recv_slot(const InBuffer& b, uint8_t* base, int n, int k) {
    return base + b.off_recv + (static_cast<size_t>(n) * b.max_tokens + k) * b.slot_bytes;
}

EP_DEVICE uint8_t* stage_slot(const InBuffer& b, int n, int k) {
    return b.local + b.off_stage + (static_cast<size_t>(n) * b.max_tokens + k) * b.slot_bytes;
}

// Row of local rank j for token k of home (n, local) in the combine input region at `base`.
EP_DEVICE uint8_t* comb_in_row(const InBuffer& b, uint8_t* base, int j, int n, int k) {
    return base + b.off_comb_in +
           ((static_cast<size_t>(j) * b.num_nodes + n) * b.max_tokens + k) * b.comb_bytes;
}

// The row a forwarder returns for token k of node n's block, in the receive region.
EP_DEVICE uint8_t* comb_recv_row(const InBuffer& b, uint8_t* base, int n, int k) {
    return base + b.off_recv + (static_cast<size_t>(n) * b.max_tokens + k) * b.comb_bytes;
}

// Spins until `*word >= seq` (acquire, system scope) or the deadline; reports a timeout
// naming `awaited` and returns false then.
EP_DEVICE bool wait_seq(const InBuffer& b, const uint64_t* word, uint64_t seq, int kernel,
                        int awaited, int site) {
    const ep::Deadline deadline = ep::Deadline::after(b.timeout_ns);
    while (ep::ld_acquire_sys_u64(word) < seq) {
        if (deadline.expired()) {
            report_timeout(b.error_info, kernel, b.rank, awaited, site);
            return false;
        }
    }
    return true;
}

// Block-wide: waits until rank f of this node has received node n's block for every (f, n)
// with f in `[first, first + count)` of this node; false if one timed out (the sender of that
// block is named). Every thread returns the same value.
EP_DEVICE bool wait_blocks(const InBuffer& b, uint64_t seq, int kernel) {
    __shared__ int s_ok;
    if (threadIdx.x == 0) {
        s_ok = 1;
    }
    __syncthreads();
    const int P = b.gpus_per_node, N = b.num_nodes, me_node = node_of(b, b.rank);
    for (int i = threadIdx.x; i < P * N; i += blockDim.x) {
        const int j = i / N, n = i % N;
        const int f = me_node * P + j;
        if (!wait_seq(b, rdma_sig(b, peer_base(b, f), n), seq, kernel, n * P + j, 0)) {
            s_ok = 0;
        }
    }
    __syncthreads();
    return s_ok != 0;
}

// Block-wide exclusive scan of one int per thread (blocks of at most 1024 threads;
// every thread calls it); returns the thread's prefix and writes the
// block total to `*total`.
EP_DEVICE int block_exclusive_scan(int v, int* total) {
    __shared__ int s_warp[32];
    const int lane = ep::lane_id(), warp = ep::warp_id();
    int x = v;
#pragma unroll
    for (int o = 1; o < ep::kWarpSize; o <<= 1) {
        const int y = __shfl_up_sync(ep::kFullMask, x, o);
        if (lane >= o) {
            x += y;
        }
    }
    if (lane == ep::kWarpSize - 1) {
        s_warp[warp] = x;
    }
    __syncthreads();
    const int warps = blockDim.x / ep::kWarpSize;
    int before = 0, all = 0;
    for (int w = 0; w < warps; ++w) {
        before += w < warp ? s_warp[w] : 0;
        all += s_warp[w];
    }
    __syncthreads();
    *total = all;
    return before + x - v;
}

// Warp copy of `bytes` (a multiple of 16) from `src` (possibly a peer's memory) to `dst`.
EP_DEVICE void warp_copy_bytes(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
    const int n = bytes / 16;
    auto* d = reinterpret_cast<int4*>(dst);
    const auto* s = reinterpret_cast<const int4*>(src);
    for (int i = lane; i < n; i += ep::kWarpSize) {
        ep::st_no_alloc(d + i, ep::ld_peer_no_alloc(s + i));
    }
}

}  // namespace
