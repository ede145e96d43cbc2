//! Per-token fp8 casts of tensors, for fp8 dispatch (see [`ep_kernels::fp8`]).

use crate::buffer::{check_dtype, check_shape};
use crate::error::{Error, Result};
use candle_core::{DType, Tensor};
use ep_kernels::fp8::{self, ScaleFormat};
pub use ep_kernels::FP8_GROUP;

/// Casts `x: [T, H]` to fp8 e4m3 with one f32 scale per token and 128 channels:
/// returns `(q: [T, H] f8e4m3, scales: [T, H / 128] f32)`. `ue8m0` rounds scales up to
/// powers of two.
pub fn per_token_cast_to_fp8(x: &Tensor, ue8m0: bool) -> Result<(Tensor, Tensor)> {
    check_shape("x", x, &[None, None])?;
    check_dtype(
        "x",
        x,
        &[DType::BF16, DType::F16, DType::F32],
        "bf16, f16 or f32",
    )?;
    let (t, h) = x.dims2()?;
    if h % FP8_GROUP != 0 {
        return Err(Error::invalid(
            "hidden",
            h,
            format!("fp8 needs a multiple of {FP8_GROUP}"),
        ));
    }
    let dev = x.device();
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(cd) = dev {
        let format = if ue8m0 {
            ScaleFormat::Ue8m0
        } else {
            ScaleFormat::Float
        };
        return crate::cuda::cast::quantize(cd, x, t, h, format);
    }
    let xb = x
        .to_dtype(DType::BF16)?
        .flatten_all()?
        .to_vec1::<half::bf16>()?;
    let format = if ue8m0 {
        ScaleFormat::Ue8m0
    } else {
        ScaleFormat::Float
    };
    let (q, s) = fp8::quantize(&xb, t, h, format)?;
    Ok((
        Tensor::from_vec(q, (t, h), dev)?,
        Tensor::from_vec(s, (t, h / FP8_GROUP), dev)?,
    ))
}

/// The inverse of [`per_token_cast_to_fp8`] for any leading shape: `q: [.., H]` f8e4m3 and
/// `scales: [.., H / 128]` f32 to `dtype`.
pub fn per_token_cast_back(q: &Tensor, scales: &Tensor, dtype: DType) -> Result<Tensor> {
    check_dtype("q", q, &[DType::F8E4M3], "f8e4m3")?;
    check_dtype("scales", scales, &[DType::F32], "f32")?;
    let dims = q.dims().to_vec();
    let h = *dims
        .last()
        .ok_or_else(|| Error::invalid("q", "a scalar", "needs a hidden dimension"))?;
    let mut sdims = dims.clone();
    *sdims.last_mut().expect("non-empty") = h / FP8_GROUP;
    if h % FP8_GROUP != 0 || scales.dims() != sdims.as_slice() {
        return Err(Error::Shape {
            arg: "scales",
            expected: format!("{sdims:?}"),
            got: scales.dims().to_vec(),
        });
    }
    let rows = dims.iter().rev().skip(1).product::<usize>();
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(cd) = q.device() {
        return crate::cuda::cast::dequantize(cd, q, scales, rows, h, &dims, dtype);
    }
    let qv = q.flatten_all()?.to_vec1::<float8::F8E4M3>()?;
    let sv = scales.flatten_all()?.to_vec1::<f32>()?;
    let out = fp8::dequantize(&qv, &sv, rows, h)?;
    Ok(Tensor::from_vec(out, dims, q.device())?.to_dtype(dtype)?)
}
