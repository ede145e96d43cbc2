//! Point-to-point byte transports between the ranks of the host backend.
//!
//! The host backend moves every payload through a [`Transport`]: ranks that are threads of one
//! process use [`LocalTransport`] (channels), ranks that are processes use [`TcpTransport`]
//! (a TCP mesh whose addresses are swapped through the bootstrap store). Messages carry a
//! tag (the op's sequence number) so that a late message of a timed-out op is never mistaken
//! for the next op's.
//!
//! With the `nvshmem` feature, `init_nvshmem` starts NVSHMEM (the GPU transport for peers on
//! other nodes) on every rank of the store, bootstrapped by a unique id that the store carries
//! (see the module `nvshmem`); CUDA buffers across nodes start it over their own group
//! (`nvshmem_group`).

mod local;
#[cfg(any(feature = "nvshmem", test))]
pub mod nvshmem;
#[cfg(feature = "nvshmem")]
mod nvshmem_group;
mod tcp;

pub use local::LocalTransport;

/// What NVSHMEM (and NCCL inside it) needs to treat GPUs of one host as several nodes: NVLink
/// multicast off, no remote transport (the P2P transport carries the "network"), and the
/// unique-id bootstrap over the loopback interface. For launchers of tests and benchmarks.
pub const ONE_HOST_NODES_ENV: [(&str, &str); 4] = [
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("NVSHMEM_REMOTE_TRANSPORT", "none"),
    ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
    ("NCCL_NVLS_ENABLE", "0"),
];
#[cfg(feature = "nvshmem")]
pub use nvshmem::init_nvshmem;
#[cfg(feature = "nvshmem")]
pub(crate) use nvshmem_group::nvshmem_for_group;
pub use tcp::TcpTransport;

use crate::error::Result;
use std::time::Instant;

/// Ordered, tagged, reliable byte messages between ranks.
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn num_ranks(&self) -> usize;
    /// Sends `data` to `peer` under `tag`. Never blocks for long: delivery is buffered.
    /// Sending to oneself is allowed and lands in one's own inbox.
    fn send(&self, peer: usize, tag: u64, data: Vec<u8>) -> Result<()>;
    /// Receives the message `peer` sent under `tag`, waiting until `deadline`.
    /// Errors name `peer`: [`crate::Error::Timeout`] when the deadline passes,
    /// [`crate::Error::PeerLost`] when its connection is gone. Messages with a smaller tag
    /// that were never received are dropped.
    fn recv(&self, peer: usize, tag: u64, deadline: Instant) -> Result<Vec<u8>>;
}
