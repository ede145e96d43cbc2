//! API errors as OpenAI sends them: a status and `{"error": {"message", "type", "param",
//! "code"}}`.

use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// An API error: status, OpenAI error type, message, and optionally the parameter and a code.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// What went wrong, naming the argument and its value.
    pub message: String,
    /// The request field at fault.
    pub param: Option<&'static str>,
    /// A machine-readable code (`model_not_found`, `invalid_api_key`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: a malformed or unacceptable request.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 400 for request field `param`.
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param),
            ..Self::invalid(message)
        }
    }

    /// 400: a field this server does not implement was given a value that needs it.
    pub fn unsupported(param: &'static str, value: &Value) -> Self {
        Self {
            code: Some("unsupported_parameter"),
            ..Self::invalid_param(
                param,
                format!("`{param}` = {value} is not supported by this server"),
            )
        }
    }

    /// 404: no model of that name is served.
    pub fn model_not_found(model: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!(
                "The model `{model}` does not exist; this server serves `{served}` (--model-name)"
            ),
            param: Some("model"),
            code: Some("model_not_found"),
        }
    }

    /// 500: the server failed.
    pub fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 503: the generation engine has stopped.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            ..Self::server(message)
        }
    }

    /// A body that could not be read (too large, broken stream).
    pub fn body(e: BytesRejection) -> Self {
        Self {
            status: e.status(),
            ..Self::invalid(format!("cannot read the request body: {}", e.body_text()))
        }
    }

    /// The `{"error": ...}` object.
    pub fn to_json(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.to_json())).into_response()
    }
}
