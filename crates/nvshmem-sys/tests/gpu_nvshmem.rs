//! GPU test of nvshmem-sys (run on the GPU machine; `harness = false`).
//!
//! The parent checks that bad arguments are rejected before NVSHMEM is loaded, counts the
//! visible GPUs through the shim, makes a `UniqueId` (its bootstrap listener lives in the
//! parent) and re-executes this binary once per GPU (at most 8; `EP_NVSHMEM_WORLD` overrides)
//! with `RANK`, `WORLD_SIZE` and the id in hex. Each child initialises NVSHMEM on GPU `RANK`
//! and checks: its PE number, that a second init is refused, a put around the ring (each PE
//! receives its predecessor's value), a put-with-signal around the ring (the data is there when
//! the signal is), `nvshmem_ptr` for every PE, a barrier on a stream, host copies, finalize,
//! and that init after finalize is refused. With more than one GPU the children run a second
//! time as a single PE (a put to itself). Children that hang are killed after
//! `EP_NVSHMEM_TIMEOUT` seconds (default 120).
//!
//! NVSHMEM's environment for the children (set here unless already set):
//! `NVSHMEM_REMOTE_TRANSPORT=none`, `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo`, and always
//! `NVSHMEM_DISABLE_NVLS=1`. Prints `PASS name` / `FAIL name: why` per case and
//! `N passed, N failed` last; exits 1 on failure.

use nvshmem_sys::{
    library_loaded, Error, Nvshmem, RawStream, UniqueId, UNIQUE_ID_BYTES, UNIQUE_ID_VERSION,
};
use std::process::Command;
use std::time::Duration;

#[path = "support/children.rs"]
mod children;
use children::{run_children, Outcome, Tally, TestResult};

const CHILD: &str = "EP_NVSHMEM_CHILD";
const UID: &str = "EP_NVSHMEM_UID";

fn main() {
    if let Ok(launch) = std::env::var(CHILD) {
        std::process::exit(child(&launch));
    }
    children::nvshmem_environment();
    let mut tally = Tally::default();
    tally.record("parent/arguments_rejected_before_loading", args_rejected());

    let (world, timeout) = children::world_of_visible_gpus(&mut tally);
    let mut launches = vec![(format!("pes{world}"), world)];
    if world > 1 {
        launches.push(("pes1".to_owned(), 1));
    }
    for (launch, n) in launches {
        let id = match UniqueId::new() {
            Ok(id) => id,
            Err(e) => {
                tally.record(&format!("{launch}/unique_id"), Err(e.to_string()));
                continue;
            }
        };
        for (rank, outcome) in spawn(&launch, n, &id, timeout).into_iter().enumerate() {
            tally.child(&launch, rank, &outcome);
        }
    }
    tally.finish();
}

/// Bad ids and arguments give typed errors, and NVSHMEM is not loaded by them.
fn args_rejected() -> TestResult {
    if library_loaded() {
        return Err("NVSHMEM was loaded before anything asked for it".into());
    }
    match UniqueId::from_bytes(&[0u8; 5]) {
        Err(Error::UniqueIdLength { expected, got: 5 }) if expected == UNIQUE_ID_BYTES => {}
        other => return Err(format!("5-byte id: expected UniqueIdLength, got {other:?}")),
    }
    match UniqueId::from_bytes(&[0u8; UNIQUE_ID_BYTES]) {
        Err(Error::UniqueIdVersion { found: 0, .. }) => {}
        other => {
            return Err(format!(
                "zeroed id: expected UniqueIdVersion, got {other:?}"
            ))
        }
    }
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    bytes[..4].copy_from_slice(&UNIQUE_ID_VERSION.to_le_bytes());
    let id = UniqueId::from_bytes(&bytes).map_err(|e| e.to_string())?;
    let cases: [(usize, usize, usize, &str); 3] = [
        (0, 0, 0, "nranks"),
        (2, 2, 0, "rank"),
        (0, 1, usize::MAX, "device"),
    ];
    for (rank, nranks, device, arg) in cases {
        match Nvshmem::init(rank, nranks, &id, device) {
            Err(Error::InvalidArgument { name, .. }) if name == arg => {}
            other => {
                return Err(format!(
                    "init(rank {rank}, nranks {nranks}, device {device}): expected \
                     InvalidArgument for `{arg}`, got {other:?}"
                ))
            }
        }
    }
    if library_loaded() {
        return Err("a rejected init loaded NVSHMEM".into());
    }
    Ok(())
}

