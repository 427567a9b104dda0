//! The Redis [`GuardStore`], shared by every replica: one session window whichever replica a
//! request reaches. Each call is one Lua script (one round trip, atomic); every key carries the
//! tenant's `{hash tag}` and is passed in `KEYS`, so the scripts run unchanged on Redis Cluster.
//! A request's turn and its retry-budget count, both made for every request while the loop check
//! is on, are one script (`admit.lua`, running the functions of `record.lua` and `retries.lua`).
//! A request's settle (its turn answered, its cost) is queued for one flusher task, which
//! sends every settle queued by then in one script per tenant; a turn of the tenant that this
//! gateway sends first takes the queued settles along (the same script, applied before the
//! turn is recorded). Under load nearly every settle rides on a turn: one round trip per
//! request instead of two. A settle taken for a call counts as on its way until that call is
//! answered, and a turn of its session identical to the request it settles waits for it (up to
//! the timeout): the flusher may take a settle and be preempted before writing its call while
//! the session's next turn is admitted on another thread, which would otherwise read the
//! answered turn as unanswered and the identical next one as a client's retry. Only an
//! identical request can be told apart that way, so no other turn waits.
//!
//! Keys, for tenant `t` and session `s`: `{g:t}:s:s` (a hash: counters, cooldown, block, the
//! latest loop, what a turn is judged by), `{g:t}:w:s` (a list of encoded [`Turn`]s, the newest
//! `turns` of them read, trimmed now and then), `{g:t}:i` (a sorted set of the
//! tenant's sessions by latest request, for listing) and `{g:t}:bl` (its blocked sessions, a
//! sorted set by when they were blocked). A session expires `session_ttl_secs` after its latest
//! request; a blocked one `block_ttl_secs` after it was blocked, unless cleared first.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::{Script, ScriptInvocation, Value};

use super::store::{
    GuardError, GuardStore, Known, Limits, LoopNote, Mark, RetryCounts, Seen, SessionInfo,
    SessionKey, SessionState, Turn, FLAGS_AT, TURN_BYTES,
};
use crate::redis_conn::RedisConn;

/// Session windows in Redis (a single node, or a cluster when several URLs are given).
pub struct RedisGuard {
    link: Arc<Link>,
    record: Script,
    mark: Script,
    mark_failed: Script,
    retries: Script,
    /// The queued settles, then `record` and `retries`, in one script.
    admit: Script,
    /// How long a block lasts unless cleared, ms.
    block_ttl_ms: i64,
}

/// The connection, and what every call through it shares (also held by a queued flush).
struct Link {
    redis: RedisConn,
    /// Queued settles on their own (`lua/settle.lua`).
    settle: Script,
    /// The clock [`Self::down_until_ms`] counts from.
    since: Instant,
    /// Calls fail at once until then (ms since `since`): Redis failed moments ago.
    down_until_ms: AtomicU64,
    /// Settles not yet sent, and the sessions of those on their way.
    queue: Mutex<Queue>,
    /// Woken when settles taken for a call are done with (sent or failed).
    sent: tokio::sync::Notify,
}

/// Settles waiting to be sent, by tenant (one tenant's keys share a slot, so they go in one
/// script).
#[derive(Default)]
struct Queue {
    by_tenant: HashMap<String, VecDeque<Settled>>,
    /// The flusher is running (it clears this when it finds the queue empty).
    scheduled: bool,
    /// Settles taken for a call not yet done with, by [`Self::slot`] of their session and
    /// request, and how many.
    sending: HashMap<u64, u32>,
    hasher: std::hash::RandomState,
}

/// Settles taken from the queue for a call: their sessions count as having settles on their
/// way until this is dropped (the call answered, failed or abandoned).
struct Taken<'a> {
    settles: Vec<Settled>,
    link: &'a Link,
}

/// One request settled (the arguments of [`GuardStore::settle`]).
struct Settled {
    key: SessionKey,
    request: u64,
    ok: bool,
    cost_micros: i64,
}

/// At most this many settles ride on one call (the rest wait for the next).
const SETTLES_PER_CALL: usize = 32;

/// At most this many settles wait per tenant; beyond it the oldest is dropped (Redis is not
/// answering, or a flood): a settle lost leaves its turn unanswered and its cost out of the
/// session's total (the ledger still has it).
const MAX_QUEUED: usize = 4096;

/// The function `record(keys, argv)`: a request's turn in its session's window.
const RECORD: &str = include_str!("lua/record.lua");
/// The function `retries(keys, argv)`: a request counted in its tenant's retry budget.
const RETRIES: &str = include_str!("lua/retries.lua");
/// The functions `settle(...)` and `settle_all(keys, k, argv, a, at)`: requests settled.
const SETTLE: &str = include_str!("lua/settle.lua");

/// How long calls are skipped after Redis failed.
const BACKOFF: Duration = Duration::from_secs(1);

