//! `bench_moe_layer`'s rows and its report: the table on standard output, the JSON lines of
//! `EP_BENCH_OUT`.

use std::fmt::Write as _;
use std::io::Write as _;

use crate::expert_groups;
use crate::layer_common::{BoxError, H};

/// One row of the report.
#[derive(Debug, Default, Clone)]
pub(crate) struct Row {
    pub(crate) tokens: usize,
    pub(crate) mode: &'static str,
    /// The layer sent fp8 rows (`MoeLayerOptions::fp8_dispatch`).
    pub(crate) fp8_dispatch: bool,
    /// One step at a time, each from a synchronised device (`time_ms`).
    pub(crate) step: StepTimes,
    /// Back to back (`time_b2b_ms`): the layer, its captured graph, and the compute parts
    /// (router, grouped GEMMs, shared experts) in normal mode.
    pub(crate) b2b: Option<StepTimes>,
    pub(crate) dispatch_ms: f64,
    pub(crate) combine_ms: f64,
    /// Normal mode across ranks: the dispatch with the shared expert beside it, issued in
    /// three ways: the dispatch first; the shared expert first; the shared expert first with
    /// cuBLAS targeting the SMs the dispatch leaves.
    pub(crate) overlap_ms: Option<[f64; 3]>,
    /// Normal mode across ranks: the dispatch with its layout computed beforehand, and again
    /// reusing the first dispatch's handle (no notify, no host read of the count: the
    /// transfer and a barrier), with the rows this rank received.
    pub(crate) dispatch_split: Option<([f64; 3], usize)>,
    pub(crate) floor_ms: f64,
    pub(crate) floor_gb: f64,
    pub(crate) dense_ms: f64,
}

/// A layer step's times, eager and captured, and its compute parts measured alone the same way.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct StepTimes {
    pub(crate) layer_ms: f64,
    pub(crate) graph_ms: Option<f64>,
    pub(crate) router_ms: f64,
    pub(crate) gemm_ms: f64,
    pub(crate) shared_ms: f64,
    /// The largest router + GEMMs + shared experts over ranks.
    pub(crate) busiest_compute_ms: f64,
}

impl StepTimes {
    /// The better of the eager and the captured layer.
    pub(crate) fn best_ms(&self) -> f64 {
        self.graph_ms
            .map_or(self.layer_ms, |g| g.min(self.layer_ms))
    }

    /// The layer's time beyond its compute parts measured alone.
    pub(crate) fn exposed_ms(&self) -> f64 {
        self.best_ms() - (self.router_ms + self.gemm_ms + self.shared_ms)
    }

    /// The layer's time beyond the busiest rank's compute parts (the step's critical path runs
    /// through it: the others wait for its rows in the combine).
    pub(crate) fn exposed_busiest_ms(&self) -> f64 {
        self.best_ms() - self.busiest_compute_ms
    }
}