/// Runs `n` children of `launch`, one per GPU, and collects their output (killing those that
/// outlive `timeout`).
fn spawn(launch: &str, n: usize, id: &UniqueId, timeout: Duration) -> Vec<Outcome> {
    let exe = std::env::current_exe().expect("own path");
    let commands = (0..n)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.env(CHILD, launch)
                .env(UID, id.to_hex())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string());
            cmd
        })
        .collect();
    run_children(commands, timeout)
}

fn env_usize(var: &str) -> std::result::Result<usize, String> {
    std::env::var(var)
        .map_err(|_| format!("{var} is not set"))?
        .parse()
        .map_err(|e| format!("{var}: {e}"))
}

fn child(launch: &str) -> i32 {
    let setup = (|| -> std::result::Result<(usize, usize, UniqueId), String> {
        let id = std::env::var(UID).map_err(|_| format!("{UID} is not set"))?;
        let id = UniqueId::from_hex(&id).map_err(|e| e.to_string())?;
        Ok((env_usize("RANK")?, env_usize("WORLD_SIZE")?, id))
    })();
    let (rank, world, id) = match setup {
        Ok(s) => s,
        Err(e) => {
            println!("FAIL {launch}/setup: {e}");
            return 1;
        }
    };
    let mut failed = 0;
    let mut report = |name: &str, result: TestResult| {
        failed += usize::from(children::print_case(launch, rank, name, result));
    };

    let nv = match Nvshmem::init(rank, world, &id, rank) {
        Ok(nv) => nv,
        Err(e) => {
            report("init", Err(e.to_string()));
            return 1;
        }
    };
    report("init", check_init(&nv, rank, world));
    report(
        "second_init_rejected",
        second_init_rejected(&id, rank, world),
    );
    report("ring_put", ring_put(&nv));
    report("ring_put_signal", ring_put_signal(&nv));
    report("peer_ptr", peer_ptr(&nv));
    report("barrier_all_on_stream", barrier_on_stream(&nv));
    report("host_copies", host_copies(&nv));
    report("finalize", nv.finalize().map_err(|e| e.to_string()));
    report("init_after_finalize_rejected", {
        match Nvshmem::init(rank, world, &id, rank) {
            Err(Error::NoReinit { .. }) => Ok(()),
            other => Err(format!("expected NoReinit, got {other:?}")),
        }
    });
    i32::from(failed > 0)
}

fn check_init(nv: &Nvshmem, rank: usize, world: usize) -> TestResult {
    if (nv.my_pe(), nv.n_pes(), nv.device()) != (rank, world, rank) {
        return Err(format!(
            "my_pe {} n_pes {} device {}, expected {rank} {world} {rank}",
            nv.my_pe(),
            nv.n_pes(),
            nv.device()
        ));
    }
    let v = nv.version();
    println!(
        "NVSHMEM {}.{}.{} from {} (found by {})",
        v.0,
        v.1,
        v.2,
        nv.library().host_library.display(),
        nv.library().from
    );
    Ok(())
}

fn second_init_rejected(id: &UniqueId, rank: usize, world: usize) -> TestResult {
    match Nvshmem::init(rank, world, id, rank) {
        Err(Error::AlreadyInitialized { rank: r, device }) if (r, device) == (rank, rank) => Ok(()),
        other => Err(format!("expected AlreadyInitialized, got {other:?}")),
    }
}

fn prev(nv: &Nvshmem) -> usize {
    (nv.my_pe() + nv.n_pes() - 1) % nv.n_pes()
}

fn e(err: Error) -> String {
    err.to_string()
}

