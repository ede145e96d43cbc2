// SM-ring dispatch of the intranode normal mode (protocol and shared pieces: `rings.cuh`):
// every rank streams its tokens to their destination ranks through per-(channel, source) ring
// buffers in the receivers' NVLink buffers; its own tokens go straight into its outputs.
// Kernel `intranode_dispatch` (one by-value params struct mirrored by its launcher).

#include "rings.cuh"

namespace {

constexpr int kDispatchThreads = 768;  // 24 warps, split into groups on both sides
constexpr int kDispatchWarps = kDispatchThreads / ep::kWarpSize;

// Dispatch row copies: the sender stores rows into the peer's ring with 16-byte warp copies
// (`warp_copy`, kDispatchUnroll loads in flight per lane); the receiver moves them from the ring
// into recv_x with Hopper bulk copies (TMA) through a per-warp shared-memory pipeline (`TmaPipe`
// below). The other combinations measured slower (docs/benchmarks.md, "tried and rejected").
constexpr int kDispatchUnroll = 5;

// Per warp: kTmaStages staging buffers of kTmaStageBytes, then the metadata: mbarriers
// u64[S], destinations u64[S], sizes u32[S]. Rows are split into equal 16-byte-multiple
// chunks of at most kTmaStageBytes (a 7168-bf16 row: 7 x 2048 B; 7168 fp8: 4 x 1792 B). Up to
// S - 1 chunk loads are in flight per warp; the last stage lets stores drain.
// Mirrored by `DISPATCH_SMEM_BYTES` in cuda/rings_dispatch.rs (24 warps x 9344 B = 224256 B
// dynamic smem, within the 227 KiB opt-in limit of sm_90 with the kernel's static smem).
constexpr int kTmaStages = 4;
constexpr int kTmaStageBytes = 2304;
constexpr int kTmaWarpMetaBytes = 128;
constexpr int kTmaWarpBytes = kTmaStages * kTmaStageBytes + kTmaWarpMetaBytes;
constexpr int kDispatchSmemBytes = kDispatchWarps * kTmaWarpBytes;
static_assert(kTmaStages >= 2 && kTmaStages <= 4, "TmaPipe::push waits with at most 3 newer groups");
static_assert(kTmaStageBytes % 16 == 0 && kTmaWarpBytes % 16 == 0, "bulk copies need 16 B units");
static_assert(kTmaStages * (8 + 8 + 4) <= kTmaWarpMetaBytes, "TMA metadata");
static_assert(kDispatchSmemBytes == 224256, "update DISPATCH_SMEM_BYTES in cuda/rings_dispatch.rs");

// A warp's bulk-copy pipeline. Every method but `init` is called by lane 0 only (it alone
// issues and tracks the bulk operations). Chunk i uses stage i % S: its load completes phase i / S of
// mbarrier i % S; `retire` waits for it and stores the stage out as one bulk async-group.
// Before stage s is loaded again, the store that last read it has finished reading
// (`wait_group.read`). Counters never wrap within one kernel.
struct TmaPipe {
    char* region;       // generic pointer to this warp's smem region
    uint32_t base;      // its shared address
    uint32_t issued;    // chunks whose load was issued
    uint32_t retired;   // chunks whose store was issued
    uint32_t phases;    // bit s: parity of the next phase of mbarrier s

    EP_DEVICE uint32_t stage(uint32_t s) const { return base + s * kTmaStageBytes; }
    EP_DEVICE uint32_t bar(uint32_t s) const { return base + kTmaStages * kTmaStageBytes + s * 8; }
    EP_DEVICE void** dsts() const {
        return reinterpret_cast<void**>(region + kTmaStages * kTmaStageBytes + kTmaStages * 8);
    }
    EP_DEVICE uint32_t* lens() const {
        return reinterpret_cast<uint32_t*>(region + kTmaStages * kTmaStageBytes + kTmaStages * 16);
    }

    // Called by every lane (uniform state); lane 0 also initialises the mbarriers.
    EP_DEVICE void init(char* smem, int warp, int lane) {
        region = smem + static_cast<size_t>(warp) * kTmaWarpBytes;
        base = ep::smem_addr(region);
        issued = 0;
        retired = 0;
        phases = 0;
        if (lane != 0) {
            return;
        }
#pragma unroll
        for (int s = 0; s < kTmaStages; ++s) {
            ep::mbarrier_init(bar(s), 1);
        }
        ep::fence_mbarrier_init();
        ep::fence_proxy_async_shared();
    }

