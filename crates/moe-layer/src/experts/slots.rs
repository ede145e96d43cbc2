//! One local slot's weights out of a shard and into another, for experts that change rank when
//! a layer is re-placed (`MoeLayer::replace_experts`): the slot's stacked weights (and fp8
//! scales) as safetensors bytes in the shard's own layout, written back in place, so that the
//! shard's tensors (and the CUDA graphs that captured their addresses) stay where they are.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use super::shard::Experts;
use crate::error::{Error, Result};

/// The names of a slot's tensors in its bytes.
const GATE_UP: &str = "gate_up";
const DOWN: &str = "down";
const GATE_UP_SCALE: &str = "gate_up_scale";
const DOWN_SCALE: &str = "down_scale";

impl Experts {
    /// The stacked tensors of the shard by name (values, then fp8 scales).
    fn slot_tensors(&self) -> Vec<(&'static str, &Tensor)> {
        let mut t = vec![(GATE_UP, &self.gate_up), (DOWN, &self.down)];
        if let Some(s) = self.fp8_scales() {
            t.extend([(GATE_UP_SCALE, &s.gate_up), (DOWN_SCALE, &s.down)]);
        }
        t
    }

    fn check_slot(&self, l: usize) -> Result<()> {
        if l >= self.num_local() {
            return Err(Error::invalid(
                "slot",
                l,
                format!("must be below the shard's {} local slots", self.num_local()),
            ));
        }
        Ok(())
    }

    /// The weights of local slot `l` as bytes (a device-to-host copy of one expert).
    pub fn slot_bytes(&self, l: usize) -> Result<Vec<u8>> {
        self.check_slot(l)?;
        let host = self
            .slot_tensors()
            .into_iter()
            .map(|(name, t)| Ok((name, slot_on_host(t, l)?)))
            .collect::<Result<Vec<_>>>()?;
        safetensors::serialize(host, None).map_err(|e| {
            Error::invalid(
                "slot",
                l,
                format!("its weights could not be serialized: {e}"),
            )
        })
    }

    /// Writes `bytes` ([`Experts::slot_bytes`] of a shard of the same shapes, dtype and layout)
    /// into local slot `l`, in place.
    pub fn write_slot_bytes(&self, l: usize, bytes: &[u8]) -> Result<()> {
        self.check_slot(l)?;
        let got: HashMap<String, Tensor> =
            candle_core::safetensors::load_buffer(bytes, self.device()).map_err(|e| {
                Error::invalid(
                    "slot weights",
                    format!("{} bytes", bytes.len()),
                    format!("are not a slot's safetensors: {e}"),
                )
            })?;
        let want = self.slot_tensors();
        if got.len() != want.len() {
            return Err(Error::invalid(
                "slot weights",
                format!("{} tensors", got.len()),
                format!("this shard's slots hold {}", want.len()),
            ));
        }
        // Every tensor checked before the first write: a bad message changes nothing.
        let mut writes = Vec::with_capacity(want.len());
        for (name, stack) in want {
            let t = got.get(name).ok_or_else(|| {
                Error::invalid(
                    "slot weights",
                    format!("without {name}"),
                    "must hold every tensor of the shard's slots",
                )
            })?;
            if t.dims() != &stack.dims()[1..] || t.dtype() != stack.dtype() {
                return Err(Error::invalid(
                    "slot weights",
                    format!("{name} {:?} {:?}", t.dtype(), t.dims()),
                    format!(
                        "must be {:?} {:?} like the shard's",
                        stack.dtype(),
                        &stack.dims()[1..]
                    ),
                ));
            }
            writes.push((stack, t));
        }
        for (stack, t) in writes {
            stack.slice_set(&t.unsqueeze(0)?, 0, l)?;
        }
        Ok(())
    }
}

/// Slot `l` of `stack` on the host, copying that slot only: a view's `to_device` would copy
/// the whole stack (candle moves a tensor's storage, not its view).
fn slot_on_host(stack: &Tensor, l: usize) -> Result<Tensor> {
    let view = stack.get(l)?;
    if stack.device().is_cpu() {
        // Serialized through its layout: only the slot's values are read.
        return Ok(view);
    }
    let own = Tensor::zeros(view.shape(), view.dtype(), view.device())?;
    own.slice_set(&view, 0, 0)?;
    Ok(own.to_device(&Device::Cpu)?)
}
