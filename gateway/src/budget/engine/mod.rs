//! [`Budgets`]: the budget step of the request pipeline. It keeps this replica's snapshot of
//! policies and rate limits, turns a request into one [`ReserveRequest`], maps the outcome to an
//! [`Admission`] or a [`Refusal`] (`admission`), and commits actual usage after the response
//! (`commit`); `usage` reads what each budget has left.
//!
//! While the shared store is unreachable a tenant fails closed (503) or open (a local
//! [`MemoryStore`] enforcing `budgets.fail_open_share` of every limit on this replica). Commits
//! that could not reach the shared store — including the spend of requests admitted locally —
//! are queued and replayed when it is back (commits are idempotent per request id), so no
//! reservation dangles and no spend is lost.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use chrono::{DateTime, Utc};
use tokio::sync::mpsc;

use super::decision::{Admission, Exhausted, Refusal, Tightest, Warning};
use super::lease::{Lease, Leases, Need};
use super::memory::MemoryStore;
use super::{
    counter_key, rate_key, Action, BudgetError, BudgetPolicy, BudgetStore, Clock, CommitRequest,
    CounterSpec, CounterState, FailMode, Limit, Mode, Outcome, RateKind, RateLimit, RateSpec,
    ReserveRequest,
};
use crate::config::{BudgetConfig, BudgetStoreKind};
use crate::ledger::LedgerStore;
use crate::metrics::Metrics;
use crate::store::{ApiKey, Store, StoreError};
use crate::tasks::Background;
use crate::FastMap;
use tokio_util::sync::CancellationToken;

/// How long a counter outlives its window (so `gatewayctl usage` can still read a window that
/// just ended), ms.
const COUNTER_GRACE_MS: i64 = 86_400_000;
/// After a shared-store failure, skip it for this long before trying again, ms.
const STORE_BACKOFF_MS: i64 = 1_000;
/// How long a reseed of one (policy, window) stands in for another one, ms.
const RESEED_MEMORY_MS: i64 = 1_000;
/// Most commits held for replay while the shared store is unreachable.
const MAX_BACKLOG: usize = 1_000_000;
/// Most commits sent to the shared store in one batch.
const COMMIT_BATCH: usize = 256;

/// Every tenant's rules, as of the last refresh.
#[derive(Debug, Default)]
struct Snapshot {
    policies: FastMap<String, Vec<Arc<BudgetPolicy>>>,
    /// Each rate limit with its limiters (their store keys made once, not per request).
    rates: FastMap<String, Vec<RateRule>>,
    fail_modes: FastMap<String, FailMode>,
}

/// A rate limit and its limiters (one per kind it limits).
type RateRule = (Arc<RateLimit>, Vec<RateSpec>);

/// The rules that apply to one request, found without any I/O.
#[derive(Debug)]
pub struct Plan {
    tenant_id: String,
    tenant_name: String,
    policies: Vec<Arc<BudgetPolicy>>,
    rates: Vec<(RateSpec, Arc<RateLimit>)>,
    fail_mode: FailMode,
}

impl Plan {
    /// Only the plan's request-rate limits (`None` when it has none): what a request refused
    /// before admission (unparsable, unknown model) is still counted against, so such requests
    /// cannot be sent without limit.
    pub fn requests_only(mut self) -> Option<Plan> {
        self.policies.clear();
        self.rates.retain(|(r, _)| r.kind == RateKind::Requests);
        (!self.rates.is_empty()).then_some(self)
    }

    /// Whether anything may lower `max_tokens` (so the forwarded request must carry one).
    pub fn bounds_output(&self) -> bool {
        self.policies.iter().any(|p| p.action != Action::Flag)
            || self.rates.iter().any(|(r, _)| r.kind == RateKind::Tokens)
    }
}

/// Prices (micro-dollars per 1M tokens) the reservation is made at.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReservePrice {
    /// Input tokens.
    pub input: i64,
    /// Output tokens.
    pub output: i64,
}

