//! `bench-serve`: a serving benchmark like vLLM's `benchmark_serving`. For each concurrency
//! level, that many clients send streaming `/v1/completions` requests back to back until
//! `--num-requests` are done; every prompt is `--prompt-tokens` random token ids and every
//! answer exactly `--output-tokens` tokens (`ignore_eos`, greedy). Reports request throughput,
//! output and total tokens per second, time to first token (TTFT), time per output token after
//! the first (TPOT) and end-to-end latency (mean, p50, p99), as a table and optionally JSON.

mod client;

pub use client::{RequestOutcome, Target};

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};

use crate::stats::Summary;

/// Prompt token ids are drawn from this range: valid in any vocabulary of 256 tokens or more.
const PROMPT_IDS: std::ops::Range<u32> = 10..256;

/// Options of `bench-serve`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// The server, `http://host:port`.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Model name sent in requests (default: the first of `GET /v1/models`).
    #[arg(long)]
    pub model: Option<String>,
    /// Concurrency levels, comma-separated: that many requests in flight at once.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub concurrency: Vec<usize>,
    /// Requests per level (default: 4 x the level's concurrency).
    #[arg(long)]
    pub num_requests: Option<usize>,
    /// Prompt length in tokens (random token ids, sent as a token-id prompt).
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens to generate per request (`ignore_eos`, so exactly this many).
    #[arg(long, default_value_t = 128)]
    pub output_tokens: usize,
    /// Seed of the prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "DEEPSEEK_V3_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 600)]
    pub timeout_secs: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The results of one concurrency level.
#[derive(Clone, Debug, Serialize)]
pub struct LevelReport {
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Requests sent.
    pub num_requests: usize,
    /// Requests that completed.
    pub completed: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Completed requests whose output was not exactly `--output-tokens` tokens.
    pub wrong_output_length: usize,
    /// Wall time of the level, seconds.
    pub duration_s: f64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Generated tokens per second.
    pub output_throughput: f64,
    /// Prompt plus generated tokens per second.
    pub total_token_throughput: f64,
    /// Prompt tokens of the completed requests, as the server counted them.
    pub total_prompt_tokens: usize,
    /// Generated tokens of the completed requests.
    pub total_output_tokens: usize,
    /// Time to first token, milliseconds.
    pub ttft_ms: Option<Summary>,
    /// Time per output token after the first, milliseconds.
    pub tpot_ms: Option<Summary>,
    /// End-to-end latency, milliseconds.
    pub e2e_ms: Option<Summary>,
    /// The first few errors.
    pub errors: Vec<String>,
}

impl LevelReport {
    fn new(
        concurrency: usize,
        outcomes: &[RequestOutcome],
        duration: f64,
        output_tokens: usize,
    ) -> Self {
        let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
        let total_prompt_tokens: usize = ok.iter().map(|o| o.prompt_tokens).sum();
        let total_output_tokens: usize = ok.iter().map(|o| o.output_tokens).sum();
        let ms = |v: Vec<f64>| Summary::of(&v).map(|s| s.scaled(1e3));
        let duration = duration.max(1e-9);
        Self {
            concurrency,
            num_requests: outcomes.len(),
            completed: ok.len(),
            failed: outcomes.len() - ok.len(),
            wrong_output_length: ok
                .iter()
                .filter(|o| o.output_tokens != output_tokens)
                .count(),
            duration_s: duration,
            request_throughput: ok.len() as f64 / duration,
            output_throughput: total_output_tokens as f64 / duration,
            total_token_throughput: (total_prompt_tokens + total_output_tokens) as f64 / duration,
            total_prompt_tokens,
            total_output_tokens,
            ttft_ms: ms(ok.iter().map(|o| o.ttft).collect()),
            tpot_ms: ms(ok.iter().filter_map(|o| o.tpot()).collect()),
            e2e_ms: ms(ok.iter().map(|o| o.latency).collect()),
            errors: outcomes
                .iter()
                .filter_map(|o| o.error.clone())
                .take(5)
                .collect(),
        }
    }
}

