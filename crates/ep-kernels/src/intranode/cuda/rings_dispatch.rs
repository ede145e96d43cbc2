//! Launcher of the SM-ring dispatch kernel (`rings_dispatch.cu`).

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig};

use super::checks::{args_payload_ptrs, check_prefix_matrices, check_resident, ring_sizes};
use super::config::{check_buffer, dispatch_ring_bytes};
use super::payload::dispatch_row_shape;
use super::{to_i32, Config, Payload, PeerBuffers, RecvPayload, RecvTopK, TopK, MAX_NVL_RANKS};
use crate::cuda::{assert_params_layout, KernelParams, Kernels};
use crate::error::{Error, Result};

/// The cubin of `rings_dispatch.cu`.
const FILE: &str = "intranode/rings_dispatch";
/// Threads of the dispatch kernel blocks (`kDispatchThreads`).
const DISPATCH_THREADS: u32 = 768;
/// Dynamic shared memory of the dispatch kernel blocks (`kDispatchSmemBytes`: the per-warp
/// bulk-copy staging buffers of the receive side).
const DISPATCH_SMEM_BYTES: u32 = 224_256;

/// Mirror of `DispatchParams` in rings_dispatch.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DispatchParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    x: CUdeviceptr,
    x_scales: CUdeviceptr,
    topk_idx: CUdeviceptr,
    topk_weights: CUdeviceptr,
    is_token_in_rank: CUdeviceptr,
    rank_prefix_matrix: CUdeviceptr,
    channel_prefix_matrix: CUdeviceptr,
    recv_x: CUdeviceptr,
    recv_x_scales: CUdeviceptr,
    recv_src_idx: CUdeviceptr,
    recv_topk_idx: CUdeviceptr,
    recv_topk_weights: CUdeviceptr,
    recv_channel_offset: CUdeviceptr,
    send_head: CUdeviceptr,
    error_info: CUdeviceptr,
    timeout_ns: u64,
    rank: i32,
    num_ranks: i32,
    num_tokens: i32,
    hidden_int4: i32,
    num_scales: i32,
    num_topk: i32,
    experts_per_rank: i32,
    num_channels: i32,
    num_max_send_tokens: i32,
    num_max_recv_tokens: i32,
    num_recv_rows: i32,
    worst_case: i32,
}
assert_params_layout!(
    DispatchParams,
    240;
    buffer_ptrs = 0, x = 64, x_scales = 72, topk_idx = 80, topk_weights = 88,
    is_token_in_rank = 96, rank_prefix_matrix = 104, channel_prefix_matrix = 112, recv_x = 120,
    recv_x_scales = 128, recv_src_idx = 136, recv_topk_idx = 144, recv_topk_weights = 152,
    recv_channel_offset = 160, send_head = 168, error_info = 176, timeout_ns = 184, rank = 192,
    num_ranks = 196, num_tokens = 200, hidden_int4 = 204, num_scales = 208, num_topk = 212,
    experts_per_rank = 216, num_channels = 220, num_max_send_tokens = 224,
    num_max_recv_tokens = 228, num_recv_rows = 232, worst_case = 236,
);
// SAFETY: repr(C) plain data mirroring `DispatchParams` in rings_dispatch.cu.
unsafe impl KernelParams for DispatchParams {}

/// Inputs and outputs of [`dispatch_cuda`] (`T` tokens, `H` hidden, `K` top-k, `R` ranks,
/// `C` channels, `N` tokens received).
#[derive(Debug)]
pub struct DispatchArgs<'a> {
    /// The rows to send.
    pub x: Payload<'a>,
    /// Routing to send along (optional: cached dispatch of activations only).
    pub topk: Option<TopK<'a>>,
    /// Number of experts `E` (to localise expert ids; ignored without `topk`).
    pub num_experts: usize,
    /// `[T, R]` 0/1 bytes.
    pub is_token_in_rank: CudaView<'a, u8>,
    /// `[R, R]` from notify (or the handle).
    pub rank_prefix_matrix: CudaView<'a, i32>,
    /// `[R, C]` this rank's, from notify (or the handle).
    pub channel_prefix_matrix: CudaView<'a, i32>,
    /// Out: the received rows (`N` = `rank_prefix_matrix[R - 1][rank]` of them).
    pub recv_x: RecvPayload<'a>,
    /// Out: `[N]` index of each received token on its source rank.
    pub recv_src_idx: CudaViewMut<'a, i32>,
    /// Out: localised routing (required iff `topk` is given).
    pub recv_topk: Option<RecvTopK<'a>>,
    /// Out: `[R, C]` index in the receive buffers where source `s`'s channel-`c` tokens start.
    pub recv_channel_offset: CudaViewMut<'a, i32>,
    /// Out: `[T, R]` for each token and destination, its index among this channel's tokens
    /// sent to that destination, or `-1` (what combine needs).
    pub send_head: CudaViewMut<'a, i32>,
    /// Rows `N` of the outputs: the tokens this rank receives (from notify or the handle), or
    /// with `worst_case` a capacity for any routing.
    pub num_recv_tokens: usize,
    /// Hidden size `H` (same on every rank: it fixes the ring layout).
    pub hidden: usize,
    /// Top-k `K` (0 without `topk`; same on every rank).
    pub num_topk: usize,
    /// `num_recv_tokens` is a worst-case capacity, the same on every rank, not this rank's
    /// count (which the host never read): the kernel checks every rank's count against it
    /// (when one exceeds it every rank returns before moving anything and records
    /// [`Error::RecvCapacity`](crate::Error::RecvCapacity)), and marks the rows past this rank's
    /// count as empty: source `-1`, routing `-1`, weight 0 (their payload is left unwritten).
    pub worst_case: bool,
}

