//! The gate: per-token expert choice and weights, DeepSeek-V3 grouped top-k (`noaux_tc`) or
//! plain softmax top-k.
//!
//! Logits and scores are computed with candle ops in f32 on the input's device; the selection
//! (a few hundred experts per token) runs on the host over the `[T, E]` scores, with ties broken
//! towards the lower expert (and group) id so that every rank and every backend agrees. The
//! outputs are placed back on the input's device.

use std::cmp::Ordering;

use candle_core::{DType, Device, Error, Result, Tensor};
use candle_nn::VarBuilder;

use crate::config::{MoeConfig, ScoringFunc, TopkMethod};

/// The routing of a batch of tokens.
#[derive(Clone, Debug)]
pub struct Routing {
    /// `[T, K]` i64 global expert ids, best first (never `-1` from the router).
    pub topk_idx: Tensor,
    /// `[T, K]` f32 weights of the chosen experts.
    pub topk_weights: Tensor,
}

/// A MoE gate: a bias-free linear map `[E, H]` from hidden states to expert logits plus the
/// selection rule of the configuration.
#[derive(Clone, Debug)]
pub struct Router {
    /// `[E, H]` f32.
    weight: Tensor,
    /// `[E]` f32 selection bias (`noaux_tc` only).
    bias: Option<Vec<f32>>,
    top_k: usize,
    n_group: usize,
    topk_group: usize,
    scoring: ScoringFunc,
    method: TopkMethod,
    norm_topk_prob: bool,
    scaling: f32,
}

