//! `get_dispatch_layout`: where each token goes, computed locally.

use crate::backend::Backend;
use crate::buffer::{check_dtype, check_shape, Buffer};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
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

/// Host copy of a `[T, K]` i64 `topk_idx`, validated against `num_experts`.
pub(crate) fn read_topk_idx(
    topk_idx: &Tensor,
    placement: &ExpertPlacement,
) -> Result<(Vec<i64>, usize, usize)> {
    check_shape("topk_idx", topk_idx, &[None, None])?;
    check_dtype("topk_idx", topk_idx, &[DType::I64], "i64")?;
    let (t, k) = topk_idx.dims2()?;
    let idx = topk_idx.flatten_all()?.to_vec1::<i64>()?;
    placement.check_topk_idx(&idx)?;
    Ok((idx, t, k))
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
        match &self.backend {
            Backend::Host => self.dispatch_layout_host(topk_idx, num_experts, placement),
            // CUDA buffers: the layout kernel reads the routing on the device (entries outside
            // [0, num_experts) other than -1 are skipped there); nothing comes back to the host.
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                check_shape("topk_idx", topk_idx, &[None, None])?;
                check_dtype("topk_idx", topk_idx, &[DType::I64], "i64")?;
                let k = topk_idx.dims2()?.1;
                c.get_dispatch_layout(topk_idx, k, &placement)
            }
        }
    }

    /// The layout on the host backend (arguments checked): the routing is read back and the
    /// host twin computes the layout.
    fn dispatch_layout_host(
        &self,
        topk_idx: &Tensor,
        num_experts: usize,
        placement: ExpertPlacement,
    ) -> Result<DispatchLayout> {
        let (idx, t, k) = read_topk_idx(topk_idx, &placement)?;
        let host = kl::get_dispatch_layout(&idx, t, k, &placement)?;
        let dev = &self.device;
        let r = self.topology.num_ranks;
        let in_rank: Vec<u8> = host.is_token_in_rank.iter().map(|&b| b as u8).collect();
        Ok(DispatchLayout {
            num_tokens_per_rank: Tensor::from_slice(&host.num_tokens_per_rank, r, dev)?,
            num_tokens_per_node: if placement.num_nodes() > 1 {
                Some(Tensor::from_slice(
                    &host.num_tokens_per_node,
                    placement.num_nodes(),
                    dev,
                )?)
            } else {
                None
            },
            num_tokens_per_expert: Tensor::from_slice(
                &host.num_tokens_per_expert,
                num_experts,
                dev,
            )?,
            is_token_in_rank: Tensor::from_vec(in_rank, (t, r), dev)?,
            event: EventOverlap::complete(),
            host: Some(host),
            num_experts,
            num_tokens: t,
        })
    }
}
