//! The one-rank path (`local.cu`): at `num_ranks == 1` with [`Phases::Both`](super::Phases),
//! [`super::dispatch_cuda`] and [`super::combine_cuda`] launch `ll_local_dispatch` /
//! `ll_local_combine`, which produce bit for bit the outputs of `ll_dispatch` / `ll_combine`
//! without their multi-rank protocol (no signals, flags, fences, op counters or grid-wide
//! waits; the control words are left as they are, see `local.cu`).

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, LaunchConfig};

use super::{CombineParams, DispatchParams};
use crate::cuda::{assert_params_layout, grid_for, KernelParams, Kernels};
use crate::error::{Error, Result};

/// The cubin of `local.cu`.
const FILE: &str = "low_latency/local";
/// Threads per block (`kThreads` in `local.cu`).
const THREADS: u32 = 128;
/// Hidden channels per dispatch item (`kDispatchChans`: 16 per thread).
const DISPATCH_CHANS: usize = THREADS as usize * 16;
/// `-1` fills of `recv_src_info` per thread the dispatch grid is sized for.
const FILL_PER_THREAD: usize = 8;
/// Most experts one dispatch block writes the counts and fills of.
const EXPERTS_PER_BLOCK: usize = 8;
/// Most resident blocks per SM the grids are capped at (every block builds its own top-k
/// table, so more blocks only repeat that work).
const BLOCKS_PER_SM: u32 = 4;

/// Mirror of `struct LocalDispatchParams` in `local.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct LocalDispatchParams {
    x: CUdeviceptr,
    topk_idx: CUdeviceptr,
    active: CUdeviceptr,
    active_mirror: CUdeviceptr,
    recv_x: CUdeviceptr,
    recv_scales: CUdeviceptr,
    recv_count: CUdeviceptr,
    recv_src_info: CUdeviceptr,
    recv_src_topk: CUdeviceptr,
    recv_layout_range: CUdeviceptr,
    num_tokens: i32,
    num_topk: i32,
    num_experts: i32,
    max_tokens: i32,
    hidden: i32,
    fp8: u32,
    scale_format: u32,
    reserved: u32,
}
assert_params_layout!(
    LocalDispatchParams,
    112;
    x = 0, topk_idx = 8, active = 16, active_mirror = 24, recv_x = 32, recv_scales = 40,
    recv_count = 48, recv_src_info = 56, recv_src_topk = 64, recv_layout_range = 72,
    num_tokens = 80, num_topk = 84, num_experts = 88, max_tokens = 92, hidden = 96, fp8 = 100,
    scale_format = 104, reserved = 108,
);
// SAFETY: `repr(C)` plain data mirroring `LocalDispatchParams` (size asserted on both sides).
unsafe impl KernelParams for LocalDispatchParams {}

/// Mirror of `struct LocalCombineParams` in `local.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct LocalCombineParams {
    x: CUdeviceptr,
    topk_idx: CUdeviceptr,
    topk_weights: CUdeviceptr,
    src_info: CUdeviceptr,
    src_topk: CUdeviceptr,
    active: CUdeviceptr,
    active_mirror: CUdeviceptr,
    out: CUdeviceptr,
    num_tokens: i32,
    num_topk: i32,
    num_experts: i32,
    max_tokens: i32,
    hidden: i32,
    reserved: u32,
}
assert_params_layout!(
    LocalCombineParams,
    88;
    x = 0, topk_idx = 8, topk_weights = 16, src_info = 24, src_topk = 32, active = 40,
    active_mirror = 48, out = 56, num_tokens = 64, num_topk = 68, num_experts = 72,
    max_tokens = 76, hidden = 80, reserved = 84,
);
// SAFETY: `repr(C)` plain data mirroring `LocalCombineParams` (size asserted on both sides).
unsafe impl KernelParams for LocalCombineParams {}

fn config(grid: u32, smem: usize) -> Result<LaunchConfig> {
    let shared_mem_bytes = u32::try_from(smem)
        .map_err(|_| Error::invalid("shared_mem_bytes", smem, "must fit in u32"))?;
    Ok(LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes,
    })
}

