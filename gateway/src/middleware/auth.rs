//! Authentication: tenant API keys for `/v1`, the admin token for `/admin/v1`. Deny by default:
//! only the routes named in `build_router`'s allowlist skip these layers.

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use secrecy::ExposeSecret;
use subtle::ConstantTimeEq;

use crate::app::AppState;
use crate::error::ApiError;

fn authorization(req: &Request) -> Option<&str> {
    req.headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
}

/// Resolve the bearer key to a live [`ApiKey`](crate::store::ApiKey) and put it in the request
/// extensions; 401 otherwise.
pub async fn require_api_key(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Response {
    match state.auth.authenticate(authorization(&req)).await {
        Ok(key) => {
            req.extensions_mut().insert(key);
            next.run(req).await
        }
        Err(e) => {
            state.metrics.rejected.with_label_values(&[e.kind()]).inc();
            e.into_response()
        }
    }
}

/// Compare the bearer token with `admin.token` in constant time; 403 when no token is configured,
/// 401 when it does not match.
pub async fn require_admin(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(expected) = &state.config.admin.token else {
        return ApiError::Forbidden(
            "the admin API is disabled: set admin.token (GATEWAY__ADMIN__TOKEN)".into(),
        )
        .into_response();
    };
    let presented = authorization(&req)
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let ok: bool = presented
        .as_bytes()
        .ct_eq(expected.expose_secret().as_bytes())
        .into();
    if !ok {
        return ApiError::Unauthorized("invalid admin token".into()).into_response();
    }
    next.run(req).await
}
