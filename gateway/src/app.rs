//! Application state, the one router, and the server's life cycle.

use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::Request;
use axum::middleware::from_fn_with_state;
use axum::routing::{delete, get, post, put};
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::config::Config;
use crate::keys::Authenticator;
use crate::ledger::writer::LedgerWriter;
use crate::ledger::LedgerStore;
use crate::metrics::Metrics;
use crate::pricing::Prices;
use crate::store::{self, Store};
use crate::upstream::Upstreams;
use crate::usage::{LogSink, SharedSink};
use crate::{middleware, routes};

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
    /// The ledger, when the gateway writes one.
    pub ledger: Option<Arc<dyn LedgerStore>>,
    /// The ledger writer task, flushed on shutdown.
    ledger_writer: std::sync::Mutex<Option<LedgerWriter>>,
    /// Pipelines and stream drivers, awaited on shutdown so no usage is lost.
    pub tasks: TaskTracker,
    /// Fired when the server shuts down (stops background loops).
    pub shutdown: CancellationToken,
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
    /// Use this clock for budget windows (tests move time with a `ManualClock`).
    pub clock: Option<Arc<dyn crate::budget::Clock>>,
}

impl AppState {
    /// Build the state: open (and for SQLite migrate) the store, load keys, build the upstream
    /// tiers, and start the key refresher.
    pub async fn build(config: Config, deps: Deps) -> anyhow::Result<Self> {
        config.validate()?;
        let store = match deps.store {
            Some(s) => s,
            None => store::open(&config.store.url)
                .await
                .with_context(|| format!("opening store {}", redact_url(&config.store.url)))?,
        };
        let auth = Arc::new(Authenticator::new(Arc::clone(&store)).await?);
        let upstreams = Upstreams::new(&config)?;
        for name in config.tiers.keys() {
            if let Some(t) = upstreams.tier(name) {
                t.tokenizer.warm();
            }
        }
        let prices =
            Arc::new(Prices::new(Arc::clone(&store), config.prices(chrono::Utc::now())?).await?);
        let metrics = Metrics::new()?;
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
        let budgets = Arc::new(
            crate::budget::Budgets::new(
                config.budgets.clone(),
                config.upstream.total_timeout(),
                Arc::clone(&store),
                spend_source,
                deps.clock
                    .unwrap_or_else(|| Arc::new(crate::budget::SystemClock)),
                metrics.clone(),
                deps.budget_store,
            )
            .await
            .context("starting budgets")?,
        );
        tokio::spawn(Arc::clone(&budgets).run_commits());
        tokio::spawn(Arc::clone(&budgets).run_leases());
        let shutdown = CancellationToken::new();
        let every = Duration::from_millis(config.store.key_refresh_ms);
        let b = Arc::clone(&budgets);
        tokio::spawn(store::refresh_every(
            "budget policies",
            every,
            shutdown.clone(),
            move || {
                let b = Arc::clone(&b);
                async move { b.refresh().await }
            },
        ));
        let b = Arc::clone(&budgets);
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => b.replay_backlog().await,
                }
            }
        });
        let cache = Arc::new(
            crate::cache::Cache::new(config.cache.clone(), Arc::clone(&store), metrics.clone())
                .await
                .context("starting the cache")?,
        );
        let c = Arc::clone(&cache);
        tokio::spawn(store::refresh_every(
            "cache policies",
            every,
            shutdown.clone(),
            move || {
                let c = Arc::clone(&c);
                async move { c.refresh().await }
            },
        ));
        let (a, p) = (Arc::clone(&auth), Arc::clone(&prices));
        tokio::spawn(store::refresh_every(
            "keys",
            every,
            shutdown.clone(),
            move || {
                let a = Arc::clone(&a);
                async move { a.refresh().await }
            },
        ));
        tokio::spawn(store::refresh_every(
            "prices",
            every,
            shutdown.clone(),
            move || {
                let p = Arc::clone(&p);
                async move { p.refresh().await }
            },
        ));
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
            ledger,
            ledger_writer: std::sync::Mutex::new(ledger_writer),
            tasks: TaskTracker::new(),
            shutdown,
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

