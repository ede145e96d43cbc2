//! Typed launchers of the intranode (NVLink) normal-mode kernels; host twins: [`super::host`].
//!
//! One op on every rank of a node, each rank on its own stream (the kernels of different ranks
//! wait on each other, so they must run concurrently):
//!
//! 1. [`notify_dispatch_cuda`] (fresh routing) or [`cached_notify_cuda`] (reusing a handle);
//!    after `notify_dispatch_cuda` the host polls the mapped counters
//!    ([`crate::notify::poll_recv_counts`], or word by word [`HostMappedI32::poll_nonneg`])
//!    and allocates the receive buffers;
//! 2. [`dispatch_cuda`] (SM rings) or [`ce_dispatch_cuda`] (copy engines);
//! 3. [`cached_notify_cuda`], then [`combine_cuda`] or [`ce_combine_cuda`].
//!
//! After each op (or at least before trusting its outputs) the host checks the error record with
//! [`PeerBuffers::check_error`]: a device wait that timed out is reported as
//! [`Error::PeerTimeout`](crate::Error::PeerTimeout).
//!
//! Modules, one concern each (kernels in `src/intranode/*.cu`, the NVLink buffer layout they
//! share in `src/intranode/intranode.cuh`); each kernel source `X.cu` has its launchers in
//! module `X`:
//! - `buffers`: [`PeerBuffers`], the node's buffers and this rank's error record;
//! - [`HostMappedI32`], counters the host polls while kernels run, lives in [`crate::memory`]
//!   (re-exported here);
//! - `config`: [`Config`] of the SM rings and [`buffer_size_hint`];
//! - `payload`: the rows, scales and routing a dispatch moves ([`Payload`], [`TopK`], ...);
//! - `notify`, `rings_dispatch`, `rings_combine`: the launchers of `notify.cu`,
//!   `rings_dispatch.cu` and `rings_combine.cu`;
//! - `checks`: the argument checks these launchers share;
//! - `copy_engine_dispatch`, `copy_engine_combine`: the launchers of the copy-engine path
//!   (`copy_engine_dispatch.cu`, `copy_engine_combine.cu`); `copy_engine`: what they share
//!   (its config, copy streams, params mirrors and fused launch).

mod buffers;
mod checks;
mod config;
mod copy_engine;
mod copy_engine_combine;
mod copy_engine_dispatch;
mod notify;
mod payload;
mod rings_combine;
mod rings_dispatch;

pub use crate::memory::HostMappedI32;
pub use buffers::{PeerBuffers, DEFAULT_TIMEOUT};
pub use config::{buffer_size_hint, Config, MAX_CHANNELS};
pub use copy_engine::{
    CeConfig, CopyStreams, COMBINE_CE_TAIL_CHUNKS, COMBINE_PUSH_WARPS, FP8_PACK_LOCAL_BLOCKS,
    MAX_COPY_LANES, PACK_LOCAL_WARPS, PUSH_CHUNK_ROWS,
};
pub use copy_engine_combine::{ce_combine_cuda, CeCombineArgs};
pub use copy_engine_dispatch::{ce_dispatch_cuda, CeDispatchArgs};
pub use notify::{cached_notify_cuda, notify_dispatch_cuda, NotifyArgs};
pub use payload::{Payload, RecvPayload, RecvTopK, TopK};
pub use rings_combine::{combine_cuda, CombineArgs, COMBINE_ROUND_TOKENS};
pub use rings_dispatch::{dispatch_cuda, DispatchArgs};

use crate::cuda::to_i32;

/// Most ranks of one node (`kMaxRanks`).
pub const MAX_NVL_RANKS: usize = 8;
pub use super::ring_bytes::RING_BASE;
/// Bytes at the start of every NVLink buffer that must be zero before first use
/// (barrier signals and counters).
pub const HEADER_ZERO_BYTES: usize = RING_BASE;

/// Kernel names by the ids the device writes into error records (`KernelId` in
/// `intranode.cuh`).
pub(crate) const KERNEL_NAMES: [&str; 8] = [
    "intranode_unknown",
    "intranode_notify_dispatch",
    "intranode_cached_notify",
    "intranode_dispatch",
    "intranode_combine",
    "intranode_ce_wait",
    "intranode_ce_combine",
    "intranode_ce_dispatch",
];

/// The kernel that writes the notify counters, as a timeout names it
/// ([`HostMappedI32::poll_nonneg`]).
pub const NOTIFY_KERNEL: &str = KERNEL_NAMES[1];