impl std::fmt::Debug for RedisGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisGuard")
            .field("redis", &self.link.redis)
            .finish_non_exhaustive()
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The key marking an error answer to `fingerprint` for API key `key_id`.
fn failed_key(tenant_id: &str, key_id: &str, fingerprint: &str) -> String {
    tenant_key(tenant_id, &[":failed:", key_id, ":", fingerprint])
}

/// A key of tenant `tenant_id`: its hash tag (`{g:<tenant>}`, so all of a tenant's keys share
/// a Cluster slot) and `parts`, put together in one allocation.
fn tenant_key(tenant_id: &str, parts: &[&str]) -> String {
    let len = 4 + tenant_id.len() + parts.iter().map(|p| p.len()).sum::<usize>();
    let mut key = String::with_capacity(len);
    key.push_str("{g:");
    key.push_str(tenant_id);
    key.push('}');
    for part in parts {
        key.push_str(part);
    }
    key
}

fn state_key(k: &SessionKey) -> String {
    tenant_key(k.tenant_id(), &[":s:", k.session()])
}

fn window_key(k: &SessionKey) -> String {
    tenant_key(k.tenant_id(), &[":w:", k.session()])
}

/// The tenant's retry-budget hash (see `lua/retries.lua`).
fn budget_key(tenant_id: &str) -> String {
    tenant_key(tenant_id, &[":rt"])
}

fn index_key(tenant_id: &str) -> String {
    tenant_key(tenant_id, &[":i"])
}

fn blocked_key(tenant_id: &str) -> String {
    tenant_key(tenant_id, &[":bl"])
}

impl RedisGuard {
    /// A store for `urls` (one URL: a single node; several: cluster seed nodes). Connects
    /// lazily; every call is bounded by `timeout`.
    pub fn new(urls: Vec<String>, timeout: Duration) -> Result<Self, GuardError> {
        Ok(Self {
            link: Arc::new(Link {
                redis: RedisConn::new(urls, timeout)?,
                settle: Script::new(&format!(
                    "{SETTLE}\nreturn settle_all(KEYS, 1, ARGV, 2, tonumber(ARGV[1]) + 1)"
                )),
                since: Instant::now(),
                down_until_ms: AtomicU64::new(0),
                queue: Mutex::default(),
                sent: tokio::sync::Notify::new(),
            }),
            record: Script::new(&format!("{RECORD}\nreturn record(KEYS, ARGV)")),
            mark: Script::new(include_str!("lua/mark.lua")),
            mark_failed: Script::new(include_str!("lua/mark_failed.lua")),
            retries: Script::new(&format!("{RETRIES}\nreturn retries(KEYS, ARGV)")),
            admit: Script::new(&format!(
                "{RECORD}\n{RETRIES}\n{SETTLE}\n{}",
                include_str!("lua/admit.lua")
            )),
            block_ttl_ms: millis(super::memory::DEFAULT_BLOCK_TTL),
        })
    }

    /// Blocks last `ttl` unless cleared first.
    #[must_use]
    pub fn with_block_ttl(mut self, ttl: Duration) -> Self {
        self.block_ttl_ms = millis(ttl);
        self
    }

    /// Send `tenant_id`'s queued settles now (before reading its sessions, so that they are
    /// read as this gateway settled them).
    async fn flush_tenant(&self, tenant_id: &str) {
        loop {
            let taken = self.link.take(tenant_id);
            if taken.settles.is_empty() {
                return;
            }
            self.link.send_settles(&taken.settles).await;
        }
    }

    /// Once no settle of request `request` in `key`'s session is on its way (or the timeout
    /// passed), its tenant's queued settles (up to [`SETTLES_PER_CALL`]), taken for a call that
    /// records the request as the session's turn: so that an identical earlier turn this
    /// gateway answered is read as answered.
    async fn settled_for(&self, key: &SessionKey, request: u64) -> Taken<'_> {
        let deadline = tokio::time::Instant::now() + self.link.redis.timeout();
        loop {
            {
                let mut q = lock(&self.link.queue);
                if !q.is_sending(key, request) || tokio::time::Instant::now() >= deadline {
                    return Taken {
                        settles: q.take(key.tenant_id()),
                        link: &self.link,
                    };
                }
            }
            let mut sent = std::pin::pin!(self.link.sent.notified());
            // Registered, then checked again: a call done with before this still counts.
            sent.as_mut().enable();
            if lock(&self.link.queue).is_sending(key, request) {
                // Past the deadline the check above lets it through.
                let _ = tokio::time::timeout_at(deadline, sent).await;
            }
        }
    }

    /// Send `key`'s tenant's queued settles once no settle of `request` in its session is on
    /// its way.
    async fn flush_for(&self, key: &SessionKey, request: u64) {
        loop {
            let taken = self.settled_for(key, request).await;
            if taken.settles.is_empty() {
                return;
            }
            self.link.send_settles(&taken.settles).await;
        }
    }

    /// One session as Redis has it (the caller sends the tenant's queued settles first).
    async fn read(&self, key: &SessionKey) -> Result<Option<SessionInfo>, GuardError> {
        let fields = match self
            .link
            .query::<Value>(redis::cmd("HGETALL").arg(state_key(key)))
            .await?
        {
            // RESP3 answers a map.
            Value::Map(kv) => kv.into_iter().flat_map(|(k, v)| [k, v]).collect(),
            flat => array(flat)?,
        };
        if fields.is_empty() {
            return Ok(None);
        }
        // The window's steps (`st`, 8 bytes a turn) say how many turns it keeps; the list may
        // hold a few more until its next trim (lua/record.lua). A session written before `st`
        // existed is counted in its list.
        let turns = match pairs(&fields).find(|(field, _)| *field == b"st") {
            Some((_, steps)) => steps.len() / 8,
            None => {
                self.link
                    .query(redis::cmd("LLEN").arg(window_key(key)))
                    .await?
            }
        };
        Ok(Some(SessionInfo {
            tenant_id: key.tenant_id().to_owned(),
            session: key.session().to_owned(),
            state: state_of(pairs(&fields))?,
            turns,
        }))
    }
}

