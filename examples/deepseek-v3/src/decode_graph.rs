//! Whole decode steps captured in CUDA graphs.
//!
//! Eager, a decode step launches every kernel of every layer from the host (about thirty per
//! layer: projections, rotary, cache writes, attention, norms), so at small batches the host's
//! launch time, not the GPU, sets the step time. Here the whole step (embedding, every layer
//! with its MoE layer in low-latency mode, final norm, `lm_head`) is captured once per shape
//! and replayed: the host copies the step's token ids and positions into the graph's inputs,
//! launches one graph and reads the logits.
//!
//! A captured step runs over slots `0..B` of the cache (`B` the batch rounded up to a power of
//! two, capped at the cache's slots) and reads keys `0..L` (`L` the longest sequence rounded
//! up to a multiple of `max(128, next power of two / 8)`, at least 256, capped at the
//! context: [`crate::batch::captured_keys`]; powers of two left attention reading up to twice
//! the keys). Padding rows read token 0 at the last position of their (unused) slots: a
//! decode batch is every live sequence, so the slots past it are free, and the last position
//! is masked for every sequence shorter than the context. The graph is reused for every step
//! with the same `(B, L)`; positions, the mask and the cache writes are computed inside it from
//! the inputs.
//!
//! With several ranks each rank captures the shapes of its own batches, whenever they first
//! occur: what must stay in step across ranks is the number of MoE collectives each rank runs
//! per engine step, and a step that captures a new shape runs exactly one real step too (the
//! step eagerly, whose result it returns, then the capture, which executes nothing), the same
//! as a step that replays a graph or a rank without sequences running its layers eagerly.

use std::collections::HashMap;

use candle_core::{Device, Result, Tensor};
use moe_layer::ep_runtime::graph::{capture, warm_up, CapturedGraph};

use crate::batch::BatchPlan;
use crate::kv_cache::KvCache;
use crate::model::{DeepSeekV3, Ffn};

/// One captured step: its inputs, its output, the graph.
struct CapturedStep {
    /// `[B]` u32 token ids (written before every replay).
    ids: Tensor,
    /// `[B]` u32 positions (written before every replay).
    positions: Tensor,
    /// `[B, vocab]` logits in the model dtype (written by every replay).
    logits: Tensor,
    /// Tensors made before the capture that the graph reads (the key positions `0..L` and the
    /// rows `0..B`): held for as long as the graph, which reads their memory by address.
    _constants: [Tensor; 2],
    graph: CapturedGraph,
}

/// The captured steps of one model, by `(B, L)`.
#[derive(Default)]
pub struct DecodeGraphs {
    steps: HashMap<(usize, usize), CapturedStep>,
}

impl std::fmt::Debug for DecodeGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut keys: Vec<_> = self.steps.keys().collect();
        keys.sort();
        f.debug_struct("DecodeGraphs")
            .field("steps", &keys)
            .finish()
    }
}

impl DecodeGraphs {
    /// Whether `model` can decode through captured steps: a CUDA model (one rank or several:
    /// see the module docs).
    pub fn supported(model: &DeepSeekV3) -> bool {
        model.device().is_cuda()
    }

