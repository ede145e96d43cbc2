//! The memory plan of one rank (docs/design.md, "Memory plan"): the bytes of its weights by
//! kind, its KV cache and its expert-parallel buffers, computed from the shapes before anything
//! is allocated, and the check that they fit the GPU with a reserve for activations, so that a
//! model too large for its ranks is refused at start with the figures instead of failing an
//! allocation halfway through the load.

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use moe_layer::ep_runtime::{BufferBytes, BufferConfig};
use moe_layer::{WeightBytes, WeightTarget};

use crate::attention::Attention;
use crate::config::{DeepSeekV3Config, Quantization};
use crate::kv_cache::{KvCache, KvShape};
use crate::model::ModelBytes;

/// What a rank is planned for.
#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    /// The model.
    pub config: &'a DeepSeekV3Config,
    /// Ranks (the routed experts are spread over them; everything else is on each).
    pub world_size: usize,
    /// Ranks per node.
    pub gpus_per_node: usize,
    /// Dtype of the float weights and the KV cache.
    pub dtype: DType,
    /// Whether the rank runs on a GPU (fp8 experts stay fp8 there; the EP buffers take device
    /// memory).
    pub on_gpu: bool,
    /// Whether the weights come from a checkpoint in the block-scaled fp8 release format.
    pub fp8_checkpoint: bool,
    /// KV cache slots (live sequences).
    pub kv_sequences: usize,
    /// Positions asked for each sequence (at most the model's `max_position_embeddings`).
    pub max_positions: usize,
    /// The rank's expert-parallel buffer.
    pub buffer: &'a BufferConfig,
    /// Redundant expert slots of every MoE layer (`--num-redundant-experts`).
    pub redundant_experts: usize,
}

/// The bytes one rank holds on its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Weights by kind (what the loaded model then reports, `DeepSeekV3::weight_bytes`).
    pub weights: ModelBytes,
    /// The KV cache.
    pub kv_cache: usize,
    /// Its sequences and positions.
    pub kv_slots: (usize, usize),
    /// The expert-parallel buffers (none on the CPU, where they are host memory).
    pub ep_buffers: BufferBytes,
}

/// `b` bytes in GiB.
fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// `b` bytes in GiB, or MiB below 1 GiB.
pub fn size(b: usize) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", gib(b))
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

impl MemoryPlan {
    /// The plan of one rank.
    pub fn new(p: &PlanInput<'_>) -> Result<Self> {
        let cfg = p.config;
        let d = p.dtype.size_in_bytes();
        let h = cfg.hidden_size;
        let head = if cfg.tie_word_embeddings { 0 } else { 1 };
        let mut weights = ModelBytes {
            other: (1 + head) * cfg.vocab_size * h * d + h * d,
            ..Default::default()
        };
        let moe = if cfg.has_moe() {
            let target = WeightTarget {
                num_ranks: p.world_size,
                dtype: p.dtype,
                cuda: p.on_gpu,
                fp8_experts: p.fp8_checkpoint,
                redundant_experts: p.redundant_experts,
            };
            Some(WeightBytes::planned(&cfg.moe_config()?, target)?)
        } else {
            None
        };
        // Projections of an fp8 checkpoint that stay fp8 on a GPU (`Fp8Linear`, `Fp8Mlp`).
        let fp8_on_gpu = p.fp8_checkpoint && p.on_gpu;
        for i in 0..cfg.num_hidden_layers {
            weights.other += Attention::planned_bytes(cfg, d, fp8_on_gpu) + 2 * h * d;
            match (&moe, cfg.is_moe_layer(i)) {
                (Some(w), true) => {
                    weights.routed_experts += w.routed;
                    weights.shared_experts += w.shared;
                    weights.other += w.router;
                }
                _ => weights.other += crate::model::dense_mlp_bytes(cfg, d, fp8_on_gpu),
            }
        }
        let positions = crate::loader::max_positions(cfg, p.max_positions);
        let shape = KvShape {
            layers: cfg.num_hidden_layers,
            latent: cfg.kv_lora_rank,
            rope: cfg.qk_rope_head_dim,
        };
        let ep_buffers = if p.on_gpu && cfg.has_moe() {
            p.buffer.device_bytes(p.world_size, p.gpus_per_node)?
        } else {
            BufferBytes::default()
        };
        Ok(Self {
            weights,
            kv_cache: KvCache::bytes(shape, p.kv_sequences, positions, p.dtype),
            kv_slots: (p.kv_sequences, positions),
            ep_buffers,
        })
    }

    /// All of it.
    pub fn total(&self) -> usize {
        self.weights.total() + self.kv_cache + self.ep_buffers.total()
    }

    /// What a GPU of `total` bytes keeps free beyond the plan for activations, the pool's
    /// fragments and library workspaces: 5 % of it, at least 1 GiB.
    pub fn reserve(total: usize) -> usize {
        (total / 20).max(1 << 30)
    }

    /// One line: the total and its parts.
    pub fn summary(&self) -> String {
        let w = &self.weights;
        format!(
            "{}: weights {} (routed experts {}, shared experts {}, other {}), KV cache {} ({} \
             sequences x {} positions), EP buffers {}",
            size(self.total()),
            size(w.total()),
            size(w.routed_experts),
            size(w.shared_experts),
            size(w.other),
            size(self.kv_cache),
            self.kv_slots.0,
            self.kv_slots.1,
            size(self.ep_buffers.total()),
        )
    }

    /// Checks that the plan and a reserve of `reserve` bytes fit the `free` bytes of a GPU;
    /// the error gives the figures and what would make it fit.
    pub fn check_fits(&self, free: usize, reserve: usize) -> Result<()> {
        if self.total() + reserve <= free {
            return Ok(());
        }
        bail!(
            "the rank needs {} and {} for activations, but its GPU has {} free: \
             use more ranks (WORLD_SIZE: the routed experts spread over them), an fp8 \
             checkpoint, fewer sequences (--max-batch) or a shorter context",
            self.summary(),
            size(reserve),
            size(free)
        )
    }
}

/// Whether `config` is a block-scaled fp8 checkpoint's.
pub fn is_fp8(config: &DeepSeekV3Config) -> bool {
    matches!(config.quantization, Some(Quantization::Fp8 { .. }))
}

/// `(free, total)` bytes of a GPU, `None` on the CPU.
pub fn device_memory(device: &Device) -> Option<(usize, usize)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        return dev.cuda_stream().context().mem_get_info().ok();
    }
    let _ = device;
    None
}
