//! The MLA attention pieces a DeepSeek-V3 model runs around its MoE layers, on the kernels of
//! `ep_kernels::attention` where they are faster than candle's ops (`docs/design.md`, "MLA
//! attention"), and candle's ops elsewhere:
//! - [`HeadMaps`]: each head's map of token-major rows (MLA's absorbed `kv_b_proj`);
//! - [`scores_softmax`]: the attention probabilities from the two score products, the scale and
//!   the mask, in one pass.

mod head_maps;
mod softmax;

pub use head_maps::HeadMaps;
pub use softmax::scores_softmax;
