// Low-latency dispatch (protocol: `protocol.cuh`): each token once per destination rank with an
// index entry per (token, k), the count signals, and the receive phase's packed layout, rows and
// (with the top-k weights) the per-rank combine's records. Host twins: `host.rs`,
// `src/fp8/host.rs`; launcher: `cuda/dispatch.rs` (`dispatch_cuda`).
#include "protocol.cuh"

namespace {

// ------------------------------------------------------------------------------------------
// Dispatch
// ------------------------------------------------------------------------------------------

// Offset in a buffer set of the message of source `src`'s token `t`.
EP_DEVICE uint64_t msg_offset(const LlBuffer& b, int src, int t) {
    return b.off_msgs + (static_cast<uint64_t>(src) * b.max_tokens + t) *
                            static_cast<uint64_t>(b.msg_stride);
}

// Block per token: the token is cast once (staged in shared memory) and written to each rank
// that holds one of its experts, with an index entry per (t, k). `s_count[e]` (this rank's
// selections of expert e) tells the warp that publishes an expert's last selection that it is
// the last: it sends the count signal `-n - 1` then. Experts nobody selected are signalled
// at once. With `topk_weights`, each message to a rank goes with the token's record for that
// rank (see the file comment), built from the per-k slots the K warps leave in shared memory.
__device__ void dispatch_send(const DispatchParams& p, uint8_t* smem, const int* s_topk,
                              const int* s_count, uint32_t set, uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int T = p.num_tokens, K = p.num_topk, H = b.hidden, R = b.num_ranks;
    const int E = b.num_experts, L = E / R, M = b.max_tokens;
    const int tid = threadIdx.x, lane = ep::lane_id(), warp = ep::warp_id();
    int* active = reinterpret_cast<int*>(b.local + b.off_active);
    int* send_done = reinterpret_cast<int*>(b.local + b.off_send_done);
    uint8_t* stage = smem;
    uint8_t** s_dst = reinterpret_cast<uint8_t**>(smem + b.msg_stride);
    // Per k of the current token (records only): its rank, whether its entry is written, and
    // the j of its rank.
    __shared__ int s_rank[kMaxTopk];
    __shared__ int s_placed[kMaxTopk];
    __shared__ int s_j[kMaxTopk];
    // Per k (NVSHMEM build): the remote rank its staged copy goes to, or -1.
    __shared__ int s_put_rank[kMaxTopk];
    // Per k (NVSHMEM build): 1 if its index entry (and maybe the message) went to a remote rank.
    __shared__ int s_remote[kMaxTopk];
    const bool records = p.topk_weights != nullptr;
    // The weights [T * K], staged by the kernel's start after the per-expert counts.
    const float* s_wtab = reinterpret_cast<const float*>(s_count + E);

    const int groups = H / ep::kFp8Group;
    const int payload = p.fp8 ? H : 2 * H;
    const int msg_bytes = 16 + payload + (p.fp8 ? groups * 4 : 0);
    const int body_vecs = ep::ceil_div(msg_bytes, 16);
    // With the records, the K weights follow the body (ll_msg_weights), 4 per vector.
    const int msg_vecs = body_vecs + (records ? ep::ceil_div(K, 4) : 0);
    float* stage_w = reinterpret_cast<float*>(stage + body_vecs * 16);
    // Deterministic padding after the scales and after the weights (the weights themselves
    // are staged per token).
    for (int i = msg_bytes + tid; i < msg_vecs * 16; i += kThreads) {
        if (i < body_vecs * 16 || i >= body_vecs * 16 + 4 * K) {
            stage[i] = 0;
        }
    }

    // The count signal of expert e (n selections) into its rank's slot for this source.
    auto signal = [&](int e, int n) {
        const int r = e / L;
        if (ld_vol(active + r) != 0) {
            signal_peer(b, r, set,
                        b.off_signals + (static_cast<uint64_t>(e - r * L) * R + b.rank) * 8,
                        (static_cast<uint64_t>(tag) << 32) |
                            static_cast<uint64_t>(static_cast<uint32_t>(-n - 1)));
        }
    };
    for (int e = blockIdx.x + tid * static_cast<int>(gridDim.x); e < E;
         e += kThreads * static_cast<int>(gridDim.x)) {
        if (s_count[e] == 0) {
            signal(e, 0);
        }
    }

    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        // Warp k: destination of (t, k); the slot is the number of earlier (token, k) entries
        // of this rank routed to the same expert (the host twin `send_slots`).
        for (int k = warp; k < K; k += kWarps) {
            const int idx = t * K + k;
            const int e = s_topk[idx];
            int slot = 0;
            if (e >= 0) {
                for (int j = lane; j < idx; j += ep::kWarpSize) {
                    slot += s_topk[j] == e ? 1 : 0;
                }
                slot = ep::warp_reduce_sum(slot);
            }
            // j of this k's rank: the distinct ranks among the earlier valid k (lane k2 < k
            // counts when it is its rank's first appearance; K <= kMaxTopk < 32 lanes).
            bool first_of_rank = false;
            if (lane < k) {
                const int e2 = s_topk[t * K + lane];
                first_of_rank = e2 >= 0;
                for (int k3 = 0; k3 < lane && first_of_rank; ++k3) {
                    const int e3 = s_topk[t * K + k3];
                    first_of_rank = !(e3 >= 0 && e3 / L == e2 / L);
                }
            }
            const int j_rank = __popc(__ballot_sync(ep::kFullMask, first_of_rank));
            if (lane == 0 && records) {
                s_rank[k] = e >= 0 ? e / L : -1;
                s_placed[k] = e >= 0 && slot < M ? 1 : 0;
                s_j[k] = j_rank;
                stage_w[k] = s_wtab[idx];
            }
            if (lane == 0) {
                // The token goes once to each rank: the first k routed there sends it; every
                // k writes its slot's index entry.
                uint8_t* dst = nullptr;
                if constexpr (kRemotePeers) {
                    s_put_rank[k] = -1;
                    s_remote[k] = 0;
                }
                if (e >= 0) {
                    const int r = e / L;
                    // slot < M holds when a token's experts are distinct (checked for memory
                    // safety only).
                    if (ld_vol(active + r) != 0 && slot < M) {
                        const int l = e - r * L;
                        if constexpr (kRemotePeers) {
                            s_remote[k] = is_remote(b, r) ? 1 : 0;
                        }
                        entry_peer(b, r, set,
                                   b.off_idx + ((static_cast<uint64_t>(l) * R + b.rank) * M +
                                                static_cast<uint64_t>(slot)) * 4,
                                   t | (k << 24));
                        bool first = true;
                        for (int k2 = 0; k2 < k; ++k2) {
                            const int e2 = s_topk[t * K + k2];
                            first = first && !(e2 >= 0 && e2 / L == r);
                        }
                        if (first) {
                            // A remote rank's copy is staged at (r, t).
                            dst = write_target(b, r, set, msg_offset(b, b.rank, t),
                                               (static_cast<uint64_t>(r) * M + t) *
                                                   static_cast<uint64_t>(b.msg_stride));
                            if constexpr (kRemotePeers) {
                                s_put_rank[k] = r;
                            }
                        }
                    }
                }
                s_dst[k] = dst;
            }
        }

        // Meanwhile warps [K, kWarps) stage the message body (payload and scales) in shared
        // memory (K <= kMaxTopk < kWarps).
        const __nv_bfloat16* xrow = p.x + static_cast<int64_t>(t) * H;
        const int cast_warps = kWarps - K;
        if (warp < K) {
            // Busy with the destinations above.
        } else if (p.fp8) {
            // 8 lanes x 16 channels per 128-channel group; 4 groups per warp step.
            const int sub = lane & 7;
            for (int g0 = (warp - K) * 4; g0 < groups; g0 += cast_warps * 4) {
                const int g = g0 + (lane >> 3);
                int4 a = make_int4(0, 0, 0, 0), c = a, q;
                float scale;
                if (g < groups) {
                    ep::ll::load_bf16x16(xrow, g, sub, a, c);
                }
                ep::ll::cast_e4m3_x16(a, c, g < groups, p.scale_format, q, scale);
                if (g < groups) {
                    *reinterpret_cast<int4*>(stage + 16 + g * ep::kFp8Group + sub * 16) = q;
                    if (sub == 0) {
                        *reinterpret_cast<float*>(stage + 16 + H + g * 4) = scale;
                    }
                }
            }
        } else {
            const int4* src = reinterpret_cast<const int4*>(xrow);
            for (int i = tid - K * ep::kWarpSize; i < H / 8; i += cast_warps * ep::kWarpSize) {
                *reinterpret_cast<int4*>(stage + 16 + i * 16) = ep::ld_nc_no_alloc(src + i);
            }
        }
        __syncthreads();

        // Send, 16 bytes per thread per step: K copies of the message. Vector 0 is the header,
        // per destination: the token, and with the records the j of the rank, the mask of the
        // token's k whose entries it got (the receiver reads no k >= K) and the tag.
        const int jobs = K * msg_vecs;
        for (int j = tid; j < jobs; j += kThreads) {
            const int k = j / msg_vecs;
            const int i = j - k * msg_vecs;
            uint8_t* dst = s_dst[k];
            if (dst == nullptr) {
                continue;
            }
            int4 v;
            if (i != 0) {
                v = *reinterpret_cast<const int4*>(stage + i * 16);
            } else if (records) {
                uint32_t mask = 0;
                for (int k2 = 0; k2 < K; ++k2) {
                    mask |= s_rank[k2] == s_rank[k] && s_placed[k2] != 0 ? 1u << k2 : 0u;
                }
                v = make_int4(t, s_j[k], static_cast<int>(mask), static_cast<int>(tag));
            } else {
                v = make_int4(t, 0, 0, 0);
            }
            put_v4(dst + i * 16, v);
        }
        if constexpr (kRemotePeers) {
            // Warp k puts its staged copy to a remote rank, and completes that put and its
            // index entry's before the publish below.
            __syncthreads();
            if (warp < K && s_remote[warp] != 0) {
                const int r = s_put_rank[warp];
                if (r >= 0 && s_dst[warp] != nullptr) {
                    put_staged(b, r, set, msg_offset(b, b.rank, t),
                               (static_cast<uint64_t>(r) * M + t) *
                                   static_cast<uint64_t>(b.msg_stride),
                               0, static_cast<uint64_t>(msg_vecs) * 16);
                }
                remote_quiet();
            }
        }
        __syncthreads();
        // Publish: every (t, k) counts once for its expert (also when the rank is inactive,
        // so the counters always balance); the last one signals the expert's rank.
        if (tid < K) {
            const int e = s_topk[t * K + tid];
            if (e >= 0 && ep::atomic_add_release_gpu(send_done + e, 1) == s_count[e] - 1) {
                // The atomics form a release sequence: the fence (acquire, then release
                // pattern with the relaxed signal store) orders every earlier selection's
                // messages before the signal.
                atomicExch(send_done + e, 0);
                ep::fence_acq_rel_sys();
                signal(e, s_count[e]);
            }
        }
    }
}

