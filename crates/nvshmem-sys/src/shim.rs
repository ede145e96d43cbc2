//! The FFI layer: loads NVSHMEM's host library and the embedded shim, and wraps every shim
//! entry point in a function that returns [`Result`].
//!
//! Loading ([`Shim::get`], once per process, never unloaded):
//! 1. [`crate::locate`] finds `libnvshmem_host.so.3`; it is `dlopen`ed by absolute path with
//!    `RTLD_NOW | RTLD_GLOBAL`, so that the shim's `NEEDED` entry for it is already satisfied
//!    (no `LD_LIBRARY_PATH` needed; setting it after the process started would not help);
//! 2. the shim (`libep_nvshmem_shim.so`, embedded by build.rs) is written to an anonymous
//!    in-memory file (`memfd_create`; else a private file in the temp folder, removed once
//!    loaded) and `dlopen`ed with `RTLD_NOW | RTLD_LOCAL`;
//! 3. its ABI version and `sizeof(nvshmemx_uniqueid_t)` are checked against this crate.
//!
//! NVSHMEM itself then loads its bootstrap plugin (`nvshmem_bootstrap_uid.so.3`) and transports
//! from the host library's folder (its `RPATH` is `$ORIGIN`).
//!
//! Functions that take device addresses are `unsafe`, with their contract in `# Safety`; the
//! safe types of [`crate::nvshmem`] and [`crate::symmetric`] uphold them.

use crate::error::{Error, Result};
use crate::locate::{self, Located, SearchEnv};
use crate::unique_id::{UniqueId, UNIQUE_ID_BYTES};
use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_LOCAL, RTLD_NOW};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::io::Write as _;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::Mutex;

/// The shim built by build.rs from `csrc/shim.cu`.
static SHIM_SO: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libep_nvshmem_shim.so"));

/// `EP_NVSHMEM_ABI_VERSION` of `csrc/shim.cu`.
const ABI_VERSION: c_int = 1;

// Status codes of `csrc/shim.cu`.
const OK: c_int = 0;
const ERR_CUDA: c_int = 1;
const ERR_NVSHMEM: c_int = 2;
const ERR_OUT_OF_MEMORY: c_int = 4;

/// A raw CUDA stream (`CUstream` / `cudaStream_t`); null is the legacy default stream.
pub type RawStream = *mut c_void;

/// The shim's entry points (see `csrc/shim.cu`).
struct Fns {
    abi_version: unsafe extern "C" fn() -> c_int,
    uniqueid_size: unsafe extern "C" fn() -> usize,
    last_error: unsafe extern "C" fn() -> *const c_char,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int, *mut c_int) -> c_int,
    device_count: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_uniqueid: unsafe extern "C" fn(*mut c_void, usize) -> c_int,
    init: unsafe extern "C" fn(c_int, c_int, c_int, *const c_void, usize) -> c_int,
    my_pe: unsafe extern "C" fn() -> c_int,
    n_pes: unsafe extern "C" fn() -> c_int,
    malloc: unsafe extern "C" fn(usize, c_int, *mut *mut c_void) -> c_int,
    free: unsafe extern "C" fn(*mut c_void) -> c_int,
    ptr: unsafe extern "C" fn(*const c_void, c_int) -> *mut c_void,
    barrier_all: unsafe extern "C" fn() -> c_int,
    barrier_all_on_stream: unsafe extern "C" fn(RawStream) -> c_int,
    quiet: unsafe extern "C" fn() -> c_int,
    finalize: unsafe extern "C" fn() -> c_int,
    cumodule_init: unsafe extern "C" fn(*mut c_void) -> c_int,
    memcpy: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int,
    stream_synchronize: unsafe extern "C" fn(RawStream) -> c_int,
    ring_put: unsafe extern "C" fn(*mut c_int, c_int, RawStream) -> c_int,
    ring_put_signal: unsafe extern "C" fn(*mut c_int, *mut u64, c_int, RawStream) -> c_int,
}

/// NVSHMEM's host library and the shim, loaded for the rest of the process.
pub(crate) struct Shim {
    fns: Fns,
    located: Located,
    version: (i32, i32, i32),
    _host: Library,
    _shim: Library,
}

