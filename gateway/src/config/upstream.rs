//! `[upstream]`: timeouts, retries and passive health of upstream calls.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What to do with an upstream stream whose client went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DisconnectPolicy {
    /// Keep reading the upstream to the end so the usage it reports is exact.
    Drain,
    /// Stop the upstream at once (saves GPU time); usage is counted from what was received.
    Cancel,
}

/// How a replica of a tier is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaChoice {
    /// The one with the fewest requests in flight (ties round-robin).
    LeastLoaded,
    /// Prefix affinity with SGLang's imbalance gate ([`router::affinity`]).
    AffinityGate,
    /// Prefix affinity with llm-d's weighted score.
    AffinityWeighted,
    /// Each replica in turn, whatever its load (a baseline for comparisons).
    RoundRobin,
}

/// Timeouts, retries and passive health for upstream calls.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// TCP (and TLS) connect timeout, ms.
    pub connect_timeout_ms: u64,
    /// Per attempt, time from sending a non-streamed request to the response headers, ms. Model
    /// servers send those headers once the whole answer is generated, so this bounds generation.
    pub first_byte_timeout_ms: u64,
    /// Per attempt, time from sending a streamed request to the response headers, ms. Model
    /// servers send those as soon as they accept the request, so a replica that does not is hung.
    pub stream_first_byte_timeout_ms: u64,
    /// Waiting for response headers across all attempts of one request, ms: once it is spent
    /// the request fails (504) instead of trying another replica, so a hung tier costs at most
    /// this long, not attempts × first-byte timeout.
    pub first_byte_budget_ms: u64,
    /// Largest non-streamed response body accepted from a model server, bytes (502 above).
    pub max_response_bytes: usize,
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
    /// Share of a replica's requests over `error_ratio_window_ms` that, once failed, takes it
    /// out (a replica failing every other request never fails `failure_threshold` in a row).
    pub error_ratio: f64,
    /// The sliding window of the error ratio, ms.
    pub error_ratio_window_ms: u64,
    /// Requests the window must hold before the ratio can take a replica out.
    pub error_ratio_min_requests: u32,
    /// The gateway's own retries and failovers in flight, per tier, at most this share of the
    /// requests active on it (Envoy's retry budget)...
    pub retry_budget_ratio: f64,
    /// ...and never fewer than this many.
    pub retry_budget_min: u32,
    /// Adaptive throttling: once a tier's model servers reject (429, 503, refused
    /// connections), reject locally with probability `max(0, (requests − K·accepts) /
    /// (requests + 1))` over the window. `K`: 2 lets the servers reject up to half before the
    /// gateway steps in; 0 turns it off.
    pub throttle_k: f64,
    /// The window of the throttle's counts, ms.
    pub throttle_window_ms: u64,
    /// Requests to a tier the window must hold before the throttle rejects anything.
    pub throttle_min_requests: u32,
    /// Fallback to the other tier (small → large multiplies a request's cost) for at most this
    /// share of a tenant's requests over `fallback_window_ms`...
    pub fallback_max_share: f64,
    /// ...but always this many in the window.
    pub fallback_min: u32,
    /// The window of the fallback bound, ms.
    pub fallback_window_ms: u64,
    /// Requests that may wait, per tier, for a replica at its `max_concurrency` to free a slot;
    /// beyond it a request fails fast (503, `Retry-After`) instead of queueing without bound.
    pub queue_depth: u32,
    /// Longest wait in that queue, ms (then 503).
    pub queue_wait_ms: u64,
    /// Adapt each replica's concurrency limit (at most its `max_concurrency`) to its measured
    /// time to first token: the limit falls while the server's queue makes TTFT grow past
    /// `adaptive_tolerance` × its baseline, and climbs back once it answers in time (a gradient
    /// limiter, `router::limit`). Off: the limit is `max_concurrency`.
    pub adaptive_concurrency: bool,
    /// The adaptive limit never falls below this (nor above a replica's `max_concurrency`).
    pub adaptive_min_concurrency: u32,
    /// How much slower than its baseline a replica may answer before its limit falls.
    pub adaptive_tolerance: f64,
    /// Latency over the baseline that never counts as a queue, ms (a fast upstream's answers
    /// vary by more than `adaptive_tolerance` × with the gateway host's own load).
    pub adaptive_slack_ms: u64,
    /// How often each replica's unloaded latency is measured afresh, ms: its limit drops to
    /// `adaptive_min_concurrency` until 8 requests sent since are answered (the first answer
    /// a replica gives starts one too).
    pub adaptive_probe_interval_ms: u64,
    /// Idle pooled connections kept per upstream host.
    pub pool_max_idle_per_host: usize,
    /// What to do with an upstream stream whose client disconnected.
    pub on_client_disconnect: DisconnectPolicy,
    /// How a replica is chosen: prefix affinity (`affinity_weighted`, the default, or
    /// `affinity_gate`) so prompts sharing a prefix reach the replica whose KV cache holds it,
    /// or `least_loaded` (docs/benchmarks.md, "Prefix affinity", has the comparison).
    pub replica_choice: ReplicaChoice,
    /// Bytes of prompt text per prefix block the affinity memory hashes.
    pub affinity_block_bytes: usize,
    /// Blocks the affinity memory keeps per replica (near the server's KV-cache capacity: a
    /// longer memory claims prefixes the server already evicted).
    pub affinity_capacity_blocks: usize,
    /// How often replicas with a `metrics_url` are scraped, ms; a scrape older than three
    /// intervals no longer counts.
    pub scrape_interval_ms: u64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 2_000,
            first_byte_timeout_ms: 60_000,
            stream_first_byte_timeout_ms: 15_000,
            first_byte_budget_ms: 60_000,
            max_response_bytes: 32 * 1024 * 1024,
            idle_timeout_ms: 60_000,
            total_timeout_ms: 600_000,
            retries_same_tier: 1,
            fallback_to_other_tier: true,
            failure_threshold: 3,
            cooldown_ms: 10_000,
            error_ratio: 0.5,
            error_ratio_window_ms: 10_000,
            error_ratio_min_requests: 20,
            retry_budget_ratio: 0.2,
            retry_budget_min: 3,
            throttle_k: 2.0,
            throttle_window_ms: 60_000,
            throttle_min_requests: 20,
            fallback_max_share: 0.3,
            fallback_min: 10,
            fallback_window_ms: 60_000,
            queue_depth: 256,
            queue_wait_ms: 2_000,
            adaptive_concurrency: true,
            adaptive_min_concurrency: 4,
            adaptive_tolerance: 2.0,
            adaptive_slack_ms: 50,
            adaptive_probe_interval_ms: 60_000,
            pool_max_idle_per_host: 256,
            on_client_disconnect: DisconnectPolicy::Drain,
            replica_choice: ReplicaChoice::AffinityWeighted,
            affinity_block_bytes: 256,
            affinity_capacity_blocks: 65_536,
            scrape_interval_ms: 1_000,
        }
    }
}

impl UpstreamConfig {
    /// The replicas' metrics scrape interval.
    pub fn scrape_interval(&self) -> Duration {
        Duration::from_millis(self.scrape_interval_ms)
    }
    /// Connect timeout as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    /// One attempt's first-byte timeout as a duration (streamed or not).
    pub fn first_byte_timeout(&self, stream: bool) -> Duration {
        Duration::from_millis(if stream {
            self.stream_first_byte_timeout_ms
        } else {
            self.first_byte_timeout_ms
        })
    }
    /// The first-byte budget shared by a request's attempts, as a duration.
    pub fn first_byte_budget(&self) -> Duration {
        Duration::from_millis(self.first_byte_budget_ms)
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
