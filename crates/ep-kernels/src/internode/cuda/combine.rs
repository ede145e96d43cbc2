//! Launcher of `combine.cu`: the op barrier, rows back to the forwarders over NVLink, the
//! forwarders' node sums put to the homes, and the homes' sums.

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig};

use super::buffer::{InBuffer, InternodeBuffer, SignalTarget};
use super::notify::{notify_cuda, signal_cuda};
use crate::cuda::{assert_params_layout, check_align, grid_for, KernelParams, Kernels};
use crate::error::{Error, Result};
use crate::internode::layout::combine_row;

/// Threads of the combine kernels (`kCombineThreads`): 16 warps.
const THREADS: u32 = 512;
const WARPS: u64 = THREADS as u64 / 32;

/// Mirror of `CombineSendParams` in combine.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CombineSendParams {
    b: InBuffer,
    x: CUdeviceptr,
    topk_weights: CUdeviceptr,
    origin: CUdeviceptr,
    num_recv: i32,
    hidden: i32,
    num_topk: i32,
    off_w: i32,
}
assert_params_layout!(
    CombineSendParams,
    168;
    b = 0, x = 128, topk_weights = 136, origin = 144, num_recv = 152, hidden = 156,
    num_topk = 160, off_w = 164,
);
// SAFETY: repr(C) plain data mirroring `CombineSendParams`.
unsafe impl KernelParams for CombineSendParams {}

/// Mirror of `ForwardParams` in combine.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ForwardParams {
    b: InBuffer,
    seq: u64,
    block_count: CUdeviceptr,
    fwd_mask: CUdeviceptr,
    x: CUdeviceptr,
    topk_weights: CUdeviceptr,
    dest: CUdeviceptr,
    hidden: i32,
    num_topk: i32,
    off_w: i32,
    row_bytes: i32,
}
assert_params_layout!(
    ForwardParams,
    192;
    b = 0, seq = 128, block_count = 136, fwd_mask = 144, x = 152, topk_weights = 160,
    dest = 168, hidden = 176, num_topk = 180, off_w = 184, row_bytes = 188,
);
// SAFETY: repr(C) plain data mirroring `ForwardParams`.
unsafe impl KernelParams for ForwardParams {}

/// Mirror of `CombineRecvParams` in combine.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CombineRecvParams {
    b: InBuffer,
    seq: u64,
    node_send_index: CUdeviceptr,
    combined_x: CUdeviceptr,
    combined_w: CUdeviceptr,
    num_tokens: i32,
    hidden: i32,
    num_topk: i32,
    off_w: i32,
    bias: CUdeviceptr,
}
assert_params_layout!(
    CombineRecvParams,
    184;
    b = 0, seq = 128, node_send_index = 136, combined_x = 144, combined_w = 152,
    num_tokens = 160, hidden = 164, num_topk = 168, off_w = 172, bias = 176,
);
// SAFETY: repr(C) plain data mirroring `CombineRecvParams`.
unsafe impl KernelParams for CombineRecvParams {}

/// Inputs and outputs of [`combine_cuda`] (`n` received rows, `T` own tokens, `K` weights).
#[derive(Debug)]
pub struct InternodeCombineArgs<'a> {
    /// `[n, hidden]` one row per received token, in the dispatch's `recv_x` order.
    pub x: CudaView<'a, half::bf16>,
    /// `[n, K]` weights summed back along (optional).
    pub topk_weights: Option<CudaView<'a, f32>>,
    /// `[n]` the dispatch plan's origin of each row.
    pub origin: CudaView<'a, i32>,
    /// `[P, N]` the dispatch's block counts.
    pub block_count: CudaView<'a, i32>,
    /// `[N, M]` the dispatch's node masks of this rank's own blocks.
    pub fwd_mask: CudaView<'a, u8>,
    /// `[P, N, M]` the dispatch plan's row of each block message (the forwarder finds its own
    /// rows in `x` through it).
    pub dest: CudaView<'a, i32>,
    /// `[T, N]` the dispatch's per-node send index.
    pub node_send_index: CudaView<'a, i32>,
    /// Optional `[T, hidden]` added to every combined row: the f32 sum starts from it.
    pub bias: Option<CudaView<'a, half::bf16>>,
    /// Out: `[T, hidden]`: the f32 sum of the bias (if any) and the returned rows.
    pub combined_x: CudaViewMut<'a, half::bf16>,
    /// Out: `[T, K]` (with `topk_weights`).
    pub combined_topk_weights: Option<CudaViewMut<'a, f32>>,
    /// `n`.
    pub num_recv_tokens: usize,
    /// `T`.
    pub num_tokens: usize,
    /// Channels per row.
    pub hidden: usize,
    /// `K` of the weights (0 without).
    pub num_topk: usize,
}

