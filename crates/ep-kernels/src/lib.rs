//! Expert-parallel MoE kernels.
//!
//! Every kernel exists twice: a CUDA kernel (`src/<mode>/*.cu`, behind the `cuda` feature,
//! launched through typed Rust functions) and a pure-Rust **host twin** over plain slices with
//! the same inputs and outputs. The host twins are the CPU backend of `ep-runtime` and the
//! reference the CUDA kernels are tested against, element by element.
//!
//! Modules follow the data path and DeepEP's split by mode:
//! - [`routing`]: each token's top-k experts and weights from the gate's scores;
//! - [`layout`]: per-rank / per-node / per-expert token counts and `is_token_in_rank`;
//! - [`fp8`]: per-token 1x128 fp8 e4m3 quantisation (optionally UE8M0 scales) and back;
//! - [`internode`]: the normal mode across nodes (a token crosses the network once per node,
//!   NVLink inside the node), over NVSHMEM (feature `nvshmem`);
//! - [`intranode`]: the normal (high-throughput) mode: notify (prefix matrices, receive
//!   counts), the dispatch receive order, and the combine reduction;
//! - [`low_latency`]: the decode mode: fixed per-(expert, source) slots, pack/unpack and the
//!   weighted combine;
//! - [`expert_order`]: received rows to expert-major order for the grouped GEMM, and the
//!   weighted sum back per token;
//! - [`gemm`]: the experts' grouped GEMMs (contiguous and masked layouts, CUTLASS on sm_90a),
//!   SwiGLU in the first one's epilogue;
//! - [`attention`]: the MLA attention kernels of the model around the layer (per-head maps,
//!   the scores' softmax);
//! - [`sampling`]: greedy sampling's argmax on the device.
//!
//! With the `cuda` feature, `notify` holds what the notify steps of the two normal modes
//! share, and `memory` owns the device memory the kernels use (raw
//! allocations, host-mapped words, CUDA IPC handles, peer access); launchers take pointers and
//! sizes and own nothing.

pub mod attention;
pub mod error;
pub mod expert_order;
pub mod fp8;
pub mod gemm;
pub mod internode;
pub mod intranode;
pub mod layout;
pub mod low_latency;
pub mod routing;
pub mod sampling;

#[cfg(feature = "cuda")]
pub mod cublas_sms;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod memory;
#[cfg(feature = "cuda")]
pub mod notify;

pub use error::{Error, Result};

/// Largest number of ranks a kernel supports (sizes of on-chip per-rank arrays).
pub const MAX_RANKS: usize = 1024;
/// Number of hidden channels sharing one fp8 scale.
pub const FP8_GROUP: usize = 128;
