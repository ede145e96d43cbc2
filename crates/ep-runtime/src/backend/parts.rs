//! What crosses the seam in normal mode and for the layout: the checked inputs an op module
//! hands a backend, and the raw parts a backend hands back, which the op module assembles into
//! the public outputs ([`crate::layout::DispatchLayout`], [`crate::normal::DispatchOutput`],
//! [`crate::normal::Handle`], [`crate::normal::CombineOutput`]).
//!
//! Backends import these types and nothing of the op modules.

use crate::event::EventOverlap;
use candle_core::Tensor;
use ep_kernels::layout::{self as kl, ExpertPlacement};

/// The counts of a dispatch layout, as a backend computed them.
pub(crate) struct LayoutParts {
    /// `[R]` i32.
    pub num_tokens_per_rank: Tensor,
    /// `[R / P]` i32; `None` on a single node.
    pub num_tokens_per_node: Option<Tensor>,
    /// `[E]` i32.
    pub num_tokens_per_expert: Tensor,
    /// `[T, R]` u8.
    pub is_token_in_rank: Tensor,
    /// Completion of the computation.
    pub event: EventOverlap,
    /// The host twin's layout (host backend only).
    pub host: Option<kl::DispatchLayout>,
}

/// A given layout, as a fresh dispatch reads it.
// Fields that only CUDA buffers read (the host backend orders its ops on the calling thread).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct LayoutInput<'a> {
    /// `[R]` i32.
    pub num_tokens_per_rank: &'a Tensor,
    /// `[R / P]` i32; `None` on a single node (read by buffers across nodes only).
    #[cfg_attr(not(feature = "nvshmem"), allow(dead_code))]
    pub num_tokens_per_node: Option<&'a Tensor>,
    /// `[E]` i32.
    pub num_tokens_per_expert: &'a Tensor,
    /// `[T, R]` u8.
    pub is_token_in_rank: &'a Tensor,
    /// The host twin's layout, when a CPU buffer made it.
    pub host: Option<&'a kl::DispatchLayout>,
    /// Tokens it was computed for.
    pub num_tokens: usize,
}

/// A fresh (non-cached) normal-mode dispatch whose arguments the op module checked.
// Fields that only CUDA buffers read (the host backend orders its ops on the calling thread).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct FreshDispatch<'a> {
    /// `[T, H]` rows: bf16, f16, f32, or f8e4m3 with `x_scales`.
    pub x: &'a Tensor,
    /// `[T, H / 128]` f32, when `x` is fp8.
    pub x_scales: Option<&'a Tensor>,
    /// `[T, K]` i64 routing sent along (backends check it: CUDA ones never read it back).
    pub topk_idx: Option<&'a Tensor>,
    /// `[T, K]` f32 weights sent along.
    pub topk_weights: Option<&'a Tensor>,
    /// The caller's layout (computed from `topk_idx` when `None`).
    pub layout: Option<LayoutInput<'a>>,
    /// Round each local expert's count up to a multiple of this.
    pub expert_alignment: usize,
    /// Worst-case rows (0 = exact outputs).
    pub num_worst_tokens: usize,
    /// Work to order before the op.
    pub previous_event: Option<&'a EventOverlap>,
    /// Return before the op completes.
    pub async_finish: bool,
    pub num_tokens: usize,
    pub hidden: usize,
    pub fp8: bool,
    pub num_experts: usize,
    pub placement: ExpertPlacement,
}

/// A cached dispatch along `handle` whose arguments the op module checked.
// Fields that only CUDA buffers read (the host backend orders its ops on the calling thread).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct CachedDispatch<'a> {
    pub x: &'a Tensor,
    pub x_scales: Option<&'a Tensor>,
    pub previous_event: Option<&'a EventOverlap>,
    pub async_finish: bool,
    pub hidden: usize,
    pub fp8: bool,
    pub handle: &'a HandleRecord,
}

/// A combine along `handle` whose arguments the op module checked.
// Fields that only CUDA buffers read (the host backend orders its ops on the calling thread).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct CombineInput<'a> {
    /// `[N, H]` rows to send back.
    pub x: &'a Tensor,
    /// `[N, K]` f32 weights to sum along.
    pub topk_weights: Option<&'a Tensor>,
    /// `[T, H]` rows the sums start from.
    pub bias: Option<&'a Tensor>,
    pub previous_event: Option<&'a EventOverlap>,
    pub async_finish: bool,
    pub hidden: usize,
    /// `K` of `topk_weights`, when given.
    pub num_topk: Option<usize>,
    pub handle: &'a HandleRecord,
}

/// What a fresh dispatch returns besides its handle's record.
pub(crate) struct DispatchParts {
    pub recv_x: Tensor,
    pub recv_x_scales: Option<Tensor>,
    pub recv_topk_idx: Option<Tensor>,
    pub recv_topk_weights: Option<Tensor>,
    pub num_recv_tokens_per_expert: Vec<usize>,
    pub handle: HandleRecord,
    pub event: EventOverlap,
}

/// What a cached dispatch returns.
pub(crate) struct CachedParts {
    pub recv_x: Tensor,
    pub recv_x_scales: Option<Tensor>,
    pub event: EventOverlap,
}

/// What a combine returns.
pub(crate) struct CombineParts {
    pub combined_x: Tensor,
    pub combined_topk_weights: Option<Tensor>,
    pub event: EventOverlap,
}

/// Everything combine and cached dispatch need to retrace a dispatch, as the backend that ran
/// it left it (the public [`crate::normal::Handle`] adds the buffer it belongs to).
#[derive(Debug)]
pub(crate) struct HandleRecord {
    pub num_tokens: usize,
    pub num_recv_tokens: usize,
    /// `[R, R]` inclusive prefix over sources (host backend; empty on CUDA buffers, which keep
    /// it on the device).
    pub rank_prefix_matrix: Vec<i32>,
    /// `[T, R]` (host backend; empty on CUDA buffers).
    pub is_token_in_rank: Vec<bool>,
    pub tensors: HandleTensors,
    /// What the CUDA kernels need besides `tensors` (records made by CUDA buffers).
    #[cfg(feature = "cuda")]
    pub cuda: Option<crate::cuda::handle_data::CudaHandleData>,
}

/// The tensors of a handle, on the buffer's device.
#[derive(Debug)]
pub(crate) struct HandleTensors {
    pub rank_prefix_matrix: Tensor,
    pub channel_prefix_matrix: Tensor,
    pub recv_src_idx: Tensor,
    pub is_token_in_rank: Tensor,
    pub send_head: Tensor,
}

impl HandleRecord {
    /// The CUDA side of a record made by a CUDA buffer.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_data(
        &self,
    ) -> crate::error::Result<&crate::cuda::handle_data::CudaHandleData> {
        self.cuda.as_ref().ok_or_else(|| {
            crate::error::Error::HandleMismatch(
                "the handle was made by a CPU buffer; a CUDA buffer needs its own handle".into(),
            )
        })
    }

    /// Rows received from each source rank, `[R]`, for rank `me` as destination (host records).
    pub(crate) fn recv_counts_from(&self, num_ranks: usize, me: usize) -> Vec<usize> {
        recv_counts(&self.rank_prefix_matrix, num_ranks, me)
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
