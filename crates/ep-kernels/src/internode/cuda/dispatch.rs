//! Launchers of `dispatch.cu`: the home's send (and the signal that releases its blocks),
//! then the receiver's plan and copy.

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig};

use super::buffer::{InBuffer, InternodeBuffer, SignalTarget};
use super::notify::signal_cuda;
use crate::cuda::{assert_params_layout, check_align, grid_for, KernelParams, Kernels};
use crate::error::{Error, Result};
use crate::internode::layout::MessageLayout;
use crate::intranode::{Payload, RecvPayload, RecvTopK, TopK};

/// Threads of the send and receive kernels (`kSendThreads`, `kRecvThreads`): 16 warps.
const THREADS: u32 = 512;
const WARPS: u64 = THREADS as u64 / 32;

/// Mirror of `SendParams` in dispatch.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SendParams {
    b: InBuffer,
    m: MessageLayout,
    x: CUdeviceptr,
    scales: CUdeviceptr,
    topk_idx: CUdeviceptr,
    topk_weights: CUdeviceptr,
    node_send_index: CUdeviceptr,
    is_token_in_rank: CUdeviceptr,
    num_tokens: i32,
    pad: i32,
}
assert_params_layout!(
    SendParams,
    216;
    b = 0, m = 128, x = 160, scales = 168, topk_idx = 176, topk_weights = 184,
    node_send_index = 192, is_token_in_rank = 200, num_tokens = 208, pad = 212,
);
// SAFETY: repr(C) plain data mirroring `SendParams`.
unsafe impl KernelParams for SendParams {}

/// Mirror of `PlanParams` in dispatch.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PlanParams {
    b: InBuffer,
    m: MessageLayout,
    seq: u64,
    block_count: CUdeviceptr,
    rank_prefix_matrix: CUdeviceptr,
    dest: CUdeviceptr,
    fwd_mask: CUdeviceptr,
}
assert_params_layout!(
    PlanParams,
    200;
    b = 0, m = 128, seq = 160, block_count = 168, rank_prefix_matrix = 176, dest = 184,
    fwd_mask = 192,
);
// SAFETY: repr(C) plain data mirroring `PlanParams`.
unsafe impl KernelParams for PlanParams {}

/// Mirror of `RecvParams` in dispatch.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RecvParams {
    b: InBuffer,
    m: MessageLayout,
    seq: u64,
    block_count: CUdeviceptr,
    dest: CUdeviceptr,
    recv_x: CUdeviceptr,
    recv_scales: CUdeviceptr,
    recv_src_idx: CUdeviceptr,
    recv_topk_idx: CUdeviceptr,
    recv_topk_weights: CUdeviceptr,
    origin: CUdeviceptr,
    num_experts: i32,
    pad: i32,
}
assert_params_layout!(
    RecvParams,
    240;
    b = 0, m = 128, seq = 160, block_count = 168, dest = 176, recv_x = 184, recv_scales = 192,
    recv_src_idx = 200, recv_topk_idx = 208, recv_topk_weights = 216, origin = 224,
    num_experts = 232, pad = 236,
);
// SAFETY: repr(C) plain data mirroring `RecvParams`.
unsafe impl KernelParams for RecvParams {}

/// What a home rank sends (`T` tokens of `hidden` channels, `N` nodes).
#[derive(Debug)]
pub struct InternodeSendArgs<'a> {
    /// `[T, hidden]` rows (and scales, for fp8).
    pub x: Payload<'a>,
    /// The routing sent along (a fresh dispatch); `None` in a cached dispatch.
    pub topk: Option<TopK<'a>>,
    /// Top-k `K` of `topk` (0 without).
    pub num_topk: usize,
    /// `[T, N]` from the notify step (or the handle).
    pub node_send_index: CudaView<'a, i32>,
    /// `[T, R]` 0/1 bytes: the ranks each token goes to (from the layout or the handle).
    pub is_token_in_rank: CudaView<'a, u8>,
    /// `T`.
    pub num_tokens: usize,
    /// Channels per row.
    pub hidden: usize,
}

/// The message layout of a dispatch of `hidden` channels.
fn message(x_fp8: bool, hidden: usize, num_topk: usize) -> Result<MessageLayout> {
    MessageLayout::new(hidden, x_fp8, num_topk)
}

