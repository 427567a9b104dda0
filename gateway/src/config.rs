//! The one typed configuration tree.
//!
//! Layers, later wins: built-in defaults → TOML file → environment (`GATEWAY__SECTION__KEY`, e.g.
//! `GATEWAY__ADMIN__TOKEN`) → command-line flags (applied by the binary). Unknown fields are
//! rejected, and [`Config::validate`] refuses a bad config with a message naming the field.
//! Nothing below this module reads the environment, except the upstream API keys whose variable
//! *names* the config carries (resolved once, here).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use secrecy::SecretString;
use serde::{Deserialize, Serialize};

/// Name of the small tier; requests fall back between it and [`LARGE`].
pub const SMALL: &str = "small";
/// Name of the large tier.
pub const LARGE: &str = "large";
/// Client-facing model name routed by the gateway itself (large tier until the classifier lands).
pub const AUTO: &str = "auto";

/// Configuration errors, each naming the offending field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The layers could not be read or did not match the schema.
    #[error("configuration: {0}")]
    Load(#[from] Box<figment::Error>),
    /// A value is present but unusable.
    #[error("configuration field `{field}`: {message}")]
    Invalid {
        /// Dotted path of the field.
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// Root of the configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// HTTP listener and request limits.
    pub server: ServerConfig,
    /// Where tenants and keys live.
    pub store: StoreConfig,
    /// The admin API.
    pub admin: AdminConfig,
    /// Timeouts, retries and health for upstream calls.
    pub upstream: UpstreamConfig,
    /// Tiers of replicas by name; `small` and `large` are required for chat routing.
    pub tiers: BTreeMap<String, TierConfig>,
    /// Client-facing model name → tier name (or `auto`).
    pub models: BTreeMap<String, String>,
    /// Prices by served model name, USD per 1M tokens.
    pub prices: BTreeMap<String, PriceConfig>,
    /// The cost ledger.
    pub ledger: LedgerConfig,
    /// Budgets and rate limits (policies are managed with `gatewayctl budgets|limits`).
    pub budgets: BudgetConfig,
    /// The exact and semantic response cache (per-tenant policies: `gatewayctl cache`).
    pub cache: CacheConfig,
}

/// The response cache. A tenant without its own policy gets [`CacheConfig::mode`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Default for tenants without their own policy: `off`, `exact` or `semantic` (exact first,
    /// then semantic).
    pub mode: crate::cache::CacheMode,
    /// Most bytes of cached responses held by this replica.
    pub max_bytes: u64,
    /// Responses larger than this are not cached.
    pub max_entry_bytes: u64,
    /// Default time to live of a cached response, seconds.
    pub ttl_secs: u64,
    /// Default point on the verifier's held-out curve: the precision a semantic hit must have.
    pub min_precision: f64,
    /// Also share exact answers through Redis (one URL, or several cluster seed nodes), so a
    /// repeat hits on every replica. Empty: each replica caches on its own.
    pub redis_urls: Vec<String>,
    /// Longest wait for the shared layer before a lookup counts as a miss, ms.
    pub redis_timeout_ms: u64,
    /// The semantic layer's model and limits.
    pub semantic: SemanticConfig,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            mode: crate::cache::CacheMode::Semantic,
            max_bytes: 256 << 20,
            max_entry_bytes: 1 << 20,
            ttl_secs: 3600,
            min_precision: 0.9,
            redis_urls: Vec::new(),
            redis_timeout_ms: 50,
            semantic: SemanticConfig::default(),
        }
    }
}

/// Where the semantic layer computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EmbedDevice {
    /// The GPU when usable, else the CPU.
    Auto,
    /// Always the CPU.
    Cpu,
    /// The GPU, or refuse to start.
    Cuda,
}

