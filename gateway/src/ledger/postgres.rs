//! The ledger in Postgres: weekly partitions, batch inserts as one `UNNEST` statement per batch.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Datelike, Duration as Days, NaiveDate, TimeZone, Utc};
use sqlx::postgres::{PgPool, PgPoolOptions};

use super::report::{Aggregate, Dimension, RepeatRow};
use super::{tokens, LedgerStore, COLUMNS};
use crate::store::StoreError;
use crate::usage::UsageEvent;

/// Ledger rows in Postgres.
#[derive(Debug)]
pub struct PostgresLedger {
    pool: PgPool,
    /// Monday dates whose partition this process has made sure of.
    partitions: Mutex<HashSet<NaiveDate>>,
}

/// The Monday (UTC) of `t`'s ISO week.
pub fn week_start(t: DateTime<Utc>) -> NaiveDate {
    let d = t.date_naive();
    d - Days::days(i64::from(d.weekday().num_days_from_monday()))
}

impl PostgresLedger {
    /// Connect to the (already migrated) database at `url`.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect(url)
            .await?;
        Ok(Self {
            pool,
            partitions: Mutex::new(HashSet::new()),
        })
    }

    /// Create the partition for the week starting `monday` unless it exists. Partition bounds are
    /// dates this code computes (never input), so formatting them into the DDL is safe; DDL
    /// cannot take bind parameters.
    async fn ensure_partition(&self, monday: NaiveDate) -> Result<(), StoreError> {
        if self
            .partitions
            .lock()
            .map(|p| p.contains(&monday))
            .unwrap_or(false)
        {
            return Ok(());
        }
        let next = monday + Days::days(7);
        let iso = monday.iso_week();
        let name = format!("ledger_{}w{:02}", iso.year(), iso.week());
        let from = Utc.from_utc_datetime(&monday.and_hms_opt(0, 0, 0).unwrap_or_default());
        let to = Utc.from_utc_datetime(&next.and_hms_opt(0, 0, 0).unwrap_or_default());
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {name} PARTITION OF ledger \
             FOR VALUES FROM ('{}') TO ('{}')",
            from.to_rfc3339(),
            to.to_rfc3339()
        );
        if let Err(e) = sqlx::query(&ddl).execute(&self.pool).await {
            // Rows of that week already sit in the default partition (or a concurrent replica
            // raced us); inserts still land in a partition, so this is not fatal.
            tracing::warn!(partition = %name, error = %e, "could not create ledger partition");
        }
        if let Ok(mut p) = self.partitions.lock() {
            p.insert(monday);
        }
        Ok(())
    }
}

#[async_trait]
impl LedgerStore for PostgresLedger {
    async fn insert(&self, rows: &[UsageEvent]) -> Result<u64, StoreError> {
        if rows.is_empty() {
            return Ok(0);
        }
        let weeks: HashSet<NaiveDate> = rows.iter().map(|r| week_start(r.started_at)).collect();
        for w in weeks {
            self.ensure_partition(w).await?;
        }
        macro_rules! col {
            ($f:expr) => {
                rows.iter().map($f).collect::<Vec<_>>()
            };
        }
        // One statement: insert the new rows, add exactly those to the daily rollup, count them.
        let rollup =
            super::report::rollup_upsert_sql("(started_at AT TIME ZONE 'UTC')::date", "ins");
        let sql = format!(
            "WITH ins AS (INSERT INTO ledger ({COLUMNS}) SELECT * FROM UNNEST(\
             $1::text[], $2::timestamptz[], $3::text[], $4::text[], $5::text[], $6::text[], \
             $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[], \
             $13::text[], $14::text[], $15::int8[], $16::int8[], $17::int8[], $18::text[], \
             $19::int8[], $20::int8[], $21::int8[], $22::text[], $23::int4[], $24::text[], \
             $25::bool[], $26::bool[], $27::float8[], $28::float8[], $29::int4[], $30::bool[], \
             $31::bool[], $32::text[], $33::int4[], $34::int8[], $35::text[], \
             $36::int8[], $37::text[], $38::int4[]) ON CONFLICT DO NOTHING RETURNING *), \
             up AS ({rollup}) SELECT COUNT(*) FROM ins"
        );
        let inserted: i64 = sqlx::query_scalar(&sql)
            .bind(col!(|e| e.request_id.as_ref()))
            .bind(col!(|e| e.started_at))
            .bind(col!(|e| e.tenant_id.as_str()))
            .bind(col!(|e| e.tenant_name.as_str()))
            .bind(col!(|e| e.key_id.as_str()))
            .bind(col!(|e| e.feature()))
            .bind(col!(|e| e.end_user()))
            .bind(col!(|e| e.session()))
            .bind(col!(|e| serde_json::to_string(&e.tags).unwrap_or_default()))
            .bind(col!(|e| e.endpoint.as_ref()))
            .bind(col!(|e| e.requested_model.as_str()))
            .bind(col!(|e| e.served_model.as_deref()))
            .bind(col!(|e| e.tier.as_deref()))
            .bind(col!(|e| e.replica.as_deref()))
            .bind(col!(|e| tokens(e.prompt_tokens)))
            .bind(col!(|e| tokens(e.completion_tokens)))
            .bind(col!(|e| tokens(e.cached_tokens)))
            .bind(col!(|e| e.usage_source.as_str()))
            .bind(col!(|e| e.cost_micros))
            .bind(col!(|e| e.output_cost_micros))
            .bind(col!(|e| e.saved_micros))
            .bind(col!(|e| e.cache_status.as_str()))
            .bind(col!(|e| i32::from(e.status)))
            .bind(col!(|e| e.error_kind.as_deref()))
            .bind(col!(|e| e.stream))
            .bind(col!(|e| e.client_disconnected))
            .bind(col!(|e| e.latency_ms))
            .bind(col!(|e| e.ttft_ms))
            .bind(col!(|e| i32::try_from(e.retries).unwrap_or(i32::MAX)))
            .bind(col!(|e| e.loop_flag))
            .bind(col!(|e| e.retry_storm_flag))
            .bind(col!(|e| e.fingerprint.as_str()))
            .bind(col!(|e| i32::try_from(e.loop_steps).unwrap_or(i32::MAX)))
            .bind(col!(|e| e.avoided_micros))
            .bind(col!(|e| e.route_reason.as_deref()))
            .bind(col!(|e| e.all_large_micros))
            .bind(col!(|e| e.replica_choice.as_deref()))
            .bind(col!(|e| e
                .matched_blocks
                .map(|n| i32::try_from(n).unwrap_or(i32::MAX))))
            .fetch_one(&self.pool)
            .await?;
        Ok(u64::try_from(inserted).unwrap_or(0))
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
            "(started_at AT TIME ZONE 'UTC')::date",
            tenant_id,
            name,
            label
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weeks_start_on_monday_utc() {
        let sunday = Utc
            .with_ymd_and_hms(2026, 11, 29, 23, 0, 0)
            .single()
            .unwrap_or_default();
        let monday = Utc
            .with_ymd_and_hms(2026, 11, 30, 0, 0, 0)
            .single()
            .unwrap_or_default();
        assert_eq!(
            week_start(sunday),
            NaiveDate::from_ymd_opt(2026, 11, 23).unwrap_or_default()
        );
        assert_eq!(
            week_start(monday),
            NaiveDate::from_ymd_opt(2026, 11, 30).unwrap_or_default()
        );
    }
}
