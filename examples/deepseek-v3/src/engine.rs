//! The per-rank step engine and the step protocol between ranks.
//!
//! Rank 0 decides every step ([`StepPlan`]) and sends it to all ranks with the EP buffer's host
//! all-gather; each rank runs attention for the sequences it owns (data parallelism) and all
//! ranks call every MoE layer together (expert parallelism), in the same mode; the sampled
//! tokens come back to rank 0 with a second all-gather.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::dist::Dist;
use crate::model::{DeepSeekV3, SeqCache, SeqInput, StepKind};
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
    cache: SeqCache,
    last: u32,
    sampler: Sampler,
}

/// One rank's model and the sequences it owns.
pub struct Engine {
    model: DeepSeekV3,
    rank: usize,
    seqs: HashMap<SeqId, SeqState>,
}

impl Engine {
    /// An engine for rank `rank`.
    pub fn new(model: DeepSeekV3, rank: usize) -> Self {
        Self {
            model,
            rank,
            seqs: HashMap::new(),
        }
    }

    /// The model.
    pub fn model(&self) -> &DeepSeekV3 {
        &self.model
    }

    /// Number of sequences this rank owns.
    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// Runs this rank's part of `plan` and returns the tokens sampled for its sequences.
    pub fn run(&mut self, plan: &StepPlan) -> Result<Vec<(SeqId, u32)>> {
        for id in &plan.free {
            self.seqs.remove(id);
        }
        match &plan.op {
            StepOp::Idle | StepOp::Shutdown => Ok(Vec::new()),
            StepOp::Prefill(new) => {
                let mine: Vec<&NewSeq> = new.iter().filter(|n| n.rank == self.rank).collect();
                let mut states: Vec<(SeqId, SeqState)> = Vec::with_capacity(mine.len());
                for n in &mine {
                    if self.seqs.contains_key(&n.id) {
                        bail!("rank {}: sequence {} started twice", self.rank, n.id);
                    }
                    states.push((
                        n.id,
                        SeqState {
                            cache: self.model.new_cache(),
                            last: 0,
                            sampler: Sampler::new(n.sampling),
                        },
                    ));
                }
                let prompts: Vec<&[u32]> = mine.iter().map(|n| n.prompt.as_slice()).collect();
                let out = self.forward_and_sample(&mut states, &prompts, StepKind::Prefill)?;
                self.seqs.extend(states);
                Ok(out)
            }
            StepOp::Decode => {
                let mut ids: Vec<SeqId> = self.seqs.keys().copied().collect();
                ids.sort_unstable();
                let mut states: Vec<(SeqId, SeqState)> = ids
                    .iter()
                    .map(|id| (*id, self.seqs.remove(id).expect("id from the map")))
                    .collect();
                let inputs: Vec<[u32; 1]> = states.iter().map(|(_, s)| [s.last]).collect();
                let inputs: Vec<&[u32]> = inputs.iter().map(|a| a.as_slice()).collect();
                let out = self.forward_and_sample(&mut states, &inputs, StepKind::Decode);
                self.seqs.extend(states);
                out
            }
        }
    }

    fn forward_and_sample(
        &self,
        states: &mut [(SeqId, SeqState)],
        tokens: &[&[u32]],
        kind: StepKind,
    ) -> Result<Vec<(SeqId, u32)>> {
        let mut inputs: Vec<SeqInput<'_>> = states
            .iter_mut()
            .zip(tokens)
            .map(|((_, s), t)| SeqInput {
                tokens: t,
                cache: &mut s.cache,
            })
            .collect();
        let logits = self
            .model
            .forward(&mut inputs, kind)
            .with_context(|| format!("rank {}: {kind:?} step failed", self.rank))?;
        drop(inputs);
        if states.is_empty() {
            return Ok(Vec::new());
        }
        let rows = DeepSeekV3::logits_rows(&logits)?;
        Ok(states
            .iter_mut()
            .zip(rows)
            .map(|((id, s), row)| {
                s.last = s.sampler.sample(&row);
                (*id, s.last)
            })
            .collect())
    }
}

/// One rank of the serving job: its engine and its communication.
pub struct Cluster {
    /// This rank's engine.
    pub engine: Engine,
    /// This rank's communication.
    pub dist: Dist,
}

impl Cluster {
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
        self.dist.all_gather(&bytes)?;
        self.run_and_gather(plan)
    }

    fn run_and_gather(&mut self, plan: &StepPlan) -> Result<Vec<(SeqId, u32)>> {
        let mine = self.engine.run(plan)?;
        let all = self.dist.all_gather(&serde_json::to_vec(&mine)?)?;
        let mut tokens = Vec::new();
        for (rank, bytes) in all.iter().enumerate() {
            let part: Vec<(SeqId, u32)> = serde_json::from_slice(bytes)
                .with_context(|| format!("bad step result from rank {rank}"))?;
            tokens.extend(part);
        }
        Ok(tokens)
    }

    /// Ranks other than 0: follow rank 0's plans until it shuts the job down.
    pub fn follow(&mut self) -> Result<()> {
        loop {
            let all = self.dist.all_gather(&[])?;
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
