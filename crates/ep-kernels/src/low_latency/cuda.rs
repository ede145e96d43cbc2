//! Typed launchers of the low-latency kernels (`dispatch.cu`, `combine.cu`, `control.cu`); host
//! twins: [`super::host`] (slots, receive layout, combine) and [`crate::fp8`] (the cast fused
//! into the dispatch).
//!
//! Protocol in short (details and the buffer layout: `protocol.cuh`, [`LowLatencyLayout`]):
//! - **dispatch**: each token of a source is cast (fp8 1x128, fused) and written once to every
//!   rank that holds at least one of its experts (NVLink stores into that rank's per-source
//!   token region); each `(t, k)` also writes a 4-byte index entry into slot
//!   [`super::send_slots`]`[t, k]` of expert `topk_idx[t, k]`'s region for this source. Then per
//!   expert the count `n` goes out as a signal. The receiver waits for the `R` signals of each
//!   local expert and packs the tokens source-major ([`super::RecvLayout`]) into
//!   [`LowLatencyRecv`], following the index entries. Sending a token once per rank instead of
//!   once per expert divides the NVLink bytes by the number of its experts a rank holds.
//! - **combine**: each expert output row goes back into row `(t, k)` of its source token on
//!   the home rank, then a flag per (expert, home); the home waits for every expert's flag and
//!   reduces `sum_k w[t, k] * y(t, k)` in f32, in k order, like [`super::combine`].
//!   [`Reduction::PerRank`](super::Reduction): the expert rank sums the weighted rows of its
//!   experts per token first and sends one row per (token, rank) into row `j` (the rank's place
//!   among the token's ranks), then a flag per (rank, home); the home adds its rows like
//!   [`super::combine_per_rank`]. The weights come with the dispatch (`topk_weights` of
//!   [`dispatch_cuda`]: in each message, a header with `j` and the mask of the token's `k` held
//!   by the rank, and the weights after the body; the receive phase copies them into
//!   [`RankRecords`] with the packed rows, which the combine's send phase reads).
//! - Both take a [`Phases`]: `Both` in one launch, or `Send` now and `Recv` later (a receive
//!   hook; at most two sends of one kind may be pending).
//! - Nothing needs the host between ops: the buffer set (op parity) and the signal tags come
//!   from a device-side op counter, so dispatch + combine can be captured in a CUDA graph and
//!   replayed. Every rank must run the same sequence of ops. After other kernels used the
//!   buffer's memory, or after a timeout, run [`clean_buffer_cuda`] on every rank (with a
//!   barrier before and after).
//! - Waits time out after [`LowLatencyBuffer::timeout`]; the waiting rank then marks the peer
//!   inactive in its `active_ranks` mask ([`LowLatencyBuffer::active_ranks`]) and treats its
//!   contribution as zero. Inactive ranks are neither waited for nor written to. Every launch
//!   with a receive phase leaves the mask in host-mapped memory as it ends
//!   ([`LowLatencyBuffer::active_ranks_mirror`]), so the host learns of a timeout without a
//!   copy on the stream.
//! - **one rank** (`num_ranks == 1` with [`Phases::Both`]): the op never leaves the GPU, so
//!   `local.cu` runs it with two small kernels (`cuda/local.rs`) that skip the protocol (no
//!   signals, flags, fences, op counters or grid-wide waits) and produce bit for bit the same
//!   outputs; split phases at one rank keep the protocol kernels.
//!
//! No launcher synchronises the stream. Launch on a stream of the buffer's context; with
//! cudarc's event tracking on, slices used across streams add event waits, so disable it
//! (`CudaContext::disable_event_tracking`) before capturing graphs.

mod buffer;
mod local;
mod recv;

/// Peer access lives with the rest of device memory in [`crate::memory`].
pub use crate::memory::enable_peer_access;
pub use buffer::{LowLatencyBuffer, DEFAULT_TIMEOUT};
pub use recv::{
    LowLatencyFormat, LowLatencyRecv, LowLatencyRecvMut, LowLatencyRecvRef, Phases, RankRecords,
    RankRecordsMut, RankRecordsRef, RecvXMut,
};

// `buffer` reaches the layout as `super::layout`.
use super::layout::{self, LowLatencyLayout, LL_MAX_TOPK};

use std::time::Duration;

use buffer::LlBuffer;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop};
use half::bf16;

use crate::cuda::{assert_params_layout, check_align, KernelParams, Kernels};
use crate::error::{Error, Result};

/// The cubins of the dispatch, the combine and the buffer's reset and delay kernels (`dispatch.cu`,
/// `combine.cu`, `control.cu`; their protocol: `protocol.cuh`).
const DISPATCH_FILE: &str = "low_latency/dispatch";
const COMBINE_FILE: &str = "low_latency/combine";
/// The same kernels with NVSHMEM puts to other nodes (feature `nvshmem`).
const DISPATCH_NVSHMEM_FILE: &str = "low_latency/dispatch_nvshmem";
const COMBINE_NVSHMEM_FILE: &str = "low_latency/combine_nvshmem";
const CONTROL_FILE: &str = "low_latency/control";
/// Threads per block (`kThreads` in `protocol.cuh`).
const THREADS: u32 = 1024;

