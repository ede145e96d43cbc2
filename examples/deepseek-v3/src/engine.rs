//! The per-rank step engine and the step protocol between ranks.
//!
//! Rank 0 decides every step ([`StepPlan`]) and sends it to all ranks with the EP buffer's host
//! all-gather; each rank runs attention for the sequences it owns (data parallelism) and all
//! ranks call every MoE layer together (expert parallelism), in the same mode; the sampled
//! tokens come back to rank 0 with a second all-gather (with each rank's word on experts being
//! re-placed, `crate::eplb`).

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::dist::Dist;
use crate::eplb::{Eplb, EplbReport};
use crate::kv_cache::KvCache;
use crate::model::{DeepSeekV3, SeqInput, StepKind, StepShape};
use crate::recovery::RankLoss;
use crate::sampling::{Sampler, SamplingParams};
use moe_layer::ep_runtime::Membership;

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
    /// The step's number, counted by rank 0 ([`Cluster::lead_step`] sets it): after a rank is
    /// lost, the step rank 0 did not complete is rolled back on every rank (`crate::recovery`).
    pub step: u64,
    /// Sequences to drop before the step.
    pub free: Vec<SeqId>,
    /// The work.
    pub op: StepOp,
}

#[derive(Clone)]
struct SeqState {
    last: u32,
    sampler: Sampler,
}

/// What a step changed in an engine, kept until it is known to stand: the sequences before it
/// and their cached lengths.
struct Undo {
    step: u64,
    seqs: HashMap<SeqId, SeqState>,
    lens: Vec<(SeqId, usize)>,
}

/// One rank's model, its KV cache and the sequences it owns.
pub struct Engine {
    model: DeepSeekV3,
    cache: KvCache,
    rank: usize,
    seqs: HashMap<SeqId, SeqState>,
    /// Whether steps keep what undoes them (jobs that go on without lost ranks).
    keeps_undo: bool,
    /// How to undo the last step this engine ran.
    undo: Option<Undo>,
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
            keeps_undo: false,
            undo: None,
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

    /// Runs this rank's part of `plan` and returns the tokens sampled for its sequences. With
    /// [`Engine::keep_undo`], a step that fails leaves the engine as it was before it (but for
    /// the freed sequences), and one that succeeds can still be undone by
    /// [`Engine::roll_back`] until the next.
    pub fn run(&mut self, plan: &StepPlan) -> Result<Vec<(SeqId, u32)>> {
        for id in &plan.free {
            self.seqs.remove(id);
            self.cache.remove(*id)?;
        }
        self.undo = None;
        if !self.keeps_undo {
            return self.run_op(plan);
        }
        let undo = Undo {
            step: plan.step,
            seqs: self.seqs.clone(),
            lens: self
                .cache
                .keys()
                .iter()
                .copied()
                .zip(self.cache.lens().iter().copied())
                .collect(),
        };
        match self.run_op(plan) {
            Ok(tokens) => {
                self.undo = Some(undo);
                Ok(tokens)
            }
            Err(e) => {
                self.restore(undo)?;
                Err(e)
            }
        }
    }

    /// Keeps, from the next step on, what undoes each step ([`Engine::roll_back`]): a job
    /// that goes on without lost ranks needs it; otherwise steps skip that host work.
    pub fn keep_undo(&mut self, on: bool) {
        self.keeps_undo = on;
        if !on {
            self.undo = None;
        }
    }

    /// Undoes the last step this engine ran if it is newer than `committed` (the last step
    /// rank 0 completed); returns whether it did.
    pub fn roll_back(&mut self, committed: u64) -> Result<bool> {
        match self.undo.take() {
            Some(undo) if undo.step > committed => {
                self.restore(undo)?;
                Ok(true)
            }
            other => {
                self.undo = other;
                Ok(false)
            }
        }
    }

    fn restore(&mut self, undo: Undo) -> Result<()> {
        let started: Vec<SeqId> = self
            .cache
            .keys()
            .iter()
            .copied()
            .filter(|k| !undo.seqs.contains_key(k))
            .collect();
        for id in started {
            self.cache.remove(id)?;
        }
        for (id, len) in undo.lens {
            self.cache.truncate(id, len)?;
        }
        self.seqs = undo.seqs;
        Ok(())
    }

