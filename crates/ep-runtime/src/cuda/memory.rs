//! Device memory that peers of the node map: the records ranks swap, and the peer pointers.
//!
//! Every rank allocates its buffer as an [`ep_kernels::memory::DeviceMemory`] (`cuMemAlloc`,
//! not a stream-ordered pool, which peers cannot reach), then the ranks swap one
//! [`PeerRecord`] each over the host transport. A peer in another process is mapped with
//! CUDA IPC ([`ipc::open`]); a peer in this process (several GPUs driven by threads) is
//! reached through its raw pointer after [`enable_peer_access`] (a process cannot open its own
//! IPC handles). The driver calls themselves live in [`ep_kernels::memory`].

use crate::error::{Error, Result};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaContext;
use ep_kernels::memory::{enable_peer_access, ipc, DeviceMemory};
use std::sync::Arc;

/// What one rank tells the others about a buffer: who it is and how to reach the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerRecord {
    /// The owning process.
    pub pid: u32,
    /// The owning device ordinal.
    pub ordinal: u32,
    /// The raw device address in the owner's process.
    pub ptr: u64,
    /// The buffer's size.
    pub bytes: u64,
    /// `cuIpcGetMemHandle` of the allocation.
    pub handle: ipc::Handle,
}

impl PeerRecord {
    const LEN: usize = 4 + 4 + 8 + 8 + ipc::HANDLE_BYTES;

    /// The record of `mem` (gets its IPC handle).
    pub(crate) fn of(mem: &DeviceMemory, ordinal: usize) -> Result<Self> {
        let handle = mem.ipc_handle()?;
        Ok(Self {
            pid: std::process::id(),
            ordinal: u32::try_from(ordinal).unwrap_or(u32::MAX),
            ptr: mem.ptr(),
            bytes: mem.bytes() as u64,
            handle,
        })
    }

    /// Serialises the record.
    pub(crate) fn to_bytes(self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::LEN);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.ordinal.to_le_bytes());
        v.extend_from_slice(&self.ptr.to_le_bytes());
        v.extend_from_slice(&self.bytes.to_le_bytes());
        v.extend_from_slice(&self.handle);
        v
    }

    /// Parses the record sent by `rank`.
    pub(crate) fn from_bytes(b: &[u8], rank: usize) -> Result<Self> {
        if b.len() != Self::LEN {
            return Err(Error::Protocol {
                rank,
                what: format!(
                    "buffer record has {} bytes, expected {} (is that rank a CUDA buffer of the same build?)",
                    b.len(),
                    Self::LEN
                ),
            });
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let mut handle = [0u8; ipc::HANDLE_BYTES];
        handle.copy_from_slice(&b[24..88]);
        Ok(Self {
            pid: u32_at(0),
            ordinal: u32_at(4),
            ptr: u64_at(8),
            bytes: u64_at(16),
            handle,
        })
    }
}

/// Every node peer's buffer as this rank's context addresses it.
#[derive(Debug)]
pub(crate) struct PeerMap {
    ctx: Arc<CudaContext>,
    /// `ptrs[i]`: the buffer of the `i`-th rank of the node.
    ptrs: Vec<u64>,
    /// Addresses returned by [`ipc::open`] (closed on drop).
    opened: Vec<CUdeviceptr>,
    /// Primary contexts of same-process peers on other devices (kept alive while mapped).
    _peer_ctxs: Vec<Arc<CudaContext>>,
}

// SAFETY: plain addresses and driver handles; the driver is thread-safe.
unsafe impl Send for PeerMap {}
// SAFETY: as above; `&self` only reads the addresses.
unsafe impl Sync for PeerMap {}

impl PeerMap {
    /// Maps the buffers described by `records` (index = node-local rank; `me` = this rank's
    /// index, whose record is its own buffer). `global_rank(i)` names a peer in errors.
    pub(crate) fn open(
        ctx: &Arc<CudaContext>,
        records: &[PeerRecord],
        me: usize,
        global_rank: impl Fn(usize) -> usize,
    ) -> Result<Self> {
        let own = records[me];
        let mut map = Self {
            ctx: ctx.clone(),
            ptrs: Vec::with_capacity(records.len()),
            opened: Vec::new(),
            _peer_ctxs: Vec::new(),
        };
        ctx.bind_to_thread()?;
        for (i, rec) in records.iter().enumerate() {
            if rec.bytes != own.bytes {
                return Err(Error::invalid(
                    "num_nvl_bytes",
                    format!("{} bytes on rank {}", rec.bytes, global_rank(i)),
                    format!(
                        "every rank must allocate the same buffer size (this rank: {})",
                        own.bytes
                    ),
                ));
            }
            if i == me {
                map.ptrs.push(rec.ptr);
            } else if rec.pid == own.pid {
                // Same process: unified addressing; enable peer access to the other device.
                if rec.ordinal != own.ordinal {
                    let peer = CudaContext::new(rec.ordinal as usize)?;
                    enable_peer_access(ctx, &peer).map_err(|e| {
                        Error::Unsupported(format!(
                            "rank {} (device {}) is not reachable over NVLink/P2P from device {}: {e}",
                            global_rank(i),
                            rec.ordinal,
                            own.ordinal
                        ))
                    })?;
                    map._peer_ctxs.push(peer);
                    ctx.bind_to_thread()?;
                }
                map.ptrs.push(rec.ptr);
            } else {
                // The mapping (into `ctx`, bound above) is closed in `Drop`.
                let ptr = ipc::open(&rec.handle).map_err(|e| {
                    Error::Unsupported(format!(
                        "cannot open the CUDA IPC handle of rank {} (pid {}, device {}): {e}; \
                         are both processes on one node with NVLink/P2P between the GPUs?",
                        global_rank(i),
                        rec.pid,
                        rec.ordinal
                    ))
                })?;
                map.opened.push(ptr);
                map.ptrs.push(ptr);
            }
        }
        Ok(map)
    }

    /// The node's buffers as this context addresses them (index = node-local rank).
    pub(crate) fn ptrs(&self) -> &[u64] {
        &self.ptrs
    }
}

impl Drop for PeerMap {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.ctx.synchronize();
            for &p in &self.opened {
                // SAFETY: `p` came from `ipc::open` in this context and is closed once, after
                // this context's kernels (the only users of the mapping) finished.
                let _ = unsafe { ipc::close(p) };
            }
        }
    }
}
