//! Launchers of the experts' row quantizations (`quantize_rows.cu`): their input rows, and
//! SwiGLU with its quantization. Host twins: [`crate::gemm::fp8::quantize_rows`],
//! [`crate::gemm::fp8::swiglu_quantize`].

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use float8::F8E4M3;
use half::bf16;

use super::opt_ptr;
use crate::cuda::check_align;
use crate::error::{Error, Result};
use crate::gemm::fp8::FP8_BLOCK;

/// The cubin of `fp8/quantize_rows.cu`.
const ROWS_FILE: &str = "gemm/fp8/quantize_rows";

/// Mirror of `struct RowsParams` in `fp8/quantize_rows.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RowsParams {
    input: CUdeviceptr,
    q: CUdeviceptr,
    scales: CUdeviceptr,
    counts: CUdeviceptr,
    rows: i64,
    cols: i32,
    m_max: i32,
    block: i32,
}
crate::cuda::assert_params_layout!(
    RowsParams,
    56;
    input = 0, q = 8, scales = 16, counts = 24, rows = 32, cols = 40, m_max = 44, block = 48,
);

// SAFETY: `repr(C)` plain data mirroring `RowsParams` in quantize_rows.cu (size asserted both
// sides, offsets here).
unsafe impl crate::cuda::KernelParams for RowsParams {}

/// Most blocks of a masked layout the row kernels take (their prefix of the counts, 4 bytes a
/// block, is in shared memory).
pub const MAX_MASK_GROUPS: usize = 4096;

/// The mask of a masked layout: the device counts (`[rows / m_max]` i32, at most
/// [`MAX_MASK_GROUPS`]) and `m_max`; the row kernels visit only the rows within each block's
/// count.
pub type RowsMask<'a> = (&'a dyn DevicePtr<i32>, usize);

/// The experts' input rows quantized on `stream`: `x` (`[rows, cols]` bf16) to `q`
/// (`[rows, cols]` e4m3) and `scales` (`[rows, cols / 128]` f32), 1 x 128 as the per-token
/// fp8 cast, bit for bit; with `mask` only the rows within each block's count (the others'
/// outputs are not written). Host twin: [`crate::gemm::fp8::quantize_rows`].
pub fn quantize_rows_fp8_cuda(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<bf16>,
    rows: usize,
    cols: usize,
    mask: Option<RowsMask<'_>>,
    q: &mut impl DevicePtrMut<F8E4M3>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    Error::check_len("x", rows * cols, x.len())?;
    launch_rows(
        stream,
        "quantize_rows_fp8",
        x,
        rows,
        cols,
        cols,
        mask,
        q,
        scales,
    )
}

/// The fp8 experts' SwiGLU and its quantization for the down GEMM on `stream`: for every row of
/// `h` (`[rows, 2 * inter]` bf16, `block` gate columns then `block` up columns in turn:
/// `block = inter` for all gate columns then all up columns) and every 128 columns of
/// `act = silu(gate) * up`, writes `q` (`[rows, inter]` e4m3) and `scales`
/// (`[rows, inter / 128]` f32) as the per-token fp8 cast would; with `mask` only the rows
/// within each block's count. Host twin: [`crate::gemm::fp8::swiglu_quantize`].
#[allow(clippy::too_many_arguments)]
pub fn swiglu_quantize_fp8_cuda(
    stream: &Arc<CudaStream>,
    h: &impl DevicePtr<bf16>,
    rows: usize,
    inter: usize,
    block: usize,
    mask: Option<RowsMask<'_>>,
    q: &mut impl DevicePtrMut<F8E4M3>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    Error::check_len("h", rows * 2 * inter, h.len())?;
    if block == 0 || block % FP8_BLOCK != 0 || inter % block.max(1) != 0 {
        return Err(Error::invalid(
            "block",
            block,
            format!("must be a multiple of {FP8_BLOCK} dividing inter = {inter}"),
        ));
    }
    launch_rows(
        stream,
        "swiglu_quantize_fp8",
        h,
        rows,
        inter,
        block,
        mask,
        q,
        scales,
    )
}

/// The checks and launch of a row kernel of `quantize_rows.cu` over `rows` rows of `cols`
/// outputs (its input's length and `block` checked by the caller).
#[allow(clippy::too_many_arguments)]
fn launch_rows(
    stream: &Arc<CudaStream>,
    kernel: &str,
    input: &impl DevicePtr<bf16>,
    rows: usize,
    cols: usize,
    block: usize,
    mask: Option<RowsMask<'_>>,
    q: &mut impl DevicePtrMut<F8E4M3>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    if cols == 0 || cols % FP8_BLOCK != 0 || cols > i32::MAX as usize {
        return Err(Error::invalid(
            "cols",
            cols,
            format!("must be a positive multiple of {FP8_BLOCK} below 2^31"),
        ));
    }
    Error::check_len("q", rows * cols, q.len())?;
    Error::check_len("scales", rows * cols / FP8_BLOCK, scales.len())?;
    let m_max = match mask {
        Some((counts, m_max)) => {
            if m_max == 0 || m_max > i32::MAX as usize || counts.len() * m_max != rows {
                return Err(Error::invalid(
                    "mask",
                    format!("{} counts of m_max {m_max}", counts.len()),
                    format!("must cover the {rows} rows"),
                ));
            }
            if counts.len() > MAX_MASK_GROUPS || rows > i32::MAX as usize {
                return Err(Error::invalid(
                    "mask",
                    format!("{} blocks of {m_max} rows", counts.len()),
                    format!("at most {MAX_MASK_GROUPS} blocks and 2^31 rows"),
                ));
            }
            m_max as i32
        }
        None => 0,
    };
    if rows == 0 {
        return Ok(());
    }
    let kernels = crate::cuda::Kernels::for_stream(stream)?;
    let function = kernels.kernel(ROWS_FILE, kernel)?;
    stream.context().bind_to_thread()?;
    let mut guards = Vec::new();
    let c_ptr = opt_ptr(mask.map(|(c, _)| c), stream, &mut guards);
    let (i_ptr, _gi) = input.device_ptr(stream);
    let (q_ptr, _gq) = q.device_ptr_mut(stream);
    let (s_ptr, _gs) = scales.device_ptr_mut(stream);
    check_align("input", i_ptr, 16)?;
    check_align("q", q_ptr, 8)?;
    check_align("scales", s_ptr, 4)?;
    let params = RowsParams {
        input: i_ptr,
        q: q_ptr,
        scales: s_ptr,
        counts: c_ptr,
        rows: rows as i64,
        cols: cols as i32,
        m_max,
        // At most cols.
        block: block as i32,
    };
    // One half-warp per (row, 128 columns), a grid sized for every row (masked: every block
    // full); the kernels share the valid rows over it.
    let warps_per_block = 256 / 32;
    let blocks = crate::cuda::grid_for(
        (rows * cols / FP8_BLOCK).div_ceil(2) as u64,
        warps_per_block,
        kernels.props(),
        8,
    );
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        // The masked layout's prefix of the counts (`for_each_group` in quantize_rows.cu).
        shared_mem_bytes: mask.map_or(0, |(counts, _)| 4 * (counts.len() as u32 + 1)),
    };
    // SAFETY: `params` mirrors `RowsParams`; the input, `q` and `scales` hold the elements of
    // `rows` rows (checked here and by the caller) with the alignments the kernels' vector
    // accesses need, and `counts` (when given) one entry per block of `m_max` rows; their
    // guards keep them alive and in stream order until the launch is queued.
    let launched = unsafe { function.launch(stream, cfg, params) };
    drop(guards);
    launched
}
