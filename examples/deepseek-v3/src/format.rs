//! What a checkpoint folder's safetensors hold, read from their headers before any weight is:
//! every tensor's dtype and shape is checked against what the model runs, so that a format it
//! does not implement is refused with the tensor, its dtype and what is supported, never turned
//! into numbers. Tensors the model does not use (DeepSeek-V3's multi-token-prediction layer
//! `model.layers.{num_hidden_layers}.*`) are skipped with one log line.
//!
//! Supported: F32, BF16 and F16 tensors, and DeepSeek's block-scaled FP8 linear weights
//! (`*.weight` F8_E4M3 beside a `*.weight_scale_inv` F32 of one scale per 128 x 128 block).
//! [`CheckedSafetensors`] is the `VarBuilder` backend the loader reads through: it hands out an
//! F8_E4M3 tensor only as F8_E4M3 (to code that reads its scales too,
//! `moe_layer::fp8::load_weight`), never converted to a float dtype without them.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;

use crate::config::{DeepSeekV3Config, Quantization};

/// What the dtype checks accept, for the error messages.
const SUPPORTED: &str = "supported: F32, BF16 and F16 tensors, and F8_E4M3 linear weights \
                         beside an F32 weight_scale_inv of one scale per 128 x 128 block \
                         (DeepSeek's fp8 format)";

/// The suffix of an fp8 weight's scales.
const SCALE_SUFFIX: &str = ".weight_scale_inv";

/// A tensor's stored dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The stored dtype.
    pub dtype: DType,
    /// The stored shape.
    pub shape: Vec<usize>,
}

/// The checked contents of a checkpoint.
#[derive(Debug)]
pub struct CheckpointFormat {
    /// Every tensor the model may read, by name.
    pub tensors: HashMap<String, TensorInfo>,
    /// Linear weights stored as block-scaled fp8.
    pub fp8_weights: usize,
    /// Tensors skipped because the model does not use them (the MTP layer), by name.
    pub skipped: Vec<String>,
}

impl CheckpointFormat {
    /// Whether the checkpoint holds block-scaled fp8 weights.
    pub fn is_fp8(&self) -> bool {
        self.fp8_weights > 0
    }

    /// Bytes of the tensors as stored (the skipped ones excluded).
    pub fn stored_bytes(&self) -> usize {
        self.tensors
            .values()
            .map(|t| t.shape.iter().product::<usize>() * t.dtype.size_in_bytes())
            .sum()
    }
}

/// The layer index of a `model.layers.{i}.` tensor name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// Reads the headers of `files` and checks every tensor against `cfg` (see the module docs);
/// returns the memory-mapped files (no weight read yet) and what they hold.
pub fn inspect(
    files: &[PathBuf],
    cfg: &DeepSeekV3Config,
) -> Result<(MmapedSafetensors, CheckpointFormat)> {
    // SAFETY: the files are memory-mapped read-only; like every safetensors loader we rely on
    // them not being modified while the model is alive.
    let st = unsafe { MmapedSafetensors::multi(files)? };
    let mut tensors = HashMap::new();
    let mut skipped = Vec::new();
    for (name, view) in st.tensors() {
        if layer_of(&name).is_some_and(|l| l >= cfg.num_hidden_layers) {
            skipped.push(name);
            continue;
        }
        let dtype = DType::try_from(view.dtype()).map_err(|_| {
            anyhow::anyhow!(
                "{name}: dtype {:?} is not supported ({SUPPORTED})",
                view.dtype()
            )
        })?;
        tensors.insert(
            name,
            TensorInfo {
                dtype,
                shape: view.shape().to_vec(),
            },
        );
    }
    let fp8_weights = check_dtypes(&tensors, cfg)?;
    if !skipped.is_empty() {
        skipped.sort();
        let layers: std::collections::BTreeSet<usize> =
            skipped.iter().filter_map(|n| layer_of(n)).collect();
        tracing::info!(
            "skipping {} tensors of layer(s) {layers:?}: past num_hidden_layers = {} (the \
             multi-token-prediction layer, not used to generate)",
            skipped.len(),
            cfg.num_hidden_layers
        );
    }
    Ok((
        st,
        CheckpointFormat {
            tensors,
            fp8_weights,
            skipped,
        },
    ))
}

