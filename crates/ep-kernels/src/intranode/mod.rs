//! Normal (high-throughput) mode: notify, dispatch receive order, combine reduction.
//!
//! The host twins here fix what the intranode (NVLink) and internode kernels must produce:
//! the prefix matrices of the notify step, the slot every (token, destination) pair lands in,
//! the local expert ids a receiver sees, and the combine sum.
//!
//! - [`host`]: the host twins;
//! - [`ce_layout`]: the copy-engine path's chunks and slots (host-side geometry);
//! - `cuda` (feature `cuda`): the typed launchers of the kernels in `notify.cu` (count
//!   exchange), `rings.cu` (SM-ring dispatch and combine) and `copy_engine.cu` (the
//!   copy-engine path), whose NVLink buffer layout is `csrc/intranode.cuh`.

pub mod ce_layout;
pub mod host;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

pub use ce_layout::*;
pub use host::*;
