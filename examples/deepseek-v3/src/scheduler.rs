//! Rank 0's continuous-batching loop: admits requests, places each new sequence on the rank
//! with the fewest sequences, alternates prefill steps (new prompts, normal MoE mode) and
//! decode steps (one token for every live sequence, low-latency MoE mode), detokenizes, applies
//! stop conditions, streams events back to whoever asked, and keeps the serving [`Metrics`].

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::{Cluster, NewSeq, SeqId, StepOp, StepOutcome, StepPlan};
use crate::metrics::Metrics;
use crate::recovery::RankLoss;
use crate::sampling::SamplingParams;
use crate::tokenizer::TextTokenizer;

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` (or the context) was reached.
    Length,
}

impl FinishReason {
    /// The OpenAI spelling (`stop`, `length`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// When a sequence's milestones happened, from its arrival.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SeqTiming {
    /// Arrival to the prefill step that took it.
    pub queue: Duration,
    /// Arrival to its first token.
    pub first_token: Duration,
    /// Arrival to its last token.
    pub total: Duration,
}

impl SeqTiming {
    /// Mean time per output token after the first, over `tokens` tokens (`None` below 2).
    pub fn per_token(&self, tokens: usize) -> Option<Duration> {
        (tokens >= 2).then(|| (self.total - self.first_token) / (tokens as u32 - 1))
    }
}

/// What a request hears back.
#[derive(Clone, Debug, PartialEq)]
pub enum GenEvent {
    /// New text of sequence `index` (only complete UTF-8 characters). The first token always
    /// sends one, even when its text is still empty, so streams show the time to first token.
    Delta {
        /// The request's sequence index.
        index: usize,
        /// Text added since the last delta.
        text: String,
    },
    /// Sequence `index` ended.
    Done {
        /// The request's sequence index.
        index: usize,
        /// All generated text (stop strings cut off).
        text: String,
        /// All generated tokens (a final stop token excluded).
        tokens: Vec<u32>,
        /// Why it ended.
        finish_reason: FinishReason,
        /// Number of prompt tokens.
        prompt_tokens: usize,
        /// When it got its first and last tokens.
        timing: SeqTiming,
    },
    /// Sequence `index` cannot go on (the rank that held it was lost); nothing more comes.
    Failed {
        /// The request's sequence index.
        index: usize,
        /// Why, a sentence for the client.
        message: String,
    },
}

/// One sequence to generate.
#[derive(Clone, Debug)]
pub struct GenRequest {
    /// Index of this sequence within its request (choices of one HTTP request, or prompts of
    /// a `generate` run).
    pub index: usize,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token choice.
    pub sampling: SamplingParams,
    /// Tokens that end the sequence (not part of the output).
    pub stop_tokens: Vec<u32>,
    /// Strings that end the sequence (cut from the output).
    pub stop_strings: Vec<String>,
    /// Where events go; a closed receiver cancels the sequence.
    pub events: UnboundedSender<GenEvent>,
    /// When the request arrived (timings are measured from here).
    pub arrival: Instant,
}

/// Scheduler limits.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Most live sequences per rank (also the low-latency token limit per rank).
    pub max_batch_per_rank: usize,
    /// Most prompt tokens of one prefill step on each rank (a longer prompt still goes alone):
    /// bounds a rank's activations, attention scores and MoE dispatch in a step, so a job of N
    /// ranks prefills up to N times as many tokens per step as one GPU.
    pub max_prefill_tokens: usize,
    /// How often an idle multi-rank job runs an empty step, so waiting ranks do not time out.
    pub heartbeat: Duration,
}

struct Active {
    req: GenRequest,
    rank: usize,
    tokens: Vec<u32>,
    emitted: usize,
    queue: Duration,
    first_token: Option<Duration>,
    last_token: Instant,
}

impl Active {
    /// Handles a new token that arrived at `now`; returns whether the sequence is finished.
    fn push(
        &mut self,
        token: u32,
        now: Instant,
        tokenizer: &TextTokenizer,
        max_positions: usize,
        metrics: &Metrics,
    ) -> bool {
        let first = self.first_token.is_none();
        if first {
            let ttft = now - self.req.arrival;
            self.first_token = Some(ttft);
            metrics.ttft.observe(ttft.as_secs_f64());
        } else {
            metrics.tpot.observe((now - self.last_token).as_secs_f64());
        }
        self.last_token = now;
        metrics.generation_tokens.inc();
        let mut finish = None;
        if self.req.stop_tokens.contains(&token) {
            finish = Some(FinishReason::Stop);
        } else {
            self.tokens.push(token);
            if self.tokens.len() >= self.req.max_tokens
                || self.req.prompt.len() + self.tokens.len() >= max_positions
            {
                finish = Some(FinishReason::Length);
            }
        }
        let mut text = tokenizer.decode(&self.tokens).unwrap_or_default();
        if let Some(pos) = self
            .req
            .stop_strings
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            text.truncate(pos);
            finish = Some(FinishReason::Stop);
        }
        let complete = finish.is_some() || !text.ends_with('\u{FFFD}');
        let mut alive = true;
        let grew = complete && text.len() > self.emitted && text.is_char_boundary(self.emitted);
        if grew || first {
            let delta = if grew {
                text[self.emitted..].to_string()
            } else {
                String::new()
            };
            self.emitted = text.len();
            alive = self
                .req
                .events
                .send(GenEvent::Delta {
                    index: self.req.index,
                    text: delta,
                })
                .is_ok();
        }
        if let Some(reason) = finish {
            let timing = SeqTiming {
                queue: self.queue,
                first_token: self.first_token.unwrap_or_default(),
                total: now - self.req.arrival,
            };
            metrics.e2e.observe(timing.total.as_secs_f64());
            metrics.prompt_tokens.inc_by(self.req.prompt.len() as u64);
            metrics.finished.with_label_values(&[reason.as_str()]).inc();
            // Leaves the running gauge before the client can see the end of its response (the
            // step loop sets the gauge to the batch size again after the step).
            metrics.running.dec();
            let _ = self.req.events.send(GenEvent::Done {
                index: self.req.index,
                text,
                tokens: self.tokens.clone(),
                finish_reason: reason,
                prompt_tokens: self.req.prompt.len(),
                timing,
            });
            return true;
        }
        // A request whose receiver is gone is cancelled.
        !alive || self.req.events.is_closed()
    }
}

/// Whether a prompt of `next` tokens joins a rank's share of a prefill step that has `taken`
/// tokens already (the first prompt always does).
fn fits_prefill(taken: usize, next: usize, budget: usize) -> bool {
    taken == 0 || taken + next <= budget
}

/// The rank a new prompt of `len` tokens goes to in this step: of the ranks with a free
/// sequence slot and room in their prefill budget, the one with the fewest sequences (the
/// lowest index on ties); `None` when no rank can take it now.
fn place(load: &[usize], taken: &[usize], len: usize, cfg: &SchedulerConfig) -> Option<usize> {
    (0..load.len())
        .filter(|&r| load[r] < cfg.max_batch_per_rank)
        .filter(|&r| fits_prefill(taken[r], len, cfg.max_prefill_tokens))
        .min_by_key(|&r| (load[r], r))
}

/// Runs the loop on rank 0 until `requests` is closed and every sequence has ended, then shuts
/// the job down (every rank leaves [`Cluster::follow`]).
pub fn run(
    cluster: &mut Cluster,
    tokenizer: &TextTokenizer,
    requests: Receiver<GenRequest>,
    cfg: SchedulerConfig,
    metrics: &Metrics,
) -> Result<()> {
    let world = cluster.world_size();
    let max_positions = cluster.engine.model().max_positions();
    let mut waiting: VecDeque<GenRequest> = VecDeque::new();
    let mut active: BTreeMap<SeqId, Active> = BTreeMap::new();
    let mut free: Vec<SeqId> = Vec::new();
    let mut next_id: SeqId = 0;
    let mut open = true;
    loop {
        if active.is_empty() && waiting.is_empty() {
            if !open {
                break;
            }
            match requests.recv_timeout(cfg.heartbeat) {
                Ok(r) => waiting.push_back(r),
                Err(RecvTimeoutError::Timeout) => {
                    if world > 1 {
                        let plan = StepPlan {
                            step: 0,
                            free: std::mem::take(&mut free),
                            op: StepOp::Idle,
                        };
                        if let StepOutcome::Recovered(loss) = cluster.lead_step(&plan)? {
                            Broken::new(plan).settle(
                                &loss,
                                &mut active,
                                &mut waiting,
                                &mut free,
                                metrics,
                            );
                        }
                        // Moved experts may land in an idle step.
                        if let Some(r) = cluster.take_eplb_report() {
                            metrics.record_eplb(&r);
                        }
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    open = false;
                    continue;
                }
            }
        }
        while open {
            match requests.try_recv() {
                Ok(r) => waiting.push_back(r),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => open = false,
            }
        }
        let mut load = vec![0usize; world];
        for a in active.values() {
            load[a.rank] += 1;
        }
        // Lost ranks take no new sequence.
        for (r, _) in cluster.lost_ranks().iter().enumerate().filter(|(_, &l)| l) {
            load[r] = cfg.max_batch_per_rank;
        }
        let mut new = Vec::new();
        let mut prefill_tokens = vec![0usize; world];
        let now = Instant::now();
        while let Some(req) = waiting.front() {
            if req.events.is_closed() {
                waiting.pop_front();
                continue;
            }
            let Some(rank) = place(&load, &prefill_tokens, req.prompt.len(), &cfg) else {
                break;
            };
            let req = waiting.pop_front().expect("front exists");
            load[rank] += 1;
            prefill_tokens[rank] += req.prompt.len();
            let id = next_id;
            next_id += 1;
            new.push(NewSeq {
                id,
                rank,
                prompt: req.prompt.clone(),
                sampling: req.sampling,
            });
            let queue = now - req.arrival;
            metrics.queue.observe(queue.as_secs_f64());
            active.insert(
                id,
                Active {
                    req,
                    rank,
                    tokens: Vec::new(),
                    emitted: 0,
                    queue,
                    first_token: None,
                    last_token: now,
                },
            );
        }
        metrics.running.set(active.len() as i64);
        metrics.waiting.set(waiting.len() as i64);
        let (op, kind) = if !new.is_empty() {
            (StepOp::Prefill(new), "prefill")
        } else if !active.is_empty() {
            (StepOp::Decode, "decode")
        } else {
            continue;
        };
        let plan = StepPlan {
            step: 0,
            free: std::mem::take(&mut free),
            op,
        };
        let start = Instant::now();
        let tokens = match cluster.lead_step(&plan)? {
            StepOutcome::Done(tokens) => tokens,
            StepOutcome::Recovered(loss) => {
                Broken::new(plan).settle(&loss, &mut active, &mut waiting, &mut free, metrics);
                metrics.running.set(active.len() as i64);
                continue;
            }
        };
        let now = Instant::now();
        // A re-placement of the experts after the step is the load balancer's time, not the
        // step's (its own metric).
        let eplb = cluster.take_eplb_report();
        let step_secs = (now - start)
            .saturating_sub(eplb.as_ref().map_or(Duration::ZERO, |r| r.elapsed))
            .as_secs_f64();
        if let Some(r) = &eplb {
            metrics.record_eplb(r);
        }
        metrics.step.with_label_values(&[kind]).observe(step_secs);
        if kind == "decode" {
            metrics
                .decode_step
                .with_label_values(&[&crate::metrics::batch_label(active.len())])
                .observe(step_secs);
            if let Some(r) = &eplb {
                metrics.record_decode_experts(r, active.len());
            }
        }
        for (id, token) in tokens {
            let Some(a) = active.get_mut(&id) else {
                continue;
            };
            if a.push(token, now, tokenizer, max_positions, metrics) {
                active.remove(&id);
                free.push(id);
            }
        }
        metrics.running.set(active.len() as i64);
    }
    loop {
        let plan = StepPlan {
            step: 0,
            free: std::mem::take(&mut free),
            op: StepOp::Shutdown,
        };
        match cluster.lead_step(&plan)? {
            StepOutcome::Done(_) => return Ok(()),
            StepOutcome::Recovered(loss) => {
                Broken::new(plan).settle(&loss, &mut active, &mut waiting, &mut free, metrics)
            }
        }
    }
}

/// A step that broke off because ranks were lost (every rank has rolled it back).
struct Broken {
    plan: StepPlan,
}

impl Broken {
    fn new(plan: StepPlan) -> Self {
        Self { plan }
    }

    /// Settles the scheduler's books after `loss`: the sequences that lived on lost ranks fail
    /// (their clients get an error event); the new sequences the broken step was prefilling on
    /// the other ranks wait again at the front of the queue; the sequences it freed are freed
    /// again in the next step; the metrics count the lost ranks.
    fn settle(
        self,
        loss: &RankLoss,
        active: &mut BTreeMap<SeqId, Active>,
        waiting: &mut VecDeque<GenRequest>,
        free: &mut Vec<SeqId>,
        metrics: &Metrics,
    ) {
        free.extend(self.plan.free);
        if !loss.newly_lost.is_empty() {
            tracing::warn!(
                "ranks {:?} lost ({}); their sequences fail, the others go on",
                loss.newly_lost,
                loss.cause
            );
            metrics.record_rank_loss(&loss.newly_lost);
        }
        let lost: Vec<SeqId> = active
            .iter()
            .filter(|(_, a)| loss.lost[a.rank])
            .map(|(&id, _)| id)
            .collect();
        for id in lost {
            let a = active.remove(&id).expect("listed above");
            let _ = a.req.events.send(GenEvent::Failed {
                index: a.req.index,
                message: format!(
                    "rank {}, which held this sequence, was lost: {}",
                    a.rank, loss.cause
                ),
            });
            metrics.failed_sequences.inc();
        }
        if let StepOp::Prefill(new) = self.plan.op {
            // Back to the queue in their order, ahead of the later arrivals.
            for n in new.iter().rev() {
                if let Some(a) = active.remove(&n.id) {
                    waiting.push_front(a.req);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_steps_keep_to_the_token_budget() {
        assert!(
            fits_prefill(0, 5000, 4096),
            "a long prompt still goes alone"
        );
        assert!(fits_prefill(4000, 96, 4096));
        assert!(!fits_prefill(4000, 97, 4096));
    }

    #[test]
    fn prompts_go_to_the_least_loaded_rank_with_room() {
        let cfg = SchedulerConfig {
            max_batch_per_rank: 2,
            max_prefill_tokens: 1000,
            heartbeat: Duration::from_secs(1),
        };
        assert_eq!(place(&[1, 0, 0], &[0, 0, 0], 600, &cfg), Some(1));
        // Rank 0's share of this step is taken: the next rank of the same load gets it.
        assert_eq!(place(&[1, 1, 1], &[600, 0, 0], 600, &cfg), Some(1));
        assert_eq!(place(&[1, 1, 1], &[600, 600, 0], 600, &cfg), Some(2));
        assert_eq!(place(&[1, 1, 1], &[600, 600, 600], 600, &cfg), None);
        // Full ranks take nothing; a budget that fits keeps a rank eligible.
        assert_eq!(place(&[2, 2, 1], &[0, 0, 900], 100, &cfg), Some(2));
        assert_eq!(place(&[2, 2, 2], &[0, 0, 0], 10, &cfg), None);
    }

    #[test]
    fn per_token_time_excludes_the_first_token() {
        let t = SeqTiming {
            queue: Duration::ZERO,
            first_token: Duration::from_millis(100),
            total: Duration::from_millis(400),
        };
        assert_eq!(t.per_token(4), Some(Duration::from_millis(100)));
        assert_eq!(t.per_token(1), None);
    }
}
