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
use moe_layer::fp8::Fp8Weight;
use moe_layer::mla::{scores_softmax, HeadMaps};
use moe_layer::Fp8Linear;

use crate::batch::BatchPlan;
use crate::config::DeepSeekV3Config;
use crate::kv_cache::KvCache;
use crate::rotary::{softmax_scale, Rotary};

/// A projection of the attention: float weights (as stored, or dequantized from block-scaled fp8
/// once at load), or block-scaled fp8 weights run by the fp8 GEMMs (`moe_layer::Fp8Linear`;
/// `docs/design.md`, "Dense layers in fp8").
#[derive(Clone, Debug)]
enum Proj {
    Float(Linear),
    Fp8(Arc<Fp8Linear>),
}

impl Proj {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Proj::Float(l) => l.forward(x),
            Proj::Fp8(l) => Ok(l.forward(x)?),
        }
    }

    fn weight_bytes(&self) -> usize {
        match self {
            Proj::Float(l) => bytes(l.weight()) + l.bias().map_or(0, bytes),
            Proj::Fp8(l) => l.weight_bytes(),
        }
    }
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Fewest output features of a projection that an fp8 checkpoint keeps in fp8 on a GPU (its
/// attention projections and dense MLPs). Narrower ones (DeepSeek-V3's `q_a_proj` and
/// `kv_a_proj_with_mqa`, 1536 and 576 outputs; DeepSeek-V2-Lite's) leave the GPU idle in one
/// fp8 GEMM and measure slower than bf16 at every batch (`docs/benchmarks.md`, "Dense fp8
/// projections"): they are dequantized once at load. (`kv_b_proj` is always: MLA's absorbed
/// form multiplies per-head slices of it, and those maps in fp8, `moe_layer::Fp8BatchedLinear`,
/// measure slower than bf16's batched matmuls at every token count.)
pub const FP8_MIN_OUTPUTS: usize = 4096;

/// Whether a projection `[out, inp]` of an fp8 checkpoint stays fp8 on a device: on CUDA, at
/// least [`FP8_MIN_OUTPUTS`] outputs, a shape the fp8 GEMMs take.
pub fn fp8_projection(out: usize, inp: usize, cuda: bool) -> bool {
    cuda && out >= FP8_MIN_OUTPUTS && Fp8Linear::takes(out, inp)
}

/// The projection `name` `[out, inp]` (with a bias when `bias`) of `vb`: fp8 where
/// [`fp8_projection`] says so and the checkpoint has its scales, else float weights in `vb`'s
/// dtype.
fn projection(inp: usize, out: usize, bias: bool, vb: &VarBuilder, name: &str) -> Result<Proj> {
    let vb = vb.pp(name);
    if fp8_projection(out, inp, vb.device().is_cuda()) {
        if let Some(w) = Fp8Weight::load(&vb, out, inp)? {
            let b = if bias {
                Some(vb.get(out, "bias")?)
            } else {
                None
            };
            return Ok(Proj::Fp8(Arc::new(Fp8Linear::new(w, b)?)));
        }
    }
    Ok(Proj::Float(linear(inp, out, bias, vb)?))
}

/// A float projection `[out, inp]` (with a bias when `bias`) at `vb`: as stored, or dequantized
/// from block-scaled fp8 once at load (`moe_layer::fp8::load_weight`).
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
    Full(Proj),
    LowRank { a: Proj, norm: RmsNorm, b: Proj },
}

/// Multi-head latent attention of one layer.
#[derive(Clone, Debug)]
pub struct Attention {
    q: QProj,
    kv_a: Proj,
    kv_a_norm: RmsNorm,
    /// `kv_b_proj`'s key rows per head, `[heads, nope, kv_rank]`: a query's nope part into
    /// the latent space.
    w_uk: HeadMaps,
    /// `kv_b_proj`'s value rows per head, transposed, `[heads, kv_rank, v_dim]`: a latent
    /// output to values.
    w_uv_t: HeadMaps,
    o: Proj,
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
            None => QProj::Full(projection(h, heads * qd, false, &vb, "q_proj")?),
            Some(r) => QProj::LowRank {
                a: projection(h, r, bias, &vb, "q_a_proj")?,
                norm: candle_nn::rms_norm(r, cfg.rms_norm_eps, vb.pp("q_a_layernorm"))?,
                b: projection(r, heads * qd, false, &vb, "q_b_proj")?,
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
            kv_a: projection(
                h,
                kv_rank + cfg.qk_rope_head_dim,
                bias,
                &vb,
                "kv_a_proj_with_mqa",
            )?,
            kv_a_norm: candle_nn::rms_norm(kv_rank, cfg.rms_norm_eps, vb.pp("kv_a_layernorm"))?,
            w_uk: HeadMaps::new(w_uk)?,
            w_uv_t: HeadMaps::new(w_uv_t)?,
            o: projection(heads * cfg.v_head_dim, h, bias, &vb, "o_proj")?,
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
        let q = match &self.q {
            QProj::Full(p) => p.weight_bytes(),
            QProj::LowRank { a, norm, b } => {
                a.weight_bytes() + bytes(norm.clone().into_inner().weight()) + b.weight_bytes()
            }
        };
        q + self.kv_a.weight_bytes()
            + bytes(self.kv_a_norm.clone().into_inner().weight())
            + bytes(self.w_uk.weight())
            + bytes(self.w_uv_t.weight())
            + self.o.weight_bytes()
    }

