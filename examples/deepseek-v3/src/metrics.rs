//! The serving metrics behind `GET /metrics`, in the Prometheus text format: requests by
//! endpoint and status, prompt and generated tokens, time to first token, time per output
//! token, end-to-end latency, queue time, running and waiting sequences, and the duration of
//! prefill and decode steps. Names follow vLLM's where there is one (`deepseek_v3_` for
//! `vllm:`). Each [`Metrics`] owns its registry, so tests can run several side by side.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

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
        let m = Self {
            decode_step,
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
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
    }
}
