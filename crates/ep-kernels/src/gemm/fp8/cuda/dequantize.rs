//! Launcher of the weight dequantization (`dequantize.cu`); host twin:
//! [`crate::gemm::fp8::dequantize_weight`].

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use float8::F8E4M3;
use half::bf16;

use crate::cuda::check_align;
use crate::error::{Error, Result};
use crate::gemm::fp8::weight_scale_dims;

/// The cubin of `fp8/dequantize.cu`.
const DEQUANTIZE_FILE: &str = "gemm/fp8/dequantize";
/// Threads per block (`kThreads` in `dequantize.cu`).
const DEQUANTIZE_THREADS: u32 = 256;
/// Values per thread and grid-stride step (`kPerThread`).
const DEQUANTIZE_PER_THREAD: u64 = 16;

/// Mirror of `struct DequantizeWeightParams` in `fp8/dequantize.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DequantizeWeightParams {
    q: CUdeviceptr,
    scales: CUdeviceptr,
    out: CUdeviceptr,
    n: i64,
    k: i64,
    scale_rows: i32,
    scale_cols: i32,
}
crate::cuda::assert_params_layout!(
    DequantizeWeightParams,
    48;
    q = 0, scales = 8, out = 16, n = 24, k = 32, scale_rows = 40, scale_cols = 44,
);

// SAFETY: `repr(C)` plain data mirroring `DequantizeWeightParams` in dequantize.cu (size
// asserted both sides, offsets here).
unsafe impl crate::cuda::KernelParams for DequantizeWeightParams {}

/// Dequantizes a `[n, k]` e4m3 weight with `scale_rows x 128` scale blocks
/// (`[ceil(n / scale_rows), ceil(k / 128)]` f32) into `out` (`[n, k]` bf16) on `stream`:
/// `bf16(f32(q) * scale)`, bit-identical to [`crate::gemm::fp8::dequantize_weight`] rounded to
/// bf16. `k` must be a multiple of 16, `q` and `out` 16-byte aligned.
pub fn dequantize_weight_cuda(
    stream: &Arc<CudaStream>,
    q: &impl DevicePtr<F8E4M3>,
    scales: &impl DevicePtr<f32>,
    n: usize,
    k: usize,
    scale_rows: usize,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    if k == 0 || k % 16 != 0 {
        return Err(Error::invalid("k", k, "must be a positive multiple of 16"));
    }
    if scale_rows == 0 || scale_rows > i32::MAX as usize {
        return Err(Error::invalid(
            "scale_rows",
            scale_rows,
            "must be in 1..2^31",
        ));
    }
    let (sr, sc) = weight_scale_dims(n, k, scale_rows);
    Error::check_len("q", n * k, q.len())?;
    Error::check_len("scales", sr * sc, scales.len())?;
    Error::check_len("out", n * k, out.len())?;
    if n == 0 {
        return Ok(());
    }
    let kernels = crate::cuda::Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(DEQUANTIZE_FILE, "dequantize_weight_fp8")?;
    stream.context().bind_to_thread()?;
    let (q_ptr, _gq) = q.device_ptr(stream);
    let (s_ptr, _gs) = scales.device_ptr(stream);
    let (o_ptr, _go) = out.device_ptr_mut(stream);
    check_align("q", q_ptr, 16)?;
    check_align("out", o_ptr, 16)?;
    check_align("scales", s_ptr, 4)?;
    let params = DequantizeWeightParams {
        q: q_ptr,
        scales: s_ptr,
        out: o_ptr,
        n: n as i64,
        k: k as i64,
        scale_rows: scale_rows as i32,
        scale_cols: sc as i32,
    };
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (
            crate::cuda::grid_for(
                (n * k) as u64 / DEQUANTIZE_PER_THREAD,
                u64::from(DEQUANTIZE_THREADS),
                kernels.props(),
                8,
            ),
            1,
            1,
        ),
        block_dim: (DEQUANTIZE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` mirrors `DequantizeWeightParams`; `q`, `scales` and `out` hold the
    // elements of a `[n, k]` weight and its scales (checked above), `q` and `out` are 16-byte
    // aligned, and their guards keep them alive and in stream order until the launch is
    // queued; the kernel touches `n * k / 16` vectors of each.
    unsafe { kernel.launch(stream, cfg, params) }
}