    /// How many of its projections run on the fp8 GEMMs.
    pub fn fp8_projections(&self) -> usize {
        let q = match &self.q {
            QProj::Full(p) => vec![p],
            QProj::LowRank { a, b, .. } => vec![a, b],
        };
        q.into_iter()
            .chain([&self.kv_a, &self.o])
            .filter(|p| matches!(p, Proj::Fp8(_)))
            .count()
    }

    /// The bytes [`Attention::load`] holds for `cfg` in float weights of `dtype_bytes` a value,
    /// with the projections of an fp8 checkpoint that [`fp8_projection`] keeps in fp8 when
    /// `fp8_on_cuda` (what [`Attention::weight_bytes`] then reports).
    pub fn planned_bytes(cfg: &DeepSeekV3Config, dtype_bytes: usize, fp8_on_cuda: bool) -> usize {
        let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
        let bias = |out: usize| if cfg.attention_bias { out } else { 0 };
        // One projection `[out, inp]`: e4m3 values and f32 128 x 128 scales, or float values.
        let proj = |out: usize, inp: usize| {
            if fp8_projection(out, inp, fp8_on_cuda) {
                out * inp + 4 * out.div_ceil(128) * inp.div_ceil(128)
            } else {
                out * inp * dtype_bytes
            }
        };
        let q = match cfg.q_lora_rank {
            None => proj(heads * cfg.q_head_dim(), h),
            Some(r) => proj(r, h) + (bias(r) + r) * dtype_bytes + proj(heads * cfg.q_head_dim(), r),
        };
        let kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
        let float_values = bias(kv_a)
            + cfg.kv_lora_rank
            + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
            + bias(h);
        q + proj(kv_a, h) + proj(h, heads * cfg.v_head_dim) + float_values * dtype_bytes
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
        // Each head's query in the latent space, token-major: [total, heads, rank].
        let q_latent = self.w_uk.forward(&q, 0)?;
        // [total, heads, rope]: every token rotated by its own position, token-major.
        let q_pe = rope_rows.apply_columns(&q, self.nope, rope)?;

        // [total, rank + rope]. On the strided latent rows candle's RMS norm follows Hugging
        // Face's recipe (the normalised latent rounded to the dtype before the weight); they are
        // not made contiguous on purpose: the fused kernel rounds once (docs/design.md, "MLA
        // attention and greedy sampling").
        let ckv = self.kv_a.forward(x)?;
        let latent = self.kv_a_norm.forward(&ckv.narrow(1, 0, r)?)?;
        let k_pe = rope_rows.apply_columns(&ckv.reshape((t, 1, r + rope))?, r, rope)?;
        let latent = plan
            .pad(&latent.reshape((t, 1, r))?)?
            .reshape((b, t_max, r))?;
        let k_pe = plan.pad(&k_pe)?.reshape((b, t_max, rope))?;
        cache.write(layer, &latent, &k_pe, plan)?;
        let (c, pe) = cache.view(layer, plan)?; // [b, max_len, rank], [b, max_len, rope]
        let len = plan.max_len();

        // Queries of every head of a sequence as the rows of one matrix, token-major:
        // [b, t_max * heads, *].
        let q_latent = plan.pad(&q_latent)?.reshape((b, t_max * h, r))?;
        let q_pe = plan.pad(&q_pe)?.reshape((b, t_max * h, rope))?;
        let latent_scores = q_latent.matmul(&c.t()?)?.reshape((b, t_max, h, len))?;
        let rope_scores = q_pe.matmul(&pe.t()?)?.reshape((b, t_max, h, len))?;
        let att = scores_softmax(&latent_scores, &rope_scores, plan.mask(), self.scale)?
            .reshape((b, t_max * h, len))?;
        // Latent outputs [b, t_max, heads, rank]; back to values per head, token-major:
        // [total, heads, rank] -> [total, heads, v_dim].
        let out = att.matmul(&c)?.reshape((b, t_max, h, r))?;
        let out = self
            .w_uv_t
            .forward(&plan.unpad(&out)?.reshape((t, h, r))?, 0)?;
        self.o.forward(&out.reshape((t, h * self.v_dim))?)
    }
}
