//! [`HeadMaps`]: one linear map per attention head, applied to rows laid out
//! `[tokens, heads, width]` and written in the same token-major layout (MLA's absorbed
//! `kv_b_proj`: `q_nope · W_UK` into the latent space, the latent output `· W_UV^T` back to
//! values). On CUDA in bf16 one strided batched GEMM reads each head's slice of the rows in
//! place and writes `[tokens, heads, n]` directly (`ep_kernels::attention::per_head_gemm_bf16_cuda`),
//! where the same product as candle matmuls copies the rows head-major and the result back
//! (`docs/design.md`, "MLA attention"). Elsewhere, candle's batched matmul.

use candle_core::Tensor;
#[cfg(feature = "cuda")]
use ep_kernels::attention::PerHeadShape;

use crate::error::{Error, Result};

/// `heads` linear maps `[k, n]`: `y[t, g, :] = x[t, g, first .. first + k] · w[g]`.
#[derive(Clone, Debug)]
pub struct HeadMaps {
    w: Tensor,
}

impl HeadMaps {
    /// The maps of `w` (`[heads, k, n]`, made contiguous).
    pub fn new(w: Tensor) -> Result<Self> {
        if w.rank() != 3 || w.dims().contains(&0) {
            return Err(Error::invalid(
                "head maps",
                format!("{:?}", w.dims()),
                "must be [heads, k, n], none of them 0",
            ));
        }
        Ok(Self { w: w.contiguous()? })
    }

    /// The weights `[heads, k, n]`.
    pub fn weight(&self) -> &Tensor {
        &self.w
    }

    /// `y[t, g, :] = x[t, g, first .. first + k] · w[g]` for `x` `[tokens, heads, width]` with
    /// `first + k <= width`: `[tokens, heads, n]`, contiguous.
    pub fn forward(&self, x: &Tensor, first: usize) -> Result<Tensor> {
        let (heads, k, n) = self.w.dims3()?;
        let (_, x_heads, width) = x.dims3().map_err(|_| {
            Error::invalid(
                "head maps input",
                format!("{:?}", x.dims()),
                "must be [tokens, heads, width]",
            )
        })?;
        if x_heads != heads || first + k > width || x.dtype() != self.w.dtype() {
            return Err(Error::invalid(
                "head maps input",
                format!("{:?} {:?} from value {first}", x.dtype(), x.dims()),
                format!(
                    "must be {:?} [tokens, {heads}, >= {first} + {k}] for maps [{heads}, {k}, {n}]",
                    self.w.dtype()
                ),
            ));
        }
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = x.device() {
            if x.dtype() == candle_core::DType::BF16 {
                let shape = PerHeadShape {
                    tokens: x.dim(0)?,
                    heads,
                    x_width: width,
                    first,
                    k,
                    n,
                };
                return self.forward_cuda(dev, &x.contiguous()?, shape);
            }
        }
        let rows = x.narrow(2, first, k)?.transpose(0, 1)?.contiguous()?;
        Ok(rows.matmul(&self.w)?.transpose(0, 1)?.contiguous()?)
    }

    /// [`HeadMaps::forward`] on cuBLAS, on candle's stream and handle.
    #[cfg(feature = "cuda")]
    fn forward_cuda(
        &self,
        dev: &candle_core::cuda_backend::CudaDevice,
        x: &Tensor,
        shape: PerHeadShape,
    ) -> Result<Tensor> {
        use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
        use half::bf16;
        let stream = dev.cuda_stream();
        let blas = dev.cublas_handle();
        let len = shape.tokens * shape.heads * shape.n;
        let mut y = alloc_uninit::<bf16>(&stream, len.max(1))?;
        {
            let x_d = DeviceTensor::new("x", x)?;
            let w_d = DeviceTensor::new("weight", &self.w)?;
            ep_kernels::attention::per_head_gemm_bf16_cuda(
                &stream,
                &blas,
                &x_d.view::<bf16>()?,
                &w_d.view::<bf16>()?,
                shape,
                &mut y.slice_mut(0..len),
            )?;
        }
        let y = wrap(y, (len.max(1),), dev);
        Ok(y.narrow(0, 0, len)?
            .reshape((shape.tokens, shape.heads, shape.n))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn equals_per_head_matmuls_on_the_slices() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (5, 3, 7), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (3, 4, 6), &dev).unwrap();
        let maps = HeadMaps::new(w.clone()).unwrap();
        let y = maps.forward(&x, 2).unwrap();
        assert_eq!(y.dims(), &[5, 3, 6]);
        for g in 0..3 {
            let want = x
                .narrow(1, g, 1)
                .unwrap()
                .squeeze(1)
                .unwrap()
                .narrow(1, 2, 4)
                .unwrap();
            let want = want.matmul(&w.get(g).unwrap()).unwrap();
            let got = y.narrow(1, g, 1).unwrap().squeeze(1).unwrap();
            let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap();
            assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
        }
    }

    #[test]
    fn refuses_a_slice_past_the_head() {
        let dev = Device::Cpu;
        let maps = HeadMaps::new(Tensor::zeros((3, 4, 6), DType::F32, &dev).unwrap()).unwrap();
        let x = Tensor::zeros((5, 3, 7), DType::F32, &dev).unwrap();
        let err = maps.forward(&x, 4).unwrap_err().to_string();
        assert!(err.contains("[tokens, 3, >= 4 + 4]"), "{err}");
    }
}
