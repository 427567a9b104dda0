//! The Redis [`BudgetStore`], shared by every gateway replica. Each operation is one Lua script
//! (one round trip, atomic); every key it touches carries the tenant's `{hash tag}` and is passed
//! in `KEYS`, so the scripts run unchanged on Redis Cluster.

use std::time::Duration;

use async_trait::async_trait;
use redis::{Script, ScriptInvocation, Value};

use crate::redis_conn::RedisConn;

use super::{
    marker_key, BudgetError, BudgetStore, CommitRequest, CounterState, LeaseSync, Mode, Outcome,
    RateKind, ReserveRequest,
};

const COMMON: &str = include_str!("lua/common.lua");

fn script(body: &str) -> Script {
    Script::new(&format!("{COMMON}\n{body}"))
}

/// Counters in Redis (a single node, or a cluster when several URLs are given).
pub struct RedisStore {
    redis: RedisConn,
    reserve: Script,
    commit: Script,
    peek: Script,
    seed: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("redis", &self.redis)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store for `urls` (one URL: a single node; several: cluster seed nodes). Connects
    /// lazily, so a gateway starts while Redis is down; every call is bounded by `timeout`.
    pub fn new(urls: Vec<String>, timeout: Duration) -> Result<Self, BudgetError> {
        Ok(Self {
            redis: RedisConn::new(urls, timeout)?,
            reserve: script(include_str!("lua/reserve.lua")),
            commit: script(include_str!("lua/commit.lua")),
            peek: script(include_str!("lua/peek.lua")),
            seed: script(include_str!("lua/seed.lua")),
        })
    }

    async fn invoke(&self, inv: ScriptInvocation<'_>) -> Result<Value, BudgetError> {
        let call = async {
            let mut conn = self.redis.get().await?;
            let v: Value = inv.invoke_async(&mut conn).await?;
            Ok::<_, BudgetError>(v)
        };
        tokio::time::timeout(self.redis.timeout(), call)
            .await
            .map_err(|_| BudgetError::Timeout)?
    }
}

fn ints(v: Value) -> Result<Vec<i64>, BudgetError> {
    let items = match v {
        Value::Array(items) => items,
        other => {
            return Err(BudgetError::Protocol(format!(
                "expected an array, got {other:?}"
            )))
        }
    };
    items
        .into_iter()
        .map(|i| match i {
            Value::Int(n) => Ok(n),
            other => Err(BudgetError::Protocol(format!(
                "expected an integer, got {other:?}"
            ))),
        })
        .collect()
}

fn states(flat: &[i64]) -> Vec<CounterState> {
    flat.chunks_exact(6)
        .map(|c| CounterState {
            spent_tokens: u64::try_from(c[0]).unwrap_or(0),
            spent_micros: c[1],
            reserved_tokens: u64::try_from(c[2]).unwrap_or(0),
            reserved_micros: c[3],
            leased_tokens: u64::try_from(c[4]).unwrap_or(0),
            leased_micros: c[5],
        })
        .collect()
}

fn opt_i64(v: Option<i64>) -> i64 {
    v.unwrap_or(-1)
}

fn opt_u64(v: Option<u64>) -> i64 {
    v.map_or(-1, |t| i64::try_from(t).unwrap_or(i64::MAX))
}

fn zset(key: &str) -> String {
    format!("{key}:z")
}

fn index(n: i64) -> usize {
    usize::try_from(n).unwrap_or(0)
}

#[async_trait]
impl BudgetStore for RedisStore {
    async fn reserve(&self, req: &ReserveRequest) -> Result<Outcome, BudgetError> {
        let mut inv = self.reserve.prepare_invoke();
        for c in &req.counters {
            inv.key(&c.key).key(zset(&c.key));
        }
        for r in &req.rates {
            inv.key(r.key.as_bytes());
        }
        if req.lease {
            inv.key(marker_key(&req.tenant_id, &req.rid));
        }
        inv.arg(req.now_ms)
            .arg(req.ttl_ms)
            .arg(&req.rid)
            .arg(req.prompt_tokens)
            .arg(req.prompt_micros)
            .arg(req.output_micros_per_token.to_string())
            .arg(req.max_tokens)
            .arg(req.min_tokens)
            .arg(u8::from(req.downgraded))
            .arg(req.units)
            .arg(u8::from(req.lease))
            .arg(req.lease_quiet_ms)
            .arg(u8::from(req.seeded_only))
            .arg(req.counters.len());
        for c in &req.counters {
            let mode = match c.mode {
                Mode::Enforce => 0,
                Mode::Downgrade => 1,
                Mode::Count => 2,
            };
            inv.arg(mode)
                .arg(opt_u64(c.limit.tokens))
                .arg(opt_i64(c.limit.micros))
                .arg(opt_u64(c.hard.tokens))
                .arg(opt_i64(c.hard.micros))
                .arg(c.expire_at_ms);
        }
        inv.arg(req.rates.len());
        for r in &req.rates {
            let kind = match r.kind {
                RateKind::Requests => 0,
                RateKind::Tokens => 1,
            };
            inv.arg(r.per_minute).arg(kind);
        }
        let reply = ints(self.invoke(inv).await?)?;
        let [status, a, b, rest @ ..] = reply.as_slice() else {
            return Err(BudgetError::Protocol(format!(
                "short reserve reply {reply:?}"
            )));
        };
        Ok(match status {
            0 => {
                let (counters, rooms) = rest.split_at((6 * req.counters.len()).min(rest.len()));
                Outcome::Admitted {
                    max_tokens: u64::try_from(*a).unwrap_or(0),
                    counters: states(counters),
                    rate_room: rooms
                        .iter()
                        .map(|&r| u64::try_from(r).unwrap_or(0))
                        .collect(),
                }
            }
            1 => Outcome::Rejected {
                index: index(*a),
                counters: states(rest),
            },
            2 => Outcome::Downgrade { index: index(*a) },
            3 => Outcome::RateLimited {
                index: index(*a),
                retry_after_ms: *b,
            },
            4 => Outcome::Unseeded { index: index(*a) },
            other => return Err(BudgetError::Protocol(format!("reserve status {other}"))),
        })
    }

