//! Reading and checking a request: the content type, the JSON body, the model name, the
//! sampling parameters, the prompt (text or token ids) or chat messages, and the OpenAI fields
//! this server does not implement (refused with 400 rather than ignored).

use axum::http::{header, HeaderMap, StatusCode};
use serde_json::{Map, Value};

use super::error::ApiError;
use super::Limits;
use crate::tokenizer::ChatMessage;

/// Sampling and output parameters shared by both endpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Softmax temperature (0 is greedy).
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Seed of the first sequence (`seed + i` for choice `i`).
    pub seed: Option<u64>,
    /// Strings that end a sequence.
    pub stop: Vec<String>,
    /// Token ids that end a sequence (vLLM's extension).
    pub stop_token_ids: Vec<u32>,
    /// Whether to stream server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the token counts.
    pub include_usage: bool,
    /// Keep generating past the end-of-sentence token (vLLM's extension; fixed-length output
    /// for benchmarks).
    pub ignore_eos: bool,
}

/// One prompt of `/v1/completions`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Text, tokenized with a leading BOS.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// 415 unless the body is declared as JSON (`application/json` or `application/*+json`).
pub fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let value = headers
        .get(header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let mime = value
        .as_deref()
        .and_then(|v| v.split(';').next())
        .map(|m| m.trim().to_ascii_lowercase());
    let json = mime.as_deref().is_some_and(|m| {
        m == "application/json" || (m.starts_with("application/") && m.ends_with("+json"))
    });
    if json {
        return Ok(());
    }
    Err(ApiError {
        status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ..ApiError::invalid(format!(
            "Content-Type must be application/json, got {}",
            value.map_or("none".to_string(), |v| format!("{v:?}"))
        ))
    })
}

/// The body as a JSON object.
pub fn parse_body(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("request body is not valid JSON: {e}")))?;
    match value {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::invalid("request body must be a JSON object")),
    }
}

/// 404 when `model` names another model than `served` (a missing `model` is accepted).
pub fn check_model(obj: &Map<String, Value>, served: &str) -> Result<(), ApiError> {
    match obj.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(m)) if m == served => Ok(()),
        Some(Value::String(m)) => Err(ApiError::model_not_found(m, served)),
        Some(v) => Err(ApiError::invalid_param(
            "model",
            format!("`model` must be a string, got {v}"),
        )),
    }
}

/// Whether `value` asks for nothing: null, false, 0, "", an empty array or object.
fn is_off(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// Refuses the OpenAI fields this server does not implement when they ask for something
/// (`logprobs`, `top_logprobs`, `echo`, `suffix`, penalties, `logit_bias`, tools, ...).
pub fn reject_unsupported(obj: &Map<String, Value>) -> Result<(), ApiError> {
    // `logprobs: 0` still asks for the chosen tokens' log probabilities.
    if let Some(v) = obj
        .get("logprobs")
        .filter(|v| !matches!(v, Value::Null | Value::Bool(false)))
    {
        return Err(ApiError::unsupported("logprobs", v));
    }
    const OFF_ONLY: [&str; 9] = [
        "top_logprobs",
        "echo",
        "suffix",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "tools",
        "functions",
        "prediction",
    ];
    for key in OFF_ONLY {
        if let Some(v) = obj.get(key).filter(|v| !is_off(v)) {
            return Err(ApiError::unsupported(key, v));
        }
    }
    if let Some(v) = obj
        .get("best_of")
        .filter(|v| !v.is_null() && v.as_f64() != Some(1.0))
    {
        return Err(ApiError::unsupported("best_of", v));
    }
    if let Some(v) = obj.get("response_format").filter(|v| !v.is_null()) {
        if v.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::unsupported("response_format", v));
        }
    }
    Ok(())
}

fn number(obj: &Map<String, Value>, key: &'static str) -> Result<Option<f64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| {
            ApiError::invalid_param(key, format!("`{key}` must be a number, got {v}"))
        }),
    }
}

fn boolean(obj: &Map<String, Value>, key: &'static str) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::invalid_param(
            key,
            format!("`{key}` must be a boolean, got {v}"),
        )),
    }
}

fn strings(obj: &Map<String, Value>, key: &'static str) -> Result<Option<Vec<String>>, ApiError> {
    let err = || {
        ApiError::invalid_param(
            key,
            format!("`{key}` must be a string or an array of strings"),
        )
    };
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

fn token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

fn token_ids(obj: &Map<String, Value>, key: &'static str) -> Result<Vec<u32>, ApiError> {
    let err = || ApiError::invalid_param(key, format!("`{key}` must be an array of token ids"));
    match obj.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(|v| token_id(v).ok_or_else(err)).collect(),
        Some(_) => Err(err()),
    }
}

