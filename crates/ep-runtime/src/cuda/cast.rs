//! The per-token fp8 casts of [`crate::cast`] on CUDA tensors (the `fp8.cu` kernels, run on
//! candle's stream).

use super::tensor::{alloc_uninit, wrap, DeviceTensor};
use crate::error::Result;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Tensor};
use ep_kernels::fp8 as kf;
use ep_kernels::fp8::ScaleFormat;
use ep_kernels::FP8_GROUP;

/// `x: [T, H]` to `(q: [T, H] f8e4m3, scales: [T, H / 128] f32)`.
pub(crate) fn quantize(
    dev: &CudaDevice,
    x: &Tensor,
    t: usize,
    h: usize,
    format: ScaleFormat,
) -> Result<(Tensor, Tensor)> {
    let stream = dev.cuda_stream();
    let xb = x.to_dtype(DType::BF16)?.contiguous()?;
    let groups = h / FP8_GROUP;
    // Both written whole by the kernel.
    let mut q = alloc_uninit::<float8::F8E4M3>(&stream, t * h)?;
    let mut s = alloc_uninit::<f32>(&stream, t * groups)?;
    {
        let xd = DeviceTensor::new("x", &xb)?;
        kf::quantize_cuda(
            &stream,
            &xd.view::<half::bf16>()?,
            t,
            h,
            format,
            &mut q.slice_mut(0..t * h),
            &mut s.slice_mut(0..t * groups),
        )?;
    }
    Ok((wrap(q, (t, h), dev), wrap(s, (t, groups), dev)))
}

/// `q: [.., H]` f8e4m3 and `scales: [.., H / 128]` f32 (`rows` rows) back to `dtype`.
pub(crate) fn dequantize(
    dev: &CudaDevice,
    q: &Tensor,
    scales: &Tensor,
    rows: usize,
    h: usize,
    dims: &[usize],
    dtype: DType,
) -> Result<Tensor> {
    let stream = dev.cuda_stream();
    let qc = q.contiguous()?;
    let sc = scales.contiguous()?;
    // Written whole by the kernel.
    let mut out = alloc_uninit::<half::bf16>(&stream, rows * h)?;
    {
        let qd = DeviceTensor::new("q", &qc)?;
        let sd = DeviceTensor::new("scales", &sc)?;
        kf::dequantize_cuda(
            &stream,
            &qd.view::<float8::F8E4M3>()?,
            &sd.view::<f32>()?,
            rows,
            h,
            &mut out.slice_mut(0..rows * h),
        )?;
    }
    Ok(wrap(out, dims.to_vec(), dev).to_dtype(dtype)?)
}
