//! A candle Mixture-of-Experts layer with expert parallelism, the way DeepSeek serves
//! DeepSeek-V3: route -> dispatch -> grouped GEMM -> combine, with shared experts, a
//! high-throughput mode for prefill and a low-latency mode for decode.
//!
//! - [`router`]: DeepSeek-V3 `noaux_tc` grouped top-k and plain softmax top-k;
//! - [`experts`]: this rank's shard of SwiGLU experts (grouped GEMM) and the dense [`Mlp`];
//! - [`fp8`]: block-scaled fp8 weights as DeepSeek ships them (kept as e4m3 by the experts on
//!   CUDA, dequantized exactly elsewhere);
//! - [`fp8_linear`]: dense layers on such weights (attention projections, dense MLPs);
//! - [`mla`]: the MLA attention pieces of the model around the layer (per-head maps, the
//!   scores' softmax);
//! - [`MoeLayer`]: the expert-parallel layer over an [`ep_runtime::Buffer`];
//! - [`placement`] and [`replacement`]: redundant experts placed by DeepSeek's EPLB from the
//!   layer's load statistics, and re-placed while serving (weights moved between ranks);
//! - [`MoeLayer::exclude_ranks`]: serving on when ranks are lost, each expert from its
//!   replicas on the ranks that remain;
//! - [`dense`]: the single-process reference layer EP results are tested against;
//! - [`WeightBytes::planned`]: what a layer's weights will take on a rank, before loading.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{Module, VarBuilder, VarMap};
//! use moe_layer::{ep_runtime::{Buffer, BufferConfig}, MoeConfig, MoeLayer, MoeLayerOptions, Mode};
//! use std::sync::Arc;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cfg: MoeConfig = serde_json::from_str(r#"{"hidden_size": 32, "moe_intermediate_size": 16,
//!     "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1}"#)?;
//! // One rank; with more, each rank (thread or process) builds its own layer and buffer.
//! let buffer = Arc::new(Buffer::local_group(1, 1, BufferConfig::default().with_low_latency(8, 32, 4))?.remove(0));
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
//! let opts = MoeLayerOptions { low_latency_max_tokens: 8, ..Default::default() };
//! let layer = MoeLayer::load(vb, &cfg, buffer, opts)?;
//! let x = Tensor::randn(0f32, 1.0, (5, 32), &Device::Cpu)?;
//! let y = layer.forward_with_mode(&x, Mode::Normal)?;
//! assert_eq!(y.dims(), &[5, 32]);
//! # Ok(())
//! # }
//! ```

pub mod config;
pub mod dense;
mod empty;
pub mod error;
mod expert_load;
pub mod expert_map;
pub mod experts;
pub mod fp8;
pub mod fp8_linear;
mod layer;
mod lost_ranks;
pub mod mla;
mod modes;
mod options;
pub mod placement;
pub mod replacement;
pub mod router;
mod step;
mod weight_plan;

pub use config::MoeConfig;
pub use ep_kernels;
pub use ep_runtime;
pub use error::{Error, Result};
pub use experts::mlp;
pub use experts::{ExpertInput, Experts, Fp8Expert};
pub use experts::{GateUpLayout, Mlp};
pub use fp8_linear::{Fp8BatchedLinear, Fp8Linear, Fp8Mlp};
pub use layer::{MoeLayer, WeightBytes};
#[cfg(feature = "cuda")]
pub use modes::{DecodeGraph, StepGraph};
pub use options::{MoeLayerOptions, SharedPlacement, SHARED_GROUPED_MAX_ROWS_ONE_RANK};
pub use router::{Router, Routing};
pub use step::{Mode, Step};
pub use weight_plan::WeightTarget;
