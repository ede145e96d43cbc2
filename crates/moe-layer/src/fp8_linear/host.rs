//! The CPU path of the dense fp8 layers: the fp8 GEMM's and SwiGLU cast's host twins
//! (`ep_kernels::gemm::fp8`), in f32 on the dequantized operands.

use candle_core::{DType, Device, Tensor};
use ep_kernels::gemm::fp8::{self as gemm_fp8, HostFp8};
use ep_kernels::gemm::GroupedGemmShape;
use float8::F8E4M3;
use half::bf16;

use crate::error::Result;

fn host_vec<T: candle_core::WithDType>(t: &Tensor) -> Result<Vec<T>> {
    Ok(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?)
}

/// Host twin of `cuda::gemm`: `[rows, n]` bf16.
pub(super) fn gemm(
    w_q: &Tensor,
    w_s: &Tensor,
    q: &Tensor,
    s: &Tensor,
    shape: &GroupedGemmShape,
) -> Result<Tensor> {
    let (a, sa) = (host_vec::<F8E4M3>(q)?, host_vec::<f32>(s)?);
    let (b, sb) = (host_vec::<F8E4M3>(w_q)?, host_vec::<f32>(w_s)?);
    let mut d = vec![bf16::ZERO; shape.rows * shape.n];
    let counts = vec![(shape.rows / shape.groups) as i32; shape.groups];
    gemm_fp8::grouped_gemm_fp8(
        HostFp8 { q: &a, scales: &sa },
        HostFp8 { q: &b, scales: &sb },
        &counts,
        shape,
        None,
        &mut d,
    )?;
    Ok(Tensor::from_vec(d, (shape.rows, shape.n), q.device())?)
}

/// Host twin of `cuda::swiglu_quantize`.
pub(super) fn swiglu_quantize(gu: &Tensor, i: usize) -> Result<(Tensor, Tensor)> {
    let rows = gu.dims2()?.0;
    let h = host_vec::<bf16>(&gu.to_dtype(DType::BF16)?)?;
    let sg = i / gemm_fp8::FP8_BLOCK;
    let mut q = vec![F8E4M3::ZERO; rows * i];
    let mut s = vec![0f32; rows * sg];
    gemm_fp8::swiglu_quantize(&h, rows, i, i, None, &mut q, &mut s)?;
    let dev = gu.device();
    Ok((
        Tensor::from_vec(q, (rows, i), dev)?,
        Tensor::from_vec(s, (rows, sg), dev)?,
    ))
}
