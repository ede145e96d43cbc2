// Low-latency (decode) dispatch and combine over NVLink peer pointers.
//
// Host twins: `src/low_latency/host.rs` (slots, packed receive layout, weighted combine) and
// `src/fp8/host.rs` (the 1x128 cast fused into the dispatch send). Launchers and the buffer
// layout (offsets passed in `LlBuffer`): `src/low_latency/cuda.rs`, `cuda/layout.rs`.
//
// Buffer of one rank (byte offsets in `LlBuffer`; the same layout on every rank):
//
//   control   u32 words [kCtlWords] (op sequence, launch arrival counters, hook FIFOs),
//             active_ranks i32 [R], send_done i32 [E] (local per-expert send counters)
//   set 0/1   signals  u64 [L][R]       dispatch counts: (tag << 32) | u32(-n - 1)
//             flags    i32 [E]          combine: tag once expert e's rows for us are written
//             msgs     [L][R][M] x msg_stride: {i32 src_token, i32 topk_pos, 0, 0 | payload
//                      (fp8 H bytes or bf16 2H bytes) | f32 scales [H/128] (fp8 only)}
//             rows     bf16 [M][max_topk][H] combine rows, one per (token, k) of the home rank
//
// Sequencing without the host: every op (dispatch or combine) that has a send phase takes the
// rank's device-side op counter `seq` (the same on every rank as long as every rank runs the
// same ops) and uses buffer set `seq & 1`; signals and flags carry `tag = seq + 1`, so a
// receiver never mistakes a value of an older op for the current one and nothing needs to be
// zeroed between ops. A send-only launch pushes its `seq` to a per-kind FIFO of depth 2; the
// matching receive-only launch pops it. The last block of each launch to arrive advances the
// counters, so each launch sees the values its predecessors on the stream left, which makes
// the kernels capturable in CUDA graphs and replayable.
//
// Buffer reuse: a peer reaches op N+2 (same set) only after finishing op N+1, whose receive
// phase waited for a signal or flag this rank sent after finishing op N (dispatch receivers
// wait for every source's count of every local expert, combine receivers for every expert's
// flag), so op N's data is consumed before op N+2 overwrites it.
//
// Failure handling: every wait polls `%globaltimer`; on timeout the waiter clears the peer's
// entry in `active_ranks`, treats its contribution as zero and carries on. Inactive ranks are
// neither waited for nor written to.
#include "common.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / ep::kWarpSize;
constexpr uint32_t kPhaseSend = 1u;
constexpr uint32_t kPhaseRecv = 2u;
// Largest top-k (Rust: `LL_MAX_TOPK`): rows per token in the combine region.
constexpr int kMaxTopk = 16;
// Vectors in flight per thread in the copy loops.
constexpr int kUnroll = 4;

// Control words (u32) at offset 0 of the buffer (Rust: `layout.rs`).
constexpr int kCtlOpSeq = 0;
constexpr int kCtlArrive = 1;    // [kind][recv_only]: 4 words
constexpr int kCtlPendTail = 5;  // [kind]
constexpr int kCtlPendHead = 7;  // [kind]
constexpr int kCtlPendSeq = 9;   // [kind][2]
constexpr int kCtlWords = 13;
constexpr int kKindDispatch = 0;
constexpr int kKindCombine = 1;

}  // namespace

// Where this rank's buffer lies and how it is laid out; mirrors `LlBuffer` in cuda.rs.
struct LlBuffer {
    uint8_t* local;          // this rank's buffer
    const uint64_t* peers;   // [num_ranks] every rank's buffer as this GPU addresses it
    uint64_t set_bytes;      // bytes of one buffer set
    uint64_t sets_offset;    // offset of set 0 (set 1 follows)
    uint64_t off_signals;    // in a set: dispatch count signals u64 [L][R]
    uint64_t off_flags;      // in a set: combine flags i32 [E]
    uint64_t off_msgs;       // in a set: dispatch messages [L][R][M] x msg_stride
    uint64_t off_rows;       // in a set: combine rows bf16 [M][max_topk][H]
    uint64_t off_active;     // in control: active_ranks i32 [R]
    uint64_t off_send_done;  // in control: send_done i32 [E]
    uint64_t timeout_ns;     // 0 = wait forever
    int32_t num_ranks;
    int32_t rank;
    int32_t num_experts;
    int32_t max_tokens;
    int32_t hidden;
    int32_t max_topk;
    int32_t msg_stride;
    int32_t reserved;
};
EP_CHECK_PARAMS_SIZE(LlBuffer, 120);

