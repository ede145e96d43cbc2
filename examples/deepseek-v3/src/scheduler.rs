//! Rank 0's continuous-batching loop: admits requests, places each new sequence on the rank
//! with the fewest sequences, alternates prefill steps (new prompts, normal MoE mode) and
//! decode steps (one token for every live sequence, low-latency MoE mode), detokenizes, applies
//! stop conditions, and streams events back to whoever asked.

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use anyhow::Result;
use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::{Cluster, NewSeq, SeqId, StepOp, StepPlan};
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

/// What a request hears back.
#[derive(Clone, Debug, PartialEq)]
pub enum GenEvent {
    /// New text of sequence `index` (only complete UTF-8 characters).
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
}

/// Scheduler limits.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Most live sequences per rank (also the low-latency token limit per rank).
    pub max_batch_per_rank: usize,
    /// How often an idle multi-rank job runs an empty step, so waiting ranks do not time out.
    pub heartbeat: Duration,
}

struct Active {
    req: GenRequest,
    rank: usize,
    tokens: Vec<u32>,
    emitted: usize,
}

impl Active {
    /// Handles a new token; returns whether the sequence is finished.
    fn push(&mut self, token: u32, tokenizer: &TextTokenizer, max_positions: usize) -> bool {
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
        if complete && text.len() > self.emitted && text.is_char_boundary(self.emitted) {
            let delta = text[self.emitted..].to_string();
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
            let _ = self.req.events.send(GenEvent::Done {
                index: self.req.index,
                text,
                tokens: self.tokens.clone(),
                finish_reason: reason,
                prompt_tokens: self.req.prompt.len(),
            });
            return true;
        }
        // A request whose receiver is gone is cancelled.
        !alive || self.req.events.is_closed()
    }
}

/// Runs the loop on rank 0 until `requests` is closed and every sequence has ended, then shuts
/// the job down (every rank leaves [`Cluster::follow`]).
pub fn run(
    cluster: &mut Cluster,
    tokenizer: &TextTokenizer,
    requests: Receiver<GenRequest>,
    cfg: SchedulerConfig,
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
                            free: std::mem::take(&mut free),
                            op: StepOp::Idle,
                        };
                        cluster.lead_step(&plan)?;
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
        let mut new = Vec::new();
        while let Some(req) = waiting.front() {
            if req.events.is_closed() {
                waiting.pop_front();
                continue;
            }
            let (rank, &n) = load
                .iter()
                .enumerate()
                .min_by_key(|(r, n)| (**n, *r))
                .expect("at least one rank");
            if n >= cfg.max_batch_per_rank {
                break;
            }
            let req = waiting.pop_front().expect("front exists");
            load[rank] += 1;
            let id = next_id;
            next_id += 1;
            new.push(NewSeq {
                id,
                rank,
                prompt: req.prompt.clone(),
                sampling: req.sampling,
            });
            active.insert(
                id,
                Active {
                    req,
                    rank,
                    tokens: Vec::new(),
                    emitted: 0,
                },
            );
        }
        let op = if !new.is_empty() {
            StepOp::Prefill(new)
        } else if !active.is_empty() {
            StepOp::Decode
        } else {
            continue;
        };
        let plan = StepPlan {
            free: std::mem::take(&mut free),
            op,
        };
        let tokens = cluster.lead_step(&plan)?;
        for (id, token) in tokens {
            let Some(a) = active.get_mut(&id) else {
                continue;
            };
            if a.push(token, tokenizer, max_positions) {
                active.remove(&id);
                free.push(id);
            }
        }
    }
    cluster.lead_step(&StepPlan {
        free,
        op: StepOp::Shutdown,
    })?;
    Ok(())
}
