//! The subcommands: `gen-checkpoint` (here), [`generate`], [`serve`], [`bench_serve`] (and
//! `launch`, in [`crate::launch`]); the model options `generate` and `serve` share, and
//! [`start`], which joins the job and loads this rank's part of the model.

mod generate;
mod serve;

pub use generate::{generate, GenerateArgs};
pub use serve::{serve, ServeArgs};

pub use crate::bench::{bench_serve, BenchArgs};

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use candle_core::DType;
use clap::{Args, ValueEnum};
use moe_layer::ep_runtime::BufferConfig;

use crate::checkpoint;
use crate::config::DeepSeekV3Config;
use crate::dist::{select_device, Dist, RankInfo};
use crate::engine::{Cluster, Engine};
use crate::kv_cache::KvCache;
use crate::loader::{self, LoadOptions, MoeBackend};
use crate::tokenizer::TextTokenizer;

/// Options of `gen-checkpoint`.
#[derive(Args, Debug, Clone)]
pub struct GenCheckpointArgs {
    /// Folder to write `config.json`, `tokenizer.json` and the safetensors shards into.
    #[arg(long)]
    pub out: PathBuf,
    /// Random seed of the weights.
    #[arg(long, default_value_t = checkpoint::DEFAULT_SEED)]
    pub seed: u64,
    /// Number of safetensors shards.
    #[arg(long, default_value_t = 2)]
    pub shards: usize,
    /// A `config.json` to use instead of the tiny preset.
    #[arg(long)]
    pub config: Option<PathBuf>,
}

/// `gen-checkpoint`: writes a random checkpoint.
pub fn gen_checkpoint(args: &GenCheckpointArgs) -> Result<()> {
    let cfg = match &args.config {
        Some(p) => DeepSeekV3Config::from_file(p)?,
        None => DeepSeekV3Config::tiny(),
    };
    checkpoint::generate_reporting(&args.out, &cfg, args.seed, args.shards, true)?;
    println!("wrote {}", args.out.display());
    Ok(())
}

/// Where the weights come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum InitMode {
    /// Read them from `--model` (or the tiny default checkpoint, generated on first use).
    Checkpoint,
    /// Make them at random on the device, for the model of `--config` (a benchmark mode: no
    /// checkpoint is written or read).
    Random,
}

/// Options shared by `generate` and `serve`: the model and how it runs.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Checkpoint folder (`config.json`, `*.safetensors`, `tokenizer.json`); without it the
    /// embedded tiny checkpoint is generated into the cache folder and used.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the weights come from: `checkpoint` (`--model`, or the tiny default) or `random`
    /// (made on the device for the model of `--config`; nothing is read or written).
    #[arg(long, value_enum, default_value_t = InitMode::Checkpoint)]
    pub init: InitMode,
    /// With `--init random`: the model's `config.json` (default: the tiny preset), e.g.
    /// `examples/deepseek-v3/configs/deepseek-v2-lite.json`.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// With `--init random`: seed of the weights.
    #[arg(long, default_value_t = checkpoint::DEFAULT_SEED)]
    pub init_seed: u64,
    /// Run on the CPU even in a `cuda` build.
    #[arg(long)]
    pub cpu: bool,
    /// Weight dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Most live sequences per rank (also the low-latency MoE token limit per rank, and the
    /// number of KV cache slots, allocated at start).
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Most prompt tokens of one prefill step on each rank (new sequences wait for the next
    /// step beyond it; a longer prompt goes alone).
    #[arg(long, default_value_t = 8192)]
    pub max_prefill_tokens: usize,
    /// Send dispatched activations in FP8.
    #[arg(long)]
    pub fp8_dispatch: bool,
    /// Size every prefill dispatch's outputs exactly, reading the received count on the host,
    /// instead of for --max-prefill-tokens on every rank (worst-case outputs, with the shared
    /// experts queued first: no host wait inside a step; a step over the bound, a long prompt
    /// alone, runs exactly anyway). Worst-case outputs are for one node of GPUs.
    #[arg(long)]
    pub exact_prefill_outputs: bool,
    /// Seconds any rank may wait for another before failing.
    #[arg(long, default_value_t = 60)]
    pub timeout_secs: u64,
    /// Launch decode steps kernel by kernel instead of replaying whole steps captured in CUDA
    /// graphs (which CUDA runs do by default, on one GPU or several).
    #[arg(long)]
    pub eager_decode: bool,
}

fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype {other:?} is not supported (f32, bf16, f16)"),
    })
}

/// Where [`start`] takes the model from.
enum Source {
    Checkpoint(PathBuf),
    Random,
}

