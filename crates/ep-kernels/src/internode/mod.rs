//! Internode (multi-node) normal mode: a token crosses the network once per destination
//! node, to the GPU with its home's local index there (the node's forwarder for that home),
//! and the node's GPUs pull from their forwarders over NVLink what is theirs; combine sums a
//! node's rows on the forwarder and sends one row per node back.
//!
//! - [`host`]: the host twins of the route (per-node send index, the plan of a block); the
//!   receive order and values are the intranode mode's, so the CPU backend is the reference;
//! - `layout`: the byte layout of a rank's buffer and of a message, and the size checks;
//! - `cuda` (feature `nvshmem`): [`InternodeBuffer`] on NVSHMEM's symmetric heap and the
//!   launchers of `notify.cu` (op barrier and count exchange, signals), `dispatch.cu` and
//!   `combine.cu`; the buffer layout and the ordering argument are in `internode.cuh`.

pub mod host;
mod layout;

#[cfg(feature = "nvshmem")]
mod cuda;
#[cfg(feature = "nvshmem")]
pub use cuda::*;

pub use host::*;
pub use layout::{InternodeLayout, MessageLayout, MAX_GPUS_PER_NODE, MAX_NODES};
