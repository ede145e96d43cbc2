// Low-latency (decode) dispatch and combine over NVLink peer pointers.
//
// Dispatch sends each token once per destination rank (however many of its experts live
// there) plus a 4-byte index entry per (token, k) in the expert's slot; the receiver follows
// the entries when it packs. Combine sends one bf16 row per (token, k) back to the home rank,
// or, per rank (`CombineParams::reduce`), one row per (token, rank): the expert rank sums the
// weighted outputs of its experts that the token chose, in f32, and the home adds the ranks'
// rows. For that the dispatch carries the top-k weights (`DispatchParams::topk_weights`): each
// token's message says in its header which of its selections the rank holds (a mask of k) and
// the rank's place j among the token's ranks, and carries the weights after its body; the
// receive phase copies header and weights into the handle's records (`recv_rank_records`: the
// header turned into j or -1), a few vectors per record on the blocks the row copy leaves idle,
// and the row copy writes the packed row of each (source, token, k) it places into its record;
// the per-rank combine's send phase reads them there. (Building the same tables with a block per
// source that copied no rows cost the dispatch about 1.3 us more at EP4; records in a region of
// their own instead of in the message about 0.3 us more.)
//
// Host twins: `src/low_latency/host.rs` (slots, packed receive layout, weighted combine) and
// `src/fp8/host.rs` (the 1x128 cast fused into the dispatch send). Launchers and the buffer
// layout (offsets passed in `LlBuffer`): `src/low_latency/cuda.rs`, `cuda/layout.rs`.
//
// Buffer of one rank (byte offsets in `LlBuffer`; the same layout on every rank):
//
//   control   u32 words [kCtlWords] (op sequence, launch arrival counters, hook FIFOs),
//             active_ranks i32 [R], send_done i32 [E] (local per-expert send counters),
//             unit_done i32 [L*R] (local per-(expert, home) combine chunk counters)
//   set 0/1   signals  u64 [L][R]       dispatch counts: (tag << 32) | u32(-n - 1)
//             flags    i32 [E]          combine: tag once expert e's rows for us are written
//             msgs     [R][M] x msg_stride, one per (source, token), sent once per destination
//                      rank however many of the token's experts live there:
//                      {i32 src_token, i32 j, u32 mask, u32 tag | payload (fp8 H bytes or
//                      bf16 2H bytes) | f32 scales [H/128] (fp8 only) | padding to 16 bytes |
//                      f32 w[K] (with the weights)}; without the weights the header is
//                      {src_token, 0, 0, 0}; with them j is the rank's place among the
//                      token's distinct ranks in k order, mask has bit k where expert k is on
//                      the rank and its index entry was written, tag the op's
//             idx      i32 [L][R][M]: slot -> src_token | topk_pos << 24
//             rows     bf16 [M][max_topk][H] combine rows, one per (token, k) of the home rank
//                      (per rank: one per (token, j), j = the expert rank's place among the
//                      token's distinct ranks in k order)
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
// The last block of a launch with a receive phase copies `active_ranks` into the host-mapped
// `active_mirror`, where the host reads it after the op (no copy on the stream).
#include "common.cuh"
#include "low_latency.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / ep::kWarpSize;
constexpr uint32_t kPhaseSend = 1u;
constexpr uint32_t kPhaseRecv = 2u;
// Largest top-k (Rust: `LL_MAX_TOPK`): rows per token in the combine region.
constexpr int kMaxTopk = 16;
// 4-byte words of one record in the handle (Rust: `LL_RECORD_WORDS`): word 0 the token's row j
// at its home (-1: the source sent no selection of the token here, or it was inactive), word 1
// the mask of its k held here; from word 4 the packed row here of each k in the mask (the
// others unspecified), from word 4 + kMaxTopk the weights (f32 bits).
constexpr int kRecordWords = 4 + 2 * kMaxTopk;
// 16-byte vectors per lane of one per-rank combine item (a chunk of 32 x n vectors of each of
// the token's rows on this rank), and rows loaded per batch: 2 x 8 f32 accumulators and
// 2 x 2 vectors in flight fit the 64 registers of a 1024-thread block (4 rows at a time, or
// 1 vector of 4 or 8 rows, spilled 76-124 bytes).
constexpr int kRankVecs = 2;
constexpr int kRankBatch = 2;
// 16-byte vectors per lane of one copy work item (a chunk of 32 x n vectors), measured at EP2
// and EP4 (`docs/benchmarks.md`): the combine send keeps 8 (4 or 2: +2 to +6 us, fewer bytes
// in flight per warp); the dispatch receive copies 4 (8 left half the warps without work:
// about 1 us slower; 2 is no better).
constexpr int kSendUnroll = 8;
constexpr int kRecvUnroll = 4;

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
    uint64_t off_msgs;       // in a set: dispatch token messages [R][M] x msg_stride
    uint64_t off_idx;        // in a set: dispatch slot index i32 [L][R][M]: t | k << 24
    uint64_t off_rows;       // in a set: combine rows bf16 [M][max_topk][H]
    uint64_t off_active;     // in control: active_ranks i32 [R]
    uint64_t off_send_done;  // in control: send_done i32 [E]
    uint64_t reserved_u64;   // unused
    uint64_t timeout_ns;     // 0 = wait forever
    int32_t num_ranks;
    int32_t rank;
    int32_t num_experts;
    int32_t max_tokens;
    int32_t hidden;
    int32_t max_topk;
    int32_t msg_stride;
    int32_t reserved;
    int32_t* active_mirror;  // [num_ranks] host-mapped: the mask as a receive phase left it
};
EP_CHECK_PARAMS_SIZE(LlBuffer, 144);

