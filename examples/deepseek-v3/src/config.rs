//! The model configuration, read from a Hugging Face `config.json` with DeepSeek-V3's field
//! names, plus the tiny preset that the checkpoint generator writes.

use std::path::Path;

use anyhow::{bail, Context, Result};
use moe_layer::config::MoeConfig;
use serde::{Deserialize, Serialize};

fn one() -> usize {
    1
}

fn one_f64() -> f64 {
    1.0
}

fn silu() -> String {
    "silu".to_string()
}

fn greedy() -> String {
    "greedy".to_string()
}

fn softmax() -> String {
    "softmax".to_string()
}

/// YaRN context extension of the decoupled RoPE (`rope_scaling` in `config.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    /// Scaling kind; only `"yarn"` is supported.
    #[serde(rename = "type", alias = "rope_type")]
    pub kind: String,
    /// Context extension factor.
    pub factor: f64,
    /// Context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
    /// Rotations above which dimensions keep their original frequency.
    #[serde(default = "default_beta_fast")]
    pub beta_fast: f64,
    /// Rotations below which dimensions are fully interpolated.
    #[serde(default = "default_beta_slow")]
    pub beta_slow: f64,
    /// Magnitude correction applied to cos/sin.
    #[serde(default = "one_f64")]
    pub mscale: f64,
    /// Magnitude correction shared by all dimensions (also scales the softmax).
    #[serde(default)]
    pub mscale_all_dim: f64,
}

fn default_beta_fast() -> f64 {
    32.0
}

fn default_beta_slow() -> f64 {
    1.0
}

