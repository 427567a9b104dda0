//! The OpenAI-compatible surface: thin handlers over [`crate::pipeline`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::headers;
use crate::middleware::auth::ApiKeyAuth;
use crate::openai::Endpoint;
use crate::pipeline::{self, RequestContext};
use crate::routes::read_body;
use crate::state::AppState;
use crate::store::ApiKey;

/// `POST /v1/chat/completions`
pub async fn chat_completions(
    State(state): State<AppState>,
    ApiKeyAuth(key): ApiKeyAuth,
    req: Request,
) -> Response {
    proxy(state, key, req, Endpoint::Chat).await
}

/// `POST /v1/completions`
pub async fn completions(
    State(state): State<AppState>,
    ApiKeyAuth(key): ApiKeyAuth,
    req: Request,
) -> Response {
    proxy(state, key, req, Endpoint::Completions).await
}

/// `POST /v1/embeddings`
pub async fn embeddings(
    State(state): State<AppState>,
    ApiKeyAuth(key): ApiKeyAuth,
    req: Request,
) -> Response {
    proxy(state, key, req, Endpoint::Embeddings).await
}

/// Most tags one request's `x-gateway-tags` may carry (each is stored on its ledger row).
const MAX_REQUEST_TAGS: usize = 16;

/// Parse `x-gateway-tags: feature=search, user=42`.
fn request_tags(headers: &HeaderMap) -> Result<BTreeMap<String, String>, ApiError> {
    let mut tags = BTreeMap::new();
    let Some(value) = headers.get(headers::TAGS) else {
        return Ok(tags);
    };
    let bad = || {
        ApiError::invalid(
            headers::TAGS.as_str(),
            "expected comma-separated key=value pairs",
        )
    };
    let value = value.to_str().map_err(|_| bad())?;
    for pair in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').ok_or_else(bad)?;
        let (k, v) = (k.trim(), v.trim());
        if k.is_empty() || k.len() > 64 || v.len() > 256 {
            return Err(bad());
        }
        tags.insert(k.to_owned(), v.to_owned());
        if tags.len() > MAX_REQUEST_TAGS {
            return Err(ApiError::invalid(
                headers::TAGS.as_str(),
                format!("at most {MAX_REQUEST_TAGS} tags"),
            ));
        }
    }
    Ok(tags)
}

/// Add a client's `x-gateway-tags` to the key's: the key's own tags win (a client may add tags,
/// never replace one its key fixes, or a `tag:` budget could be escaped and attribution forged),
/// and a key with `client_tags` set allows only those names (400 naming the first other one).
fn merge_client_tags(
    tags: &mut BTreeMap<String, String>,
    key: &ApiKey,
    client: BTreeMap<String, String>,
) -> Result<(), ApiError> {
    for (k, v) in client {
        if tags.contains_key(&k) {
            continue;
        }
        if !key.allows_client_tag(&k) {
            return Err(ApiError::invalid(
                headers::TAGS.as_str(),
                format!(
                    "this key does not allow the client tag `{k}` (allowed: {})",
                    key.client_tags
                        .as_deref()
                        .filter(|t| !t.is_empty())
                        .map_or_else(|| "none".to_owned(), |t| t.join(", "))
                ),
            ));
        }
        tags.insert(k, v);
    }
    Ok(())
}

async fn proxy(state: AppState, key: Arc<ApiKey>, req: Request, endpoint: Endpoint) -> Response {
    // The request taken apart, not its headers copied (axum's `HeaderMap` extractor clones).
    let (parts, body) = req.into_parts();
    let headers = parts.headers;
    let started = Instant::now();
    let request_id_header = headers.get(headers::REQUEST_ID).cloned();
    let request_id = request_id_header
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .into();
    let mut ctx = RequestContext {
        request_id,
        request_id_header,
        tags: key.tags.clone(),
        key,
        started,
        started_at: chrono::Utc::now(),
        cache_control: crate::cache::Directives::parse(
            headers
                .get(axum::http::header::CACHE_CONTROL)
                .and_then(|v| v.to_str().ok()),
        ),
        session: None,
        retry: crate::guard::retries::ClientRetry::default(),
    };
    let retry = client_retry(&headers);
    let session = headers
        .get(headers::SESSION_ID)
        .map(|v| crate::guard::session::validate_header(v.as_bytes()))
        .transpose();
    let body = match (session, request_tags(&headers), retry) {
        (Ok(session), Ok(tags), Ok(retry)) => {
            ctx.session = session;
            ctx.retry = retry;
            match merge_client_tags(&mut ctx.tags, &ctx.key, tags) {
                Ok(()) => read_body(body, state.config.server.max_body_bytes).await,
                Err(e) => Err(e),
            }
        }
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => Err(e),
    };
    // The pipeline runs on a tracked task: a client hang-up drops this future, not the work.
    // Boxed: the pipeline's future is kilobytes, and the runtime moves a task's future and
    // its stage by value (into the task cell, out as the output) several times per request.
    // (Run in this task instead, handed to the tracker only if dropped, it executed fewer
    // instructions but cost more CPU per request at saturation: docs/benchmarks.md.)
    let task_state = state.clone();
    let handle = state.tasks.spawn(Box::pin(async move {
        match body {
            Ok(body) => pipeline::run(task_state, ctx, endpoint, body).await,
            Err(e) => pipeline::reject_early(&task_state, &ctx, endpoint, e).await,
        }
    }));
    handle
        .await
        .unwrap_or_else(|e| ApiError::internal(e).into_response())
}

/// The client's retry headers: the OpenAI SDKs' `x-stainless-retry-count` (a bad value is
/// ignored: it is informational) and `Idempotency-Key` (a bad one is a 400).
fn client_retry(headers: &HeaderMap) -> Result<crate::guard::retries::ClientRetry, ApiError> {
    let sdk_attempt = headers
        .get("x-stainless-retry-count")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    let idempotency_key = headers
        .get("idempotency-key")
        .map(|v| crate::guard::retries::validate_idempotency_key(v.as_bytes()))
        .transpose()
        .map_err(|message| ApiError::InvalidRequest {
            message,
            param: Some("Idempotency-Key".into()),
        })?;
    Ok(crate::guard::retries::ClientRetry {
        sdk_attempt,
        idempotency_key,
    })
}

fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "llm-gateway"})
}

/// `GET /v1/models`: every client-facing model name.
pub async fn list_models(State(state): State<AppState>, _: ApiKeyAuth) -> Json<Value> {
    let data: Vec<Value> = state
        .config
        .model_names()
        .iter()
        .map(|m| model_object(m))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// `GET /v1/models/{model}`
pub async fn get_model(
    State(state): State<AppState>,
    _: ApiKeyAuth,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if state.config.resolve_model(&model).is_some() {
        Ok(Json(model_object(&model)))
    } else {
        Err(ApiError::ModelNotFound(model))
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn tags_header_is_parsed_or_refused() {
        let mut h = HeaderMap::new();
        h.insert(headers::TAGS, "feature=search, user = 42".parse().unwrap());
        let t = request_tags(&h).unwrap();
        assert_eq!(t["feature"], "search");
        assert_eq!(t["user"], "42");
        h.insert(headers::TAGS, "nonsense".parse().unwrap());
        assert!(request_tags(&h).is_err());
    }
}
