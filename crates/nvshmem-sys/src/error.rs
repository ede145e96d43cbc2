//! The crate's error type.

use std::fmt;
use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One folder that the library search looked in, and why it looked there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Searched {
    /// The folder.
    pub dir: PathBuf,
    /// Where the folder came from (`LD_LIBRARY_PATH`, `$VIRTUAL_ENV`, `well-known`, ...).
    pub from: String,
}

impl fmt::Display for Searched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.dir.display(), self.from)
    }
}

fn list(searched: &[Searched]) -> String {
    if searched.is_empty() {
        return "nothing".to_owned();
    }
    searched
        .iter()
        .map(Searched::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Everything that can go wrong in `nvshmem-sys`.
///
/// Messages name the argument, the value and the limit (bad input), the file and the folders
/// searched with the variable to set (a missing library), or the NVSHMEM / CUDA call and its
/// status (a failure inside NVSHMEM).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument is out of range; NVSHMEM was not called.
    #[error("invalid argument `{name}` = {value}: {limit}")]
    InvalidArgument {
        /// The argument's name.
        name: &'static str,
        /// The offending value, printed.
        value: String,
        /// What it must satisfy.
        limit: String,
    },
    /// Bytes given as a unique id have the wrong length.
    #[error("an NVSHMEM unique id is {expected} bytes (nvshmemx_uniqueid_t), got {got}")]
    UniqueIdLength {
        /// `size_of::<nvshmemx_uniqueid_t>()` (128).
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// Bytes given as a unique id do not start with the id's version word.
    #[error(
        "not an NVSHMEM unique id: its version word is {found:#x}, expected {expected:#x} \
         (nvshmemx_uniqueid_v1, as written by nvshmemx_get_uniqueid)"
    )]
    UniqueIdVersion {
        /// The version word that `nvshmemx_get_uniqueid` writes.
        expected: u32,
        /// The first four bytes given, little-endian.
        found: u32,
    },
    /// A hex string given as a unique id is malformed.
    #[error("unique id hex string: {reason}")]
    UniqueIdHex {
        /// What is wrong with it (length, the offending character and its position).
        reason: String,
    },
    /// An explicitly named NVSHMEM folder does not hold the host library.
    #[error(
        "{var}={} does not hold {file} (looked in {}); set {var} to NVSHMEM's prefix, the \
         folder whose lib/ holds {file} (e.g. <venv>/lib/python3.12/site-packages/nvidia/nvshmem \
         of the wheel nvidia-nvshmem-cu13==3.4.5)",
        dir.display(),
        list(looked)
    )]
    LibraryNotInDir {
        /// The variable (`NVSHMEM_DIR` or `NVSHMEM_HOME`).
        var: &'static str,
        /// Its value.
        dir: PathBuf,
        /// The file looked for (`libnvshmem_host.so.3`).
        file: &'static str,
        /// The folders looked in.
        looked: Vec<Searched>,
    },
    /// The host library was found nowhere.
    #[error(
        "NVSHMEM's host library {file} was not found; searched: {}. Set NVSHMEM_DIR to NVSHMEM's \
         prefix (the folder whose lib/ holds {file}, e.g. <venv>/lib/python3.12/site-packages/\
         nvidia/nvshmem of the wheel nvidia-nvshmem-cu13==3.4.5), or add its lib/ folder to \
         LD_LIBRARY_PATH",
        list(searched)
    )]
    LibraryNotFound {
        /// The file looked for (`libnvshmem_host.so.3`).
        file: &'static str,
        /// Every folder searched, in order.
        searched: Vec<Searched>,
    },
    /// A library was found but could not be loaded.
    #[error("cannot load {}: {reason}", path.display())]
    Load {
        /// The library's path.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// The embedded shim could not be written to an executable in-memory or temporary file.
    #[error(
        "cannot write the embedded NVSHMEM shim ({bytes} bytes) to a file to load: {reason}; \
         set TMPDIR to a writable folder that allows executable mappings"
    )]
    ShimFile {
        /// The shim's size.
        bytes: usize,
        /// What failed.
        reason: String,
    },
    /// The loaded shim does not match this crate.
    #[error("the NVSHMEM shim's {what} is {found}, this crate expects {expected}")]
    AbiMismatch {
        /// Which property differs.
        what: &'static str,
        /// What this crate expects.
        expected: u64,
        /// What the shim reports.
        found: u64,
    },
    /// `Nvshmem::init` was called while an `Nvshmem` is alive in this process.
    #[error(
        "NVSHMEM is already initialised in this process (rank {rank} on CUDA device {device}); \
         one live Nvshmem per process: use it, or drop it and its SymmetricBuffers first"
    )]
    AlreadyInitialized {
        /// The live instance's rank.
        rank: usize,
        /// The live instance's CUDA device.
        device: usize,
    },
    /// `Nvshmem::init` was called after NVSHMEM was finalised (or failed to initialise) in this
    /// process.
    #[error(
        "NVSHMEM was {what} earlier in this process; this crate initialises NVSHMEM at most \
         once per process"
    )]
    NoReinit {
        /// `finalised` or `left unusable by a failed init`.
        what: &'static str,
    },
    /// `Nvshmem::finalize` was called while symmetric buffers are alive.
    #[error("cannot finalise NVSHMEM: {live} SymmetricBuffer(s) of it are still alive")]
    BuffersAlive {
        /// How many buffers (and clones of the handle) still hold the session.
        live: usize,
    },
    /// A CUDA runtime call in the shim failed.
    #[error("CUDA: {message}")]
    Cuda {
        /// The call, its arguments and CUDA's error string.
        message: String,
    },
    /// An NVSHMEM call failed.
    #[error(
        "NVSHMEM: {message} (NVSHMEM_DEBUG=WARN or INFO prints NVSHMEM's own reason; the UID \
         bootstrap plugin nvshmem_bootstrap_uid.so.3 is loaded from beside libnvshmem_host.so.3 \
         unless NVSHMEM_BOOTSTRAP_UID_PLUGIN names another)"
    )]
    Nvshmem {
        /// The call, its arguments and its status.
        message: String,
    },
    /// The symmetric heap has no room for an allocation.
    #[error(
        "{message}: the symmetric heap is full (NVSHMEM_SYMMETRIC_SIZE sets its size per PE, \
         default 1 GiB)"
    )]
    OutOfSymmetricMemory {
        /// The call and the size asked for.
        message: String,
    },
    /// The shim rejected a call (a bug in this crate: its arguments are checked first).
    #[error("NVSHMEM shim: {message} (status {code})")]
    Shim {
        /// The shim's status code.
        code: i32,
        /// The shim's message.
        message: String,
    },
}
