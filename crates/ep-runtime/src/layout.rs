//! `get_dispatch_layout`: where each token goes, computed locally.

use crate::backend::{Backend, LayoutInput, LayoutParts};
use crate::buffer::{check_dtype, check_shape, Buffer};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use crate::host::layout as host_layout;
use candle_core::{DType, Tensor};
use ep_kernels::layout::{self as kl, ExpertPlacement};

/// Token counts per destination and the token-to-rank map, from `topk_idx`.
#[derive(Debug, Clone)]
pub struct DispatchLayout {
    /// `[R]` i32: tokens sent to each rank.
    pub num_tokens_per_rank: Tensor,
    /// `[R / P]` i32: tokens sent to each node; `None` on a single node.
    pub num_tokens_per_node: Option<Tensor>,
    /// `[E]` i32: (token, expert) pairs per expert.
    pub num_tokens_per_expert: Tensor,
    /// `[T, R]` u8 (0/1): whether token `t` goes to rank `r`.
    pub is_token_in_rank: Tensor,
    /// Completion of the layout computation.
    pub event: EventOverlap,
    /// The host twin's layout (host backend only: CUDA buffers never read the routing back).
    pub(crate) host: Option<kl::DispatchLayout>,
    pub(crate) num_experts: usize,
    pub(crate) num_tokens: usize,
}

impl DispatchLayout {
    /// Number of routed experts the layout was computed for.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Number of tokens the layout was computed for.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
}

impl DispatchLayout {
    /// The layout of `num_tokens` tokens for `num_experts` experts from a backend's parts.
    fn from_parts(p: LayoutParts, num_experts: usize, num_tokens: usize) -> Self {
        Self {
            num_tokens_per_rank: p.num_tokens_per_rank,
            num_tokens_per_node: p.num_tokens_per_node,
            num_tokens_per_expert: p.num_tokens_per_expert,
            is_token_in_rank: p.is_token_in_rank,
            event: p.event,
            host: p.host,
            num_experts,
            num_tokens,
        }
    }

    /// The layout as a fresh dispatch reads it.
    pub(crate) fn input(&self) -> LayoutInput<'_> {
        LayoutInput {
            num_tokens_per_rank: &self.num_tokens_per_rank,
            num_tokens_per_node: self.num_tokens_per_node.as_ref(),
            num_tokens_per_expert: &self.num_tokens_per_expert,
            is_token_in_rank: &self.is_token_in_rank,
            host: self.host.as_ref(),
            num_tokens: self.num_tokens,
        }
    }
}

impl Buffer {
    /// The expert placement for `num_experts` experts on this group.
    pub(crate) fn placement(&self, num_experts: usize) -> Result<ExpertPlacement> {
        Ok(ExpertPlacement::new(
            num_experts,
            self.topology.num_ranks,
            self.topology.gpus_per_node,
        )?)
    }

    /// Computes the dispatch layout of `topk_idx: [T, K]` (i64, `-1` = no expert) for
    /// `num_experts` routed experts spread evenly over the ranks. No communication.
    pub fn get_dispatch_layout(
        &self,
        topk_idx: &Tensor,
        num_experts: usize,
    ) -> Result<DispatchLayout> {
        self.check_device("topk_idx", topk_idx)?;
        if num_experts % self.topology.num_ranks != 0 || num_experts == 0 {
            return Err(Error::invalid(
                "num_experts",
                num_experts,
                format!(
                    "must be a positive multiple of num_ranks = {}",
                    self.topology.num_ranks
                ),
            ));
        }
        let placement = self.placement(num_experts)?;
        check_shape("topk_idx", topk_idx, &[None, None])?;
        check_dtype("topk_idx", topk_idx, &[DType::I64], "i64")?;
        let t = topk_idx.dims2()?.0;
        let parts = match &self.backend {
            Backend::Host => host_layout::dispatch_layout(topk_idx, &placement, &self.device)?,
            // CUDA buffers: the layout kernel reads the routing on the device (entries outside
            // [0, num_experts) other than -1 are skipped there); nothing comes back to the host.
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                let k = topk_idx.dims2()?.1;
                c.get_dispatch_layout(topk_idx, k, &placement)?
            }
        };
        Ok(DispatchLayout::from_parts(parts, num_experts, t))
    }
}
