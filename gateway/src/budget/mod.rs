//! Per-tenant budgets and rate limits that hold under concurrency and across replicas.
//!
//! Policies (scope × calendar window × limit × action) and rate limits are stored with tenants
//! (SQL, [`crate::store::Store`]) and snapshotted on every replica. Counters live in a
//! [`BudgetStore`]: [`redis::RedisStore`] (shared by replicas; every check-and-reserve is one Lua
//! script, every key carries the tenant's `{hash tag}`) or [`memory::MemoryStore`] (embedded
//! default; rebuilt from the ledger at start). Both implement one contract and pass one
//! conformance suite (`tests/tests/budget_conformance.rs`).
//!
//! Enforcement is by reservation ([`engine::Budgets`]): before forwarding, reserve
//! `prompt estimate + max_tokens` (and its price) in every applicable budget in one atomic step,
//! clamping `max_tokens` to what is left; after the response, commit the actual tokens and cost
//! and release the rest. Reservations carry a TTL, so those of a gateway that died expire. The
//! overspend bound is the prompt-token estimation error of the requests in flight when a budget
//! runs out.
//!
//! With the shared store a replica leases room for many requests in one call and admits them
//! locally ([`lease`]), so Redis is off the per-request path except near a limit.

pub mod decision;
pub mod engine;
pub mod lease;
pub mod memory;
pub mod redis;

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub use crate::types::budget::{Action, BudgetPolicy, FailMode, Limit, RateLimit, Scope, Window};
pub use decision::{Admission, Refusal};
pub use engine::Budgets;

/// How one counter enforces its limit during a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// Admit only what fits under `limit`.
    Enforce,
    /// `downgrade`: if it does not fit under `limit`, answer [`Outcome::Downgrade`] (unless the
    /// request is already downgraded, in which case only `hard` applies).
    Downgrade,
    /// Count only; report when over `limit`.
    Count,
}

/// One budget counter touched by a reservation: a (policy, window) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterSpec {
    /// Store key, with the tenant's hash tag (see [`counter_key`]).
    pub key: String,
    /// Enforcement mode.
    pub mode: Mode,
    /// The limit.
    pub limit: Limit,
    /// For [`Mode::Downgrade`]: the hard cap.
    pub hard: Limit,
    /// When the counter may be forgotten (window end plus a day), ms since the epoch.
    pub expire_at_ms: i64,
}

/// Kind of a rate limiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateKind {
    /// Requests per minute: each request costs 1.
    Requests,
    /// Tokens per minute: each request costs its reserved tokens.
    Tokens,
}

/// One GCRA rate limiter touched by a reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateSpec {
    /// Store key, with the tenant's hash tag (see [`rate_key`]); shared, since each request's
    /// plan and reservation carry a copy.
    pub key: std::sync::Arc<str>,
    /// Units per minute (also the burst: one minute's worth).
    pub per_minute: u64,
    /// What a request costs.
    pub kind: RateKind,
}