impl Link {
    /// Run `call` bounded by the timeout. After a failure every call fails at once for
    /// [`BACKOFF`], so an outage costs the requests on the path one timeout, not one each.
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, GuardError>>,
    ) -> Result<T, GuardError> {
        let now = self.since.elapsed().as_millis();
        if now < u128::from(self.down_until_ms.load(Ordering::Relaxed)) {
            return Err(GuardError::Unavailable);
        }
        let result = match tokio::time::timeout(self.redis.timeout(), call).await {
            Ok(r) => r,
            Err(_) => Err(GuardError::Timeout),
        };
        if result.is_err() {
            let until = self.since.elapsed() + BACKOFF;
            self.down_until_ms.store(
                u64::try_from(until.as_millis()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
        }
        result
    }

    async fn invoke(&self, inv: ScriptInvocation<'_>) -> Result<Value, GuardError> {
        self.bounded(async {
            let mut conn = self.redis.get().await?;
            Ok(inv.invoke_async(&mut conn).await?)
        })
        .await
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, GuardError> {
        self.bounded(async {
            let mut conn = self.redis.get().await?;
            Ok(cmd.query_async(&mut conn).await?)
        })
        .await
    }

    /// Up to [`SETTLES_PER_CALL`] of `tenant_id`'s queued settles, taken for a call.
    fn take(&self, tenant_id: &str) -> Taken<'_> {
        Taken {
            settles: lock(&self.queue).take(tenant_id),
            link: self,
        }
    }

    /// Send every settle queued (each tenant's in calls of its own).
    async fn send_all(&self) {
        // Bound first: the lock must not be held across the sends.
        let all = lock(&self.queue).take_all();
        for settles in all {
            let taken = Taken {
                settles,
                link: self,
            };
            self.send_settles(&taken.settles).await;
        }
    }

    /// Send one tenant's settles on their own, [`SETTLES_PER_CALL`] to a call. A failure is
    /// logged: the turns stay unanswered (the next identical request reads as a retry).
    async fn send_settles(&self, settles: &[Settled]) {
        for chunk in settles.chunks(SETTLES_PER_CALL) {
            let mut inv = self.settle.prepare_invoke();
            inv.arg(FLAGS_AT);
            settle_args(&mut inv, chunk);
            if let Err(e) = self.invoke(inv).await {
                tracing::debug!(error = %e, settles = chunk.len(), "guard store: settles not recorded");
            }
        }
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if !self.settles.is_empty() {
            lock(&self.link.queue).done(&self.settles);
            self.link.sent.notify_waiters();
        }
    }
}

impl Queue {
    /// Queue `settled` behind its tenant's (dropping the oldest beyond [`MAX_QUEUED`]); whether
    /// a flusher must be started (none is running).
    fn push(&mut self, settled: Settled) -> bool {
        match self.by_tenant.get_mut(settled.key.tenant_id()) {
            Some(list) => {
                if list.len() >= MAX_QUEUED {
                    list.pop_front();
                }
                list.push_back(settled);
            }
            None => {
                self.by_tenant.insert(
                    settled.key.tenant_id().to_owned(),
                    VecDeque::from([settled]),
                );
            }
        }
        !std::mem::replace(&mut self.scheduled, true)
    }

    /// Up to [`SETTLES_PER_CALL`] of `tenant_id`'s settles, oldest first, counted as on
    /// their way until [`Self::done`].
    fn take(&mut self, tenant_id: &str) -> Vec<Settled> {
        let taken: Vec<Settled> = match self.by_tenant.get_mut(tenant_id) {
            Some(list) if list.len() > SETTLES_PER_CALL => list.drain(..SETTLES_PER_CALL).collect(),
            Some(list) => std::mem::take(list).into(),
            None => Vec::new(),
        };
        self.sending_of(&taken);
        taken
    }

    /// Every tenant's settles (each tenant's a list of its own, oldest first), counted as on
    /// their way until [`Self::done`].
    fn take_all(&mut self) -> Vec<Vec<Settled>> {
        let all: Vec<Vec<Settled>> = std::mem::take(&mut self.by_tenant)
            .into_values()
            .filter(|list| !list.is_empty())
            .map(Vec::from)
            .collect();
        for settles in &all {
            self.sending_of(settles);
        }
        all
    }

    /// Where a settle of `request` in `key`'s session is counted (two that share one only make
    /// a turn wait when it need not, for at most the timeout).
    fn slot(&self, key: &SessionKey, request: u64) -> u64 {
        use std::hash::BuildHasher as _;
        self.hasher.hash_one((key, request))
    }

    fn sending_of(&mut self, settles: &[Settled]) {
        for s in settles {
            let slot = self.slot(&s.key, s.request);
            *self.sending.entry(slot).or_insert(0) += 1;
        }
    }

    /// `settles` (taken earlier) are no longer on their way.
    fn done(&mut self, settles: &[Settled]) {
        for s in settles {
            let slot = self.slot(&s.key, s.request);
            if let Some(n) = self.sending.get_mut(&slot) {
                *n -= 1;
                if *n == 0 {
                    self.sending.remove(&slot);
                }
            }
        }
    }

    /// Whether a settle of `request` in `key`'s session is on its way.
    fn is_sending(&self, key: &SessionKey, request: u64) -> bool {
        !self.sending.is_empty() && self.sending.contains_key(&self.slot(key, request))
    }
}

/// Lock the queue (a panic while it was held leaves nothing half-done in it).
fn lock(queue: &Mutex<Queue>) -> std::sync::MutexGuard<'_, Queue> {
    queue
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Send every settle queued, and again while more arrive during a send: one flush at a time,
/// so settles queued while one is on its way go together in the next (and a turn of their
/// tenant sent meanwhile takes its own along). It starts once the task that queued the first
/// settle lets go of its thread, so a settle reaches Redis about as soon as a call of its own
/// would have.
async fn flush_later(link: Arc<Link>) {
    tokio::task::yield_now().await;
    loop {
        {
            let mut q = lock(&link.queue);
            if q.by_tenant.values().all(VecDeque::is_empty) {
                // Cleared under the lock: a settle queued after this schedules the next flush.
                q.scheduled = false;
                return;
            }
        }
        link.send_all().await;
    }
}

/// The keys and arguments of `settles` for `settle_all` (two keys and three arguments each).
fn settle_args(inv: &mut ScriptInvocation<'_>, settles: &[Settled]) {
    for s in settles {
        inv.key(state_key(&s.key))
            .key(window_key(&s.key))
            .arg(&Turn::request_bytes(s.request)[..])
            .arg(u8::from(s.ok))
            .arg(s.cost_micros);
    }
}

fn bytes(v: Value) -> Result<Vec<u8>, GuardError> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        Value::Int(n) => Ok(n.to_string().into_bytes()),
        other => Err(GuardError::Protocol(format!(
            "expected a string, got {other:?}"
        ))),
    }
}

