//! What users of other OpenAI-compatible servers expect, on a server with random weights made
//! at start (`--init random`, the tiny preset) and an API key: 401 without the key, 404 for
//! another model, 415 for a body that is not JSON, 400 for fields it does not implement,
//! `GET /v1/models/{id}`, token-id prompts, `ignore_eos`, `stream_options.include_usage`, chat
//! streams that start with the role, Prometheus `/metrics`, and one log line per request.

mod common;

use std::process::Command;

use common::{request, sse_data, Server, BIN};
use serde_json::Value;

const KEY: &str = "sk-test-123";

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// A JSON request with the key.
fn post(port: u16, path: &str, body: &str) -> common::HttpResponse {
    let auth = format!("Bearer {KEY}");
    request(
        port,
        "POST",
        path,
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &auth),
        ],
        Some(body),
    )
}

fn get(port: u16, path: &str) -> common::HttpResponse {
    let auth = format!("Bearer {KEY}");
    request(port, "GET", path, &[("Authorization", &auth)], None)
}

fn assert_error(resp: &common::HttpResponse, status: u16, needle: &str) -> Value {
    assert_eq!(resp.status, status, "{}", resp.body);
    let v = json(&resp.body);
    let msg = v["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error.message: {}", resp.body));
    assert!(v["error"]["type"].is_string(), "{}", resp.body);
    assert!(
        msg.contains(needle),
        "error {msg:?} does not mention {needle:?}"
    );
    v
}

/// The value of the Prometheus sample `name` (with its labels, exactly as rendered).
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no sample {name} in:\n{metrics}"))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn openai_api_details() {
    let server = Server::start(
        &[],
        &[
            "--init",
            "random",
            "--api-key",
            KEY,
            "--model-name",
            "tiny-ds",
            "--max-batch",
            "4",
            "--max-tokens-limit",
            "32",
        ],
    );
    let port = server.port;

    // The key: needed on /v1/*, not on /health and /metrics.
    assert_error(
        &request(port, "GET", "/v1/models", &[], None),
        401,
        "API key",
    );
    assert_error(
        &request(
            port,
            "GET",
            "/v1/models",
            &[("Authorization", "Bearer wrong")],
            None,
        ),
        401,
        "Incorrect API key",
    );
    assert_eq!(request(port, "GET", "/health", &[], None).status, 200);
    assert_eq!(request(port, "GET", "/metrics", &[], None).status, 200);

    // Models: the list, one model by id, and 404 for another.
    let list = json(&get(port, "/v1/models").body);
    assert_eq!(list["data"][0]["id"], "tiny-ds");
    assert!(list["data"][0]["created"].is_u64(), "{list}");
    let one = get(port, "/v1/models/tiny-ds");
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(json(&one.body)["id"], "tiny-ds");
    let v = assert_error(&get(port, "/v1/models/gpt-4o"), 404, "gpt-4o");
    assert_eq!(v["error"]["code"], "model_not_found");

    // Another model in a request: 404, like OpenAI and vLLM.
    let v = assert_error(
        &post(
            port,
            "/v1/completions",
            r#"{"model": "gpt-4o", "prompt": "hi"}"#,
        ),
        404,
        "gpt-4o",
    );
    assert_eq!(v["error"]["code"], "model_not_found");

    // A body that is not declared as JSON: 415.
    let auth = format!("Bearer {KEY}");
    let plain = request(
        port,
        "POST",
        "/v1/completions",
        &[("Content-Type", "text/plain"), ("Authorization", &auth)],
        Some(r#"{"prompt": "hi"}"#),
    );
    assert_error(&plain, 415, "text/plain");
    let untyped = request(
        port,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", &auth)],
        Some(r#"{"messages": []}"#),
    );
    assert_error(&untyped, 415, "application/json");

    // Fields this server does not implement: 400 naming them.
    for (path, body, field) in [
        (
            "/v1/completions",
            r#"{"prompt": "hi", "logprobs": 2}"#,
            "logprobs",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "echo": true}"#,
            "echo",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": true}"#,
            "logprobs",
        ),
    ] {
        let v = assert_error(&post(port, path, body), 400, "not supported");
        assert_eq!(v["error"]["param"], field);
    }

    // Token-id prompt, ignore_eos: exactly max_tokens tokens, prompt counted as sent.
    let resp = post(
        port,
        "/v1/completions",
        r#"{"model": "tiny-ds", "prompt": [5, 60, 70, 80], "max_tokens": 12, "ignore_eos": true, "temperature": 0}"#,
    );
    assert_eq!(resp.status, 200, "{}", resp.body);
    let v = json(&resp.body);
    assert_eq!(v["usage"]["prompt_tokens"], 4, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_error(
        &post(port, "/v1/completions", r#"{"prompt": [5, 320]}"#),
        400,
        "token id 320",
    );

    // Streaming with usage: chunks carry "usage": null, the last one before [DONE] has the
    // counts and no choices.
    let resp = post(
        port,
        "/v1/completions",
        r#"{"prompt": "The quick", "max_tokens": 6, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}"#,
    );
    assert_eq!(resp.status, 200, "{}", resp.body);
    let data = sse_data(&resp.body);
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        resp.body
    );
    let usage = json(&data[data.len() - 2]);
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0, "{usage}");
    assert_eq!(usage["usage"]["completion_tokens"], 6, "{usage}");
    let first = json(&data[0]);
    assert!(
        first["usage"].is_null() && first.get("usage").is_some(),
        "{first}"
    );

    // Chat streaming: the first chunk gives the role, the last choice chunk the finish reason.
    let resp = post(
        port,
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], "max_tokens": 4, "stream": true}"#,
    );
    assert_eq!(resp.status, 200, "{}", resp.body);
    let data = sse_data(&resp.body);
    let first = json(&data[0]);
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant", "{first}");
    let last = json(&data[data.len() - 2]);
    assert!(last["choices"][0]["finish_reason"].is_string(), "{last}");

    // Metrics: requests by status, tokens, latency histograms, gauges, step times.
    let metrics = request(port, "GET", "/metrics", &[], None);
    assert!(
        metrics.headers.to_ascii_lowercase().contains("text/plain"),
        "{}",
        metrics.headers
    );
    let m = &metrics.body;
    for (name, at_least) in [
        (
            r#"deepseek_v3_http_requests_total{endpoint="/v1/completions",status="200"}"#,
            2.0,
        ),
        (
            r#"deepseek_v3_http_requests_total{endpoint="/v1/completions",status="404"}"#,
            1.0,
        ),
        (
            r#"deepseek_v3_http_requests_total{endpoint="/v1/completions",status="415"}"#,
            1.0,
        ),
        (
            r#"deepseek_v3_http_requests_total{endpoint="/v1/models",status="401"}"#,
            2.0,
        ),
        ("deepseek_v3_generation_tokens_total", 19.0),
        ("deepseek_v3_prompt_tokens_total", 4.0),
        ("deepseek_v3_time_to_first_token_seconds_count", 3.0),
        ("deepseek_v3_time_per_output_token_seconds_count", 16.0),
        (
            r#"deepseek_v3_step_duration_seconds_count{kind="prefill"}"#,
            1.0,
        ),
        (
            r#"deepseek_v3_step_duration_seconds_count{kind="decode"}"#,
            1.0,
        ),
        (
            r#"deepseek_v3_request_success_total{finish_reason="length"}"#,
            2.0,
        ),
    ] {
        let v = sample(m, name);
        assert!(v >= at_least, "{name} = {v}, expected >= {at_least}");
    }
    assert_eq!(sample(m, "deepseek_v3_num_requests_running"), 0.0);
    assert_eq!(sample(m, "deepseek_v3_num_requests_waiting"), 0.0);

    // One log line per request at info, by default.
    let log = server.stderr_text();
    assert!(
        log.lines()
            .any(|l| l.contains("POST /v1/completions 200 in ")),
        "no request line in:\n{log}"
    );
    assert!(log.contains("GET /v1/models/gpt-4o 404"), "{log}");
}

