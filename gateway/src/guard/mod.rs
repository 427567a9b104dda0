//! The guard step: agent loops found on the request path, before any cost.
//!
//! Shaped like [`crate::budget`]: a check before the cache ([`Guard::check`]), an observe at
//! settle ([`Guard::observe`]), and a store trait ([`store::GuardStore`]) with an in-process
//! ([`memory::MemoryGuard`]) and a Redis ([`redis::RedisGuard`]) implementation.
//!
//! Two signals, judged by the tenant's policy (`gatewayctl guard set`, else `[guard]`):
//! - *inside one request* ([`signals::detect`]): the conversation itself ends in the same step
//!   `repeats` times, or a 2-3 step cycle repeated; needs no state, so it works across replicas
//!   and on the first request that carries the loop;
//! - *across requests* of a session: its window of latest turns ends the same way (for clients
//!   that send each call as a fresh conversation, or trim their history). A byte-identical
//!   request after one that was not answered is a client retry, never a step.
//!
//! Texts compare exactly after masking times, ids and counters, and by their static-embedding
//! sketches ([`near`]) for paraphrases. What happens then is the policy's action: `flag`
//! (answer, and say so), `throttle` (429 and a cooldown for the session) or `block` (429 until
//! `gatewayctl sessions clear`). [`decide`] is that choice, pure, with time passed in.

pub mod decide;
pub mod memory;
pub mod near;
pub mod redis;
pub mod retries;
pub mod session;
pub mod signals;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use crate::config::GuardConfig;
use crate::metrics::Metrics;
use crate::store::{Store, StoreError, TenantPolicies};
use crate::tasks::Background;
pub use crate::types::guard::{GuardPolicy, LoopAction};
pub use decide::{Decision, Refusal};
pub use session::Session;
pub use signals::Loop;
use store::{GuardError, GuardStore, Limits, Seen, SessionInfo, SessionKey, Turn};

/// The guard: policies, the session store and the near-duplicate model.
pub struct Guard {
    config: GuardConfig,
    store: Arc<dyn GuardStore>,
    policies: TenantPolicies<GuardPolicy>,
    near: Option<Arc<near::NearDup>>,
    clock: Arc<dyn crate::budget::Clock>,
    metrics: Metrics,
}

/// What the guard step found about a client retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryVerdict {
    /// How it was recognised as a retry (`None`: not a retry).
    pub signal: Option<retries::Signal>,
    /// It is a retry beyond the tenant's retry budget.
    pub over_budget: bool,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("enabled", &self.config.enabled)
            .field("near", &self.near)
            .finish_non_exhaustive()
    }
}

/// A request's part in the retry budget, for [`Guard::step`].
#[derive(Debug, Clone, Copy)]
pub struct RetryCheck<'a> {
    /// The API key that sent it.
    pub key: &'a crate::store::ApiKey,
    /// What its client said about it being a retry.
    pub client: &'a retries::ClientRetry,
    /// Its fingerprint (a repeat of a request that got an error answer is a retry).
    pub fingerprint: &'a str,
}

/// What [`Guard::look`] found before the store is asked.
struct Looked {
    key: SessionKey,
    turn: Turn,
    in_request: Option<Loop>,
    policy: GuardPolicy,
    repeats: usize,
    similarity: f32,
    now: i64,
}

/// What [`Guard::retry_ask`] knows before the request is counted.
struct RetryAsk<'a> {
    signal: Option<retries::Signal>,
    known: store::Known<'a>,
    slot: u64,
    window_ms: i64,
}

/// A request as the guard sees it.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The tenant.
    pub tenant_id: &'a str,
    /// Its name (for messages: how an admin names it).
    pub tenant_name: &'a str,
    /// The request's session.
    pub session: &'a str,
    /// Its chat messages (`None`: not a chat request; only the session's state applies).
    pub messages: Option<&'a [crate::openai::Message<'a>]>,
    /// Hash of the whole request (its fingerprint): a byte-identical retry has the same.
    pub request: u64,
}

impl Guard {
    /// A guard over `store` (sessions) with policies from `tenants`.
    pub async fn new(
        config: GuardConfig,
        store: Arc<dyn GuardStore>,
        tenants: Arc<dyn Store>,
        model_dir: Option<std::path::PathBuf>,
        clock: Arc<dyn crate::budget::Clock>,
        metrics: Metrics,
    ) -> Result<Self, StoreError> {
        let near = model_dir
            .filter(|_| config.near_duplicates && config.enabled)
            .map(|dir| Arc::new(near::NearDup::new(dir)));
        let guard = Self {
            config,
            store,
            policies: TenantPolicies::new(tenants),
            near,
            clock,
            metrics,
        };
        guard.refresh().await?;
        Ok(guard)
    }

