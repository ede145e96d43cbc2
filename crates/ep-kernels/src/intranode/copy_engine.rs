//! The copy-engine path of the intranode normal mode: SMs pack and reduce in local memory, and
//! the NVLink bytes move by the GPUs' copy engines (`cuMemcpyDtoDAsync` between NVLink buffers
//! and tensors) for `copy_engine_peers` peers and by SM warps for the others (the copy engines
//! of one GPU do not scale past one peer). Kernels: `intranode_ce_dispatch` (pack + SM pulls),
//! `intranode_ce_wait`, `intranode_ce_combine` (reduce + SM pushes) in `intranode.cu`; the
//! protocol is described there and in `docs/design.md`.
//!
//! One op on every rank of a node, each rank on its own stream (plus its [`CopyStreams`]):
//!
//! 1. dispatch: [`super::notify_dispatch_cuda`] with `send_index`, poll the counters (word
//!    `1 + s` = rows from source `s`), allocate, then [`ce_dispatch_cuda`];
//! 2. combine: [`super::cached_notify_cuda`], then [`ce_combine_cuda`] with the dispatch's
//!    `send_index` and per-source counts.
//!
//! Results equal the ring path's (and the host twins'): the same receive order, the same
//! combine sums in rank order.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig};

use super::ce_layout::{chunk_bounds, copy_engine_peer, CeSlotLayout, CE_MAX_CHUNKS, CE_SLOT_BASE};
use super::cuda::{
    combine_weights_ptrs, dispatch_payload_ptrs, dispatch_row_shape, to_i32, Payload,
    PayloadCounts, PeerBuffers, RecvPayload, RecvTopK, TopK, FILE, MAX_NVL_RANKS, RING_BASE,
};
use crate::cuda::{check_align, KernelParams, Kernels};
use crate::error::{Error, Result};

const _: () = assert!(CE_SLOT_BASE == RING_BASE);

/// Threads of the pack and reduce kernel blocks (`kCeThreads`).
const CE_THREADS: u32 = 768;
/// Launch configuration of the copy-engine path.
///
/// The copy engines of one GPU carry about 360 GB/s to one peer but only about 195 GB/s in
/// total to three (4 x H200, `scripts/gpu/probe`), so they serve `copy_engine_peers` peers and
/// SM warps move the other peers' bytes with the same slots, chunks and flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CeConfig {
    /// Blocks (SMs) of the pack (dispatch) and reduce (combine) kernels.
    pub num_sms: usize,
    /// Rows of the first chunk of each block; each next chunk doubles, up to `max_chunk_rows`.
    pub first_chunk_rows: usize,
    /// Largest chunk (raised to `ceil(m / 16)` for blocks of `m` rows).
    pub max_chunk_rows: usize,
    /// Peers served by the copy engines (see [`copy_engine_peer`]); SM warps serve the rest.
    pub copy_engine_peers: usize,
    /// Blocks (SMs, 1024 threads) of the SM copy kernel: dispatch pulls the rows of the peers
    /// not served by copy engines and every peer's metadata; combine pushes the rows of the
    /// peers not served by copy engines. Unused (no launch) when it has nothing to move.
    pub sm_blocks: usize,
    /// Dispatch: between two peers that both serve each other by SM copies, the pack writes
    /// the rows straight into the peer's buffer over NVLink (stores need no round trip) and the
    /// peer's SM blocks copy them out locally, instead of the peer pulling them over NVLink.
    pub dispatch_push: bool,
    /// Dispatch: the pack first stores every token's rows for the peers, then (a second pass
    /// over the tokens, reading `x` again) this rank's own rows, so the peers' chunks, which
    /// the copy engines and SM copies wait for, complete sooner. `false`: one pass, each row
    /// read once and stored to every destination.
    pub own_rows_last: bool,
    /// Dispatch: copy streams per copy-engine peer (1 to [`MAX_COPY_LANES`]). Chunks take
    /// them in turn, so that a chunk's wait and copy set-up overlap the previous chunk's copy.
    /// Combine always uses one per home (its weights copy and chunk flags stay in order).
    pub copy_lanes: usize,
    /// Dispatch, with `dispatch_push`: the rows the peers pushed into this rank's buffer are
    /// copied out into `recv_x` by this GPU's copy engines (one contiguous block per chunk, on
    /// the source's copy streams) instead of by the SM copy blocks, which then move only the
    /// metadata; the SMs saved can pack (and push) instead.
    pub local_copy_out: bool,
}

