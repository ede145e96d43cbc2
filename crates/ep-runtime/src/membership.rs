//! [`Membership`]: the survivors of a failed rank agree, through the bootstrap store, on which
//! ranks are lost, and resume their collectives without them (docs/design.md, "Serving around a
//! lost rank").
//!
//! A rank whose collective fails (a peer's connection closed, or a peer did not answer within
//! the timeout) opens an agreement round: every other rank's watcher thread sees it in the
//! store and cancels that rank's host collectives ([`Buffer::cancel_collectives`]), so nobody
//! waits out a timeout on a survivor that has already left the step. Each survivor checks in
//! with the rounds it has run and the ranks it saw fail; rank 0, which hosts the store,
//! decides: a rank is lost when it has not checked in by the time every rank has either checked
//! in or been seen failing by one that has (after a short grace, so a rank that was merely late
//! still makes it), or when the timeout passes. Every survivor applies the same decision: the
//! lost ranks masked, the next round numbered alike ([`Buffer::resume_collectives`]).
//!
//! Rank 0 cannot be lost: it hosts the store (and, in a serving job, the front end). When it
//! is gone the others' agreement fails with an error naming it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::bootstrap::Store;
use crate::buffer::Buffer;
use crate::error::{Error, Result};

/// How often the watcher looks for an open agreement round in the store.
const WATCH_POLL: Duration = Duration::from_millis(20);
/// How long rank 0 still waits for a rank that another survivor saw fail (a rank that was only
/// slow, e.g. cancelled late, checks in within it).
const LATE_GRACE: Duration = Duration::from_millis(500);

/// What the survivors agreed on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Agreement {
    /// The agreement's number (0 for the first in a job).
    pub epoch: u64,
    /// Every rank lost so far, one flag per rank.
    pub lost: Vec<bool>,
    /// The ranks this agreement found lost (none when every rank checked in).
    pub newly_lost: Vec<usize>,
}

/// One rank's part in agreeing on lost ranks; see the module docs. Built on every rank of a
/// multi-process job, over the job's bootstrap store and the buffer whose collectives it
/// cancels and resumes.
pub struct Membership {
    store: Arc<Store>,
    buffer: Arc<Buffer>,
    /// Agreements completed. Behind a lock that the watcher holds while it cancels, so that a
    /// finished round's marker cannot cancel the collectives that follow it.
    epoch: Arc<Mutex<u64>>,
    stop: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
    lost: Vec<bool>,
    timeout: Duration,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("rank", &self.buffer.topology().rank)
            .field("lost", &self.lost)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn open_key(epoch: u64) -> String {
    format!("ep-membership/{epoch}/open")
}

fn check_in_key(epoch: u64, rank: usize) -> String {
    format!("ep-membership/{epoch}/check-in/{rank}")
}

fn decision_key(epoch: u64) -> String {
    format!("ep-membership/{epoch}/decision")
}

/// `round` then one byte per rank (1: set).
fn encode(round: u64, flags: &[bool]) -> Vec<u8> {
    let mut v = round.to_le_bytes().to_vec();
    v.extend(flags.iter().map(|&f| f as u8));
    v
}

fn decode(bytes: &[u8], ranks: usize, from: usize) -> Result<(u64, Vec<bool>)> {
    if bytes.len() != 8 + ranks {
        return Err(Error::Protocol {
            rank: from,
            what: format!(
                "a membership message of {} bytes, expected {}",
                bytes.len(),
                8 + ranks
            ),
        });
    }
    let round = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    Ok((round, bytes[8..].iter().map(|&b| b != 0).collect()))
}

impl Membership {
    /// This rank's part, over the job's `store` and `buffer`; starts the watcher thread. The
    /// agreement waits up to `buffer`'s timeout for a rank to check in.
    pub fn new(store: Arc<Store>, buffer: Arc<Buffer>) -> Result<Self> {
        let n = buffer.topology().num_ranks;
        if store.world_size() != n || store.rank() != buffer.topology().rank {
            return Err(Error::invalid(
                "store",
                format!("rank {} of {}", store.rank(), store.world_size()),
                format!(
                    "must be the buffer's rank {} of {n}",
                    buffer.topology().rank
                ),
            ));
        }
        let epoch = Arc::new(Mutex::new(0u64));
        let stop = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (store, buffer, epoch, stop) =
                (store.clone(), buffer.clone(), epoch.clone(), stop.clone());
            std::thread::Builder::new()
                .name("ep-membership".into())
                .spawn(move || watch(&store, &buffer, &epoch, &stop))
                .map_err(|e| Error::io("starting the membership watcher", e))?
        };
        let timeout = buffer.config().timeout;
        Ok(Self {
            store,
            buffer,
            epoch,
            stop,
            watcher: Some(watcher),
            lost: vec![false; n],
            timeout,
        })
    }

