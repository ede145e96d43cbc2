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

use crate::error::Result;
use crate::experts::Experts;
use crate::mlp::Mlp;

/// A shared MLP restacked into blocks of the routed experts' width.
#[derive(Debug)]
pub(crate) struct SharedGroups {
    /// `[X, 2I, H]`: block `j`'s gate rows `jI..(j+1)I`, then its up rows.
    gate_up: Tensor,
    /// `[X, H, I]`: block `j`'s columns `jI..(j+1)I` of `down_proj`.
    down: Tensor,
}

impl SharedGroups {
    /// The blocks of `shared` for `experts`' grouped GEMMs, or `None` when they cannot join them
    /// (experts not on grouped GEMMs, another dtype or device, an inner width that is not a
    /// multiple of the experts', or too many groups).
    pub(crate) fn new(shared: &Mlp, experts: &Experts) -> Result<Option<Self>> {
        let (h, i) = (experts.hidden_size(), experts.intermediate_size());
        let i_s = shared.intermediate_size();
        let eligible = experts.uses_grouped_gemm()
            && shared.dtype() == DType::BF16
            && shared.device().same_device(experts.device())
            && shared.hidden_size() == h
            && i_s % i == 0
            && experts.num_local() + i_s / i <= MAX_GROUPS;
        if !eligible {
            return Ok(None);
        }
        let x = i_s / i;
        if x == 1 {
            // One block: the MLP's own stacked weights, as views (no copy).
            return Ok(Some(Self {
                gate_up: shared.gate_up().unsqueeze(0)?,
                down: shared.down_proj().unsqueeze(0)?,
            }));
        }
        let mut gate_up = Vec::with_capacity(x);
        let mut down = Vec::with_capacity(x);
        for j in 0..x {
            gate_up.push(Tensor::cat(
                &[
                    shared.gate_proj().narrow(0, j * i, i)?,
                    shared.up_proj().narrow(0, j * i, i)?,
                ],
                0,
            )?);
            down.push(shared.down_proj().narrow(1, j * i, i)?);
        }
        Ok(Some(Self {
            gate_up: Tensor::stack(&gate_up, 0)?.contiguous()?,
            down: Tensor::stack(&down, 0)?.contiguous()?,
        }))
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
