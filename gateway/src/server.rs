//! The HTTP listener: accepts connections up to `server.max_connections`, serves HTTP/1.1 and
//! HTTP/2 on each with a header read deadline (`server.header_read_timeout_ms`, which is also how
//! long an idle keep-alive connection stays open) and a whole-body read deadline
//! (`server.body_read_timeout_ms`), and drains on shutdown.
//!
//! Without these a client trickling one header byte every few seconds (slowloris) holds a
//! connection, and its task, for ever; enough of them exhaust file descriptors.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::Router;
use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt as _;

use crate::config::ServerConfig;
use crate::middleware::request_id::Edge;

/// The error a request body yields once its read deadline has passed; `routes::read_body` turns
/// it into a 408.
#[derive(Debug, thiserror::Error)]
#[error("the request body was not received within {0:?}")]
pub struct BodyDeadline(pub Duration);

/// Connection limits from `[server]`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most connections open at once; at the cap the listener stops accepting until one closes.
    pub max_connections: usize,
    /// Deadline for a request's headers, from the moment the connection waits for them.
    pub header_read: Duration,
    /// Deadline for a request's whole body, from the moment its headers were read.
    pub body_read: Duration,
}

impl Limits {
    /// The limits `[server]` configures.
    pub fn from_config(c: &ServerConfig) -> Self {
        Self {
            max_connections: c.max_connections,
            header_read: Duration::from_millis(c.header_read_timeout_ms),
            body_read: Duration::from_millis(c.body_read_timeout_ms),
        }
    }
}

/// Serve `app` on `listener` until `shutdown` resolves; then stop accepting, ask every
/// connection to finish its in-flight requests, and return once all of them have closed.
pub async fn serve(
    listener: TcpListener,
    app: Edge<Router>,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Dropping `stop_tx` tells connections to shut down gracefully; each holds a `done_rx`, and
    // `done_tx.closed()` resolves when the last of them is gone.
    let (stop_tx, stop_rx) = watch::channel(());
    let (done_tx, done_rx) = watch::channel(());
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // hyper's default cap of 100 header fields stays: past it hyper answers 431 itself
        // (without a body) and closes the connection. A cap above 100 would keep its header
        // arrays off the stack: two 12.8 KB allocations, filled, per request (3% of the plain
        // path's throughput, docs/benchmarks.md).
        .header_read_timeout(limits.header_read);
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let body_read = limits.body_read;
        let service = app
            .clone()
            .map_request(move |req: http::Request<Incoming>| -> Request {
                req.map(|body| Body::new(DeadlineBody::new(body, body_read)))
            });
        let hyper_service = TowerToHyperService::new(service);
        let builder = builder.clone();
        let mut stop = stop_rx.clone();
        let done = done_rx.clone();
        tokio::spawn(async move {
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), hyper_service);
            tokio::pin!(conn);
            let mut stopping = false;
            loop {
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            tracing::debug!(%peer, error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    _ = stop.changed(), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(done);
            drop(permit);
        });
    }
    drop(listener);
    drop(stop_tx);
    drop(done_rx);
    done_tx.closed().await;
}

/// A request body that fails with [`BodyDeadline`] once `limit` has passed since its first
/// poll. The timer is only armed when the body is not already complete on that poll, so a small
/// body that arrived with its headers costs nothing.
pub struct DeadlineBody {
    inner: Incoming,
    limit: Duration,
    started: Option<tokio::time::Instant>,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl DeadlineBody {
    fn new(inner: Incoming, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            started: None,
            sleep: None,
        }
    }
}

impl hyper::body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let started = *this.started.get_or_insert_with(tokio::time::Instant::now);
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|f| f.map_err(axum::Error::new))),
            Poll::Pending => {
                let limit = this.limit;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(started + limit)));
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        Poll::Ready(Some(Err(axum::Error::new(BodyDeadline(limit)))))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
