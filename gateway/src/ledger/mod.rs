//! The cost ledger: one row per request (a costed [`UsageEvent`]), behind [`LedgerStore`] with a
//! SQLite and a Postgres implementation, written by [`writer::LedgerWriter`] in batches off the
//! request path, spooled to local disk while the database is unreachable.

pub mod journal;
pub mod loops;
pub mod postgres;
pub mod report;
pub mod spool;
pub mod sqlite;
pub mod writer;

use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::store::StoreError;
use crate::usage::UsageEvent;

/// Where ledger rows are stored.
#[async_trait]
pub trait LedgerStore: Send + Sync + 'static {
    /// Insert rows; a row whose request id is already stored is skipped (replays are no-ops).
    /// Returns how many rows were new.
    async fn insert(&self, rows: &[UsageEvent]) -> Result<u64, StoreError>;
    /// Rows that started in `[from, to)`, oldest first.
    async fn rows_between(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<Vec<UsageEvent>, StoreError>;
    /// Number of rows stored.
    async fn count(&self) -> Result<u64, StoreError>;
    /// Sums over `[from, to)` (optionally one tenant), grouped by `group` (key `a|b|…`; one row
    /// with key `""` when `group` is empty).
    async fn aggregate(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        tenant: Option<&str>,
        group: &[report::Dimension],
    ) -> Result<Vec<(String, report::Aggregate)>, StoreError>;
    /// Budget spend (tokens of requests not answered from a cache, and cost) since `from`,
    /// grouped by tenant, key and tags: what budget counters are rebuilt from at start.
    async fn spend_since(&self, from: DateTime<Utc>) -> Result<Vec<SpendRow>, StoreError>;
    /// A tenant was deleted: its rows (and their daily rollup) are relabelled `label`, so a
    /// tenant later created under the same name reports apart from it. Returns the rows
    /// relabelled.
    async fn retire_tenant(
        &self,
        tenant_id: &str,
        name: &str,
        label: &str,
    ) -> Result<u64, StoreError>;
    /// Rows whose (key, session, fingerprint) repeats at least `min` times in `[from, to)`.
    async fn repeats(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        min: usize,
    ) -> Result<Vec<report::RepeatRow>, StoreError>;
    /// The rows of every session the guard marked (flagged or refused) in `[from, to)`,
    /// optionally one tenant's, from [`loops::lookback`] before `from`, ordered by session and
    /// time: what [`loops::detected`] reads.
    async fn guard_rows(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        tenant: Option<&str>,
    ) -> Result<Vec<loops::GuardRow>, StoreError>;
}

/// Body of [`LedgerStore::rows_between`], identical for both stores.
macro_rules! rows_between_body {
    ($pool:expr, $from:expr, $to:expr) => {{
        let sql = format!(
            "SELECT {} FROM ledger WHERE started_at >= $1 AND started_at < $2 \
             ORDER BY started_at, request_id",
            $crate::ledger::COLUMNS
        );
        let rows = sqlx::query(&sql)
            .bind($from)
            .bind($to)
            .fetch_all($pool)
            .await?;
        rows.iter()
            .map(|r| $crate::ledger::decode_row!(r))
            .collect()
    }};
}
pub(crate) use rows_between_body;

/// Spend of one (tenant, key, tags) group, see [`LedgerStore::spend_since`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpendRow {
    /// Tenant id.
    pub tenant_id: String,
    /// Key id.
    pub key_id: String,
    /// The rows' tags.
    pub tags: std::collections::BTreeMap<String, String>,
    /// Prompt + completion tokens.
    pub tokens: u64,
    /// Cost, micro-dollars.
    pub micros: i64,
}