    async fn commit(&self, req: &CommitRequest) -> Result<bool, BudgetError> {
        let applied = self.commit_batch(std::slice::from_ref(req)).await?;
        Ok(applied.first().copied().unwrap_or(false))
    }

    async fn commit_batch(&self, reqs: &[CommitRequest]) -> Result<Vec<bool>, BudgetError> {
        // One script call per tenant: every key of a tenant is in one cluster slot.
        let mut by_tenant: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            match by_tenant.iter_mut().find(|(t, _)| *t == r.tenant_id) {
                Some((_, v)) => v.push(i),
                None => by_tenant.push((&r.tenant_id, vec![i])),
            }
        }
        let calls = by_tenant.iter().map(|(_, idx)| {
            let mut inv = self.commit.prepare_invoke();
            inv.arg(idx.len());
            for &i in idx {
                let req = &reqs[i];
                inv.key(marker_key(&req.tenant_id, &req.rid));
                for (key, _) in &req.counters {
                    inv.key(key).key(zset(key));
                }
                for (key, _, _) in &req.refunds {
                    inv.key(key.as_bytes());
                }
                let (mode, tokens, micros, lease) = match req.lease {
                    Some(l) => (
                        if l.close { 3 } else { 2 },
                        l.spent_tokens,
                        l.spent_micros,
                        l,
                    ),
                    None => (
                        u8::from(req.unreserved),
                        req.tokens,
                        req.micros,
                        LeaseSync::default(),
                    ),
                };
                inv.arg(&req.rid)
                    .arg(req.now_ms)
                    .arg(req.dedupe_ms.max(1))
                    .arg(tokens)
                    .arg(micros)
                    .arg(mode)
                    .arg(lease.released_tokens)
                    .arg(lease.released_micros)
                    .arg(req.counters.len());
                for (_, expire) in &req.counters {
                    inv.arg(*expire);
                }
                inv.arg(req.refunds.len());
                for (_, per_minute, refund) in &req.refunds {
                    inv.arg(*per_minute).arg(*refund);
                }
            }
            async move { ints(self.invoke(inv).await?) }
        });
        let replies = futures_util::future::join_all(calls).await;
        let mut out = vec![false; reqs.len()];
        for ((_, idx), reply) in by_tenant.iter().zip(replies) {
            let reply = reply?;
            if reply.len() != idx.len() {
                return Err(BudgetError::Protocol(format!("commit reply {reply:?}")));
            }
            for (&i, applied) in idx.iter().zip(reply) {
                out[i] = applied == 1;
            }
        }
        Ok(out)
    }

    async fn peek(
        &self,
        _tenant_id: &str,
        keys: &[String],
        now_ms: i64,
    ) -> Result<Vec<CounterState>, BudgetError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = self.peek.prepare_invoke();
        for k in keys {
            inv.key(k).key(zset(k));
        }
        inv.arg(now_ms);
        Ok(states(&ints(self.invoke(inv).await?)?))
    }

    async fn seed(
        &self,
        _tenant_id: &str,
        key: &str,
        tokens: u64,
        micros: i64,
        expire_at_ms: i64,
    ) -> Result<bool, BudgetError> {
        let mut inv = self.seed.prepare_invoke();
        inv.key(key).arg(tokens).arg(micros).arg(expire_at_ms);
        match self.invoke(inv).await? {
            Value::Int(n) => Ok(n == 1),
            other => Err(BudgetError::Protocol(format!("seed reply {other:?}"))),
        }
    }
}