/// The loaded shim, once loading succeeded (a failed load is retried by the next call).
static LOADED: Mutex<Option<&'static Shim>> = Mutex::new(None);

impl Shim {
    /// The process's shim, loaded on first use.
    pub(crate) fn get() -> Result<&'static Shim> {
        let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(shim) = *loaded {
            return Ok(shim);
        }
        let shim: &'static Shim = Box::leak(Box::new(Self::load()?));
        *loaded = Some(shim);
        Ok(shim)
    }

    /// Whether the shim (and so NVSHMEM's host library) is loaded in this process.
    pub(crate) fn is_loaded() -> bool {
        LOADED.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn load() -> Result<Self> {
        let located = locate::locate(&SearchEnv::from_process())?;
        // SAFETY: loading NVSHMEM's host library runs its initialisers, which only set up the
        // library's own state; it stays loaded for the rest of the process (leaked with the
        // Shim), so its finalisers run only at exit.
        let host = unsafe {
            Library::open(
                Some(located.host_library.as_os_str()),
                RTLD_NOW | RTLD_GLOBAL,
            )
        }
        .map_err(|e| Error::Load {
            path: located.host_library.clone(),
            reason: e.to_string(),
        })?;
        let shim = open_embedded_shim()?;
        // SAFETY: each type below is the C signature of the same-named `ep_nvshmem_*` function
        // in csrc/shim.cu (built into this very library by build.rs); the function pointers are
        // used only while `shim` is loaded, and it is never unloaded.
        let fns = unsafe {
            Fns {
                abi_version: symbol(&shim, "ep_nvshmem_abi_version")?,
                uniqueid_size: symbol(&shim, "ep_nvshmem_uniqueid_size")?,
                last_error: symbol(&shim, "ep_nvshmem_last_error")?,
                version: symbol(&shim, "ep_nvshmem_version")?,
                device_count: symbol(&shim, "ep_nvshmem_device_count")?,
                get_uniqueid: symbol(&shim, "ep_nvshmem_get_uniqueid")?,
                init: symbol(&shim, "ep_nvshmem_init")?,
                my_pe: symbol(&shim, "ep_nvshmem_my_pe")?,
                n_pes: symbol(&shim, "ep_nvshmem_n_pes")?,
                malloc: symbol(&shim, "ep_nvshmem_malloc")?,
                free: symbol(&shim, "ep_nvshmem_free")?,
                ptr: symbol(&shim, "ep_nvshmem_ptr")?,
                barrier_all: symbol(&shim, "ep_nvshmem_barrier_all")?,
                barrier_all_on_stream: symbol(&shim, "ep_nvshmem_barrier_all_on_stream")?,
                quiet: symbol(&shim, "ep_nvshmem_quiet")?,
                finalize: symbol(&shim, "ep_nvshmem_finalize")?,
                cumodule_init: symbol(&shim, "ep_nvshmem_cumodule_init")?,
                memcpy: symbol(&shim, "ep_nvshmem_memcpy")?,
                stream_synchronize: symbol(&shim, "ep_nvshmem_stream_synchronize")?,
                ring_put: symbol(&shim, "ep_nvshmem_ring_put")?,
                ring_put_signal: symbol(&shim, "ep_nvshmem_ring_put_signal")?,
            }
        };
        // SAFETY: plain getters of constants, no arguments.
        let (abi, id_size) = unsafe { ((fns.abi_version)(), (fns.uniqueid_size)()) };
        if abi != ABI_VERSION {
            return Err(Error::AbiMismatch {
                what: "ABI version",
                expected: ABI_VERSION as u64,
                found: abi as u64,
            });
        }
        if id_size != UNIQUE_ID_BYTES {
            return Err(Error::AbiMismatch {
                what: "sizeof(nvshmemx_uniqueid_t)",
                expected: UNIQUE_ID_BYTES as u64,
                found: id_size as u64,
            });
        }
        let mut v = [0 as c_int; 3];
        // SAFETY: three valid, writable ints.
        let status = unsafe { (fns.version)(&mut v[0], &mut v[1], &mut v[2]) };
        let mut this = Self {
            fns,
            located,
            version: (0, 0, 0),
            _host: host,
            _shim: shim,
        };
        this.check(status)?;
        this.version = (v[0], v[1], v[2]);
        Ok(this)
    }

    /// Where NVSHMEM's host library was loaded from.
    pub(crate) fn located(&self) -> &Located {
        &self.located
    }

    /// The NVSHMEM version the shim was built against (major, minor, patch).
    pub(crate) fn version(&self) -> (i32, i32, i32) {
        self.version
    }

    /// Turns a shim status into a `Result`, with the shim's message for this thread.
    fn check(&self, status: c_int) -> Result<()> {
        if status == OK {
            return Ok(());
        }
        // SAFETY: returns a pointer to the shim's NUL-terminated, thread-local message buffer,
        // which lives as long as the thread; it is copied out at once.
        let message = unsafe { CStr::from_ptr((self.fns.last_error)()) }
            .to_string_lossy()
            .into_owned();
        Err(match status {
            ERR_CUDA => Error::Cuda { message },
            ERR_NVSHMEM => Error::Nvshmem { message },
            ERR_OUT_OF_MEMORY => Error::OutOfSymmetricMemory { message },
            code => Error::Shim { code, message },
        })
    }

    /// The number of visible CUDA devices (`cudaGetDeviceCount`).
    pub(crate) fn device_count(&self) -> Result<usize> {
        let mut count: c_int = 0;
        // SAFETY: one valid, writable int.
        self.check(unsafe { (self.fns.device_count)(&mut count) })?;
        Ok(count.max(0) as usize)
    }

    /// `nvshmemx_get_uniqueid`.
    pub(crate) fn get_uniqueid(&self) -> Result<[u8; UNIQUE_ID_BYTES]> {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        // SAFETY: a writable buffer of exactly the length passed.
        self.check(unsafe { (self.fns.get_uniqueid)(bytes.as_mut_ptr().cast(), UNIQUE_ID_BYTES) })?;
        Ok(bytes)
    }

    /// `cudaSetDevice(device)` then `nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, ..)`.
    /// Arguments are checked by the caller (they fit `int`, `rank < nranks`).
    pub(crate) fn init(&self, device: i32, rank: i32, nranks: i32, id: &UniqueId) -> Result<()> {
        let bytes = id.as_bytes();
        // SAFETY: `bytes` is a readable buffer of exactly the length passed; the shim copies it.
        self.check(unsafe {
            (self.fns.init)(device, rank, nranks, bytes.as_ptr().cast(), bytes.len())
        })
    }

    /// `nvshmem_my_pe()` (-1 before init).
    pub(crate) fn my_pe(&self) -> i32 {
        // SAFETY: no arguments; the shim returns -1 when NVSHMEM is not initialised.
        unsafe { (self.fns.my_pe)() }
    }

    /// `nvshmem_n_pes()` (-1 before init).
    pub(crate) fn n_pes(&self) -> i32 {
        // SAFETY: as `my_pe`.
        unsafe { (self.fns.n_pes)() }
    }

    /// `nvshmem_calloc(bytes, 1)`: a zeroed symmetric allocation (collective).
    pub(crate) fn calloc(&self, bytes: usize) -> Result<NonNull<c_void>> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: one valid, writable pointer; the shim checks that NVSHMEM is initialised.
        self.check(unsafe { (self.fns.malloc)(bytes, 1, &mut ptr) })?;
        NonNull::new(ptr).ok_or_else(|| Error::Shim {
            code: OK,
            message: format!("nvshmem_calloc({bytes} bytes) reported success with a null pointer"),
        })
    }

    /// `cudaDeviceSynchronize`, then `nvshmem_free` (collective).
    ///
    /// # Safety
    /// `ptr` came from [`Shim::calloc`] of the live NVSHMEM instance and is freed once.
    pub(crate) unsafe fn free(&self, ptr: NonNull<c_void>) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check(unsafe { (self.fns.free)(ptr.as_ptr()) })
    }

    /// `nvshmem_ptr(ptr, pe)`: the address at which this GPU can load/store PE `pe`'s copy of
    /// the symmetric object at `ptr`, or `None` when `pe` is not reachable that way.
    ///
    /// # Safety
    /// `ptr` points into a live symmetric allocation and `pe < n_pes`.
    pub(crate) unsafe fn ptr(&self, ptr: NonNull<c_void>, pe: i32) -> Option<NonNull<c_void>> {
        // SAFETY: the caller's contract; nvshmem_ptr only computes an address.
        NonNull::new(unsafe { (self.fns.ptr)(ptr.as_ptr(), pe) })
    }

    /// `nvshmem_barrier_all` (collective; completes outstanding puts).
    pub(crate) fn barrier_all(&self) -> Result<()> {
        // SAFETY: no arguments; the shim checks that NVSHMEM is initialised.
        self.check(unsafe { (self.fns.barrier_all)() })
    }

    /// `nvshmemx_barrier_all_on_stream` (collective, enqueued on `stream`).
    ///
    /// # Safety
    /// `stream` is null (the legacy default stream) or a live stream of the NVSHMEM device's
    /// primary context.
    pub(crate) unsafe fn barrier_all_on_stream(&self, stream: RawStream) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check(unsafe { (self.fns.barrier_all_on_stream)(stream) })
    }

    /// `nvshmem_quiet` from the host.
    pub(crate) fn quiet(&self) -> Result<()> {
        // SAFETY: no arguments; the shim checks that NVSHMEM is initialised.
        self.check(unsafe { (self.fns.quiet)() })
    }

    /// `nvshmem_finalize` (collective).
    pub(crate) fn finalize(&self) -> Result<()> {
        // SAFETY: no arguments; the shim checks that NVSHMEM is initialised.
        self.check(unsafe { (self.fns.finalize)() })
    }

    /// `nvshmemx_cumodule_init(module)`.
    ///
    /// # Safety
    /// `module` is a live `CUmodule` loaded in the NVSHMEM device's primary context.
    pub(crate) unsafe fn cumodule_init(&self, module: NonNull<c_void>) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check(unsafe { (self.fns.cumodule_init)(module.as_ptr()) })
    }

    /// Synchronous `cudaMemcpy` of `bytes` bytes, device to host.
    ///
    /// # Safety
    /// `src` is device memory with `bytes` readable bytes; `dst` is host memory with `bytes`
    /// writable bytes.
    pub(crate) unsafe fn copy_to_host(
        &self,
        dst: *mut c_void,
        src: *const c_void,
        bytes: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check(unsafe { (self.fns.memcpy)(dst, src, bytes, 0) })
    }

    /// Synchronous `cudaMemcpy` of `bytes` bytes, host to device.
    ///
    /// # Safety
    /// `dst` is device memory with `bytes` writable bytes; `src` is host memory with `bytes`
    /// readable bytes.
    pub(crate) unsafe fn copy_to_device(
        &self,
        dst: *mut c_void,
        src: *const c_void,
        bytes: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check(unsafe { (self.fns.memcpy)(dst, src, bytes, 1) })
    }

    /// `cudaStreamSynchronize(stream)`.
    ///
    /// # Safety
    /// As [`Shim::barrier_all_on_stream`].
    pub(crate) unsafe fn stream_synchronize(&self, stream: RawStream) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check(unsafe { (self.fns.stream_synchronize)(stream) })
    }

    /// Launches the test kernel that puts `value` into the next PE's `*sym`.
    ///
    /// # Safety
    /// `sym` points to a live symmetric `i32`; `stream` as in [`Shim::barrier_all_on_stream`].
    pub(crate) unsafe fn ring_put(
        &self,
        sym: NonNull<i32>,
        value: i32,
        stream: RawStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check(unsafe { (self.fns.ring_put)(sym.as_ptr(), value, stream) })
    }

    /// Launches the put-with-signal test kernel (see `csrc/shim.cu`).
    ///
    /// # Safety
    /// `sym` points to three live symmetric `i32`s, `sig` to a live symmetric `u64`; `stream`
    /// as in [`Shim::barrier_all_on_stream`].
    pub(crate) unsafe fn ring_put_signal(
        &self,
        sym: NonNull<i32>,
        sig: NonNull<u64>,
        value: i32,
        stream: RawStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check(unsafe { (self.fns.ring_put_signal)(sym.as_ptr(), sig.as_ptr(), value, stream) })
    }
}