/// The whole HTTP surface. Layers, outermost first:
/// 1. `SetRequestIdLayer`: gives every request an `x-request-id` (keeps the client's if sent);
/// 2. `TraceLayer`: one span per request (method, path) for logs;
/// 3. `PropagateRequestIdLayer`: copies `x-request-id` onto the response;
/// 4. per route group: `/v1/*` requires a tenant API key (`middleware::auth::require_api_key` puts the
///    resolved key in the request extensions); `/admin/v1/*` and `GET /dashboard` (the HTML cost
///    dashboard) require the admin token (`middleware::auth::require_admin`: bearer, or HTTP
///    Basic auth with the token as password, so a browser can open the dashboard).
///
/// Unauthenticated allowlist: `GET /healthz`, `GET /readyz`, `GET /metrics`.
/// Body size limits are enforced in the handlers (`server.max_body_bytes`, 413 in OpenAI shape).
pub fn build_router(state: AppState) -> Router {
    let v1 = Router::new()
        .route(
            "/v1/chat/completions",
            post(routes::openai::chat_completions),
        )
        .route("/v1/completions", post(routes::openai::completions))
        .route("/v1/embeddings", post(routes::openai::embeddings))
        .route("/v1/models", get(routes::openai::list_models))
        .route("/v1/models/{model}", get(routes::openai::get_model))
        .route_layer(from_fn_with_state(
            state.clone(),
            middleware::auth::require_api_key,
        ));
    let admin = Router::new()
        .route(
            "/admin/v1/tenants",
            post(routes::admin::create_tenant).get(routes::admin::list_tenants),
        )
        .route(
            "/admin/v1/tenants/{tenant}",
            delete(routes::admin::delete_tenant),
        )
        .route(
            "/admin/v1/keys",
            post(routes::admin::create_key).get(routes::admin::list_keys),
        )
        .route("/admin/v1/keys/{key}", delete(routes::admin::revoke_key))
        .route("/admin/v1/replicas", get(routes::admin::replicas))
        .route(
            "/admin/v1/reports/weekly",
            get(routes::admin::weekly_report),
        )
        .route(
            "/admin/v1/reports/explain",
            get(routes::admin::explain_report),
        )
        .route("/admin/v1/reports/loops", get(routes::admin::loops_report))
        .route(
            "/admin/v1/budgets",
            post(routes::budgets::set_budget).get(routes::budgets::list_budgets),
        )
        .route(
            "/admin/v1/budgets/{id}",
            delete(routes::budgets::delete_budget),
        )
        .route("/admin/v1/usage", get(routes::budgets::usage))
        .route(
            "/admin/v1/rate-limits",
            put(routes::budgets::set_rate_limit)
                .get(routes::budgets::list_rate_limits)
                .delete(routes::budgets::delete_rate_limit),
        )
        .route(
            "/admin/v1/tenants/{tenant}/fail-mode",
            put(routes::budgets::set_fail_mode),
        )
        .route(
            "/admin/v1/tenants/{tenant}/cache-policy",
            put(routes::budgets::set_cache_policy)
                .get(routes::budgets::get_cache_policy)
                .delete(routes::budgets::delete_cache_policy),
        )
        .route("/dashboard", get(routes::dashboard::dashboard))
        .route(
            "/admin/v1/prices",
            post(routes::admin::set_price).get(routes::admin::list_prices),
        )
        .route_layer(from_fn_with_state(
            state.clone(),
            middleware::auth::require_admin,
        ));
    let open = Router::new()
        .route("/healthz", get(routes::health::healthz))
        .route("/readyz", get(routes::health::readyz))
        .route("/metrics", get(routes::health::metrics));
    v1.merge(admin)
        .merge(open)
        .fallback(routes::health::not_found)
        .method_not_allowed_fallback(routes::health::method_not_allowed)
        .with_state(state)
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
            tracing::info_span!("request", method = %req.method(), path = %req.uri().path())
        }))
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
}

/// Serve on `listener` until `shutdown` resolves, then drain: stop accepting, let in-flight
/// requests finish, and wait (up to `server.shutdown_grace_secs`) for background settlement.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = build_router(state.clone());
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("HTTP server failed")?;
    state.shutdown.cancel();
    state.tasks.close();
    let grace = Duration::from_secs(state.config.server.shutdown_grace_secs);
    if tokio::time::timeout(grace, state.tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            pending = state.tasks.len(),
            "shutdown grace expired with requests still settling"
        );
    }
    // Every request task has settled (or the grace ran out): their budget commits go out, then
    // the ledger is flushed last.
    state.budgets.flush(grace).await;
    let writer = state.ledger_writer.lock().ok().and_then(|mut w| w.take());
    if let Some(writer) = writer {
        writer.shutdown().await;
    }
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: draining in-flight requests");
}

/// `gateway serve`: build the state from `config`, bind `server.listen`, serve until a signal.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let listen = config.server.listen;
    let state = AppState::build(config, Deps::default()).await?;
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding server.listen = {listen}"))?;
    tracing::info!(address = %listen, "gateway listening");
    serve(listener, state, shutdown_signal()).await
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
