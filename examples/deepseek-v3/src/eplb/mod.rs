//! Expert load balancing while serving (`--expert-stats-interval`, `--eplb-interval`,
//! `--eplb-window`, `--eplb-min-gain`): every rank counts, on its device, the tokens its
//! routers send to each logical expert (`MoeLayer::enable_load_stats`); every
//! `stats_interval` compute steps the ranks read their counts and sum them over the job (one
//! host all-gather), keep the last `window` sums, and report each MoE layer's imbalance
//! (max / mean over logical experts, and over ranks under its current placement). Every
//! `replace_interval` steps, once the window is full and the last re-placement has landed,
//! they also recompute each layer's placement from the window (DeepSeek's EPLB,
//! `moe_layer::placement::place`), align its slots to the current ones
//! (`Placement::aligned_to`: only experts that change rank move) and re-place the layers whose
//! rank imbalance it lowers by at least `min_gain` (a fraction), one layer at a time, their
//! weights travelling while the steps go on (`mover`). Every rank runs the same steps and sees
//! the same sums and the same readiness, so all decide alike without another message.

use std::collections::VecDeque;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use moe_layer::ep_runtime::TcpTransport;
use moe_layer::placement::{imbalance, place, Placement, PlacementShape};

use crate::dist::Dist;
use crate::model::DeepSeekV3;

mod mover;
use mover::Mover;

/// When to collect and re-place.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EplbOptions {
    /// Compute steps between two reads of the load statistics (0: never).
    pub stats_interval: usize,
    /// Compute steps between two re-placements (0: never; else a multiple of
    /// `stats_interval`).
    pub replace_interval: usize,
    /// Reads of the statistics a placement is computed from (the newest).
    pub window: usize,
    /// Least fraction by which a new placement must lower a layer's rank imbalance
    /// (`max / mean`) to be applied: moving weights costs steps, and placements of nearly
    /// equal balance would otherwise churn them.
    pub min_gain: f64,
    /// The slots and machines placements are for.
    pub shape: PlacementShape,
}

impl EplbOptions {
    /// Checks the intervals against each other.
    pub fn check(&self) -> Result<()> {
        if self.replace_interval > 0
            && (self.stats_interval == 0 || self.replace_interval % self.stats_interval != 0)
        {
            bail!(
                "--eplb-interval {} must be a multiple of --expert-stats-interval {}",
                self.replace_interval,
                self.stats_interval
            );
        }
        if self.window == 0 {
            bail!("--eplb-window must be at least 1");
        }
        if !(0.0..1.0).contains(&self.min_gain) {
            bail!("--eplb-min-gain {} must be in [0, 1)", self.min_gain);
        }
        Ok(())
    }
}

/// One MoE layer's balance at a read of the statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerBalance {
    /// Layer index.
    pub layer: usize,
    /// `max / mean` of the window's loads over logical experts.
    pub experts: f64,
    /// `max / mean` over ranks under the placement the layer had.
    pub ranks: f64,
    /// The same under the placement it has now, when it was re-placed.
    pub ranks_after: Option<f64>,
    /// Logical experts given tokens in the steps this read covers (with one step a read,
    /// the experts whose weights a step reads).
    pub experts_read: usize,
}

/// What one read of the statistics (and maybe a re-placement) found and did on this rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EplbReport {
    /// Every MoE layer's balance.
    pub layers: Vec<LayerBalance>,
    /// Compute steps since the previous read (the statistics' interval), 0 without a read.
    pub steps_read: usize,
    /// Layers whose slots and map were written at this step boundary.
    pub replaced_layers: usize,
    /// Their slots (all ranks) whose expert changed.
    pub moved_slots: usize,
    /// Bytes of expert weights this rank sent for them.
    pub bytes_sent: usize,
    /// Time the steps waited for the re-placement at this boundary (reading the weights to
    /// send, writing the received ones; the transfer runs beside the steps).
    pub elapsed: Duration,
}

/// The collecting and re-placing state of one rank (module docs).
#[derive(Debug)]
pub struct Eplb {
    opts: EplbOptions,
    steps: u64,
    /// The job's loads at each read, newest last: `[read][MoE layer][expert]`.
    window: VecDeque<Vec<Vec<f64>>>,
    mover: Mover,
}

