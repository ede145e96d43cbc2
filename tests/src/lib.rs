//! Shared fixtures of the end-to-end tests: a random DeepSeek-V3-style MoE layer written to
//! safetensors with HF names, and helpers to run ranks as threads.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use moe_layer::ep_runtime::Buffer;
use moe_layer::placement::Placement;
use moe_layer::{Mode, MoeConfig, MoeLayer, MoeLayerOptions};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The prefix of the layer inside the checkpoint.
pub const PREFIX: &str = "model.layers.3.mlp";

/// A small DeepSeek-V3-style config: 16 routed experts in 4 groups (2 kept), top-4, one
/// shared expert, hidden 128 (so fp8 dispatch works).
pub fn config() -> MoeConfig {
    serde_json::from_str(
        r#"{"hidden_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 16,
            "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
            "routed_scaling_factor": 2.5, "norm_topk_prob": true, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc"}"#,
    )
    .expect("valid config")
}

/// Writes random weights for `cfg` under [`PREFIX`] into a fresh folder; returns the file.
pub fn write_checkpoint(cfg: &MoeConfig, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ep-moe-test-{}-{}-{}",
        tag,
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("model.safetensors");
    let dev = Device::Cpu;
    let (h, i, e) = (
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
    );
    let mut t: HashMap<String, Tensor> = HashMap::new();
    let rnd = |shape: &[usize], s: f64| Tensor::randn(0f32, s as f32, shape, &dev).expect("randn");
    t.insert(format!("{PREFIX}.gate.weight"), rnd(&[e, h], 0.2));
    t.insert(
        format!("{PREFIX}.gate.e_score_correction_bias"),
        rnd(&[e], 0.05),
    );
    for x in 0..e {
        t.insert(
            format!("{PREFIX}.experts.{x}.gate_proj.weight"),
            rnd(&[i, h], 0.1),
        );
        t.insert(
            format!("{PREFIX}.experts.{x}.up_proj.weight"),
            rnd(&[i, h], 0.1),
        );
        t.insert(
            format!("{PREFIX}.experts.{x}.down_proj.weight"),
            rnd(&[h, i], 0.1),
        );
    }
    let si = i * cfg.n_shared_experts.unwrap_or(0);
    if si > 0 {
        t.insert(
            format!("{PREFIX}.shared_experts.gate_proj.weight"),
            rnd(&[si, h], 0.1),
        );
        t.insert(
            format!("{PREFIX}.shared_experts.up_proj.weight"),
            rnd(&[si, h], 0.1),
        );
        t.insert(
            format!("{PREFIX}.shared_experts.down_proj.weight"),
            rnd(&[h, si], 0.1),
        );
    }
    candle_core::safetensors::save(&t, &path).expect("save");
    path
}

/// A VarBuilder over the checkpoint at [`PREFIX`].
pub fn var_builder(path: &Path, dtype: DType) -> VarBuilder<'static> {
    // SAFETY: the test owns the file and does not modify it while mapped.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], dtype, &Device::Cpu) }.expect("mmap");
    vb.pp(PREFIX)
}

/// Largest `|a - b| / |b|` over the tensors, in f64 norms.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("a");
    let b = b
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("b");
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// This rank's layer of the checkpoint at `path` on `buf`, in `Mode::Auto` with low-latency
/// steps of up to `max_tokens` tokens, its experts placed by `placement` (`None`: `E / R`
/// fixed experts a rank).
pub fn load_layer(
    path: &Path,
    cfg: &MoeConfig,
    buf: Buffer,
    max_tokens: usize,
    placement: Option<&Placement>,
) -> MoeLayer {
    let opts = MoeLayerOptions {
        mode: Mode::Auto,
        low_latency_max_tokens: max_tokens,
        ..Default::default()
    };
    MoeLayer::load_placed(
        var_builder(path, DType::F32),
        cfg,
        Arc::new(buf),
        opts,
        placement,
    )
    .expect("layer")
}
