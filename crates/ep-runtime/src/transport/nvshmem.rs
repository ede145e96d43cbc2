//! NVSHMEM bootstrapped through the bootstrap [`Store`]: rank 0 makes NVSHMEM's unique id, the
//! store carries it to the other ranks, and every rank initialises its PE with it
//! ([`init_nvshmem`], feature `nvshmem`).
//!
//! ```no_run
//! # fn main() -> ep_runtime::Result<()> {
//! use ep_runtime::{init_nvshmem, Store, StoreConfig};
//! let store = Store::connect(StoreConfig::from_env()?)?;
//! let device = store.config().local_rank;
//! let nv = init_nvshmem(&store, "ep", device)?; // collective: every rank of the store
//! assert_eq!((nv.my_pe(), nv.n_pes()), (store.rank(), store.world_size()));
//! # Ok(())
//! # }
//! ```
//!
//! # Keys
//!
//! A job has a name (one per NVSHMEM job sharing a store). Each rank counts its own calls under
//! that name in the store (the [`Store::add`] counter `__nvshmem/{name}/calls/{rank}`), so
//! every rank's `g`-th call (from 0) uses generation `g`, and a later job under the same name
//! never reads an earlier job's id:
//!
//! | key | written by | value |
//! | --- | --- | --- |
//! | `__nvshmem/{name}/{g}/uid/0` | rank 0 | the id's 128 bytes (`nvshmemx_uniqueid_t`) |
//! | `__nvshmem/{name}/{g}/ready/{rank}` | every rank | empty when ready, else why it cannot join (UTF-8) |
//!
//! Keys end in the rank that writes them (the store's `"{name}/{rank}"` convention), so a
//! timeout names the late ranks.
//!
//! # Protocol
//!
//! 1. Every rank checks what it can alone (its CUDA device exists); rank 0 then makes the id
//!    (which starts NVSHMEM's bootstrap listener in rank 0) and writes it.
//! 2. Every rank writes its `ready` key and waits, up to the store's timeout, for all of them.
//!    A rank that never arrives is named by an [`Error::Timeout`] on every other rank, and one
//!    that reported a failure by an [`Error::PeerFailed`]: nobody enters NVSHMEM's init, whose
//!    bootstrap would wait for the missing rank under no limit of ours.
//! 3. The other ranks read the id (a value of the wrong length or version is an
//!    [`Error::Protocol`] naming the key) and every rank calls
//!    `Nvshmem::init(store.rank(), store.world_size(), &id, device)`.
//!
//! After a failure the ranks are out of step (their generations may differ): end the job, as
//! after any failed collective.

use crate::bootstrap::Store;
use crate::error::{Error, Result};

#[cfg(feature = "nvshmem")]
use nvshmem_sys::{Nvshmem, UniqueId, UNIQUE_ID_BYTES};

/// First component of every key this module writes.
const KEY_ROOT: &str = "__nvshmem";

/// The store counter of `rank`'s calls under `name`.
fn calls_key(name: &str, rank: usize) -> String {
    format!("{KEY_ROOT}/{name}/calls/{rank}")
}

/// The keys of one generation of a named job.
#[derive(Debug, Clone, PartialEq, Eq)]
struct JobKeys {
    /// `__nvshmem/{name}/{generation}`.
    prefix: String,
}

impl JobKeys {
    fn new(name: &str, generation: u64) -> Self {
        Self {
            prefix: format!("{KEY_ROOT}/{name}/{generation}"),
        }
    }

    /// Rank 0's id.
    fn uid(&self) -> String {
        format!("{}/uid/0", self.prefix)
    }

    /// `rank`'s status.
    fn ready(&self, rank: usize) -> String {
        format!("{}/ready/{rank}", self.prefix)
    }
}

/// What [`share_from_rank0`] hands back.
#[derive(Debug)]
struct Shared {
    /// The key the bytes were published under.
    key: String,
    /// Rank 0's bytes.
    bytes: Vec<u8>,
}

