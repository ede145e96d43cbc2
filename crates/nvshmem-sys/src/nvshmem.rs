//! [`Nvshmem`]: this process's NVSHMEM instance (one PE).

use crate::error::{Error, Result};
use crate::locate::Located;
use crate::session::{lifecycle, Lifecycle, Session};
use crate::shim::{RawStream, Shim};
use crate::symmetric::SymmetricBuffer;
use crate::unique_id::UniqueId;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

/// This process's NVSHMEM instance: one processing element (PE) of a job of `n_pes`, on one
/// CUDA device.
///
/// Made by [`Nvshmem::init`], which every rank calls with the same [`UniqueId`]. At most one
/// instance is ever initialised per process (a second `init` while one is alive, or after it
/// was finalised, is an error). Dropping the handle and every [`SymmetricBuffer`] made from it
/// finalises NVSHMEM (`nvshmem_finalize`, collective), as does [`Nvshmem::finalize`].
///
/// Calls into NVSHMEM are serialised by a lock (NVSHMEM is initialised with
/// `NVSHMEM_THREAD_SERIALIZED`), so the handle can be shared between threads. Each call first
/// makes the NVSHMEM device current on the calling thread (`cudaSetDevice`).
///
/// Collective operations ([`Nvshmem::init`], [`Nvshmem::alloc_zeroed`], dropping a buffer,
/// [`Nvshmem::barrier_all`], finalising) must be called by every PE, in the same order, with
/// the same sizes; otherwise they hang.
pub struct Nvshmem {
    session: Arc<Session>,
}

impl std::fmt::Debug for Nvshmem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvshmem")
            .field("pe", &self.session.pe)
            .field("n_pes", &self.session.n_pes)
            .field("device", &self.session.device)
            .finish()
    }
}

impl Nvshmem {
    /// Initialises NVSHMEM as PE `rank` of `nranks` on CUDA device `device` (an ordinal among
    /// the visible devices), joined by the unique id `id` (collective: every rank calls it).
    ///
    /// The arguments are checked before NVSHMEM is loaded or called: `nranks >= 1`,
    /// `rank < nranks`, both and `device` fit a C `int`; then `device` is checked against the
    /// number of visible devices. Fails with [`Error::AlreadyInitialized`] while another
    /// instance is alive and [`Error::NoReinit`] after one was finalised.
    ///
    /// Useful variables (read by NVSHMEM): `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME` (network
    /// interface of the bootstrap, e.g. `lo` on one node), `NVSHMEM_SYMMETRIC_SIZE` (heap size
    /// per PE), `NVSHMEM_REMOTE_TRANSPORT=none` (NVLink only), `NVSHMEM_DISABLE_NVLS=1`,
    /// `NVSHMEM_DEBUG=INFO`.
    pub fn init(rank: usize, nranks: usize, id: &UniqueId, device: usize) -> Result<Self> {
        let int_max = i32::MAX as usize;
        if nranks == 0 || nranks > int_max {
            return Err(Error::InvalidArgument {
                name: "nranks",
                value: nranks.to_string(),
                limit: format!("must be in 1..={int_max}"),
            });
        }
        if rank >= nranks {
            return Err(Error::InvalidArgument {
                name: "rank",
                value: rank.to_string(),
                limit: format!("must be < nranks = {nranks}"),
            });
        }
        if device > int_max {
            return Err(Error::InvalidArgument {
                name: "device",
                value: device.to_string(),
                limit: format!("must be <= {int_max}"),
            });
        }
        let mut state = lifecycle();
        match *state {
            Lifecycle::Uninitialized => {}
            Lifecycle::Live { rank, device } => {
                return Err(Error::AlreadyInitialized { rank, device })
            }
            Lifecycle::Finalized => return Err(Error::NoReinit { what: "finalised" }),
            Lifecycle::Failed => {
                return Err(Error::NoReinit {
                    what: "left unusable by a failed init",
                })
            }
        }
        let shim = Shim::get()?;
        let count = shim.device_count()?;
        if device >= count {
            return Err(Error::InvalidArgument {
                name: "device",
                value: device.to_string(),
                limit: format!(
                    "must be < {count}, the number of visible CUDA devices (CUDA_VISIBLE_DEVICES applies)"
                ),
            });
        }
        // The casts are lossless: checked against i32::MAX above.
        match shim.init(device as i32, rank as i32, nranks as i32, id) {
            Ok(()) => {}
            // cudaSetDevice / context creation failed before NVSHMEM was called.
            Err(e @ Error::Cuda { .. }) => return Err(e),
            Err(e) => {
                *state = Lifecycle::Failed;
                return Err(e);
            }
        }
        *state = Lifecycle::Live { rank, device };
        let (pe, n_pes) = (shim.my_pe(), shim.n_pes());
        let session = Session::new(
            shim,
            usize::try_from(pe).unwrap_or(rank),
            usize::try_from(n_pes).unwrap_or(nranks),
            device,
        );
        Ok(Self {
            session: Arc::new(session),
        })
    }

