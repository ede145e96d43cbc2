//! Multi-head latent attention (MLA) with decoupled RoPE over a batch of sequences of different
//! lengths, in the absorbed form: the cache holds each position's normalised latent `c` and its
//! rotated rope key once for all heads; each head's query is taken into the latent space through
//! its slice of `kv_b_proj` (`q_nope · W_UK`), scores are `q_latent · c + q_pe · k_pe`, and the
//! attention output stays in the latent space until each head's `W_UV` maps it to values. This
//! equals attention over keys and values expanded per head (`k = c · W_UK^T`, `v = c · W_UV^T`),
//! and reads `kv_lora_rank + qk_rope_head_dim` values per cached position instead of
//! `heads * (q_head_dim + v_head_dim)`. Projections run on the concatenated tokens; attention
//! runs once for the whole batch on padded tensors, with a mask for causality and each
//! sequence's length.

use std::sync::Arc;

use candle_core::{Module, Result, Tensor};
use candle_nn::{Linear, RmsNorm, VarBuilder};

use crate::batch::BatchPlan;
use crate::config::DeepSeekV3Config;
use crate::kv_cache::KvCache;
use crate::rotary::{softmax_scale, Rotary};

/// A projection `[out, inp]` (with a bias when `bias`) at `vb`: as stored, or dequantized from
/// block-scaled fp8 once at load (`moe_layer::fp8::load_weight`).
fn linear(inp: usize, out: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    let w = moe_layer::fp8::load_weight(&vb, out, inp)?;
    let b = if bias {
        Some(vb.get(out, "bias")?)
    } else {
        None
    };
    Ok(Linear::new(w, b))
}

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
    /// `kv_b_proj`'s key rows per head, `[heads, nope, kv_rank]`.
    w_uk: Tensor,
    /// `kv_b_proj`'s value rows per head, transposed: `[heads, kv_rank, v_dim]`.
    w_uv_t: Tensor,
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
            None => QProj::Full(linear(h, heads * qd, false, vb.pp("q_proj"))?),
            Some(r) => QProj::LowRank {
                a: linear(h, r, bias, vb.pp("q_a_proj"))?,
                norm: candle_nn::rms_norm(r, cfg.rms_norm_eps, vb.pp("q_a_layernorm"))?,
                b: linear(r, heads * qd, false, vb.pp("q_b_proj"))?,
            },
        };
        let kv_rank = cfg.kv_lora_rank;
        let (nope, v_dim) = (cfg.qk_nope_head_dim, cfg.v_head_dim);
        let kv_b = linear(kv_rank, heads * (nope + v_dim), false, vb.pp("kv_b_proj"))?;
        let per_head = kv_b.weight().reshape((heads, nope + v_dim, kv_rank))?;
        let w_uk = per_head.narrow(1, 0, nope)?.contiguous()?;
        let w_uv_t = per_head
            .narrow(1, nope, v_dim)?
            .transpose(1, 2)?
            .contiguous()?;
        Ok(Self {
            q,
            kv_a: linear(
                h,
                kv_rank + cfg.qk_rope_head_dim,
                bias,
                vb.pp("kv_a_proj_with_mqa"),
            )?,
            kv_a_norm: candle_nn::rms_norm(kv_rank, cfg.rms_norm_eps, vb.pp("kv_a_layernorm"))?,
            w_uk,
            w_uv_t,
            o: linear(heads * cfg.v_head_dim, h, bias, vb.pp("o_proj"))?,
            heads,
            nope: cfg.qk_nope_head_dim,
            rope: cfg.qk_rope_head_dim,
            v_dim: cfg.v_head_dim,
            kv_rank,
            scale: softmax_scale(cfg),
            rotary,
        })
    }

    /// Bytes of its weights (projections, norms, and the per-head `kv_b_proj` views it keeps).
    pub fn weight_bytes(&self) -> usize {
        let b = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let lin = |l: &Linear| b(l.weight()) + l.bias().map_or(0, b);
        let q = match &self.q {
            QProj::Full(p) => lin(p),
            QProj::LowRank { a, norm, b: up } => {
                lin(a) + b(norm.clone().into_inner().weight()) + lin(up)
            }
        };
        q + lin(&self.kv_a)
            + b(self.kv_a_norm.clone().into_inner().weight())
            + b(&self.w_uk)
            + b(&self.w_uv_t)
            + lin(&self.o)
    }

    /// The bytes [`Attention::load`] holds for `cfg` in weights of `dtype_bytes` a value (what
    /// [`Attention::weight_bytes`] then reports).
    pub fn planned_bytes(cfg: &DeepSeekV3Config, dtype_bytes: usize) -> usize {
        let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
        let bias = |out: usize| if cfg.attention_bias { out } else { 0 };
        let q = match cfg.q_lora_rank {
            None => h * heads * cfg.q_head_dim(),
            Some(r) => h * r + bias(r) + r + r * heads * cfg.q_head_dim(),
        };
        let kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
        let values = q
            + h * kv_a
            + bias(kv_a)
            + cfg.kv_lora_rank
            + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
            + heads * cfg.v_head_dim * h
            + bias(h);
        values * dtype_bytes
    }

    /// The rotary tables.
    pub fn rotary(&self) -> &Rotary {
        &self.rotary
    }

    /// Attention of the batch's new tokens `x: [total, hidden]` (concatenated in the plan's
    /// slot order) over their caches and themselves; writes their latents and rope keys into
    /// layer `layer` of `cache` first. Returns `[total, hidden]`.
    pub fn forward(
        &self,
        x: &Tensor,
        cache: &KvCache,
        layer: usize,
        plan: &BatchPlan,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        let (h, r, rope) = (self.heads, self.kv_rank, self.rope);
        let (b, t_max) = (plan.num_seqs(), plan.max_new());
        let rope_rows = plan.rotary_rows();
        let q = match &self.q {
            QProj::Full(p) => p.forward(x)?,
            QProj::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(x)?)?)?,
        };
        let q = q.reshape((t, h, self.nope + rope))?;
        // Each head's query in the latent space: [heads, total, nope] x [heads, nope, rank].
        let q_nope = q.narrow(2, 0, self.nope)?.transpose(0, 1)?.contiguous()?;
        let q_latent = q_nope.matmul(&self.w_uk)?.transpose(0, 1)?; // [total, heads, rank]
                                                                    // [1, heads, total, rope]: every token rotated by its own position.
        let q_pe = q
            .narrow(2, self.nope, rope)?
            .transpose(0, 1)?
            .unsqueeze(0)?;
        let q_pe = rope_rows.apply(&q_pe)?.squeeze(0)?.transpose(0, 1)?;

        let ckv = self.kv_a.forward(x)?; // [total, rank + rope]
        let latent = self.kv_a_norm.forward(&ckv.narrow(1, 0, r)?)?;
        let k_pe = ckv.narrow(1, r, rope)?.reshape((1, 1, t, rope))?;
        let k_pe = rope_rows.apply(&k_pe)?.reshape((t, 1, rope))?;
        let latent = plan
            .pad(&latent.reshape((t, 1, r))?)?
            .reshape((b, t_max, r))?;
        let k_pe = plan.pad(&k_pe)?.reshape((b, t_max, rope))?;
        cache.write(layer, &latent, &k_pe, plan)?;
        let (c, pe) = cache.view(layer, plan)?; // [b, max_len, rank], [b, max_len, rope]
        let len = plan.max_len();

        // Queries of every head of a sequence as the rows of one matrix: [b, heads * t_max, *].
        let q_latent = plan.pad(&q_latent)?.reshape((b, h * t_max, r))?;
        let q_pe = plan.pad(&q_pe)?.reshape((b, h * t_max, rope))?;
        let att = (q_latent.matmul(&c.t()?)? + q_pe.matmul(&pe.t()?)?)?;
        let att = (att * self.scale)?.reshape((b, h, t_max, len))?;
        let att = att.broadcast_add(plan.mask())?;
        let att = candle_nn::ops::softmax_last_dim(&att)?.reshape((b, h * t_max, len))?;
        let out = att.matmul(&c)?.reshape((b, h, t_max, r))?; // latent outputs
                                                              // Back to values per head: [heads, total, rank] x [heads, rank, v_dim].
        let out = plan
            .unpad(&out)?
            .reshape((t, h, r))?
            .transpose(0, 1)?
            .contiguous()?;
        let out = out.matmul(&self.w_uv_t)?.transpose(0, 1)?.contiguous()?;
        self.o.forward(&out.reshape((t, h * self.v_dim))?)
    }
}
