//! The routed experts a rank holds and how they run, from the weights up:
//!
//! - [`mlp`]: one SwiGLU MLP ([`Mlp`], the dense and shared experts' form, and the view of one
//!   routed expert), its gate_up layouts;
//! - `input`, `fp8_expert`: what the experts read ([`ExpertInput`]: float or e4m3 rows) and
//!   how an fp8 checkpoint's expert arrives ([`Fp8Expert`]);
//! - `rules`: which path a shard's weights take, from shapes, dtype and device;
//! - `shard`: [`Experts`], this rank's shard (stacked weights, constructors, loading);
//!   `forward`: its forward passes (routed rows, per-expert blocks);
//! - on CUDA, the device paths: `grouped` (bf16 grouped GEMMs) and `grouped_fp8` (block-scaled
//!   fp8), their `grouped_state`, and the shared experts as extra groups of those GEMMs
//!   (`shared_groups`, `shared_fp8`).

mod forward;
mod fp8_expert;
mod input;
pub mod mlp;
mod rules;
mod shard;
mod slots;

#[cfg(feature = "cuda")]
pub(crate) mod grouped;
#[cfg(feature = "cuda")]
pub(crate) mod grouped_fp8;
#[cfg(feature = "cuda")]
mod grouped_state;
#[cfg(feature = "cuda")]
pub(crate) mod shared_fp8;
#[cfg(feature = "cuda")]
pub(crate) mod shared_groups;

pub use fp8_expert::Fp8Expert;
pub use input::ExpertInput;
pub(crate) use mlp::tensor_bytes;
pub use mlp::{GateUpLayout, Mlp};
pub(crate) use rules::{fp8_shapes_supported, shared_fp8_blocks};
pub use shard::Experts;