// The records into the handle (after the signals have been awaited): per (source s, token t)
// the message's header and the weights of k < K (4 per vector) that follow its body, a vector
// per thread, taken from the last block of the grid backwards: the row copy hands out its items
// from the first block on, and at 128 tokens it leaves the last blocks without rows (fp8 at EP4:
// about 4100 items for 4224 warps), so the records cost those blocks' idle time. The header
// becomes the token's row j at its home and the mask, or -1 when the message is not this op's
// (the source sent nothing of the token here) or the source is inactive. The packed rows of the
// mask's k are written by the row copy, which places them.
__device__ void dispatch_recv_records(const DispatchParams& p, const uint8_t* my_set,
                                      int body_vecs, uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int R = b.num_ranks, M = b.max_tokens;
    const int* active = reinterpret_cast<const int*>(b.local + b.off_active);
    const int rec_vecs = 1 + ep::ceil_div(p.num_topk, 4);
    const int64_t vecs = static_cast<int64_t>(R) * M * rec_vecs;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
    for (int64_t i = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kThreads + threadIdx.x;
         i < vecs; i += stride) {
        const int64_t st = i / rec_vecs;
        const int v = static_cast<int>(i - st * rec_vecs);
        const uint8_t* msg = my_set + b.off_msgs + st * static_cast<int64_t>(b.msg_stride);
        int4 x = ep::ld_cg_v4(msg + (v == 0 ? 0 : (body_vecs + v - 1) * 16));
        if (v == 0) {
            const int s = static_cast<int>(st / M);
            const bool ok = ld_vol(active + s) != 0 && static_cast<uint32_t>(x.w) == tag &&
                            x.y >= 0 && x.y < b.max_topk;
            x = make_int4(ok ? x.y : -1, x.z, 0, 0);
        }
        // Handle vector 0 the header, the weights from vector 1 + kMaxTopk / 4.
        const int at = v == 0 ? 0 : v + kMaxTopk / 4;
        *reinterpret_cast<int4*>(p.recv_rank_records + st * kRecordWords + at * 4) = x;
    }
}

