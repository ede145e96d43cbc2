//! The OpenAI-compatible HTTP API on rank 0: `POST /v1/completions`,
//! `POST /v1/chat/completions` (both streaming with server-sent events when `"stream": true`),
//! `GET /v1/models`, `GET /v1/models/{id}`, `GET /health` and `GET /metrics` (Prometheus).
//!
//! Requests are checked here ([`request`]) and handed to the scheduler loop; answers are built
//! in [`response`]. Every error is a JSON `{"error": {"message", "type", "param", "code"}}` with
//! a 4xx/5xx status ([`error`]). With `--api-key`, `/v1/*` needs `Authorization: Bearer KEY`.
//! Every request is counted in `/metrics` and logged at `info`.

pub mod error;
pub mod request;
pub mod response;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::watch;

use crate::metrics::Metrics;
use crate::sampling::SamplingParams;
use crate::scheduler::{GenEvent, GenRequest};
use crate::tokenizer::TextTokenizer;
use error::ApiError;
use request::{Params, Prompt};
use response::{ChunkMeta, Failure};

/// Request size limits (`--max-prompt-tokens`, `--max-tokens-limit`, `--max-batch`) and the
/// vocabulary that token-id prompts must stay within.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest accepted prompt, in tokens.
    pub max_prompt_tokens: usize,
    /// Largest accepted `max_tokens`.
    pub max_tokens_limit: usize,
    /// Most prompts in one request.
    pub max_batch: usize,
    /// The model's vocabulary size.
    pub vocab_size: usize,
}

/// How the server presents itself.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Request limits.
    pub limits: Limits,
    /// The model name clients must use (`--model-name`).
    pub model_name: String,
    /// The key `/v1/*` requests must present as `Authorization: Bearer KEY` (`--api-key`).
    pub api_key: Option<String>,
}

/// What the handlers share.
pub struct AppState {
    submit: Mutex<Sender<GenRequest>>,
    tokenizer: Arc<TextTokenizer>,
    options: ServerOptions,
    metrics: Arc<Metrics>,
    failure: watch::Sender<Option<Arc<str>>>,
    next_id: AtomicU64,
    seed_base: u64,
    created: u64,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl AppState {
    /// State that hands requests to the scheduler through `submit`.
    pub fn new(
        submit: Sender<GenRequest>,
        tokenizer: Arc<TextTokenizer>,
        metrics: Arc<Metrics>,
        options: ServerOptions,
    ) -> Self {
        let seed_base = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self {
            submit: Mutex::new(submit),
            tokenizer,
            options,
            metrics,
            failure: watch::Sender::new(None),
            next_id: AtomicU64::new(0),
            seed_base,
            created: now_secs(),
        }
    }

    /// Marks the engine as failed (or the server as stopping) with `message`, a sentence the
    /// clients see (the first one is kept): open streams get an error event and end, waiting
    /// requests a 503, `/health` answers 503.
    pub fn fail(&self, message: &str) {
        self.failure.send_if_modified(|f| {
            if f.is_some() {
                return false;
            }
            *f = Some(Arc::from(message));
            true
        });
    }

    /// The failure, if the engine has failed.
    pub fn failure(&self) -> Option<Arc<str>> {
        self.failure.borrow().clone()
    }

    fn failure_watch(&self) -> Failure {
        self.failure.subscribe()
    }
}

/// The API's routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                code: Some("not_found"),
                ..ApiError::invalid(
                    "no such endpoint; try POST /v1/completions, POST /v1/chat/completions, \
                     GET /v1/models, GET /health, GET /metrics",
                )
            }
        })
        .method_not_allowed_fallback(|| async {
            ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                ..ApiError::invalid("method not allowed on this endpoint (completions take POST)")
            }
        })
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// Counts every request in `/metrics` by endpoint and status, and logs it at `info`.
async fn observe(
    State(st): State<Arc<AppState>>,
    matched: Option<MatchedPath>,
    req: Request,
    next: Next,
) -> Response {
    let start = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let endpoint = matched.map_or_else(|| "other".to_string(), |m| m.as_str().to_string());
    let resp = next.run(req).await;
    let status = resp.status();
    st.metrics
        .requests
        .with_label_values(&[endpoint.as_str(), status.as_str()])
        .inc();
    tracing::info!(
        "{method} {path} {} in {:.1} ms",
        status.as_u16(),
        start.elapsed().as_secs_f64() * 1e3
    );
    resp
}

