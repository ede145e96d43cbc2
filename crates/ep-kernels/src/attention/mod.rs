//! MLA attention's kernels for decode and prefill batches (DeepSeek-V3's absorbed form, as the
//! example model runs it; `docs/design.md`, "MLA attention"):
//! - [`per_head_gemm`]: each head's map of token-major rows (`q_nope · W_UK`, `o · W_UV^T`),
//!   reading each head's slice in place and writing token-major, on cuBLAS;
//! - [`scores_softmax`]: the softmax of the two score products with the scale and the
//!   sequence's mask, in one pass;
//! - [`rope_rows`]: the rotary embedding of the rope columns where they lie in the
//!   projections' token-major output.

mod per_head;
mod rope;
mod softmax;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

pub use per_head::{per_head_gemm, PerHeadShape};
pub use rope::{rope_rows, RopeShape};
pub use softmax::{scores_softmax, ScoresShape};