/// A check-and-reserve request.
#[derive(Debug, Clone)]
pub struct ReserveRequest {
    /// Tenant id (every key carries its hash tag).
    pub tenant_id: String,
    /// Reservation id (the request id).
    pub rid: String,
    /// Now, ms since the epoch (from the engine's clock, so tests can move time).
    pub now_ms: i64,
    /// How long the reservation lives if never committed, ms.
    pub ttl_ms: i64,
    /// Estimated prompt tokens.
    pub prompt_tokens: u64,
    /// Price of the estimated prompt, micro-dollars.
    pub prompt_micros: i64,
    /// Price of one output token, micro-dollars (fractional).
    pub output_micros_per_token: f64,
    /// The `max_tokens` the client asked for (or the default).
    pub max_tokens: u64,
    /// The least `max_tokens` worth forwarding; below it the request is refused.
    pub min_tokens: u64,
    /// The request was already sent to the small tier by a `downgrade` budget.
    pub downgraded: bool,
    /// What a requests-per-minute limiter is charged: 1 for a request, more for a lease.
    pub units: u64,
    /// This reservation is a replica's lease (see [`CommitRequest::lease`]): counters also track
    /// it as lease-held (`CounterState::leased_*`), so a refusal can tell capacity that a lease
    /// will soon give back from capacity that is spent.
    pub lease: bool,
    /// For a request (not a lease): when a counter refuses it while leases hold part of its
    /// room, that counter takes no new lease for this long, ms (so the leases drain and a retry
    /// can fit). 0: never.
    pub lease_quiet_ms: i64,
    /// Budget counters, all of which must admit.
    pub counters: Vec<CounterSpec>,
    /// Rate limiters, all of which must admit.
    pub rates: Vec<RateSpec>,
    /// Refuse with [`Outcome::Unseeded`] when a counter was never seeded from the ledger: new
    /// (a window's first request), or lost with the store's data (a Redis restart without
    /// persistence). The engine then seeds it and asks again, so budgets survive such a loss.
    pub seeded_only: bool,
}

impl ReserveRequest {
    /// The counters it reserves on, as a commit names them: (key, expire_at_ms).
    pub fn counter_keys(&self) -> Vec<(String, i64)> {
        self.counters
            .iter()
            .map(|c| (c.key.clone(), c.expire_at_ms))
            .collect()
    }

    /// Micro-dollars reserved for a request granted `max_tokens` output tokens.
    pub fn micros_for(&self, max_tokens: u64) -> i64 {
        self.prompt_micros + (max_tokens as f64 * self.output_micros_per_token).ceil() as i64
    }
}

/// A counter's totals, micro-dollars and tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterState {
    /// Committed tokens.
    pub spent_tokens: u64,
    /// Committed micro-dollars.
    pub spent_micros: i64,
    /// Tokens held by live reservations.
    pub reserved_tokens: u64,
    /// Micro-dollars held by live reservations.
    pub reserved_micros: i64,
    /// Of `reserved_tokens`, what replicas' leases hold (admitted locally or given back soon).
    pub leased_tokens: u64,
    /// Of `reserved_micros`, what replicas' leases hold.
    pub leased_micros: i64,
}

impl CounterState {
    /// Tokens and micro-dollars `limit` has left after what is spent and reserved (`None` where
    /// that limit is not set).
    pub fn remaining(&self, limit: &Limit) -> (Option<u64>, Option<i64>) {
        (
            limit
                .tokens
                .map(|l| l.saturating_sub(self.spent_tokens + self.reserved_tokens)),
            limit
                .micros
                .map(|l| (l - self.spent_micros - self.reserved_micros).max(0)),
        )
    }
}

/// The result of a check-and-reserve.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Reserved; `max_tokens` is what was granted (≤ requested).
    Admitted {
        /// Granted `max_tokens`.
        max_tokens: u64,
        /// Each counter's state after the reservation, in request order.
        counters: Vec<CounterState>,
        /// Each rate limiter's room after the reservation (units it would still admit now), in
        /// request order.
        rate_room: Vec<u64>,
    },
    /// Counter `index` (an enforce counter, or a downgrade counter past its hard cap) cannot
    /// cover even `min_tokens`. Nothing was reserved.
    Rejected {
        /// Which counter.
        index: usize,
        /// Each counter's state (unchanged).
        counters: Vec<CounterState>,
    },
    /// Downgrade counter `index` is at its limit: retry on the small tier with `downgraded`.
    /// Nothing was reserved.
    Downgrade {
        /// Which counter.
        index: usize,
    },
    /// Counter `index` was not seeded from the ledger (see [`ReserveRequest::seeded_only`]).
    /// Nothing was reserved.
    Unseeded {
        /// Which counter.
        index: usize,
    },
    /// Rate limiter `index` is exhausted for now. Nothing was reserved.
    RateLimited {
        /// Which limiter.
        index: usize,
        /// When the request would fit, ms from now.
        retry_after_ms: i64,
    },
}