    /// Use this near-duplicate model (tests, benchmarks).
    pub fn with_near(mut self, near: Option<Arc<near::NearDup>>) -> Self {
        self.near = near;
        self
    }

    /// The session store.
    pub fn store(&self) -> &Arc<dyn GuardStore> {
        &self.store
    }

    /// Reload the policies every `every` until `background` stops.
    pub fn start(self: &Arc<Self>, background: &Background, every: Duration) {
        let guard = Arc::clone(self);
        background.every("guard policies", every, move || {
            let guard = Arc::clone(&guard);
            async move { guard.refresh().await }
        });
    }

    /// Reload every tenant's policy.
    pub async fn refresh(&self) -> Result<(), StoreError> {
        self.policies.refresh().await
    }

    /// The policy in force for `tenant_id`, every field set.
    pub fn policy(&self, tenant_id: &str) -> GuardPolicy {
        self.config.effective(self.policies.get(tenant_id).as_ref())
    }

    fn limits(&self) -> Limits {
        Limits {
            turns: self.config.window_requests,
            ttl_ms: i64::try_from(self.config.session_ttl_secs.saturating_mul(1000))
                .unwrap_or(i64::MAX),
        }
    }

    /// Whether the loop check runs (it reads the conversation; off, only the session and the
    /// client-retry bookkeeping remain).
    pub fn enabled(&self) -> bool {
        self.config.enabled
    }

    /// The loop check alone: find a loop in the request and in its session's window, and
    /// decide what to do by the tenant's policy. A store that fails leaves the in-request
    /// signal. (The request path runs [`Self::step`], which also counts the retry budget.)
    pub async fn check(&self, req: Check<'_>) -> Decision {
        if !self.config.enabled {
            return Decision::Allow;
        }
        let looked = self.look(&req);
        let seen = match self
            .store
            .record(&looked.key, &looked.turn, self.limits())
            .await
        {
            Ok(seen) => Some(seen),
            Err(e) => {
                tracing::warn!(error = %e, "guard store unavailable; the in-request signal alone applies");
                None
            }
        };
        self.decide(&req, looked, seen).await
    }

