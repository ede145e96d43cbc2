//! Expert-parallel dispatch and combine, in the shape of DeepEP's API, over candle tensors.
//!
//! A [`Buffer`] is one rank's end of an expert-parallel group. Its ops are collectives that
//! every rank calls in the same order:
//!
//! - [`Buffer::get_dispatch_layout`]: how many tokens go to each rank and expert (local);
//! - [`Buffer::dispatch`] / [`Buffer::combine`]: the normal (high-throughput, prefill) mode,
//!   with exactly-sized outputs and a [`Handle`] for combine and cached dispatch;
//! - [`Buffer::low_latency_dispatch`] / [`Buffer::low_latency_combine`]: the low-latency
//!   (decode) mode with fixed per-(expert, source) slots, send/receive hooks and the
//!   active-ranks mask.
//!
//! Ranks are threads of one process ([`Buffer::local_group`]) or processes joined through
//! the [`Store`] ([`Buffer::from_store`]). The semantics of every op are those of the host
//! twins in [`ep_kernels`].
//!
//! Feature `nvshmem` (implies `cuda`): `init_nvshmem(&store, name, device)` starts NVSHMEM on
//! every rank of the store, bootstrapped by a unique id that rank 0 makes and the store
//! carries; every wait is bounded by the store's timeout and a missing rank is named (module
//! `transport::nvshmem`; the bindings are re-exported as `nvshmem_sys`).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use ep_runtime::{Buffer, BufferConfig, CombineArgs, DispatchArgs};
//!
//! # fn main() -> ep_runtime::Result<()> {
//! let buffers = Buffer::local_group(2, 2, BufferConfig::default())?;
//! let handles: Vec<_> = buffers
//!     .into_iter()
//!     .map(|buf| {
//!         std::thread::spawn(move || -> ep_runtime::Result<Tensor> {
//!             let x = Tensor::ones((3, 8), candle_core::DType::F32, &Device::Cpu)?;
//!             // token t goes to expert t (of 4: two per rank) and nowhere else
//!             let idx = Tensor::new(&[[0i64, -1], [1, -1], [2, -1]], &Device::Cpu)?;
//!             let w = Tensor::ones((3, 2), candle_core::DType::F32, &Device::Cpu)?;
//!             let out = buf.dispatch(&DispatchArgs::new(&x).topk(&idx, &w).num_experts(4))?;
//!             let back = buf.combine(&CombineArgs::new(&out.recv_x, &out.handle))?;
//!             Ok(back.combined_x)
//!         })
//!     })
//!     .collect();
//! for h in handles {
//!     let y = h.join().unwrap()?;
//!     assert_eq!(y.sum_all()?.to_scalar::<f32>()?, 24.0);
//! }
//! # Ok(())
//! # }
//! ```

mod backend;
pub mod bootstrap;
mod buffer;
mod buffer_bytes;
pub mod cast;
mod codec;
pub mod config;
#[cfg(feature = "cuda")]
mod cuda;
pub mod error;
pub mod event;
mod group;
mod host;
pub mod layout;
pub mod low_latency;
mod membership;
pub mod normal;
pub mod topology;
pub mod transport;

pub use bootstrap::{Store, StoreConfig};
pub use buffer::Buffer;
pub use buffer_bytes::BufferBytes;
pub use config::{BufferConfig, Config, InternodeSizing, LowLatencySizing, NvlTransfer};
#[cfg(feature = "cuda")]
pub use cuda::graph;
#[cfg(feature = "cuda")]
pub use cuda::tensor as device_tensor;
pub use ep_kernels::low_latency::Reduction;
pub use error::{Error, Result};
pub use event::EventOverlap;
pub use layout::DispatchLayout;
pub use low_latency::{
    LowLatencyCombineArgs, LowLatencyCombineOutput, LowLatencyDispatchArgs,
    LowLatencyDispatchOutput, LowLatencyHandle, RecvHook,
};
pub use membership::{Agreement, Membership};
pub use normal::{CombineArgs, CombineOutput, DispatchArgs, DispatchOutput, Handle};
pub use topology::Topology;
#[cfg(feature = "nvshmem")]
pub use transport::init_nvshmem;
pub use transport::{LocalTransport, TcpTransport, Transport};

/// The project's NVSHMEM bindings (feature `nvshmem`), for the [`init_nvshmem`] handle
/// (`Nvshmem`) and its symmetric buffers.
#[cfg(feature = "nvshmem")]
pub use nvshmem_sys;
