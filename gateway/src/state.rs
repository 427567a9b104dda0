//! Shared state: [`AppState`], one cheap clone of everything a handler and the pipeline need,
//! and [`AppState::build`], which opens the stores and starts the components. Apart from
//! [`crate::app`] (the router and the server's life cycle) so handlers depend on the state, not
//! on the router that mounts them.

use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::keys::Authenticator;
use crate::ledger::writer::LedgerWriter;
use crate::ledger::LedgerStore;
use crate::metrics::Metrics;
use crate::pricing::Prices;
use crate::store::{self, Store};
use crate::tasks::Background;
use crate::upstream::Upstreams;
use crate::usage::{LogSink, SharedSink};

/// Everything a handler needs; one cheap clone.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

/// The shared state behind [`AppState`].
pub struct Inner {
    /// The validated configuration.
    pub config: Config,
    /// Tenants and keys.
    pub store: Arc<dyn Store>,
    /// Key snapshot and lookup.
    pub auth: Arc<Authenticator>,
    /// Tiers, replicas and the HTTP client.
    pub upstreams: Upstreams,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// Where settlement events go.
    pub sink: SharedSink,
    /// Model prices.
    pub prices: Arc<Prices>,
    /// Budgets and rate limits.
    pub budgets: Arc<crate::budget::Budgets>,
    /// The exact and semantic response cache.
    pub cache: Arc<crate::cache::Cache>,
    /// Agent-loop detection.
    pub guard: Arc<crate::guard::Guard>,
    /// The tier router for `auto`.
    pub routing: Arc<crate::routing::TierRouter>,
    /// Non-streamed requests in flight, which a client retry of one joins.
    pub inflight: Arc<crate::pipeline::coalesce::Inflight>,
    /// The ledger, when the gateway writes one.
    pub ledger: Option<Arc<dyn LedgerStore>>,
    /// The ledger writer task, flushed on shutdown.
    pub(crate) ledger_writer: std::sync::Mutex<Option<LedgerWriter>>,
    /// Pipelines and stream drivers, awaited on shutdown so no usage is lost.
    pub tasks: TaskTracker,
    /// The components' loops, stopped on shutdown once the requests have settled.
    pub background: Background,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("listen", &self.config.server.listen)
            .field("upstreams", &self.upstreams)
            .finish_non_exhaustive()
    }
}

impl Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

/// Optional collaborators a caller (tests, `gateway demo`, the ledger) can supply.
#[derive(Default, Clone)]
pub struct Deps {
    /// Use this store instead of opening `config.store.url`.
    pub store: Option<Arc<dyn Store>>,
    /// Send usage events here instead of the ledger (tests capture them this way).
    pub sink: Option<SharedSink>,
    /// Use this budget store instead of the configured one.
    pub budget_store: Option<Arc<dyn crate::budget::BudgetStore>>,
    /// Use this clock for budget windows and guard cooldowns (tests move time with a
    /// `ManualClock`).
    pub clock: Option<Arc<dyn crate::budget::Clock>>,
    /// Use this session store instead of the configured one.
    pub guard_store: Option<Arc<dyn crate::guard::store::GuardStore>>,
}

