//! Typed launchers of the low-latency kernels, one module per kernel source: `dispatch`
//! (`dispatch.cu`, and its NVSHMEM build `dispatch_nvshmem.cu`), `combine` (`combine.cu`,
//! `combine_nvshmem.cu`), `control` (`control.cu`) and `local` (`local.cu`); host twins:
//! [`super::host`] (slots, receive layout, combine) and [`crate::fp8`] (the cast fused into the
//! dispatch). This module holds what they share: the params mirrors of `protocol.cuh` and the
//! launch configuration; `buffer` and `recv` the buffer and the receive-side outputs.
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
mod combine;
mod control;
mod dispatch;
mod local;
mod recv;

/// Peer access lives with the rest of device memory in [`crate::memory`].
pub use crate::memory::enable_peer_access;
pub use buffer::{LowLatencyBuffer, DEFAULT_TIMEOUT};
pub use combine::combine_cuda;
pub use control::{clean_buffer_cuda, delay_cuda};
pub use dispatch::dispatch_cuda;
pub use recv::{
    LowLatencyFormat, LowLatencyRecv, LowLatencyRecvMut, LowLatencyRecvParts, LowLatencyRecvRef,
    Phases, RankRecords, RankRecordsMut, RankRecordsRef, RecvRows, RecvXMut,
};

// `buffer` reaches the layout as `super::layout`.
use super::layout::{self, LowLatencyLayout, LL_MAX_TOPK};

use buffer::LlBuffer;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::LaunchConfig;

use crate::cuda::{assert_params_layout, KernelParams, Kernels};
use crate::error::{Error, Result};

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

fn align16(v: usize) -> usize {
    v.div_ceil(16) * 16
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