/// The request body of prompt `i`.
fn request_body(model: &str, args: &BenchArgs, i: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(args.seed.wrapping_add(i as u64));
    let prompt: Vec<u32> = (0..args.prompt_tokens)
        .map(|_| rng.random_range(PROMPT_IDS))
        .collect();
    json!({
        "model": model, "prompt": prompt, "max_tokens": args.output_tokens,
        "temperature": 0.0, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string()
    .into_bytes()
}

/// Runs `n` requests with `concurrency` clients; returns the outcomes and the wall time.
async fn run_level(
    client: &reqwest::Client,
    target: &Target,
    bodies: Arc<Vec<Vec<u8>>>,
    concurrency: usize,
) -> (Vec<RequestOutcome>, f64) {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, target, bodies, next) =
                (client.clone(), target.clone(), bodies.clone(), next.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(body) = bodies.get(i) else { break };
                    out.push(client::run_one(&client, &target, body.clone()).await);
                }
                out
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for w in workers {
        match w.await {
            Ok(o) => outcomes.extend(o),
            Err(e) => outcomes.push(RequestOutcome {
                error: Some(format!("client task failed: {e}")),
                ..RequestOutcome::default()
            }),
        }
    }
    (outcomes, start.elapsed().as_secs_f64())
}

fn print_table(reports: &[LevelReport]) {
    println!(
        "{:>11} {:>8} {:>6} {:>9} {:>8} {:>12} {:>11} {:>9} {:>9} {:>9} {:>9}",
        "concurrency",
        "requests",
        "failed",
        "time (s)",
        "req/s",
        "output tok/s",
        "total tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99"
    );
    let ms = |s: Option<Summary>, f: fn(&Summary) -> f64| {
        s.map_or("n/a".to_string(), |s| format!("{:.1}", f(&s)))
    };
    for r in reports {
        println!(
            "{:>11} {:>8} {:>6} {:>9.2} {:>8.2} {:>12.1} {:>11.1} {:>9} {:>9} {:>9} {:>9}",
            r.concurrency,
            r.num_requests,
            r.failed,
            r.duration_s,
            r.request_throughput,
            r.output_throughput,
            r.total_token_throughput,
            ms(r.ttft_ms, |s| s.p50),
            ms(r.ttft_ms, |s| s.p99),
            ms(r.tpot_ms, |s| s.p50),
            ms(r.tpot_ms, |s| s.p99),
        );
    }
    println!("(TTFT and TPOT in milliseconds; TPOT is (latency - TTFT) / (output tokens - 1))");
}

/// `bench-serve` (see the module docs). Fails, after reporting, when any request failed or got
/// another number of output tokens than asked.
pub fn bench_serve(args: &BenchArgs) -> Result<()> {
    let base = args.url.trim_end_matches('/').to_string();
    if !base.starts_with("http://") {
        bail!(
            "--url {:?} must be an http:// address (this client has no TLS)",
            args.url
        );
    }
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!(
            "--concurrency {:?} must list levels of at least 1",
            args.concurrency
        );
    }
    if args.prompt_tokens == 0 || args.output_tokens == 0 {
        bail!(
            "--prompt-tokens {} and --output-tokens {} must be at least 1",
            args.prompt_tokens,
            args.output_tokens
        );
    }
    if args.num_requests == Some(0) {
        bail!("--num-requests must be at least 1, got 0");
    }
    let target = Target {
        base,
        api_key: args.api_key.clone(),
        timeout: Duration::from_secs(args.timeout_secs),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let reports = rt.block_on(async {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(usize::MAX)
            .build()
            .context("cannot build the HTTP client")?;
        let model = match &args.model {
            Some(m) => m.clone(),
            None => {
                let v = target
                    .get_json(&client, "/v1/models")
                    .await
                    .map_err(anyhow::Error::msg)?;
                v["data"][0]["id"]
                    .as_str()
                    .with_context(|| format!("GET /v1/models lists no model: {v}"))?
                    .to_string()
            }
        };
        // One request first, not counted: connections and lazy initialisation.
        let warm = client::run_one(&client, &target, request_body(&model, args, usize::MAX)).await;
        if let Some(e) = warm.error {
            bail!("the warm-up request failed: {e}");
        }
        let mut reports = Vec::new();
        for &c in &args.concurrency {
            let n = args.num_requests.unwrap_or(4 * c);
            let offset = reports.len() * 1_000_000;
            let bodies: Vec<Vec<u8>> = (0..n)
                .map(|i| request_body(&model, args, offset + i))
                .collect();
            eprintln!("bench-serve: concurrency {c}, {n} requests ...");
            let (outcomes, secs) = run_level(&client, &target, Arc::new(bodies), c).await;
            reports.push(LevelReport::new(c, &outcomes, secs, args.output_tokens));
        }
        Ok((model, reports))
    });
    let (model, reports) = reports?;
    print_table(&reports);
    if let Some(path) = &args.json {
        let doc: Value = json!({
            "url": args.url, "model": model, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens, "seed": args.seed, "results": reports,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("cannot write --json {}", path.display()))?;
    }
    let failed: usize = reports.iter().map(|r| r.failed).sum();
    let wrong: usize = reports.iter().map(|r| r.wrong_output_length).sum();
    if failed > 0 || wrong > 0 {
        let first = reports.iter().flat_map(|r| r.errors.first()).next();
        bail!(
            "{failed} requests failed and {wrong} got another length than --output-tokens {}{}",
            args.output_tokens,
            first.map_or(String::new(), |e| format!("; first error: {e}"))
        );
    }
    Ok(())
}