fn array(v: Value) -> Result<Vec<Value>, GuardError> {
    match v {
        Value::Array(items) => Ok(items),
        Value::Nil => Ok(Vec::new()),
        other => Err(GuardError::Protocol(format!(
            "expected an array, got {other:?}"
        ))),
    }
}

/// A session's state from its hash's fields and values (`HGETALL`'s pairs, in any order;
/// fields this version does not know are skipped).
fn state_of<'a>(
    pairs: impl Iterator<Item = (&'a [u8], &'a [u8])>,
) -> Result<SessionState, GuardError> {
    let num = |v: &[u8]| -> i64 {
        std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    };
    let count = |v: &[u8]| u64::try_from(num(v)).unwrap_or(0);
    let mut state = SessionState::default();
    for (field, value) in pairs {
        match field {
            b"f" => state.first_seen_ms = num(value),
            b"l" => state.last_seen_ms = num(value),
            b"n" => state.requests = count(value),
            b"fl" => state.flagged = count(value),
            b"rf" => state.refused = count(value),
            b"c" => state.cost_micros = num(value),
            b"lc" => state.last_cost_micros = num(value),
            b"av" => state.avoided_micros = num(value),
            b"cd" => state.cooldown_until_ms = num(value),
            b"bk" => state.blocked_at_ms = num(value),
            b"lp" => {
                state.last_loop = Some(
                    serde_json::from_slice::<LoopNote>(value)
                        .map_err(|e| GuardError::Protocol(format!("session loop note: {e}")))?,
                );
            }
            _ => {}
        }
    }
    Ok(state)
}

/// The pairs of a flat `[field, value, field, value, ...]` reply (a string's bytes, an
/// integer's digits are not expected here and end the pairs).
fn pairs(flat: &[Value]) -> impl Iterator<Item = (&[u8], &[u8])> {
    flat.chunks_exact(2).map_while(|kv| match (&kv[0], &kv[1]) {
        (Value::BulkString(k), Value::BulkString(v)) => Some((k.as_slice(), v.as_slice())),
        _ => None,
    })
}

