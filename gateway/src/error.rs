//! The one HTTP-facing error type.
//!
//! Every error the gateway itself produces is an [`ApiError`]: one `match` picks the status, one
//! `IntoResponse` writes OpenAI's `{"error":{"message","type","param","code"}}` so client SDKs
//! raise their usual exceptions. [`ApiError::kind`] is a short fixed string used as a metric label
//! and in usage events. 5xx bodies never carry internal details; the cause goes to the log.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::SecondsFormat;
use serde::{Deserialize, Serialize};

use crate::budget::{RateKind, Refusal};
use crate::types::price::Usd;

/// OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`: what every error
/// response carries, and what `gatewayctl` reads its message from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The `error` of an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Human-readable explanation.
    pub message: String,
    /// OpenAI's error type, e.g. `invalid_request_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The offending field, if any.
    pub param: Option<String>,
    /// OpenAI's error code, if any.
    pub code: Option<String>,
}

/// Errors answered to API clients.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON.
    #[error("invalid JSON body: {0}")]
    InvalidJson(String),
    /// A field is missing or has the wrong type or value.
    #[error("{message}")]
    InvalidRequest {
        /// Human-readable explanation.
        message: String,
        /// The offending field, e.g. `messages[0].role`.
        param: Option<String>,
    },
    /// Missing, malformed, unknown or revoked API key.
    #[error("{0}")]
    Unauthorized(String),
    /// The admin API is disabled or the caller is not allowed.
    #[error("{0}")]
    Forbidden(String),
    /// No such model.
    #[error("the model `{0}` does not exist or is not served by this gateway")]
    ModelNotFound(String),
    /// No such resource (admin API) or route.
    #[error("{0}")]
    NotFound(String),
    /// The route exists but not with this method.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// A uniqueness rule was violated (admin API).
    #[error("{0}")]
    Conflict(String),
    /// The body is not of a media type the route accepts (admin writes take JSON only).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// The request's header section is over the limits (431).
    #[error("{0}")]
    HeadersTooLarge(String),
    /// The body did not arrive within `server.body_read_timeout_ms`.
    #[error("the request body was not received within {secs} s (server.body_read_timeout_ms)")]
    RequestTimeout {
        /// The configured deadline, in seconds.
        secs: f64,
    },
    /// The body exceeds `server.max_body_bytes`.
    #[error("request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge {
        /// The configured limit.
        limit: usize,
    },
    /// A replica answered something that is not a valid response (or every attempt failed).
    #[error("upstream error: {message}")]
    BadGateway {
        /// What went wrong, without internal details.
        message: String,
    },
    /// No replica could take the request (all unhealthy or at their concurrency limit).
    #[error("{message}")]
    Unavailable {
        /// What is unavailable.
        message: String,
        /// Seconds the client should wait before retrying.
        retry_after: u64,
    },
    /// A budget cannot cover the request (429 `insufficient_quota`).
    #[error("{message}")]
    InsufficientQuota {
        /// Which budget and window, and what is left.
        message: String,
        /// Seconds to the window's reset.
        retry_after: u64,
    },
    /// A rate limit is exhausted for now (429 `rate_limit_exceeded`).
    #[error("{message}")]
    RateLimited {
        /// Which limit.
        message: String,
        /// `requests` or `tokens` (OpenAI's `error.type` for rate limits).
        kind: &'static str,
        /// Seconds until the request would fit.
        retry_after: u64,
    },
    /// The guard found the session looping and refuses it (429 `loop_detected`): throttled
    /// for a cooldown (`Retry-After`) or blocked until an admin clears it.
    #[error("{message}")]
    LoopDetected {
        /// Which session, what repeated, and how to clear it.
        message: String,
        /// Seconds until the cooldown ends; `None`: blocked (the client should not retry).
        retry_after: Option<u64>,
    },
    /// A client retry beyond the tenant's retry budget (429 `retry_budget_exceeded`).
    #[error("{message}")]
    RetryBudgetExceeded {
        /// How many retries the tenant sent and what the budget allows.
        message: String,
        /// Seconds the client should wait before retrying.
        retry_after: u64,
    },
    /// The upstream did not answer in time.
    #[error("upstream timed out: {0}")]
    GatewayTimeout(String),
    /// A bug or an unreachable dependency; the cause is logged, not returned.
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

