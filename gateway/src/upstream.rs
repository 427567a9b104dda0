//! Upstream tiers: the replicas of each tier, their routing state (from `router`), the pooled
//! HTTP client, and one forwarding attempt with its timeouts.
//!
//! The client is hyper-util's pooled client over rustls (HTTP/1.1 keep-alive, HTTP/2 where the
//! upstream offers it through ALPN), used directly: a proxy needs none of a general client's
//! redirect, retry, proxy-discovery or URL-parsing layers on its hot path.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use router::{
    HealthPolicy, Lease, ReplicaSet, ReplicaSnapshot, RetryBudget, ShareBudget, Throttle,
};
use secrecy::ExposeSecret;

use crate::config::{Config, ConfigError, UpstreamConfig};
use crate::openai::Endpoint;
use crate::tokens::Tokenizer;
use crate::types::Tier;

/// One replica's address and credentials.
#[derive(Debug)]
pub struct Target {
    /// Replica name (shared: each answer's usage event names it).
    pub name: Arc<str>,
    /// Base URL without trailing slash (ends in `/v1` by convention).
    pub base_url: String,
    /// Model name the upstream expects (shared: each answer's usage event names it).
    pub model: Arc<str>,
    /// `Bearer <key>` for the upstream, marked sensitive.
    authorization: Option<HeaderValue>,
    /// Endpoint URIs, indexed by [`Endpoint::ALL`] order (parsed once, not per request).
    uris: Vec<Uri>,
    /// `name` and `model` as response header values (`None`: not valid in a header), made
    /// once: each answer names its replica and model.
    headers: (Option<HeaderValue>, Option<HeaderValue>),
    /// The `Host` header of a plain-HTTP replica (HTTP/1.1 always), made once; `None` for
    /// HTTPS, where ALPN may pick HTTP/2 and the client sets it (or `:authority`) itself.
    host: Option<HeaderValue>,
}

impl Target {
    /// The replica's name as a header value (`None`: not valid in a header).
    pub fn name_header(&self) -> Option<HeaderValue> {
        self.headers.0.clone()
    }

    /// The upstream's model as a header value (`None`: not valid in a header).
    pub fn model_header(&self) -> Option<HeaderValue> {
        self.headers.1.clone()
    }
}

/// One tier's replicas and their routing state.
#[derive(Debug)]
pub struct TierPool {
    /// The tier.
    pub tier: Tier,
    /// Routing state, index-aligned with `targets`.
    pub set: ReplicaSet,
    /// Replica addresses.
    pub targets: Vec<Target>,
    /// Each replica's `metrics_url`.
    pub metrics_urls: Vec<Option<String>>,
    /// Tokenizer for counting when the upstream reports no usage.
    pub tokenizer: Tokenizer,
    /// The gateway's own retries to this tier, bounded by the requests active on it.
    pub retry_budget: RetryBudget,
    /// Local rejection while the tier's servers reject as overloaded.
    pub throttle: Throttle,
    /// Requests waiting for a slot on this tier's replicas, served in order.
    pub queue: TierQueue,
    /// How fast its replicas free slots while it is at capacity (read by the queue).
    pub drain: router::Drain,
    /// How a replica is chosen (`upstream.replica_choice`).
    pub choice: crate::config::ReplicaChoice,
    /// Prefix-affinity memory, when `upstream.replica_choice` asks for it and the tier has more
    /// than one replica (with one there is nothing to choose, so no prompt is hashed).
    pub affinity: Option<std::sync::Mutex<router::Affinity>>,
    /// Stable identities of the replicas (hashes of their names) for rendezvous hashing.
    pub replica_ids: Vec<u64>,
    /// The latest scrape of each replica's own metrics (empty when never scraped).
    pub observed: Vec<std::sync::Arc<crate::scrape::Observed>>,
}

