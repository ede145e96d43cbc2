//! The expert groups of normal mode's pipeline
//! ([`MoeLayerOptions::expert_groups`](crate::MoeLayerOptions::expert_groups); the pipeline
//! itself is `MoeLayer::routed_normal_expert_groups`, in `normal.rs`).
//!
//! Each rank's `E / R` local experts are split into `n` runs of consecutive local slots, the
//! same split on every rank. Group `g`'s step is the normal-mode step of the same tokens with
//! every routing entry outside the group set to -1: its dispatch sends a token to a rank only
//! if one of the token's experts there is in the group, its grouped GEMMs read only the group's
//! weights, and its combine returns each token's sum over the group's experts. The token's
//! output is the sum of the groups' combined outputs. Streams:
//!
//! ```text
//! communication: dispatch 0 | dispatch 1 | combine 0 | dispatch 2 | combine 1 | ... | combine n-1
//! compute:       shared     | experts 0             | experts 1             | ... | sum
//! ```
//!
//! Unlike the two-batch overlap (which splits the tokens), no weight is read twice and every
//! grouped GEMM keeps all of its rows per expert; the price is bytes on the wire, since a token
//! whose experts on one rank fall in two groups travels there twice.

use crate::error::Result;
use candle_core::{Device, Tensor};

/// The group of global expert `expert` when each rank's `per_rank` local experts are split into
/// `groups` runs of consecutive local slots whose sizes differ by at most one.
pub(crate) fn group_of(expert: usize, per_rank: usize, groups: usize) -> usize {
    (expert % per_rank) * groups / per_rank
}

/// The routing masks of the groups, as tables on the layer's device.
#[derive(Debug)]
pub(crate) struct ExpertGroups {
    /// Per group, `[E]` u8: 1 where the global expert belongs to the group.
    keep: Vec<Tensor>,
    /// The i64 scalar -1 (a dropped routing entry).
    dropped: Tensor,
}

impl ExpertGroups {
    /// `groups` groups of the `num_experts / num_ranks` local experts of every rank.
    pub(crate) fn new(
        groups: usize,
        num_experts: usize,
        num_ranks: usize,
        dev: &Device,
    ) -> Result<Self> {
        let per_rank = num_experts / num_ranks;
        let keep = (0..groups)
            .map(|g| {
                let table: Vec<u8> = (0..num_experts)
                    .map(|e| u8::from(group_of(e, per_rank, groups) == g))
                    .collect();
                Tensor::from_vec(table, num_experts, dev)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            keep,
            dropped: Tensor::new(-1i64, dev)?,
        })
    }

    /// How many groups there are.
    pub(crate) fn len(&self) -> usize {
        self.keep.len()
    }

    /// `idx` (`[T, K]` i64, experts in `0..E` as the router gives them) with every entry
    /// outside group `g` set to -1; on the device, no host synchronisation.
    pub(crate) fn routing(&self, idx: &Tensor, g: usize) -> Result<Tensor> {
        if idx.elem_count() == 0 {
            return Ok(idx.clone());
        }
        let keep = self.keep[g]
            .index_select(&idx.flatten_all()?, 0)?
            .reshape(idx.shape())?;
        Ok(keep.where_cond(idx, &self.dropped.broadcast_as(idx.shape())?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn groups_split_local_slots_evenly_and_alike_on_every_rank() {
        // 4 ranks of 6 experts in 4 groups: local slots 0..6 -> groups 0 0 1 2 2 3.
        let want = [0, 0, 1, 2, 2, 3];
        for e in 0..24 {
            assert_eq!(group_of(e, 6, 4), want[e % 6], "expert {e}");
        }
        // One group per local expert.
        for e in 0..16 {
            assert_eq!(group_of(e, 4, 4), e % 4);
        }
    }

    #[test]
    fn routing_keeps_the_group_and_drops_the_rest() -> Result<()> {
        let dev = Device::Cpu;
        // 2 ranks x 4 experts, 2 groups: experts 0, 1, 4, 5 in group 0.
        let groups = ExpertGroups::new(2, 8, 2, &dev)?;
        let idx = Tensor::new(&[[0i64, 5, 2, 7], [3, 4, 1, 6]], &dev)?;
        let g0 = groups.routing(&idx, 0)?.to_vec2::<i64>()?;
        let g1 = groups.routing(&idx, 1)?.to_vec2::<i64>()?;
        assert_eq!(g0, vec![vec![0, 5, -1, -1], vec![-1, 4, 1, -1]]);
        assert_eq!(g1, vec![vec![-1, -1, 2, 7], vec![3, -1, -1, 6]]);
        let empty = Tensor::zeros((0, 4), DType::I64, &dev)?;
        assert_eq!(groups.routing(&empty, 1)?.dims(), &[0, 4]);
        Ok(())
    }
}
