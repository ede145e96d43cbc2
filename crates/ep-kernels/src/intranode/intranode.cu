// Normal-mode (high-throughput) expert-parallel kernels inside one NVLink node.
// Host twins: `src/intranode/host.rs`; launchers: `src/intranode/cuda.rs`.
//
// Kernels (each takes ONE by-value params struct mirrored in cuda.rs):
//   * intranode_notify_dispatch: exchange per-rank / per-expert counts with every peer, compute
//     `rank_prefix_matrix [R, R]`, the totals (written to host-mapped counters) and this rank's
//     `channel_prefix_matrix [R, C]`; also resets the channel counters for the next kernel;
//   * intranode_cached_notify: barrier + counter reset + barrier (before a cached dispatch, and
//     before every combine);
//   * intranode_dispatch: every rank streams its tokens to their destination ranks through
//     per-(channel, source) ring buffers in the receivers' NVLink buffers;
//   * intranode_combine: the reverse path; the home rank sums the returned rows in rank order.
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
//                       `copy_engine.cu`); [18432, 19456) its chunk counters, same shape.
//                       Reset with the channel counters.
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
//                       ring_bytes is the larger of the two for the op (see `ring_bytes` here
//                       and `buffer_size_hint` in cuda.rs).
//
// Flow control: the sender of ring (c, s -> d) waits until `Q - (sent - head) >= chunk`, copies
// up to `num_max_send_tokens` tokens (warps of its group in parallel), group barrier, then
// publishes `tail = sent` with a system-scope release store. The receiver polls `tail` with
// acquire loads (its own memory), copies slots [head, tail) out, group barrier, then publishes
// `head` with a release store into the sender's buffer. Counters never wrap within one kernel.
//
// Ordering between ops: notify_dispatch starts with a barrier (every peer has finished its
// previous kernels, so nothing touches this buffer any more), resets the counters, writes the
// counts, and barriers again; cached_notify does barrier / reset / barrier. The caller runs
// cached_notify before every combine and before a cached (handle-reusing) dispatch.
//
// Timeouts: every device-side wait gives up after `timeout_ns` (0 = never) of no progress, on
// the `%globaltimer` clock. The waiter then writes an error record {1, awaited rank, kernel id,
// site} with one 16-byte store to `error_info` (host-mapped or device memory, int32[4], zeroed
// by the host before the op), prints one line, and its warp group / block leaves its loop and
// *exits cleanly* (no trap: the context stays usable). Peers waiting on it then time out too.
// Outputs are garbage after a timeout; the barrier signals are unbalanced, so the runtime must
// re-zero the buffers' signal regions on all ranks (after a global sync) before reusing them.
// ---------------------------------------------------------------------------------------------

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
// Copy-engine path (mirrored in copy_engine.cu): flags and chunk counters, reset with the
// channel counters.
constexpr size_t kCeFlagOffset = kCounterOffset + 4 * kCounterArrayBytes;
constexpr int kCeMaxChunks = 32;
static_assert(kCeFlagOffset == 17408, "copy_engine.cu assumes this offset");
static_assert(kCeFlagOffset + 2 * sizeof(int) * kMaxRanks * kCeMaxChunks <= kNotifyOffset,
              "copy-engine flag region");
static_assert(kNotifyOffset + sizeof(int) * kMaxRanks * (kMaxRanks + kMaxLocalExperts) <=
                  kRingBase,
              "notify region");

enum CounterArray : int { kStart = 0, kEnd = 1, kTail = 2, kHead = 3 };

// Kernel ids in error records (Rust: `KERNEL_NAMES` in cuda.rs).
enum KernelId : int { kNotifyKernel = 1, kCachedNotifyKernel = 2, kDispatchKernel = 3, kCombineKernel = 4 };

// Wait sites in error records.
enum Site : int {
    kSiteBarrier = 1,
    kSiteDispatchSendHead = 2,
    kSiteDispatchRecvMeta = 3,
    kSiteDispatchRecvTail = 4,
    kSiteCombineSendHead = 5,
    kSiteCombineRecvTail = 6,
};

constexpr int kBarrierTag = 1 << 20;

constexpr int kNotifyThreads = 256;
constexpr int kDispatchThreads = 768;  // 24 warps, split into R groups on both sides
constexpr int kDispatchWarps = kDispatchThreads / ep::kWarpSize;
constexpr int kCombineThreads = 768;
constexpr int kCombineWarps = kCombineThreads / ep::kWarpSize;

// Hidden-row copies of the dispatch: 1 = Hopper bulk copies (TMA) through a per-warp
// shared-memory pipeline (`TmaPipe` below), 0 = `warp_copy` (16-byte loads/stores by every
// lane).
// EP_DISPATCH_TMA_SEND / EP_DISPATCH_TMA_RECV (default: EP_DISPATCH_TMA) pick the path of the
// sender (x -> peer's ring) and of the receiver (ring -> recv_x) separately.
#ifndef EP_DISPATCH_TMA
#define EP_DISPATCH_TMA 1
#endif
#ifndef EP_DISPATCH_TMA_SEND
// Measured on 4 x H200 (2026-11-21, 24 SMs): TMA on the receive side only is the fastest
// (EP4 dispatch bf16 374 GB/s vs 338 with warp copies on both sides and 316 with TMA on both);
// bulk stores into a peer's ring over NVLink are slower than the lanes' 16-byte stores.
#define EP_DISPATCH_TMA_SEND 0
#endif
#ifndef EP_DISPATCH_TMA_RECV
#define EP_DISPATCH_TMA_RECV EP_DISPATCH_TMA
#endif
#define EP_DISPATCH_TMA_ANY (EP_DISPATCH_TMA_SEND || EP_DISPATCH_TMA_RECV)
#if !(EP_DISPATCH_TMA_SEND && EP_DISPATCH_TMA_RECV)
// int4 loads in flight per lane in the dispatch copies (latency-bound: more is faster).
constexpr int kDispatchUnroll = 5;
#endif

EP_DEVICE char* buf(const uint64_t* ptrs, int r) { return reinterpret_cast<char*>(ptrs[r]); }

EP_DEVICE int* signals(char* base) { return reinterpret_cast<int*>(base + kSignalOffset); }

EP_DEVICE int* counter(char* base, CounterArray array, int channel, int peer) {
    return reinterpret_cast<int*>(base + kCounterOffset + array * kCounterArrayBytes) +
           channel * kMaxRanks + peer;
}

EP_DEVICE int* notify_rank_counts(char* base) { return reinterpret_cast<int*>(base + kNotifyOffset); }

EP_DEVICE int* notify_expert_counts(char* base) {
    return reinterpret_cast<int*>(base + kNotifyOffset) + kMaxRanks * kMaxRanks;
}

EP_HOST_DEVICE size_t align16(size_t v) { return (v + 15) & ~size_t{15}; }

// Byte offsets of the arrays inside one ring (mirrored by `RingLayout` in cuda.rs).
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

// Records a timeout (one 16-byte store, so a record is never torn) and prints it.
EP_DEVICE void report_timeout(int* error_info, int kernel, int self_rank, int awaited, int site) {
    printf("ep-kernels: rank %d kernel %d timed out waiting for rank %d (site %d, block %d)\n",
           self_rank, kernel, awaited, site, static_cast<int>(blockIdx.x));
    if (error_info != nullptr) {
        const int4 rec = make_int4(1, awaited, kernel, site);
        asm volatile("st.volatile.global.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(error_info),
                     "r"(rec.x), "r"(rec.y), "r"(rec.z), "r"(rec.w)
                     : "memory");
        __threadfence_system();
    }
}

// Non-allocating weak load of data another GPU wrote (ordered by a prior acquire + barrier).
EP_DEVICE int4 ld_ring(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr)
                 : "memory");
    return v;
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
                v[u] = kSrcReadOnly ? ep::ld_nc_no_alloc(src + i) : ld_ring(src + i);
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