fn ring_put(nv: &Nvshmem) -> TestResult {
    let buf = nv.alloc_zeroed::<i32>(1).map_err(e)?;
    if buf.to_vec().map_err(e)? != [0] {
        return Err("nvshmem_calloc memory is not zeroed".into());
    }
    nv.barrier_all().map_err(e)?;
    nv.test_ring_put(&buf, 1000 + nv.my_pe() as i32)
        .map_err(e)?;
    nv.barrier_all().map_err(e)?;
    nv.quiet().map_err(e)?;
    let got = buf.to_vec().map_err(e)?[0];
    let want = 1000 + prev(nv) as i32;
    if got != want {
        return Err(format!(
            "received {got}, expected {want} from PE {}",
            prev(nv)
        ));
    }
    Ok(())
}

fn ring_put_signal(nv: &Nvshmem) -> TestResult {
    let data = nv.alloc_zeroed::<i32>(3).map_err(e)?;
    let signal = nv.alloc_zeroed::<u64>(1).map_err(e)?;
    let short = nv.alloc_zeroed::<i32>(2).map_err(e)?;
    match nv.test_ring_put_signal(&short, &signal, 0) {
        Err(Error::InvalidArgument { name: "data", .. }) => {}
        other => {
            return Err(format!(
                "2-element data: expected InvalidArgument, got {other:?}"
            ))
        }
    }
    nv.barrier_all().map_err(e)?;
    nv.test_ring_put_signal(&data, &signal, 2000 + nv.my_pe() as i32)
        .map_err(e)?;
    nv.barrier_all().map_err(e)?;
    let d = data.to_vec().map_err(e)?;
    let s = signal.to_vec().map_err(e)?[0];
    let p = prev(nv);
    let want = [2000 + nv.my_pe() as i32, 2000 + p as i32, 2000 + p as i32];
    if d != want || s != p as u64 + 1 {
        return Err(format!(
            "data {d:?} signal {s}, expected {want:?} signal {} (from PE {p}; data[2] is what \
             the kernel saw when the signal arrived)",
            p + 1
        ));
    }
    Ok(())
}

fn peer_ptr(nv: &Nvshmem) -> TestResult {
    let buf = nv.alloc_zeroed::<f32>(256).map_err(e)?;
    for pe in 0..nv.n_pes() {
        match buf.peer_ptr(pe).map_err(e)? {
            Some(p) if pe == nv.my_pe() && p != buf.as_device_ptr() => {
                return Err(format!(
                    "own PE: nvshmem_ptr {:#x} != local {:#x}",
                    p.addr(),
                    buf.as_device_ptr().addr()
                ))
            }
            Some(_) => {}
            None => return Err(format!("nvshmem_ptr is null for PE {pe} on the same node")),
        }
    }
    match buf.peer_ptr(nv.n_pes()) {
        Err(Error::InvalidArgument { name: "pe", .. }) => {}
        other => {
            return Err(format!(
                "pe = n_pes: expected InvalidArgument, got {other:?}"
            ))
        }
    }
    Ok(())
}

fn barrier_on_stream(nv: &Nvshmem) -> TestResult {
    let stream: RawStream = std::ptr::null_mut();
    // SAFETY: null is the legacy default stream of the current (NVSHMEM's) device.
    unsafe {
        nv.barrier_all_on_stream(stream).map_err(e)?;
        nv.synchronize_stream(stream).map_err(e)?;
    }
    Ok(())
}

fn host_copies(nv: &Nvshmem) -> TestResult {
    let mut buf = nv.alloc_zeroed::<u64>(4096).map_err(e)?;
    let pattern: Vec<u64> = (0..4096u64)
        .map(|i| (nv.my_pe() as u64) << 32 | i)
        .collect();
    buf.copy_from_host(&pattern).map_err(e)?;
    if buf.to_vec().map_err(e)? != pattern {
        return Err("copy_from_host then to_vec changed the data".into());
    }
    match buf.copy_from_host(&pattern[..7]) {
        Err(Error::InvalidArgument { name: "src", .. }) => {}
        other => {
            return Err(format!(
                "7 of 4096 elements: expected InvalidArgument, got {other:?}"
            ))
        }
    }
    match nv.alloc_zeroed::<u8>(0) {
        Err(Error::InvalidArgument { name: "len", .. }) => {}
        other => {
            return Err(format!(
                "0 elements: expected InvalidArgument, got {other:?}"
            ))
        }
    }
    nv.barrier_all().map_err(e)?;
    Ok(())
}