/// Checks every tensor's dtype (and every fp8 weight's scales); returns the number of fp8
/// weights.
fn check_dtypes(tensors: &HashMap<String, TensorInfo>, cfg: &DeepSeekV3Config) -> Result<usize> {
    let block = match &cfg.quantization {
        Some(Quantization::Fp8 { block, .. }) => *block,
        Some(Quantization::Unsupported { reason, .. }) => bail!("{reason}"),
        None => crate::config::FP8_BLOCK,
    };
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut fp8 = 0;
    for name in names {
        let t = &tensors[name];
        match t.dtype {
            DType::F32 | DType::BF16 | DType::F16 => {
                if let Some(weight) = name.strip_suffix(SCALE_SUFFIX) {
                    let w = format!("{weight}.weight");
                    if tensors.get(&w).is_none_or(|i| i.dtype != DType::F8E4M3) {
                        bail!(
                            "{name}: scales of {w}, which is not an F8_E4M3 tensor ({SUPPORTED})"
                        );
                    }
                    if t.dtype != DType::F32 {
                        bail!(
                            "{name}: dtype {:?} is not supported for fp8 scales ({SUPPORTED})",
                            t.dtype
                        );
                    }
                }
            }
            DType::F8E4M3 => {
                let Some(prefix) = name.strip_suffix(".weight") else {
                    bail!("{name}: an F8_E4M3 tensor that is not a linear weight ({SUPPORTED})");
                };
                let [n, k] = t.shape[..] else {
                    bail!(
                        "{name}: an F8_E4M3 weight of shape {:?}: must be a matrix ({SUPPORTED})",
                        t.shape
                    );
                };
                let scale_name = format!("{prefix}{SCALE_SUFFIX}");
                let Some(s) = tensors.get(&scale_name) else {
                    bail!(
                        "{name} is F8_E4M3 but {scale_name} is missing: an fp8 weight needs its \
                         scales ({SUPPORTED})"
                    );
                };
                let want = vec![n.div_ceil(block[0]), k.div_ceil(block[1])];
                if s.shape != want {
                    bail!(
                        "{scale_name} has shape {:?}; the [{n}, {k}] F8_E4M3 weight needs \
                         {want:?}: one scale per {} x {} block ({SUPPORTED})",
                        s.shape,
                        block[0],
                        block[1]
                    );
                }
                fp8 += 1;
            }
            other => bail!("{name}: dtype {other:?} is not supported ({SUPPORTED})"),
        }
    }
    Ok(fp8)
}

/// The loader's `VarBuilder` backend: the checked, memory-mapped tensors, converted to the
/// dtype asked for, except that an F8_E4M3 tensor is handed out only as F8_E4M3.
pub struct CheckedSafetensors {
    st: MmapedSafetensors,
    tensors: HashMap<String, TensorInfo>,
}

impl CheckedSafetensors {
    /// The backend over `st`, whose tensors [`inspect`] listed in `format`.
    pub fn new(st: MmapedSafetensors, format: &CheckpointFormat) -> Self {
        Self {
            st,
            tensors: format.tensors.clone(),
        }
    }

    fn load(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let Some(info) = self.tensors.get(name) else {
            candle_core::bail!("cannot find tensor {name} in the checkpoint")
        };
        if info.dtype == DType::F8E4M3 && dtype != DType::F8E4M3 {
            candle_core::bail!(
                "{name} is an F8_E4M3 weight: read it with its weight_scale_inv \
                 (moe_layer::fp8::load_weight), not as {dtype:?}"
            )
        }
        self.st.load(name, dev)?.to_dtype(dtype)
    }
}

impl SimpleBackend for CheckedSafetensors {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.load(name, dtype, dev)?;
        if t.shape() != &s {
            Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt())?
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.load(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(dtype: DType, shape: &[usize]) -> TensorInfo {
        TensorInfo {
            dtype,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn fp8_weights_need_their_scales_of_the_right_shape() {
        let cfg = DeepSeekV3Config::tiny();
        let mut t = HashMap::from([
            ("a.weight".to_string(), info(DType::F8E4M3, &[300, 130])),
            ("a.weight_scale_inv".to_string(), info(DType::F32, &[3, 2])),
            ("b.weight".to_string(), info(DType::BF16, &[4, 4])),
        ]);
        assert_eq!(check_dtypes(&t, &cfg).unwrap(), 1);
        t.insert("a.weight_scale_inv".into(), info(DType::F32, &[3, 1]));
        let err = check_dtypes(&t, &cfg).unwrap_err().to_string();
        assert!(
            err.contains("a.weight_scale_inv") && err.contains("[3, 2]"),
            "{err}"
        );
        t.remove("a.weight_scale_inv");
        let err = check_dtypes(&t, &cfg).unwrap_err().to_string();
        assert!(err.contains("a.weight") && err.contains("missing"), "{err}");
    }

    #[test]
    fn other_dtypes_are_refused_naming_the_tensor() {
        let cfg = DeepSeekV3Config::tiny();
        let t = HashMap::from([(
            "model.layers.0.mlp.experts.0.gate_proj.qweight".to_string(),
            info(DType::I64, &[16, 128]),
        )]);
        let err = check_dtypes(&t, &cfg).unwrap_err().to_string();
        assert!(
            err.contains("experts.0.gate_proj.qweight") && err.contains("I64"),
            "{err}"
        );
        assert!(err.contains("supported: F32, BF16"), "{err}");
    }
}