#if EP_DISPATCH_TMA_ANY
// Per warp: kTmaStages staging buffers of kTmaStageBytes, then the metadata: mbarriers
// u64[S], destinations u64[S], sizes u32[S]. Rows are split into equal 16-byte-multiple
// chunks of at most kTmaStageBytes (a 7168-bf16 row: 7 x 2048 B; 7168 fp8: 4 x 1792 B). Up to
// S - 1 chunk loads are in flight per warp; the last stage lets stores drain.
// Mirrored by `DISPATCH_SMEM_BYTES` in cuda.rs (24 warps x 9344 B = 224256 B dynamic smem,
// within the 227 KiB opt-in limit of sm_90 with the kernel's static smem).
constexpr int kTmaStages = 4;
constexpr int kTmaStageBytes = 2304;
constexpr int kTmaWarpMetaBytes = 128;
constexpr int kTmaWarpBytes = kTmaStages * kTmaStageBytes + kTmaWarpMetaBytes;
constexpr int kDispatchSmemBytes = kDispatchWarps * kTmaWarpBytes;
static_assert(kTmaStages >= 2 && kTmaStages <= 4, "TmaPipe::push waits with at most 3 newer groups");
static_assert(kTmaStageBytes % 16 == 0 && kTmaWarpBytes % 16 == 0, "bulk copies need 16 B units");
static_assert(kTmaStages * (8 + 8 + 4) <= kTmaWarpMetaBytes, "TMA metadata");
static_assert(kDispatchSmemBytes == 224256, "update DISPATCH_SMEM_BYTES in cuda.rs");

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
#endif

// Barrier of the whole node, run by one block// Barrier of the whole node, run by one block (threads [0, R) talk to the peers). Every
// write of the block before the call is visible to every peer after it. Returns false (and
// records the error) on timeout; all threads of the block get the same answer.
__device__ bool barrier_block(const uint64_t* buffer_ptrs, int rank, int num_ranks,
                              uint64_t timeout_ns, int* error_info, int kernel) {
    __shared__ int s_failed;
    if (threadIdx.x == 0) {
        s_failed = 0;
    }
    __syncthreads();
    const int i = static_cast<int>(threadIdx.x);
    if (i < num_ranks) {
        ep::fence_acq_rel_sys();
        int* mine = signals(buf(buffer_ptrs, rank)) + i;
        int* theirs = signals(buf(buffer_ptrs, i)) + rank;
        ep::atomic_add_release_sys(mine, kBarrierTag);
        ep::atomic_add_release_sys(theirs, -kBarrierTag);
        const ep::Deadline deadline = ep::Deadline::after(timeout_ns);
        bool timed_out = false;
        ep::wait_flag_sys(mine, [](int v) { return v <= 0; }, deadline, &timed_out);
        if (timed_out) {
            report_timeout(error_info, kernel, rank, i, kSiteBarrier);
            atomicExch(&s_failed, 1);
        }
    }
    __syncthreads();
    const bool ok = s_failed == 0;
    // Every thread has read s_failed before the block can reach the next barrier's reset.
    __syncthreads();
    return ok;
}

// Zeroes this rank's channel counters (start, end, tail, head) and the copy-engine path's
// flags and chunk counters.
__device__ void reset_counters(char* my_buf) {
    int* c = counter(my_buf, kStart, 0, 0);
    constexpr int kWords = static_cast<int>((kNotifyOffset - kCounterOffset) / sizeof(int));
    for (int i = threadIdx.x; i < kWords; i += blockDim.x) {
        c[i] = 0;
    }
}

EP_DEVICE void channel_range(int num_tokens, int num_channels, int channel, int* begin, int* end) {
    const int per = (num_tokens + num_channels - 1) / num_channels;
    *begin = min(per * channel, num_tokens);
    *end = min(per * (channel + 1), num_tokens);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// notify_dispatch
// ---------------------------------------------------------------------------------------------

// Mirrors `NotifyParams` in src/intranode/cuda.rs.
struct NotifyParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int* num_tokens_per_rank;    // [R]
    const int* num_tokens_per_expert;  // [E]
    const uint8_t* is_token_in_rank;   // [T, R]
    int* rank_prefix_matrix;           // [R, R] out
    int* channel_prefix_matrix;        // [R, C] out
    int* moe_recv_counter;             // mapped [1 + R] out: total, then per source
    int* moe_recv_expert_counter;      // mapped [L] out
    int* error_info;                   // [4]
    int* send_index;                   // [T, R] out or null
    uint64_t timeout_ns;
    int rank;
    int num_ranks;
    int num_tokens;
    int num_experts;
    int num_channels;
    int expert_alignment;
};
EP_CHECK_PARAMS_SIZE(NotifyParams, 168);

