//! The one router and the server's life cycle; the state it serves lives in [`crate::state`].

use std::future::Future;
use std::time::Duration;

use anyhow::Context as _;
use axum::middleware::from_fn_with_state;
use axum::routing::{delete, get, post, put};
use axum::Router;
use tokio::net::TcpListener;

use crate::cache::CachePolicy;
use crate::config::Config;
use crate::guard::GuardPolicy;
use crate::middleware::request_id::Edge;
use crate::state::{AppState, Deps};
use crate::types::routing::RoutingPolicy;
use crate::{middleware, routes};

/// The whole HTTP surface. Layers, outermost first:
/// 1. `middleware::request_id::Edge`, the one edge layer around the router (one layer, not
///    three, and a service of its own, not a `from_fn` layer: those cost a service clone and a
///    boxed future per request): 431 in OpenAI shape over 32 KiB of header fields
///    (`middleware::headers::oversized`; past 100 fields hyper's own 431, without a body, comes
///    first); then it mints the request's own `x-request-id` (never the client's: it keys the
///    ledger row, the budget reservation and replays), keeps a client's `x-request-id` /
///    `x-client-request-id` as `x-client-request-id`, echoed back, and runs the request in one
///    span (method, path, both ids) for logs;
/// 2. per route group: `/v1/*` requires a tenant API key (every `/v1` handler's first
///    extractor is `middleware::auth::ApiKeyAuth`, the resolved key); `/admin/v1/*` and
///    `GET /dashboard` (the HTML cost dashboard) require the admin token
///    (`middleware::auth::require_admin`: bearer, or HTTP Basic auth with the token as
///    password, so a browser can open the dashboard).
///
/// Unauthenticated allowlist: `GET /healthz`, `GET /readyz`, `GET /metrics`.
/// Body size limits are enforced in the handlers (`server.max_body_bytes`, 413 in OpenAI shape).
pub fn build_router(state: AppState) -> Edge<Router> {
    let v1 = Router::new()
        .route(
            "/v1/chat/completions",
            post(routes::openai::chat_completions),
        )
        .route("/v1/completions", post(routes::openai::completions))
        .route("/v1/embeddings", post(routes::openai::embeddings))
        .route("/v1/models", get(routes::openai::list_models))
        .route("/v1/models/{model}", get(routes::openai::get_model));
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
            put(routes::policy::set_policy::<CachePolicy>)
                .get(routes::policy::get_policy::<CachePolicy>)
                .delete(routes::policy::delete_policy::<CachePolicy>),
        )
        .route(
            "/admin/v1/tenants/{tenant}/guard-policy",
            put(routes::policy::set_policy::<GuardPolicy>)
                .get(routes::policy::get_policy::<GuardPolicy>)
                .delete(routes::policy::delete_policy::<GuardPolicy>),
        )
        .route(
            "/admin/v1/tenants/{tenant}/routing-policy",
            put(routes::policy::set_policy::<RoutingPolicy>)
                .get(routes::policy::get_policy::<RoutingPolicy>)
                .delete(routes::policy::delete_policy::<RoutingPolicy>),
        )
        .route(
            "/admin/v1/tenants/{tenant}/sessions",
            get(routes::guard::list_sessions),
        )
        .route(
            "/admin/v1/tenants/{tenant}/sessions/{session}",
            get(routes::guard::get_session).delete(routes::guard::clear_session),
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
    let router = v1
        .merge(admin)
        .merge(open)
        .fallback(routes::health::not_found)
        .method_not_allowed_fallback(routes::health::method_not_allowed)
        .with_state(state);
    Edge::new(router)
}

/// Serve on `listener` (on the caller's runtime) until `shutdown` resolves, then drain: stop
/// accepting, let in-flight requests finish, and wait (up to `server.shutdown_grace_secs`) for
/// background settlement.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_on(crate::server::Listeners::Here(listener), state, shutdown).await
}

/// [`serve`] on `listeners`: one listener on the caller's runtime, or the `per-core` lanes.
/// The lanes' runtimes must outlive this (requests settle on them while it drains).
async fn serve_on(
    listeners: crate::server::Listeners,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = build_router(state.clone());
    let limits = crate::server::Limits::from_config(&state.config.server);
    crate::server::serve(listeners, app, limits, shutdown).await;
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
    // Every request task has settled (or the grace ran out): their budget commits go out, the
    // components' loops stop, then the ledger is flushed last.
    state.budgets.flush(grace).await;
    if tokio::time::timeout(grace, state.guard.flush())
        .await
        .is_err()
    {
        tracing::warn!("shutdown grace expired with the guard's settles still being sent");
    }
    if !state.background.stop(grace).await {
        tracing::warn!(
            running = state.background.running(),
            "shutdown grace expired with background loops still running"
        );
    }
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

/// `gateway serve`: build the state from `config`, bind `server.listen`, serve until a signal
/// (on the `per-core` lanes or the caller's runtime, as `server.runtime` says).
pub async fn run(config: Config) -> anyhow::Result<()> {
    let listen = config.server.listen;
    let state = AppState::build(config, Deps::default()).await?;
    if state.config.server.runtime == crate::config::ServerRuntime::Shared {
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding server.listen = {listen}"))?;
        tracing::info!(address = %listen, "gateway listening");
        return serve(listener, state, shutdown_signal()).await;
    }
    let threads = state.config.server.lanes();
    let sockets = crate::server::bind_lanes(listen, threads)
        .with_context(|| format!("binding server.listen = {listen}"))?;
    let lanes = crate::server::Lanes::start(threads).context("starting the server's threads")?;
    tracing::info!(address = %listen, threads, "gateway listening");
    let listeners = crate::server::Listeners::Lanes(sockets, lanes.handles());
    let served = serve_on(listeners, state, shutdown_signal()).await;
    // Only now: requests still settling during the drain ran on the lanes.
    drop(lanes);
    served
}
