//! The serving metrics behind `GET /metrics`, in the Prometheus text format: requests by
//! endpoint and status, prompt and generated tokens, time to first token, time per output
//! token, end-to-end latency, queue time, running and waiting sequences, and the duration of
//! prefill and decode steps; with expert load statistics on, each MoE layer's load imbalance
//! and the re-placements (`crate::eplb`). Names follow vLLM's where there is one
//! (`deepseek_v3_` for `vllm:`). Each [`Metrics`] owns its registry, so tests can run several side by side.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    Opts, Registry, TextEncoder,
};

use crate::eplb::EplbReport;

/// Latency buckets, in seconds, from a millisecond (a tiny model's CPU step) to minutes.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
];

/// Per-token buckets, in seconds.
const TOKEN_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5,
];

/// Every serving metric (see the module docs).
pub struct Metrics {
    registry: Registry,
    /// `deepseek_v3_http_requests_total{endpoint, status}`: HTTP requests answered.
    pub requests: IntCounterVec,
    /// `deepseek_v3_prompt_tokens_total`: prompt tokens of finished sequences.
    pub prompt_tokens: IntCounter,
    /// `deepseek_v3_generation_tokens_total`: tokens generated.
    pub generation_tokens: IntCounter,
    /// `deepseek_v3_request_success_total{finish_reason}`: sequences that finished.
    pub finished: IntCounterVec,
    /// `deepseek_v3_time_to_first_token_seconds`: arrival to first token, per sequence.
    pub ttft: Histogram,
    /// `deepseek_v3_time_per_output_token_seconds`: time between consecutive tokens of a
    /// sequence (every token after the first).
    pub tpot: Histogram,
    /// `deepseek_v3_e2e_request_latency_seconds`: arrival to last token, per sequence.
    pub e2e: Histogram,
    /// `deepseek_v3_request_queue_time_seconds`: arrival to the prefill step that took it.
    pub queue: Histogram,
    /// `deepseek_v3_num_requests_running`: sequences in the batch (all ranks).
    pub running: IntGauge,
    /// `deepseek_v3_num_requests_waiting`: sequences waiting for a place in the batch.
    pub waiting: IntGauge,
    /// `deepseek_v3_step_duration_seconds{kind}`: one step on all ranks (`prefill`, `decode`),
    /// from sending the plan to having every rank's tokens.
    pub step: HistogramVec,
    /// `deepseek_v3_decode_step_duration_seconds{batch}`: decode steps by the number of
    /// sequences in them, rounded up to a power of two (`1`, `2`, `4`, ...).
    pub decode_step: HistogramVec,
    /// `deepseek_v3_decode_experts_read{batch}`: per MoE layer, the experts a decode step's
    /// tokens chose (whose weights the step reads), by batch as `decode_step`; recorded when
    /// the statistics are read after every compute step (`--expert-stats-interval 1`).
    pub decode_experts_read: HistogramVec,
    /// `deepseek_v3_expert_load_imbalance{layer, over}`: `max / mean` of a MoE layer's expert
    /// loads over the last window of statistics, over its logical experts (`over="experts"`)
    /// and over the ranks under its current placement (`over="ranks"`).
    pub expert_imbalance: GaugeVec,
    /// `deepseek_v3_eplb_layers_replaced_total`: MoE layers whose experts were re-placed.
    pub eplb_layers: IntCounter,
    /// `deepseek_v3_eplb_moved_experts_total`: expert slots whose weights changed.
    pub eplb_moved: IntCounter,
    /// `deepseek_v3_eplb_duration_seconds`: rank 0's time in each re-placement.
    pub eplb_duration: Histogram,
    /// `deepseek_v3_rank_failures_total`: ranks lost while serving (the others went on).
    pub rank_failures: IntCounter,
    /// `deepseek_v3_ranks_lost`: ranks lost so far.
    pub ranks_lost: IntGauge,
    /// `deepseek_v3_request_failed_total`: sequences that failed because their rank was lost.
    pub failed_sequences: IntCounter,
    /// The lost ranks, in order (for `/health`).
    lost: std::sync::Mutex<Vec<usize>>,
}

impl Metrics {
    /// Records that `ranks` were lost (the service goes on without them).
    pub fn record_rank_loss(&self, ranks: &[usize]) {
        let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
        for &r in ranks {
            if !lost.contains(&r) {
                lost.push(r);
                self.rank_failures.inc();
            }
        }
        lost.sort_unstable();
        self.ranks_lost.set(lost.len() as i64);
    }

