// The NVLink buffer of the intranode (normal-mode) kernels: its layout, the addressing helpers,
// the kernel and wait-site ids of error records, and the timeout report. Shared by
// `src/intranode/notify.cu`, `src/intranode/rings_{dispatch,combine}.cu` and `src/intranode/copy_engine_{dispatch,combine}.cu`;
// launchers: `src/intranode/cuda/`.
//
// ---------------------------------------------------------------------------------------------
// NVLink buffer layout (one buffer per rank, on that rank's GPU, mapped into every peer; all
// offsets in bytes from the buffer base; `kMax*` below):
//
//   [0, 128)            barrier signals: int32[kMaxRanks]; signal[i] is this rank's counter
//                       for its barrier with rank i. Never reset by the kernels (balanced: +T by
//                       self, -T by the peer per barrier); zero it only when (re)creating the
//                       buffer or after a timeout.
//   [1024, 17408)       channel counters, four int32 arrays [kMaxChannels][kMaxRanks]:
//                         start[c][src] (-v-1 encoded: 0 = not yet written) first index of
//                                        source `src`'s channel-`c` tokens within its block;
//                         end[c][src]   (-v-1 encoded) one past the last one;
//                         tail[c][src]  tokens the sender `src` has published into ring (c, src);
//                         head[c][dst]  tokens the receiver `dst` has consumed from the ring
//                                        (c, me) that lives in *dst's* buffer (written by dst).
//                       Reset to zero by notify_dispatch / cached_notify (between two barriers).
//   [17408, 18432)      copy-engine path flags: int32 [kMaxRanks][kCeMaxChunks] (see
//                       `intranode/copy_engine.cuh`); [18432, 19456) its chunk counters, same
//                       shape. Reset with the channel counters.
//   [19456, 19468)      copy-engine path: three work queues (int32 each, items taken so far;
//                       see `ce_pack` and `ce_combine_roles`). Reset with the channel counters.
//   [20480, 53248)      notify counts: int32[kMaxRanks][kMaxRanks] tokens per destination rank
//                       written by each source (row = source), then
//                       int32[kMaxRanks][kMaxLocalExperts] tokens per local expert (row = source).
//   [65536, ...)        rings: for channel c and peer p, ring (c, p) at
//                       kRingBase + (c * R + p) * ring_bytes; ring (c, p) of rank `r` receives
//                       from rank `p` (dispatch: p sends its tokens; combine: p returns rows).
//                       Each ring holds Q = num_max_recv_tokens slots, as arrays (16-byte
//                       aligned, in this order):
//                         dispatch: x [Q][row_bytes], src_idx i32 [Q], topk_idx i32 [Q][K],
//                                   topk_weights f32 [Q][K], scales f32 [Q][S];
//                         combine:  x [Q][row_bytes] (bf16), topk_weights f32 [Q][K].
//                       ring_bytes is the larger of the two for the op (see `RingLayout` in
//                       `intranode/rings.cuh` and `buffer_size_hint` in the launchers).
//                       The copy-engine path uses the same region as per-peer slots (see
//                       `intranode/copy_engine.cuh`).
//
// Timeouts: every device-side wait gives up after `timeout_ns` (0 = never) of no progress, on
// the `%globaltimer` clock. The waiter then writes an error record {1, awaited rank, kernel id,
// site} with one 16-byte store to `error_info` (host-mapped or device memory, int32[4], zeroed
// by the host before the op), prints one line, and its warp group / block leaves its loop and
// *exits cleanly* (no trap: the context stays usable). Peers waiting on it then time out too.
// Outputs are garbage after a timeout; the barrier signals are unbalanced, so the runtime must
// re-zero the buffers' signal regions on all ranks (after a global sync) before reusing them.
// ---------------------------------------------------------------------------------------------

#pragma once

#include "common.cuh"

