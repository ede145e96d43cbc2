//! The per-rank step engine and the step protocol between ranks.
//!
//! Rank 0 decides every step ([`StepPlan`]) and sends it to all ranks with the EP buffer's host
//! all-gather; each rank runs attention for the sequences it owns (data parallelism) and all
//! ranks call every MoE layer together (expert parallelism), in the same mode; the sampled
//! tokens come back to rank 0 with a second all-gather (with each rank's word on experts being
//! re-placed, `crate::eplb`).

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::{Tensor, D};
use serde::{Deserialize, Serialize};

use crate::dist::Dist;
use crate::eplb::{Eplb, EplbReport};
use crate::kv_cache::KvCache;
use crate::model::{DeepSeekV3, SeqInput, StepKind, StepShape};
use crate::sampling::{Sampler, SamplingParams};

/// Sequence id, unique for the lifetime of a job.
pub type SeqId = u64;

/// A sequence that starts in a prefill step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NewSeq {
    /// Its id.
    pub id: SeqId,
    /// The rank that owns it (runs its attention and keeps its KV cache).
    pub rank: usize,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// How its tokens are picked.
    pub sampling: SamplingParams,
}

/// What a step does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StepOp {
    /// Nothing to compute (keeps idle ranks from timing out; frees sequences).
    Idle,
    /// Process these new sequences' prompts and sample their first token (normal MoE mode).
    Prefill(Vec<NewSeq>),
    /// One token for every live sequence (low-latency MoE mode).
    Decode,
    /// The job ends.
    Shutdown,
}

/// One step, as rank 0 sends it to every rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepPlan {
    /// Sequences to drop before the step.
    pub free: Vec<SeqId>,
    /// The work.
    pub op: StepOp,
}

struct SeqState {
    last: u32,
    sampler: Sampler,
}

/// One rank's model, its KV cache and the sequences it owns.
pub struct Engine {
    model: DeepSeekV3,
    cache: KvCache,
    rank: usize,
    seqs: HashMap<SeqId, SeqState>,
    /// Captured whole decode steps (CUDA models), if used.
    #[cfg(feature = "cuda")]
    decode_graphs: Option<crate::decode_graph::DecodeGraphs>,
}

impl Engine {
    /// An engine for rank `rank` with room for `max_seqs` live sequences (the KV cache is
    /// allocated here, for [`DeepSeekV3::max_positions`] positions each).
    pub fn new(model: DeepSeekV3, rank: usize, max_seqs: usize) -> Result<Self> {
        let cache = model
            .new_kv_cache(max_seqs)
            .with_context(|| format!("rank {rank}: cannot allocate the KV cache"))?;
        Ok(Self {
            model,
            cache,
            rank,
            seqs: HashMap::new(),
            #[cfg(feature = "cuda")]
            decode_graphs: None,
        })
    }

    /// Decodes through whole steps captured in CUDA graphs when `enabled` and the model
    /// supports it (CUDA: see `decode_graph`); otherwise eagerly.
    #[cfg(feature = "cuda")]
    pub fn with_decode_graphs(mut self, enabled: bool) -> Self {
        self.decode_graphs = (enabled && crate::decode_graph::DecodeGraphs::supported(&self.model))
            .then(Default::default);
        self
    }

    /// Decodes through whole steps captured in CUDA graphs when `enabled` and the model
    /// supports it (CUDA builds only: here always eagerly).
    #[cfg(not(feature = "cuda"))]
    pub fn with_decode_graphs(self, enabled: bool) -> Self {
        let _ = enabled;
        self
    }