/// Launches a whole combine on `stream` (every rank, for the same dispatch).
pub fn combine_cuda(
    stream: &CudaStream,
    buffer: &InternodeBuffer,
    args: InternodeCombineArgs<'_>,
) -> Result<()> {
    let l = buffer.layout();
    let (n_nodes, p, mt) = (l.num_nodes(), l.gpus_per_node, l.max_tokens);
    let (nr, t, h, k) = (
        args.num_recv_tokens,
        args.num_tokens,
        args.hidden,
        args.num_topk,
    );
    if h == 0 || h % 8 != 0 {
        return Err(Error::invalid(
            "hidden",
            h,
            "must be a positive multiple of 8",
        ));
    }
    l.check_op(t, None, Some((h, k)))?;
    Error::check_len("x", nr * h, args.x.len())?;
    Error::check_len("origin", nr, args.origin.len())?;
    Error::check_len("block_count", p * n_nodes, args.block_count.len())?;
    Error::check_len("fwd_mask", n_nodes * mt, args.fwd_mask.len())?;
    Error::check_len("dest", p * n_nodes * mt, args.dest.len())?;
    Error::check_len("node_send_index", t * n_nodes, args.node_send_index.len())?;
    Error::check_len("combined_x", t * h, args.combined_x.len())?;
    if let Some(b) = &args.bias {
        Error::check_len("bias", t * h, b.len())?;
    }
    let mut guards = Vec::new();
    let (w, cw) = match (&args.topk_weights, &args.combined_topk_weights) {
        (Some(w), Some(cw)) => {
            Error::check_len("topk_weights", nr * k, w.len())?;
            Error::check_len("combined_topk_weights", t * k, cw.len())?;
            let (a, ga) = w.device_ptr(stream);
            let (b, gb) = cw.device_ptr(stream);
            guards.extend([ga, gb]);
            (a, b)
        }
        (None, None) => (0, 0),
        _ => {
            return Err(Error::invalid(
                "combined_topk_weights",
                "given without topk_weights (or the other way round)",
                "both or neither",
            ))
        }
    };
    let k = if w == 0 { 0 } else { k };
    let (row_bytes, off_w) = combine_row(h, k);
    let (x, gx) = args.x.device_ptr(stream);
    let (origin, go) = args.origin.device_ptr(stream);
    let (bc, gb) = args.block_count.device_ptr(stream);
    let (fm, gf) = args.fwd_mask.device_ptr(stream);
    let (dest, gd) = args.dest.device_ptr(stream);
    let (nsi, gn) = args.node_send_index.device_ptr(stream);
    let (out, gc) = args.combined_x.device_ptr(stream);
    guards.extend([gx, go, gb, gf, gd, gn, gc]);
    let bias = match &args.bias {
        Some(b) => {
            let (ptr, g) = b.device_ptr(stream);
            guards.push(g);
            ptr
        }
        None => 0,
    };
    check_align("x", x, 16)?;
    check_align("combined_x", out, 16)?;
    check_align("bias", bias, 16)?;

    let seq = notify_cuda(stream, buffer, None)?;
    let kernels = Kernels::for_stream(stream)?;
    let view = buffer.view(stream);
    let i32_of = |v: usize| v as i32;
    let send = kernels.kernel(super::buffer::COMBINE_FILE, "internode_combine_send")?;
    let cfg = |grid: u32| LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let send_params = CombineSendParams {
        b: view,
        x,
        topk_weights: w,
        origin,
        num_recv: i32_of(nr),
        hidden: i32_of(h),
        num_topk: i32_of(k),
        off_w: i32_of(off_w),
    };
    // SAFETY: `send_params` matches `CombineSendParams`; `x`, `topk_weights` and `origin`
    // hold n rows (checked); every origin is a (block, k) of this dispatch's plan, so the row
    // lands inside the forwarder's `comb_in` region (rows of at most `comb_bytes`, checked);
    // rows of this rank's own blocks are not sent (the forward reads them from `x`).
    unsafe {
        send.launch(
            stream,
            cfg(grid_for(nr as u64, WARPS, send.props(), 2)),
            send_params,
        )
    }?;
    signal_cuda(stream, buffer, seq, SignalTarget::NodePeers)?;
    let forward = kernels.kernel(super::buffer::COMBINE_FILE, "internode_combine_forward")?;
    let fwd_params = ForwardParams {
        b: view,
        seq,
        block_count: bc,
        fwd_mask: fm,
        x,
        topk_weights: w,
        dest,
        hidden: i32_of(h),
        num_topk: i32_of(k),
        off_w: i32_of(off_w),
        row_bytes: i32_of(row_bytes),
    };
    // SAFETY: `fwd_params` matches `ForwardParams`; block counts are at most M and the masks
    // and plan hold N * M and P * N * M entries (checked), so every row read and written lies
    // in this buffer's regions or in `x` / `topk_weights` (a planned row is below n), and
    // every put lands in the home's receive region.
    unsafe { forward.launch(stream, cfg(forward.props().sm_count.max(1)), fwd_params) }?;
    signal_cuda(stream, buffer, seq, SignalTarget::Nodes)?;
    let recv = kernels.kernel(super::buffer::COMBINE_FILE, "internode_combine_recv")?;
    let recv_params = CombineRecvParams {
        b: view,
        seq,
        node_send_index: nsi,
        combined_x: out,
        combined_w: cw,
        num_tokens: i32_of(t),
        hidden: i32_of(h),
        num_topk: i32_of(k),
        off_w: i32_of(off_w),
        bias,
    };
    // SAFETY: `recv_params` matches `CombineRecvParams`; the outputs and the bias hold T rows
    // (checked)
    // and every send index is below M, inside the receive region.
    unsafe {
        recv.launch(
            stream,
            cfg(grid_for(t as u64, WARPS, recv.props(), 2)),
            recv_params,
        )
    }?;
    drop(guards);
    Ok(())
}
