// Low-latency dispatch and combine at world size 1: the whole op stays on this GPU, so none of
// the protocol of `protocol.cuh` (buffer sets, signals, flags, fences, op counters, grid-wide
// waits) is needed. Launched by `dispatch_cuda` / `combine_cuda` (`cuda/local.rs`) instead of
// `ll_dispatch` / `ll_combine` when `num_ranks == 1` and the phases are `Both`; the outputs are
// bit for bit those of the protocol kernels at one rank (host twins: `host.rs`, `fp8/host.rs`).
//
// At R = 1 there are L = E local experts and M = max_tokens rows per expert; slot(t, k) is the
// number of earlier entries (flattened order) routed to the same expert (`send_slots`), and
// the row of (t, k) in its expert's region is the slot (the only source's offset is 0).
//
// Dispatch: (t, k) is placed in row e * M + slot(t, k) when its expert e is in [0, E), the
// rank is active (`active_ranks[0]`) and slot < M (always true for well-formed input: a token's
// experts are distinct and T <= M, so slot <= t < M). recv_count[e] and the layout range
// (0, n) carry n = the number of valid selections of e (what `ll_dispatch` signals and its
// receive phase counts), 0 when the rank is inactive; recv_src_info is -1 in every row from n
// on, and recv_src_topk is written for placed rows only, as in `ll_dispatch`. The top-k
// weights (a dispatch for a per-rank combine) are not needed: at one rank a per-rank combine
// gives the bits of a per-expert one, and `combine_cuda` runs it per expert.
//
// Combine: out[t] = sum over k in order of w[t, k] * x[e * M + slot(t, k)] in f32 (separate
// multiply and add), packed to bf16, over the (t, k) whose expert is in [0, E), with the rank
// active, and whose row the dispatch placed, which is checked with the handle:
// src_info[row] == t and src_topk[row] == k. `ll_combine` reads the combine row (t, k) of its
// buffer, written only from a handle row that names (t, k); when no such row exists (slot >= M,
// or a handle of a dispatch made while the rank was inactive) it reads whatever an older op
// left there, which is not reproducible: the local path adds nothing for such a (t, k).
//
// Sequencing: these kernels do not read or advance the control words (op sequence, arrival
// counters, pending-receive FIFOs). That stays consistent because the op sequence only pairs
// the ops of different ranks and picks a buffer set, and at one rank the runtime always runs
// ops with `Phases::Both` (served here, touching no buffer set); split-phase launches, which
// keep using `ll_dispatch` / `ll_combine`, take and advance the counters among themselves, and
// a skipped op changes nothing they rely on (a Send pushes its own sequence to the FIFO that
// the matching Recv pops; parity and tags only have to differ between consecutive ops of the
// protocol kernels, which they still do). Like every launch with a receive phase, both kernels
// leave the active mask in the host-mapped mirror.
//
// Work split: blocks of kThreads threads; an item is (token, chunk of the hidden dimension) and
// every block takes a contiguous range of items, so consecutive items of one token share the
// slots. Every dispatch block builds the top-k table and the expert histogram in shared memory
// (cheap), so the per-expert outputs need no cross-block communication: no global atomics, no
// fences, no grid-wide waits.
#include "common.cuh"
#include "low_latency.cuh"

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / ep::kWarpSize;
// Largest top-k (Rust: `LL_MAX_TOPK`).
constexpr int kMaxTopk = 16;
// Dispatch: 16 channels per thread (an eighth of an fp8 group), so a chunk is whole groups.
constexpr int kDispatchChans = kThreads * 16;
// Combine: one 16-byte vector (8 channels) per thread and item; rows loaded per batch.
constexpr int kCombineBatch = 8;

}  // namespace