/// The `kind` (and `error.code`) of the gateway's own policy refusals: a budget, a rate limit,
/// a loop, the retry budget. A repeat of such a request gets the same refusal.
pub const POLICY_REFUSALS: [&str; 4] = [
    INSUFFICIENT_QUOTA,
    RATE_LIMIT_EXCEEDED,
    LOOP_DETECTED,
    RETRY_BUDGET_EXCEEDED,
];
const INSUFFICIENT_QUOTA: &str = "insufficient_quota";
const RATE_LIMIT_EXCEEDED: &str = "rate_limit_exceeded";
const LOOP_DETECTED: &str = "loop_detected";
const RETRY_BUDGET_EXCEEDED: &str = "retry_budget_exceeded";

impl ApiError {
    /// Shorthand for [`ApiError::InvalidRequest`] naming a field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// Wrap any error as an internal one.
    pub fn internal(e: impl Into<anyhow::Error>) -> Self {
        Self::Internal(e.into())
    }

    /// HTTP status for this error.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidJson(_) | Self::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::ModelNotFound(_) | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Self::HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::BadGateway { .. } => StatusCode::BAD_GATEWAY,
            Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::InsufficientQuota { .. }
            | Self::RateLimited { .. }
            | Self::LoopDetected { .. }
            | Self::RetryBudgetExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::GatewayTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Short fixed label for metrics, logs and usage events.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidJson(_) => "invalid_json",
            Self::InvalidRequest { .. } => "invalid_request",
            Self::Unauthorized(_) => "unauthorized",
            Self::Forbidden(_) => "forbidden",
            Self::ModelNotFound(_) => "model_not_found",
            Self::NotFound(_) => "not_found",
            Self::MethodNotAllowed(_) => "method_not_allowed",
            Self::Conflict(_) => "conflict",
            Self::PayloadTooLarge { .. } => "payload_too_large",
            Self::RequestTimeout { .. } => "request_timeout",
            Self::HeadersTooLarge(_) => "headers_too_large",
            Self::UnsupportedMediaType(_) => "unsupported_media_type",
            Self::BadGateway { .. } => "bad_gateway",
            Self::Unavailable { .. } => "unavailable",
            Self::InsufficientQuota { .. } => INSUFFICIENT_QUOTA,
            Self::RateLimited { .. } => RATE_LIMIT_EXCEEDED,
            Self::LoopDetected { .. } => LOOP_DETECTED,
            Self::RetryBudgetExceeded { .. } => RETRY_BUDGET_EXCEEDED,
            Self::GatewayTimeout(_) => "timeout",
            Self::Internal(_) => "internal",
        }
    }

    /// OpenAI's `error.type` for this error.
    fn openai_type(&self) -> &'static str {
        match self {
            Self::InvalidJson(_)
            | Self::InvalidRequest { .. }
            | Self::ModelNotFound(_)
            | Self::NotFound(_)
            | Self::MethodNotAllowed(_)
            | Self::Conflict(_)
            | Self::PayloadTooLarge { .. }
            | Self::RequestTimeout { .. }
            | Self::HeadersTooLarge(_)
            | Self::UnsupportedMediaType(_) => "invalid_request_error",
            Self::Unauthorized(_) => "authentication_error",
            Self::Forbidden(_) => "permission_error",
            Self::BadGateway { .. } | Self::GatewayTimeout(_) | Self::Internal(_) => "api_error",
            Self::Unavailable { .. } => "service_unavailable",
            Self::InsufficientQuota { .. } => "insufficient_quota",
            Self::RateLimited { kind, .. } => kind,
            Self::LoopDetected { .. } | Self::RetryBudgetExceeded { .. } => "rate_limit_error",
        }
    }

    /// OpenAI's `error.code` for this error.
    fn code(&self) -> Option<&'static str> {
        match self {
            Self::Unauthorized(_) => Some("invalid_api_key"),
            Self::ModelNotFound(_) => Some("model_not_found"),
            Self::PayloadTooLarge { .. } => Some("request_too_large"),
            Self::RequestTimeout { .. } => Some("request_timeout"),
            Self::HeadersTooLarge(_) => Some("request_header_fields_too_large"),
            Self::InvalidJson(_) => Some("invalid_json"),
            Self::InsufficientQuota { .. } => Some(INSUFFICIENT_QUOTA),
            Self::RateLimited { .. } => Some(RATE_LIMIT_EXCEEDED),
            Self::LoopDetected { .. } => Some(LOOP_DETECTED),
            Self::RetryBudgetExceeded { .. } => Some(RETRY_BUDGET_EXCEEDED),
            _ => None,
        }
    }

    /// The body, as OpenAI shapes it.
    pub fn error_body(&self) -> ErrorBody {
        let param = match self {
            Self::InvalidRequest { param, .. } => param.clone(),
            Self::ModelNotFound(_) => Some("model".to_owned()),
            _ => None,
        };
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.openai_type().to_owned(),
                param,
                code: self.code().map(str::to_owned),
            },
        }
    }

    /// [`ApiError::error_body`] as JSON.
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(self.error_body()).unwrap_or_default()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if let Self::Internal(cause) = &self {
            tracing::error!(error = ?cause, "internal error");
        }
        let mut response = (status, axum::Json(self.body())).into_response();
        if let Self::Unavailable { retry_after, .. }
        | Self::InsufficientQuota { retry_after, .. }
        | Self::RateLimited { retry_after, .. }
        | Self::RetryBudgetExceeded { retry_after, .. } = &self
        {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(*retry_after));
        }
        if let Self::LoopDetected { retry_after, .. } = &self {
            let headers = response.headers_mut();
            match retry_after {
                Some(secs) => {
                    headers.insert(header::RETRY_AFTER, HeaderValue::from(*secs));
                }
                // Blocked: OpenAI's SDKs honour `x-should-retry: false` and stop retrying.
                None => {
                    headers.insert(
                        crate::headers::SHOULD_RETRY,
                        HeaderValue::from_static("false"),
                    );
                }
            }
        }
        response
    }
}

