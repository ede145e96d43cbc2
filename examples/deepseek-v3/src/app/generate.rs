//! `generate`: every rank loads its part; rank 0 runs the scheduler over all prompts, prints the
//! results in prompt order, then the performance: generated tokens per second, time to first
//! token and time per output token (on stderr, or as a last JSON line with `--json`).

use std::borrow::Cow;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use tokio::sync::mpsc::unbounded_channel;

use super::{start, ModelArgs};
use crate::metrics::Metrics;
use crate::sampling::SamplingParams;
use crate::scheduler::{self, FinishReason, GenEvent, GenRequest, SchedulerConfig, SeqTiming};
use crate::stats::Summary;
use crate::tokenizer::ChatMessage;

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
    /// Keep generating past the end-of-sentence token: every prompt gets `--max-tokens`
    /// tokens (fixed lengths for timing).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object per prompt (index, prompt, text, tokens, finish_reason, timings),
    /// then one `{"summary": ...}` object.
    #[arg(long)]
    pub json: bool,
}

/// One prompt's result.
struct Outcome {
    text: String,
    tokens: Vec<u32>,
    reason: FinishReason,
    timing: SeqTiming,
}

/// `generate` (see the module docs).
pub fn generate(args: &GenerateArgs) -> Result<()> {
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1, got 0");
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    if !(0.0..=2.0).contains(&args.temperature) {
        bail!("--temperature must be in [0, 2], got {}", args.temperature);
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
    let arrival = Instant::now();
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
                .filter(|_| !args.ignore_eos)
                .into_iter()
                .chain(args.stop_token_ids.iter().copied())
                .collect(),
            stop_strings: args.stop.clone(),
            events: ev_tx.clone(),
            arrival,
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
            max_prefill_tokens: args.model.max_prefill_tokens,
            heartbeat: Duration::from_millis(200),
        },
        &Metrics::new(),
    )?;
    let elapsed = arrival.elapsed();
    let mut results: Vec<Option<Outcome>> = (0..args.prompts.len()).map(|_| None).collect();
    let mut failed: Vec<Option<String>> = vec![None; args.prompts.len()];
    while let Ok(ev) = ev_rx.try_recv() {
        match ev {
            GenEvent::Done {
                index,
                text,
                tokens,
                finish_reason,
                timing,
                ..
            } => {
                results[index] = Some(Outcome {
                    text,
                    tokens,
                    reason: finish_reason,
                    timing,
                });
            }
            GenEvent::Failed { index, message } => failed[index] = Some(message),
            GenEvent::Delta { .. } => {}
        }
    }
    let results = results
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.with_context(|| match &failed[i] {
                Some(m) => format!("prompt {i} failed: {m}"),
                None => format!("prompt {i} got no result"),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let terminal = std::io::stdout().is_terminal();
    for (i, r) in results.iter().enumerate() {
        if args.json {
            let line = json!({
                "index": i, "prompt": args.prompts[i], "prompt_tokens": prompt_ids[i].len(),
                "text": r.text, "tokens": r.tokens, "finish_reason": r.reason.as_str(),
                "ttft_ms": r.timing.first_token.as_secs_f64() * 1e3,
                "tpot_ms": r.timing.per_token(r.tokens.len()).map(|d| d.as_secs_f64() * 1e3),
            });
            println!("{line}");
        } else {
            println!("=== [{i}] {}", args.prompts[i]);
            println!("{}", shown(&r.text, terminal));
        }
    }
    let prompt_tokens: usize = prompt_ids.iter().map(Vec::len).sum();
    report(&results, prompt_tokens, elapsed, args.json);
    cluster.finish(Duration::from_secs(args.model.timeout_secs))?;
    Ok(())
}

/// `text` as printed: exactly the API's text (undecodable bytes are U+FFFD there too), except
/// that on a terminal control characters other than newline and tab are written as escapes
/// (`\x05`), which terminals would otherwise swallow or show as `?`.
fn shown(text: &str, terminal: bool) -> Cow<'_, str> {
    let hidden = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !terminal || !text.chars().any(hidden) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(
        text.chars()
            .map(|c| {
                if hidden(c) {
                    // Control characters (C0, DEL, C1) are all below U+0100.
                    format!("\\x{:02x}", c as u32)
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

/// Prints the performance of the run: a JSON line on stdout with `json`, else a line on stderr.
fn report(results: &[Outcome], prompt_tokens: usize, elapsed: Duration, json: bool) {
    let generated: usize = results.iter().map(|r| r.tokens.len()).sum();
    let secs = elapsed.as_secs_f64();
    let tokens_per_s = generated as f64 / secs.max(1e-9);
    let ttft: Vec<f64> = results
        .iter()
        .map(|r| r.timing.first_token.as_secs_f64())
        .collect();
    let tpot: Vec<f64> = results
        .iter()
        .filter_map(|r| r.timing.per_token(r.tokens.len()))
        .map(|d| d.as_secs_f64())
        .collect();
    let ttft = Summary::of(&ttft).map(|s| s.scaled(1e3));
    let tpot = Summary::of(&tpot).map(|s| s.scaled(1e3));
    if json {
        let line = json!({"summary": {
            "prompts": results.len(), "prompt_tokens": prompt_tokens,
            "generated_tokens": generated, "elapsed_s": secs, "tokens_per_s": tokens_per_s,
            "ttft_ms": ttft, "tpot_ms": tpot,
        }});
        println!("{line}");
        return;
    }
    let fmt = |s: Option<Summary>| {
        s.map_or("n/a".to_string(), |s| {
            format!("mean {:.1} ms (p50 {:.1}, max {:.1})", s.mean, s.p50, s.max)
        })
    };
    eprintln!(
        "generated {generated} tokens for {} prompts ({prompt_tokens} prompt tokens) in {secs:.2} s: \
         {tokens_per_s:.1} tokens/s; time to first token {}; time per output token {}",
        results.len(),
        fmt(ttft),
        fmt(tpot)
    );
}

#[cfg(test)]
mod tests {
    use super::shown;
    use std::borrow::Cow;

    #[test]
    fn terminals_see_control_characters_escaped_and_u_fffd_as_is() {
        let text = "a\u{5}b\u{FFFD}c\n\td\u{1b}";
        assert_eq!(shown(text, false), text);
        assert_eq!(shown(text, true), "a\\x05b\u{FFFD}c\n\td\\x1b");
        assert!(matches!(shown("plain", true), Cow::Borrowed(_)));
    }
}