/// Mirror of `struct DispatchParams` in `protocol.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DispatchParams {
    buf: LlBuffer,
    x: CUdeviceptr,
    topk_idx: CUdeviceptr,
    recv_x: CUdeviceptr,
    recv_scales: CUdeviceptr,
    recv_count: CUdeviceptr,
    recv_src_info: CUdeviceptr,
    recv_src_topk: CUdeviceptr,
    recv_layout_range: CUdeviceptr,
    topk_weights: CUdeviceptr,
    recv_rank_records: CUdeviceptr,
    num_tokens: i32,
    num_topk: i32,
    fp8: u32,
    scale_format: u32,
    phases: u32,
    reserved: u32,
}
assert_params_layout!(
    DispatchParams,
    248;
    buf = 0, x = 144, topk_idx = 152, recv_x = 160, recv_scales = 168, recv_count = 176,
    recv_src_info = 184, recv_src_topk = 192, recv_layout_range = 200, topk_weights = 208,
    recv_rank_records = 216, num_tokens = 224, num_topk = 228, fp8 = 232, scale_format = 236,
    phases = 240, reserved = 244,
);
// SAFETY: `repr(C)` plain data mirroring `DispatchParams` (size asserted on both sides).
unsafe impl KernelParams for DispatchParams {}

/// Mirror of `struct CombineParams` in `protocol.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CombineParams {
    buf: LlBuffer,
    x: CUdeviceptr,
    src_info: CUdeviceptr,
    src_topk: CUdeviceptr,
    layout_range: CUdeviceptr,
    topk_idx: CUdeviceptr,
    topk_weights: CUdeviceptr,
    out: CUdeviceptr,
    rank_records: CUdeviceptr,
    num_tokens: i32,
    num_topk: i32,
    phases: u32,
    reduce: u32,
}
assert_params_layout!(
    CombineParams,
    224;
    buf = 0, x = 144, src_info = 152, src_topk = 160, layout_range = 168, topk_idx = 176,
    topk_weights = 184, out = 192, rank_records = 200, num_tokens = 208, num_topk = 212,
    phases = 216, reduce = 220,
);
// SAFETY: `repr(C)` plain data mirroring `CombineParams` (size asserted on both sides).
unsafe impl KernelParams for CombineParams {}

/// Mirror of `struct CleanParams` in `protocol.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CleanParams {
    buf: LlBuffer,
    reset_active: u32,
    reserved: u32,
}
assert_params_layout!(
    CleanParams,
    152;
    buf = 0, reset_active = 144, reserved = 148,
);
// SAFETY: `repr(C)` plain data mirroring `CleanParams` (size asserted on both sides).
unsafe impl KernelParams for CleanParams {}

/// Mirror of `struct SpinParams` in `protocol.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SpinParams {
    ns: u64,
}
assert_params_layout!(
    SpinParams,
    8;
    ns = 0,
);
// SAFETY: `repr(C)` plain data mirroring `SpinParams` (size asserted on both sides).
unsafe impl KernelParams for SpinParams {}

fn align16(v: usize) -> usize {
    v.div_ceil(16) * 16
}

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

/// One block per SM: the kernels' blocks wait for each other, so all must be resident.
fn comm_config(kernels: &Kernels, smem: usize) -> Result<LaunchConfig> {
    let shared_mem_bytes = u32::try_from(smem)
        .map_err(|_| Error::invalid("shared_mem_bytes", smem, "must fit in u32"))?;
    Ok(LaunchConfig {
        grid_dim: (kernels.props().sm_count.max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes,
    })
}

fn check_tokens(layout: &LowLatencyLayout, num_tokens: usize, num_topk: usize) -> Result<()> {
    if num_tokens > layout.max_tokens_per_rank {
        return Err(Error::invalid(
            "num_tokens",
            num_tokens,
            format!(
                "must be <= max_tokens_per_rank = {}",
                layout.max_tokens_per_rank
            ),
        ));
    }
    if num_topk == 0 || num_topk > LL_MAX_TOPK {
        return Err(Error::invalid(
            "num_topk",
            num_topk,
            format!("must be in [1, {LL_MAX_TOPK}]"),
        ));
    }
    Ok(())
}

/// Low-latency dispatch of this rank's `x: [num_tokens, H]` bf16 routed by
/// `topk_idx: [num_tokens, num_topk]` (i64, `-1` = none) into every expert's rank; receives
/// into `out` (a `&mut` [`LowLatencyRecv`], or a [`LowLatencyRecvMut`] of views). `x`,
/// `topk_idx` and `topk_weights` are read by the send phase only; `out` is written by the
/// receive phase only. With `topk_weights` (`[num_tokens, num_topk]` f32) the dispatch also
/// carries what a [`Reduction::PerRank`](super::Reduction) combine needs, and the receive phase
/// writes `out.ranks` (then required). Every rank must launch the same phases in the same
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
    let (rc, _g2) = out.recv_count.device_ptr_mut(stream);
    let (ri, _g3) = out.recv_src_info.device_ptr_mut(stream);
    let (rk, _g4) = out.recv_src_topk.device_ptr_mut(stream);
    let (rl, _g5) = out.recv_layout_range.device_ptr_mut(stream);
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
    // (checked above; the scales may be null only for bf16, where the kernel does not touch
    // them; the records are null exactly when the weights are, and the kernel writes
    // them only then), all 16-byte aligned where the
    // kernel uses vectors; every pointer comes from a borrowed slice or view, so its memory
    // lives until the launch is queued, and its owner frees it stream-ordered (after the
    // kernel); the buffer and its peer table outlive the launch because the buffer
    // synchronises its context before freeing; the guards keep cudarc's stream ordering until
    // the launch is queued.
    unsafe { kernel.launch(stream, cfg, params) }
}