// Every block waits for all L x R signals, computes the whole packed layout in shared memory,
// and then the grid's warps share all rows (chunks of 32 lanes x kRecvUnroll vectors), so the
// copy is balanced however the tokens are spread over the experts.
__device__ void dispatch_recv(const DispatchParams& p, int* s_cnt, int* s_off, int* s_pre,
                              uint32_t set, uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int H = b.hidden, R = b.num_ranks, E = b.num_experts, L = E / R, M = b.max_tokens;
    const int tid = threadIdx.x, lane = ep::lane_id(), warp = ep::warp_id();
    int* active = reinterpret_cast<int*>(b.local + b.off_active);
    const int groups = H / ep::kFp8Group;
    const int payload = p.fp8 ? H : 2 * H;
    const int payload_vecs = payload / 16;
    uint8_t* my_set = set_base(b, b.local, set);
    const uint64_t* sigs = reinterpret_cast<const uint64_t*>(my_set + b.off_signals);
    const int64_t rows_per_expert = static_cast<int64_t>(R) * M;

    for (int i = tid; i < L * R; i += kThreads) {
        s_cnt[i] = wait_count(sigs + i, tag, active + i % R, b.timeout_ns);
    }
    __syncthreads();
    for (int l = tid; l < L; l += kThreads) {
        int acc = 0;
        for (int s = 0; s < R; ++s) {
            s_off[l * R + s] = acc;
            acc += s_cnt[l * R + s];
        }
        s_pre[l + 1] = acc;
    }
    __syncthreads();
    block_prefix_sum(s_pre, L);
    __syncthreads();
    if (p.recv_rank_records != nullptr) {
        dispatch_recv_records(p, my_set, ep::ceil_div(16 + payload + (p.fp8 ? groups * 4 : 0), 16),
                              tag);
    }
    // Per local expert (a block each): the count, the ranges, and -1 in the source-token
    // entries past the count (the rows below it are written by the copy below), so the outputs
    // need no fill before the launch.
    for (int l = blockIdx.x; l < L; l += gridDim.x) {
        const int count = s_pre[l + 1] - s_pre[l];
        if (tid == 0) {
            p.recv_count[l] = count;
        }
        for (int s = tid; s < R; s += kThreads) {
            p.recv_layout_range[(static_cast<int64_t>(l) * R + s) * 2] = s_off[l * R + s];
            p.recv_layout_range[(static_cast<int64_t>(l) * R + s) * 2 + 1] = s_cnt[l * R + s];
        }
        for (int64_t row = count + tid; row < rows_per_expert; row += kThreads) {
            p.recv_src_info[l * rows_per_expert + row] = -1;
        }
    }

    constexpr int kChunkVecs = ep::kWarpSize * kRecvUnroll;
    const int chunks = ep::ceil_div(payload_vecs, kChunkVecs);
    const int64_t items = static_cast<int64_t>(s_pre[L]) * chunks;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp; item < items;
         item += warps) {
        const int j = static_cast<int>(item / chunks);
        const int chunk = static_cast<int>(item - static_cast<int64_t>(j) * chunks);
        // Expert: the last l with s_pre[l] <= j (binary search), then source by offsets.
        const int l = last_at_or_below(s_pre, L, j);
        const int row = j - s_pre[l];
        int s = R - 1;
        while (s_off[l * R + s] > row) {
            --s;
        }
        const int slot = row - s_off[l * R + s];
        const int entry = ep::ld_cg_i32(my_set + b.off_idx +
                                    ((static_cast<int64_t>(l) * R + s) * M + slot) * 4);
        const int t = entry & 0xffffff;
        const int64_t out_row = l * rows_per_expert + row;
        if (t >= M) {
            // Never for a well-formed op (the entry is written with its message): the row
            // stays unused, marked as such for combine.
            if (chunk == 0 && lane == 0) {
                p.recv_src_info[out_row] = -1;
            }
            continue;
        }
        const uint8_t* msg = my_set + b.off_msgs +
                             (static_cast<uint64_t>(s) * M + t) * static_cast<uint64_t>(b.msg_stride);
        uint8_t* dst = p.recv_x + out_row * payload;
        int4 v[kRecvUnroll];
#pragma unroll
        for (int u = 0; u < kRecvUnroll; ++u) {
            const int i = chunk * kChunkVecs + u * ep::kWarpSize + lane;
            if (i < payload_vecs) {
                v[u] = ep::ld_cg_v4(msg + 16 + i * 16);
            }
        }
        if (chunk == 0) {
            if (lane == 0) {
                const int k = static_cast<int>(static_cast<uint32_t>(entry) >> 24);
                p.recv_src_info[out_row] = t;
                p.recv_src_topk[out_row] = k;
                if (p.recv_rank_records != nullptr && k < kMaxTopk) {
                    // The packed row of (s, t, k) in the token's record (its mask has k).
                    p.recv_rank_records[(static_cast<int64_t>(s) * M + t) * kRecordWords + 4 + k] =
                        static_cast<int>(out_row);
                }
            }
            if (p.fp8) {
                float* scales = p.recv_scales + out_row * groups;
                for (int g = lane; g < groups; g += ep::kWarpSize) {
                    scales[g] = ep::ld_cg_f32(msg + 16 + H + g * 4);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kRecvUnroll; ++u) {
            const int i = chunk * kChunkVecs + u * ep::kWarpSize + lane;
            if (i < payload_vecs) {
                *reinterpret_cast<int4*>(dst + i * 16) = v[u];
            }
        }
    }
}

}  // namespace

