//! [`Fp8Expert`]: one routed expert of a block-scaled fp8 checkpoint, and [`Fp8Scales`], the
//! block scales of a shard that keeps its experts in e4m3.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use ep_kernels::gemm::fp8::{FP8_BLOCK, FP8_GATE_UP_BLOCK};

use super::mlp::Mlp;
use crate::error::{Error, Result};
use crate::fp8::Fp8Weight;

/// One routed expert of a block-scaled fp8 checkpoint: its three projections.
#[derive(Clone, Debug)]
pub struct Fp8Expert {
    /// `gate_proj` `[I, H]`.
    pub gate: Fp8Weight,
    /// `up_proj` `[I, H]`.
    pub up: Fp8Weight,
    /// `down_proj` `[H, I]`.
    pub down: Fp8Weight,
}

impl Fp8Expert {
    /// The expert at `vb` (`gate_proj`, `up_proj`, `down_proj`, each with its
    /// `weight_scale_inv`), or `None` when its `gate_proj` has no scales (an unquantized
    /// expert). A projection of an fp8 expert without scales is an error naming it.
    pub fn load(vb: &VarBuilder, h: usize, i: usize) -> Result<Option<Self>> {
        let Some(gate) = Fp8Weight::load(&vb.pp("gate_proj"), i, h)? else {
            return Ok(None);
        };
        let need = |name: &str, n: usize, k: usize| -> Result<Fp8Weight> {
            let pvb = vb.pp(name);
            Fp8Weight::load(&pvb, n, k)?.ok_or_else(|| {
                Error::invalid(
                    "fp8 weight",
                    format!("{}.weight_scale_inv", pvb.prefix()),
                    "is missing: every projection of an fp8 expert needs its scales",
                )
            })
        };
        Ok(Some(Self {
            gate,
            up: need("up_proj", i, h)?,
            down: need("down_proj", h, i)?,
        }))
    }

    /// The expert's gate_up weight `[2I, H]` e4m3 in [`super::GateUpLayout::ScaleBlocks`] and
    /// its scales `[2I / 128, ceil(H / 128)]` in the same order.
    pub(crate) fn gate_up_blocks(&self) -> Result<(Tensor, Tensor)> {
        Ok((
            scale_blocks(self.gate.q(), self.up.q(), FP8_GATE_UP_BLOCK)?,
            scale_blocks(
                self.gate.scale(),
                self.up.scale(),
                FP8_GATE_UP_BLOCK / FP8_BLOCK,
            )?,
        ))
    }

    /// The expert dequantized to `dtype` ([`Fp8Weight::dequantize`]).
    pub fn dequantize(&self, dtype: DType) -> Result<Mlp> {
        Ok(Mlp::new(
            self.gate.dequantize(dtype)?,
            self.up.dequantize(dtype)?,
            self.down.dequantize(dtype)?,
        )?)
    }
}

/// `gate` and `up` (`[n, ..]` each, `n` a multiple of `rows`) as `rows` rows of `gate`, then
/// the same rows of `up`, in turn: `[2n, ..]` (the [`super::GateUpLayout::ScaleBlocks`] order
/// of a weight with `rows = 128`, or of its scales with `rows = 1`).
pub(crate) fn scale_blocks(gate: &Tensor, up: &Tensor, rows: usize) -> Result<Tensor> {
    let (n, k) = gate.dims2()?;
    if n % rows != 0 || up.dims() != gate.dims() {
        return Err(Error::invalid(
            "gate_up",
            format!("gate {:?} and up {:?}", gate.dims(), up.dims()),
            format!("must be equal shapes of whole blocks of {rows} rows"),
        ));
    }
    let blocks = |t: &Tensor| t.reshape((n / rows, 1, rows, k));
    Ok(Tensor::cat(&[blocks(gate)?, blocks(up)?], 1)?.reshape((2 * n, k))?)
}

/// The block scales of an fp8 shard (the e4m3 weights are [`Experts::gate_up`] and
/// [`Experts::down`]).
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Fp8Scales {
    /// `[L, 2I / 128, ceil(H / 128)]`: a gate_proj block row's scales, then its up_proj
    /// block row's, in turn (as the weights, [`super::GateUpLayout::ScaleBlocks`]).
    pub(crate) gate_up: Tensor,
    /// `[L, ceil(H / 128), ceil(I / 128)]`.
    pub(crate) down: Tensor,
}
