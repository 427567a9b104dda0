//! `[budgets]`: where budget counters live and how reservations behave.

use serde::{Deserialize, Serialize};

use crate::types::budget::FailMode;

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
    pub fail_mode: FailMode,
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
            fail_mode: FailMode::Closed,
            fail_open_share: 0.1,
            lease_requests: 64,
            lease_ms: 200,
        }
    }
}