/// Most copy streams per peer ([`CeConfig::copy_lanes`]).
pub const MAX_COPY_LANES: usize = 2;

impl Default for CeConfig {
    /// The combine defaults ([`CeConfig::combine_default`]).
    fn default() -> Self {
        Self::combine_default()
    }
}

impl CeConfig {
    /// Dispatch defaults for 2 ranks and 24 SMs ([`CeConfig::dispatch_for`]).
    pub fn dispatch_default() -> Self {
        Self::dispatch_for(2, 24)
    }

    /// Combine defaults for 2 ranks and 24 SMs ([`CeConfig::combine_for`]).
    pub fn combine_default() -> Self {
        Self::combine_for(2, 24)
    }

    /// Dispatch split of `sms` SMs (at least 3) for `num_ranks` ranks, one copy-engine peer, the
    /// own rows packed last and two copy streams per copy-engine peer. Two ranks: all but 2 SMs
    /// pack and 2 pull the metadata, chunks of 768 rows doubling to 4096 (on 2 x H200, 4096 x
    /// 7168 tokens, top-8 of 256: about 548 GB/s bf16, 441 fp8). More ranks: two thirds of the SMs
    /// pack (pushing the rows of the SM peers into their buffers), the receiver's copy engines
    /// copy the pushed rows out (`local_copy_out`) and the other third moves the metadata,
    /// chunks of 1024 doubling to 4096 (about 354 / 291 GB/s at EP4, where the SM rings reach
    /// 369 / 299).
    pub fn dispatch_for(num_ranks: usize, sms: usize) -> Self {
        let sms = sms.max(3);
        if num_ranks <= 2 {
            Self {
                num_sms: sms - 2,
                first_chunk_rows: 768,
                max_chunk_rows: 4096,
                copy_engine_peers: 1,
                sm_blocks: 2,
                dispatch_push: true,
                own_rows_last: true,
                copy_lanes: 2,
                local_copy_out: false,
            }
        } else {
            Self {
                num_sms: sms - sms / 3,
                first_chunk_rows: 1024,
                max_chunk_rows: 4096,
                copy_engine_peers: 1,
                sm_blocks: (sms / 3).max(1),
                dispatch_push: true,
                own_rows_last: true,
                copy_lanes: 2,
                local_copy_out: true,
            }
        }
    }

    /// Combine split of `sms` SMs (at least 3) for `num_ranks` ranks, one copy-engine peer. Two
    /// ranks: every SM reduces (the copy engines push everything), chunks of 1024 rows doubling
    /// to 4096 (577 GB/s on 2 x H200, same shape). More ranks: two thirds reduce and one third push to
    /// the peers beyond the copy engines' one, chunks of 256 doubling to 1024 (335 GB/s at EP4,
    /// where the SM rings reach 354).
    pub fn combine_for(num_ranks: usize, sms: usize) -> Self {
        let sms = sms.max(3);
        if num_ranks <= 2 {
            Self {
                num_sms: sms,
                first_chunk_rows: 1024,
                max_chunk_rows: 4096,
                copy_engine_peers: 1,
                sm_blocks: 1,
                dispatch_push: true,
                own_rows_last: true,
                copy_lanes: 2,
                local_copy_out: false,
            }
        } else {
            Self {
                num_sms: sms - sms / 3,
                first_chunk_rows: 256,
                max_chunk_rows: 1024,
                copy_engine_peers: 1,
                sm_blocks: (sms / 3).max(1),
                dispatch_push: true,
                own_rows_last: true,
                copy_lanes: 2,
                local_copy_out: false,
            }
        }
    }

