//! [`scores_softmax`]: MLA's attention probabilities from its two score products.

use candle_core::Tensor;

use crate::error::{Error, Result};

/// `softmax((latent + rope) * scale + mask)` over the keys: `latent` and `rope` the scores
/// `[seqs, queries, heads, len]` of the latent and rope parts of the queries (token-major),
/// `mask` the additive `[seqs, queries, 1, len]` mask every head of a query shares. On CUDA in
/// bf16 one kernel computes it in f32 with one rounding
/// (`ep_kernels::attention::scores_softmax_bf16_cuda`); elsewhere candle's ops in the
/// tensors' dtype. Returns `[seqs, queries, heads, len]`.
pub fn scores_softmax(latent: &Tensor, rope: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let (seqs, queries, _, len) = latent.dims4().map_err(|_| {
        Error::invalid(
            "latent scores",
            format!("{:?}", latent.dims()),
            "must be [seqs, queries, heads, len]",
        )
    })?;
    let dtype = latent.dtype();
    if rope.dims() != latent.dims() || rope.dtype() != dtype {
        return Err(Error::invalid(
            "rope scores",
            format!("{:?} {:?}", rope.dtype(), rope.dims()),
            format!(
                "must be {dtype:?} {:?}, as the latent scores",
                latent.dims()
            ),
        ));
    }
    if mask.dims() != [seqs, queries, 1, len] || mask.dtype() != dtype {
        return Err(Error::invalid(
            "mask",
            format!("{:?} {:?}", mask.dtype(), mask.dims()),
            format!("must be {dtype:?} [{seqs}, {queries}, 1, {len}]"),
        ));
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = latent.device() {
        if dtype == candle_core::DType::BF16 && seqs > 0 {
            let shape = ep_kernels::attention::ScoresShape {
                seqs,
                heads: latent.dim(2)?,
                queries,
                len,
            };
            return softmax_cuda(dev, [latent, rope, mask], scale, shape);
        }
    }
    let scores = ((latent + rope)? * scale)?.broadcast_add(mask)?;
    Ok(candle_nn::ops::softmax_last_dim(&scores)?)
}

/// [`scores_softmax`] on the kernel, on candle's stream.
#[cfg(feature = "cuda")]
fn softmax_cuda(
    dev: &candle_core::cuda_backend::CudaDevice,
    [latent, rope, mask]: [&Tensor; 3],
    scale: f64,
    shape: ep_kernels::attention::ScoresShape,
) -> Result<Tensor> {
    use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
    use half::bf16;
    let stream = dev.cuda_stream();
    let (latent, rope, mask) = (latent.contiguous()?, rope.contiguous()?, mask.contiguous()?);
    let elems = shape.rows() * shape.len;
    let mut probs = alloc_uninit::<bf16>(&stream, elems)?;
    {
        let l = DeviceTensor::new("latent scores", &latent)?;
        let r = DeviceTensor::new("rope scores", &rope)?;
        let m = DeviceTensor::new("mask", &mask)?;
        ep_kernels::attention::scores_softmax_bf16_cuda(
            &stream,
            &l.view::<bf16>()?,
            &r.view::<bf16>()?,
            &m.view::<bf16>()?,
            scale as f32,
            shape,
            &mut probs.slice_mut(0..elems),
        )?;
    }
    let dims = (shape.seqs, shape.queries, shape.heads, shape.len);
    Ok(wrap(probs, dims, dev))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn refuses_a_mask_per_head() {
        let dev = Device::Cpu;
        let s = Tensor::zeros((2, 1, 3, 4), DType::F32, &dev).unwrap();
        let err = scores_softmax(&s, &s, &s, 1.0).unwrap_err().to_string();
        assert!(err.contains("must be F32 [2, 1, 1, 4]"), "{err}");
    }

    #[test]
    fn masked_keys_get_nothing() {
        let dev = Device::Cpu;
        let latent = Tensor::new(&[[[[1f32, 2.0, 7.0]]]], &dev).unwrap();
        let rope = Tensor::new(&[[[[1f32, 0.0, 0.0]]]], &dev).unwrap();
        let mask = Tensor::new(&[[[[0f32, 0.0, -1e9]]]], &dev).unwrap();
        let p: Vec<f32> = scores_softmax(&latent, &rope, &mask, 0.5)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(p, [0.5, 0.5, 0.0]);
    }
}