namespace {

constexpr int kMaxRanks = 8;
constexpr int kMaxChannels = 128;
constexpr int kMaxLocalExperts = 1024;

constexpr size_t kSignalOffset = 0;
constexpr size_t kCounterOffset = 1024;
constexpr size_t kCounterArrayBytes = sizeof(int) * kMaxChannels * kMaxRanks;  // 4 KiB
constexpr size_t kNotifyOffset = 20480;
constexpr size_t kRingBase = 65536;
static_assert(kCounterOffset + 4 * kCounterArrayBytes <= kNotifyOffset, "counter region");
// Copy-engine path (`intranode/copy_engine.cuh`): flags and chunk counters, reset with the
// channel counters.
constexpr size_t kCeFlagOffset = kCounterOffset + 4 * kCounterArrayBytes;
constexpr int kCeMaxChunks = 32;
static_assert(kCeFlagOffset == 17408, "`flag_offset` of the copy-engine launchers assumes this offset");
static_assert(kCeFlagOffset + 2 * sizeof(int) * kMaxRanks * kCeMaxChunks <= kNotifyOffset,
              "copy-engine flag region");
static_assert(kNotifyOffset + sizeof(int) * kMaxRanks * (kMaxRanks + kMaxLocalExperts) <=
                  kRingBase,
              "notify region");

enum CounterArray : int { kStart = 0, kEnd = 1, kTail = 2, kHead = 3 };

// Kernel ids in error records (Rust: `KERNEL_NAMES` in src/intranode/cuda/mod.rs).
enum KernelId : int {
    kNotifyKernel = 1,
    kCachedNotifyKernel = 2,
    kDispatchKernel = 3,
    kCombineKernel = 4,
    kCeWaitKernel = 5,
    kCeReduceKernel = 6,
    kCeSmPullKernel = 7,
};

// Wait sites in error records.
enum Site : int {
    kSiteBarrier = 1,
    kSiteDispatchSendHead = 2,
    kSiteDispatchRecvMeta = 3,
    kSiteDispatchRecvTail = 4,
    kSiteCombineSendHead = 5,
    kSiteCombineRecvTail = 6,
    kSiteCeWait = 7,
    kSiteCeReduce = 8,
    kSiteCeSmPull = 9,
};

EP_DEVICE char* buf(const uint64_t* ptrs, int r) { return reinterpret_cast<char*>(ptrs[r]); }

EP_DEVICE int* counter(char* base, CounterArray array, int channel, int peer) {
    return reinterpret_cast<int*>(base + kCounterOffset + array * kCounterArrayBytes) +
           channel * kMaxRanks + peer;
}

EP_DEVICE int* ce_flag(char* base, int peer, int chunk) {
    return reinterpret_cast<int*>(base + kCeFlagOffset) + peer * kCeMaxChunks + chunk;
}

EP_DEVICE int* ce_count(char* base, int peer, int chunk) {
    return reinterpret_cast<int*>(base + kCeFlagOffset) + kMaxRanks * kCeMaxChunks +
           peer * kCeMaxChunks + chunk;
}

// Work queue `q` of the copy-engine path: the dispatch's pack takes 0 (rows fetched from this
// rank), 1 (NVLink pushes) and 2 (own rows); the combine with both roles per block takes 0
// (tokens to reduce) and 1 (rows to push).
constexpr size_t kCeWorkOffset = kCeFlagOffset + 2 * sizeof(int) * kMaxRanks * kCeMaxChunks;
static_assert(kCeWorkOffset + 3 * sizeof(int) <= kNotifyOffset, "pack work queues");

EP_DEVICE int* ce_work(char* base, int q) { return reinterpret_cast<int*>(base + kCeWorkOffset) + q; }

// Stores an error record in one 16-byte store (so a record is never torn), visible system-wide.
EP_DEVICE void store_error_record(int* error_info, int4 rec) {
    if (error_info != nullptr) {
        asm volatile("st.volatile.global.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(error_info),
                     "r"(rec.x), "r"(rec.y), "r"(rec.z), "r"(rec.w)
                     : "memory");
        __threadfence_system();
    }
}

// Records a timeout ({1, awaited, kernel, site}) and prints it.
EP_DEVICE void report_timeout(int* error_info, int kernel, int self_rank, int awaited, int site) {
    printf("ep-kernels: rank %d kernel %d timed out waiting for rank %d (site %d, block %d)\n",
           self_rank, kernel, awaited, site, static_cast<int>(blockIdx.x));
    store_error_record(error_info, make_int4(1, awaited, kernel, site));
}

// A worst-case receive capacity too small (`rank` receives `received` rows, more than
// `capacity`): records {2, rank, received, capacity}, as a timeout is recorded.
EP_DEVICE void report_capacity(int* error_info, int self_rank, int rank, int received, int capacity) {
    printf("ep-kernels: rank %d: rank %d receives %d rows, more than the %d sized for\n", self_rank,
           rank, received, capacity);
    store_error_record(error_info, make_int4(2, rank, received, capacity));
}

// The token range [begin, end) of `channel` when `num_tokens` tokens are split into
// `num_channels` contiguous channels of ceil(T / C) tokens (host twin: `channel_range`).
EP_DEVICE void channel_range(int num_tokens, int num_channels, int channel, int* begin, int* end) {
    const int per = (num_tokens + num_channels - 1) / num_channels;
    *begin = min(per * channel, num_tokens);
    *end = min(per * (channel + 1), num_tokens);
}

}  // namespace