struct LocalDispatchParams {
    const __nv_bfloat16* x;      // [T, H]
    const int64_t* topk_idx;     // [T, K]
    const int32_t* active;       // active_ranks [1] in the buffer's control area
    int32_t* active_mirror;      // [1] host-mapped, or null
    uint8_t* recv_x;             // [E, M, H] fp8 bytes or bf16
    float* recv_scales;          // [E, M, H/128] (fp8 only)
    int32_t* recv_count;         // [E]
    int32_t* recv_src_info;      // [E, M] source token index, -1 past recv_count
    int32_t* recv_src_topk;      // [E, M] top-k position of placed rows
    int32_t* recv_layout_range;  // [E, 1, 2] (offset, count)
    int32_t num_tokens;
    int32_t num_topk;
    int32_t num_experts;
    int32_t max_tokens;
    int32_t hidden;
    uint32_t fp8;                // 0: bf16 payload, 1: fp8 e4m3 + f32 scales
    uint32_t scale_format;       // 0: amax / 448, 1: UE8M0
    uint32_t reserved;
};
EP_CHECK_PARAMS_SIZE(LocalDispatchParams, 112);

struct LocalCombineParams {
    const __nv_bfloat16* x;      // [E, M, H] expert outputs in the dispatch's row order
    const int64_t* topk_idx;     // [T, K]
    const float* topk_weights;   // [T, K]
    const int32_t* src_info;     // [E, M]
    const int32_t* src_topk;     // [E, M]
    const int32_t* active;       // active_ranks [1] in the buffer's control area
    int32_t* active_mirror;      // [1] host-mapped, or null
    __nv_bfloat16* out;          // [T, H]
    int32_t num_tokens;
    int32_t num_topk;
    int32_t num_experts;
    int32_t max_tokens;
    int32_t hidden;
    uint32_t reserved;
};
EP_CHECK_PARAMS_SIZE(LocalCombineParams, 88);

namespace {

// This block's contiguous share [lo, hi) of `items`.
EP_DEVICE void block_items(int64_t items, int64_t& lo, int64_t& hi) {
    lo = items * blockIdx.x / gridDim.x;
    hi = items * (blockIdx.x + 1) / gridDim.x;
}

// One thread reads the mask (volatile, like the protocol kernels) and block 0 leaves it in the
// host-mapped mirror (the host reads it after the launch has completed).
EP_DEVICE int read_active(const int32_t* active, int32_t* mirror) {
    const int a = ep::ld_volatile(active);
    if (blockIdx.x == 0 && mirror != nullptr) {
        mirror[0] = a;
    }
    return a;
}

// The first n entries of the top-k table into s_topk, entries outside [0, E) (the host twin
// rejects them) as -1; with s_cnt (zeroed), also counts the valid ones per expert. Loads go out
// in batches, not one latency per entry.
EP_DEVICE void load_topk(const int64_t* topk_idx, int n, int E, int* s_topk, int* s_cnt) {
    constexpr int kBatch = 4;
    for (int base = 0; base < n; base += kThreads * kBatch) {
        int64_t ev[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int i = base + u * kThreads + static_cast<int>(threadIdx.x);
            ev[u] = i < n ? topk_idx[i] : -1;
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int i = base + u * kThreads + static_cast<int>(threadIdx.x);
            const bool valid = ev[u] >= 0 && ev[u] < E;
            if (i < n) {
                s_topk[i] = valid ? static_cast<int>(ev[u]) : -1;
            }
            if (valid && s_cnt != nullptr) {
                atomicAdd(s_cnt + ev[u], 1);
            }
        }
    }
}

// Warp-collective: slot of entry `idx` routed to expert e >= 0, the number of earlier entries
// of `s_topk` routed to e (the host twin `send_slots`).
EP_DEVICE int slot_of(const int* s_topk, int idx, int e) {
    int slot = 0;
#pragma unroll 4
    for (int j = ep::lane_id(); j < idx; j += ep::kWarpSize) {
        slot += s_topk[j] == e ? 1 : 0;
    }
    return ep::warp_reduce_sum(slot);
}

// Rows of token t's K entries into s_row (-1: not placed). Every thread of the block calls it.
EP_DEVICE void token_rows(const int* s_topk, int t, int K, int M, bool active, int64_t* s_row) {
    const int lane = ep::lane_id();
    for (int k = ep::warp_id(); k < K; k += kWarps) {
        const int idx = t * K + k;
        const int e = s_topk[idx];
        const int slot = e >= 0 ? slot_of(s_topk, idx, e) : 0;
        if (lane == 0) {
            s_row[k] = e >= 0 && active && slot < M ? static_cast<int64_t>(e) * M + slot : -1;
        }
    }
}

}  // namespace

