//! Loads a checkpoint folder (`config.json`, sharded `*.safetensors` with an optional
//! `model.safetensors.index.json`, `tokenizer.json`) into a [`DeepSeekV3`] model, or builds one
//! with random weights made on the device ([`load_random`]). The safetensors files are
//! memory-mapped, so each rank reads only the tensors it asks for: the shared weights and its
//! own experts. Every tensor's dtype is checked first ([`crate::format`]): block-scaled FP8
//! weights (DeepSeek-V3's release format) are read with their scales, the routed experts' kept
//! in FP8 on a GPU and every other one dequantized once (exactly, as DeepSeek's
//! `weight_dequant`); a format the model does not run is refused before any weight is read.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use moe_layer::dense::DenseMoe;

use crate::attention::Attention;
use crate::config::DeepSeekV3Config;
use crate::init::RandomInit;
use crate::kv_cache::KvShape;
use crate::model::{DecoderLayer, DeepSeekV3, Ffn};
use crate::progress::Progress;
use crate::rotary::Rotary;
use crate::tokenizer::{build_tokenizer_json, TextTokenizer};

/// How MoE layers are built.
pub enum MoeBackend {
    /// Expert-parallel [`moe_layer::MoeLayer`]s over `buffer`'s ranks: this rank loads
    /// `n_routed_experts / num_ranks` experts.
    ExpertParallel {
        /// The communication buffer shared by all MoE layers of this rank.
        buffer: Arc<moe_layer::ep_runtime::Buffer>,
        /// Mode and sizing options of every MoE layer.
        options: moe_layer::MoeLayerOptions,
        /// Redundant experts: every MoE layer's placement of its physical slots (the buffer
        /// then sized for them); `None`: `n_routed_experts / num_ranks` experts a rank.
        placements: Option<Arc<crate::placements::ExpertPlacements>>,
    },
    /// Every expert in this process ([`DenseMoe`]), no communication: a single-process reference.
    Dense,
}

/// What [`load`] needs besides the folder.
pub struct LoadOptions {
    /// Device of the weights.
    pub device: Device,
    /// Weight dtype (the checkpoint's tensors are converted on load).
    pub dtype: DType,
    /// Longest sequence to support (rotary tables are built up to it); capped by
    /// `max_position_embeddings`.
    pub max_positions: usize,
    /// How MoE layers are built.
    pub moe: MoeBackend,
    /// Whether to report progress on stderr (rank 0 of a node usually).
    pub progress: bool,
}

/// A loaded model with its configuration and tokenizer.
#[derive(Debug)]
pub struct LoadedModel {
    /// The configuration read from `config.json`.
    pub config: DeepSeekV3Config,
    /// The model.
    pub model: DeepSeekV3,
    /// The tokenizer read from `tokenizer.json`.
    pub tokenizer: TextTokenizer,
    /// What was loaded (for the log line at load).
    pub report: LoadReport,
}

/// What a load read and what the weights take.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Linear weights the checkpoint stores as block-scaled fp8.
    pub fp8_weights: usize,
    /// Tensors skipped (the MTP layer).
    pub skipped: usize,
    /// Device memory the load took on a GPU, measured (free memory before and after, the
    /// memory pool trimmed): the weights plus what the pool could not give back.
    pub device_bytes: Option<u64>,
}

/// The safetensors files of a checkpoint folder: those named by `model.safetensors.index.json`
/// when present (each must exist), else every `*.safetensors` file, sorted.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    let mut files: Vec<PathBuf> = if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read {}", index.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: invalid JSON", index.display()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{}: no \"weight_map\" object", index.display()))?;
        let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        std::fs::read_dir(dir)
            .with_context(|| format!("cannot read folder {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect()
    };
    files.sort();
    if files.is_empty() {
        bail!("{}: no *.safetensors files", dir.display());
    }
    for f in &files {
        if !f.exists() {
            bail!("{}: listed in the index but missing", f.display());
        }
    }
    Ok(files)
}

/// Loads the checkpoint in `dir`. Missing or mis-shaped tensors give an error naming the
/// tensor, the expected and the found shape.
pub fn load(dir: &Path, opts: LoadOptions) -> Result<LoadedModel> {
    let config = DeepSeekV3Config::from_file(dir.join("config.json"))?;
    let tokenizer = TextTokenizer::from_file(dir.join("tokenizer.json"))?;
    let files = safetensors_files(dir)?;
    let (st, format) = crate::format::inspect(&files, &config)
        .with_context(|| format!("{}: cannot load the model", dir.display()))?;
    let backend = crate::format::CheckedSafetensors::new(st, &format);
    let vb = VarBuilder::from_backend(Box::new(backend), opts.dtype, opts.device.clone());
    let device = opts.device.clone();
    let before = device_free_bytes(&device);
    let mut loaded = build(
        config,
        tokenizer,
        vb,
        opts,
        &format!("loading {}", dir.display()),
    )
    .with_context(|| format!("{}: cannot load the model", dir.display()))?;
    loaded.report.fp8_weights = format.fp8_weights;
    loaded.report.skipped = format.skipped.len();
    loaded.report.device_bytes = before
        .zip(device_free_bytes(&device))
        .map(|(b, a)| b.saturating_sub(a));
    Ok(loaded)
}