struct DispatchParams {
    LlBuffer buf;
    const __nv_bfloat16* x;     // [T, H]
    const int64_t* topk_idx;    // [T, K]
    uint8_t* recv_x;            // [L, R*M, H] fp8 bytes or bf16
    float* recv_scales;         // [L, R*M, H/128] (fp8 only)
    int32_t* recv_count;        // [L]
    int32_t* recv_src_info;     // [L, R*M] source token index
    int32_t* recv_src_topk;     // [L, R*M] top-k position at the source
    int32_t* recv_layout_range; // [L, R, 2] (offset, count)
    int32_t num_tokens;
    int32_t num_topk;
    uint32_t fp8;               // 0: bf16 payload, 1: fp8 e4m3 + f32 scales
    uint32_t scale_format;      // 0: amax / 448, 1: UE8M0
    uint32_t phases;            // kPhaseSend | kPhaseRecv
    uint32_t reserved;
};
EP_CHECK_PARAMS_SIZE(DispatchParams, 208);

struct CombineParams {
    LlBuffer buf;
    const __nv_bfloat16* x;          // [L, R*M, H] expert outputs in the dispatch order
    const int32_t* src_info;         // [L, R*M]
    const int32_t* src_topk;         // [L, R*M]
    const int32_t* layout_range;     // [L, R, 2]
    const int64_t* topk_idx;         // [T, K] of this (home) rank
    const float* topk_weights;       // [T, K]
    __nv_bfloat16* out;              // [T, H]
    int32_t num_tokens;
    int32_t num_topk;
    uint32_t phases;
    uint32_t reserved;
};
EP_CHECK_PARAMS_SIZE(CombineParams, 192);

struct CleanParams {
    LlBuffer buf;
    uint32_t reset_active;
    uint32_t reserved;
};
EP_CHECK_PARAMS_SIZE(CleanParams, 128);

struct SpinParams {
    uint64_t ns;
};
EP_CHECK_PARAMS_SIZE(SpinParams, 8);

namespace {

// ------------------------------------------------------------------------------------------
// Addresses and the per-peer write path
// ------------------------------------------------------------------------------------------

EP_DEVICE uint8_t* set_base(const LlBuffer& b, uint8_t* base, uint32_t set) {
    return base + b.sets_offset + static_cast<uint64_t>(set) * b.set_bytes;
}

// Rank `r`'s buffer as this GPU addresses it (a peer pointer over NVLink).
EP_DEVICE uint8_t* peer_base(const LlBuffer& b, int r) {
    return reinterpret_cast<uint8_t*>(b.peers[r]);
}

// Every byte written into a peer's buffer goes through `put_v4`, `put_signal` and `put_flag`.
// Over NVLink they are stores through the peer pointer; a remote-node transport (an NVSHMEM
// put per peer) replaces them for peers that load/store cannot reach.
EP_DEVICE void put_v4(uint8_t* dst, int4 v) { ep::st_no_alloc(reinterpret_cast<int4*>(dst), v); }

EP_DEVICE void put_signal(uint8_t* dst, uint64_t v) {
    ep::st_release_sys_u64(reinterpret_cast<uint64_t*>(dst), v);
}

EP_DEVICE void put_flag(uint8_t* dst, int v) { ep::st_release_sys(reinterpret_cast<int*>(dst), v); }

// A 16-byte load of data that peers wrote during this kernel: L2 (the coherence point for
// NVLink writes), never a possibly stale L1 line.
EP_DEVICE int4 ld_cg_v4(const uint8_t* ptr) {
    int4 v;
    asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr)
                 : "memory");
    return v;
}