struct DispatchParams {
    LlBuffer buf;
    const __nv_bfloat16* x;     // [T, H]
    const int64_t* topk_idx;    // [T, K]
    uint8_t* recv_x;            // [L, R*M, H] fp8 bytes or bf16
    float* recv_scales;         // [L, R*M, H/128] (fp8 only)
    int32_t* recv_count;        // [L]
    int32_t* recv_src_info;     // [L, R*M] source token index, -1 past recv_count
    int32_t* recv_src_topk;     // [L, R*M] top-k position at the source
    int32_t* recv_layout_range; // [L, R, 2] (offset, count)
    const float* topk_weights;  // [T, K], or null: no per-rank records are sent
    int32_t* recv_rank_records; // [R, M, kRecordWords] the records, with their weights; or null
    int32_t num_tokens;
    int32_t num_topk;
    uint32_t fp8;               // 0: bf16 payload, 1: fp8 e4m3 + f32 scales
    uint32_t scale_format;      // 0: amax / 448, 1: UE8M0
    uint32_t phases;            // kPhaseSend | kPhaseRecv
    uint32_t reserved;
};
EP_CHECK_PARAMS_SIZE(DispatchParams, 248);

struct CombineParams {
    LlBuffer buf;
    const __nv_bfloat16* x;          // [L, R*M, H] expert outputs in the dispatch order
    const int32_t* src_info;         // [L, R*M]
    const int32_t* src_topk;         // [L, R*M]
    const int32_t* layout_range;     // [L, R, 2]
    const int64_t* topk_idx;         // [T, K] of this (home) rank
    const float* topk_weights;       // [T, K]
    __nv_bfloat16* out;              // [T, H]
    const int32_t* rank_records;     // per rank: the dispatch's recv_rank_records
    int32_t num_tokens;
    int32_t num_topk;
    uint32_t phases;
    uint32_t reduce;                 // 0: per expert (DeepEP), 1: per rank
};
EP_CHECK_PARAMS_SIZE(CombineParams, 224);

struct CleanParams {
    LlBuffer buf;
    uint32_t reset_active;
    uint32_t reserved;
};
EP_CHECK_PARAMS_SIZE(CleanParams, 152);

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