    /// This PE's number (`nvshmem_my_pe`; equals the `rank` given to [`Nvshmem::init`] with
    /// the UID bootstrap).
    pub fn my_pe(&self) -> usize {
        self.session.pe
    }

    /// The number of PEs (`nvshmem_n_pes`).
    pub fn n_pes(&self) -> usize {
        self.session.n_pes
    }

    /// The CUDA device ordinal this PE runs on.
    pub fn device(&self) -> usize {
        self.session.device
    }

    /// The NVSHMEM version the shim was built against (major, minor, patch).
    pub fn version(&self) -> (i32, i32, i32) {
        self.session.shim.version()
    }

    /// Where NVSHMEM's host library was loaded from.
    pub fn library(&self) -> &Located {
        self.session.shim.located()
    }

    /// A zeroed symmetric allocation of `len` elements of `T` (`nvshmem_calloc`; collective:
    /// every PE allocates the same `len` in the same order). `len >= 1`.
    pub fn alloc_zeroed<T: bytemuck::Pod>(&self, len: usize) -> Result<SymmetricBuffer<T>> {
        SymmetricBuffer::new(self.session.clone(), len)
    }

    /// `nvshmem_barrier_all`: waits for every PE and completes every put issued before it
    /// (collective).
    pub fn barrier_all(&self) -> Result<()> {
        let _guard = self.session.serialize();
        self.session.shim.barrier_all()
    }

    /// `nvshmemx_barrier_all_on_stream`: the barrier enqueued on `stream` (collective).
    ///
    /// # Safety
    /// `stream` is null (the legacy default stream) or a live `CUstream` of the primary
    /// context of [`Nvshmem::device`], e.g. cudarc's `CudaStream::cu_stream()` there.
    pub unsafe fn barrier_all_on_stream(&self, stream: RawStream) -> Result<()> {
        let _guard = self.session.serialize();
        // SAFETY: the caller's contract.
        unsafe { self.session.shim.barrier_all_on_stream(stream) }
    }