// Grid: 1 + R blocks of kNotifyThreads. Block 0 exchanges counts; block 1 + d computes row d of
// channel_prefix_matrix and, if `send_index` is given, its column d: the index of each token
// among this rank's tokens sent to d, in token order (-1 if not sent).
EP_KERNEL void __launch_bounds__(kNotifyThreads, 1) intranode_notify_dispatch(const NotifyParams p) {
    const int R = p.num_ranks;
    if (blockIdx.x == 0) {
        const int L = p.num_experts / R;
        char* my_buf = buf(p.buffer_ptrs, p.rank);
        // 1. Everybody has finished with the buffers (previous op).
        if (!barrier_block(p.buffer_ptrs, p.rank, R, p.timeout_ns, p.error_info, kNotifyKernel)) {
            return;
        }
        // 2. Reset our counters; send our counts to every peer (row `rank` of their tables).
        reset_counters(my_buf);
        for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
            const int d = i / R;
            const int j = i % R;
            notify_rank_counts(buf(p.buffer_ptrs, d))[p.rank * kMaxRanks + j] = p.num_tokens_per_rank[j];
        }
        for (int i = threadIdx.x; i < R * L; i += blockDim.x) {
            const int d = i / L;
            const int le = i % L;
            notify_expert_counts(buf(p.buffer_ptrs, d))[p.rank * kMaxLocalExperts + le] =
                p.num_tokens_per_expert[d * L + le];
        }
        // 3. Every count has arrived, every counter is reset.
        if (!barrier_block(p.buffer_ptrs, p.rank, R, p.timeout_ns, p.error_info, kNotifyKernel)) {
            return;
        }
        // 4. Prefix matrix and totals.
        const int* counts = notify_rank_counts(my_buf);
        for (int j = threadIdx.x; j < R; j += blockDim.x) {
            int acc = 0;
            for (int i = 0; i < R; ++i) {
                acc += ep::ld_volatile(counts + i * kMaxRanks + j);
                p.rank_prefix_matrix[i * R + j] = acc;
            }
        }
        const int* ecounts = notify_expert_counts(my_buf);
        for (int le = threadIdx.x; le < L; le += blockDim.x) {
            int n = 0;
            for (int s = 0; s < R; ++s) {
                n += ep::ld_volatile(ecounts + s * kMaxLocalExperts + le);
            }
            const int a = p.expert_alignment;
            ep::st_release_sys(p.moe_recv_expert_counter + le, (n + a - 1) / a * a);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int total = 0;
            for (int i = 0; i < R; ++i) {
                const int n = ep::ld_volatile(counts + i * kMaxRanks + p.rank);
                ep::st_volatile(p.moe_recv_counter + 1 + i, n);
                total += n;
            }
            ep::fence_acq_rel_sys();
            ep::st_release_sys(p.moe_recv_counter, total);
        }
        return;
    }

    // channel_prefix_matrix row d: warp w counts channels w, w + 8, ...
    __shared__ int s_counts[kMaxChannels];
    const int d = static_cast<int>(blockIdx.x) - 1;
    const int C = p.num_channels;
    const int lane = ep::lane_id();
    for (int c = ep::warp_id(); c < C; c += kNotifyThreads / ep::kWarpSize) {
        int begin, end;
        channel_range(p.num_tokens, C, c, &begin, &end);
        int n = 0;
        for (int t = begin + lane; t < end; t += ep::kWarpSize) {
            n += p.is_token_in_rank[static_cast<int64_t>(t) * R + d] != 0;
        }
        n = ep::warp_reduce_sum(n);
        if (lane == 0) {
            s_counts[c] = n;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int c = 0; c < C; ++c) {
            acc += s_counts[c];
            p.channel_prefix_matrix[d * C + c] = acc;
            s_counts[c] = acc;  // inclusive prefix
        }
    }
    __syncthreads();
    if (p.send_index != nullptr) {
        for (int c = ep::warp_id(); c < C; c += kNotifyThreads / ep::kWarpSize) {
            int begin, end;
            channel_range(p.num_tokens, C, c, &begin, &end);
            int next = c > 0 ? s_counts[c - 1] : 0;
            for (int t0 = begin; t0 < end; t0 += ep::kWarpSize) {
                const int t = t0 + lane;
                const bool in = t < end && p.is_token_in_rank[static_cast<int64_t>(t) * R + d] != 0;
                const unsigned ballot = __ballot_sync(ep::kFullMask, in);
                if (t < end) {
                    p.send_index[static_cast<int64_t>(t) * R + d] =
                        in ? next + __popc(ballot & ((1u << lane) - 1u)) : -1;
                }
                next += __popc(ballot);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// cached_notify: barrier, reset counters, barrier
// ---------------------------------------------------------------------------------------------

// Mirrors `CachedNotifyParams` in src/intranode/cuda.rs.
struct CachedNotifyParams {
    uint64_t buffer_ptrs[kMaxRanks];
    int* error_info;  // [4]
    uint64_t timeout_ns;
    int rank;
    int num_ranks;
};
EP_CHECK_PARAMS_SIZE(CachedNotifyParams, 88);

// Grid: 1 block of kNotifyThreads.
EP_KERNEL void __launch_bounds__(kNotifyThreads, 1) intranode_cached_notify(const CachedNotifyParams p) {
    if (!barrier_block(p.buffer_ptrs, p.rank, p.num_ranks, p.timeout_ns, p.error_info,
                       kCachedNotifyKernel)) {
        return;
    }
    reset_counters(buf(p.buffer_ptrs, p.rank));
    barrier_block(p.buffer_ptrs, p.rank, p.num_ranks, p.timeout_ns, p.error_info,
                  kCachedNotifyKernel);
}

// ---------------------------------------------------------------------------------------------
// dispatch
// ---------------------------------------------------------------------------------------------

// Mirrors `DispatchParams` in src/intranode/cuda.rs.
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
};
EP_CHECK_PARAMS_SIZE(DispatchParams, 232);

namespace {

// One token into slot `slot` of a dispatch ring, by one warp.
#if EP_DISPATCH_TMA_SEND
EP_DEVICE void dispatch_send_token(const DispatchParams& p, char* ring_base, const RingLayout& lay,
                                   int token, int slot, int dst, int lane, TmaPipe& pipe) {
    const int hi = p.hidden_int4;
    if (lane == 0) {
        pipe.row(reinterpret_cast<int4*>(ring_base) + static_cast<int64_t>(slot) * hi,
                 p.x + static_cast<int64_t>(token) * hi, static_cast<uint32_t>(hi) * 16u);
    }
#else
EP_DEVICE void dispatch_send_token(const DispatchParams& p, char* ring_base, const RingLayout& lay,
                                   int token, int slot, int dst, int lane) {
    const int hi = p.hidden_int4;
    warp_copy<true, kDispatchUnroll>(reinterpret_cast<int4*>(ring_base) + static_cast<int64_t>(slot) * hi,
                    p.x + static_cast<int64_t>(token) * hi, hi, lane);
#endif
    if (lane == 0) {
        reinterpret_cast<int*>(ring_base + lay.src_idx)[slot] = token;
    }
    const int K = p.num_topk;
    if (K > 0) {
        const int64_t lo = static_cast<int64_t>(dst) * p.experts_per_rank;
        const int64_t hi_e = lo + p.experts_per_rank;
        int* ridx = reinterpret_cast<int*>(ring_base + lay.topk_idx) + static_cast<int64_t>(slot) * K;
        float* rw = reinterpret_cast<float*>(ring_base + lay.topk_weights) + static_cast<int64_t>(slot) * K;
        for (int k = lane; k < K; k += ep::kWarpSize) {
            const int64_t e = __ldg(p.topk_idx + static_cast<int64_t>(token) * K + k);
            const bool local = e >= lo && e < hi_e;
            ridx[k] = local ? static_cast<int>(e - lo) : -1;
            rw[k] = local ? __ldg(p.topk_weights + static_cast<int64_t>(token) * K + k) : 0.0f;
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

// Slot `slot` of a dispatch ring into row `out` of the outputs, by one warp.
#if EP_DISPATCH_TMA_RECV
EP_DEVICE void dispatch_recv_token(const DispatchParams& p, const char* ring_base,
                                   const RingLayout& lay, int slot, int64_t out, int lane,
                                   TmaPipe& pipe) {
    const int hi = p.hidden_int4;
    if (lane == 0) {
        pipe.row(p.recv_x + out * hi,
                 reinterpret_cast<const int4*>(ring_base) + static_cast<int64_t>(slot) * hi,
                 static_cast<uint32_t>(hi) * 16u);
    }
#else
EP_DEVICE void dispatch_recv_token(const DispatchParams& p, const char* ring_base,
                                   const RingLayout& lay, int slot, int64_t out, int lane) {
    const int hi = p.hidden_int4;
    warp_copy<false, kDispatchUnroll>(p.recv_x + out * hi,
                     reinterpret_cast<const int4*>(ring_base) + static_cast<int64_t>(slot) * hi, hi,
                     lane);
#endif
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

}  // namespace

// Grid: 2 * C blocks of kDispatchThreads. Block 2c sends channel c, block 2c + 1 receives it.
// In both, warp group g (kDispatchWarps / R warps, named barrier g + 1) serves peer g.
EP_KERNEL void __launch_bounds__(kDispatchThreads, 1) intranode_dispatch(const DispatchParams p) {
    __shared__ int s_value[kMaxRanks][2];
    __shared__ int s_tail[kMaxRanks];
    __shared__ int s_abort[kMaxRanks];

    const int R = p.num_ranks;
    const int C = p.num_channels;
    const int Q = p.num_max_recv_tokens;
    const int c = static_cast<int>(blockIdx.x) / 2;
    const bool is_sender = (blockIdx.x % 2) == 0;
    const int lane = ep::lane_id();
    const int warps_per_group = kDispatchWarps / R;
    const int g = ep::warp_id() / warps_per_group;
    if (g >= R) {
        return;  // spare warps (R does not divide 24)
    }
    const int gw = ep::warp_id() % warps_per_group;
    const int group_threads = warps_per_group * ep::kWarpSize;
    const int bar_id = g + 1;
    const bool leader = gw == 0 && lane == 0;
#if EP_DISPATCH_TMA_ANY
    extern __shared__ __align__(128) char s_tma[];
    // The launcher must pass kDispatchSmemBytes of dynamic shared memory.
    EP_DEVICE_ASSERT(ep::dynamic_smem_bytes() >= static_cast<uint32_t>(kDispatchSmemBytes));
    TmaPipe pipe;
#endif
    const RingLayout lay = RingLayout::dispatch(Q, p.hidden_int4 * 16, p.num_topk, p.num_scales);
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    int t_begin, t_end;
    channel_range(p.num_tokens, C, c, &t_begin, &t_end);

    if (is_sender) {
        const int d = g;
        char* dst_buf = buf(p.buffer_ptrs, d);
        const int first = c > 0 ? p.channel_prefix_matrix[d * C + c - 1] : 0;
        const int last = p.channel_prefix_matrix[d * C + c];
        const int n_total = last - first;
        if (leader) {
            ep::st_release_sys(counter(dst_buf, kStart, c, p.rank), -first - 1);
            ep::st_release_sys(counter(dst_buf, kEnd, c, p.rank), -last - 1);
        }
#if EP_DISPATCH_TMA_SEND
        pipe.init(s_tma, ep::warp_id(), lane);
        __syncwarp();
#endif
        char* ring_base = ring(dst_buf, lay.bytes, c, R, p.rank);
        int* tail_ptr = counter(dst_buf, kTail, c, p.rank);
        const int* head_ptr = counter(my_buf, kHead, c, d);
        const int chunk = p.num_max_send_tokens;
        int sent = 0;
        int t = t_begin;
        bool aborted = false;
        while (sent < n_total) {
            const int k = min(chunk, n_total - sent);
            if (leader) {
                bool timed_out = false;
                ep::wait_flag_sys(head_ptr, [&](int head) { return Q - (sent - head) >= k; },
                                  ep::Deadline::after(p.timeout_ns), &timed_out);
                if (timed_out) {
                    report_timeout(p.error_info, kDispatchKernel, p.rank, d, kSiteDispatchSendHead);
                }
                s_abort[g] = timed_out;
            }
            named_barrier(bar_id, group_threads);
            if (s_abort[g]) {
                aborted = true;
                break;
            }
#if EP_DISPATCH_TMA_SEND
            // The slots were freed by the receiver (generic head, acquired by the leader):
            // order that before this warp's async-proxy writes into them.
            const uint32_t issued_before = pipe.issued;
            if (lane == 0) {
                ep::fence_proxy_async_global();
            }
#endif
            // Scan the channel's tokens 32 at a time for the next k bound to d.
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
                const int j0 = sent + filled;
                if (gw == 0 && lane < window) {
                    const bool taken = (mask >> lane) & 1u;
                    p.send_head[static_cast<int64_t>(tok) * R + d] =
                        taken ? j0 + __popc(mask & ((1u << lane) - 1u)) : -1;
                }
                unsigned m = mask;
                for (int r = 0; m != 0; ++r) {
                    const int b = __ffs(m) - 1;
                    m &= m - 1;
                    const int j = j0 + r;
                    if (j % warps_per_group == gw) {
#if EP_DISPATCH_TMA_SEND
                        dispatch_send_token(p, ring_base, lay, t + b, j % Q, d, lane, pipe);
#else
                        dispatch_send_token(p, ring_base, lay, t + b, j % Q, d, lane);
#endif
                    }
                }
                filled += __popc(mask);
                t += window;
            }
#if EP_DISPATCH_TMA_SEND
            // The rows must have landed in the peer's ring before the leader's release of tail:
            // complete the bulk stores (not only their smem reads), then order them (async
            // proxy) with the generic release, at system scope.
            if (lane == 0 && pipe.issued != issued_before) {
                pipe.flush();
                ep::bulk_wait_group<0>();
                ep::fence_proxy_async_global();
                ep::fence_acq_rel_sys();
            }
            __syncwarp();
#endif
            named_barrier(bar_id, group_threads);
            sent += k;
            if (leader) {
                ep::st_release_sys(tail_ptr, sent);
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

    // Receiver of channel c from source s = g.
    const int s = g;
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
#if EP_DISPATCH_TMA_RECV
    pipe.init(s_tma, ep::warp_id(), lane);
    __syncwarp();
#endif
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
#if EP_DISPATCH_TMA_RECV
            if (lane == 0) {
                ep::bulk_wait_group<0>();  // earlier rows' stores still read this block's smem
            }
#endif
            return;
        }
        const int tail = s_tail[g];
#if EP_DISPATCH_TMA_RECV
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
#else
        for (int j = head + gw; j < tail; j += warps_per_group) {
            dispatch_recv_token(p, ring_base, lay, j % Q, base + j, lane);
        }
#endif
        named_barrier(bar_id, group_threads);
        head = tail;
        if (leader) {
            ep::st_release_sys(head_ptr, head);
        }
    }
#if EP_DISPATCH_TMA_RECV
    if (lane == 0) {
        ep::bulk_wait_group<0>();  // the recv_x rows are written, the smem no longer read
    }
#endif
}

// ---------------------------------------------------------------------------------------------
// combine
// ---------------------------------------------------------------------------------------------

// Mirrors `CombineParams` in src/intranode/cuda.rs.
struct CombineParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int4* x;                    // [N, hidden_int4] bf16 rows in receive order
    const float* topk_weights;        // [N, K] or null (K == 0)
    const int* rank_prefix_matrix;    // [R, R]
    const int* recv_channel_offset;   // [R, C]
    const int* send_head;             // [T, R]
    int4* combined_x;                 // [T, hidden_int4] out
    float* combined_topk_weights;     // [T, K] out, or null
    int* error_info;                  // [4]
    uint64_t timeout_ns;
    int rank;
    int num_ranks;
    int num_tokens;
    int num_recv_tokens;
    int hidden_int4;
    int num_topk;
    int num_channels;
    int num_max_send_tokens;
    int num_max_recv_tokens;
    int pad;
};
EP_CHECK_PARAMS_SIZE(CombineParams, 176);

namespace {

// The home side of combine for channel c with R == kR ranks (compile-time, so the per-rank
// slots and loads stay in registers).
template <int kR>
__device__ void combine_home(const CombineParams& p, int c, int* s_abort) {
    const int R = kR;
    const int C = p.num_channels;
    const int Q = p.num_max_recv_tokens;
    const int K = p.num_topk;
    const int hi = p.hidden_int4;
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const RingLayout lay = RingLayout::combine(Q, hi * 16, K);
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    int t_begin, t_end;
    channel_range(p.num_tokens, C, c, &t_begin, &t_end);
    for (int round = t_begin; round < t_end; round += kCombineWarps) {
        __syncthreads();
        if (*s_abort) {
            break;
        }
        const int t = round + warp;
        if (t < t_end) {
            const int my_slot = lane < R ? p.send_head[static_cast<int64_t>(t) * R + lane] : -1;
            bool timed_out = false;
            if (my_slot >= 0) {
                ep::wait_flag_sys(counter(my_buf, kTail, c, lane), [&](int v) { return v > my_slot; },
                                  ep::Deadline::after(p.timeout_ns), &timed_out);
                if (timed_out) {
                    report_timeout(p.error_info, kCombineKernel, p.rank, lane, kSiteCombineRecvTail);
                    *s_abort = 1;
                }
            }
            if (!__any_sync(ep::kFullMask, timed_out)) {
                // Per rank: the int4 offset of this token's row in ring (c, d), or -1.
                int row[kR];
#pragma unroll
                for (int d = 0; d < kR; ++d) {
                    const int sl = __shfl_sync(ep::kFullMask, my_slot, d);
                    row[d] = sl >= 0 ? (sl % Q) * hi : -1;
                }
                const char* ring0 = ring(my_buf, lay.bytes, c, R, 0);
                int4* out = p.combined_x + static_cast<int64_t>(t) * hi;
                for (int i = lane; i < hi; i += ep::kWarpSize) {
                    float acc[8];
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        acc[e] = 0.0f;
                    }
                    // Up to 4 rows in flight, then summed in rank order.
                    constexpr int kBatch = kR < 4 ? kR : 4;
#pragma unroll
                    for (int d0 = 0; d0 < kR; d0 += kBatch) {
                        int4 v[kBatch];
#pragma unroll
                        for (int b = 0; b < kBatch; ++b) {
                            if (d0 + b < kR && row[d0 + b] >= 0) {
                                v[b] = ld_ring(reinterpret_cast<const int4*>(ring0 + (d0 + b) * lay.bytes) + row[d0 + b] + i);
                            }
                        }
#pragma unroll
                        for (int b = 0; b < kBatch; ++b) {
                            if (d0 + b < kR && row[d0 + b] >= 0) {
                                const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[b]);
#pragma unroll
                                for (int e = 0; e < 4; ++e) {
                                    const float2 f = __bfloat1622float2(h[e]);
                                    acc[2 * e] += f.x;
                                    acc[2 * e + 1] += f.y;
                                }
                            }
                        }
                    }
                    int4 o;
                    __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        oh[e] = __floats2bfloat162_rn(acc[2 * e], acc[2 * e + 1]);
                    }
                    ep::st_no_alloc(out + i, o);
                }
                if (p.combined_topk_weights != nullptr) {
                    for (int kk = lane; kk < K; kk += ep::kWarpSize) {
                        float acc = 0.0f;
#pragma unroll
                        for (int d = 0; d < kR; ++d) {
                            if (row[d] >= 0) {
                                const float* w = reinterpret_cast<const float*>(
                                    ring0 + d * lay.bytes + lay.topk_weights);
                                acc += w[static_cast<int64_t>(row[d] / hi) * K + kk];
                            }
                        }
                        p.combined_topk_weights[static_cast<int64_t>(t) * K + kk] = acc;
                    }
                }
            }
        }
        __syncthreads();
        // Free the slots this round consumed.
        if (warp == 0 && lane < R && !*s_abort) {
            int last = -1;
            for (int w = 0; w < kCombineWarps && round + w < t_end; ++w) {
                last = max(last, p.send_head[static_cast<int64_t>(round + w) * R + lane]);
            }
            if (last >= 0) {
                ep::st_release_sys(counter(buf(p.buffer_ptrs, lane), kHead, c, p.rank), last + 1);
            }
        }
    }
}

}  // namespace

// Grid: 2 * C blocks of kCombineThreads. Block 2c: warp group g returns to home rank g the rows
// of channel c it received from g. Block 2c + 1: the home side of channel c, one token per warp
// per round, summing the rows of every rank in rank order.
template <int kR>
__device__ __forceinline__ void combine_impl(const CombineParams& p) {
    __shared__ int s_abort_group[kMaxRanks];
    __shared__ int s_abort;

    const int R = kR;
    const int C = p.num_channels;
    const int Q = p.num_max_recv_tokens;
    const int K = p.num_topk;
    const int hi = p.hidden_int4;
    const int c = static_cast<int>(blockIdx.x) / 2;
    const bool is_sender = (blockIdx.x % 2) == 0;
    const int lane = ep::lane_id();
    const int warp = ep::warp_id();
    const RingLayout lay = RingLayout::combine(Q, hi * 16, K);
    char* my_buf = buf(p.buffer_ptrs, p.rank);

    if (is_sender) {
        const int warps_per_group = kCombineWarps / R;
        const int g = warp / warps_per_group;
        if (g >= R) {
            return;
        }
        const int gw = warp % warps_per_group;
        const int group_threads = warps_per_group * ep::kWarpSize;
        const int bar_id = g + 1;
        const bool leader = gw == 0 && lane == 0;
        const int s = g;
        char* home_buf = buf(p.buffer_ptrs, s);
        const int off = p.recv_channel_offset[s * C + c];
        const int end = c + 1 < C ? p.recv_channel_offset[s * C + c + 1] : p.rank_prefix_matrix[s * R + p.rank];
        const int n = end - off;
        char* ring_base = ring(home_buf, lay.bytes, c, R, p.rank);
        int4* ring_x = reinterpret_cast<int4*>(ring_base);
        float* ring_w = reinterpret_cast<float*>(ring_base + lay.topk_weights);
        int* tail_ptr = counter(home_buf, kTail, c, p.rank);
        const int* head_ptr = counter(my_buf, kHead, c, s);
        int sent = 0;
        while (sent < n) {
            const int k = min(p.num_max_send_tokens, n - sent);
            if (leader) {
                bool timed_out = false;
                ep::wait_flag_sys(head_ptr, [&](int head) { return Q - (sent - head) >= k; },
                                  ep::Deadline::after(p.timeout_ns), &timed_out);
                if (timed_out) {
                    report_timeout(p.error_info, kCombineKernel, p.rank, s, kSiteCombineSendHead);
                }
                s_abort_group[g] = timed_out;
            }
            named_barrier(bar_id, group_threads);
            if (s_abort_group[g]) {
                return;
            }
            for (int j = sent + gw; j < sent + k; j += warps_per_group) {
                const int slot = j % Q;
                const int64_t row = static_cast<int64_t>(off) + j;
                warp_copy<true>(ring_x + static_cast<int64_t>(slot) * hi, p.x + row * hi, hi, lane);
                for (int kk = lane; kk < K; kk += ep::kWarpSize) {
                    ring_w[static_cast<int64_t>(slot) * K + kk] = __ldg(p.topk_weights + row * K + kk);
                }
            }
            named_barrier(bar_id, group_threads);
            sent += k;
            if (leader) {
                ep::st_release_sys(tail_ptr, sent);
            }
        }
        return;
    }

    // Home side.
    if (threadIdx.x == 0) {
        s_abort = 0;
    }
    combine_home<kR>(p, c, &s_abort);
}

// One kernel per rank count (the home side keeps per-rank state in registers):
// intranode_combine_<R> for R in 1..=8.
#define EP_COMBINE_KERNEL(n)                                                                     \
    EP_KERNEL void __launch_bounds__(kCombineThreads, 1) intranode_combine_##n(const CombineParams p) { \
        combine_impl<n>(p);                                                                      \
    }
EP_COMBINE_KERNEL(1)
EP_COMBINE_KERNEL(2)
EP_COMBINE_KERNEL(3)
EP_COMBINE_KERNEL(4)
EP_COMBINE_KERNEL(5)
EP_COMBINE_KERNEL(6)
EP_COMBINE_KERNEL(7)
EP_COMBINE_KERNEL(8)
#undef EP_COMBINE_KERNEL

// ---------------------------------------------------------------------------------------------
// Copy-engine path (launchers: src/intranode/copy_engine.rs; design: docs/design.md)
//
// The NVLink bytes of `copy_engine_peers` peers move by copy engines (cuMemcpyDtoDAsync), those
// of the others by SM warps (next section); `intranode_ce_dispatch` = pack + SM pulls,
// `intranode_ce_combine` = reduce + SM pushes:
//   * dispatch: the pack (`ce_pack`, SMs, local memory only) writes this rank's rows for each
//     peer d, in d's receive order, into slot d of this rank's own buffer and its local rows
//     straight into recv_x; chunk counters in this rank's header count finished rows and the
//     warp that completes a chunk raises flag [rank][chunk] in d's header. The receiver's copy
//     streams (one per source) wait for each chunk (`intranode_ce_wait`, one thread, with the
//     device timeout) and pull it into recv_x with a copy engine.
//   * combine: each rank's copy streams push its rows for home s (a contiguous block of its
//     combine input) into slot [rank] of s's buffer, chunk by chunk, each followed by a stream
//     write of flag [rank][chunk] in the home's header; the reduce (`ce_reduce`) on the home
//     polls those flags in its own memory and sums the rows in rank order.
//
// Slots start at kRingBase: slot d at kRingBase + d * slot_bytes (offsets in the params).
// Chunk c of a block of m rows: see `ce_chunk`, mirrored by `chunk_bounds` in copy_engine.rs.
// ---------------------------------------------------------------------------------------------

namespace {

enum CeSite : int { kSiteCeWait = 7, kSiteCeReduce = 8 };
enum CeKernelId : int { kCeWaitKernel = 5, kCeReduceKernel = 6 };

EP_DEVICE int* ce_flag(char* base, int peer, int chunk) {
    return reinterpret_cast<int*>(base + kCeFlagOffset) + peer * kCeMaxChunks + chunk;
}

EP_DEVICE int* ce_count(char* base, int peer, int chunk) {
    return reinterpret_cast<int*>(base + kCeFlagOffset) + kMaxRanks * kCeMaxChunks +
           peer * kCeMaxChunks + chunk;
}

// Chunking of a block of `m` rows: the first chunk has `first` rows, each next one twice the
// previous, up to `cap` = max(max_rows, ceil(m / 16)) (first is raised to cap / 256 so that
// there are at most kCeMaxChunks chunks). Returns the chunk of row `idx` and its bounds.
struct CeChunk {
    int index;
    int begin;
    int end;
};

EP_DEVICE CeChunk ce_chunk(int m, int idx, int first_rows, int max_rows) {
    const int cap = max(max_rows, (m + 15) / 16);
    int size = min(max(first_rows, cap / 256), cap);
    int begin = 0;
    int j = 0;
    while (idx >= begin + size) {
        begin += size;
        size = min(2 * size, cap);
        ++j;
    }
    return CeChunk{j, begin, min(begin + size, m)};
}

constexpr int kCeThreads = 768;
constexpr int kCePackUnroll = 7;

}  // namespace

// Mirrors `CePackParams` in src/intranode/copy_engine.rs.
struct CePackParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int4* x;                // [T, row_int4]
    const float* x_scales;        // [T, S] or null
    const int64_t* topk_idx;      // [T, K] or null
    const float* topk_weights;    // [T, K] or null
    const int* send_index;        // [T, R]
    const int* rank_prefix_matrix;  // [R, R]
    int4* recv_x;                 // [N, row_int4]
    float* recv_x_scales;         // [N, S] or null
    int* recv_src_idx;            // [N]
    int64_t* recv_topk_idx;       // [N, K] or null
    float* recv_topk_weights;     // [N, K] or null
    int64_t slot_bytes;
    int64_t off_scales;
    int64_t off_src;
    int64_t off_topk_idx;
    int64_t off_topk_weights;
    int rank;
    int num_ranks;
    int num_tokens;
    int row_int4;
    int num_scales;
    int num_topk;
    int experts_per_rank;
    int first_chunk_rows;
    int max_chunk_rows;
    int sm_push_mask;  // bit d: peer d's rows go straight into slot [rank] of d's buffer
    int own_rows_last;  // 1: the peers' rows first (all tokens), then this rank's own rows
    int reserved;
};
EP_CHECK_PARAMS_SIZE(CePackParams, 240);

// Blocks [0, nblocks) of kCeThreads; warp w of them takes work items w, w + W, ... (token order
// within each pass, so early chunks complete first).
__device__ void ce_pack(const CePackParams& p, int block, int nblocks) {
    const int R = p.num_ranks, K = p.num_topk, S = p.num_scales, L = p.experts_per_rank;
    const int lane = ep::lane_id();
    const int warps = nblocks * (kCeThreads / ep::kWarpSize);
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    char* ce_base = my_buf + kRingBase;
    // Where the rows for peer d go: slot d of this rank's buffer (a copy engine or the peer's
    // SM pull blocks fetch them), or slot [rank] of d's buffer (pushed here over NVLink; the
    // peer copies them out locally).
    auto slot_of = [&](int d) -> char* {
        return (p.sm_push_mask >> d) & 1 ? buf(p.buffer_ptrs, d) + kRingBase + p.rank * p.slot_bytes
                                         : ce_base + d * p.slot_bytes;
    };
    // Rows this rank sends to peer `lane` (block size there) and where its own block starts.
    int m_lane = 0;
    if (lane < R) {
        const int prev = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + lane] : 0;
        m_lane = p.rank_prefix_matrix[p.rank * R + lane] - prev;
    }
    const int own_base = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + p.rank] : 0;

    // Pass 0 stores the rows for the peers (and, unless `own_rows_last`, this rank's own rows);
    // pass 1 this rank's own rows. Own rows last: the peers' chunks, which the copy engines and
    // SM copies wait for, complete sooner, at the cost of reading x twice.
    // Work item i is token i % T of pass i / T.
    const int passes = p.own_rows_last ? 2 : 1;
    const int T = p.num_tokens;
    for (int i = block * (kCeThreads / ep::kWarpSize) + ep::warp_id(); i < passes * T; i += warps) {
        const int pass = i / T;
        const int t = i - pass * T;
        // Destinations of this pass (bit d).
        const uint32_t pass_mask = passes == 1 ? 0xffu : (pass == 0 ? 0xffu & ~(1u << p.rank) : 1u << p.rank);
        const int my_idx = lane < R ? p.send_index[static_cast<int64_t>(t) * R + lane] : -1;
        int idx[kMaxRanks];
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            idx[d] = (pass_mask >> d) & 1u ? __shfl_sync(ep::kFullMask, my_idx, d) : -1;
        }
        bool any = false;
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            any |= d < R && idx[d] >= 0;
        }
        if (!any) {
            continue;
        }
        // Row: loaded once, stored to every destination.
        const int4* src = p.x + static_cast<int64_t>(t) * p.row_int4;
        for (int base = 0; base < p.row_int4; base += ep::kWarpSize * kCePackUnroll) {
            int4 v[kCePackUnroll];
#pragma unroll
            for (int u = 0; u < kCePackUnroll; ++u) {
                const int i = base + u * ep::kWarpSize + lane;
                if (i < p.row_int4) {
                    v[u] = ep::ld_nc_no_alloc(src + i);
                }
            }
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d) {
                if (d < R && idx[d] >= 0) {
                    int4* dst = d == p.rank
                                    ? p.recv_x + static_cast<int64_t>(own_base + idx[d]) * p.row_int4
                                    : reinterpret_cast<int4*>(slot_of(d)) +
                                          static_cast<int64_t>(idx[d]) * p.row_int4;
#pragma unroll
                    for (int u = 0; u < kCePackUnroll; ++u) {
                        const int i = base + u * ep::kWarpSize + lane;
                        if (i < p.row_int4) {
                            dst[i] = v[u];
                        }
                    }
                }
            }
        }
        // Source index, localised routing, scales.
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            if (d >= R || idx[d] < 0) {
                continue;
            }
            const bool own = d == p.rank;
            const int64_t row = own ? own_base + idx[d] : idx[d];
            char* slot = own ? ce_base : slot_of(d);
            if (lane == 0) {
                (own ? p.recv_src_idx : reinterpret_cast<int*>(slot + p.off_src))[row] = t;
            }
            if (p.topk_idx != nullptr) {
                int64_t* out_idx = own ? p.recv_topk_idx : reinterpret_cast<int64_t*>(slot + p.off_topk_idx);
                float* out_w = own ? p.recv_topk_weights : reinterpret_cast<float*>(slot + p.off_topk_weights);
                for (int k = lane; k < K; k += ep::kWarpSize) {
                    const int64_t e = p.topk_idx[static_cast<int64_t>(t) * K + k];
                    const bool here = e >= static_cast<int64_t>(d) * L && e < static_cast<int64_t>(d + 1) * L;
                    out_idx[row * K + k] = here ? e - static_cast<int64_t>(d) * L : -1;
                    out_w[row * K + k] = here ? p.topk_weights[static_cast<int64_t>(t) * K + k] : 0.0f;
                }
            }
            if (S > 0) {
                float* out_s = own ? p.recv_x_scales : reinterpret_cast<float*>(slot + p.off_scales);
                for (int j = lane; j < S; j += ep::kWarpSize) {
                    out_s[row * S + j] = p.x_scales[static_cast<int64_t>(t) * S + j];
                }
            }
        }
        // Count the rows into their chunks; the warp that completes a chunk raises the flag in
        // the destination's header (its rows, written by any warp of this GPU, were released to
        // the counter at gpu scope; the system fence orders them before the flag).
        if (pass == 0 && p.sm_push_mask != 0) {
            // Rows pushed over NVLink reach the system before they are counted.
            ep::fence_acq_rel_sys();
        }
        __syncwarp();
        if (pass == 0 && lane < R && lane != p.rank && my_idx >= 0) {
            const CeChunk c = ce_chunk(m_lane, my_idx, p.first_chunk_rows, p.max_chunk_rows);
            const int done = ep::atomic_add_release_gpu(ce_count(my_buf, lane, c.index), 1) + 1;
            if (done == c.end - c.begin) {
                ep::fence_acq_rel_sys();
                ep::st_release_sys(ce_flag(buf(p.buffer_ptrs, lane), p.rank, c.index), 1);
            }
        }
    }
}

