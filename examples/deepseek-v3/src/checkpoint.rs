//! The tiny-checkpoint generator: random weights with Hugging Face tensor names, sharded
//! safetensors with `model.safetensors.index.json`, `config.json` and `tokenizer.json`, in f32
//! or bf16, or in DeepSeek-V3's block-scaled FP8 release format when the configuration has an
//! fp8 `quantization_config` (every `*_proj` weight e4m3 with its `weight_scale_inv`, the rest
//! as stored); and the embedded default checkpoint, generated on first use into a cache folder.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use moe_layer::ep_kernels::gemm::fp8::quantize_weight;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::config::{DeepSeekV3Config, Quantization};
use crate::progress::Progress;
use crate::tokenizer::{build_tokenizer_json, plain_text_tokens};

/// Seed of the embedded default checkpoint.
pub const DEFAULT_SEED: u64 = 20241226;

/// Bumped whenever the generator's output changes, so stale cached checkpoints are not reused.
const GENERATOR_VERSION: u32 = 3;

/// Name of the file that marks a complete generated checkpoint.
const COMPLETE_MARKER: &str = ".complete";

/// How a tensor is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    /// Uniform in `±gain / sqrt(fan_in)` where `fan_in` is the last dimension.
    Linear(f32),
    /// `1 + U(±0.1)` (norm weights).
    Norm,
    /// `U(0, 0.1)` (router bias).
    Bias,
}

/// Every tensor of a model with configuration `cfg`: HF name, shape, and initialisation.
fn tensor_specs(cfg: &DeepSeekV3Config) -> Vec<(String, Vec<usize>, Init)> {
    let h = cfg.hidden_size;
    let heads = cfg.num_attention_heads;
    let mut specs = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
        Init::Linear(1.0),
    )];
    let lin = |name: String, out: usize, inp: usize| (name, vec![out, inp], Init::Linear(1.0));
    let mlp = |specs: &mut Vec<_>, p: &str, inter: usize| {
        specs.push(lin(format!("{p}.gate_proj.weight"), inter, h));
        specs.push(lin(format!("{p}.up_proj.weight"), inter, h));
        specs.push(lin(format!("{p}.down_proj.weight"), h, inter));
    };
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        specs.push((format!("{p}.input_layernorm.weight"), vec![h], Init::Norm));
        specs.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            Init::Norm,
        ));
        let a = format!("{p}.self_attn");
        let qd = cfg.q_head_dim();
        match cfg.q_lora_rank {
            None => specs.push(lin(format!("{a}.q_proj.weight"), heads * qd, h)),
            Some(r) => {
                specs.push(lin(format!("{a}.q_a_proj.weight"), r, h));
                specs.push((format!("{a}.q_a_layernorm.weight"), vec![r], Init::Norm));
                specs.push(lin(format!("{a}.q_b_proj.weight"), heads * qd, r));
            }
        }
        let r = cfg.kv_lora_rank;
        specs.push(lin(
            format!("{a}.kv_a_proj_with_mqa.weight"),
            r + cfg.qk_rope_head_dim,
            h,
        ));
        specs.push((format!("{a}.kv_a_layernorm.weight"), vec![r], Init::Norm));
        specs.push(lin(
            format!("{a}.kv_b_proj.weight"),
            heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            r,
        ));
        specs.push(lin(format!("{a}.o_proj.weight"), h, heads * cfg.v_head_dim));
        let m = format!("{p}.mlp");
        if cfg.is_moe_layer(i) {
            let e = cfg.n_routed_experts.unwrap_or(0);
            specs.push(lin(format!("{m}.gate.weight"), e, h));
            if cfg.topk_method == "noaux_tc" {
                specs.push((
                    format!("{m}.gate.e_score_correction_bias"),
                    vec![e],
                    Init::Bias,
                ));
            }
            for j in 0..e {
                mlp(
                    &mut specs,
                    &format!("{m}.experts.{j}"),
                    cfg.moe_intermediate_size,
                );
            }
            if let Some(n) = cfg.n_shared_experts.filter(|&n| n > 0) {
                mlp(
                    &mut specs,
                    &format!("{m}.shared_experts"),
                    cfg.moe_intermediate_size * n,
                );
            }
        } else {
            mlp(&mut specs, &m, cfg.intermediate_size);
        }
    }
    specs.push(("model.norm.weight".to_string(), vec![h], Init::Norm));
    specs.push((
        "lm_head.weight".to_string(),
        vec![cfg.vocab_size, h],
        Init::Linear(3.0),
    ));
    specs
}

