//! Decoupled rotary position embedding of MLA (interleaved pairs, as in DeepSeek-V3's
//! checkpoints, or halves with `rope_interleave: false`) with optional YaRN scaling, and MLA's
//! softmax scale.

use candle_core::{DType, Device, Result, Tensor};

use crate::config::{DeepSeekV3Config, RopeScaling};

fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The cos/sin tables of the rotary part of queries and keys, with optional YaRN scaling.
///
/// Pair `i` of a `d`-wide rotary part is `(x[2i], x[2i + 1])` with `rope_interleave` (DeepSeek's
/// checkpoints) and `(x[i], x[i + d/2])` without; both rotate by the angle `position * f_i`.
#[derive(Clone, Debug)]
pub struct Rotary {
    cos: Tensor,
    sin: Tensor,
    interleave: bool,
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
        Ok(Self {
            cos,
            sin,
            interleave: cfg.rope_interleave,
        })
    }

    /// Number of positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The cos and sin rows of `positions` (`u32`, one per token), `[positions.len(),
    /// rope_dim / 2]`. A batch gathers them once per step and reuses them in every layer.
    pub fn rows(&self, positions: &Tensor) -> Result<RopeRows> {
        Ok(RopeRows {
            cos: self.cos.index_select(positions, 0)?,
            sin: self.sin.index_select(positions, 0)?,
            interleave: self.interleave,
        })
    }
}

/// The rotary rows of a batch's tokens ([`Rotary::rows`]) and the pairing they rotate.
#[derive(Clone, Debug)]
pub struct RopeRows {
    cos: Tensor,
    sin: Tensor,
    interleave: bool,
}

