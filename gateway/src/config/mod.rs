//! The one typed configuration tree.
//!
//! Layers, later wins: built-in defaults → TOML file → environment (`GATEWAY__SECTION__KEY`, e.g.
//! `GATEWAY__ADMIN__TOKEN`) → command-line flags (applied by the binary). Unknown fields are
//! rejected, and [`Config::validate`] refuses a bad config with a message naming the field.
//! Nothing below this module reads the environment, except the upstream API keys whose variable
//! *names* the config carries (resolved once, here).
//!
//! Plain data, one file per section, and a leaf: it imports nothing from the gateway but the
//! plain types of [`crate::types`]. The components each take their own section.

mod admin;
mod budgets;
mod cache;
mod guard;
mod ledger;
mod prices;
mod routing;
mod server;
mod store;
mod tiers;
mod upstream;

use std::collections::BTreeMap;
use std::path::Path;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

pub use admin::{AdminConfig, MIN_ADMIN_TOKEN_LEN};
pub use budgets::{BudgetConfig, BudgetStoreKind};
pub use cache::{CacheConfig, CpuPrecision, EmbedDevice, SemanticConfig};
pub use guard::{GuardConfig, GuardStoreKind, RetryAction};
pub use ledger::LedgerConfig;
pub use prices::PriceConfig;
pub use routing::{RoutingConfig, ToolsRule, Unavailable};
pub use server::{Runtime as ServerRuntime, ServerConfig};
pub use store::StoreConfig;
pub use tiers::{ReplicaConfig, TierConfig};
pub use upstream::{DisconnectPolicy, ReplicaChoice, UpstreamConfig};

use crate::types::price::usd_to_micros;
pub use crate::types::{ModelTarget, Tier, TokenizerKind};

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

/// Check that every URL of `field` is a Redis URL.
fn redis_urls(field: &str, urls: &[String]) -> Result<(), ConfigError> {
    match urls
        .iter()
        .find(|u| !(u.starts_with("redis://") || u.starts_with("rediss://")))
    {
        Some(url) => Err(invalid(
            field,
            format!("{url:?} must start with redis:// or rediss://"),
        )),
        None => Ok(()),
    }
}

/// Most request-serving threads `server.threads` may ask for (each holds a runtime and an
/// upstream connection pool).
pub const MAX_SERVER_THREADS: usize = 256;

pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
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
    /// The replicas of each tier; `small` and `large` are both required.
    pub tiers: BTreeMap<Tier, TierConfig>,
    /// Client-facing model name → `small`, `large` or `auto` (routed by the gateway).
    pub models: BTreeMap<String, ModelTarget>,
    /// Prices by served model name, USD per 1M tokens.
    pub prices: BTreeMap<String, PriceConfig>,
    /// The cost ledger.
    pub ledger: LedgerConfig,
    /// Budgets and rate limits (policies are managed with `gatewayctl budgets|limits`).
    pub budgets: BudgetConfig,
    /// The exact and semantic response cache (per-tenant policies: `gatewayctl cache`).
    pub cache: CacheConfig,
    /// Agent-loop detection (per-tenant policies: `gatewayctl guard`).
    pub guard: GuardConfig,
    /// The tier router for `auto` (per-tenant policies: `gatewayctl routing`).
    pub routing: RoutingConfig,
}

