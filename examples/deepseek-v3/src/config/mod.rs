//! The model configuration, read from a Hugging Face `config.json` with DeepSeek-V3's field
//! names, plus the tiny preset that the checkpoint generator writes.
//!
//! Every form the Hugging Face Hub and transformers write for DeepSeek-style models is read:
//! DeepSeek-V2, V3, V3.1, R1 and Kimi-K2 as published, and as re-saved by transformers 4.5x
//! (`rope_scaling` with both `type` and `rope_type`) and 5 (`rope_parameters` holding the RoPE
//! base and type). `quantization_config` becomes a typed [`Quantization`].

mod hf;
mod quantization;

use std::path::Path;

use anyhow::{bail, Context, Result};
use moe_layer::config::MoeConfig;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub use quantization::{Quantization, ScaleFmt, FP8_BLOCK};

/// The architecture family named by `model_type`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ModelType {
    /// `deepseek_v3` (DeepSeek-V3, V3.1, R1); also assumed when `model_type` is absent.
    #[default]
    DeepseekV3,
    /// `deepseek_v2` (DeepSeek-V2, V2-Lite, V2.5).
    DeepseekV2,
    /// `kimi_k2` (Kimi-K2: DeepSeek-V3's architecture with other sizes).
    KimiK2,
    /// Any other `model_type`; [`DeepSeekV3Config::validate`] refuses it.
    Other(String),
}

impl ModelType {
    /// The type a `model_type` value names.
    pub fn from_name(name: &str) -> Self {
        match name {
            "deepseek_v3" => ModelType::DeepseekV3,
            "deepseek_v2" => ModelType::DeepseekV2,
            "kimi_k2" => ModelType::KimiK2,
            other => ModelType::Other(other.to_string()),
        }
    }

    /// The `model_type` value.
    pub fn as_str(&self) -> &str {
        match self {
            ModelType::DeepseekV3 => "deepseek_v3",
            ModelType::DeepseekV2 => "deepseek_v2",
            ModelType::KimiK2 => "kimi_k2",
            ModelType::Other(name) => name,
        }
    }

    /// The `architectures` entry of this family's published checkpoints.
    pub fn architecture(&self) -> &str {
        match self {
            ModelType::DeepseekV2 => "DeepseekV2ForCausalLM",
            _ => "DeepseekV3ForCausalLM",
        }
    }
}

/// YaRN context extension of the decoupled RoPE (`rope_scaling` in `config.json`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RopeScaling {
    /// Scaling kind; only `"yarn"` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// Context extension factor.
    pub factor: f64,
    /// Context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
    /// Rotations above which dimensions keep their original frequency.
    pub beta_fast: f64,
    /// Rotations below which dimensions are fully interpolated.
    pub beta_slow: f64,
    /// Magnitude correction applied to cos/sin.
    pub mscale: f64,
    /// Magnitude correction shared by all dimensions (also scales the softmax).
    pub mscale_all_dim: f64,
}

