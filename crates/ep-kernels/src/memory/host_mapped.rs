//! [`HostMappedI32`]: host-mapped `i32` words (page-locked host memory every context
//! addresses): counters the notify kernel writes and the host polls while it runs, error
//! records, and the low-latency active-ranks mirror.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::CudaContext;

use crate::error::{Error, Result};

/// `i32`s in page-locked host memory mapped into every context (`cuMemHostAlloc` with
/// `DEVICEMAP | PORTABLE`): the host reads what kernels write while they run.
#[derive(Debug)]
pub struct HostMappedI32 {
    host: *mut i32,
    device: CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is plain pinned memory owned by this value; access from several
// threads goes through volatile reads/writes of i32, which cannot tear.
unsafe impl Send for HostMappedI32 {}
// SAFETY: as above; `&self` methods only do volatile i32 reads/writes.
unsafe impl Sync for HostMappedI32 {}

impl HostMappedI32 {
    /// Allocates `len` (>= 1) words, all set to `fill`, while `ctx` is current.
    pub fn new(ctx: &Arc<CudaContext>, len: usize, fill: i32) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid("len", 0, "must be at least 1"));
        }
        ctx.bind_to_thread()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: plain allocation of `len * 4` bytes; the memory is initialised below before
        // any read.
        let host = unsafe { cudarc::driver::result::malloc_host(len * 4, flags) }? as *mut i32;
        let mut device: CUdeviceptr = 0;
        // SAFETY: `host` was returned by cuMemHostAlloc with DEVICEMAP; `device` is a valid
        // out-pointer.
        let res = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut c_void, 0) };
        let out = Self {
            host,
            device,
            len,
            ctx: ctx.clone(),
        };
        res.result()?;
        out.fill(fill);
        Ok(out)
    }

    /// Number of words.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (at least one word).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The device address of word 0 (valid in every context).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.device
    }

    /// Reads word `i` (volatile).
    pub fn get(&self, i: usize) -> i32 {
        assert!(
            i < self.len,
            "index {i} out of range for {} words",
            self.len
        );
        // SAFETY: in bounds of a live allocation; volatile because the device writes it.
        unsafe { self.host.add(i).read_volatile() }
    }

    /// Writes word `i` (volatile). Do not call while a kernel uses the words.
    pub fn set(&self, i: usize, v: i32) {
        assert!(
            i < self.len,
            "index {i} out of range for {} words",
            self.len
        );
        // SAFETY: in bounds of a live allocation.
        unsafe { self.host.add(i).write_volatile(v) }
    }

    /// Sets every word to `v`.
    pub fn fill(&self, v: i32) {
        (0..self.len).for_each(|i| self.set(i, v));
    }

    /// Every word.
    pub fn to_vec(&self) -> Vec<i32> {
        (0..self.len).map(|i| self.get(i)).collect()
    }

    /// Polls word `i` until it is `>= 0` (the notify kernels' counters start at `-1`), for at
    /// most `timeout`; returns the value, or [`Error::PeerTimeout`] naming `rank` and the
    /// kernel that was to write it (e.g. [`crate::intranode::NOTIFY_KERNEL`]) if it never
    /// arrives.
    pub fn poll_nonneg(
        &self,
        i: usize,
        timeout: Duration,
        rank: usize,
        kernel: &'static str,
    ) -> Result<i32> {
        let start = Instant::now();
        loop {
            let v = self.get(i);
            if v >= 0 {
                return Ok(v);
            }
            if start.elapsed() > timeout {
                return Err(Error::PeerTimeout { rank, kernel });
            }
            std::hint::spin_loop();
        }
    }
}

impl Drop for HostMappedI32 {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `host` came from cuMemHostAlloc and is freed once; no kernel may use it any
        // more (the owner drops it after its streams are done).
        let _ = unsafe { cudarc::driver::result::free_host(self.host as *mut c_void) };
    }
}
