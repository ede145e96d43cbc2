//! What both modes of the CUDA backend share: stream ordering around an op, lock and error
//! helpers, and the all-gather of buffer records.

use super::memory::PeerRecord;
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use crate::group::Group;
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// Locks `m`, ignoring poisoning (the state behind every lock here stays consistent).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Turns a kernel-layer error into the runtime's, keeping a peer timeout's rank.
pub(crate) fn kernel_err(e: ep_kernels::Error, timeout: Duration) -> Error {
    match e {
        ep_kernels::Error::PeerTimeout { rank, kernel } => Error::Timeout {
            rank,
            what: format!("device wait in kernel `{kernel}`"),
            waited: timeout,
        },
        ep_kernels::Error::RecvCapacity {
            rank,
            received,
            capacity,
        } => Error::RecvCapacity {
            rank,
            received,
            capacity,
        },
        other => Error::Kernel(other),
    }
}

/// All-gathers `own` and returns the records of the node's ranks (index = local rank).
pub(super) fn gather_records(group: &dyn Group, own: PeerRecord) -> Result<Vec<PeerRecord>> {
    let all = group.all_gather(&own.to_bytes())?;
    all.iter()
        .enumerate()
        .map(|(r, b)| PeerRecord::from_bytes(b, r))
        .collect()
}

/// Makes the communication stream `comm` wait for `previous` (or for candle's stream
/// `compute`), with the context bound to this thread.
pub(super) fn begin(
    compute: &Arc<CudaStream>,
    comm: &Arc<CudaStream>,
    previous: Option<&EventOverlap>,
) -> Result<()> {
    compute.context().bind_to_thread()?;
    match previous {
        Some(e) => e.stream_wait(comm),
        None => Ok(comm.join(compute)?),
    }
}

/// Records the end of an op on `comm`; in synchronous mode candle's stream `compute` waits
/// for it too.
pub(super) fn finish_event(
    compute: &Arc<CudaStream>,
    comm: &Arc<CudaStream>,
    async_finish: bool,
) -> Result<Arc<CudaEvent>> {
    let ev = Arc::new(comm.record_event(None)?);
    if !async_finish {
        compute.wait(&ev)?;
    }
    Ok(ev)
}
