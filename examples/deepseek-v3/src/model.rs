//! The DeepSeek-V3 model: embedding, decoder layers (pre-norm MLA attention and a dense or MoE
//! feed-forward, both residual), final norm and `lm_head`.
//!
//! One forward call runs a batch of sequences of any lengths (prefill and decode alike): the
//! tokens of all sequences are concatenated, attention runs once for the batch against the
//! slotted [`KvCache`] (data-parallel attention), and each MoE layer is called once with all of
//! this rank's tokens (a collective across ranks, even with zero tokens).

use std::sync::Arc;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder};
use moe_layer::dense::DenseMoe;
use moe_layer::experts::Mlp;
use moe_layer::fp8::Fp8Weight;
use moe_layer::Fp8Mlp;

use crate::attention::Attention;
use crate::batch::BatchPlan;
use crate::config::DeepSeekV3Config;
use crate::kv_cache::{KvCache, KvShape, SeqKey};
use crate::rotary::Rotary;

/// Which kind of step a forward call belongs to; every rank uses the same kind in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StepKind {
    /// Prompt processing: many tokens per sequence; MoE layers use the normal (throughput) mode.
    Prefill,
    /// One token per sequence; MoE layers use the low-latency mode.
    Decode,
}

/// A forward pass's kind and, when the caller knows it, the most tokens any rank brings to
/// it: then the MoE layers split and run a prefill without asking the other ranks
/// ([`moe_layer::Step`]); else each MoE layer that needs the count asks once (a host
/// all-gather per layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    /// Prefill or decode.
    pub kind: StepKind,
    /// The most new tokens any rank has in this step, if known.
    pub most_tokens: Option<usize>,
}

impl From<StepKind> for StepShape {
    fn from(kind: StepKind) -> Self {
        Self {
            kind,
            most_tokens: None,
        }
    }
}

/// The feed-forward part of a layer.
#[derive(Debug)]
pub enum Ffn {
    /// Dense SwiGLU MLP of width `intermediate_size` (the first `first_k_dense_replace` layers).
    Dense(Mlp),
    /// The same on block-scaled fp8 weights (an fp8 checkpoint on CUDA: `moe_layer::Fp8Mlp`).
    DenseFp8(Fp8Mlp),
    /// Expert-parallel MoE layer: this rank's experts; every call is a collective.
    Moe(Box<moe_layer::MoeLayer>),
    /// All experts in this process (single-process reference path, no communication).
    DenseMoe(DenseMoe),
}

impl Ffn {
    /// Whether calling this layer involves the other ranks.
    pub fn is_collective(&self) -> bool {
        matches!(self, Ffn::Moe(_))
    }

    /// Runs the layer on `x: [T, hidden]` (`T` may be 0 for MoE layers).
    pub fn forward(&self, x: &Tensor, step: StepShape) -> Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::DenseFp8(m) => Ok(m.forward(x)?),
            Ffn::Moe(m) => match step.kind {
                StepKind::Prefill => match step.most_tokens {
                    Some(most) => {
                        m.forward_step(x, moe_layer::Step::new(moe_layer::Mode::Normal, most))
                    }
                    None => m.forward_with_mode(x, moe_layer::Mode::Normal),
                },
                // Low-latency mode; on one GPU through captured CUDA graphs.
                StepKind::Decode => m.forward_decode(x),
            },
            Ffn::DenseMoe(m) => m.forward(x),
        }
    }

    /// [`Ffn::forward`] as a decode step being captured into a CUDA graph runs it: MoE layers
    /// eagerly in low-latency mode (their kernels join the step's graph).
    pub(crate) fn forward_captured(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Ffn::Moe(m) => m.forward_with_mode(x, moe_layer::Mode::LowLatency),
            other => other.forward(x, StepKind::Decode.into()),
        }
    }
}

/// Whether an fp8 checkpoint's dense MLP of hidden size `h` and inner width `i` stays fp8 on a
/// device: on CUDA, sizes the fp8 GEMMs take, and its narrowest GEMM (`down_proj`, `h` outputs)
/// at least [`crate::attention::FP8_MIN_OUTPUTS`] wide.
pub fn fp8_dense_mlp(h: usize, i: usize, cuda: bool) -> bool {
    cuda && h >= crate::attention::FP8_MIN_OUTPUTS && Fp8Mlp::takes(h, i)
}

