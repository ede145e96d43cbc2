//! Multi-head latent attention (MLA) with decoupled RoPE over a batch of sequences of different
//! lengths: projections run on the concatenated tokens, attention runs once for the whole
//! batch on padded `[b, heads, t_max, *]` tensors against the slotted KV cache, with a mask for
//! causality and each sequence's length.

use std::sync::Arc;

use candle_core::{Module, Result, Tensor};
use candle_nn::{Linear, RmsNorm, VarBuilder};

use crate::batch::BatchPlan;
use crate::config::DeepSeekV3Config;
use crate::kv_cache::KvCache;
use crate::rotary::{softmax_scale, Rotary};

#[derive(Clone, Debug)]
enum QProj {
    Full(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

/// Multi-head latent attention of one layer.
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

    /// The rotary tables.
    pub fn rotary(&self) -> &Rotary {
        &self.rotary
    }

    /// Attention of the batch's new tokens `x: [total, hidden]` (concatenated in the plan's
    /// slot order) over their caches and themselves; writes their keys and values into layer
    /// `layer` of `cache` first. Returns `[total, hidden]`.
    pub fn forward(
        &self,
        x: &Tensor,
        cache: &KvCache,
        layer: usize,
        plan: &BatchPlan,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        let (h, qd) = (self.heads, self.nope + self.rope);
        let (cos, sin) = plan.rotary_rows();
        let q = match &self.q {
            QProj::Full(p) => p.forward(x)?,
            QProj::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(x)?)?)?,
        };
        let q = q.reshape((t, h, qd))?;
        let q_nope = q.narrow(2, 0, self.nope)?;
        // [1, heads, total, rope]: every token rotated by its own position.
        let q_pe = q
            .narrow(2, self.nope, self.rope)?
            .transpose(0, 1)?
            .unsqueeze(0)?;
        let q_pe = Rotary::apply(&q_pe, cos, sin)?
            .squeeze(0)?
            .transpose(0, 1)?;

        let ckv = self.kv_a.forward(x)?; // [total, rank + rope]
        let latent = ckv.narrow(1, 0, self.kv_rank)?;
        let k_pe = ckv
            .narrow(1, self.kv_rank, self.rope)?
            .reshape((1, 1, t, self.rope))?;
        let k_pe = Rotary::apply(&k_pe, cos, sin)?.reshape((t, 1, self.rope))?;
        let kv = self
            .kv_b
            .forward(&self.kv_a_norm.forward(&latent)?)?
            .reshape((t, h, self.nope + self.v_dim))?;
        let k_nope = kv.narrow(2, 0, self.nope)?;
        let v = kv.narrow(2, self.nope, self.v_dim)?;

        let q = Tensor::cat(&[&q_nope, &q_pe], 2)?; // [total, heads, qd]
        let k = Tensor::cat(&[&k_nope, &k_pe.broadcast_as((t, h, self.rope))?], 2)?;
        let (q, k, v) = (plan.pad(&q)?, plan.pad(&k)?, plan.pad(&v)?);
        cache.write(layer, &k, &v, plan)?;
        let (k, v) = cache.view(layer, plan)?; // [b, heads, max_len, *]

        let att = (q.matmul(&k.t()?)? * self.scale)?; // [b, heads, t_max, max_len]
        let att = att.broadcast_add(plan.mask())?;
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let out = att.matmul(&v)?; // [b, heads, t_max, v]
        self.o.forward(&plan.unpad(&out)?)
    }
}
