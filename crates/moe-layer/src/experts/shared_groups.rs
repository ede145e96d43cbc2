//! The shared experts as extra groups of the low-latency grouped GEMMs.
//!
//! In decode the shared experts read as many weight bytes as one or two routed experts but run
//! as separate, small GEMMs that use a fraction of the SMs. Here the shared MLP of inner width
//! `X * I` is split into `X` blocks of the routed experts' width `I` (SwiGLU acts on each inner
//! column alone and `down_proj` sums over them, so the blocks' outputs add up to the MLP's) and
//! the blocks run as groups `L..L + X` of the routed experts' masked grouped GEMMs, over the
//! layer's own tokens (`ExtraGroups`): one launch reads every weight in one wave of tiles.

use candle_core::{DType, Tensor};
use ep_kernels::gemm::MAX_GROUPS;

use super::mlp::{GateUpLayout, Mlp};
use super::shard::Experts;
use crate::error::{Error, Result};

/// A shared MLP as blocks of the routed experts' width.
#[derive(Debug)]
pub(crate) struct SharedGroups {
    /// `[X, 2I, H]`, blocked gate_up layout: block `j` holds inner columns `jI..(j+1)I` (a view
    /// of the shared MLP's blocked `gate_up`: with `I` a multiple of the layout's block, those
    /// columns' rows are rows `2jI..2(j+1)I`).
    gate_up: Tensor,
    /// `[X, H, I]`: block `j`'s columns `jI..(j+1)I` of `down_proj`.
    down: Tensor,
}

impl SharedGroups {
    /// Whether `shared` can join `experts`' grouped GEMMs: bf16 experts on grouped GEMMs, the
    /// same dtype and device, an inner width that is a multiple of the experts', not too many groups.
    pub(crate) fn eligible(shared: &Mlp, experts: &Experts) -> bool {
        let (h, i) = (experts.hidden_size(), experts.intermediate_size());
        let i_s = shared.intermediate_size();
        experts.uses_grouped_gemm()
            && !experts.is_fp8()
            && shared.dtype() == DType::BF16
            && shared.device().same_device(experts.device())
            && shared.hidden_size() == h
            && i_s % i == 0
            && experts.num_local() + i_s / i <= MAX_GROUPS
    }

    /// The blocks of `shared` (eligible, its `gate_up` in [`GateUpLayout::Blocked`]) for
    /// `experts`' grouped GEMMs.
    pub(crate) fn new(shared: &Mlp, experts: &Experts) -> Result<Self> {
        debug_assert!(Self::eligible(shared, experts));
        if shared.gate_up_layout() != GateUpLayout::Blocked {
            return Err(Error::invalid(
                "shared",
                format!("{:?} gate_up", shared.gate_up_layout()),
                "the shared experts' blocks need the blocked gate_up layout",
            ));
        }
        let (h, i) = (experts.hidden_size(), experts.intermediate_size());
        let x = shared.intermediate_size() / i;
        let gate_up = shared.gate_up().reshape((x, 2 * i, h))?;
        let down = if x == 1 {
            shared.down_proj().unsqueeze(0)?
        } else {
            let blocks = (0..x)
                .map(|j| shared.down_proj().narrow(1, j * i, i))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::stack(&blocks, 0)?.contiguous()?
        };
        Ok(Self { gate_up, down })
    }

    /// Number of blocks `X`.
    pub(crate) fn blocks(&self) -> usize {
        self.gate_up.dims()[0]
    }

    /// `[X, 2I, H]`.
    pub(crate) fn gate_up(&self) -> &Tensor {
        &self.gate_up
    }

    /// `[X, H, I]`.
    pub(crate) fn down(&self) -> &Tensor {
        &self.down
    }
}
