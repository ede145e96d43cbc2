//! Launchers of the internode normal-mode kernels (feature `nvshmem`); host twins:
//! [`super::host`]. One op on every rank, each on its own stream:
//!
//! 1. fresh dispatch: [`notify_cuda`] (barrier and count exchange), [`dispatch_send_cuda`];
//!    the host polls the receive counts ([`InternodeBuffer::recv_counts`]), allocates the
//!    outputs, then [`dispatch_recv_cuda`] with [`DispatchPlan::Fresh`];
//! 2. cached dispatch: [`notify_cuda`] without counts, [`dispatch_send_cuda`],
//!    [`dispatch_recv_cuda`] with [`DispatchPlan::Cached`];
//! 3. combine: [`combine_cuda`] (barrier, rows to the forwarders, node sums, home sums).
//!
//! After each op the host checks [`InternodeBuffer::check_error`]: a device wait that timed
//! out names the rank it waited for ([`Error::PeerTimeout`](crate::Error::PeerTimeout)).

mod buffer;
mod combine;
mod dispatch;
mod notify;

pub use crate::notify::RecvCounts;
pub use buffer::{InternodeBuffer, DEFAULT_TIMEOUT};
pub use combine::{combine_cuda, InternodeCombineArgs};
pub use dispatch::{
    dispatch_recv_cuda, dispatch_send_cuda, DispatchPlan, InternodeRecvArgs, InternodeSendArgs,
};
pub use notify::{notify_cuda, NotifyCounts};