impl RopeRows {
    /// Rotates `x` of shape `[1, heads, t, rope_dim]` (token `i` by the angle of its own
    /// position).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        if self.interleave {
            candle_nn::rotary_emb::rope_i(&x, &self.cos, &self.sin)
        } else {
            candle_nn::rotary_emb::rope(&x, &self.cos, &self.sin)
        }
    }

    /// The `dim` rope columns from `first` of each head's block of `x` (`[t, heads, width]`,
    /// token `i` by the angle of its own position), rotated: `[t, heads, dim]`. On CUDA in
    /// bf16 one kernel reads them where they lie (`ep_kernels::attention::rope_rows`: candle's
    /// strided copy of the columns took longer than the rotation, `docs/design.md`, "MLA
    /// attention"); elsewhere [`RopeRows::apply_token_major`] on the columns. The kernel spells
    /// the rotation in bf16 operations as candle's CUDA rope kernels do, and gave the model the
    /// same logits.
    pub fn apply_columns(&self, x: &Tensor, first: usize, dim: usize) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = x.device() {
            if x.dtype() == DType::BF16 && self.cos.dtype() == DType::BF16 && x.dim(0)? > 0 {
                return self.apply_columns_cuda(dev, x, first, dim);
            }
        }
        self.apply_token_major(&x.narrow(2, first, dim)?)
    }

    /// [`RopeRows::apply_columns`] on the rope kernel.
    #[cfg(feature = "cuda")]
    fn apply_columns_cuda(
        &self,
        dev: &candle_core::cuda_backend::CudaDevice,
        x: &Tensor,
        first: usize,
        dim: usize,
    ) -> Result<Tensor> {
        use candle_core::Error as E;
        use half::bf16;
        use moe_layer::ep_kernels::attention::{rope_bf16_cuda, RopeShape};
        use moe_layer::ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
        let (t, heads, width) = x.dims3()?;
        let shape = RopeShape {
            tokens: t,
            heads,
            x_width: width,
            first,
            dim,
            interleave: self.interleave,
        };
        let stream = dev.cuda_stream();
        let (x, cos, sin) = (
            x.contiguous()?,
            self.cos.contiguous()?,
            self.sin.contiguous()?,
        );
        let mut out = alloc_uninit::<bf16>(&stream, t * heads * dim).map_err(E::wrap)?;
        {
            let (x_d, cos_d, sin_d) = (
                DeviceTensor::new("x", &x).map_err(E::wrap)?,
                DeviceTensor::new("cos", &cos).map_err(E::wrap)?,
                DeviceTensor::new("sin", &sin).map_err(E::wrap)?,
            );
            let (x_v, cos_v, sin_v) = (
                x_d.view::<bf16>().map_err(E::wrap)?,
                cos_d.view::<bf16>().map_err(E::wrap)?,
                sin_d.view::<bf16>().map_err(E::wrap)?,
            );
            rope_bf16_cuda(&stream, &x_v, &cos_v, &sin_v, shape, &mut out).map_err(E::wrap)?;
        }
        Ok(wrap(out, (t, heads, dim), dev))
    }

    /// Rotates `x` of shape `[t, heads, rope_dim]` (token `i` by the angle of its own position)
    /// where it lies, token-major: each token is a batch of one position whose cos and sin
    /// rows are its own, so no transposing copy goes in or out (the same values as
    /// [`RopeRows::apply`] on the transposed rows).
    pub fn apply_token_major(&self, x: &Tensor) -> Result<Tensor> {
        let (t, heads, d) = x.dims3()?;
        let x = x.contiguous()?.reshape((t, heads, 1, d))?;
        let (cos, sin) = (self.cos.unsqueeze(1)?, self.sin.unsqueeze(1)?);
        let y = if self.interleave {
            candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?
        } else {
            candle_nn::rotary_emb::rope(&x, &cos, &sin)?
        };
        y.reshape((t, heads, d))
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

    /// `RopeRows::apply_token_major` on `[t, heads, d]` equals `RopeRows::apply` on the same
    /// rows transposed to `[1, heads, t, d]`, bit for bit, for both pairings; a strided input
    /// (the query's rope columns) is read where it lies.
    #[test]
    fn token_major_rotation_equals_the_head_major_one() {
        let dev = Device::Cpu;
        for interleave in [true, false] {
            let mut cfg = DeepSeekV3Config::tiny();
            cfg.rope_interleave = interleave;
            let d = cfg.qk_rope_head_dim;
            let rotary = Rotary::new(&cfg, 32, DType::F32, &dev).unwrap();
            let positions = [5u32, 0, 17, 31];
            let (t, heads, nope) = (positions.len(), 3, 4);
            let q = Tensor::randn(0f32, 1.0, (t, heads, nope + d), &dev).unwrap();
            let x = q.narrow(2, nope, d).unwrap();
            let rows = rotary
                .rows(&Tensor::new(&positions[..], &dev).unwrap())
                .unwrap();
            let got = rows.apply_token_major(&x).unwrap();
            let want = rows
                .apply(&x.transpose(0, 1).unwrap().unsqueeze(0).unwrap())
                .unwrap()
                .squeeze(0)
                .unwrap()
                .transpose(0, 1)
                .unwrap();
            assert_eq!(got.dims(), [t, heads, d]);
            let (g, w): (Vec<f32>, Vec<f32>) = (
                got.flatten_all().unwrap().to_vec1().unwrap(),
                want.flatten_all().unwrap().to_vec1().unwrap(),
            );
            assert_eq!(g, w, "interleave {interleave}");
        }
    }

    /// `Rotary::apply` against the rotation written out pair by pair, for both pairings.
    #[test]
    fn both_pairings_rotate_like_the_formula() {
        let dev = Device::Cpu;
        for interleave in [true, false] {
            let mut cfg = DeepSeekV3Config::tiny();
            cfg.rope_interleave = interleave;
            let d = cfg.qk_rope_head_dim;
            let rotary = Rotary::new(&cfg, 16, DType::F32, &dev).unwrap();
            let positions = [3u32, 0, 11];
            let (heads, t) = (2, positions.len());
            let x: Vec<f32> = (0..heads * t * d)
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            let xt = Tensor::from_vec(x.clone(), (1, heads, t, d), &dev).unwrap();
            let rows = rotary
                .rows(&Tensor::new(&positions[..], &dev).unwrap())
                .unwrap();
            let got: Vec<f32> = rows
                .apply(&xt)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            for h in 0..heads {
                for (j, &p) in positions.iter().enumerate() {
                    let row = (h * t + j) * d;
                    for i in 0..d / 2 {
                        let (a, b) = if interleave {
                            (row + 2 * i, row + 2 * i + 1)
                        } else {
                            (row + i, row + i + d / 2)
                        };
                        let f = 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / d as f64);
                        let (s, c) = (p as f64 * f).sin_cos();
                        let (xa, xb) = (x[a] as f64, x[b] as f64);
                        let want = [xa * c - xb * s, xa * s + xb * c];
                        for (k, w) in [a, b].into_iter().zip(want) {
                            assert!(
                                (got[k] as f64 - w).abs() < 1e-5,
                                "interleave {interleave}, head {h}, position {p}, pair {i}"
                            );
                        }
                    }
                }
            }
        }
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
