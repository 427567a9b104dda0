//! [`Budgets`]: the budget step of the request pipeline. It keeps this replica's snapshot of
//! policies and rate limits, turns a request into one [`ReserveRequest`], maps the outcome to an
//! [`Admission`] or an OpenAI-shaped error, and commits actual usage after the response.
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
use serde::{Deserialize, Serialize};
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
use tokio_util::sync::CancellationToken;

/// How long a counter outlives its window (so `gatewayctl usage` can still read a window that
/// just ended), ms.
const COUNTER_GRACE_MS: i64 = 86_400_000;
/// After a shared-store failure, skip it for this long before trying again, ms.
const STORE_BACKOFF_MS: i64 = 1_000;
/// Most commits held for replay while the shared store is unreachable.
const MAX_BACKLOG: usize = 1_000_000;
/// Most commits sent to the shared store in one batch.
const COMMIT_BATCH: usize = 256;

/// Every tenant's rules, as of the last refresh.
#[derive(Debug, Default)]
struct Snapshot {
    policies: HashMap<String, Vec<BudgetPolicy>>,
    rates: HashMap<String, Vec<RateLimit>>,
    fail_modes: HashMap<String, FailMode>,
}

/// The rules that apply to one request, found without any I/O.
#[derive(Debug)]
pub struct Plan {
    tenant_id: String,
    tenant_name: String,
    policies: Vec<BudgetPolicy>,
    rates: Vec<(RateSpec, RateLimit)>,
    fail_mode: FailMode,
}

impl Plan {
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
    token_rates: Vec<(String, u64)>,
    reserved_tokens: u64,
    /// Made in the local fail-open store (the shared one was unreachable).
    local: bool,
    /// Admitted from this replica's lease (settled with it, not committed on its own).
    lease: Option<(Arc<Lease>, Need)>,
}

/// How the shared store admitted (or did not admit) a request.
enum Shared {
    /// From a lease of this replica.
    Leased(Admission),
    /// By a reservation of its own (or not: see the outcome), and whether it was downgraded.
    Reserved(ReserveRequest, Outcome, bool),
}

/// What a store granted a request, for [`Budgets::admitted`].
struct Grant<'a> {
    /// Output tokens for all choices together.
    output_tokens: u64,
    /// The counters after the reservation, index-aligned with the plan's policies.
    counters: &'a [CounterState],
    /// Served by the small tier because of a `downgrade` budget.
    downgraded: bool,
    /// Reserved in the local fail-open store.
    local: bool,
}

