//! The C entry points of `swiglu_fp8_wide.cu` (host library, CUTLASS): the fp8 gate_up GEMM
//! with SwiGLU and the act quantization in its epilogue, 128 x 128 cooperative tiles, clusters
//! of 2 along N (`EP_GROUPED_GEMM_FP8` in `grouped_gemm_fp8_sm90.cuh`). Launched by
//! [`super::grouped_gemm_swiglu_fp8_cuda`].

use std::ffi::c_char;

use cudarc::driver::sys::CUstream;

use super::GroupedGemmFp8Args;

extern "C" {
    pub(super) fn ep_grouped_gemm_fp8_swiglu_wide_workspace(groups: i32, sm_count: i32) -> u64;
    pub(super) fn ep_grouped_gemm_fp8_swiglu_wide_run(
        args: *const GroupedGemmFp8Args,
        stream: CUstream,
        message: *mut c_char,
        message_len: u64,
    ) -> i32;
}