// The caller fences (`fence.acq_rel.sys`) after the data and before its signals and flags.
EP_DEVICE void put_signal(uint8_t* dst, uint64_t v) {
    ep::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(dst), v);
}

EP_DEVICE void put_flag(uint8_t* dst, int v) { ep::st_relaxed_sys(reinterpret_cast<int*>(dst), v); }

EP_DEVICE int ld_vol(const int* ptr) { return ep::ld_volatile(ptr); }

EP_DEVICE uint32_t tag_of(uint32_t seq) { return (seq & 0x7fffffffu) + 1u; }

// ------------------------------------------------------------------------------------------
// Op sequencing (see the file comment)
// ------------------------------------------------------------------------------------------

// This launch's op sequence number (the same in every block); called by one thread, which
// shares it through shared memory. The caller issues its other start-up loads before it uses
// the value, so their latencies overlap.
__device__ uint32_t op_begin(const uint32_t* ctl, int kind, uint32_t phases) {
    const int* words = reinterpret_cast<const int*>(ctl);
    if ((phases & kPhaseSend) != 0) {
        return static_cast<uint32_t>(ld_vol(words + kCtlOpSeq));
    }
    const uint32_t head = static_cast<uint32_t>(ld_vol(words + kCtlPendHead + kind));
    return static_cast<uint32_t>(ld_vol(words + kCtlPendSeq + kind * 2 + (head & 1u)));
}

// Called by every block at its end: the last block to arrive (so after every block read the
// control words in `op_begin`, and after every wait of this launch) advances them for the next
// launch on the stream. A launch with a receive phase also leaves the active-ranks mask in the
// host-mapped mirror (the host reads it once an event after the launch has completed, which
// makes the stores visible), so no copy after the kernel is needed.
__device__ void op_end(const LlBuffer& b, int kind, uint32_t phases, uint32_t seq) {
    uint32_t* ctl = reinterpret_cast<uint32_t*>(b.local);
    if (threadIdx.x == 0) {
        const bool sends = (phases & kPhaseSend) != 0;
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
            if ((phases & kPhaseRecv) != 0 && b.active_mirror != nullptr) {
                const int* active = reinterpret_cast<const int*>(b.local + b.off_active);
                for (int r = 0; r < b.num_ranks; ++r) {
                    b.active_mirror[r] = ld_vol(active + r);
                }
            }
            __threadfence();
        }
    }
}