/// Whether `a` equals `b`, in time that depends on their lengths only.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// With `--api-key`, `/v1/*` needs `Authorization: Bearer KEY` (401 otherwise).
async fn authorize(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &st.options.api_key {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same_secret(g.trim().as_bytes(), key.as_bytes())) {
            let message = if given.is_some() {
                "Incorrect API key provided"
            } else {
                "Missing API key: send `Authorization: Bearer KEY` (the server's --api-key)"
            };
            let mut resp = ApiError {
                status: StatusCode::UNAUTHORIZED,
                code: Some("invalid_api_key"),
                ..ApiError::invalid(message)
            }
            .into_response();
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, "Bearer".parse().expect("valid"));
            return resp;
        }
    }
    next.run(req).await
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let lost = st.metrics.lost_ranks();
    match st.failure() {
        None if lost.is_empty() => Json(json!({"status": "ok"})).into_response(),
        // Still answering, on fewer ranks.
        None => Json(json!({"status": "degraded", "ranks_lost": lost})).into_response(),
        Some(msg) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "error", "error": &*msg})),
        )
            .into_response(),
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}

fn model_card(st: &AppState) -> Value {
    json!({"id": st.options.model_name, "object": "model", "created": st.created, "owned_by": "ep-moe"})
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&st)]}))
}

async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id == st.options.model_name {
        Json(model_card(&st)).into_response()
    } else {
        ApiError::model_not_found(&id, &st.options.model_name).into_response()
    }
}

/// A checked request, ready for the scheduler.
struct Job {
    meta: ChunkMeta,
    prompts: Vec<Vec<u32>>,
    params: Params,
}

impl AppState {
    /// The body as a JSON object, after the checks every completion request gets.
    fn read(
        &self,
        headers: &HeaderMap,
        body: Result<Bytes, BytesRejection>,
    ) -> Result<Map<String, Value>, ApiError> {
        request::check_content_type(headers)?;
        let body = body.map_err(ApiError::body)?;
        let obj = request::parse_body(&body)?;
        request::check_model(&obj, &self.options.model_name)?;
        request::reject_unsupported(&obj)?;
        Ok(obj)
    }

    fn check_prompt(&self, prompt: &[u32]) -> Result<(), ApiError> {
        let limits = &self.options.limits;
        if prompt.len() > limits.max_prompt_tokens {
            return Err(ApiError::invalid_param(
                "prompt",
                format!(
                    "prompt is {} tokens, more than this server's limit of {} (--max-prompt-tokens)",
                    prompt.len(),
                    limits.max_prompt_tokens
                ),
            ));
        }
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= limits.vocab_size) {
            return Err(ApiError::invalid_param(
                "prompt",
                format!(
                    "token id {bad} is outside the vocabulary (vocab_size {})",
                    limits.vocab_size
                ),
            ));
        }
        Ok(())
    }

    fn completion_job(&self, obj: &Map<String, Value>) -> Result<Job, ApiError> {
        let params = request::parse_params(obj, &self.options.limits)?;
        let prompts = request::completion_prompts(obj)?;
        if prompts.len() > self.options.limits.max_batch {
            return Err(ApiError::invalid_param(
                "prompt",
                format!(
                    "{} prompts in one request, more than this server's limit of {} (--max-batch)",
                    prompts.len(),
                    self.options.limits.max_batch
                ),
            ));
        }
        let prompts = prompts
            .into_iter()
            .map(|p| {
                let ids = match p {
                    Prompt::Text(t) => self
                        .tokenizer
                        .encode_prompt(&t)
                        .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?,
                    Prompt::Tokens(ids) => ids,
                };
                self.check_prompt(&ids)?;
                Ok(ids)
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        Ok(self.job(false, prompts, params))
    }

    fn chat_job(&self, obj: &Map<String, Value>) -> Result<Job, ApiError> {
        let params = request::parse_params(obj, &self.options.limits)?;
        let messages = request::chat_messages(obj)?;
        let ids = self
            .tokenizer
            .apply_chat_template(&messages)
            .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
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
            meta: ChunkMeta {
                id,
                chat,
                created: now_secs(),
                model: self.options.model_name.clone(),
                include_usage: params.include_usage,
            },
            prompts,
            params,
        }
    }

    /// Hands the job's sequences to the scheduler; events arrive on the returned receiver.
    fn submit(&self, job: &Job) -> Result<UnboundedReceiver<GenEvent>, ApiError> {
        if let Some(msg) = self.failure() {
            return Err(ApiError::unavailable(msg.to_string()));
        }
        let (tx, rx) = unbounded_channel();
        let eos = self.tokenizer.eos_id().filter(|_| !job.params.ignore_eos);
        let stop_tokens: Vec<u32> = eos
            .into_iter()
            .chain(job.params.stop_token_ids.iter().copied())
            .collect();
        let arrival = Instant::now();
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
                arrival,
            };
            submit
                .send(req)
                .map_err(|_| ApiError::unavailable("the generation loop has stopped"))?;
        }
        Ok(rx)
    }

    async fn respond(&self, job: Job) -> Response {
        let rx = match self.submit(&job) {
            Ok(rx) => rx,
            Err(e) => return e.into_response(),
        };
        let n = job.prompts.len();
        if job.params.stream {
            response::stream(job.meta, n, rx, self.failure_watch()).into_response()
        } else {
            response::whole(job.meta, n, rx, self.failure_watch()).await
        }
    }
}

