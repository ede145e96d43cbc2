//! The C entry points of `grouped_bf16_wide.cu` (host library, CUTLASS): the plain grouped bf16
//! GEMM, 128 x 256 tiles ([`GemmTiles::Wide`](crate::gemm::GemmTiles::Wide)). Launched by the
//! grouped GEMMs of [`super`].

cutlass_entry_points! {
    ep_grouped_gemm_bf16_wide_workspace, ep_grouped_gemm_bf16_wide_run;
}
