//! Launcher of the copy-engine dispatch: the fused pack + SM-pull kernel, and per
//! copy-engine source a wait kernel and a copy for each chunk on its copy streams.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig};

use super::copy_engine::params::{flag_offset, CePackParams, CeSmPullParams, CeWaitParams};
use super::copy_engine::streams::{copy, fork, join};
use super::copy_engine::{
    check_slot_capacity, dptr, launch_fused, op_sizes, CeConfig, CopyStreams, FusedGrid,
};
use crate::cuda::Kernels;
use crate::error::{Error, Result};
use crate::intranode::cuda::checks::args_payload_ptrs;
use crate::intranode::cuda::payload::dispatch_row_shape;
use crate::intranode::cuda::{to_i32, Payload, PeerBuffers, RecvPayload, RecvTopK, TopK};
use crate::intranode::cuda::{MAX_NVL_RANKS, RING_BASE};
use crate::intranode::{chunk_bounds, copy_engine_peer, CeSlotLayout};

/// The cubin of `copy_engine_dispatch.cu`.
const DISPATCH_FILE: &str = "intranode/copy_engine_dispatch";

/// Inputs and outputs of [`ce_dispatch_cuda`] (`T` tokens, `H` hidden, `K` top-k, `R` ranks,
/// `N` tokens received).
#[derive(Debug)]
pub struct CeDispatchArgs<'a> {
    /// The rows to send.
    pub x: Payload<'a>,
    /// Routing to send along (optional).
    pub topk: Option<TopK<'a>>,
    /// Number of experts `E` (ignored without `topk`).
    pub num_experts: usize,
    /// `[T, R]` from notify (`NotifyArgs::send_index`) or the handle.
    pub send_index: CudaView<'a, i32>,
    /// `[R, R]` from notify (or the handle).
    pub rank_prefix_matrix: CudaView<'a, i32>,
    /// Host copy of this rank's column of the prefix matrix as counts: rows from each source
    /// (notify's counter words `1..=R`).
    pub recv_per_source: &'a [usize],
    /// Out: the received rows (`N` = sum of `recv_per_source`).
    pub recv_x: RecvPayload<'a>,
    /// Out: `[N]` index of each received token on its source rank.
    pub recv_src_idx: CudaViewMut<'a, i32>,
    /// Out: localised routing (required iff `topk` is given).
    pub recv_topk: Option<RecvTopK<'a>>,
    /// Hidden size `H` (same on every rank).
    pub hidden: usize,
    /// Top-k `K` (0 without `topk`; same on every rank).
    pub num_topk: usize,
}

