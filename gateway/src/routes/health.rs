//! Probes and metrics: the unauthenticated allowlist.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::ApiError;
use crate::state::AppState;

/// `GET /healthz`: the process is up.
pub async fn healthz() -> &'static str {
    "ok"
}

/// How long `/readyz` waits for the store's answer (a load balancer's probe must not hang).
const STORE_PING_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// `GET /readyz`: whether this replica can serve, which is whether every tier has a replica in
/// rotation. The store's state is reported but does not decide: while the database is down,
/// requests are still served (keys from the snapshot, ledger rows to the spool), and a probe
/// that failed on it would have a load balancer pull every replica at once.
pub async fn readyz(State(state): State<AppState>) -> Response {
    let store_ok = matches!(
        tokio::time::timeout(STORE_PING_TIMEOUT, state.store.ping()).await,
        Ok(Ok(()))
    );
    let now = std::time::Instant::now();
    let tiers: serde_json::Map<String, serde_json::Value> = state
        .upstreams
        .snapshot(now)
        .into_iter()
        .map(|(tier, replicas)| {
            let healthy = replicas.iter().filter(|r| r.healthy).count();
            (
                tier,
                json!({"healthy_replicas": healthy, "replicas": replicas.len()}),
            )
        })
        .collect();
    let tiers_ok = tiers
        .values()
        .all(|t| t["healthy_replicas"].as_u64().unwrap_or(0) > 0);
    let status = if tiers_ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({"ready": status == StatusCode::OK, "store": store_ok, "tiers": tiers})),
    )
        .into_response()
}

/// `GET /metrics`: Prometheus text format.
pub async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state
            .metrics
            .render(&state.upstreams.snapshot(std::time::Instant::now())),
    )
        .into_response()
}

/// Any other route: 404 in OpenAI shape.
pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {}", uri.path()))
}

/// A known route with the wrong method: 405 in OpenAI shape.
pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("{method} is not allowed on {}", uri.path()))
}