/// Low-latency combine: sends the expert outputs `x: [L, R*M, H]` bf16 (rows in the order of
/// `handle`, the outputs of the matching dispatch: a `&` [`LowLatencyRecv`] or a
/// [`LowLatencyRecvRef`] of views) back to their home ranks, and
/// on this (home) rank reduces the rows of its `num_tokens` tokens into
/// `out: [num_tokens, H]` bf16 with `topk_idx`, `topk_weights: [num_tokens, num_topk]`
/// exactly as [`super::combine`] (inactive ranks contribute nothing), or, with
/// [`Reduction::PerRank`](super::Reduction), as [`super::combine_per_rank`] with the weights
/// the dispatch carried (its `handle.ranks`, then required; `topk_weights` is not read). The
/// send phase reads `x` and `handle`; the receive phase reads `topk_idx` (and, per expert,
/// `topk_weights`) and writes `out`. At one rank both reductions give the same bits, and both
/// run per expert (a `Both` launch in the one-rank kernel, split phases in the protocol's),
/// so there a per-rank combine reads `topk_weights` (the dispatch's weights) and not
/// `handle.ranks`. Every rank must use the same reduction.
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
    reduction: super::Reduction,
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
    let per_rank = reduction == super::Reduction::PerRank && layout.num_ranks > 1;
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
    let (si, _g0) = handle.recv_src_info.device_ptr(stream);
    let (sk, _g1) = handle.recv_src_topk.device_ptr(stream);
    let (lr, _g2) = handle.recv_layout_range.device_ptr(stream);
    let (t_ptr, _g3) = topk_idx.device_ptr(stream);
    let (w_ptr, _g4) = topk_weights.device_ptr(stream);
    let (o_ptr, _g5) = out.device_ptr_mut(stream);
    let (rr, _g6) = match ranks {
        Some(t) => t.rank_records.device_ptr(stream),
        None => (0, SyncOnDrop::Sync(None)),
    };
    check_align("x", x_ptr, 16)?;
    check_align("out", o_ptr, 16)?;
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
    // (checked above; the records are null exactly when `reduce` is 0, and only read
    // then) and the vector-accessed ones are 16-byte aligned; the buffer outlives
    // the launch (it synchronises its context before freeing); the guards keep cudarc's
    // stream ordering until the launch is queued.
    unsafe { kernel.launch(stream, cfg, params) }
}

/// Resets the buffer's op sequencing, send counters, and the signals and flags of both sets
/// (after other kernels used the memory, or after a timeout); with `reset_active`, also marks
/// every rank active. Run it on every rank, with a barrier before (no op in flight anywhere)
/// and after (before the next op).
pub fn clean_buffer_cuda(
    stream: &CudaStream,
    buffer: &LowLatencyBuffer,
    reset_active: bool,
) -> Result<()> {
    let buf = buffer.desc(stream)?;
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(CONTROL_FILE, "ll_clean")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = CleanParams {
        buf,
        reset_active: u32::from(reset_active),
        reserved: 0,
    };
    // SAFETY: `params` matches `CleanParams`; the kernel writes only inside the buffer's own
    // allocation, at offsets of its layout.
    unsafe { kernel.launch(stream, cfg, params) }
}

/// Keeps `stream` busy for `duration` with a one-thread kernel (benchmarks and tests use it
/// to stand for work done between a send and a receive phase).
pub fn delay_cuda(stream: &CudaStream, duration: Duration) -> Result<()> {
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(CONTROL_FILE, "ll_spin")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = SpinParams {
        ns: u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX),
    };
    // SAFETY: `params` matches `SpinParams`; the kernel touches no memory.
    unsafe { kernel.launch(stream, cfg, params) }
}