EP_DEVICE float ld_cg_f32(const uint8_t* ptr) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(ptr) : "memory");
    return v;
}

EP_DEVICE int ld_vol(const int* ptr) { return ep::ld_volatile(ptr); }

EP_DEVICE uint32_t tag_of(uint32_t seq) { return (seq & 0x7fffffffu) + 1u; }

// ------------------------------------------------------------------------------------------
// Op sequencing (see the file comment)
// ------------------------------------------------------------------------------------------

// Returns this launch's op sequence number, the same in every block; the last block to
// arrive advances the control words for the next launch.
__device__ uint32_t op_begin(uint32_t* ctl, int kind, uint32_t phases) {
    __shared__ uint32_t s_seq;
    if (threadIdx.x == 0) {
        int* words = reinterpret_cast<int*>(ctl);
        const bool sends = (phases & kPhaseSend) != 0;
        uint32_t seq;
        if (sends) {
            seq = static_cast<uint32_t>(ld_vol(words + kCtlOpSeq));
        } else {
            const uint32_t head = static_cast<uint32_t>(ld_vol(words + kCtlPendHead + kind));
            seq = static_cast<uint32_t>(ld_vol(words + kCtlPendSeq + kind * 2 + (head & 1u)));
        }
        __threadfence();
        const int arrive = kCtlArrive + kind * 2 + (sends ? 0 : 1);
        const uint32_t old = atomicAdd(ctl + arrive, 1u);
        if (old == gridDim.x - 1) {
            __threadfence();
            ctl[arrive] = 0;
            if (sends) {
                ctl[kCtlOpSeq] = seq + 1u;
                if ((phases & kPhaseRecv) == 0) {
                    const uint32_t tail = ctl[kCtlPendTail + kind];
                    ctl[kCtlPendSeq + kind * 2 + (tail & 1u)] = seq;
                    ctl[kCtlPendTail + kind] = tail + 1u;
                }
            } else {
                ctl[kCtlPendHead + kind] += 1u;
            }
            __threadfence();
        }
        s_seq = seq;
    }
    __syncthreads();
    return s_seq;
}

// Waits until `*sig` carries `tag`; returns the count it signals, or 0 if the source is (or
// becomes) inactive or the deadline passes (then the source is marked inactive).
EP_DEVICE int wait_count(const uint64_t* sig, uint32_t tag, int* active_src, uint64_t timeout_ns) {
    if (ld_vol(active_src) == 0) {
        return 0;
    }
    const ep::Deadline deadline = ep::Deadline::after(timeout_ns);
    for (;;) {
        const uint64_t v = ep::ld_acquire_sys_u64(sig);
        if (static_cast<uint32_t>(v >> 32) == tag) {
            return -static_cast<int>(static_cast<uint32_t>(v)) - 1;
        }
        if (ld_vol(active_src) == 0) {
            return 0;
        }
        if (deadline.expired()) {
            atomicExch(active_src, 0);
            return 0;
        }
    }
}

// Waits until `*flag == tag`, unless the expert's rank is (or becomes) inactive; on timeout
// marks it inactive.
EP_DEVICE void wait_flag(const int* flag, uint32_t tag, int* active_src, uint64_t timeout_ns) {
    if (ld_vol(active_src) == 0) {
        return;
    }
    const ep::Deadline deadline = ep::Deadline::after(timeout_ns);
    while (static_cast<uint32_t>(ep::ld_acquire_sys(flag)) != tag) {
        if (ld_vol(active_src) == 0) {
            return;
        }
        if (deadline.expired()) {
            atomicExch(active_src, 0);
            return;
        }
    }
}

// Dynamic shared memory of the dispatch kernel (Rust: `dispatch_smem_bytes`):
// [stage: msg_stride][dst pointers: kMaxTopk x 8][counts, offsets: 2 (R + 1) i32, 16-aligned]
// [topk: T*K i32].
EP_DEVICE int align16(int v) { return (v + 15) & ~15; }

// bf16 pair (low half first) to two floats.
EP_DEVICE void unpack_bf16x2(uint32_t w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}