/// The dense MLP at `vb` (`gate_proj`, `up_proj`, `down_proj`): an fp8 checkpoint's stays fp8
/// where [`fp8_dense_mlp`] says so; otherwise float weights (as stored, or dequantized once at
/// load).
pub fn load_dense_mlp(vb: VarBuilder, hidden: usize, inter: usize) -> Result<Ffn> {
    if fp8_dense_mlp(hidden, inter, vb.device().is_cuda()) {
        let gate = Fp8Weight::load(&vb.pp("gate_proj"), inter, hidden)?;
        let up = Fp8Weight::load(&vb.pp("up_proj"), inter, hidden)?;
        let down = Fp8Weight::load(&vb.pp("down_proj"), hidden, inter)?;
        if let (Some(g), Some(u), Some(d)) = (gate, up, down) {
            return Ok(Ffn::DenseFp8(Fp8Mlp::new(&g, &u, d)?));
        }
    }
    Ok(Ffn::Dense(Mlp::load(vb, hidden, inter)?))
}

/// The bytes [`load_dense_mlp`] holds for `cfg`'s dense MLP in float weights of `dtype_bytes`
/// a value, or in fp8 with its scales where [`fp8_dense_mlp`] keeps it (`fp8_on_cuda`).
pub fn dense_mlp_bytes(cfg: &DeepSeekV3Config, dtype_bytes: usize, fp8_on_cuda: bool) -> usize {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    if fp8_dense_mlp(h, i, fp8_on_cuda) {
        3 * h * i + 4 * 3 * h.div_ceil(128) * i.div_ceil(128)
    } else {
        3 * h * i * dtype_bytes
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
    rotary: Arc<Rotary>,
    kv_shape: KvShape,
    hidden: usize,
    device: Device,
    dtype: DType,
}

/// Bytes of a model's weights on one rank, by kind ([`DeepSeekV3::weight_bytes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelBytes {
    /// This rank's routed experts.
    pub routed_experts: usize,
    /// The shared experts.
    pub shared_experts: usize,
    /// Everything else: embedding, attention, dense MLPs, routers, norms, `lm_head`.
    pub other: usize,
}

impl ModelBytes {
    /// All of them.
    pub fn total(&self) -> usize {
        self.routed_experts + self.shared_experts + self.other
    }
}

/// Bytes of a tensor's elements.
fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl DecoderLayer {
    /// Bytes of the layer's weights on this rank, by kind.
    pub fn weight_bytes(&self) -> ModelBytes {
        let mut b = ModelBytes {
            other: self.attn.weight_bytes()
                + bytes(self.input_norm.clone().into_inner().weight())
                + bytes(self.post_norm.clone().into_inner().weight()),
            ..Default::default()
        };
        match &self.ffn {
            Ffn::Dense(m) => b.other += m.weight_bytes(),
            Ffn::DenseFp8(m) => b.other += m.weight_bytes(),
            Ffn::Moe(m) => {
                let w = m.weight_bytes();
                b.routed_experts += w.routed;
                b.shared_experts += w.shared;
                b.other += w.router;
            }
            Ffn::DenseMoe(m) => b.routed_experts += m.weight_bytes(),
        }
        b
    }
}

/// One sequence in a batched forward call: its cache key and its new tokens.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// The sequence (inserted in the cache beforehand).
    pub seq: SeqKey,
    /// Tokens to append (the whole prompt at prefill, the last sampled token at decode).
    pub tokens: &'a [u32],
}

impl DeepSeekV3 {
    /// Bytes of the weights this rank holds, by kind (what loading an fp8 checkpoint saves).
    pub fn weight_bytes(&self) -> ModelBytes {
        let mut b = ModelBytes {
            other: bytes(self.embed.embeddings())
                + bytes(self.norm.clone().into_inner().weight())
                // Tied embeddings: one tensor, counted once.
                + if self.lm_head.weight().id() == self.embed.embeddings().id() {
                    0
                } else {
                    bytes(self.lm_head.weight())
                },
            ..Default::default()
        };
        for l in &self.layers {
            let w = l.weight_bytes();
            b.routed_experts += w.routed_experts;
            b.shared_experts += w.shared_experts;
            b.other += w.other;
        }
        b
    }

