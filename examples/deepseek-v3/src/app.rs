//! The subcommands: `gen-checkpoint`, `generate` and `serve` (and `launch`, in [`crate::launch`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::Args;
use moe_layer::ep_runtime::BufferConfig;
use tokio::sync::mpsc::unbounded_channel;

use crate::checkpoint;
use crate::config::DeepSeekV3Config;
use crate::dist::{select_device, Dist, RankInfo};
use crate::engine::{Cluster, Engine};
use crate::loader::{self, LoadOptions, MoeBackend};
use crate::sampling::SamplingParams;
use crate::scheduler::{self, GenEvent, GenRequest, SchedulerConfig};
use crate::server::{self, AppState, Limits};
use crate::tokenizer::{ChatMessage, TextTokenizer};

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
    checkpoint::generate(&args.out, &cfg, args.seed, args.shards)?;
    println!("wrote {}", args.out.display());
    Ok(())
}

/// Options shared by `generate` and `serve`: the model and how it runs.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Checkpoint folder (`config.json`, `*.safetensors`, `tokenizer.json`); without it the
    /// embedded tiny checkpoint is generated into the cache folder and used.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Run on the CPU even in a `cuda` build.
    #[arg(long)]
    pub cpu: bool,
    /// Weight dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Most live sequences per rank (also the low-latency MoE token limit per rank).
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Send dispatched activations in FP8.
    #[arg(long)]
    pub fp8_dispatch: bool,
    /// Seconds any rank may wait for another before failing.
    #[arg(long, default_value_t = 60)]
    pub timeout_secs: u64,
}

fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype {other:?} is not supported (f32, bf16, f16)"),
    })
}

/// Joins the job, loads this rank's part of the model, and returns the rank's [`Cluster`] and
/// the tokenizer. `max_positions` bounds sequence length (prompt plus generated tokens).
pub fn start(args: &ModelArgs, max_positions: usize) -> Result<(Cluster, TextTokenizer)> {
    if args.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    let info = RankInfo::from_env()?;
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => checkpoint::ensure_default_checkpoint()?,
    };
    let cfg = DeepSeekV3Config::from_file(dir.join("config.json"))?;
    let device = select_device(&info, args.cpu)?;
    let dtype = parse_dtype(&args.dtype)?;
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
    }
    tracing::info!(rank = info.rank, world = info.world_size, model = %dir.display(), ?device, "starting");
    let dist = Dist::init(info, &device, buffer_cfg)?;
    // `..Default::default()` keeps this working when the options grow new fields.
    #[allow(clippy::needless_update)]
    let options = moe_layer::MoeLayerOptions {
        mode: moe_layer::Mode::Auto,
        low_latency_max_tokens: args.max_batch,
        fp8_dispatch: args.fp8_dispatch,
        ..Default::default()
    };
    let loaded = loader::load(
        &dir,
        LoadOptions {
            device,
            dtype,
            max_positions,
            moe: MoeBackend::ExpertParallel {
                buffer: dist.buffer.clone(),
                options,
            },
            progress: info.local_rank == 0,
        },
    )?;
    tracing::info!(rank = info.rank, "model loaded");
    Ok((
        Cluster {
            engine: Engine::new(loaded.model, info.rank),
            dist,
        },
        loaded.tokenizer,
    ))
}

/// Options of `generate`.
#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The model and how it runs.
    #[command(flatten)]
    pub model: ModelArgs,
    /// A prompt (repeat for several; they are spread over the ranks).
    #[arg(long = "prompt", required = true)]
    pub prompts: Vec<String>,
    /// Wrap each prompt as a user message in the chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate per prompt.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Random seed (prompt `i` uses `seed + i`, wherever it runs).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A string that ends generation (repeatable); the end-of-sentence token always does.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// A token id that ends generation (repeatable), besides the end-of-sentence token.
    #[arg(long = "stop-token-id")]
    pub stop_token_ids: Vec<u32>,
    /// Print one JSON object per prompt (index, prompt, text, tokens, finish_reason).
    #[arg(long)]
    pub json: bool,
}

