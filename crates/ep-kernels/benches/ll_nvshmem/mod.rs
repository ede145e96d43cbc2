//! The benchmark across processes (feature `nvshmem`, `EP_BENCH_NVSHMEM=<GPUs per node>`): one
//! process per rank, buffers on NVSHMEM's symmetric heap, ranks of other "nodes" reached through
//! NVSHMEM puts. On one host NVSHMEM carries those puts over NVLink
//! (`NVSHMEM_REMOTE_TRANSPORT=none`): the figures are the path's cost with NVLink standing in
//! for RDMA, not a network's. Each child times its rank as the threaded benchmark does and
//! prints one `RESULT` line per (experts, reduction); the parent prints the medians over ranks.

use super::{time_rank, BoxError, Rank, Reduction};
use nvshmem_sys::{Nvshmem, UniqueId};
use std::fmt::Write as _;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

#[path = "../../../nvshmem-sys/tests/support/children.rs"]
#[allow(dead_code)]
mod children;

/// (experts, reduction: "expert" or "rank").
type Config = (usize, String);

const CHILD: &str = "EP_LL_BENCH_CHILD";
const UID: &str = "EP_LL_BENCH_UID";

/// `EP_BENCH_NVSHMEM`: GPUs per node of the process mode.
pub fn gpus_per_node() -> Option<usize> {
    std::env::var("EP_BENCH_NVSHMEM").ok()?.parse().ok()
}

/// What a child needs to build its rank.
pub struct Child {
    pub rank: usize,
    pub nv: Arc<Nvshmem>,
}

/// In a child process: NVSHMEM initialised as rank `RANK` of `world` on GPU `RANK`.
pub fn child(world: usize) -> Result<Option<Child>, BoxError> {
    let Ok(id) = std::env::var(UID) else {
        return Ok(None);
    };
    std::env::var(CHILD)?;
    let rank: usize = std::env::var("RANK")?.parse()?;
    let id = UniqueId::from_hex(&id)?;
    let nv = Nvshmem::init(rank, world, &id, rank)?;
    Ok(Some(Child {
        rank,
        nv: Arc::new(nv),
    }))
}

/// Times the child's rank and prints its line.
pub fn report(
    experts: usize,
    red: Reduction,
    rank: &mut Rank,
    warmup: usize,
    iters: usize,
) -> Result<(), BoxError> {
    let t = time_rank(rank, warmup, iters)?;
    let sels: usize = rank.send_counts.iter().sum();
    let per = if red == Reduction::PerRank {
        "rank"
    } else {
        "expert"
    };
    println!(
        "RESULT {experts} {per} {sels} {}",
        t.iter()
            .map(|v| format!("{v:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(())
}

/// The parent: runs `world` children and prints the medians over ranks per op.
pub fn parent(world: usize, gpn: usize, header: &str) -> Result<(), BoxError> {
    children::nvshmem_environment();
    if std::env::var_os("NVSHMEM_SYMMETRIC_SIZE").is_none() {
        std::env::set_var("NVSHMEM_SYMMETRIC_SIZE", "4G");
    }
    let id = UniqueId::new()?;
    let exe = std::env::current_exe()?;
    let commands = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.env(CHILD, "1")
                .env(UID, id.to_hex())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string());
            cmd
        })
        .collect();
    let outcomes = children::run_children(commands, Duration::from_secs(540));
    // (experts, reduction) -> each rank's timings.
    let mut rows: Vec<(Config, Vec<Vec<f64>>)> = Vec::new();
    for (rank, o) in outcomes.iter().enumerate() {
        if !o.ok {
            return Err(format!("rank {rank} failed ({}):\n{}", o.status, o.text).into());
        }
        for line in o.text.lines().filter_map(|l| l.strip_prefix("RESULT ")) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() != 3 + super::OP_NAMES.len() {
                return Err(format!("rank {rank}: malformed line {line:?}").into());
            }
            let key = (f[0].parse::<usize>()?, f[1].to_owned());
            let t = f[3..]
                .iter()
                .map(|v| v.parse::<f64>())
                .collect::<Result<Vec<_>, _>>()?;
            match rows.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => v.push(t),
                None => rows.push((key, vec![t])),
            }
        }
    }
    let mut table = String::new();
    println!(
        "{header}\nNVSHMEM, {} nodes x {gpn} GPUs: ranks of other nodes through NVSHMEM puts, \
         which NVSHMEM carries over NVLink on this host (NVLink standing in for RDMA)",
        world.div_ceil(gpn)
    );
    let _ = writeln!(table, "{:>8} {:<30} {:>10}", "experts", "op", "us");
    for ((experts, red), per_rank) in &rows {
        if per_rank.len() != world {
            return Err(format!(
                "{experts} experts {red}: {} of {world} ranks reported",
                per_rank.len()
            )
            .into());
        }
        for (i, name) in super::OP_NAMES.iter().enumerate() {
            let mut us: Vec<f64> = per_rank.iter().map(|t| t[i]).collect();
            let med = super::median(&mut us);
            let suffix = if red == "rank" { " per rank" } else { "" };
            let _ = writeln!(
                table,
                "{experts:>8} {:<30} {med:>10.1}",
                format!("{name}{suffix}")
            );
        }
    }
    print!("{table}");
    Ok(())
}
