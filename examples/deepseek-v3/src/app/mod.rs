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

use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::{Args, ValueEnum};
use moe_layer::ep_runtime::BufferConfig;

use crate::checkpoint;
use crate::config::DeepSeekV3Config;
use crate::dist::{select_device, Dist, RankInfo};
use crate::engine::{Cluster, Engine};
use crate::kv_cache::KvCache;
use crate::loader::{self, LoadOptions, MoeBackend};
use crate::memory_plan::{self, MemoryPlan, PlanInput};
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
    /// Write the linear projections in DeepSeek-V3's block-scaled FP8 format (`fp8`: e4m3 with
    /// one f32 `weight_scale_inv` per 128 x 128 block, and an fp8 `quantization_config`) or as
    /// floats (`none`); default: as the config says.
    #[arg(long)]
    pub quant: Option<QuantArg>,
    /// dtype of the other tensors: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

/// The weight formats `gen-checkpoint --quant` writes and `--init random --quant` makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QuantArg {
    /// DeepSeek-V3's block-scaled FP8.
    Fp8,
    /// Floats (no `quantization_config`).
    None,
}

impl QuantArg {
    /// `cfg` with this format's `quantization_config`.
    fn apply(self, cfg: &mut DeepSeekV3Config) {
        cfg.quantization = match self {
            QuantArg::Fp8 => Some(crate::config::Quantization::Fp8 {
                block: crate::config::FP8_BLOCK,
                scale_fmt: crate::config::ScaleFmt::Float,
            }),
            QuantArg::None => None,
        };
    }
}

/// `gen-checkpoint`: writes a random checkpoint.
pub fn gen_checkpoint(args: &GenCheckpointArgs) -> Result<()> {
    let mut cfg = match &args.config {
        Some(p) => DeepSeekV3Config::from_file(p)?,
        None => DeepSeekV3Config::tiny(),
    };
    if let Some(q) = args.quant {
        q.apply(&mut cfg);
    }
    let storage = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => bail!("gen-checkpoint --dtype {other:?} is not supported (f32, bf16)"),
    };
    checkpoint::generate_stored(&args.out, &cfg, args.seed, args.shards, storage, true)?;
    println!("wrote {}", args.out.display());
    Ok(())
}

/// The one line an error is reported as: every cause once, in words. Candle's errors are
/// unwrapped (the typed error a layer wrapped, without the Debug form candle prints beside it),
/// and their backtraces are shown only when `RUST_BACKTRACE` is set.
pub fn error_report(e: &anyhow::Error) -> String {
    let backtraces = std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0");
    report_with(e, backtraces)
}

/// [`error_report`], with or without candle's backtraces.
fn report_with(e: &anyhow::Error, backtraces: bool) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = match cause.downcast_ref::<candle_core::Error>() {
            Some(c) => describe_candle(c, backtraces),
            None => cause.to_string(),
        };
        if parts.last() != Some(&text) {
            parts.push(text);
        }
    }
    parts.join(": ")
}