    // Waits for the oldest outstanding load and stores its stage out.
    EP_DEVICE void retire() {
        const uint32_t s = retired % kTmaStages;
        ep::mbarrier_wait_parity(bar(s), (phases >> s) & 1u);
        phases ^= 1u << s;
        ep::bulk_store(dsts()[s], stage(s), lens()[s]);
        ep::bulk_commit_group();
        ++retired;
    }

    // Copies one chunk (16-byte aligned addresses, size a multiple of 16, <= kTmaStageBytes).
    EP_DEVICE void push(void* dst, const void* src, uint32_t bytes) {
        if (issued - retired == kTmaStages - 1) {
            retire();
        }
        const uint32_t s = issued % kTmaStages;
        if (issued >= kTmaStages) {
            // Stores issued after the one of chunk `issued - S` (which read stage s): >= 1.
            const uint32_t newer = retired - (issued - kTmaStages) - 1;
            if (newer >= 3) {
                ep::bulk_wait_group_read<3>();
            } else if (newer == 2) {
                ep::bulk_wait_group_read<2>();
            } else {
                ep::bulk_wait_group_read<1>();
            }
        }
        dsts()[s] = dst;
        lens()[s] = bytes;
        ep::mbarrier_arrive_expect_tx(bar(s), bytes);
        ep::bulk_load(stage(s), src, bytes, bar(s));
        ++issued;
    }

    // Copies `bytes` (a multiple of 16) from `src` to `dst` (both 16-byte aligned).
    EP_DEVICE void row(void* dst, const void* src, uint32_t bytes) {
        const uint32_t n = (bytes + kTmaStageBytes - 1) / kTmaStageBytes;
        const uint32_t chunk = n == 0 ? 0 : ((bytes + n - 1) / n + 15u) & ~15u;
        for (uint32_t off = 0; off < bytes; off += chunk) {
            push(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off,
                 min(chunk, bytes - off));
        }
    }

    // Issues the stores of every loaded chunk (all loads have then completed: their sources
    // may be overwritten). The stores may still be in flight.
    EP_DEVICE void flush() {
        while (retired != issued) {
            retire();
        }
    }
};
}  // namespace

// Mirrors `DispatchParams` in src/intranode/cuda/rings_dispatch.rs.
struct DispatchParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int4* x;                      // [T, hidden_int4]
    const float* x_scales;              // [T, S] or null (S == 0)
    const int64_t* topk_idx;            // [T, K] or null (K == 0)
    const float* topk_weights;          // [T, K] or null (K == 0)
    const uint8_t* is_token_in_rank;    // [T, R]
    const int* rank_prefix_matrix;      // [R, R]
    const int* channel_prefix_matrix;   // [R, C] (this rank's)
    int4* recv_x;                       // [N, hidden_int4]
    float* recv_x_scales;               // [N, S]
    int* recv_src_idx;                  // [N]
    int64_t* recv_topk_idx;             // [N, K]
    float* recv_topk_weights;           // [N, K]
    int* recv_channel_offset;           // [R, C] out
    int* send_head;                     // [T, R] out
    int* error_info;                    // [4]
    uint64_t timeout_ns;
    int rank;
    int num_ranks;
    int num_tokens;
    int hidden_int4;  // row bytes / 16
    int num_scales;   // S
    int num_topk;     // K
    int experts_per_rank;
    int num_channels;
    int num_max_send_tokens;
    int num_max_recv_tokens;
    int num_recv_rows;  // N: rows of the outputs
    int worst_case;     // N is a capacity every rank shares, not this rank's count
};
EP_CHECK_PARAMS_SIZE(DispatchParams, 240);