/// The semantic cache layer: embedding model, index and verifier.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SemanticConfig {
    /// Where embeddings and the vector index run: `auto` (the GPU when this build has the `cuda`
    /// feature and a GPU is present, else the CPU), `cpu`, or `cuda` (a startup error when no
    /// GPU can be used).
    pub device: EmbedDevice,
    /// Directory of all-MiniLM-L6-v2 (`scripts/fetch-model.sh`). Without it the semantic layer
    /// is off (logged at start); the exact layer still works.
    pub model_dir: std::path::PathBuf,
    /// A verifier artefact from `gateway embed train-verifier` (default: the shipped one).
    pub verifier: Option<std::path::PathBuf>,
    /// Most questions held in the vector index (each ~2 KB for its vector plus ~0.4 KB per
    /// token for the verifier: ~8 KB for a 15-token question).
    pub capacity: usize,
    /// Nearest neighbours handed to the verifier.
    pub candidates: usize,
    /// Least cosine similarity for a neighbour to be a candidate at all.
    pub min_cosine: f32,
    /// Most requests embedded in one batch.
    pub batch: usize,
    /// Longest a request waits for the semantic lookup before it is treated as a miss, ms.
    pub lookup_timeout_ms: u64,
    /// Lookups queued beyond this are skipped (a miss) rather than queued: the embedding model
    /// must not become the gateway's bottleneck.
    pub max_queue: usize,
}

impl Default for SemanticConfig {
    fn default() -> Self {
        Self {
            device: EmbedDevice::Auto,
            model_dir: "models/all-MiniLM-L6-v2".into(),
            verifier: None,
            capacity: 50_000,
            candidates: 4,
            min_cosine: 0.7,
            batch: 16,
            lookup_timeout_ms: 250,
            max_queue: 32,
        }
    }
}

/// Where budget counters live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BudgetStoreKind {
    /// In this process (embedded default; rebuilt from the ledger at start).
    Memory,
    /// Redis, shared by every replica (`budgets.redis_urls`).
    Redis,
}

/// Budget enforcement settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BudgetConfig {
    /// `memory` (one gateway) or `redis` (several replicas).
    pub store: BudgetStoreKind,
    /// Redis URLs: one for a single node, several seed nodes for Redis Cluster.
    pub redis_urls: Vec<String>,
    /// Longest wait for one Redis call before the tenant's fail mode applies, ms.
    pub store_timeout_ms: u64,
    /// Lifetime of a reservation that is never committed (its gateway died), seconds.
    /// Default: `upstream.total_timeout_ms` plus 30 s.
    pub reservation_ttl_secs: Option<u64>,
    /// `max_tokens` reserved (and forwarded) for a request that names none, when a budget or
    /// a token rate limit applies.
    pub default_max_tokens: u64,
    /// The least `max_tokens` worth forwarding after clamping; below it the request is refused.
    pub min_tokens: u64,
    /// Default for tenants without their own setting: `closed` (503 while Redis is unreachable)
    /// or `open` (admit against a local share of each limit).
    pub fail_mode: crate::budget::FailMode,
    /// Share of each limit one replica may use on its own while failing open (0 < share ≤ 1).
    pub fail_open_share: f64,
    /// Redis store: a replica reserves room for up to this many requests at once (a lease) and
    /// admits them locally, taking Redis off the per-request path. A lease never holds more
    /// than an eighth of what is left of a limit, so near a limit requests are reserved one by
    /// one again. 0 turns leasing off.
    pub lease_requests: u64,
    /// How long a lease admits requests before what it did not use goes back, ms. Also how
    /// often leases settle their spend with Redis (a quarter of it).
    pub lease_ms: u64,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            store: BudgetStoreKind::Memory,
            redis_urls: Vec::new(),
            store_timeout_ms: 250,
            reservation_ttl_secs: None,
            default_max_tokens: 4096,
            min_tokens: 16,
            fail_mode: crate::budget::FailMode::Closed,
            fail_open_share: 0.1,
            lease_requests: 64,
            lease_ms: 200,
        }
    }
}

/// One model's prices in USD per 1M tokens (e.g. `input = 0.15`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceConfig {
    /// Uncached input tokens.
    pub input: f64,
    /// Output tokens.
    pub output: f64,
    /// Cached input tokens (default: the input price).
    #[serde(default)]
    pub cached_input: Option<f64>,
}

