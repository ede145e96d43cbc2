//! One benchmark request: a streaming `POST /v1/completions` whose server-sent events are read
//! as they arrive, timing the first chunk and the end, and taking the token counts from the
//! usage chunk (`stream_options.include_usage`).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;

/// What one request measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestOutcome {
    /// Why it failed (HTTP status, error event, broken stream), if it did.
    pub error: Option<String>,
    /// Seconds from sending to the first chunk with a choice.
    pub ttft: f64,
    /// Seconds from sending to the end of the stream.
    pub latency: f64,
    /// Prompt tokens, as the server counted them.
    pub prompt_tokens: usize,
    /// Generated tokens, as the server counted them.
    pub output_tokens: usize,
}

impl RequestOutcome {
    /// Mean seconds per output token after the first (`None` with fewer than two tokens).
    pub fn tpot(&self) -> Option<f64> {
        (self.output_tokens >= 2)
            .then(|| (self.latency - self.ttft) / (self.output_tokens - 1) as f64)
    }

    fn failed(error: String, start: Instant) -> Self {
        Self {
            error: Some(error),
            latency: start.elapsed().as_secs_f64(),
            ..Self::default()
        }
    }
}

/// Where and how to send requests.
#[derive(Clone, Debug)]
pub struct Target {
    /// `http://host:port`, without a trailing slash.
    pub base: String,
    /// Sent as `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Per-request limit.
    pub timeout: Duration,
}

impl Target {
    fn post(&self, client: &reqwest::Client, path: &str, body: Vec<u8>) -> reqwest::RequestBuilder {
        let req = client
            .post(format!("{}{path}", self.base))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .timeout(self.timeout)
            .body(body);
        match &self.api_key {
            Some(k) => req.bearer_auth(k),
            None => req,
        }
    }

    /// `GET path` as JSON.
    pub async fn get_json(&self, client: &reqwest::Client, path: &str) -> Result<Value, String> {
        let mut req = client
            .get(format!("{}{path}", self.base))
            .timeout(self.timeout);
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.map_err(|e| format!("GET {path}: {e}"))?;
        let status = resp.status();
        let text = resp.text().await.map_err(|e| format!("GET {path}: {e}"))?;
        if !status.is_success() {
            return Err(format!("GET {path}: {status}: {text}"));
        }
        serde_json::from_str(&text).map_err(|e| format!("GET {path}: not JSON ({e}): {text}"))
    }
}

/// Handles one `data:` payload; returns whether the stream is complete (`[DONE]`).
fn on_data(data: &str, start: Instant, out: &mut RequestOutcome) -> Result<bool, String> {
    if data == "[DONE]" {
        return Ok(true);
    }
    let v: Value = serde_json::from_str(data).map_err(|e| format!("bad event ({e}): {data}"))?;
    if let Some(err) = v.get("error") {
        return Err(format!("error event: {err}"));
    }
    let has_choice = v
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty());
    if has_choice && out.ttft == 0.0 {
        out.ttft = start.elapsed().as_secs_f64();
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        let count = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
        out.prompt_tokens = count("prompt_tokens");
        out.output_tokens = count("completion_tokens");
    }
    Ok(false)
}

/// Sends `body` (a streaming completion request) and measures it.
pub async fn run_one(client: &reqwest::Client, target: &Target, body: Vec<u8>) -> RequestOutcome {
    let start = Instant::now();
    let resp = match target.post(client, "/v1/completions", body).send().await {
        Ok(r) => r,
        Err(e) => return RequestOutcome::failed(format!("request failed: {e}"), start),
    };
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return RequestOutcome::failed(format!("HTTP {status}: {text}"), start);
    }
    let mut out = RequestOutcome::default();
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => return RequestOutcome::failed(format!("stream broke: {e}"), start),
        };
        buf.extend_from_slice(&chunk);
        // Complete lines only; an event's `data:` line ends with a newline.
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim_end().strip_prefix("data:") else {
                continue;
            };
            match on_data(data.trim_start(), start, &mut out) {
                Ok(true) => done = true,
                Ok(false) => {}
                Err(e) => return RequestOutcome::failed(e, start),
            }
        }
    }
    out.latency = start.elapsed().as_secs_f64();
    if !done {
        out.error = Some("the stream ended without [DONE]".to_string());
    } else if out.ttft == 0.0 {
        out.error = Some("the stream had no chunk with a choice".to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_give_first_chunk_time_and_usage() {
        let start = Instant::now();
        let mut out = RequestOutcome::default();
        assert!(!on_data(
            r#"{"choices":[{"index":0,"text":"a"}],"usage":null}"#,
            start,
            &mut out
        )
        .unwrap());
        assert!(out.ttft > 0.0);
        let ttft = out.ttft;
        on_data(
            r#"{"choices":[{"index":0,"text":"b"}],"usage":null}"#,
            start,
            &mut out,
        )
        .unwrap();
        assert_eq!(
            out.ttft, ttft,
            "only the first chunk sets the time to first token"
        );
        on_data(
            r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9,"total_tokens":14}}"#,
            start,
            &mut out,
        )
        .unwrap();
        assert_eq!((out.prompt_tokens, out.output_tokens), (5, 9));
        assert!(on_data("[DONE]", start, &mut out).unwrap());
        let err = on_data(r#"{"error":{"message":"engine died"}}"#, start, &mut out).unwrap_err();
        assert!(err.contains("engine died"), "{err}");
        out.latency = out.ttft + 0.8;
        assert!((out.tpot().unwrap() - 0.1).abs() < 1e-9);
    }
}