/// The store half of [`init_nvshmem`], over plain bytes (tested without NVSHMEM): every rank
/// runs `check`, rank 0 then runs `make` and publishes its `len` bytes; once every rank is
/// ready, returns rank 0's bytes on every rank. See the module docs for the keys and the
/// errors. A failure of this rank's `check` or `make` is reported to the others and returned.
fn share_from_rank0(
    store: &Store,
    name: &str,
    len: usize,
    check: impl FnOnce() -> Result<()>,
    make: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Shared> {
    if name.is_empty() {
        return Err(Error::invalid(
            "name",
            "\"\"",
            "must be a non-empty job name",
        ));
    }
    let (rank, world) = (store.rank(), store.world_size());
    let calls = store.add(&calls_key(name, rank), 1)?;
    let generation = u64::try_from(calls - 1).map_err(|_| Error::Protocol {
        rank,
        what: format!(
            "bootstrap store counter {:?} is {calls}, expected >= 1 after an increment",
            calls_key(name, rank)
        ),
    })?;
    let keys = JobKeys::new(name, generation);
    let what = || format!("join NVSHMEM job {name:?} (generation {generation})");

    // 1. What this rank can check alone; rank 0 makes and publishes the bytes.
    let mine = check().and_then(|()| {
        if rank != 0 {
            return Ok(None);
        }
        let bytes = make()?;
        check_len(&keys.uid(), &bytes, len)?;
        store.set(&keys.uid(), &bytes)?;
        Ok(Some(bytes))
    });
    // 2. Every rank says whether it is ready, a failing one too, so that the others stop at
    //    once instead of timing out.
    let status = match &mine {
        Ok(_) => Vec::new(),
        Err(e) => e.to_string().into_bytes(),
    };
    let published = store.set(&keys.ready(rank), &status);
    let mine = mine?;
    published?;
    let ready_keys: Vec<String> = (0..world).map(|r| keys.ready(r)).collect();
    let ready_refs: Vec<&str> = ready_keys.iter().map(String::as_str).collect();
    let statuses = store
        .multi_get(&ready_refs, store.config().timeout)
        .map_err(|e| match e {
            Error::Timeout {
                rank,
                what: awaited,
                waited,
            } => Error::Timeout {
                rank,
                what: format!("all ranks to {}: {awaited}", what()),
                waited,
            },
            other => other,
        })?;
    let failed: Vec<(usize, String)> = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_empty())
        .map(|(r, s)| (r, String::from_utf8_lossy(s).into_owned()))
        .collect();
    if let Some((first, reason)) = failed.first() {
        let also: Vec<usize> = failed[1..].iter().map(|(r, _)| *r).collect();
        let reason = if also.is_empty() {
            reason.clone()
        } else {
            format!("{reason} (ranks {also:?} failed too)")
        };
        return Err(Error::PeerFailed {
            rank: *first,
            what: what(),
            reason,
        });
    }

    // 3. Rank 0's bytes (written before its ready key, so already there).
    let key = keys.uid();
    let bytes = match mine {
        Some(bytes) => bytes,
        None => {
            let bytes = store.get(&key)?;
            check_len(&key, &bytes, len)?;
            bytes
        }
    };
    tracing::debug!(
        rank,
        world,
        name,
        generation,
        "shared rank 0's NVSHMEM unique id"
    );
    Ok(Shared { key, bytes })
}

/// The value under `key` must be `len` bytes.
fn check_len(key: &str, bytes: &[u8], len: usize) -> Result<()> {
    if bytes.len() == len {
        return Ok(());
    }
    Err(Error::Protocol {
        rank: 0,
        what: format!(
            "bootstrap store key {key:?} holds {} bytes, an NVSHMEM unique id is {len} bytes",
            bytes.len()
        ),
    })
}