/// One row of `gatewayctl usage`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UsageRow {
    /// The policy.
    pub policy: BudgetPolicy,
    /// Start of the current window.
    pub window_start: DateTime<Utc>,
    /// When it resets.
    pub resets_at: DateTime<Utc>,
    /// Committed and reserved totals.
    pub state: CounterState,
    /// Tokens left (when limited).
    pub remaining_tokens: Option<u64>,
    /// Micro-dollars left (when limited).
    pub remaining_micros: Option<i64>,
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
    /// Leases in the shared store (`None`: every request reserves on its own).
    leases: Option<Leases>,
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
                .push(p);
        }
        for r in rates {
            snap.rates.entry(r.tenant_id.clone()).or_default().push(r);
        }
        snap.fail_modes = modes.into_iter().collect();
        let fresh: Vec<BudgetPolicy> = {
            let now = self.clock.now();
            let seeded = self.seeded.lock().unwrap_or_else(|e| e.into_inner());
            snap.policies
                .values()
                .flatten()
                .filter(|p| !seeded.contains(&(p.id.clone(), ms(p.window.start(now)))))
                .cloned()
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

    /// Seed the current window of each policy from the ledger (a no-op where a counter exists).
    async fn seed(&self, policies: &[BudgetPolicy]) -> anyhow::Result<()> {
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
                self.store
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
        let policies: Vec<BudgetPolicy> = snap
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
        for r in snap.rates.get(&key.tenant_id).into_iter().flatten() {
            let scope = match &r.key_id {
                None => "tenant",
                Some(id) if *id == key.id => id.as_str(),
                Some(_) => continue,
            };
            for (kind, per_minute) in [(RateKind::Requests, r.rpm), (RateKind::Tokens, r.tpm)] {
                if let Some(per_minute) = per_minute {
                    let spec = RateSpec {
                        key: rate_key(&key.tenant_id, scope, kind),
                        per_minute,
                        kind,
                    };
                    rates.push((spec, r.clone()));
                }
            }
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

    fn request(
        &self,
        plan: &Plan,
        input: &AdmitInput,
        now: DateTime<Utc>,
        downgraded: bool,
        share: f64,
    ) -> ReserveRequest {
        let price = if downgraded && !input.primary_is_small {
            input.small_price
        } else {
            input.price
        };
        let choices = input.choices.max(1);
        let max_tokens = if input.generates {
            input.max_tokens.unwrap_or(self.config.default_max_tokens) * choices
        } else {
            0
        };
        let counters = plan
            .policies
            .iter()
            .map(|p| {
                let start = p.window.start(now);
                CounterSpec {
                    key: counter_key(&p.tenant_id, &p.id, start),
                    mode: match p.action {
                        Action::Reject => Mode::Enforce,
                        Action::Downgrade => Mode::Downgrade,
                        Action::Flag => Mode::Count,
                    },
                    limit: p.limit.scaled(share),
                    hard: p.hard_limit.scaled(share),
                    expire_at_ms: ms(p.window.end(start)) + COUNTER_GRACE_MS,
                }
            })
            .collect();
        let rates = plan
            .rates
            .iter()
            .map(|(r, _)| RateSpec {
                per_minute: ((r.per_minute as f64 * share) as u64).max(1),
                ..r.clone()
            })
            .collect();
        let prompt_micros = i64::try_from(
            (u128::from(input.prompt_tokens) * u128::try_from(price.input.max(0)).unwrap_or(0))
                .div_ceil(1_000_000),
        )
        .unwrap_or(i64::MAX / 4);
        ReserveRequest {
            tenant_id: plan.tenant_id.clone(),
            rid: input.rid.clone(),
            now_ms: ms(now),
            ttl_ms: self.ttl_ms,
            prompt_tokens: input.prompt_tokens,
            prompt_micros,
            output_micros_per_token: price.output.max(0) as f64 / 1e6,
            max_tokens,
            min_tokens: self.config.min_tokens * choices,
            downgraded: downgraded || input.primary_is_small,
            units: 1,
            lease: false,
            lease_quiet_ms: self.leases.as_ref().map_or(0, |l| 2 * l.drain_ms()),
            counters,
            rates,
        }
    }

    async fn reserve_in(
        &self,
        store: &dyn BudgetStore,
        req: &ReserveRequest,
    ) -> Result<Outcome, BudgetError> {
        let started = Instant::now();
        let out = store.reserve(req).await;
        self.metrics
            .budget_store_seconds
            .with_label_values(&["reserve"])
            .observe(started.elapsed().as_secs_f64());
        out
    }

    /// Check and reserve; on `downgrade`, once more at the small tier.
    async fn reserve_with(
        &self,
        store: &dyn BudgetStore,
        plan: &Plan,
        input: &AdmitInput,
        now: DateTime<Utc>,
        share: f64,
    ) -> Result<(ReserveRequest, Outcome, bool), BudgetError> {
        let req = self.request(plan, input, now, false, share);
        let outcome = self.reserve_in(store, &req).await?;
        if let Outcome::Downgrade { .. } = outcome {
            let req = self.request(plan, input, now, true, share);
            let outcome = self.reserve_in(store, &req).await?;
            return Ok((req, outcome, true));
        }
        Ok((req, outcome, false))
    }

    /// Admit through the shared store: from a lease when one has room (or can be taken),
    /// otherwise by a reservation of its own.
    async fn shared_admit(
        &self,
        plan: &Plan,
        input: &AdmitInput,
        now: DateTime<Utc>,
    ) -> Result<Shared, BudgetError> {
        let Some(leases) = &self.leases else {
            let (req, outcome, downgraded) = self
                .reserve_with(&*self.store, plan, input, now, 1.0)
                .await?;
            return Ok(Shared::Reserved(req, outcome, downgraded));
        };
        let now_ms = ms(now);
        let req = self.request(plan, input, now, false, 1.0);
        let need = Need::of(&req);
        let slot = leases.slot(&req);
        if let Some(taken) = slot.take(need, now_ms) {
            return Ok(Shared::Leased(self.leased(plan, input, &req, taken, now)));
        }
        {
            // One lease at a time per slot: the others wait for it, then take from it.
            let _one = slot.acquire.lock().await;
            if let Some(taken) = slot.take(need, now_ms) {
                return Ok(Shared::Leased(self.leased(plan, input, &req, taken, now)));
            }
            if !self.store_available(ms(self.clock.now())) {
                // It failed while this request waited: do not queue up behind it.
                return Err(BudgetError::Unavailable);
            }
            if let Some(lease_req) = leases.lease_request(&slot, &req, need, self.ttl_ms) {
                let outcome = match self.reserve_in(&*self.store, &lease_req).await {
                    Ok(o) => o,
                    Err(e) => {
                        // The lease may have been made with its answer lost: close it once
                        // the store is back (a no-op if it was never made).
                        slot.refused(now_ms, leases.drain_ms());
                        self.enqueue(Leases::orphan_close(&lease_req));
                        return Err(e);
                    }
                };
                slot.observe(&lease_req, &outcome);
                if let Outcome::Admitted { counters, .. } = outcome {
                    self.metrics.budget_leases.inc();
                    leases.install(&slot, &lease_req, counters);
                    if let Some(taken) = slot.take(need, now_ms) {
                        return Ok(Shared::Leased(self.leased(plan, input, &req, taken, now)));
                    }
                } else {
                    slot.refused(now_ms, leases.drain_ms());
                }
            }
        }
        let (req, outcome, downgraded) = self
            .reserve_with(&*self.store, plan, input, now, 1.0)
            .await?;
        if !downgraded {
            slot.observe(&req, &outcome);
        }
        let held_by_leases = match &outcome {
            Outcome::Rejected { index, counters } => counters
                .get(*index)
                .is_some_and(|c| c.leased_tokens > 0 || c.leased_micros > 0),
            _ => false,
        };
        if held_by_leases {
            // Part of what is left is held by leases (this replica's or others'). The refusal
            // made that counter take no new lease for a while (`lease_quiet_ms`), so the open
            // ones close and give back what they do not use: ask once more after that.
            slot.close();
            let wait = u64::try_from(leases.drain_ms()).unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(wait)).await;
            let (req, outcome, downgraded) = self
                .reserve_with(&*self.store, plan, input, self.clock.now(), 1.0)
                .await?;
            if !downgraded {
                slot.observe(&req, &outcome);
            }
            return Ok(Shared::Reserved(req, outcome, downgraded));
        }
        Ok(Shared::Reserved(req, outcome, downgraded))
    }

    /// The admission of a request taken from a lease.
    fn leased(
        &self,
        plan: &Plan,
        input: &AdmitInput,
        req: &ReserveRequest,
        (lease, counters): (Arc<Lease>, Vec<CounterState>),
        now: DateTime<Utc>,
    ) -> Admission {
        let grant = Grant {
            output_tokens: req.max_tokens,
            counters: &counters,
            downgraded: false,
            local: false,
        };
        let mut admission = self.admitted(plan, input, req, grant, now);
        if let Some(r) = admission.reservation.as_mut() {
            r.lease = Some((lease, Need::of(req)));
        }
        admission
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

    async fn settle_leases(&self, all: bool) {
        let Some(leases) = &self.leases else {
            return;
        };
        let now_ms = ms(self.clock.now());
        let due = leases.settlements(now_ms, all);
        self.metrics.budget_leases_live.set(leases.live() as i64);
        if due.is_empty() {
            return;
        }
        if self.store_available(now_ms) {
            for batch in due.chunks(COMMIT_BATCH) {
                self.commit_now(batch.to_vec()).await;
            }
        } else {
            for req in due {
                self.enqueue(req);
            }
        }
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

    /// Admit a request under `plan`, or say why not.
    pub async fn admit(&self, plan: &Plan, input: AdmitInput) -> Result<Admission, Refusal> {
        let now = self.clock.now();
        let now_ms = ms(now);
        let shared = if !self.shared || self.store_available(now_ms) {
            match self.shared_admit(plan, &input, now).await {
                Ok(Shared::Leased(admission)) => return Ok(admission),
                Ok(Shared::Reserved(req, outcome, downgraded)) => Some((req, outcome, downgraded)),
                Err(BudgetError::Unavailable) => {
                    self.metrics
                        .budget_store_errors
                        .with_label_values(&[plan.fail_mode.as_str()])
                        .inc();
                    None
                }
                Err(e) => {
                    self.store_failed(plan, &e, now_ms);
                    None
                }
            }
        } else {
            self.metrics
                .budget_store_errors
                .with_label_values(&[plan.fail_mode.as_str()])
                .inc();
            None
        };
        let (req, outcome, downgraded, local) = match shared {
            Some((req, outcome, downgraded)) => (req, outcome, downgraded, false),
            None if plan.fail_mode == FailMode::Closed => {
                self.decision(plan, "store_unavailable");
                return Err(Refusal::StoreUnavailable);
            }
            None => {
                let share = self.config.fail_open_share;
                // The local store never fails.
                let (req, outcome, downgraded) = self
                    .reserve_with(&self.local, plan, &input, now, share)
                    .await
                    .map_err(Refusal::Internal)?;
                (req, outcome, downgraded, true)
            }
        };
        match outcome {
            Outcome::Admitted {
                max_tokens,
                counters,
                ..
            } => {
                let grant = Grant {
                    output_tokens: max_tokens,
                    counters: &counters,
                    downgraded,
                    local,
                };
                Ok(self.admitted(plan, &input, &req, grant, now))
            }
            Outcome::Rejected { index, counters } => {
                self.decision(plan, "rejected");
                Err(self.exhausted(plan, &req, index, &counters, now))
            }
            Outcome::Downgrade { index } => {
                // Only possible if the policy changed between the two calls; treat as exhausted.
                self.decision(plan, "rejected");
                Err(self.exhausted(plan, &req, index, &[], now))
            }
            Outcome::RateLimited {
                index,
                retry_after_ms,
            } => {
                self.decision(plan, "rate_limited");
                let (spec, rule) = &plan.rates[index];
                Err(Refusal::RateLimited {
                    kind: spec.kind,
                    per_minute: spec.per_minute,
                    key_id: rule.key_id.clone(),
                    retry_after_ms,
                })
            }
        }
    }

    fn decision(&self, plan: &Plan, outcome: &str) {
        self.metrics
            .budget_decisions
            .with_label_values(&[plan.tenant_name.as_str(), outcome])
            .inc();
    }

    fn admitted(
        &self,
        plan: &Plan,
        input: &AdmitInput,
        req: &ReserveRequest,
        grant: Grant<'_>,
        now: DateTime<Utc>,
    ) -> Admission {
        let Grant {
            output_tokens: reserved_output,
            counters,
            downgraded,
            local,
        } = grant;
        let requested = input.max_tokens.unwrap_or(self.config.default_max_tokens);
        // The store grants output tokens for all choices together.
        let granted = reserved_output / input.choices.max(1);
        let clamped = input.generates && granted < requested;
        let mut outcome = if clamped { "clamped" } else { "admitted" };
        if downgraded {
            outcome = "downgraded";
        }
        // The tightest budget: the least fraction left after this reservation.
        let mut tightest: Option<(f64, usize, Option<u64>, Option<i64>)> = None;
        let mut flagged = Vec::new();
        let mut warnings = Vec::new();
        for (i, (p, state)) in plan.policies.iter().zip(counters).enumerate() {
            let limit = if downgraded && p.action == Action::Downgrade {
                if p.hard_limit.is_unlimited() {
                    continue;
                }
                p.hard_limit
            } else {
                p.limit
            };
            let (rem_t, rem_m) = state.remaining(&limit);
            let frac_t = limit
                .tokens
                .map(|l| rem_t.unwrap_or(0) as f64 / l.max(1) as f64);
            let frac_m = limit
                .micros
                .map(|l| rem_m.unwrap_or(0) as f64 / l.max(1) as f64);
            let frac = frac_t.unwrap_or(1.0).min(frac_m.unwrap_or(1.0));
            if p.action == Action::Flag && frac <= 0.0 {
                flagged.push(p.id.clone());
            }
            if let Some(w) = p.warn_percent {
                if (1.0 - frac) * 100.0 >= f64::from(w) {
                    warnings.push(Warning {
                        policy_id: p.id.clone(),
                        used_percent: (1.0 - frac) * 100.0,
                    });
                }
            }
            if tightest.is_none_or(|(f, ..)| frac < f) {
                tightest = Some((frac, i, rem_t, rem_m));
            }
        }
        if !flagged.is_empty() {
            outcome = "flagged";
            tracing::warn!(tenant = %plan.tenant_id, policies = ?flagged, "budget exceeded (flag only)");
        }
        let tightest = tightest.map(|(_, i, remaining_tokens, remaining_micros)| {
            let p = &plan.policies[i];
            Tightest {
                policy_id: p.id.clone(),
                scope: p.scope.clone(),
                window: p.window,
                remaining_tokens,
                remaining_micros,
                resets_at: p.window.end(p.window.start(now)),
            }
        });
        self.decision(plan, outcome);
        // The limiters as reserved on (already scaled to the local share when failing open).
        let token_rates = req
            .rates
            .iter()
            .filter(|r| r.kind == RateKind::Tokens)
            .map(|r| (r.key.clone(), r.per_minute))
            .collect();
        Admission {
            max_tokens: (input.generates && plan.bounds_output()).then_some(granted),
            clamped_to: clamped.then_some(granted),
            downgraded,
            warnings,
            flagged,
            tightest,
            fail_open: local,
            reservation: Some(Reservation {
                tenant_id: plan.tenant_id.clone(),
                rid: req.rid.clone(),
                counters: req.counter_keys(),
                token_rates,
                reserved_tokens: req.prompt_tokens + reserved_output,
                local,
                lease: None,
            }),
        }
    }

    fn exhausted(
        &self,
        plan: &Plan,
        req: &ReserveRequest,
        index: usize,
        counters: &[CounterState],
        now: DateTime<Utc>,
    ) -> Refusal {
        let p = &plan.policies[index];
        let state = counters.get(index).copied().unwrap_or_default();
        let limit = if req.downgraded && p.action == Action::Downgrade {
            p.hard_limit
        } else {
            p.limit
        };
        Refusal::Exhausted(Exhausted {
            policy_id: p.id.clone(),
            scope: p.scope.clone(),
            window: p.window,
            limit,
            used_tokens: state.spent_tokens + state.reserved_tokens,
            used_micros: state.spent_micros + state.reserved_micros,
            prompt_tokens: req.prompt_tokens,
            min_tokens: req.min_tokens.min(req.max_tokens),
            resets_at: p.window.end(p.window.start(now)),
            now,
        })
    }

    /// Commit actual usage and release the rest of the reservation. Never fails: a commit the
    /// shared store cannot take now is queued for replay.
    pub async fn commit(&self, reservation: Reservation, tokens: u64, micros: i64) {
        if let Some((lease, need)) = &reservation.lease {
            // Settled with the lease.
            lease.finish(*need, tokens, micros);
            return;
        }
        let now_ms = ms(self.clock.now());
        let refund = reservation.reserved_tokens.saturating_sub(tokens);
        let req = CommitRequest {
            tenant_id: reservation.tenant_id,
            rid: reservation.rid,
            now_ms,
            dedupe_ms: self.ttl_ms * 2,
            unreserved: false,
            tokens,
            micros,
            counters: reservation.counters,
            lease: None,
            refunds: reservation
                .token_rates
                .into_iter()
                .map(|(k, pm)| (k, pm, refund))
                .collect(),
        };
        if reservation.local {
            let _ = self.local.commit(&req).await;
            // The spend happened: add it to the shared counters once they are reachable.
            let mut replay = req;
            replay.refunds.clear();
            replay.unreserved = true;
            self.enqueue(replay);
            return;
        }
        if !self.shared {
            let _ = self.store.commit(&req).await;
            return;
        }
        if !self.store_available(now_ms) {
            self.enqueue(req);
            return;
        }
        self.pending.fetch_add(1, Ordering::SeqCst);
        if let Err(mpsc::error::SendError(req)) = self.commits.send(req) {
            // No batcher (it only stops with the process): commit directly.
            self.pending.fetch_sub(1, Ordering::SeqCst);
            self.commit_now(vec![req]).await;
        }
    }

    /// Send commits to the shared store in batches: one script call per tenant for whatever
    /// accumulated while the previous batch was in flight (under load, many requests per round
    /// trip; at low load, one). Ends when `stop` fires, after sending what is queued.
    async fn run_commits(self: Arc<Self>, stop: CancellationToken) {
        let Some(mut rx) = self
            .commits_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        loop {
            let first = tokio::select! {
                first = rx.recv() => first,
                _ = stop.cancelled() => rx.try_recv().ok(),
            };
            let Some(first) = first else {
                return;
            };
            let mut batch = vec![first];
            while batch.len() < COMMIT_BATCH {
                match rx.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
            let n = batch.len();
            self.commit_now(batch).await;
            self.pending.fetch_sub(n, Ordering::SeqCst);
        }
    }

    async fn commit_now(&self, batch: Vec<CommitRequest>) {
        let started = Instant::now();
        let result = self.store.commit_batch(&batch).await;
        self.metrics
            .budget_store_seconds
            .with_label_values(&["commit"])
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = result {
            let now_ms = ms(self.clock.now());
            self.down_until_ms
                .store(now_ms + STORE_BACKOFF_MS, Ordering::Relaxed);
            tracing::warn!(error = %e, commits = batch.len(), "budget commit failed; queued for replay");
            for req in batch {
                self.enqueue(req);
            }
        }
    }

    /// Wait (up to `grace`) until every commit sent to the shared store was answered, so a
    /// shutdown leaves no reservation to expire.
    pub async fn flush(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        self.settle_leases(true).await;
        while self.pending.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if self.shared && self.backlog_len() > 0 {
            self.replay_backlog().await;
        }
    }

    fn enqueue(&self, req: CommitRequest) {
        let mut q = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= MAX_BACKLOG {
            if let Some(dropped) = q.pop_front() {
                tracing::error!(rid = %dropped.rid, "budget commit backlog full; dropping the oldest commit");
            }
        }
        q.push_back(req);
        self.metrics.budget_backlog.set(q.len() as i64);
    }

    /// Replay queued commits into the shared store, oldest first, until it fails again.
    pub async fn replay_backlog(&self) {
        loop {
            let next: Vec<CommitRequest> = {
                let q = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
                q.iter().take(COMMIT_BATCH).cloned().collect()
            };
            if next.is_empty() {
                return;
            }
            match self.store.commit_batch(&next).await {
                Ok(_) => {
                    let mut q = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
                    let n = next.len().min(q.len());
                    q.drain(..n);
                    self.metrics.budget_backlog.set(q.len() as i64);
                    self.down_until_ms.store(0, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "budget store still unreachable");
                    return;
                }
            }
        }
    }

    /// Commits waiting for the shared store.
    pub fn backlog_len(&self) -> usize {
        self.backlog.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Spent, reserved and remaining per policy of a tenant, in the current windows.
    pub async fn usage(&self, tenant_id: &str) -> Result<Vec<UsageRow>, BudgetError> {
        let now = self.clock.now();
        let policies = self
            .rules
            .list_budgets(Some(tenant_id))
            .await
            .map_err(|e| BudgetError::Protocol(format!("reading policies: {e}")))?;
        let keys: Vec<String> = policies
            .iter()
            .map(|p| counter_key(&p.tenant_id, &p.id, p.window.start(now)))
            .collect();
        let states = self.store.peek(tenant_id, &keys, ms(now)).await?;
        Ok(policies
            .into_iter()
            .zip(states)
            .map(|(policy, state)| {
                let window_start = policy.window.start(now);
                let (remaining_tokens, remaining_micros) = state.remaining(&policy.limit);
                UsageRow {
                    window_start,
                    resets_at: policy.window.end(window_start),
                    remaining_tokens,
                    remaining_micros,
                    state,
                    policy,
                }
            })
            .collect())
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
