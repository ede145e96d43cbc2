//! The low-latency cases across processes (feature `nvshmem`): one process per GPU, NVSHMEM
//! initialised from a unique id the parent makes, each process one rank of a world split into
//! "nodes" of `gpus_per_node` GPUs. Buffers lie on NVSHMEM's symmetric heap
//! (`LowLatencyBuffer::new_nvshmem`): ranks of the same node are written over NVLink, the
//! others through NVSHMEM puts (on one host NVSHMEM carries those over NVLink too, with
//! `NVSHMEM_REMOTE_TRANSPORT=none`: NVLink standing in for RDMA).
//!
//! Every child builds the same cases with the same seed (`EP_TEST_SEED` from the parent), so
//! every child draws every rank's inputs and checks its own rank's outputs against the host
//! twins. The parent prints each child's lines and adds its `N passed, N failed` to its own.

use super::common::Runner;
use nvshmem_sys::{Nvshmem, UniqueId};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

#[path = "../../../nvshmem-sys/tests/support/children.rs"]
#[allow(dead_code)]
mod children;

/// Set in a child: `{world}x{gpus_per_node}`.
const CHILD: &str = "EP_LL_NVSHMEM_CHILD";
const UID: &str = "EP_LL_NVSHMEM_UID";
/// How long a launch's children may run (`EP_NVSHMEM_TIMEOUT` seconds overrides).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// This process's place in a multi-process world.
pub struct Proc {
    pub rank: usize,
    pub world: usize,
    pub gpus_per_node: usize,
    pub nv: Arc<Nvshmem>,
}

static PROC: OnceLock<Proc> = OnceLock::new();

/// The multi-process world this process is a rank of (children only).
pub fn proc() -> Option<&'static Proc> {
    PROC.get()
}

/// In a child process: `(world, gpus_per_node)` from the environment.
pub fn child_spec() -> Option<(usize, usize)> {
    let spec = std::env::var(CHILD).ok()?;
    let (w, g) = spec.split_once('x')?;
    Some((w.parse().ok()?, g.parse().ok()?))
}

/// Initialises NVSHMEM as rank `RANK` on GPU `RANK` of a child.
pub fn init_child(world: usize, gpus_per_node: usize) -> Result<(), String> {
    let rank: usize = std::env::var("RANK")
        .map_err(|_| "RANK is not set".to_owned())?
        .parse()
        .map_err(|e| format!("RANK: {e}"))?;
    let id = std::env::var(UID).map_err(|_| format!("{UID} is not set"))?;
    let id = UniqueId::from_hex(&id).map_err(|e| e.to_string())?;
    let nv = Nvshmem::init(rank, world, &id, rank).map_err(|e| e.to_string())?;
    PROC.set(Proc {
        rank,
        world,
        gpus_per_node,
        nv: Arc::new(nv),
    })
    .map_err(|_| "initialised twice".to_owned())
}

/// The worlds the parent launches on `gpus` GPUs: 2 nodes x 2 GPUs, 2 nodes x 1, and one node
/// of 4 on NVSHMEM's heap (the NVLink kernels over symmetric memory).
pub fn launches(gpus: usize) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    if gpus >= 4 {
        v.push((4, 2));
        v.push((4, 4));
    }
    if gpus >= 2 {
        v.push((2, 1));
    }
    v
}

/// Runs every launch's children (this binary again, with the runner's filter and seed) and
/// counts their cases into `runner`.
pub fn run_launches(runner: &mut Runner, gpus: usize) {
    children::nvshmem_environment();
    if std::env::var_os("NVSHMEM_SYMMETRIC_SIZE").is_none() {
        std::env::set_var("NVSHMEM_SYMMETRIC_SIZE", "4G");
    }
    let timeout = std::env::var("EP_NVSHMEM_TIMEOUT")
        .ok()
        .and_then(|t| t.parse().ok())
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs);
    let exe = std::env::current_exe().expect("own path");
    for (world, gpn) in launches(gpus) {
        let launch = format!("{world}x{gpn}");
        let id = match UniqueId::new() {
            Ok(id) => id,
            Err(e) => {
                println!("FAILED nvshmem/{launch}/unique_id: {e}");
                runner.add_counts(0, 1);
                continue;
            }
        };
        let commands = (0..world)
            .map(|rank| {
                let mut cmd = Command::new(&exe);
                if let Some(f) = runner.filter() {
                    cmd.arg(f);
                }
                cmd.env(CHILD, &launch)
                    .env(UID, id.to_hex())
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("EP_TEST_SEED", runner.seed().to_string());
                cmd
            })
            .collect();
        for (rank, outcome) in children::run_children(commands, timeout)
            .into_iter()
            .enumerate()
        {
            let mut counted = None;
            for line in outcome.text.lines() {
                println!("[{launch} rank {rank}] {line}");
                if let Some((p, f)) = parse_counts(line) {
                    counted = Some((p, f));
                }
            }
            match counted {
                Some((p, f)) => runner.add_counts(p, f),
                None => {
                    println!(
                        "FAILED nvshmem/{launch}/rank {rank}: ended ({}) without a tally",
                        outcome.status
                    );
                    runner.add_counts(0, 1);
                }
            }
            if !outcome.ok && counted.is_some_and(|(_, f)| f == 0) {
                println!(
                    "FAILED nvshmem/{launch}/rank {rank}: exit {}",
                    outcome.status
                );
                runner.add_counts(0, 1);
            }
        }
    }
}

/// `N passed, M failed`.
fn parse_counts(line: &str) -> Option<(usize, usize)> {
    let (p, rest) = line.split_once(" passed, ")?;
    let f = rest.strip_suffix(" failed")?;
    Some((p.trim().parse().ok()?, f.trim().parse().ok()?))
}
