//! Launchers of the expert-order kernels (`expert_order.cu`); host twins:
//! [`crate::expert_order::host`].

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::cuda::{check_align, grid_for, KernelParams, Kernels};
use crate::error::{Error, Result};
use crate::expert_order::MAX_LOCAL_EXPERTS;

/// The cubin of `expert_order.cu`.
const FILE: &str = "expert_order/expert_order";
/// Threads per block (`kThreads`).
const THREADS: u32 = 256;
/// Resident blocks per SM the grids are capped at.
const BLOCKS_PER_SM: u32 = 4;
/// Most slots per token (one lane each).
const MAX_TOPK: usize = 32;

/// Mirror of `struct PermuteParams` in `expert_order.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PermuteParams {
    x: CUdeviceptr,
    topk_idx: CUdeviceptr,
    a: CUdeviceptr,
    counts: CUdeviceptr,
    fill: CUdeviceptr,
    positions: CUdeviceptr,
    num_tokens: i64,
    row_vectors: i64,
    a_rows: i64,
    top_k: i32,
    num_local: i32,
    alignment: i32,
    reserved: i32,
}
const _: () = assert!(std::mem::size_of::<PermuteParams>() == 88);
const _: () = assert!(std::mem::offset_of!(PermuteParams, num_tokens) == 48);
const _: () = assert!(std::mem::offset_of!(PermuteParams, top_k) == 72);

// SAFETY: `repr(C)` plain data mirroring `PermuteParams` in expert_order.cu (size asserted
// both sides, offsets here).
unsafe impl KernelParams for PermuteParams {}

/// Mirror of `struct UnpermuteParams` in `expert_order.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct UnpermuteParams {
    y: CUdeviceptr,
    positions: CUdeviceptr,
    weights: CUdeviceptr,
    out: CUdeviceptr,
    num_tokens: i64,
    row_vectors: i64,
    y_rows: i64,
    top_k: i32,
    reserved: i32,
}
const _: () = assert!(std::mem::size_of::<UnpermuteParams>() == 64);
const _: () = assert!(std::mem::offset_of!(UnpermuteParams, top_k) == 56);

// SAFETY: `repr(C)` plain data mirroring `UnpermuteParams` in expert_order.cu.
unsafe impl KernelParams for UnpermuteParams {}

/// Checks a bf16 row length (16-byte vectors) and returns the vectors per row.
fn row_vectors(row: usize) -> Result<i64> {
    row_vectors_of(row, std::mem::size_of::<bf16>())
}

/// Checks a row of `row` elements of `size` bytes (whole 16-byte vectors) and returns the
/// vectors per row.
fn row_vectors_of(row: usize, size: usize) -> Result<i64> {
    let bytes = row * size;
    if row == 0 || bytes % 16 != 0 {
        return Err(Error::invalid(
            "row",
            row,
            format!(
                "must be a positive number of {size}-byte elements making whole 16-byte vectors"
            ),
        ));
    }
    Ok((bytes / 16) as i64)
}

fn check_topk(k: usize) -> Result<()> {
    if k == 0 || k > MAX_TOPK {
        return Err(Error::invalid(
            "top_k",
            k,
            format!("must be in 1..={MAX_TOPK}"),
        ));
    }
    Ok(())
}

