//! Block-scaled FP8 weights as DeepSeek-V3, R1, V3.1 and Kimi-K2 ship them: a linear weight
//! `W [n, k]` stored as e4m3 (`{prefix}.weight`) with one f32 scale per 128 x 128 block
//! (`{prefix}.weight_scale_inv`, `[ceil(n / 128), ceil(k / 128)]`, edge blocks partial), so that
//! `W = f32(q) * scale` per block (DeepSeek's `weight_dequant`).
//!
//! [`load_weight`] reads a linear weight either way: as stored, or, when its scales are there,
//! dequantized exactly to the builder's dtype. [`Fp8Weight`] keeps the e4m3 values and their
//! scales for the layers that run fp8 GEMMs on them (the routed experts on CUDA,
//! [`crate::Experts`]).

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use ep_kernels::gemm::fp8::{weight_scale_dims, FP8_BLOCK};
use float8::F8E4M3;

use crate::error::{Error, Result};

/// A block-scaled e4m3 weight `[n, k]` and its `[ceil(n / 128), ceil(k / 128)]` f32 scales.
#[derive(Clone, Debug)]
pub struct Fp8Weight {
    q: Tensor,
    scale: Tensor,
}

/// The name of the scales of the weight at `prefix` (`{prefix}.weight_scale_inv`).
const SCALE_NAME: &str = "weight_scale_inv";

impl Fp8Weight {
    /// Checks `q` (e4m3 `[n, k]`) and `scale` (f32 `[ceil(n / 128), ceil(k / 128)]`) of the
    /// weight named `name`; an error names the tensor, what it holds and what is needed.
    pub fn new(name: &str, q: Tensor, scale: Tensor) -> Result<Self> {
        let (n, k) = q.dims2().map_err(|_| {
            Error::invalid(
                "fp8 weight",
                format!("{name}.weight of shape {:?}", q.dims()),
                "must be a matrix [out, in]",
            )
        })?;
        if q.dtype() != DType::F8E4M3 {
            return Err(Error::invalid(
                "fp8 weight",
                format!("{name}.weight of dtype {:?}", q.dtype()),
                "must be F8_E4M3 beside its weight_scale_inv",
            ));
        }
        let want = weight_scale_dims(n, k, FP8_BLOCK);
        if scale.dims() != [want.0, want.1] || scale.dtype() != DType::F32 {
            return Err(Error::invalid(
                "fp8 weight",
                format!(
                    "{name}.{SCALE_NAME} of dtype {:?} and shape {:?}",
                    scale.dtype(),
                    scale.dims()
                ),
                format!(
                    "must be F32 [{}, {}]: one scale per 128 x 128 block of the [{n}, {k}] weight",
                    want.0, want.1
                ),
            ));
        }
        if !q.device().same_device(scale.device()) {
            return Err(Error::invalid(
                "fp8 weight",
                format!(
                    "{name}: values on {:?}, scales on {:?}",
                    q.device(),
                    scale.device()
                ),
                "values and scales must be on one device",
            ));
        }
        Ok(Self { q, scale })
    }

    /// The fp8 weight at `prefix` of `vb` (`weight` `[n, k]` e4m3 and `weight_scale_inv`),
    /// or `None` when `vb` has no `weight_scale_inv` there (a weight stored unquantized).
    pub fn load(vb: &VarBuilder, n: usize, k: usize) -> Result<Option<Self>> {
        if !vb.contains_tensor(SCALE_NAME) {
            return Ok(None);
        }
        let name = vb.prefix();
        let q = vb.get_with_hints_dtype((n, k), "weight", Default::default(), DType::F8E4M3)?;
        let (sr, sc) = weight_scale_dims(n, k, FP8_BLOCK);
        let scale = vb
            .get_with_hints_dtype((sr, sc), SCALE_NAME, Default::default(), DType::F32)
            .map_err(|e| {
                Error::invalid(
                    "fp8 weight",
                    format!("{name}.{SCALE_NAME}"),
                    format!("must be F32 [{sr}, {sc}] for the [{n}, {k}] weight: {e}"),
                )
            })?;
        Self::new(&name, q, scale).map(Some)
    }

    /// `(n, k)`.
    pub fn dims(&self) -> (usize, usize) {
        let d = self.q.dims();
        (d[0], d[1])
    }

    /// The e4m3 values `[n, k]`.
    pub fn q(&self) -> &Tensor {
        &self.q
    }

    /// The scales `[ceil(n / 128), ceil(k / 128)]`.
    pub fn scale(&self) -> &Tensor {
        &self.scale
    }

    /// The weight in `dtype` on its device: `f32(q) * scale` per block, rounded once to
    /// `dtype` (exact in f32), as DeepSeek's `weight_dequant`. On the CPU the host twin
    /// (`ep_kernels::gemm::fp8::dequantize_weight`); on CUDA the device kernel (bf16, the same
    /// numbers), converted to `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let (n, k) = self.dims();
        match self.q.device() {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => {
                use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
                let stream = dev.cuda_stream();
                let q = self.q.contiguous()?;
                let scale = self.scale.contiguous()?;
                let mut out = alloc_uninit::<half::bf16>(&stream, (n * k).max(1))?;
                {
                    let q_d = DeviceTensor::new("weight", &q)?;
                    let s_d = DeviceTensor::new("weight_scale_inv", &scale)?;
                    ep_kernels::gemm::fp8::dequantize_weight_cuda(
                        &stream,
                        &q_d.view::<F8E4M3>()?,
                        &s_d.view::<f32>()?,
                        n,
                        k,
                        FP8_BLOCK,
                        &mut out.slice_mut(0..n * k),
                    )?;
                }
                Ok(wrap(out, (n, k), dev).narrow(0, 0, n)?.to_dtype(dtype)?)
            }
            device => {
                let q: Vec<F8E4M3> = self.q.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?;
                let s: Vec<f32> = self
                    .scale
                    .to_device(&Device::Cpu)?
                    .flatten_all()?
                    .to_vec1()?;
                let w = ep_kernels::gemm::fp8::dequantize_weight(&q, &s, n, k, FP8_BLOCK)?;
                Ok(Tensor::from_vec(w, (n, k), &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_device(device)?)
            }
        }
    }
}

/// The linear weight `[n, k]` at `prefix` of `vb` (`{prefix}.weight`) in `vb`'s dtype: as
/// stored, or dequantized from e4m3 with its `weight_scale_inv` when the checkpoint has one
/// ([`Fp8Weight::dequantize`]). Never the e4m3 values without their scales.
pub fn load_weight(vb: &VarBuilder, n: usize, k: usize) -> Result<Tensor> {
    match Fp8Weight::load(vb, n, k)? {
        Some(w) => w.dequantize(vb.dtype()),
        None => Ok(vb.get((n, k), "weight")?),
    }
}