    /// The ranks lost so far, in order.
    pub fn lost_ranks(&self) -> Vec<usize> {
        self.lost.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The `batch` label of [`Metrics::decode_step`] for `n` sequences.
pub fn batch_label(n: usize) -> String {
    n.max(1).next_power_of_two().to_string()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics in their own registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique name");
            c
        };
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique name");
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique name");
            g
        };
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
                .expect("valid metric");
            registry.register(Box::new(h.clone())).expect("unique name");
            h
        };
        let step = HistogramVec::new(
            HistogramOpts::new(
                "deepseek_v3_step_duration_seconds",
                "Duration of one step on all ranks, by kind (prefill, decode).",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["kind"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(step.clone()))
            .expect("unique name");
        // Known label values are exported from the start, at zero.
        for kind in ["prefill", "decode"] {
            step.with_label_values(&[kind]);
        }
        let decode_step = HistogramVec::new(
            HistogramOpts::new(
                "deepseek_v3_decode_step_duration_seconds",
                "Duration of one decode step, by batch size rounded up to a power of two.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["batch"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(decode_step.clone()))
            .expect("unique name");
        let decode_experts_read = HistogramVec::new(
            HistogramOpts::new(
                "deepseek_v3_decode_experts_read",
                "Experts a decode step's tokens chose in one MoE layer (read with \
                 --expert-stats-interval 1), by batch size rounded up to a power of two.",
            )
            .buckets(vec![
                1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 192.0, 256.0, 384.0, 512.0,
            ]),
            &["batch"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(decode_experts_read.clone()))
            .expect("unique name");
        let expert_imbalance = GaugeVec::new(
            Opts::new(
                "deepseek_v3_expert_load_imbalance",
                "Max / mean of a MoE layer's expert loads over the last window, over its \
                 logical experts or over the ranks under its current placement.",
            ),
            &["layer", "over"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(expert_imbalance.clone()))
            .expect("unique name");
        let m = Self {
            rank_failures: counter(
                "deepseek_v3_rank_failures_total",
                "Ranks lost while serving (the others went on without them).",
            ),
            ranks_lost: gauge("deepseek_v3_ranks_lost", "Ranks lost so far."),
            failed_sequences: counter(
                "deepseek_v3_request_failed_total",
                "Sequences that failed because the rank that held them was lost.",
            ),
            lost: std::sync::Mutex::new(Vec::new()),
            decode_step,
            decode_experts_read,
            expert_imbalance,
            eplb_layers: counter(
                "deepseek_v3_eplb_layers_replaced_total",
                "MoE layers whose experts were re-placed while serving.",
            ),
            eplb_moved: counter(
                "deepseek_v3_eplb_moved_experts_total",
                "Expert slots whose weights changed in re-placements.",
            ),
            eplb_duration: histogram(
                "deepseek_v3_eplb_duration_seconds",
                "Time of one re-placement of the experts (rank 0).",
                LATENCY_BUCKETS,
            ),
            requests: counter_vec(
                "deepseek_v3_http_requests_total",
                "HTTP requests answered, by endpoint and status code.",
                &["endpoint", "status"],
            ),
            prompt_tokens: counter(
                "deepseek_v3_prompt_tokens_total",
                "Prompt tokens of the sequences that finished.",
            ),
            generation_tokens: counter("deepseek_v3_generation_tokens_total", "Tokens generated."),
            finished: counter_vec(
                "deepseek_v3_request_success_total",
                "Sequences that finished, by finish reason.",
                &["finish_reason"],
            ),
            ttft: histogram(
                "deepseek_v3_time_to_first_token_seconds",
                "Time from a sequence's arrival to its first token.",
                LATENCY_BUCKETS,
            ),
            tpot: histogram(
                "deepseek_v3_time_per_output_token_seconds",
                "Time between consecutive tokens of a sequence.",
                TOKEN_BUCKETS,
            ),
            e2e: histogram(
                "deepseek_v3_e2e_request_latency_seconds",
                "Time from a sequence's arrival to its last token.",
                LATENCY_BUCKETS,
            ),
            queue: histogram(
                "deepseek_v3_request_queue_time_seconds",
                "Time a sequence waited before its prefill step.",
                LATENCY_BUCKETS,
            ),
            running: gauge(
                "deepseek_v3_num_requests_running",
                "Sequences in the running batch, over all ranks.",
            ),
            waiting: gauge(
                "deepseek_v3_num_requests_waiting",
                "Sequences waiting for a place in the batch.",
            ),
            step,
            registry,
        };
        for reason in ["stop", "length"] {
            m.finished.with_label_values(&[reason]);
        }
        m
    }

    /// Records the experts each MoE layer read in a decode step of `batch` sequences, when
    /// `report` is a read of that step alone.
    pub fn record_decode_experts(&self, report: &EplbReport, batch: usize) {
        if report.steps_read != 1 {
            return;
        }
        let h = self
            .decode_experts_read
            .with_label_values(&[&batch_label(batch)]);
        for l in &report.layers {
            h.observe(l.experts_read as f64);
        }
    }

    /// Records a read of the expert load statistics (and its re-placement, if any).
    pub fn record_eplb(&self, report: &EplbReport) {
        for l in &report.layers {
            let layer = l.layer.to_string();
            let ranks = l.ranks_after.unwrap_or(l.ranks);
            self.expert_imbalance
                .with_label_values(&[layer.as_str(), "experts"])
                .set(l.experts);
            self.expert_imbalance
                .with_label_values(&[layer.as_str(), "ranks"])
                .set(ranks);
        }
        if report.replaced_layers > 0 {
            self.eplb_layers.inc_by(report.replaced_layers as u64);
            self.eplb_moved.inc_by(report.moved_slots as u64);
            self.eplb_duration.observe(report.elapsed.as_secs_f64());
        }
    }

    /// Everything in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding our own metric families into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn decode_batches_are_labelled_by_power_of_two() {
        let labels: Vec<String> = [0, 1, 3, 4, 33, 64]
            .iter()
            .map(|&n| super::batch_label(n))
            .collect();
        assert_eq!(labels, ["1", "1", "4", "4", "64", "64"]);
    }

    use super::*;

    #[test]
    fn renders_every_family_in_text_format() {
        let m = Metrics::new();
        m.requests
            .with_label_values(&["/v1/completions", "200"])
            .inc();
        m.ttft.observe(0.02);
        m.step.with_label_values(&["decode"]).observe(0.003);
        m.running.set(3);
        let text = m.render();
        for needle in [
            "# TYPE deepseek_v3_http_requests_total counter",
            "deepseek_v3_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1",
            "# TYPE deepseek_v3_time_to_first_token_seconds histogram",
            "deepseek_v3_time_to_first_token_seconds_bucket{le=\"0.04\"} 1",
            "deepseek_v3_time_to_first_token_seconds_count 1",
            "deepseek_v3_step_duration_seconds_count{kind=\"decode\"} 1",
            "deepseek_v3_num_requests_running 3",
            "deepseek_v3_num_requests_waiting 0",
            "deepseek_v3_generation_tokens_total 0",
            "# TYPE deepseek_v3_time_per_output_token_seconds histogram",
            "deepseek_v3_eplb_layers_replaced_total 0",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
    }

    #[test]
    fn a_load_balancing_report_sets_each_layers_imbalance() {
        use crate::eplb::{EplbReport, LayerBalance};
        let m = Metrics::new();
        let report = EplbReport {
            layers: vec![
                LayerBalance {
                    layer: 1,
                    experts: 3.5,
                    ranks: 1.25,
                    ranks_after: Some(1.0),
                    experts_read: 7,
                },
                LayerBalance {
                    layer: 2,
                    experts: 2.0,
                    ranks: 1.5,
                    ranks_after: None,
                    experts_read: 5,
                },
            ],
            steps_read: 1,
            replaced_layers: 1,
            moved_slots: 6,
            bytes_sent: 100,
            elapsed: std::time::Duration::from_millis(30),
        };
        m.record_eplb(&report);
        // A read of one decode step of 40 sequences: each layer's experts read.
        m.record_decode_experts(&report, 40);
        // A read of several steps says nothing of one step.
        m.record_decode_experts(
            &EplbReport {
                steps_read: 4,
                ..report.clone()
            },
            40,
        );
        let text = m.render();
        for needle in [
            "deepseek_v3_expert_load_imbalance{layer=\"1\",over=\"experts\"} 3.5",
            "deepseek_v3_expert_load_imbalance{layer=\"1\",over=\"ranks\"} 1",
            "deepseek_v3_expert_load_imbalance{layer=\"2\",over=\"ranks\"} 1.5",
            "deepseek_v3_eplb_layers_replaced_total 1",
            "deepseek_v3_eplb_moved_experts_total 6",
            "deepseek_v3_eplb_duration_seconds_count 1",
            "deepseek_v3_decode_experts_read_sum{batch=\"64\"} 12",
            "deepseek_v3_decode_experts_read_count{batch=\"64\"} 2",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
    }
}
