//! Launchers of MLA attention's kernels: the per-head GEMM (cuBLAS), the scores' softmax
//! (`scores_softmax.cu`) and the rope columns' rotation (`rope.cu`). Host twins:
//! [`super::per_head_gemm`], [`super::scores_softmax`], [`super::rope_rows`].

mod per_head;
mod rope;
mod scores_softmax;

pub use per_head::per_head_gemm_bf16_cuda;
pub use rope::rope_bf16_cuda;
pub use scores_softmax::scores_softmax_bf16_cuda;