/// One entry point of the shim as a function pointer of type `T`.
///
/// # Safety
/// `T` is the function's exact C signature, and the pointer is used only while `lib` is loaded.
unsafe fn symbol<T: Copy>(lib: &Library, name: &str) -> Result<T> {
    // SAFETY: the caller's contract.
    let sym = unsafe { lib.get::<T>(name) }.map_err(|e| Error::Load {
        path: PathBuf::from("<embedded libep_nvshmem_shim.so>"),
        reason: format!("symbol {name}: {e}"),
    })?;
    Ok(*sym)
}

/// Writes the embedded shim to a file that can be `dlopen`ed, and loads it: an anonymous
/// in-memory file first, else a private file in the temp folder (removed once loaded).
fn open_embedded_shim() -> Result<Library> {
    let mut reasons = Vec::new();
    match memfd_with_shim() {
        Ok(file) => {
            use std::os::fd::AsRawFd as _;
            let path = format!("/proc/self/fd/{}", file.as_raw_fd());
            match open_shim_file(&path) {
                Ok(lib) => return Ok(lib),
                Err(e) => reasons.push(format!("memfd {path}: {e}")),
            }
        }
        Err(e) => reasons.push(format!("memfd_create: {e}")),
    }
    let dir = std::env::temp_dir();
    let path = dir.join(format!(
        "ep_nvshmem_shim-{}-{}.so",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    let written = (|| -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o700)
            .open(&path)?;
        f.write_all(SHIM_SO)?;
        f.sync_all()
    })();
    let result = match written {
        Ok(()) => open_shim_file(&path.to_string_lossy()).map_err(|e| {
            reasons.push(format!("{}: {e}", path.display()));
        }),
        Err(e) => {
            reasons.push(format!("{}: {e}", path.display()));
            Err(())
        }
    };
    let _ = std::fs::remove_file(&path);
    result.map_err(|()| Error::ShimFile {
        bytes: SHIM_SO.len(),
        reason: reasons.join("; "),
    })
}

