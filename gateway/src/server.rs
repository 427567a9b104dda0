//! The HTTP listener: accepts connections up to `server.max_connections`, serves HTTP/1.1 and
//! HTTP/2 on each with a header read deadline (`server.header_read_timeout_ms`, which is also how
//! long an idle keep-alive connection stays open) and a whole-body read deadline
//! (`server.body_read_timeout_ms`), and drains on shutdown.
//!
//! Without these a client trickling one header byte every few seconds (slowloris) holds a
//! connection, and its task, for ever; enough of them exhaust file descriptors.
//!
//! Connections are served on the caller's runtime ([`Listeners::Here`]) or on [`Lanes`]
//! (`server.runtime = "per-core"`): one single-worker runtime per thread, each accepting from
//! its own socket of one `SO_REUSEPORT` group, so a connection and its requests never move
//! between threads.

use std::cell::Cell;
use std::future::Future;
use std::net::SocketAddr;
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
use tokio::runtime::{Handle, Runtime};
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

/// Where connections are accepted and served.
pub enum Listeners {
    /// One listener, its connections served on the caller's runtime.
    Here(TcpListener),
    /// A listening socket per lane ([`bind_lanes`]); each lane serves the connections it
    /// accepted, and their requests, on its own runtime.
    Lanes(Vec<std::net::TcpListener>, Vec<Handle>),
}

/// Bind `n` listening sockets on `addr` (its port resolved first when 0) for the lanes.
///
/// On Unix they form one `SO_REUSEPORT` group, and the kernel spreads new connections over
/// them evenly (by a hash of the client's address and port). A socket bound without the option
/// first checks that the port is free and is closed again: a group would otherwise let a second
/// process of the same user (another gateway started by mistake) join it silently and take a
/// share of the connections, where now that process's start fails. Elsewhere every lane
/// accepts from one shared socket. Call from within a tokio runtime.
pub fn bind_lanes(addr: SocketAddr, n: usize) -> std::io::Result<Vec<std::net::TcpListener>> {
    let addr = std::net::TcpListener::bind(addr)?.local_addr()?;
    #[cfg(unix)]
    {
        (0..n.max(1))
            .map(|_| {
                let socket = match addr {
                    SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
                    SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
                };
                socket.set_reuseaddr(true)?;
                socket.set_reuseport(true)?;
                socket.bind(addr)?;
                socket.listen(1024)?.into_std()
            })
            .collect()
    }
    #[cfg(not(unix))]
    {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        (0..n.max(1)).map(|_| listener.try_clone()).collect()
    }
}

