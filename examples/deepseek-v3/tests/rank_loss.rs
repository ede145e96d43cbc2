//! Serving goes on without a lost rank: four ranks on the CPU under `launch`, every expert with
//! a replica on another rank (`--num-redundant-experts`), clients sending requests all along,
//! and rank 2 killed (`kill -9`) or stopped (`SIGSTOP`, past the timeout, then woken) in the
//! middle. Every request completes or gets an error naming the lost rank (none hangs), requests
//! sent after the loss succeed within 10 s of it, the throughput afterwards is at least 0.6 x
//! the throughput before, and `/health` and `/metrics` report the loss.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{rank_pid, Server};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// One request as a client saw it.
#[derive(Debug)]
struct Outcome {
    sent: Instant,
    answered: Instant,
    status: u16,
    tokens: u64,
    body: String,
}

const OUTPUT_TOKENS: usize = 16;

/// Sends requests one after the other until `stop`, recording each.
fn client(port: u16, id: usize, stop: Arc<AtomicBool>, log: Arc<Mutex<Vec<Outcome>>>) {
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let body = format!(
            r#"{{"prompt": "client {id} request {n}", "max_tokens": {OUTPUT_TOKENS}, "ignore_eos": true, "temperature": 0}}"#
        );
        let sent = Instant::now();
        let r = common::http(port, "POST", "/v1/completions", Some(&body));
        let tokens = serde_json::from_str::<serde_json::Value>(&r.body)
            .ok()
            .and_then(|v| v["usage"]["completion_tokens"].as_u64())
            .unwrap_or(0);
        log.lock().unwrap().push(Outcome {
            sent,
            answered: Instant::now(),
            status: r.status,
            tokens,
            body: r.body,
        });
        n += 1;
    }
}

/// Output tokens per second of the requests answered within `[from, to)`.
fn throughput(log: &[Outcome], from: Instant, to: Instant) -> f64 {
    let tokens: u64 = log
        .iter()
        .filter(|o| o.status == 200 && o.answered >= from && o.answered < to)
        .map(|o| o.tokens)
        .sum();
    tokens as f64 / (to - from).as_secs_f64()
}

#[test]
fn a_killed_rank_s_sequences_fail_and_the_others_go_on() {
    let report = serve_through_a_loss(Signal::SIGKILL, "20");
    assert!(
        report.contains(
            "launch: rank 2 killed by signal 9 (SIGKILL); the other ranks go on without it"
        ),
        "{report}"
    );
}

/// A rank stopped past the timeout is found lost; woken up, it learns so and leaves.
#[test]
fn a_stalled_rank_is_found_lost_and_leaves_when_it_wakes() {
    let report = serve_through_a_loss(Signal::SIGSTOP, "3");
    assert!(
        report.contains("launch: rank 2 exited with code 1")
            && report.contains("found rank 2 lost")
            && report.contains("the other ranks go on without it"),
        "{report}"
    );
}

