//! Authentication: tenant API keys for `/v1`, the admin token for `/admin/v1` and `/dashboard`.
//! Deny by default: every `/v1` handler takes [`ApiKeyAuth`] (a test sends each `/v1` route
//! without a key), the admin routes sit behind [`require_admin`], and only the routes named in
//! `build_router`'s allowlist take neither.

use std::sync::Arc;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::header::{
    AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING, WWW_AUTHENTICATE,
};
use axum::http::request::Parts;
use axum::http::Method;
use axum::http::{HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use secrecy::ExposeSecret;
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::state::AppState;
use crate::store::ApiKey;

fn authorization(headers: &HeaderMap) -> Option<&str> {
    headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok())
}

/// The `/v1/*` handlers' first extractor: the bearer key resolved to a live
/// [`ApiKey`]; 401 in OpenAI shape otherwise (counted in `gateway_rejected_total`). An
/// extractor rather than a layer: a `from_fn` layer costs each request a clone of the boxed
/// inner service, a boxed future and a request-extensions map to pass the key on in.
#[derive(Debug, Clone)]
pub struct ApiKeyAuth(pub Arc<ApiKey>);

impl FromRequestParts<AppState> for ApiKeyAuth {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Response> {
        match state.auth.authenticate(authorization(&parts.headers)).await {
            Ok(key) => Ok(Self(key)),
            Err(e) => {
                state.metrics.rejected.with_label_values(&[e.kind()]).inc();
                Err(e.into_response())
            }
        }
    }
}

/// The realm browsers show when they prompt for the dashboard's credentials.
const DASHBOARD_REALM: &str = "Basic realm=\"llm-gateway\"";

/// Whether `req` may authenticate with HTTP Basic: only reading the dashboard page. A browser
/// resends Basic credentials by itself, even with a cross-site form, so everything else (every
/// write above all) takes the token as a bearer, which no other site can make a browser send.
fn basic_allowed(req: &Request) -> bool {
    req.method() == Method::GET && req.uri().path().starts_with("/dashboard")
}

/// Admin writes take JSON bodies only: a cross-site HTML form can post `text/plain` or form
/// encodings without a preflight, never `application/json`.
fn json_body_or_none(req: &Request) -> Result<(), ApiError> {
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return Ok(());
    }
    let length = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok());
    let has_body = match length {
        Some(n) => n.trim() != "0",
        None => req.headers().contains_key(TRANSFER_ENCODING),
    };
    let json = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"));
    if has_body && !json {
        return Err(ApiError::UnsupportedMediaType(
            "admin requests with a body must send it as Content-Type: application/json".into(),
        ));
    }
    Ok(())
}

/// The admin token a request presents: `Authorization: Bearer <token>`, or (for the dashboard
/// page only, see [`basic_allowed`]) HTTP Basic auth whose password is the token.
fn admin_credential(req: &Request) -> Option<String> {
    let value = authorization(req.headers())?;
    if let Some(token) = value.strip_prefix("Bearer ") {
        return Some(token.to_owned());
    }
    if !basic_allowed(req) {
        return None;
    }
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = STANDARD.decode(encoded.trim()).ok()?;
    let decoded = String::from_utf8(decoded).ok()?;
    decoded
        .split_once(':')
        .map(|(_user, password)| password.to_owned())
}

/// Compare the presented admin token (bearer, or the password of HTTP Basic auth) with
/// `admin.token` in constant time; 403 when no token is configured, 401 when it does not match.
/// Under `/dashboard` the 401 carries `WWW-Authenticate: Basic` so browsers prompt for it.
pub async fn require_admin(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(expected) = &state.config.admin.token else {
        return ApiError::Forbidden(
            "the admin API is disabled: set admin.token (GATEWAY__ADMIN__TOKEN)".into(),
        )
        .into_response();
    };
    // A request without a credential is refused outright, never compared: compared, it
    // would match an empty token if one ever got past `Config::validate`.
    let ok = match admin_credential(&req) {
        Some(presented) if !presented.is_empty() && !expected.expose_secret().is_empty() => {
            presented
                .as_bytes()
                .ct_eq(expected.expose_secret().as_bytes())
                .into()
        }
        _ => false,
    };
    if !ok {
        let mut response = ApiError::Unauthorized("invalid admin token".into()).into_response();
        if req.uri().path().starts_with("/dashboard") {
            response
                .headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static(DASHBOARD_REALM));
        }
        return response;
    }
    if let Err(e) = json_body_or_none(&req) {
        return e.into_response();
    }
    next.run(req).await
}