    /// A decode step of every live sequence of `cache` (slot order), `tokens[i]` the new token
    /// of slot `i`: returns the logits `[n, vocab]` in the model's dtype, as the step leaves
    /// them (greedy sampling reads them so: no cast of every sequence's vocabulary row), and
    /// advances the cache. On the first step of a shape the step runs eagerly (that is this
    /// step) and is then captured for the next ones.
    pub fn step(
        &mut self,
        model: &DeepSeekV3,
        cache: &mut KvCache,
        tokens: &[u32],
    ) -> Result<Tensor> {
        let n = tokens.len();
        if n == 0 || n != cache.num_seqs() {
            candle_core::bail!(
                "a captured decode step takes one token for each of the {} live sequences, got {n}",
                cache.num_seqs()
            );
        }
        let capacity = cache.capacity();
        let longest = cache.lens().iter().max().copied().unwrap_or(0) + 1;
        if longest > capacity {
            candle_core::bail!(
                "a sequence of {longest} tokens exceeds the model's context of {capacity}"
            );
        }
        let b = n.next_power_of_two().min(cache.max_seqs());
        let len = crate::batch::captured_keys(longest, capacity);
        let mut ids = vec![0u32; b];
        ids[..n].copy_from_slice(tokens);
        let mut positions = vec![(capacity - 1) as u32; b];
        for (p, &l) in positions.iter_mut().zip(cache.lens()) {
            *p = l as u32;
        }
        let dev = model.device().clone();
        let ids = Tensor::new(ids.as_slice(), &dev)?;
        let positions = Tensor::new(positions.as_slice(), &dev)?;
        let buffers = moe_buffers(model);
        let logits = match self.steps.entry((b, len)) {
            std::collections::hash_map::Entry::Occupied(e) => {
                let step = e.into_mut();
                step.ids.slice_set(&ids, 0, 0)?;
                step.positions.slice_set(&positions, 0, 0)?;
                for buf in &buffers {
                    buf.low_latency_poll().map_err(candle_core::Error::wrap)?;
                }
                step.graph.launch().map_err(candle_core::Error::wrap)?;
                for buf in &buffers {
                    buf.low_latency_note_replay()
                        .map_err(candle_core::Error::wrap)?;
                }
                step.logits.clone()
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                let (step, eager) = CapturedStep::capture(model, cache, &dev, ids, positions, len)?;
                e.insert(step);
                eager
            }
        };
        let logits = logits.narrow(0, 0, n)?;
        cache.advance_all(n);
        Ok(logits)
    }

    /// Number of captured shapes.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Whether no shape was captured yet.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

impl CapturedStep {
    /// Runs the step eagerly on `ids` and `positions` (modules, workspaces, buffers and
    /// candle's layout uploads exist before the capture: see `ep_runtime::graph::warm_up`),
    /// then captures it without running it; returns the captured step and the eager step's
    /// logits (this step's).
    fn capture(
        model: &DeepSeekV3,
        cache: &KvCache,
        dev: &Device,
        ids: Tensor,
        positions: Tensor,
        len: usize,
    ) -> Result<(Self, Tensor)> {
        let b = ids.dim(0)?;
        let keys = Tensor::arange(0u32, len as u32, dev)?.reshape((1, 1, 1, len))?;
        let rows = Tensor::arange(0u32, b as u32, dev)?;
        let body = || -> Result<Tensor> {
            let plan = BatchPlan::captured_decode(
                &positions,
                &keys,
                &rows,
                cache,
                model.rotary(),
                model.dtype(),
            )?;
            let x = model.hidden_states(&ids, cache, &plan, None)?;
            model.logits(&x)
        };
        let eager = warm_up(dev, || body().map_err(moe_layer::ep_runtime::Error::Candle))
            .map_err(candle_core::Error::wrap)?;
        let (graph, logits) = capture(dev, || body().map_err(moe_layer::ep_runtime::Error::Candle))
            .map_err(candle_core::Error::wrap)?;
        Ok((
            Self {
                ids,
                positions,
                logits,
                _constants: [keys, rows],
                graph,
            },
            eager,
        ))
    }
}

/// The distinct communication buffers of the model's MoE layers.
fn moe_buffers(model: &DeepSeekV3) -> Vec<std::sync::Arc<moe_layer::ep_runtime::Buffer>> {
    let mut out: Vec<std::sync::Arc<moe_layer::ep_runtime::Buffer>> = Vec::new();
    for l in model.layers() {
        if let Ffn::Moe(m) = &l.ffn {
            if !out.iter().any(|b| std::sync::Arc::ptr_eq(b, m.buffer())) {
                out.push(m.buffer().clone());
            }
        }
    }
    out
}
