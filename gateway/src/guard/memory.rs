//! The in-process [`GuardStore`]: one replica's sessions, bounded. At most `max_sessions` are
//! kept (the least recently seen go first) and each forgets itself `session_ttl_secs` after its
//! latest request. A blocked session is kept apart, where eviction of active sessions cannot
//! drop it, until it is cleared or `block_ttl_secs` after it was blocked; at most
//! `max_sessions` blocked sessions are kept (the oldest block goes first).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// One shard of [`Active`]: each session with when it was last seen (ms since the map's epoch).
type Shard = HashMap<SessionKey, (Shared, u64), Hasher>;

/// The active sessions: a map in shards, each bounded (the least recently seen go first), an
/// entry forgotten `ttl` after it was last seen. A lookup is one shard lock, one probe and one
/// timestamp: about a third of what a general-purpose cache with LRU and idle expiry cost here
/// per request (docs/benchmarks.md, the guard's cost).
struct Active {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    ttl_ms: u64,
    epoch: Instant,
    hasher: Hasher,
}

impl Active {
    fn new(max: u64, ttl: Duration, hasher: Hasher) -> Self {
        let max = usize::try_from(max).unwrap_or(usize::MAX).max(1);
        // Small bounds keep one shard, so "least recently seen" is exact where it is tested;
        // large ones spread the locks.
        let n = (max / 4096).clamp(1, 16);
        Self {
            shards: (0..n)
                .map(|_| Mutex::new(HashMap::with_hasher(hasher.clone())))
                .collect(),
            per_shard: max.div_ceil(n),
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            epoch: Instant::now(),
            hasher,
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn shard(&self, key: &SessionKey) -> &Mutex<Shard> {
        use std::hash::BuildHasher;
        let i = self.hasher.hash_one(key) as usize % self.shards.len();
        &self.shards[i]
    }

    fn lock<'a>(&self, shard: &'a Mutex<Shard>) -> std::sync::MutexGuard<'a, Shard> {
        // A panic while holding a shard leaves its map consistent (every update is one insert,
        // remove or timestamp store): keep using it.
        shard
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether an entry last seen at `last` is still kept at `now`.
    fn live(&self, last: u64, now: u64) -> bool {
        now.saturating_sub(last) <= self.ttl_ms
    }

    /// The session in `map`, seen now; `None` when absent or idle past the ttl (then
    /// forgotten).
    fn touch(&self, map: &mut Shard, key: &SessionKey, now: u64) -> Option<Shared> {
        let (s, last) = map.get_mut(key)?;
        if self.live(*last, now) {
            *last = now;
            return Some(Arc::clone(s));
        }
        map.remove(key);
        None
    }

    /// The session, seen now; `None` when absent or idle past the ttl (then forgotten).
    fn get(&self, key: &SessionKey) -> Option<Shared> {
        let now = self.now();
        self.touch(&mut self.lock(self.shard(key)), key, now)
    }

    /// The session, seen now, made when absent (evicting the least recently seen when full).
    fn get_or_insert(&self, key: &SessionKey) -> Shared {
        let now = self.now();
        let mut map = self.lock(self.shard(key));
        if let Some(s) = self.touch(&mut map, key, now) {
            return s;
        }
        if map.len() >= self.per_shard {
            self.evict(&mut map, now);
        }
        let s: Shared = Arc::default();
        map.insert(key.clone(), (Arc::clone(&s), now));
        s
    }

    /// Drop what is idle past the ttl and, if the shard is still full, its least recently seen
    /// sixteenth (at least one): a full scan once per many inserts, not one per insert.
    fn evict(&self, map: &mut Shard, now: u64) {
        map.retain(|_, (_, last)| self.live(*last, now));
        if map.len() < self.per_shard {
            return;
        }
        let mut seen: Vec<u64> = map.values().map(|(_, last)| *last).collect();
        let k = (self.per_shard / 16).max(1).min(seen.len());
        let (_, oldest, _) = seen.select_nth_unstable(k - 1);
        let cut = *oldest;
        let mut dropped = 0;
        // Ties at the cut go only as far as needed, so a burst seen in one millisecond is not
        // dropped whole.
        map.retain(|_, (_, last)| {
            if *last < cut || (*last == cut && dropped < k) {
                dropped += 1;
                false
            } else {
                true
            }
        });
    }

    fn remove(&self, key: &SessionKey) -> Option<Shared> {
        self.lock(self.shard(key)).remove(key).map(|(s, _)| s)
    }

    /// Every session not idle past the ttl.
    fn all(&self) -> Vec<(SessionKey, Shared)> {
        let now = self.now();
        self.shards
            .iter()
            .flat_map(|shard| {
                self.lock(shard)
                    .iter()
                    .filter(|(_, (_, last))| self.live(*last, now))
                    .map(|(k, (s, _))| (k.clone(), Arc::clone(s)))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    fn len(&self) -> usize {
        self.shards.iter().map(|s| self.lock(s).len()).sum()
    }
}

/// Sessions in this process.
pub struct MemoryGuard {
    sessions: Active,
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
    retries: Mutex<crate::FastMap<String, router::window::SlidingCounts>>,
    /// When the latest error answer was marked (ms; 0: never): while older than the retry
    /// window, no request can be a retry after an error, and none is looked up.
    latest_failure_ms: AtomicI64,
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
            .field("sessions", &self.sessions.len())
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
            sessions: Active::new(max_sessions, ttl, hasher.clone()),
            blocked: blocked_cache(max_sessions, DEFAULT_BLOCK_TTL, hasher.clone()),
            blocks: AtomicU64::new(0),
            max_sessions,
            idempotency: Cache::builder()
                .max_capacity(max_sessions)
                .eviction_policy(EvictionPolicy::lru())
                .build_with_hasher(hasher.clone()),
            retries: Mutex::new(crate::FastMap::default()),
            latest_failure_ms: AtomicI64::new(0),
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
        self.find_blocked(key).or_else(|| self.sessions.get(key))
    }

    /// The session if it is blocked (one atomic load while nothing is).
    fn find_blocked(&self, key: &SessionKey) -> Option<Shared> {
        if self.blocks.load(Ordering::Relaxed) > 0 {
            return self.blocked.get(key);
        }
        None
    }
}

fn info(key: &SessionKey, s: &Session) -> SessionInfo {
    SessionInfo {
        tenant_id: key.tenant_id().to_owned(),
        session: key.session().to_owned(),
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
        let shared = match self.find_blocked(key) {
            Some(s) => s,
            None => self.sessions.get_or_insert(key),
        };
        let mut s = shared.lock().map_err(|_| poisoned())?;
        let seen = Seen {
            state: s.state.clone(),
            window: if turn.may_repeat(s.window.iter()) {
                s.window.iter().cloned().collect()
            } else {
                Vec::new()
            },
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
            self.sessions.remove(key);
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
        for (key, shared) in self.sessions.all() {
            if key.tenant_id() == tenant_id {
                let s = shared.lock().map_err(|_| poisoned())?;
                let i = info(&key, &s);
                all.insert(key, i);
            }
        }
        for (key, shared) in self.blocked.iter() {
            if key.tenant_id() == tenant_id {
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
        self.latest_failure_ms.fetch_max(now_ms, Ordering::Relaxed);
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
            } => {
                let latest = self.latest_failure_ms.load(Ordering::Relaxed);
                latest > 0
                    && now_ms - latest < ttl_ms
                    && self
                        .idempotency
                        .get(&failed_key(tenant_id, key_id, fingerprint))
                        .is_some_and(|at| now_ms - at < ttl_ms)
            }
        };
        let retry = after_error || known == Known::Retry;
        let mut tenants = self.retries.lock().unwrap_or_else(|p| p.into_inner());
        let tally = |counts: &mut router::window::SlidingCounts| {
            counts.add(slot, 1, u32::from(retry));
            counts.totals(slot)
        };
        // Looked up by `&str`: a String is made only for a tenant's first request.
        let (requests, retries) = match tenants.get_mut(tenant_id) {
            Some(counts) => tally(counts),
            None => tally(tenants.entry(tenant_id.to_owned()).or_default()),
        };
        Ok(RetryCounts {
            requests,
            retries,
            after_error,
        })
    }
}

#[cfg(test)]
mod active_tests {
    use super::*;

    fn key(s: &str) -> SessionKey {
        SessionKey::new("t", s)
    }

    #[test]
    fn the_least_recently_seen_session_goes_first_when_full() {
        let a = Active::new(3, Duration::from_secs(3600), Hasher::with_seed(7));
        let first = a.get_or_insert(&key("a"));
        a.get_or_insert(&key("b"));
        a.get_or_insert(&key("c"));
        // Seen again: the same session, and now the most recent.
        assert!(Arc::ptr_eq(&first, &a.get_or_insert(&key("a"))));
        std::thread::sleep(Duration::from_millis(3));
        a.get(&key("a"));
        a.get(&key("c"));
        a.get_or_insert(&key("d"));
        assert_eq!(a.len(), 3);
        assert!(a.get(&key("b")).is_none(), "b was the least recently seen");
        for k in ["a", "c", "d"] {
            assert!(a.get(&key(k)).is_some(), "{k} kept");
        }
        assert!(a.remove(&key("a")).is_some());
        assert!(a.get(&key("a")).is_none());
        assert_eq!(a.all().len(), 2);
    }

    #[test]
    fn a_session_idle_past_the_ttl_is_forgotten() {
        let a = Active::new(10, Duration::from_millis(20), Hasher::with_seed(7));
        let old = a.get_or_insert(&key("a"));
        assert!(a.get(&key("a")).is_some());
        std::thread::sleep(Duration::from_millis(40));
        assert!(a.get(&key("a")).is_none());
        assert!(a.all().is_empty());
        let new = a.get_or_insert(&key("a"));
        assert!(!Arc::ptr_eq(&old, &new), "a fresh session");
    }

    #[test]
    fn a_large_bound_spreads_over_shards_and_holds() {
        let a = Active::new(100_000, Duration::from_secs(3600), Hasher::with_seed(7));
        assert_eq!(a.shards.len(), 16);
        for i in 0..120_000 {
            a.get_or_insert(&key(&i.to_string()));
        }
        let n = a.len();
        assert!((90_000..=100_000).contains(&n), "{n} sessions kept");
        assert!(a.get(&key("119999")).is_some(), "the newest is kept");
    }
}