// Grid: at most one block per SM (blocks wait for each other's sends). Dynamic shared memory:
// max(send: msg_stride + kMaxTopk * 8 + 4 * (T * K + E) (+ 4 * T * K with weights),
// receive: 4 * (2 * E + L + 1)) bytes (the receive phase reuses the send phase's space).
EP_KERNEL void __launch_bounds__(kThreads, 1) ll_dispatch(const __grid_constant__ DispatchParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    const LlBuffer& b = p.buf;
    uint32_t* ctl = reinterpret_cast<uint32_t*>(b.local);
    __shared__ uint32_t s_seq;
    int* s_topk = reinterpret_cast<int*>(smem + b.msg_stride + kMaxTopk * 8);
    // Selections per expert of this rank [E], after the top-k table; then (records only) the
    // weights [T * K].
    int* s_count = s_topk + p.num_tokens * p.num_topk;
    float* s_wtab = reinterpret_cast<float*>(s_count + b.num_experts);
    const bool sends = (p.phases & kPhaseSend) != 0;
    const int total = sends ? p.num_tokens * p.num_topk : 0;
    const bool weights = p.topk_weights != nullptr;
    // Start-up loads in flight together: each thread's first top-k entry (and weight) and the
    // op sequence.
    const int64_t first_e = static_cast<int>(threadIdx.x) < total ? p.topk_idx[threadIdx.x] : -1;
    const float first_w =
        weights && static_cast<int>(threadIdx.x) < total ? p.topk_weights[threadIdx.x] : 0.0f;
    const uint32_t seq0 = threadIdx.x == 0 ? op_begin(ctl, kKindDispatch, p.phases) : 0u;
    if (sends) {
        for (int e = threadIdx.x; e < b.num_experts; e += kThreads) {
            s_count[e] = 0;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < total; i += kThreads) {
        // Entries outside [0, E) (the host twin rejects them) are treated as -1.
        const int64_t e = i == static_cast<int>(threadIdx.x) ? first_e : p.topk_idx[i];
        const bool valid = e >= 0 && e < b.num_experts;
        s_topk[i] = valid ? static_cast<int>(e) : -1;
        if (valid) {
            atomicAdd(s_count + e, 1);
        }
        if (weights) {
            s_wtab[i] = i == static_cast<int>(threadIdx.x) ? first_w : p.topk_weights[i];
        }
    }
    if (threadIdx.x == 0) {
        s_seq = seq0;
    }
    __syncthreads();
    const uint32_t seq = s_seq;
    const uint32_t set = seq & 1u;
    const uint32_t tag = tag_of(seq);
    if (p.phases & kPhaseSend) {
        dispatch_send(p, smem, s_topk, s_count, set, tag);
    }
    if (p.phases & kPhaseRecv) {
        __syncthreads();
        int* s_cnt = reinterpret_cast<int*>(smem);
        int* s_off = s_cnt + b.num_experts;
        int* s_pre = s_off + b.num_experts;
        dispatch_recv(p, s_cnt, s_off, s_pre, set, tag);
    }
    op_end(b, kKindDispatch, p.phases, seq);
}
