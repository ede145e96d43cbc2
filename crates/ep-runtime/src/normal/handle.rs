//! The dispatch handle: everything combine and cached dispatch need to retrace a dispatch.

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
    pub(crate) inner: Arc<HandleInner>,
}

#[derive(Debug)]
pub(crate) struct HandleInner {
    pub buffer_id: u64,
    pub num_ranks: usize,
    pub num_tokens: usize,
    pub num_recv_tokens: usize,
    /// `[R, R]` inclusive prefix over sources (row = source, column = destination).
    pub rank_prefix_matrix: Vec<i32>,
    /// `[T, R]`.
    pub is_token_in_rank: Vec<bool>,
    pub tensors: HandleTensors,
    /// What the CUDA kernels need besides `tensors` (handles made by CUDA buffers). Those
    /// handles leave `rank_prefix_matrix` and `is_token_in_rank` above empty (host-only).
    #[cfg(feature = "cuda")]
    pub cuda: Option<crate::cuda::handle_data::CudaHandleData>,
}

#[derive(Debug)]
pub(crate) struct HandleTensors {
    pub rank_prefix_matrix: Tensor,
    pub channel_prefix_matrix: Tensor,
    pub recv_src_idx: Tensor,
    pub is_token_in_rank: Tensor,
    pub send_head: Tensor,
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

    /// The CUDA side of a handle made by a CUDA buffer.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_data(
        &self,
    ) -> crate::error::Result<&crate::cuda::handle_data::CudaHandleData> {
        self.inner.cuda.as_ref().ok_or_else(|| {
            crate::error::Error::HandleMismatch(
                "the handle was made by a CPU buffer; a CUDA buffer needs its own handle".into(),
            )
        })
    }

    /// Rows received from each source rank, `[R]`, for this rank as destination.
    pub(crate) fn recv_counts_from(&self, me: usize) -> Vec<usize> {
        recv_counts(&self.inner.rank_prefix_matrix, self.inner.num_ranks, me)
    }
}

/// Rows rank `me` receives from each source, `[R]`, from the inclusive `[R, R]` prefix matrix.
pub(crate) fn recv_counts(rank_prefix_matrix: &[i32], num_ranks: usize, me: usize) -> Vec<usize> {
    let (p, r) = (rank_prefix_matrix, num_ranks);
    (0..r)
        .map(|s| {
            let hi = p[s * r + me];
            let lo = if s == 0 { 0 } else { p[(s - 1) * r + me] };
            (hi - lo) as usize
        })
        .collect()
}