    /// Assembles a model from loaded parts; `rotary` bounds the context (its table length).
    pub fn new(
        embed: Embedding,
        layers: Vec<DecoderLayer>,
        norm: RmsNorm,
        lm_head: Linear,
        rotary: Arc<Rotary>,
        kv_shape: KvShape,
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
            rotary,
            kv_shape,
            hidden,
        })
    }

    /// How many dense weights run on the fp8 GEMMs: attention projections, and the three of
    /// each dense MLP kept in fp8.
    pub fn fp8_dense_weights(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                l.attn.fp8_projections()
                    + if matches!(l.ffn, Ffn::DenseFp8(_)) {
                        3
                    } else {
                        0
                    }
            })
            .sum()
    }

    /// Whether the routed experts run on the fp8 grouped GEMMs (block-scaled fp8 weights on a
    /// GPU whose shapes they take).
    pub fn fp8_experts(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(&l.ffn, Ffn::Moe(m) if m.experts().is_fp8()))
    }

    /// The expert-parallel MoE layers, with their layer index.
    pub fn moe_layers(&self) -> impl Iterator<Item = (usize, &moe_layer::MoeLayer)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match &l.ffn {
                Ffn::Moe(m) => Some((i, m.as_ref())),
                _ => None,
            })
    }

    /// [`DeepSeekV3::moe_layers`], mutable (re-placement).
    pub fn moe_layers_mut(&mut self) -> impl Iterator<Item = (usize, &mut moe_layer::MoeLayer)> {
        self.layers
            .iter_mut()
            .enumerate()
            .filter_map(|(i, l)| match &mut l.ffn {
                Ffn::Moe(m) => Some((i, m.as_mut())),
                _ => None,
            })
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Longest sequence (prompt plus generated tokens) the model accepts.
    pub fn max_positions(&self) -> usize {
        self.rotary.max_positions()
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Vocabulary size (rows of `lm_head`).
    pub fn vocab_size(&self) -> usize {
        self.lm_head.weight().dims()[0]
    }

    /// The sizes of this model's KV cache entries.
    pub fn kv_shape(&self) -> KvShape {
        self.kv_shape
    }

    /// An empty KV cache for up to `max_seqs` sequences of [`DeepSeekV3::max_positions`].
    pub fn new_kv_cache(&self, max_seqs: usize) -> Result<KvCache> {
        KvCache::new(
            self.kv_shape,
            max_seqs,
            self.max_positions(),
            self.dtype,
            &self.device,
        )
    }

    /// Runs the new tokens of every sequence in `seqs` and returns the logits of each sequence's
    /// last token, `[seqs.len(), vocab]` in f32, in the order of `seqs`. The sequences must be
    /// in `cache` and fill a contiguous run of its slots (all live sequences, or the ones added
    /// last); each brings at least one token. With no sequences this rank still takes part in
    /// every MoE layer's collective with zero tokens.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        step: impl Into<StepShape>,
    ) -> Result<Tensor> {
        let step = step.into();
        if seqs.is_empty() {
            let empty = Tensor::zeros((0, self.hidden), self.dtype, &self.device)?;
            for layer in self.layers.iter().filter(|l| l.ffn.is_collective()) {
                layer.ffn.forward(&empty, step)?;
            }
            return Tensor::zeros((0, self.vocab_size()), DType::F32, &self.device);
        }
        let batch: Vec<(SeqKey, &[u32])> = seqs.iter().map(|s| (s.seq, s.tokens)).collect();
        let (plan, ids) = BatchPlan::new(&batch, cache, &self.rotary, self.dtype, &self.device)?;
        let ids = Tensor::new(ids.as_slice(), &self.device)?;
        let x = self.hidden_states(&ids, cache, &plan, Some(step))?;
        cache.advance(&plan);
        let last = plan.last_rows(&x)?;
        self.logits(&last)?.to_dtype(DType::F32)
    }

    /// The decoder layers over the tokens `ids` laid out by `plan`: `[total, hidden]` before the
    /// final norm. `step` `None`: a decode step being captured ([`Ffn::forward_captured`]).
    pub(crate) fn hidden_states(
        &self,
        ids: &Tensor,
        cache: &KvCache,
        plan: &BatchPlan,
        step: Option<StepShape>,
    ) -> Result<Tensor> {
        let mut x = self.embed.forward(ids)?; // [total, hidden]
        for (l, layer) in self.layers.iter().enumerate() {
            let h = layer.input_norm.forward(&x)?;
            x = (x + layer.attn.forward(&h, cache, l, plan)?)?;
            let h = layer.post_norm.forward(&x)?;
            let f = match step {
                Some(step) => layer.ffn.forward(&h, step)?,
                None => layer.ffn.forward_captured(&h)?,
            };
            x = (&x + f)?;
        }
        Ok(x)
    }

    /// Final norm and `lm_head` of hidden rows `[n, hidden]`: `[n, vocab]` in the model dtype.
    pub(crate) fn logits(&self, x: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(&self.norm.forward(x)?)
    }

    /// The decoder layers (for the captured decode steps).
    #[cfg(feature = "cuda")]
    pub(crate) fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    /// The rotary tables.
    #[cfg(feature = "cuda")]
    pub(crate) fn rotary(&self) -> &Rotary {
        &self.rotary
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
