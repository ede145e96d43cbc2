//! Launcher of the SM-ring combine kernels (`rings_combine.cu`, one per rank count).

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig};

use super::checks::{check_resident, ring_sizes};
use super::config::{check_buffer, combine_ring_bytes};
use super::payload::combine_weights_ptrs;
use super::{to_i32, Config, PeerBuffers, MAX_NVL_RANKS};
use crate::cuda::{assert_params_layout, check_align, KernelParams, Kernels};
use crate::error::{Error, Result};

/// The cubin of `rings_combine.cu`.
const FILE: &str = "intranode/rings_combine";
/// Threads of the combine kernel blocks (`kCombineThreads`).
const COMBINE_THREADS: u32 = 768;
/// Tokens the combine home side consumes per round (`kCombineWarps`).
pub const COMBINE_ROUND_TOKENS: usize = 24;

/// Mirror of `CombineParams` in rings_combine.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CombineParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    x: CUdeviceptr,
    topk_weights: CUdeviceptr,
    rank_prefix_matrix: CUdeviceptr,
    recv_channel_offset: CUdeviceptr,
    send_head: CUdeviceptr,
    combined_x: CUdeviceptr,
    combined_topk_weights: CUdeviceptr,
    error_info: CUdeviceptr,
    timeout_ns: u64,
    rank: i32,
    num_ranks: i32,
    num_tokens: i32,
    num_recv_tokens: i32,
    hidden_int4: i32,
    num_topk: i32,
    num_channels: i32,
    num_max_send_tokens: i32,
    num_max_recv_tokens: i32,
    pad: i32,
    bias: CUdeviceptr,
}
assert_params_layout!(
    CombineParams,
    184;
    buffer_ptrs = 0, x = 64, topk_weights = 72, rank_prefix_matrix = 80, recv_channel_offset = 88,
    send_head = 96, combined_x = 104, combined_topk_weights = 112, error_info = 120,
    timeout_ns = 128, rank = 136, num_ranks = 140, num_tokens = 144, num_recv_tokens = 148,
    hidden_int4 = 152, num_topk = 156, num_channels = 160, num_max_send_tokens = 164,
    num_max_recv_tokens = 168, pad = 172, bias = 176,
);
// SAFETY: repr(C) plain data mirroring `CombineParams` in rings_combine.cu.
unsafe impl KernelParams for CombineParams {}

/// Inputs and outputs of [`combine_cuda`] (`N` rows this rank holds in dispatch receive
/// order, `T` tokens this rank owns, `H` hidden, `K` top-k).
#[derive(Debug)]
pub struct CombineArgs<'a> {
    /// `[N, H]` bf16 rows to return (e.g. the experts' weighted outputs), in receive order.
    pub x: CudaView<'a, half::bf16>,
    /// Optional `[N, K]` weights returned along and summed (with `combined_topk_weights`).
    pub topk_weights: Option<CudaView<'a, f32>>,
    /// `[R, R]` from the dispatch handle.
    pub rank_prefix_matrix: CudaView<'a, i32>,
    /// `[R, C]` from the dispatch (`recv_channel_offset`).
    pub recv_channel_offset: CudaView<'a, i32>,
    /// `[T, R]` from the dispatch (`send_head`).
    pub send_head: CudaView<'a, i32>,
    /// Optional `[T, H]` bf16 added to every combined row: the f32 sum starts from it.
    pub bias: Option<CudaView<'a, half::bf16>>,
    /// Out: `[T, H]` bf16, the f32 sum of the bias (if any) and, in rank order, the rows
    /// returned for each token.
    pub combined_x: CudaViewMut<'a, half::bf16>,
    /// Out: `[T, K]` sums of the returned weights (required iff `topk_weights` is given).
    pub combined_topk_weights: Option<CudaViewMut<'a, f32>>,
    /// Number of rows `N` this rank holds (the dispatch's `num_recv_tokens`).
    pub num_recv_tokens: usize,
    /// Hidden size `H` (a multiple of 8; same on every rank).
    pub hidden: usize,
    /// Top-k `K` of the weights (0 without them; same on every rank).
    pub num_topk: usize,
}