/// Launches `ll_local_dispatch` with the arguments of `ll_dispatch` (`p.buf.num_ranks == 1`).
///
/// # Safety
///
/// `p` must satisfy everything a launch of `ll_dispatch` with it requires (as checked by
/// [`super::dispatch_cuda`]), and the memory behind its pointers must stay valid and ordered on
/// `stream` until the launch is queued.
pub(super) unsafe fn dispatch(
    stream: &CudaStream,
    kernels: &Kernels,
    p: &DispatchParams,
) -> Result<()> {
    let b = &p.buf;
    let (t, k) = (p.num_tokens as usize, p.num_topk as usize);
    let (e, m, h) = (
        b.num_experts as usize,
        b.max_tokens as usize,
        b.hidden as usize,
    );
    let kernel = kernels.kernel(FILE, "ll_local_dispatch")?;
    // Blocks for the token items, or for the per-expert counts and `-1` fills (at most one
    // block per expert, at least one per EXPERTS_PER_BLOCK experts: a block walks its experts
    // one after another), whichever needs more.
    let items = t * h.div_ceil(DISPATCH_CHANS);
    let fill_blocks = (e * m)
        .div_ceil(THREADS as usize * FILL_PER_THREAD)
        .max(e.div_ceil(EXPERTS_PER_BLOCK))
        .min(e);
    let grid = grid_for(
        items.max(fill_blocks) as u64,
        1,
        kernels.props(),
        BLOCKS_PER_SM,
    );
    let cfg = config(grid, 4 * (t * k + e))?;
    let params = LocalDispatchParams {
        x: p.x,
        topk_idx: p.topk_idx,
        active: b.local + b.off_active,
        active_mirror: b.active_mirror,
        recv_x: p.recv_x,
        recv_scales: p.recv_scales,
        recv_count: p.recv_count,
        recv_src_info: p.recv_src_info,
        recv_src_topk: p.recv_src_topk,
        recv_layout_range: p.recv_layout_range,
        num_tokens: p.num_tokens,
        num_topk: p.num_topk,
        num_experts: b.num_experts,
        max_tokens: b.max_tokens,
        hidden: b.hidden,
        fp8: p.fp8,
        scale_format: p.scale_format,
        reserved: 0,
    };
    // SAFETY: `params` matches `LocalDispatchParams`; it takes the pointers and sizes of `p`,
    // which the caller guarantees valid for `ll_dispatch`: the kernel touches a subset of what
    // `ll_dispatch` does (the inputs, the outputs sized for the layout, the mask word at
    // `off_active` of the buffer and the host-mapped mirror).
    unsafe { kernel.launch(stream, cfg, params) }
}

/// Launches `ll_local_combine` with the arguments of `ll_combine` (`p.buf.num_ranks == 1`).
///
/// # Safety
///
/// `p` must satisfy everything a launch of `ll_combine` with it requires (as checked by
/// [`super::combine_cuda`]), and the memory behind its pointers must stay valid and ordered on
/// `stream` until the launch is queued.
pub(super) unsafe fn combine(
    stream: &CudaStream,
    kernels: &Kernels,
    p: &CombineParams,
) -> Result<()> {
    let b = &p.buf;
    let (t, k) = (p.num_tokens as usize, p.num_topk as usize);
    let kernel = kernels.kernel(FILE, "ll_local_combine")?;
    // Items: (token, chunk of THREADS vectors of 8 channels).
    let items = t * (b.hidden as usize / 8).div_ceil(THREADS as usize);
    let grid = grid_for(items as u64, 1, kernels.props(), BLOCKS_PER_SM);
    let cfg = config(grid, 4 * t * k)?;
    let params = LocalCombineParams {
        x: p.x,
        topk_idx: p.topk_idx,
        topk_weights: p.topk_weights,
        src_info: p.src_info,
        src_topk: p.src_topk,
        active: b.local + b.off_active,
        active_mirror: b.active_mirror,
        out: p.out,
        num_tokens: p.num_tokens,
        num_topk: p.num_topk,
        num_experts: b.num_experts,
        max_tokens: b.max_tokens,
        hidden: b.hidden,
        reserved: 0,
    };
    // SAFETY: `params` matches `LocalCombineParams`; it takes the pointers and sizes of `p`,
    // which the caller guarantees valid for `ll_combine`: the kernel touches a subset of what
    // `ll_combine` does (the expert outputs, the handle's source entries, the routing, `out`,
    // the mask word at `off_active` of the buffer and the host-mapped mirror).
    unsafe { kernel.launch(stream, cfg, params) }
}