    /// Checks `1 <= num_sms <= 1024`, `1 <= sm_blocks <= 1024` and
    /// `1 <= first_chunk_rows <= max_chunk_rows <= 2^24`.
    pub fn validate(&self) -> Result<()> {
        if self.num_sms == 0 || self.num_sms > 1024 {
            return Err(Error::invalid(
                "num_sms",
                self.num_sms,
                "must be in [1, 1024]",
            ));
        }
        if self.sm_blocks == 0 || self.sm_blocks > 1024 {
            return Err(Error::invalid(
                "sm_blocks",
                self.sm_blocks,
                "must be in [1, 1024]",
            ));
        }
        if self.first_chunk_rows == 0 || self.first_chunk_rows > self.max_chunk_rows {
            return Err(Error::invalid(
                "first_chunk_rows",
                self.first_chunk_rows,
                format!("must be in [1, max_chunk_rows = {}]", self.max_chunk_rows),
            ));
        }
        if self.copy_lanes == 0 || self.copy_lanes > MAX_COPY_LANES {
            return Err(Error::invalid(
                "copy_lanes",
                self.copy_lanes,
                format!("must be in [1, {MAX_COPY_LANES}]"),
            ));
        }
        if self.max_chunk_rows > 1 << 24 {
            return Err(Error::invalid(
                "max_chunk_rows",
                self.max_chunk_rows,
                "must be <= 2^24",
            ));
        }
        Ok(())
    }
}

/// The copy streams of one rank: [`MAX_COPY_LANES`] per peer, so that a late peer delays only
/// its own copies.
#[derive(Debug)]
pub struct CopyStreams {
    streams: Vec<Arc<CudaStream>>,
}

impl CopyStreams {
    /// Creates `MAX_COPY_LANES` streams per rank on `ctx` (those of this rank's own index stay
    /// unused).
    pub fn new(ctx: &Arc<CudaContext>, num_ranks: usize) -> Result<Self> {
        let streams = (0..num_ranks * MAX_COPY_LANES)
            .map(|_| ctx.new_stream())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Self { streams })
    }

    /// Copy stream `lane` of `peer`.
    fn get(&self, peer: usize, lane: usize) -> Result<&Arc<CudaStream>> {
        self.streams
            .get(peer * MAX_COPY_LANES + lane % MAX_COPY_LANES)
            .ok_or_else(|| {
                Error::invalid(
                    "copy_streams",
                    format!("{} streams", self.streams.len()),
                    format!("needs {MAX_COPY_LANES} per rank (peer {peer})"),
                )
            })
    }
}

/// Mirror of `CePackParams` in intranode.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CePackParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    x: CUdeviceptr,
    x_scales: CUdeviceptr,
    topk_idx: CUdeviceptr,
    topk_weights: CUdeviceptr,
    send_index: CUdeviceptr,
    rank_prefix_matrix: CUdeviceptr,
    recv_x: CUdeviceptr,
    recv_x_scales: CUdeviceptr,
    recv_src_idx: CUdeviceptr,
    recv_topk_idx: CUdeviceptr,
    recv_topk_weights: CUdeviceptr,
    slot_bytes: i64,
    off_scales: i64,
    off_src: i64,
    off_topk_idx: i64,
    off_topk_weights: i64,
    rank: i32,
    num_ranks: i32,
    num_tokens: i32,
    row_int4: i32,
    num_scales: i32,
    num_topk: i32,
    experts_per_rank: i32,
    first_chunk_rows: i32,
    max_chunk_rows: i32,
    sm_push_mask: i32,
    own_rows_last: i32,
    reserved: i32,
}
const _: () = assert!(std::mem::size_of::<CePackParams>() == 240);

/// Mirror of `CeWaitParams` in intranode.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CeWaitParams {
    flag: CUdeviceptr,
    error_info: CUdeviceptr,
    timeout_ns: u64,
    rank: i32,
    awaited: i32,
}
const _: () = assert!(std::mem::size_of::<CeWaitParams>() == 32);
// SAFETY: repr(C) plain data mirroring `CeWaitParams` in intranode.cu.
unsafe impl KernelParams for CeWaitParams {}

/// Mirror of `CeReduceParams` in intranode.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CeReduceParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    x: CUdeviceptr,
    topk_weights: CUdeviceptr,
    send_index: CUdeviceptr,
    rank_prefix_matrix: CUdeviceptr,
    combined_x: CUdeviceptr,
    combined_topk_weights: CUdeviceptr,
    error_info: CUdeviceptr,
    timeout_ns: u64,
    slot_bytes: i64,
    off_weights: i64,
    rank: i32,
    num_ranks: i32,
    num_tokens: i32,
    row_int4: i32,
    num_topk: i32,
    first_chunk_rows: i32,
    max_chunk_rows: i32,
    pad: i32,
}
const _: () = assert!(std::mem::size_of::<CeReduceParams>() == 176);

