//! The DeepSeek-V3 model: multi-head latent attention (MLA) with decoupled RoPE and a per-sequence
//! KV cache, RMSNorm, dense SwiGLU layers, then expert-parallel MoE layers.
//!
//! One forward call runs a batch of sequences of any lengths (prefill and decode alike): the
//! tokens of all sequences are concatenated, attention runs per sequence against its own cache
//! (data-parallel attention), and each MoE layer is called once with all of this rank's tokens
//! (a collective across ranks, even with zero tokens).

use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder};
use moe_layer::dense::DenseMoe;
use moe_layer::experts::Mlp;

use crate::config::{DeepSeekV3Config, RopeScaling};

/// Which kind of step a forward call belongs to; every rank uses the same kind in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StepKind {
    /// Prompt processing: many tokens per sequence; MoE layers use the normal (throughput) mode.
    Prefill,
    /// One token per sequence; MoE layers use the low-latency mode.
    Decode,
}

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

    /// Rotates `x` of shape `[b, heads, t, rope_dim]` for positions `offset..offset + t`.
    pub fn apply(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        let t = x.dim(2)?;
        if offset + t > self.max_positions() {
            candle_core::bail!(
                "position {} is beyond the longest supported context {}",
                offset + t,
                self.max_positions()
            );
        }
        let cos = self.cos.narrow(0, offset, t)?;
        let sin = self.sin.narrow(0, offset, t)?;
        candle_nn::rotary_emb::rope_i(&x.contiguous()?, &cos, &sin)
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

/// One sequence's cached keys `[heads, len, q_head_dim]` and values `[heads, len, v_head_dim]`
/// for one layer.
#[derive(Clone, Debug, Default)]
pub struct LayerCache {
    kv: Option<(Tensor, Tensor)>,
}

impl LayerCache {
    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.dims()[1])
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn append(&mut self, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = match self.kv.take() {
            None => (k, v),
            Some((ck, cv)) => (Tensor::cat(&[&ck, &k], 1)?, Tensor::cat(&[&cv, &v], 1)?),
        };
        self.kv = Some((k.clone(), v.clone()));
        Ok((k, v))
    }
}

/// The KV cache of one sequence: one [`LayerCache`] per layer.
#[derive(Clone, Debug)]
pub struct SeqCache {
    layers: Vec<LayerCache>,
}

impl SeqCache {
    /// An empty cache for a model of `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![LayerCache::default(); num_layers],
        }
    }

    /// Number of positions already processed.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    /// Whether no position was processed yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Clone, Debug)]