/// The pairs of `record.lua`'s state: fields and values joined by NUL bytes (none when empty).
fn joined_pairs(joined: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    let mut parts = joined.split(|&b| b == 0);
    std::iter::from_fn(move || Some((parts.next()?, parts.next()?)))
}

fn opt(v: Option<i64>) -> String {
    v.map(|n| n.to_string()).unwrap_or_default()
}

#[async_trait]
impl GuardStore for RedisGuard {
    async fn record(
        &self,
        key: &SessionKey,
        turn: &Turn,
        limits: Limits,
    ) -> Result<Seen, GuardError> {
        self.flush_for(key, turn.request).await;
        let mut inv = self.record.prepare_invoke();
        record_args(&mut inv, key, turn, limits);
        seen_of(self.link.invoke(inv).await?, turn)
    }

    async fn record_and_count(
        &self,
        key: &SessionKey,
        turn: &Turn,
        limits: Limits,
        known: Known<'_>,
        slot: u64,
        ttl_ms: i64,
    ) -> Result<(Seen, RetryCounts), GuardError> {
        let mut inv = self.admit.prepare_invoke();
        record_args(&mut inv, key, turn, limits);
        // The settles' keys follow record's three and retries' one or two (admit.lua's ARGV[12]).
        let first_settle = 3 + retry_args(&mut inv, key.tenant_id(), known, slot, ttl_ms) + 1;
        // The tenant's queued settles ride along (applied before the turn is recorded); if the
        // call fails they are lost with it, as their own call would have been.
        let taken = self.settled_for(key, turn.request).await;
        inv.arg(first_settle);
        settle_args(&mut inv, &taken.settles);
        let answer = self.link.invoke(inv).await;
        drop(taken);
        admitted(&bytes(answer?)?, turn)
    }

    async fn mark(&self, key: &SessionKey, mark: &Mark) -> Result<(), GuardError> {
        let found = match &mark.found {
            Some(f) => serde_json::to_string(f).map_err(|e| GuardError::Protocol(e.to_string()))?,
            None => String::new(),
        };
        let mut inv = self.mark.prepare_invoke();
        inv.key(state_key(key))
            .key(window_key(key))
            .key(blocked_key(key.tenant_id()))
            .arg(u8::from(mark.flagged))
            .arg(u8::from(mark.refused.is_some()))
            .arg(mark.refused.unwrap_or(0))
            .arg(opt(mark.cooldown_until_ms))
            .arg(opt(mark.blocked_at_ms))
            .arg(found)
            .arg(key.session())
            .arg(self.block_ttl_ms);
        self.link.invoke(inv).await.map(drop)
    }

    async fn settle(
        &self,
        key: &SessionKey,
        request: u64,
        ok: bool,
        cost_micros: i64,
    ) -> Result<(), GuardError> {
        let settled = Settled {
            key: key.clone(),
            request,
            ok,
            cost_micros,
        };
        if lock(&self.link.queue).push(settled) {
            tokio::spawn(flush_later(Arc::clone(&self.link)));
        }
        Ok(())
    }

    async fn flush(&self) {
        self.link.send_all().await;
    }