impl TierPool {
    /// Lease a replica not in `exclude` as `upstream.replica_choice` says. `chain` is the
    /// prompt's prefix-block chain (asked for only when this tier chooses by affinity); the
    /// affinity choice made, if any, comes back beside the lease. Scrapes older than `max_age`
    /// do not count.
    pub fn choose<'c>(
        &self,
        now: Instant,
        exclude: &[usize],
        chain: impl FnOnce() -> &'c [u64],
        max_age: Duration,
    ) -> (Option<Lease>, Option<router::Choice>) {
        let Some(aff) = &self.affinity else {
            let lease = if self.choice == crate::config::ReplicaChoice::RoundRobin {
                self.set.choose_in_turn(now, exclude)
            } else {
                self.set.choose(now, exclude)
            };
            return (lease, None);
        };
        let chain = chain();
        if chain.is_empty() {
            return (self.set.choose(now, exclude), None);
        }
        let mut chose = None;
        let lease = self.set.choose_by(
            now,
            exclude,
            |i, c| self.describe(i, c, max_age),
            |candidates| {
                let c = lock(aff).choose(chain, candidates)?;
                chose = Some(c);
                Some(c.index)
            },
        );
        (lease, chose)
    }

    /// What affinity choice weighs of replica `index`: its stable id, and the server's own load
    /// and KV-cache use from a fresh scrape (the load never below this gateway's in-flight count).
    pub fn describe(&self, index: usize, c: &mut router::Candidate, max_age: Duration) {
        c.id = self.replica_ids.get(index).copied().unwrap_or(index as u64);
        if let Some(o) = self.observed.get(index) {
            let (load, kv) = o.fresh(max_age);
            if let Some(load) = load {
                c.load = c.load.max(load);
            }
            c.kv_usage = kv;
        }
    }
}

impl TierPool {
    /// The target a lease points at.
    pub fn target(&self, lease: &Lease) -> &Target {
        &self.targets[lease.index()]
    }

    /// The request on `lease` got its first token, its whole answer, or timed out waiting for
    /// either, now: feed the replica's adaptive concurrency limit.
    pub fn record_latency(&self, lease: &Lease, signal: router::Signal) {
        if let Some(c) = self.set.record_latency(lease, Instant::now(), signal) {
            tracing::debug!(
                tier = %self.tier,
                replica = %self.target(lease).name,
                from = c.from,
                to = c.to,
                why = ?c.why,
                ratio = c.ratio,
                "adaptive concurrency limit moved"
            );
        }
    }
}

/// The requests waiting for a slot on a tier whose replicas are all at their limit, first come
/// first served: only the one at the head tries for a slot (so the wait a newcomer is told it
/// would have, from its place and the rate slots free, is the wait it gets), the others sleep
/// until the head changes.
#[derive(Debug, Default)]
pub struct TierQueue {
    waiting: std::sync::Mutex<std::collections::VecDeque<u64>>,
    /// Its length, read without the lock on every attempt.
    len: std::sync::atomic::AtomicUsize,
    next_id: std::sync::atomic::AtomicU64,
    /// Woken whenever the head changes.
    turn: tokio::sync::Notify,
}

impl TierQueue {
    fn waiting(&self) -> std::sync::MutexGuard<'_, std::collections::VecDeque<u64>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.len.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A place at the back, unless `depth` already wait.
    pub fn join(&self, depth: usize) -> Option<Place<'_>> {
        let mut waiting = self.waiting();
        if waiting.len() >= depth {
            return None;
        }
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        waiting.push_back(id);
        self.len
            .store(waiting.len(), std::sync::atomic::Ordering::Release);
        Some(Place { queue: self, id })
    }

    /// A future that completes when the head next changes (enable it before checking).
    pub fn turn(&self) -> tokio::sync::futures::Notified<'_> {
        self.turn.notified()
    }
}

/// A request's place in a [`TierQueue`]; leaving it (dropped) lets the next one on.
#[derive(Debug)]
pub struct Place<'q> {
    queue: &'q TierQueue,
    id: u64,
}