enum QProj {
    Full(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

/// Multi-head latent attention.
#[derive(Clone, Debug)]
pub struct Attention {
    q: QProj,
    kv_a: Linear,
    kv_a_norm: RmsNorm,
    kv_b: Linear,
    o: Linear,
    heads: usize,
    nope: usize,
    rope: usize,
    v_dim: usize,
    kv_rank: usize,
    scale: f64,
    rotary: Arc<Rotary>,
}

impl Attention {
    /// Loads `self_attn` of a layer (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`,
    /// `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`).
    pub fn load(vb: VarBuilder, cfg: &DeepSeekV3Config, rotary: Arc<Rotary>) -> Result<Self> {
        let h = cfg.hidden_size;
        let heads = cfg.num_attention_heads;
        let qd = cfg.q_head_dim();
        let bias = cfg.attention_bias;
        let q = match cfg.q_lora_rank {
            None => QProj::Full(candle_nn::linear_no_bias(h, heads * qd, vb.pp("q_proj"))?),
            Some(r) => QProj::LowRank {
                a: candle_nn::linear_b(h, r, bias, vb.pp("q_a_proj"))?,
                norm: candle_nn::rms_norm(r, cfg.rms_norm_eps, vb.pp("q_a_layernorm"))?,
                b: candle_nn::linear_no_bias(r, heads * qd, vb.pp("q_b_proj"))?,
            },
        };
        let kv_rank = cfg.kv_lora_rank;
        Ok(Self {
            q,
            kv_a: candle_nn::linear_b(
                h,
                kv_rank + cfg.qk_rope_head_dim,
                bias,
                vb.pp("kv_a_proj_with_mqa"),
            )?,
            kv_a_norm: candle_nn::rms_norm(kv_rank, cfg.rms_norm_eps, vb.pp("kv_a_layernorm"))?,
            kv_b: candle_nn::linear_no_bias(
                kv_rank,
                heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                vb.pp("kv_b_proj"),
            )?,
            o: candle_nn::linear_b(heads * cfg.v_head_dim, h, bias, vb.pp("o_proj"))?,
            heads,
            nope: cfg.qk_nope_head_dim,
            rope: cfg.qk_rope_head_dim,
            v_dim: cfg.v_head_dim,
            kv_rank,
            scale: softmax_scale(cfg),
            rotary,
        })
    }

    /// Attention of one sequence's new tokens `x: [t, hidden]` over its cache and themselves
    /// (causal); appends the new keys and values to `cache`.
    pub fn forward(&self, x: &Tensor, cache: &mut LayerCache) -> Result<Tensor> {
        let t = x.dim(0)?;
        let offset = cache.len();
        let (h, qd) = (self.heads, self.nope + self.rope);
        let q = match &self.q {
            QProj::Full(p) => p.forward(x)?,
            QProj::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(x)?)?)?,
        };
        let q = q.reshape((t, h, qd))?.transpose(0, 1)?; // [h, t, qd]
        let q_nope = q.narrow(2, 0, self.nope)?;
        let q_pe = q.narrow(2, self.nope, self.rope)?;

        let ckv = self.kv_a.forward(x)?; // [t, rank + rope]
        let latent = ckv.narrow(1, 0, self.kv_rank)?;
        let k_pe = ckv
            .narrow(1, self.kv_rank, self.rope)?
            .reshape((1, 1, t, self.rope))?;
        let kv = self.kv_b.forward(&self.kv_a_norm.forward(&latent)?)?;
        let kv = kv
            .reshape((t, h, self.nope + self.v_dim))?
            .transpose(0, 1)?; // [h, t, nope+v]
        let k_nope = kv.narrow(2, 0, self.nope)?;
        let v = kv.narrow(2, self.nope, self.v_dim)?.contiguous()?;

        let q_pe = self.rotary.apply(&q_pe.unsqueeze(0)?, offset)?.squeeze(0)?;
        let k_pe = self.rotary.apply(&k_pe, offset)?.squeeze(0)?; // [1, t, rope]
        let q = Tensor::cat(&[&q_nope, &q_pe], 2)?.contiguous()?;
        let k = Tensor::cat(&[&k_nope, &k_pe.broadcast_as((h, t, self.rope))?], 2)?.contiguous()?;
        let (k, v) = cache.append(k, v)?;
        let total = offset + t;

        let mut att = (q.matmul(&k.t()?)? * self.scale)?; // [h, t, total]
        if t > 1 {
            let mask: Vec<f32> = (0..t)
                .flat_map(|i| {
                    (0..total).map(move |j| {
                        if j > offset + i {
                            f32::NEG_INFINITY
                        } else {
                            0.0
                        }
                    })
                })
                .collect();
            let mask = Tensor::from_vec(mask, (t, total), x.device())?.to_dtype(att.dtype())?;
            att = att.broadcast_add(&mask)?;
        }
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let out = att.matmul(&v)?; // [h, t, v]
        let out = out.transpose(0, 1)?.reshape((t, h * self.v_dim))?;
        self.o.forward(&out)
    }
}

/// The feed-forward part of a layer.
#[derive(Debug)]
pub enum Ffn {
    /// Dense SwiGLU MLP of width `intermediate_size` (the first `first_k_dense_replace` layers).
    Dense(Mlp),
    /// Expert-parallel MoE layer: this rank's experts; every call is a collective.
    Moe(moe_layer::MoeLayer),
    /// All experts in this process (single-process reference path, no communication).
    DenseMoe(DenseMoe),
}

impl Ffn {
    /// Whether calling this layer involves the other ranks.
    pub fn is_collective(&self) -> bool {
        matches!(self, Ffn::Moe(_))
    }

    /// Runs the layer on `x: [T, hidden]` (`T` may be 0 for MoE layers).
    pub fn forward(&self, x: &Tensor, kind: StepKind) -> Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::Moe(m) => {
                let mode = match kind {
                    StepKind::Prefill => moe_layer::Mode::Normal,
                    StepKind::Decode => moe_layer::Mode::LowLatency,
                };
                m.forward_with_mode(x, mode)
            }
            Ffn::DenseMoe(m) => m.forward(x),
        }
    }
}

