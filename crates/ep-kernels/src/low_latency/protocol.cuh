// The protocol of the low-latency (decode) dispatch (`dispatch.cu`) and combine (`combine.cu`) over
// NVLink peer pointers, and through NVSHMEM puts to ranks of other nodes in the `*_nvshmem.cu`
// builds: constants, the buffer and parameter structs (mirrored in `cuda/mod.rs`,
// `cuda/buffer.rs`), addresses, the per-peer write path, op sequencing and waits. `control.cu`
// holds the buffer reset and the benchmarks' delay.
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
// source that copied no rows, or keeping the records in a region of their own instead of in the
// message, measured slower at EP4.)
//
// Host twins: `src/low_latency/host.rs` (slots, packed receive layout, weighted combine) and
// `src/fp8/host.rs` (the 1x128 cast fused into the dispatch send). Launchers and the buffer
// layout (offsets passed in `LlBuffer`): `src/low_latency/cuda/`, `layout.rs`.
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
//   stage     (NVSHMEM buffers only) what is put to ranks of other nodes: messages per
//             (destination, token) at (r * M + t) * msg_stride, or combine rows per (home,
//             token, row) at ((s * M + t) * max_topk + row) * 2H
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
#pragma once

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
// 16-byte vectors per lane of one copy work item (a chunk of 32 x n vectors), what measured
// fastest at EP2 and EP4 (`docs/benchmarks.md`, "Low-latency mode"): the combine send keeps 8
// (fewer leave fewer bytes in flight per warp); the dispatch receive copies 4 (8 leaves half
// the warps without work; 2 is no better).
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

// Where this rank's buffer lies and how it is laid out; mirrors `LlBuffer` in cuda/buffer.rs.
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
    uint64_t off_stage;      // staging of data put to remote peers (0: no remote peers)
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

// Rank `r`'s buffer as this GPU addresses it (a peer pointer over NVLink; 0 for a rank on
// another node, which only the NVSHMEM build reaches).
EP_DEVICE uint8_t* peer_base(const LlBuffer& b, int r) {
    return reinterpret_cast<uint8_t*>(b.peers[r]);
}

// Every byte written into a peer's buffer goes through `put_v4`, `signal_peer`, `flag_peer`
// and `entry_peer`. Over NVLink they are stores through the peer pointer. The NVSHMEM build
// (`EP_LL_NVSHMEM`, the `*_nvshmem` cubins) reaches the ranks of other nodes, whose `peers`
// entry is 0, through NVSHMEM: rows and messages are written (`put_v4`) into the local staging
// region (`off_stage`) and put from there by a warp (`nvshmemx_putmem_nbi_warp`), words are
// single puts, and the writers complete their puts (`nvshmem_quiet`) before the counters that
// release the signal or flag (see `remote_quiet`). Addresses of a remote rank are this rank's
// own buffer addresses (symmetric: NVSHMEM translates them for the target PE = rank).
#if EP_LL_NVSHMEM
constexpr bool kRemotePeers = true;
#else
constexpr bool kRemotePeers = false;
#endif

EP_DEVICE bool is_remote(const LlBuffer& b, int r) { return kRemotePeers && b.peers[r] == 0; }

EP_DEVICE void put_v4(uint8_t* dst, int4 v) { ep::st_no_alloc(reinterpret_cast<int4*>(dst), v); }

// The caller fences (`fence.acq_rel.sys`) after the data and before its signals and flags.
// `off` is the word's offset in buffer set `set`.
EP_DEVICE void signal_peer(const LlBuffer& b, int r, uint32_t set, uint64_t off, uint64_t v) {
#if EP_LL_NVSHMEM
    if (is_remote(b, r)) {
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(set_base(b, b.local, set) + off), v,
                           NVSHMEM_SIGNAL_SET, r);
        return;
    }
#endif
    ep::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(set_base(b, peer_base(b, r), set) + off), v);
}

