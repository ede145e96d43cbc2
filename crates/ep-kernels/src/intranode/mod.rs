//! Normal (high-throughput) mode: notify, dispatch receive order, combine reduction.
//!
//! The host twins here fix what the intranode (NVLink) and internode kernels must produce:
//! the prefix matrices of the notify step, the slot every (token, destination) pair lands in,
//! the local expert ids a receiver sees, and the combine sum.
//!
//! - [`host`]: the host twins;
//! - [`ce_layout`]: the copy-engine path's chunks and slots (host-side geometry);
//! - [`ring_bytes`]: the SM-ring path's NVLink buffer bytes (host-side geometry);
//! - `cuda` (feature `cuda`): the typed launchers of the kernels in `notify.cu` (count
//!   exchange), `rings_dispatch.cu` / `rings_combine.cu` (SM-ring dispatch and combine, shared
//!   pieces in `rings.cuh`) and `copy_engine_dispatch.cu` / `copy_engine_combine.cu` (the
//!   copy-engine path, shared pieces in `copy_engine.cuh`), one module `cuda/X.rs` per `X.cu`,
//!   whose NVLink buffer layout is `intranode.cuh` (also included by the internode kernels).

pub mod ce_layout;
pub mod host;
pub mod ring_bytes;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

pub use ce_layout::*;
pub use host::*;
pub use ring_bytes::{rings_buffer_bytes, RING_BASE};

/// Most local experts per rank the notify steps accept (`kMaxLocalExperts`).
pub const MAX_LOCAL_EXPERTS: usize = 1024;

/// Tokens per send chunk of the SM-ring dispatch and combine that measured fastest for
/// `num_ranks` ranks at 24 SMs and 256-token rings (the ring sweep of `docs/benchmarks.md`,
/// "Normal mode (prefill), intranode"): `(dispatch, combine)` = (24, 12) for 2 ranks, (32, 12)
/// for 3, (36, 12) for 4 (a multiple of the 6 sending warps per ring), (16, 6) beyond.
pub fn tuned_send_tokens(num_ranks: usize) -> (usize, usize) {
    match num_ranks {
        0..=2 => (24, 12),
        3 => (32, 12),
        4 => (36, 12),
        _ => (16, 6),
    }
}