impl Config {
    /// The Redis the guard's session windows live in, `None`: this process. `auto` follows
    /// the budgets (Redis when they use it).
    pub fn guard_redis_urls(&self) -> Option<Vec<String>> {
        let urls = if self.guard.redis_urls.is_empty() {
            &self.budgets.redis_urls
        } else {
            &self.guard.redis_urls
        };
        let shared = match self.guard.store {
            GuardStoreKind::Memory => false,
            GuardStoreKind::Redis => true,
            GuardStoreKind::Auto => {
                self.budgets.store == BudgetStoreKind::Redis || !self.guard.redis_urls.is_empty()
            }
        };
        (shared && !urls.is_empty()).then(|| urls.clone())
    }

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
        self.guard.validate()?;
        self.routing
            .defaults()
            .check()
            .map_err(|(field, message)| invalid(format!("routing.{field}"), message))?;
        if self.server.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes", "must be greater than 0"));
        }
        if self.server.threads > MAX_SERVER_THREADS {
            return Err(invalid(
                "server.threads",
                format!("must be at most {MAX_SERVER_THREADS} (0 is one per core)"),
            ));
        }
        for (field, value) in [
            ("server.max_connections", self.server.max_connections as u64),
            (
                "server.header_read_timeout_ms",
                self.server.header_read_timeout_ms,
            ),
            (
                "server.body_read_timeout_ms",
                self.server.body_read_timeout_ms,
            ),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be greater than 0"));
            }
        }
        if !(self.store.url.starts_with("sqlite:") || self.store.url.starts_with("postgres")) {
            return Err(invalid(
                "store.url",
                "must start with sqlite:// or postgres://",
            ));
        }
        if !(0.0..1.0).contains(&self.cache.semantic.gate_overlap) {
            return Err(invalid(
                "cache.semantic.gate_overlap",
                "must be in [0, 1) (0 turns the first stage off)",
            ));
        }
        if !(0.0..1.0).contains(&self.cache.semantic.gate_student) {
            return Err(invalid(
                "cache.semantic.gate_student",
                "must be in [0, 1) (0 turns the learned first stage off)",
            ));
        }
        if !(0..=19).contains(&self.cache.semantic.nice) {
            return Err(invalid(
                "cache.semantic.nice",
                "must be in 0..=19 (0: the embedding threads run at the requests' priority)",
            ));
        }
        if self.cache.semantic.gate_overlap > 0.0 && self.cache.semantic.gate_student > 0.0 {
            return Err(invalid(
                "cache.semantic.gate_student",
                "set at most one first stage: gate_overlap or gate_student",
            ));
        }
        if self.store.key_refresh_ms == 0 {
            return Err(invalid("store.key_refresh_ms", "must be greater than 0"));
        }
        if self.upstream.retries_same_tier > 1 {
            return Err(invalid("upstream.retries_same_tier", "must be 0 or 1"));
        }
        let u = &self.upstream;
        if !(u.error_ratio > 0.0 && u.error_ratio <= 1.0) {
            return Err(invalid("upstream.error_ratio", "must be in (0, 1]"));
        }
        if u.scrape_interval_ms < 50 {
            return Err(invalid(
                "upstream.scrape_interval_ms",
                "must be at least 50",
            ));
        }
        if u.affinity_block_bytes == 0 {
            return Err(invalid(
                "upstream.affinity_block_bytes",
                "must be at least 1",
            ));
        }
        if !(0.0..=1.0).contains(&u.fallback_max_share) {
            return Err(invalid("upstream.fallback_max_share", "must be in [0, 1]"));
        }
        if u.fallback_window_ms < 100 {
            return Err(invalid(
                "upstream.fallback_window_ms",
                "must be at least 100 (ms)",
            ));
        }
        if !(0.0..=1.0).contains(&u.retry_budget_ratio) {
            return Err(invalid("upstream.retry_budget_ratio", "must be in [0, 1]"));
        }
        if !(u.throttle_k == 0.0 || (1.0..=100.0).contains(&u.throttle_k)) {
            return Err(invalid(
                "upstream.throttle_k",
                "must be 0 (off) or between 1 and 100",
            ));
        }
        if u.adaptive_min_concurrency == 0 {
            return Err(invalid(
                "upstream.adaptive_min_concurrency",
                "must be at least 1",
            ));
        }
        if u.adaptive_probe_interval_ms < 1_000 {
            return Err(invalid(
                "upstream.adaptive_probe_interval_ms",
                "must be at least 1000 (ms)",
            ));
        }
        if !(1.0..=100.0).contains(&u.adaptive_tolerance) {
            return Err(invalid(
                "upstream.adaptive_tolerance",
                "must be between 1 and 100 (times the baseline latency)",
            ));
        }
        if u.throttle_window_ms < 100 {
            return Err(invalid(
                "upstream.throttle_window_ms",
                "must be at least 100 (ms)",
            ));
        }
        if u.error_ratio_min_requests == 0 {
            return Err(invalid(
                "upstream.error_ratio_min_requests",
                "must be at least 1",
            ));
        }
        if u.error_ratio_window_ms < 10 {
            return Err(invalid(
                "upstream.error_ratio_window_ms",
                "must be at least 10 (ms)",
            ));
        }
        if self.upstream.failure_threshold == 0 {
            return Err(invalid("upstream.failure_threshold", "must be at least 1"));
        }
        let up = &self.upstream;
        for (field, value) in [
            ("upstream.first_byte_timeout_ms", up.first_byte_timeout_ms),
            (
                "upstream.stream_first_byte_timeout_ms",
                up.stream_first_byte_timeout_ms,
            ),
            ("upstream.first_byte_budget_ms", up.first_byte_budget_ms),
            ("upstream.total_timeout_ms", up.total_timeout_ms),
            ("upstream.max_response_bytes", up.max_response_bytes as u64),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be greater than 0"));
            }
        }
        for tier in Tier::ALL {
            if !self.tiers.contains_key(&tier) {
                return Err(invalid(
                    format!("tiers.{tier}"),
                    "is required (a list of replicas)",
                ));
            }
        }
        let mut names = std::collections::HashSet::new();
        for (tier_name, tier) in &self.tiers {
            if tier.replicas.is_empty() {
                return Err(invalid(
                    format!("tiers.{tier_name}.replicas"),
                    "needs at least one replica",
                ));
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
        for (model, p) in &self.prices {
            let amounts = [("input", Some(p.input)), ("output", Some(p.output))];
            for (field, usd) in amounts
                .into_iter()
                .chain([("cached_input", p.cached_input)])
            {
                if usd.is_some_and(|usd| usd_to_micros(usd).is_none()) {
                    return Err(invalid(
                        format!("prices.{model}.{field}"),
                        "must be a non-negative amount of USD",
                    ));
                }
            }
        }
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
        redis_urls("budgets.redis_urls", &b.redis_urls)?;
        if self.guard.store == GuardStoreKind::Redis && self.guard_redis_urls().is_none() {
            return Err(invalid(
                "guard.redis_urls",
                "needs a URL (or budgets.redis_urls) when guard.store = \"redis\"",
            ));
        }
        redis_urls("guard.redis_urls", &self.guard.redis_urls)?;
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
    pub fn resolve_model(&self, model: &str) -> Option<ModelTarget> {
        if let Some(target) = self.models.get(model) {
            return Some(*target);
        }
        self.tiers
            .iter()
            .find(|(_, t)| t.replicas.iter().any(|r| r.model == model))
            .map(|(tier, _)| ModelTarget::from(*tier))
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
                metrics_url: None,
            }],
        }
    }

    fn valid() -> Config {
        let mut c = Config::default();
        c.tiers
            .insert(Tier::Small, tier("s1", "http://127.0.0.1:1/v1"));
        c.tiers
            .insert(Tier::Large, tier("l1", "http://127.0.0.1:2/v1"));
        c.models.insert("fast".into(), ModelTarget::Small);
        c.models.insert("auto".into(), ModelTarget::Auto);
        c
    }

    #[test]
    fn a_valid_config_passes_and_resolves_models() {
        let c = valid();
        c.validate().unwrap();
        assert_eq!(c.resolve_model("fast"), Some(ModelTarget::Small));
        assert_eq!(c.resolve_model("auto"), Some(ModelTarget::Auto));
        assert_eq!(c.resolve_model("l1-model"), Some(ModelTarget::Large));
        assert_eq!(c.resolve_model("gpt-7"), None);
    }

    #[test]
    fn errors_name_the_field() {
        let mut c = valid();
        c.tiers.get_mut(&Tier::Large).unwrap().replicas[0].url = "ftp://x".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("tiers.large.replicas[0].url"), "{e}");

        let mut c = valid();
        c.tiers.remove(&Tier::Small);
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("tiers.small"));

        let mut c = valid();
        c.prices.insert(
            "m".into(),
            PriceConfig {
                input: -1.0,
                output: 1.0,
                cached_input: None,
            },
        );
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("prices.m.input"), "{e}");

        for bad in [1.0, -0.1, f32::NAN] {
            let mut c = valid();
            c.cache.semantic.gate_overlap = bad;
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("cache.semantic.gate_overlap"), "{bad}: {e}");
            let mut c = valid();
            c.cache.semantic.gate_student = bad;
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("cache.semantic.gate_student"), "{bad}: {e}");
        }
        let mut c = valid();
        c.cache.semantic.gate_overlap = 0.15;
        c.cache.semantic.gate_student = 0.45;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("at most one first stage"), "{e}");
        for bad in [-1, 20] {
            let mut c = valid();
            c.cache.semantic.nice = bad;
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("cache.semantic.nice"), "{bad}: {e}");
        }
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
        assert_eq!(c.tiers[&Tier::Small].replicas.len(), 2);
        assert_eq!(c.resolve_model("smart"), Some(ModelTarget::Large));
        assert_eq!(c.upstream.on_client_disconnect, DisconnectPolicy::Drain);
    }

    #[test]
    fn unknown_tiers_targets_tokenizers_and_precisions_are_refused_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.toml");
        for (toml, field) in [
            (
                "[[tiers.medium.replicas]]\nname = \"m\"\nurl = \"http://x/v1\"\nmodel = \"m\"\n",
                "medium",
            ),
            ("[models]\nfast = \"medium\"\n", "models.fast"),
            (
                "[tiers.small]\ntokenizer = \"llama\"\n",
                "tiers.small.tokenizer",
            ),
            (
                "[cache.semantic]\nprecision = \"fp8\"\n",
                "cache.semantic.precision",
            ),
        ] {
            std::fs::write(&path, toml).unwrap();
            let e = Config::load(Some(&path)).unwrap_err().to_string();
            assert!(e.contains(field), "{toml}: {e}");
        }
        let c: CacheConfig = Figment::new()
            .merge(Toml::string("[semantic]\nprecision = \"f16\"\n"))
            .extract()
            .unwrap();
        assert_eq!(c.semantic.precision, CpuPrecision::F16);
        assert_eq!(
            Config::default().cache.semantic.precision,
            CpuPrecision::Auto
        );
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