impl From<Refusal> for ApiError {
    /// The budget step's refusal as the client sees it: which budget or limit, what is used,
    /// and when to retry.
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::Exhausted(e) => {
                let mut used = Vec::new();
                if let Some(l) = e.limit.tokens {
                    used.push(format!("{} of {l} tokens spent or reserved", e.used_tokens));
                }
                if let Some(l) = e.limit.micros {
                    used.push(format!(
                        "{:#} of {:#} spent or reserved",
                        Usd(e.used_micros),
                        Usd(l)
                    ));
                }
                ApiError::InsufficientQuota {
                    message: format!(
                        "budget {} ({} scope, {} window) cannot cover this request: {}; this \
                         request needs {} prompt tokens plus at least {} completion tokens; the \
                         window resets at {}",
                        e.policy_id,
                        e.scope.label(),
                        e.window.as_str(),
                        used.join(", "),
                        e.prompt_tokens,
                        e.min_tokens,
                        e.resets_at.to_rfc3339_opts(SecondsFormat::Secs, true)
                    ),
                    retry_after: u64::try_from((e.resets_at - e.now).num_seconds().max(1))
                        .unwrap_or(1),
                }
            }
            Refusal::RateLimited {
                kind,
                per_minute,
                key_id,
                retry_after_ms,
            } => {
                let what = match kind {
                    RateKind::Requests => "requests",
                    RateKind::Tokens => "tokens",
                };
                let scope = key_id.map_or_else(|| "tenant".to_owned(), |k| format!("key {k}"));
                ApiError::RateLimited {
                    message: format!(
                        "rate limit reached: {per_minute} {what} per minute for the {scope}; \
                         retry in {:.1}s",
                        retry_after_ms as f64 / 1000.0
                    ),
                    kind: what,
                    retry_after: u64::try_from(retry_after_ms.max(0))
                        .unwrap_or(0)
                        .div_ceil(1000)
                        .max(1),
                }
            }
            Refusal::StoreUnavailable => ApiError::Unavailable {
                message: "the budget store is unreachable and this tenant's budgets fail \
                          closed; retry shortly"
                    .into(),
                retry_after: 1,
            },
            Refusal::Internal(e) => ApiError::internal(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_openai_shaped_and_5xx_hides_the_cause() {
        let e = ApiError::invalid("messages[0].role", "missing field `role`");
        let b = e.body();
        assert_eq!(b["error"]["param"], "messages[0].role");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);

        let e = ApiError::internal(anyhow::anyhow!("password=hunter2"));
        assert_eq!(e.body()["error"]["message"], "internal error");
        assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
