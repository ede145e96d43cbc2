//! The OpenAI-compatible HTTP API on rank 0: `POST /v1/completions`,
//! `POST /v1/chat/completions` (both streaming with server-sent events when `"stream": true`),
//! `GET /v1/models` and `GET /health`. Requests are validated here and handed to the scheduler
//! loop; every error is a JSON `{"error": {"message", "type"}}` with a 4xx/5xx status.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::sampling::SamplingParams;
use crate::scheduler::{FinishReason, GenEvent, GenRequest};
use crate::tokenizer::{ChatMessage, TextTokenizer};

/// Request size limits (`--max-prompt-tokens`, `--max-tokens-limit`, `--max-batch`).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest accepted prompt, in tokens.
    pub max_prompt_tokens: usize,
    /// Largest accepted `max_tokens`.
    pub max_tokens_limit: usize,
    /// Most prompts in one request.
    pub max_batch: usize,
}

/// What the handlers share.
pub struct AppState {
    submit: Mutex<Sender<GenRequest>>,
    tokenizer: Arc<TextTokenizer>,
    limits: Limits,
    model_name: String,
    next_id: AtomicU64,
    seed_base: u64,
}

impl AppState {
    /// State that hands requests to the scheduler through `submit`.
    pub fn new(
        submit: Sender<GenRequest>,
        tokenizer: Arc<TextTokenizer>,
        limits: Limits,
        model_name: String,
    ) -> Self {
        let seed_base = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self {
            submit: Mutex::new(submit),
            tokenizer,
            limits,
            model_name,
            next_id: AtomicU64::new(0),
            seed_base,
        }
    }
}

/// An API error: status, OpenAI error type and message.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    fn invalid(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
        }
    }

    fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": null}});
        (self.status, Json(body)).into_response()
    }
}

/// The API's routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                kind: "not_found_error",
                message: "no such endpoint; try POST /v1/completions, POST /v1/chat/completions, GET /health".into(),
            }
        })
        .method_not_allowed_fallback(|| async {
            ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                kind: "invalid_request_error",
                message: "method not allowed on this endpoint (completions take POST)".into(),
            }
        })
        .with_state(state)
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": st.model_name, "object": "model", "owned_by": "ep-moe"}]}),
    )
}

/// Parameters shared by both endpoints.
struct Params {
    max_tokens: usize,
    temperature: f32,
    top_p: f32,
    seed: Option<u64>,
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    stream: bool,
}

fn parse_body(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("request body is not valid JSON: {e}")))?;
    match value {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::invalid("request body must be a JSON object")),
    }
}

fn number(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(format!("`{key}` must be a number, got {v}"))),
    }
}

fn strings(obj: &Map<String, Value>, key: &str) -> Result<Option<Vec<String>>, ApiError> {
    let err = || ApiError::invalid(format!("`{key}` must be a string or an array of strings"));
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(vec![s.clone()])),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(err))
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(err()),
    }
}

fn token_ids(obj: &Map<String, Value>, key: &str) -> Result<Vec<u32>, ApiError> {
    let err = || ApiError::invalid(format!("`{key}` must be an array of token ids"));
    match obj.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(err)
            })
            .collect(),
        Some(_) => Err(err()),
    }
}

fn parse_params(obj: &Map<String, Value>, limits: &Limits) -> Result<Params, ApiError> {
    let max_tokens = match number(obj, "max_tokens")?.or(number(obj, "max_completion_tokens")?) {
        None => 16.min(limits.max_tokens_limit),
        Some(v) if v >= 1.0 && v.fract() == 0.0 => v as usize,
        Some(v) => {
            return Err(ApiError::invalid(format!(
                "`max_tokens` must be a positive integer, got {v}"
            )))
        }
    };
    if max_tokens > limits.max_tokens_limit {
        return Err(ApiError::invalid(format!(
            "`max_tokens` = {max_tokens} exceeds this server's limit of {} (--max-tokens-limit)",
            limits.max_tokens_limit
        )));
    }
    let temperature = number(obj, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(format!(
            "`temperature` must be in [0, 2], got {temperature}"
        )));
    }
    let top_p = number(obj, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(format!(
            "`top_p` must be in (0, 1], got {top_p}"
        )));
    }
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            ApiError::invalid(format!("`seed` must be a non-negative integer, got {v}"))
        })?),
    };
    if let Some(n) = number(obj, "n")? {
        if n != 1.0 {
            return Err(ApiError::invalid(format!(
                "`n` = {n} is not supported (only 1)"
            )));
        }
    }
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(ApiError::invalid(format!(
                "`stream` must be a boolean, got {v}"
            )))
        }
    };
    Ok(Params {
        max_tokens,
        temperature: temperature as f32,
        top_p: top_p as f32,
        seed,
        stop: strings(obj, "stop")?.unwrap_or_default(),
        stop_token_ids: token_ids(obj, "stop_token_ids")?,
        stream,
    })
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A validated request, ready for the scheduler.
struct Job {
    id: String,
    chat: bool,
    prompts: Vec<Vec<u32>>,
    params: Params,
}