/// Launches the copy-engine dispatch: the pack kernel on `stream`, the pulls from every peer
/// on its copy stream, joined back into `stream` (after notify with `send_index` on every
/// rank; every rank must use the same `config`, hidden size, top-k and payload kind).
pub fn ce_dispatch_cuda(
    stream: &CudaStream,
    copies: &CopyStreams,
    buffers: &PeerBuffers,
    config: &CeConfig,
    args: CeDispatchArgs<'_>,
) -> Result<()> {
    let (r, me, t, n) = op_sizes(
        config,
        buffers,
        args.send_index.len(),
        args.rank_prefix_matrix.len(),
        args.recv_per_source,
    )?;
    let shape = dispatch_row_shape(&args.x, args.hidden)?;
    let (row_bytes, scales) = (shape.row_bytes, shape.scales);
    let k = args.num_topk;
    let lay = CeSlotLayout::dispatch(buffers.bytes(), r, row_bytes, scales, k);
    check_slot_capacity(buffers, &lay, t, args.recv_per_source, "dispatch")?;
    let payload = args_payload_ptrs!(stream, shape, args, t, n, r)?;
    Error::check_len("recv_src_idx", n, args.recv_src_idx.len())?;
    payload.check_row_align()?;
    let (push_first, push_max) = config.push_chunks();
    let kernels = Kernels::for_stream(stream)?;
    let fused = kernels.kernel(DISPATCH_FILE, "intranode_ce_dispatch")?;
    let wait = kernels.kernel(DISPATCH_FILE, "intranode_ce_wait")?;
    let (rsi, _g0) = args.recv_src_idx.device_ptr(stream);
    let mut params = CePackParams {
        buffer_ptrs: buffers.ptrs(),
        x: payload.x,
        x_scales: payload.x_scales,
        topk_idx: payload.topk_idx,
        topk_weights: payload.topk_weights,
        send_index: dptr(&args.send_index, stream),
        rank_prefix_matrix: dptr(&args.rank_prefix_matrix, stream),
        recv_x: payload.recv_x,
        recv_x_scales: payload.recv_x_scales,
        recv_src_idx: rsi,
        recv_topk_idx: payload.recv_topk_idx,
        recv_topk_weights: payload.recv_topk_weights,
        slot_bytes: lay.slot_bytes as i64,
        off_scales: lay.off_scales as i64,
        off_src: lay.off_src as i64,
        off_topk_idx: lay.off_topk_idx as i64,
        off_topk_weights: lay.off_topk_weights as i64,
        rank: to_i32("rank", me)?,
        num_ranks: to_i32("num_ranks", r)?,
        num_tokens: to_i32("num_tokens", t)?,
        row_int4: to_i32("hidden", row_bytes / 16)?,
        num_scales: to_i32("num_scales", scales)?,
        num_topk: to_i32("num_topk", k)?,
        experts_per_rank: to_i32("num_experts", payload.experts_per_rank)?,
        first_chunk_rows: to_i32("first_chunk_rows", config.first_chunk_rows)?,
        max_chunk_rows: to_i32("max_chunk_rows", config.max_chunk_rows)?,
        sm_push_mask: 0,
        own_rows_last: i32::from(config.own_rows_last),
        local_warps: to_i32("pack_local_warps", config.pack_local_warps)?,
        local_blocks: to_i32("pack_local_blocks", config.pack_local_blocks)?,
        push_first_chunk_rows: to_i32("push_first_chunk_rows", push_first)?,
        push_max_chunk_rows: to_i32("push_max_chunk_rows", push_max)?,
        pad: 0,
    };
    // The copy streams of the sources served by copy engines start after the outputs exist
    // and notify reset the flags.
    let peers = || (0..r).filter(move |&s| s != me && args.recv_per_source[s] > 0);
    let any_peer = peers().next().is_some();
    let by_engine = |s: usize| copy_engine_peer(me, s, r, config.copy_engine_peers);
    // Peers this rank and they push dispatch rows to each other (both directions by SMs).
    let pushed = |s: usize| {
        config.dispatch_push
            && s != me
            && !copy_engine_peer(me, s, r, config.copy_engine_peers)
            && !copy_engine_peer(s, me, r, config.copy_engine_peers)
    };
    // Sources whose pushed rows this GPU's copy engines copy out of its own buffer.
    let copied_out = move |s: usize| config.local_copy_out && pushed(s);
    let streams = || peers().filter(move |&s| by_engine(s) || copied_out(s));
    for s in (0..r).filter(|&s| pushed(s)) {
        params.sm_push_mask |= 1 << s;
    }
    fork(stream, copies, streams(), config.copy_lanes)?;
    // Every source's metadata, and the rows of the sources the copy engines do not serve,
    // move by the SM pull kernel; the copy streams pull the other sources' rows.
    let mut pull = CeSmPullParams {
        buffer_ptrs: buffers.ptrs(),
        recv_x: payload.recv_x,
        recv_x_scales: payload.recv_x_scales,
        recv_src_idx: rsi,
        recv_topk_idx: payload.recv_topk_idx,
        recv_topk_weights: payload.recv_topk_weights,
        error_info: buffers.error_info(),
        timeout_ns: buffers.timeout_ns(),
        slot_bytes: lay.slot_bytes as i64,
        off_scales: lay.off_scales as i64,
        off_src: lay.off_src as i64,
        off_topk_idx: lay.off_topk_idx as i64,
        off_topk_weights: lay.off_topk_weights as i64,
        row_begin: [0; MAX_NVL_RANKS],
        rows: [0; MAX_NVL_RANKS],
        rank: params.rank,
        num_ranks: params.num_ranks,
        row_int4: params.row_int4,
        num_scales: params.num_scales,
        num_topk: params.num_topk,
        first_chunk_rows: params.first_chunk_rows,
        max_chunk_rows: params.max_chunk_rows,
        sm_rows_mask: 0,
        local_mask: params.sm_push_mask,
        push_first_chunk_rows: params.push_first_chunk_rows,
        push_max_chunk_rows: params.push_max_chunk_rows,
        pad: 0,
    };
    // Receive row ranges per source (source-major order).
    let mut row_begin = [0usize; MAX_NVL_RANKS];
    let mut prefix = 0usize;
    for (begin, &m) in row_begin.iter_mut().zip(args.recv_per_source) {
        *begin = prefix;
        prefix += m;
    }
    for s in peers() {
        pull.row_begin[s] = to_i32("recv_per_source", row_begin[s])?;
        pull.rows[s] = to_i32("recv_per_source", args.recv_per_source[s])?;
        if !by_engine(s) && !copied_out(s) {
            pull.sm_rows_mask |= 1 << s;
        }
    }
    // Pack blocks, then (when any peer sends rows here) the SM pull blocks.
    // SAFETY: `CeDispatchParams` is the params type of `intranode_ce_dispatch`. Pack: the
    // views hold what it touches: T rows of x (and T*S scales, T*K routing), T*R send indices
    // and R*R prefixes from the same notify, N receive rows / indices / routing for the own
    // block (which lies in [0, N) because the prefixes sum to N); peer slots hold
    // `lay.capacity >= T` rows and fit in the buffers (CeSlotLayout), valid per
    // `PeerBuffers::new`. Pull: for each source s with rows[s] = m > 0 it reads rows [0, m)
    // of slot `me` in s's buffer (capacity >= m, checked) only after the flag of their chunk,
    // and writes receive rows [row_begin[s], + m), inside the N-row outputs.
    unsafe {
        launch_fused(
            stream,
            &fused,
            FusedGrid::new(config, any_peer, 0),
            t,
            params,
            pull,
        )
    }?;
    // The copy-engine sources' chunks, each pulled once its flag is up (or, for sources that
    // pushed them, copied out of this rank's own buffer). Launched after the kernel: a wait
    // kernel that shares a hardware queue with it must not hold it back.
    for s in streams() {
        let m = args.recv_per_source[s];
        let dst_row0 = row_begin[s];
        let slot = if copied_out(s) {
            buffers.ptr(me) + (RING_BASE + s * lay.slot_bytes) as u64
        } else {
            buffers.ptr(s) + (RING_BASE + me * lay.slot_bytes) as u64
        };
        let (first, max) = if pushed(s) {
            (push_first, push_max)
        } else {
            (config.first_chunk_rows, config.max_chunk_rows)
        };
        for (j, (b, e)) in chunk_bounds(m, first, max).into_iter().enumerate() {
            let cs = copies.get(s, j % config.copy_lanes)?;
            let wp = CeWaitParams {
                flag: buffers.ptr(me) + flag_offset(s, j),
                error_info: buffers.error_info(),
                timeout_ns: buffers.timeout_ns(),
                rank: to_i32("rank", me)?,
                awaited: to_i32("rank", s)?,
            };
            let one = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `wp` matches `CeWaitParams`; the flag lies in this rank's header and the
            // error record is the buffers' (valid per `PeerBuffers::new`).
            unsafe { wait.launch(cs, one, wp) }?;
            // SAFETY: the source rows [b, e) of slot `me` in peer `s`'s buffer (or of slot `s`
            // in this rank's, where `s` pushed them) were published by the flag awaited above;
            // the destination rows lie in recv_x (N rows, checked); `stream` joins `cs` before
            // the views' guards are released.
            unsafe {
                copy(
                    cs,
                    payload.recv_x + ((dst_row0 + b) * row_bytes) as u64,
                    slot + (b * row_bytes) as u64,
                    (e - b) * row_bytes,
                )
            }?;
        }
    }
    join(stream, copies, streams(), config.copy_lanes)
}