/// An anonymous in-memory file (`memfd_create`) holding the shim.
fn memfd_with_shim() -> std::io::Result<std::fs::File> {
    use std::os::fd::FromRawFd as _;
    let name = c"ep_nvshmem_shim";
    // SAFETY: `name` is NUL-terminated; memfd_create only reads it. MFD_EXEC asks for an
    // executable memfd where the kernel restricts them (vm.memfd_noexec); older kernels reject
    // the flag with EINVAL, then it is retried without.
    let mut fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_EXEC) };
    if fd < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // SAFETY: as above.
        fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    }
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(SHIM_SO)?;
    Ok(file)
}

/// `dlopen(path, RTLD_NOW | RTLD_LOCAL)` of a file holding the shim.
fn open_shim_file(path: &str) -> std::result::Result<Library, String> {
    // SAFETY: the file holds the shim built by build.rs; its initialisers only register its
    // device code with the static CUDA runtime linked into it. Its symbols stay local, and it
    // is never unloaded.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| e.to_string())
}

// Made here, where NVSHMEM is loaded, so that the id's type needs nothing of the shim.
impl UniqueId {
    /// Asks NVSHMEM for a fresh id (`nvshmemx_get_uniqueid`). Loads NVSHMEM (see the crate
    /// docs); needs no GPU. The network interface of the bootstrap listener is chosen by
    /// `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME` (e.g. `lo` for one node), its address by
    /// `NVSHMEM_BOOTSTRAP_UID_SESSION_ID` (`<ip>:<port>`) if set.
    pub fn new() -> Result<Self> {
        let bytes = Shim::get()?.get_uniqueid()?;
        Self::from_bytes(&bytes)
    }
}
