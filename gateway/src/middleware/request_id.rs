//! Request ids: the gateway mints its own for every request. It is the ledger row's key, the
//! budget reservation's id and the replay dedupe key, so nothing a client sends may choose it:
//! a client's `x-request-id` (or `x-client-request-id`) is kept only as a correlation id, logged
//! and echoed back as `x-client-request-id`.

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument as _;

use crate::headers::{CLIENT_REQUEST_ID, REQUEST_ID};

/// Longest client correlation id kept (longer ones are ignored, not truncated).
pub const MAX_CLIENT_ID_LEN: usize = 128;

/// The ids of one request, in the request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId {
    /// Minted by the gateway: `req_` and 32 hex digits, unique per request and in the order
    /// requests arrived (see [`RequestId::mint`]).
    pub id: String,
    /// What the client sent as its own id, when it is short printable ASCII.
    pub client: Option<String>,
}

impl RequestId {
    /// A fresh gateway id: a UUIDv7 (48 bits of Unix milliseconds, then a counter and random
    /// bits), so ids sort by time. The ledger's primary key is this id: time-ordered keys go
    /// into its index at the end, where random ones touched a random page of it per row
    /// (SQLite and Postgres alike).
    pub fn mint() -> String {
        format!("req_{}", uuid::Uuid::now_v7().simple())
    }
}

fn client_id(req: &Request) -> Option<String> {
    [&CLIENT_REQUEST_ID, &REQUEST_ID]
        .into_iter()
        .filter_map(|name| req.headers().get(name))
        .filter_map(|v| v.to_str().ok())
        .map(str::trim)
        .find(|v| {
            !v.is_empty() && v.len() <= MAX_CLIENT_ID_LEN && v.bytes().all(|b| b.is_ascii_graphic())
        })
        .map(str::to_owned)
}

/// The edge of every request: refuse oversized headers (431, see
/// [`super::headers::oversized`]), replace whatever request id the client sent with a minted one
/// (for every layer and handler behind this one, and the upstream), remember the client's as its
/// correlation id, run the request in its log span, and answer with both ids.
pub async fn assign(mut req: Request, next: Next) -> Response {
    if let Some(refused) = super::headers::oversized(req.headers()) {
        return refused;
    }
    let client = client_id(&req);
    let id = RequestId::mint();
    let value = HeaderValue::from_str(&id).ok();
    if let Some(v) = &value {
        req.headers_mut().insert(REQUEST_ID, v.clone());
    }
    let echo = client
        .as_deref()
        .and_then(|c| HeaderValue::from_str(c).ok());
    match &echo {
        Some(c) => req.headers_mut().insert(CLIENT_REQUEST_ID, c.clone()),
        None => req.headers_mut().remove(CLIENT_REQUEST_ID),
    };
    let span = tracing::info_span!(
        "request",
        method = %req.method(),
        path = %req.uri().path(),
        request_id = id.as_str(),
        client_request_id = client.as_deref().unwrap_or(""),
    );
    req.extensions_mut().insert(RequestId { id, client });
    let mut response = next.run(req).instrument(span).await;
    if let Some(v) = value {
        response.headers_mut().insert(REQUEST_ID, v);
    }
    if let Some(c) = echo {
        response.headers_mut().insert(CLIENT_REQUEST_ID, c);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(headers: &[(&str, &str)]) -> Request {
        let mut b = Request::builder();
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(axum::body::Body::empty()).unwrap_or_default()
    }

    #[test]
    fn client_ids_are_correlation_only_and_must_be_short_printable_ascii() {
        assert_eq!(
            client_id(&with(&[("x-request-id", "abc-1")])).as_deref(),
            Some("abc-1")
        );
        assert_eq!(
            client_id(&with(&[
                ("x-request-id", "a"),
                ("x-client-request-id", "b")
            ]))
            .as_deref(),
            Some("b"),
            "the explicit correlation header wins"
        );
        assert_eq!(client_id(&with(&[("x-request-id", "has space")])), None);
        let long = "x".repeat(MAX_CLIENT_ID_LEN + 1);
        assert_eq!(client_id(&with(&[("x-request-id", long.as_str())])), None);
        let (a, b) = (RequestId::mint(), RequestId::mint());
        assert!(a.starts_with("req_") && a.len() == 36 && a != b);
        let ids: Vec<String> = (0..10_000).map(|_| RequestId::mint()).collect();
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "ids sort in the order they were minted"
        );
    }
}