namespace {

// Selection k of `token` as rank `dst` sees it: its local expert index (-1 when the expert
// is on another rank) and its weight (0 then).
EP_DEVICE void local_selection(const DispatchParams& p, int token, int k, int dst, int* idx,
                               float* weight) {
    const int K = p.num_topk;
    const int64_t lo = static_cast<int64_t>(dst) * p.experts_per_rank;
    const int64_t e = __ldg(p.topk_idx + static_cast<int64_t>(token) * K + k);
    const bool local = e >= lo && e < lo + p.experts_per_rank;
    *idx = local ? static_cast<int>(e - lo) : -1;
    *weight = local ? __ldg(p.topk_weights + static_cast<int64_t>(token) * K + k) : 0.0f;
}

// One token into slot `slot` of a dispatch ring, by one warp.
EP_DEVICE void dispatch_send_token(const DispatchParams& p, char* ring_base, const RingLayout& lay,
                                   int token, int slot, int dst, int lane) {
    const int hi = p.hidden_int4;
    warp_copy<true, kDispatchUnroll>(reinterpret_cast<int4*>(ring_base) + static_cast<int64_t>(slot) * hi,
                    p.x + static_cast<int64_t>(token) * hi, hi, lane);
    if (lane == 0) {
        reinterpret_cast<int*>(ring_base + lay.src_idx)[slot] = token;
    }
    const int K = p.num_topk;
    if (K > 0) {
        int* ridx = reinterpret_cast<int*>(ring_base + lay.topk_idx) + static_cast<int64_t>(slot) * K;
        float* rw = reinterpret_cast<float*>(ring_base + lay.topk_weights) + static_cast<int64_t>(slot) * K;
        for (int k = lane; k < K; k += ep::kWarpSize) {
            local_selection(p, token, k, dst, ridx + k, rw + k);
        }
    }
    const int S = p.num_scales;
    if (S > 0) {
        float* rs = reinterpret_cast<float*>(ring_base + lay.scales) + static_cast<int64_t>(slot) * S;
        for (int i = lane; i < S; i += ep::kWarpSize) {
            rs[i] = __ldg(p.x_scales + static_cast<int64_t>(token) * S + i);
        }
    }
}

// One token of this rank's own into row `out` of the outputs, by one warp: what
// `dispatch_send_token` and `dispatch_recv_token` do through a ring, without the ring. The row
// goes through the warp's bulk-copy pipeline (the sending block has the receiving block's
// shared memory too), which keeps more bytes in flight than registers would.
EP_DEVICE void dispatch_own_token(const DispatchParams& p, int token, int64_t out, int lane,
                                  TmaPipe& pipe) {
    const int hi = p.hidden_int4;
    if (lane == 0) {
        pipe.row(p.recv_x + out * hi, p.x + static_cast<int64_t>(token) * hi,
                 static_cast<uint32_t>(hi) * 16u);
        p.recv_src_idx[out] = token;
    }
    const int K = p.num_topk;
    for (int k = lane; k < K; k += ep::kWarpSize) {
        int idx;
        float w;
        local_selection(p, token, k, p.rank, &idx, &w);
        p.recv_topk_idx[out * K + k] = static_cast<int64_t>(idx);
        p.recv_topk_weights[out * K + k] = w;
    }
    const int S = p.num_scales;
    for (int i = lane; i < S; i += ep::kWarpSize) {
        p.recv_x_scales[out * S + i] = __ldg(p.x_scales + static_cast<int64_t>(token) * S + i);
    }
}

// Slot `slot` of a dispatch ring into row `out` of the outputs, by one warp.
EP_DEVICE void dispatch_recv_token(const DispatchParams& p, const char* ring_base,
                                   const RingLayout& lay, int slot, int64_t out, int lane,
                                   TmaPipe& pipe) {
    const int hi = p.hidden_int4;
    if (lane == 0) {
        pipe.row(p.recv_x + out * hi,
                 reinterpret_cast<const int4*>(ring_base) + static_cast<int64_t>(slot) * hi,
                 static_cast<uint32_t>(hi) * 16u);
    }
    if (lane == 0) {
        p.recv_src_idx[out] = reinterpret_cast<const int*>(ring_base + lay.src_idx)[slot];
    }
    const int K = p.num_topk;
    if (K > 0) {
        const int* ridx = reinterpret_cast<const int*>(ring_base + lay.topk_idx) + static_cast<int64_t>(slot) * K;
        const float* rw = reinterpret_cast<const float*>(ring_base + lay.topk_weights) + static_cast<int64_t>(slot) * K;
        for (int k = lane; k < K; k += ep::kWarpSize) {
            p.recv_topk_idx[out * K + k] = static_cast<int64_t>(ridx[k]);
            p.recv_topk_weights[out * K + k] = rw[k];
        }
    }
    const int S = p.num_scales;
    if (S > 0) {
        const float* rs = reinterpret_cast<const float*>(ring_base + lay.scales) + static_cast<int64_t>(slot) * S;
        for (int i = lane; i < S; i += ep::kWarpSize) {
            p.recv_x_scales[out * S + i] = rs[i];
        }
    }
}

// The next k tokens of the channel bound to rank d, from token `t` on (advanced past them):
// scanned 32 at a time, numbered j = j0, j0 + 1, ... in token order; warp `gw` of the group's
// `wpg` takes those with j % wpg == gw (`take(token, j)`), and warp 0 records each scanned
// token's j (or -1) in `send_head` for the combine.
template <typename Take>
EP_DEVICE void take_tokens(const DispatchParams& p, int d, int& t, int t_end, int k, int j0,
                           int gw, int wpg, int lane, Take&& take) {
    const int R = p.num_ranks;
    int filled = 0;
    while (filled < k) {
        EP_DEVICE_ASSERT(t < t_end);  // channel_prefix_matrix disagrees with is_token_in_rank
        const int tok = t + lane;
        const bool flag = tok < t_end && p.is_token_in_rank[static_cast<int64_t>(tok) * R + d] != 0;
        unsigned mask = __ballot_sync(ep::kFullMask, flag);
        const int need = k - filled;
        int window = min(ep::kWarpSize, t_end - t);
        if (__popc(mask) > need) {
            unsigned m = mask;
            for (int i = 1; i < need; ++i) {
                m &= m - 1;
            }
            window = __ffs(m);  // position of the need-th set bit, plus one
            mask &= window == 32 ? ep::kFullMask : ((1u << window) - 1u);
        }
        const int jw = j0 + filled;
        if (gw == 0 && lane < window) {
            const bool taken = (mask >> lane) & 1u;
            p.send_head[static_cast<int64_t>(tok) * R + d] =
                taken ? jw + __popc(mask & ((1u << lane) - 1u)) : -1;
        }
        unsigned m = mask;
        for (int r = 0; m != 0; ++r) {
            const int b = __ffs(m) - 1;
            m &= m - 1;
            if ((jw + r) % wpg == gw) {
                take(t + b, jw + r);
            }
        }
        filled += __popc(mask);
        t += window;
    }
}

// Worst-case outputs (`N` rows sized for any routing, the same on every rank): checks every
// rank's received count (the last row of the prefix matrix, which every rank holds) against N,
// so that all ranks stop together when one would overflow (block 0 records it), and marks the
// rows past this rank's count as empty: source -1, routing -1, weight 0 (their payload stays
// unwritten). Returns false when the dispatch must not run.
EP_DEVICE bool worst_case_prelude(const DispatchParams& p) {
    const int R = p.num_ranks;
    const int* received = p.rank_prefix_matrix + (R - 1) * R;
    for (int r = 0; r < R; ++r) {
        const int n = received[r];
        if (n > p.num_recv_rows) {
            if (blockIdx.x == 0 && threadIdx.x == 0) {
                report_capacity(p.error_info, p.rank, r, n, p.num_recv_rows);
            }
            return false;
        }
    }
    const int64_t first = received[p.rank];
    const int64_t rows = p.num_recv_rows - first;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int64_t i = tid; i < rows; i += stride) {
        p.recv_src_idx[first + i] = -1;
    }
    if (p.recv_topk_idx != nullptr) {
        const int64_t K = p.num_topk;
        for (int64_t i = tid; i < rows * K; i += stride) {
            p.recv_topk_idx[first * K + i] = -1;
            p.recv_topk_weights[first * K + i] = 0.0f;
        }
    }
    return true;
}

}  // namespace