/// The parameters shared by both endpoints, checked against `limits`.
pub fn parse_params(obj: &Map<String, Value>, limits: &Limits) -> Result<Params, ApiError> {
    let max_tokens = match number(obj, "max_tokens")?.or(number(obj, "max_completion_tokens")?) {
        None => 16.min(limits.max_tokens_limit),
        Some(v) if v >= 1.0 && v.fract() == 0.0 => v as usize,
        Some(v) => {
            return Err(ApiError::invalid_param(
                "max_tokens",
                format!("`max_tokens` must be a positive integer, got {v}"),
            ))
        }
    };
    if max_tokens > limits.max_tokens_limit {
        return Err(ApiError::invalid_param(
            "max_tokens",
            format!(
                "`max_tokens` = {max_tokens} exceeds this server's limit of {} (--max-tokens-limit)",
                limits.max_tokens_limit
            ),
        ));
    }
    let temperature = number(obj, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid_param(
            "temperature",
            format!("`temperature` must be in [0, 2], got {temperature}"),
        ));
    }
    let top_p = number(obj, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid_param(
            "top_p",
            format!("`top_p` must be in (0, 1], got {top_p}"),
        ));
    }
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            ApiError::invalid_param(
                "seed",
                format!("`seed` must be a non-negative integer, got {v}"),
            )
        })?),
    };
    if let Some(n) = number(obj, "n")? {
        if n != 1.0 {
            return Err(ApiError::invalid_param(
                "n",
                format!("`n` = {n} is not supported (only 1)"),
            ));
        }
    }
    let stream = boolean(obj, "stream")?;
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid_param(
                    "stream_options",
                    "`stream_options` is only allowed with \"stream\": true",
                ));
            }
            boolean(o, "include_usage").map_err(|_| {
                ApiError::invalid_param(
                    "stream_options",
                    "`stream_options.include_usage` must be a boolean",
                )
            })?
        }
        Some(v) => {
            return Err(ApiError::invalid_param(
                "stream_options",
                format!("`stream_options` must be an object, got {v}"),
            ))
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
        include_usage,
        ignore_eos: boolean(obj, "ignore_eos")?,
    })
}

/// The prompts of `/v1/completions`: a string, an array of strings, an array of token ids, or
/// an array of arrays of token ids.
pub fn completion_prompts(obj: &Map<String, Value>) -> Result<Vec<Prompt>, ApiError> {
    let err = || {
        ApiError::invalid_param(
            "prompt",
            "`prompt` must be a string, an array of strings, an array of token ids or an array of \
             arrays of token ids",
        )
    };
    let tokens = |a: &[Value]| -> Result<Prompt, ApiError> {
        if a.is_empty() {
            return Err(ApiError::invalid_param(
                "prompt",
                "`prompt` has an empty token list",
            ));
        }
        a.iter()
            .map(|v| token_id(v).ok_or_else(err))
            .collect::<Result<Vec<_>, _>>()
            .map(Prompt::Tokens)
    };
    let prompts = match obj.get("prompt") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "missing `prompt` (a string, an array of strings or token ids)",
            ))
        }
        Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
        Some(Value::Array(a)) if a.first().is_some_and(Value::is_number) => vec![tokens(a)?],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(Prompt::Text(s.clone())),
                Value::Array(t) => tokens(t),
                _ => Err(err()),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(err()),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid_param(
            "prompt",
            "`prompt` is an empty array",
        ));
    }
    Ok(prompts)
}

