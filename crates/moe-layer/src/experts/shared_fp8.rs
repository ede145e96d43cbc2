//! The shared experts of an fp8 layer on its fp8 grouped GEMMs: the shared MLP of inner width
//! `X * I` kept as block-scaled e4m3 weights, split into `X` blocks of the routed experts'
//! width `I` (as `shared_groups` does for bf16: SwiGLU acts on each inner column
//! alone and `down_proj` sums over them). In a decode step the blocks join the routed experts'
//! masked GEMMs as extra groups over the layer's tokens (one launch reads every weight); alone
//! (normal mode, or beside a transfer) they run as a grouped GEMM of their own whose every
//! group reads the tokens.

use candle_core::{DType, Device, Tensor};

use ep_kernels::gemm::fp8::{FP8_BLOCK, FP8_GATE_UP_BLOCK};

use super::fp8_expert::{scale_blocks, Fp8Expert};
use super::shard::Experts;
use crate::error::{Error, Result};

/// A shared MLP's fp8 weights as blocks of the routed experts' width.
#[derive(Debug)]
pub(crate) struct SharedFp8 {
    /// `[X, 2I, H]` e4m3: block `j`'s gate rows `jI..(j+1)I` and its up rows in
    /// [`super::GateUpLayout::ScaleBlocks`] (as the routed experts').
    pub(crate) gate_up: Tensor,
    /// `[X, 2I / 128, ceil(H / 128)]`, in the weights' block order.
    pub(crate) gate_up_scale: Tensor,
    /// `[X, H, I]` e4m3: block `j`'s columns `jI..(j+1)I` of `down_proj`.
    pub(crate) down: Tensor,
    /// `[X, ceil(H / 128), I / 128]`.
    pub(crate) down_scale: Tensor,
}

impl SharedFp8 {
    /// The blocks of `shared` for `experts`' fp8 GEMMs, or `None` where they cannot join them
    /// (experts not fp8, an inner width that is not a multiple of the experts', other hidden
    /// size, too many groups).
    pub(crate) fn new(shared: &Fp8Expert, experts: &Experts) -> Result<Option<Self>> {
        let (h, i) = (experts.hidden_size(), experts.intermediate_size());
        let (i_s, h_s) = shared.gate.dims();
        let blocks = super::rules::shared_fp8_blocks(experts.num_local(), i, i_s);
        let Some(x) = blocks.filter(|_| experts.is_fp8() && h_s == h) else {
            return Ok(None);
        };
        let device = shared.gate.q().device().clone();
        // Split on the host (a load-time copy of one MLP): strided e4m3 copies stay off the
        // device.
        let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
        let (gate, up, down) = (
            cpu(shared.gate.q())?,
            cpu(shared.up.q())?,
            cpu(shared.down.q())?,
        );
        let (gs, us, ds) = (
            cpu(shared.gate.scale())?,
            cpu(shared.up.scale())?,
            cpu(shared.down.scale())?,
        );
        let sb = i / 128;
        let mut blocks = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for j in 0..x {
            blocks.0.push(scale_blocks(
                &gate.narrow(0, j * i, i)?,
                &up.narrow(0, j * i, i)?,
                FP8_GATE_UP_BLOCK,
            )?);
            blocks.1.push(scale_blocks(
                &gs.narrow(0, j * sb, sb)?,
                &us.narrow(0, j * sb, sb)?,
                FP8_GATE_UP_BLOCK / FP8_BLOCK,
            )?);
            blocks.2.push(down.narrow(1, j * i, i)?.contiguous()?);
            blocks.3.push(ds.narrow(1, j * sb, sb)?.contiguous()?);
        }
        let up_dev = |v: &[Tensor]| -> Result<Tensor> {
            Ok(Tensor::stack(v, 0)?.contiguous()?.to_device(&device)?)
        };
        let out = Self {
            gate_up: up_dev(&blocks.0)?,
            gate_up_scale: up_dev(&blocks.1)?,
            down: up_dev(&blocks.2)?,
            down_scale: up_dev(&blocks.3)?,
        };
        if out.gate_up.dtype() != DType::F8E4M3 || out.gate_up_scale.dtype() != DType::F32 {
            return Err(Error::invalid(
                "shared_experts",
                format!("{:?} weights", out.gate_up.dtype()),
                "fp8 shared experts hold F8_E4M3 weights and F32 scales",
            ));
        }
        Ok(Some(out))
    }

    /// Number of blocks `X`.
    pub(crate) fn blocks(&self) -> usize {
        self.gate_up.dims()[0]
    }
}