impl AppState {
    fn check_prompt(&self, prompt: &[u32]) -> Result<(), ApiError> {
        if prompt.len() > self.limits.max_prompt_tokens {
            return Err(ApiError::invalid(format!(
                "prompt is {} tokens, more than this server's limit of {} (--max-prompt-tokens)",
                prompt.len(),
                self.limits.max_prompt_tokens
            )));
        }
        Ok(())
    }

    fn completion_job(&self, body: &Bytes) -> Result<Job, ApiError> {
        let obj = parse_body(body)?;
        let params = parse_params(&obj, &self.limits)?;
        let texts = strings(&obj, "prompt")?.ok_or_else(|| {
            ApiError::invalid("missing `prompt` (a string or an array of strings)")
        })?;
        if texts.is_empty() {
            return Err(ApiError::invalid("`prompt` is an empty array"));
        }
        if texts.len() > self.limits.max_batch {
            return Err(ApiError::invalid(format!(
                "{} prompts in one request, more than this server's limit of {} (--max-batch)",
                texts.len(),
                self.limits.max_batch
            )));
        }
        let prompts = texts
            .iter()
            .map(|t| {
                let ids = self
                    .tokenizer
                    .encode_prompt(t)
                    .map_err(|e| ApiError::invalid(e.to_string()))?;
                self.check_prompt(&ids)?;
                Ok(ids)
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        Ok(self.job(false, prompts, params))
    }

    fn chat_job(&self, body: &Bytes) -> Result<Job, ApiError> {
        let obj = parse_body(body)?;
        let params = parse_params(&obj, &self.limits)?;
        let messages = obj
            .get("messages")
            .ok_or_else(|| ApiError::invalid("missing `messages` (an array of {role, content})"))?;
        let messages: Vec<ChatMessage> = serde_json::from_value(messages.clone()).map_err(|e| {
            ApiError::invalid(format!(
                "`messages` must be an array of {{\"role\": string, \"content\": string}}: {e}"
            ))
        })?;
        if messages.is_empty() {
            return Err(ApiError::invalid("`messages` is empty"));
        }
        let ids = self
            .tokenizer
            .apply_chat_template(&messages)
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        self.check_prompt(&ids)?;
        Ok(self.job(true, vec![ids], params))
    }

    fn job(&self, chat: bool, prompts: Vec<Vec<u32>>, params: Params) -> Job {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let id = if chat {
            format!("chatcmpl-{n}")
        } else {
            format!("cmpl-{n}")
        };
        Job {
            id,
            chat,
            prompts,
            params,
        }
    }

    /// Hands the job's sequences to the scheduler; events arrive on the returned receiver.
    fn submit(&self, job: &Job) -> Result<UnboundedReceiver<GenEvent>, ApiError> {
        let (tx, rx) = unbounded_channel();
        let stop_tokens: Vec<u32> = self
            .tokenizer
            .eos_id()
            .into_iter()
            .chain(job.params.stop_token_ids.iter().copied())
            .collect();
        let submit = self.submit.lock().unwrap_or_else(|e| e.into_inner());
        for (index, prompt) in job.prompts.iter().enumerate() {
            let seed = job
                .params
                .seed
                .unwrap_or_else(|| {
                    self.seed_base
                        .wrapping_add(self.next_id.load(Ordering::Relaxed))
                })
                .wrapping_add(index as u64);
            let req = GenRequest {
                index,
                prompt: prompt.clone(),
                max_tokens: job.params.max_tokens,
                sampling: SamplingParams {
                    temperature: job.params.temperature,
                    top_p: job.params.top_p,
                    seed,
                },
                stop_tokens: stop_tokens.clone(),
                stop_strings: job.params.stop.clone(),
                events: tx.clone(),
            };
            submit
                .send(req)
                .map_err(|_| ApiError::server("the generation loop has stopped"))?;
        }
        Ok(rx)
    }
}

/// A body that could not be read (too large, broken stream) as a JSON error.
fn body_error(e: BytesRejection) -> Response {
    ApiError {
        status: e.status(),
        kind: "invalid_request_error",
        message: format!("cannot read the request body: {}", e.body_text()),
    }
    .into_response()
}

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => return body_error(e),
    };
    match st.completion_job(&body) {
        Ok(job) => respond(&st, job).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => return body_error(e),
    };
    match st.chat_job(&body) {
        Ok(job) => respond(&st, job).await,
        Err(e) => e.into_response(),
    }
}

fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

async fn respond(st: &AppState, job: Job) -> Response {
    let mut rx = match st.submit(&job) {
        Ok(rx) => rx,
        Err(e) => return e.into_response(),
    };
    let created = now_secs();
    let n = job.prompts.len();
    if job.params.stream {
        let meta = ChunkMeta {
            id: job.id.clone(),
            chat: job.chat,
            created,
            model: st.model_name.clone(),
        };
        let mut pending = VecDeque::new();
        if job.chat {
            for index in 0..n {
                pending.push_back(meta.chunk(index, Some("assistant"), "", None));
            }
        }
        let stream = SseStream {
            rx,
            remaining: n,
            done_sent: false,
            pending,
            meta,
        };
        return Sse::new(stream).into_response();
    }
    let mut done: Vec<Option<(String, FinishReason, usize, usize)>> = vec![None; n];
    let mut remaining = n;
    while remaining > 0 {
        match rx.recv().await {
            Some(GenEvent::Done {
                index,
                text,
                tokens,
                finish_reason,
                prompt_tokens,
            }) => {
                if index < n && done[index].is_none() {
                    done[index] = Some((text, finish_reason, tokens.len(), prompt_tokens));
                    remaining -= 1;
                }
            }
            Some(GenEvent::Delta { .. }) => {}
            None => {
                return ApiError::server(
                    "the generation loop stopped before the reply was complete",
                )
                .into_response()
            }
        }
    }
    let done: Vec<_> = done.into_iter().flatten().collect();
    let prompt_tokens: usize = done.iter().map(|d| d.3).sum();
    let completion_tokens: usize = done.iter().map(|d| d.2).sum();
    let choices: Vec<Value> = done
        .iter()
        .enumerate()
        .map(|(index, (text, reason, _, _))| {
            if job.chat {
                json!({"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_str(*reason)})
            } else {
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish_str(*reason)})
            }
        })
        .collect();
    let object = if job.chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    Json(json!({
        "id": job.id,
        "object": object,
        "created": created,
        "model": st.model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens
        }
    }))
    .into_response()
}

struct ChunkMeta {
    id: String,
    chat: bool,
    created: u64,
    model: String,
}

impl ChunkMeta {
    fn chunk(
        &self,
        index: usize,
        role: Option<&str>,
        text: &str,
        finish: Option<FinishReason>,
    ) -> String {
        let finish = finish.map(finish_str);
        let choice = if self.chat {
            let mut delta = Map::new();
            if let Some(r) = role {
                delta.insert("role".into(), json!(r));
            }
            if !text.is_empty() || role.is_some() {
                delta.insert("content".into(), json!(text));
            }
            json!({"index": index, "delta": delta, "finish_reason": finish})
        } else {
            json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish})
        };
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]})
            .to_string()
    }
}

/// The server-sent events of one streaming request: a chunk per text delta, a final chunk with
/// `finish_reason` per sequence, then `[DONE]`. Dropping it (client gone) cancels the request.
struct SseStream {
    rx: UnboundedReceiver<GenEvent>,
    remaining: usize,
    done_sent: bool,
    pending: VecDeque<String>,
    meta: ChunkMeta,
}

impl futures_core::Stream for SseStream {
    type Item = Result<Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(data) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(Event::default().data(data))));
            }
            if this.remaining == 0 {
                if this.done_sent {
                    return Poll::Ready(None);
                }
                this.done_sent = true;
                return Poll::Ready(Some(Ok(Event::default().data("[DONE]"))));
            }
            match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    // The loop died: report it in-band and end the stream.
                    this.remaining = 0;
                    let err = json!({"error": {"message": "the generation loop stopped", "type": "server_error"}});
                    this.pending.push_back(err.to_string());
                }
                Poll::Ready(Some(GenEvent::Delta { index, text })) => {
                    this.pending
                        .push_back(this.meta.chunk(index, None, &text, None));
                }
                Poll::Ready(Some(GenEvent::Done {
                    index,
                    finish_reason,
                    ..
                })) => {
                    this.remaining -= 1;
                    this.pending
                        .push_back(this.meta.chunk(index, None, "", Some(finish_reason)));
                }
            }
        }
    }
}
