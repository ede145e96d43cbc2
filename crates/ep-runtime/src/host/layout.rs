//! The dispatch layout on the host backend: the routing is read back and the host twin of
//! `ep_kernels::layout` computes the counts.

use crate::backend::LayoutParts;
use crate::buffer::{check_dtype, check_shape};
use crate::error::Result;
use crate::event::EventOverlap;
use candle_core::{DType, Device, Tensor};
use ep_kernels::layout::{self as kl, ExpertPlacement};

/// Host copy of a `[T, K]` i64 `topk_idx`, validated against the placement's experts:
/// `(ids, T, K)`.
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

/// The layout of `topk_idx` on `placement`, as tensors of `device` and the host twin's record.
pub(crate) fn dispatch_layout(
    topk_idx: &Tensor,
    placement: &ExpertPlacement,
    device: &Device,
) -> Result<LayoutParts> {
    let (idx, t, k) = read_topk_idx(topk_idx, placement)?;
    let host = kl::get_dispatch_layout(&idx, t, k, placement)?;
    let r = placement.num_ranks;
    let nodes = placement.num_nodes();
    let in_rank: Vec<u8> = host.is_token_in_rank.iter().map(|&b| b as u8).collect();
    Ok(LayoutParts {
        num_tokens_per_rank: Tensor::from_slice(&host.num_tokens_per_rank, r, device)?,
        num_tokens_per_node: if nodes > 1 {
            Some(Tensor::from_slice(
                &host.num_tokens_per_node,
                nodes,
                device,
            )?)
        } else {
            None
        },
        num_tokens_per_expert: Tensor::from_slice(
            &host.num_tokens_per_expert,
            placement.num_experts,
            device,
        )?,
        is_token_in_rank: Tensor::from_vec(in_rank, (t, r), device)?,
        event: EventOverlap::complete(),
        host: Some(host),
    })
}
