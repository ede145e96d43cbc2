//! Launcher of the low-latency dispatch (`dispatch.cu`, and `dispatch_nvshmem.cu`, the same
//! kernel built with NVSHMEM puts to other nodes); protocol and host twins in [`super`].

use cudarc::driver::{CudaStream, CudaView, DevicePtr, DevicePtrMut, SyncOnDrop};
use half::bf16;

use super::layout::{LowLatencyLayout, RecvI32Block, LL_MAX_TOPK};
use super::recv::block_part;
use super::{
    align16, check_tokens, comm_config, local, DispatchParams, LowLatencyBuffer, LowLatencyFormat,
    LowLatencyRecvMut, Phases,
};
use crate::cuda::{check_align, Kernels};
use crate::error::{Error, Result};

/// The cubin of the dispatch (`dispatch.cu`; its protocol: `protocol.cuh`).
const DISPATCH_FILE: &str = "low_latency/dispatch";
/// The same kernel with NVSHMEM puts to other nodes (feature `nvshmem`), which the buffer binds.
pub(super) const DISPATCH_NVSHMEM_FILE: &str = "low_latency/dispatch_nvshmem";

/// Dynamic shared memory of `ll_dispatch` (see the kernel's comment): the send phase's
/// staging, destinations, top-k (and weights), or the receive phase's layout, whichever is
/// larger.
fn dispatch_smem_bytes(
    layout: &LowLatencyLayout,
    num_tokens: usize,
    num_topk: usize,
    weights: bool,
) -> usize {
    let tk = num_tokens * num_topk;
    let send = layout.msg_stride
        + LL_MAX_TOPK * 8
        + 4 * (tk + layout.num_experts)
        + if weights { 4 * tk } else { 0 };
    let recv = 4 * (2 * layout.num_experts + layout.num_local_experts() + 1);
    align16(send.max(recv))
}

