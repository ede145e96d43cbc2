//! The C entry points of `grouped_fp8_narrow.cu` (host library, CUTLASS): the grouped
//! block-scaled fp8 GEMM with 64 x 128 ping-pong tiles, clusters of 2 along N
//! (`EP_GROUPED_GEMM_FP8` in `grouped_gemm_fp8_sm90.cuh`). Launched by
//! [`super::grouped_gemm_fp8_cuda`].

use std::ffi::c_char;

use cudarc::driver::sys::CUstream;

use super::GroupedGemmFp8Args;

extern "C" {
    pub(super) fn ep_grouped_gemm_fp8_narrow_workspace(groups: i32, sm_count: i32) -> u64;
    pub(super) fn ep_grouped_gemm_fp8_narrow_run(
        args: *const GroupedGemmFp8Args,
        stream: CUstream,
        message: *mut c_char,
        message_len: u64,
    ) -> i32;
}
