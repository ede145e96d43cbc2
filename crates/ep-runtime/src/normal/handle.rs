//! The dispatch handle: everything combine and cached dispatch need to retrace a dispatch.

use crate::backend::HandleRecord;
use candle_core::Tensor;
use std::sync::Arc;

/// The record of one normal-mode dispatch, like DeepEP's handle tuple but named.
///
/// Pass it to [`Buffer::combine`](crate::Buffer::combine) to send rows back, or to
/// [`Buffer::dispatch`](crate::Buffer::dispatch) (cached mode) to dispatch other data along
/// the same routing without a count exchange. A handle only works with the buffer that made
/// it.
#[derive(Debug, Clone)]
pub struct Handle {
    /// The buffer that made it.
    pub(crate) buffer_id: u64,
    pub(crate) inner: Arc<HandleRecord>,
}

impl Handle {
    /// Tokens this rank dispatched.
    pub fn num_tokens(&self) -> usize {
        self.inner.num_tokens
    }

    /// Tokens this rank received (rows of `recv_x`, and of combine's input).
    pub fn num_recv_tokens(&self) -> usize {
        self.inner.num_recv_tokens
    }

    /// `[R, R]` i32: entry `(i, j)` = tokens sent to rank `j` by ranks `0..=i`.
    pub fn rank_prefix_matrix(&self) -> &Tensor {
        &self.inner.tensors.rank_prefix_matrix
    }

    /// `[R, C]` i32: tokens this rank sends to each destination from channels `0..=c`.
    pub fn channel_prefix_matrix(&self) -> &Tensor {
        &self.inner.tensors.channel_prefix_matrix
    }

    /// `[N]` i32: the source token index of each received token.
    pub fn recv_src_idx(&self) -> &Tensor {
        &self.inner.tensors.recv_src_idx
    }

    /// `[T, R]` u8: whether each token went to each rank.
    pub fn is_token_in_rank(&self) -> &Tensor {
        &self.inner.tensors.is_token_in_rank
    }

    /// `[T, R]` i32: the row each token took in each destination's `recv_x` (`-1`: not sent).
    ///
    /// On CUDA buffers: the intranode kernel's send head instead, the token's index among the
    /// tokens of its channel sent to that destination (`-1`: not sent).
    pub fn send_head(&self) -> &Tensor {
        &self.inner.tensors.send_head
    }

    /// The handle of `record`, made by buffer `buffer_id`.
    pub(crate) fn new(buffer_id: u64, record: HandleRecord) -> Self {
        Self {
            buffer_id,
            inner: Arc::new(record),
        }
    }
}
