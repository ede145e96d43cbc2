//! Expert-major order: the step between a normal-mode dispatch (rows in token order, each
//! with its top-k local experts) and the contiguous grouped GEMM (rows of each expert
//! together), and back.
//!
//! - **permute**: for every (token `n`, slot `k`) with a local expert `e = idx[n, k] >= 0`,
//!   copy row `x[n]` to its row `positions[n, k]` of `A`, where expert `e`'s rows start at
//!   `sum_{j<e} align_up(counts[j], alignment)` (the grouped GEMM's contiguous layout) and
//!   `counts[e]` is the number of pairs routed to `e`;
//! - **scatter**: a second payload of each token (the fp8 rows' scales) to the rows the
//!   permute placed its row at;
//! - **unpermute**: `out[n] = sum_k w[n, k] * y[positions[n, k]]` over the valid slots, in f32,
//!   in slot order (zero for a token with none).
//!
//! Kernels `expert_order.cu` (counts, then placement and copy with atomics, so the order of
//! rows within an expert may differ between runs; every row is computed independently by the
//! GEMM, so results do not), launchers `cuda/expert_order.rs`, host twins [`host`] (rows of an
//! expert in (token, slot) order).

pub mod host;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

pub use host::{permute, scatter, unpermute, ExpertOrder};

/// Most local experts the kernels take (one block scans their counts).
pub const MAX_LOCAL_EXPERTS: usize = 1024;

/// Rows `A` needs for `tokens` tokens of `top_k` slots with `num_local` experts and
/// `alignment` (an upper bound of the rows the placement can use, known without reading the
/// routing).
pub fn rows_bound(tokens: usize, top_k: usize, num_local: usize, alignment: usize) -> usize {
    tokens * top_k.min(num_local) + num_local * alignment.saturating_sub(1)
}