/// The cost ledger: one row per request, written in batches off the request path.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LedgerConfig {
    /// Write the ledger (into the store's database). Off: usage events are only logged.
    pub enabled: bool,
    /// Directory of the append-only spool used while the database is unreachable.
    pub spool_dir: std::path::PathBuf,
    /// Most rows per database write.
    pub batch_rows: usize,
    /// Longest a row waits before its batch is written, ms.
    pub flush_ms: u64,
    /// Rows queued in memory before overflow goes straight to the spool.
    pub queue_capacity: usize,
    /// A database write slower than this is treated as failed and spooled, ms.
    pub write_timeout_ms: u64,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            spool_dir: "spool".into(),
            batch_rows: 16000,
            flush_ms: 200,
            queue_capacity: 100_000,
            write_timeout_ms: 2_000,
        }
    }
}

impl Config {
    /// Configured prices as of `effective_from`, in micro-dollars per 1M tokens.
    pub fn prices(
        &self,
        effective_from: chrono::DateTime<chrono::Utc>,
    ) -> Result<Vec<crate::pricing::Price>, ConfigError> {
        use crate::pricing::usd_to_micros;
        self.prices
            .iter()
            .map(|(model, p)| {
                let conv = |field: &str, usd: f64| {
                    usd_to_micros(usd).ok_or_else(|| {
                        invalid(
                            format!("prices.{model}.{field}"),
                            "must be a non-negative amount of USD",
                        )
                    })
                };
                Ok(crate::pricing::Price {
                    model: model.clone(),
                    effective_from,
                    input: conv("input", p.input)?,
                    output: conv("output", p.output)?,
                    cached_input: conv("cached_input", p.cached_input.unwrap_or(p.input))?,
                })
            })
            .collect()
    }
}

/// HTTP listener and request limits.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Largest accepted request body, in bytes (413 above).
    pub max_body_bytes: usize,
    /// How long graceful shutdown waits for in-flight requests, in seconds.
    pub shutdown_grace_secs: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 4 * 1024 * 1024,
            shutdown_grace_secs: 30,
        }
    }
}

/// Where tenants and keys live.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `sqlite://path/to/file.db` (embedded default, created and migrated at start) or
    /// `postgres://…` (migrated by `gateway migrate`).
    pub url: String,
    /// How often each replica reloads the key table, in milliseconds (revocation latency).
    pub key_refresh_ms: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            url: "sqlite://gateway.db".into(),
            key_refresh_ms: 1000,
        }
    }
}

/// Fewest characters an admin token may have: an empty or short token refuses to start.
pub const MIN_ADMIN_TOKEN_LEN: usize = 16;

/// The admin API.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Bearer token for `/admin/v1`, at least [`MIN_ADMIN_TOKEN_LEN`] characters. Without one
    /// (the setting absent) the admin API answers 403; set but empty or short, the gateway
    /// refuses to start.
    #[serde(serialize_with = "serialize_secret_opt")]
    pub token: Option<SecretString>,
}

impl AdminConfig {
    /// A token that is set must be long enough to guess at no better than chance: set but
    /// empty (e.g. `GATEWAY__ADMIN__TOKEN=`) it would otherwise compare equal to a request
    /// that presents no credential at all.
    fn validate(&self) -> Result<(), ConfigError> {
        use secrecy::ExposeSecret;
        let Some(token) = &self.token else {
            return Ok(());
        };
        let token = token.expose_secret();
        if token.trim() != token || token.chars().any(char::is_control) {
            return Err(invalid(
                "admin.token",
                "must not contain spaces at either end or control characters \
                 (GATEWAY__ADMIN__TOKEN)",
            ));
        }
        if token.chars().count() < MIN_ADMIN_TOKEN_LEN {
            return Err(invalid(
                "admin.token",
                format!(
                    "is set but {} characters long; use at least {MIN_ADMIN_TOKEN_LEN} \
                     (e.g. `openssl rand -hex 24`), or leave admin.token and \
                     GATEWAY__ADMIN__TOKEN unset to turn the admin API off",
                    token.chars().count()
                ),
            ));
        }
        Ok(())
    }
}

