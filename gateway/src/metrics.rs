//! Every Prometheus metric the gateway exports, defined once. Dashboards query these names; a
//! test checks each name a dashboard uses exists here.

use std::collections::HashMap;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use router::ReplicaSnapshot;

/// Metric names, for dashboards and tests.
pub mod names {
    /// Requests by tenant, model, tier and status.
    pub const REQUESTS: &str = "gateway_requests_total";
    /// Tokens by tenant, model and kind (prompt, completion, cached).
    pub const TOKENS: &str = "gateway_tokens_total";
    /// Request duration by tier and replica.
    pub const DURATION: &str = "gateway_request_duration_seconds";
    /// Time to first token by tier and replica.
    pub const TTFT: &str = "gateway_time_to_first_token_seconds";
    /// Upstream failures by replica and kind.
    pub const UPSTREAM_ERRORS: &str = "gateway_upstream_errors_total";
    /// Requests in flight per replica.
    pub const IN_FLIGHT: &str = "gateway_replica_in_flight";
    /// 1 when the replica is in rotation, 0 while cooling down.
    pub const HEALTHY: &str = "gateway_replica_healthy";
    /// Requests a replica may have in flight now: its adaptive limit (falling as its time to
    /// first token grows), or its `max_concurrency`.
    pub const CONCURRENCY_LIMIT: &str = "gateway_replica_concurrency_limit";
    /// Requests shed because a tier was at capacity, by tier and reason (`queue_full`: too many
    /// already waiting; `expected_wait`: those waiting would take longer than
    /// `upstream.queue_wait_ms` at the rate the tier frees slots; `queue_timeout`: no slot
    /// freed within `upstream.queue_wait_ms`).
    pub const SHED: &str = "gateway_shed_requests_total";
    /// Requests that fell back to the other tier, by tenant, the tier fallen back to and outcome
    /// (`answered`, or `over_share` when the tenant's share of fallback was spent).
    pub const FALLBACKS: &str = "gateway_fallbacks_total";
    /// Client retries recognised, by tenant and signal (sdk_header, idempotency_key).
    pub const CLIENT_RETRIES: &str = "gateway_client_retries_total";
    /// Requests the gateway turned away from a tier whose servers were rejecting (adaptive
    /// throttling), by tier.
    pub const UPSTREAM_THROTTLED: &str = "gateway_upstream_throttled_total";
    /// The gateway's own retries and failovers, by tier and outcome (`sent`, or
    /// `budget_exhausted` when the tier's retry budget refused one).
    pub const RETRIES: &str = "gateway_upstream_retries_total";
    /// Times a replica's circuit breaker opened, by tier, replica and reason
    /// (consecutive_failures, error_ratio, probe_failed).
    pub const BREAKER_TRIPS: &str = "gateway_replica_breaker_trips_total";
    /// Replica choices under prefix affinity, by tier, replica and reason (affinity,
    /// rendezvous, least-loaded, imbalanced).
    pub const REPLICA_CHOICES: &str = "gateway_replica_choices_total";
    /// Prompt prefix blocks sent to a replica under prefix affinity, by tier, replica and kind:
    /// `sent` (every block of the prompt) and `matched` (those the router had sent there
    /// before): matched / sent is the prefix hit rate the router aims for.
    pub const PREFIX_BLOCKS: &str = "gateway_prefix_blocks_total";
    /// Requests rejected before reaching an upstream, by error kind.
    pub const REJECTED: &str = "gateway_rejected_requests_total";
    /// Agent loops the guard step found, by the action taken (flag, throttle, block).
    pub const GUARD_LOOPS: &str = "gateway_guard_loops_total";
    /// USD micro-dollars of agent loops, by tenant and kind: `burned` (what flagged requests
    /// cost) and `avoided` (what refused ones would have cost, estimated).
    pub const GUARD_LOOP_COST: &str = "gateway_guard_loop_cost_micros_total";
    /// Store lookups of API keys missing from the snapshot, by outcome (found, unknown,
    /// cached_unknown, busy, error, skipped).
    pub const KEY_LOOKUPS: &str = "gateway_key_lookups_total";
    /// Ledger rows waiting in the in-memory queue.
    pub const LEDGER_QUEUE: &str = "gateway_ledger_queue_depth";
    /// Ledger rows waiting in the disk spool (database unreachable).
    pub const LEDGER_SPOOLED: &str = "gateway_ledger_spooled_rows";
    /// Ledger rows by outcome (written, spooled, replayed, overflow_spooled, lost).
    pub const LEDGER_ROWS: &str = "gateway_ledger_rows_total";
    /// Ledger batch write latency.
    pub const LEDGER_WRITE: &str = "gateway_ledger_write_seconds";

