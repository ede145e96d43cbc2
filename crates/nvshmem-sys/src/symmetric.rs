//! [`SymmetricBuffer`]: memory on NVSHMEM's symmetric heap, and [`DevicePtr`], its address.

use crate::error::{Error, Result};
use crate::session::Session;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

/// A device address of `T`s: a number to hand to a kernel launch (e.g. as a cudarc kernel
/// argument), never dereferenced by this crate.
#[derive(Debug, PartialEq, Eq)]
pub struct DevicePtr<T> {
    addr: u64,
    /// Typed, but owns and borrows nothing (so it is `Send + Sync` like a `u64`).
    _elem: PhantomData<fn() -> T>,
}

impl<T> Clone for DevicePtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DevicePtr<T> {}

impl<T> DevicePtr<T> {
    fn new(ptr: NonNull<c_void>) -> Self {
        Self {
            addr: ptr.as_ptr() as u64,
            _elem: PhantomData,
        }
    }

    /// The address.
    pub fn addr(self) -> u64 {
        self.addr
    }
}

/// `len` elements of `T` on NVSHMEM's symmetric heap: the same allocation exists on every PE
/// (made collectively by [`crate::Nvshmem::alloc_zeroed`]), and PEs write into each other's
/// copies from kernels. Dropping it waits for all work on the device (`cudaDeviceSynchronize`)
/// and frees it (`nvshmem_free`, collective: every PE drops its buffers in the same order).
/// Keeps NVSHMEM initialised while it lives.
pub struct SymmetricBuffer<T> {
    ptr: NonNull<T>,
    len: usize,
    session: Arc<Session>,
}

// SAFETY: the pointer is device memory, reached only through the shim's calls, which are
// serialised by the session's lock; `T: Pod` values have no thread affinity.
unsafe impl<T: bytemuck::Pod> Send for SymmetricBuffer<T> {}
// SAFETY: `&self` methods only read the buffer (copies to the host) or compute addresses.
unsafe impl<T: bytemuck::Pod> Sync for SymmetricBuffer<T> {}

impl<T> std::fmt::Debug for SymmetricBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmetricBuffer")
            .field("addr", &format_args!("{:#x}", self.ptr.as_ptr() as u64))
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .finish()
    }
}

impl<T: bytemuck::Pod> SymmetricBuffer<T> {
    pub(crate) fn new(session: Arc<Session>, len: usize) -> Result<Self> {
        let elem = std::mem::size_of::<T>();
        let bytes = len.checked_mul(elem).filter(|&b| b > 0);
        let Some(bytes) = bytes else {
            return Err(Error::InvalidArgument {
                name: "len",
                value: len.to_string(),
                limit: format!(
                    "must be >= 1 and len * {elem} bytes (size of {}) must be non-zero and fit usize",
                    std::any::type_name::<T>()
                ),
            });
        };
        let ptr = {
            let _guard = session.serialize();
            session.shim.calloc(bytes)?
        };
        Ok(Self {
            ptr: ptr.cast(),
            len,
            session,
        })
    }

    pub(crate) fn session(&self) -> &Arc<Session> {
        &self.session
    }

    /// The pointer, for the shim's launchers.
    pub(crate) fn raw(&self) -> NonNull<T> {
        self.ptr
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (allocations hold at least one element).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// This PE's copy's device address.
    pub fn as_device_ptr(&self) -> DevicePtr<T> {
        DevicePtr::new(self.ptr.cast())
    }

    /// The address at which this PE's GPU can load and store PE `pe`'s copy (`nvshmem_ptr`):
    /// `Some` for PEs reachable over NVLink/P2P (and for this PE itself), `None` otherwise
    /// (e.g. another node). `pe < n_pes`.
    pub fn peer_ptr(&self, pe: usize) -> Result<Option<DevicePtr<T>>> {
        if pe >= self.session.n_pes {
            return Err(Error::InvalidArgument {
                name: "pe",
                value: pe.to_string(),
                limit: format!("must be < n_pes = {}", self.session.n_pes),
            });
        }
        let _guard = self.session.serialize();
        // SAFETY: `self.ptr` is a live symmetric allocation and `pe < n_pes` (checked above;
        // n_pes fits i32 since init checked it).
        let peer = unsafe { self.session.shim.ptr(self.ptr.cast(), pe as i32) };
        Ok(peer.map(DevicePtr::new))
    }

    /// Copies this PE's copy into `dst` (synchronous `cudaMemcpy`, which also waits for work
    /// queued on the legacy default stream). `dst.len() == self.len()`.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.check_len("dst", dst.len())?;
        let _guard = self.session.serialize();
        // SAFETY: both sides hold `num_bytes` bytes (lengths checked); `self.ptr` is live
        // device memory and `dst` writable host memory of a Pod type.
        unsafe {
            self.session.shim.copy_to_host(
                dst.as_mut_ptr().cast(),
                self.ptr.as_ptr().cast_const().cast(),
                self.num_bytes(),
            )
        }
    }

    /// This PE's copy as a vector (see [`SymmetricBuffer::copy_to_host`]).
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    /// Overwrites this PE's copy with `src` (synchronous `cudaMemcpy`). `src.len() ==
    /// self.len()`.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        self.check_len("src", src.len())?;
        let _guard = self.session.serialize();
        // SAFETY: both sides hold `num_bytes` bytes (lengths checked); `self.ptr` is live
        // device memory, written only through `&mut self` from the host.
        unsafe {
            self.session.shim.copy_to_device(
                self.ptr.as_ptr().cast(),
                src.as_ptr().cast(),
                self.num_bytes(),
            )
        }
    }

    fn check_len(&self, name: &'static str, len: usize) -> Result<()> {
        if len == self.len {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            name,
            value: format!("{len} elements"),
            limit: format!("must equal the buffer's {} elements", self.len),
        })
    }
}

impl<T> Drop for SymmetricBuffer<T> {
    fn drop(&mut self) {
        let _guard = self.session.serialize();
        // SAFETY: allocated by `calloc` of this session, which is still initialised (the
        // buffer holds it), and freed only here; the shim waits for the device's pending work
        // before freeing. On an error the memory is leaked (drop cannot report it).
        let _ = unsafe { self.session.shim.free(self.ptr.cast()) };
    }
}