    /// `cudaStreamSynchronize(stream)`: waits on the host for the work queued on `stream`.
    ///
    /// # Safety
    /// As [`Nvshmem::barrier_all_on_stream`].
    pub unsafe fn synchronize_stream(&self, stream: RawStream) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.session.shim.stream_synchronize(stream) }
    }

    /// `nvshmem_quiet` from the host: completes the puts this PE issued from the host.
    pub fn quiet(&self) -> Result<()> {
        let _guard = self.session.serialize();
        self.session.shim.quiet()
    }

    /// `nvshmemx_cumodule_init(module)`: binds a module whose kernels call NVSHMEM's device
    /// API (compiled with `-rdc=true` and device-linked with `libnvshmem_device.a`) to this
    /// NVSHMEM instance. Call it once per module before launching its kernels.
    ///
    /// # Safety
    /// `module` is a live `CUmodule` loaded in the primary context of [`Nvshmem::device`]
    /// (e.g. the raw module of a cudarc `CudaModule`), and it stays loaded while its kernels
    /// use NVSHMEM.
    pub unsafe fn cumodule_init(&self, module: *mut c_void) -> Result<()> {
        let module = NonNull::new(module).ok_or_else(|| Error::InvalidArgument {
            name: "module",
            value: "null".to_owned(),
            limit: "must be a loaded CUmodule".to_owned(),
        })?;
        let _guard = self.session.serialize();
        // SAFETY: the caller's contract; `module` is not null.
        unsafe { self.session.shim.cumodule_init(module) }
    }

    /// Finalises NVSHMEM now (collective) and reports its status. While buffers of this
    /// instance are alive it fails with [`Error::BuffersAlive`]; NVSHMEM is then finalised
    /// when the last of them is dropped.
    pub fn finalize(self) -> Result<()> {
        match Arc::try_unwrap(self.session) {
            Ok(mut session) => session.finalize(),
            Err(session) => Err(Error::BuffersAlive {
                live: Arc::strong_count(&session) - 1,
            }),
        }
    }

    /// The test kernel of the shim: one thread puts `value` into the next PE's `buf[0]`
    /// (`nvshmem_int_p` to PE `(my_pe + 1) % n_pes`, then `nvshmem_quiet`), on the legacy
    /// default stream; returns when the kernel has finished. Call [`Nvshmem::barrier_all`]
    /// before reading what the previous PE put.
    pub fn test_ring_put(&self, buf: &SymmetricBuffer<i32>, value: i32) -> Result<()> {
        self.check_own(buf.session(), "buf")?;
        let _guard = self.session.serialize();
        let stream: RawStream = std::ptr::null_mut();
        // SAFETY: `buf` is a live symmetric allocation of this instance with at least one
        // element (len >= 1 is enforced at allocation); null is the legacy default stream.
        unsafe {
            self.session.shim.ring_put(buf.raw(), value, stream)?;
            self.session.shim.stream_synchronize(stream)
        }
    }

    /// The put-with-signal test kernel of the shim (collective: every PE must call it, or the
    /// others wait forever): one thread writes `value` to its own `data[0]`, puts it into the
    /// next PE's `data[1]` with `nvshmem_int_put_signal` (setting that PE's `signal[0]` to
    /// `my_pe + 1`), then waits until its own `signal[0]` is set and copies the `data[1]` it
    /// sees at that moment to `data[2]`. Runs on the legacy default stream and returns when
    /// the kernel has finished.
    pub fn test_ring_put_signal(
        &self,
        data: &SymmetricBuffer<i32>,
        signal: &SymmetricBuffer<u64>,
        value: i32,
    ) -> Result<()> {
        self.check_own(data.session(), "data")?;
        self.check_own(signal.session(), "signal")?;
        if data.len() < 3 {
            return Err(Error::InvalidArgument {
                name: "data",
                value: format!("{} elements", data.len()),
                limit: "needs at least 3 (outgoing, received, seen at the signal)".to_owned(),
            });
        }
        let _guard = self.session.serialize();
        let stream: RawStream = std::ptr::null_mut();
        // SAFETY: `data` holds at least 3 symmetric i32s and `signal` at least one symmetric
        // u64 (len >= 1), both live allocations of this instance; null is the legacy default
        // stream.
        unsafe {
            self.session
                .shim
                .ring_put_signal(data.raw(), signal.raw(), value, stream)?;
            self.session.shim.stream_synchronize(stream)
        }
    }

    fn check_own(&self, session: &Arc<Session>, name: &'static str) -> Result<()> {
        if Arc::ptr_eq(session, &self.session) {
            Ok(())
        } else {
            Err(Error::InvalidArgument {
                name,
                value: "a buffer of another NVSHMEM instance".to_owned(),
                limit: "must be allocated by this Nvshmem".to_owned(),
            })
        }
    }
}

/// The number of visible CUDA devices, through the shim's CUDA runtime (loads NVSHMEM's host
/// library, see the crate docs; `CUDA_VISIBLE_DEVICES` applies).
pub fn cuda_device_count() -> Result<usize> {
    Shim::get()?.device_count()
}

/// Whether NVSHMEM's host library and the shim are loaded in this process (they are loaded by
/// the first [`UniqueId::new`], [`Nvshmem::init`] or [`cuda_device_count`] that gets past its
/// argument checks).
pub fn library_loaded() -> bool {
    Shim::is_loaded()
}
