//! Typed launchers of the layout kernels, one module per kernel source: `layout`
//! (`layout.cu`, the dispatch layout) and `permute` (`permute.cu`, the row gather, exported as
//! [`super::permute::gather_rows_cuda`]).

mod layout;
pub(super) mod permute;

pub use layout::*;
