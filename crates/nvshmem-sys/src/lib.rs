//! The project's FFI to NVSHMEM's host API (NVSHMEM 3.4, CUDA 13): initialisation by unique
//! id, symmetric memory, barriers, and `nvshmemx_cumodule_init` for modules whose kernels use
//! NVSHMEM's device API.
//!
//! ```no_run
//! # #[cfg(feature = "cuda")]
//! # fn main() -> nvshmem_sys::Result<()> {
//! use nvshmem_sys::{Nvshmem, UniqueId};
//! // Rank 0 makes the id and sends its bytes to the others (e.g. through a store).
//! let (rank, world) = (0, 1);
//! let id = UniqueId::new()?;
//! let id = UniqueId::from_bytes(&id.to_bytes())?;
//! let nv = Nvshmem::init(rank, world, &id, /* CUDA device */ rank)?;
//! let buf = nv.alloc_zeroed::<i32>(1)?; // collective
//! nv.test_ring_put(&buf, 42)?;          // to PE (my_pe + 1) % n_pes
//! nv.barrier_all()?;
//! assert_eq!(buf.to_vec()?, [42]);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "cuda"))]
//! # fn main() {}
//! ```
//!
//! # Two layers, one feature
//!
//! Without the `cuda` feature the crate needs no CUDA at build or run time and holds the pure
//! Rust parts, tested on the CPU: [`Error`], [`UniqueId`] (bytes, hex, checks) and [`locate`]
//! (finding NVSHMEM's host library). With `cuda`, build.rs compiles `csrc/shim.cu` with nvcc
//! and the crate adds [`Nvshmem`], [`SymmetricBuffer`], [`UniqueId::new`],
//! [`cuda_device_count`] and [`library_loaded`].
//!
//! # Why a shim loaded at run time
//!
//! NVSHMEM's init functions (`nvshmemx_init_attr`, ...) are `static inline` in its headers and
//! call `nvshmemi_init_thread` from `libnvshmem_device.a`, which also registers the calling
//! library's device code with NVSHMEM; they cannot be bound from Rust directly. So
//! `csrc/shim.cu` wraps the host API in plain C functions (status codes and a per-thread error
//! message, no exceptions; init calls `nvshmemi_init_thread` itself so that a failure returns
//! an error instead of the header's `exit(-1)`). build.rs compiles it with `-rdc=true`,
//! device-links it with `libnvshmem_device.a` and links a shared library,
//! `libep_nvshmem_shim.so`, against `libnvshmem_host.so.3` and the static CUDA runtime.
//!
//! That library is embedded in the Rust crate (`include_bytes!`), not linked: a binary that
//! uses nvshmem-sys has no `NEEDED` entry for NVSHMEM and starts on machines without it.
//! NVSHMEM is loaded only when first used ([`UniqueId::new`], [`Nvshmem::init`],
//! [`cuda_device_count`]): the host library is found (see [`locate`]), `dlopen`ed by absolute
//! path with `RTLD_GLOBAL` (so the shim's dependency on it is already met), and the shim is
//! written to an anonymous in-memory file (`memfd_create`; else a private file in the temp
//! folder, deleted once loaded) and `dlopen`ed. Neither is ever unloaded.
//!
//! # Where NVSHMEM comes from
//!
//! Build time (`cuda` feature): nvcc from `CUDA_ROOT` / `CUDA_HOME` / `CUDA_PATH` / `PATH`,
//! NVSHMEM from `NVSHMEM_HOME` else `$CUDA_ROOT/nvshmem`: `eval "$(scripts/cuda-toolchain.sh)"`
//! sets both up from the pinned PyPI wheels (`nvidia-nvshmem-cu13==3.4.5`).
//!
//! Run time: `libnvshmem_host.so.3` from `NVSHMEM_DIR` (or `NVSHMEM_HOME`), else
//! `LD_LIBRARY_PATH`, else the wheel in `$VIRTUAL_ENV` / `$CONDA_PREFIX` / `~/.local`, else
//! well-known places (the GPU machine's `/opt/torch/.venv/lib/python3.*/site-packages/nvidia/
//! nvshmem/lib`, system packages), else the folder the crate was built against; see
//! [`locate`]. When it is not found, the error lists every folder searched and names
//! `NVSHMEM_DIR`. NVSHMEM then loads its UID bootstrap plugin (`nvshmem_bootstrap_uid.so.3`)
//! and its transports from its own folder (the host library's `RPATH` is `$ORIGIN`);
//! `NVSHMEM_BOOTSTRAP_UID_PLUGIN` names another plugin file. The CUDA driver (`libcuda.so.1`)
//! is found by NVSHMEM and the CUDA runtime as usual.
//!
//! # Environment read by NVSHMEM
//!
//! - `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME`: the network interface of the UID bootstrap (`lo` for
//!   one node; read by [`UniqueId::new`] and by every rank's init);
//! - `NVSHMEM_REMOTE_TRANSPORT=none`: NVLink/P2P only (no InfiniBand NIC is needed; without
//!   one NVSHMEM logs that its IBGDA transport failed and carries on over P2P);
//! - `NVSHMEM_DISABLE_NVLS=1`: no NVLink SHARP (multicast) for collectives — keep it set on
//!   this project's machines;
//! - `NVSHMEM_SYMMETRIC_SIZE`: the symmetric heap per PE (default 1 GiB);
//! - `NVSHMEM_DEBUG=WARN|INFO`: NVSHMEM's own diagnostics.
//!
//! # Safety and threads
//!
//! `unsafe` lives in the FFI layer (`shim.rs`) and in the calls the safe types make into it.
//! Safe functions never take device addresses; those that do (a stream, a `CUmodule`) are
//! `unsafe fn`s with a `# Safety` section, and buffers hand out their addresses only as
//! [`DevicePtr`] numbers. NVSHMEM runs with `NVSHMEM_THREAD_SERIALIZED`: every call takes the
//! instance's lock, and makes the NVSHMEM device current on the calling thread.

pub mod error;
pub mod locate;
pub mod unique_id;

#[cfg(feature = "cuda")]
mod nvshmem;
#[cfg(feature = "cuda")]
mod session;
#[cfg(feature = "cuda")]
mod shim;
#[cfg(feature = "cuda")]
mod symmetric;

pub use error::{Error, Result, Searched};
pub use unique_id::{UniqueId, UNIQUE_ID_BYTES, UNIQUE_ID_VERSION};

#[cfg(feature = "cuda")]
pub use nvshmem::{cuda_device_count, library_loaded, Nvshmem};
#[cfg(feature = "cuda")]
pub use shim::RawStream;
#[cfg(feature = "cuda")]
pub use symmetric::{DevicePtr, SymmetricBuffer};
