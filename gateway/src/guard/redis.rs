//! The Redis [`GuardStore`], shared by every replica: one session window whichever replica a
//! request reaches. Each call is one Lua script (one round trip, atomic); every key carries the
//! tenant's `{hash tag}` and is passed in `KEYS`, so the scripts run unchanged on Redis Cluster.
//! A request's turn and its retry-budget count, both made for every request while the loop check
//! is on, are one script (`admit.lua`, running the functions of `record.lua` and `retries.lua`).
//!
//! Keys, for tenant `t` and session `s`: `{g:t}:s:s` (a hash: counters, cooldown, block, the
//! latest loop), `{g:t}:w:s` (a list of encoded [`Turn`]s), `{g:t}:i` (a sorted set of the
//! tenant's sessions by latest request, for listing) and `{g:t}:bl` (its blocked sessions, a
//! sorted set by when they were blocked). A session expires `session_ttl_secs` after its latest
//! request; a blocked one `block_ttl_secs` after it was blocked, unless cleared first.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::{Script, ScriptInvocation, Value};

use super::store::{
    GuardError, GuardStore, Known, Limits, LoopNote, Mark, RetryCounts, Seen, SessionInfo,
    SessionKey, SessionState, Turn, FLAGS_AT,
};
use crate::redis_conn::RedisConn;

/// Session windows in Redis (a single node, or a cluster when several URLs are given).
pub struct RedisGuard {
    redis: RedisConn,
    record: Script,
    mark: Script,
    settle: Script,
    retries: Script,
    /// `record` and `retries` in one script.
    admit: Script,
    /// The clock [`Self::down_until_ms`] counts from.
    since: Instant,
    /// Calls fail at once until then (ms since `since`): Redis failed moments ago.
    down_until_ms: AtomicU64,
    /// How long a block lasts unless cleared, ms.
    block_ttl_ms: i64,
}

/// The function `record(keys, argv)`: a request's turn in its session's window.
const RECORD: &str = include_str!("lua/record.lua");
/// The function `retries(keys, argv)`: a request counted in its tenant's retry budget.
const RETRIES: &str = include_str!("lua/retries.lua");

/// How long calls are skipped after Redis failed.
const BACKOFF: Duration = Duration::from_secs(1);

impl std::fmt::Debug for RedisGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisGuard")
            .field("redis", &self.redis)
            .finish_non_exhaustive()
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The key marking an error answer to `fingerprint` for API key `key_id`.
fn failed_key(tenant_id: &str, key_id: &str, fingerprint: &str) -> String {
    format!("{}:failed:{key_id}:{fingerprint}", tag(tenant_id))
}

fn tag(tenant_id: &str) -> String {
    format!("{{g:{tenant_id}}}")
}

fn state_key(k: &SessionKey) -> String {
    format!("{}:s:{}", tag(k.tenant_id()), k.session())
}

fn window_key(k: &SessionKey) -> String {
    format!("{}:w:{}", tag(k.tenant_id()), k.session())
}

fn index_key(tenant_id: &str) -> String {
    format!("{}:i", tag(tenant_id))
}

fn blocked_key(tenant_id: &str) -> String {
    format!("{}:bl", tag(tenant_id))
}

impl RedisGuard {
    /// A store for `urls` (one URL: a single node; several: cluster seed nodes). Connects
    /// lazily; every call is bounded by `timeout`.
    pub fn new(urls: Vec<String>, timeout: Duration) -> Result<Self, GuardError> {
        Ok(Self {
            redis: RedisConn::new(urls, timeout)?,
            record: Script::new(&format!("{RECORD}\nreturn record(KEYS, ARGV)")),
            mark: Script::new(include_str!("lua/mark.lua")),
            retries: Script::new(&format!("{RETRIES}\nreturn retries(KEYS, ARGV)")),
            admit: Script::new(&format!(
                "{RECORD}\n{RETRIES}\n{}",
                include_str!("lua/admit.lua")
            )),
            settle: Script::new(include_str!("lua/settle.lua")),
            since: Instant::now(),
            down_until_ms: AtomicU64::new(0),
            block_ttl_ms: millis(super::memory::DEFAULT_BLOCK_TTL),
        })
    }

    /// Blocks last `ttl` unless cleared first.
    #[must_use]
    pub fn with_block_ttl(mut self, ttl: Duration) -> Self {
        self.block_ttl_ms = millis(ttl);
        self
    }

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

