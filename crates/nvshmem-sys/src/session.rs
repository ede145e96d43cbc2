//! The process-wide NVSHMEM lifecycle and the live [`Session`] that the [`crate::Nvshmem`]
//! handle and its [`crate::SymmetricBuffer`]s share.

use crate::error::Result;
use crate::shim::Shim;
use std::sync::{Mutex, MutexGuard};

/// Where NVSHMEM stands in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lifecycle {
    Uninitialized,
    Live {
        rank: usize,
        device: usize,
    },
    Finalized,
    /// An init failed inside NVSHMEM, which may have left it half set up.
    Failed,
}

static LIFECYCLE: Mutex<Lifecycle> = Mutex::new(Lifecycle::Uninitialized);

pub(crate) fn lifecycle() -> MutexGuard<'static, Lifecycle> {
    LIFECYCLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The live NVSHMEM session, shared by the [`crate::Nvshmem`] handle and its buffers; finalised when
/// the last of them is dropped.
pub(crate) struct Session {
    pub(crate) shim: &'static Shim,
    pub(crate) pe: usize,
    pub(crate) n_pes: usize,
    pub(crate) device: usize,
    /// Serialises calls into NVSHMEM (initialised with `NVSHMEM_THREAD_SERIALIZED`).
    lock: Mutex<()>,
    finalized: bool,
}

impl Session {
    /// The session of PE `pe` of `n_pes` on CUDA device `device`, NVSHMEM just initialised.
    pub(crate) fn new(shim: &'static Shim, pe: usize, n_pes: usize, device: usize) -> Self {
        Self {
            shim,
            pe,
            n_pes,
            device,
            lock: Mutex::new(()),
            finalized: false,
        }
    }

    /// Holds the call lock for one NVSHMEM call (or a few that belong together).
    pub(crate) fn serialize(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn finalize(&mut self) -> Result<()> {
        if self.finalized {
            return Ok(());
        }
        self.finalized = true;
        let result = {
            let _guard = self.serialize();
            self.shim.finalize()
        };
        *lifecycle() = Lifecycle::Finalized;
        result
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Errors cannot be returned from drop; `Nvshmem::finalize` reports them.
        let _ = self.finalize();
    }
}
