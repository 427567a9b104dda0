//! The in-process [`GuardStore`]: one replica's sessions, bounded. At most `max_sessions` are
//! kept (the least recently seen go first) and each forgets itself `session_ttl_secs` after its
//! latest request. A blocked session is kept apart, where eviction of active sessions cannot
//! drop it, until it is cleared or `block_ttl_secs` after it was blocked; at most
//! `max_sessions` blocked sessions are kept (the oldest block goes first).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use moka::policy::EvictionPolicy;
use moka::sync::Cache;

use super::store::{
    GuardError, GuardStore, Known, Limits, Mark, RetryCounts, Seen, SessionInfo, SessionKey,
    SessionState, Turn,
};

#[derive(Debug, Default)]
struct Session {
    state: SessionState,
    window: VecDeque<Turn>,
}

type Shared = Arc<Mutex<Session>>;

/// The caches' hasher: foldhash, seeded per process (session ids come from clients).
type Hasher = foldhash::fast::FixedState;

type Sessions = Cache<SessionKey, Shared, Hasher>;

/// Sessions in this process.
pub struct MemoryGuard {
    sessions: Sessions,
    blocked: Sessions,
    /// Blocks placed minus blocks cleared (expired ones are not subtracted): while 0, no
    /// lookup goes to `blocked`.
    blocks: AtomicU64,
    max_sessions: u64,
    hasher: Hasher,
    /// (tenant, key, Idempotency-Key) → when first sent, ms; and (tenant, key, "failed " +
    /// fingerprint) → when its error answer came.
    idempotency: Cache<(String, String, String), i64, Hasher>,
    /// Each tenant's retry-budget counts.
    retries: Mutex<HashMap<String, router::window::SlidingCounts>>,
}

/// The idempotency map's key for an error answer to a fingerprint (a space, which no
/// `Idempotency-Key` holds, keeps the two apart).
fn failed_key(tenant_id: &str, key_id: &str, fingerprint: &str) -> (String, String, String) {
    (
        tenant_id.to_owned(),
        key_id.to_owned(),
        format!("failed {fingerprint}"),
    )
}

/// How long a block lasts when nobody clears it, unless set otherwise.
pub const DEFAULT_BLOCK_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

fn blocked_cache(max: u64, ttl: Duration, hasher: Hasher) -> Sessions {
    Cache::builder()
        .max_capacity(max)
        .time_to_live(ttl)
        .eviction_policy(EvictionPolicy::lru())
        .build_with_hasher(hasher)
}

fn seeded() -> Hasher {
    use std::hash::{BuildHasher, Hasher as _};
    let seed = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    Hasher::with_seed(seed)
}

impl std::fmt::Debug for MemoryGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryGuard")
            .field("sessions", &self.sessions.entry_count())
            .finish_non_exhaustive()
    }
}

impl MemoryGuard {
    /// Keep at most `max_sessions`, each for `ttl` after its latest request.
    /// (LRU, not moka's default TinyLFU: that one may refuse to admit a new session into a full
    /// cache, and a session never kept would never show its loop.) Blocks last
    /// [`DEFAULT_BLOCK_TTL`].
    pub fn new(max_sessions: u64, ttl: Duration) -> Self {
        let hasher = seeded();
        Self {
            sessions: Cache::builder()
                .max_capacity(max_sessions)
                .time_to_idle(ttl)
                .eviction_policy(EvictionPolicy::lru())
                .build_with_hasher(hasher.clone()),
            blocked: blocked_cache(max_sessions, DEFAULT_BLOCK_TTL, hasher.clone()),
            blocks: AtomicU64::new(0),
            max_sessions,
            idempotency: Cache::builder()
                .max_capacity(max_sessions)
                .eviction_policy(EvictionPolicy::lru())
                .build_with_hasher(hasher.clone()),
            retries: Mutex::new(HashMap::new()),
            hasher,
        }
    }

    /// Blocks last `ttl` unless cleared first.
    #[must_use]
    pub fn with_block_ttl(mut self, ttl: Duration) -> Self {
        self.blocked = blocked_cache(self.max_sessions, ttl, self.hasher.clone());
        self
    }

    fn find(&self, key: &SessionKey) -> Option<Shared> {
        if self.blocks.load(Ordering::Relaxed) > 0 {
            if let Some(s) = self.blocked.get(key) {
                return Some(s);
            }
        }
        self.sessions.get(key)
    }
}

fn info(key: &SessionKey, s: &Session) -> SessionInfo {
    SessionInfo {
        tenant_id: key.tenant_id.clone(),
        session: key.session.clone(),
        state: s.state.clone(),
        turns: s.window.len(),
    }
}

fn poisoned() -> GuardError {
    GuardError::Protocol("a session lock was poisoned".into())
}

#[async_trait]
impl GuardStore for MemoryGuard {
    async fn record(
        &self,
        key: &SessionKey,
        turn: &Turn,
        limits: Limits,
    ) -> Result<Seen, GuardError> {
        let shared = match self.find(key) {
            Some(s) => s,
            None => self
                .sessions
                .get_with(key.clone(), || Arc::new(Mutex::new(Session::default()))),
        };
        let mut s = shared.lock().map_err(|_| poisoned())?;
        let seen = Seen {
            state: s.state.clone(),
            window: s.window.iter().cloned().collect(),
            retry: s
                .window
                .back()
                .is_some_and(|t| t.request == turn.request && !t.answered),
        };
        if s.state.first_seen_ms == 0 {
            s.state.first_seen_ms = turn.at_ms;
        }
        s.state.last_seen_ms = turn.at_ms;
        s.state.requests += 1;
        if !seen.retry {
            s.window.push_back(turn.clone());
            while s.window.len() > limits.turns {
                s.window.pop_front();
            }
        }
        Ok(seen)
    }