    async fn list(&self, tenant_id: &str, limit: usize) -> Result<Vec<SessionInfo>, GuardError> {
        self.flush_tenant(tenant_id).await;
        // The most recently seen sessions, then the most recently blocked (a blocked one may
        // have dropped out of the index).
        let mut ids: Vec<String> = Vec::new();
        for set in [index_key(tenant_id), blocked_key(tenant_id)] {
            let newest: Vec<String> = self
                .link
                .query(
                    redis::cmd("ZREVRANGE")
                        .arg(set)
                        .arg(0)
                        .arg(limit.saturating_sub(1)),
                )
                .await?;
            for id in newest {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        let mut out = Vec::new();
        for session in ids {
            let key = SessionKey::new(tenant_id, &session);
            if let Some(info) = self.read(&key).await? {
                out.push(info);
            }
        }
        Ok(super::store::most_recent(out, limit))
    }

    async fn get(&self, key: &SessionKey) -> Result<Option<SessionInfo>, GuardError> {
        self.flush_tenant(key.tenant_id()).await;
        self.read(key).await
    }

    async fn clear(&self, key: &SessionKey) -> Result<bool, GuardError> {
        let deleted: i64 = self
            .link
            .query(redis::cmd("DEL").arg(state_key(key)).arg(window_key(key)))
            .await?;
        // Same slot as the session's keys (the tenant's hash tag).
        for set in [index_key(key.tenant_id()), blocked_key(key.tenant_id())] {
            let _: i64 = self
                .link
                .query(redis::cmd("ZREM").arg(set).arg(key.session()))
                .await?;
        }
        Ok(deleted > 0)
    }

    async fn idempotency_seen(
        &self,
        tenant_id: &str,
        key_id: &str,
        idem: &str,
        _now_ms: i64,
        ttl_ms: i64,
    ) -> Result<bool, GuardError> {
        let key = tenant_key(tenant_id, &[":idem:", key_id, ":", idem]);
        let set: Option<String> = self
            .link
            .query(
                redis::cmd("SET")
                    .arg(key)
                    .arg(1)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl_ms.max(1)),
            )
            .await?;
        Ok(set.is_none())
    }

    async fn mark_failed(
        &self,
        tenant_id: &str,
        key_id: &str,
        fingerprint: &str,
        _now_ms: i64,
        ttl_ms: i64,
    ) -> Result<(), GuardError> {
        let mut inv = self.mark_failed.prepare_invoke();
        inv.key(failed_key(tenant_id, key_id, fingerprint))
            .key(budget_key(tenant_id))
            .arg(ttl_ms.max(1));
        self.link.invoke(inv).await.map(drop)
    }

    async fn retry_counts(
        &self,
        tenant_id: &str,
        known: Known<'_>,
        slot: u64,
        ttl_ms: i64,
    ) -> Result<RetryCounts, GuardError> {
        let mut inv = self.retries.prepare_invoke();
        retry_args(&mut inv, tenant_id, known, slot, ttl_ms);
        counts_of(self.link.invoke(inv).await?)
    }
}

/// `record`'s keys and arguments (see `lua/record.lua`).
fn record_args(inv: &mut ScriptInvocation<'_>, key: &SessionKey, turn: &Turn, limits: Limits) {
    inv.key(state_key(key))
        .key(window_key(key))
        .key(index_key(key.tenant_id()))
        .arg(turn.at_ms)
        .arg(turn.encode())
        .arg(&Turn::request_bytes(turn.request)[..])
        .arg(limits.turns)
        .arg(limits.ttl_ms)
        .arg(key.session())
        .arg(FLAGS_AT);
}

/// `record`'s answer: the session before `turn`.
fn seen_of(answer: Value, turn: &Turn) -> Result<Seen, GuardError> {
    let mut parts = array(answer)?.into_iter();
    let (Some(flat), Some(window), Some(retry)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(GuardError::Protocol("record: expected three parts".into()));
    };
    let window = array(window)?
        .into_iter()
        .filter_map(|t| bytes(t).ok().and_then(|b| Turn::decode(&b)))
        .collect();
    seen(&bytes(flat)?, window, matches!(retry, Value::Int(1)), turn)
}

/// The session before `turn` from its NUL-joined `state`, its `window` and whether `turn` is a
/// retry; the window is dropped unless a loop could end at `turn`.
fn seen(state: &[u8], mut window: Vec<Turn>, retry: bool, turn: &Turn) -> Result<Seen, GuardError> {
    if !turn.may_repeat(window.iter()) {
        window.clear();
    }
    Ok(Seen {
        state: state_of(joined_pairs(state))?,
        window,
        retry,
    })
}

/// `admit.lua`'s answer, one string: `retry requests retries after_error state_length\n`, the
/// state (NUL-joined), then the window's turns, [`TURN_BYTES`] each.
fn admitted(answer: &[u8], turn: &Turn) -> Result<(Seen, RetryCounts), GuardError> {
    let bad = |what: &str| GuardError::Protocol(format!("admit: {what}"));
    let line = answer
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| bad("no header line"))?;
    let mut numbers = std::str::from_utf8(&answer[..line])
        .map_err(|_| bad("header not text"))?
        .split(' ')
        .map(str::parse::<i64>);
    let mut next = || {
        numbers
            .next()
            .and_then(Result::ok)
            .ok_or_else(|| bad("header numbers"))
    };
    let (retry, requests, retries, after_error, state_len) =
        (next()?, next()?, next()?, next()?, next()?);
    let rest = &answer[line + 1..];
    let state_len = usize::try_from(state_len).map_err(|_| bad("state length"))?;
    if state_len > rest.len() || !(rest.len() - state_len).is_multiple_of(TURN_BYTES) {
        return Err(bad("state and window lengths"));
    }
    let (state, turns) = rest.split_at(state_len);
    let window = turns
        .chunks_exact(TURN_BYTES)
        .filter_map(Turn::decode)
        .collect();
    Ok((
        seen(state, window, retry == 1, turn)?,
        RetryCounts {
            requests: count(requests),
            retries: count(retries),
            after_error: after_error == 1,
        },
    ))
}

/// `retries`' keys and arguments (see `lua/retries.lua`); how many keys (1 or 2).
fn retry_args(
    inv: &mut ScriptInvocation<'_>,
    tenant_id: &str,
    known: Known<'_>,
    slot: u64,
    ttl_ms: i64,
) -> usize {
    inv.key(budget_key(tenant_id));
    let (retry, keys) = match known {
        Known::Retry => ("1", 1),
        Known::IfFailed {
            key_id,
            fingerprint,
            ..
        } => {
            // Same hash tag: one slot in a Cluster.
            inv.key(failed_key(tenant_id, key_id, fingerprint));
            ("failed", 2)
        }
    };
    inv.arg(slot)
        .arg(retry)
        .arg(router::window::SlidingCounts::BUCKETS)
        .arg(ttl_ms.max(1));
    keys
}