/// One decoder layer: pre-norm attention and pre-norm feed-forward, both residual.
#[derive(Debug)]
pub struct DecoderLayer {
    /// `input_layernorm`.
    pub input_norm: RmsNorm,
    /// `self_attn`.
    pub attn: Attention,
    /// `post_attention_layernorm`.
    pub post_norm: RmsNorm,
    /// `mlp`.
    pub ffn: Ffn,
}

/// The whole model.
#[derive(Debug)]
pub struct DeepSeekV3 {
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    hidden: usize,
    device: Device,
    dtype: DType,
    max_positions: usize,
}

/// One sequence in a batched forward call: its new tokens and its cache.
pub struct SeqInput<'a> {
    /// Tokens to append (the whole prompt at prefill, the last sampled token at decode).
    pub tokens: &'a [u32],
    /// The sequence's KV cache, extended by the call.
    pub cache: &'a mut SeqCache,
}

impl DeepSeekV3 {
    /// Assembles a model from loaded parts.
    pub fn new(
        embed: Embedding,
        layers: Vec<DecoderLayer>,
        norm: RmsNorm,
        lm_head: Linear,
        max_positions: usize,
    ) -> Result<Self> {
        let emb = embed.embeddings();
        let hidden = emb.dim(1)?;
        Ok(Self {
            device: emb.device().clone(),
            dtype: emb.dtype(),
            embed,
            layers,
            norm,
            lm_head,
            hidden,
            max_positions,
        })
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Longest sequence (prompt plus generated tokens) the model accepts.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An empty cache for one new sequence.
    pub fn new_cache(&self) -> SeqCache {
        SeqCache::new(self.layers.len())
    }

    /// Runs the new tokens of every sequence in `seqs` and returns the logits of each sequence's
    /// last token, `[seqs.len(), vocab]` in f32. With no sequences (or no tokens) this rank
    /// still takes part in every MoE layer's collective with zero tokens.
    pub fn forward(&self, seqs: &mut [SeqInput<'_>], kind: StepKind) -> Result<Tensor> {
        let lens: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        let total: usize = lens.iter().sum();
        if total == 0 {
            let empty = Tensor::zeros((0, self.hidden), self.dtype, &self.device)?;
            for layer in self.layers.iter().filter(|l| l.ffn.is_collective()) {
                layer.ffn.forward(&empty, kind)?;
            }
            let vocab = self.lm_head.weight().dim(0)?;
            return Tensor::zeros((seqs.len(), vocab), DType::F32, &self.device);
        }
        for s in seqs.iter() {
            if s.cache.len() + s.tokens.len() > self.max_positions {
                candle_core::bail!(
                    "sequence of {} tokens exceeds the model's context of {}",
                    s.cache.len() + s.tokens.len(),
                    self.max_positions
                );
            }
        }
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let ids = Tensor::new(ids.as_slice(), &self.device)?;
        let mut x = self.embed.forward(&ids)?; // [T, H]
        for (l, layer) in self.layers.iter().enumerate() {
            let h = layer.input_norm.forward(&x)?;
            let mut outs = Vec::with_capacity(seqs.len());
            let mut start = 0;
            for (s, &len) in seqs.iter_mut().zip(&lens) {
                if len > 0 {
                    let hs = h.narrow(0, start, len)?;
                    outs.push(layer.attn.forward(&hs, &mut s.cache.layers[l])?);
                }
                start += len;
            }
            x = (x + Tensor::cat(&outs, 0)?)?;
            let h = layer.post_norm.forward(&x)?;
            x = (&x + layer.ffn.forward(&h, kind)?)?;
        }
        // Last token of each sequence (a sequence with no new token gets zero logits' row
        // from a zero hidden state; callers never ask for those).
        let mut rows = Vec::with_capacity(seqs.len());
        let mut end = 0;
        for &len in &lens {
            end += len;
            rows.push(if len > 0 {
                x.i(end - 1)?
            } else {
                Tensor::zeros(self.hidden, self.dtype, &self.device)?
            });
        }
        let last = Tensor::stack(&rows, 0)?;
        let logits = self.lm_head.forward(&self.norm.forward(&last)?)?;
        logits.to_dtype(DType::F32)
    }

    /// Logits of the last position as a vector for each sequence (helper for sampling).
    pub fn logits_rows(logits: &Tensor) -> Result<Vec<Vec<f32>>> {
        logits.to_dtype(DType::F32)?.to_vec2::<f32>()
    }

    /// Hidden size.
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    /// Weight dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
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
