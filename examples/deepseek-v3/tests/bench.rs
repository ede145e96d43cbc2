//! `bench-serve` against a real `serve` (random tiny weights, CPU) at concurrency 1 and 4: every
//! request completes with exactly the asked number of tokens, and the reported throughput and
//! latencies are finite, positive and ordered (p99 >= p50); the server kept to its prefill
//! token budget.

mod common;

use std::process::Command;

use common::{Server, BIN};
use serde_json::Value;

const PROMPT: usize = 24;
const OUTPUT: usize = 8;

fn positive(v: &Value, what: &str) -> f64 {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x.is_finite() && x > 0.0, "{what} = {x}");
    x
}

fn check_summary(s: &Value, what: &str) {
    let p50 = positive(&s["p50"], &format!("{what}.p50"));
    let p99 = positive(&s["p99"], &format!("{what}.p99"));
    let max = positive(&s["max"], &format!("{what}.max"));
    positive(&s["mean"], &format!("{what}.mean"));
    assert!(p99 >= p50 && max >= p99, "{what}: {s}");
}

#[test]
fn bench_serve_reports_sane_numbers() {
    let server = Server::start(
        &[],
        &[
            "--init",
            "random",
            "--max-batch",
            "4",
            "--max-prompt-tokens",
            "64",
            "--max-tokens-limit",
            "16",
            // Two prompts of 24 tokens exceed it: every request gets its own prefill step.
            "--max-prefill-tokens",
            "30",
        ],
    );
    let out_file = common::scratch("bench").join("bench.json");
    let url = format!("http://127.0.0.1:{}", server.port);
    let out = Command::new(BIN)
        .args([
            "bench-serve",
            "--url",
            &url,
            "--concurrency",
            "1,4",
            "--num-requests",
            "8",
            "--prompt-tokens",
            &PROMPT.to_string(),
            "--output-tokens",
            &OUTPUT.to_string(),
            "--json",
        ])
        .arg(&out_file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench-serve failed: {}\n{stdout}\nserver:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.stderr_text()
    );
    assert!(stdout.contains("TTFT p50"), "no table: {stdout}");

    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out_file).unwrap()).unwrap();
    assert_eq!(doc["model"], "deepseek-v3", "{doc}");
    let results = doc["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "{doc}");
    for (r, concurrency) in results.iter().zip([1, 4]) {
        assert_eq!(r["concurrency"], concurrency, "{r}");
        assert_eq!(r["num_requests"], 8, "{r}");
        assert_eq!(r["completed"], 8, "{r}");
        assert_eq!(r["failed"], 0, "{r}");
        assert_eq!(r["wrong_output_length"], 0, "{r}");
        assert_eq!(r["total_output_tokens"], 8 * OUTPUT, "{r}");
        assert_eq!(r["total_prompt_tokens"], 8 * PROMPT, "{r}");
        let secs = positive(&r["duration_s"], "duration_s");
        let rps = positive(&r["request_throughput"], "request_throughput");
        let tps = positive(&r["output_throughput"], "output_throughput");
        assert!((rps * secs - 8.0).abs() < 1e-6, "{r}");
        assert!((tps / rps - OUTPUT as f64).abs() < 1e-6, "{r}");
        check_summary(&r["ttft_ms"], "ttft_ms");
        check_summary(&r["tpot_ms"], "tpot_ms");
        check_summary(&r["e2e_ms"], "e2e_ms");
        // A request's latency covers its first token and the rest.
        assert!(
            r["e2e_ms"]["p50"].as_f64() > r["ttft_ms"]["p50"].as_f64(),
            "{r}"
        );
    }
    // The server saw every request: the warm-up plus 16 counted ones, all answered 200.
    let metrics = common::http(server.port, "GET", "/metrics", None).body;
    assert!(
        metrics.contains(
            r#"deepseek_v3_http_requests_total{endpoint="/v1/completions",status="200"} 17"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"deepseek_v3_step_duration_seconds_count{kind="prefill"} 17"#),
        "{metrics}"
    );
}

#[test]
fn bench_serve_fails_loudly_when_requests_fail() {
    // Nothing listens on a freshly freed port: the warm-up request fails with a clear error.
    let port = common::free_port();
    let out = Command::new(BIN)
        .args([
            "bench-serve",
            "--url",
            &format!("http://127.0.0.1:{port}"),
            "--model",
            "m",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("warm-up request failed"), "{stderr}");
    let out = Command::new(BIN)
        .args(["bench-serve", "--url", "https://x", "--model", "m"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--url \"https://x\" must be an http://"),
        "{stderr}"
    );
}