    async fn read(&self, key: &SessionKey) -> Result<Option<SessionInfo>, GuardError> {
        let fields: HashMap<String, Vec<u8>> = self
            .query(redis::cmd("HGETALL").arg(state_key(key)))
            .await?;
        if fields.is_empty() {
            return Ok(None);
        }
        let turns: usize = self.query(redis::cmd("LLEN").arg(window_key(key))).await?;
        Ok(Some(SessionInfo {
            tenant_id: key.tenant_id().to_owned(),
            session: key.session().to_owned(),
            state: state_of(&fields)?,
            turns,
        }))
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

fn state_of(fields: &HashMap<String, Vec<u8>>) -> Result<SessionState, GuardError> {
    let num = |name: &str| -> i64 {
        fields
            .get(name)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    };
    let count = |name: &str| u64::try_from(num(name)).unwrap_or(0);
    let last_loop = match fields.get("lp") {
        Some(json) => Some(
            serde_json::from_slice::<LoopNote>(json)
                .map_err(|e| GuardError::Protocol(format!("session loop note: {e}")))?,
        ),
        None => None,
    };
    Ok(SessionState {
        first_seen_ms: num("f"),
        last_seen_ms: num("l"),
        requests: count("n"),
        flagged: count("fl"),
        refused: count("rf"),
        cost_micros: num("c"),
        last_cost_micros: num("lc"),
        avoided_micros: num("av"),
        cooldown_until_ms: num("cd"),
        blocked_at_ms: num("bk"),
        last_loop,
    })
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
        let mut inv = self.record.prepare_invoke();
        record_args(&mut inv, key, turn, limits);
        seen_of(self.invoke(inv).await?, turn)
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
        retry_args(&mut inv, key.tenant_id(), known, slot, ttl_ms);
        let mut parts = array(self.invoke(inv).await?)?.into_iter();
        let (Some(seen), Some(counts)) = (parts.next(), parts.next()) else {
            return Err(GuardError::Protocol("admit: expected two parts".into()));
        };
        Ok((seen_of(seen, turn)?, counts_of(counts)?))
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
        self.invoke(inv).await.map(drop)
    }

    async fn settle(
        &self,
        key: &SessionKey,
        request: u64,
        ok: bool,
        cost_micros: i64,
    ) -> Result<(), GuardError> {
        let mut inv = self.settle.prepare_invoke();
        inv.key(state_key(key))
            .key(window_key(key))
            .arg(&Turn::request_bytes(request)[..])
            .arg(u8::from(ok))
            .arg(cost_micros)
            .arg(FLAGS_AT);
        self.invoke(inv).await.map(drop)
    }

    async fn list(&self, tenant_id: &str, limit: usize) -> Result<Vec<SessionInfo>, GuardError> {
        // The most recently seen sessions, then the most recently blocked (a blocked one may
        // have dropped out of the index).
        let mut ids: Vec<String> = Vec::new();
        for set in [index_key(tenant_id), blocked_key(tenant_id)] {
            let newest: Vec<String> = self
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
        self.read(key).await
    }

    async fn clear(&self, key: &SessionKey) -> Result<bool, GuardError> {
        let deleted: i64 = self
            .query(redis::cmd("DEL").arg(state_key(key)).arg(window_key(key)))
            .await?;
        // Same slot as the session's keys (the tenant's hash tag).
        for set in [index_key(key.tenant_id()), blocked_key(key.tenant_id())] {
            let _: i64 = self
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
        let key = format!("{}:idem:{key_id}:{idem}", tag(tenant_id));
        let set: Option<String> = self
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
        let key = failed_key(tenant_id, key_id, fingerprint);
        let _: Option<String> = self
            .query(
                redis::cmd("SET")
                    .arg(key)
                    .arg(1)
                    .arg("PX")
                    .arg(ttl_ms.max(1)),
            )
            .await?;
        Ok(())
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
        counts_of(self.invoke(inv).await?)
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
    let mut fields = HashMap::new();
    let mut flat = array(flat)?.into_iter();
    while let (Some(k), Some(v)) = (flat.next(), flat.next()) {
        fields.insert(String::from_utf8_lossy(&bytes(k)?).into_owned(), bytes(v)?);
    }
    let mut window: Vec<Turn> = array(window)?
        .into_iter()
        .filter_map(|t| bytes(t).ok().and_then(|b| Turn::decode(&b)))
        .collect();
    if !turn.may_repeat(window.iter()) {
        window.clear();
    }
    Ok(Seen {
        state: state_of(&fields)?,
        window,
        retry: matches!(retry, Value::Int(1)),
    })
}

/// `retries`' keys and arguments (see `lua/retries.lua`).
fn retry_args(
    inv: &mut ScriptInvocation<'_>,
    tenant_id: &str,
    known: Known<'_>,
    slot: u64,
    ttl_ms: i64,
) {
    inv.key(format!("{}:rt", tag(tenant_id)));
    let retry = match known {
        Known::Retry => "1",
        Known::IfFailed {
            key_id,
            fingerprint,
            ..
        } => {
            // Same hash tag: one slot in a Cluster.
            inv.key(failed_key(tenant_id, key_id, fingerprint));
            "failed"
        }
    };
    inv.arg(slot)
        .arg(retry)
        .arg(router::window::SlidingCounts::BUCKETS)
        .arg(ttl_ms.max(1));
}

/// `retries`' answer.
fn counts_of(answer: Value) -> Result<RetryCounts, GuardError> {
    let v = array(answer)?;
    let num = |i: usize| match v.get(i) {
        Some(Value::Int(n)) => Ok(u32::try_from(*n).unwrap_or(u32::MAX)),
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
