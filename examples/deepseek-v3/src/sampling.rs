//! Next-token selection: greedy (temperature 0) or temperature plus nucleus (top-p) sampling
//! from a seeded generator, so a given seed always gives the same text.

use anyhow::Result;
use candle_core::{Tensor, D};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// How one sequence picks its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Nucleus mass in `(0, 1]`: sample among the most likely tokens whose probabilities sum
    /// to at least `top_p`.
    pub top_p: f32,
    /// Seed of the sequence's random generator.
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A sequence's sampler: its parameters and random state.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Index of the largest value (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The index of a largest logit of each row of `logits` `[B, V]` (the first on ties), computed
/// where the logits are; only the ids come back. On a GPU, f32 or bf16 logits go to one kernel
/// (`ep_kernels::sampling`; bf16 as the model leaves them, without a cast): candle's reductions
/// index every element through its strides, and its argmax gives a 129280-token row one
/// block, the longest kernels of a decode step after the weight reads (`docs/design.md`,
/// "Greedy sampling"). Elsewhere candle's argmax.
pub fn greedy_ids(logits: &Tensor) -> Result<Vec<u32>> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = logits.device() {
        if matches!(
            logits.dtype(),
            candle_core::DType::F32 | candle_core::DType::BF16
        ) {
            return greedy_ids_cuda(dev, logits);
        }
    }
    Ok(logits.argmax(D::Minus1)?.to_vec1()?)
}

/// [`greedy_ids`] on the argmax kernel, on candle's stream: one key a row comes back.
#[cfg(feature = "cuda")]
fn greedy_ids_cuda(
    dev: &candle_core::cuda_backend::CudaDevice,
    logits: &Tensor,
) -> Result<Vec<u32>> {
    use moe_layer::ep_kernels::sampling;
    use moe_layer::ep_runtime::device_tensor::{alloc_uninit, DeviceTensor};
    let (rows, vocab) = logits.dims2()?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    let logits = logits.contiguous()?;
    let stream = dev.cuda_stream();
    // Zeroed by the launcher, on the stream.
    let mut keys = alloc_uninit::<u64>(&stream, rows)?;
    {
        let l = DeviceTensor::new("logits", &logits)?;
        if logits.dtype() == candle_core::DType::BF16 {
            let v = l.view::<half::bf16>()?;
            sampling::argmax_rows_bf16_cuda(&stream, &v, rows, vocab, &mut keys)?;
        } else {
            sampling::argmax_rows_f32_cuda(&stream, &l.view::<f32>()?, rows, vocab, &mut keys)?;
        }
    }
    let keys = stream.clone_dtoh(&keys)?;
    Ok(keys.into_iter().map(sampling::key_index).collect())
}

impl Sampler {
    /// A sampler seeded with `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Self {
            rng: StdRng::seed_from_u64(params.seed),
            params,
        }
    }

    /// Whether this sampler always takes the argmax (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0
    }

    /// Picks the next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let t = self.params.temperature;
        if t <= 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) / t).exp()))
            .collect();
        let sum: f32 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= sum);
        if self.params.top_p >= 1.0 {
            // The whole distribution: no need to sort a large vocabulary.
            let r: f32 = self.rng.random::<f32>();
            let mut acc = 0.0;
            for p in &probs {
                acc += p.1;
                if r < acc {
                    return p.0;
                }
            }
            return probs.last().map_or(0, |p| p.0);
        }
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let top_p = self.params.top_p.clamp(f32::MIN_POSITIVE, 1.0);
        let mut kept = 0;
        let mut mass = 0.0;
        for p in &probs {
            kept += 1;
            mass += p.1;
            if mass >= top_p {
                break;
            }
        }
        let r: f32 = self.rng.random::<f32>() * mass;
        let mut acc = 0.0;
        for p in &probs[..kept] {
            acc += p.1;
            if r < acc {
                return p.0;
            }
        }
        probs[kept - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0]), 1);
    }

    #[test]
    fn tiny_top_p_is_greedy_and_seed_repeats() {
        let logits = [0.5, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            seed: 3,
        });
        assert_eq!(s.sample(&logits), 1);
        let params = SamplingParams {
            temperature: 1.5,
            top_p: 0.9,
            seed: 7,
        };
        let (mut a, mut b) = (Sampler::new(params), Sampler::new(params));
        let xs: Vec<u32> = (0..32).map(|_| a.sample(&logits)).collect();
        let ys: Vec<u32> = (0..32).map(|_| b.sample(&logits)).collect();
        assert_eq!(xs, ys);
        assert!(
            xs.iter().any(|&x| x != xs[0]),
            "sampling never varied: {xs:?}"
        );
    }
}