impl Eplb {
    /// The state for `opts` (checked), with load statistics switched on in `model`'s MoE
    /// layers; re-placed weights travel over `transport` (`Dist::side_transport`; `None` for
    /// one rank), a peer's weights awaited at most `wait`.
    pub fn new(
        opts: EplbOptions,
        model: &mut DeepSeekV3,
        transport: Option<TcpTransport>,
        wait: Duration,
    ) -> Result<Self> {
        opts.check()?;
        if opts.replace_interval > 0 {
            if let Some((i, _)) = model.moe_layers().find(|(_, l)| l.expert_map().is_none()) {
                bail!("--eplb-interval: MoE layer {i} has no expert placement to change");
            }
        }
        for (i, layer) in model.moe_layers_mut() {
            layer
                .enable_load_stats()
                .with_context(|| format!("layer {i}: cannot count the expert load"))?;
        }
        Ok(Self {
            opts,
            steps: 0,
            window: VecDeque::new(),
            mover: Mover::new(transport, wait),
        })
    }

    /// Whether this rank holds the weights of the layer being moved (true when none is):
    /// sent with the step's tokens, so that every rank learns when all have them.
    pub fn ready_here(&mut self) -> bool {
        self.mover.ready_here()
    }

    /// Called by every rank after each step (the same steps on every rank), with whether
    /// every rank said [`Eplb::ready_here`] in the step's all-gather and whether it computed
    /// (prefill or decode; idle steps only land moved weights): writes a moved layer when all
    /// have its weights, starts the next; after compute steps, reads the statistics and
    /// decides a re-placement when due (collectives then).
    pub fn after_step(
        &mut self,
        model: &mut DeepSeekV3,
        dist: &Dist,
        all_ready: bool,
        compute: bool,
    ) -> Result<Option<EplbReport>> {
        let finished = self.mover.step(model, all_ready)?;
        let mut report = EplbReport {
            replaced_layers: finished.layers.len(),
            moved_slots: finished.moved_slots,
            bytes_sent: finished.bytes_sent,
            elapsed: finished.stalled,
            ..Default::default()
        };
        if compute {
            self.steps += 1;
        }
        let steps = self.steps;
        let every = move |n: usize| n > 0 && steps % n as u64 == 0;
        if !compute || !every(self.opts.stats_interval) {
            return Ok((report.replaced_layers > 0).then(|| self.log(report, dist)));
        }
        let mut local = Vec::new();
        for (i, layer) in model.moe_layers() {
            let load = layer
                .take_expert_load()?
                .with_context(|| format!("layer {i}: expert load statistics are off"))?;
            local.push(load);
        }
        let summed = sum_over_ranks(&local, dist)?;
        let read: Vec<usize> = summed
            .iter()
            .map(|l| l.iter().filter(|&&n| n > 0.0).count())
            .collect();
        self.window.push_back(summed);
        while self.window.len() > self.opts.window {
            self.window.pop_front();
        }
        let loads = window_sum(&self.window);
        // A placement from a part-filled window would follow the first few requests' noise
        // (and be undone by the next): none before the window is full, nor while the last
        // one is still moving.
        let replace = every(self.opts.replace_interval)
            && self.window.len() == self.opts.window
            && self.mover.idle();
        let ranks = self.opts.shape.num_gpus;
        let mut chosen = Vec::new();
        report.steps_read = self.opts.stats_interval;
        for (((idx, layer), load), &experts_read) in model.moe_layers().zip(&loads).zip(&read) {
            let current = layer
                .expert_map()
                .map(|m| m.placement().clone())
                .unwrap_or_else(|| Placement::identity(load.len()));
            let before = current.imbalance(load, ranks);
            let mut balance = LayerBalance {
                layer: idx,
                experts: imbalance(load),
                ranks: before,
                ranks_after: None,
                experts_read,
            };
            if replace {
                let next = place(load, self.opts.shape)
                    .with_context(|| format!("layer {idx}: expert placement"))?
                    .aligned_to(&current, ranks);
                let after = next.imbalance(load, ranks);
                if next != current && after <= before * (1.0 - self.opts.min_gain) {
                    tracing::debug!(
                        layer = idx,
                        imbalance_before = before,
                        imbalance_after = after,
                        "layer to re-place"
                    );
                    chosen.push((idx, next));
                    balance.ranks_after = Some(after);
                }
            }
            report.layers.push(balance);
        }
        if !chosen.is_empty() {
            self.mover.start(chosen);
            // The first layer's weights are read now and leave while the next steps run.
            let more = self.mover.step(model, false)?;
            report.replaced_layers += more.layers.len();
            report.moved_slots += more.moved_slots;
            report.bytes_sent += more.bytes_sent;
            report.elapsed += more.stalled;
        }
        Ok(Some(self.log(report, dist)))
    }