// Grid: any size (the launcher covers the items and the per-expert fills). Dynamic shared
// memory: 4 * (T * K + E) bytes (top-k table, histogram).
EP_KERNEL void __launch_bounds__(kThreads) ll_local_dispatch(const __grid_constant__ LocalDispatchParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int64_t s_row[kMaxTopk];
    __shared__ int s_active;
    const int T = p.num_tokens, K = p.num_topk, E = p.num_experts, M = p.max_tokens, H = p.hidden;
    const int tid = threadIdx.x;
    const int total = T * K;
    int* s_topk = reinterpret_cast<int*>(smem);
    int* s_cnt = s_topk + total;

    // Items (t, chunk of kDispatchChans channels): the token's 16 channels of this thread are
    // read once and written to the rows of its K entries. A lane octet holds one 128-channel
    // group (as in `ll_dispatch`'s cast); `has` is the same within an octet (H is whole groups).
    const int chunks = ep::ceil_div(H, kDispatchChans);
    const int groups = H / ep::kFp8Group;
    int64_t lo, hi;
    block_items(static_cast<int64_t>(T) * chunks, lo, hi);
    int4 a = make_int4(0, 0, 0, 0), c = a;
    auto load = [&](int64_t item) {
        const int t = static_cast<int>(item / chunks);
        const int c0 = static_cast<int>(item - static_cast<int64_t>(t) * chunks) * kDispatchChans;
        if (c0 + tid * 16 < H) {
            ep::ll::load_bf16x16(p.x + static_cast<int64_t>(t) * H + c0, tid >> 3, tid & 7, a, c);
        }
    };
    // The first item's row is in flight with the start-up loads.
    if (lo < hi) {
        load(lo);
    }
    if (tid == 0) {
        s_active = read_active(p.active, p.active_mirror);
    }
    for (int e = tid; e < E; e += kThreads) {
        s_cnt[e] = 0;
    }
    __syncthreads();
    load_topk(p.topk_idx, total, E, s_topk, s_cnt);
    __syncthreads();
    const bool active = s_active != 0;

    // Per expert (a block each): the count, the range, and -1 in the source-token entries from
    // the count on (the rows below it are placed by the items below).
    for (int e = blockIdx.x; e < E; e += gridDim.x) {
        const int count = active ? s_cnt[e] : 0;
        if (tid == 0) {
            p.recv_count[e] = count;
            p.recv_layout_range[static_cast<int64_t>(e) * 2] = 0;
            p.recv_layout_range[static_cast<int64_t>(e) * 2 + 1] = count;
        }
        int32_t* info = p.recv_src_info + static_cast<int64_t>(e) * M;
        for (int row = count + tid; row < M; row += kThreads) {
            info[row] = -1;
        }
    }
    int cur_t = -1;
    for (int64_t item = lo; item < hi; ++item) {
        if (item != lo) {
            load(item);
        }
        const int t = static_cast<int>(item / chunks);
        const int chunk = static_cast<int>(item - static_cast<int64_t>(t) * chunks);
        if (t != cur_t) {
            __syncthreads();  // the previous token's copy is done with s_row
            token_rows(s_topk, t, K, M, active, s_row);
            __syncthreads();
            cur_t = t;
        }
        if (chunk == 0 && tid < K) {
            const int64_t row = s_row[tid];
            if (row >= 0) {
                p.recv_src_info[row] = t;
                p.recv_src_topk[row] = tid;
            }
        }
        const int c0 = chunk * kDispatchChans + tid * 16;  // this thread's first channel
        const bool has = c0 < H;
        if (p.fp8) {
            const int g = c0 / ep::kFp8Group;
            int4 q;
            float scale;
            ep::ll::cast_e4m3_x16(a, c, has, p.scale_format, q, scale);
            if (has) {
                for (int k = 0; k < K; ++k) {
                    const int64_t row = s_row[k];
                    if (row >= 0) {
                        *reinterpret_cast<int4*>(p.recv_x + row * H + c0) = q;
                        if ((tid & 7) == 0) {
                            p.recv_scales[row * groups + g] = scale;
                        }
                    }
                }
            }
        } else if (has) {
            for (int k = 0; k < K; ++k) {
                const int64_t row = s_row[k];
                if (row >= 0) {
                    int4* dst = reinterpret_cast<int4*>(p.recv_x + (row * H + c0) * 2);
                    dst[0] = a;
                    dst[1] = c;
                }
            }
        }
    }
}

