//! Next-token selection: greedy (temperature 0) or temperature plus nucleus (top-p) sampling
//! from a seeded generator, so a given seed always gives the same text.

use anyhow::Result;
use candle_core::{DType, Tensor, D};
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

/// Runs a row of `vocab` logits is cut into for [`greedy_ids`]: the most, up to 256, that divide
/// it (1: no split).
fn argmax_runs(vocab: usize) -> usize {
    (1..=256).rev().find(|r| vocab % r == 0).unwrap_or(1)
}

/// The index of a largest logit of each row of `logits` `[B, V]`, computed where the logits
/// are; only the ids come back. On a GPU in two passes over `runs` runs of each row (the
/// largest value and its place in every run, then the run holding the row's largest): candle's
/// argmax gives each row one block, which a 129280-token vocabulary makes the longest kernel
/// of a one-sequence decode step after the weight reads (docs/benchmarks.md, "Serving"). On
/// the CPU candle's argmax, as before.
pub fn greedy_ids(logits: &Tensor) -> Result<Vec<u32>> {
    let runs = argmax_runs(logits.dims2()?.1);
    if !logits.device().is_cuda() || runs == 1 {
        return Ok(logits.argmax(D::Minus1)?.to_vec1()?);
    }
    argmax_in_runs(logits, runs)
}

/// [`greedy_ids`] in two passes over `runs` runs of each row (`runs` divides the row).
fn argmax_in_runs(logits: &Tensor, runs: usize) -> Result<Vec<u32>> {
    let (b, v) = logits.dims2()?;
    let len = v / runs;
    let split = logits.reshape((b, runs, len))?;
    // A run's largest value and where in the run it is (both passes compare alike, so the
    // place holds the value).
    let best = split.max(D::Minus1)?;
    let place = split.argmax(D::Minus1)?;
    let run = best.argmax_keepdim(D::Minus1)?;
    let within = place.gather(&run, D::Minus1)?;
    let both: Vec<Vec<u32>> = Tensor::cat(&[&run, &within], 1)?
        .to_dtype(DType::U32)?
        .to_vec2()?;
    Ok(both.iter().map(|p| p[0] * len as u32 + p[1]).collect())
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
    fn the_two_pass_argmax_finds_every_rows_largest_logit() -> Result<()> {
        use candle_core::Device;
        assert_eq!(argmax_runs(129280), 256);
        assert_eq!(argmax_runs(102400), 256);
        assert_eq!(argmax_runs(251), 251);
        assert_eq!(argmax_runs(257), 1);
        let (b, v) = (5, 129280);
        let logits = Tensor::randn(0f32, 1.0, (b, v), &Device::Cpu)?;
        // The largest logit of some rows in the first and last places of the row and of a run.
        let mut rows: Vec<Vec<f32>> = logits.to_vec2()?;
        for (row, at) in rows.iter_mut().zip([0, v - 1, 504, 505, 77_777]) {
            row[at] = 100.0;
        }
        let logits = Tensor::new(rows.clone(), &Device::Cpu)?;
        let want: Vec<u32> = rows.iter().map(|r| argmax(r)).collect();
        assert_eq!(want, [0, v as u32 - 1, 504, 505, 77_777]);
        assert_eq!(argmax_in_runs(&logits, argmax_runs(v))?, want);
        // Ties: an index holding the largest value.
        let tied = Tensor::new(&[[1f32, 3.0, 3.0, 0.0, 3.0, 2.0]], &Device::Cpu)?;
        let got = argmax_in_runs(&tied, 3)?[0];
        assert!([1, 2, 4].contains(&got), "{got}");
        Ok(())
    }

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