/// Mirror of `CeSmPushParams` in intranode.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CeSmPushParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    x: CUdeviceptr,
    topk_weights: CUdeviceptr,
    slot_bytes: i64,
    off_weights: i64,
    row_begin: [i32; MAX_NVL_RANKS],
    rows: [i32; MAX_NVL_RANKS],
    rank: i32,
    num_ranks: i32,
    row_int4: i32,
    num_topk: i32,
    first_chunk_rows: i32,
    max_chunk_rows: i32,
    pad: [i32; 2],
}
const _: () = assert!(std::mem::size_of::<CeSmPushParams>() == 192);

/// Mirror of `CeSmPullParams` in intranode.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CeSmPullParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    recv_x: CUdeviceptr,
    recv_x_scales: CUdeviceptr,
    recv_src_idx: CUdeviceptr,
    recv_topk_idx: CUdeviceptr,
    recv_topk_weights: CUdeviceptr,
    error_info: CUdeviceptr,
    timeout_ns: u64,
    slot_bytes: i64,
    off_scales: i64,
    off_src: i64,
    off_topk_idx: i64,
    off_topk_weights: i64,
    row_begin: [i32; MAX_NVL_RANKS],
    rows: [i32; MAX_NVL_RANKS],
    rank: i32,
    num_ranks: i32,
    row_int4: i32,
    num_scales: i32,
    num_topk: i32,
    first_chunk_rows: i32,
    max_chunk_rows: i32,
    sm_rows_mask: i32,
    local_mask: i32,
    pad: i32,
}
const _: () = assert!(std::mem::size_of::<CeSmPullParams>() == 264);

/// Mirror of `CeDispatchParams` in intranode.cu: pack blocks, then SM pull blocks.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CeDispatchParams {
    pack: CePackParams,
    pull: CeSmPullParams,
    pack_blocks: i32,
    pad: i32,
}
const _: () = assert!(std::mem::size_of::<CeDispatchParams>() == 512);
// SAFETY: repr(C) plain data mirroring `CeDispatchParams` in intranode.cu.
unsafe impl KernelParams for CeDispatchParams {}

/// Mirror of `CeCombineParams` in intranode.cu: reduce blocks, then SM push blocks.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CeCombineParams {
    reduce: CeReduceParams,
    push: CeSmPushParams,
    reduce_blocks: i32,
    pad: i32,
}
const _: () = assert!(std::mem::size_of::<CeCombineParams>() == 376);
// SAFETY: repr(C) plain data mirroring `CeCombineParams` in intranode.cu.
unsafe impl KernelParams for CeCombineParams {}

/// Byte offset of flag `[peer][chunk]` in a buffer (`ce_flag` in intranode.cu).
fn flag_offset(peer: usize, chunk: usize) -> u64 {
    (17408 + 4 * (peer * CE_MAX_CHUNKS + chunk)) as u64
}

/// The checks every copy-engine op starts with: the config, `send_index` `[T, R]`, the `[R, R]`
/// prefixes and one count per source. Returns `(R, rank, T, N)`, `N` the rows received.
fn op_sizes(
    config: &CeConfig,
    buffers: &PeerBuffers,
    send_index_len: usize,
    rank_prefix_len: usize,
    recv_per_source: &[usize],
) -> Result<(usize, usize, usize, usize)> {
    config.validate()?;
    let r = buffers.num_ranks();
    let t = send_index_len / r;
    Error::check_len("send_index", t * r, send_index_len)?;
    Error::check_len("rank_prefix_matrix", r * r, rank_prefix_len)?;
    Error::check_len("recv_per_source", r, recv_per_source.len())?;
    Ok((r, buffers.rank(), t, recv_per_source.iter().sum()))
}