impl Router {
    /// Builds a router from the gate weight `[E, H]` (any float dtype, kept as f32) and, for
    /// `noaux_tc`, the `e_score_correction_bias` `[E]`; `None` there means no correction.
    /// A bias given with another top-k method is an error, as it would be silently ignored.
    pub fn new(weight: Tensor, bias: Option<Tensor>, cfg: &MoeConfig) -> Result<Self> {
        cfg.validate()?;
        let (e, h) = (cfg.n_routed_experts, cfg.hidden_size);
        if weight.dims() != [e, h] {
            return Err(Error::Msg(format!(
                "Router::new: weight has shape {:?}, expected [n_routed_experts, hidden_size] = [{e}, {h}]",
                weight.dims()
            )));
        }
        let bias = match bias {
            None => None,
            Some(b) => {
                if cfg.topk_method != TopkMethod::NoauxTc {
                    return Err(Error::Msg(format!(
                        "Router::new: bias given but topk_method = {:?}; only noaux_tc uses e_score_correction_bias",
                        cfg.topk_method
                    )));
                }
                if b.dims() != [e] {
                    return Err(Error::Msg(format!(
                        "Router::new: bias has shape {:?}, expected [n_routed_experts] = [{e}]",
                        b.dims()
                    )));
                }
                Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?)
            }
        };
        Ok(Self {
            weight: weight.to_dtype(DType::F32)?.contiguous()?,
            bias,
            top_k: cfg.num_experts_per_tok,
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            scoring: cfg.scoring_func,
            method: cfg.topk_method,
            norm_topk_prob: cfg.norm_topk_prob,
            scaling: cfg.routed_scaling_factor as f32,
        })
    }

    /// Loads the gate from `vb` at the layer's `mlp.gate` prefix: `weight` `[E, H]` and, for
    /// `noaux_tc`, `e_score_correction_bias` `[E]` (read as f32 whatever `vb`'s dtype).
    pub fn load(vb: VarBuilder, cfg: &MoeConfig) -> Result<Self> {
        cfg.validate()?;
        let weight = vb.get((cfg.n_routed_experts, cfg.hidden_size), "weight")?;
        let bias = if cfg.topk_method == TopkMethod::NoauxTc {
            Some(vb.get_with_hints_dtype(
                cfg.n_routed_experts,
                "e_score_correction_bias",
                Default::default(),
                DType::F32,
            )?)
        } else {
            None
        };
        Self::new(weight, bias, cfg)
    }

    /// Number of routed experts `E`.
    pub fn num_experts(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Hidden size `H`.
    pub fn hidden_size(&self) -> usize {
        self.weight.dims()[1]
    }

    /// Experts per token `K`.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The gate weight `[E, H]` in f32.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The selection bias `[E]`, if any.
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    /// Expert scores `[T, E]` f32 (sigmoid or softmax of `x @ W^T` computed in f32), on `x`'s device.
    pub fn scores(&self, x: &Tensor) -> Result<Tensor> {
        let (t, h) = x.dims2().map_err(|_| {
            Error::Msg(format!(
                "Router: x has shape {:?}, expected [tokens, hidden_size = {}]",
                x.dims(),
                self.hidden_size()
            ))
        })?;
        if h != self.hidden_size() {
            return Err(Error::Msg(format!(
                "Router: x has hidden size {h} (shape {:?}), expected hidden_size = {}",
                x.dims(),
                self.hidden_size()
            )));
        }
        if t == 0 {
            return Tensor::zeros((0, self.num_experts()), DType::F32, x.device());
        }
        let logits = x
            .to_dtype(DType::F32)?
            .matmul(&self.weight.to_device(x.device())?.t()?)?;
        match self.scoring {
            ScoringFunc::Sigmoid => candle_nn::ops::sigmoid(&logits),
            ScoringFunc::Softmax => candle_nn::ops::softmax_last_dim(&logits),
        }
    }

    /// Routes `x` (`[T, H]`, any float dtype, CPU or CUDA): `topk_idx` `[T, K]` i64 and
    /// `topk_weights` `[T, K]` f32, both on `x`'s device.
    pub fn forward(&self, x: &Tensor) -> Result<Routing> {
        let scores = self.scores(x)?;
        let t = scores.dims()[0];
        let e = self.num_experts();
        let k = self.top_k;
        let host: Vec<f32> = scores.flatten_all()?.to_vec1()?;
        let mut idx = Vec::with_capacity(t * k);
        let mut weights = Vec::with_capacity(t * k);
        let mut scratch = Scratch::default();
        for row in host.chunks_exact(e) {
            self.select(row, &mut scratch, &mut idx, &mut weights);
        }
        let dev: &Device = x.device();
        Ok(Routing {
            topk_idx: Tensor::from_vec(idx, (t, k), dev)?,
            topk_weights: Tensor::from_vec(weights, (t, k), dev)?,
        })
    }

    /// Chooses the experts of one token from its scores and appends ids and weights.
    fn select(&self, scores: &[f32], s: &mut Scratch, idx: &mut Vec<i64>, weights: &mut Vec<f32>) {
        let e = scores.len();
        s.key.clear();
        match (&self.bias, self.method) {
            (Some(bias), TopkMethod::NoauxTc) => {
                s.key.extend(scores.iter().zip(bias).map(|(a, b)| a + b))
            }
            _ => s.key.extend_from_slice(scores),
        }
        let key = &s.key;
        // Descending key, lower id first on ties.
        let better =
            |a: &usize, b: &usize| -> Ordering { key[*b].total_cmp(&key[*a]).then(a.cmp(b)) };

        s.candidates.clear();
        if self.method == TopkMethod::Greedy || self.n_group == 1 {
            s.candidates.extend(0..e);
        } else {
            let per_group = e / self.n_group;
            s.group_score.clear();
            for g in 0..self.n_group {
                let members = &key[g * per_group..(g + 1) * per_group];
                let score = match self.method {
                    TopkMethod::NoauxTc => top2_sum(members),
                    _ => members.iter().copied().fold(f32::NEG_INFINITY, f32::max),
                };
                s.group_score.push(score);
            }
            s.groups.clear();
            s.groups.extend(0..self.n_group);
            let gs = &s.group_score;
            s.groups
                .sort_by(|a, b| gs[*b].total_cmp(&gs[*a]).then(a.cmp(b)));
            s.groups.truncate(self.topk_group);
            s.groups.sort_unstable();
            for &g in &s.groups {
                s.candidates.extend(g * per_group..(g + 1) * per_group);
            }
        }
        s.candidates.sort_by(better);
        let chosen = &s.candidates[..self.top_k];

        let start = weights.len();
        weights.extend(chosen.iter().map(|&c| scores[c]));
        if self.norm_topk_prob {
            let sum: f32 = weights[start..].iter().sum::<f32>() + 1e-20;
            for w in &mut weights[start..] {
                *w /= sum;
            }
        }
        for w in &mut weights[start..] {
            *w *= self.scaling;
        }
        idx.extend(chosen.iter().map(|&c| c as i64));
    }
}

/// Reused per-token buffers of the selection.
#[derive(Default)]
struct Scratch {
    key: Vec<f32>,
    group_score: Vec<f32>,
    groups: Vec<usize>,
    candidates: Vec<usize>,
}

/// Sum of the two largest values (the single value for a group of one).
fn top2_sum(v: &[f32]) -> f32 {
    let mut first = f32::NEG_INFINITY;
    let mut second = f32::NEG_INFINITY;
    for &x in v {
        if x.total_cmp(&first) == Ordering::Greater {
            second = first;
            first = x;
        } else if x.total_cmp(&second) == Ordering::Greater {
            second = x;
        }
    }
    if v.len() < 2 {
        first
    } else {
        first + second
    }
}
