//! Low-latency (decode) mode: send without asking.
//!
//! Every rank reserves, per (local expert, source rank), room for
//! `max_tokens_per_rank` tokens, so senders never ask how much a receiver will get: one
//! message per (token, expert), then a count per (expert, source). Received tokens are
//! packed per local expert into `recv_x: [L, R * M, H]`, sources in rank order, each
//! source's tokens in token order (see [`ep_kernels::low_latency`]). Combine sends each
//! expert output row straight back to its token's home rank, which computes
//! `sum_k w_k * y_k` in f32.
//!
//! A peer that does not answer within the buffer's timeout is **masked**: it is marked
//! inactive in [`Buffer::active_ranks`], its contribution is treated as zero, the op
//! completes on every other rank, and the op that noticed returns an error naming it.
//! Later ops skip masked ranks without waiting (that is also how masking on purpose, with
//! [`Buffer::mask_rank`], works) until [`Buffer::reset_active_ranks`].
//!
//! Both ops can be split into a send phase and a receive phase:
//! [`Buffer::low_latency_dispatch_send`] returns a [`RecvHook`] whose
//! [`RecvHook::recv`] finishes the op, so the caller can compute while tokens travel.

mod combine;
pub(crate) mod dispatch;

pub use combine::{LowLatencyCombineArgs, LowLatencyCombineOutput};
pub use dispatch::{LowLatencyDispatchArgs, LowLatencyDispatchOutput, LowLatencyHandle};

use crate::error::Result;

/// The receive phase of a low-latency op whose send phase has been issued.
///
/// Call [`RecvHook::recv`] exactly once, on every rank, in the same order relative to other
/// ops as the other ranks.
#[must_use = "the op is not finished until the hook is called"]
pub struct RecvHook<'b, T> {
    pub(crate) finish: Box<dyn FnOnce() -> Result<T> + 'b>,
}

impl<T> std::fmt::Debug for RecvHook<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecvHook")
    }
}

impl<T> RecvHook<'_, T> {
    /// Runs the receive phase and returns the op's outputs.
    pub fn recv(self) -> Result<T> {
        (self.finish)()
    }
}
