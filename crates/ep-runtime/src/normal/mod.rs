//! Normal (high-throughput) mode: ask, then send.
//!
//! [`Buffer::dispatch`](crate::Buffer::dispatch) first exchanges the layout counts (the
//! notify step), so every receiver knows exactly how many tokens each source sends, then
//! moves the tokens into exactly-sized outputs ordered by source rank, then token order.
//! [`Buffer::combine`](crate::Buffer::combine) sends rows back along the same path, using
//! the [`Handle`] of the dispatch, and sums them on the tokens' home ranks.
//!
//! Masked ranks ([`Buffer::active_ranks`](crate::Buffer::active_ranks)) take no part: on the
//! host backend no token goes to them (their experts contribute zero, as in low-latency mode)
//! and nothing is awaited from them; an op along a handle that exchanged rows with a rank
//! masked since fails with [`Error::RanksMasked`](crate::Error::RanksMasked). CUDA buffers
//! refuse normal mode while a rank is masked.
//!
//! `dispatch` and `combine` hold the public ops and their argument checks; each op then
//! matches on the buffer's backend once (the host backend, `crate::host`, moves the payloads
//! through the transport; CUDA buffers run the NVLink kernels of `crate::cuda`) and assembles
//! its outputs from the raw parts the backend returns.

mod combine;
mod dispatch;
pub(crate) mod handle;

pub use combine::{CombineArgs, CombineOutput};
pub use dispatch::{DispatchArgs, DispatchOutput};
pub use handle::Handle;