/// A DeepSeek-V3 model configuration (`DeepseekV3Config` of Hugging Face), limited to the
/// fields inference needs. Unknown fields are ignored; absent optional fields take the
/// defaults of Hugging Face's `DeepseekV2Config`.
#[derive(Clone, Debug, PartialEq)]
pub struct DeepSeekV3Config {
    /// The architecture family (`model_type`).
    pub model_type: ModelType,
    /// Token vocabulary size (rows of the embedding and of `lm_head`).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Inner width of the dense layers' SwiGLU MLP.
    pub intermediate_size: usize,
    /// Inner width of one routed (and shared) expert.
    pub moe_intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of attention heads.
    pub num_attention_heads: usize,
    /// Shared experts per MoE layer (fused into one MLP).
    pub n_shared_experts: Option<usize>,
    /// Routed experts per MoE layer; `null` makes every layer dense.
    pub n_routed_experts: Option<usize>,
    /// Factor on the routing weights.
    pub routed_scaling_factor: f64,
    /// Rank of the compressed key/value projection.
    pub kv_lora_rank: usize,
    /// Rank of the compressed query projection; `null` uses a full `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Per-head width of the rotary part of queries and keys.
    pub qk_rope_head_dim: usize,
    /// Per-head width of values.
    pub v_head_dim: usize,
    /// Per-head width of the non-rotary part of queries and keys.
    pub qk_nope_head_dim: usize,
    /// Router top-k method (`noaux_tc`, `greedy`, `group_limited_greedy`).
    pub topk_method: String,
    /// Expert groups (`null` reads as 1).
    pub n_group: usize,
    /// Groups a token may use (`null` reads as 1).
    pub topk_group: usize,
    /// Experts per token.
    pub num_experts_per_tok: Option<usize>,
    /// Every `moe_layer_freq`-th layer after the dense ones is an MoE layer.
    pub moe_layer_freq: usize,
    /// Number of leading dense layers.
    pub first_k_dense_replace: usize,
    /// Whether the chosen experts' weights are renormalised.
    pub norm_topk_prob: bool,
    /// Router score function (`sigmoid` or `softmax`).
    pub scoring_func: String,
    /// MLP activation; only `silu` is supported.
    pub hidden_act: String,
    /// Longest supported context.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base (`rope_theta`, at the top level or in transformers 5's `rope_parameters`).
    pub rope_theta: f64,
    /// Optional YaRN scaling (`rope_scaling`, or transformers 5's `rope_parameters`).
    pub rope_scaling: Option<RopeScaling>,
    /// Whether RoPE rotates interleaved pairs `(x[2i], x[2i + 1])`, as DeepSeek's checkpoints
    /// do (the default), rather than the halves `(x[i], x[i + d/2])`.
    pub rope_interleave: bool,
    /// Whether the attention projections have biases.
    pub attention_bias: bool,
    /// Whether `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token id (the first one where `config.json` lists several).
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id (the first one where `config.json` lists several).
    pub eos_token_id: Option<u32>,
    /// The end-of-sequence ids after [`DeepSeekV3Config::eos_token_id`] where `config.json`
    /// lists several.
    pub extra_eos_token_ids: Vec<u32>,
    /// The weights' quantization (`quantization_config`); `None` for bf16/f16/f32 weights.
    pub quantization: Option<Quantization>,
}

impl<'de> Deserialize<'de> for DeepSeekV3Config {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        hf::RawConfig::deserialize(deserializer)?
            .into_config()
            .map_err(|e| serde::de::Error::custom(format!("{e:#}")))
    }
}

impl Serialize for DeepSeekV3Config {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        hf::OutConfig::from(self).serialize(serializer)
    }
}