/// What the pipeline knows about a request when it asks for admission.
#[derive(Debug, Clone)]
pub struct AdmitInput {
    /// Request id (the reservation id).
    pub rid: String,
    /// Estimated prompt tokens.
    pub prompt_tokens: u64,
    /// The client's `max_tokens`, if any.
    pub max_tokens: Option<u64>,
    /// Whether the endpoint generates tokens (not embeddings).
    pub generates: bool,
    /// Completions generated per request (`n`, `best_of`): each may use `max_tokens`.
    pub choices: u64,
    /// Price at the primary tier.
    pub price: ReservePrice,
    /// Price at the small tier (for a `downgrade`).
    pub small_price: ReservePrice,
    /// The primary tier is already the small tier.
    pub primary_is_small: bool,
}

/// A live reservation, to be committed after the response.
#[derive(Debug, Clone)]
pub struct Reservation {
    tenant_id: String,
    rid: String,
    counters: Vec<(String, i64)>,
    token_rates: Vec<(std::sync::Arc<str>, u64)>,
    reserved_tokens: u64,
    /// Made in the local fail-open store (the shared one was unreachable).
    local: bool,
    /// Admitted from this replica's lease (settled with it, not committed on its own).
    lease: Option<(Arc<Lease>, Need)>,
}

/// The budget engine of one replica.
pub struct Budgets {
    config: BudgetConfig,
    store: Arc<dyn BudgetStore>,
    /// The shared store is Redis (so a local fallback and a replay backlog exist).
    shared: bool,
    local: MemoryStore,
    rules: Arc<dyn Store>,
    ledger: Option<Arc<dyn LedgerStore>>,
    clock: Arc<dyn Clock>,
    metrics: Metrics,
    snapshot: ArcSwap<Snapshot>,
    seeded: Mutex<HashSet<(String, i64)>>,
    down_until_ms: AtomicI64,
    backlog: Mutex<VecDeque<CommitRequest>>,
    ttl_ms: i64,
    /// Commits on their way to the shared store, sent in batches by [`Budgets::run_commits`].
    commits: mpsc::UnboundedSender<CommitRequest>,
    commits_rx: Mutex<Option<mpsc::UnboundedReceiver<CommitRequest>>>,
    /// Commits sent and not yet answered (for [`Budgets::flush`]).
    pending: AtomicUsize,
    /// Serialises [`Budgets::refresh`].
    refreshing: tokio::sync::Mutex<()>,
    /// Serialises reseeds of counters the store reports unseeded, and remembers when each
    /// (policy, window start) was last reseeded, so a burst of requests costs one ledger query.
    reseeding: tokio::sync::Mutex<HashMap<(String, i64), i64>>,
    /// Leases in the shared store (`None`: every request reserves on its own).
    leases: Option<Leases>,
    /// Budget pressure as this replica last saw it: each `downgrade` counter's key → the share
    /// of its limit used (spent and reserved) after the latest admission against it, leased or
    /// reserved, and when the counter expires (ms). Read by [`Budgets::pressure`] with no I/O.
    pressure: Mutex<FastMap<String, (f64, i64)>>,
}

impl std::fmt::Debug for Budgets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Budgets")
            .field("store", &self.config.store)
            .finish_non_exhaustive()
    }
}

fn ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

mod admission;
mod commit;
mod usage;

pub use usage::UsageRow;