EP_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
    const __nv_bfloat162 v = __halves2bfloat162(ep::f32_to_bf16(lo), ep::f32_to_bf16(hi));
    return *reinterpret_cast<const uint32_t*>(&v);
}

// ------------------------------------------------------------------------------------------
// Dispatch
// ------------------------------------------------------------------------------------------

__device__ void dispatch_send(const DispatchParams& p, uint8_t* smem, int* s_topk, uint32_t set,
                              uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int T = p.num_tokens, K = p.num_topk, H = b.hidden, R = b.num_ranks;
    const int E = b.num_experts, L = E / R, M = b.max_tokens;
    const int tid = threadIdx.x, lane = ep::lane_id(), warp = ep::warp_id();
    int* active = reinterpret_cast<int*>(b.local + b.off_active);
    int* send_done = reinterpret_cast<int*>(b.local + b.off_send_done);
    uint8_t* stage = smem;
    uint8_t** s_dst = reinterpret_cast<uint8_t**>(smem + b.msg_stride);

    const int groups = H / ep::kFp8Group;
    const int payload = p.fp8 ? H : 2 * H;
    const int msg_bytes = 16 + payload + (p.fp8 ? groups * 4 : 0);
    const int msg_vecs = ep::ceil_div(msg_bytes, 16);
    // Deterministic padding after the scales.
    for (int i = msg_bytes + tid; i < msg_vecs * 16; i += kThreads) {
        stage[i] = 0;
    }

    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        // Destination of each (t, k): the slot is the number of earlier (token, k) entries of
        // this rank routed to the same expert (the host twin `send_slots`).
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
            if (lane == 0) {
                uint8_t* dst = nullptr;
                if (e >= 0) {
                    const int r = e / L;
                    if (ld_vol(active + r) != 0) {
                        const int l = e - r * L;
                        const uint64_t msg = (static_cast<uint64_t>(l) * R + b.rank) * M + slot;
                        dst = set_base(b, peer_base(b, r), set) + b.off_msgs +
                              msg * static_cast<uint64_t>(b.msg_stride);
                    }
                }
                s_dst[k] = dst;
            }
        }

        // Stage the message body (payload and scales) in shared memory.
        const __nv_bfloat16* xrow = p.x + static_cast<int64_t>(t) * H;
        if (p.fp8) {
            // 8 lanes x 16 channels per 128-channel group; 4 groups per warp step.
            const int sub = lane & 7;
            for (int g0 = warp * 4; g0 < groups; g0 += kWarps * 4) {
                const int g = g0 + (lane >> 3);
                float v[16];
                float amax = 0.0f;
                if (g < groups) {
                    const int4* src = reinterpret_cast<const int4*>(xrow + g * ep::kFp8Group + sub * 16);
                    const int4 a = ep::ld_nc_no_alloc(src);
                    const int4 c = ep::ld_nc_no_alloc(src + 1);
                    const uint32_t w[8] = {static_cast<uint32_t>(a.x), static_cast<uint32_t>(a.y),
                                           static_cast<uint32_t>(a.z), static_cast<uint32_t>(a.w),
                                           static_cast<uint32_t>(c.x), static_cast<uint32_t>(c.y),
                                           static_cast<uint32_t>(c.z), static_cast<uint32_t>(c.w)};
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        unpack_bf16x2(w[i], v[2 * i], v[2 * i + 1]);
                    }
#pragma unroll
                    for (int i = 0; i < 16; ++i) {
                        amax = fmaxf(amax, fabsf(v[i]));
                    }
                }
                amax = fmaxf(amax, __shfl_xor_sync(ep::kFullMask, amax, 1));
                amax = fmaxf(amax, __shfl_xor_sync(ep::kFullMask, amax, 2));
                amax = fmaxf(amax, __shfl_xor_sync(ep::kFullMask, amax, 4));
                if (g < groups) {
                    float scale = __fdiv_rn(fmaxf(amax, ep::kAmaxMin), ep::kE4m3Max);
                    if (p.scale_format == 1) {
                        scale = ep::round_scale_ue8m0(scale);
                    }
                    uint32_t q[4] = {0, 0, 0, 0};
#pragma unroll
                    for (int i = 0; i < 16; ++i) {
                        q[i / 4] |= static_cast<uint32_t>(ep::f32_to_e4m3(__fdiv_rn(v[i], scale)))
                                    << (8 * (i % 4));
                    }
                    *reinterpret_cast<int4*>(stage + 16 + g * ep::kFp8Group + sub * 16) =
                        make_int4(static_cast<int>(q[0]), static_cast<int>(q[1]),
                                  static_cast<int>(q[2]), static_cast<int>(q[3]));
                    if (sub == 0) {
                        *reinterpret_cast<float*>(stage + 16 + H + g * 4) = scale;
                    }
                }
            }
        } else {
            const int4* src = reinterpret_cast<const int4*>(xrow);
            for (int i = tid; i < H / 8; i += kThreads) {
                *reinterpret_cast<int4*>(stage + 16 + i * 16) = ep::ld_nc_no_alloc(src + i);
            }
        }
        __syncthreads();

        // Send: K copies of the message, 16 bytes per thread per step; vector 0 is the header.
        const int jobs = K * msg_vecs;
        for (int j = tid; j < jobs; j += kThreads) {
            const int k = j / msg_vecs;
            const int i = j - k * msg_vecs;
            uint8_t* dst = s_dst[k];
            if (dst != nullptr) {
                const int4 v = i == 0 ? make_int4(t, k, 0, 0)
                                      : *reinterpret_cast<const int4*>(stage + i * 16);
                put_v4(dst + i * 16, v);
            }
        }
        __syncthreads();
        // Publish: every (t, k) counts once for its expert (also when the rank is inactive,
        // so the counters always balance).
        if (tid < K) {
            const int e = s_topk[t * K + tid];
            if (e >= 0) {
                ep::atomic_add_release_sys(send_done + e, 1);
            }
        }
    }

    // Count signals: one warp per expert, spread over the blocks.
    const int total = T * K;
    for (int e = warp * gridDim.x + blockIdx.x; e < E; e += gridDim.x * kWarps) {
        int n = 0;
        for (int j = lane; j < total; j += ep::kWarpSize) {
            n += s_topk[j] == e ? 1 : 0;
        }
        n = ep::warp_reduce_sum(n);
        if (lane == 0) {
            // Local wait for the blocks sending this expert's messages (all blocks are
            // resident: the grid is at most one block per SM).
            const ep::Deadline deadline = ep::Deadline::after(b.timeout_ns);
            while (ep::ld_acquire_gpu(send_done + e) < n && !deadline.expired()) {
            }
            atomicSub(send_done + e, n);
            const int r = e / L;
            if (ld_vol(active + r) != 0) {
                uint8_t* sig = set_base(b, peer_base(b, r), set) + b.off_signals +
                               (static_cast<uint64_t>(e - r * L) * R + b.rank) * 8;
                put_signal(sig, (static_cast<uint64_t>(tag) << 32) |
                                    static_cast<uint64_t>(static_cast<uint32_t>(-n - 1)));
            }
        }
    }
}

