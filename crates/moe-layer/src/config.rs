//! The MoE part of a model's `config.json`, with the field names of Hugging Face's DeepSeek-V3
//! configuration, and the checks that the router and experts rely on.

use std::path::Path;

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// How router logits become expert scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoringFunc {
    /// Independent per-expert scores `sigmoid(logit)` (DeepSeek-V3).
    Sigmoid,
    /// Scores that sum to one over all experts, `softmax(logits)` (DeepSeek-V2, Mixtral, Qwen).
    Softmax,
}

/// How the router picks the `num_experts_per_tok` experts of a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopkMethod {
    /// DeepSeek-V3's auxiliary-loss-free balancing: selection uses `score + e_score_correction_bias`,
    /// restricted to the `topk_group` groups whose two best selection scores sum highest; the
    /// weights use the unbiased scores.
    NoauxTc,
    /// Plain top-k over all experts' scores.
    Greedy,
    /// DeepSeek-V2's device-limited routing: keep the `topk_group` groups with the highest
    /// single expert score, then top-k by score among them (no bias).
    GroupLimitedGreedy,
}

fn default_one() -> usize {
    1
}

fn default_scaling() -> f64 {
    1.0
}

fn default_scoring() -> ScoringFunc {
    ScoringFunc::Softmax
}

fn default_topk_method() -> TopkMethod {
    TopkMethod::Greedy
}

/// Mixture-of-Experts hyper-parameters, read from a Hugging Face `config.json`.
///
/// Fields that DeepSeek-V2/V3 configurations always carry are required; the others default to
/// the values of Hugging Face's `DeepseekV2Config` (no shared expert, one group, no scaling,
/// no renormalisation, softmax scoring, greedy top-k). Unknown fields are ignored, so a whole
/// model configuration can be parsed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Model width `H`: the length of a token's hidden vector.
    pub hidden_size: usize,
    /// Inner width `I` of one routed expert's SwiGLU MLP.
    pub moe_intermediate_size: usize,
    /// Number of routed experts `E`.
    pub n_routed_experts: usize,
    /// Experts chosen per token `K`.
    pub num_experts_per_tok: usize,
    /// Number of shared experts, fused into one MLP of width `moe_intermediate_size * n`;
    /// `None` or `Some(0)` means none.
    #[serde(default)]
    pub n_shared_experts: Option<usize>,
    /// Number of expert groups for group-limited routing (experts `g*E/n_group..` form group `g`).
    #[serde(default = "default_one")]
    pub n_group: usize,
    /// Number of groups a token may pick experts from.
    #[serde(default = "default_one")]
    pub topk_group: usize,
    /// Factor applied to the routing weights after the optional renormalisation.
    #[serde(default = "default_scaling")]
    pub routed_scaling_factor: f64,
    /// Whether the chosen experts' weights are renormalised to sum to one.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Logit-to-score function.
    #[serde(default = "default_scoring")]
    pub scoring_func: ScoringFunc,
    /// Expert selection method.
    #[serde(default = "default_topk_method")]
    pub topk_method: TopkMethod,
}

impl MoeConfig {
    /// Parses a configuration from JSON text (a whole model `config.json` is fine) and validates it.
    pub fn from_json_str(json: &str) -> Result<Self> {
        let cfg: MoeConfig = serde_json::from_str(json).map_err(|e| {
            Error::invalid(
                "json",
                e,
                "must be a model configuration with the MoE fields",
            )
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and validates the configuration in the JSON file at `path`.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::invalid("path", path.display(), format!("cannot be read: {e}")))?;
        Self::from_json_str(&text)
    }

    /// Whether the top-k method restricts each token to `topk_group` of `n_group` groups.
    pub fn group_limited(&self) -> bool {
        matches!(
            self.topk_method,
            TopkMethod::NoauxTc | TopkMethod::GroupLimitedGreedy
        )
    }

    /// Experts per group, `n_routed_experts / n_group`.
    pub fn experts_per_group(&self) -> usize {
        self.n_routed_experts / self.n_group.max(1)
    }

    /// Inner width of the fused shared-expert MLP, or `None` when the layer has no shared expert.
    pub fn shared_intermediate_size(&self) -> Option<usize> {
        match self.n_shared_experts {
            Some(n) if n > 0 => Some(self.moe_intermediate_size * n),
            _ => None,
        }
    }

    /// Checks the invariants the router and experts rely on; errors name the field, its value
    /// and the limit it breaks.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(Error::invalid(name, 0, "must be at least 1"));
            }
        }
        if !self.routed_scaling_factor.is_finite() {
            return Err(Error::invalid(
                "routed_scaling_factor",
                self.routed_scaling_factor,
                "must be a finite number",
            ));
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err(Error::invalid(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                format!("must be <= n_routed_experts = {}", self.n_routed_experts),
            ));
        }
        if self.n_routed_experts % self.n_group != 0 {
            return Err(Error::invalid(
                "n_routed_experts",
                self.n_routed_experts,
                format!("must be a multiple of n_group = {}", self.n_group),
            ));
        }
        if self.topk_group > self.n_group {
            return Err(Error::invalid(
                "topk_group",
                self.topk_group,
                format!("must be <= n_group = {}", self.n_group),
            ));
        }
        if self.group_limited() {
            let reachable = self.topk_group * self.experts_per_group();
            if self.num_experts_per_tok > reachable {
                return Err(Error::invalid(
                    "num_experts_per_tok",
                    self.num_experts_per_tok,
                    format!(
                        "must be <= the {reachable} experts of the topk_group = {} groups a \
                         token may use (n_routed_experts {} / n_group {} = {} experts per group)",
                        self.topk_group,
                        self.n_routed_experts,
                        self.n_group,
                        self.experts_per_group()
                    ),
                ));
            }
        }
        Ok(())
    }
}