impl Budgets {
    /// Build the engine: open the configured store, load the rules and (for policies whose
    /// current window has no counter yet) seed spend from the ledger, so a restart of the
    /// embedded default does not reset a budget.
    pub async fn new(
        config: BudgetConfig,
        total_timeout: Duration,
        rules: Arc<dyn Store>,
        ledger: Option<Arc<dyn LedgerStore>>,
        clock: Arc<dyn Clock>,
        metrics: Metrics,
        store: Option<Arc<dyn BudgetStore>>,
    ) -> anyhow::Result<Self> {
        let (store, shared): (Arc<dyn BudgetStore>, bool) = match (store, config.store) {
            (Some(s), kind) => (s, kind == BudgetStoreKind::Redis),
            (None, BudgetStoreKind::Memory) => (Arc::new(MemoryStore::new()), false),
            (None, BudgetStoreKind::Redis) => (
                Arc::new(super::redis::RedisStore::new(
                    config.redis_urls.clone(),
                    Duration::from_millis(config.store_timeout_ms),
                )?),
                true,
            ),
        };
        let ttl_ms = config.reservation_ttl_secs.map_or_else(
            || i64::try_from(total_timeout.as_millis()).unwrap_or(i64::MAX / 2) + 30_000,
            |s| i64::try_from(s).unwrap_or(i64::MAX / 2_000) * 1000,
        );
        let (commits, commits_rx) = mpsc::unbounded_channel();
        let leases = (shared && config.lease_requests > 0)
            .then(|| Leases::new(config.lease_requests, config.lease_ms));
        let budgets = Self {
            leases,
            commits,
            commits_rx: Mutex::new(Some(commits_rx)),
            pending: AtomicUsize::new(0),
            refreshing: tokio::sync::Mutex::new(()),
            reseeding: tokio::sync::Mutex::new(HashMap::new()),
            config,
            store,
            shared,
            local: MemoryStore::new(),
            rules,
            ledger,
            clock,
            metrics,
            snapshot: ArcSwap::from_pointee(Snapshot::default()),
            seeded: Mutex::new(HashSet::new()),
            down_until_ms: AtomicI64::new(0),
            backlog: Mutex::new(VecDeque::new()),
            ttl_ms,
            pressure: Mutex::new(FastMap::default()),
        };
        budgets.refresh().await?;
        Ok(budgets)
    }

