// Shared pieces of the copy-engine path of the intranode (NVLink) normal mode: the dispatch
// (`copy_engine_dispatch.cu`) and the combine (`copy_engine_combine.cu`). Launchers:
// `src/intranode/cuda/copy_engine_{dispatch,combine}.rs`; design: docs/design.md; the NVLink
// buffer (flags, chunk counters, work queues, slots): `intranode.cuh`. Run after `notify.cu`.
//
// The NVLink bytes of `copy_engine_peers` peers move by copy engines (cuMemcpyDtoDAsync), those
// of the others by SM warps (next section); `intranode_ce_dispatch` = pack + SM pulls,
// `intranode_ce_combine` = reduce + SM pushes (`intranode_ce_combine_roles`: both in every
// block):
//   * dispatch: the pack (`ce_pack`, SMs, local memory only) writes this rank's rows for each
//     peer d, in d's receive order, into slot d of this rank's own buffer and its local rows
//     straight into recv_x; chunk counters in this rank's header count finished rows and the
//     warp that completes a chunk raises flag [rank][chunk] in d's header. The receiver's copy
//     streams (one per source) wait for each chunk (`intranode_ce_wait`, one thread, with the
//     device timeout) and pull it into recv_x with a copy engine.
//   * combine: each rank's copy streams push its rows for home s (a contiguous block of its
//     combine input) into slot [rank] of s's buffer, chunk by chunk, each followed by a stream
//     write of flag [rank][chunk] in the home's header; the reduce (`ce_reduce`) on the home
//     polls those flags in its own memory and sums the rows in rank order. The copy-engine
//     home's stream also pushes the last `combine_ce_tail_chunks` chunks of the SM homes
//     (next section), interleaved chunk by chunk with its own home's.
//
// Slots start at kRingBase: slot d at kRingBase + d * slot_bytes (offsets in the params).
// Chunk c of a block of m rows: see `ce_chunk`, mirrored by `chunk_bounds` in
// src/intranode/ce_layout.rs. The dispatch's pushed blocks (between SM peers) have a chunking
// of their own (`push_first_chunk_rows` / `push_max_chunk_rows` in the params).
// ---------------------------------------------------------------------------------------------

#pragma once

#include "intranode.cuh"

namespace {

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

// Chunks of a block of `m` rows (`ce_chunk`'s schedule): 0 for an empty block.
EP_DEVICE int ce_num_chunks(int m, int first_rows, int max_rows) {
    return m > 0 ? ce_chunk(m, m - 1, first_rows, max_rows).index + 1 : 0;
}

constexpr int kCeThreads = 768;
constexpr int kCePackUnroll = 7;

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

// Counts `n` finished rows (or warps) into `count` (gpu-scope release); the call that brings it
// to `target` publishes the chunk: a system fence, then `flag` set with a system-scope release.
// The caller orders its stores before the call (warp barrier, and a system fence for NVLink
// stores it wants covered without the cumulativity argument).
EP_DEVICE void ce_count_and_publish(int* count, int n, int target, int* flag) {
    if (ep::atomic_add_release_gpu(count, n) + n == target) {
        ep::fence_acq_rel_sys();
        ep::st_release_sys(flag, 1);
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Copy-engine path, SM peers. The copy engines of one GPU do not add up over peers (measured:
// docs/benchmarks.md, "What NVLink carries"), so beyond 2 ranks the copy engines serve
// `copy_engine_peers` peers and SM warps move the bytes of the others, with the same slots,
// chunks and flags, so the receive side cannot tell which engine moved a chunk:
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
// another idles; in the push a warp fences and counts itself once per (chunk, peer). The
// combine with both roles in every block (`intranode_ce_combine_roles`) pushes the same chunks
// in items of a few rows taken from a work queue in chunk order, counting rows instead.
//
// Both run as extra blocks of the pack and reduce kernels, not as kernels of their own on
// another stream: the reduce waits for peers' pushes, and two streams may share one hardware
// queue, where a push kernel queued behind its own rank's reduce would never start.
// ---------------------------------------------------------------------------------------------
