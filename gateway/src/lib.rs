//! The gateway service: an OpenAI-compatible proxy in front of self-hosted model servers and
//! hosted providers, with tenants, API keys, usage settlement and metrics.
//!
//! Module map (dependencies point downwards):
//! - [`app`]: the one `build_router`, `serve`/`run` — the request path in one place;
//! - [`server`]: the listener: connection cap, header and body read deadlines, draining;
//! - [`state`]: [`AppState`], the shared state handlers and the pipeline take, and its builder;
//! - [`routes`]: thin axum handlers for `/v1`, `/admin/v1` and the probes;
//! - [`pipeline`]: the request pipeline (route → forward with failover → settle);
//! - [`guard`]: the guard step's sessions and loop signals;
//! - [`upstream`]: tiers of replicas, the pooled HTTP client, one forwarding attempt;
//! - [`openai`]: typed views of OpenAI request bodies and the SSE stream rewriter;
//! - [`keys`], [`store`]: API keys and tenants behind one store trait (SQLite, Postgres);
//! - [`usage`], [`metrics`], [`tokens`]: settlement events, Prometheus metrics, token counting;
//! - [`simulator`], [`demo`], [`ctl`]: the backend simulator, `gateway demo`, `gatewayctl`.

pub mod app;
pub mod budget;
pub mod cache;
pub mod config;
pub mod ctl;
pub mod demo;
pub mod error;
pub mod guard;
pub mod headers;
pub mod keys;
pub mod ledger;
pub mod metrics;
pub mod middleware;
pub mod openai;
pub mod pipeline;
pub mod pricing;
pub mod redis_conn;
pub mod routes;
pub mod routing;
pub mod scrape;
pub mod server;
pub mod simulator;
pub mod state;
pub mod store;
pub mod tasks;
pub mod telemetry;
pub mod tokens;
pub mod types;
pub mod upstream;
pub mod usage;

/// The hash map of the request path's lookups (API keys, prices, policies, budget counters,
/// requests in flight): foldhash, seeded per process since keys can come from clients. With std's
/// SipHash instead, a request with budgets ran ~4.9 k more instructions (callgrind; fourteenth
/// sitting in docs/benchmarks.md).
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

pub use app::{run, serve};
pub use config::Config;
pub use error::ApiError;
pub use state::{AppState, Deps};