impl ModelArgs {
    /// Checks the combination of options and reads the model configuration.
    fn source(&self, info: &RankInfo) -> Result<(Source, DeepSeekV3Config)> {
        if self.max_batch == 0 {
            bail!("--max-batch must be at least 1, got 0");
        }
        if self.max_prefill_tokens == 0 {
            bail!("--max-prefill-tokens must be at least 1, got 0");
        }
        match self.init {
            InitMode::Checkpoint => {
                if let Some(c) = &self.config {
                    bail!(
                        "--config {} needs --init random (a checkpoint brings its own config.json)",
                        c.display()
                    );
                }
                let dir = match &self.model {
                    Some(d) => d.clone(),
                    None => checkpoint::ensure_default_checkpoint(info.local_rank == 0)?,
                };
                let cfg = DeepSeekV3Config::from_file(dir.join("config.json"))?;
                Ok((Source::Checkpoint(dir), cfg))
            }
            InitMode::Random => {
                if let Some(m) = &self.model {
                    bail!(
                        "--model {} and --init random exclude each other (random weights need \
                         only --config)",
                        m.display()
                    );
                }
                let cfg = match &self.config {
                    Some(p) => DeepSeekV3Config::from_file(p)?,
                    None => DeepSeekV3Config::tiny(),
                };
                Ok((Source::Random, cfg))
            }
        }
    }
}

/// Joins the job, loads this rank's part of the model (or makes it, with `--init random`),
/// allocates its KV cache, and returns the rank's [`Cluster`] and the tokenizer.
/// `max_positions` bounds sequence length (prompt plus generated tokens).
pub fn start(args: &ModelArgs, max_positions: usize) -> Result<(Cluster, TextTokenizer)> {
    let info = RankInfo::from_env()?;
    let dtype = parse_dtype(&args.dtype)?;
    let (source, cfg) = args.source(&info)?;
    let device = select_device(&info, args.cpu)?;
    let mut buffer_cfg =
        BufferConfig::default().with_timeout(Duration::from_secs(args.timeout_secs));
    if let Some(e) = cfg.n_routed_experts.filter(|_| cfg.has_moe()) {
        if e % info.world_size != 0 {
            bail!(
                "n_routed_experts = {e} is not divisible by WORLD_SIZE = {}",
                info.world_size
            );
        }
        buffer_cfg = buffer_cfg.with_low_latency(args.max_batch, cfg.hidden_size, e);
        // Across nodes (CUDA with `nvshmem`) the normal mode runs the internode kernels over a
        // buffer of this many tokens per op; longer steps run as several ops. Ignored on one
        // node.
        if let Some(k) = cfg.num_experts_per_tok {
            buffer_cfg = buffer_cfg.with_internode(args.max_prefill_tokens, cfg.hidden_size, k);
        }
    }
    let what = match &source {
        Source::Checkpoint(dir) => dir.display().to_string(),
        Source::Random => format!(
            "random init (seed {}): {:.2} B parameters, {:.1} GiB in {}",
            args.init_seed,
            cfg.num_parameters() as f64 / 1e9,
            (cfg.num_parameters() * dtype.size_in_bytes()) as f64 / (1u64 << 30) as f64,
            args.dtype
        ),
    };
    tracing::info!(rank = info.rank, world = info.world_size, model = %what, ?device, "starting");
    let dist = Dist::init(info, &device, buffer_cfg)?;
    // `..Default::default()` keeps this working when the options grow new fields.
    #[allow(clippy::needless_update)]
    // Worst-case prefill outputs with the shared experts first: what left the least of the
    // transfers exposed at 4 ranks (docs/benchmarks.md); one node only.
    let worst_case = !args.exact_prefill_outputs
        && info.world_size > 1
        && dist.buffer.normal_mode_max_tokens().is_none();
    let options = moe_layer::MoeLayerOptions {
        mode: moe_layer::Mode::Auto,
        low_latency_max_tokens: args.max_batch,
        fp8_dispatch: args.fp8_dispatch,
        normal_max_tokens_per_rank: worst_case.then_some(args.max_prefill_tokens),
        shared_before_dispatch: worst_case,
        ..Default::default()
    };
    let opts = LoadOptions {
        device,
        dtype,
        max_positions,
        moe: MoeBackend::ExpertParallel {
            buffer: dist.buffer.clone(),
            options,
        },
        progress: info.local_rank == 0,
    };
    let loaded = match source {
        Source::Checkpoint(dir) => loader::load(&dir, opts)?,
        Source::Random => loader::load_random(cfg, args.init_seed, opts)?,
    };
    let kv_bytes = KvCache::bytes(
        loaded.model.kv_shape(),
        args.max_batch,
        loaded.model.max_positions(),
        dtype,
    );
    tracing::info!(
        rank = info.rank,
        "model ready; KV cache: {} sequences x {} positions = {:.1} MiB",
        args.max_batch,
        loaded.model.max_positions(),
        kv_bytes as f64 / (1 << 20) as f64
    );
    Ok((
        Cluster {
            engine: Engine::new(loaded.model, info.rank, args.max_batch)?
                .with_decode_graphs(!args.eager_decode),
            dist,
        },
        loaded.tokenizer,
    ))
}

impl Cluster {
    /// Ranks other than 0: follow rank 0's steps, then finish the job cleanly.
    pub fn engine_follow(&mut self) -> Result<()> {
        self.follow()?;
        self.dist.finish(Duration::from_secs(60))
    }
}
