//! Request ids: the gateway mints its own for every request. It is the ledger row's key, the
//! budget reservation's id and the replay dedupe key, so nothing a client sends may choose it:
//! a client's `x-request-id` (or `x-client-request-id`) is kept only as a correlation id, logged
//! and echoed back as `x-client-request-id`.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::response::{IntoResponse as _, Response};
use tower::Service;
use tracing::instrument::Instrumented;
use tracing::Instrument as _;

use crate::error::ApiError;
use crate::headers::{CLIENT_REQUEST_ID, REQUEST_ID};

/// Longest client correlation id kept (longer ones are ignored, not truncated).
pub const MAX_CLIENT_ID_LEN: usize = 128;

/// A fresh gateway id: `req_` and a UUIDv7's 32 hex digits (48 bits of Unix milliseconds, then a
/// counter and random bits), so ids sort by time. The ledger's primary key is this id:
/// time-ordered keys go into its index at the end, where random ones touched a random page of
/// it per row (SQLite and Postgres alike).
pub fn mint() -> HeaderValue {
    let mut id = *b"req_00000000000000000000000000000000";
    uuid::Uuid::now_v7().simple().encode_lower(&mut id[4..]);
    // One allocation, shared by its clones (the request's header, the answer's, the upstream
    // request's). ASCII letters, digits and `_`: always a valid header value.
    HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(id))
        .unwrap_or_else(|_| HeaderValue::from_static("req_"))
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

/// The edge of every request, wrapped around the whole router: refuse oversized headers (431,
/// see [`super::headers::oversized`]), replace whatever request id the client sent with a minted
/// one (for every layer and handler behind this one, and the upstream), remember the client's as
/// its correlation id, run the request in its log span, and answer with both ids.
///
/// A service of its own rather than an axum `from_fn` layer: its future is a named type, so a
/// request costs no boxed future and no clone of a boxed inner service here.
#[derive(Debug, Clone)]
pub struct Edge<S> {
    inner: S,
}

impl<S> Edge<S> {
    /// The edge in front of `inner`.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }
}

impl<S> Service<Request> for Edge<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = EdgeFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> Self::Future {
        if let Some(refused) = super::headers::oversized(req.headers()) {
            return EdgeFuture {
                future: None,
                refused: Some(refused),
                value: None,
                echo: None,
            };
        }
        let client = client_id(&req);
        let id = mint();
        req.headers_mut().insert(REQUEST_ID, id.clone());
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
            request_id = id.to_str().unwrap_or_default(),
            client_request_id = tracing::field::Empty,
        );
        if let Some(c) = client.as_deref() {
            span.record("client_request_id", c);
        }
        EdgeFuture {
            future: Some(self.inner.call(req).instrument(span)),
            refused: None,
            value: Some(id),
            echo,
        }
    }
}

pin_project_lite::pin_project! {
    /// The answer of [`Edge`]: the router's, with the request's ids added, or the edge's own
    /// refusal.
    pub struct EdgeFuture<F> {
        // The router's answer, in the request's span (none when the edge refused).
        #[pin]
        future: Option<Instrumented<F>>,
        // The edge's refusal.
        refused: Option<Response>,
        // The minted `x-request-id`.
        value: Option<HeaderValue>,
        // The client's id, echoed as `x-client-request-id`.
        echo: Option<HeaderValue>,
    }
}

impl<F> Future for EdgeFuture<F>
where
    F: Future<Output = Result<Response, Infallible>>,
{
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Some(future) = this.future.as_pin_mut() else {
            let refused = this.refused.take();
            return Poll::Ready(Ok(refused.unwrap_or_else(|| {
                ApiError::internal(anyhow::anyhow!(
                    "the edge's answer was polled after it was taken"
                ))
                .into_response()
            })));
        };
        let Ok(mut response) = ready!(future.poll(cx));
        if let Some(v) = this.value.take() {
            response.headers_mut().insert(REQUEST_ID, v);
        }
        if let Some(c) = this.echo.take() {
            response.headers_mut().insert(CLIENT_REQUEST_ID, c);
        }
        Poll::Ready(Ok(response))
    }
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
        let text = |v: HeaderValue| v.to_str().unwrap_or_default().to_owned();
        let (a, b) = (text(mint()), text(mint()));
        assert!(a.starts_with("req_") && a.len() == 36 && a != b, "{a}");
        assert!(a[4..].bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
        let ids: Vec<String> = (0..10_000).map(|_| text(mint())).collect();
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "ids sort in the order they were minted"
        );
    }
}
