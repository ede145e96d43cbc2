//! [`DeviceMemory`]: one raw `cuMemAlloc` allocation (not a stream-ordered pool, which peers
//! cannot reach), its zeroing, and its release on drop.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{result, CudaContext, CudaStream};

use super::ipc;
use crate::error::{Error, Result};

/// A `cuMemAlloc` allocation of one context, freed on drop (after the context's work).
///
/// Peers reach it through peer access ([`super::enable_peer_access`]) or CUDA IPC
/// ([`DeviceMemory::ipc_handle`]); kernels get its address from [`DeviceMemory::ptr`].
#[derive(Debug)]
pub struct DeviceMemory {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
    bytes: usize,
}

// SAFETY: the allocation is owned by this value and only touched through the (thread-safe)
// CUDA driver; nothing in it is tied to the creating thread.
unsafe impl Send for DeviceMemory {}
// SAFETY: as above; `&self` methods only read the address.
unsafe impl Sync for DeviceMemory {}

impl DeviceMemory {
    /// Allocates `bytes` (>= 1) on `ctx`'s device, binding `ctx` to this thread. The contents
    /// are undefined until written (see [`DeviceMemory::zero_async`]).
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Err(Error::invalid(
                "bytes",
                0,
                "a device buffer needs at least 1 byte",
            ));
        }
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation; the owning value is built right away, so it is freed
        // once, in `Drop`; nobody reads it before the owner writes it.
        let ptr = unsafe { result::malloc_sync(bytes) }?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    /// Allocates `bytes` (>= 1) on `stream`'s device and zeroes them (synchronises `stream`).
    pub fn zeroed(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self> {
        let mut mem = Self::alloc(stream.context(), bytes)?;
        mem.zero_async(stream)?;
        stream.synchronize()?;
        Ok(mem)
    }

    /// Enqueues zeroing every byte on `stream` (a stream of this allocation's context); the
    /// memory is zero once the stream has passed this point.
    pub fn zero_async(&mut self, stream: &CudaStream) -> Result<()> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `ptr` holds `bytes` bytes of this context, alive until `Drop`, which
        // synchronises the context first, so the memset finishes before the memory is freed.
        unsafe { result::memset_d8_async(self.ptr, 0, self.bytes, stream.cu_stream()) }?;
        Ok(())
    }

    /// Zeroes the first `bytes` (at most the whole allocation) synchronously. No kernel may be
    /// using the memory.
    pub fn zero_sync(&mut self, bytes: usize) -> Result<()> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `ptr` is a live allocation of `self.bytes >= bytes.min(self.bytes)` bytes.
        unsafe { result::memset_d8_sync(self.ptr, 0, bytes.min(self.bytes)) }?;
        Ok(())
    }

    /// The device address (valid while `self` lives).
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The context the memory belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The CUDA IPC handle of the allocation (binds its context), for a peer process to map
    /// with [`ipc::open`].
    pub fn ipc_handle(&self) -> Result<ipc::Handle> {
        // SAFETY: `ptr` is the base of this live `cuMemAlloc` allocation of `ctx`.
        unsafe { ipc::get_handle(&self.ctx, self.ptr) }
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // Kernels (of this rank) using the memory must be done before it is freed.
            let _ = self.ctx.synchronize();
            // SAFETY: `ptr` came from `malloc_sync` and is freed only here, after the
            // context's work has finished.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}
