//! Launcher of the tile-less grouped GEMV (`grouped_gemv.cu`): masked blocks of a few rows
//! ([`GemmTiles::Gemv`](crate::gemm::GemmTiles::Gemv)), plain or with SwiGLU, called by the
//! grouped GEMMs of [`super`] with their checked arguments.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, LaunchConfig};

use crate::cuda::{grid_for, KernelParams, Kernels};
use crate::error::Result;

/// The cubin of `grouped_gemv.cu`.
const GEMV_FILE: &str = "gemm/grouped_gemv";
/// Threads per block (`kThreads` in `grouped_gemv.cu`).
const GEMV_THREADS: u32 = 256;
/// Output columns per work item of a block (`kColsPerItem`).
const GEMV_COLS_PER_ITEM: usize = 16;
/// Resident blocks per SM the grid is sized to (`kBlocksPerSm`; grid-stride loops over the items).
const GEMV_BLOCKS_PER_SM: u32 = 2;

/// Mirror of `struct GemvParams` in `grouped_gemv.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct GemvParams {
    pub(super) a: CUdeviceptr,
    pub(super) b: CUdeviceptr,
    pub(super) d: CUdeviceptr,
    pub(super) counts: CUdeviceptr,
    pub(super) extra_a: CUdeviceptr,
    pub(super) extra_b: CUdeviceptr,
    pub(super) extra_a_rows: i64,
    pub(super) groups: i32,
    pub(super) n: i32,
    pub(super) k: i32,
    pub(super) m_max: i32,
    pub(super) first_extra: i32,
    pub(super) reserved: i32,
}
const _: () = assert!(std::mem::size_of::<GemvParams>() == 80);
const _: () = assert!(std::mem::offset_of!(GemvParams, extra_b) == 40);
const _: () = assert!(std::mem::offset_of!(GemvParams, extra_a_rows) == 48);
const _: () = assert!(std::mem::offset_of!(GemvParams, groups) == 56);
const _: () = assert!(std::mem::offset_of!(GemvParams, first_extra) == 72);

// SAFETY: `repr(C)` plain data mirroring `GemvParams` in grouped_gemv.cu (size asserted both
// sides, field offsets here).
unsafe impl KernelParams for GemvParams {}

/// Launches `grouped_gemv_bf16` (or, with `swiglu`, `grouped_gemv_swiglu_bf16`) with `params`
/// filled and checked by `run_grouped` ([`super`]): one grid of blocks sized to the device,
/// which take (active group, column slab) items in turn.
pub(super) fn launch_gemv(
    stream: &Arc<CudaStream>,
    params: GemvParams,
    groups: usize,
    n: usize,
    swiglu: bool,
) -> Result<()> {
    let kernels = Kernels::for_stream(stream)?;
    let name = if swiglu {
        "grouped_gemv_swiglu_bf16"
    } else {
        "grouped_gemv_bf16"
    };
    let kernel = kernels.kernel(GEMV_FILE, name)?;
    // A SwiGLU item covers 8 output columns (16 weight rows), a plain one 16 columns.
    let items = (groups * n.div_ceil(GEMV_COLS_PER_ITEM)) as u64;
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(items, 1, kernels.props(), GEMV_BLOCKS_PER_SM),
            1,
            1,
        ),
        block_dim: (GEMV_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `GemvParams`; the caller checked every operand's length against
    // the shape (`a` its blocks, `b` and `extra_b` `[groups, n, k]` in two parts, `d`
    // `[groups * m_max, n]` or with `swiglu` `[groups * m_max, n / 2]`, `counts` `[groups]`,
    // `extra_a` its rows) and their 16-byte
    // alignment, and holds their guards until this returns, after the launch is queued; the
    // kernel reads only rows below each group's count, which it checks against `m_max` and the
    // rows of `extra_a` (trapping otherwise), and writes only those rows of `d`.
    unsafe { kernel.launch(stream, cfg, params) }
}
