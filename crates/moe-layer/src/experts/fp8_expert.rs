//! [`Fp8Expert`]: one routed expert of a block-scaled fp8 checkpoint, and [`Fp8Scales`], the
//! block scales of a shard that keeps its experts in e4m3.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

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

    /// The expert dequantized to `dtype` ([`Fp8Weight::dequantize`]).
    pub fn dequantize(&self, dtype: DType) -> Result<Mlp> {
        Ok(Mlp::new(
            self.gate.dequantize(dtype)?,
            self.up.dequantize(dtype)?,
            self.down.dequantize(dtype)?,
        )?)
    }
}

/// The block scales of an fp8 shard (the e4m3 weights are [`Experts::gate_up`] and
/// [`Experts::down`]).
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Fp8Scales {
    /// `[L, 2I / 128, ceil(H / 128)]`: the gate_proj scales, then the up_proj scales.
    pub(crate) gate_up: Tensor,
    /// `[L, ceil(H / 128), ceil(I / 128)]`.
    pub(crate) down: Tensor,
}
