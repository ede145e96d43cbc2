//! The NVLink buffers of one node as the kernels see them from one rank, and the error record
//! their device-side waits write.

use std::time::Duration;

use super::{KERNEL_NAMES, MAX_NVL_RANKS, RING_BASE};
use crate::cuda::check_align;
use crate::error::{Error, Result};

/// Default device-side wait timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The NVLink buffers of one node as seen from one rank, plus that rank's error record.
///
/// Every rank allocates one buffer of at least [`buffer_size_hint`](super::buffer_size_hint) bytes on its GPU, zeroes
/// its first [`HEADER_ZERO_BYTES`](super::HEADER_ZERO_BYTES) once, and maps every peer's buffer into its context (peer
/// access in one process, CUDA IPC across processes).
#[derive(Debug, Clone, Copy)]
pub struct PeerBuffers {
    rank: usize,
    num_ranks: usize,
    ptrs: [u64; MAX_NVL_RANKS],
    bytes: usize,
    error_info: u64,
    timeout: Duration,
}

impl PeerBuffers {
    /// Describes the node's buffers from rank `rank`'s point of view: `ptrs[r]` is rank `r`'s
    /// buffer as a device address valid in this rank's context, each `bytes` long;
    /// `error_info` is the device address of this rank's error record (4 `i32`, host-mapped or
    /// device memory; see [`HostMappedI32`](super::HostMappedI32)). Waits time out after [`DEFAULT_TIMEOUT`].
    ///
    /// # Safety
    ///
    /// Every pointer must stay valid (allocated, mapped, peer-accessible from this rank's
    /// context) for as long as kernels launched with this value may run; each buffer must be
    /// at least `bytes` long with its first [`HEADER_ZERO_BYTES`](super::HEADER_ZERO_BYTES) zeroed before the first op;
    /// all ranks must describe the same buffers in the same order; `ptrs[rank]` must be
    /// this rank's own buffer; the buffers must be used by one op at a time. Stream-ordered
    /// (`cuMemAllocAsync` pool) allocations are not reachable through peer access unless the
    /// pool grants it: allocate with `cuMemAlloc` or export through CUDA IPC.
    pub unsafe fn new(rank: usize, ptrs: &[u64], bytes: usize, error_info: u64) -> Result<Self> {
        let num_ranks = ptrs.len();
        if num_ranks == 0 || num_ranks > MAX_NVL_RANKS {
            return Err(Error::invalid(
                "ptrs",
                format!("{num_ranks} buffers"),
                format!("a node has 1 to {MAX_NVL_RANKS} ranks"),
            ));
        }
        if rank >= num_ranks {
            return Err(Error::invalid(
                "rank",
                rank,
                format!("must be < num_ranks = {num_ranks}"),
            ));
        }
        if bytes < RING_BASE {
            return Err(Error::invalid(
                "bytes",
                bytes,
                format!("must be at least {RING_BASE}"),
            ));
        }
        for &p in ptrs {
            check_align("ptrs", p, 128)?;
        }
        check_align("error_info", error_info, 16)?;
        if error_info == 0 {
            return Err(Error::invalid("error_info", 0, "must be a device address"));
        }
        let mut all = [0u64; MAX_NVL_RANKS];
        all[..num_ranks].copy_from_slice(ptrs);
        Ok(Self {
            rank,
            num_ranks,
            ptrs: all,
            bytes,
            error_info,
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// Sets the device-side wait timeout (`Duration::ZERO` = wait forever).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks of the node.
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }

    /// Size of each buffer in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device-side wait timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Rank `r`'s buffer as this rank's context addresses it.
    pub(crate) fn ptr(&self, r: usize) -> u64 {
        self.ptrs[r]
    }

    /// The raw pointer table passed to kernels.
    pub(crate) fn ptrs(&self) -> [u64; MAX_NVL_RANKS] {
        self.ptrs
    }

    /// The device address of this rank's error record.
    pub(crate) fn error_info(&self) -> u64 {
        self.error_info
    }

    pub(crate) fn timeout_ns(&self) -> u64 {
        u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX)
    }

    /// Turns an error record (read by the host after the op's stream has synchronised) into
    /// [`Error::PeerTimeout`] or [`Error::RecvCapacity`]; `Ok` if it is clear. `record` is the
    /// 4 words at `error_info`: `{1 = timeout, awaited rank, kernel id, wait site}` or
    /// `{2 = capacity, rank, received, capacity}`.
    pub fn check_error(record: &[i32]) -> Result<()> {
        let count = |v: i32| usize::try_from(v).unwrap_or(usize::MAX);
        match record {
            [0, ..] => Ok(()),
            [2, rank, received, capacity] => Err(Error::RecvCapacity {
                rank: count(*rank),
                received: count(*received),
                capacity: count(*capacity),
            }),
            [_, rank, kernel, ..] => Err(Error::PeerTimeout {
                rank: usize::try_from(*rank).unwrap_or(usize::MAX),
                kernel: KERNEL_NAMES
                    .get(usize::try_from(*kernel).unwrap_or(0))
                    .copied()
                    .unwrap_or(KERNEL_NAMES[0]),
            }),
            _ => Err(Error::invalid(
                "record",
                format!("{record:?}"),
                "must hold 4 words",
            )),
        }
    }
}
