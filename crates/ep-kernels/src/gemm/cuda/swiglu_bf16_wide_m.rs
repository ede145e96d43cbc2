//! The C entry points of `swiglu_bf16_wide_m.cu` (host library, CUTLASS): the grouped bf16 GEMM
//! with the SwiGLU epilogue, 128 x 256 tiles, clusters along M
//! ([`GemmTiles::WideM`](crate::gemm::GemmTiles::WideM)). Launched by the grouped GEMMs of
//! [`super`].

cutlass_entry_points! {
    ep_grouped_gemm_bf16_swiglu_wide_m_workspace, ep_grouped_gemm_bf16_swiglu_wide_m_run;
}
