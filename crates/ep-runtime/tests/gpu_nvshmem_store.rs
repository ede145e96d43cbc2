//! GPU test of NVSHMEM bootstrapped through the bootstrap store (`ep_runtime::init_nvshmem`;
//! run on the GPU machine; `harness = false`).
//!
//! The parent counts the visible GPUs (through nvshmem-sys), picks a free port and re-executes
//! this binary once per GPU (at most 8; `EP_NVSHMEM_WORLD` sets fewer) with a launcher's
//! variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`); the child of rank 0 hosts the store. Launches:
//!
//! - `ring`: every child joins the store and calls `init_nvshmem` on GPU `LOCAL_RANK`, then
//!   checks its PE number and the number of PEs, a put around the ring into a symmetric buffer
//!   (each PE receives its predecessor's value after a barrier) and finalize;
//! - `bad_device`: rank `world - 1` asks for a device that is not visible; it must fail with
//!   `InvalidArgument` for `device`, and every other rank at once with `PeerFailed` naming it
//!   (nobody enters NVSHMEM's init);
//! - `missing_last`, `missing_first` (2 GPUs or more): rank `world - 1` (then rank 0) joins the
//!   store but never calls `init_nvshmem`; every other rank must fail, within the store timeout
//!   (3 s) plus slack, with a timeout naming that rank and its `ready` key, instead of hanging.
//!
//! Every child ends with a store barrier so that rank 0 (the store) leaves last. Children that
//! outlive `EP_NVSHMEM_TIMEOUT` seconds (default 120) are killed and count as failures.
//! NVSHMEM's environment for the children (set here unless already set):
//! `NVSHMEM_REMOTE_TRANSPORT=none`, `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo`, and always
//! `NVSHMEM_DISABLE_NVLS=1`. Prints `PASS name` / `FAIL name: why` per case and
//! `N passed, N failed` last; exits 1 on failure.

use ep_runtime::nvshmem_sys::{self, Nvshmem};
use ep_runtime::{init_nvshmem, Error, Store, StoreConfig};
use std::process::Command;
use std::time::{Duration, Instant};

#[path = "../../nvshmem-sys/tests/support/children.rs"]
mod children;
use children::{run_children, Outcome, Tally, TestResult};

const CHILD: &str = "EP_NVSHMEM_STORE_CHILD";
/// The job name of every launch.
const JOB: &str = "gpu_test";
/// The store timeout of the `missing_*` launches.
const MISSING_TIMEOUT: Duration = Duration::from_secs(3);

fn main() {
    if let Ok(launch) = std::env::var(CHILD) {
        std::process::exit(child(&launch));
    }
    children::nvshmem_environment();
    let mut tally = Tally::default();
    let (world, timeout) = children::world_of_visible_gpus(&mut tally);
    let mut launches = vec!["ring", "bad_device"];
    if world >= 2 {
        launches.extend(["missing_last", "missing_first"]);
    }
    for launch in launches {
        for (rank, outcome) in spawn(launch, world, timeout).into_iter().enumerate() {
            tally.child(launch, rank, &outcome);
        }
    }
    tally.finish();
}

/// Runs `world` children of `launch`, one per GPU, and collects their output (killing those
/// that outlive `timeout`).
fn spawn(launch: &str, world: usize, timeout: Duration) -> Vec<Outcome> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let exe = std::env::current_exe().expect("own path");
    let commands = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.env(CHILD, launch)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string());
            cmd
        })
        .collect();
    run_children(commands, timeout)
}

fn child(launch: &str) -> i32 {
    let store_timeout = if launch.starts_with("missing") {
        MISSING_TIMEOUT
    } else {
        Duration::from_secs(60)
    };
    let store = StoreConfig::from_env()
        .and_then(|c| c.with_timeout(store_timeout))
        .and_then(Store::connect);
    let store = match store {
        Ok(s) => s,
        Err(e) => {
            println!("FAIL {launch}/setup: {e}");
            return 1;
        }
    };
    let (rank, world, device) = (store.rank(), store.world_size(), store.config().local_rank);
    let mut failed = 0;
    let mut report = |name: &str, result: TestResult| {
        failed += usize::from(children::print_case(launch, rank, name, result));
    };

    match launch {
        "ring" => ring(&store, device, &mut report),
        "bad_device" => bad_device(&store, device, &mut report),
        "missing_last" => missing(&store, world - 1, device, &mut report),
        "missing_first" => missing(&store, 0, device, &mut report),
        other => report("launch", Err(format!("unknown launch {other:?}"))),
    }
    // Rank 0 hosts the store: it leaves last.
    report(
        "final_store_barrier",
        store
            .barrier_timeout("gpu_nvshmem_store/done", Duration::from_secs(60))
            .map_err(e),
    );
    i32::from(failed > 0)
}

