//! The project's FFI to NVSHMEM's host API (NVSHMEM 3.4, CUDA 13).
//!
//! This first part is pure Rust and needs no CUDA: [`Error`], [`UniqueId`] (bytes, hex,
//! checks) and [`locate`] (finding NVSHMEM's host library, `libnvshmem_host.so.3`, at run time).

pub mod error;
pub mod locate;
pub mod unique_id;

pub use error::{Error, Result, Searched};
pub use unique_id::{UniqueId, UNIQUE_ID_BYTES, UNIQUE_ID_VERSION};