/// A commit of actual usage against an earlier reservation.
#[derive(Debug, Clone)]
pub struct CommitRequest {
    /// Tenant id.
    pub tenant_id: String,
    /// The reservation id.
    pub rid: String,
    /// Now, ms since the epoch.
    pub now_ms: i64,
    /// For an unreserved commit: how long it is remembered (so a retry applies once), ms.
    pub dedupe_ms: i64,
    /// The spend was admitted without a reservation in this store (locally, while the shared
    /// store was unreachable): add it to the counters, deduplicated by a marker. A reserved
    /// commit is deduplicated by its reservation instead and leaves nothing behind.
    pub unreserved: bool,
    /// Actual tokens (prompt + completion).
    pub tokens: u64,
    /// Actual cost, micro-dollars.
    pub micros: i64,
    /// The counters reserved on (key, expire_at_ms).
    pub counters: Vec<(String, i64)>,
    /// The rate limiters charged (key, per_minute, units to give back).
    pub refunds: Vec<(std::sync::Arc<str>, u64, u64)>,
    /// Set for a lease's settlement: `tokens`/`micros` are ignored and the totals here apply
    /// instead (see [`LeaseSync`]).
    pub lease: Option<LeaseSync>,
}

/// A lease's settlement with the shared store, in running totals since the lease began, so a
/// settlement replayed late or out of order changes nothing: the store keeps the totals it has
/// applied per lease and adds only what is new. `close` ends the lease: whatever it still
/// holds is released, the rate-limiter refunds apply, and later settlements of it are no-ops.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseSync {
    /// Tokens actually spent by requests the lease admitted (running total).
    pub spent_tokens: u64,
    /// Micro-dollars actually spent (running total).
    pub spent_micros: i64,
    /// Tokens of the hold given back: spent ones move to `spent`, unused ones return (running
    /// total).
    pub released_tokens: u64,
    /// Micro-dollars of the hold given back (running total).
    pub released_micros: i64,
    /// The lease is over.
    pub close: bool,
}

/// Budget store failures (the store is unreachable, slow, or answered nonsense).
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    /// Redis failed or is unreachable.
    #[error("budget store error: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// The store did not answer within `budgets.store_timeout_ms`.
    #[error("budget store timed out")]
    Timeout,
    /// The store failed moments ago and is skipped until its backoff ends.
    #[error("budget store unavailable (backing off after a failure)")]
    Unavailable,
    /// A reply could not be decoded.
    #[error("budget store protocol error: {0}")]
    Protocol(String),
}

/// Where counters and reservations live. Implementations must make `reserve` one atomic step
/// (no two concurrent reservations can both take the last of a budget) and `commit` idempotent
/// per reservation id.
#[async_trait]
pub trait BudgetStore: Send + Sync + 'static {
    /// Purge expired reservations of the counters involved, then check every counter and rate
    /// limiter and, only if all admit, reserve in all of them.
    async fn reserve(&self, req: &ReserveRequest) -> Result<Outcome, BudgetError>;
    /// Release the reservation `rid` and add the actual usage, once per `rid`: to each counter
    /// still holding the reservation, live or expired-but-uncommitted (or, for an `unreserved`
    /// commit, to every counter). Returns `false` when this `rid` was already committed.
    async fn commit(&self, req: &CommitRequest) -> Result<bool, BudgetError>;
    /// [`BudgetStore::commit`] for many requests at once (fewer round trips under load).
    async fn commit_batch(&self, reqs: &[CommitRequest]) -> Result<Vec<bool>, BudgetError> {
        let mut out = Vec::with_capacity(reqs.len());
        for r in reqs {
            out.push(self.commit(r).await?);
        }
        Ok(out)
    }
    /// Current state of counters (expired reservations purged), for `gatewayctl usage`.
    async fn peek(
        &self,
        tenant_id: &str,
        keys: &[String],
        now_ms: i64,
    ) -> Result<Vec<CounterState>, BudgetError>;
    /// Seed a counter from the ledger unless it is seeded already: its spent totals become the
    /// larger of what it holds (commits since its data was lost) and the ledger's, and it is
    /// marked seeded. Returns whether it was seeded now.
    async fn seed(
        &self,
        tenant_id: &str,
        key: &str,
        tokens: u64,
        micros: i64,
        expire_at_ms: i64,
    ) -> Result<bool, BudgetError>;
}