// Grid: 2 * C blocks of kDispatchThreads. Block 2c sends channel c, block 2c + 1 receives it.
// Sending block: the own group (kDispatchWarps / R warps and what the ring groups leave) writes
// this rank's own tokens straight into the outputs (no ring, no receiver); then ring group g
// (the rest shared by R - 1, named barrier g + 1) streams to the g-th other rank. Receiving
// block: ring group g (kDispatchWarps / (R - 1) warps) takes the g-th other rank's ring, so at
// R = 4 each ring has 8 receiving warps instead of 6 (which measured faster at EP4).
EP_KERNEL void __launch_bounds__(kDispatchThreads, 1) intranode_dispatch(const DispatchParams p) {
    if (p.worst_case != 0 && !worst_case_prelude(p)) {
        return;  // some rank receives more rows than the capacity: every rank stops here
    }
    __shared__ int s_value[kMaxRanks][2];
    __shared__ int s_tail[kMaxRanks];
    __shared__ int s_abort[kMaxRanks];

    const int R = p.num_ranks;
    const int C = p.num_channels;
    const int Q = p.num_max_recv_tokens;
    const int c = static_cast<int>(blockIdx.x) / 2;
    const bool is_sender = (blockIdx.x % 2) == 0;
    const int lane = ep::lane_id();
    // Groups: sending block, the own group's warps first, then R - 1 ring groups; receiving
    // block, R - 1 ring groups. Group g serves peer `d`; ring groups use named barrier g + 1.
    const int warp = ep::warp_id();
    const int ring_groups = R - 1;
    const int ring_wpg = ring_groups == 0 ? 0
                         : is_sender     ? (kDispatchWarps - kDispatchWarps / R) / ring_groups
                                         : kDispatchWarps / ring_groups;
    const int own_warps = is_sender ? kDispatchWarps - ring_wpg * ring_groups : 0;
    int g, gw, warps_per_group;
    if (warp < own_warps) {
        g = -1;  // the own group (sending block only)
        gw = warp;
        warps_per_group = own_warps;
    } else {
        g = ring_wpg == 0 ? ring_groups : (warp - own_warps) / ring_wpg;
        if (g >= ring_groups) {
            return;  // spare warps, or one rank's receiving block
        }
        gw = (warp - own_warps) % ring_wpg;
        warps_per_group = ring_wpg;
    }
    // The peer: this rank for the own group, else the g-th other rank.
    const int peer = g < 0 ? p.rank : (g < p.rank ? g : g + 1);
    const int group_threads = warps_per_group * ep::kWarpSize;
    const int bar_id = g + 1;
    const bool leader = gw == 0 && lane == 0;
    extern __shared__ __align__(128) char s_tma[];
    // The launcher must pass kDispatchSmemBytes of dynamic shared memory.
    EP_DEVICE_ASSERT(ep::dynamic_smem_bytes() >= static_cast<uint32_t>(kDispatchSmemBytes));
    TmaPipe pipe;
    const RingLayout lay = RingLayout::dispatch(Q, p.hidden_int4 * 16, p.num_topk, p.num_scales);
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    int t_begin, t_end;
    channel_range(p.num_tokens, C, c, &t_begin, &t_end);

    if (is_sender) {
        const int d = peer;
        char* dst_buf = buf(p.buffer_ptrs, d);
        const int first = c > 0 ? p.channel_prefix_matrix[d * C + c - 1] : 0;
        const int last = p.channel_prefix_matrix[d * C + c];
        const int n_total = last - first;
        int t = t_begin;
        bool aborted = false;
        if (d == p.rank) {
            // Own tokens, straight into the outputs from the channel's first row (the
            // receiver's `base`); no flow control, one pass.
            const int64_t own_base =
                (p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + p.rank] : 0) + first;
            if (leader) {
                p.recv_channel_offset[p.rank * C + c] = static_cast<int>(own_base);
            }
            if (n_total > 0) {
                pipe.init(s_tma, ep::warp_id(), lane);
                __syncwarp();
                take_tokens(p, d, t, t_end, n_total, 0, gw, warps_per_group, lane, [&](int token, int j) {
                    dispatch_own_token(p, token, own_base + j, lane, pipe);
                });
                if (lane == 0) {
                    pipe.flush();
                    ep::bulk_wait_group<0>();  // the rows are written, the smem no longer read
                }
            }
        } else {
            if (leader) {
                ep::st_release_sys(counter(dst_buf, kStart, c, p.rank), -first - 1);
                ep::st_release_sys(counter(dst_buf, kEnd, c, p.rank), -last - 1);
            }
            char* ring_base = ring(dst_buf, lay.bytes, c, R, p.rank);
            int* tail_ptr = counter(dst_buf, kTail, c, p.rank);
            const int* head_ptr = counter(my_buf, kHead, c, d);
            const int chunk = p.num_max_send_tokens;
            int sent = 0;
            while (sent < n_total) {
                const int k = min(chunk, n_total - sent);
                if (leader) {
                    bool timed_out = false;
                    ep::wait_flag_sys(head_ptr, [&](int head) { return Q - (sent - head) >= k; },
                                      ep::Deadline::after(p.timeout_ns), &timed_out);
                    if (timed_out) {
                        report_timeout(p.error_info, kDispatchKernel, p.rank, d,
                                       kSiteDispatchSendHead);
                    }
                    s_abort[g] = timed_out;
                }
                named_barrier(bar_id, group_threads);
                if (s_abort[g]) {
                    aborted = true;
                    break;
                }
                take_tokens(p, d, t, t_end, k, sent, gw, warps_per_group, lane, [&](int token, int j) {
                    dispatch_send_token(p, ring_base, lay, token, j % Q, d, lane);
                });
                named_barrier(bar_id, group_threads);
                sent += k;
                if (leader) {
                    ep::st_release_sys(tail_ptr, sent);
                }
            }
        }
        // Tokens after the last one sent to d.
        if (!aborted && gw == 0) {
            for (int tok = t + lane; tok < t_end; tok += ep::kWarpSize) {
                p.send_head[static_cast<int64_t>(tok) * R + d] = -1;
            }
        }
        return;
    }

    // Receiver of channel c from source s, the g-th rank other than this one.
    const int s = peer;
    char* src_buf = buf(p.buffer_ptrs, s);
    if (leader) {
        const ep::Deadline deadline = ep::Deadline::after(p.timeout_ns);
        bool timed_out = false;
        const int start = ep::wait_flag_sys(counter(my_buf, kStart, c, s), [](int v) { return v != 0; },
                                            deadline, &timed_out);
        int end = 0;
        if (!timed_out) {
            end = ep::wait_flag_sys(counter(my_buf, kEnd, c, s), [](int v) { return v != 0; },
                                    deadline, &timed_out);
        }
        if (timed_out) {
            report_timeout(p.error_info, kDispatchKernel, p.rank, s, kSiteDispatchRecvMeta);
        }
        s_abort[g] = timed_out;
        s_value[g][0] = -start - 1;
        s_value[g][1] = -end - 1;
    }
    named_barrier(bar_id, group_threads);
    if (s_abort[g]) {
        return;
    }
    const int start = s_value[g][0];
    const int n = s_value[g][1] - start;
    // The leader rewrites s_abort / s_tail below: every thread of the group has read them.
    named_barrier(bar_id, group_threads);
    const int64_t base = (s > 0 ? p.rank_prefix_matrix[(s - 1) * R + p.rank] : 0) + start;
    if (leader) {
        p.recv_channel_offset[s * C + c] = static_cast<int>(base);
    }
    pipe.init(s_tma, ep::warp_id(), lane);
    __syncwarp();
    const char* ring_base = ring(my_buf, lay.bytes, c, R, s);
    const int* tail_ptr = counter(my_buf, kTail, c, s);
    int* head_ptr = counter(src_buf, kHead, c, p.rank);
    int head = 0;
    while (head < n) {
        if (leader) {
            bool timed_out = false;
            const int tail = ep::wait_flag_sys(tail_ptr, [&](int v) { return v > head; },
                                               ep::Deadline::after(p.timeout_ns), &timed_out);
            if (timed_out) {
                report_timeout(p.error_info, kDispatchKernel, p.rank, s, kSiteDispatchRecvTail);
            }
            s_abort[g] = timed_out;
            s_tail[g] = tail;
        }
        named_barrier(bar_id, group_threads);
        if (s_abort[g]) {
            if (lane == 0) {
                ep::bulk_wait_group<0>();  // earlier rows' stores still read this block's smem
            }
            return;
        }
        const int tail = s_tail[g];
        // Slots [head, tail) were published by the sender (acquire by the leader): order that
        // before this warp's async-proxy reads of them.
        if (lane == 0) {
            ep::fence_proxy_async_global();
        }
        for (int j = head + gw; j < tail; j += warps_per_group) {
            dispatch_recv_token(p, ring_base, lay, j % Q, base + j, lane, pipe);
        }
        // Every load from the ring has completed (the slots may be handed back); the stores
        // into recv_x may still be in flight.
        if (lane == 0) {
            pipe.flush();
        }
        __syncwarp();
        named_barrier(bar_id, group_threads);
        head = tail;
        if (leader) {
            ep::st_release_sys(head_ptr, head);
        }
    }
    if (lane == 0) {
        ep::bulk_wait_group<0>();  // the recv_x rows are written, the smem no longer read
    }
}