    async fn mark(&self, key: &SessionKey, mark: &Mark) -> Result<(), GuardError> {
        let Some(shared) = self.find(key) else {
            return Ok(());
        };
        let mut s = shared.lock().map_err(|_| poisoned())?;
        let st = &mut s.state;
        if mark.flagged {
            st.flagged += 1;
        }
        if let Some(avoided) = mark.refused {
            st.refused += 1;
            st.avoided_micros += avoided;
        }
        if let Some(until) = mark.cooldown_until_ms {
            st.cooldown_until_ms = until;
        }
        if let Some(found) = &mark.found {
            st.last_loop = Some(found.clone());
        }
        if let Some(at) = mark.blocked_at_ms {
            // The first block stands: its time, and the expiry counted from it.
            if st.blocked_at_ms == 0 {
                st.blocked_at_ms = at;
            }
            drop(s);
            // Moved out of the active sessions: when the block expires the session is gone.
            if !self.blocked.contains_key(key) {
                self.blocked.insert(key.clone(), Arc::clone(&shared));
                self.blocks.fetch_add(1, Ordering::Relaxed);
            }
            self.sessions.invalidate(key);
        }
        Ok(())
    }

    async fn settle(
        &self,
        key: &SessionKey,
        request: u64,
        ok: bool,
        cost_micros: i64,
    ) -> Result<(), GuardError> {
        let Some(shared) = self.find(key) else {
            return Ok(());
        };
        let mut s = shared.lock().map_err(|_| poisoned())?;
        if ok {
            if let Some(t) = s.window.iter_mut().rev().find(|t| t.request == request) {
                t.answered = true;
            }
            s.state.last_cost_micros = cost_micros;
        }
        s.state.cost_micros += cost_micros;
        Ok(())
    }

    async fn list(&self, tenant_id: &str, limit: usize) -> Result<Vec<SessionInfo>, GuardError> {
        let mut all: HashMap<SessionKey, SessionInfo> = HashMap::new();
        for (key, shared) in self.sessions.iter() {
            if key.tenant_id == tenant_id {
                let s = shared.lock().map_err(|_| poisoned())?;
                all.insert((*key).clone(), info(&key, &s));
            }
        }
        for (key, shared) in self.blocked.iter() {
            if key.tenant_id == tenant_id {
                let s = shared.lock().map_err(|_| poisoned())?;
                all.insert((*key).clone(), info(&key, &s));
            }
        }
        let out: Vec<SessionInfo> = all.into_values().collect();
        Ok(super::store::most_recent(out, limit))
    }

    async fn get(&self, key: &SessionKey) -> Result<Option<SessionInfo>, GuardError> {
        let Some(shared) = self.find(key) else {
            return Ok(None);
        };
        let s = shared.lock().map_err(|_| poisoned())?;
        Ok(Some(info(key, &s)))
    }

    async fn clear(&self, key: &SessionKey) -> Result<bool, GuardError> {
        let blocked = self.blocked.remove(key).is_some();
        if blocked {
            self.blocks.fetch_sub(1, Ordering::Relaxed);
        }
        let held = self.sessions.remove(key).is_some();
        Ok(blocked || held)
    }

    async fn idempotency_seen(
        &self,
        tenant_id: &str,
        key_id: &str,
        idem: &str,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<bool, GuardError> {
        let key = (tenant_id.to_owned(), key_id.to_owned(), idem.to_owned());
        let seen = self
            .idempotency
            .get(&key)
            .is_some_and(|at| now_ms - at < ttl_ms);
        if !seen {
            self.idempotency.insert(key, now_ms);
        }
        Ok(seen)
    }

    async fn mark_failed(
        &self,
        tenant_id: &str,
        key_id: &str,
        fingerprint: &str,
        now_ms: i64,
        _ttl_ms: i64,
    ) -> Result<(), GuardError> {
        self.idempotency
            .insert(failed_key(tenant_id, key_id, fingerprint), now_ms);
        Ok(())
    }

    async fn retry_counts(
        &self,
        tenant_id: &str,
        known: Known<'_>,
        slot: u64,
        _ttl_ms: i64,
    ) -> Result<RetryCounts, GuardError> {
        let after_error = match known {
            Known::Retry => false,
            Known::IfFailed {
                key_id,
                fingerprint,
                now_ms,
                ttl_ms,
            } => self
                .idempotency
                .get(&failed_key(tenant_id, key_id, fingerprint))
                .is_some_and(|at| now_ms - at < ttl_ms),
        };
        let retry = after_error || known == Known::Retry;
        let mut tenants = self.retries.lock().unwrap_or_else(|p| p.into_inner());
        let counts = tenants.entry(tenant_id.to_owned()).or_default();
        counts.add(slot, 1, u32::from(retry));
        let (requests, retries) = counts.totals(slot);
        Ok(RetryCounts {
            requests,
            retries,
            after_error,
        })
    }
}