    /// Budget decisions by tenant and outcome (admitted, clamped, downgraded, flagged, rejected,
    /// rate_limited, store_unavailable).
    pub const BUDGET_DECISIONS: &str = "gateway_budget_decisions_total";
    /// Budget store calls that failed or were skipped (store unreachable), by the tenant's fail
    /// mode (`closed` answered 503, `open` admitted locally).
    pub const BUDGET_STORE_ERRORS: &str = "gateway_budget_store_errors_total";
    /// Budget store call latency by operation (reserve, commit).
    pub const BUDGET_STORE_SECONDS: &str = "gateway_budget_store_seconds";
    /// Budget commits waiting for the shared store to come back.
    pub const BUDGET_BACKLOG: &str = "gateway_budget_commit_backlog";
    /// Leases taken in the shared budget store (each admits many requests locally).
    pub const BUDGET_LEASES: &str = "gateway_budget_leases_total";
    /// Leases of this replica not yet closed.
    pub const BUDGET_LEASES_LIVE: &str = "gateway_budget_leases_live";

    /// Cache lookups by layer (exact, shared, semantic) and result (hit, miss, skipped, error;
    /// `gated`: a semantic miss decided by the first stage, without an embedding).
    pub const CACHE_LOOKUPS: &str = "gateway_cache_lookups_total";
    /// USD micro-dollars cache hits saved, by tenant.
    pub const CACHE_SAVED: &str = "gateway_cache_saved_micros_total";
    /// Responses held by the exact layer.
    pub const CACHE_ENTRIES: &str = "gateway_cache_entries";
    /// Bytes held by the exact layer.
    pub const CACHE_BYTES: &str = "gateway_cache_bytes";
    /// 1 once the semantic layer (model, static table, verifier) is loaded.
    pub const CACHE_SEMANTIC_READY: &str = "gateway_cache_semantic_ready";
    /// Semantic lookup latency (queue, embedding, search, verification).
    pub const CACHE_SEMANTIC_SECONDS: &str = "gateway_cache_semantic_seconds";
    /// Fresh answers' questions handed to the semantic index, by result: `indexed`, `dropped`
    /// (`cache.semantic.max_queue` answers were already waiting) or `failed` (their embedding
    /// failed).
    pub const CACHE_SEMANTIC_ANSWERS: &str = "gateway_cache_semantic_answers_total";
    /// 1, labelled with where the loaded semantic layer's model runs (`device`: `cpu`, `cuda`)
    /// and how it keeps its matrices (`precision`: `f16`, `f32`, `int8`).
    pub const CACHE_SEMANTIC_MODEL: &str = "gateway_cache_semantic_model_info";

    /// Every name above.
    pub const ALL: &[&str] = &[
        REQUESTS,
        TOKENS,
        DURATION,
        TTFT,
        UPSTREAM_ERRORS,
        IN_FLIGHT,
        HEALTHY,
        CONCURRENCY_LIMIT,
        BREAKER_TRIPS,
        REPLICA_CHOICES,
        PREFIX_BLOCKS,
        UPSTREAM_THROTTLED,
        RETRIES,
        CLIENT_RETRIES,
        FALLBACKS,
        SHED,
        REJECTED,
        KEY_LOOKUPS,
        GUARD_LOOPS,
        GUARD_LOOP_COST,
        LEDGER_QUEUE,
        LEDGER_SPOOLED,
        LEDGER_ROWS,
        LEDGER_WRITE,
        BUDGET_DECISIONS,
        BUDGET_STORE_ERRORS,
        BUDGET_STORE_SECONDS,
        BUDGET_BACKLOG,
        BUDGET_LEASES,
        BUDGET_LEASES_LIVE,
        CACHE_LOOKUPS,
        CACHE_SAVED,
        CACHE_ENTRIES,
        CACHE_BYTES,
        CACHE_SEMANTIC_READY,
        CACHE_SEMANTIC_SECONDS,
        CACHE_SEMANTIC_ANSWERS,
        CACHE_SEMANTIC_MODEL,
    ];
}