/// The key of a policy's counter for the window starting at `window_start`.
pub fn counter_key(tenant_id: &str, policy_id: &str, window_start: DateTime<Utc>) -> String {
    // Pushed piece by piece rather than by `format!` (per policy, per request).
    use std::fmt::Write as _;
    let mut key = String::with_capacity(tenant_id.len() + policy_id.len() + 32);
    key.push_str("gw:{");
    key.push_str(tenant_id);
    key.push_str("}:bud:");
    key.push_str(policy_id);
    key.push(':');
    let _ = write!(key, "{}", window_start.timestamp());
    key
}

/// The key marking a commit applied (an unreserved one) or a lease not yet closed.
pub fn marker_key(tenant_id: &str, rid: &str) -> String {
    format!("gw:{{{tenant_id}}}:done:{rid}")
}

/// The key of a rate limiter (`scope` is `tenant` or a key id).
pub fn rate_key(tenant_id: &str, scope: &str, kind: RateKind) -> String {
    let kind = match kind {
        RateKind::Requests => "rpm",
        RateKind::Tokens => "tpm",
    };
    format!("gw:{{{tenant_id}}}:rl:{scope}:{kind}")
}

/// The largest `max_tokens` (≤ `req.max_tokens`) that `limit` allows on top of `state`, or
/// `None` when not even the prompt fits. Shared by the in-process store; the Lua script
/// implements the same arithmetic.
pub fn fits(req: &ReserveRequest, state: &CounterState, limit: &Limit) -> Option<u64> {
    let mut m = req.max_tokens;
    if let Some(cap) = limit.tokens {
        let left = cap
            .checked_sub(state.spent_tokens + state.reserved_tokens)?
            .checked_sub(req.prompt_tokens)?;
        m = m.min(left);
    }
    if let Some(cap) = limit.micros {
        let left = cap - state.spent_micros - state.reserved_micros - req.prompt_micros;
        if left < 0 {
            return None;
        }
        if req.output_micros_per_token > 0.0 {
            let mut by_cost = (left as f64 / req.output_micros_per_token).floor() as u64;
            // Float rounding must never let the reservation exceed the cap.
            while by_cost > 0 && req.micros_for(by_cost) - req.prompt_micros > left {
                by_cost -= 1;
            }
            m = m.min(by_cost);
        }
    }
    Some(m)
}

/// Microseconds a GCRA limiter of `per_minute` units adds per unit.
pub fn emission_us(per_minute: u64) -> f64 {
    60_000_000.0 / per_minute.max(1) as f64
}

/// A source of wall-clock time; tests substitute a [`ManualClock`] to cross windows.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// Now.
    fn now(&self) -> DateTime<Utc>;

    /// Now, in milliseconds since the Unix epoch (what a hot path compares; no calendar).
    fn now_ms(&self) -> i64 {
        self.now().timestamp_millis()
    }
}

/// The system clock.
#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }

    fn now_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    }
}