/// The expert-major permute on `stream` (see the module docs): from `x` (`[n, row]` of any
/// element type whose rows are whole 16-byte vectors: bf16, or the e4m3 rows of an fp8
/// dispatch) and
/// `topk_idx` (`[n, k]` i64 local ids or -1) writes `counts` (`[num_local]`), `positions`
/// (`[n, k]`) and the rows of `a` (`[rows, row]`: at least the rows the placement needs, which
/// `rows_bound(..)` holds for any routing; fewer when the caller knows the per-expert counts);
/// `fill` (`[num_local]`) is scratch. Counts and scratch are zeroed here; nothing is read back
/// to the host. Ids outside `[-1, num_local)`, and a placement past the rows of `a`, trap on
/// the device.
#[allow(clippy::too_many_arguments)]
pub fn permute_cuda<T>(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<T>,
    topk_idx: &impl DevicePtr<i64>,
    k: usize,
    num_local: usize,
    alignment: usize,
    row: usize,
    a: &mut impl DevicePtrMut<T>,
    counts: &mut impl DevicePtrMut<i32>,
    fill: &mut impl DevicePtrMut<i32>,
    positions: &mut impl DevicePtrMut<i32>,
) -> Result<()> {
    check_topk(k)?;
    let vectors = row_vectors_of(row, std::mem::size_of::<T>())?;
    if num_local == 0 || num_local > MAX_LOCAL_EXPERTS {
        return Err(Error::invalid(
            "num_local",
            num_local,
            format!("must be in 1..={MAX_LOCAL_EXPERTS}"),
        ));
    }
    if alignment == 0 || alignment > i32::MAX as usize {
        return Err(Error::invalid(
            "alignment",
            alignment,
            "must be in 1..=i32::MAX",
        ));
    }
    if topk_idx.len() % k != 0 {
        return Err(Error::invalid(
            "topk_idx",
            format!("{} entries", topk_idx.len()),
            format!("must be whole rows of k = {k}"),
        ));
    }
    let n = topk_idx.len() / k;
    Error::check_len("x", n * row, x.len())?;
    Error::check_len("counts", num_local, counts.len())?;
    Error::check_len("fill", num_local, fill.len())?;
    Error::check_len("positions", n * k, positions.len())?;
    // The rows the placement needs depend on the device routing: `rows_bound` holds any, a
    // caller who knows the per-expert counts (a dispatch's) may pass fewer, and a placement
    // past `a` traps on the device.
    let a_rows = a.len() / row;
    if n > 0 && a_rows == 0 {
        return Err(Error::invalid(
            "a",
            "0 rows",
            format!(
                "must hold the routing's rows (at most rows_bound = {})",
                crate::expert_order::rows_bound(n, k, num_local, alignment)
            ),
        ));
    }
    stream.memset_zeros(counts)?;
    stream.memset_zeros(fill)?;
    if n == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    let count = kernels.kernel(FILE, "expert_count")?;
    let place = kernels.kernel(FILE, "expert_permute")?;
    let (x_ptr, _gx) = x.device_ptr(stream);
    let (i_ptr, _gi) = topk_idx.device_ptr(stream);
    let (a_ptr, _ga) = a.device_ptr_mut(stream);
    let (c_ptr, _gc) = counts.device_ptr_mut(stream);
    let (f_ptr, _gf) = fill.device_ptr_mut(stream);
    let (p_ptr, _gp) = positions.device_ptr_mut(stream);
    check_align("x", x_ptr, 16)?;
    check_align("a", a_ptr, 16)?;
    let params = PermuteParams {
        x: x_ptr,
        topk_idx: i_ptr,
        a: a_ptr,
        counts: c_ptr,
        fill: f_ptr,
        positions: p_ptr,
        num_tokens: n as i64,
        row_vectors: vectors,
        a_rows: a_rows as i64,
        // Fit: checked above.
        top_k: k as i32,
        num_local: num_local as i32,
        alignment: alignment as i32,
        reserved: 0,
    };
    let props = kernels.props();
    let count_cfg = LaunchConfig {
        grid_dim: (grid_for((n * k) as u64, u64::from(THREADS), props, 1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let place_cfg = LaunchConfig {
        grid_dim: (
            grid_for(n as u64, u64::from(THREADS / 32), props, BLOCKS_PER_SM),
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `PermuteParams`; `x` holds `n * row` elements, `topk_idx` `n * k`,
    // `positions` `n * k`, `counts` and `fill` `num_local` (checked above, zeroed on this
    // stream before); `a` holds `a_rows` rows and the kernel traps before writing a row past
    // it; both row bases are 16-byte aligned with 16-byte rows. `count` runs before `place`
    // on the same stream, so `place` reads the final counts. Guards keep stream order.
    unsafe {
        count.launch(stream, count_cfg, params)?;
        place.launch(stream, place_cfg, params)
    }
}

/// The weighted un-permute on `stream`: `out[t] = bf16(sum_k w[t, k] * y[positions[t, k]])`
/// in f32 over the valid slots, slot order (zero for a token without one); `y` is
/// `[rows, row]` bf16, `positions` `[n, k]` (from [`permute_cuda`]), `weights` `[n, k]` f32,
/// `out` `[n, row]`. Same result as the host twin [`crate::expert_order::unpermute`], bit for bit.
pub fn unpermute_cuda(
    stream: &Arc<CudaStream>,
    y: &impl DevicePtr<bf16>,
    positions: &impl DevicePtr<i32>,
    weights: &impl DevicePtr<f32>,
    k: usize,
    row: usize,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    check_topk(k)?;
    let vectors = row_vectors(row)?;
    if positions.len() % k != 0 {
        return Err(Error::invalid(
            "positions",
            format!("{} entries", positions.len()),
            format!("must be whole rows of k = {k}"),
        ));
    }
    let n = positions.len() / k;
    Error::check_len("weights", n * k, weights.len())?;
    Error::check_len("out", n * row, out.len())?;
    if n == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "expert_unpermute")?;
    let (y_ptr, _gy) = y.device_ptr(stream);
    let (p_ptr, _gp) = positions.device_ptr(stream);
    let (w_ptr, _gw) = weights.device_ptr(stream);
    let (o_ptr, _go) = out.device_ptr_mut(stream);
    check_align("y", y_ptr, 16)?;
    check_align("out", o_ptr, 16)?;
    let params = UnpermuteParams {
        y: y_ptr,
        positions: p_ptr,
        weights: w_ptr,
        out: o_ptr,
        num_tokens: n as i64,
        row_vectors: vectors,
        y_rows: (y.len() / row) as i64,
        top_k: k as i32,
        reserved: 0,
    };
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(
                n as u64,
                u64::from(THREADS / 32),
                kernels.props(),
                BLOCKS_PER_SM,
            ),
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `UnpermuteParams`; `positions` and `weights` hold `n * k`
    // entries, `out` `n * row` bf16 (checked above); the kernel traps on a position past the
    // rows of `y` before reading it; 16-byte aligned bases and rows. Guards keep stream order.
    unsafe { kernel.launch(stream, cfg, params) }
}

/// Mirror of `struct ScatterParams` in `expert_order.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ScatterParams {
    src: CUdeviceptr,
    positions: CUdeviceptr,
    dst: CUdeviceptr,
    num_tokens: i64,
    row_words: i64,
    dst_rows: i64,
    top_k: i32,
    reserved: i32,
}
const _: () = assert!(std::mem::size_of::<ScatterParams>() == 56);
const _: () = assert!(std::mem::offset_of!(ScatterParams, top_k) == 48);

// SAFETY: `repr(C)` plain data mirroring `ScatterParams` in expert_order.cu.
unsafe impl KernelParams for ScatterParams {}

/// A second payload of every token to the rows [`permute_cuda`] placed its rows at: for every
/// valid slot, `dst[positions[t, s]] = src[t]`; `src` is `[n, row]`, `dst` `[rows, row]` of
/// `T` whose rows are whole 4-byte words (e.g. the fp8 rows' f32 scales), `positions`
/// `[n, k]`. Rows of `dst` no slot lands on are not written; a position past `dst` traps.
/// Host twin: [`crate::expert_order::scatter`].
pub fn scatter_cuda<T>(
    stream: &Arc<CudaStream>,
    src: &impl DevicePtr<T>,
    positions: &impl DevicePtr<i32>,
    k: usize,
    row: usize,
    dst: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    check_topk(k)?;
    let bytes = row * std::mem::size_of::<T>();
    if row == 0 || bytes % 4 != 0 {
        return Err(Error::invalid(
            "row",
            row,
            "must be a positive number of elements making whole 4-byte words",
        ));
    }
    if positions.len() % k != 0 {
        return Err(Error::invalid(
            "positions",
            format!("{} entries", positions.len()),
            format!("must be whole rows of k = {k}"),
        ));
    }
    let n = positions.len() / k;
    Error::check_len("src", n * row, src.len())?;
    let dst_rows = dst.len() / row;
    if n == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "expert_scatter")?;
    let (s_ptr, _gs) = src.device_ptr(stream);
    let (p_ptr, _gp) = positions.device_ptr(stream);
    let (d_ptr, _gd) = dst.device_ptr_mut(stream);
    check_align("src", s_ptr, 4)?;
    check_align("dst", d_ptr, 4)?;
    let params = ScatterParams {
        src: s_ptr,
        positions: p_ptr,
        dst: d_ptr,
        num_tokens: n as i64,
        row_words: (bytes / 4) as i64,
        dst_rows: dst_rows as i64,
        // Fits: checked above.
        top_k: k as i32,
        reserved: 0,
    };
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(
                n as u64,
                u64::from(THREADS / 32),
                kernels.props(),
                BLOCKS_PER_SM,
            ),
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `ScatterParams`; `src` holds `n` rows and `positions` `n * k`
    // entries (checked above), `dst` holds `dst_rows` rows and the kernel traps before writing
    // one past it; rows are whole aligned 4-byte words. Guards keep stream order.
    unsafe { kernel.launch(stream, cfg, params) }
}