// Grid: any size (the launcher covers the items). Dynamic shared memory: 4 * T * K bytes (the
// top-k table, of which a block loads the prefix its tokens need).
EP_KERNEL void __launch_bounds__(kThreads) ll_local_combine(const __grid_constant__ LocalCombineParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int64_t s_row[kMaxTopk];
    __shared__ float s_w[kMaxTopk];
    __shared__ int s_active;
    const int T = p.num_tokens, K = p.num_topk, E = p.num_experts, M = p.max_tokens, H = p.hidden;
    const int tid = threadIdx.x;
    int* s_topk = reinterpret_cast<int*>(smem);

    // Items (t, chunk of kThreads vectors of 8 channels).
    const int vpr = H / 8;
    const int chunks = ep::ceil_div(vpr, kThreads);
    int64_t lo, hi;
    block_items(static_cast<int64_t>(T) * chunks, lo, hi);
    if (tid == 0) {
        s_active = read_active(p.active, p.active_mirror);
    }
    // The first token's weights are in flight with the start-up loads.
    const int t_first = lo < hi ? static_cast<int>(lo / chunks) : -1;
    const bool first_w = t_first >= 0 && tid < K;
    const float w_first = first_w ? p.topk_weights[static_cast<int64_t>(t_first) * K + tid] : 0.0f;
    // The slots of this block's tokens need the table up to its last token.
    const int n = lo < hi ? static_cast<int>((hi - 1) / chunks + 1) * K : 0;
    load_topk(p.topk_idx, n, E, s_topk, nullptr);
    if (first_w) {
        s_w[tid] = w_first;
    }
    __syncthreads();
    const bool active = s_active != 0;

    int cur_t = -1;
    for (int64_t item = lo; item < hi; ++item) {
        const int t = static_cast<int>(item / chunks);
        const int chunk = static_cast<int>(item - static_cast<int64_t>(t) * chunks);
        if (t != cur_t) {
            __syncthreads();  // the previous token's reduction is done with s_row and s_w
            if (t != t_first && tid < K) {
                s_w[tid] = p.topk_weights[static_cast<int64_t>(t) * K + tid];
            }
            token_rows(s_topk, t, K, M, active, s_row);
            __syncthreads();
            cur_t = t;
        }
        const int i = chunk * kThreads + tid;
        if (i >= vpr) {
            continue;
        }
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            acc[j] = 0.0f;
        }
        // In k order, as the host twin; a batch's rows and handle entries load together.
        for (int k0 = 0; k0 < K; k0 += kCombineBatch) {
            int4 v[kCombineBatch];
            uint32_t placed = 0;  // bit q: the handle names (t, k0 + q) for its row
#pragma unroll
            for (int q = 0; q < kCombineBatch; ++q) {
                const int k = k0 + q;
                const int64_t row = k < K ? s_row[k] : -1;
                if (row >= 0) {
                    v[q] = ep::ld_nc_no_alloc(reinterpret_cast<const int4*>(p.x + row * H) + i);
                    const int src_t = __ldg(p.src_info + row);
                    const int src_k = __ldg(p.src_topk + row);
                    placed |= src_t == t && src_k == k ? 1u << q : 0u;
                }
            }
#pragma unroll
            for (int q = 0; q < kCombineBatch; ++q) {
                // The row of (t, k) as the dispatch placed it (see the file comment).
                if ((placed >> q) & 1u) {
                    ep::ll::accumulate_bf16x8(acc, v[q], s_w[k0 + q]);
                }
            }
        }
        *reinterpret_cast<int4*>(p.out + static_cast<int64_t>(t) * H + static_cast<int64_t>(i) * 8) =
            ep::ll::pack_bf16x8(acc);
    }
}
