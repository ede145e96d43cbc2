//! The HTTP server, started on a free port, answers completions (plain and streaming) and chat
//! completions, and rejects malformed or oversized requests with JSON errors.

mod common;

use std::process::Command;

use common::{Server, BIN};
use serde_json::Value;

fn gen_model(name: &str) -> std::path::PathBuf {
    let dir = common::scratch(name);
    let out = Command::new(BIN)
        .args(["gen-checkpoint", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

/// Starts `serve` on the checkpoint `model`, directly or under `launch_args` (`launch ... --`).
fn start_server(model: &std::path::Path, launch_args: &[&str]) -> Server {
    start_server_with(model, launch_args, &[])
}

/// [`start_server`] with more `serve` arguments.
fn start_server_with(model: &std::path::Path, launch_args: &[&str], more: &[&str]) -> Server {
    let model = model.display().to_string();
    let mut args = vec![
        "--max-prompt-tokens",
        "64",
        "--max-tokens-limit",
        "16",
        "--max-batch",
        "4",
        "--model",
        &model,
    ];
    args.extend_from_slice(more);
    Server::start(launch_args, &args)
}

/// `launch` arguments for two ranks meeting on `port`.
fn two_ranks(port: &str) -> [&str; 6] {
    [
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        port,
        "--",
    ]
}

/// The greedy texts of `prompts`, sent to the server on `port` all at once.
fn greedy_texts_at_once(port: u16, prompts: &[&str]) -> Vec<String> {
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let p = p.to_string();
            std::thread::spawn(move || greedy_text(port, &p))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

fn assert_error(resp: &common::HttpResponse, status: u16, needle: &str) {
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
}

#[test]
fn server_answers_and_rejects() {
    let model = gen_model("server-model");
    let server = start_server(&model, &[]);
    let port = server.port;

    let health = common::http(port, "GET", "/health", None);
    assert_eq!(health.status, 200, "{}", health.body);

    // Plain completion, greedy: deterministic, and equal to the streamed text.
    let req = r#"{"model": "deepseek-v3", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}"#;
    let resp = common::http(port, "POST", "/v1/completions", Some(req));
    assert_eq!(resp.status, 200, "{}", resp.body);
    let v = json(&resp.body);
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let reason = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(reason == "length" || reason == "stop", "{reason}");
    let completion_tokens = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=8).contains(&completion_tokens), "{v}");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() >= 2);

    let again = json(&common::http(port, "POST", "/v1/completions", Some(req)).body);
    assert_eq!(again["choices"][0]["text"], v["choices"][0]["text"]);

    // Streaming: SSE chunks whose texts add up to the same completion, then [DONE].
    let stream_req =
        r#"{"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "stream": true}"#;
    let resp = common::http(port, "POST", "/v1/completions", Some(stream_req));
    assert_eq!(resp.status, 200, "{}", resp.body);
    assert!(
        resp.headers
            .to_ascii_lowercase()
            .contains("text/event-stream"),
        "{}",
        resp.headers
    );
    let data = common::sse_data(&resp.body);
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        resp.body
    );
    let mut streamed = String::new();
    let mut finished = false;
    for d in &data[..data.len() - 1] {
        let c = json(d);
        streamed.push_str(c["choices"][0]["text"].as_str().unwrap());
        finished |= c["choices"][0]["finish_reason"].is_string();
    }
    assert!(finished, "no chunk carried a finish_reason: {}", resp.body);
    assert_eq!(streamed, text);

    // Batched prompts and sampling with a seed.
    let resp = common::http(
        port,
        "POST",
        "/v1/completions",
        Some(
            r#"{"prompt": ["a", "b", "c"], "max_tokens": 4, "temperature": 0.8, "top_p": 0.9, "seed": 1}"#,
        ),
    );
    assert_eq!(resp.status, 200, "{}", resp.body);
    assert_eq!(json(&resp.body)["choices"].as_array().unwrap().len(), 3);

    // Chat, plain and streaming.
    let chat = r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], "max_tokens": 5}"#;
    let resp = common::http(port, "POST", "/v1/chat/completions", Some(chat));
    assert_eq!(resp.status, 200, "{}", resp.body);
    let v = json(&resp.body);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["choices"][0]["message"]["content"].is_string());
    let chat_stream =
        r#"{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "stream": true}"#;
    let resp = common::http(port, "POST", "/v1/chat/completions", Some(chat_stream));
    assert_eq!(resp.status, 200, "{}", resp.body);
    assert!(resp.body.contains("chat.completion.chunk"), "{}", resp.body);
    assert!(resp.body.contains("[DONE]"), "{}", resp.body);

    // Errors: JSON bodies with 4xx, and the server keeps working.
    assert_error(
        &common::http(port, "POST", "/v1/completions", Some("{not json")),
        400,
        "JSON",
    );
    assert_error(
        &common::http(
            port,
            "POST",
            "/v1/completions",
            Some(r#"{"max_tokens": 3}"#),
        ),
        400,
        "prompt",
    );
    assert_error(
        &common::http(port, "POST", "/v1/completions", Some(r#"{"prompt": 5}"#)),
        400,
        "prompt",
    );
    assert_error(
        &common::http(
            port,
            "POST",
            "/v1/completions",
            Some(r#"{"prompt": "x", "max_tokens": 17}"#),
        ),
        400,
        "--max-tokens-limit",
    );
    let long = format!(r#"{{"prompt": "{}"}}"#, "word ".repeat(100));
    assert_error(
        &common::http(port, "POST", "/v1/completions", Some(&long)),
        400,
        "--max-prompt-tokens",
    );
    assert_error(
        &common::http(
            port,
            "POST",
            "/v1/completions",
            Some(r#"{"prompt": ["a","b","c","d","e"]}"#),
        ),
        400,
        "--max-batch",
    );
    assert_error(
        &common::http(
            port,
            "POST",
            "/v1/chat/completions",
            Some(r#"{"messages": [{"role": "robot", "content": "x"}]}"#),
        ),
        400,
        "role",
    );
    assert_error(
        &common::http(port, "GET", "/v1/nothing", None),
        404,
        "endpoint",
    );
    let ok = common::http(
        port,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "still alive", "max_tokens": 2}"#),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
}

fn greedy_text(port: u16, prompt: &str) -> String {
    let req = format!(r#"{{"prompt": "{prompt}", "max_tokens": 8, "temperature": 0}}"#);
    let resp = common::http(port, "POST", "/v1/completions", Some(&req));
    assert_eq!(resp.status, 200, "{}", resp.body);
    json(&resp.body)["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn two_rank_server_batches_concurrent_requests_like_one_rank() {
    let model = gen_model("server-2-model");
    let prompts = [
        "The quick",
        "brown fox",
        "jumps over",
        "the lazy dog",
        "again",
    ];
    let want: Vec<String> = {
        let one = start_server(&model, &[]);
        prompts.iter().map(|p| greedy_text(one.port, p)).collect()
    };
    let port = common::free_port().to_string();
    let two = start_server(&model, &two_ranks(&port));
    // All at once: the scheduler batches them over both ranks.
    assert_eq!(greedy_texts_at_once(two.port, &prompts), want);
}

/// Re-placement while serving (`--eplb-interval 1`: after every step the experts are re-placed
/// from the last two reads of the load statistics, moving between the two ranks): the same
/// greedy text as one rank without it, the moves counted in /metrics with each layer's
/// imbalance.
#[test]
fn re_placing_experts_every_step_keeps_the_text() {
    let model = gen_model("server-eplb-model");
    let prompts = ["The quick", "brown fox", "jumps over", "the lazy dog"];
    let want: Vec<String> = {
        let one = start_server(&model, &[]);
        prompts.iter().map(|p| greedy_text(one.port, p)).collect()
    };
    let port = common::free_port().to_string();
    let two = start_server_with(
        &model,
        &two_ranks(&port),
        &[
            "--num-redundant-experts",
            "2",
            "--eplb-interval",
            "1",
            "--eplb-window",
            "2",
        ],
    );
    assert_eq!(greedy_texts_at_once(two.port, &prompts), want);
    let metrics = common::http(two.port, "GET", "/metrics", None).body;
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{metrics}"))
    };
    assert!(value("deepseek_v3_eplb_layers_replaced_total") >= 1.0);
    assert!(value("deepseek_v3_eplb_moved_experts_total") >= 1.0);
    // Every MoE layer (1, 2, 3 of the tiny model) reports its imbalance.
    for layer in 1..4 {
        let over_experts = value(&format!(
            "deepseek_v3_expert_load_imbalance{{layer=\"{layer}\",over=\"experts\"}}"
        ));
        assert!(over_experts >= 1.0, "layer {layer}: {over_experts}");
    }
}