/// A clock that moves only when told to.
#[derive(Debug)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    /// A clock stopped at `t`.
    pub fn at(t: DateTime<Utc>) -> Arc<Self> {
        Arc::new(Self(AtomicI64::new(t.timestamp_millis())))
    }

    /// Move forward by `d`.
    pub fn advance(&self, d: std::time::Duration) {
        self.0.fetch_add(
            i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
            Ordering::SeqCst,
        );
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(self.now_ms()).unwrap_or_default()
    }

    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s)
            .map(|d| d.with_timezone(&Utc))
            .unwrap_or_default()
    }

    #[test]
    fn a_counters_key_names_its_tenant_policy_and_window() {
        let start = t("2025-12-01T00:00:00Z");
        assert_eq!(
            counter_key("t-1", "pol_9", start),
            "gw:{t-1}:bud:pol_9:1764547200"
        );
        let before_the_epoch = t("1969-12-31T00:00:00Z");
        assert_eq!(
            counter_key("t", "p", before_the_epoch),
            "gw:{t}:bud:p:-86400"
        );
    }

    #[test]
    fn windows_are_calendar_windows_in_utc() {
        let now = t("2026-11-29T23:59:30.5Z"); // a Sunday
        assert_eq!(Window::Minute.start(now), t("2026-11-29T23:59:00Z"));
        assert_eq!(Window::Hour.start(now), t("2026-11-29T23:00:00Z"));
        assert_eq!(Window::Day.start(now), t("2026-11-29T00:00:00Z"));
        assert_eq!(Window::Week.start(now), t("2026-11-23T00:00:00Z"));
        assert_eq!(Window::Month.start(now), t("2026-11-01T00:00:00Z"));
        assert_eq!(
            Window::Month.end(t("2026-12-01T00:00:00Z")),
            t("2027-01-01T00:00:00Z")
        );
        assert_eq!(
            Window::Week.end(t("2026-11-23T00:00:00Z")),
            t("2026-11-30T00:00:00Z")
        );
        for w in Window::ALL {
            assert_eq!(Window::parse(w.as_str()), Some(w));
            let s = w.start(now);
            assert!(s <= now && now < w.end(s), "{w:?}");
        }
    }

    #[test]
    fn scopes_round_trip_and_match() {
        for s in ["tenant", "key:key_1", "tag:feature=search"] {
            let scope = Scope::parse(s).unwrap_or(Scope::Tenant);
            assert_eq!(scope.label(), s);
            let (k, v) = scope.to_columns();
            assert_eq!(Scope::from_columns(k, &v), Some(scope));
        }
        assert_eq!(Scope::parse("tag:feature"), None);
        let tags = [("feature".to_owned(), "search".to_owned())].into();
        assert!(Scope::parse("tag:feature=search").is_some_and(|s| s.matches("key_9", &tags)));
        assert!(!Scope::Key("key_1".into()).matches("key_9", &tags));
    }

    #[test]
    fn fits_clamps_to_the_tighter_of_tokens_and_dollars() {
        let req = ReserveRequest {
            tenant_id: "t".into(),
            rid: "r".into(),
            now_ms: 0,
            ttl_ms: 1,
            prompt_tokens: 100,
            prompt_micros: 100,
            output_micros_per_token: 2.5,
            max_tokens: 1000,
            min_tokens: 1,
            downgraded: false,
            units: 1,
            lease: false,
            lease_quiet_ms: 0,
            counters: vec![],
            rates: vec![],
            seeded_only: false,
        };
        let state = CounterState {
            spent_tokens: 600,
            ..Default::default()
        };
        let tokens = Limit {
            tokens: Some(1000),
            micros: None,
        };
        assert_eq!(fits(&req, &state, &tokens), Some(300));
        let dollars = Limit {
            tokens: None,
            micros: Some(1100),
        };
        // (1100 - 100) / 2.5 = 400 output tokens.
        assert_eq!(fits(&req, &CounterState::default(), &dollars), Some(400));
        assert_eq!(req.micros_for(400), 1100);
        let full = CounterState {
            spent_tokens: 950,
            ..Default::default()
        };
        assert_eq!(fits(&req, &full, &tokens), None);
    }
}