EP_DEVICE void flag_peer(const LlBuffer& b, int r, uint32_t set, uint64_t off, int v) {
#if EP_LL_NVSHMEM
    if (is_remote(b, r)) {
        nvshmem_int_p(reinterpret_cast<int*>(set_base(b, b.local, set) + off), v, r);
        return;
    }
#endif
    ep::st_relaxed_sys(reinterpret_cast<int*>(set_base(b, peer_base(b, r), set) + off), v);
}

// A data word (a dispatch index entry): ordered before the signal like the messages.
EP_DEVICE void entry_peer(const LlBuffer& b, int r, uint32_t set, uint64_t off, int v) {
#if EP_LL_NVSHMEM
    if (is_remote(b, r)) {
        nvshmem_int_p(reinterpret_cast<int*>(set_base(b, b.local, set) + off), v, r);
        return;
    }
#endif
    *reinterpret_cast<int*>(set_base(b, peer_base(b, r), set) + off) = v;
}

// Where a warp writes `bytes` bytes bound for offset `off` of rank r's set `set`: the peer's
// memory over NVLink, else the staging region at `stage_off` (then `put_staged` sends them).
EP_DEVICE uint8_t* write_target(const LlBuffer& b, int r, uint32_t set, uint64_t off,
                                uint64_t stage_off) {
    if (is_remote(b, r)) {
        return b.local + b.off_stage + stage_off;
    }
    return set_base(b, peer_base(b, r), set) + off;
}

// Called by a whole warp, after its lanes wrote `bytes` bytes at `write_target(..)` + `from`:
// for a remote rank, puts them from the staging region to offset `off + from` of its set.
// Nothing for a peer over NVLink (the stores went there).
EP_DEVICE void put_staged(const LlBuffer& b, int r, uint32_t set, uint64_t off, uint64_t stage_off,
                          uint64_t from, uint64_t bytes) {
#if EP_LL_NVSHMEM
    if (is_remote(b, r)) {
        __syncwarp();
        nvshmemx_putmem_nbi_warp(set_base(b, b.local, set) + off + from,
                                 b.local + b.off_stage + stage_off + from, bytes, r);
    }
#else
    (void)b, (void)r, (void)set, (void)off, (void)stage_off, (void)from, (void)bytes;
#endif
}

// Completes the calling thread's NVSHMEM puts (delivered at the target) before what it does
// next releases a signal or flag; nothing in the NVLink build.
EP_DEVICE void remote_quiet() {
#if EP_LL_NVSHMEM
    nvshmem_quiet();
#endif
}

EP_DEVICE int ld_vol(const int* ptr) { return ep::ld_volatile(ptr); }

EP_DEVICE uint32_t tag_of(uint32_t seq) { return (seq & 0x7fffffffu) + 1u; }

// ------------------------------------------------------------------------------------------
// Op sequencing (see the file comment)
// ------------------------------------------------------------------------------------------

// This launch's op sequence number (the same in every block); called by one thread, which
// shares it through shared memory. The caller issues its other start-up loads before it uses
// the value, so their latencies overlap.
__device__ inline uint32_t op_begin(const uint32_t* ctl, int kind, uint32_t phases) {
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
__device__ inline void op_end(const LlBuffer& b, int kind, uint32_t phases, uint32_t seq) {
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


// The last i in [0, n) with pre[i] <= j, for a non-decreasing prefix sum `pre` with pre[0] <= j
// (the work unit that item j of a prefix-summed list falls into).
EP_DEVICE int last_at_or_below(const int* pre, int n, int j) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (pre[mid] <= j) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// In place: s_pre[1..=n] holds n values; on return s_pre[i] is the sum of the first i of them
// (s_pre[0] = 0). Every thread of the block calls it, after a barrier that made the values
// visible; the caller's next barrier makes the result visible. One warp scan per 1024 values
// and one over the warps' totals, instead of a single warp walking all n.
__device__ inline void block_prefix_sum(int* s_pre, int n) {
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

}  // namespace
