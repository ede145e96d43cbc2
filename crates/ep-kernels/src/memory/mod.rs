//! Device memory and how it is shared: the one owner of raw device allocations
//! ([`DeviceMemory`]), host-mapped words ([`HostMappedI32`]), CUDA IPC handles ([`ipc`]) and
//! peer access ([`enable_peer_access`]).
//!
//! One concept per file:
//! - `device`: [`DeviceMemory`], a `cuMemAlloc` allocation (reachable by peers) freed on drop;
//! - `host_mapped`: [`HostMappedI32`], page-locked host words mapped into every context;
//! - [`ipc`]: the IPC handle of an allocation, and mapping / unmapping a peer process's one;
//! - `peer`: [`enable_peer_access`] between the contexts of one process.
//!
//! The kernels' launchers take pointers and sizes out of these and own no memory themselves.

mod device;
mod host_mapped;
pub mod ipc;
mod peer;

pub use device::DeviceMemory;
pub use host_mapped::HostMappedI32;
pub use peer::enable_peer_access;