/// The `messages` of `/v1/chat/completions`; a `content` may be a string or an array of text
/// parts (`{"type": "text", "text": ...}`), which are joined.
pub fn chat_messages(obj: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let err = |what: String| ApiError::invalid_param("messages", what);
    let messages = match obj.get("messages") {
        Some(Value::Array(a)) => a,
        Some(v) => return Err(err(format!("`messages` must be an array, got {v}"))),
        None => {
            return Err(err(
                "missing `messages` (an array of {role, content})".into()
            ))
        }
    };
    if messages.is_empty() {
        return Err(err("`messages` is empty".into()));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| err(format!("`messages[{i}].role` must be a string, got {m}")))?;
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(
                        |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                            (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                            _ => Err(err(format!(
                            "`messages[{i}].content` part {p} is not supported (only text parts)"
                        ))),
                        },
                    )
                    .collect::<Result<String, _>>()?,
                Some(v) => {
                    return Err(err(format!(
                    "`messages[{i}].content` must be a string or an array of text parts, got {v}"
                )))
                }
            };
            Ok(ChatMessage {
                role: role.to_string(),
                content,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    const LIMITS: Limits = Limits {
        max_prompt_tokens: 64,
        max_tokens_limit: 16,
        max_batch: 4,
        vocab_size: 320,
    };

    #[test]
    fn content_type_must_be_json() {
        let mut h = HeaderMap::new();
        assert_eq!(
            check_content_type(&h).unwrap_err().status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        h.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        let e = check_content_type(&h).unwrap_err();
        assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert!(e.message.contains("text/plain"), "{}", e.message);
        h.insert(
            header::CONTENT_TYPE,
            "Application/JSON; charset=utf-8".parse().unwrap(),
        );
        check_content_type(&h).unwrap();
        h.insert(
            header::CONTENT_TYPE,
            "application/vnd.x+json".parse().unwrap(),
        );
        check_content_type(&h).unwrap();
    }

    #[test]
    fn unsupported_fields_are_refused_only_when_they_ask_for_something() {
        for off in [
            json!({"logprobs": null, "echo": false, "top_logprobs": 0, "suffix": "", "best_of": 1}),
            json!({"logprobs": false}),
            json!({"logit_bias": {}, "presence_penalty": 0.0, "tools": [], "response_format": {"type": "text"}}),
        ] {
            reject_unsupported(&obj(off)).unwrap();
        }
        for (on, key) in [
            (json!({"logprobs": 0}), "logprobs"),
            (json!({"logprobs": 1}), "logprobs"),
            (json!({"logprobs": true}), "logprobs"),
            (json!({"echo": true}), "echo"),
            (json!({"best_of": 3}), "best_of"),
            (json!({"frequency_penalty": 0.5}), "frequency_penalty"),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
        ] {
            let e = reject_unsupported(&obj(on)).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.param, Some(key));
            assert!(e.message.contains("not supported"), "{}", e.message);
        }
    }

    #[test]
    fn params_read_stream_options_and_ignore_eos() {
        let p = parse_params(
            &obj(json!({"stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true, "max_tokens": 4})),
            &LIMITS,
        )
        .unwrap();
        assert!(p.stream && p.include_usage && p.ignore_eos);
        assert_eq!(p.max_tokens, 4);
        let e = parse_params(
            &obj(json!({"stream_options": {"include_usage": true}})),
            &LIMITS,
        )
        .unwrap_err();
        assert!(e.message.contains("only allowed"), "{}", e.message);
        let e = parse_params(&obj(json!({"ignore_eos": "yes"})), &LIMITS).unwrap_err();
        assert!(e.message.contains("ignore_eos"), "{}", e.message);
    }

    #[test]
    fn model_names_are_checked() {
        check_model(&obj(json!({"model": "dsv3"})), "dsv3").unwrap();
        check_model(&obj(json!({})), "dsv3").unwrap();
        let e = check_model(&obj(json!({"model": "gpt-4o"})), "dsv3").unwrap_err();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(e.code, Some("model_not_found"));
        assert!(e.message.contains("gpt-4o"));
    }

    #[test]
    fn prompts_take_text_or_token_ids() {
        assert_eq!(
            completion_prompts(&obj(json!({"prompt": [5, 6, 7]}))).unwrap(),
            vec![Prompt::Tokens(vec![5, 6, 7])]
        );
        assert_eq!(
            completion_prompts(&obj(json!({"prompt": ["a", [1, 2]]}))).unwrap(),
            vec![Prompt::Text("a".into()), Prompt::Tokens(vec![1, 2])]
        );
        assert!(completion_prompts(&obj(json!({"prompt": [[]]}))).is_err());
        assert!(completion_prompts(&obj(json!({"prompt": [1, "a"]}))).is_err());
        assert!(completion_prompts(&obj(json!({"prompt": 5}))).is_err());
    }

    #[test]
    fn chat_content_may_be_text_parts() {
        let m = chat_messages(&obj(json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}
        ]})))
        .unwrap();
        assert_eq!(m[0].content, "Hello");
        let e = chat_messages(&obj(json!({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
        ]})))
        .unwrap_err();
        assert!(e.message.contains("only text parts"), "{}", e.message);
    }
}