// Mirrors `CeWaitParams` in src/intranode/copy_engine.rs.
struct CeWaitParams {
    const int* flag;
    int* error_info;
    uint64_t timeout_ns;
    int rank;
    int awaited;
};
EP_CHECK_PARAMS_SIZE(CeWaitParams, 32);

// One thread: returns once `*flag` is set (a chunk arrived), or records a timeout naming the
// source and returns (the copy after it then moves stale bytes; the host reports the error).
EP_KERNEL void intranode_ce_wait(const CeWaitParams p) {
    const ep::Deadline deadline = ep::Deadline::after(p.timeout_ns);
    bool timed_out = false;
    ep::wait_flag_sys(p.flag, [](int v) { return v != 0; }, deadline, &timed_out);
    if (timed_out) {
        report_timeout(p.error_info, kCeWaitKernel, p.rank, p.awaited, kSiteCeWait);
    }
}

// Mirrors `CeReduceParams` in src/intranode/copy_engine.rs.
struct CeReduceParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int4* x;                  // [N, row_int4] this rank's combine input
    const float* topk_weights;      // [N, K] or null
    const int* send_index;          // [T, R] from the dispatch
    const int* rank_prefix_matrix;  // [R, R]
    int4* combined_x;               // [T, row_int4]
    float* combined_topk_weights;   // [T, K] or null
    int* error_info;
    uint64_t timeout_ns;
    int64_t slot_bytes;
    int64_t off_weights;
    int rank;
    int num_ranks;
    int num_tokens;
    int row_int4;
    int num_topk;
    int first_chunk_rows;
    int max_chunk_rows;
    int pad;
};
EP_CHECK_PARAMS_SIZE(CeReduceParams, 176);

