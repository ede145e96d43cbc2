//! The launcher, run as 2 nodes x 2 ranks over loopback (two `launch` invocations), generates
//! the same greedy tokens as a single process (whose `--json` summary reports its speed); a
//! failing rank stops the job, and the launcher names the first rank that failed and why.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_deepseek-v3");

const PROMPTS: [&str; 5] = [
    "The quick brown fox",
    "Experts travel to",
    "In the beginning",
    "a",
    "Then the model wrote",
];

fn generate_args(model: Option<&Path>) -> Vec<String> {
    let mut args = vec![
        "generate".to_string(),
        "--json".into(),
        "--max-tokens".into(),
        "6".into(),
    ];
    if let Some(m) = model {
        args.push("--model".into());
        args.push(m.display().to_string());
    }
    for p in PROMPTS {
        args.push("--prompt".into());
        args.push(p.into());
    }
    args
}

/// The `tokens` of every JSON result line on stdout (rank prefixes stripped), by index.
fn results(out: &Output) -> Vec<Vec<u64>> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut res = vec![None; PROMPTS.len()];
    for line in stdout.lines() {
        let line = line.strip_prefix("[rank 0] ").unwrap_or(line);
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
            let Some(i) = v["index"].as_u64().map(|i| i as usize) else {
                continue; // the summary line
            };
            let toks = v["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap())
                .collect();
            res[i] = Some(toks);
        }
    }
    res.into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|| panic!("no result for prompt {i}; stdout:\n{stdout}")))
        .collect()
}

/// The `{"summary": ...}` line of `generate --json`.
fn summary(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .map(|l| l.strip_prefix("[rank 0] ").unwrap_or(l))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get("summary").cloned())
        .unwrap_or_else(|| panic!("no summary line in:\n{stdout}"))
}

fn check(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn two_nodes_of_two_ranks_match_one_rank() {
    let cache = common::scratch("launcher-cache");
    // One rank, with the embedded default checkpoint (generated into the cache on first use).
    let single = Command::new(BIN)
        .args(generate_args(None))
        .env("DEEPSEEK_V3_CACHE", &cache)
        .output()
        .unwrap();
    check(&single, "single-rank generate");
    let want = results(&single);
    assert!(want.iter().all(|t| !t.is_empty()), "{want:?}");
    let summary = summary(&single);
    let generated: usize = want.iter().map(Vec::len).sum();
    assert_eq!(summary["generated_tokens"], generated, "{summary}");
    assert_eq!(summary["prompts"], PROMPTS.len(), "{summary}");
    assert!(summary["tokens_per_s"].as_f64().unwrap() > 0.0, "{summary}");
    let ttft = &summary["ttft_ms"];
    assert!(ttft["p50"].as_f64().unwrap() > 0.0, "{summary}");
    assert!(ttft["max"].as_f64() >= ttft["p50"].as_f64(), "{summary}");
    let model = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("config.json").exists())
        .expect("the default checkpoint was generated into the cache");

    let port = common::free_port().to_string();
    let spawn_node = |node: &str| {
        let mut args: Vec<String> = [
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            node,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(generate_args(Some(&model)));
        Command::new(BIN)
            .args(args)
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let node0 = spawn_node("0");
    let node1 = spawn_node("1");
    let out1 = node1.wait_with_output().unwrap();
    let out0 = node0.wait_with_output().unwrap();
    check(&out0, "node 0");
    check(&out1, "node 1");
    assert_eq!(
        results(&out0),
        want,
        "4 ranks generated other tokens than 1 rank"
    );
    // Only rank 0 prints results.
    assert!(!String::from_utf8_lossy(&out1.stdout).contains("\"tokens\""));
}

#[test]
fn a_failing_rank_stops_the_job() {
    let dir = common::scratch("launcher-fail");
    let port = common::free_port().to_string();
    // The model folder does not exist: every rank fails; the launcher must report it.
    let out = Command::new(BIN)
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--",
            "generate",
            "--prompt",
            "x",
            "--model",
        ])
        .arg(dir.join("missing"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("[rank "), "{stderr}");
    // The launcher names the rank, how it ended, and repeats its last error line.
    let report = stderr
        .lines()
        .find(|l| l.starts_with("launch: rank "))
        .unwrap_or_else(|| panic!("no launcher report in:\n{stderr}"));
    assert!(
        report.contains("exited with code 1: error: cannot read"),
        "{report}"
    );
    assert!(report.contains("missing/config.json"), "{report}");
}
