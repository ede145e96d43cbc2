//! Normal (high-throughput) mode: notify, dispatch receive order, combine reduction.
//!
//! The host twins here fix what the intranode (NVLink) and internode kernels must produce:
//! the prefix matrices of the notify step, the slot every (token, destination) pair lands in,
//! the local expert ids a receiver sees, and the combine sum.

pub mod ce_layout;
pub mod host;

#[cfg(feature = "cuda")]
mod copy_engine;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use copy_engine::*;
#[cfg(feature = "cuda")]
pub use cuda::*;

pub use ce_layout::*;
pub use host::*;