thread_local! {
    static LANE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The lane the calling thread belongs to (`0..lanes`); none outside the lanes (the `shared`
/// runtime, background loops, tests).
pub fn lane() -> Option<usize> {
    LANE.with(Cell::get)
}

/// Which of `lanes + 1` per-lane resources (connection pools) the calling thread uses: its
/// lane's, or the last one for any thread outside the lanes (the `shared` runtime's workers,
/// tests), which then never drives, or wakes, a lane's connections.
pub fn slot(lanes: usize) -> usize {
    lane().filter(|&i| i < lanes).unwrap_or(lanes)
}

/// The `per-core` runtime's threads: one single-worker tokio runtime per lane. A lane's
/// connections and the requests on them run on its one worker from accept to answer (no
/// hand-offs or wake-ups between workers, no tasks moved between caches), and its upstream
/// connections too ([`slot`] picks the pool). A blocking step still leaves the worker
/// (`block_in_place` hands the lane's tasks to a new worker meanwhile).
pub struct Lanes {
    runtimes: Vec<Runtime>,
}

impl Lanes {
    /// Start `n` lanes (at least one).
    pub fn start(n: usize) -> std::io::Result<Self> {
        let runtimes = (0..n.max(1))
            .map(|i| {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name(format!("gateway-lane-{i}"))
                    .on_thread_start(move || LANE.with(|l| l.set(Some(i))))
                    .enable_all()
                    .build()
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Self { runtimes })
    }

    /// Each lane's runtime, to spawn on.
    pub fn handles(&self) -> Vec<Handle> {
        self.runtimes.iter().map(|r| r.handle().clone()).collect()
    }
}

/// Dropping the lanes stops their runtimes without waiting for what still runs on them, so it
/// may happen in async code (where dropping a runtime would panic); drop them once everything
/// to finish has finished.
impl Drop for Lanes {
    fn drop(&mut self) {
        for r in self.runtimes.drain(..) {
            r.shutdown_background();
        }
    }
}

/// What every accept loop of one server shares: the connection cap, the shutdown signal and
/// the count of open connections.
#[derive(Clone)]
struct Accept {
    app: Edge<Router>,
    body_read: Duration,
    builder: Arc<Builder<TokioExecutor>>,
    permits: Arc<Semaphore>,
    /// Changes (closes) when the server stops: accept loops end, connections finish their
    /// in-flight requests and close.
    stop: watch::Receiver<()>,
    /// Held by every connection; the server returns once the last one is dropped.
    done: watch::Receiver<()>,
}

/// Serve `app` on `listeners` until `shutdown` resolves; then stop accepting, ask every
/// connection to finish its in-flight requests, and return once all of them have closed.
pub async fn serve(
    listeners: Listeners,
    app: Edge<Router>,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    // Dropping `stop_tx` tells accept loops to end and connections to shut down gracefully;
    // each connection holds a `done` receiver, and `done_tx.closed()` resolves when the last
    // of them is gone.
    let (stop_tx, stop) = watch::channel(());
    let (done_tx, done) = watch::channel(());
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // hyper's default cap of 100 header fields stays: past it hyper answers 431 itself
        // (without a body) and closes the connection. A cap above 100 would keep its header
        // arrays off the stack: two 12.8 KB allocations, filled, per request (3% of the plain
        // path's throughput, docs/benchmarks.md).
        .header_read_timeout(limits.header_read);
    let pace = pace_period(limits.header_read);
    let accept = Accept {
        app,
        body_read: limits.body_read,
        builder: Arc::new(builder),
        permits: Arc::new(Semaphore::new(limits.max_connections.max(1))),
        stop,
        done,
    };
    match listeners {
        Listeners::Here(listener) => {
            tokio::spawn(keep_a_timer_due(pace, accept.stop.clone()));
            tokio::select! {
                () = shutdown => {}
                () = accept.clone().run(listener) => {}
            }
        }
        Listeners::Lanes(listeners, lanes) => {
            for (socket, lane) in listeners.into_iter().zip(lanes) {
                let accept = accept.clone();
                lane.spawn(keep_a_timer_due(pace, accept.stop.clone()));
                lane.spawn(async move {
                    // Registered with this lane's reactor: it is this lane's worker that wakes
                    // for a new connection and serves it.
                    match TcpListener::from_std(socket) {
                        Ok(l) => accept.run(l).await,
                        Err(e) => tracing::error!(error = %e, "a lane cannot listen"),
                    }
                });
            }
            shutdown.await;
        }
    }
    drop(stop_tx);
    drop(accept);
    done_tx.closed().await;
}

/// How often [`keep_a_timer_due`] ticks: half the header-read timeout, between 1 and 10 s.
fn pace_period(header_read: Duration) -> Duration {
    (header_read / 2).clamp(Duration::from_secs(1), Duration::from_secs(10))
}

/// Keep a timer due within `period` on the calling runtime until the server stops, so that the
/// timers armed for every request never have to wake the runtime's driver.
///
/// Tokio's timer driver is woken (an eventfd write, and a spurious return from the next
/// `epoll_wait`) whenever a timer is armed to fire before the earliest one the driver knew of
/// when it last parked. hyper arms the header-read timer afresh each time a keep-alive
/// connection waits for its next request, and when no other connection's timer is earlier (one
/// or a few connections) that was one wake-up per request: at one connection, 1.0 `write` and
/// 3.0 `epoll_wait` calls per request instead of 0 and 2 (`perf stat`, docs/benchmarks.md). With
/// a timer always due sooner than the header-read timeout, arming that one never wakes the
/// driver; the cost is one wake-up per `period` per runtime.
async fn keep_a_timer_due(period: Duration, mut stop: watch::Receiver<()>) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = tick.tick() => {}
        }
    }
}