/// Launches the home's send and the signal that releases its blocks (every rank, after
/// [`super::notify_cuda`] of the same op, whose sequence number is `seq`).
pub fn dispatch_send_cuda(
    stream: &CudaStream,
    buffer: &InternodeBuffer,
    seq: u64,
    args: InternodeSendArgs<'_>,
) -> Result<()> {
    let l = buffer.layout();
    let (t, n, h, k) = (args.num_tokens, l.num_nodes(), args.hidden, args.num_topk);
    let fp8 = matches!(args.x, Payload::Fp8 { .. });
    let m = message(fp8, h, k)?;
    l.check_op(t, Some(&m), None)?;
    Error::check_len("node_send_index", t * n, args.node_send_index.len())?;
    Error::check_len(
        "is_token_in_rank",
        t * l.num_ranks,
        args.is_token_in_rank.len(),
    )?;
    let (x, scales, _gx) = match &args.x {
        Payload::Bf16(x) => {
            Error::check_len("x", t * h, x.len())?;
            let (p, g) = x.device_ptr(stream);
            (p, 0, vec![g])
        }
        Payload::Fp8 { x, scales } => {
            Error::check_len("x", t * h, x.len())?;
            Error::check_len("x_scales", t * (h / crate::FP8_GROUP), scales.len())?;
            let (p, g) = x.device_ptr(stream);
            let (s, gs) = scales.device_ptr(stream);
            (p, s, vec![g, gs])
        }
    };
    check_align("x", x, 16)?;
    let (idx, w, _gk) = match &args.topk {
        Some(tk) => {
            Error::check_len("topk_idx", t * k, tk.idx.len())?;
            Error::check_len("topk_weights", t * k, tk.weights.len())?;
            let (i, gi) = tk.idx.device_ptr(stream);
            let (w, gw) = tk.weights.device_ptr(stream);
            (i, w, vec![gi, gw])
        }
        None => (0, 0, Vec::new()),
    };
    let (nsi, _gn) = args.node_send_index.device_ptr(stream);
    let (itir, _gi) = args.is_token_in_rank.device_ptr(stream);
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(super::buffer::DISPATCH_FILE, "internode_dispatch_send")?;
    let params = SendParams {
        b: buffer.view(stream),
        m,
        x,
        scales,
        topk_idx: idx,
        topk_weights: w,
        node_send_index: nsi,
        is_token_in_rank: itir,
        num_tokens: t as i32,
        pad: 0,
    };
    let cfg = LaunchConfig {
        grid_dim: (grid_for(t as u64, WARPS, kernel.props(), 2), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `SendParams`; the views hold T rows, T * K routing entries and
    // T * N indices and T * R flags (checked); every index is below max_tokens (T <= max_tokens, checked) and
    // every message fits a slot (checked), so all writes and puts stay in the symmetric buffers.
    unsafe { kernel.launch(stream, cfg, params) }?;
    signal_cuda(stream, buffer, seq, SignalTarget::Nodes)
}

/// Where a receiver's rows come from.
#[derive(Debug)]
pub enum DispatchPlan<'a> {
    /// A fresh dispatch: the plan kernel fills `dest` (`[P, N, M]`) and, for this rank's own
    /// blocks, `fwd_mask` (`[N, M]`), from the notify step's outputs.
    Fresh {
        /// `[P, N]` from the notify step.
        block_count: CudaView<'a, i32>,
        /// `[R, R]` from the notify step.
        rank_prefix_matrix: CudaView<'a, i32>,
        /// Out: `[P, N, M]` row of each block message in `recv_x` (`-1`: not this rank's).
        dest: CudaViewMut<'a, i32>,
        /// Out: `[N, M]` GPUs of this node holding each token of this rank's own blocks.
        fwd_mask: CudaViewMut<'a, u8>,
        /// Out: `[n]` `block * M + k` of each received row (combine's input).
        origin: CudaViewMut<'a, i32>,
    },
    /// A cached dispatch: the handle's plan.
    Cached {
        /// `[P, N]`.
        block_count: CudaView<'a, i32>,
        /// `[P, N, M]`.
        dest: CudaView<'a, i32>,
    },
}

/// What a receiver writes (`n` rows).
#[derive(Debug)]
pub struct InternodeRecvArgs<'a> {
    /// `[n, hidden]` rows (and scales, for fp8), the layout of the send's `x`.
    pub recv_x: RecvPayload<'a>,
    /// `[n]` source token index (a fresh dispatch).
    pub recv_src_idx: Option<CudaViewMut<'a, i32>>,
    /// `[n, K]` local expert ids and weights (a fresh dispatch with routing).
    pub recv_topk: Option<RecvTopK<'a>>,
    /// Top-k `K` of the send (0 without routing).
    pub num_topk: usize,
    /// `n`.
    pub num_recv_tokens: usize,
    /// Channels per row.
    pub hidden: usize,
    /// `E` (a fresh dispatch with routing; else 0).
    pub num_experts: usize,
}

