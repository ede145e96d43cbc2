//! Answers: the whole completion as one JSON object, or server-sent events (a chunk per text
//! delta, a final chunk per sequence with its `finish_reason`, the usage chunk when
//! `stream_options.include_usage` asks for it, then `[DONE]`). When the generation engine
//! fails, open streams get an error event (`data: {"error": ...}`) and end, and waiting plain
//! requests a 503.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_core::Stream;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;

use super::error::ApiError;
use crate::scheduler::{FinishReason, GenEvent, SeqTiming};

/// The engine's failure, once it has failed (shared by every open request).
pub type Failure = watch::Receiver<Option<Arc<str>>>;

/// What every chunk of one request repeats.
#[derive(Clone, Debug)]
pub struct ChunkMeta {
    /// `cmpl-N` or `chatcmpl-N`.
    pub id: String,
    /// Chat (`delta`s) or plain completion (`text`s).
    pub chat: bool,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Whether chunks carry `"usage": null` and a final usage chunk follows.
    pub include_usage: bool,
}

impl ChunkMeta {
    fn object(&self) -> &'static str {
        if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        }
    }

    fn wrap(&self, choices: Vec<Value>, usage: Option<Value>) -> String {
        let mut chunk = json!({
            "id": self.id, "object": self.object(), "created": self.created,
            "model": self.model, "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = usage.unwrap_or(Value::Null);
        }
        chunk.to_string()
    }

    /// One choice's chunk: a role (chat's first chunk), text, or the finish reason.
    pub fn chunk(
        &self,
        index: usize,
        role: Option<&str>,
        text: &str,
        finish: Option<FinishReason>,
    ) -> String {
        let finish = finish.map(FinishReason::as_str);
        let choice = if self.chat {
            let mut delta = Map::new();
            if let Some(r) = role {
                delta.insert("role".into(), json!(r));
            }
            if !text.is_empty() || role.is_some() {
                delta.insert("content".into(), json!(text));
            }
            json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish})
        };
        self.wrap(vec![choice], None)
    }

    /// The usage chunk (no choices).
    pub fn usage_chunk(&self, usage: &Usage) -> String {
        self.wrap(Vec::new(), Some(usage.to_json()))
    }
}

/// Token counts of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens over all choices.
    pub prompt_tokens: usize,
    /// Generated tokens over all choices.
    pub completion_tokens: usize,
}

impl Usage {
    /// OpenAI's `usage` object.
    pub fn to_json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }
}

/// How long a request whose events stopped waits for the engine's error message.
const FAILURE_NOTICE: Duration = Duration::from_secs(2);

/// The events of a request stopped (the scheduler dropped them): waits a moment for the
/// reason, which the failing loop reports right after.
async fn await_reason(failure: &mut Failure) {
    let _ = tokio::time::timeout(FAILURE_NOTICE, failure.wait_for(Option::is_some)).await;
}

/// The message open requests get when the engine stops.
fn failure_message(failure: &Failure) -> String {
    match failure.borrow().as_deref() {
        Some(msg) => msg.to_string(),
        None => "the generation engine stopped before the reply was complete".to_string(),
    }
}

fn log_finished(meta: &ChunkMeta, usage: &Usage, first: Option<SeqTiming>, start: Instant) {
    tracing::info!(
        "{} finished: prompt {} tokens, generated {} tokens, first token {:.1} ms, total {:.1} ms",
        meta.id,
        usage.prompt_tokens,
        usage.completion_tokens,
        first.map_or(0.0, |t| t.first_token.as_secs_f64() * 1e3),
        start.elapsed().as_secs_f64() * 1e3
    );
}

/// Waits for every sequence of a plain request and answers with the whole completion.
pub async fn whole(
    meta: ChunkMeta,
    n: usize,
    mut rx: UnboundedReceiver<GenEvent>,
    mut failure: Failure,
) -> Response {
    let start = Instant::now();
    let mut done: Vec<Option<(String, FinishReason, usize, usize)>> = vec![None; n];
    let mut first: Option<SeqTiming> = None;
    let mut remaining = n;
    while remaining > 0 {
        let event = tokio::select! {
            ev = rx.recv() => ev,
            _ = failure.wait_for(Option::is_some) => None,
        };
        match event {
            Some(GenEvent::Done {
                index,
                text,
                tokens,
                finish_reason,
                prompt_tokens,
                timing,
            }) => {
                if index < n && done[index].is_none() {
                    done[index] = Some((text, finish_reason, tokens.len(), prompt_tokens));
                    first.get_or_insert(timing);
                    remaining -= 1;
                }
            }
            Some(GenEvent::Delta { .. }) => {}
            Some(GenEvent::Failed { message, .. }) => {
                tracing::warn!("{}: {message}", meta.id);
                return ApiError::server(message).into_response();
            }
            None => {
                await_reason(&mut failure).await;
                return ApiError::unavailable(failure_message(&failure)).into_response();
            }
        }
    }
    let done: Vec<_> = done.into_iter().flatten().collect();
    let usage = Usage {
        prompt_tokens: done.iter().map(|d| d.3).sum(),
        completion_tokens: done.iter().map(|d| d.2).sum(),
    };
    log_finished(&meta, &usage, first, start);
    let choices: Vec<Value> = done
        .iter()
        .enumerate()
        .map(|(index, (text, reason, _, _))| {
            if meta.chat {
                json!({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": reason.as_str()})
            } else {
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": reason.as_str()})
            }
        })
        .collect();
    let object = if meta.chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    Json(json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage.to_json(),
    }))
    .into_response()
}

