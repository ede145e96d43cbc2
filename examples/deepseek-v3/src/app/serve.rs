//! `serve`: rank 0 runs the HTTP server and the scheduler; the other ranks follow its steps.
//!
//! Rank 0 binds its port before loading the model, so a port in use fails at once. When the
//! engine fails (a rank died, a step failed) or the process gets SIGTERM or SIGINT, open
//! streams get an error event, the server stops taking requests and drains the open ones for
//! a few seconds, and the process exits (non-zero after an engine failure).

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tokio::signal::unix::{signal, SignalKind};

use super::{start, ModelArgs};
use crate::dist::RankInfo;
use crate::metrics::Metrics;
use crate::scheduler::{self, GenRequest, SchedulerConfig};
use crate::server::{self, AppState, Limits, ServerOptions};

/// How long open connections may take to finish once the server stops.
const DRAIN: Duration = Duration::from_secs(5);

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
    /// Name of the served model: requests naming another `model` get 404.
    #[arg(long, default_value = "deepseek-v3")]
    pub model_name: String,
    /// Require `Authorization: Bearer KEY` on `/v1/*` (`/health` and `/metrics` stay open).
    #[arg(long, env = "DEEPSEEK_V3_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

/// Why the server stopped.
enum Stop {
    Engine(anyhow::Error),
    Signal(&'static str),
}

/// `serve` (see the module docs).
pub fn serve(args: &ServeArgs) -> Result<()> {
    if args.api_key.as_deref().is_some_and(str::is_empty) {
        anyhow::bail!("--api-key is empty; give a key or leave the option out");
    }
    // Rank 0 takes its port first: a port in use is reported before any loading.
    let listener = if RankInfo::from_env()?.rank == 0 {
        let l =
            std::net::TcpListener::bind((args.host.as_str(), args.port)).with_context(|| {
                format!(
                    "cannot listen on {}:{} (--host, --port)",
                    args.host, args.port
                )
            })?;
        l.set_nonblocking(true)?;
        Some(l)
    } else {
        None
    };
    let (mut cluster, tokenizer) =
        start(&args.model, args.max_prompt_tokens + args.max_tokens_limit)?;
    let Some(listener) = listener else {
        return cluster.engine_follow();
    };
    let vocab_size = cluster.engine.model().vocab_size();
    let tokenizer = Arc::new(tokenizer);
    let metrics = Arc::new(Metrics::new());
    let (tx, rx) = std::sync::mpsc::channel::<GenRequest>();
    let state = Arc::new(AppState::new(
        tx,
        tokenizer.clone(),
        metrics.clone(),
        ServerOptions {
            limits: Limits {
                max_prompt_tokens: args.max_prompt_tokens,
                max_tokens_limit: args.max_tokens_limit,
                max_batch: args.model.max_batch,
                vocab_size,
            },
            model_name: args.model_name.clone(),
            api_key: args.api_key.clone(),
        },
    ));
    let cfg = SchedulerConfig {
        max_batch_per_rank: args.model.max_batch,
        max_prefill_tokens: args.model.max_prefill_tokens,
        heartbeat: Duration::from_secs(1),
    };
    let (dead_tx, dead_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
    let sched_state = state.clone();
    std::thread::Builder::new()
        .name("scheduler".into())
        .spawn(move || {
            let result = scheduler::run(&mut cluster, &tokenizer, rx, cfg, &metrics)
                .and_then(|_| cluster.finish(Duration::from_secs(60)));
            let err = match result {
                Ok(()) => anyhow::anyhow!("the generation loop ended"),
                Err(e) => e,
            };
            // Open streams hear it at once, before the HTTP side winds down.
            sched_state.fail(&format!("the generation engine failed: {err:#}"));
            let _ = dead_tx.send(err);
        })?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        println!("listening on http://{addr}");
        tracing::info!("serving on http://{addr}");
        let mut term = signal(SignalKind::terminate())?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = axum::serve(listener, server::router(state.clone()))
            .with_graceful_shutdown(async {
                let _ = stop_rx.await;
            })
            .into_future();
        tokio::pin!(server);
        let stop = tokio::select! {
            r = &mut server => return r.context("HTTP server failed"),
            e = dead_rx => Stop::Engine(
                e.unwrap_or_else(|_| anyhow::anyhow!("the generation loop panicked")),
            ),
            _ = term.recv() => Stop::Signal("SIGTERM"),
            _ = tokio::signal::ctrl_c() => Stop::Signal("SIGINT"),
        };
        match &stop {
            Stop::Engine(e) => state.fail(&format!("the generation engine failed: {e:#}")),
            Stop::Signal(s) => {
                tracing::warn!("{s}: shutting down");
                state.fail(&format!("the server is shutting down ({s})"));
            }
        }
        let _ = stop_tx.send(());
        if tokio::time::timeout(DRAIN, &mut server).await.is_err() {
            tracing::warn!("open connections did not finish within {DRAIN:?}; closing them");
        }
        match stop {
            Stop::Engine(e) => Err(e),
            Stop::Signal(_) => Ok(()),
        }
    })
}