/// A retry-budget count as the scripts answer it (a negative one, counts gone out of step,
/// reads as none).
fn count(n: i64) -> u32 {
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

/// `retries`' answer.
fn counts_of(answer: Value) -> Result<RetryCounts, GuardError> {
    let v = array(answer)?;
    let num = |i: usize| match v.get(i) {
        Some(Value::Int(n)) => Ok(count(*n)),
        other => Err(GuardError::Protocol(format!(
            "retry counts: expected an integer, got {other:?}"
        ))),
    };
    Ok(RetryCounts {
        requests: num(0)?,
        retries: num(1)?,
        after_error: num(2)? == 1,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_the_names_earlier_versions_stored() {
        let k = SessionKey::new("ten_1", "run:7");
        assert_eq!(state_key(&k), "{g:ten_1}:s:run:7");
        assert_eq!(window_key(&k), "{g:ten_1}:w:run:7");
        assert_eq!(index_key("ten_1"), "{g:ten_1}:i");
        assert_eq!(blocked_key("ten_1"), "{g:ten_1}:bl");
        assert_eq!(budget_key("ten_1"), "{g:ten_1}:rt");
        assert_eq!(
            failed_key("ten_1", "key_2", "fp"),
            "{g:ten_1}:failed:key_2:fp"
        );
    }

    #[test]
    fn a_state_is_read_from_its_fields_in_any_order() {
        let flat: Vec<Value> = [
            ("n", "3"),
            ("zz", "unknown"),
            ("f", "1000"),
            ("lc", "250"),
            ("l", "1200"),
            ("bk", "1300"),
            (
                "lp",
                r#"{"what":"tool call `x`","repeats":3,"period":1,"at_ms":1100}"#,
            ),
        ]
        .iter()
        .flat_map(|(k, v)| {
            [
                Value::BulkString(k.as_bytes().to_vec()),
                Value::BulkString(v.as_bytes().to_vec()),
            ]
        })
        .collect();
        let state = state_of(pairs(&flat)).unwrap();
        assert_eq!(
            (
                state.first_seen_ms,
                state.last_seen_ms,
                state.requests,
                state.last_cost_micros,
                state.blocked_at_ms,
                state.flagged
            ),
            (1000, 1200, 3, 250, 1300, 0)
        );
        assert_eq!(state.last_loop.map(|l| l.repeats), Some(3));
        // The same fields as record.lua answers them: joined by NUL bytes.
        let joined: Vec<u8> = flat
            .iter()
            .map(|v| match v {
                Value::BulkString(b) => b.clone(),
                _ => unreachable!(),
            })
            .collect::<Vec<_>>()
            .join(&0);
        assert_eq!(
            state_of(joined_pairs(&joined)).unwrap(),
            state_of(pairs(&flat)).unwrap()
        );
        assert_eq!(joined_pairs(b"").count(), 0);
        let empty_value: Vec<_> = joined_pairs(b"cd\0\0n\x003").collect();
        assert_eq!(
            empty_value,
            vec![(&b"cd"[..], &b""[..]), (&b"n"[..], &b"3"[..])]
        );
    }

    #[test]
    fn a_full_queue_drops_its_oldest_settle_and_hands_them_out_oldest_first() {
        let mut q = Queue::default();
        let settled = |tenant: &str, request: u64| Settled {
            key: SessionKey::new(tenant, "s"),
            request,
            ok: true,
            cost_micros: 1,
        };
        assert!(q.push(settled("a", 0)), "the first settle starts a flusher");
        for request in 1..=MAX_QUEUED as u64 {
            assert!(!q.push(settled("a", request)), "one flusher at a time");
        }
        q.push(settled("b", 7));
        assert_eq!(q.by_tenant["a"].len(), MAX_QUEUED);
        let first = q.take("a");
        assert_eq!(first.len(), SETTLES_PER_CALL);
        assert_eq!(
            first.iter().map(|s| s.request).take(2).collect::<Vec<_>>(),
            [1, 2],
            "the oldest (0) was dropped"
        );
        let mut rest = 0;
        loop {
            let more = q.take("a");
            if more.is_empty() {
                break;
            }
            rest += more.len();
        }
        assert_eq!(rest, MAX_QUEUED - SETTLES_PER_CALL);
        assert_eq!(q.take("b").len(), 1);
    }

    #[tokio::test]
    async fn a_turn_waits_for_its_sessions_settles_on_their_way_and_no_longer_than_the_timeout() {
        // Nothing here reaches Redis (it connects on the first call).
        let guard = RedisGuard::new(
            vec!["redis://127.0.0.1:1".to_owned()],
            Duration::from_millis(300),
        )
        .unwrap();
        let (s, other) = (SessionKey::new("a", "s"), SessionKey::new("a", "t"));
        let settled = |key: &SessionKey, request: u64| Settled {
            key: key.clone(),
            request,
            ok: true,
            cost_micros: 1,
        };
        lock(&guard.link.queue).push(settled(&s, 1));
        // A flusher takes s's settle of request 1 and has not written its call yet.
        let on_its_way = guard.link.take("a");
        assert_eq!(on_its_way.settles.len(), 1);
        lock(&guard.link.queue).push(settled(&other, 2));

        // Another session's turn goes at once, taking the tenant's queued settles along; so
        // does a turn of s that is not the request on its way (it cannot be taken for a retry
        // of it).
        let taken = guard.settled_for(&other, 1).await;
        assert_eq!(
            taken.settles.iter().map(|t| t.request).collect::<Vec<_>>(),
            [2]
        );
        drop(taken);
        drop(guard.settled_for(&s, 5).await);

        // s's identical next turn waits until the settle's call is done with, then goes.
        let mut next = std::pin::pin!(guard.settled_for(&s, 1));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut next)
                .await
                .is_err(),
            "the turn went before its session's settle reached Redis"
        );
        drop(on_its_way);
        let taken = tokio::time::timeout(Duration::from_millis(200), next)
            .await
            .expect("the turn still waits after the settle's call is done");
        assert!(taken.settles.is_empty());
        drop(taken);
        assert!(lock(&guard.link.queue).sending.is_empty());

        // A call that never answers holds the turn for the timeout, no longer.
        lock(&guard.link.queue).push(settled(&s, 3));
        let stuck = guard.link.take("a");
        let started = tokio::time::Instant::now();
        drop(guard.settled_for(&s, 3).await);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(290) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        drop(stuck);
        assert!(lock(&guard.link.queue).sending.is_empty());
    }

    #[test]
    fn settles_taken_count_as_on_their_way_until_done_with() {
        let mut q = Queue::default();
        let settled = |tenant: &str, session: &str| Settled {
            key: SessionKey::new(tenant, session),
            request: 1,
            ok: true,
            cost_micros: 1,
        };
        for (tenant, session) in [("a", "s"), ("a", "s"), ("a", "t"), ("b", "s")] {
            q.push(settled(tenant, session));
        }
        let a = q.take("a");
        assert!(q.is_sending(&SessionKey::new("a", "s"), 1));
        assert!(
            !q.is_sending(&SessionKey::new("a", "s"), 2),
            "another request"
        );
        assert!(!q.is_sending(&SessionKey::new("b", "s"), 1));
        let rest = q.take_all();
        assert_eq!(rest.len(), 1);
        assert!(q.is_sending(&SessionKey::new("b", "s"), 1));
        q.done(&a[..1]);
        assert!(
            q.is_sending(&SessionKey::new("a", "s"), 1),
            "one of two done"
        );
        q.done(&a[1..]);
        q.done(&rest[0]);
        assert!(q.sending.is_empty());
    }

    #[test]
    fn an_admit_answer_is_read_from_its_one_string() {
        let turn = |at_ms: i64, step: u64, request: u64| Turn {
            at_ms,
            step,
            request,
            text: false,
            answered: false,
            sketch: None,
        };
        let state = b"n\x002\x00lc\x0040";
        let (a, b) = (turn(1, 5, 50), turn(2, 6, 60));
        let mut answer = format!("0 7 1 1 {}\n", state.len()).into_bytes();
        answer.extend_from_slice(state);
        answer.extend_from_slice(&a.encode());
        answer.extend_from_slice(&b.encode());
        // The same step as the first turn: the window comes back.
        let (seen, counts) = admitted(&answer, &turn(3, 5, 70)).unwrap();
        assert_eq!(seen.window, vec![a, b]);
        assert!(!seen.retry);
        assert_eq!((seen.state.requests, seen.state.last_cost_micros), (2, 40));
        assert_eq!(
            (counts.requests, counts.retries, counts.after_error),
            (7, 1, true)
        );
        // A new step: no window; a retry, nothing else.
        let (seen, _) = admitted(&answer, &turn(3, 9, 90)).unwrap();
        assert!(seen.window.is_empty());
        let (seen, counts) = admitted(b"1 -1 1 0 0\n", &turn(3, 9, 90)).unwrap();
        assert!(seen.retry && !counts.after_error);
        assert_eq!(counts.requests, 0, "a count out of step reads as none");
        assert_eq!(seen.state, SessionState::default());
        // Anything else is a protocol error, not a guess.
        for bad in [
            &b""[..],
            b"1 1 1 0\n",
            b"1 1 1 0 5\nab",
            b"1 1 1 0 0\nabc",
            b"x 1 1 0 0\n",
        ] {
            assert!(admitted(bad, &turn(3, 9, 90)).is_err(), "{bad:?}");
        }
    }
}
