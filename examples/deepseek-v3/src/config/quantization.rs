//! `quantization_config` of a Hugging Face `config.json`, as a typed value.

use anyhow::{bail, Result};
use serde_json::{json, Map, Value};

/// What the model runs, for error messages that refuse anything else.
const SUPPORTED: &str = "supported: fp8 with fmt e4m3, dynamic activation scales and 128 x 128 \
                         weight blocks, or no quantization_config for bf16/f16/f32 weights";

/// The weight blocks DeepSeek's FP8 checkpoints scale together (`[rows, columns]`).
pub const FP8_BLOCK: [usize; 2] = [128, 128];

/// How the FP8 scales are stored and computed (`quantization_config.scale_fmt`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScaleFmt {
    /// Any `f32` scale (no `scale_fmt`: DeepSeek-V3, R1, Kimi-K2).
    #[default]
    Float,
    /// `"ue8m0"` (DeepSeek-V3.1): every scale is a power of two, activation scales are rounded
    /// up to one.
    Ue8m0,
}

/// The quantization of a checkpoint's weights (`quantization_config` in `config.json`).
#[derive(Clone, Debug, PartialEq)]
pub enum Quantization {
    /// DeepSeek's block-wise FP8: `float8_e4m3fn` weights with one `f32` scale per
    /// `block[0] x block[1]` block (`weight_scale_inv`) and activations quantized on the fly.
    Fp8 {
        /// Rows and columns of a weight block (`weight_block_size`).
        block: [usize; 2],
        /// Format of the scales.
        scale_fmt: ScaleFmt,
    },
    /// A `quantization_config` this model does not run; [`Quantization::check`] refuses it.
    Unsupported {
        /// One line naming the method or value and what is supported.
        reason: String,
        /// The `quantization_config` object as written, serialised back unchanged.
        raw: Value,
    },
}

impl Quantization {
    /// Reads a `quantization_config` value. Never fails: what the model cannot run becomes
    /// [`Quantization::Unsupported`] with the reason.
    pub fn from_hf(raw: &Value) -> Self {
        let parsed = raw
            .as_object()
            .ok_or_else(|| {
                format!("quantization_config must be an object, got {raw} ({SUPPORTED})")
            })
            .and_then(|obj| match obj.get("quant_method") {
                Some(Value::String(m)) if m == "fp8" => fp8(obj),
                Some(m) => Err(format!(
                    "quantization_config.quant_method {m} is not supported ({SUPPORTED})"
                )),
                None => Err(format!(
                    "quantization_config has no quant_method ({SUPPORTED})"
                )),
            });
        parsed.unwrap_or_else(|reason| Quantization::Unsupported {
            reason,
            raw: raw.clone(),
        })
    }

    /// The Hugging Face form, as DeepSeek's checkpoints write it.
    pub fn to_hf(&self) -> Value {
        match self {
            Quantization::Fp8 { block, scale_fmt } => {
                let mut v = json!({
                    "activation_scheme": "dynamic",
                    "fmt": "e4m3",
                    "quant_method": "fp8",
                    "weight_block_size": block,
                });
                if *scale_fmt == ScaleFmt::Ue8m0 {
                    v["scale_fmt"] = json!("ue8m0");
                }
                v
            }
            Quantization::Unsupported { raw, .. } => raw.clone(),
        }
    }

    /// Refuses what the model cannot run, in one line naming the method or value.
    pub fn check(&self) -> Result<()> {
        match self {
            Quantization::Fp8 { block, .. } if *block != FP8_BLOCK => bail!(
                "quantization_config.weight_block_size [{}, {}] is not supported ({SUPPORTED})",
                block[0],
                block[1]
            ),
            Quantization::Fp8 { .. } => Ok(()),
            Quantization::Unsupported { reason, .. } => bail!("{reason}"),
        }
    }
}

/// The fields of an `fp8` configuration; `Err` holds the reason it cannot run.
fn fp8(obj: &Map<String, Value>) -> std::result::Result<Quantization, String> {
    let only = |field: &str, allowed: &str| match obj.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s == allowed => Ok(()),
        Some(v) => Err(format!(
            "quantization_config.{field} {v} is not supported ({SUPPORTED})"
        )),
    };
    only("fmt", "e4m3")?;
    only("activation_scheme", "dynamic")?;
    let block = match obj.get("weight_block_size") {
        None | Some(Value::Null) => FP8_BLOCK,
        Some(v) => block_size(v).ok_or_else(|| {
            format!(
                "quantization_config.weight_block_size {v} must be two positive integers \
                 ({SUPPORTED})"
            )
        })?,
    };
    let scale_fmt = match obj.get("scale_fmt") {
        None | Some(Value::Null) => ScaleFmt::Float,
        Some(Value::String(s)) if s == "ue8m0" => ScaleFmt::Ue8m0,
        Some(v) => {
            return Err(format!(
                "quantization_config.scale_fmt {v} is not supported (supported: \"ue8m0\" or none)"
            ))
        }
    };
    Ok(Quantization::Fp8 { block, scale_fmt })
}

/// `[rows, columns]` from a JSON pair of positive integers.
fn block_size(v: &Value) -> Option<[usize; 2]> {
    match v.as_array()?.as_slice() {
        [r, c] => {
            let r = usize::try_from(r.as_u64()?).ok()?;
            let c = usize::try_from(c.as_u64()?).ok()?;
            (r > 0 && c > 0).then_some([r, c])
        }
        _ => None,
    }
}
