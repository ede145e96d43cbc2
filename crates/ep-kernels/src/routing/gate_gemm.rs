//! The gate's logits for many tokens on the tensor cores: `logits[T, E] = x[T, H] W[E, H]^T`
//! with `x` and `W` in bf16, products and sums in f32, f32 out (cuBLAS `GemmEx`, compute type
//! 32F). Host twin: [`super::gate_logits`] (with `W` as f32 holding the same bf16 values).
//!
//! A product of two bf16 values is exact in f32, so with a gate weight that is bf16 (as
//! DeepSeek-V3's checkpoints store it) this computes the f32 logits of the f32 GEMM the router
//! would otherwise run on `x` converted to f32, up to the summation order, which no two GEMM
//! libraries share anyway; it skips the `[T, H]` f32 copy of `x` and runs on the tensor cores
//! instead of the f32 pipes, which measured faster for prefill batches (`docs/benchmarks.md`,
//! "The MoE layer (one GPU)"). Past [`super::GATE_KERNEL_MAX_TOKENS_BESIDE_GEMM`] tokens the
//! router uses it whenever `x` is bf16 and its weight is exactly bf16.

use std::sync::Arc;

use cudarc::cublas::{result as cublas, sys, CudaBlas};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::GateShape;
use crate::error::{Error, Result};

/// Computes the gate's logits `[T, E]` f32 = `x` (`[T, H]` bf16) times `weight^T` (`weight`
/// `[E, H]` bf16) on `stream` with cuBLAS on the tensor cores, f32 accumulation. `blas` must
/// be a handle bound to `stream` (candle: `CudaDevice::cublas_handle` with
/// `CudaDevice::cuda_stream`); nothing is read back to the host.
pub fn gate_logits_gemm_cuda(
    stream: &Arc<CudaStream>,
    blas: &CudaBlas,
    x: &impl DevicePtr<bf16>,
    weight: &impl DevicePtr<bf16>,
    shape: GateShape,
    logits: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let t = shape.check(true, x.len(), weight.len(), logits.len())?;
    if t == 0 {
        return Ok(());
    }
    let (e, h) = (shape.num_experts, shape.hidden);
    let t_i = i32::try_from(t)
        .map_err(|_| Error::invalid("x", format!("{t} tokens"), "must fit in an i32"))?;
    // `e` and `h` fit: `shape.check` with `device` bounds them.
    let (e_i, h_i) = (e as i32, h as i32);
    let (x_ptr, _gx) = x.device_ptr(stream);
    let (w_ptr, _gw) = weight.device_ptr(stream);
    let (l_ptr, _gl) = logits.device_ptr_mut(stream);
    let (alpha, beta) = (1.0f32, 0.0f32);
    // Row-major `logits [T, E] = x [T, H] . W [E, H]^T` is column-major
    // `logits^T [E, T] = W . x^T`: A = W read transposed (column-major `[H, E]`, lda = H),
    // B = x (column-major `[H, T]`, ldb = H), C column-major `[E, T]` (ldc = E).
    // SAFETY: `blas` is a live handle bound to `stream` (the caller's contract), so the GEMM is
    // ordered after the guards' stream waits; `weight` holds `e * h`, `x` `t * h` bf16 and
    // `logits` `t * e` f32 (checked by `shape.check`), exactly what the GEMM of these sizes
    // and leading dimensions reads and writes; `alpha` and `beta` are host f32 scalars (the
    // handle's default pointer mode) that live across the call; the guards keep the slices'
    // stream ordering until the call is queued.
    unsafe {
        cublas::gemm_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            e_i,
            t_i,
            h_i,
            (&alpha as *const f32).cast(),
            w_ptr as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            h_i,
            x_ptr as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            h_i,
            (&beta as *const f32).cast(),
            l_ptr as *mut _,
            sys::cudaDataType_t::CUDA_R_32F,
            e_i,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}