    /// Reload policies, rate limits and fail modes; seed counters of policies seen for the
    /// first time. A policy change reaches this replica within one refresh.
    pub async fn refresh(&self) -> Result<(), StoreError> {
        // One refresh at a time: otherwise a slow periodic refresh that read the rules before an
        // admin change could store its stale snapshot after the admin's fresh one.
        let _serial = self.refreshing.lock().await;
        let policies = self.rules.list_budgets(None).await?;
        let rates = self.rules.list_rate_limits(None).await?;
        let modes = self.rules.list_fail_modes().await?;
        let mut snap = Snapshot::default();
        for p in policies {
            snap.policies
                .entry(p.tenant_id.clone())
                .or_default()
                .push(Arc::new(p));
        }
        for r in rates {
            let scope = r.key_id.as_deref().unwrap_or("tenant");
            let specs = [(RateKind::Requests, r.rpm), (RateKind::Tokens, r.tpm)]
                .into_iter()
                .filter_map(|(kind, per_minute)| {
                    Some(RateSpec {
                        key: rate_key(&r.tenant_id, scope, kind).into(),
                        per_minute: per_minute?,
                        kind,
                    })
                })
                .collect();
            snap.rates
                .entry(r.tenant_id.clone())
                .or_default()
                .push((Arc::new(r), specs));
        }
        snap.fail_modes = modes.into_iter().collect();
        let now_ms = ms(self.clock.now());
        self.pressure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, (_, expire_at_ms)| *expire_at_ms > now_ms);
        let fresh: Vec<BudgetPolicy> = {
            let now = self.clock.now();
            let seeded = self.seeded.lock().unwrap_or_else(|e| e.into_inner());
            snap.policies
                .values()
                .flatten()
                .filter(|p| !seeded.contains(&(p.id.clone(), ms(p.window.start(now)))))
                .map(|p| BudgetPolicy::clone(p))
                .collect()
        };
        self.snapshot.store(Arc::new(snap));
        if !fresh.is_empty() {
            if let Err(e) = self.seed(&fresh).await {
                tracing::warn!(error = %e, "could not seed budget counters from the ledger; retrying at the next refresh");
            }
        }
        Ok(())
    }

    /// Seed counter `index` of `plan` (its policy's current window) from the ledger, after the
    /// store reported it unseeded: a window's first request, or a counter the store lost (Redis
    /// restarted without persistence). What the ledger has not written yet (its queue, its
    /// spool) is not counted: that, at most, is what such a loss can let through.
    async fn reseed(
        &self,
        store: &dyn BudgetStore,
        plan: &Plan,
        index: usize,
        now_ms: i64,
    ) -> Result<(), BudgetError> {
        let Some(policy) = plan.policies.get(index) else {
            return Err(BudgetError::Protocol(format!(
                "unseeded counter {index} of {} policies",
                plan.policies.len()
            )));
        };
        let start = ms(policy.window.start(self.clock.now()));
        let mut recent = self.reseeding.lock().await;
        recent.retain(|_, at| now_ms - *at < RESEED_MEMORY_MS);
        if recent.contains_key(&(policy.id.clone(), start)) {
            // Seeded a moment ago by a request that waited here first.
            return Ok(());
        }
        tracing::info!(
            policy = %policy.id,
            tenant = %policy.tenant_id,
            "budget counter not seeded (new window, or lost by the store): seeding it from the ledger"
        );
        self.seed_into(store, std::slice::from_ref(policy))
            .await
            .map_err(|e| BudgetError::Protocol(format!("seeding from the ledger: {e:#}")))?;
        recent.insert((policy.id.clone(), start), now_ms);
        Ok(())
    }

    /// Seed the current window of each policy from the ledger (a no-op where a counter is
    /// seeded already).
    async fn seed(&self, policies: &[BudgetPolicy]) -> anyhow::Result<()> {
        self.seed_into(&*self.store, policies).await
    }

    async fn seed_into(
        &self,
        store: &dyn BudgetStore,
        policies: &[BudgetPolicy],
    ) -> anyhow::Result<()> {
        let now = self.clock.now();
        let mut by_start: BTreeMap<DateTime<Utc>, Vec<&BudgetPolicy>> = BTreeMap::new();
        for p in policies {
            by_start.entry(p.window.start(now)).or_default().push(p);
        }
        for (start, group) in by_start {
            let spend = match &self.ledger {
                Some(l) => l.spend_since(start).await?,
                None => Vec::new(),
            };
            for p in group {
                let (mut tokens, mut micros) = (0u64, 0i64);
                for row in spend.iter().filter(|r| r.tenant_id == p.tenant_id) {
                    if p.scope.matches(&row.key_id, &row.tags) {
                        tokens += row.tokens;
                        micros += row.micros;
                    }
                }
                let key = counter_key(&p.tenant_id, &p.id, start);
                let expire = ms(p.window.end(start)) + COUNTER_GRACE_MS;
                store
                    .seed(&p.tenant_id, &key, tokens, micros, expire)
                    .await?;
                self.seeded
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert((p.id.clone(), ms(start)));
            }
        }
        Ok(())
    }

    /// The rules that apply to a request by `key` carrying `tags`; `None` when none do (the
    /// request then costs no budget work at all).
    pub fn plan(&self, key: &ApiKey, tags: &BTreeMap<String, String>) -> Option<Plan> {
        let snap = self.snapshot.load();
        // Shared with the snapshot: a plan per request copies no policy.
        let policies: Vec<Arc<BudgetPolicy>> = snap
            .policies
            .get(&key.tenant_id)
            .map(|ps| {
                ps.iter()
                    .filter(|p| p.scope.matches(&key.id, tags))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let mut rates = Vec::new();
        for (r, specs) in snap.rates.get(&key.tenant_id).into_iter().flatten() {
            // A tenant's limit, or one of this key's.
            if r.key_id.as_ref().is_some_and(|id| *id != key.id) {
                continue;
            }
            rates.extend(specs.iter().map(|spec| (spec.clone(), Arc::clone(r))));
        }
        if policies.is_empty() && rates.is_empty() {
            return None;
        }
        Some(Plan {
            tenant_id: key.tenant_id.clone(),
            tenant_name: key.tenant_name.clone(),
            policies,
            rates,
            fail_mode: snap
                .fail_modes
                .get(&key.tenant_id)
                .copied()
                .unwrap_or(self.config.fail_mode),
        })
    }

    /// The budget pressure on a request by `key` carrying `tags`: the highest share of its limit
    /// used (0..=1) among the `downgrade` budgets that apply to it, in their current windows, as
    /// this replica saw it at its latest admission against each (from a lease or the store).
    /// No I/O, so the route step can move the tier threshold before the budget step runs. 0
    /// when no `downgrade` budget applies, or none has admitted anything on this replica in
    /// its current window yet.
    pub fn pressure(&self, key: &ApiKey, tags: &BTreeMap<String, String>) -> f64 {
        let snap = self.snapshot.load();
        let Some(policies) = snap.policies.get(&key.tenant_id) else {
            return 0.0;
        };
        let mut downgrading = policies
            .iter()
            .filter(|p| p.action == Action::Downgrade && p.scope.matches(&key.id, tags))
            .peekable();
        if downgrading.peek().is_none() {
            return 0.0;
        }
        let now = self.clock.now();
        let seen = self.pressure.lock().unwrap_or_else(|e| e.into_inner());
        downgrading
            .filter_map(|p| seen.get(&counter_key(&p.tenant_id, &p.id, p.window.start(now))))
            .fold(0.0, |most, (used, _)| most.max(*used))
    }

    /// Remember the share of `downgrade` counter `spec`'s limit used after an admission.
    fn saw_pressure(&self, spec: &CounterSpec, used: f64) {
        self.pressure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(spec.key.clone(), (used, spec.expire_at_ms));
    }

    /// Start the engine's loops on `background`: batched commits, lease settlement, replay of
    /// the commit backlog, and the policy refresh every `every`. They end when it stops
    /// ([`Budgets::flush`] first, so what they hold goes out).
    pub fn start(self: &Arc<Self>, background: &Background, every: Duration) {
        let stop = background.stopping().clone();
        background.spawn(Arc::clone(self).run_commits(stop.clone()));
        if let Some(leases) = &self.leases {
            let b = Arc::clone(self);
            let period = Duration::from_millis(leases.tick_ms());
            background.every("budget leases", period, move || {
                let b = Arc::clone(&b);
                async move {
                    b.settle_leases(false).await;
                    Ok::<(), std::convert::Infallible>(())
                }
            });
        }
        if self.shared {
            let b = Arc::clone(self);
            background.every(
                "budget commit replay",
                Duration::from_millis(500),
                move || {
                    let b = Arc::clone(&b);
                    async move {
                        b.replay_backlog().await;
                        Ok::<(), std::convert::Infallible>(())
                    }
                },
            );
        }
        let b = Arc::clone(self);
        background.every("budget policies", every, move || {
            let b = Arc::clone(&b);
            async move { b.refresh().await }
        });
    }

    fn store_available(&self, now_ms: i64) -> bool {
        self.down_until_ms.load(Ordering::Relaxed) <= now_ms
    }

    fn store_failed(&self, plan: &Plan, e: &BudgetError, now_ms: i64) {
        self.down_until_ms
            .store(now_ms + STORE_BACKOFF_MS, Ordering::Relaxed);
        self.metrics
            .budget_store_errors
            .with_label_values(&[plan.fail_mode.as_str()])
            .inc();
        tracing::warn!(error = %e, tenant = %plan.tenant_id, fail_mode = plan.fail_mode.as_str(),
            "budget store unreachable");
    }

    fn decision(&self, plan: &Plan, outcome: &str) {
        self.metrics
            .budget_decisions
            .with_label_values(&[plan.tenant_name.as_str(), outcome])
            .inc();
    }
}

/// Check `limit` values typed by an operator.
pub fn limit_from(tokens: Option<u64>, usd: Option<f64>) -> Result<Limit, String> {
    let micros = match usd {
        Some(u) => Some(
            crate::pricing::usd_to_micros(u).ok_or_else(|| format!("invalid USD amount {u}"))?,
        ),
        None => None,
    };
    Ok(Limit { tokens, micros })
}
