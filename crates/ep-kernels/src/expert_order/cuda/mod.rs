//! Typed launchers of the expert-order kernels, one module per kernel source: `expert_order`
//! (`expert_order.cu`).

mod expert_order;

pub use expert_order::*;
