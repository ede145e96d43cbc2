//! Mirrors of the copy-engine kernels' params structs (`copy_engine_dispatch.cu`,
//! `copy_engine_combine.cu`), and where the
//! kernels' flags lie in an NVLink buffer.

use cudarc::driver::sys::CUdeviceptr;

use super::super::MAX_NVL_RANKS;
use crate::cuda::{assert_params_layout, KernelParams};
use crate::intranode::CE_MAX_CHUNKS;

/// Mirror of `CePackParams` in copy_engine_dispatch.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CePackParams {
    pub(crate) buffer_ptrs: [u64; MAX_NVL_RANKS],
    pub(crate) x: CUdeviceptr,
    pub(crate) x_scales: CUdeviceptr,
    pub(crate) topk_idx: CUdeviceptr,
    pub(crate) topk_weights: CUdeviceptr,
    pub(crate) send_index: CUdeviceptr,
    pub(crate) rank_prefix_matrix: CUdeviceptr,
    pub(crate) recv_x: CUdeviceptr,
    pub(crate) recv_x_scales: CUdeviceptr,
    pub(crate) recv_src_idx: CUdeviceptr,
    pub(crate) recv_topk_idx: CUdeviceptr,
    pub(crate) recv_topk_weights: CUdeviceptr,
    pub(crate) slot_bytes: i64,
    pub(crate) off_scales: i64,
    pub(crate) off_src: i64,
    pub(crate) off_topk_idx: i64,
    pub(crate) off_topk_weights: i64,
    pub(crate) rank: i32,
    pub(crate) num_ranks: i32,
    pub(crate) num_tokens: i32,
    pub(crate) row_int4: i32,
    pub(crate) num_scales: i32,
    pub(crate) num_topk: i32,
    pub(crate) experts_per_rank: i32,
    pub(crate) first_chunk_rows: i32,
    pub(crate) max_chunk_rows: i32,
    pub(crate) sm_push_mask: i32,
    pub(crate) own_rows_last: i32,
    pub(crate) local_warps: i32,
    pub(crate) local_blocks: i32,
    pub(crate) push_first_chunk_rows: i32,
    pub(crate) push_max_chunk_rows: i32,
    pub(crate) pad: i32,
}
assert_params_layout!(
    CePackParams,
    256;
    buffer_ptrs = 0, x = 64, x_scales = 72, topk_idx = 80, topk_weights = 88, send_index = 96,
    rank_prefix_matrix = 104, recv_x = 112, recv_x_scales = 120, recv_src_idx = 128,
    recv_topk_idx = 136, recv_topk_weights = 144, slot_bytes = 152, off_scales = 160,
    off_src = 168, off_topk_idx = 176, off_topk_weights = 184, rank = 192, num_ranks = 196,
    num_tokens = 200, row_int4 = 204, num_scales = 208, num_topk = 212, experts_per_rank = 216,
    first_chunk_rows = 220, max_chunk_rows = 224, sm_push_mask = 228, own_rows_last = 232,
    local_warps = 236, local_blocks = 240, push_first_chunk_rows = 244, push_max_chunk_rows = 248,
    pad = 252,
);

/// Mirror of `CeWaitParams` in copy_engine_dispatch.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CeWaitParams {
    pub(crate) flag: CUdeviceptr,
    pub(crate) error_info: CUdeviceptr,
    pub(crate) timeout_ns: u64,
    pub(crate) rank: i32,
    pub(crate) awaited: i32,
}
assert_params_layout!(
    CeWaitParams,
    32;
    flag = 0, error_info = 8, timeout_ns = 16, rank = 24, awaited = 28,
);
// SAFETY: repr(C) plain data mirroring `CeWaitParams` in copy_engine_dispatch.cu.
unsafe impl KernelParams for CeWaitParams {}

/// Mirror of `CeReduceParams` in copy_engine_combine.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CeReduceParams {
    pub(crate) buffer_ptrs: [u64; MAX_NVL_RANKS],
    pub(crate) x: CUdeviceptr,
    pub(crate) topk_weights: CUdeviceptr,
    pub(crate) send_index: CUdeviceptr,
    pub(crate) rank_prefix_matrix: CUdeviceptr,
    pub(crate) combined_x: CUdeviceptr,
    pub(crate) combined_topk_weights: CUdeviceptr,
    pub(crate) error_info: CUdeviceptr,
    pub(crate) timeout_ns: u64,
    pub(crate) slot_bytes: i64,
    pub(crate) off_weights: i64,
    pub(crate) rank: i32,
    pub(crate) num_ranks: i32,
    pub(crate) num_tokens: i32,
    pub(crate) row_int4: i32,
    pub(crate) num_topk: i32,
    pub(crate) first_chunk_rows: i32,
    pub(crate) max_chunk_rows: i32,
    pub(crate) pad: i32,
    /// `[T, H]` bf16 added to every combined row, or 0.
    pub(crate) bias: CUdeviceptr,
}
assert_params_layout!(
    CeReduceParams,
    184;
    buffer_ptrs = 0, x = 64, topk_weights = 72, send_index = 80, rank_prefix_matrix = 88,
    combined_x = 96, combined_topk_weights = 104, error_info = 112, timeout_ns = 120,
    slot_bytes = 128, off_weights = 136, rank = 144, num_ranks = 148, num_tokens = 152,
    row_int4 = 156, num_topk = 160, first_chunk_rows = 164, max_chunk_rows = 168, pad = 172,
    bias = 176,
);