impl Place<'_> {
    /// Whether it is this request's turn to try for a slot.
    pub fn is_head(&self) -> bool {
        self.queue.waiting().front() == Some(&self.id)
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut waiting = self.queue.waiting();
        let was_head = waiting.front() == Some(&self.id);
        waiting.retain(|id| *id != self.id);
        self.queue
            .len
            .store(waiting.len(), std::sync::atomic::Ordering::Release);
        drop(waiting);
        if was_head {
            self.queue.turn.notify_waiters();
        }
    }
}

/// The prefix-affinity memory, through a poisoned lock too (it holds nothing a panic can break).
pub fn lock(
    aff: &std::sync::Mutex<router::Affinity>,
) -> std::sync::MutexGuard<'_, router::Affinity> {
    aff.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The affinity policy `upstream.replica_choice` names (`None`: least loaded).
fn affinity_policy(up: &UpstreamConfig) -> Option<router::AffinityPolicy> {
    match up.replica_choice {
        crate::config::ReplicaChoice::LeastLoaded | crate::config::ReplicaChoice::RoundRobin => {
            None
        }
        crate::config::ReplicaChoice::AffinityGate => Some(router::AffinityPolicy::GATE),
        crate::config::ReplicaChoice::AffinityWeighted => Some(router::AffinityPolicy::WEIGHTED),
    }
}

/// Why one attempt failed. Retry decisions branch on the variant, never on messages.
#[derive(Debug, thiserror::Error)]
pub enum AttemptError {
    /// Could not connect (refused, DNS, TLS, connect timeout).
    #[error("connect failed: {0}")]
    Connect(String),
    /// No response headers within the first-byte timeout, or the body did not finish in time.
    #[error("timed out")]
    Timeout,
    /// The connection broke or the response was malformed.
    #[error("transport error: {0}")]
    Transport(String),
    /// The response body is larger than `upstream.max_response_bytes`.
    #[error("response body larger than upstream.max_response_bytes = {0}")]
    TooLarge(usize),
}

impl AttemptError {
    /// Short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Connect(_) => "connect",
            Self::Timeout => "timeout",
            Self::Transport(_) => "transport",
            Self::TooLarge(_) => "too_large",
        }
    }

    /// Whether the replica is to blame (and another one is worth trying): not for an answer
    /// that is merely too large, which any replica would give again.
    pub fn is_replica_failure(&self) -> bool {
        !matches!(self, Self::TooLarge(_))
    }
}

/// The response of an upstream, body still streaming.
pub type UpstreamResponse = http::Response<hyper::body::Incoming>;

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// All tiers and the HTTP clients.
#[derive(Debug)]
pub struct Upstreams {
    /// One client (connection pool) per lane of the server (`ServerConfig::lanes`), so that a
    /// request's upstream connection is driven by the lane serving it, and one for every other
    /// thread (`server::slot`).
    clients: Vec<HttpsClient>,
    config: UpstreamConfig,
    tiers: BTreeMap<Tier, TierPool>,
    /// Each tenant's share of requests that may fall back to the other tier.
    fallbacks: ShareBudget,
}