/// Serves under load, sends `signal` to rank 2 (then SIGCONT) and checks the service (see the
/// module docs); returns the launcher's stderr.
fn serve_through_a_loss(signal: Signal, timeout_secs: &str) -> String {
    let master = common::free_port().to_string();
    let mut server = Server::start(
        &[
            "launch",
            "--nproc-per-node",
            "4",
            "--master-port",
            &master,
            "--",
        ],
        &[
            "--init",
            "random",
            "--max-batch",
            "4",
            // 16 experts + 16 slots: each expert twice, on two ranks.
            "--num-redundant-experts",
            "16",
            "--max-tokens-limit",
            "64",
            "--timeout-secs",
            timeout_secs,
        ],
    );
    let port = server.port;
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..8)
        .map(|id| {
            let (stop, log) = (stop.clone(), log.clone());
            std::thread::spawn(move || client(port, id, stop, log))
        })
        .collect();
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(8));
    let killed = Instant::now();
    let victim = Pid::from_raw(rank_pid(server.child.id(), 2));
    kill(victim, signal).unwrap();
    std::thread::sleep(Duration::from_secs(12));
    // A stopped rank wakes up (a killed one ignores it).
    let _ = kill(victim, Signal::SIGCONT);
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        if c.join().is_err() {
            panic!("a client failed; server:\n{}", server.stderr_text());
        }
    }
    let ended = Instant::now();
    let log = log.lock().unwrap();

    // Every request completed, or failed with an error naming the lost rank.
    for o in log.iter() {
        match o.status {
            200 => assert_eq!(o.tokens, OUTPUT_TOKENS as u64, "{}", o.body),
            500 => assert!(
                o.body.contains("rank 2") && o.body.contains("server_error"),
                "{}",
                o.body
            ),
            s => panic!("status {s}: {}\nserver:\n{}", o.body, server.stderr_text()),
        }
    }
    let failed = log.iter().filter(|o| o.status != 200).count();
    // A request sent after the kill succeeds within 10 s of it.
    let first_after = log
        .iter()
        .filter(|o| o.status == 200 && o.sent >= killed)
        .map(|o| o.answered)
        .min()
        .unwrap_or_else(|| {
            panic!(
                "no request succeeded after the kill:\n{}",
                server.stderr_text()
            )
        });
    let back = first_after - killed;
    assert!(back < Duration::from_secs(10), "back after {back:?}");
    let before = throughput(&log, started + Duration::from_secs(3), killed);
    let after = throughput(&log, killed + back, ended);
    eprintln!(
        "requests: {} ({failed} failed); back {:.2} s after the kill; output tokens/s before {before:.1}, after {after:.1} ({:.2} x)",
        log.len(),
        back.as_secs_f64(),
        after / before
    );
    assert!(
        after >= 0.6 * before,
        "before {before:.1}, after {after:.1}"
    );

    let health = common::http(port, "GET", "/health", None);
    assert_eq!(health.status, 200, "{}", health.body);
    let health: serde_json::Value = serde_json::from_str(&health.body).unwrap();
    assert_eq!(health["status"], "degraded");
    assert_eq!(health["ranks_lost"], serde_json::json!([2]));
    let metrics = common::http(port, "GET", "/metrics", None).body;
    assert!(
        metrics.contains("deepseek_v3_rank_failures_total 1"),
        "{metrics}"
    );
    // The job still stops.
    kill(Pid::from_raw(server.child.id() as i32), Signal::SIGTERM).unwrap();
    server
        .wait_exit(Duration::from_secs(60))
        .expect("the launcher did not exit");
    server.stderr_text()
}

/// Rank 0 hosts the bootstrap store and the HTTP front end: when it is killed the service ends
/// (the others cannot agree without it), and the launcher names it and stops the rest.
#[test]
fn losing_rank_0_ends_the_service_and_is_named() {
    let master = common::free_port().to_string();
    let mut server = Server::start(
        &[
            "launch",
            "--nproc-per-node",
            "4",
            "--master-port",
            &master,
            "--",
        ],
        &[
            "--init",
            "random",
            "--max-batch",
            "4",
            "--num-redundant-experts",
            "16",
            "--timeout-secs",
            "20",
        ],
    );
    let ok = common::http(server.port, "GET", "/health", None);
    assert_eq!(ok.status, 200, "{}", ok.body);
    kill(
        Pid::from_raw(rank_pid(server.child.id(), 0)),
        Signal::SIGKILL,
    )
    .unwrap();
    let status = server
        .wait_exit(Duration::from_secs(60))
        .expect("the launcher did not exit");
    assert_eq!(status.code(), Some(128 + 9), "{status:?}");
    let report = server.stderr_text();
    let line = report
        .lines()
        .find(|l| l.starts_with("launch: rank "))
        .unwrap_or_else(|| panic!("no launcher report in:\n{report}"));
    assert!(
        line.starts_with("launch: rank 0 killed by signal 9 (SIGKILL)")
            && line.ends_with("stopping the other ranks"),
        "{line}"
    );
    assert!(std::net::TcpStream::connect(("127.0.0.1", server.port)).is_err());
}