    /// Logs the layers `report` wrote, and returns it.
    fn log(&self, report: EplbReport, dist: &Dist) -> EplbReport {
        if report.replaced_layers > 0 {
            tracing::info!(
                rank = dist.info.rank,
                layers = report.replaced_layers,
                moved_slots = report.moved_slots,
                sent_mib = format!("{:.1}", report.bytes_sent as f64 / (1 << 20) as f64),
                stalled_ms = format!("{:.1}", report.elapsed.as_secs_f64() * 1e3),
                "experts re-placed"
            );
        }
        report
    }
}

/// `[layer][expert]` loads summed over the ranks (one all-gather; the same sums, in rank
/// order, on every rank).
fn sum_over_ranks(local: &[Vec<f64>], dist: &Dist) -> Result<Vec<Vec<f64>>> {
    let bytes: Vec<u8> = local
        .iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let all = dist
        .all_gather(&bytes)
        .context("cannot gather the expert loads")?;
    let mut sum: Vec<Vec<f64>> = local.iter().map(|l| vec![0.0; l.len()]).collect();
    for (rank, msg) in all.iter().enumerate() {
        if msg.len() != bytes.len() {
            bail!(
                "rank {rank} sent {} bytes of expert loads, this rank {}",
                msg.len(),
                bytes.len()
            );
        }
        let mut values = msg
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")));
        for v in sum.iter_mut().flatten() {
            *v += values.next().expect("lengths checked");
        }
    }
    Ok(sum)
}

/// The window's loads summed per layer and expert.
fn window_sum(window: &VecDeque<Vec<Vec<f64>>>) -> Vec<Vec<f64>> {
    let mut out: Vec<Vec<f64>> = match window.front() {
        Some(first) => first.iter().map(|l| vec![0.0; l.len()]).collect(),
        None => return Vec::new(),
    };
    for read in window {
        for (o, l) in out.iter_mut().zip(read) {
            for (a, b) in o.iter_mut().zip(l) {
                *a += b;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_must_nest() {
        let shape = PlacementShape {
            num_physical: 8,
            num_groups: 1,
            num_nodes: 1,
            num_gpus: 2,
        };
        let opts = |stats, replace, window| EplbOptions {
            stats_interval: stats,
            replace_interval: replace,
            window,
            min_gain: 0.05,
            shape,
        };
        assert!(opts(10, 30, 3).check().is_ok());
        assert!(opts(10, 0, 1).check().is_ok());
        let e = opts(10, 25, 3).check().unwrap_err().to_string();
        assert!(e.contains("multiple of --expert-stats-interval 10"), "{e}");
        assert!(opts(0, 10, 3).check().is_err());
        assert!(opts(10, 10, 0).check().is_err());
        let bad_gain = EplbOptions {
            min_gain: 1.0,
            ..opts(10, 10, 1)
        };
        assert!(bad_gain.check().is_err());
    }

    #[test]
    fn the_window_sums_its_reads() {
        let mut w = VecDeque::new();
        w.push_back(vec![vec![1.0, 2.0], vec![0.0]]);
        w.push_back(vec![vec![3.0, 0.5], vec![4.0]]);
        assert_eq!(window_sum(&w), vec![vec![4.0, 2.5], vec![4.0]]);
        assert!(window_sum(&VecDeque::new()).is_empty());
    }
}