__device__ void dispatch_recv(const DispatchParams& p, int* s_count, int* s_off, uint32_t set,
                              uint32_t tag) {
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

    for (int l = blockIdx.x; l < L; l += gridDim.x) {
        for (int s = tid; s < R; s += kThreads) {
            s_count[s] = wait_count(sigs + static_cast<int64_t>(l) * R + s, tag, active + s,
                                    b.timeout_ns);
        }
        __syncthreads();
        if (tid == 0) {
            int acc = 0;
            for (int s = 0; s < R; ++s) {
                s_off[s] = acc;
                acc += s_count[s];
            }
            s_off[R] = acc;
            p.recv_count[l] = acc;
        }
        __syncthreads();
        for (int s = tid; s < R; s += kThreads) {
            p.recv_layout_range[(static_cast<int64_t>(l) * R + s) * 2] = s_off[s];
            p.recv_layout_range[(static_cast<int64_t>(l) * R + s) * 2 + 1] = s_count[s];
        }
        const int total = s_off[R];
        // One warp per packed row.
        for (int row = warp; row < total; row += kWarps) {
            int s = 0;
            while (s_off[s + 1] <= row) {
                ++s;
            }
            const int slot = row - s_off[s];
            const uint8_t* msg = my_set + b.off_msgs +
                                 ((static_cast<uint64_t>(l) * R + s) * M + slot) *
                                     static_cast<uint64_t>(b.msg_stride);
            const int64_t out_row = l * rows_per_expert + row;
            if (lane == 0) {
                const int4 h = ld_cg_v4(msg);
                p.recv_src_info[out_row] = h.x;
                p.recv_src_topk[out_row] = h.y;
            }
            uint8_t* dst = p.recv_x + out_row * payload;
            for (int i0 = lane; i0 < payload_vecs; i0 += ep::kWarpSize * kUnroll) {
                int4 v[kUnroll];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int i = i0 + u * ep::kWarpSize;
                    if (i < payload_vecs) {
                        v[u] = ld_cg_v4(msg + 16 + i * 16);
                    }
                }
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int i = i0 + u * ep::kWarpSize;
                    if (i < payload_vecs) {
                        *reinterpret_cast<int4*>(dst + i * 16) = v[u];
                    }
                }
            }
            if (p.fp8) {
                float* scales = p.recv_scales + out_row * groups;
                for (int g = lane; g < groups; g += ep::kWarpSize) {
                    scales[g] = ld_cg_f32(msg + 16 + H + g * 4);
                }
            }
        }
        __syncthreads();
    }
}

