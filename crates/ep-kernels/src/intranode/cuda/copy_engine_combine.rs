//! Launcher of the copy-engine combine: per copy-engine home the row copies and flag writes on
//! its copy stream, and the fused reduce + SM-push kernel.

use cudarc::driver::sys;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr};

use super::copy_engine::params::{flag_offset, CeReduceParams, CeSmPushParams};
use super::copy_engine::streams::{copy, fork, join};
use super::copy_engine::{
    check_slot_capacity, dptr, launch_fused, op_sizes, CeConfig, CopyStreams, FusedGrid,
};
use crate::cuda::{check_align, Kernels};
use crate::error::{Error, Result};
use crate::intranode::cuda::payload::combine_weights_ptrs;
use crate::intranode::cuda::{to_i32, PeerBuffers, MAX_NVL_RANKS, RING_BASE};
use crate::intranode::{chunk_bounds, copy_engine_peer, CeSlotLayout};

/// The cubin of `copy_engine_combine.cu`.
const COMBINE_FILE: &str = "intranode/copy_engine_combine";

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
    /// Optional `[T, H]` bf16 added to every combined row: the f32 sum starts from it.
    pub bias: Option<CudaView<'a, half::bf16>>,
    /// Out: `[T, H]` bf16, the f32 sum of the bias (if any) and, in rank order, the rows
    /// returned for each token.
    pub combined_x: CudaViewMut<'a, half::bf16>,
    /// Out: `[T, K]` sums of the returned weights (required iff `topk_weights` is given).
    pub combined_topk_weights: Option<CudaViewMut<'a, f32>>,
    /// Hidden size `H` (a multiple of 8; same on every rank).
    pub hidden: usize,
    /// Top-k `K` of the weights (0 without them; same on every rank).
    pub num_topk: usize,
}

/// Launches the copy-engine combine (after [`crate::intranode::cached_notify_cuda`] on every rank): the
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
    if let Some(b) = &args.bias {
        Error::check_len("bias", t * h, b.len())?;
    }
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
    let bias = args.bias.as_ref().map(|b| b.device_ptr(stream));
    let bias_ptr = bias.as_ref().map_or(0, |(p, _)| *p);
    check_align("bias", bias_ptr, 16)?;
    let kernels = Kernels::for_stream(stream)?;
    // Reduce blocks beside push blocks, or every block with both roles.
    let fused = kernels.kernel(
        COMBINE_FILE,
        if config.combine_push_warps > 0 {
            "intranode_ce_combine_roles"
        } else {
            "intranode_ce_combine"
        },
    )?;
    // Homes served by the copy streams, and whether the SM push blocks serve any.
    let peers = || (0..r).filter(move |&s| s != me && args.recv_per_source[s] > 0);
    let by_sm = |s: usize| !copy_engine_peer(me, s, r, config.copy_engine_peers);
    let any_sm = peers().any(by_sm);
    // The last chunks of the SM homes go on one copy stream, chunk by chunk with the
    // copy-engine home's own: the first copy-engine home's stream, else the first SM home's.
    let tail_stream = (config.combine_ce_tail_chunks > 0 && any_sm)
        .then(|| {
            peers()
                .find(|&s| !by_sm(s))
                .or_else(|| peers().find(|&s| by_sm(s)))
        })
        .flatten();
    let streams = || peers().filter(move |&s| !by_sm(s) || Some(s) == tail_stream);
    // One copy stream per home: every chunk's copies and then its flag, in order.
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
        bias: bias_ptr,
    };
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
        combine_ce_tail_chunks: to_i32("combine_ce_tail_chunks", config.combine_ce_tail_chunks)?,
        pad: 0,
    };
    // First row of x returned to each home.
    let row0: Vec<usize> = args
        .recv_per_source
        .iter()
        .scan(0, |acc, &m| {
            *acc += m;
            Some(*acc - m)
        })
        .collect();
    // Each home's chunks, computed once (none for this rank's own block).
    let bounds: Vec<Vec<(usize, usize)>> = (0..r)
        .map(|s| {
            let m = if s == me { 0 } else { args.recv_per_source[s] };
            chunk_bounds(m, config.first_chunk_rows, config.max_chunk_rows)
        })
        .collect();
    let pusher = HomePusher {
        buffers,
        me,
        slot_bytes: lay.slot_bytes,
        off_weights: lay.off_topk_weights,
        x: x_ptr,
        weights: weights.topk_weights,
        row_bytes: 2 * h,
        k,
    };
    // Per copy stream (keyed by its home), the chunks it pushes: every chunk of its
    // copy-engine home and, on `tail_stream`, the SM homes' last `combine_ce_tail_chunks`
    // chunks; pushed chunk by chunk (every home's chunk j before any home's chunk j + 1), homes
    // in the push kernel's order me + 1, me + 2, ...
    let mut queues: Vec<(usize, Vec<ChunkItem>)> = Vec::new();
    let mut add = |stream_home: usize, items: &mut dyn Iterator<Item = ChunkItem>| match queues
        .iter_mut()
        .find(|(h, _)| *h == stream_home)
    {
        Some((_, q)) => q.extend(items),
        None => queues.push((stream_home, items.collect())),
    };
    for (order, s) in (1..r).map(|i| (me + i) % r).enumerate() {
        let n = bounds[s].len();
        if n == 0 {
            continue;
        }
        if by_sm(s) {
            push.row_begin[s] = to_i32("recv_per_source", row0[s])?;
            push.rows[s] = to_i32("recv_per_source", args.recv_per_source[s])?;
            if let Some(ts) = tail_stream {
                let first = n.saturating_sub(config.combine_ce_tail_chunks);
                add(ts, &mut (first..n).map(|j| (j, order, s)));
            }
        } else {
            add(s, &mut (0..n).map(|j| (j, order, s)));
        }
    }
    for (stream_home, mut q) in queues {
        q.sort_unstable();
        let cs = copies.get(stream_home, 0)?;
        // Each home's weights go once, from its first chunk on this stream to the end of its
        // block, before that chunk's flag.
        let mut weights_sent = 0u32;
        for (j, _, s) in q {
            let (b, e) = bounds[s][j];
            if weights_sent & (1 << s) == 0 {
                weights_sent |= 1 << s;
                pusher.weights(cs, s, row0[s], b, args.recv_per_source[s])?;
            }
            pusher.rows(cs, s, row0[s], j, b, e)?;
        }
    }
    // Reduce blocks, then (when some home is not served by copy engines) the SM push blocks.
    // SAFETY: `CeCombineParams` is the params type of `intranode_ce_combine`. Reduce: x
    // holds N rows (the own block lies in [0, N)), send_index T*R and the prefixes R*R from the
    // dispatch of these rows; the bias T*H (read); the outputs T*H and T*K; slots of `lay.capacity >= T` rows fit
    // the buffers; it reads a peer's slot rows only after that peer's flag for their chunk.
    // Push: for each home s with rows[s] = m > 0 it reads rows [row_begin[s], + m) of x (the
    // per-source counts sum to N) and their weights, and writes rows [0, m) of slot `me` in
    // s's buffer (capacity >= m, checked), free since cached notify's barrier, which `stream`
    // follows; it counts chunks in this rank's own header and flags them in the home's.
    unsafe {
        launch_fused(
            stream,
            &fused,
            FusedGrid::new(config, any_sm, config.combine_push_warps),
            t,
            params,
            push,
        )
    }?;
    join(stream, copies, streams(), 1)
}