impl AppState {
    /// Build the state: open (and for SQLite migrate) the store, load keys, build the upstream
    /// tiers, and start the key refresher.
    pub async fn build(config: Config, deps: Deps) -> anyhow::Result<Self> {
        config.validate()?;
        let store = match deps.store {
            Some(s) => s,
            None => store::open(&config.store.url).await.with_context(|| {
                format!(
                    "opening store.url = {} (a replica starts only once the database \
                         answers: it needs the key snapshot)",
                    redact_url(&config.store.url)
                )
            })?,
        };
        let metrics = Metrics::new()?;
        let auth = Arc::new(Authenticator::new(Arc::clone(&store), metrics.clone()).await?);
        let upstreams = Upstreams::new(&config)?;
        for tier in config.tiers.keys() {
            if let Some(t) = upstreams.tier(*tier) {
                t.tokenizer.warm();
            }
        }
        let prices = Arc::new(
            Prices::new(
                Arc::clone(&store),
                crate::pricing::configured(&config.prices, chrono::Utc::now()),
            )
            .await?,
        );
        let (sink, ledger, ledger_writer): (SharedSink, _, _) = match deps.sink {
            Some(sink) => (sink, None, None),
            None if config.ledger.enabled => {
                let ledger = crate::ledger::open(&config.store.url).await?;
                let (sink, writer) =
                    LedgerWriter::start(Arc::clone(&ledger), &config.ledger, &metrics)
                        .with_context(|| {
                            format!(
                                "opening ledger.spool_dir {}",
                                config.ledger.spool_dir.display()
                            )
                        })?;
                (sink, Some(ledger), Some(writer))
            }
            None => (Arc::new(LogSink), None, None),
        };
        // Budgets rebuild their counters from the ledger even when events go elsewhere.
        let spend_source = match &ledger {
            Some(l) => Some(Arc::clone(l)),
            None if config.ledger.enabled => crate::ledger::open(&config.store.url).await.ok(),
            None => None,
        };
        let clock = deps
            .clock
            .unwrap_or_else(|| Arc::new(crate::budget::SystemClock));
        let budgets = Arc::new(
            crate::budget::Budgets::new(
                config.budgets.clone(),
                config.upstream.total_timeout(),
                Arc::clone(&store),
                spend_source,
                Arc::clone(&clock),
                metrics.clone(),
                deps.budget_store,
            )
            .await
            .context("starting budgets")?,
        );
        let background = Background::new();
        let cache = Arc::new(
            crate::cache::Cache::new(
                config.cache.clone(),
                Arc::clone(&store),
                metrics.clone(),
                &background,
            )
            .await
            .context("starting the cache")?,
        );
        let guard_store: Arc<dyn crate::guard::store::GuardStore> =
            match (deps.guard_store, config.guard_redis_urls()) {
                (Some(s), _) => s,
                (None, Some(urls)) => Arc::new(
                    crate::guard::redis::RedisGuard::new(
                        urls,
                        Duration::from_millis(config.guard.store_timeout_ms),
                    )
                    .context("guard.redis_urls")?
                    .with_block_ttl(Duration::from_secs(config.guard.block_ttl_secs)),
                ),
                (None, None) => Arc::new(
                    crate::guard::memory::MemoryGuard::new(
                        config.guard.max_sessions,
                        Duration::from_secs(config.guard.session_ttl_secs),
                    )
                    .with_block_ttl(Duration::from_secs(config.guard.block_ttl_secs)),
                ),
            };
        let model_dir = &config.cache.semantic.model_dir;
        let guard = Arc::new(
            crate::guard::Guard::new(
                config.guard.clone(),
                guard_store,
                Arc::clone(&store),
                model_dir
                    .join("tokenizer.json")
                    .exists()
                    .then(|| model_dir.clone()),
                clock,
                metrics.clone(),
            )
            .await
            .context("starting the guard")?,
        );
        let routed = config
            .models
            .values()
            .any(|t| *t == crate::types::ModelTarget::Auto);
        let routing = Arc::new(
            crate::routing::TierRouter::new(
                config.routing.clone(),
                model_dir,
                Arc::clone(&store),
                routed,
            )
            .await
            .context("starting the tier router")?,
        );
        // Everything is built: the components start their loops (stopped by `serve`).
        let every = Duration::from_millis(config.store.key_refresh_ms);
        auth.start(&background, every);
        prices.start(&background, every);
        budgets.start(&background, every);
        cache.start(&background, every);
        guard.start(&background, every);
        routing.start(&background, every);
        for tier in config.tiers.keys() {
            if let Some(pool) = upstreams.tier(*tier) {
                for (url, into) in pool.metrics_urls.iter().zip(&pool.observed) {
                    if let Some(url) = url {
                        crate::scrape::start(
                            &background,
                            url.clone(),
                            Arc::clone(into),
                            config.upstream.scrape_interval(),
                        );
                    }
                }
            }
        }
        Ok(Self(Arc::new(Inner {
            config,
            store,
            auth,
            upstreams,
            metrics,
            sink,
            prices,
            budgets,
            cache,
            guard,
            routing,
            inflight: Arc::default(),
            ledger,
            ledger_writer: std::sync::Mutex::new(ledger_writer),
            tasks: TaskTracker::new(),
            background,
        })))
    }
}

/// A database URL with any password replaced, for logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn passwords_are_redacted_from_urls() {
        assert_eq!(
            redact_url("postgres://u:secret@h/db"),
            "postgres://***@h/db"
        );
        assert_eq!(redact_url("sqlite://gateway.db"), "sqlite://gateway.db");
    }
}