// Waits until `*sig` carries `tag`; returns the count it signals, or 0 if the source is (or
// becomes) inactive or the deadline passes (then the source is marked inactive).
EP_DEVICE int wait_count(const uint64_t* sig, uint32_t tag, int* active_src, uint64_t timeout_ns) {
    const ep::Deadline deadline = ep::Deadline::after(timeout_ns);
    for (;;) {
        const uint64_t v = ep::ld_acquire_sys_u64(sig);
        if (static_cast<uint32_t>(v >> 32) == tag && ld_vol(active_src) != 0) {
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


// In place: s_pre[1..=n] holds n values; on return s_pre[i] is the sum of the first i of them
// (s_pre[0] = 0). Every thread of the block calls it, after a barrier that made the values
// visible; the caller's next barrier makes the result visible. One warp scan per 1024 values
// and one over the warps' totals, instead of a single warp walking all n.
__device__ void block_prefix_sum(int* s_pre, int n) {
    static_assert(kWarps == ep::kWarpSize, "one warp scans the warps' totals");
    __shared__ int s_tot[kWarps];
    const int tid = threadIdx.x, lane = ep::lane_id(), warp = ep::warp_id();
    int carry = 0;
    for (int base = 0; base < n; base += kThreads) {
        const int i = base + tid;
        int v = i < n ? s_pre[i + 1] : 0;
#pragma unroll
        for (int d = 1; d < ep::kWarpSize; d <<= 1) {
            const int o = __shfl_up_sync(ep::kFullMask, v, d);
            v += lane >= d ? o : 0;
        }
        if (lane == ep::kWarpSize - 1) {
            s_tot[warp] = v;
        }
        __syncthreads();
        if (warp == 0) {
            int w = s_tot[lane];
#pragma unroll
            for (int d = 1; d < ep::kWarpSize; d <<= 1) {
                const int o = __shfl_up_sync(ep::kFullMask, w, d);
                w += lane >= d ? o : 0;
            }
            s_tot[lane] = w;
        }
        __syncthreads();
        if (i < n) {
            s_pre[i + 1] = v + carry + (warp > 0 ? s_tot[warp - 1] : 0);
        }
        carry += s_tot[kWarps - 1];
        __syncthreads();  // s_tot is rewritten by the next tile
    }
    if (tid == 0) {
        s_pre[0] = 0;
    }
}

// ------------------------------------------------------------------------------------------
// Dispatch
// ------------------------------------------------------------------------------------------

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
            uint8_t* sig = set_base(b, peer_base(b, r), set) + b.off_signals +
                           (static_cast<uint64_t>(e - r * L) * R + b.rank) * 8;
            put_signal(sig, (static_cast<uint64_t>(tag) << 32) |
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
                if (e >= 0) {
                    const int r = e / L;
                    // slot < M holds when a token's experts are distinct (checked for memory
                    // safety only).
                    if (ld_vol(active + r) != 0 && slot < M) {
                        const int l = e - r * L;
                        uint8_t* peer_set = set_base(b, peer_base(b, r), set);
                        int* entry = reinterpret_cast<int*>(peer_set + b.off_idx) +
                                     (static_cast<int64_t>(l) * R + b.rank) * M + slot;
                        *entry = t | (k << 24);
                        bool first = true;
                        for (int k2 = 0; k2 < k; ++k2) {
                            const int e2 = s_topk[t * K + k2];
                            first = first && !(e2 >= 0 && e2 / L == r);
                        }
                        if (first) {
                            dst = peer_set + b.off_msgs +
                                  (static_cast<uint64_t>(b.rank) * M + t) *
                                      static_cast<uint64_t>(b.msg_stride);
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
        int lo = 0, hi = L - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_pre[mid] <= j) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        const int l = lo;
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

// ------------------------------------------------------------------------------------------
// Combine
// ------------------------------------------------------------------------------------------

// Shared memory of the combine send phase: [E] chunks per unit, prefix [E + 1], row offset per
// unit [E], mask snapshot [R].
struct CombineSendSmem {
    int* items;
    int* pre;
    int* off;
    int* active;
    __device__ explicit CombineSendSmem(uint8_t* smem, int E)
        : items(reinterpret_cast<int*>(smem)), pre(items + E), off(pre + E + 1), active(off + E) {}
};

// The combine send phase's first loads, into shared memory (no barrier: the caller's next one
// makes them visible): the units' ranges and the mask.
__device__ void combine_stage(const CombineParams& p, uint8_t* smem) {
    const LlBuffer& b = p.buf;
    const int H = b.hidden, R = b.num_ranks, E = b.num_experts;
    const int tid = threadIdx.x;
    const int* active = reinterpret_cast<const int*>(b.local + b.off_active);
    const int chunks = ep::ceil_div(H / 8, ep::kWarpSize * kSendUnroll);
    const CombineSendSmem sm(smem, E);
    // Units are numbered u = l * R + s, as layout_range.
    for (int u = tid; u < E; u += kThreads) {
        const int2 range = *reinterpret_cast<const int2*>(p.layout_range + static_cast<int64_t>(u) * 2);
        sm.off[u] = range.x;
        sm.items[u] = range.y * chunks;
        sm.pre[u + 1] = range.y * chunks;
    }
    for (int r = tid; r < R; r += kThreads) {
        sm.active[r] = ld_vol(active + r);
    }
}

// Rows of all units (local expert l, home rank s) are spread over the whole grid in chunks of
// 32 lanes x kSendUnroll vectors. The units' row offsets and the mask are staged in shared
// memory first, so a chunk's loads (the rows and their source token and top-k slot) go out
// together, with no dependent global load before them. Each finished chunk counts in
// `unit_done[u]` (local); the warp that finishes a unit's last chunk flags the home, and units
// without rows are flagged at once.
// Called after `combine_stage` and a barrier.
__device__ void combine_send(const CombineParams& p, uint8_t* smem, uint32_t set, uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int H = b.hidden, R = b.num_ranks, E = b.num_experts, L = E / R, M = b.max_tokens;
    const int tid = threadIdx.x, lane = ep::lane_id(), warp = ep::warp_id();
    // unit_done [L*R] follows send_done [E] (L * R == E).
    int* unit_done = reinterpret_cast<int*>(b.local + b.off_send_done) + E;
    const int vpr = H / 8;  // 16-byte vectors per bf16 row
    const int64_t row_bytes = 2 * static_cast<int64_t>(H);
    constexpr int kChunkVecs = ep::kWarpSize * kSendUnroll;
    const int chunks = ep::ceil_div(vpr, kChunkVecs);
    const CombineSendSmem sm(smem, E);
    const int* s_items = sm.items;
    int* s_pre = sm.pre;
    const int* s_off = sm.off;
    const int* s_active = sm.active;
    block_prefix_sum(s_pre, E);
    __syncthreads();

    // Units without rows: their flag goes out now (one thread per unit, over the blocks).
    for (int u = blockIdx.x + tid * static_cast<int>(gridDim.x); u < E;
         u += kThreads * static_cast<int>(gridDim.x)) {
        const int s = u % R;
        if (s_items[u] == 0 && s_active[s] != 0) {
            put_flag(set_base(b, peer_base(b, s), set) + b.off_flags +
                         static_cast<int64_t>(b.rank * L + u / R) * 4,
                     static_cast<int>(tag));
        }
    }

    // Items fit in an int: s_pre is an int prefix sum.
    const int items = s_pre[E];
    const int warps = static_cast<int>(gridDim.x) * kWarps;
    for (int j = static_cast<int>(blockIdx.x) * kWarps + warp; j < items; j += warps) {
        int lo = 0, hi = E - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_pre[mid] <= j) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        const int u = lo;
        const int s = u % R;
        if (s_active[s] != 0) {
            const int r = (j - s_pre[u]) / chunks;
            const int chunk = (j - s_pre[u]) - r * chunks;
            const int64_t src_row = static_cast<int64_t>(u / R) * R * M + s_off[u] + r;
            const int4* src = reinterpret_cast<const int4*>(p.x + src_row * H);
            // The row's loads and its (t, k) are in flight together.
            const int t = p.src_info[src_row];
            const int k = p.src_topk[src_row];
            int4 v[kSendUnroll];
#pragma unroll
            for (int q = 0; q < kSendUnroll; ++q) {
                const int i = chunk * kChunkVecs + q * ep::kWarpSize + lane;
                if (i < vpr) {
                    v[q] = ep::ld_nc_no_alloc(src + i);
                }
            }
            if (t >= 0 && t < M && k >= 0 && k < b.max_topk) {
                uint8_t* dst = set_base(b, peer_base(b, s), set) + b.off_rows +
                               (static_cast<int64_t>(t) * b.max_topk + k) * row_bytes;
#pragma unroll
                for (int q = 0; q < kSendUnroll; ++q) {
                    const int i = chunk * kChunkVecs + q * ep::kWarpSize + lane;
                    if (i < vpr) {
                        put_v4(dst + static_cast<int64_t>(i) * 16, v[q]);
                    }
                }
            }
        }
        __syncwarp();
        if (lane == 0 && ep::atomic_add_release_gpu(unit_done + u, 1) == s_items[u] - 1) {
            // The unit's last chunk (the atomics form a release sequence, so every chunk's
            // stores precede this one's read): reset the counter for the next op, then fence
            // and flag the home (fence + relaxed store form a release pattern).
            atomicExch(unit_done + u, 0);
            if (s_active[s] != 0) {
                ep::fence_acq_rel_sys();
                put_flag(set_base(b, peer_base(b, s), set) + b.off_flags +
                             static_cast<int64_t>(b.rank * L + u / R) * 4,
                         static_cast<int>(tag));
            }
        }
    }
}

// Per-rank combine, send phase. Items are (home s, token t, chunk of 32 lanes x kRankVecs vectors)
// over all R x M (s, t), homes in the order rank + 1, rank + 2, ..., rank. An item reads the
// token's record in the handle (`rank_records`): one whose header is -1 (the token sent nothing
// here) is skipped; the others sum, in k order and in f32, the weighted rows of the token's
// experts on this rank (the record's packed rows, loaded kRankBatch rows at a time) and write
// the bf16 partial into row (t, j) of the home's combine region. Every item of a home counts in `rank_done[s]`
// (local, the first R counters of `unit_done`), a block at a time: the block's warps count their
// items per home in shared memory, and after the block's last item one thread per home adds the
// block's count (about 130 global atomics per home instead of one per item, all of which hit R
// neighbouring words); the thread whose addition completes a home (M x chunks items) flags it
// (`flags[rank]`). Shared memory: the mask snapshot [R], this block's items per home [R].
__device__ void combine_send_ranks(const CombineParams& p, uint8_t* smem, uint32_t set,
                                   uint32_t tag) {
    const LlBuffer& b = p.buf;
    const int H = b.hidden, R = b.num_ranks, E = b.num_experts, M = b.max_tokens;
    const int K = p.num_topk;
    const int tid = threadIdx.x, lane = ep::lane_id(), warp = ep::warp_id();
    int* rank_done = reinterpret_cast<int*>(b.local + b.off_send_done) + E;
    const int vpr = H / 8;
    const int64_t row_bytes = 2 * static_cast<int64_t>(H);
    constexpr int kChunkVecs = ep::kWarpSize * kRankVecs;
    const int chunks = ep::ceil_div(vpr, kChunkVecs);
    const int* s_active = reinterpret_cast<const int*>(smem);
    int* s_done = reinterpret_cast<int*>(smem) + R;

    const int64_t items = static_cast<int64_t>(R) * M * chunks;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * kWarps + warp; j < items; j += warps) {
        // Home-major, each rank starting at the next rank's home and ending at its own: at any
        // moment the ranks write to different homes. (Every rank starting at home 0 made homes 0
        // and 1 take every rank's stores while the last home's links idled: EP4 30.2-30.6 us; a
        // token-major order 27.9-28.0 at EP4 but 17.1-17.3 at EP2; this order 27.2-27.3 and
        // 16.1-16.5.)
        const int64_t q = j / chunks;
        const int chunk = static_cast<int>(j - q * chunks);
        const int h = static_cast<int>(q / M);
        const int t = static_cast<int>(q - static_cast<int64_t>(h) * M);
        const int s = (h + b.rank + 1) % R;
        // The record's header, and lane k's packed row and weight, load together.
        const int* rec = p.rank_records + (static_cast<int64_t>(s) * M + t) * kRecordWords;
        const int home_row = rec[0];
        const uint32_t mask = static_cast<uint32_t>(rec[1]);
        const int placed = lane < K ? rec[4 + lane] : -1;
        const float w = lane < K ? __int_as_float(rec[4 + kMaxTopk + lane]) : 0.0f;
        // Rows of k outside the mask were not written by this op (the bound keeps the loads in
        // `x` whatever the memory holds, e.g. after a peer timed out mid-op).
        const int row = (mask >> lane) & 1u && placed >= 0 && placed < E * M ? placed : -1;
        if (home_row >= 0 && s_active[s] != 0) {
            float acc[kRankVecs][8];
#pragma unroll
            for (int q = 0; q < kRankVecs; ++q) {
#pragma unroll
                for (int c = 0; c < 8; ++c) {
                    acc[q][c] = 0.0f;
                }
            }
            // In k order (the host twin `partial_row`), kRankBatch rows in flight at a time.
            uint32_t have = __ballot_sync(ep::kFullMask, row >= 0);
            while (have != 0) {
                int4 v[kRankBatch][kRankVecs];
                float wq[kRankBatch];
                bool used[kRankBatch];
#pragma unroll
                for (int u = 0; u < kRankBatch; ++u) {
                    used[u] = have != 0;
                    const int k = used[u] ? __ffs(have) - 1 : 0;
                    have &= have - 1;
                    const int r_u = __shfl_sync(ep::kFullMask, row, k);
                    wq[u] = __shfl_sync(ep::kFullMask, w, k);
                    const int4* src = reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(r_u) * H);
#pragma unroll
                    for (int q = 0; q < kRankVecs; ++q) {
                        const int i = chunk * kChunkVecs + q * ep::kWarpSize + lane;
                        if (used[u] && i < vpr) {
                            v[u][q] = ep::ld_nc_no_alloc(src + i);
                        }
                    }
                }
#pragma unroll
                for (int u = 0; u < kRankBatch; ++u) {
#pragma unroll
                    for (int q = 0; q < kRankVecs; ++q) {
                        const int i = chunk * kChunkVecs + q * ep::kWarpSize + lane;
                        if (used[u] && i < vpr) {
                            ep::ll::accumulate_bf16x8(acc[q], v[u][q], wq[u]);
                        }
                    }
                }
            }
            uint8_t* dst = set_base(b, peer_base(b, s), set) + b.off_rows +
                           (static_cast<int64_t>(t) * b.max_topk + home_row) * row_bytes;
#pragma unroll
            for (int q = 0; q < kRankVecs; ++q) {
                const int i = chunk * kChunkVecs + q * ep::kWarpSize + lane;
                if (i < vpr) {
                    put_v4(dst + static_cast<int64_t>(i) * 16, ep::ll::pack_bf16x8(acc[q]));
                }
            }
        }
        if (lane == 0) {
            atomicAdd(s_done + s, 1);
        }
    }
    // Every item of this block is stored (the barrier orders its warps' stores before the
    // counting thread's release), then its counts go out; the addition that completes a home
    // (the atomics form a release sequence, so every block's stores precede its read) resets
    // the counter for the next op, fences and flags the home (fence + relaxed store form a
    // release pattern), as `combine_send`'s last chunk of a unit does.
    __syncthreads();
    const int per_home = M * chunks;
    for (int s = tid; s < R; s += kThreads) {
        const int n = s_done[s];
        if (n > 0 && ep::atomic_add_release_gpu(rank_done + s, n) == per_home - n) {
            atomicExch(rank_done + s, 0);
            if (s_active[s] != 0) {
                ep::fence_acq_rel_sys();
                put_flag(set_base(b, peer_base(b, s), set) + b.off_flags +
                             static_cast<int64_t>(b.rank) * 4,
                         static_cast<int>(tag));
            }
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
    // Per rank: the token's expert ranks (-1: no expert) in k order.
    __shared__ int s_erank[kMaxTopk];
    const bool per_rank = p.reduce != 0;

    // The first token's routing (a local input) is read while the flags are awaited.
    const int t_first = blockIdx.x;
    int64_t pre_e = -1;
    float pre_w = 0.0f;
    if (t_first < T && tid < K) {
        pre_e = p.topk_idx[static_cast<int64_t>(t_first) * K + tid];
        pre_w = p.topk_weights[static_cast<int64_t>(t_first) * K + tid];
    }
    // Every expert (per rank: every rank) of every active rank flags every home, also with
    // zero rows: waiting for all of them is what makes reusing the buffer set two ops later
    // safe.
    if (per_rank) {
        for (int r = tid; r < R; r += kThreads) {
            wait_flag(flags + r, tag, active + r, b.timeout_ns);
        }
    } else {
        for (int e = tid; e < E; e += kThreads) {
            wait_flag(flags + e, tag, active + e / L, b.timeout_ns);
        }
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
            const bool first = t == t_first;
            const int64_t e = first ? pre_e : p.topk_idx[static_cast<int64_t>(t) * K + tid];
            const bool valid = e >= 0 && e < E && s_active[static_cast<int>(e) / L] != 0;
            s_valid[tid] = valid ? 1 : 0;
            const float w = first ? pre_w : p.topk_weights[static_cast<int64_t>(t) * K + tid];
            s_w[tid] = valid ? w : 0.0f;
            s_erank[tid] = e >= 0 && e < E ? static_cast<int>(e) / L : -1;
        }
        __syncthreads();
        if (per_rank) {
            // Row j of the token is the partial sum of its j-th distinct rank (k order, as
            // the host twin `rank_order`), added with weight 1 (exact: 1 * v == v).
            if (tid < K) {
                int n = 0, rank_j = -1;
                for (int k = 0; k < K && rank_j < 0; ++k) {
                    const int r = s_erank[k];
                    bool seen = r < 0;
                    for (int k2 = 0; k2 < k && !seen; ++k2) {
                        seen = s_erank[k2] == r;
                    }
                    if (!seen) {
                        rank_j = n == tid ? r : -1;
                        ++n;
                    }
                }
                s_valid[tid] = rank_j >= 0 && s_active[rank_j] != 0 ? 1 : 0;
                s_w[tid] = 1.0f;
            }
            __syncthreads();
        }
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
                        v[q] = ep::ld_cg_v4(rows + k * row_bytes + static_cast<int64_t>(i) * 16);
                    }
                }
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int k = k0 + q;
                    if (k < K && s_valid[k] != 0) {
                        // Separate multiply and add (no FMA), as the host twin.
                        ep::ll::accumulate_bf16x8(acc, v[q], s_w[k]);
                    }
                }
            }
            *reinterpret_cast<int4*>(p.out + static_cast<int64_t>(t) * H + i * 8) =
                ep::ll::pack_bf16x8(acc);
        }
        __syncthreads();
    }
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------

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