/// Initialises NVSHMEM on every rank of `store` (collective), bootstrapped by a unique id that
/// rank 0 makes and the store carries: this rank becomes PE `store.rank()` of
/// `store.world_size()` on CUDA device `device` (an ordinal among the visible devices).
///
/// `name` names the job's keys (`__nvshmem/{name}/...`); every rank passes the same one. Every
/// store wait is bounded by the store's timeout, and nobody enters NVSHMEM's init until every
/// rank is ready (see the [module docs](self)). Errors:
///
/// - [`Error::Timeout`] naming a rank that never called `init_nvshmem` and its `ready` key;
/// - [`Error::PeerFailed`] naming a rank that could not join (e.g. a bad `device`, or no
///   NVSHMEM library), whose own error is this call's error on that rank;
/// - [`Error::Protocol`] when the id read from the store has the wrong length (naming the key
///   and the length) or version;
/// - [`Error::Nvshmem`] from NVSHMEM itself (e.g. `NoReinit`: NVSHMEM initialises at most once
///   per process), and [`Error::InvalidArgument`] for an empty `name` or a `device` that is not
///   visible.
///
/// Rank 0's process holds the id's bootstrap listener: it is one of the PEs, so it lives until
/// every rank has initialised. NVSHMEM reads its own variables (see [`nvshmem_sys`]): on one
/// node set `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo`, `NVSHMEM_REMOTE_TRANSPORT=none` and
/// `NVSHMEM_DISABLE_NVLS=1`.
#[cfg(feature = "nvshmem")]
pub fn init_nvshmem(store: &Store, name: &str, device: usize) -> Result<Nvshmem> {
    let check = || {
        let count = nvshmem_sys::cuda_device_count()?;
        if device >= count {
            return Err(Error::invalid(
                "device",
                device,
                format!(
                    "must be < {count}, the number of visible CUDA devices \
                     (CUDA_VISIBLE_DEVICES applies)"
                ),
            ));
        }
        Ok(())
    };
    let make = || Ok(UniqueId::new()?.to_bytes().to_vec());
    let shared = share_from_rank0(store, name, UNIQUE_ID_BYTES, check, make)?;
    let id = UniqueId::from_bytes(&shared.bytes).map_err(|e| Error::Protocol {
        rank: 0,
        what: format!("bootstrap store key {:?}: {e}", shared.key),
    })?;
    Ok(Nvshmem::init(
        store.rank(),
        store.world_size(),
        &id,
        device,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::StoreConfig;
    use std::sync::{mpsc, Arc, Mutex};
    use std::time::{Duration, Instant};

    const LEN: usize = 16;

    /// Runs `f(store)` on `world` ranks as threads (rank 0 hosts the store on a free port);
    /// the results by rank. Every rank then waits for the others, so rank 0 leaves last.
    fn run_ranks<T: Send + 'static>(
        world: usize,
        timeout: Duration,
        f: impl Fn(&Store) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let cfg = move |rank, port| {
            StoreConfig::new(rank, world, "127.0.0.1", port)
                .and_then(|c| c.with_timeout(timeout))
                .unwrap()
        };
        let f = Arc::new(f);
        let (port_tx, port_rx) = mpsc::channel();
        let port_rx = Arc::new(Mutex::new(port_rx));
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (f, port_tx, port_rx) = (f.clone(), port_tx.clone(), port_rx.clone());
                std::thread::spawn(move || {
                    let store = if rank == 0 {
                        let store = Store::connect(cfg(0, 0)).unwrap();
                        let port = store.server_addr().unwrap().port();
                        for _ in 1..world {
                            port_tx.send(port).unwrap();
                        }
                        store
                    } else {
                        let port = port_rx.lock().unwrap().recv().unwrap();
                        Store::connect(cfg(rank, port)).unwrap()
                    };
                    let out = f(&store);
                    store
                        .barrier_timeout("test-done", Duration::from_secs(30))
                        .unwrap();
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Rank 0's bytes for `call`.
    fn bytes(call: u8) -> Vec<u8> {
        (0..LEN as u8).map(|i| i ^ call.wrapping_mul(37)).collect()
    }

    fn only_rank0(call: u8) -> impl FnOnce() -> Result<Vec<u8>> {
        move || Ok(bytes(call))
    }

    #[test]
    fn every_rank_gets_rank0_bytes_and_each_call_a_new_generation() {
        for world in [1, 2, 4] {
            let got = run_ranks(world, Duration::from_secs(30), |store| {
                let rank = store.rank();
                let ok = || Ok(());
                let make = |call| {
                    move || {
                        assert_eq!(rank, 0, "make runs on rank 0 only");
                        only_rank0(call)()
                    }
                };
                let a0 = share_from_rank0(store, "a", LEN, ok, make(1)).unwrap();
                let b0 = share_from_rank0(store, "b", LEN, ok, make(2)).unwrap();
                let a1 = share_from_rank0(store, "a", LEN, ok, make(3)).unwrap();
                [a0, b0, a1].map(|s| (s.key, s.bytes))
            });
            for (rank, shares) in got.into_iter().enumerate() {
                assert_eq!(
                    shares,
                    [
                        ("__nvshmem/a/0/uid/0".to_owned(), bytes(1)),
                        ("__nvshmem/b/0/uid/0".to_owned(), bytes(2)),
                        ("__nvshmem/a/1/uid/0".to_owned(), bytes(3)),
                    ],
                    "world {world}, rank {rank}"
                );
            }
        }
    }

    #[test]
    fn a_rank_that_never_joins_is_named_within_the_timeout() {
        let timeout = Duration::from_millis(600);
        for (world, missing) in [(3, 2), (3, 0), (2, 1)] {
            let got = run_ranks(world, timeout, move |store| {
                if store.rank() == missing {
                    return None;
                }
                let start = Instant::now();
                let res = share_from_rank0(store, "job", LEN, || Ok(()), only_rank0(0));
                Some((res, start.elapsed()))
            });
            for (rank, outcome) in got.into_iter().enumerate() {
                let Some((res, took)) = outcome else {
                    assert_eq!(rank, missing);
                    continue;
                };
                let err = res.expect_err("a rank never joined");
                let msg = err.to_string();
                assert!(
                    matches!(err, Error::Timeout { rank: r, .. } if r == missing),
                    "world {world}, rank {rank}: {msg}"
                );
                let key = format!("__nvshmem/job/0/ready/{missing}");
                assert!(
                    msg.contains(&key) && msg.contains("NVSHMEM job \"job\""),
                    "{msg}"
                );
                assert!(took < timeout + Duration::from_secs(5), "took {took:?}");
            }
        }
    }

    #[test]
    fn an_id_of_the_wrong_length_names_the_key_and_the_length() {
        let got = run_ranks(3, Duration::from_secs(30), |store| {
            share_from_rank0(store, "short", LEN, || Ok(()), || Ok(vec![7; 5])).unwrap_err()
        });
        for (rank, err) in got.into_iter().enumerate() {
            let msg = err.to_string();
            if rank == 0 {
                // Rank 0 checks its own bytes before publishing them.
                assert!(matches!(err, Error::Protocol { rank: 0, .. }), "{msg}");
            } else {
                // The others learn of it through rank 0's status.
                assert!(matches!(err, Error::PeerFailed { rank: 0, .. }), "{msg}");
            }
            assert!(
                msg.contains("\"__nvshmem/short/0/uid/0\"")
                    && msg.contains("5 bytes")
                    && msg.contains(&format!("{LEN} bytes")),
                "rank {rank}: {msg}"
            );
        }
    }

    #[test]
    fn a_wrong_length_in_the_store_is_caught_by_the_readers() {
        let got = run_ranks(2, Duration::from_secs(30), |store| {
            if store.rank() == 0 {
                // As if an older rank 0 wrote a short id under this generation's key.
                store.set("__nvshmem/stale/0/uid/0", &[1, 2, 3]).unwrap();
                store.add(&calls_key("stale", 0), 1).unwrap();
                store.set("__nvshmem/stale/0/ready/0", &[]).unwrap();
                return None;
            }
            Some(share_from_rank0(store, "stale", LEN, || Ok(()), only_rank0(0)).unwrap_err())
        });
        let err = got[1].as_ref().unwrap();
        let msg = err.to_string();
        assert!(matches!(err, Error::Protocol { rank: 0, .. }), "{msg}");
        assert!(
            msg.contains("\"__nvshmem/stale/0/uid/0\"") && msg.contains("holds 3 bytes"),
            "{msg}"
        );
    }

    #[test]
    fn a_rank_that_cannot_join_stops_the_others_at_once() {
        let timeout = Duration::from_secs(30);
        for failing in [0, 1] {
            let got = run_ranks(3, timeout, move |store| {
                let rank = store.rank();
                let check = move || {
                    if rank == failing {
                        Err(Error::invalid("device", 9, "must be < 8"))
                    } else {
                        Ok(())
                    }
                };
                let start = Instant::now();
                let res = share_from_rank0(store, "dev", LEN, check, only_rank0(0));
                (res.unwrap_err(), start.elapsed())
            });
            for (rank, (err, took)) in got.into_iter().enumerate() {
                let msg = err.to_string();
                if rank == failing {
                    assert!(
                        matches!(err, Error::InvalidArgument { arg: "device", .. }),
                        "{msg}"
                    );
                } else {
                    assert!(
                        matches!(&err, Error::PeerFailed { rank: r, .. } if *r == failing),
                        "{msg}"
                    );
                    assert!(msg.contains("`device` = 9"), "{msg}");
                    assert_eq!(err.rank(), Some(failing));
                }
                assert!(took < Duration::from_secs(10), "took {took:?}");
            }
        }
    }

    #[test]
    fn an_empty_name_is_rejected() {
        let got = run_ranks(1, Duration::from_secs(30), |store| {
            share_from_rank0(store, "", LEN, || Ok(()), only_rank0(0)).unwrap_err()
        });
        assert!(
            matches!(got[0], Error::InvalidArgument { arg: "name", .. }),
            "{}",
            got[0]
        );
    }
}