// ------------------------------------------------------------------------------------------
// Combine
// ------------------------------------------------------------------------------------------

__device__ void combine_send(const CombineParams& p, uint32_t set, uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int H = b.hidden, R = b.num_ranks, E = b.num_experts, L = E / R, M = b.max_tokens;
    const int tid = threadIdx.x;
    int* active = reinterpret_cast<int*>(b.local + b.off_active);
    const int vpr = H / 8;  // 16-byte vectors per bf16 row
    const int64_t row_bytes = 2 * static_cast<int64_t>(H);

    // One block per (local expert, home rank) unit; units of the same expert go to different
    // homes, so consecutive blocks write to different peers.
    for (int u = blockIdx.x; u < L * R; u += gridDim.x) {
        const int l = u / R;
        const int s = u - l * R;
        const int off = p.layout_range[(static_cast<int64_t>(l) * R + s) * 2];
        const int cnt = p.layout_range[(static_cast<int64_t>(l) * R + s) * 2 + 1];
        const bool home_active = ld_vol(active + s) != 0;
        uint8_t* home_set = home_active ? set_base(b, peer_base(b, s), set) : nullptr;
        if (home_active && cnt > 0) {
            uint8_t* rows = home_set + b.off_rows;
            const int64_t base_row = static_cast<int64_t>(l) * R * M + off;
            const int n = cnt * vpr;
            for (int j0 = tid; j0 < n; j0 += kThreads * kUnroll) {
                int4 v[kUnroll];
                uint8_t* d[kUnroll];
#pragma unroll
                for (int q = 0; q < kUnroll; ++q) {
                    const int j = j0 + q * kThreads;
                    d[q] = nullptr;
                    if (j < n) {
                        const int r = j / vpr;
                        const int i = j - r * vpr;
                        const int64_t src_row = base_row + r;
                        const int t = p.src_info[src_row];
                        const int k = p.src_topk[src_row];
                        if (t >= 0 && t < M && k >= 0 && k < b.max_topk) {
                            v[q] = ep::ld_nc_no_alloc(
                                reinterpret_cast<const int4*>(p.x + src_row * H) + i);
                            d[q] = rows + (static_cast<int64_t>(t) * b.max_topk + k) * row_bytes +
                                   static_cast<int64_t>(i) * 16;
                        }
                    }
                }
#pragma unroll
                for (int q = 0; q < kUnroll; ++q) {
                    if (d[q] != nullptr) {
                        put_v4(d[q], v[q]);
                    }
                }
            }
        }
        __syncthreads();
        if (tid == 0 && home_active) {
            ep::fence_acq_rel_sys();
            put_flag(home_set + b.off_flags + static_cast<int64_t>(b.rank * L + l) * 4,
                     static_cast<int>(tag));
        }
    }
}

