//! The forms of `config.json` that the Hugging Face Hub and transformers write for
//! DeepSeek-style models, read into [`DeepSeekV3Config`] and written back in DeepSeek's own form.
//!
//! RoPE comes in three spellings: DeepSeek's (`rope_theta` and
//! `rope_scaling: {"type": "yarn", ...}`), transformers 4.5x's re-save (`rope_scaling` holds both
//! `type` and `rope_type`) and transformers 5's (`rope_parameters: {"rope_type", "rope_theta",
//! ...}`, no top-level `rope_scaling`, often no top-level `rope_theta`).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{DeepSeekV3Config, ModelType, Quantization, RopeScaling};

/// `rope_scaling` or `rope_parameters` as written, every field optional.
#[derive(Deserialize)]
struct RawRope {
    #[serde(rename = "type")]
    kind: Option<String>,
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
}

/// `config.json` as written; unknown fields are ignored.
#[derive(Deserialize)]
pub(super) struct RawConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    moe_intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    n_shared_experts: Option<usize>,
    n_routed_experts: Option<usize>,
    routed_scaling_factor: Option<f64>,
    kv_lora_rank: usize,
    q_lora_rank: Option<usize>,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    qk_nope_head_dim: usize,
    topk_method: Option<String>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_layer_freq: Option<usize>,
    first_k_dense_replace: Option<usize>,
    norm_topk_prob: Option<bool>,
    scoring_func: Option<String>,
    hidden_act: Option<String>,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    rope_interleave: Option<bool>,
    attention_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    quantization_config: Option<Value>,
}

impl RawConfig {
    /// Normalises every accepted spelling into the typed configuration.
    pub(super) fn into_config(self) -> Result<DeepSeekV3Config> {
        let (rope_theta, rope_scaling) =
            rope(self.rope_theta, self.rope_scaling, self.rope_parameters)?;
        let (bos, _) = token_ids("bos_token_id", self.bos_token_id)?;
        let (eos, extra_eos) = token_ids("eos_token_id", self.eos_token_id)?;
        Ok(DeepSeekV3Config {
            model_type: self
                .model_type
                .map_or(ModelType::DeepseekV3, |m| ModelType::from_name(&m)),
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            moe_intermediate_size: self.moe_intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            n_shared_experts: self.n_shared_experts,
            n_routed_experts: self.n_routed_experts,
            routed_scaling_factor: self.routed_scaling_factor.unwrap_or(1.0),
            kv_lora_rank: self.kv_lora_rank,
            q_lora_rank: self.q_lora_rank,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
            qk_nope_head_dim: self.qk_nope_head_dim,
            topk_method: self.topk_method.unwrap_or_else(|| "greedy".into()),
            n_group: self.n_group.unwrap_or(1),
            topk_group: self.topk_group.unwrap_or(1),
            num_experts_per_tok: self.num_experts_per_tok,
            moe_layer_freq: self.moe_layer_freq.unwrap_or(1),
            first_k_dense_replace: self.first_k_dense_replace.unwrap_or(0),
            norm_topk_prob: self.norm_topk_prob.unwrap_or(false),
            scoring_func: self.scoring_func.unwrap_or_else(|| "softmax".into()),
            hidden_act: self.hidden_act.unwrap_or_else(|| "silu".into()),
            max_position_embeddings: self.max_position_embeddings,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            rope_interleave: self.rope_interleave.unwrap_or(true),
            attention_bias: self.attention_bias.unwrap_or(false),
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            bos_token_id: bos,
            eos_token_id: eos,
            extra_eos_token_ids: extra_eos,
            quantization: self.quantization_config.as_ref().map(Quantization::from_hf),
        })
    }
}

/// The RoPE base and scaling from the top-level `rope_theta` and the `rope_scaling` (DeepSeek,
/// transformers 4) and `rope_parameters` (transformers 5) blocks; where several say the same
/// thing they must agree.
fn rope(
    theta: Option<f64>,
    scaling: Option<RawRope>,
    parameters: Option<RawRope>,
) -> Result<(f64, Option<RopeScaling>)> {
    let mut theta = theta.map(|t| ("rope_theta".to_string(), t));
    let mut found: Option<(&str, Option<RopeScaling>)> = None;
    for (name, block) in [("rope_scaling", scaling), ("rope_parameters", parameters)] {
        let Some(block) = block else { continue };
        match (&theta, block.rope_theta) {
            (Some((first, a)), Some(b)) if *a != b => {
                bail!("{first} {a} and {name}.rope_theta {b} disagree")
            }
            (None, Some(b)) => theta = Some((format!("{name}.rope_theta"), b)),
            _ => {}
        }
        let s = rope_scaling(name, &block)?;
        match &found {
            Some((first, a)) if *a != s => bail!("{first} and {name} disagree"),
            Some(_) => {}
            None => found = Some((name, s)),
        }
    }
    let (_, theta) =
        theta.context("missing rope_theta (neither at the top level nor in rope_parameters)")?;
    Ok((theta, found.and_then(|(_, s)| s)))
}