/// A fused kernel's launch: `blocks` blocks of [`CE_THREADS`] (the pack or reduce blocks, then
/// the SM copy blocks).
fn fused_grid(blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (CE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Errors unless the slots of `lay` hold this rank's `t` tokens and every source's block.
fn check_slot_capacity(
    buffers: &PeerBuffers,
    lay: &CeSlotLayout,
    t: usize,
    recv_per_source: &[usize],
    op: &str,
) -> Result<()> {
    if t > lay.capacity {
        return Err(Error::invalid(
            "num_tokens",
            t,
            format!(
                "the NVLink buffers ({} bytes) hold {} tokens per rank for this {op}",
                buffers.bytes(),
                lay.capacity
            ),
        ));
    }
    if let Some((s, &m)) = recv_per_source
        .iter()
        .enumerate()
        .find(|(_, &m)| m > lay.capacity)
    {
        return Err(Error::invalid(
            "recv_per_source",
            format!("{m} rows of rank {s}"),
            format!("at most {} (the slot capacity)", lay.capacity),
        ));
    }
    Ok(())
}

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

fn dptr<T>(v: &CudaView<'_, T>, stream: &CudaStream) -> CUdeviceptr {
    let (p, _g) = v.device_ptr(stream);
    p
}

/// Makes each copy stream wait for `stream`'s work so far; returns nothing.
fn fork(
    stream: &CudaStream,
    copies: &CopyStreams,
    peers: impl Iterator<Item = usize>,
    lanes: usize,
) -> Result<()> {
    let ev = stream.record_event(None)?;
    for p in peers {
        for lane in 0..lanes {
            copies.get(p, lane)?.wait(&ev)?;
        }
    }
    Ok(())
}

/// Makes `stream` wait for the copy streams of `peers`.
fn join(
    stream: &CudaStream,
    copies: &CopyStreams,
    peers: impl Iterator<Item = usize>,
    lanes: usize,
) -> Result<()> {
    for p in peers {
        for lane in 0..lanes {
            let ev = copies.get(p, lane)?.record_event(None)?;
            stream.wait(&ev)?;
        }
    }
    Ok(())
}

/// Async device-to-device copy of `bytes` on `stream`.
///
/// # Safety
///
/// Both ranges must be valid device memory in `stream`'s context (own or peer-mapped) for
/// the copy's duration, not written concurrently by anything unordered with it.
unsafe fn copy(stream: &CudaStream, dst: u64, src: u64, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller guarantees both ranges (this function's contract).
    unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }?;
    Ok(())
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
    let payload = dispatch_payload_ptrs(
        stream,
        shape,
        PayloadCounts {
            num_tokens: t,
            num_recv_tokens: n,
            num_topk: k,
            num_experts: args.num_experts,
            num_ranks: r,
        },
        &args.x,
        &args.recv_x,
        args.topk.as_ref(),
        args.recv_topk.as_ref(),
    )?;
    Error::check_len("recv_src_idx", n, args.recv_src_idx.len())?;
    payload.check_row_align()?;
    let kernels = Kernels::for_stream(stream)?;
    let fused = kernels.kernel(FILE, "intranode_ce_dispatch")?;
    let wait = kernels.kernel(FILE, "intranode_ce_wait")?;
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
        reserved: 0,
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
    if t > 0 || any_peer {
        // Pack blocks, then (when any peer sends rows here) the SM pull blocks, in one kernel
        // so that they run side by side.
        let pull_blocks = if any_peer { config.sm_blocks } else { 0 };
        let cfg = fused_grid(config.num_sms + pull_blocks);
        let fp = CeDispatchParams {
            pack: params,
            pull,
            pack_blocks: to_i32("num_sms", config.num_sms)?,
            pad: 0,
        };
        // SAFETY: `fp` matches `CeDispatchParams`. Pack: the views hold what it touches: T rows
        // of x (and T*S scales, T*K routing), T*R send indices and R*R prefixes from the same
        // notify, N receive rows / indices / routing for the own block (which lies in [0, N)
        // because the prefixes sum to N); peer slots hold `lay.capacity >= T` rows and fit in
        // the buffers (CeSlotLayout), valid per `PeerBuffers::new`. Pull: for each source s
        // with rows[s] = m > 0 it reads rows [0, m) of slot `me` in s's buffer (capacity >= m,
        // checked) only after the flag of their chunk, and writes receive rows
        // [row_begin[s], + m), inside the N-row outputs.
        unsafe { fused.launch(stream, cfg, fp) }?;
    }
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
        for (j, (b, e)) in chunk_bounds(m, config.first_chunk_rows, config.max_chunk_rows)
            .into_iter()
            .enumerate()
        {
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
            // in this rank's, where `s` pushed them) were published by the flag awaited above; the destination rows lie in recv_x (N rows, checked);
            // `stream` joins `cs` before the views' guards are released.
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

/// Inputs and outputs of [`ce_combine_cuda`] (`N` rows this rank holds in dispatch receive
/// order, `T` tokens this rank owns, `H` hidden, `K` top-k).
#[derive(Debug)]
pub struct CeCombineArgs<'a> {
    /// `[N, H]` bf16 rows to return, in receive order.
    pub x: CudaView<'a, half::bf16>,
    /// Optional `[N, K]` weights returned along and summed.
    pub topk_weights: Option<CudaView<'a, f32>>,
    /// `[R, R]` from the dispatch.
    pub rank_prefix_matrix: CudaView<'a, i32>,
    /// `[T, R]` from the dispatch's notify.
    pub send_index: CudaView<'a, i32>,
    /// Rows of `x` from each source (its home): the dispatch's `recv_per_source`.
    pub recv_per_source: &'a [usize],
    /// Out: `[T, H]` bf16, the f32 sum in rank order of the rows returned for each token.
    pub combined_x: CudaViewMut<'a, half::bf16>,
    /// Out: `[T, K]` sums of the returned weights (required iff `topk_weights` is given).
    pub combined_topk_weights: Option<CudaViewMut<'a, f32>>,
    /// Hidden size `H` (a multiple of 8; same on every rank).
    pub hidden: usize,
    /// Top-k `K` of the weights (0 without them; same on every rank).
    pub num_topk: usize,
}

/// Launches the copy-engine combine (after [`super::cached_notify_cuda`] on every rank): the
/// pushes to every home on the copy streams, the reduction on `stream`, joined.
pub fn ce_combine_cuda(
    stream: &CudaStream,
    copies: &CopyStreams,
    buffers: &PeerBuffers,
    config: &CeConfig,
    args: CeCombineArgs<'_>,
) -> Result<()> {
    let (r, me, t, n) = op_sizes(
        config,
        buffers,
        args.send_index.len(),
        args.rank_prefix_matrix.len(),
        args.recv_per_source,
    )?;
    let h = args.hidden;
    if h == 0 || h % 8 != 0 {
        return Err(Error::invalid(
            "hidden",
            h,
            "must be a positive multiple of 8",
        ));
    }
    Error::check_len("x", n * h, args.x.len())?;
    Error::check_len("combined_x", t * h, args.combined_x.len())?;
    let k = args.num_topk;
    let weights = combine_weights_ptrs(
        stream,
        args.topk_weights.as_ref(),
        args.combined_topk_weights.as_ref(),
        n,
        t,
        k,
    )?;
    let lay = CeSlotLayout::combine(buffers.bytes(), r, h, k);
    check_slot_capacity(buffers, &lay, t, args.recv_per_source, "combine")?;
    let (x_ptr, _gx) = args.x.device_ptr(stream);
    let (cx, _gcx) = args.combined_x.device_ptr(stream);
    check_align("x", x_ptr, 16)?;
    check_align("combined_x", cx, 16)?;
    let kernels = Kernels::for_stream(stream)?;
    let fused = kernels.kernel(FILE, "intranode_ce_combine")?;
    // Homes served by the copy streams, and whether the SM push blocks serve any.
    let peers = || (0..r).filter(move |&s| s != me && args.recv_per_source[s] > 0);
    let by_sm = |s: usize| !copy_engine_peer(me, s, r, config.copy_engine_peers);
    let any_sm = peers().any(by_sm);
    let streams = || peers().filter(move |&s| !by_sm(s));
    // One copy stream per home: the weights copy and every chunk's flag stay in order.
    fork(stream, copies, streams(), 1)?;
    let params = CeReduceParams {
        buffer_ptrs: buffers.ptrs(),
        x: x_ptr,
        topk_weights: weights.topk_weights,
        send_index: dptr(&args.send_index, stream),
        rank_prefix_matrix: dptr(&args.rank_prefix_matrix, stream),
        combined_x: cx,
        combined_topk_weights: weights.combined_topk_weights,
        error_info: buffers.error_info(),
        timeout_ns: buffers.timeout_ns(),
        slot_bytes: lay.slot_bytes as i64,
        off_weights: lay.off_topk_weights as i64,
        rank: to_i32("rank", me)?,
        num_ranks: to_i32("num_ranks", r)?,
        num_tokens: to_i32("num_tokens", t)?,
        row_int4: to_i32("hidden", h / 8)?,
        num_topk: to_i32("num_topk", k)?,
        first_chunk_rows: to_i32("first_chunk_rows", config.first_chunk_rows)?,
        max_chunk_rows: to_i32("max_chunk_rows", config.max_chunk_rows)?,
        pad: 0,
    };
    let row_bytes = 2 * h;
    let mut push = CeSmPushParams {
        buffer_ptrs: buffers.ptrs(),
        x: x_ptr,
        topk_weights: weights.topk_weights,
        slot_bytes: params.slot_bytes,
        off_weights: params.off_weights,
        row_begin: [0; MAX_NVL_RANKS],
        rows: [0; MAX_NVL_RANKS],
        rank: params.rank,
        num_ranks: params.num_ranks,
        row_int4: params.row_int4,
        num_topk: params.num_topk,
        first_chunk_rows: params.first_chunk_rows,
        max_chunk_rows: params.max_chunk_rows,
        pad: [0; 2],
    };
    let mut prefix = 0usize;
    for s in 0..r {
        let m = args.recv_per_source[s];
        let src_row0 = prefix;
        prefix += m;
        if s == me || m == 0 {
            continue;
        }
        if by_sm(s) {
            push.row_begin[s] = to_i32("recv_per_source", src_row0)?;
            push.rows[s] = to_i32("recv_per_source", m)?;
            continue;
        }
        let cs = copies.get(s, 0)?;
        let slot = buffers.ptr(s) + (RING_BASE + me * lay.slot_bytes) as u64;
        if k > 0 {
            // SAFETY: m*K weights from row `src_row0` of topk_weights (N rows) into the home's
            // slot (capacity >= m); the home reads them after the first flag below.
            unsafe {
                copy(
                    cs,
                    slot + lay.off_topk_weights as u64,
                    weights.topk_weights + (src_row0 * k * 4) as u64,
                    m * k * 4,
                )
            }?;
        }
        for (j, (b, e)) in chunk_bounds(m, config.first_chunk_rows, config.max_chunk_rows)
            .into_iter()
            .enumerate()
        {
            // SAFETY: rows [src_row0 + b, src_row0 + e) of x (N rows) into rows [b, e) of the
            // home's slot; the home's previous use of its slot ended before cached notify's
            // barrier, which this stream follows.
            unsafe {
                copy(
                    cs,
                    slot + (b * row_bytes) as u64,
                    x_ptr + ((src_row0 + b) * row_bytes) as u64,
                    (e - b) * row_bytes,
                )
            }?;
            // SAFETY: a 4-byte write into the home's header (flag [me][j]; the buffers are
            // valid per `PeerBuffers::new`); the default flags fence the copies before it.
            unsafe {
                sys::cuStreamWriteValue32_v2(
                    cs.cu_stream(),
                    buffers.ptr(s) + flag_offset(me, j),
                    1,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
            }
            .result()?;
        }
    }
    if t > 0 || any_sm {
        // Reduce blocks, then (when some home is not served by copy engines) the SM push
        // blocks, in one kernel so that they run side by side.
        let push_blocks = if any_sm { config.sm_blocks } else { 0 };
        let cfg = fused_grid(config.num_sms + push_blocks);
        let fp = CeCombineParams {
            reduce: params,
            push,
            reduce_blocks: to_i32("num_sms", config.num_sms)?,
            pad: 0,
        };
        // SAFETY: `fp` matches `CeCombineParams`. Reduce: x holds N rows (the own block lies
        // in [0, N)), send_index T*R and the prefixes R*R from the dispatch of these rows; the
        // outputs T*H and T*K; slots of `lay.capacity >= T` rows fit the buffers; it reads a
        // peer's slot rows only after that peer's flag for their chunk. Push: for each home s
        // with rows[s] = m > 0 it reads rows [row_begin[s], + m) of x (the per-source counts
        // sum to N) and their weights, and writes rows [0, m) of slot `me` in s's buffer
        // (capacity >= m, checked), free since cached notify's barrier, which `stream`
        // follows; it counts chunks in this rank's own header and flags them in the home's.
        unsafe { fused.launch(stream, cfg, fp) }?;
    }
    join(stream, copies, streams(), 1)
}
