//! The ledger in the embedded SQLite file.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

use super::report::{Aggregate, Dimension, RepeatRow};
use super::{enum_text, tokens, LedgerStore, COLUMNS};
use crate::store::StoreError;
use crate::usage::UsageEvent;

/// Ledger rows in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteLedger {
    pool: SqlitePool,
}

impl SqliteLedger {
    /// Open the (already migrated) database at `url`.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await?;
        crate::store::sqlite_migrator().await?.run(&pool).await?;
        Ok(Self { pool })
    }
}

#[async_trait]
impl LedgerStore for SqliteLedger {
    async fn insert(&self, rows: &[UsageEvent]) -> Result<u64, StoreError> {
        let sql = format!(
            "INSERT OR IGNORE INTO ledger ({COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, \
             $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, $32, $33, $34, $35, $36, $37, $38)"
        );
        let rollup = super::report::rollup_upsert_sql(
            "substr(started_at, 1, 10)",
            "ledger WHERE request_id = $1",
        );
        let mut tx = self.pool.begin().await?;
        let mut inserted = 0;
        for e in rows {
            let new = sqlx::query(&sql)
                .bind(&e.request_id)
                .bind(e.started_at)
                .bind(&e.tenant_id)
                .bind(&e.tenant_name)
                .bind(&e.key_id)
                .bind(e.feature())
                .bind(e.end_user())
                .bind(e.session())
                .bind(serde_json::to_string(&e.tags).unwrap_or_default())
                .bind(&e.endpoint)
                .bind(&e.requested_model)
                .bind(&e.served_model)
                .bind(&e.tier)
                .bind(&e.replica)
                .bind(tokens(e.prompt_tokens))
                .bind(tokens(e.completion_tokens))
                .bind(tokens(e.cached_tokens))
                .bind(enum_text(&e.usage_source))
                .bind(e.cost_micros)
                .bind(e.output_cost_micros)
                .bind(e.saved_micros)
                .bind(enum_text(&e.cache_status))
                .bind(i32::from(e.status))
                .bind(&e.error_kind)
                .bind(e.stream)
                .bind(e.client_disconnected)
                .bind(e.latency_ms)
                .bind(e.ttft_ms)
                .bind(i32::try_from(e.retries).unwrap_or(i32::MAX))
                .bind(e.loop_flag)
                .bind(e.retry_storm_flag)
                .bind(&e.fingerprint)
                .bind(i32::try_from(e.loop_steps).unwrap_or(i32::MAX))
                .bind(e.avoided_micros)
                .bind(&e.route_reason)
                .bind(e.all_large_micros)
                .bind(&e.replica_choice)
                .bind(
                    e.matched_blocks
                        .map(|n| i32::try_from(n).unwrap_or(i32::MAX)),
                )
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if new > 0 {
                // Only a row stored now counts in the rollup (a replayed one was ignored above).
                sqlx::query(&rollup)
                    .bind(&e.request_id)
                    .execute(&mut *tx)
                    .await?;
            }
            inserted += new;
        }
        tx.commit().await?;
        Ok(inserted)
    }

    async fn rows_between(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<Vec<UsageEvent>, StoreError> {
        super::rows_between_body!(&self.pool, from, to)
    }

    async fn aggregate(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        tenant: Option<&str>,
        group: &[Dimension],
    ) -> Result<Vec<(String, Aggregate)>, StoreError> {
        super::aggregate_body!(&self.pool, from, to, tenant, group)
    }

    async fn repeats(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        min: usize,
    ) -> Result<Vec<RepeatRow>, StoreError> {
        super::repeats_body!(&self.pool, from, to, min)
    }

    async fn guard_rows(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        tenant: Option<&str>,
    ) -> Result<Vec<super::loops::GuardRow>, StoreError> {
        super::loops::guard_rows_body!(&self.pool, from, to, tenant)
    }

    async fn spend_since(&self, from: DateTime<Utc>) -> Result<Vec<super::SpendRow>, StoreError> {
        super::spend_since_body!(&self.pool, from)
    }

    async fn count(&self) -> Result<u64, StoreError> {
        super::count_body!(&self.pool)
    }

    async fn retire_tenant(
        &self,
        tenant_id: &str,
        name: &str,
        label: &str,
    ) -> Result<u64, StoreError> {
        super::retire_tenant_body!(
            &self.pool,
            "substr(started_at, 1, 10)",
            tenant_id,
            name,
            label
        )
    }
}
