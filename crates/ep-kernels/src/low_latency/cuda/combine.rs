//! Launcher of the low-latency combine (`combine.cu`, and `combine_nvshmem.cu`, the same
//! kernel built with NVSHMEM puts to other nodes); protocol and host twins in [`super`].

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use half::bf16;

use super::layout::RecvI32Block;
use super::recv::block_part;
use super::{
    align16, check_tokens, comm_config, local, CombineParams, LowLatencyBuffer, LowLatencyRecvRef,
    Phases, LL_MAX_TOPK,
};
use crate::cuda::{check_align, Kernels};
use crate::error::{Error, Result};

/// The cubin of the combine (`combine.cu`; its protocol: `protocol.cuh`).
const COMBINE_FILE: &str = "low_latency/combine";
/// The same kernel with NVSHMEM puts to other nodes (feature `nvshmem`), which the buffer binds.
pub(super) const COMBINE_NVSHMEM_FILE: &str = "low_latency/combine_nvshmem";

/// Low-latency combine: sends the expert outputs `x: [L, R*M, H]` bf16 (rows in the order of
/// `handle`, the outputs of the matching dispatch: a `&` [`LowLatencyRecv`](super::LowLatencyRecv)
/// or a [`LowLatencyRecvRef`] of views) back to their home ranks, and on this (home) rank reduces
/// the rows of its `num_tokens` tokens into `out: [num_tokens, H]` bf16 with `topk_idx`,
/// `topk_weights: [num_tokens, num_topk]` exactly as [`crate::low_latency::combine`] (inactive
/// ranks contribute nothing), or, with [`Reduction::PerRank`](crate::low_latency::Reduction), as
/// [`crate::low_latency::combine_per_rank`] with the weights the dispatch carried (its
/// `handle.ranks`, then required; `topk_weights` is not read). The send phase reads `x` and
/// `handle`; the receive phase reads `topk_idx` (and, per expert, `topk_weights`) and writes `out`.
/// At one rank both reductions give the same bits, and both run per expert (a `Both` launch in the
/// one-rank kernel, split phases in the protocol's), so there a per-rank combine reads
/// `topk_weights` (the dispatch's weights) and not `handle.ranks`. Every rank must use the same
/// reduction.
#[allow(clippy::too_many_arguments)]
pub fn combine_cuda<'h>(
    stream: &CudaStream,
    buffer: &LowLatencyBuffer,
    x: &impl DevicePtr<bf16>,
    handle: impl Into<LowLatencyRecvRef<'h>>,
    topk_idx: &impl DevicePtr<i64>,
    topk_weights: &impl DevicePtr<f32>,
    num_tokens: usize,
    num_topk: usize,
    phases: Phases,
    reduction: crate::low_latency::Reduction,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let handle = handle.into();
    let layout = buffer.layout();
    check_tokens(layout, num_tokens, num_topk)?;
    let rows = layout.num_local_experts() * layout.recv_rows_per_expert();
    Error::check_len("x", rows * layout.hidden, x.len())?;
    handle.check(layout)?;
    let local = layout.num_ranks == 1 && phases == Phases::Both;
    // At one rank a per-rank combine gives the bits of a per-expert one (the rank's partial
    // sum is the token's sum, added at the home with weight 1): it runs per expert there.
    let per_rank = reduction == crate::low_latency::Reduction::PerRank && layout.num_ranks > 1;
    let ranks = match (&handle.ranks, per_rank) {
        (Some(t), true) => Some(t),
        (None, true) => {
            return Err(Error::invalid(
                "handle.ranks",
                "None",
                "a per-rank combine reads the records of a dispatch that carried topk_weights",
            ))
        }
        (_, false) => None,
    };
    Error::check_len("topk_idx", num_tokens * num_topk, topk_idx.len())?;
    Error::check_len("topk_weights", num_tokens * num_topk, topk_weights.len())?;
    Error::check_len("out", num_tokens * layout.hidden, out.len())?;
    let buf = buffer.desc(stream)?;
    let kernels = Kernels::for_stream(stream)?;
    let (x_ptr, _gx) = x.device_ptr(stream);
    let at = RecvI32Block::new(layout);
    let (block, _g0) = handle.block.device_ptr(stream);
    let (si, sk) = (
        block_part(block, at.src_info()),
        block_part(block, at.src_topk()),
    );
    let lr = block_part(block, at.layout_range());
    let (t_ptr, _g3) = topk_idx.device_ptr(stream);
    let (w_ptr, _g4) = topk_weights.device_ptr(stream);
    let (o_ptr, _g5) = out.device_ptr_mut(stream);
    let (rr, _g6) = match ranks {
        Some(t) => t.rank_records.device_ptr(stream),
        None => (0, SyncOnDrop::Sync(None)),
    };
    check_align("x", x_ptr, 16)?;
    check_align("out", o_ptr, 16)?;
    check_align("handle.block", block, 16)?;
    let params = CombineParams {
        buf,
        x: x_ptr,
        src_info: si,
        src_topk: sk,
        layout_range: lr,
        topk_idx: t_ptr,
        topk_weights: w_ptr,
        out: o_ptr,
        rank_records: rr,
        num_tokens: num_tokens as i32,
        num_topk: num_topk as i32,
        phases: phases as u32,
        reduce: u32::from(per_rank),
    };
    if local {
        // SAFETY: `params` is what `ll_combine` would be launched with below (see there); the
        // guards are alive until `local::combine` has queued the launch.
        return unsafe { local::combine(stream, &kernels, &params) };
    }
    let kernel = if buffer.reaches_other_nodes() {
        let kernel = kernels.kernel(COMBINE_NVSHMEM_FILE, "ll_combine")?;
        buffer.bind(&kernel)?;
        kernel
    } else {
        kernels.kernel(COMBINE_FILE, "ll_combine")?
    };
    let send_smem = if per_rank {
        4 * (2 * layout.num_ranks + 2 * layout.num_experts)
    } else {
        4 * (3 * layout.num_experts + 1 + layout.num_ranks)
    };
    let recv_smem = LL_MAX_TOPK * 8 + 4 * layout.num_ranks;
    let cfg = comm_config(&kernels, align16(send_smem.max(recv_smem)))?;
    // SAFETY: `params` matches `CombineParams`; every slice has the length the kernel uses
    // (checked above; the handle's parts lie inside `handle.block` at the offsets of
    // `RecvI32Block`; the records are null exactly when `reduce` is 0, and only read
    // then) and the vector-accessed ones are 16-byte aligned; the buffer outlives
    // the launch (it synchronises its context before freeing); the guards keep cudarc's
    // stream ordering until the launch is queued.
    unsafe { kernel.launch(stream, cfg, params) }
}