fn serialize_secret_opt<S: serde::Serializer>(
    v: &Option<SecretString>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use secrecy::ExposeSecret;
    match v {
        Some(secret) => s.serialize_some(secret.expose_secret()),
        None => s.serialize_none(),
    }
}

/// What to do with an upstream stream whose client went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DisconnectPolicy {
    /// Keep reading the upstream to the end so the usage it reports is exact.
    Drain,
    /// Stop the upstream at once (saves GPU time); usage is counted from what was received.
    Cancel,
}

/// Timeouts, retries and passive health for upstream calls.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// TCP (and TLS) connect timeout, ms.
    pub connect_timeout_ms: u64,
    /// Time from sending the request to the response headers, ms.
    pub first_byte_timeout_ms: u64,
    /// Longest silence between two chunks of a streamed body, ms.
    pub idle_timeout_ms: u64,
    /// Whole exchange, ms.
    pub total_timeout_ms: u64,
    /// Try another replica of the same tier after a connect error / 5xx / timeout (0 or 1).
    pub retries_same_tier: u32,
    /// After the same-tier retry, try the other tier (small ↔ large).
    pub fallback_to_other_tier: bool,
    /// Consecutive failures that take a replica out of rotation.
    pub failure_threshold: u32,
    /// How long a tripped replica stays out, ms.
    pub cooldown_ms: u64,
    /// Idle pooled connections kept per upstream host.
    pub pool_max_idle_per_host: usize,
    /// What to do with an upstream stream whose client disconnected.
    pub on_client_disconnect: DisconnectPolicy,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 2_000,
            first_byte_timeout_ms: 60_000,
            idle_timeout_ms: 60_000,
            total_timeout_ms: 600_000,
            retries_same_tier: 1,
            fallback_to_other_tier: true,
            failure_threshold: 3,
            cooldown_ms: 10_000,
            pool_max_idle_per_host: 256,
            on_client_disconnect: DisconnectPolicy::Drain,
        }
    }
}

impl UpstreamConfig {
    /// Connect timeout as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    /// First-byte timeout as a duration.
    pub fn first_byte_timeout(&self) -> Duration {
        Duration::from_millis(self.first_byte_timeout_ms)
    }
    /// Idle-between-chunks timeout as a duration.
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }
    /// Total timeout as a duration.
    pub fn total_timeout(&self) -> Duration {
        Duration::from_millis(self.total_timeout_ms)
    }
}

/// One tier: a list of interchangeable replicas serving the same model.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierConfig {
    /// Tokenizer used to count tokens when the upstream reports none (`cl100k_base`,
    /// `o200k_base`).
    pub tokenizer: Option<String>,
    /// The replicas.
    pub replicas: Vec<ReplicaConfig>,
}

/// One upstream replica.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Name used in logs, metrics and the `x-gateway-replica` header.
    pub name: String,
    /// OpenAI-compatible base URL, including `/v1` (e.g. `http://10.0.0.5:8000/v1`).
    pub url: String,
    /// Model name the upstream expects.
    pub model: String,
    /// Environment variable holding the upstream API key (sent as a bearer token).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Most requests in flight to this replica from this gateway.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: u32,
}

fn default_max_concurrency() -> u32 {
    256
}

impl ReplicaConfig {
    /// The upstream API key, read from the environment variable the config names.
    pub fn api_key(&self, field: &str) -> Result<Option<SecretString>, ConfigError> {
        let Some(var) = &self.api_key_env else {
            return Ok(None);
        };
        match std::env::var(var) {
            Ok(v) if !v.is_empty() => Ok(Some(SecretString::from(v))),
            _ => Err(invalid(
                format!("{field}.api_key_env"),
                format!("environment variable {var} is not set"),
            )),
        }
    }
}