/// Launches the dispatch of this rank's tokens on `stream` (after [`notify_dispatch_cuda`](super::notify_dispatch_cuda) or
/// [`cached_notify_cuda`](super::cached_notify_cuda) on every rank). Every rank must launch it with the same `config`.
pub fn dispatch_cuda(
    stream: &CudaStream,
    buffers: &PeerBuffers,
    config: &Config,
    args: DispatchArgs<'_>,
) -> Result<()> {
    let (r, c) = ring_sizes(config, buffers)?;
    let t = args.is_token_in_rank.len() / r.max(1);
    Error::check_len("is_token_in_rank", t * r, args.is_token_in_rank.len())?;
    let n = args.num_recv_tokens;
    let shape = dispatch_row_shape(&args.x, args.hidden)?;
    let (row_bytes, scales) = (shape.row_bytes, shape.scales);
    let k = args.num_topk;
    let payload = args_payload_ptrs!(stream, shape, args, t, n, r)?;
    check_prefix_matrices(
        r,
        c,
        args.rank_prefix_matrix.len(),
        args.channel_prefix_matrix.len(),
    )?;
    Error::check_len("recv_src_idx", n, args.recv_src_idx.len())?;
    Error::check_len("recv_channel_offset", r * c, args.recv_channel_offset.len())?;
    Error::check_len("send_head", t * r, args.send_head.len())?;
    let q = config.num_max_recv_tokens;
    if q.checked_mul(row_bytes / 16)
        .is_none_or(|v| v > i32::MAX as usize)
    {
        return Err(Error::invalid(
            "num_max_recv_tokens",
            q,
            "ring too large for 32-bit slot offsets",
        ));
    }
    check_buffer(buffers, c, dispatch_ring_bytes(q, row_bytes, k, scales))?;

    let kernels = Kernels::for_stream(stream)?;
    check_resident(config, &kernels)?;
    let kernel = kernels.kernel(FILE, "intranode_dispatch")?;
    payload.check_row_align()?;
    let (itir, _g0) = args.is_token_in_rank.device_ptr(stream);
    let (rpm, _g1) = args.rank_prefix_matrix.device_ptr(stream);
    let (cpm, _g2) = args.channel_prefix_matrix.device_ptr(stream);
    let (rsi, _g3) = args.recv_src_idx.device_ptr(stream);
    let (rco, _g4) = args.recv_channel_offset.device_ptr(stream);
    let (sh, _g5) = args.send_head.device_ptr(stream);
    let params = DispatchParams {
        buffer_ptrs: buffers.ptrs(),
        x: payload.x,
        x_scales: payload.x_scales,
        topk_idx: payload.topk_idx,
        topk_weights: payload.topk_weights,
        is_token_in_rank: itir,
        rank_prefix_matrix: rpm,
        channel_prefix_matrix: cpm,
        recv_x: payload.recv_x,
        recv_x_scales: payload.recv_x_scales,
        recv_src_idx: rsi,
        recv_topk_idx: payload.recv_topk_idx,
        recv_topk_weights: payload.recv_topk_weights,
        recv_channel_offset: rco,
        send_head: sh,
        error_info: buffers.error_info(),
        timeout_ns: buffers.timeout_ns(),
        rank: to_i32("rank", buffers.rank())?,
        num_ranks: to_i32("num_ranks", r)?,
        num_tokens: to_i32("num_tokens", t)?,
        hidden_int4: to_i32("hidden", row_bytes / 16)?,
        num_scales: to_i32("num_scales", scales)?,
        num_topk: to_i32("num_topk", k)?,
        experts_per_rank: to_i32("num_experts", payload.experts_per_rank)?,
        num_channels: to_i32("num_channels", c)?,
        num_max_send_tokens: to_i32("num_max_send_tokens", config.num_max_send_tokens)?,
        num_max_recv_tokens: to_i32("num_max_recv_tokens", q)?,
        num_recv_rows: to_i32("num_recv_tokens", n)?,
        worst_case: i32::from(args.worst_case),
    };
    let cfg = LaunchConfig {
        grid_dim: (2 * c as u32, 1, 1),
        block_dim: (DISPATCH_THREADS, 1, 1),
        shared_mem_bytes: DISPATCH_SMEM_BYTES,
    };
    // SAFETY: `params` matches `DispatchParams`. Every view was checked to hold exactly what
    // the kernel touches for T tokens, N received tokens, H hidden, K top-k, R ranks and C
    // channels (the kernel writes recv rows at offsets from the prefix matrices, which sum to
    // N when they come from notify on these counts, and with `worst_case` it returns before
    // writing when they sum to more than N); optional pointers are null exactly when
    // their counts (K, S) are 0; the rings fit in the NVLink buffers (`check_buffer`), which
    // are valid per `PeerBuffers::new`. The guards keep the views ordered on `stream`.
    unsafe { kernel.launch(stream, cfg, params) }
}
