//! The C entry points of `swiglu_bf16_narrow.cu` (host library, CUTLASS): the grouped bf16 GEMM
//! with the SwiGLU epilogue, 64 x 128 tiles
//! ([`GemmTiles::Narrow`](crate::gemm::GemmTiles::Narrow)). Launched by the grouped GEMMs of
//! [`super`].

cutlass_entry_points! {
    ep_grouped_gemm_bf16_swiglu_narrow_workspace, ep_grouped_gemm_bf16_swiglu_narrow_run;
}