impl Upstreams {
    /// Build tiers and the client from config (reads the upstream API keys' variables).
    pub fn new(config: &Config) -> Result<Self, ConfigError> {
        crate::telemetry::install_crypto_provider();
        let up = &config.upstream;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(up.connect_timeout()));
        let tls = match hyper_rustls::HttpsConnectorBuilder::new().with_native_roots() {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "no system CA certificates; using the bundled Mozilla roots");
                hyper_rustls::HttpsConnectorBuilder::new().with_webpki_roots()
            }
        };
        let https = tls
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        let pools = config.server.lanes() + 1;
        let clients = (0..pools)
            .map(|_| {
                Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(90))
                    .pool_max_idle_per_host(up.pool_max_idle_per_host.div_ceil(pools))
                    .build(https.clone())
            })
            .collect();
        let policy = HealthPolicy {
            failure_threshold: up.failure_threshold,
            cooldown: Duration::from_millis(up.cooldown_ms),
            error_ratio: up.error_ratio,
            ratio_window: Duration::from_millis(up.error_ratio_window_ms),
            min_requests: up.error_ratio_min_requests,
        };
        let mut tiers = BTreeMap::new();
        for (name, tier) in &config.tiers {
            let mut targets = Vec::with_capacity(tier.replicas.len());
            for (i, r) in tier.replicas.iter().enumerate() {
                let field = format!("tiers.{name}.replicas[{i}]");
                let base_url = r.url.trim_end_matches('/').to_owned();
                let uris = Endpoint::ALL
                    .iter()
                    .map(|e| format!("{base_url}/{}", e.path()).parse::<Uri>())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| ConfigError::Invalid {
                        field: format!("{field}.url"),
                        message: format!("not a valid URL: {e}"),
                    })?;
                let authorization = match r.api_key(&field)? {
                    Some(key) => {
                        let mut v =
                            HeaderValue::from_str(&format!("Bearer {}", key.expose_secret()))
                                .map_err(|_| ConfigError::Invalid {
                                    field: format!("{field}.api_key_env"),
                                    message: "the key is not a valid header value".into(),
                                })?;
                        v.set_sensitive(true);
                        Some(v)
                    }
                    None => None,
                };
                // Shared from the start, so each answer's copy is a reference count.
                let header = |v: &str| {
                    HeaderValue::from_maybe_shared(Bytes::copy_from_slice(v.as_bytes())).ok()
                };
                targets.push(Target {
                    name: r.name.as_str().into(),
                    base_url,
                    model: r.model.as_str().into(),
                    authorization,
                    headers: (header(&r.name), header(&r.model)),
                    host: uris.first().and_then(host_header),
                    uris,
                });
            }
            let mut set = ReplicaSet::new(
                tier.replicas
                    .iter()
                    .map(|r| (r.name.clone(), r.max_concurrency)),
                policy,
            );
            if up.adaptive_concurrency {
                set = set.with_adaptive_limits(|max| router::LimitPolicy {
                    min: up.adaptive_min_concurrency,
                    tolerance: up.adaptive_tolerance,
                    slack: Duration::from_millis(up.adaptive_slack_ms),
                    probe_interval: Duration::from_millis(up.adaptive_probe_interval_ms),
                    ..router::LimitPolicy::new(max)
                });
            }
            let tokenizer = Tokenizer::of(tier.tokenizer.unwrap_or_default());
            tiers.insert(
                *name,
                TierPool {
                    tier: *name,
                    set,
                    targets,
                    metrics_urls: tier
                        .replicas
                        .iter()
                        .map(|r| r.metrics_url.clone())
                        .collect(),
                    tokenizer,
                    retry_budget: RetryBudget::new(up.retry_budget_ratio, up.retry_budget_min),
                    throttle: Throttle::new(
                        up.throttle_k,
                        Duration::from_millis(up.throttle_window_ms),
                        up.throttle_min_requests,
                        Instant::now(),
                    ),
                    queue: TierQueue::default(),
                    drain: router::Drain::default(),
                    choice: up.replica_choice,
                    affinity: affinity_policy(up)
                        .filter(|_| tier.replicas.len() > 1)
                        .map(|p| {
                            std::sync::Mutex::new(router::Affinity::new(
                                p,
                                tier.replicas.len(),
                                up.affinity_capacity_blocks,
                            ))
                        }),
                    replica_ids: tier
                        .replicas
                        .iter()
                        .map(|r| {
                            // The whole name as one block: the same id on every gateway.
                            router::prefix_byte_hashes(r.name.as_bytes(), r.name.len().max(1))
                                .first()
                                .copied()
                                .unwrap_or(0)
                        })
                        .collect(),
                    observed: tier
                        .replicas
                        .iter()
                        .map(|_| std::sync::Arc::default())
                        .collect(),
                },
            );
        }
        Ok(Self {
            clients,
            fallbacks: ShareBudget::new(
                up.fallback_max_share,
                up.fallback_min,
                Duration::from_millis(up.fallback_window_ms),
                Instant::now(),
            ),
            config: up.clone(),
            tiers,
        })
    }

    /// Timeouts and retry settings.
    pub fn config(&self) -> &UpstreamConfig {
        &self.config
    }

    /// The per-tenant bound on fallback to the other tier.
    pub fn fallbacks(&self) -> &ShareBudget {
        &self.fallbacks
    }

    /// A tier's replicas.
    pub fn tier(&self, tier: Tier) -> Option<&TierPool> {
        self.tiers.get(&tier)
    }

    /// Every replica's state, by tier.
    pub fn snapshot(&self, now: Instant) -> Vec<(String, Vec<ReplicaSnapshot>)> {
        self.tiers
            .iter()
            .map(|(tier, t)| (tier.as_str().to_owned(), t.set.snapshot(now)))
            .collect()
    }

    /// Send one request to the leased replica and wait up to `first_byte` for the response
    /// headers.
    pub async fn send(
        &self,
        target: &Target,
        endpoint: Endpoint,
        body: Bytes,
        request_id: Option<&HeaderValue>,
        first_byte: Duration,
    ) -> Result<UpstreamResponse, AttemptError> {
        // Put together in place: the builder moves the request's parts through every call.
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = target.uris[endpoint as usize].clone();
        let headers = req.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(id) = request_id {
            headers.insert(crate::headers::REQUEST_ID, id.clone());
        }
        if let Some(auth) = &target.authorization {
            headers.insert(AUTHORIZATION, auth.clone());
        }
        if let Some(host) = &target.host {
            // What the client would write (a `format!` and a copy per request), shared.
            headers.insert(http::header::HOST, host.clone());
        }
        let client = &self.clients[crate::server::slot(self.clients.len() - 1)];
        match tokio::time::timeout(first_byte, client.request(req)).await {
            Err(_) => Err(AttemptError::Timeout),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if e.is_connect() => Err(AttemptError::Connect(error_chain(&e))),
            Ok(Err(e)) => Err(AttemptError::Transport(error_chain(&e))),
        }
    }
}

