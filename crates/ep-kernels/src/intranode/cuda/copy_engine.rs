//! The copy-engine path of the intranode normal mode: SMs pack and reduce in local memory, and
//! the NVLink bytes move by the GPUs' copy engines (`cuMemcpyDtoDAsync` between NVLink buffers
//! and tensors) for `copy_engine_peers` peers and by SM warps for the others (the copy engines
//! of one GPU do not scale past one peer). Kernels: `intranode_ce_dispatch` (pack + SM pulls),
//! `intranode_ce_wait`, `intranode_ce_combine` (reduce + SM pushes; `intranode_ce_combine_roles`
//! with both roles in every block) in `copy_engine_dispatch.cu` / `copy_engine_combine.cu`
//! (shared pieces in `copy_engine.cuh`); the
//! protocol is described there and in `docs/design.md`.
//!
//! One op on every rank of a node, each rank on its own stream (plus its [`CopyStreams`]):
//!
//! 1. dispatch: [`super::notify_dispatch_cuda`] with `send_index`, poll the counters (word
//!    `1 + s` = rows from source `s`), allocate, then [`super::ce_dispatch_cuda`];
//! 2. combine: [`super::cached_notify_cuda`], then [`super::ce_combine_cuda`] with the
//!    dispatch's `send_index` and per-source counts.
//!
//! Results equal the ring path's (and the host twins'): the same receive order, the same
//! combine sums in rank order.
//!
//! This module holds what the two launchers share (`super::copy_engine_dispatch` and
//! `super::copy_engine_combine`, one per kernel source): `config` ([`CeConfig`]), `streams`
//! ([`CopyStreams`] and the copies), `params` (the kernels' params mirrors), the op checks and
//! the fused kernels' launch.

mod config;
pub(super) mod params;
pub(super) mod streams;

pub use config::{
    CeConfig, COMBINE_CE_TAIL_CHUNKS, COMBINE_PUSH_WARPS, FP8_PACK_LOCAL_BLOCKS, MAX_COPY_LANES,
    PACK_LOCAL_WARPS, PUSH_CHUNK_ROWS,
};
pub use streams::CopyStreams;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, DevicePtr, LaunchConfig};

use super::{to_i32, PeerBuffers, RING_BASE};
use crate::cuda::{Kernel, KernelParams};
use crate::error::{Error, Result};
use crate::intranode::{CeSlotLayout, CE_SLOT_BASE};
use params::CeFusedParams;

const _: () = assert!(CE_SLOT_BASE == RING_BASE);

/// Threads of the pack and reduce kernel blocks (`kCeThreads`).
const CE_THREADS: u32 = 768;

/// The checks every copy-engine op starts with: the config, `send_index` `[T, R]`, the `[R, R]`
/// prefixes and one count per source. Returns `(R, rank, T, N)`, `N` the rows received.
pub(super) fn op_sizes(
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

/// The blocks of a fused kernel (`launch_fused`).
pub(super) struct FusedGrid {
    /// Blocks running `main` (pack or reduce): `CeConfig::num_sms`.
    main_blocks: usize,
    /// Blocks running `copies` (SM pull or push) after them: `CeConfig::sm_blocks` when some
    /// peer's rows or metadata move by SM copies, else 0.
    copy_blocks: usize,
    /// Combine only: > 0 gives every block both roles, its first `role_warps` warps copying
    /// before they join `main` (`CeConfig::combine_push_warps`).
    role_warps: usize,
}

impl FusedGrid {
    pub(super) fn new(config: &CeConfig, sm_copies: bool, role_warps: usize) -> Self {
        Self {
            main_blocks: config.num_sms,
            copy_blocks: if sm_copies { config.sm_blocks } else { 0 },
            role_warps,
        }
    }
}

/// Launches a fused kernel on `stream` unless it has nothing to do (no own tokens, `t == 0`,
/// and no SM copies): `grid.main_blocks` blocks running `main` (pack or reduce), then
/// `grid.copy_blocks` running `copies` (SM pull or push), in one kernel so that they run side
/// by side, all of [`CE_THREADS`] threads.
///
/// # Safety
///
/// As for [`Kernel::launch`]: `CeFusedParams<M, C>` must be `kernel`'s params type, and
/// `main` and `copies` must point only into memory that holds what the kernel touches.
pub(super) unsafe fn launch_fused<M, C>(
    stream: &CudaStream,
    kernel: &Kernel,
    grid: FusedGrid,
    t: usize,
    main: M,
    copies: C,
) -> Result<()>
where
    CeFusedParams<M, C>: KernelParams,
{
    if t > 0 || grid.copy_blocks > 0 {
        let cfg = LaunchConfig {
            grid_dim: ((grid.main_blocks + grid.copy_blocks) as u32, 1, 1),
            block_dim: (CE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let fp = CeFusedParams {
            main,
            copies,
            main_blocks: to_i32("num_sms", grid.main_blocks)?,
            role_warps: to_i32("combine_push_warps", grid.role_warps)?,
        };
        // SAFETY: `fp` is `kernel`'s params type and points only into memory that holds what
        // the kernel touches (this function's contract).
        unsafe { kernel.launch(stream, cfg, fp) }?;
    }
    Ok(())
}

/// Errors unless the slots of `lay` hold this rank's `t` tokens and every source's block.
pub(super) fn check_slot_capacity(
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

pub(super) fn dptr<T>(v: &CudaView<'_, T>, stream: &CudaStream) -> CUdeviceptr {
    let (p, _g) = v.device_ptr(stream);
    p
}