/// The gateway's metrics, registered in their own registry (one per app instance).
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// See [`names::REQUESTS`].
    pub requests: IntCounterVec,
    /// See [`names::TOKENS`].
    pub tokens: IntCounterVec,
    /// See [`names::DURATION`].
    pub duration: HistogramVec,
    /// See [`names::TTFT`].
    pub ttft: HistogramVec,
    /// See [`names::UPSTREAM_ERRORS`].
    pub upstream_errors: IntCounterVec,
    /// See [`names::IN_FLIGHT`].
    pub in_flight: IntGaugeVec,
    /// See [`names::CONCURRENCY_LIMIT`].
    pub concurrency_limit: IntGaugeVec,
    /// See [`names::HEALTHY`].
    pub healthy: IntGaugeVec,
    /// See [`names::BREAKER_TRIPS`].
    pub breaker_trips: IntCounterVec,
    /// See [`names::REPLICA_CHOICES`].
    pub replica_choices: IntCounterVec,
    /// See [`names::PREFIX_BLOCKS`].
    pub prefix_blocks: IntCounterVec,
    /// See [`names::CLIENT_RETRIES`].
    pub client_retries: IntCounterVec,
    /// See [`names::FALLBACKS`].
    pub fallbacks: IntCounterVec,
    /// See [`names::SHED`].
    pub shed: IntCounterVec,
    /// See [`names::UPSTREAM_THROTTLED`].
    pub upstream_throttled: IntCounterVec,
    /// See [`names::RETRIES`].
    pub retries: IntCounterVec,
    /// See [`names::REJECTED`].
    pub rejected: IntCounterVec,
    /// See [`names::KEY_LOOKUPS`].
    pub key_lookups: IntCounterVec,
    /// See [`names::GUARD_LOOPS`].
    pub guard_loops: IntCounterVec,
    /// See [`names::GUARD_LOOP_COST`].
    pub guard_loop_cost: IntCounterVec,
    /// See [`names::LEDGER_QUEUE`].
    pub ledger_queue: IntGauge,
    /// See [`names::LEDGER_SPOOLED`].
    pub ledger_spooled: IntGauge,
    /// See [`names::LEDGER_ROWS`].
    pub ledger_rows: IntCounterVec,
    /// See [`names::LEDGER_WRITE`].
    pub ledger_write: Histogram,
    /// See [`names::BUDGET_DECISIONS`].
    pub budget_decisions: IntCounterVec,
    /// See [`names::BUDGET_STORE_ERRORS`].
    pub budget_store_errors: IntCounterVec,
    /// See [`names::BUDGET_STORE_SECONDS`].
    pub budget_store_seconds: HistogramVec,
    /// See [`names::BUDGET_BACKLOG`].
    pub budget_backlog: IntGauge,
    /// See [`names::BUDGET_LEASES`].
    pub budget_leases: IntCounter,
    /// See [`names::BUDGET_LEASES_LIVE`].
    pub budget_leases_live: IntGauge,
    /// See [`names::CACHE_LOOKUPS`].
    pub cache_lookups: IntCounterVec,
    /// See [`names::CACHE_SAVED`].
    pub cache_saved: IntCounterVec,
    /// See [`names::CACHE_ENTRIES`].
    pub cache_entries: IntGauge,
    /// See [`names::CACHE_BYTES`].
    pub cache_bytes: IntGauge,
    /// See [`names::CACHE_SEMANTIC_READY`].
    pub cache_semantic_ready: IntGauge,
    /// See [`names::CACHE_SEMANTIC_SECONDS`].
    pub cache_semantic_seconds: Histogram,
    /// See [`names::CACHE_SEMANTIC_ANSWERS`].
    pub cache_semantic_answers: IntCounterVec,
    /// See [`names::CACHE_SEMANTIC_MODEL`].
    pub cache_semantic_model: IntGaugeVec,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