/// The `Host` header hyper-util's client writes for an HTTP/1 request to `uri` (the host, and
/// the port unless it is the scheme's default), for a plain-HTTP `uri`; `None` otherwise.
fn host_header(uri: &Uri) -> Option<HeaderValue> {
    if uri.scheme_str() != Some("http") {
        return None;
    }
    let host = uri.host()?;
    let value = match uri.port_u16() {
        Some(80) | None => host.to_owned(),
        Some(port) => format!("{host}:{port}"),
    };
    HeaderValue::from_maybe_shared(Bytes::from(value)).ok()
}

/// Read a whole response body of at most `limit` bytes before `deadline`.
pub async fn read_body(
    resp: UpstreamResponse,
    deadline: Instant,
    limit: usize,
) -> Result<(http::response::Parts, Bytes), AttemptError> {
    let (parts, body) = resp.into_parts();
    let body = http_body_util::Limited::new(body, limit);
    match tokio::time::timeout_at(deadline.into(), body.collect()).await {
        Err(_) => Err(AttemptError::Timeout),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(AttemptError::TooLarge(limit))
        }
        Ok(Err(e)) => Err(AttemptError::Transport(error_chain(e.as_ref()))),
        Ok(Ok(collected)) => Ok((parts, collected.to_bytes())),
    }
}

/// An error with its sources, for logs.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_header_is_the_one_the_http1_client_would_write() {
        let host = |uri: &str| {
            host_header(&uri.parse::<Uri>().unwrap_or_default())
                .map(|v| v.to_str().unwrap_or_default().to_owned())
        };
        for (uri, expected) in [
            (
                "http://127.0.0.1:8000/v1/chat/completions",
                "127.0.0.1:8000",
            ),
            ("http://vllm.internal/v1/completions", "vllm.internal"),
            ("http://vllm.internal:80/v1", "vllm.internal"),
            ("http://vllm.internal:443/v1", "vllm.internal:443"),
            ("http://[::1]:9000/v1", "[::1]:9000"),
        ] {
            assert_eq!(host(uri).as_deref(), Some(expected), "{uri}");
        }
        // HTTPS may be HTTP/2 (ALPN): left to the client.
        assert_eq!(host("https://api.example.com/v1"), None);
    }
}