/// A chunk a copy stream pushes: (chunk index, position of its home in the push order, home).
/// Sorted, a stream's chunks go chunk by chunk.
type ChunkItem = (usize, usize, usize);

/// Pushes chunks of this rank's combine input (and their weights) to a home by copy engine,
/// each chunk followed by its flag.
struct HomePusher<'a> {
    buffers: &'a PeerBuffers,
    me: usize,
    slot_bytes: usize,
    off_weights: usize,
    x: u64,
    /// `[N, K]` weights (0 without them).
    weights: u64,
    row_bytes: usize,
    k: usize,
}

impl HomePusher<'_> {
    /// Slot `me` of home `s`'s buffer.
    fn slot(&self, s: usize) -> u64 {
        self.buffers.ptr(s) + (RING_BASE + self.me * self.slot_bytes) as u64
    }

    /// Copies the weights of rows [b, m) of home `s`'s block (rows `row0 + b ..` of x) into the
    /// home's slot on `cs` (nothing without weights); the flags of those rows' chunks follow on
    /// the same stream.
    fn weights(&self, cs: &CudaStream, s: usize, row0: usize, b: usize, m: usize) -> Result<()> {
        if self.k == 0 {
            return Ok(());
        }
        let w = self.k * 4;
        // SAFETY: the weights of rows [row0 + b, row0 + m) of topk_weights (N rows) into rows
        // [b, m) of the home's slot weights (capacity >= its block of m rows, checked by the
        // caller); the home reads them only after a later flag of this stream.
        unsafe {
            copy(
                cs,
                self.slot(s) + (self.off_weights + b * w) as u64,
                self.weights + ((row0 + b) * w) as u64,
                (m - b) * w,
            )
        }
    }

    /// Copies rows [b, e) of home `s`'s block (rows `row0 + b ..` of x) into slot `me` of
    /// `s`'s buffer on `cs`, then writes flag [me][j] in `s`'s header.
    fn rows(
        &self,
        cs: &CudaStream,
        s: usize,
        row0: usize,
        j: usize,
        b: usize,
        e: usize,
    ) -> Result<()> {
        // SAFETY: rows [row0 + b, row0 + e) of x (N rows) into rows [b, e) of the home's slot;
        // the home's previous use of its slot ended before cached notify's barrier, which this
        // stream follows.
        unsafe {
            copy(
                cs,
                self.slot(s) + (b * self.row_bytes) as u64,
                self.x + ((row0 + b) * self.row_bytes) as u64,
                (e - b) * self.row_bytes,
            )
        }?;
        // SAFETY: a 4-byte write into the home's header (flag [me][j]; the buffers are valid
        // per `PeerBuffers::new`); the default flags fence the copies before it.
        unsafe {
            sys::cuStreamWriteValue32_v2(
                cs.cu_stream(),
                self.buffers.ptr(s) + flag_offset(self.me, j),
                1,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        }
        .result()?;
        Ok(())
    }
}
