//! Launcher of the per-head GEMM (`crate::attention::per_head`): one cuBLAS strided batched GEMM,
//! a batch a head, bf16 in and out, f32 accumulation. Host twin:
//! [`crate::attention::per_head_gemm`].

use std::sync::Arc;

use cudarc::cublas::{result as cublas, sys, CudaBlas};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::attention::PerHeadShape;
use crate::error::Result;

/// `y[t, g, :] = x[t, g, first .. first + k] · w[g]` (`x` `[tokens, heads, x_width]`, `w`
/// `[heads, k, n]`, `y` `[tokens, heads, n]`, all bf16 and row-major) on `stream`, products
/// summed in f32. `blas` must be a handle bound to `stream` (candle: `CudaDevice::cublas_handle`
/// with `CudaDevice::cuda_stream`). Every value of `y` is written; nothing is read back.
pub fn per_head_gemm_bf16_cuda(
    stream: &Arc<CudaStream>,
    blas: &CudaBlas,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    shape: PerHeadShape,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    shape.check(x.len(), w.len(), y.len())?;
    let PerHeadShape {
        tokens,
        heads,
        x_width,
        first,
        k,
        n,
    } = shape;
    if tokens == 0 {
        return Ok(());
    }
    // Every size below fits in an i32 (`shape.check`).
    let (x_ptr, _gx) = x.device_ptr(stream);
    let (w_ptr, _gw) = w.device_ptr(stream);
    let (y_ptr, _gy) = y.device_ptr_mut(stream);
    let (alpha, beta) = (1.0f32, 0.0f32);
    // Head g in column-major terms: `y_g^T [n, tokens] = w_g^T [n, k] . x_g^T [k, tokens]`.
    // `w_g` row-major `[k, n]` is column-major `[n, k]` (lda = n, a head every k * n values);
    // `x_g` is the rows' `k` values from `first` of head g's block (ldb = heads * x_width, a
    // head every x_width values); `y_g` likewise (ldc = heads * n, a head every n values).
    // SAFETY: `blas` is a live handle bound to `stream` (the caller's contract), so the GEMM is
    // ordered after the guards' stream waits. `shape.check` proved `x`, `w` and `y` hold
    // exactly `tokens * heads * x_width`, `heads * k * n` and `tokens * heads * n` values and
    // `first + k <= x_width`: the last head's last row ends at `(tokens - 1) * heads * x_width
    // + (heads - 1) * x_width + first + k <= x.len()` (and alike for `y`), so the GEMM stays
    // inside the three allocations. `alpha` and `beta` are host f32 scalars (the handle's
    // default pointer mode) that live across the call.
    unsafe {
        cublas::gemm_strided_batched_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_N,
            sys::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            tokens as i32,
            k as i32,
            (&alpha as *const f32).cast(),
            w_ptr as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            n as i32,
            (k * n) as i64,
            (x_ptr + (first * std::mem::size_of::<bf16>()) as u64) as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            (heads * x_width) as i32,
            x_width as i64,
            (&beta as *const f32).cast(),
            y_ptr as *mut _,
            sys::cudaDataType_t::CUDA_R_16BF,
            (heads * n) as i32,
            n as i64,
            heads as i32,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}