/// The state of one event stream.
struct Events {
    rx: UnboundedReceiver<GenEvent>,
    failure: Failure,
    meta: ChunkMeta,
    pending: VecDeque<String>,
    /// Whether each choice has had its first chunk (chat sends the role there).
    started: Vec<bool>,
    remaining: usize,
    usage: Usage,
    first: Option<SeqTiming>,
    start: Instant,
    ended: bool,
}

impl Events {
    fn on_event(&mut self, event: GenEvent) {
        match event {
            GenEvent::Delta { index, text } => {
                if self.meta.chat && !self.started.get(index).copied().unwrap_or(true) {
                    self.pending
                        .push_back(self.meta.chunk(index, Some("assistant"), "", None));
                }
                if let Some(s) = self.started.get_mut(index) {
                    *s = true;
                }
                if !text.is_empty() || !self.meta.chat {
                    self.pending
                        .push_back(self.meta.chunk(index, None, &text, None));
                }
            }
            GenEvent::Failed { message, .. } => self.on_sequence_failure(message),
            GenEvent::Done {
                index,
                tokens,
                finish_reason,
                prompt_tokens,
                timing,
                ..
            } => {
                self.remaining = self.remaining.saturating_sub(1);
                self.usage.prompt_tokens += prompt_tokens;
                self.usage.completion_tokens += tokens.len();
                self.first.get_or_insert(timing);
                self.pending
                    .push_back(self.meta.chunk(index, None, "", Some(finish_reason)));
                if self.remaining == 0 {
                    if self.meta.include_usage {
                        self.pending.push_back(self.meta.usage_chunk(&self.usage));
                    }
                    self.pending.push_back("[DONE]".to_string());
                    self.ended = true;
                    log_finished(&self.meta, &self.usage, self.first, self.start);
                }
            }
        }
    }

    /// One of the request's sequences failed: the stream ends with its error.
    fn on_sequence_failure(&mut self, message: String) {
        tracing::warn!("{}: {message}", self.meta.id);
        self.pending
            .push_back(ApiError::server(message).to_json().to_string());
        self.pending.push_back("[DONE]".to_string());
        self.ended = true;
    }

    fn on_failure(&mut self) {
        let message = failure_message(&self.failure);
        tracing::warn!("{}: stream ended by an engine failure", self.meta.id);
        self.pending
            .push_back(ApiError::server(message).to_json().to_string());
        self.pending.push_back("[DONE]".to_string());
        self.ended = true;
    }
}

/// The event stream of a streaming request over `n` choices. Dropping it (the client left)
/// closes `rx`, which cancels the request's sequences.
pub fn stream(
    meta: ChunkMeta,
    n: usize,
    rx: UnboundedReceiver<GenEvent>,
    failure: Failure,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let events = Events {
        rx,
        failure,
        meta,
        pending: VecDeque::new(),
        started: vec![false; n],
        remaining: n,
        usage: Usage::default(),
        first: None,
        start: Instant::now(),
        ended: false,
    };
    let stream = futures_util::stream::unfold(events, |mut ev| async move {
        loop {
            if let Some(data) = ev.pending.pop_front() {
                return Some((Ok(Event::default().data(data)), ev));
            }
            if ev.ended {
                return None;
            }
            let next = {
                let (rx, failure) = (&mut ev.rx, &mut ev.failure);
                tokio::select! {
                    event = rx.recv() => event,
                    _ = async { failure.wait_for(Option::is_some).await.map(|_| ()) } => None,
                }
            };
            match next {
                Some(event) => ev.on_event(event),
                None => {
                    await_reason(&mut ev.failure).await;
                    ev.on_failure();
                }
            }
        }
    });
    Sse::new(stream)
}