fn describe_candle(e: &candle_core::Error, backtraces: bool) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, backtrace } => {
            let text = describe_candle(inner, backtraces);
            if backtraces {
                format!("{text}\n{backtrace}")
            } else {
                text
            }
        }
        candle_core::Error::WrappedContext { wrapped, .. } => wrapped.to_string(),
        candle_core::Error::Context { inner, context } => {
            format!("{context}: {}", describe_candle(inner, backtraces))
        }
        other => other.to_string(),
    }
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
    /// With `--init random`: skew the routers so that expert loads are lumpy, roughly
    /// Zipf(S) over each layer's experts (its correction bias; 0: even).
    #[arg(long, default_value_t = 0.0)]
    pub init_router_skew: f32,
    /// With `--init random`: the weights' format, `fp8` (every linear projection in
    /// DeepSeek-V3's block-scaled FP8, as an fp8 checkpoint holds them: the experts run the fp8
    /// grouped GEMMs on a GPU) or `none` (floats); default: as the config says.
    #[arg(long)]
    pub quant: Option<QuantArg>,
    /// Run on the CPU even in a `cuda` build.
    #[arg(long)]
    pub cpu: bool,
    /// Weight and activation dtype: `auto` (bf16 on a GPU, f32 on the CPU), f32, bf16 or f16.
    /// A GPU runs bf16 (with fp8 experts for an fp8 checkpoint).
    #[arg(long, default_value = "auto")]
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
    /// Redundant expert slots of every MoE layer: `n_routed_experts + r` slots over the ranks
    /// (divisible by WORLD_SIZE), placed by DeepSeek's EPLB algorithm so that the loads of
    /// `--expert-loads` (equal loads without it) spread evenly over the GPUs.
    #[arg(long, default_value_t = 0)]
    pub num_redundant_experts: usize,
    /// Expert loads to place the experts by (JSON: an array of `n_routed_experts` numbers for
    /// every MoE layer, or an object of layer index -> array).
    #[arg(long)]
    pub expert_loads: Option<PathBuf>,
    /// Read the experts' load statistics every N compute steps (summed over the ranks; each
    /// MoE layer's imbalance in /metrics); 0: never, unless `--eplb-interval` asks.
    #[arg(long, default_value_t = 0)]
    pub expert_stats_interval: usize,
    /// Re-place every MoE layer's experts every N compute steps from the last
    /// `--eplb-window` reads of the statistics (DeepSeek's EPLB; only the experts that change
    /// place move, between ranks, while serving); 0: never.
    #[arg(long, default_value_t = 0)]
    pub eplb_interval: usize,
    /// Reads of the load statistics a re-placement is computed from.
    #[arg(long, default_value_t = 4)]
    pub eplb_window: usize,
    /// Least fraction by which a re-placement must lower a layer's max / mean load over the
    /// ranks to be applied (moving experts holds the steps meanwhile).
    #[arg(long, default_value_t = 0.05)]
    pub eplb_min_gain: f64,
}

impl ModelArgs {
    /// Steps between two reads of the load statistics: `--expert-stats-interval`, else
    /// `--eplb-interval`.
    fn stats_interval(&self) -> usize {
        if self.expert_stats_interval > 0 {
            self.expert_stats_interval
        } else {
            self.eplb_interval
        }
    }
}

/// The dtype `--dtype` asks for on `device`: `auto` is bf16 on a GPU and f32 on the CPU; a
/// GPU runs bf16 only (its expert-parallel buffers and grouped GEMMs are bf16), so another
/// dtype there is refused before anything is loaded.
fn parse_dtype(s: &str, device: &candle_core::Device) -> Result<DType> {
    let dtype = match s {
        "auto" if device.is_cuda() => DType::BF16,
        "auto" | "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype {other:?} is not supported (auto, f32, bf16, f16)"),
    };
    if device.is_cuda() && dtype != DType::BF16 {
        bail!(
            "--dtype {s} is not supported on a GPU, which runs bf16 (the default there); \
             use --dtype bf16, or --cpu for {s}"
        );
    }
    Ok(dtype)
}

