//! Upstream tiers: the replicas of each tier, their routing state (from `router`), the pooled
//! HTTP client, and one forwarding attempt with its timeouts.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use router::{HealthPolicy, Lease, ReplicaSet, ReplicaSnapshot};
use secrecy::{ExposeSecret, SecretString};

use crate::config::{Config, ConfigError, UpstreamConfig};
use crate::openai::Endpoint;
use crate::tokens::Tokenizer;

/// One replica's address and credentials.
#[derive(Debug)]
pub struct Target {
    /// Replica name.
    pub name: String,
    /// Base URL without trailing slash (ends in `/v1` by convention).
    pub base_url: String,
    /// Model name the upstream expects.
    pub model: String,
    api_key: Option<SecretString>,
    /// Parsed endpoint URLs, indexed by [`Endpoint::ALL`] order (parsed once, not per request).
    urls: Vec<reqwest::Url>,
}

/// One tier: its replicas and their routing state.
#[derive(Debug)]
pub struct Tier {
    /// Tier name.
    pub name: String,
    /// Routing state, index-aligned with `targets`.
    pub set: ReplicaSet,
    /// Replica addresses.
    pub targets: Vec<Target>,
    /// Tokenizer for counting when the upstream reports no usage.
    pub tokenizer: Tokenizer,
}

impl Tier {
    /// The target a lease points at.
    pub fn target(&self, lease: &Lease) -> &Target {
        &self.targets[lease.index()]
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
}

impl AttemptError {
    /// Short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Connect(_) => "connect",
            Self::Timeout => "timeout",
            Self::Transport(_) => "transport",
        }
    }
}

/// All tiers and the shared HTTP client.
#[derive(Debug)]
pub struct Upstreams {
    client: reqwest::Client,
    config: UpstreamConfig,
    tiers: BTreeMap<String, Tier>,
}

impl Upstreams {
    /// Build tiers and the client from config (reads the upstream API keys' variables).
    pub fn new(config: &Config) -> Result<Self, ConfigError> {
        crate::telemetry::install_crypto_provider();
        let up = &config.upstream;
        let client = reqwest::Client::builder()
            .connect_timeout(up.connect_timeout())
            .pool_max_idle_per_host(up.pool_max_idle_per_host)
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            // A POST to a model server is never redirected; following one would resend the body.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ConfigError::Invalid {
                field: "upstream".into(),
                message: format!("cannot build the HTTP client: {e}"),
            })?;
        let policy = HealthPolicy {
            failure_threshold: up.failure_threshold,
            cooldown: Duration::from_millis(up.cooldown_ms),
        };
        let mut tiers = BTreeMap::new();
        for (name, tier) in &config.tiers {
            let mut targets = Vec::with_capacity(tier.replicas.len());
            for (i, r) in tier.replicas.iter().enumerate() {
                let field = format!("tiers.{name}.replicas[{i}]");
                let base_url = r.url.trim_end_matches('/').to_owned();
                let urls = Endpoint::ALL
                    .iter()
                    .map(|e| reqwest::Url::parse(&format!("{base_url}/{}", e.path())))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| ConfigError::Invalid {
                        field: format!("{field}.url"),
                        message: format!("not a valid URL: {e}"),
                    })?;
                targets.push(Target {
                    name: r.name.clone(),
                    base_url,
                    model: r.model.clone(),
                    api_key: r.api_key(&field)?,
                    urls,
                });
            }
            let set = ReplicaSet::new(
                tier.replicas
                    .iter()
                    .map(|r| (r.name.clone(), r.max_concurrency)),
                policy,
            );
            let tokenizer = tier
                .tokenizer
                .as_deref()
                .and_then(Tokenizer::by_name)
                .unwrap_or_default();
            tiers.insert(
                name.clone(),
                Tier {
                    name: name.clone(),
                    set,
                    targets,
                    tokenizer,
                },
            );
        }
        Ok(Self {
            client,
            config: up.clone(),
            tiers,
        })
    }

    /// Timeouts and retry settings.
    pub fn config(&self) -> &UpstreamConfig {
        &self.config
    }

    /// A tier by name.
    pub fn tier(&self, name: &str) -> Option<&Tier> {
        self.tiers.get(name)
    }

    /// Every replica's state, by tier.
    pub fn snapshot(&self, now: Instant) -> Vec<(String, Vec<ReplicaSnapshot>)> {
        self.tiers
            .iter()
            .map(|(name, t)| (name.clone(), t.set.snapshot(now)))
            .collect()
    }

    /// Send one request to the leased replica and wait for the response headers (first byte).
    pub async fn send(
        &self,
        target: &Target,
        endpoint: Endpoint,
        body: Bytes,
        request_id: &str,
    ) -> Result<reqwest::Response, AttemptError> {
        let url = target.urls[endpoint as usize].clone();
        let mut req = self
            .client
            .post(url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header("x-request-id", request_id)
            .body(body);
        if let Some(key) = &target.api_key {
            req = req.bearer_auth(key.expose_secret());
        }
        match tokio::time::timeout(self.config.first_byte_timeout(), req.send()).await {
            Err(_) => Err(AttemptError::Timeout),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if e.is_connect() => Err(AttemptError::Connect(e.to_string())),
            Ok(Err(e)) if e.is_timeout() => Err(AttemptError::Timeout),
            Ok(Err(e)) => Err(AttemptError::Transport(e.to_string())),
        }
    }
}