/// Launches the receiver's side of the op whose sequence number is `seq` (after
/// [`dispatch_send_cuda`]): the plan (a fresh dispatch), then the copy.
pub fn dispatch_recv_cuda(
    stream: &CudaStream,
    buffer: &InternodeBuffer,
    seq: u64,
    plan: DispatchPlan<'_>,
    args: InternodeRecvArgs<'_>,
) -> Result<()> {
    let l = buffer.layout();
    let (r, n, p, mt) = (l.num_ranks, l.num_nodes(), l.gpus_per_node, l.max_tokens);
    let (nr, h, k) = (args.num_recv_tokens, args.hidden, args.num_topk);
    let fp8 = matches!(args.recv_x, RecvPayload::Fp8 { .. });
    let m = message(fp8, h, k)?;
    let mut guards = Vec::new();
    let (recv_x, recv_scales) = match &args.recv_x {
        RecvPayload::Bf16(x) => {
            Error::check_len("recv_x", nr * h, x.len())?;
            let (p, g) = x.device_ptr(stream);
            guards.push(g);
            (p, 0)
        }
        RecvPayload::Fp8 { x, scales } => {
            Error::check_len("recv_x", nr * h, x.len())?;
            Error::check_len("recv_x_scales", nr * (h / crate::FP8_GROUP), scales.len())?;
            let (p, g) = x.device_ptr(stream);
            let (s, gs) = scales.device_ptr(stream);
            guards.extend([g, gs]);
            (p, s)
        }
    };
    check_align("recv_x", recv_x, 16)?;
    let recv_src_idx = match &args.recv_src_idx {
        Some(v) => {
            Error::check_len("recv_src_idx", nr, v.len())?;
            let (p, g) = v.device_ptr(stream);
            guards.push(g);
            p
        }
        None => 0,
    };
    let (recv_idx, recv_w) = match &args.recv_topk {
        Some(tk) => {
            if args.num_experts == 0 || args.num_experts % r != 0 {
                return Err(Error::invalid(
                    "num_experts",
                    args.num_experts,
                    format!("must be a positive multiple of num_ranks = {r}"),
                ));
            }
            Error::check_len("recv_topk_idx", nr * k, tk.idx.len())?;
            Error::check_len("recv_topk_weights", nr * k, tk.weights.len())?;
            let (i, gi) = tk.idx.device_ptr(stream);
            let (w, gw) = tk.weights.device_ptr(stream);
            guards.extend([gi, gw]);
            (i, w)
        }
        None => (0, 0),
    };
    let kernels = Kernels::for_stream(stream)?;
    let view = buffer.view(stream);
    let (block_count, dest, origin) = match &plan {
        DispatchPlan::Fresh {
            block_count,
            rank_prefix_matrix,
            dest,
            fwd_mask,
            origin,
        } => {
            Error::check_len("block_count", p * n, block_count.len())?;
            Error::check_len("rank_prefix_matrix", r * r, rank_prefix_matrix.len())?;
            Error::check_len("dest", p * n * mt, dest.len())?;
            Error::check_len("fwd_mask", n * mt, fwd_mask.len())?;
            Error::check_len("origin", nr, origin.len())?;
            let (bc, g0) = block_count.device_ptr(stream);
            let (rpm, g1) = rank_prefix_matrix.device_ptr(stream);
            let (d, g2) = dest.device_ptr(stream);
            let (fm, g3) = fwd_mask.device_ptr(stream);
            let (o, g4) = origin.device_ptr(stream);
            guards.extend([g0, g1, g2, g3, g4]);
            let plan_params = PlanParams {
                b: view,
                m,
                seq,
                block_count: bc,
                rank_prefix_matrix: rpm,
                dest: d,
                fwd_mask: fm,
            };
            let kernel = kernels.kernel(super::buffer::DISPATCH_FILE, "internode_dispatch_plan")?;
            let cfg = LaunchConfig {
                grid_dim: ((p * n) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `plan_params` matches `PlanParams`; `dest` holds P * N * M and
            // `fwd_mask` N * M entries (checked); block counts never exceed M (each home
            // sends at most max_tokens tokens, checked at its send); the forwarders' buffers
            // are mapped through the peer table.
            unsafe { kernel.launch(stream, cfg, plan_params) }?;
            (bc, d, o)
        }
        DispatchPlan::Cached { block_count, dest } => {
            Error::check_len("block_count", p * n, block_count.len())?;
            Error::check_len("dest", p * n * mt, dest.len())?;
            let (bc, g0) = block_count.device_ptr(stream);
            let (d, g1) = dest.device_ptr(stream);
            guards.extend([g0, g1]);
            (bc, d, 0)
        }
    };
    let params = RecvParams {
        b: view,
        m,
        seq,
        block_count,
        dest,
        recv_x,
        recv_scales,
        recv_src_idx,
        recv_topk_idx: recv_idx,
        recv_topk_weights: recv_w,
        origin,
        num_experts: args.num_experts as i32,
        pad: 0,
    };
    let kernel = kernels.kernel(super::buffer::DISPATCH_FILE, "internode_dispatch_recv")?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(nr as u64, WARPS, kernel.props(), 2), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `RecvParams`; every `dest` entry of the plan is a row below
    // `n` (the notify counts of this op; the plan gives each of this rank's tokens one row
    // of its source's block, and the blocks' rows add up to `n`), and the outputs hold `n`
    // rows (checked).
    unsafe { kernel.launch(stream, cfg, params) }?;
    drop(guards);
    Ok(())
}
