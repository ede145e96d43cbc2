//! Helpers shared by the integration tests: scratch folders, free ports, a server process, a
//! tiny HTTP client.

#![allow(dead_code)]

pub mod reference;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_deepseek-v3");

/// A fresh, empty folder under cargo's per-target scratch folder.
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("deepseek-v3-tests")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// First and count of the ports [`free_port`] hands out: below Linux's ephemeral range
/// (32768-60999). A port the kernel picked for a listener on port 0 comes from that range, which
/// the ranks' own outgoing connections draw from too: one of them could take it before the
/// launcher's store binds it (seen as "Address already in use" in a clean-clone run).
const TEST_PORTS: (u16, u16) = (20000, 12000);

/// A TCP port that was free a moment ago on every interface, outside the ephemeral range, and
/// not handed out before by this test process.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let (first, count) = TEST_PORTS;
    // Each test binary starts at its own place, so that consecutive binaries reuse no port
    // still in TIME_WAIT.
    let start = (std::process::id() % u32::from(count)) as u16;
    for _ in 0..count {
        let i = NEXT.fetch_add(1, Ordering::Relaxed) % count;
        let port = first + (start + i) % count;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {first}..{}", first + count);
}

/// A `serve` process (directly or under `launch`), killed when dropped; its stderr is kept.
pub struct Server {
    pub child: Child,
    pub port: u16,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `BIN [launch...] serve --port 0 [serve_args...]` and waits until it listens.
    pub fn start(launch: &[&str], serve_args: &[&str]) -> Server {
        Self::start_env(&[], launch, serve_args)
    }

    /// [`Server::start`] with extra environment variables.
    pub fn start_env(env: &[(&str, &str)], launch: &[&str], serve_args: &[&str]) -> Server {
        let mut child = Command::new(BIN)
            .envs(env.iter().copied())
            .args(launch)
            .args(["serve", "--port", "0"])
            .args(serve_args)
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let sink = stderr.clone();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line);
            }
        });
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let port = loop {
            let Some(Ok(line)) = lines.next() else {
                let _ = child.wait();
                panic!(
                    "server exited before listening; stderr:\n{}",
                    stderr.lock().unwrap().join("\n")
                );
            };
            let line = line.strip_prefix("[rank 0] ").unwrap_or(&line);
            if let Some(addr) = line.strip_prefix("listening on http://") {
                break addr.rsplit(':').next().unwrap().parse().unwrap();
            }
        };
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server {
            child,
            port,
            stderr,
        }
    }

    /// Everything the server wrote to stderr so far.
    pub fn stderr_text(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Waits up to `timeout` for the process to exit; its status, or `None` if still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A parsed HTTP/1.1 response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

/// Sends one JSON request (`Connection: close`) and reads the whole response (chunked bodies
/// are de-chunked).
pub fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
    request(
        port,
        method,
        path,
        &[("Content-Type", "application/json")],
        body,
    )
}

/// [`http`] with the given headers only.
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> HttpResponse {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.unwrap_or("");
    let headers: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").expect("response has a header");
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    HttpResponse {
        status,
        headers: head.to_string(),
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// The `data:` payloads of a server-sent event stream, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}

/// The pid of the child of `parent` whose environment has `RANK=rank`.
pub fn rank_pid(parent: u32, rank: usize) -> i32 {
    let want = format!("RANK={rank}");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        let tasks = std::fs::read_dir(format!("/proc/{parent}/task")).unwrap();
        for task in tasks.flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for pid in children.split_whitespace() {
                let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
                if env.split(|&b| b == 0).any(|kv| kv == want.as_bytes()) {
                    return pid.parse().unwrap();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no child of {parent} with {want}");
}
