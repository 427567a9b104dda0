//! The optional shared exact layer: answers also kept in Redis (`cache.redis_urls`), so a
//! repeat is a hit on every replica, not only on the one that saw the question first. Each
//! replica still checks its own memory first; Redis is the second look and is filled in the
//! background. Keys carry the tenant's `{hash tag}` (cluster-safe) and expire with the answer.
//!
//! Redis is an accelerator here, never a dependency: a failed or slow call (bounded by
//! `cache.redis_timeout_ms`) is a miss, and after a failure Redis is skipped for a second so an
//! outage does not add its timeout to every request.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::Entry;
use crate::metrics::Metrics;
use crate::openai::Usage;
use crate::redis_conn::RedisConn;
use crate::tasks::Background;

/// How long Redis is skipped after a failed call, ms.
const BACKOFF_MS: i64 = 1000;

/// An answer as stored in Redis.
#[derive(Serialize, Deserialize)]
struct Stored {
    body: String,
    model: String,
    tier: String,
    usage: [u64; 3],
}

/// Answers shared through Redis.
#[derive(Debug)]
pub struct Shared {
    redis: Arc<RedisConn>,
    skip_until_ms: Arc<AtomicI64>,
    metrics: Metrics,
    /// Where writes run (they do not hold up the answer).
    background: Background,
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn redis_key(tenant_id: &str, key: u128) -> String {
    format!("gw:cache:{{{tenant_id}}}:{key:032x}")
}

impl Shared {
    /// Answers in Redis at `urls` (one: a node; several: cluster seeds), calls bounded by
    /// `timeout`; writes run on `background`.
    pub fn new(
        urls: Vec<String>,
        timeout: Duration,
        metrics: Metrics,
        background: Background,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            redis: Arc::new(RedisConn::new(urls, timeout)?),
            skip_until_ms: Arc::new(AtomicI64::new(0)),
            metrics,
            background,
        })
    }

    fn failed(&self, what: &str, e: &dyn std::fmt::Display) {
        self.skip_until_ms
            .store(now_ms() + BACKOFF_MS, Ordering::Relaxed);
        self.metrics
            .cache_lookups
            .with_label_values(&["shared", "error"])
            .inc();
        tracing::warn!(error = %e, what, "shared cache (Redis) unavailable; skipping it for 1 s");
    }

    /// The answer stored for `key` of `tenant_id`, with its remaining time to live.
    pub async fn get(&self, tenant_id: &str, key: u128) -> Option<Entry> {
        if now_ms() < self.skip_until_ms.load(Ordering::Relaxed) {
            return None;
        }
        let name = redis_key(tenant_id, key);
        let call = async {
            let mut conn = self.redis.get().await?;
            let (value, ttl_ms): (Option<String>, i64) = redis::pipe()
                .get(&name)
                .pttl(&name)
                .query_async(&mut conn)
                .await?;
            Ok::<_, redis::RedisError>((value, ttl_ms))
        };
        let (value, ttl_ms) = match tokio::time::timeout(self.redis.timeout(), call).await {
            Ok(Ok(found)) => found,
            Ok(Err(e)) => {
                self.failed("get", &e);
                return None;
            }
            Err(_) => {
                self.failed("get", &"timed out");
                return None;
            }
        };
        let stored: Stored = serde_json::from_str(&value?).ok()?;
        let ttl = Duration::from_millis(u64::try_from(ttl_ms).ok().filter(|&t| t > 0)?);
        Some(Entry {
            body: Bytes::from(stored.body),
            served_model: stored.model,
            tier: stored.tier,
            usage: Usage {
                prompt_tokens: stored.usage[0],
                completion_tokens: stored.usage[1],
                cached_tokens: stored.usage[2],
            },
            ttl,
        })
    }

    /// Store an answer in the background (fire and forget: a failure only costs future hits).
    pub fn put(&self, tenant_id: &str, key: u128, entry: &Entry) {
        if now_ms() < self.skip_until_ms.load(Ordering::Relaxed) {
            return;
        }
        let Ok(body) = std::str::from_utf8(&entry.body) else {
            return;
        };
        let stored = Stored {
            body: body.to_owned(),
            model: entry.served_model.clone(),
            tier: entry.tier.clone(),
            usage: [
                entry.usage.prompt_tokens,
                entry.usage.completion_tokens,
                entry.usage.cached_tokens,
            ],
        };
        let Ok(value) = serde_json::to_string(&stored) else {
            return;
        };
        let name = redis_key(tenant_id, key);
        let ttl_ms = u64::try_from(entry.ttl.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let (redis, skip, metrics) = (
            Arc::clone(&self.redis),
            Arc::clone(&self.skip_until_ms),
            self.metrics.clone(),
        );
        self.background.spawn(async move {
            let call = async {
                let mut conn = redis.get().await?;
                redis::cmd("SET")
                    .arg(&name)
                    .arg(value)
                    .arg("PX")
                    .arg(ttl_ms)
                    .query_async::<()>(&mut conn)
                    .await
            };
            let failed = match tokio::time::timeout(redis.timeout(), call).await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some("timed out".to_owned()),
            };
            if let Some(e) = failed {
                skip.store(now_ms() + BACKOFF_MS, Ordering::Relaxed);
                metrics
                    .cache_lookups
                    .with_label_values(&["shared", "error"])
                    .inc();
                tracing::warn!(error = %e, "shared cache (Redis) store failed; skipping it for 1 s");
            }
        });
    }
}
