//! Settlement events: one [`UsageEvent`] per `/v1` request after authentication, produced even
//! when the client disconnects mid-stream, and handed to a [`UsageSink`] off the request path.
//! The cost ledger persists them; until then the default sink logs them.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::Serialize;

/// Where a request's answer came from, as far as caching goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheStatus {
    /// Not eligible for caching, or no cache configured.
    Bypass,
}

/// How the token counts were obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageSource {
    /// Reported by the upstream.
    Upstream,
    /// Counted by the gateway's tokenizer (upstream reported none, or the stream was cut).
    Tokenizer,
    /// No upstream call produced tokens (rejected before forwarding).
    None,
}

/// One request's settlement.
#[derive(Debug, Clone, Serialize)]
pub struct UsageEvent {
    /// Gateway request id (`x-request-id`).
    pub request_id: String,
    /// When the request arrived.
    pub started_at: DateTime<Utc>,
    /// Tenant id.
    pub tenant_id: String,
    /// Tenant name.
    pub tenant_name: String,
    /// API key id.
    pub key_id: String,
    /// Key tags merged with `x-gateway-tags` of the request.
    pub tags: BTreeMap<String, String>,
    /// `chat`, `completions` or `embeddings`.
    pub endpoint: &'static str,
    /// Model name the client asked for.
    pub requested_model: String,
    /// Model name the upstream served, if one was reached.
    pub served_model: Option<String>,
    /// Tier that served it.
    pub tier: Option<String>,
    /// Replica that served it.
    pub replica: Option<String>,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Prompt tokens served from the upstream's prefix cache.
    pub cached_tokens: u64,
    /// How the counts were obtained.
    pub usage_source: UsageSource,
    /// HTTP status returned to the client (499 when the client went away mid-stream).
    pub status: u16,
    /// Error kind, when the request failed.
    pub error_kind: Option<String>,
    /// Whether the response was streamed.
    pub stream: bool,
    /// Whether the client disconnected before the end.
    pub client_disconnected: bool,
    /// Total time to the last byte, ms.
    pub latency_ms: f64,
    /// Time to the first streamed event (or the whole body), ms.
    pub ttft_ms: Option<f64>,
    /// Upstream attempts beyond the first.
    pub retries: u32,
    /// Cache outcome.
    pub cache_status: CacheStatus,
}

/// Receives settlement events. `record` must not block: implementations queue the event.
pub trait UsageSink: Send + Sync + 'static {
    /// Take one event.
    fn record(&self, event: UsageEvent);
}

/// The default sink: writes each event as one structured log line (target `usage`).
#[derive(Debug, Default, Clone, Copy)]
pub struct LogSink;

impl UsageSink for LogSink {
    fn record(&self, event: UsageEvent) {
        if !tracing::enabled!(target: "usage", tracing::Level::INFO) {
            return;
        }
        match serde_json::to_string(&event) {
            Ok(json) => tracing::info!(target: "usage", event = %json, "usage"),
            Err(e) => tracing::warn!(error = %e, "usage event not serialisable"),
        }
    }
}

/// A sink that forwards events into a tokio channel (tests, and the ledger writer's queue).
#[derive(Debug, Clone)]
pub struct ChannelSink(pub tokio::sync::mpsc::UnboundedSender<UsageEvent>);

impl UsageSink for ChannelSink {
    fn record(&self, event: UsageEvent) {
        let _ = self.0.send(event);
    }
}

/// A shared sink handle.
pub type SharedSink = Arc<dyn UsageSink>;
