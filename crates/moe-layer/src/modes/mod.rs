//! How a [`crate::MoeLayer`] step runs, by mode (each an `impl MoeLayer` block beside the
//! layer's public API in `layer.rs`):
//!
//! - `normal`: normal mode (prefill): layout, dispatch, the experts over what arrived, combine;
//!   as two micro-batches; pipelined over `expert_groups` of each rank's experts;
//! - `low_latency`: low-latency mode (decode): fixed-slot dispatch and combine, the shared
//!   experts beside them or inside the grouped GEMMs;
//! - on CUDA, `graph`: steps captured in CUDA graphs and replayed ([`StepGraph`]), and
//!   `captured_step`, the captured steps a layer keeps.

pub(crate) mod expert_groups;
mod low_latency;
mod normal;

#[cfg(feature = "cuda")]
pub(crate) mod captured_step;
#[cfg(feature = "cuda")]
mod graph;

#[cfg(feature = "cuda")]
pub use graph::{DecodeGraph, StepGraph};