/// The expert-parallel buffer of a rank of `world_size` for `cfg`: the low-latency mode sized
/// for `max_batch` tokens per rank, the internode normal mode (across nodes) for
/// `max_prefill_tokens`; waits time out after `timeout`.
pub fn buffer_config(
    cfg: &DeepSeekV3Config,
    world_size: usize,
    max_batch: usize,
    max_prefill_tokens: usize,
    timeout: Duration,
) -> Result<BufferConfig> {
    let mut buffer_cfg = BufferConfig::default().with_timeout(timeout);
    if let Some(e) = cfg.n_routed_experts.filter(|_| cfg.has_moe()) {
        if e % world_size != 0 {
            bail!("n_routed_experts = {e} is not divisible by WORLD_SIZE = {world_size}");
        }
        buffer_cfg = buffer_cfg.with_low_latency(max_batch, cfg.hidden_size, e);
        // Across nodes (CUDA with `nvshmem`) the normal mode runs the internode kernels over a
        // buffer of this many tokens per op; longer steps run as several ops. Ignored on one
        // node.
        if let Some(k) = cfg.num_experts_per_tok {
            buffer_cfg = buffer_cfg.with_internode(max_prefill_tokens, cfg.hidden_size, k);
        }
    }
    Ok(buffer_cfg)
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
                if let Some(q) = self.quant {
                    bail!(
                        "--quant {} needs --init random (a checkpoint brings its own format)",
                        q.to_possible_value()
                            .map_or("?".into(), |v| v.get_name().to_string())
                    );
                }
                if self.init_router_skew != 0.0 {
                    bail!(
                        "--init-router-skew {} needs --init random (a checkpoint brings its own \
                         routers)",
                        self.init_router_skew
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
                let mut cfg = match &self.config {
                    Some(p) => DeepSeekV3Config::from_file(p)?,
                    None => DeepSeekV3Config::tiny(),
                };
                if let Some(q) = self.quant {
                    q.apply(&mut cfg);
                }
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
    let (source, cfg) = args.source(&info)?;
    let device = select_device(&info, args.cpu)?;
    let dtype = parse_dtype(&args.dtype, &device)?;
    let placements = if args.eplb_interval > 0 {
        // Re-placement changes a placement: every MoE layer starts with one.
        Some(crate::placements::ExpertPlacements::plan_always(
            &cfg,
            info.world_size,
            info.local_world_size,
            args.num_redundant_experts,
            args.expert_loads.as_deref(),
        )?)
    } else {
        crate::placements::ExpertPlacements::plan(
            &cfg,
            info.world_size,
            info.local_world_size,
            args.num_redundant_experts,
            args.expert_loads.as_deref(),
        )?
    }
    .map(std::sync::Arc::new);
    let eplb_shape = match &placements {
        Some(p) => Some(p.shape()),
        None if args.stats_interval() > 0 => Some(
            crate::placements::ExpertPlacements::plan_always(
                &cfg,
                info.world_size,
                info.local_world_size,
                0,
                None,
            )?
            .shape(),
        ),
        None => None,
    };
    let mut buffer_cfg = buffer_config(
        &cfg,
        info.world_size,
        args.max_batch,
        args.max_prefill_tokens,
        Duration::from_secs(args.timeout_secs),
    )?;
    if let Some(p) = &placements {
        // The low-latency buffers hold a slot per physical expert.
        buffer_cfg = buffer_cfg.with_low_latency(args.max_batch, cfg.hidden_size, p.num_physical);
    }
    // What this rank will hold, checked against its GPU before anything is allocated.
    let plan = MemoryPlan::new(&PlanInput {
        config: &cfg,
        world_size: info.world_size,
        gpus_per_node: info.local_world_size,
        dtype,
        on_gpu: device.is_cuda(),
        fp8_checkpoint: memory_plan::is_fp8(&cfg),
        kv_sequences: args.max_batch,
        max_positions,
        buffer: &buffer_cfg,
        redundant_experts: args.num_redundant_experts,
    })?;
    let free = match memory_plan::device_memory(&device) {
        Some((free, total)) => {
            plan.check_fits(free, MemoryPlan::reserve(total))
                .with_context(|| format!("rank {}: the model does not fit", info.rank))?;
            format!(" of {} free", memory_plan::size(free))
        }
        None => String::new(),
    };
    eprintln!("rank {}: memory plan {}{free}", info.rank, plan.summary());
    let what = match &source {
        Source::Checkpoint(dir) => dir.display().to_string(),
        Source::Random => format!(
            "random init (seed {}): {:.2} B parameters, {}",
            args.init_seed,
            cfg.num_parameters() as f64 / 1e9,
            if memory_plan::is_fp8(&cfg) {
                "projections in block-scaled fp8"
            } else {
                dtype.as_str()
            }
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
            placements,
        },
        progress: info.local_rank == 0,
    };
    let loaded = match source {
        Source::Checkpoint(dir) => loader::load(&dir, opts)?,
        Source::Random => {
            loader::load_random_skewed(cfg, args.init_seed, args.init_router_skew, opts)?
        }
    };
    let r = &loaded.report;
    // One line per rank at load: what the weights take, by kind.
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    let w = loaded.model.weight_bytes();
    let dense_fp8 = loaded.model.fp8_dense_weights();
    let fp8 = match (r.fp8_weights, loaded.model.fp8_experts()) {
        (0, _) => String::new(),
        (n, true) => format!(
            "; {n} fp8 weights: experts and {dense_fp8} attention and dense-MLP weights kept in \
             fp8, the rest dequantized to {}",
            dtype.as_str()
        ),
        (n, false) if dense_fp8 > 0 => format!(
            "; {n} fp8 weights: {dense_fp8} attention and dense-MLP weights kept in fp8, the \
             rest dequantized to {}",
            dtype.as_str()
        ),
        (n, false) => format!("; {n} fp8 weights dequantized to {}", dtype.as_str()),
    };
    let device = r.device_bytes.map_or(String::new(), |b| {
        format!(
            "; device memory taken by the load {:.1} MiB",
            mib(b as usize)
        )
    });
    eprintln!(
        "rank {}: weights {:.1} MiB (routed experts {:.1}, shared experts {:.1}, other {:.1}){fp8}{device}",
        info.rank,
        mib(w.total()),
        mib(w.routed_experts),
        mib(w.shared_experts),
        mib(w.other)
    );
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
    let mut model = loaded.model;
    // Load statistics switched on before any step is captured.
    let eplb = match eplb_shape.filter(|_| args.stats_interval() > 0) {
        Some(shape) => {
            // Re-placed weights travel on a mesh of their own, beside the steps.
            let transport = if args.eplb_interval > 0 {
                dist.side_transport("eplb-weights")?
            } else {
                None
            };
            Some(crate::eplb::Eplb::new(
                crate::eplb::EplbOptions {
                    stats_interval: args.stats_interval(),
                    replace_interval: args.eplb_interval,
                    window: args.eplb_window,
                    min_gain: args.eplb_min_gain,
                    shape,
                },
                &mut model,
                transport,
                // Gigabytes of weights may be on the way: longer than a step's timeout.
                Duration::from_secs(args.timeout_secs.saturating_mul(10)),
            )?)
        }
        None => None,
    };
    let engine =
        Engine::new(model, info.rank, args.max_batch)?.with_decode_graphs(!args.eager_decode);
    let membership = dist.membership()?;
    let cluster = Cluster::new(engine, dist).with_membership(membership);
    let cluster = match eplb {
        Some(e) => cluster.with_eplb(e),
        None => cluster,
    };
    Ok((cluster, loaded.tokenizer))
}

impl Cluster {
    /// Ranks other than 0: follow rank 0's steps, then finish the job cleanly.
    pub fn engine_follow(&mut self) -> Result<()> {
        self.follow()?;
        self.finish(Duration::from_secs(60))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_error_is_reported_once_in_words() {
        let layer = moe_layer::Error::invalid("x", "f32", "expected bf16 (CUDA buffers)");
        let candle: candle_core::Error = layer.into();
        let e = anyhow::Error::from(candle.bt()).context("cannot load layer 0");
        let text = report_with(&e, false);
        assert_eq!(
            text,
            "cannot load layer 0: invalid argument `x` = f32: expected bf16 (CUDA buffers)"
        );
    }

    #[test]
    fn auto_dtype_is_f32_on_the_cpu_and_other_dtypes_parse() {
        let cpu = candle_core::Device::Cpu;
        assert_eq!(parse_dtype("auto", &cpu).unwrap(), DType::F32);
        assert_eq!(parse_dtype("bf16", &cpu).unwrap(), DType::BF16);
        assert!(parse_dtype("f64", &cpu).is_err());
    }
}
