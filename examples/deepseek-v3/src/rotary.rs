//! Decoupled rotary position embedding of MLA (interleaved pairs, as in DeepSeek-V3's
//! checkpoints) with optional YaRN scaling, and MLA's softmax scale.

use candle_core::{DType, Device, Result, Tensor};

use crate::config::{DeepSeekV3Config, RopeScaling};

fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The cos/sin tables of the rotary part of queries and keys (interleaved pairs, as in
/// DeepSeek-V3's checkpoints), with optional YaRN scaling.
#[derive(Clone, Debug)]
pub struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    /// Tables for positions `0..max_positions`.
    pub fn new(
        cfg: &DeepSeekV3Config,
        max_positions: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        let dim = cfg.qk_rope_head_dim;
        let base = cfg.rope_theta;
        let plain: Vec<f64> = (0..dim / 2)
            .map(|i| 1.0 / base.powf(2.0 * i as f64 / dim as f64))
            .collect();
        let (inv_freq, mag) = match &cfg.rope_scaling {
            None => (plain, 1.0),
            Some(rs) => yarn_frequencies(rs, &plain, dim, base),
        };
        let mut cos = Vec::with_capacity(max_positions * dim / 2);
        let mut sin = Vec::with_capacity(max_positions * dim / 2);
        for p in 0..max_positions {
            for f in &inv_freq {
                let angle = p as f64 * f;
                cos.push((angle.cos() * mag) as f32);
                sin.push((angle.sin() * mag) as f32);
            }
        }
        let cos = Tensor::from_vec(cos, (max_positions, dim / 2), dev)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (max_positions, dim / 2), dev)?.to_dtype(dtype)?;
        Ok(Self { cos, sin })
    }

    /// Number of positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The cos and sin rows of `positions` (`u32`, one per token), `[positions.len(), rope_dim / 2]`,
    /// for [`Rotary::apply`]. A batch gathers them once per step and reuses them in every layer.
    pub fn rows(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((
            self.cos.index_select(positions, 0)?,
            self.sin.index_select(positions, 0)?,
        ))
    }

    /// Rotates `x` of shape `[1, heads, t, rope_dim]` by the rows `cos`, `sin` of
    /// [`Rotary::rows`] (token `i` by the angle of its own position).
    pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        candle_nn::rotary_emb::rope_i(&x.contiguous()?, cos, sin)
    }
}

/// YaRN: frequencies blended between interpolated and original by a linear ramp over the
/// dimensions, and the magnitude correction applied to cos/sin.
fn yarn_frequencies(rs: &RopeScaling, plain: &[f64], dim: usize, base: f64) -> (Vec<f64>, f64) {
    let max_pos = rs.original_max_position_embeddings as f64;
    let correction_dim = |rotations: f64| {
        dim as f64 * (max_pos / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let low = correction_dim(rs.beta_fast).floor().max(0.0);
    let high = correction_dim(rs.beta_slow).ceil().min(dim as f64 - 1.0);
    let high = if high == low { high + 0.001 } else { high };
    let inv_freq = plain
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            (f / rs.factor) * (1.0 - keep) + f * keep
        })
        .collect();
    let mag = yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim);
    (inv_freq, mag)
}

/// The softmax scale of MLA: `q_head_dim^-1/2`, times YaRN's `mscale_all_dim` correction squared.
pub fn softmax_scale(cfg: &DeepSeekV3Config) -> f64 {
    let mut scale = 1.0 / (cfg.q_head_dim() as f64).sqrt();
    if let Some(rs) = &cfg.rope_scaling {
        if rs.mscale_all_dim != 0.0 {
            let m = yarn_mscale(rs.factor, rs.mscale_all_dim);
            scale *= m * m;
        }
    }
    scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yarn_softmax_scale_follows_mscale_all_dim() {
        let mut cfg = DeepSeekV3Config::tiny();
        let plain = softmax_scale(&cfg);
        assert!((plain - 1.0 / (cfg.q_head_dim() as f64).sqrt()).abs() < 1e-12);
        cfg.rope_scaling = Some(RopeScaling {
            kind: "yarn".into(),
            factor: 40.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        });
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((softmax_scale(&cfg) - plain * m * m).abs() < 1e-12);
    }

    #[test]
    fn yarn_keeps_fast_dims_and_interpolates_slow_ones() {
        let dim = 64;
        let plain: Vec<f64> = (0..dim / 2)
            .map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / dim as f64))
            .collect();
        let rs = RopeScaling {
            kind: "yarn".into(),
            factor: 40.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        };
        let (f, mag) = yarn_frequencies(&rs, &plain, dim, 10000.0);
        assert!(
            (f[0] - plain[0]).abs() < 1e-12,
            "highest frequency must be kept"
        );
        let last = dim / 2 - 1;
        assert!(
            (f[last] - plain[last] / 40.0).abs() < 1e-15,
            "lowest must be divided by factor"
        );
        assert!(
            (mag - 1.0).abs() < 1e-12,
            "mscale == mscale_all_dim cancels"
        );
    }
}