#[test]
fn init_options_are_checked() {
    let run = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&[
        "generate", "--prompt", "x", "--init", "random", "--model", "/m",
    ]);
    assert!(err.contains("--model /m and --init random"), "{err}");
    let err = run(&["generate", "--prompt", "x", "--config", "c.json"]);
    assert!(err.contains("--config c.json needs --init random"), "{err}");
    let err = run(&[
        "generate",
        "--prompt",
        "x",
        "--init",
        "random",
        "--config",
        "/no/such.json",
    ]);
    assert!(err.contains("/no/such.json"), "{err}");
    let err = run(&["generate", "--prompt", "x", "--init", "zeros"]);
    assert!(err.contains("zeros"), "{err}");
    let err = run(&["generate", "--prompt", "x", "--quant", "fp8"]);
    assert!(err.contains("--quant fp8 needs --init random"), "{err}");
}

#[test]
fn random_fp8_init_generates_and_prints_its_memory_plan() {
    let out = Command::new(BIN)
        .args([
            "generate",
            "--init",
            "random",
            "--quant",
            "fp8",
            "--json",
            "--ignore-eos",
            "--max-tokens",
            "3",
            "--prompt",
            "a",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let first = json(stdout.lines().next().unwrap());
    assert_eq!(first["tokens"].as_array().unwrap().len(), 3, "{first}");
    // The tiny model: 4 layers of 5 attention projections, a dense MLP, and 3 MoE layers of 16
    // experts and a shared one (3 projections each).
    let projections = 4 * 5 + 3 + 3 * (16 + 1) * 3;
    for want in [
        "rank 0: memory plan ".to_string(),
        format!("{projections} fp8 weights dequantized to f32"),
    ] {
        assert!(stderr.contains(&want), "no {want:?} in:\n{stderr}");
    }
}

#[test]
fn random_init_generates_with_timings() {
    let out = Command::new(BIN)
        .args([
            "generate",
            "--init",
            "random",
            "--json",
            "--ignore-eos",
            "--max-tokens",
            "5",
            "--prompt",
            "a",
            "--prompt",
            "bc",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Value> = stdout.lines().map(json).collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    for l in &lines[..2] {
        assert_eq!(l["tokens"].as_array().unwrap().len(), 5, "{l}");
        assert!(l["ttft_ms"].as_f64().unwrap() > 0.0, "{l}");
        assert!(l["tpot_ms"].as_f64().unwrap() > 0.0, "{l}");
    }
    let s = &lines[2]["summary"];
    assert_eq!(s["generated_tokens"], 10, "{s}");
    assert!(s["tokens_per_s"].as_f64().unwrap() > 0.0, "{s}");
    assert!(
        s["tpot_ms"]["p99"].as_f64() >= s["tpot_ms"]["p50"].as_f64(),
        "{s}"
    );
    // Without --json the same numbers go to stderr, after the texts.
    let out = Command::new(BIN)
        .args([
            "generate",
            "--init",
            "random",
            "--max-tokens",
            "3",
            "--prompt",
            "a",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tokens/s; time to first token mean"),
        "{stderr}"
    );
}