/// Which shard (`0..num_shards`) holds tensor `name`: layers are spread evenly, the embedding
/// goes to the first shard, the final norm and `lm_head` to the last.
fn shard_of(name: &str, num_layers: usize, num_shards: usize) -> usize {
    if let Some(rest) = name.strip_prefix("model.layers.") {
        let layer: usize = rest
            .split('.')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        return layer * num_shards / num_layers.max(1);
    }
    if name.starts_with("model.embed_tokens") {
        0
    } else {
        num_shards - 1
    }
}

/// File name of shard `i` of `n` in Hugging Face's convention.
pub fn shard_file_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// Writes a random checkpoint of configuration `cfg` into `dir`: `num_shards` safetensors files
/// (f32) with `model.safetensors.index.json`, `config.json` and `tokenizer.json`. The same
/// seed always gives the same files.
pub fn generate(dir: &Path, cfg: &DeepSeekV3Config, seed: u64, num_shards: usize) -> Result<()> {
    generate_reporting(dir, cfg, seed, num_shards, false)
}

/// [`generate`], reporting progress on stderr when `progress` is set.
pub fn generate_reporting(
    dir: &Path,
    cfg: &DeepSeekV3Config,
    seed: u64,
    num_shards: usize,
    progress: bool,
) -> Result<()> {
    generate_stored(dir, cfg, seed, num_shards, DType::F32, progress)
}

/// Whether DeepSeek's fp8 checkpoints store tensor `name` in fp8: every linear projection
/// (`*_proj.weight`); not the embedding, `lm_head`, the norms or the router gate.
pub fn is_fp8_weight(name: &str) -> bool {
    name.ends_with("_proj.weight") || name.ends_with("_proj_with_mqa.weight")
}