/// Mirror of `CeSmPushParams` in copy_engine_combine.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CeSmPushParams {
    pub(crate) buffer_ptrs: [u64; MAX_NVL_RANKS],
    pub(crate) x: CUdeviceptr,
    pub(crate) topk_weights: CUdeviceptr,
    pub(crate) slot_bytes: i64,
    pub(crate) off_weights: i64,
    pub(crate) row_begin: [i32; MAX_NVL_RANKS],
    pub(crate) rows: [i32; MAX_NVL_RANKS],
    pub(crate) rank: i32,
    pub(crate) num_ranks: i32,
    pub(crate) row_int4: i32,
    pub(crate) num_topk: i32,
    pub(crate) first_chunk_rows: i32,
    pub(crate) max_chunk_rows: i32,
    pub(crate) combine_ce_tail_chunks: i32,
    pub(crate) pad: i32,
}
assert_params_layout!(
    CeSmPushParams,
    192;
    buffer_ptrs = 0, x = 64, topk_weights = 72, slot_bytes = 80, off_weights = 88, row_begin = 96,
    rows = 128, rank = 160, num_ranks = 164, row_int4 = 168, num_topk = 172,
    first_chunk_rows = 176, max_chunk_rows = 180, combine_ce_tail_chunks = 184, pad = 188,
);

/// Mirror of `CeSmPullParams` in copy_engine_dispatch.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CeSmPullParams {
    pub(crate) buffer_ptrs: [u64; MAX_NVL_RANKS],
    pub(crate) recv_x: CUdeviceptr,
    pub(crate) recv_x_scales: CUdeviceptr,
    pub(crate) recv_src_idx: CUdeviceptr,
    pub(crate) recv_topk_idx: CUdeviceptr,
    pub(crate) recv_topk_weights: CUdeviceptr,
    pub(crate) error_info: CUdeviceptr,
    pub(crate) timeout_ns: u64,
    pub(crate) slot_bytes: i64,
    pub(crate) off_scales: i64,
    pub(crate) off_src: i64,
    pub(crate) off_topk_idx: i64,
    pub(crate) off_topk_weights: i64,
    pub(crate) row_begin: [i32; MAX_NVL_RANKS],
    pub(crate) rows: [i32; MAX_NVL_RANKS],
    pub(crate) rank: i32,
    pub(crate) num_ranks: i32,
    pub(crate) row_int4: i32,
    pub(crate) num_scales: i32,
    pub(crate) num_topk: i32,
    pub(crate) first_chunk_rows: i32,
    pub(crate) max_chunk_rows: i32,
    pub(crate) sm_rows_mask: i32,
    pub(crate) local_mask: i32,
    pub(crate) push_first_chunk_rows: i32,
    pub(crate) push_max_chunk_rows: i32,
    pub(crate) pad: i32,
}
assert_params_layout!(
    CeSmPullParams,
    272;
    buffer_ptrs = 0, recv_x = 64, recv_x_scales = 72, recv_src_idx = 80, recv_topk_idx = 88,
    recv_topk_weights = 96, error_info = 104, timeout_ns = 112, slot_bytes = 120, off_scales = 128,
    off_src = 136, off_topk_idx = 144, off_topk_weights = 152, row_begin = 160, rows = 192,
    rank = 224, num_ranks = 228, row_int4 = 232, num_scales = 236, num_topk = 240,
    first_chunk_rows = 244, max_chunk_rows = 248, sm_rows_mask = 252, local_mask = 256,
    push_first_chunk_rows = 260, push_max_chunk_rows = 264, pad = 268,
);

/// Mirror of `CeDispatchParams` and `CeCombineParams` in copy_engine_combine.cu, the params of a fused
/// kernel: `main_blocks` pack (dispatch) or reduce (combine) blocks, then SM copy blocks (pull
/// or push).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CeFusedParams<M, C> {
    /// `pack` or `reduce`.
    pub(crate) main: M,
    /// `pull` or `push`.
    pub(crate) copies: C,
    /// `pack_blocks` or `reduce_blocks`.
    pub(crate) main_blocks: i32,
    /// Dispatch: `pad` (0). Combine: `push_warps` (> 0: every block's first `push_warps` warps
    /// push, then reduce, and the others reduce).
    pub(crate) role_warps: i32,
}

/// Mirror of `CeDispatchParams` in copy_engine_dispatch.cu: pack blocks, then SM pull blocks.
pub(crate) type CeDispatchParams = CeFusedParams<CePackParams, CeSmPullParams>;
assert_params_layout!(
    CeDispatchParams,
    536;
    main = 0, copies = 256, main_blocks = 528, role_warps = 532,
);
// SAFETY: repr(C) plain data mirroring `CeDispatchParams` in copy_engine_dispatch.cu.
unsafe impl KernelParams for CeDispatchParams {}

/// Mirror of `CeCombineParams` in copy_engine_combine.cu: reduce blocks, then SM push blocks.
pub(crate) type CeCombineParams = CeFusedParams<CeReduceParams, CeSmPushParams>;
assert_params_layout!(
    CeCombineParams,
    384;
    main = 0, copies = 184, main_blocks = 376, role_warps = 380,
);
// SAFETY: repr(C) plain data mirroring `CeCombineParams` in copy_engine_combine.cu.
unsafe impl KernelParams for CeCombineParams {}

/// Byte offset of flag `[peer][chunk]` in a buffer (`ce_flag` in `intranode.cuh`).
pub(crate) fn flag_offset(peer: usize, chunk: usize) -> u64 {
    (17408 + 4 * (peer * CE_MAX_CHUNKS + chunk)) as u64
}
