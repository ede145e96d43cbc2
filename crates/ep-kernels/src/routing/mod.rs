//! Routing: each token's top-k experts and their weights from the gate's expert scores, with
//! DeepSeek's group-limited selection and correction bias. Kernel `routing.cu` (one warp per
//! token), typed launcher [`route_topk_cuda`], host twin [`route_topk`]. The gate's logits
//! `x W^T` for a few tokens come from [`gate`] (kernel `gate.cu`, launcher `gate_logits_cuda`,
//! host twin [`gate_logits`]), for many bf16 tokens from cuBLAS on the tensor cores
//! (`gate_logits_gemm_cuda`, same host twin).
//!
//! The router takes either the scores `s[E]` of every token ([`TopkInput::Scores`]) or its
//! gate logits ([`TopkInput::Logits`]), which it scores itself with [`scoring`] (sigmoid, or
//! softmax over the token's `E` logits; the same f32 operations in the kernel and the twin).
//! For every token, from its scores:
//! 1. the selection key is `s + bias` (with a bias) or `s`;
//! 2. with groups ([`GroupScore::Top2Sum`] / [`GroupScore::Max`]), experts `g*E/G..` form group
//!    `g`; a group's score is the sum of its two best keys, or its best key; only the
//!    `topk_group` best groups keep their experts;
//! 3. the `top_k` best remaining keys are chosen, best first;
//! 4. the weights are the chosen experts' unbiased scores, optionally divided by their sum
//!    (plus 1e-20), then multiplied by `scaling`.
//!
//! "Best" is the descending IEEE total order of `f32::total_cmp`, ties to the lower expert
//! (or group) id, so every backend and rank picks the same experts; the weights are computed
//! with the same f32 operations in the same order on both sides (bit-identical).

pub mod gate;
pub mod host;
pub mod scoring;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;
#[cfg(feature = "cuda")]
mod gate_gemm;
#[cfg(feature = "cuda")]
pub use gate_gemm::gate_logits_gemm_cuda;

pub use gate::{
    gate_logits, gate_uses_kernel, GateInput, GateShape, GATE_KERNEL_MAX_TOKENS,
    GATE_KERNEL_MAX_TOKENS_BESIDE_GEMM,
};
pub use host::route_topk;

use crate::error::{Error, Result};

/// Most experts a token may choose from on the device (32 per lane of the token's warp).
pub const MAX_EXPERTS: usize = 1024;
/// Most experts per token (`top_k`) and most groups on the device.
pub const MAX_TOPK: usize = 32;

/// How a token's gate logits become its expert scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// `1 / (1 + e^-l)` per expert ([`scoring::sigmoid`]).
    Sigmoid,
    /// Softmax over the token's experts ([`scoring::softmax`]).
    Softmax,
}

/// What the `[T, E]` values handed to the router are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopkInput {
    /// Expert scores, used as they are.
    Scores,
    /// Gate logits, scored by the router first.
    Logits(Scoring),
}

/// How a group of experts is scored for group-limited routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupScore {
    /// No groups: top-k over all experts.
    None,
    /// Sum of the group's two best keys (DeepSeek-V3 `noaux_tc`).
    Top2Sum,
    /// The group's best key (DeepSeek-V2 `group_limited_greedy`).
    Max,
}

/// What a router selects; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopkSpec {
    /// Number of experts `E`.
    pub num_experts: usize,
    /// Experts per token `K`.
    pub top_k: usize,
    /// Number of groups `G` (`E % G == 0`; 1 when [`GroupScore::None`]).
    pub n_group: usize,
    /// Groups a token may choose from.
    pub topk_group: usize,
    /// How groups are scored.
    pub group_score: GroupScore,
    /// Whether the chosen weights are renormalised to sum to one.
    pub norm_topk_prob: bool,
    /// Factor applied to the weights last.
    pub scaling: f32,
}

impl TopkSpec {
    /// Checks the lengths of a routing call (`scores` (or logits) `[T, E]`, `bias` `[E]`, outputs
    /// `[T, K]`); returns `T`.
    pub fn check_lengths(
        &self,
        scores: usize,
        bias: Option<usize>,
        topk_idx: usize,
        topk_weights: usize,
    ) -> Result<usize> {
        let (e, k) = (self.num_experts, self.top_k);
        if scores % e != 0 {
            return Err(Error::invalid(
                "scores",
                format!("{scores} values"),
                format!("must be whole rows of num_experts = {e}"),
            ));
        }
        let t = scores / e;
        if let Some(b) = bias {
            Error::check_len("bias", e, b)?;
        }
        Error::check_len("topk_idx", t * k, topk_idx)?;
        Error::check_len("topk_weights", t * k, topk_weights)?;
        Ok(t)
    }

    /// Checks the spec's consistency (and the device limits when `device`).
    pub fn check(&self, device: bool) -> Result<()> {
        let e = self.num_experts;
        if e == 0 {
            return Err(Error::invalid("num_experts", e, "must be positive"));
        }
        let groups = self.group_score != GroupScore::None;
        if groups && (self.n_group == 0 || e % self.n_group != 0) {
            return Err(Error::invalid(
                "n_group",
                self.n_group,
                format!("must divide num_experts = {e}"),
            ));
        }
        if groups && (self.topk_group == 0 || self.topk_group > self.n_group) {
            return Err(Error::invalid(
                "topk_group",
                self.topk_group,
                format!("must be in 1..=n_group = {}", self.n_group),
            ));
        }
        let candidates = if groups {
            self.topk_group * (e / self.n_group)
        } else {
            e
        };
        if self.top_k == 0 || self.top_k > candidates {
            return Err(Error::invalid(
                "top_k",
                self.top_k,
                format!("must be in 1..={candidates} (the experts a token can reach)"),
            ));
        }
        if device {
            if e > MAX_EXPERTS {
                return Err(Error::invalid(
                    "num_experts",
                    e,
                    format!("the CUDA router handles at most {MAX_EXPERTS}"),
                ));
            }
            if self.top_k > MAX_TOPK || (groups && self.n_group > MAX_TOPK) {
                return Err(Error::invalid(
                    "top_k / n_group",
                    format!("{} / {}", self.top_k, self.n_group),
                    format!("the CUDA router handles at most {MAX_TOPK} of each"),
                ));
            }
        }
        Ok(())
    }
}