/// Body of [`LedgerStore::spend_since`], identical for both stores.
macro_rules! spend_since_body {
    ($pool:expr, $from:expr) => {{
        use sqlx::Row;
        let rows = sqlx::query(
            "SELECT tenant_id, key_id, tags, \
             CAST(SUM(CASE WHEN cache_status LIKE 'hit%' THEN 0 \
                      ELSE prompt_tokens + completion_tokens END) AS BIGINT) AS tokens, \
             CAST(SUM(cost_micros) AS BIGINT) AS micros \
             FROM ledger WHERE started_at >= $1 GROUP BY tenant_id, key_id, tags",
        )
        .bind($from)
        .fetch_all($pool)
        .await?;
        rows.iter()
            .map(|r| {
                let tags: String = r.try_get("tags")?;
                let tokens: i64 = r.try_get("tokens")?;
                Ok($crate::ledger::SpendRow {
                    tenant_id: r.try_get("tenant_id")?,
                    key_id: r.try_get("key_id")?,
                    tags: serde_json::from_str(&tags).map_err(|e| {
                        $crate::store::StoreError::Corrupt(format!("ledger.tags: {e}"))
                    })?,
                    tokens: u64::try_from(tokens).unwrap_or(0),
                    micros: r.try_get("micros")?,
                })
            })
            .collect()
    }};
}
pub(crate) use spend_since_body;

/// Body of [`LedgerStore::count`], identical for both stores.
macro_rules! count_body {
    ($pool:expr) => {{
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
            .fetch_one($pool)
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }};
}
pub(crate) use count_body;

/// Body of [`LedgerStore::retire_tenant`] for both stores; `$day` is the dialect's UTC day of
/// `started_at`. One transaction: the name's rollup rows go (only this tenant can hold a live
/// tenant's name: earlier holders were relabelled when they were deleted), its rows take the
/// label, and their rollup is rebuilt under it.
macro_rules! retire_tenant_body {
    ($pool:expr, $day:expr, $tenant_id:expr, $name:expr, $label:expr) => {{
        let rebuild = $crate::ledger::report::rollup_upsert_sql(
            $day,
            "ledger WHERE tenant_id = $1 AND tenant_name = $2",
        );
        let mut tx = $pool.begin().await?;
        sqlx::query("DELETE FROM ledger_daily WHERE tenant_name = $1")
            .bind($name)
            .execute(&mut *tx)
            .await?;
        let moved = sqlx::query(
            "UPDATE ledger SET tenant_name = $3 WHERE tenant_id = $1 AND tenant_name = $2",
        )
        .bind($tenant_id)
        .bind($name)
        .bind($label)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query(&rebuild)
            .bind($tenant_id)
            .bind($label)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(moved)
    }};
}
pub(crate) use retire_tenant_body;

/// Body of [`LedgerStore::aggregate`], identical for both stores.
macro_rules! aggregate_body {
    ($pool:expr, $from:expr, $to:expr, $tenant:expr, $group:expr) => {{
        use $crate::ledger::report as r;
        // Whole days on rollup dimensions come from the daily rollup; anything else from rows.
        let rollup = r::rollup_covers($group, $from, $to);
        let sql = if rollup {
            r::rollup_sql($group, $tenant.is_some())
        } else {
            r::aggregate_sql($group, $tenant.is_some())
        };
        let q = sqlx::query(&sql);
        let mut q = if rollup {
            q.bind($from.date_naive()).bind($to.date_naive())
        } else {
            q.bind($from).bind($to)
        };
        if let Some(t) = $tenant {
            q = q.bind(t);
        }
        let rows = q.fetch_all($pool).await?;
        rows.iter()
            .map(|row| $crate::ledger::report::decode_aggregate!(row))
            .collect()
    }};
}
pub(crate) use aggregate_body;

/// Body of [`LedgerStore::repeats`], identical for both stores.
macro_rules! repeats_body {
    ($pool:expr, $from:expr, $to:expr, $min:expr) => {{
        use sqlx::Row;
        let rows = sqlx::query($crate::ledger::report::REPEATS_SQL)
            .bind($from)
            .bind($to)
            .bind(i64::try_from($min).unwrap_or(i64::MAX))
            .fetch_all($pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok($crate::ledger::report::RepeatRow {
                    key_id: r.try_get("key_id")?,
                    tenant: r.try_get("tenant_name")?,
                    session: r.try_get("session")?,
                    fingerprint: r.try_get("fingerprint")?,
                    started_at: r.try_get("started_at")?,
                    cost_micros: r.try_get("cost_micros")?,
                })
            })
            .collect()
    }};
}
pub(crate) use repeats_body;

/// Open the ledger in the database at `url` (already migrated by the store).
pub async fn open(url: &str) -> Result<Arc<dyn LedgerStore>, StoreError> {
    if url.starts_with("sqlite:") {
        Ok(Arc::new(sqlite::SqliteLedger::open(url).await?))
    } else {
        Ok(Arc::new(postgres::PostgresLedger::connect(url).await?))
    }
}