/// `generate`: every rank loads its part; rank 0 runs the scheduler over all prompts and prints
/// the results in prompt order.
pub fn generate(args: &GenerateArgs) -> Result<()> {
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    // Prompt lengths are only known after tokenizing; 4 bytes per character bounds them.
    let longest = args
        .prompts
        .iter()
        .map(|p| p.len() + 64)
        .max()
        .unwrap_or(64);
    let (mut cluster, tokenizer) = start(&args.model, longest + args.max_tokens + 1)?;
    if cluster.dist.info.rank != 0 {
        cluster.engine_follow()?;
        return Ok(());
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let (ev_tx, mut ev_rx) = unbounded_channel();
    let mut prompt_ids = Vec::new();
    for (i, p) in args.prompts.iter().enumerate() {
        let ids = if args.chat {
            tokenizer.apply_chat_template(&[ChatMessage {
                role: "user".into(),
                content: p.clone(),
            }])?
        } else {
            tokenizer.encode_prompt(p)?
        };
        prompt_ids.push(ids.clone());
        tx.send(GenRequest {
            index: i,
            prompt: ids,
            max_tokens: args.max_tokens,
            sampling: SamplingParams {
                temperature: args.temperature,
                top_p: args.top_p,
                seed: args.seed.wrapping_add(i as u64),
            },
            stop_tokens: tokenizer
                .eos_id()
                .into_iter()
                .chain(args.stop_token_ids.iter().copied())
                .collect(),
            stop_strings: args.stop.clone(),
            events: ev_tx.clone(),
        })?;
    }
    drop(tx);
    drop(ev_tx);
    scheduler::run(
        &mut cluster,
        &tokenizer,
        rx,
        SchedulerConfig {
            max_batch_per_rank: args.model.max_batch,
            heartbeat: Duration::from_millis(200),
        },
    )?;
    let mut results = vec![None; args.prompts.len()];
    while let Ok(ev) = ev_rx.try_recv() {
        if let GenEvent::Done {
            index,
            text,
            tokens,
            finish_reason,
            ..
        } = ev
        {
            results[index] = Some((text, tokens, finish_reason));
        }
    }
    for (i, r) in results.into_iter().enumerate() {
        let (text, tokens, reason) = r.with_context(|| format!("prompt {i} got no result"))?;
        if args.json {
            let line = serde_json::json!({
                "index": i, "prompt": args.prompts[i], "prompt_tokens": prompt_ids[i].len(),
                "text": text, "tokens": tokens, "finish_reason": reason
            });
            println!("{line}");
        } else {
            println!("=== [{i}] {}", args.prompts[i]);
            println!("{text}");
        }
    }
    cluster
        .dist
        .finish(Duration::from_secs(args.model.timeout_secs))?;
    Ok(())
}

/// Options of `serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// The model and how it runs.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (rank 0).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (the address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Longest accepted prompt, in tokens.
    #[arg(long, default_value_t = 1024)]
    pub max_prompt_tokens: usize,
    /// Largest accepted `max_tokens`.
    #[arg(long, default_value_t = 512)]
    pub max_tokens_limit: usize,
    /// Name reported as `model` in responses.
    #[arg(long, default_value = "deepseek-v3")]
    pub model_name: String,
}

/// `serve`: rank 0 runs the HTTP server and the scheduler; the other ranks follow its steps.
pub fn serve(args: &ServeArgs) -> Result<()> {
    let (mut cluster, tokenizer) =
        start(&args.model, args.max_prompt_tokens + args.max_tokens_limit)?;
    if cluster.dist.info.rank != 0 {
        cluster.engine_follow()?;
        return Ok(());
    }
    let tokenizer = Arc::new(tokenizer);
    let (tx, rx) = std::sync::mpsc::channel::<GenRequest>();
    let sched_tok = tokenizer.clone();
    let cfg = SchedulerConfig {
        max_batch_per_rank: args.model.max_batch,
        heartbeat: Duration::from_secs(1),
    };
    let (dead_tx, dead_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
    std::thread::Builder::new()
        .name("scheduler".into())
        .spawn(move || {
            let result = scheduler::run(&mut cluster, &sched_tok, rx, cfg)
                .and_then(|_| cluster.dist.finish(Duration::from_secs(60)));
            let err = match result {
                Ok(()) => anyhow::anyhow!("the generation loop ended"),
                Err(e) => e,
            };
            let _ = dead_tx.send(err);
        })?;
    let state = Arc::new(AppState::new(
        tx,
        tokenizer,
        Limits {
            max_prompt_tokens: args.max_prompt_tokens,
            max_tokens_limit: args.max_tokens_limit,
            max_batch: args.model.max_batch,
        },
        args.model_name.clone(),
    ));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        println!("listening on http://{addr}");
        tracing::info!("serving on http://{addr}");
        tokio::select! {
            r = axum::serve(listener, server::router(state)) => r.context("HTTP server failed"),
            e = dead_rx => Err(e.unwrap_or_else(|_| anyhow::anyhow!("the generation loop panicked"))),
        }
    })
}

impl Cluster {
    /// Ranks other than 0: follow rank 0's steps, then finish the job cleanly.
    pub fn engine_follow(&mut self) -> Result<()> {
        self.follow()?;
        self.dist.finish(Duration::from_secs(60))
    }
}