/// The longest sequence a model of `config` loaded for `asked` positions takes: `asked`, at
/// most the config's `max_position_embeddings`, at least 1.
pub fn max_positions(config: &DeepSeekV3Config, asked: usize) -> usize {
    asked.min(config.max_position_embeddings).max(1)
}

/// Free memory of a GPU (after its queued work), `None` on the CPU.
pub fn device_free_bytes(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        let stream = dev.cuda_stream();
        stream.synchronize().ok()?;
        return stream
            .context()
            .mem_get_info()
            .ok()
            .map(|(free, _)| free as u64);
    }
    let _ = device;
    None
}

/// Builds a model of configuration `config` with random weights drawn on `opts.device`
/// ([`RandomInit`], seed `seed`) and the generator's byte-level tokenizer for its vocabulary.
pub fn load_random(config: DeepSeekV3Config, seed: u64, opts: LoadOptions) -> Result<LoadedModel> {
    load_random_skewed(config, seed, 0.0, opts)
}

/// [`load_random`] with routers skewed by Zipf exponent `router_skew`
/// ([`RandomInit::with_router_skew`]; 0: none).
pub fn load_random_skewed(
    config: DeepSeekV3Config,
    seed: u64,
    router_skew: f32,
    opts: LoadOptions,
) -> Result<LoadedModel> {
    config.validate()?;
    let tokenizer = TextTokenizer::from_json(&build_tokenizer_json(config.vocab_size)?)?;
    // Float weights, or those of a block-scaled fp8 checkpoint (`check` refuses any other).
    let init = match &config.quantization {
        None => RandomInit::new(seed),
        Some(q) => {
            q.check()?;
            RandomInit::fp8(seed)
        }
    }
    .with_router_skew(router_skew);
    let vb = VarBuilder::from_backend(Box::new(init.clone()), opts.dtype, opts.device.clone());
    let mut loaded = build(config, tokenizer, vb, opts, "random init")?;
    loaded.report.fp8_weights = init.fp8_weights_made();
    Ok(loaded)
}

/// The model of `config` from the tensors of `vb`.
fn build(
    config: DeepSeekV3Config,
    tokenizer: TextTokenizer,
    vb: VarBuilder,
    opts: LoadOptions,
    what: &str,
) -> Result<LoadedModel> {
    if tokenizer.vocab_size() > config.vocab_size {
        bail!(
            "tokenizer.json has {} tokens but config.json's vocab_size is {}",
            tokenizer.vocab_size(),
            config.vocab_size
        );
    }
    let max_positions = max_positions(&config, opts.max_positions);
    let rotary = Arc::new(Rotary::new(
        &config,
        max_positions,
        opts.dtype,
        &opts.device,
    )?);
    let moe_cfg = if config.has_moe() {
        Some(config.moe_config()?)
    } else {
        None
    };
    let mut progress = Progress::new(
        what,
        config.num_hidden_layers as u64,
        "layers",
        opts.progress,
    );
    let embed = candle_nn::embedding(
        config.vocab_size,
        config.hidden_size,
        vb.pp("model.embed_tokens"),
    )?;
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        let lvb = vb.pp(format!("model.layers.{i}"));
        let layer = (|| -> Result<DecoderLayer> {
            let mvb = lvb.pp("mlp");
            let ffn = match (&moe_cfg, config.is_moe_layer(i)) {
                (Some(mc), true) => match &opts.moe {
                    MoeBackend::ExpertParallel {
                        buffer,
                        options,
                        placements,
                    } => Ffn::Moe(Box::new(moe_layer::MoeLayer::load_placed(
                        mvb,
                        mc,
                        buffer.clone(),
                        *options,
                        placements.as_ref().and_then(|p| p.for_layer(i)),
                    )?)),
                    MoeBackend::Dense => Ffn::DenseMoe(DenseMoe::load(mvb, mc)?),
                },
                _ => {
                    crate::model::load_dense_mlp(mvb, config.hidden_size, config.intermediate_size)?
                }
            };
            Ok(DecoderLayer {
                input_norm: candle_nn::rms_norm(
                    config.hidden_size,
                    config.rms_norm_eps,
                    lvb.pp("input_layernorm"),
                )?,
                attn: Attention::load(lvb.pp("self_attn"), &config, rotary.clone())?,
                post_norm: candle_nn::rms_norm(
                    config.hidden_size,
                    config.rms_norm_eps,
                    lvb.pp("post_attention_layernorm"),
                )?,
                ffn,
            })
        })()
        .with_context(|| format!("cannot load layer {i}"))?;
        layers.push(layer);
        progress.inc(1);
    }
    let norm = candle_nn::rms_norm(config.hidden_size, config.rms_norm_eps, vb.pp("model.norm"))?;
    let lm_head = if config.tie_word_embeddings {
        candle_nn::Linear::new(embed.embeddings().clone(), None)
    } else {
        candle_nn::Linear::new(
            moe_layer::fp8::load_weight(&vb.pp("lm_head"), config.vocab_size, config.hidden_size)?,
            None,
        )
    };
    progress.finish();
    let kv_shape = KvShape {
        layers: config.num_hidden_layers,
        latent: config.kv_lora_rank,
        rope: config.qk_rope_head_dim,
    };
    let model = DeepSeekV3::new(embed, layers, norm, lm_head, rotary, kv_shape)?;
    Ok(LoadedModel {
        config,
        model,
        tokenizer,
        report: LoadReport::default(),
    })
}