/// [`generate_reporting`] storing the unquantized tensors in `storage` (f32 or bf16). With an
/// fp8 `quantization_config` in `cfg` every linear projection is written as DeepSeek ships
/// them: e4m3 values and one f32 scale per 128 x 128 block (`weight_scale_inv`), quantized
/// from the same random f32 weights.
pub fn generate_stored(
    dir: &Path,
    cfg: &DeepSeekV3Config,
    seed: u64,
    num_shards: usize,
    storage: DType,
    progress: bool,
) -> Result<()> {
    cfg.validate()?;
    if num_shards == 0 {
        bail!("--shards must be at least 1");
    }
    if storage != DType::F32 && storage != DType::BF16 {
        bail!(
            "checkpoints are written in f32 or bf16, not {}",
            storage.as_str()
        );
    }
    let block = match &cfg.quantization {
        Some(Quantization::Fp8 { block, .. }) => Some(*block),
        Some(Quantization::Unsupported { reason, .. }) => bail!("{reason}"),
        None => None,
    };
    if block.is_some_and(|b| b != crate::config::FP8_BLOCK) {
        bail!("fp8 checkpoints are written with 128 x 128 weight blocks");
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut shards: Vec<HashMap<String, Tensor>> = vec![HashMap::new(); num_shards];
    let mut weight_map = BTreeMap::new();
    let mut total_bytes = 0usize;
    let plain = plain_text_tokens(cfg.vocab_size);
    let specs = tensor_specs(cfg);
    let mut report = Progress::new(
        format!("writing {}", dir.display()),
        specs.len() as u64 + 1,
        "tensors",
        progress,
    );
    for (name, shape, init) in specs {
        let numel: usize = shape.iter().product();
        let mut data: Vec<f32> = match init {
            Init::Linear(gain) => {
                let bound = gain / (*shape.last().unwrap_or(&1) as f32).sqrt();
                (0..numel)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect()
            }
            Init::Norm => (0..numel)
                .map(|_| 1.0 + rng.random_range(-0.1..0.1))
                .collect(),
            Init::Bias => (0..numel).map(|_| rng.random_range(0.0..0.1)).collect(),
        };
        if name == "lm_head.weight" {
            // Rows of tokens that are not plain text (control and non-ASCII bytes, unused ids)
            // are zeroed, so a random model's greedy picks read as text.
            for (row, keep) in data.chunks_mut(cfg.hidden_size).zip(&plain) {
                if !keep {
                    row.fill(0.0);
                }
            }
        }
        let shard = shard_of(&name, cfg.num_hidden_layers, num_shards);
        if block.is_some() && is_fp8_weight(&name) {
            let (n, k) = (shape[0], shape[1]);
            let (q, scales) = quantize_weight(&data, n, k, crate::config::FP8_BLOCK[0])?;
            let scale_name = format!("{}_scale_inv", name);
            let scale_shape = (n.div_ceil(128), k.div_ceil(128));
            total_bytes += numel + scales.len() * 4;
            weight_map.insert(scale_name.clone(), shard_file_name(shard, num_shards));
            shards[shard].insert(
                scale_name,
                Tensor::from_vec(scales, scale_shape, &Device::Cpu)?,
            );
            shards[shard].insert(name.clone(), Tensor::from_vec(q, (n, k), &Device::Cpu)?);
        } else {
            total_bytes += numel * storage.size_in_bytes();
            let t = Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(storage)?;
            shards[shard].insert(name.clone(), t);
        }
        weight_map.insert(name, shard_file_name(shard, num_shards));
        report.inc(1);
    }
    for (i, tensors) in shards.iter().enumerate() {
        let path = dir.join(shard_file_name(i, num_shards));
        candle_core::safetensors::save(tensors, &path)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total_bytes},
        "weight_map": weight_map,
    });
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    let mut config: serde_json::Value = serde_json::from_str(&cfg.to_hf_json()?)?;
    config["torch_dtype"] = serde_json::json!(match storage {
        DType::BF16 => "bfloat16",
        _ => "float32",
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::write(
        dir.join("tokenizer.json"),
        build_tokenizer_json(cfg.vocab_size)?,
    )?;
    std::fs::write(dir.join(COMPLETE_MARKER), format!("seed {seed}\n"))?;
    report.inc(1);
    report.finish();
    Ok(())
}

/// Where the embedded default checkpoint lives: `$DEEPSEEK_V3_CACHE`, else
/// `$XDG_CACHE_HOME/ep-moe`, else `$HOME/.cache/ep-moe`, else the system temp folder; inside
/// it a folder named after the generator version and seed.
pub fn default_checkpoint_dir() -> PathBuf {
    let env_dir = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let root = env_dir("DEEPSEEK_V3_CACHE")
        .or_else(|| env_dir("XDG_CACHE_HOME").map(|p| p.join("ep-moe")))
        .or_else(|| env_dir("HOME").map(|p| p.join(".cache").join("ep-moe")))
        .unwrap_or_else(|| std::env::temp_dir().join("ep-moe"));
    root.join(format!(
        "deepseek-v3-tiny-v{GENERATOR_VERSION}-seed{DEFAULT_SEED}"
    ))
}

/// Returns the default checkpoint's folder, generating it first when missing (saying so on
/// stderr, with progress, when `report` is set). Safe when many processes start at once: each
/// writes a private folder and renames it into place; the first rename wins and the others'
/// identical copies are removed.
pub fn ensure_default_checkpoint(report: bool) -> Result<PathBuf> {
    let dir = default_checkpoint_dir();
    if dir.join(COMPLETE_MARKER).exists() {
        return Ok(dir);
    }
    let parent = dir.parent().context("cache folder has no parent")?;
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        dir.file_name().and_then(|n| n.to_str()).unwrap_or("ckpt"),
        std::process::id()
    ));
    tracing::info!(dir = %dir.display(), "generating the default tiny checkpoint");
    if report {
        eprintln!(
            "generating the default tiny checkpoint into {} (first use; nothing is downloaded)",
            dir.display()
        );
    }
    generate_reporting(&tmp, &DeepSeekV3Config::tiny(), DEFAULT_SEED, 2, report)?;
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another process got there first (or a stale incomplete folder is in the way).
        std::fs::remove_dir_all(&tmp).ok();
        if !dir.join(COMPLETE_MARKER).exists() {
            bail!(
                "{} exists but is not a complete checkpoint; remove it and retry",
                dir.display()
            );
        }
    }
    Ok(dir)
}
