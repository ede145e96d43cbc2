//! Watching a node's ranks: each rank has a thread that waits for it to exit without reaping it
//! (`waitid` with `WNOWAIT`), so exits arrive in the order they happened and a rank's pid stays
//! valid for signals until the launcher reaps it. A rank that fails is reported (a peer already
//! killed by a signal is preferred to a rank that exited with an error), with its real cause
//! (exit code or signal) and its last error line; then either the others go on (a rank other
//! than 0, when going on is asked for) or they get SIGTERM, then SIGKILL once the grace period
//! is over.

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// One started rank.
pub struct Rank {
    /// Global rank.
    pub rank: usize,
    /// The process.
    pub child: Child,
    /// The thread copying its stderr (finished once the process is gone).
    pub stderr_pump: Option<JoinHandle<()>>,
    /// The last line it wrote to stderr.
    pub last_error: Arc<Mutex<Option<String>>>,
}

/// How a rank ended, in words: `exited with code 1`, `killed by signal 9 (SIGKILL)`.
pub fn describe(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with code {code}");
    }
    match status.signal() {
        Some(sig) => {
            let name = Signal::try_from(sig).map_or("unknown signal", Signal::as_str);
            let core = if status.core_dumped() {
                ", core dumped"
            } else {
                ""
            };
            format!("killed by signal {sig} ({name}{core})")
        }
        None => format!("ended with status {status}"),
    }
}

/// The launcher's exit code for a rank's status: its exit code, or 128 + the signal (as a shell
/// reports it); never 0 for a failure.
pub fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(0), _) => 1,
        (Some(c), _) => c,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    }
}

/// Waits for `pid` to exit without reaping it, then reports `index` on `tx`.
fn watch(index: usize, pid: Pid, tx: Sender<usize>) {
    std::thread::spawn(move || loop {
        match waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
            Err(Errno::EINTR) => continue,
            // Exited (or cannot be waited for, which the reaping reports).
            _ => {
                let _ = tx.send(index);
                return;
            }
        }
    });
}

/// Signals every rank not yet reaped.
fn signal_all(ranks: &[Rank], reaped: &[bool], sig: Signal) {
    for (r, done) in ranks.iter().zip(reaped) {
        if !done {
            // Not reaped yet: the pid is still this rank's (at worst a zombie, which ignores it).
            let _ = kill(Pid::from_raw(r.child.id() as i32), sig);
        }
    }
}

/// How a reaped rank failed, in words, and the launcher's exit code for it; `None` if it
/// succeeded.
fn failure_of(status: &std::io::Result<ExitStatus>) -> Option<(String, i32)> {
    match status {
        Ok(s) if s.success() => None,
        Ok(s) => Some((describe(*s), exit_code(*s))),
        Err(e) => Some((format!("cannot be waited for: {e}"), 1)),
    }
}

/// How long a rank's error exit waits for a peer's death by a signal to show: a killed process
/// closes its sockets (which is what makes its peers fail) before it becomes a zombie, so on a
/// busy machine its peer's exit can be reported first.
const SIGNALLED_PEER_WAIT: Duration = Duration::from_millis(500);