/// Low-latency dispatch of this rank's `x: [num_tokens, H]` bf16 routed by
/// `topk_idx: [num_tokens, num_topk]` (i64, `-1` = none) into every expert's rank; receives into
/// `out` (a `&mut` [`LowLatencyRecv`](super::LowLatencyRecv), or a [`LowLatencyRecvMut`] of views).
/// `x`, `topk_idx` and `topk_weights` are read by the send phase only; `out` is written by the
/// receive phase only. With `topk_weights` (`[num_tokens, num_topk]` f32) the dispatch also carries
/// what a [`Reduction::PerRank`](crate::low_latency::Reduction) combine needs, and the receive
/// phase writes `out.ranks` (then required). Every rank must launch the same phases in the same
/// order, all with or all without `topk_weights`.
#[allow(clippy::too_many_arguments)]
pub fn dispatch_cuda<'o>(
    stream: &CudaStream,
    buffer: &LowLatencyBuffer,
    x: &impl DevicePtr<bf16>,
    topk_idx: &impl DevicePtr<i64>,
    topk_weights: Option<&CudaView<'_, f32>>,
    num_tokens: usize,
    num_topk: usize,
    format: LowLatencyFormat,
    phases: Phases,
    out: impl Into<LowLatencyRecvMut<'o>>,
) -> Result<()> {
    let mut out = out.into();
    let layout = buffer.layout();
    check_tokens(layout, num_tokens, num_topk)?;
    Error::check_len("x", num_tokens * layout.hidden, x.len())?;
    Error::check_len("topk_idx", num_tokens * num_topk, topk_idx.len())?;
    if let Some(w) = topk_weights {
        Error::check_len("topk_weights", num_tokens * num_topk, w.len())?;
        if out.ranks.is_none() {
            return Err(Error::invalid(
                "out.ranks",
                "None",
                "a dispatch that carries topk_weights writes the per-rank combine's records",
            ));
        }
    }
    if out.format != format {
        return Err(Error::invalid(
            "out",
            format!("allocated for {:?}", out.format),
            format!("must be allocated for {format:?}"),
        ));
    }
    out.check(layout)?;
    let buf = buffer.desc(stream)?;
    let kernels = Kernels::for_stream(stream)?;
    let (x_ptr, _gx) = x.device_ptr(stream);
    let (t_ptr, _gt) = topk_idx.device_ptr(stream);
    let (rx, _g0) = out.recv_x.device_ptr_mut(stream);
    // bf16 dispatches never touch the scales (`fp8 == 0` below): a null pointer is fine.
    let (rs, _g1) = match out.recv_x_scales.as_mut() {
        Some(s) => s.device_ptr_mut(stream),
        None => (0, SyncOnDrop::Sync(None)),
    };
    let at = RecvI32Block::new(layout);
    let (block, _g2) = out.block.device_ptr_mut(stream);
    let (rc, ri) = (
        block_part(block, at.count()),
        block_part(block, at.src_info()),
    );
    let (rk, rl) = (
        block_part(block, at.src_topk()),
        block_part(block, at.layout_range()),
    );
    let (w_ptr, _g6) = match topk_weights {
        Some(w) => w.device_ptr(stream),
        None => (0, SyncOnDrop::Sync(None)),
    };
    // The records are written only when the sources send them (with their weights).
    let (rr, _g7) = match out.ranks.as_mut().filter(|_| topk_weights.is_some()) {
        Some(t) => t.rank_records.device_ptr_mut(stream),
        None => (0, SyncOnDrop::Sync(None)),
    };
    check_align("x", x_ptr, 16)?;
    check_align("topk_idx", t_ptr, 8)?;
    check_align("recv_x", rx, 16)?;
    check_align("out.block", block, 16)?;
    let params = DispatchParams {
        buf,
        x: x_ptr,
        topk_idx: t_ptr,
        recv_x: rx,
        recv_scales: rs,
        recv_count: rc,
        recv_src_info: ri,
        recv_src_topk: rk,
        recv_layout_range: rl,
        topk_weights: w_ptr,
        recv_rank_records: rr,
        num_tokens: num_tokens as i32,
        num_topk: num_topk as i32,
        fp8: u32::from(format.is_fp8()),
        scale_format: format.scale_format() as u32,
        phases: phases as u32,
        reserved: 0,
    };
    if layout.num_ranks == 1 && phases == Phases::Both {
        // SAFETY: `params` is what `ll_dispatch` would be launched with below (see there); the
        // guards are alive until `local::dispatch` has queued the launch.
        return unsafe { local::dispatch(stream, &kernels, &params) };
    }
    let kernel = if buffer.reaches_other_nodes() {
        let kernel = kernels.kernel(DISPATCH_NVSHMEM_FILE, "ll_dispatch")?;
        buffer.bind(&kernel)?;
        kernel
    } else {
        kernels.kernel(DISPATCH_FILE, "ll_dispatch")?
    };
    let smem = dispatch_smem_bytes(layout, num_tokens, num_topk, topk_weights.is_some());
    let cfg = comm_config(&kernels, smem)?;
    // SAFETY: `params` matches `DispatchParams`; x holds T*H bf16, topk_idx T*K i64 and the
    // weights (if any) T*K f32, the outputs are sized for the buffer's layout and format
    // (checked above; the `i32` outputs are the parts of `out.block` at the offsets of
    // `RecvI32Block`, disjoint and inside it; the scales may be null only for bf16, where the
    // kernel does not touch them; the records are null exactly when the weights are, and the
    // kernel writes them only then), all 16-byte aligned where the
    // kernel uses vectors; every pointer comes from a borrowed slice or view, so its memory
    // lives until the launch is queued, and its owner frees it stream-ordered (after the
    // kernel); the buffer and its peer table outlive the launch because the buffer
    // synchronises its context before freeing; the guards keep cudarc's stream ordering until
    // the launch is queued.
    unsafe { kernel.launch(stream, cfg, params) }
}
