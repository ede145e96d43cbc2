//! A torchrun-like launcher: starts `--nproc-per-node` copies of this binary with the rank
//! variables set, prefixes their output lines with their rank, and names a rank that fails and
//! how it ended ([`supervise`]). By default the others go on without a failed rank (they decide
//! themselves whether they can: `crate::recovery`) and only rank 0's end stops them all;
//! `--on-rank-failure stop` stops them all at the first failure.

mod supervise;

pub use supervise::{describe, exit_code};

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use supervise::Rank;

/// Set in every launched rank: its stdin is a pipe from the launcher, closed when the launcher
/// ends (even when killed), which [`watch_launcher`] turns into this rank's exit.
pub const PARENT_PIPE_ENV: &str = "DEEPSEEK_V3_LAUNCHED";

/// In a launched rank, exits the process as soon as the launcher is gone, so that no rank
/// outlives its launcher. Does nothing in a process that was not launched.
pub fn watch_launcher() {
    if std::env::var_os(PARENT_PIPE_ENV).is_none() {
        return;
    }
    std::thread::spawn(|| {
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 64];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    // stderr may be the dead launcher's pipe: ignore write errors.
                    let _ = writeln!(
                        std::io::stderr(),
                        "the launcher has exited; stopping this rank"
                    );
                    std::process::exit(1);
                }
                Ok(_) => {}
            }
        }
    });
}

/// Options of `deepseek-v3 launch`.
#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Processes (ranks) to start on this node, one per GPU.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
    /// Number of nodes in the job.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index, `0..nnodes`; node 0 hosts rank 0 and the bootstrap store.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0 (where rank 0 listens).
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the bootstrap store on node 0.
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// Seconds the other ranks get to stop (SIGTERM) once one failed, before SIGKILL.
    #[arg(long, default_value_t = 5)]
    pub grace_secs: u64,
    /// When a rank other than 0 fails: `continue` leaves the others running, which go on
    /// without it when its experts have replicas on other ranks (`--num-redundant-experts`)
    /// and end the job with an error naming it otherwise; `stop` stops them all at once. Rank
    /// 0's end (it hosts the store and the HTTP front end) always stops the job.
    #[arg(long, value_enum, default_value_t = OnRankFailure::Continue)]
    pub on_rank_failure: OnRankFailure,
    /// The subcommand each rank runs, after `--` (e.g. `-- generate --prompt hi`).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// What the launcher does when a rank other than 0 fails.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnRankFailure {
    /// The others go on (if they can).
    Continue,
    /// Every rank is stopped.
    Stop,
}

/// Whether a rank's stderr line reports why it stopped: this program's `error: ...` or a panic.
fn is_error_line(line: &str) -> bool {
    line.starts_with("error:") || line.contains("panicked at")
}

/// Copies `reader` line by line to our stdout or stderr with `prefix`; remembers the last error
/// line ([`is_error_line`]) in `last`. Bytes that are not UTF-8 are passed on as U+FFFD, never
/// dropped.
fn forward<R: Read + Send + 'static>(
    reader: R,
    prefix: String,
    to_stderr: bool,
    last: Option<Arc<Mutex<Option<String>>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(reader);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let line = String::from_utf8_lossy(&buf);
            let line = line.trim_end_matches(['\n', '\r']);
            if let Some(last) = &last {
                if is_error_line(line) {
                    if let Ok(mut l) = last.lock() {
                        *l = Some(line.to_string());
                    }
                }
            }
            if to_stderr {
                let mut e = std::io::stderr().lock();
                let _ = writeln!(e, "{prefix}{line}");
            } else {
                let mut o = std::io::stdout().lock();
                let _ = writeln!(o, "{prefix}{line}");
                let _ = o.flush();
            }
        }
    })
}

/// Runs the job's part on this node; returns the exit code to exit with.
pub fn launch(args: &LaunchArgs) -> Result<i32> {
    if args.nproc_per_node == 0 || args.nnodes == 0 {
        bail!("--nproc-per-node and --nnodes must be at least 1");
    }
    if args.node_rank >= args.nnodes {
        bail!(
            "--node-rank {} must be below --nnodes {}",
            args.node_rank,
            args.nnodes
        );
    }
    if args.command.first().is_some_and(|c| c == "launch") {
        bail!("the launched command cannot itself be `launch`");
    }
    let exe = std::env::current_exe().context("cannot find this program's path")?;
    let world = args.nproc_per_node * args.nnodes;
    // Like torchrun's OMP_NUM_THREADS: share this node's cores between its ranks.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .div_ceil(args.nproc_per_node)
        .max(1);
    let mut ranks: Vec<Rank> = Vec::new();
    let mut pumps = Vec::new();
    let mut stdins = Vec::new();
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let mut cmd = Command::new(&exe);
        cmd.args(&args.command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", args.master_port.to_string())
            .env(PARENT_PIPE_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            cmd.env("RAYON_NUM_THREADS", threads.to_string());
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut ranks);
                return Err(e).with_context(|| format!("cannot start rank {rank}"));
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            pumps.push(forward(out, prefix.clone(), false, None));
        }
        let last_error = Arc::new(Mutex::new(None));
        let stderr_pump = child
            .stderr
            .take()
            .map(|err| forward(err, prefix, true, Some(last_error.clone())));
        // Kept open for the ranks' lifetime: closing it (our exit) stops them.
        stdins.extend(child.stdin.take());
        tracing::info!(rank, local, world, pid = child.id(), "started");
        ranks.push(Rank {
            rank,
            child,
            stderr_pump,
            last_error,
        });
    }
    let code = supervise::supervise(
        &mut ranks,
        Duration::from_secs(args.grace_secs),
        args.on_rank_failure == OnRankFailure::Continue,
    );
    drop(stdins);
    for p in pumps
        .into_iter()
        .chain(ranks.iter_mut().filter_map(|r| r.stderr_pump.take()))
    {
        let _ = p.join();
    }
    Ok(code)
}

fn kill_all(ranks: &mut [Rank]) {
    for r in ranks.iter_mut() {
        if let Ok(None) = r.child.try_wait() {
            let _ = r.child.kill();
        }
        let _ = r.child.wait();
    }
}