/// Launches the combine on `stream` (after [`cached_notify_cuda`](super::cached_notify_cuda) on every rank). `config`
/// must have the dispatch's channel count and `num_max_recv_tokens >= num_max_send_tokens +
/// COMBINE_ROUND_TOKENS`; every rank must use the same `config`.
pub fn combine_cuda(
    stream: &CudaStream,
    buffers: &PeerBuffers,
    config: &Config,
    args: CombineArgs<'_>,
) -> Result<()> {
    let (r, c) = ring_sizes(config, buffers)?;
    let q = config.num_max_recv_tokens;
    if q < config.num_max_send_tokens + COMBINE_ROUND_TOKENS {
        return Err(Error::invalid(
            "num_max_recv_tokens",
            q,
            format!(
                "combine needs at least num_max_send_tokens + {COMBINE_ROUND_TOKENS} = {}",
                config.num_max_send_tokens + COMBINE_ROUND_TOKENS
            ),
        ));
    }
    let t = args.send_head.len() / r;
    Error::check_len("send_head", t * r, args.send_head.len())?;
    let h = args.hidden;
    if h == 0 || h % 8 != 0 {
        return Err(Error::invalid(
            "hidden",
            h,
            "must be a positive multiple of 8",
        ));
    }
    let num_recv = args.num_recv_tokens;
    Error::check_len("x", num_recv * h, args.x.len())?;
    Error::check_len("combined_x", t * h, args.combined_x.len())?;
    if let Some(b) = &args.bias {
        Error::check_len("bias", t * h, b.len())?;
    }
    Error::check_len("rank_prefix_matrix", r * r, args.rank_prefix_matrix.len())?;
    Error::check_len("recv_channel_offset", r * c, args.recv_channel_offset.len())?;
    let k = args.num_topk;
    let weights = combine_weights_ptrs(
        stream,
        args.topk_weights.as_ref(),
        args.combined_topk_weights.as_ref(),
        num_recv,
        t,
        k,
    )?;
    check_buffer(buffers, c, combine_ring_bytes(q, h * 2, k))?;
    let kernels = Kernels::for_stream(stream)?;
    check_resident(config, &kernels)?;
    let name = format!("intranode_combine_{r}");
    let kernel = kernels.kernel(FILE, &name)?;
    let (x_ptr, _g0) = args.x.device_ptr(stream);
    let (rpm, _g1) = args.rank_prefix_matrix.device_ptr(stream);
    let (rco, _g2) = args.recv_channel_offset.device_ptr(stream);
    let (sh, _g3) = args.send_head.device_ptr(stream);
    let (cx, _g4) = args.combined_x.device_ptr(stream);
    check_align("x", x_ptr, 16)?;
    check_align("combined_x", cx, 16)?;
    let bias = args.bias.as_ref().map(|b| b.device_ptr(stream));
    let bias_ptr = bias.as_ref().map_or(0, |(p, _)| *p);
    check_align("bias", bias_ptr, 16)?;
    let params = CombineParams {
        buffer_ptrs: buffers.ptrs(),
        x: x_ptr,
        topk_weights: weights.topk_weights,
        rank_prefix_matrix: rpm,
        recv_channel_offset: rco,
        send_head: sh,
        combined_x: cx,
        combined_topk_weights: weights.combined_topk_weights,
        error_info: buffers.error_info(),
        timeout_ns: buffers.timeout_ns(),
        rank: to_i32("rank", buffers.rank())?,
        num_ranks: to_i32("num_ranks", r)?,
        num_tokens: to_i32("num_tokens", t)?,
        num_recv_tokens: to_i32("num_recv_tokens", num_recv)?,
        hidden_int4: to_i32("hidden", h / 8)?,
        num_topk: to_i32("num_topk", k)?,
        num_channels: to_i32("num_channels", c)?,
        num_max_send_tokens: to_i32("num_max_send_tokens", config.num_max_send_tokens)?,
        num_max_recv_tokens: to_i32("num_max_recv_tokens", q)?,
        pad: 0,
        bias: bias_ptr,
    };
    let cfg = LaunchConfig {
        grid_dim: (2 * c as u32, 1, 1),
        block_dim: (COMBINE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `CombineParams`; the views hold exactly what the kernel touches
    // (x: N*H read at rows given by recv_channel_offset / rank_prefix_matrix from the same
    // dispatch, which lie in [0, N); bias T*H read; outputs T*H and T*K); the rings fit the NVLink buffers
    // (`check_buffer`), valid per `PeerBuffers::new`; guards keep the views ordered.
    unsafe { kernel.launch(stream, cfg, params) }
}