/// A DeepSeek-V3 model configuration (`DeepseekV3Config` of Hugging Face), limited to the
/// fields inference needs. Unknown fields are ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeepSeekV3Config {
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
    #[serde(default)]
    pub n_shared_experts: Option<usize>,
    /// Routed experts per MoE layer; `null` makes every layer dense.
    #[serde(default)]
    pub n_routed_experts: Option<usize>,
    /// Factor on the routing weights.
    #[serde(default = "one_f64")]
    pub routed_scaling_factor: f64,
    /// Rank of the compressed key/value projection.
    pub kv_lora_rank: usize,
    /// Rank of the compressed query projection; `null` uses a full `q_proj`.
    #[serde(default)]
    pub q_lora_rank: Option<usize>,
    /// Per-head width of the rotary part of queries and keys.
    pub qk_rope_head_dim: usize,
    /// Per-head width of values.
    pub v_head_dim: usize,
    /// Per-head width of the non-rotary part of queries and keys.
    pub qk_nope_head_dim: usize,
    /// Router top-k method (`noaux_tc`, `greedy`, `group_limited_greedy`).
    #[serde(default = "greedy")]
    pub topk_method: String,
    /// Expert groups.
    #[serde(default = "one")]
    pub n_group: usize,
    /// Groups a token may use.
    #[serde(default = "one")]
    pub topk_group: usize,
    /// Experts per token.
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    /// Every `moe_layer_freq`-th layer after the dense ones is an MoE layer.
    #[serde(default = "one")]
    pub moe_layer_freq: usize,
    /// Number of leading dense layers.
    #[serde(default)]
    pub first_k_dense_replace: usize,
    /// Whether the chosen experts' weights are renormalised.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Router score function (`sigmoid` or `softmax`).
    #[serde(default = "softmax")]
    pub scoring_func: String,
    /// MLP activation; only `silu` is supported.
    #[serde(default = "silu")]
    pub hidden_act: String,
    /// Longest supported context.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Optional YaRN scaling.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Whether the attention projections have biases.
    #[serde(default)]
    pub attention_bias: bool,
    /// Whether `lm_head` shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token id.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id.
    #[serde(default)]
    pub eos_token_id: Option<u32>,
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
        if let Some(rs) = &self.rope_scaling {
            if rs.kind != "yarn" {
                bail!(
                    "rope_scaling type {:?} is not supported (only \"yarn\")",
                    rs.kind
                );
            }
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
            hidden_act: silu(),
            max_position_embeddings: 2048,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            attention_bias: false,
            tie_word_embeddings: false,
            bos_token_id: Some(0),
            eos_token_id: Some(1),
        }
    }

    /// The whole `config.json` text, with the Hugging Face metadata fields a DeepSeek-V3
    /// checkpoint carries (`architectures`, `model_type`, `torch_dtype`, ...).
    pub fn to_hf_json(&self) -> Result<String> {
        let mut value = serde_json::to_value(self)?;
        let obj = value
            .as_object_mut()
            .context("configuration did not serialise to an object")?;
        obj.insert(
            "architectures".into(),
            serde_json::json!(["DeepseekV3ForCausalLM"]),
        );
        obj.insert("model_type".into(), serde_json::json!("deepseek_v3"));
        obj.insert("torch_dtype".into(), serde_json::json!("float32"));
        obj.insert(
            "num_key_value_heads".into(),
            serde_json::json!(self.num_attention_heads),
        );
        Ok(serde_json::to_string_pretty(&value)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of DeepSeek-V3's published `config.json` (values typed in, extra fields kept).
    const V3_LIKE: &str = r#"{
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": true,
        "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": false,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
        "tie_word_embeddings": false, "bos_token_id": 0, "eos_token_id": 1,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
    }"#;

    #[test]
    fn parses_a_v3_config() {
        let cfg: DeepSeekV3Config = serde_json::from_str(V3_LIKE).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.q_head_dim(), 192);
        assert!(!cfg.is_moe_layer(2));
        assert!(cfg.is_moe_layer(3));
        let moe = cfg.moe_config().unwrap();
        assert_eq!(moe.n_routed_experts, 256);
        assert_eq!(moe.num_experts_per_tok, 8);
        assert_eq!(cfg.rope_scaling.as_ref().unwrap().factor, 40.0);
    }

    #[test]
    fn the_shipped_v2_lite_config_is_v2_lite_shaped() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/deepseek-v2-lite.json");
        let cfg = DeepSeekV3Config::from_file(path).unwrap();
        assert_eq!(cfg.q_lora_rank, None);
        assert!(!cfg.is_moe_layer(0) && cfg.is_moe_layer(1) && cfg.is_moe_layer(26));
        let moe = cfg.moe_config().unwrap();
        assert_eq!(
            (
                moe.n_routed_experts,
                moe.num_experts_per_tok,
                moe.n_shared_experts
            ),
            (64, 6, Some(2))
        );
        assert_eq!(moe.scoring_func, moe_layer::config::ScoringFunc::Softmax);
        assert_eq!(moe.topk_method, moe_layer::config::TopkMethod::Greedy);
        assert!(!moe.norm_topk_prob && moe.routed_scaling_factor == 1.0);
        // About 15.7 B weights: 31 GB in bf16.
        let n = cfg.num_parameters() as f64 / 1e9;
        assert!((15.6..15.8).contains(&n), "{n} B parameters");
    }

    #[test]
    fn parameter_count_matches_the_generated_tensors() {
        let tiny = DeepSeekV3Config::tiny();
        let dir = std::env::temp_dir().join(format!("dsv3-params-{}", std::process::id()));
        crate::checkpoint::generate(&dir, &tiny, 1, 1).unwrap();
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let bytes = index["metadata"]["total_size"].as_u64().unwrap() as usize;
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(tiny.num_parameters() * 4, bytes);
    }

    #[test]
    fn tiny_round_trips_and_bad_values_are_named() {
        let tiny = DeepSeekV3Config::tiny();
        let back: DeepSeekV3Config = serde_json::from_str(&tiny.to_hf_json().unwrap()).unwrap();
        assert_eq!(back, tiny);
        let mut bad = tiny.clone();
        bad.qk_rope_head_dim = 7;
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("qk_rope_head_dim"));
        let mut bad = tiny;
        bad.hidden_act = "gelu".into();
        assert!(bad.validate().unwrap_err().to_string().contains("gelu"));
    }
}