    /// Every rank lost so far, one flag per rank.
    pub fn lost(&self) -> &[bool] {
        &self.lost
    }

    /// Runs an agreement round (a collective of the survivors: each calls it once its step has
    /// failed or been cancelled) and resumes the buffer's collectives without the lost ranks.
    /// Errors: rank 0 (the store) gone, or this rank found lost by the others (it was too
    /// late: it must leave the job).
    pub fn agree(&mut self) -> Result<Agreement> {
        let me = self.buffer.topology().rank;
        let n = self.lost.len();
        let epoch = *lock(&self.epoch);
        self.buffer.cancel_collectives();
        let gone = |e: Error| match e {
            e @ Error::InvalidArgument { .. } => e,
            e => Error::PeerLost {
                rank: 0,
                what: format!(
                    "the bootstrap store that rank 0 hosts does not answer, so the ranks that \
                     remain cannot agree on a failure ({e})"
                ),
            },
        };
        self.store.set(&open_key(epoch), b"1").map_err(gone)?;
        let masked: Vec<bool> = self.buffer.active_ranks().iter().map(|a| !a).collect();
        let check_in = encode(self.buffer.host_rounds(), &masked);
        self.store
            .set(&check_in_key(epoch, me), &check_in)
            .map_err(gone)?;
        if me == 0 {
            let decision = self.decide(epoch)?;
            self.store
                .set(&decision_key(epoch), &decision)
                .map_err(gone)?;
        }
        let key = decision_key(epoch);
        let got = self
            .store
            .multi_get(&[key.as_str()], self.timeout * 2)
            .map_err(gone)?;
        let (next_round, lost) = decode(&got[0], n, 0)?;
        if lost[me] {
            return Err(Error::FoundLost { rank: me });
        }
        let newly_lost: Vec<usize> = (0..n).filter(|&r| lost[r] && !self.lost[r]).collect();
        let lost_ranks: Vec<usize> = (0..n).filter(|&r| lost[r]).collect();
        {
            let mut e = lock(&self.epoch);
            *e = epoch + 1;
            self.buffer.resume_collectives(&lost_ranks, next_round)?;
        }
        self.lost = lost.clone();
        if !newly_lost.is_empty() {
            tracing::warn!(
                epoch,
                ?newly_lost,
                "ranks lost; the others go on without them"
            );
        }
        Ok(Agreement {
            epoch,
            lost,
            newly_lost,
        })
    }

    /// Rank 0: waits for the check-ins and returns the decision (next round and lost flags).
    fn decide(&self, epoch: u64) -> Result<Vec<u8>> {
        let n = self.lost.len();
        let start = Instant::now();
        let mut seen: Vec<Option<(u64, Vec<bool>)>> = vec![None; n];
        loop {
            for (r, slot) in seen.iter_mut().enumerate() {
                if slot.is_some() || self.lost[r] {
                    continue;
                }
                if let Some(b) = self.store.try_get(&check_in_key(epoch, r))? {
                    *slot = Some(decode(&b, n, r)?);
                }
            }
            let missing: Vec<usize> = (0..n)
                .filter(|&r| seen[r].is_none() && !self.lost[r])
                .collect();
            let elapsed = start.elapsed();
            let all_seen_failing = missing
                .iter()
                .all(|&r| seen.iter().flatten().any(|(_, masked)| masked[r]));
            let done = missing.is_empty()
                || (elapsed >= LATE_GRACE && all_seen_failing)
                || elapsed >= self.timeout;
            if done {
                let mut lost = self.lost.clone();
                missing.iter().for_each(|&r| lost[r] = true);
                let next_round = seen.iter().flatten().map(|(r, _)| *r).max().unwrap_or(0) + 1;
                return Ok(encode(next_round, &lost));
            }
            std::thread::sleep(WATCH_POLL / 4);
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
    }
}

/// The watcher: cancels the buffer's collectives as soon as an agreement round opens.
fn watch(store: &Store, buffer: &Buffer, epoch: &Mutex<u64>, stop: &AtomicBool) {
    let mut warned = false;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(WATCH_POLL);
        let e = *lock(epoch);
        match store.try_get(&open_key(e)) {
            Ok(Some(_)) => {
                let current = lock(epoch);
                if *current == e && !buffer.collectives_cancelled() {
                    tracing::debug!(epoch = e, "agreement round open: cancelling collectives");
                    buffer.cancel_collectives();
                }
            }
            Ok(None) => {}
            // The store is gone with rank 0: the collectives fail on their own.
            Err(e) if !warned => {
                tracing::debug!("membership watcher: {e}");
                warned = true;
            }
            Err(_) => {}
        }
    }
}
