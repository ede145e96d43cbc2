//! `deepseek-v3`: generate a tiny checkpoint, generate text, serve an OpenAI-compatible API,
//! benchmark a server, or launch any of these as many ranks over processes and nodes.

use clap::{Parser, Subcommand};
use deepseek_v3::app::{self, BenchArgs, GenCheckpointArgs, GenerateArgs, ServeArgs};
use deepseek_v3::launch::{self, LaunchArgs};

/// A DeepSeek-V3-style model with expert-parallel MoE, on CPU or GPUs.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Write a small random checkpoint (sharded safetensors, config.json, tokenizer.json).
    GenCheckpoint(GenCheckpointArgs),
    /// Generate text for prompts (spread over the ranks when launched as several).
    Generate(GenerateArgs),
    /// Serve an OpenAI-compatible HTTP API (rank 0 listens; all ranks compute).
    Serve(ServeArgs),
    /// Benchmark a running server: concurrent clients, fixed prompt and output lengths.
    BenchServe(BenchArgs),
    /// Start this node's ranks of a job, like torchrun: `launch --nproc-per-node 2 -- generate ...`.
    Launch(LaunchArgs),
}

fn main() {
    let cli = Cli::parse();
    // A server logs its requests by default; the other commands only warnings.
    let default_filter = match cli.command {
        Cmd::Serve(_) => "warn,deepseek_v3=info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    launch::watch_launcher();
    let result = match &cli.command {
        Cmd::GenCheckpoint(a) => app::gen_checkpoint(a).map(|_| 0),
        Cmd::Generate(a) => app::generate(a).map(|_| 0),
        Cmd::Serve(a) => app::serve(a).map(|_| 0),
        Cmd::BenchServe(a) => app::bench_serve(a).map(|_| 0),
        Cmd::Launch(a) => launch::launch(a),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {}", deepseek_v3::app::error_report(&e));
            std::process::exit(1);
        }
    }
}