__device__ void combine_recv(const CombineParams& p, uint8_t* smem, uint32_t set, uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int T = p.num_tokens, K = p.num_topk, H = b.hidden, R = b.num_ranks;
    const int E = b.num_experts, L = E / R;
    const int tid = threadIdx.x;
    int* active = reinterpret_cast<int*>(b.local + b.off_active);
    uint8_t* my_set = set_base(b, b.local, set);
    const int* flags = reinterpret_cast<const int*>(my_set + b.off_flags);
    float* s_w = reinterpret_cast<float*>(smem);
    int* s_valid = reinterpret_cast<int*>(smem + kMaxTopk * 4);
    int* s_active = reinterpret_cast<int*>(smem + kMaxTopk * 8);

    // Every expert of every active rank flags every home, also with zero rows: waiting for
    // all of them is what makes reusing the buffer set two ops later safe.
    for (int e = tid; e < E; e += kThreads) {
        wait_flag(flags + e, tag, active + e / L, b.timeout_ns);
    }
    __syncthreads();
    // One snapshot of the mask for the whole block.
    for (int r = tid; r < R; r += kThreads) {
        s_active[r] = ld_vol(active + r);
    }
    __syncthreads();

    const int vpr = H / 8;
    const int64_t row_bytes = 2 * static_cast<int64_t>(H);
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        if (tid < K) {
            const int64_t e = p.topk_idx[static_cast<int64_t>(t) * K + tid];
            const bool valid = e >= 0 && e < E && s_active[static_cast<int>(e) / L] != 0;
            s_valid[tid] = valid ? 1 : 0;
            s_w[tid] = valid ? p.topk_weights[static_cast<int64_t>(t) * K + tid] : 0.0f;
        }
        __syncthreads();
        const uint8_t* rows = my_set + b.off_rows + static_cast<int64_t>(t) * b.max_topk * row_bytes;
        for (int i = tid; i < vpr; i += kThreads) {
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                acc[j] = 0.0f;
            }
            // In k order, as the host twin; loads batched for memory parallelism.
            for (int k0 = 0; k0 < K; k0 += 4) {
                int4 v[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int k = k0 + q;
                    if (k < K && s_valid[k] != 0) {
                        v[q] = ld_cg_v4(rows + k * row_bytes + static_cast<int64_t>(i) * 16);
                    }
                }
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int k = k0 + q;
                    if (k < K && s_valid[k] != 0) {
                        const float w = s_w[k];
                        const uint32_t words[4] = {
                            static_cast<uint32_t>(v[q].x), static_cast<uint32_t>(v[q].y),
                            static_cast<uint32_t>(v[q].z), static_cast<uint32_t>(v[q].w)};
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            float lo, hi;
                            unpack_bf16x2(words[c], lo, hi);
                            // Separate multiply and add (no FMA), as the host twin.
                            acc[2 * c] = __fadd_rn(acc[2 * c], __fmul_rn(w, lo));
                            acc[2 * c + 1] = __fadd_rn(acc[2 * c + 1], __fmul_rn(w, hi));
                        }
                    }
                }
            }
            const int4 o = make_int4(static_cast<int>(pack_bf16x2(acc[0], acc[1])),
                                     static_cast<int>(pack_bf16x2(acc[2], acc[3])),
                                     static_cast<int>(pack_bf16x2(acc[4], acc[5])),
                                     static_cast<int>(pack_bf16x2(acc[6], acc[7])));
            *reinterpret_cast<int4*>(p.out + static_cast<int64_t>(t) * H + i * 8) = o;
        }
        __syncthreads();
    }
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------

