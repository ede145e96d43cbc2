//! The C entry points of `grouped_fp8_wide_m.cu` (host library, CUTLASS): the grouped
//! block-scaled fp8 GEMM with 128 x 128 cooperative tiles, clusters of 2 along M
//! (`EP_GROUPED_GEMM_FP8` in `grouped_gemm_fp8_sm90.cuh`). Launched by
//! [`super::grouped_gemm_fp8_cuda`].

use std::ffi::c_char;

use cudarc::driver::sys::CUstream;

use super::GroupedGemmFp8Args;

extern "C" {
    pub(super) fn ep_grouped_gemm_fp8_wide_m_workspace(groups: i32, sm_count: i32) -> u64;
    pub(super) fn ep_grouped_gemm_fp8_wide_m_run(
        args: *const GroupedGemmFp8Args,
        stream: CUstream,
        message: *mut c_char,
        message_len: u64,
    ) -> i32;
}