/// Columns in insert order, shared by both stores' statements.
pub(crate) const COLUMNS: &str = "request_id, started_at, tenant_id, tenant_name, key_id, \
     feature, end_user, session, tags, endpoint, requested_model, served_model, tier, replica, \
     prompt_tokens, completion_tokens, cached_tokens, usage_source, cost_micros, output_cost_micros, saved_micros, \
     cache_status, status, error_kind, stream, client_disconnected, latency_ms, ttft_ms, retries, \
     loop_flag, retry_storm_flag, fingerprint, loop_steps, avoided_micros, route_reason, \
     all_large_micros, replica_choice, matched_blocks";

fn enum_parse<T: serde::de::DeserializeOwned>(column: &str, s: String) -> Result<T, StoreError> {
    serde_json::from_value(serde_json::Value::String(s))
        .map_err(|e| StoreError::Corrupt(format!("ledger.{column}: {e}")))
}

/// Decode one ledger row; the same code for both drivers.
macro_rules! decode_row {
    ($row:expr) => {{
        use sqlx::Row;
        let r = $row;
        let tags: String = r.try_get("tags")?;
        let all_large_micros: Option<i64> = r.try_get("all_large_micros")?;
        Ok::<_, StoreError>(UsageEvent {
            request_id: r.try_get::<String, _>("request_id")?.into(),
            started_at: r.try_get("started_at")?,
            tenant_id: r.try_get("tenant_id")?,
            tenant_name: r.try_get("tenant_name")?,
            key_id: r.try_get("key_id")?,
            tags: serde_json::from_str(&tags)
                .map_err(|e| StoreError::Corrupt(format!("ledger.tags: {e}")))?,
            endpoint: std::borrow::Cow::Owned(r.try_get::<String, _>("endpoint")?),
            requested_model: r.try_get("requested_model")?,
            served_model: r
                .try_get::<Option<String>, _>("served_model")?
                .map(Into::into),
            tier: r
                .try_get::<Option<String>, _>("tier")?
                .map(std::borrow::Cow::Owned),
            replica: r.try_get::<Option<String>, _>("replica")?.map(Into::into),
            prompt_tokens: u64::try_from(r.try_get::<i64, _>("prompt_tokens")?).unwrap_or(0),
            completion_tokens: u64::try_from(r.try_get::<i64, _>("completion_tokens")?)
                .unwrap_or(0),
            cached_tokens: u64::try_from(r.try_get::<i64, _>("cached_tokens")?).unwrap_or(0),
            usage_source: $crate::ledger::enum_parse("usage_source", r.try_get("usage_source")?)?,
            cost_micros: r.try_get("cost_micros")?,
            output_cost_micros: r.try_get("output_cost_micros")?,
            saved_micros: r.try_get("saved_micros")?,
            cache_status: $crate::ledger::enum_parse("cache_status", r.try_get("cache_status")?)?,
            status: u16::try_from(r.try_get::<i32, _>("status")?).unwrap_or(0),
            error_kind: r.try_get("error_kind")?,
            stream: r.try_get("stream")?,
            client_disconnected: r.try_get("client_disconnected")?,
            latency_ms: r.try_get("latency_ms")?,
            ttft_ms: r.try_get("ttft_ms")?,
            retries: u32::try_from(r.try_get::<i32, _>("retries")?).unwrap_or(0),
            loop_flag: r.try_get("loop_flag")?,
            retry_storm_flag: r.try_get("retry_storm_flag")?,
            fingerprint: r.try_get("fingerprint")?,
            loop_steps: u32::try_from(r.try_get::<i32, _>("loop_steps")?).unwrap_or(0),
            avoided_micros: r.try_get("avoided_micros")?,
            route_reason: r
                .try_get::<Option<String>, _>("route_reason")?
                .map(std::borrow::Cow::Owned),
            routed: all_large_micros.is_some(),
            all_large_micros,
            replica_choice: r.try_get("replica_choice")?,
            matched_blocks: r
                .try_get::<Option<i32>, _>("matched_blocks")?
                .and_then(|n| u32::try_from(n).ok()),
        })
    }};
}
pub(crate) use decode_row;

/// Non-negative token counts as the databases' signed integers.
fn tokens(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
