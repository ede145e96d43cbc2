//! What crosses the seam in low-latency mode: the checked shape of a dispatch, the record a
//! dispatch leaves for its combine, and the raw parts of both ops' outputs, which
//! `crate::low_latency` assembles into the public ones.

use crate::event::EventOverlap;
use candle_core::Tensor;
use ep_kernels::layout::ExpertPlacement;
use ep_kernels::low_latency::RecvLayout;
#[cfg(feature = "cuda")]
use std::sync::Arc;

/// A low-latency dispatch whose arguments the op module checked.
#[derive(Debug, Clone)]
pub(crate) struct LlDispatchShape {
    pub placement: ExpertPlacement,
    pub num_tokens: usize,
    pub num_topk: usize,
    pub hidden: usize,
    /// Slots per (expert, source).
    pub max_tokens: usize,
    pub fp8: bool,
    pub ue8m0: bool,
    /// The dispatch carries the top-k weights (for a per-rank combine).
    pub carries_weights: bool,
}

/// One source token's selections of this rank's experts (host backend, per-rank combine).
#[derive(Debug, Clone)]
pub(crate) struct RankToken {
    /// The token's index at its source.
    pub token: usize,
    /// `(k, row of recv_x as [L * R * M], weight)`, in k order.
    pub entries: Vec<(usize, usize, f32)>,
}

/// Everything a low-latency combine needs of its dispatch, as the backend that ran it left it
/// (the public [`crate::LowLatencyHandle`] adds the buffer it belongs to).
#[derive(Debug)]
pub(crate) struct LlHandleRecord {
    pub placement: ExpertPlacement,
    pub num_tokens: usize,
    pub num_topk: usize,
    pub hidden: usize,
    pub max_tokens: usize,
    /// This rank's routing, `[T, K]` (host backend only; empty for CUDA buffers).
    pub topk_idx: Vec<i64>,
    /// Slot of each `(t, k)` in its expert's region for this source (host backend only).
    pub slots: Vec<i32>,
    /// `[E]` tokens this rank sent to each expert (host backend only).
    pub send_counts: Vec<i32>,
    /// Where each source's tokens sit in `recv_x` (host backend only).
    pub layout: Option<RecvLayout>,
    /// Whether the dispatch carried the top-k weights (a per-rank combine can answer it).
    pub carries_weights: bool,
    /// Host backend, dispatches that carried the weights: per source, its tokens with a
    /// selection here in token order, each with its selections here in k order.
    pub rank_entries: Vec<Vec<RankToken>>,
    pub src_info: Tensor,
    /// `[L, R]` packed ranges (host backend; CUDA handles compute it on request).
    pub layout_range: Option<Tensor>,
    /// The receive buffers the CUDA combine reads (records made by CUDA buffers).
    #[cfg(feature = "cuda")]
    pub cuda: Option<Arc<crate::cuda::CudaLlDispatchData>>,
}

impl LlHandleRecord {
    /// The record of a dispatch of `shape` that kept no host routing (CUDA buffers).
    #[cfg(feature = "cuda")]
    pub(crate) fn device_only(
        shape: LlDispatchShape,
        src_info: Tensor,
        cuda: Arc<crate::cuda::CudaLlDispatchData>,
    ) -> Self {
        Self {
            placement: shape.placement,
            num_tokens: shape.num_tokens,
            num_topk: shape.num_topk,
            hidden: shape.hidden,
            max_tokens: shape.max_tokens,
            topk_idx: Vec::new(),
            slots: Vec::new(),
            send_counts: Vec::new(),
            layout: None,
            carries_weights: shape.carries_weights,
            rank_entries: Vec::new(),
            src_info,
            layout_range: None,
            cuda: Some(cuda),
        }
    }
}

/// What a low-latency dispatch returns besides its record.
pub(crate) struct LlDispatchParts {
    pub recv_x: Tensor,
    pub recv_x_scales: Option<Tensor>,
    pub recv_count: Tensor,
    pub handle: LlHandleRecord,
    pub event: EventOverlap,
}

/// What a low-latency combine returns.
pub(crate) struct LlCombineParts {
    pub combined_x: Tensor,
    pub event: EventOverlap,
}