async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match st.read(&headers, body).and_then(|o| st.completion_job(&o)) {
        Ok(job) => st.respond(job).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match st.read(&headers, body).and_then(|o| st.chat_job(&o)) {
        Ok(job) => st.respond(job).await,
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::{FinishReason, SeqTiming};
    use crate::tokenizer::build_tokenizer_json;

    fn state() -> (Arc<AppState>, std::sync::mpsc::Receiver<GenRequest>) {
        let tok = TextTokenizer::from_json(&build_tokenizer_json(320).unwrap()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let options = ServerOptions {
            limits: Limits {
                max_prompt_tokens: 64,
                max_tokens_limit: 16,
                max_batch: 4,
                vocab_size: 320,
            },
            model_name: "m".into(),
            api_key: None,
        };
        let st = AppState::new(tx, Arc::new(tok), Arc::new(Metrics::new()), options);
        (Arc::new(st), rx)
    }

    async fn body(resp: Response) -> String {
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn secrets_compare_by_content() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
    }

    #[tokio::test]
    async fn a_failed_engine_answers_503_and_keeps_the_first_reason() {
        let (st, _rx) = state();
        assert_eq!(health(State(st.clone())).await.status(), StatusCode::OK);
        st.fail("the generation engine failed: boom");
        st.fail("a later failure");
        let resp = health(State(st.clone())).await;
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(body(resp).await.contains("boom"));
        let job = st.completion_job(&obj(json!({"prompt": "hi"}))).unwrap();
        let resp = st.respond(job).await;
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(body(resp)
            .await
            .contains("the generation engine failed: boom"));
    }

    #[tokio::test]
    async fn open_streams_get_an_error_event_when_the_engine_fails() {
        let (st, rx) = state();
        let job = st
            .completion_job(&obj(json!({"prompt": "hi", "stream": true})))
            .unwrap();
        let resp = st.respond(job).await;
        assert_eq!(resp.status(), StatusCode::OK);
        // The scheduler got the request and sends one token; then the engine fails while the
        // request's event sender is still alive.
        let req = rx.recv().unwrap();
        req.events
            .send(GenEvent::Delta {
                index: 0,
                text: "a".into(),
            })
            .unwrap();
        let failer = st.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            failer.fail("the generation engine failed: rank 1 is gone");
        });
        let text = body(resp).await;
        let data: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(data.len(), 3, "{text}");
        assert!(data[0].contains(r#""text":"a""#), "{text}");
        let err: Value = serde_json::from_str(data[1]).unwrap();
        assert_eq!(
            err["error"]["message"],
            "the generation engine failed: rank 1 is gone"
        );
        assert_eq!(err["error"]["type"], "server_error");
        assert_eq!(data[2], "[DONE]");
        drop(req);
    }

    #[tokio::test]
    async fn a_finished_stream_reports_usage_when_asked() {
        let (st, rx) = state();
        let job = st
            .completion_job(&obj(json!({"prompt": ["x", "y"], "stream": true,
                "stream_options": {"include_usage": true}})))
            .unwrap();
        let resp = st.respond(job).await;
        for index in 0..2 {
            let req = rx.recv().unwrap();
            req.events
                .send(GenEvent::Done {
                    index,
                    text: String::new(),
                    tokens: vec![7; 3],
                    finish_reason: FinishReason::Length,
                    prompt_tokens: 2,
                    timing: SeqTiming::default(),
                })
                .unwrap();
        }
        let text = body(resp).await;
        let data: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        let usage: Value = serde_json::from_str(data[data.len() - 2]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 6, "{text}");
        assert_eq!(usage["usage"]["prompt_tokens"], 4, "{text}");
        assert_eq!(usage["choices"], json!([]), "{text}");
        assert_eq!(data[data.len() - 1], "[DONE]");
    }
}