fn e(err: impl std::fmt::Display) -> String {
    err.to_string()
}

fn ring(store: &Store, device: usize, report: &mut impl FnMut(&str, TestResult)) {
    let (rank, world) = (store.rank(), store.world_size());
    let nv = match init_nvshmem(store, JOB, device) {
        Ok(nv) => nv,
        Err(err) => return report("init", Err(e(err))),
    };
    report("init", {
        if (nv.my_pe(), nv.n_pes(), nv.device()) == (rank, world, device) {
            let v = nv.version();
            println!(
                "NVSHMEM {}.{}.{} from {}",
                v.0,
                v.1,
                v.2,
                nv.library().host_library.display()
            );
            Ok(())
        } else {
            Err(format!(
                "my_pe {} n_pes {} device {}, expected {rank} {world} {device}",
                nv.my_pe(),
                nv.n_pes(),
                nv.device()
            ))
        }
    });
    report("ring_put", ring_put(&nv));
    report("finalize", nv.finalize().map_err(e));
}

/// The last rank asks for a device that is not visible: it fails on its own, the others learn
/// why through the store, well before the store timeout.
fn bad_device(store: &Store, device: usize, report: &mut impl FnMut(&str, TestResult)) {
    let bad = store.world_size() - 1;
    let gpus = match nvshmem_sys::cuda_device_count() {
        Ok(n) => n,
        Err(err) => return report("device_count", Err(e(err))),
    };
    let device = if store.rank() == bad { gpus } else { device };
    let start = Instant::now();
    let res = init_nvshmem(store, JOB, device);
    let took = start.elapsed();
    report("bad_device_named", {
        let fast = took < Duration::from_secs(30);
        match res {
            Ok(_) => Err(format!(
                "init_nvshmem succeeded with rank {bad} on device {gpus}"
            )),
            Err(err @ Error::InvalidArgument { arg: "device", .. })
                if store.rank() == bad && fast =>
            {
                println!("after {took:?}: {err}");
                Ok(())
            }
            Err(err @ Error::PeerFailed { .. })
                if store.rank() != bad
                    && err.rank() == Some(bad)
                    && err.to_string().contains("`device`")
                    && fast =>
            {
                println!("after {took:?}: {err}");
                Ok(())
            }
            Err(err) => Err(format!(
                "after {took:?}: expected InvalidArgument `device` on rank {bad} and PeerFailed \
                 naming it on the others, got: {err}"
            )),
        }
    });
}

/// Each PE puts `1000 + my_pe` into the next PE's buffer and receives its predecessor's.
fn ring_put(nv: &Nvshmem) -> TestResult {
    let buf = nv.alloc_zeroed::<i32>(1).map_err(e)?;
    if buf.to_vec().map_err(e)? != [0] {
        return Err("nvshmem_calloc memory is not zeroed".into());
    }
    nv.barrier_all().map_err(e)?;
    nv.test_ring_put(&buf, 1000 + nv.my_pe() as i32)
        .map_err(e)?;
    nv.barrier_all().map_err(e)?;
    let prev = (nv.my_pe() + nv.n_pes() - 1) % nv.n_pes();
    let (got, want) = (buf.to_vec().map_err(e)?[0], 1000 + prev as i32);
    if got != want {
        return Err(format!("received {got}, expected {want} from PE {prev}"));
    }
    Ok(())
}

/// Rank `missing` stays out; the others must time out naming it and its key.
fn missing(
    store: &Store,
    missing: usize,
    device: usize,
    report: &mut impl FnMut(&str, TestResult),
) {
    if store.rank() == missing {
        println!("rank {missing} stays out of init_nvshmem");
        return;
    }
    let start = Instant::now();
    let res = init_nvshmem(store, JOB, device);
    let took = start.elapsed();
    let key = format!("__nvshmem/{JOB}/0/ready/{missing}");
    let limit = MISSING_TIMEOUT + Duration::from_secs(7);
    report("missing_rank_named", {
        match res {
            Ok(_) => Err(format!("init_nvshmem succeeded without rank {missing}")),
            Err(err @ Error::Timeout { .. })
                if err.rank() == Some(missing) && err.to_string().contains(&key) =>
            {
                println!("after {took:?}: {err}");
                if took < limit {
                    Ok(())
                } else {
                    Err(format!("took {took:?}, over {limit:?}: {err}"))
                }
            }
            Err(err) => Err(format!(
                "after {took:?}: expected a timeout naming rank {missing} and key {key:?}, \
                 got: {err}"
            )),
        }
    });
}