impl Accept {
    /// Accept connections on `listener` and serve each on a task of its own (on the calling
    /// runtime) until the server stops.
    async fn run(self, listener: TcpListener) {
        let mut stop = self.stop.clone();
        loop {
            let permit = tokio::select! {
                _ = stop.changed() => break,
                permit = self.permits.clone().acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let (stream, peer) = tokio::select! {
                _ = stop.changed() => break,
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
            let body_read = self.body_read;
            let service =
                self.app
                    .clone()
                    .map_request(move |req: http::Request<Incoming>| -> Request {
                        req.map(|body| Body::new(DeadlineBody::new(body, body_read)))
                    });
            let hyper_service = TowerToHyperService::new(service);
            let builder = self.builder.clone();
            let mut stop = self.stop.clone();
            let done = self.done.clone();
            tokio::spawn(async move {
                let conn =
                    builder.serve_connection_with_upgrades(TokioIo::new(stream), hyper_service);
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
    }
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use std::collections::BTreeMap;

    use axum::routing::get;

    use super::*;

    /// Serve `app` on `sockets` with `lanes` (header and body read timeouts of `timeout_s`)
    /// until the returned sender sends.
    fn serve_on_lanes(
        sockets: Vec<std::net::TcpListener>,
        lanes: Vec<Handle>,
        app: Edge<Router>,
        timeout_s: u64,
    ) -> (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let limits = Limits {
            max_connections: 64,
            header_read: Duration::from_secs(timeout_s),
            body_read: Duration::from_secs(timeout_s),
        };
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            Listeners::Lanes(sockets, lanes),
            app,
            limits,
            async move {
                let _ = stop_rx.await;
            },
        ));
        (stop_tx, server)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_share_one_port_each_serving_the_connections_it_accepted() {
        crate::telemetry::install_crypto_provider();
        let sockets = bind_lanes(SocketAddr::from(([127, 0, 0, 1], 0)), 2).unwrap();
        let addr = sockets[0].local_addr().unwrap();
        assert!(sockets.iter().all(|s| s.local_addr().unwrap() == addr));
        // The port is the group's: a second gateway started on it fails instead of taking a
        // share of the connections.
        assert!(bind_lanes(addr, 2).is_err());
        assert!(std::net::TcpListener::bind(addr).is_err());

        let lanes = Lanes::start(2).unwrap();
        let app =
            Edge::new(Router::new().route("/lane", get(|| async { format!("{:?}", lane()) })));
        let (stop_tx, server) = serve_on_lanes(sockets, lanes.handles(), app, 5);
        let mut served = BTreeMap::<String, usize>::new();
        for _ in 0..32 {
            // A client of its own per request: a new connection each time.
            let client = reqwest::Client::builder().build().unwrap();
            let text = client
                .get(format!("http://{addr}/lane"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            *served.entry(text).or_default() += 1;
        }
        // Each answer comes from a lane's own thread, and the kernel spread the 32 connections
        // over both (all 32 on one has a chance of 2^-31).
        assert_eq!(
            served.keys().map(String::as_str).collect::<Vec<_>>(),
            ["Some(0)", "Some(1)"],
            "{served:?}"
        );
        stop_tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the server stops once its connections close")
            .unwrap();
        drop(lanes);
        // Every lane's socket is closed: the port is free again.
        assert!(std::net::TcpListener::bind(addr).is_ok());
    }

    #[test]
    fn the_timer_kept_due_ticks_well_inside_the_header_read_timeout() {
        assert_eq!(
            pace_period(Duration::from_secs(30)),
            Duration::from_secs(10)
        );
        assert_eq!(pace_period(Duration::from_secs(6)), Duration::from_secs(3));
        assert_eq!(
            pace_period(Duration::from_millis(100)),
            Duration::from_secs(1)
        );
    }

    /// Requests on one keep-alive connection whose handler waits for another thread under a
    /// long timeout (as the pipeline waits for the upstream): the lane writes each answer and
    /// nothing else, instead of also waking its own driver (an eventfd write) when hyper re-arms
    /// the header-read timer. Counted by the lane thread's write calls (`/proc`'s `syscw`).
    #[cfg(target_os = "linux")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn re_arming_the_header_read_timer_does_not_wake_the_lane() {
        crate::telemetry::install_crypto_provider();
        let sockets = bind_lanes(SocketAddr::from(([127, 0, 0, 1], 0)), 1).unwrap();
        let addr = sockets[0].local_addr().unwrap();
        let lanes = Lanes::start(1).unwrap();
        let lane = lanes.handles().remove(0);
        let app = Edge::new(Router::new().route(
            "/wait",
            get(|| async {
                // Like the pipeline's wait for the upstream: a long timeout around something
                // another thread completes.
                let work = tokio::task::spawn_blocking(|| {
                    std::thread::sleep(Duration::from_micros(200));
                });
                tokio::time::timeout(Duration::from_secs(60), work)
                    .await
                    .unwrap()
                    .unwrap();
                "done"
            }),
        ));
        let (stop_tx, server) = serve_on_lanes(sockets, vec![lane.clone()], app, 30);
        let client = reqwest::Client::builder().build().unwrap();
        let get = || async {
            let answer = client.get(format!("http://{addr}/wait")).send().await;
            assert_eq!(answer.unwrap().text().await.unwrap(), "done");
        };
        get().await;
        let thread = lane
            .spawn(async { std::fs::read_link("/proc/thread-self").unwrap() })
            .await
            .unwrap();
        let writes = || {
            let io =
                std::fs::read_to_string(std::path::Path::new("/proc").join(&thread).join("io"))
                    .unwrap();
            let line = io.lines().find(|l| l.starts_with("syscw:")).unwrap();
            line["syscw:".len()..].trim().parse::<u64>().unwrap()
        };
        let (before, n) = (writes(), 200);
        for _ in 0..n {
            get().await;
        }
        let per_request = (writes() - before) as f64 / f64::from(n);
        // Exactly 1 (the answer's writev); without the timer kept due, 1.015 to 2 in three
        // runs (how many re-armed header timers fall before the driver's last known wake).
        assert!(per_request < 1.01, "{per_request} write calls per request");
        stop_tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the server stops")
            .unwrap();
    }
}