/// A rank not yet reaped that has been killed by a signal (checked without reaping it, for up
/// to [`SIGNALLED_PEER_WAIT`]), if any: when a rank exits with an error, a peer killed by a
/// signal at about the same time is the likelier cause (its death may simply not show yet).
fn signalled_peer(ranks: &[Rank], reaped: &[bool]) -> Option<usize> {
    let start = Instant::now();
    loop {
        let found = ranks.iter().zip(reaped).position(|(r, done)| {
            !done
                && matches!(
                    waitid(
                        Id::Pid(Pid::from_raw(r.child.id() as i32)),
                        WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT | WaitPidFlag::WNOHANG,
                    ),
                    Ok(WaitStatus::Signaled(..))
                )
        });
        if found.is_some() || start.elapsed() >= SIGNALLED_PEER_WAIT {
            return found;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The last line rank `r` wrote to stderr, once its pump has read everything (up to a second).
fn last_error(r: &Rank) -> Option<String> {
    let start = Instant::now();
    while r.stderr_pump.as_ref().is_some_and(|p| !p.is_finished())
        && start.elapsed() < Duration::from_secs(1)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    r.last_error.lock().ok().and_then(|l| l.clone())
}

/// Waits for every rank. When one fails, reports it on stderr; unless it is not rank 0 and
/// `keep_going` is set, sends SIGTERM to the others and SIGKILL to those still running after
/// `grace`. Returns the exit code: 0 when every rank succeeded, else the first failure's (see
/// [`exit_code`]).
pub fn supervise(ranks: &mut [Rank], grace: Duration, keep_going: bool) -> i32 {
    let (tx, rx) = channel();
    for (i, r) in ranks.iter().enumerate() {
        watch(i, Pid::from_raw(r.child.id() as i32), tx.clone());
    }
    drop(tx);
    let mut reaped = vec![false; ranks.len()];
    let mut code = 0;
    let mut deadline: Option<Instant> = None;
    while reaped.iter().any(|d| !d) {
        let next = match deadline {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(d) => rx.recv_timeout(d.saturating_duration_since(Instant::now())),
        };
        let i = match next {
            Ok(i) => i,
            Err(RecvTimeoutError::Timeout) => {
                eprintln!("launch: ranks still running after {grace:?}; killing them");
                signal_all(ranks, &reaped, Signal::SIGKILL);
                deadline = None;
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        if reaped[i] {
            continue;
        }
        let r = &mut ranks[i];
        let status = r.child.wait();
        reaped[i] = true;
        let exited_with_code = status.as_ref().is_ok_and(|s| s.code().is_some());
        let failure = failure_of(&status);
        let Some((mut what, mut c)) = failure else {
            continue;
        };
        if deadline.is_some() {
            // Stopping already: later exits are consequences, not causes.
            tracing::debug!(rank = r.rank, "{what}");
            continue;
        }
        let mut i = i;
        if let Some(j) = exited_with_code
            .then(|| signalled_peer(ranks, &reaped))
            .flatten()
        {
            // Report the killed peer as the cause, this rank's exit as its consequence.
            tracing::debug!(rank = ranks[i].rank, "{what}");
            let peer = ranks[j].child.wait();
            reaped[j] = true;
            (what, c) = failure_of(&peer).unwrap_or((what, c));
            i = j;
        }
        let detail = last_error(&ranks[i]).map_or(String::new(), |l| format!(": {l}"));
        let others = ranks.len() - reaped.iter().filter(|d| **d).count();
        if code == 0 {
            code = c;
        }
        if keep_going && ranks[i].rank != 0 && others > 0 {
            eprintln!(
                "launch: rank {} {what}{detail}; the other ranks go on without it \
                 (--on-rank-failure continue)",
                ranks[i].rank
            );
            continue;
        }
        eprintln!(
            "launch: rank {} {what}{detail}{}",
            ranks[i].rank,
            if others > 0 {
                "; stopping the other ranks"
            } else {
                ""
            }
        );
        signal_all(ranks, &reaped, Signal::SIGTERM);
        deadline = Some(Instant::now() + grace);
    }
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_described_with_their_cause() {
        let exited = ExitStatus::from_raw(3 << 8);
        assert_eq!(describe(exited), "exited with code 3");
        assert_eq!(exit_code(exited), 3);
        let killed = ExitStatus::from_raw(9);
        assert_eq!(describe(killed), "killed by signal 9 (SIGKILL)");
        assert_eq!(exit_code(killed), 137);
        let term = ExitStatus::from_raw(15);
        assert_eq!(describe(term), "killed by signal 15 (SIGTERM)");
    }
}
