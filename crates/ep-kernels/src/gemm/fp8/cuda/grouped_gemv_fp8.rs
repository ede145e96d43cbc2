//! Launcher of the tile-less block-scaled fp8 grouped GEMV (`grouped_gemv_fp8.cu`): masked
//! blocks of a few rows ([`GemmTiles::Gemv`](crate::gemm::GemmTiles::Gemv)), launched by
//! [`super::grouped_gemm_fp8_cuda`] with its checked arguments.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaStream;

use crate::error::{Error, Result};
use crate::gemm::fp8::GEMV_K_MULTIPLE;
use crate::gemm::GroupLayout;

/// What the tile-less GEMV takes beyond the GEMMs' checks: the masked layout, `k` a multiple of
/// [`GEMV_K_MULTIPLE`] (`n` is a multiple of 16 for every fp8 GEMM).
pub(super) fn check_gemv(layout: GroupLayout, k: usize) -> Result<()> {
    if !matches!(layout, GroupLayout::Masked { .. }) {
        return Err(Error::invalid(
            "tiles",
            "GemmTiles::Gemv",
            "the tile-less fp8 GEMV takes the masked layout only",
        ));
    }
    if k % GEMV_K_MULTIPLE != 0 {
        return Err(Error::invalid(
            "k",
            k,
            format!("the tile-less fp8 GEMV needs a multiple of {GEMV_K_MULTIPLE}"),
        ));
    }
    Ok(())
}

/// The cubin of `fp8/grouped_gemv_fp8.cu`.
const GEMV_FILE: &str = "gemm/fp8/grouped_gemv_fp8";
/// Threads per block (`kThreads`).
const GEMV_THREADS: u32 = 256;
/// Resident blocks per SM the grid is sized to (`kBlocksPerSm`; grid-stride over the units).
const GEMV_BLOCKS_PER_SM: u32 = 2;

/// Mirror of `struct GemvFp8Params` in `fp8/grouped_gemv_fp8.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct GemvFp8Params {
    pub(super) a: CUdeviceptr,
    pub(super) sfa: CUdeviceptr,
    pub(super) b: CUdeviceptr,
    pub(super) sfb: CUdeviceptr,
    pub(super) d: CUdeviceptr,
    pub(super) counts: CUdeviceptr,
    pub(super) extra_a: CUdeviceptr,
    pub(super) extra_sfa: CUdeviceptr,
    pub(super) extra_b: CUdeviceptr,
    pub(super) extra_sfb: CUdeviceptr,
    pub(super) extra_a_rows: i64,
    pub(super) groups: i32,
    pub(super) n: i32,
    pub(super) k: i32,
    pub(super) m_max: i32,
    pub(super) first_extra: i32,
    /// `grouped_gemv_swiglu_fp8` only (0 otherwise, and `d` is 0 there): the f32 act scratch,
    /// the e4m3 act, its scales and the per-block arrival counters (zero).
    pub(super) act: CUdeviceptr,
    pub(super) q: CUdeviceptr,
    pub(super) q_scales: CUdeviceptr,
    pub(super) arrivals: CUdeviceptr,
}
crate::cuda::assert_params_layout!(
    GemvFp8Params,
    144;
    a = 0, sfa = 8, b = 16, sfb = 24, d = 32, counts = 40, extra_a = 48, extra_sfa = 56,
    extra_b = 64, extra_sfb = 72, extra_a_rows = 80, groups = 88, n = 92, k = 96, m_max = 100,
    first_extra = 104, act = 112, q = 120, q_scales = 128, arrivals = 136,
);

// SAFETY: `repr(C)` plain data mirroring `GemvFp8Params` in grouped_gemv_fp8.cu (size asserted
// both sides, offsets here).
unsafe impl crate::cuda::KernelParams for GemvFp8Params {}

/// Launches `grouped_gemv_fp8` (or with `swiglu` `grouped_gemv_swiglu_fp8`) with `params` filled
/// and checked by `run` ([`super`]): one grid sized to the device (and to a team of every warp
/// of a block per unit when there are few units), whose warps take (active group, 16 weight
/// rows) units in whole rounds, then share K over the units left
/// ([`crate::gemm::fp8::gemv_tail_split`], chosen on the device from the counts). The plain
/// GEMV is a dependent launch ([`crate::cuda::Kernel::launch_dependent`]): after the fused
/// gate_up GEMV of a decode step its blocks start as that kernel's blocks leave, and wait there
/// for its act (the kernel's file comment).
pub(super) fn launch_gemv(
    stream: &Arc<CudaStream>,
    params: GemvFp8Params,
    swiglu: bool,
) -> Result<()> {
    let kernels = crate::cuda::Kernels::for_stream(stream)?;
    // An upper bound (every group active): a block a unit at most, so that up to a block's
    // warps can share each unit's K.
    let units = params.groups as u64 * (params.n as u64 / 16);
    let name = if swiglu {
        "grouped_gemv_swiglu_fp8"
    } else {
        "grouped_gemv_fp8"
    };
    let kernel = kernels.kernel(GEMV_FILE, name)?;
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (
            crate::cuda::grid_for(units, 1, kernels.props(), GEMV_BLOCKS_PER_SM),
            1,
            1,
        ),
        block_dim: (GEMV_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` mirrors `GemvFp8Params`; the caller checked every operand's length
    // against the shape (`a` and its scales by block, `b` and `extra_b` with their scales
    // `[groups, n, k]` in two parts, `d` `[groups * m_max, n]`, `counts` `[groups]`, `extra_a`
    // its rows), the 16-byte alignment of the e4m3 operands and `d` and the 4-byte alignment of
    // the scales, the masked layout and `k % 64 == 0`, and holds their guards until the launch
    // is queued; the kernel reads only rows below each group's count, which it checks against
    // `m_max` and the rows of `extra_a` (trapping otherwise), and writes only those rows of `d`
    // (with `swiglu`: of `act`, `q` and `q_scales`, each checked against `[groups * m_max,
    // n / 2]` and its scales, `n` a multiple of 256, and the `groups * n / 256` counters of
    // `arrivals`, which the workspace holds zeroed and every launch leaves zero). The plain
    // GEMV, a dependent launch, runs `griddepcontrol.wait` before any load or store.
    unsafe {
        if swiglu {
            kernel.launch(stream, cfg, params)
        } else {
            kernel.launch_dependent(stream, cfg, params)
        }
    }
}