    fn run_op(&mut self, plan: &StepPlan) -> Result<Vec<(SeqId, u32)>> {
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

    /// Picks each sequence's next token from `logits` (`[n, vocab]`, f32 or the model's dtype):
    /// greedy ones by an argmax on the device (only the ids come back), the others from their
    /// logits row on the host, in f32.
    fn sample(&mut self, inputs: &[SeqInput<'_>], logits: &Tensor) -> Result<Vec<(SeqId, u32)>> {
        let greedy = crate::sampling::greedy_ids(logits)?;
        let mut out = Vec::with_capacity(inputs.len());
        for (i, input) in inputs.iter().enumerate() {
            let s = self
                .seqs
                .get_mut(&input.seq)
                .context("sampled a sequence this rank does not own")?;
            s.last = if s.sampler.is_greedy() {
                greedy[i]
            } else {
                s.sampler
                    .sample(&logits.get(i)?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
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
    /// Agreeing with the other ranks on lost ones (jobs of several ranks).
    pub(crate) membership: Option<Membership>,
    /// Rank 0: the number of the next step.
    next_step: u64,
    /// Rank 0: the last step every rank completed.
    pub(crate) committed: u64,
}

/// What a step came to, seen from rank 0.
#[derive(Debug)]
pub enum StepOutcome {
    /// Every rank ran it: the tokens sampled for every rank's sequences.
    Done(Vec<(SeqId, u32)>),
    /// It broke off because ranks were lost: the ranks that remain agreed on which, rolled the
    /// step back and go on without them.
    Recovered(RankLoss),
}

impl Cluster {
    /// The rank's engine and communication, without load balancing.
    pub fn new(engine: Engine, dist: Dist) -> Self {
        Self {
            engine,
            dist,
            eplb: None,
            eplb_report: None,
            membership: None,
            next_step: 1,
            committed: 0,
        }
    }

    /// With expert load statistics and re-placement ([`Eplb`]).
    pub fn with_eplb(mut self, eplb: Eplb) -> Self {
        self.eplb = Some(eplb);
        self
    }

    /// Going on without ranks that are lost (`crate::recovery`): with `membership`, a step
    /// that breaks off because ranks fail is rolled back and the others go on without them;
    /// without it, such a step is an error.
    pub fn with_membership(mut self, membership: Option<Membership>) -> Self {
        self.engine.keep_undo(membership.is_some());
        self.membership = membership;
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

    /// The ranks lost so far, one flag per rank.
    pub fn lost_ranks(&self) -> Vec<bool> {
        match &self.membership {
            Some(m) => m.lost().to_vec(),
            None => vec![false; self.world_size()],
        }
    }

    /// Rank 0: runs `plan` (its step number set here) on every rank; a step that breaks off
    /// because ranks are lost is rolled back on the others, which go on without them.
    pub fn lead_step(&mut self, plan: &StepPlan) -> Result<StepOutcome> {
        if self.dist.info.rank != 0 {
            bail!("only rank 0 plans steps");
        }
        let plan = StepPlan {
            step: self.next_step,
            ..plan.clone()
        };
        self.next_step += 1;
        let run = serde_json::to_vec(&plan)
            .map_err(anyhow::Error::from)
            .and_then(|bytes| {
                self.dist
                    .all_gather(&bytes)
                    .context("rank 0: cannot send the step plan")
            })
            .and_then(|_| self.run_and_gather(&plan));
        match run {
            Ok(tokens) => {
                self.committed = plan.step;
                Ok(StepOutcome::Done(tokens))
            }
            Err(e) => self.recover(e).map(StepOutcome::Recovered),
        }
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
        let lost = self.lost_ranks();
        let mut tokens = Vec::new();
        let mut all_ready = true;
        for (rank, bytes) in all.iter().enumerate().filter(|(r, _)| !lost[*r]) {
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

    /// Ranks other than 0: follow rank 0's plans until it shuts the job down, going on without
    /// ranks that are lost (as rank 0 does).
    pub fn follow(&mut self) -> Result<()> {
        loop {
            match self.follow_step() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    self.recover(e)?;
                }
            }
        }
    }

    /// Receives and runs one step; returns whether it was the last.
    fn follow_step(&mut self) -> Result<bool> {
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
        Ok(plan.op == StepOp::Shutdown)
    }

    /// Ends the job cleanly (see [`Dist::finish`]), not waiting for lost ranks.
    pub fn finish(&self, timeout: std::time::Duration) -> Result<()> {
        let lost = self.lost_ranks().iter().filter(|&&l| l).count();
        self.dist.finish(timeout, lost)
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