// Grid: at most one block per SM. Dynamic shared memory:
// max(send: 4 * (3 * E + 1 + R) (per rank: 8 * R), receive: kMaxTopk * 8 + 4 * R) bytes.
EP_KERNEL void __launch_bounds__(kThreads, 1) ll_combine(const __grid_constant__ CombineParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    const LlBuffer& b = p.buf;
    __shared__ uint32_t s_seq;
    // The op sequence and the send phase's layout loads are in flight together.
    const uint32_t seq0 =
        threadIdx.x == 0 ? op_begin(reinterpret_cast<const uint32_t*>(b.local), kKindCombine, p.phases) : 0u;
    const bool per_rank = p.reduce != 0;
    if ((p.phases & kPhaseSend) && per_rank) {
        // The mask and this block's finished items per home, for `combine_send_ranks`.
        const int R = b.num_ranks;
        int* s_words = reinterpret_cast<int*>(smem);
        const int* active = reinterpret_cast<const int*>(b.local + b.off_active);
        for (int r = threadIdx.x; r < R; r += kThreads) {
            s_words[r] = ld_vol(active + r);
            s_words[R + r] = 0;
        }
    } else if (p.phases & kPhaseSend) {
        combine_stage(p, smem);
    }
    if (threadIdx.x == 0) {
        s_seq = seq0;
    }
    __syncthreads();
    const uint32_t seq = s_seq;
    const uint32_t set = seq & 1u;
    const uint32_t tag = tag_of(seq);
    if ((p.phases & kPhaseSend) && per_rank) {
        combine_send_ranks(p, smem, set, tag);
    } else if (p.phases & kPhaseSend) {
        combine_send(p, smem, set, tag);
    }
    if (p.phases & kPhaseRecv) {
        __syncthreads();
        combine_recv(p, smem, set, tag);
    }
    op_end(b, kKindCombine, p.phases, seq);
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
    for (int e = tid; e < 2 * E; e += blockDim.x) {
        send_done[e] = 0;  // send_done [E], then unit_done [L*R == E]
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
