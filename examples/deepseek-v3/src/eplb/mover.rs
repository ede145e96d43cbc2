//! Moving re-placed experts' weights between the ranks while the steps go on, one MoE layer at
//! a time: between two steps every rank reads the weights its slots give
//! (`MoeLayer::prepare_replacement`, on the step's thread: the device is only ever touched
//! there); a thread of the mover sends them over a TCP mesh of their own
//! (`Dist::side_transport`) and receives this rank's, while steps keep running on the current
//! placement; each step's token all-gather carries whether the rank has its weights
//! ([`Mover::ready_here`]), and after the first step at which every rank has them, every rank
//! writes its slots and the map (`MoeLayer::finish_replacement`), at the same step boundary.
//! A step waits for the reads and the writes of a layer, not for the transfer.

use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use moe_layer::ep_runtime::transport::{self, TcpTransport};
use moe_layer::placement::Placement;
use moe_layer::replacement::PreparedReplacement;

use crate::model::DeepSeekV3;

/// Messages of one layer's move, index = peer.
type Messages = Vec<Option<Vec<u8>>>;

/// A layer whose weights are on their way.
#[derive(Debug)]
struct InFlight {
    layer: usize,
    prepared: PreparedReplacement,
    /// What this rank received, once its transfer is done.
    arrived: Option<Result<Messages, String>>,
    started: Instant,
}

/// What the mover finished at a step boundary.
#[derive(Debug, Default)]
pub(super) struct Finished {
    /// Layers whose slots and map were written.
    pub layers: Vec<usize>,
    /// Their moved slots (all ranks).
    pub moved_slots: usize,
    /// Bytes this rank sent for them.
    pub bytes_sent: usize,
    /// Time the steps waited (reading and writing slots).
    pub stalled: Duration,
}

/// The mover of one rank (module docs).
#[derive(Debug)]
pub(super) struct Mover {
    /// Jobs for the transfer thread (none in a job of one rank).
    jobs: Option<Sender<(u64, Messages)>>,
    results: Option<Receiver<Result<Messages, String>>>,
    thread: Option<JoinHandle<()>>,
    /// Layers still to move, in order.
    queue: VecDeque<(usize, Placement)>,
    in_flight: Option<InFlight>,
    tag: u64,
}

impl Mover {
    /// A mover whose transfers go over `transport` (`None`: one rank, nothing to send),
    /// waiting at most `wait` for a peer's weights.
    pub(super) fn new(transport: Option<TcpTransport>, wait: Duration) -> Self {
        let (mut jobs, mut results, mut thread) = (None, None, None);
        if let Some(t) = transport {
            let (job_tx, job_rx) = channel::<(u64, Messages)>();
            let (res_tx, res_rx) = channel();
            thread = Some(std::thread::spawn(move || {
                for (tag, msgs) in job_rx {
                    let r = exchange(&t, tag, msgs, wait).map_err(|e| format!("{e:#}"));
                    if res_tx.send(r).is_err() {
                        break;
                    }
                }
            }));
            jobs = Some(job_tx);
            results = Some(res_rx);
        }
        Self {
            jobs,
            results,
            thread,
            queue: VecDeque::new(),
            in_flight: None,
            tag: 0,
        }
    }

    /// Whether no layer is waiting to move.
    pub(super) fn idle(&self) -> bool {
        self.queue.is_empty() && self.in_flight.is_none()
    }

    /// Queues `layers` (index and new placement) to move, in order.
    pub(super) fn start(&mut self, layers: Vec<(usize, Placement)>) {
        self.queue.extend(layers);
    }

    /// Whether this rank has the in-flight layer's weights (true when none is in flight):
    /// what it tells the others in the step's token all-gather.
    pub(super) fn ready_here(&mut self) -> bool {
        let Some(f) = self.in_flight.as_mut() else {
            return true;
        };
        if f.arrived.is_none() {
            if let Some(rx) = &self.results {
                match rx.try_recv() {
                    Ok(r) => f.arrived = Some(r),
                    Err(TryRecvError::Empty) => {}
                    Err(TryRecvError::Disconnected) => {
                        f.arrived = Some(Err("the weight transfer thread ended".into()))
                    }
                }
            }
        }
        f.arrived.is_some()
    }

    /// After a step's all-gather: when every rank had the in-flight layer's weights
    /// (`all_ready`), writes its slots and map; then reads the next queued layer and hands its
    /// weights to the transfer thread (a job of one rank moves it at once).
    pub(super) fn step(&mut self, model: &mut DeepSeekV3, all_ready: bool) -> Result<Finished> {
        let mut done = Finished::default();
        loop {
            if let Some(f) = self.in_flight.take() {
                if !all_ready || f.arrived.is_none() {
                    self.in_flight = Some(f);
                    return Ok(done);
                }
                let t = Instant::now();
                let incoming = match f.arrived {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => bail!("layer {}: moving the experts' weights: {e}", f.layer),
                    None => unreachable!("checked above"),
                };
                let layer = layer_mut(model, f.layer)?;
                let r = layer
                    .finish_replacement(f.prepared, incoming)
                    .with_context(|| format!("layer {}: writing the moved experts", f.layer))?;
                done.stalled += t.elapsed();
                done.layers.push(f.layer);
                done.moved_slots += r.moved_slots;
                done.bytes_sent += r.bytes_sent;
                tracing::debug!(
                    layer = f.layer,
                    moved_slots = r.moved_slots,
                    sent_mib = r.bytes_sent >> 20,
                    ms = f.started.elapsed().as_millis() as u64,
                    "layer re-placed"
                );
            }
            let Some((idx, placement)) = self.queue.pop_front() else {
                return Ok(done);
            };
            let t = Instant::now();
            let layer = layer_mut(model, idx)?;
            let Some(mut prepared) = layer
                .prepare_replacement(placement)
                .with_context(|| format!("layer {idx}: reading the experts to move"))?
            else {
                continue;
            };
            let messages = prepared.take_messages();
            done.stalled += t.elapsed();
            let mut f = InFlight {
                layer: idx,
                prepared,
                arrived: None,
                started: t,
            };
            match &self.jobs {
                Some(jobs) => {
                    self.tag += 1;
                    jobs.send((self.tag, messages))
                        .context("the weight transfer thread ended")?;
                    self.in_flight = Some(f);
                    return Ok(done);
                }
                None => {
                    // One rank: every move is local.
                    f.arrived = Some(Ok(messages));
                    self.in_flight = Some(f);
                }
            }
        }
    }
}

impl Drop for Mover {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn layer_mut(model: &mut DeepSeekV3, idx: usize) -> Result<&mut moe_layer::MoeLayer> {
    model
        .moe_layers_mut()
        .find(|(i, _)| *i == idx)
        .map(|(_, l)| l)
        .with_context(|| format!("no MoE layer {idx}"))
}

/// The weights of one layer's move: [`transport::exchange`] on the mover's mesh, waiting at
/// most `wait` for the peers.
fn exchange(t: &TcpTransport, tag: u64, msgs: Messages, wait: Duration) -> Result<Messages> {
    transport::exchange(t, tag, msgs, Instant::now() + wait).context("moving expert weights")
}
