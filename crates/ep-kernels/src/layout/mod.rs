//! Dispatch layout: which rank, node and expert each token goes to (no communication).

pub mod host;

pub mod permute;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

pub use host::{get_dispatch_layout, DispatchLayout, ExpertPlacement};