// Blocks [0, nblocks) of kCeThreads; one warp per token, tokens in order over the blocks. kR
// bounds the ranks (R <= kR); each lane keeps kR * kU = 8 row loads in flight (kU = 8 / kR
// consecutive int4 of every source), which is what bounds a reduce that is latency-bound.
template <int kR>
__device__ void ce_reduce(const CeReduceParams& p, int block, int nblocks) {
    constexpr int kU = 8 / kR;
    const int R = p.num_ranks, K = p.num_topk;
    const int lane = ep::lane_id();
    const int warps = nblocks * (kCeThreads / ep::kWarpSize);
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    char* ce_base = my_buf + kRingBase;
    // Lane d tracks peer d: rows it returns (its block for this rank), chunks seen ready, and
    // whether it timed out.
    int m_lane = 0;
    if (lane < R) {
        const int prev = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + lane] : 0;
        m_lane = p.rank_prefix_matrix[p.rank * R + lane] - prev;
    }
    const int own_base = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + p.rank] : 0;
    int ready = 0;
    bool dead = false;

    for (int t = block * (kCeThreads / ep::kWarpSize) + ep::warp_id(); t < p.num_tokens; t += warps) {
        int my_idx = lane < R ? p.send_index[static_cast<int64_t>(t) * R + lane] : -1;
        if (lane < R && lane != p.rank && my_idx >= 0) {
            const CeChunk c = ce_chunk(m_lane, my_idx, p.first_chunk_rows, p.max_chunk_rows);
            while (!dead && ready <= c.index) {
                const ep::Deadline deadline = ep::Deadline::after(p.timeout_ns);
                bool timed_out = false;
                ep::wait_flag_sys(ce_flag(my_buf, lane, ready),
                                  [](int v) { return v != 0; }, deadline, &timed_out);
                if (timed_out) {
                    report_timeout(p.error_info, kCeReduceKernel, p.rank, lane, kSiteCeReduce);
                    dead = true;
                } else {
                    ++ready;
                }
            }
            if (dead) {
                my_idx = -1;
            }
        }
        // Source d's row index (-1 when d sends none; d >= R never sends).
        int idx[kR];
#pragma unroll
        for (int d = 0; d < kR; ++d) {
            idx[d] = d < R ? __shfl_sync(ep::kFullMask, my_idx, d) : -1;
        }
        const int4* const slots = reinterpret_cast<const int4*>(ce_base);
        const int64_t slot_int4 = p.slot_bytes / 16;
        for (int base = lane; base < p.row_int4; base += ep::kWarpSize * kU) {
            int4 v[kR][kU];
#pragma unroll
            for (int d = 0; d < kR; ++d) {
                const int4* row = d == p.rank ? p.x + static_cast<int64_t>(own_base + idx[d]) * p.row_int4
                                              : slots + d * slot_int4 + static_cast<int64_t>(idx[d]) * p.row_int4;
#pragma unroll
                for (int u = 0; u < kU; ++u) {
                    const int i = base + u * ep::kWarpSize;
                    if (idx[d] >= 0 && i < p.row_int4) {
                        v[d][u] = d == p.rank ? __ldg(row + i) : __ldcg(row + i);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                const int i = base + u * ep::kWarpSize;
                if (i >= p.row_int4) {
                    break;
                }
                float acc[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    acc[j] = 0.0f;
                }
#pragma unroll
                for (int d = 0; d < kR; ++d) {
                    if (idx[d] >= 0) {
                        const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v[d][u]);
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            acc[j] = __fadd_rn(acc[j], ep::bf16_to_f32(h[j]));
                        }
                    }
                }
                int4 o;
                __nv_bfloat16* oh = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    oh[j] = ep::f32_to_bf16(acc[j]);
                }
                p.combined_x[static_cast<int64_t>(t) * p.row_int4 + i] = o;
            }
        }
        if (p.combined_topk_weights != nullptr) {
            for (int k = lane; k < K; k += ep::kWarpSize) {
                float acc = 0.0f;
#pragma unroll
                for (int d = 0; d < kR; ++d) {
                    if (idx[d] >= 0) {
                        const float w =
                            d == p.rank
                                ? p.topk_weights[static_cast<int64_t>(own_base + idx[d]) * K + k]
                                : reinterpret_cast<const float*>(ce_base + d * p.slot_bytes + p.off_weights)
                                      [static_cast<int64_t>(idx[d]) * K + k];
                        acc = __fadd_rn(acc, w);
                    }
                }
                p.combined_topk_weights[static_cast<int64_t>(t) * K + k] = acc;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Copy-engine path, SM peers. The copy engines of one GPU move about 360 GB/s to one peer but
// only about 195 GB/s in total to three (scripts/gpu/probe, 4 x H200), so beyond 2 ranks the
// copy engines serve `copy_engine_peers` peers and SM warps move the bytes of the others, with
// the same slots, chunks and flags, so the receive side cannot tell which engine moved a chunk:
//   * dispatch: the SM pull blocks (`ce_sm_pull`) on the receiver wait for each chunk's flag
//     (raised by the source's pack) and copy the chunk's rows and metadata into recv_x and the
//     metadata outputs: from the source's slot over NVLink, or, between peers that both use
//     SM copies (`sm_push_mask` / `local_mask`), from the receiver's own slot [source], into
//     which the source's pack stored the rows directly over NVLink;
//   * combine: the SM push blocks (`ce_sm_push`) copy this rank's rows for each home (a
//     contiguous block of its combine input) into slot [rank] of the home's buffer (NVLink
//     stores), count them into the chunk counters of their own header, and the warp that
//     completes a chunk raises flag [rank][chunk] in the home's header, which the home's reduce
//     polls.
// All warps stream each (chunk, peer) block side by side, chunk-major, so early chunks complete
// first, and peers in rotated order (rank + 1, rank + 2, ... for pushes, rank - 1, ... for
// pulls), so that each GPU talks to one SM peer at a time and no GPU is hit by two while
// another idles; in the push a warp fences and counts itself once per (chunk, peer).
//
// Both run as extra blocks of the pack and reduce kernels, not as kernels of their own on
// another stream: the reduce waits for peers' pushes, and two streams may share one hardware
// queue, where a push kernel queued behind its own rank's reduce would never start.
// ---------------------------------------------------------------------------------------------

namespace {

enum CeSmSite : int { kSiteCeSmPull = 9 };
enum CeSmKernelId : int { kCeSmPullKernel = 7 };

constexpr int kCeSmUnroll = 7;

// Bounds of chunk `c` of a block of `m` rows (`ce_chunk`'s schedule); begin >= m past the end.
EP_DEVICE CeChunk ce_chunk_at(int m, int c, int first_rows, int max_rows) {
    const int cap = max(max_rows, (m + 15) / 16);
    int size = min(max(first_rows, cap / 256), cap);
    int begin = 0;
    for (int j = 0; j < c; ++j) {
        begin += size;
        size = min(2 * size, cap);
    }
    return CeChunk{c, min(begin, m), min(begin + size, m)};
}

// This warp's share (warp `gw` of `warps`) of copying `n` elements of T from `src` to `dst`:
// elements gw * 32 + lane + k * warps * 32, kCeSmUnroll independent loads in flight per lane,
// so that every warp of the kernel streams the same contiguous block side by side.
template <typename T, bool kRemoteSrc>
EP_DEVICE void warp_share_copy(T* dst, const T* src, int64_t n, int gw, int warps, int lane) {
    const int64_t stride = static_cast<int64_t>(warps) * ep::kWarpSize;
    int64_t i = static_cast<int64_t>(gw) * ep::kWarpSize + lane;
    for (; i + (kCeSmUnroll - 1) * stride < n; i += kCeSmUnroll * stride) {
        T v[kCeSmUnroll];
#pragma unroll
        for (int u = 0; u < kCeSmUnroll; ++u) {
            v[u] = kRemoteSrc ? __ldcg(src + i + u * stride) : __ldg(src + i + u * stride);
        }
#pragma unroll
        for (int u = 0; u < kCeSmUnroll; ++u) {
            dst[i + u * stride] = v[u];
        }
    }
    for (; i < n; i += stride) {
        dst[i] = kRemoteSrc ? __ldcg(src + i) : __ldg(src + i);
    }
}

}  // namespace

// Mirrors `CeSmPushParams` in src/intranode/copy_engine.rs.
struct CeSmPushParams {
    uint64_t buffer_ptrs[kMaxRanks];
    const int4* x;              // [N, row_int4] this rank's combine input
    const float* topk_weights;  // [N, K] or null
    int64_t slot_bytes;
    int64_t off_weights;
    int row_begin[kMaxRanks];  // first row of x returned to home d
    int rows[kMaxRanks];       // rows returned to home d by this kernel (0: not by SMs)
    int rank;
    int num_ranks;
    int row_int4;
    int num_topk;
    int first_chunk_rows;
    int max_chunk_rows;
    int pad[2];
};
EP_CHECK_PARAMS_SIZE(CeSmPushParams, 192);

// Blocks [0, nblocks) of kCeThreads.
__device__ void ce_sm_push(const CeSmPushParams& p, int block, int nblocks) {
    const int lane = ep::lane_id();
    const int warps = nblocks * (kCeThreads / ep::kWarpSize);
    const int gw = block * (kCeThreads / ep::kWarpSize) + ep::warp_id();
    const int K = p.num_topk;
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    for (int c = 0; c < kCeMaxChunks; ++c) {
        bool any = false;
        // Homes in the order rank + 1, rank + 2, ...: at any moment every GPU receives from
        // one pusher, instead of several pushing into the same GPU while others idle.
        for (int k = 1; k < p.num_ranks; ++k) {
            const int d = (p.rank + k) % p.num_ranks;
            const CeChunk ch = ce_chunk_at(p.rows[d], c, p.first_chunk_rows, p.max_chunk_rows);
            if (ch.begin >= ch.end) {
                continue;
            }
            any = true;
            // Rows [begin, end) are contiguous in x (from row_begin[d]) and in the slot.
            char* slot = buf(p.buffer_ptrs, d) + kRingBase + p.rank * p.slot_bytes;
            const int64_t src_row = p.row_begin[d] + ch.begin;
            const int64_t rows = ch.end - ch.begin;
            warp_share_copy<int4, false>(reinterpret_cast<int4*>(slot) + ch.begin * static_cast<int64_t>(p.row_int4),
                                         p.x + src_row * p.row_int4, rows * p.row_int4, gw, warps, lane);
            if (p.topk_weights != nullptr) {
                warp_share_copy<float, false>(reinterpret_cast<float*>(slot + p.off_weights) + ch.begin * static_cast<int64_t>(K),
                                              p.topk_weights + src_row * K, rows * K, gw, warps, lane);
            }
            // This warp's NVLink stores reach the system before it counts itself in; the warp
            // completing the count (every warp of the kernel counts once) publishes the chunk.
            ep::fence_acq_rel_sys();
            __syncwarp();
            if (lane == 0) {
                const int done = ep::atomic_add_release_gpu(ce_count(my_buf, d, c), 1) + 1;
                if (done == warps) {
                    ep::fence_acq_rel_sys();
                    ep::st_release_sys(ce_flag(buf(p.buffer_ptrs, d), p.rank, c), 1);
                }
            }
        }
        if (!any) {
            break;
        }
    }
}

// Mirrors `CeSmPullParams` in src/intranode/copy_engine.rs.
struct CeSmPullParams {
    uint64_t buffer_ptrs[kMaxRanks];
    int4* recv_x;               // [N, row_int4]
    float* recv_x_scales;       // [N, S] or null
    int* recv_src_idx;          // [N]
    int64_t* recv_topk_idx;     // [N, K] or null
    float* recv_topk_weights;   // [N, K] or null
    int* error_info;
    uint64_t timeout_ns;
    int64_t slot_bytes;
    int64_t off_scales;
    int64_t off_src;
    int64_t off_topk_idx;
    int64_t off_topk_weights;
    int row_begin[kMaxRanks];  // first receive row of source s
    int rows[kMaxRanks];       // rows from source s pulled by this kernel (0: not by SMs)
    int rank;
    int num_ranks;
    int row_int4;
    int num_scales;
    int num_topk;
    int first_chunk_rows;
    int max_chunk_rows;
    int sm_rows_mask;  // bit s: rows of source s move here (else only its metadata)
    int local_mask;    // bit s: source s pushed its rows into slot [s] of this rank's buffer
    int pad;
};
EP_CHECK_PARAMS_SIZE(CeSmPullParams, 264);

// Blocks [0, nblocks) of kCeThreads. Copies every source's metadata (src index,
// localised routing, scales) and the rows of the sources in `sm_rows_mask` (the others' rows
// move by copy engines). A source whose flag does not come within the timeout is recorded
// (naming it) and skipped; its rows stay unwritten.
__device__ void ce_sm_pull(const CeSmPullParams& p, int block, int nblocks) {
    const int lane = ep::lane_id();
    const int warps = nblocks * (kCeThreads / ep::kWarpSize);
    const int gw = block * (kCeThreads / ep::kWarpSize) + ep::warp_id();
    const int K = p.num_topk, S = p.num_scales;
    char* my_buf = buf(p.buffer_ptrs, p.rank);
    unsigned dead = 0;  // bit s: source s timed out
    for (int c = 0; c < kCeMaxChunks; ++c) {
        bool any = false;
        // Sources in the order rank - 1, rank - 2, ...: at any moment every GPU is pulled from
        // by one receiver, instead of several pulling from the same GPU while others idle.
        for (int k = 1; k < p.num_ranks; ++k) {
            const int s = (p.rank + p.num_ranks - k) % p.num_ranks;
            const CeChunk ch = ce_chunk_at(p.rows[s], c, p.first_chunk_rows, p.max_chunk_rows);
            if (ch.begin >= ch.end) {
                continue;
            }
            any = true;
            if ((dead >> s) & 1u) {
                continue;
            }
            int ok = 1;
            if (lane == 0) {
                const ep::Deadline deadline = ep::Deadline::after(p.timeout_ns);
                bool timed_out = false;
                ep::wait_flag_sys(ce_flag(my_buf, s, c), [](int v) { return v != 0; }, deadline, &timed_out);
                if (timed_out) {
                    report_timeout(p.error_info, kCeSmPullKernel, p.rank, s, kSiteCeSmPull);
                    ok = 0;
                }
            }
            if (!__shfl_sync(ep::kFullMask, ok, 0)) {
                dead |= 1u << s;
                continue;
            }
            // Rows [begin, end) of the slot and their metadata are contiguous, and so are
            // receive rows row_begin[s] + [begin, end) of each output.
            const char* slot = (p.local_mask >> s) & 1 ? my_buf + kRingBase + s * p.slot_bytes
                                                       : buf(p.buffer_ptrs, s) + kRingBase + p.rank * p.slot_bytes;
            const int64_t dst_row = p.row_begin[s] + ch.begin;
            const int64_t rows = ch.end - ch.begin;
            if ((p.sm_rows_mask >> s) & 1) {
                warp_share_copy<int4, true>(p.recv_x + dst_row * p.row_int4,
                                            reinterpret_cast<const int4*>(slot) + ch.begin * static_cast<int64_t>(p.row_int4),
                                            rows * p.row_int4, gw, warps, lane);
            }
            warp_share_copy<int, true>(p.recv_src_idx + dst_row,
                                       reinterpret_cast<const int*>(slot + p.off_src) + ch.begin, rows, gw, warps, lane);
            if (K > 0) {
                warp_share_copy<long long, true>(
                    reinterpret_cast<long long*>(p.recv_topk_idx) + dst_row * K,
                    reinterpret_cast<const long long*>(slot + p.off_topk_idx) + ch.begin * static_cast<int64_t>(K), rows * K,
                    gw, warps, lane);
                warp_share_copy<float, true>(p.recv_topk_weights + dst_row * K,
                                             reinterpret_cast<const float*>(slot + p.off_topk_weights) + ch.begin * static_cast<int64_t>(K),
                                             rows * K, gw, warps, lane);
            }
            if (S > 0) {
                warp_share_copy<float, true>(p.recv_x_scales + dst_row * S,
                                             reinterpret_cast<const float*>(slot + p.off_scales) + ch.begin * static_cast<int64_t>(S),
                                             rows * S, gw, warps, lane);
            }
        }
        if (!any) {
            break;
        }
    }
}

// Mirrors `CeDispatchParams` in src/intranode/copy_engine.rs.
struct CeDispatchParams {
    CePackParams pack;
    CeSmPullParams pull;
    int pack_blocks;  // blocks [0, pack_blocks) pack, the rest pull
    int pad;
};
EP_CHECK_PARAMS_SIZE(CeDispatchParams, 512);

// Grid: pack_blocks + any number of pull blocks (none when no peer sends rows), all of
// kCeThreads and resident at once (the pull waits only for peers' packs).
EP_KERNEL void __launch_bounds__(kCeThreads, 1) intranode_ce_dispatch(const CeDispatchParams p) {
    const int b = static_cast<int>(blockIdx.x);
    if (b < p.pack_blocks) {
        ce_pack(p.pack, b, p.pack_blocks);
    } else {
        ce_sm_pull(p.pull, b - p.pack_blocks, static_cast<int>(gridDim.x) - p.pack_blocks);
    }
}

// Mirrors `CeCombineParams` in src/intranode/copy_engine.rs.
struct CeCombineParams {
    CeReduceParams reduce;
    CeSmPushParams push;
    int reduce_blocks;  // blocks [0, reduce_blocks) reduce, the rest push
    int pad;
};
EP_CHECK_PARAMS_SIZE(CeCombineParams, 376);

// Grid: reduce_blocks + any number of push blocks (none when the copy engines serve every
// home), all of kCeThreads and resident at once: the reduce waits for every peer's pushes,
// which wait for nothing.
EP_KERNEL void __launch_bounds__(kCeThreads, 1) intranode_ce_combine(const CeCombineParams p) {
    const int b = static_cast<int>(blockIdx.x);
    if (b < p.reduce_blocks) {
        if (p.reduce.num_ranks <= 2) {
            ce_reduce<2>(p.reduce, b, p.reduce_blocks);
        } else if (p.reduce.num_ranks <= 4) {
            ce_reduce<4>(p.reduce, b, p.reduce_blocks);
        } else {
            ce_reduce<8>(p.reduce, b, p.reduce_blocks);
        }
    } else {
        ce_sm_push(p.push, b - p.reduce_blocks, static_cast<int>(gridDim.x) - p.reduce_blocks);
    }
}
