//! Failures a user meets: a rank killed with SIGKILL during decode, under `launch` (open streams
//! get an SSE error event and end; the launcher names that rank and the signal) and without it
//! (rank 0's engine fails, streams get its error, rank 0 exits non-zero); and a port in use
//! (the launcher names rank 0 and repeats its error, before any model is loaded).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{rank_pid, Server, BIN};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Opens a long greedy stream on `server`, kills the process `victim()` names once the stream
/// has started, reads the stream to its end, and returns its error event.
fn kill_during_stream(server: &Server, victim: impl FnOnce() -> i32) -> serde_json::Value {
    // 4000 tokens take far longer than this test waits.
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = r#"{"prompt": "The quick brown fox", "max_tokens": 4000, "ignore_eos": true, "temperature": 0, "stream": true}"#;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: {") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    kill(Pid::from_raw(victim()), Signal::SIGKILL).unwrap();
    // The server ends the stream with an error event, long before the 4000 tokens.
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    got.extend_from_slice(&rest);
    let text = String::from_utf8_lossy(&got);
    assert!(!text.contains(r#""finish_reason":"length""#), "{text}");
    let error = common::sse_data(&text)
        .iter()
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find(|v| v.get("error").is_some())
        .unwrap_or_else(|| {
            panic!(
                "no error event in the stream:\n{text}\nserver:\n{}",
                server.stderr_text()
            )
        });
    assert_eq!(error["error"]["type"], "server_error", "{error}");
    error
}

#[test]
fn a_killed_rank_ends_open_streams_with_an_error_and_is_named() {
    let master = common::free_port().to_string();
    let mut server = Server::start(
        &[
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &master,
            "--grace-secs",
            "10",
            "--",
        ],
        &[
            "--init",
            "random",
            "--max-batch",
            "2",
            "--max-tokens-limit",
            "4000",
            "--timeout-secs",
            "20",
        ],
    );
    let error = kill_during_stream(&server, || rank_pid(server.child.id(), 1));
    // Rank 0 either sees rank 1 gone first, or the launcher's SIGTERM.
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("the generation engine failed: rank 0: ") && message.contains("rank 1")
            || message == "the server is shutting down (SIGTERM)",
        "{message}"
    );

    // The launcher stops the job and names rank 1 and the signal.
    let status = server
        .wait_exit(Duration::from_secs(30))
        .expect("the launcher did not exit");
    assert_eq!(status.code(), Some(128 + 9), "{status:?}");
    let log = server.stderr_text();
    let report = log
        .lines()
        .find(|l| l.starts_with("launch: rank "))
        .unwrap_or_else(|| panic!("no launcher report in:\n{log}"));
    assert!(
        report.starts_with("launch: rank 1 killed by signal 9 (SIGKILL)"),
        "{report}"
    );
}

#[test]
fn without_a_launcher_rank_0_reports_the_engine_failure() {
    let master = common::free_port().to_string();
    let serve_args = [
        "--init",
        "random",
        "--max-batch",
        "2",
        "--max-tokens-limit",
        "4000",
    ];
    let env = |rank: &'static str| {
        [
            ("RANK", rank),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", rank),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
        ]
    };
    let master_env = ("MASTER_PORT", master.as_str());
    // Rank 1 first (it joins the store rank 0 hosts), in the background.
    let mut rank1 = Command::new(BIN)
        .envs(env("1"))
        .envs([master_env])
        .args(["serve", "--port", "0"])
        .args(serve_args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut rank0 = Server::start_env(
        &[env("0").as_slice(), &[master_env]].concat(),
        &[],
        &serve_args,
    );
    let error = kill_during_stream(&rank0, || rank1.id() as i32);
    let _ = rank1.wait();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("the generation engine failed: "),
        "{message}"
    );
    assert!(message.contains("rank 1"), "{message}");
    let status = rank0
        .wait_exit(Duration::from_secs(30))
        .expect("rank 0 did not exit");
    assert_eq!(status.code(), Some(1), "{status:?}");
    let log = rank0.stderr_text();
    assert!(log.contains("error: "), "{log}");
    // New requests during the drain, if any got through, would have been refused with 503.
}

#[test]
fn a_port_in_use_is_reported_by_rank_0() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let master = common::free_port().to_string();
    let start = Instant::now();
    let out = Command::new(BIN)
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &master,
            "--",
            "serve",
            "--init",
            "random",
            "--port",
            &port,
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report = stderr
        .lines()
        .find(|l| l.starts_with("launch: rank "))
        .unwrap_or_else(|| panic!("no launcher report in:\n{stderr}"));
    assert!(
        report.starts_with("launch: rank 0 exited with code 1: error: cannot listen on"),
        "{report}"
    );
    assert!(report.contains(&format!("127.0.0.1:{port}")), "{report}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    drop(taken);
}
