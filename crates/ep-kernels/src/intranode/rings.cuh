// Shared pieces of the SM-ring dispatch (`rings_dispatch.cu`) and combine (`rings_combine.cu`)
// of the intranode (NVLink) normal mode. Host twins: `src/intranode/host.rs`; launchers:
// `src/intranode/cuda/rings_{dispatch,combine}.rs`; the NVLink buffer (and the rings' place in
// it): `intranode.cuh`. Both run after a notify kernel (`notify.cu`).
//
// Flow control: the sender of ring (c, s -> d) waits until `Q - (sent - head) >= chunk`, copies
// up to `num_max_send_tokens` tokens (warps of its group in parallel), group barrier, then
// publishes `tail = sent` with a system-scope release store. The receiver polls `tail` with
// acquire loads (its own memory), copies slots [head, tail) out, group barrier, then publishes
// `head` with a release store into the sender's buffer. Counters never wrap within one kernel.

#pragma once

#include "intranode.cuh"

namespace {

EP_HOST_DEVICE size_t align16(size_t v) { return (v + 15) & ~size_t{15}; }

// Byte offsets of the arrays inside one ring (mirrored by `src/intranode/ring_bytes.rs`).
struct RingLayout {
    size_t src_idx;
    size_t topk_idx;
    size_t topk_weights;
    size_t scales;
    size_t bytes;

    EP_HOST_DEVICE static RingLayout dispatch(int q, int row_bytes, int topk, int scales) {
        RingLayout l;
        l.src_idx = align16(size_t(q) * row_bytes);
        l.topk_idx = l.src_idx + align16(size_t(q) * 4);
        l.topk_weights = l.topk_idx + align16(size_t(q) * topk * 4);
        l.scales = l.topk_weights + align16(size_t(q) * topk * 4);
        l.bytes = l.scales + align16(size_t(q) * scales * 4);
        return l;
    }

    EP_HOST_DEVICE static RingLayout combine(int q, int row_bytes, int topk) {
        RingLayout l;
        l.src_idx = 0;
        l.topk_idx = 0;
        l.topk_weights = align16(size_t(q) * row_bytes);
        l.scales = 0;
        l.bytes = l.topk_weights + align16(size_t(q) * topk * 4);
        return l;
    }
};

EP_DEVICE char* ring(char* base, size_t ring_bytes, int channel, int num_ranks, int peer) {
    return base + kRingBase + (size_t(channel) * num_ranks + peer) * ring_bytes;
}

EP_DEVICE void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Warp copy of `n` int4 from `src` to `dst`, `kUnroll` loads in flight per lane.
// kSrcReadOnly: `src` is not written during the kernel (non-coherent path allowed).
template <bool kSrcReadOnly, int kUnroll = 4>
EP_DEVICE void warp_copy(int4* dst, const int4* src, int n, int lane) {
    for (int base = lane; base < n; base += ep::kWarpSize * kUnroll) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = base + u * ep::kWarpSize;
            if (i < n) {
                v[u] = kSrcReadOnly ? ep::ld_nc_no_alloc(src + i) : ep::ld_peer_no_alloc(src + i);
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = base + u * ep::kWarpSize;
            if (i < n) {
                ep::st_no_alloc(dst + i, v[u]);
            }
        }
    }
}

}  // namespace