/// The scaling a `rope_scaling` or `rope_parameters` block describes: `None` for plain RoPE
/// (`"default"` or no type), YaRN, or an error naming any other type.
fn rope_scaling(name: &str, b: &RawRope) -> Result<Option<RopeScaling>> {
    let kind = match (b.kind.as_deref(), b.rope_type.as_deref()) {
        (Some(a), Some(t)) if a != t => {
            bail!("{name}.type {a:?} and {name}.rope_type {t:?} disagree")
        }
        (Some(k), _) | (None, Some(k)) => k,
        (None, None) if b.factor.is_some() => {
            bail!("{name} has a factor but no rope_type (supported: \"yarn\", or \"default\")")
        }
        (None, None) => "default",
    };
    match kind {
        "default" => Ok(None),
        "yarn" => Ok(Some(RopeScaling {
            kind: kind.to_string(),
            factor: b
                .factor
                .with_context(|| format!("{name}: yarn needs a factor"))?,
            original_max_position_embeddings: b
                .original_max_position_embeddings
                .with_context(|| format!("{name}: yarn needs original_max_position_embeddings"))?,
            beta_fast: b.beta_fast.unwrap_or(32.0),
            beta_slow: b.beta_slow.unwrap_or(1.0),
            mscale: b.mscale.unwrap_or(1.0),
            mscale_all_dim: b.mscale_all_dim.unwrap_or(0.0),
        })),
        other => bail!(
            "{name} type {other:?} is not supported (supported: \"yarn\", or \"default\" for \
             plain RoPE)"
        ),
    }
}

/// The first id and the others of a token id field: a number, a list of numbers, or null.
fn token_ids(field: &str, v: Option<Value>) -> Result<(Option<u32>, Vec<u32>)> {
    let id = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .with_context(|| format!("{field} must be a token id or a list of them, got {v}"))
    };
    match v {
        None | Some(Value::Null) => Ok((None, Vec::new())),
        Some(Value::Array(a)) => {
            let ids = a.iter().map(id).collect::<Result<Vec<_>>>()?;
            Ok((ids.first().copied(), ids.iter().skip(1).copied().collect()))
        }
        Some(v) => Ok((Some(id(&v)?), Vec::new())),
    }
}

/// `config.json` as this crate writes it: DeepSeek's field names and RoPE form.
#[derive(Serialize)]
pub(super) struct OutConfig<'a> {
    model_type: &'a str,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    moe_intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    n_shared_experts: Option<usize>,
    n_routed_experts: Option<usize>,
    routed_scaling_factor: f64,
    kv_lora_rank: usize,
    q_lora_rank: Option<usize>,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    qk_nope_head_dim: usize,
    topk_method: &'a str,
    n_group: usize,
    topk_group: usize,
    num_experts_per_tok: Option<usize>,
    moe_layer_freq: usize,
    first_k_dense_replace: usize,
    norm_topk_prob: bool,
    scoring_func: &'a str,
    hidden_act: &'a str,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    rope_theta: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    rope_scaling: Option<&'a RopeScaling>,
    rope_interleave: bool,
    attention_bias: bool,
    tie_word_embeddings: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    quantization_config: Option<Value>,
}

impl<'a> From<&'a DeepSeekV3Config> for OutConfig<'a> {
    fn from(c: &'a DeepSeekV3Config) -> Self {
        let eos_token_id = if c.extra_eos_token_ids.is_empty() {
            serde_json::json!(c.eos_token_id)
        } else {
            serde_json::json!(c
                .eos_token_id
                .iter()
                .chain(&c.extra_eos_token_ids)
                .collect::<Vec<_>>())
        };
        OutConfig {
            model_type: c.model_type.as_str(),
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            moe_intermediate_size: c.moe_intermediate_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            n_shared_experts: c.n_shared_experts,
            n_routed_experts: c.n_routed_experts,
            routed_scaling_factor: c.routed_scaling_factor,
            kv_lora_rank: c.kv_lora_rank,
            q_lora_rank: c.q_lora_rank,
            qk_rope_head_dim: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
            qk_nope_head_dim: c.qk_nope_head_dim,
            topk_method: &c.topk_method,
            n_group: c.n_group,
            topk_group: c.topk_group,
            num_experts_per_tok: c.num_experts_per_tok,
            moe_layer_freq: c.moe_layer_freq,
            first_k_dense_replace: c.first_k_dense_replace,
            norm_topk_prob: c.norm_topk_prob,
            scoring_func: &c.scoring_func,
            hidden_act: &c.hidden_act,
            max_position_embeddings: c.max_position_embeddings,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
            rope_scaling: c.rope_scaling.as_ref(),
            rope_interleave: c.rope_interleave,
            attention_bias: c.attention_bias,
            tie_word_embeddings: c.tie_word_embeddings,
            bos_token_id: c.bos_token_id,
            eos_token_id,
            quantization_config: c.quantization.as_ref().map(Quantization::to_hf),
        }
    }
}
