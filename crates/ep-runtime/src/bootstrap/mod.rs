//! The bootstrap store: a small TCP key-value service on the rank-0 host, in the manner of
//! PyTorch's `TCPStore`, through which ranks swap what they need to start their transports
//! (socket addresses, CUDA IPC handles, NVSHMEM and NCCL unique ids).
//!
//! - [`StoreConfig`] says who this rank is and where the store lives (from the launcher's
//!   `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
//!   or given explicitly).
//! - [`Store`] is every rank's blocking client; on rank 0 it also hosts the server
//!   ([`StoreServer`], a tokio service on its own thread).
//!
//! Every wait has a time limit. Keys written once per rank follow the convention
//! `"{name}/{rank}"`; when such keys are missing at the deadline the error
//! ([`crate::Error::Timeout`]) names the ranks that never wrote them. [`Store::barrier`] and
//! [`Store::all_gather`] use that convention, so their errors always name the late ranks.
//!
//! Wire protocol: frames `u64 len | body`, little-endian; see the private `wire` module.

mod client;
mod config;
mod server;
mod wire;

pub use client::Store;
pub use config::{StoreConfig, DEFAULT_STORE_TIMEOUT};
pub use server::StoreServer;