impl Config {
    /// Load defaults → `path` (if given) → `GATEWAY__…` environment, then validate.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = path {
            if !path.exists() {
                return Err(invalid(
                    "--config",
                    format!("file {} does not exist", path.display()),
                ));
            }
            figment = figment.merge(Toml::file(path));
        }
        figment = figment.merge(Env::prefixed("GATEWAY__").split("__"));
        let config: Config = figment.extract().map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    /// Check cross-field rules. Every error names its field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.admin.validate()?;
        if self.server.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes", "must be greater than 0"));
        }
        if !(self.store.url.starts_with("sqlite:") || self.store.url.starts_with("postgres")) {
            return Err(invalid(
                "store.url",
                "must start with sqlite:// or postgres://",
            ));
        }
        if self.store.key_refresh_ms == 0 {
            return Err(invalid("store.key_refresh_ms", "must be greater than 0"));
        }
        if self.upstream.retries_same_tier > 1 {
            return Err(invalid("upstream.retries_same_tier", "must be 0 or 1"));
        }
        if self.upstream.failure_threshold == 0 {
            return Err(invalid("upstream.failure_threshold", "must be at least 1"));
        }
        for tier in [SMALL, LARGE] {
            if !self.tiers.contains_key(tier) {
                return Err(invalid(
                    format!("tiers.{tier}"),
                    "is required (a list of replicas)",
                ));
            }
        }
        let mut names = std::collections::HashSet::new();
        for (tier_name, tier) in &self.tiers {
            if tier_name == AUTO {
                return Err(invalid("tiers.auto", "`auto` is reserved for routing"));
            }
            if tier.replicas.is_empty() {
                return Err(invalid(
                    format!("tiers.{tier_name}.replicas"),
                    "needs at least one replica",
                ));
            }
            if let Some(tok) = &tier.tokenizer {
                if crate::tokens::Tokenizer::by_name(tok).is_none() {
                    return Err(invalid(
                        format!("tiers.{tier_name}.tokenizer"),
                        format!("unknown tokenizer {tok:?}; use cl100k_base or o200k_base"),
                    ));
                }
            }
            for (i, r) in tier.replicas.iter().enumerate() {
                let field = |f: &str| format!("tiers.{tier_name}.replicas[{i}].{f}");
                if !names.insert(r.name.clone()) {
                    return Err(invalid(
                        field("name"),
                        format!("duplicate replica {:?}", r.name),
                    ));
                }
                if !(r.url.starts_with("http://") || r.url.starts_with("https://")) {
                    return Err(invalid(field("url"), "must start with http:// or https://"));
                }
                if r.model.is_empty() {
                    return Err(invalid(field("model"), "must not be empty"));
                }
                if r.max_concurrency == 0 {
                    return Err(invalid(field("max_concurrency"), "must be at least 1"));
                }
            }
        }
        self.prices(chrono::Utc::now())?;
        if !(0.0..=1.0).contains(&self.cache.min_precision) {
            return Err(invalid("cache.min_precision", "must be between 0 and 1"));
        }
        if self.cache.semantic.batch == 0 || self.cache.semantic.capacity == 0 {
            return Err(invalid(
                "cache.semantic.batch",
                "batch and capacity must be at least 1",
            ));
        }
        if self.ledger.batch_rows == 0 || self.ledger.queue_capacity == 0 {
            return Err(invalid(
                "ledger.batch_rows",
                "batch_rows and queue_capacity must be at least 1",
            ));
        }
        let b = &self.budgets;
        if b.store == BudgetStoreKind::Redis && b.redis_urls.is_empty() {
            return Err(invalid(
                "budgets.redis_urls",
                "needs at least one URL when budgets.store = \"redis\"",
            ));
        }
        for url in &b.redis_urls {
            if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                return Err(invalid(
                    "budgets.redis_urls",
                    format!("{url:?} must start with redis:// or rediss://"),
                ));
            }
        }
        if b.lease_requests > 0 && !(20..=60_000).contains(&b.lease_ms) {
            return Err(invalid(
                "budgets.lease_ms",
                "must be between 20 and 60000 (or set budgets.lease_requests = 0)",
            ));
        }
        if !(b.fail_open_share > 0.0 && b.fail_open_share <= 1.0) {
            return Err(invalid("budgets.fail_open_share", "must be in (0, 1]"));
        }
        if b.store_timeout_ms == 0 || b.reservation_ttl_secs == Some(0) {
            return Err(invalid(
                "budgets.store_timeout_ms",
                "store_timeout_ms and reservation_ttl_secs must be greater than 0",
            ));
        }
        for (alias, target) in &self.models {
            if target != AUTO && !self.tiers.contains_key(target) {
                return Err(invalid(
                    format!("models.{alias}"),
                    format!("names tier {target:?}, which is not configured"),
                ));
            }
        }
        Ok(())
    }

    /// The client-facing model names: configured aliases plus every upstream model name.
    pub fn model_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.models.keys().cloned().collect();
        for tier in self.tiers.values() {
            for r in &tier.replicas {
                if !names.contains(&r.model) {
                    names.push(r.model.clone());
                }
            }
        }
        names
    }

    /// Which tier (or `auto`) a client-facing model name maps to.
    pub fn resolve_model(&self, model: &str) -> Option<String> {
        if let Some(target) = self.models.get(model) {
            return Some(target.clone());
        }
        self.tiers
            .iter()
            .find(|(_, t)| t.replicas.iter().any(|r| r.model == model))
            .map(|(name, _)| name.clone())
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    fn tier(name: &str, url: &str) -> TierConfig {
        TierConfig {
            tokenizer: None,
            replicas: vec![ReplicaConfig {
                name: name.into(),
                url: url.into(),
                model: format!("{name}-model"),
                api_key_env: None,
                max_concurrency: 4,
            }],
        }
    }

    fn valid() -> Config {
        let mut c = Config::default();
        c.tiers
            .insert(SMALL.into(), tier("s1", "http://127.0.0.1:1/v1"));
        c.tiers
            .insert(LARGE.into(), tier("l1", "http://127.0.0.1:2/v1"));
        c.models.insert("fast".into(), SMALL.into());
        c.models.insert("auto".into(), AUTO.into());
        c
    }

    #[test]
    fn a_valid_config_passes_and_resolves_models() {
        let c = valid();
        c.validate().unwrap();
        assert_eq!(c.resolve_model("fast").as_deref(), Some(SMALL));
        assert_eq!(c.resolve_model("auto").as_deref(), Some(AUTO));
        assert_eq!(c.resolve_model("l1-model").as_deref(), Some(LARGE));
        assert_eq!(c.resolve_model("gpt-7"), None);
    }

    #[test]
    fn errors_name_the_field() {
        let mut c = valid();
        c.tiers.get_mut(LARGE).unwrap().replicas[0].url = "ftp://x".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("tiers.large.replicas[0].url"), "{e}");

        let mut c = valid();
        c.tiers.remove(SMALL);
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("tiers.small"));

        let mut c = valid();
        c.models.insert("x".into(), "medium".into());
        assert!(c.validate().unwrap_err().to_string().contains("models.x"));
    }

    #[test]
    fn an_empty_or_short_admin_token_is_refused_and_an_absent_one_is_allowed() {
        for bad in ["", "short", " padded-admin-token-value ", "fifteen-chars!!"] {
            let mut c = valid();
            c.admin.token = Some(bad.to_owned().into());
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("admin.token"), "{bad:?}: {e}");
        }
        let mut c = valid();
        c.admin.token = Some("sixteen-chars-ok".to_owned().into());
        c.validate().unwrap();
        c.admin.token = None;
        c.validate().unwrap();
    }

    #[test]
    fn the_shipped_example_config_loads() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../gateway.example.toml"
        ));
        let c = Config::load(Some(path)).unwrap();
        assert_eq!(c.tiers[SMALL].replicas.len(), 2);
        assert_eq!(c.resolve_model("smart").as_deref(), Some(LARGE));
        assert_eq!(c.upstream.on_client_disconnect, DisconnectPolicy::Drain);
    }

    #[test]
    fn unknown_fields_in_the_file_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.toml");
        std::fs::write(&path, "[server]\nlisten = \"127.0.0.1:0\"\nlisen = 1\n").unwrap();
        let e = Config::load(Some(&path)).unwrap_err().to_string();
        assert!(e.contains("lisen"), "{e}");
    }
}