impl Metrics {
    /// Create and register every metric.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                names::REQUESTS,
                "Requests by tenant, model, tier and status.",
            ),
            &["tenant", "model", "tier", "status"],
        )?;
        let tokens = IntCounterVec::new(
            Opts::new(names::TOKENS, "Tokens by tenant, model and kind."),
            &["tenant", "model", "kind"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(names::DURATION, "Request duration to the last byte.")
                .buckets(LATENCY_BUCKETS.to_vec()),
            &["tier", "replica"],
        )?;
        let ttft = HistogramVec::new(
            HistogramOpts::new(names::TTFT, "Time to first token (first streamed event).")
                .buckets(LATENCY_BUCKETS.to_vec()),
            &["tier", "replica"],
        )?;
        let upstream_errors = IntCounterVec::new(
            Opts::new(
                names::UPSTREAM_ERRORS,
                "Upstream failures by replica and kind.",
            ),
            &["replica", "kind"],
        )?;
        let in_flight = IntGaugeVec::new(
            Opts::new(names::IN_FLIGHT, "Requests in flight per replica."),
            &["tier", "replica"],
        )?;
        let healthy = IntGaugeVec::new(
            Opts::new(names::HEALTHY, "1 when the replica is in rotation."),
            &["tier", "replica"],
        )?;
        let concurrency_limit = IntGaugeVec::new(
            Opts::new(
                names::CONCURRENCY_LIMIT,
                "Requests a replica may have in flight now (adaptive, at most max_concurrency).",
            ),
            &["tier", "replica"],
        )?;
        let rejected = IntCounterVec::new(
            Opts::new(
                names::REJECTED,
                "Requests answered with an error before any upstream call.",
            ),
            &["kind"],
        )?;
        let key_lookups = IntCounterVec::new(
            Opts::new(
                names::KEY_LOOKUPS,
                "Store lookups of API keys missing from the key snapshot, by outcome.",
            ),
            &["outcome"],
        )?;
        for outcome in [
            "found",
            "unknown",
            "cached_unknown",
            "busy",
            "error",
            "skipped",
        ] {
            key_lookups.with_label_values(&[outcome]);
        }
        let guard_loops = IntCounterVec::new(
            Opts::new(
                names::GUARD_LOOPS,
                "Agent loops found on the request path, by the action taken.",
            ),
            &["action"],
        )?;
        for action in ["flag", "throttle", "block"] {
            guard_loops.with_label_values(&[action]);
        }
        let ledger_queue = IntGauge::new(names::LEDGER_QUEUE, "Ledger rows queued in memory.")?;
        let ledger_spooled = IntGauge::new(
            names::LEDGER_SPOOLED,
            "Ledger rows waiting in the disk spool.",
        )?;
        let ledger_rows = IntCounterVec::new(
            Opts::new(names::LEDGER_ROWS, "Ledger rows by outcome."),
            &["outcome"],
        )?;
        let ledger_write = Histogram::with_opts(
            HistogramOpts::new(names::LEDGER_WRITE, "Ledger batch write latency.").buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ]),
        )?;
        // Export every outcome from the start, so rates and alerts see zeros, not gaps.
        for outcome in ["written", "spooled", "replayed", "overflow_spooled", "lost"] {
            ledger_rows.with_label_values(&[outcome]);
        }
        let budget_decisions = IntCounterVec::new(
            Opts::new(
                names::BUDGET_DECISIONS,
                "Budget decisions by tenant and outcome.",
            ),
            &["tenant", "outcome"],
        )?;
        let budget_store_errors = IntCounterVec::new(
            Opts::new(
                names::BUDGET_STORE_ERRORS,
                "Budget store failures by the tenant's fail mode.",
            ),
            &["mode"],
        )?;
        for mode in ["closed", "open"] {
            budget_store_errors.with_label_values(&[mode]);
        }
        let budget_store_seconds = HistogramVec::new(
            HistogramOpts::new(names::BUDGET_STORE_SECONDS, "Budget store call latency.").buckets(
                vec![
                    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                ],
            ),
            &["op"],
        )?;
        for op in ["reserve", "commit"] {
            budget_store_seconds.with_label_values(&[op]);
        }
        let budget_backlog = IntGauge::new(
            names::BUDGET_BACKLOG,
            "Budget commits waiting for the shared store.",
        )?;
        let budget_leases = IntCounter::new(
            names::BUDGET_LEASES,
            "Leases taken in the shared budget store (each admits many requests locally).",
        )?;
        let budget_leases_live = IntGauge::new(
            names::BUDGET_LEASES_LIVE,
            "Budget leases of this replica not yet closed.",
        )?;
        let cache_lookups = IntCounterVec::new(
            Opts::new(names::CACHE_LOOKUPS, "Cache lookups by layer and result."),
            &["layer", "result"],
        )?;
        for (layer, result) in [
            ("exact", "hit"),
            ("exact", "miss"),
            ("semantic", "hit"),
            ("semantic", "miss"),
            ("semantic", "gated"),
            ("semantic", "skipped"),
        ] {
            cache_lookups.with_label_values(&[layer, result]);
        }
        let guard_loop_cost = IntCounterVec::new(
            Opts::new(
                names::GUARD_LOOP_COST,
                "USD micro-dollars of agent loops: burned (flagged and answered) and avoided \
                 (refused, estimated), by tenant.",
            ),
            &["tenant", "kind"],
        )?;
        let cache_saved = IntCounterVec::new(
            Opts::new(
                names::CACHE_SAVED,
                "USD micro-dollars saved by cache hits, by tenant.",
            ),
            &["tenant"],
        )?;
        let cache_entries = IntGauge::new(names::CACHE_ENTRIES, "Responses in the exact cache.")?;
        let cache_bytes = IntGauge::new(names::CACHE_BYTES, "Bytes held by the exact cache.")?;
        let cache_semantic_ready = IntGauge::new(
            names::CACHE_SEMANTIC_READY,
            "1 once the semantic cache layer is loaded.",
        )?;
        let cache_semantic_seconds = Histogram::with_opts(
            HistogramOpts::new(names::CACHE_SEMANTIC_SECONDS, "Semantic lookup latency.").buckets(
                vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0],
            ),
        )?;
        registry.register(Box::new(cache_lookups.clone()))?;
        registry.register(Box::new(cache_saved.clone()))?;
        registry.register(Box::new(cache_entries.clone()))?;
        registry.register(Box::new(cache_bytes.clone()))?;
        registry.register(Box::new(cache_semantic_ready.clone()))?;
        registry.register(Box::new(cache_semantic_seconds.clone()))?;
        let cache_semantic_answers = IntCounterVec::new(
            Opts::new(
                names::CACHE_SEMANTIC_ANSWERS,
                "Fresh answers' questions handed to the semantic index: indexed, dropped (its \
                 queue was full) or failed.",
            ),
            &["result"],
        )?;
        for result in ["indexed", "dropped", "failed"] {
            cache_semantic_answers.with_label_values(&[result]);
        }
        registry.register(Box::new(cache_semantic_answers.clone()))?;
        let cache_semantic_model = IntGaugeVec::new(
            Opts::new(
                names::CACHE_SEMANTIC_MODEL,
                "1 for the loaded semantic layer's model: its device and matrix precision.",
            ),
            &["device", "precision"],
        )?;
        registry.register(Box::new(cache_semantic_model.clone()))?;
        registry.register(Box::new(budget_decisions.clone()))?;
        registry.register(Box::new(budget_store_errors.clone()))?;
        registry.register(Box::new(budget_store_seconds.clone()))?;
        registry.register(Box::new(budget_backlog.clone()))?;
        registry.register(Box::new(budget_leases.clone()))?;
        registry.register(Box::new(budget_leases_live.clone()))?;
        registry.register(Box::new(ledger_queue.clone()))?;
        registry.register(Box::new(ledger_spooled.clone()))?;
        registry.register(Box::new(ledger_rows.clone()))?;
        registry.register(Box::new(ledger_write.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(tokens.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(upstream_errors.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(healthy.clone()))?;
        registry.register(Box::new(concurrency_limit.clone()))?;
        let breaker_trips = IntCounterVec::new(
            Opts::new(
                names::BREAKER_TRIPS,
                "Times a replica's circuit breaker opened, by reason.",
            ),
            &["tier", "replica", "reason"],
        )?;
        registry.register(Box::new(breaker_trips.clone()))?;
        let replica_choices = IntCounterVec::new(
            Opts::new(
                names::REPLICA_CHOICES,
                "Replica choices under prefix affinity, by reason.",
            ),
            &["tier", "replica", "reason"],
        )?;
        registry.register(Box::new(replica_choices.clone()))?;
        let prefix_blocks = IntCounterVec::new(
            Opts::new(
                names::PREFIX_BLOCKS,
                "Prompt prefix blocks sent to a replica under prefix affinity (sent, matched).",
            ),
            &["tier", "replica", "kind"],
        )?;
        registry.register(Box::new(prefix_blocks.clone()))?;
        let upstream_throttled = IntCounterVec::new(
            Opts::new(
                names::UPSTREAM_THROTTLED,
                "Requests turned away by adaptive throttling, by tier.",
            ),
            &["tier"],
        )?;
        registry.register(Box::new(upstream_throttled.clone()))?;
        let retries = IntCounterVec::new(
            Opts::new(
                names::RETRIES,
                "The gateway's own retries and failovers, by tier and outcome.",
            ),
            &["tier", "outcome"],
        )?;
        registry.register(Box::new(retries.clone()))?;
        let client_retries = IntCounterVec::new(
            Opts::new(
                names::CLIENT_RETRIES,
                "Client retries recognised, by tenant and signal.",
            ),
            &["tenant", "signal"],
        )?;
        registry.register(Box::new(client_retries.clone()))?;
        let fallbacks = IntCounterVec::new(
            Opts::new(
                names::FALLBACKS,
                "Requests that fell back to the other tier, by tenant, tier and outcome.",
            ),
            &["tenant", "tier", "outcome"],
        )?;
        registry.register(Box::new(fallbacks.clone()))?;
        let shed = IntCounterVec::new(
            Opts::new(
                names::SHED,
                "Requests shed because a tier was at capacity, by tier and reason.",
            ),
            &["tier", "reason"],
        )?;
        registry.register(Box::new(shed.clone()))?;
        registry.register(Box::new(rejected.clone()))?;
        registry.register(Box::new(key_lookups.clone()))?;
        registry.register(Box::new(guard_loops.clone()))?;
        registry.register(Box::new(guard_loop_cost.clone()))?;
        Ok(Self {
            registry,
            requests,
            tokens,
            duration,
            ttft,
            upstream_errors,
            in_flight,
            healthy,
            concurrency_limit,
            breaker_trips,
            replica_choices,
            prefix_blocks,
            upstream_throttled,
            retries,
            client_retries,
            fallbacks,
            shed,
            rejected,
            key_lookups,
            guard_loops,
            guard_loop_cost,
            ledger_queue,
            ledger_spooled,
            ledger_rows,
            ledger_write,
            budget_decisions,
            budget_store_errors,
            budget_store_seconds,
            budget_backlog,
            budget_leases,
            budget_leases_live,
            cache_lookups,
            cache_saved,
            cache_entries,
            cache_bytes,
            cache_semantic_ready,
            cache_semantic_seconds,
            cache_semantic_answers,
            cache_semantic_model,
        })
    }

    /// Drop every series of tenant `name` (a deleted tenant: its counters would otherwise stay
    /// in `/metrics` until the process restarts).
    pub fn forget_tenant(&self, name: &str) {
        use prometheus::core::Collector as _;
        for vec in [
            &self.requests,
            &self.tokens,
            &self.budget_decisions,
            &self.cache_saved,
            &self.guard_loop_cost,
            &self.client_retries,
            &self.fallbacks,
        ] {
            for family in vec.collect() {
                for m in family.get_metric() {
                    let labels: HashMap<&str, &str> = m
                        .get_label()
                        .iter()
                        .map(|l| (l.name(), l.value()))
                        .collect();
                    if labels.get("tenant") == Some(&name) {
                        let _ = vec.remove(&labels);
                    }
                }
            }
        }
    }

    /// Prometheus text exposition, with the replica gauges set from `replicas` (a snapshot of
    /// the replica sets by tier, taken by the caller).
    pub fn render(&self, replicas: &[(String, Vec<ReplicaSnapshot>)]) -> String {
        for (tier, snapshot) in replicas {
            self.upstream_throttled.with_label_values(&[tier.as_str()]);
            for reason in ["queue_full", "queue_timeout", "expected_wait"] {
                self.shed.with_label_values(&[tier.as_str(), reason]);
            }
            for outcome in ["sent", "budget_exhausted"] {
                self.retries.with_label_values(&[tier.as_str(), outcome]);
            }
            for r in snapshot {
                self.in_flight
                    .with_label_values(&[tier.as_str(), r.name.as_str()])
                    .set(i64::from(r.in_flight));
                self.healthy
                    .with_label_values(&[tier.as_str(), r.name.as_str()])
                    .set(i64::from(r.healthy));
                self.concurrency_limit
                    .with_label_values(&[tier.as_str(), r.name.as_str()])
                    .set(i64::from(r.limit));
                // Every replica's trip counters exist from the start (at 0), so a rate over them
                // is defined before the first trip.
                for trip in router::Trip::ALL {
                    self.breaker_trips.with_label_values(&[
                        tier.as_str(),
                        r.name.as_str(),
                        trip.as_str(),
                    ]);
                }
                for reason in router::AffinityReason::ALL {
                    self.replica_choices.with_label_values(&[
                        tier.as_str(),
                        r.name.as_str(),
                        reason.as_str(),
                    ]);
                }
                for kind in ["sent", "matched"] {
                    self.prefix_blocks
                        .with_label_values(&[tier.as_str(), r.name.as_str(), kind]);
                }
            }
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(error = %e, "metrics encoding failed");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}