/// Prints rank 0's `rows` of a run over `world` ranks (`iters` steps per timing) and writes them
/// to `EP_BENCH_OUT` if set.
pub(crate) fn report(rows: &[Row], world: usize, iters: usize) -> Result<(), BoxError> {
    let mut table = String::new();
    writeln!(
        table,
        "\nMoeLayer, DeepSeek-V3 shapes, {world} rank(s){}{}; times in ms",
        if std::env::var("EP_BENCH_TBO").as_deref() == Ok("1") {
            ", two-batch overlap"
        } else {
            ""
        },
        match (
            rows.iter().all(|r| r.fp8_dispatch),
            rows.iter().any(|r| r.fp8_dispatch)
        ) {
            (true, _) => ", fp8 dispatch",
            (false, true) => ", fp8 dispatch for the fp8 experts",
            _ => "",
        }
    )?;
    if expert_groups() > 1 {
        writeln!(
            table,
            "normal mode pipelined over {} expert groups",
            expert_groups()
        )?;
    }
    writeln!(
        table,
        "{:>6} {:<11} {:>8} {:>8} {:>7} {:>8} {:>7} {:>8} {:>7} {:>8} {:>8} {:>8} {:>9} {:>8}",
        "tokens",
        "mode",
        "layer",
        "graph",
        "router",
        "dispatch",
        "gemms",
        "combine",
        "shared",
        "floor",
        "dense",
        "x floor",
        "x dense",
        "exposed"
    )?;
    for r in rows {
        let best = r.step.best_ms();
        writeln!(
            table,
            "{:>6} {:<11} {:>8.3} {:>8} {:>7.3} {:>8.3} {:>7.3} {:>8.3} {:>7.3} {:>8.3} {:>8.3} {:>8.2} {:>9.2} {:>7.1}%",
            r.tokens,
            r.mode,
            r.step.layer_ms,
            r.step.graph_ms.map_or("-".to_string(), |g| format!("{g:.3}")),
            r.step.router_ms,
            r.dispatch_ms,
            r.step.gemm_ms,
            r.combine_ms,
            r.step.shared_ms,
            r.floor_ms,
            r.dense_ms,
            best / r.floor_ms,
            best / r.dense_ms,
            100.0 * r.step.exposed_ms() / best
        )?;
    }
    if world > 1 {
        for r in rows {
            writeln!(
                table,
                "{:>6} exposed beyond the busiest rank's compute parts ({:.3} ms): {:.1}%",
                r.tokens,
                r.step.busiest_compute_ms,
                100.0 * r.step.exposed_busiest_ms() / r.step.best_ms()
            )?;
        }
    }
    for (r, b) in rows.iter().filter_map(|r| Some((r, r.b2b?))) {
        writeln!(
            table,
            "{:>6} back to back ({iters} steps, one synchronisation): layer {:.3} ms, graph {}, \
             router {:.3}, gemms {:.3}, shared {:.3}: exposed {:.1}% (beyond the busiest rank's \
             compute parts, {:.3}: {:.1}%)",
            r.tokens,
            b.layer_ms,
            b.graph_ms.map_or("-".to_string(), |g| format!("{g:.3}")),
            b.router_ms,
            b.gemm_ms,
            b.shared_ms,
            100.0 * b.exposed_ms() / b.best_ms(),
            b.busiest_compute_ms,
            100.0 * b.exposed_busiest_ms() / b.best_ms()
        )?;
    }
    for (r, o) in rows.iter().filter_map(|r| Some((r, r.overlap_ms?))) {
        writeln!(
            table,
            "{:>6} dispatch beside the shared expert: dispatch first {:.3} ms, shared first {:.3}, \
             shared first with cuBLAS on the SMs the dispatch leaves {:.3} (alone: {:.3} + {:.3})",
            r.tokens, o[0], o[1], o[2], r.dispatch_ms, r.step.shared_ms
        )?;
    }
    for (r, ([laid, cached, worst], n)) in rows.iter().filter_map(|r| Some((r, r.dispatch_split?)))
    {
        // As DeepEP counts: every received row, fp8 rows with their per-128 f32 scales.
        let row_bytes = if r.fp8_dispatch {
            H + H / 128 * 4
        } else {
            2 * H
        };
        let gb = (n * row_bytes) as f64 / 1e9;
        writeln!(
            table,
            "{:>6} dispatch of {n} rows ({gb:.1} GB): with its layout {:.3} ms ({:.0} GB/s), \
             layout beforehand {laid:.3} ({:.0} GB/s), cached (no notify, no host read) \
             {cached:.3} ({:.0} GB/s), worst-case outputs (layout beforehand, no host read, \
             rings) {worst:.3} ({:.0} GB/s); combine {:.0} GB/s",
            r.tokens,
            r.dispatch_ms,
            gb / r.dispatch_ms * 1e3,
            gb / laid * 1e3,
            gb / cached * 1e3,
            gb / worst * 1e3,
            (n * H * 2) as f64 / 1e9 / r.combine_ms * 1e3
        )?;
    }
    print!("{table}");
    if let Ok(path) = std::env::var("EP_BENCH_OUT") {
        let mut f = std::fs::File::create(path)?;
        for r in rows {
            writeln!(
                f,
                "{{\"tokens\": {}, \"mode\": {:?}, \"layer_ms\": {:.4}, \"graph_ms\": {}, \"router_ms\": {:.4}, \"dispatch_ms\": {:.4}, \"gemm_ms\": {:.4}, \"combine_ms\": {:.4}, \"shared_ms\": {:.4}, \"overlap_ms\": {}, \"dispatch_split_ms\": {}, \"recv_rows\": {}, \"floor_ms\": {:.4}, \"floor_gb\": {:.3}, \"dense_ms\": {:.4}, \"exposed_ms\": {:.4}, \"busiest_compute_ms\": {:.4}, \"b2b\": {}, \"ranks\": {world}, \"two_batch_overlap\": {}, \"fp8_dispatch\": {}, \"expert_groups\": {}, \"gemm_grid\": {:?}}}",
                r.tokens, r.mode, r.step.layer_ms, r.step.graph_ms.map_or("null".to_string(), |g| format!("{g:.4}")),
                r.step.router_ms, r.dispatch_ms, r.step.gemm_ms, r.combine_ms, r.step.shared_ms, r.overlap_ms.map_or("null".to_string(), |o| format!("[{:.4}, {:.4}, {:.4}]", o[0], o[1], o[2])), r.dispatch_split.map_or("null".to_string(), |(d, _)| format!("[{:.4}, {:.4}, {:.4}]", d[0], d[1], d[2])), r.dispatch_split.map_or(0, |(_, n)| n), r.floor_ms, r.floor_gb, r.dense_ms,
                r.step.exposed_ms(), r.step.busiest_compute_ms, r.b2b.map_or("null".to_string(), |b| format!("{{\"layer_ms\": {:.4}, \"graph_ms\": {}, \"router_ms\": {:.4}, \"gemm_ms\": {:.4}, \"shared_ms\": {:.4}, \"exposed_ms\": {:.4}, \"busiest_compute_ms\": {:.4}}}", b.layer_ms, b.graph_ms.map_or("null".to_string(), |g| format!("{g:.4}")), b.router_ms, b.gemm_ms, b.shared_ms, b.exposed_ms(), b.busiest_compute_ms)), std::env::var("EP_BENCH_TBO").as_deref() == Ok("1"), r.fp8_dispatch,
                expert_groups(),
                std::env::var("EP_BENCH_GEMM_GRID").unwrap_or_else(|_| "default".into())
            )?;
        }
    }
    Ok(())
}