    /// Whether decode steps replay captured graphs.
    pub fn uses_decode_graphs(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.decode_graphs.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// The model.
    pub fn model(&self) -> &DeepSeekV3 {
        &self.model
    }

    /// The model, mutable (re-placing its experts between steps).
    pub fn model_mut(&mut self) -> &mut DeepSeekV3 {
        &mut self.model
    }

    /// Number of sequences this rank owns.
    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// Runs this rank's part of `plan` and returns the tokens sampled for its sequences.
    pub fn run(&mut self, plan: &StepPlan) -> Result<Vec<(SeqId, u32)>> {
        for id in &plan.free {
            self.seqs.remove(id);
            self.cache.remove(*id)?;
        }
        match &plan.op {
            StepOp::Idle | StepOp::Shutdown => Ok(Vec::new()),
            StepOp::Prefill(new) => {
                let mine: Vec<&NewSeq> = new.iter().filter(|n| n.rank == self.rank).collect();
                for n in &mine {
                    if self.seqs.contains_key(&n.id) {
                        bail!("rank {}: sequence {} started twice", self.rank, n.id);
                    }
                    self.cache.insert(n.id)?;
                    self.seqs.insert(
                        n.id,
                        SeqState {
                            last: 0,
                            sampler: Sampler::new(n.sampling),
                        },
                    );
                }
                let inputs: Vec<SeqInput<'_>> = mine
                    .iter()
                    .map(|n| SeqInput {
                        seq: n.id,
                        tokens: &n.prompt,
                    })
                    .collect();
                // Every rank has the whole plan, so the MoE layers need not ask each other
                // for the busiest rank's token count.
                let step = StepShape {
                    kind: StepKind::Prefill,
                    most_tokens: Some(most_prefill_tokens(new)),
                };
                self.forward_and_sample(&inputs, step)
            }
            StepOp::Decode => {
                // Slot order: the batch is every live sequence, read from the cache as views.
                let ids: Vec<SeqId> = self.cache.keys().to_vec();
                let last: Vec<[u32; 1]> = ids.iter().map(|id| [self.seqs[id].last]).collect();
                let inputs: Vec<SeqInput<'_>> = ids
                    .iter()
                    .zip(&last)
                    .map(|(&seq, t)| SeqInput { seq, tokens: t })
                    .collect();
                #[cfg(feature = "cuda")]
                if let Some(graphs) = self.decode_graphs.as_mut().filter(|_| !ids.is_empty()) {
                    let tokens: Vec<u32> = last.iter().map(|t| t[0]).collect();
                    let logits = graphs
                        .step(&self.model, &mut self.cache, &tokens)
                        .with_context(|| {
                            format!("rank {}: captured decode step failed", self.rank)
                        })?;
                    return self
                        .sample(&inputs, &logits)
                        .with_context(|| format!("rank {}: sampling failed", self.rank));
                }
                self.forward_and_sample(&inputs, StepKind::Decode.into())
            }
        }
    }

    fn forward_and_sample(
        &mut self,
        inputs: &[SeqInput<'_>],
        step: StepShape,
    ) -> Result<Vec<(SeqId, u32)>> {
        let logits = self
            .model
            .forward(&mut self.cache, inputs, step)
            .with_context(|| format!("rank {}: {:?} step failed", self.rank, step.kind))?;
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        self.sample(inputs, &logits)
            .with_context(|| format!("rank {}: sampling failed", self.rank))
    }

    /// Picks each sequence's next token: greedy ones by an argmax on the device (only the ids
    /// come back), the others from their logits row on the host.
    fn sample(&mut self, inputs: &[SeqInput<'_>], logits: &Tensor) -> Result<Vec<(SeqId, u32)>> {
        let greedy: Vec<u32> = logits.argmax(D::Minus1)?.to_vec1()?;
        let mut out = Vec::with_capacity(inputs.len());
        for (i, input) in inputs.iter().enumerate() {
            let s = self
                .seqs
                .get_mut(&input.seq)
                .context("sampled a sequence this rank does not own")?;
            s.last = if s.sampler.is_greedy() {
                greedy[i]
            } else {
                s.sampler.sample(&logits.get(i)?.to_vec1::<f32>()?)
            };
            out.push((input.seq, s.last));
        }
        Ok(out)
    }
}

/// What a rank sends back after a step: its sequences' tokens, and whether it holds the
/// weights of the experts being re-placed (`crate::eplb`).
#[derive(Debug, Serialize, Deserialize)]
struct StepResult {
    tokens: Vec<(SeqId, u32)>,
    eplb_ready: bool,
}

/// One rank of the serving job: its engine and its communication.
pub struct Cluster {
    /// This rank's engine.
    pub engine: Engine,
    /// This rank's communication.
    pub dist: Dist,
    /// Expert load statistics and re-placement, when on.
    pub eplb: Option<Eplb>,
    /// The last report of [`Cluster::eplb`] not yet taken.
    eplb_report: Option<EplbReport>,
}

impl Cluster {
    /// The rank's engine and communication, without load balancing.
    pub fn new(engine: Engine, dist: Dist) -> Self {
        Self {
            engine,
            dist,
            eplb: None,
            eplb_report: None,
        }
    }

    /// With expert load statistics and re-placement ([`Eplb`]).
    pub fn with_eplb(mut self, eplb: Eplb) -> Self {
        self.eplb = Some(eplb);
        self
    }

    /// The newest load-balancing report since the last call (rank 0: for the metrics).
    pub fn take_eplb_report(&mut self) -> Option<EplbReport> {
        self.eplb_report.take()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.dist.info.world_size
    }

    /// Rank 0: runs `plan` on every rank and returns all sampled tokens (every rank's).
    pub fn lead_step(&mut self, plan: &StepPlan) -> Result<Vec<(SeqId, u32)>> {
        if self.dist.info.rank != 0 {
            bail!("only rank 0 plans steps");
        }
        let bytes = serde_json::to_vec(plan)?;
        self.dist
            .all_gather(&bytes)
            .context("rank 0: cannot send the step plan")?;
        self.run_and_gather(plan)
    }

    fn run_and_gather(&mut self, plan: &StepPlan) -> Result<Vec<(SeqId, u32)>> {
        let mine = StepResult {
            tokens: self.engine.run(plan)?,
            eplb_ready: self.eplb.as_mut().is_none_or(Eplb::ready_here),
        };
        let rank = self.dist.info.rank;
        let all = self
            .dist
            .all_gather(&serde_json::to_vec(&mine)?)
            .with_context(|| format!("rank {rank}: cannot gather the sampled tokens"))?;
        let mut tokens = Vec::new();
        let mut all_ready = true;
        for (rank, bytes) in all.iter().enumerate() {
            let part: StepResult = serde_json::from_slice(bytes)
                .with_context(|| format!("bad step result from rank {rank}"))?;
            tokens.extend(part.tokens);
            all_ready &= part.eplb_ready;
        }
        if let Some(eplb) = self.eplb.as_mut().filter(|_| plan.op != StepOp::Shutdown) {
            // Idle steps land moved weights too; only compute steps count towards the reads.
            let compute = matches!(plan.op, StepOp::Prefill(_) | StepOp::Decode);
            if let Some(report) = eplb
                .after_step(self.engine.model_mut(), &self.dist, all_ready, compute)
                .with_context(|| format!("rank {rank}: expert load balancing failed"))?
            {
                self.eplb_report = Some(report);
            }
        }
        Ok(tokens)
    }

    /// Ranks other than 0: follow rank 0's plans until it shuts the job down.
    pub fn follow(&mut self) -> Result<()> {
        loop {
            let rank = self.dist.info.rank;
            let all = self
                .dist
                .all_gather(&[])
                .with_context(|| format!("rank {rank}: cannot receive the step plan"))?;
            let plan: StepPlan = serde_json::from_slice(
                all.first()
                    .context("all-gather returned no message from rank 0")?,
            )
            .context("bad step plan from rank 0")?;
            self.run_and_gather(&plan)?;
            if plan.op == StepOp::Shutdown {
                return Ok(());
            }
        }
    }
}

/// The most prompt tokens any rank prefills in a step of `new` sequences (0 if none).
fn most_prefill_tokens(new: &[NewSeq]) -> usize {
    let mut per_rank: HashMap<usize, usize> = HashMap::new();
    for n in new {
        *per_rank.entry(n.rank).or_default() += n.prompt.len();
    }
    per_rank.into_values().max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_prefill_tokens_sums_per_rank() {
        let seq = |id, rank, len| NewSeq {
            id,
            rank,
            prompt: vec![1; len],
            sampling: SamplingParams::greedy(),
        };
        assert_eq!(most_prefill_tokens(&[]), 0);
        let new = [seq(1, 0, 3), seq(2, 1, 4), seq(3, 0, 2), seq(4, 3, 1)];
        assert_eq!(most_prefill_tokens(&new), 5);
    }
}