    /// The guard step of a request: the loop check ([`Self::check`]) and whether the request
    /// is a client retry beyond its tenant's retry budget (every request counts toward the
    /// budget's base; a store that fails lets the request through, logged), with the
    /// session's turn and the budget's count in one store call (one round trip on Redis).
    pub async fn step(&self, req: Check<'_>, retry: RetryCheck<'_>) -> (Decision, RetryVerdict) {
        let ask = self.retry_ask(&retry).await;
        if !self.config.enabled {
            return (Decision::Allow, self.count_retry(&retry, ask).await);
        }
        let looked = self.look(&req);
        let result = self
            .store
            .record_and_count(
                &looked.key,
                &looked.turn,
                self.limits(),
                ask.known,
                ask.slot,
                ask.window_ms,
            )
            .await;
        let (seen, counts) = match result {
            Ok((seen, counts)) => (Some(seen), Some(counts)),
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "guard store unavailable; the in-request signal alone applies and the retry \
                     budget was not checked"
                );
                (None, None)
            }
        };
        let verdict = self.retry_verdict(retry.key, ask.signal, counts);
        (self.decide(&req, looked, seen).await, verdict)
    }

    /// What the loop check finds without the store: the tenant's policy, a loop inside the
    /// request, and the turn it adds to its session's window.
    fn look(&self, req: &Check<'_>) -> Looked {
        let policy = self.policy(req.tenant_id);
        let repeats = policy.repeats.unwrap_or(3) as usize;
        let similarity = policy.similarity.unwrap_or(1.0) as f32;
        let near = self.near.as_deref().filter(|_| similarity < 1.0);
        if let Some(n) = &self.near {
            n.warm();
        }
        let detect = signals::Detect {
            repeats,
            near: near.map(|n| (n, similarity)),
        };
        let conversation = req
            .messages
            .map(|m| signals::Conversation::read(m, near.is_some()));
        let in_request = conversation.as_ref().and_then(|c| c.detect(detect));
        let now = self.clock.now_ms();
        let turn = conversation
            .as_ref()
            .and_then(signals::Conversation::latest_turn)
            .map(|step| Turn {
                at_ms: now,
                step: step.fingerprint,
                request: req.request,
                text: !step.is_tool(),
                answered: false,
                // Only text turns are compared by sketch across requests.
                sketch: near
                    .filter(|_| !step.is_tool())
                    .and_then(|n| n.sketch(&step.text()))
                    .map(Box::new),
            });
        let turn = turn.unwrap_or(Turn {
            at_ms: now,
            step: req.request,
            request: req.request,
            text: false,
            answered: false,
            sketch: None,
        });
        Looked {
            key: SessionKey::new(req.tenant_id, req.session),
            turn,
            in_request,
            policy,
            repeats,
            similarity,
            now,
        }
    }

    /// The loop check's decision, from what [`Self::look`] found and the session as the store
    /// had it (`None`: the store failed), written back to the store when it marks anything.
    async fn decide(&self, req: &Check<'_>, looked: Looked, seen: Option<Seen>) -> Decision {
        let Looked {
            key,
            turn,
            in_request,
            policy,
            repeats,
            similarity,
            now,
        } = looked;
        let window_ms = i64::try_from(policy.window_secs.unwrap_or(600).saturating_mul(1000))
            .unwrap_or(i64::MAX);
        let across = seen
            .as_ref()
            .filter(|s| !s.retry && req.messages.is_some())
            .and_then(|s| window_loop(&s.window, &turn, now - window_ms, repeats, similarity));
        // The longer of the two: a conversation that shows the loop itself says most.
        let found = match (in_request, across) {
            (Some(a), Some(b)) => Some(if b.steps() > a.steps() { b } else { a }),
            (a, b) => a.or(b),
        };
        let state = seen.map(|s| s.state).unwrap_or_default();
        let (decision, mark) =
            decide::decide(&policy, &state, found, req.tenant_name, req.session, now);
        if let Some(mark) = mark {
            if let Err(e) = self.store.mark(&key, &mark).await {
                tracing::warn!(error = %e, "guard store: the decision could not be recorded");
            }
        }
        let action = match &decision {
            Decision::Allow => None,
            Decision::Flag { .. } => Some("flag"),
            Decision::Refuse(r) if r.blocked => Some("block"),
            Decision::Refuse(_) => Some("throttle"),
        };
        if let Some(action) = action {
            self.metrics.guard_loops.with_label_values(&[action]).inc();
        }
        decision
    }

    /// What is known of a request being a client retry before it is counted: the client's
    /// word, then a repeated `Idempotency-Key` (one store call, only for a request with one).
    async fn retry_ask<'a>(&self, retry: &RetryCheck<'a>) -> RetryAsk<'a> {
        let now = self.clock.now_ms();
        let rule = self.config.retry_rule();
        let key = retry.key;
        let repeated_key = match &retry.client.idempotency_key {
            Some(idem) => self
                .store
                .idempotency_seen(&key.tenant_id, &key.id, idem, now, rule.window_ms())
                .await
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "guard store: Idempotency-Key not checked");
                    false
                }),
            None => false,
        };
        let signal = retries::signal(retry.client, repeated_key);
        let known = match signal {
            Some(_) => store::Known::Retry,
            // Whether it repeats a request that got an error answer is found in the same
            // round trip as the counts.
            None => store::Known::IfFailed {
                key_id: &key.id,
                fingerprint: retry.fingerprint,
                now_ms: now,
                ttl_ms: self.after_error_ms(),
            },
        };
        RetryAsk {
            signal,
            known,
            slot: rule.slot(now),
            window_ms: rule.window_ms(),
        }
    }

    /// Count the request in its tenant's retry budget, and judge it.
    async fn count_retry(&self, retry: &RetryCheck<'_>, ask: RetryAsk<'_>) -> RetryVerdict {
        let counts = self
            .store
            .retry_counts(&retry.key.tenant_id, ask.known, ask.slot, ask.window_ms)
            .await
            .map_err(
                |e| tracing::warn!(error = %e, "guard store: the retry budget was not checked"),
            )
            .ok();
        self.retry_verdict(retry.key, ask.signal, counts)
    }

    /// The retry budget's verdict on a request recognised by `signal` (before the store's
    /// word), given its tenant's `counts` (`None`: the store failed, the request goes on).
    fn retry_verdict(
        &self,
        key: &crate::store::ApiKey,
        mut signal: Option<retries::Signal>,
        counts: Option<store::RetryCounts>,
    ) -> RetryVerdict {
        let rule = self.config.retry_rule();
        let over = match counts {
            Some(c) => {
                if c.after_error {
                    signal = Some(retries::Signal::AfterError);
                }
                let (requests, retries) = (c.requests, c.retries);
                if requests == 1 {
                    // The tenant's first request in the window: its counters exist (at 0).
                    for s in retries::Signal::ALL {
                        self.metrics
                            .client_retries
                            .with_label_values(&[key.tenant_name.as_str(), s.as_str()]);
                    }
                }
                signal.is_some() && rule.over(requests, retries)
            }
            None => false,
        };
        if let Some(s) = signal {
            self.metrics
                .client_retries
                .with_label_values(&[key.tenant_name.as_str(), s.as_str()])
                .inc();
        }
        RetryVerdict {
            signal,
            over_budget: over && self.config.retry_action != crate::config::RetryAction::Off,
        }
    }

    fn after_error_ms(&self) -> i64 {
        i64::try_from(self.config.retry_after_error_secs.saturating_mul(1_000)).unwrap_or(i64::MAX)
    }

    /// API key `key_id` of `tenant_id` got an error answer (one a client retries) to the request
    /// with `fingerprint`: a repeat of it soon after is a client retry. A store that fails
    /// forgets it (logged).
    pub async fn failed(&self, tenant_id: &str, key_id: &str, fingerprint: &str) {
        if self.config.retry_after_error_secs == 0 {
            return;
        }
        let now = self.clock.now_ms();
        let ttl = self.after_error_ms();
        if let Err(e) = self
            .store
            .mark_failed(tenant_id, key_id, fingerprint, now, ttl)
            .await
        {
            tracing::debug!(error = %e, "guard store: an error answer was not marked");
        }
    }

    /// Whether agent-loop detection runs (else [`Self::check`] allows and [`Self::observe`]
    /// records nothing).
    pub fn loops_enabled(&self) -> bool {
        self.config.enabled
    }

    /// What happens to a retry beyond the budget.
    pub fn retry_action(&self) -> crate::config::RetryAction {
        self.config.retry_action
    }

    /// The observe at settle: the session's request settled (`ok`: answered 2xx) at
    /// `cost_micros`, which marks its turn answered (a byte-identical request after it is a
    /// step again, not a retry) and is the estimate for the next one refused.
    pub async fn observe(&self, key: &SessionKey, request: u64, ok: bool, cost_micros: i64) {
        if !self.config.enabled {
            return;
        }
        if let Err(e) = self.store.settle(key, request, ok, cost_micros).await {
            tracing::debug!(error = %e, "guard store: settle not recorded");
        }
    }

    /// Send the settles the store queued (at shutdown, once the requests have settled).
    pub async fn flush(&self) {
        self.store.flush().await;
    }

    /// A tenant's sessions, most recently seen first.
    pub async fn sessions(
        &self,
        tenant_id: &str,
        limit: usize,
    ) -> Result<Vec<SessionInfo>, GuardError> {
        self.store.list(tenant_id, limit).await
    }

    /// One session.
    pub async fn session(
        &self,
        tenant_id: &str,
        session: &str,
    ) -> Result<Option<SessionInfo>, GuardError> {
        self.store.get(&SessionKey::new(tenant_id, session)).await
    }

    /// Forget a session: its window, cooldown and block.
    pub async fn clear(&self, tenant_id: &str, session: &str) -> Result<bool, GuardError> {
        self.store.clear(&SessionKey::new(tenant_id, session)).await
    }
}