// Grid: at most one block per SM (blocks wait for each other's sends). Dynamic shared memory:
// msg_stride + kMaxTopk * 8 + align16(8 * (R + 1)) + align16(4 * T * K) bytes.
EP_KERNEL void __launch_bounds__(kThreads, 1) ll_dispatch(const __grid_constant__ DispatchParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    const LlBuffer& b = p.buf;
    const uint32_t seq = op_begin(reinterpret_cast<uint32_t*>(b.local), kKindDispatch, p.phases);
    const uint32_t set = seq & 1u;
    const uint32_t tag = tag_of(seq);
    const int counts_at = b.msg_stride + kMaxTopk * 8;
    int* s_count = reinterpret_cast<int*>(smem + counts_at);
    int* s_off = s_count + (b.num_ranks + 1);
    int* s_topk = reinterpret_cast<int*>(smem + counts_at + align16(8 * (b.num_ranks + 1)));
    if (p.phases & kPhaseSend) {
        const int total = p.num_tokens * p.num_topk;
        for (int i = threadIdx.x; i < total; i += kThreads) {
            // Entries outside [0, E) (the host twin rejects them) are treated as -1.
            const int64_t e = p.topk_idx[i];
            s_topk[i] = e >= 0 && e < b.num_experts ? static_cast<int>(e) : -1;
        }
        __syncthreads();
        dispatch_send(p, smem, s_topk, set, tag);
    }
    if (p.phases & kPhaseRecv) {
        __syncthreads();
        dispatch_recv(p, s_count, s_off, set, tag);
    }
}

// Grid: at most one block per SM. Dynamic shared memory: kMaxTopk * 8 + 4 * R bytes.
EP_KERNEL void __launch_bounds__(kThreads, 1) ll_combine(const __grid_constant__ CombineParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    const LlBuffer& b = p.buf;
    const uint32_t seq = op_begin(reinterpret_cast<uint32_t*>(b.local), kKindCombine, p.phases);
    const uint32_t set = seq & 1u;
    const uint32_t tag = tag_of(seq);
    if (p.phases & kPhaseSend) {
        combine_send(p, set, tag);
    }
    if (p.phases & kPhaseRecv) {
        __syncthreads();
        combine_recv(p, smem, set, tag);
    }
}

// Zeroes the control words, the send counters, and the signals and flags of both sets;
// optionally marks every rank active. One block.
EP_KERNEL void __launch_bounds__(kThreads) ll_clean(const __grid_constant__ CleanParams p) {
    const LlBuffer& b = p.buf;
    const int tid = threadIdx.x;
    const int R = b.num_ranks, E = b.num_experts, L = E / R;
    uint32_t* ctl = reinterpret_cast<uint32_t*>(b.local);
    for (int i = tid; i < kCtlWords; i += blockDim.x) {
        ctl[i] = 0;
    }
    int* send_done = reinterpret_cast<int*>(b.local + b.off_send_done);
    for (int e = tid; e < E; e += blockDim.x) {
        send_done[e] = 0;
    }
    for (uint32_t set = 0; set < 2; ++set) {
        uint8_t* base = set_base(b, b.local, set);
        uint64_t* sigs = reinterpret_cast<uint64_t*>(base + b.off_signals);
        for (int i = tid; i < L * R; i += blockDim.x) {
            sigs[i] = 0;
        }
        int* flags = reinterpret_cast<int*>(base + b.off_flags);
        for (int e = tid; e < E; e += blockDim.x) {
            flags[e] = 0;
        }
    }
    if (p.reset_active) {
        int* active = reinterpret_cast<int*>(b.local + b.off_active);
        for (int r = tid; r < R; r += blockDim.x) {
            active[r] = 1;
        }
    }
}

// Keeps the stream busy for `ns` nanoseconds (benchmarks: lets data arrive between the send
// and the receive phase, as a GEMM would). One thread.
EP_KERNEL void ll_spin(const __grid_constant__ SpinParams p) {
    const uint64_t end = ep::globaltimer_ns() + p.ns;
    while (ep::globaltimer_ns() < end) {
        __nanosleep(1000);
    }
}
