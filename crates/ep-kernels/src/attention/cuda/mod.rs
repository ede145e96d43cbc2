//! Launchers of MLA attention's kernels: the per-head GEMM (cuBLAS) and the scores' softmax
//! (`scores_softmax.cu`). Host twins: [`super::per_head_gemm`], [`super::scores_softmax`].

mod per_head;
mod scores_softmax;

pub use per_head::per_head_gemm_bf16_cuda;
pub use scores_softmax::scores_softmax_bf16_cuda;