/// The loop at the end of a session's window (`earlier` turns, then `latest`), counting only
/// turns since `since_ms`.
fn window_loop(
    earlier: &[Turn],
    latest: &Turn,
    since_ms: i64,
    repeats: usize,
    similarity: f32,
) -> Option<Loop> {
    // One turn alone repeats nothing (`repeats` is at least 2); the store sends no earlier
    // turns when none has the latest one's step.
    if earlier.is_empty() {
        return None;
    }
    let mut turns: Vec<&Turn> = earlier.iter().filter(|t| t.at_ms >= since_ms).collect();
    turns.push(latest);
    let same = |a: usize, b: usize| {
        let (x, y) = (turns[a], turns[b]);
        if x.step == y.step {
            return true;
        }
        match (&x.sketch, &y.sketch) {
            (Some(p), Some(q)) if x.text && y.text => p.cosine(q) >= similarity,
            _ => false,
        }
    };
    let what = if latest.text {
        "the same request (across requests)"
    } else {
        "the same tool step (across requests)"
    };
    if let Some((repeats, period)) = signals::repetition(turns.len(), same, repeats) {
        return Some(Loop {
            repeats,
            period,
            what: what.to_owned(),
        });
    }
    // A-A-x-A: the client asked something else once and came back to the same request.
    let repeats = signals::broken_run(turns.len(), same, repeats)?;
    Some(Loop {
        repeats,
        period: 1,
        what: format!("{what}, one other request between"),
    })
}

/// Hash of a request fingerprint (its hex digits) for the stores.
pub fn request_hash(fingerprint: &str) -> u64 {
    u64::from_str_radix(fingerprint.get(..16).unwrap_or("0"), 16).unwrap_or(0)
}