impl DeepSeekV3Config {
    /// Reads and validates `config.json` at `path`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let cfg: Self = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a DeepSeek-V3 config", path.display()))?;
        cfg.validate()
            .with_context(|| format!("{}: invalid configuration", path.display()))?;
        Ok(cfg)
    }

    /// Checks the invariants the model relies on.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("v_head_dim", self.v_head_dim),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("moe_layer_freq", self.moe_layer_freq),
        ];
        for (name, value) in positive {
            if value == 0 {
                bail!("{name} must be positive, got 0");
            }
        }
        if self.qk_rope_head_dim == 0 || self.qk_rope_head_dim % 2 != 0 {
            bail!(
                "qk_rope_head_dim must be even and positive, got {}",
                self.qk_rope_head_dim
            );
        }
        if self.q_lora_rank == Some(0) {
            bail!("q_lora_rank must be positive or null, got 0");
        }
        if self.hidden_act != "silu" {
            bail!(
                "hidden_act {:?} is not supported (only \"silu\")",
                self.hidden_act
            );
        }
        if let ModelType::Other(name) = &self.model_type {
            bail!(
                "model_type {name:?} is not supported (supported: deepseek_v3, deepseek_v2, \
                 kimi_k2)"
            );
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            bail!("rope_theta must be positive, got {}", self.rope_theta);
        }
        if let Some(rs) = &self.rope_scaling {
            if rs.kind != "yarn" {
                bail!(
                    "rope_scaling type {:?} is not supported (only \"yarn\")",
                    rs.kind
                );
            }
            if !(rs.factor.is_finite() && rs.factor > 0.0) {
                bail!("rope_scaling.factor must be positive, got {}", rs.factor);
            }
            if rs.original_max_position_embeddings == 0 {
                bail!("rope_scaling.original_max_position_embeddings must be positive, got 0");
            }
        }
        if let Some(q) = &self.quantization {
            q.check()?;
        }
        if self.has_moe() {
            self.moe_config()?;
        }
        Ok(())
    }

    /// Per-head width of queries and keys, `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn q_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Whether any layer is an MoE layer.
    pub fn has_moe(&self) -> bool {
        (0..self.num_hidden_layers).any(|i| self.is_moe_layer(i))
    }

    /// Whether layer `i` is an MoE layer (else a dense SwiGLU MLP).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.n_routed_experts.is_some_and(|e| e > 0)
            && i >= self.first_k_dense_replace
            && i % self.moe_layer_freq == 0
    }

    /// The MoE part of the configuration, as the `moe-layer` crate reads it.
    pub fn moe_config(&self) -> Result<MoeConfig> {
        let json = serde_json::json!({
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.n_routed_experts.unwrap_or(0),
            "num_experts_per_tok": self.num_experts_per_tok.unwrap_or(0),
            "n_shared_experts": self.n_shared_experts,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "scoring_func": self.scoring_func,
            "topk_method": self.topk_method,
        });
        MoeConfig::from_json_str(&json.to_string()).map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// Number of weights (all experts counted), as the checkpoint generator writes them.
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let heads = self.num_attention_heads;
        let qd = self.q_head_dim();
        let mlp = |inter: usize| 3 * h * inter;
        let q = match self.q_lora_rank {
            None => h * heads * qd,
            Some(r) => h * r + r + r * heads * qd,
        };
        let attn = q
            + h * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            + heads * self.v_head_dim * h;
        let layers: usize = (0..self.num_hidden_layers)
            .map(|i| {
                let ffn = if self.is_moe_layer(i) {
                    let e = self.n_routed_experts.unwrap_or(0);
                    let bias = if self.topk_method == "noaux_tc" { e } else { 0 };
                    e * h
                        + bias
                        + e * mlp(self.moe_intermediate_size)
                        + self
                            .n_shared_experts
                            .map_or(0, |n| mlp(self.moe_intermediate_size * n))
                } else {
                    mlp(self.intermediate_size)
                };
                attn + ffn + 2 * h
            })
            .sum();
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        self.vocab_size * h + layers + h + head
    }

    /// The tiny preset written by the checkpoint generator: hidden 128 (the smallest width the
    /// fp8 and GPU low-latency paths take: a multiple of 128), 4 layers (1 dense),
    /// 16 routed experts top-4 in 4 groups (2 used), 1 shared expert, vocabulary 320.
    pub fn tiny() -> Self {
        Self {
            model_type: ModelType::DeepseekV3,
            vocab_size: 320,
            hidden_size: 128,
            intermediate_size: 128,
            moe_intermediate_size: 32,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            n_shared_experts: Some(1),
            n_routed_experts: Some(16),
            routed_scaling_factor: 2.5,
            kv_lora_rank: 32,
            q_lora_rank: Some(48),
            qk_rope_head_dim: 8,
            v_head_dim: 16,
            qk_nope_head_dim: 16,
            topk_method: "noaux_tc".to_string(),
            n_group: 4,
            topk_group: 2,
            num_experts_per_tok: Some(4),
            moe_layer_freq: 1,
            first_k_dense_replace: 1,
            norm_topk_prob: true,
            scoring_func: "sigmoid".to_string(),
            hidden_act: "silu".to_string(),
            max_position_embeddings: 2048,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            rope_interleave: true,
            attention_bias: false,
            tie_word_embeddings: false,
            bos_token_id: Some(0),
            eos_token_id: Some(1),
            extra_eos_token_ids: Vec::new(),
            quantization: None,
        }
    }

    /// The whole `config.json` text, with the Hugging Face metadata fields a DeepSeek-V3
    /// checkpoint carries (`architectures`, `torch_dtype`, ...).
    pub fn to_hf_json(&self) -> Result<String> {
        let mut value = serde_json::to_value(self)?;
        let obj = value
            .as_object_mut()
            .context("configuration did not serialise to an object")?;
        obj.insert(
            "architectures".into(),
            serde_json::json!([self.model_type.architecture()]),
        );
        obj.insert("torch_dtype".into(), serde_json::json!("float32"));
        obj.insert(
            "num_key_value_heads".into(),
            serde_json::json!(self.num_attention_heads),
        );
        Ok(serde_json::to_string_pretty(&value)?)
    }
}

#[cfg(test)]
mod tests;
