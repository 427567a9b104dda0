//! The ledger in the embedded SQLite file.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

use super::report::{Aggregate, Dimension, RepeatRow};
use super::{tokens, LedgerStore, COLUMNS};
use crate::store::StoreError;
use crate::usage::{Rfc3339, UsageEvent};

/// Ledger rows in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteLedger {
    pool: SqlitePool,
    /// Adds the ledger rows above a rowid to the daily rollup (after a batch of which some
    /// rows were already stored).
    rollup: String,
    /// `inserts[k]` inserts `2^k` rows, up to [`ROWS_PER_INSERT`].
    inserts: Vec<String>,
    /// `upserts[k]` adds `2^k` groups' sums to the daily rollup, up to [`ROWS_PER_INSERT`].
    upserts: Vec<String>,
}

/// Most rows per `INSERT` statement: one statement per 64 rows instead of one per row (64 × 38
/// parameters, far below SQLite's limit of 32,766). A batch goes in statements of 64 rows, then
/// of the largest power of two that fits what is left: seven statement shapes in all, each
/// prepared once per connection and then reused from sqlx's statement cache. (A statement
/// sized to each batch's remainder was parsed anew for almost every batch: at a few hundred
/// requests a second that parse was ~44 k instructions per request, more than the inserts.)
const ROWS_PER_INSERT: usize = 64;

/// `INSERT OR IGNORE` of `rows` ledger rows.
fn insert_sql(rows: usize) -> String {
    let columns = COLUMNS.split(',').count();
    let mut sql = format!("INSERT OR IGNORE INTO ledger ({COLUMNS}) VALUES ");
    // Anonymous `?` parameters, bound in order: SQLite looks up a named or numbered one
    // (`$7`, `?7`) by a walk of the statement's parameter list, so binding 64 rows of numbered
    // parameters costs their count squared (measured: slower than one statement per row).
    let row = format!("({})", vec!["?"; columns].join(", "));
    sql.push_str(&vec![row.as_str(); rows].join(", "));
    sql
}

/// `rows` split into the statements that insert them: [`ROWS_PER_INSERT`] rows each, then
/// descending powers of two.
fn statement_chunks<T>(mut rows: &[T]) -> impl Iterator<Item = &[T]> {
    std::iter::from_fn(move || {
        let n = match rows.len() {
            0 => return None,
            n if n >= ROWS_PER_INSERT => ROWS_PER_INSERT,
            n => 1 << n.ilog2(),
        };
        let (chunk, rest) = rows.split_at(n);
        rows = rest;
        Some(chunk)
    })
}

/// `started_at` as sqlx binds a `DateTime<Utc>` into SQLite (`to_rfc3339_opts(AutoSi, false)`,
/// which the ledger's queries compare as text), written without chrono's formatter.
fn started_at_text(e: &UsageEvent) -> String {
    match Rfc3339::utc(&e.started_at, false) {
        Some(text) => text.as_str().to_owned(),
        None => e
            .started_at
            .to_rfc3339_opts(chrono::SecondsFormat::AutoSi, false),
    }
}

type InsertQuery<'q> = sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>;

/// Bind one row's values, in [`COLUMNS`] order.
fn bind_row<'q>(q: InsertQuery<'q>, e: &'q UsageEvent) -> InsertQuery<'q> {
    q.bind(e.request_id.as_ref())
        .bind(started_at_text(e))
        .bind(e.tenant_id.as_str())
        .bind(e.tenant_name.as_str())
        .bind(e.key_id.as_str())
        .bind(e.feature())
        .bind(e.end_user())
        .bind(e.session())
        .bind(serde_json::to_string(&e.tags).unwrap_or_default())
        .bind(e.endpoint.as_ref())
        .bind(e.requested_model.as_str())
        .bind(e.served_model.as_deref())
        .bind(e.tier.as_deref())
        .bind(e.replica.as_deref())
        .bind(tokens(e.prompt_tokens))
        .bind(tokens(e.completion_tokens))
        .bind(tokens(e.cached_tokens))
        .bind(e.usage_source.as_str())
        .bind(e.cost_micros)
        .bind(e.output_cost_micros)
        .bind(e.saved_micros)
        .bind(e.cache_status.as_str())
        .bind(i32::from(e.status))
        .bind(e.error_kind.as_deref())
        .bind(e.stream)
        .bind(e.client_disconnected)
        .bind(e.latency_ms)
        .bind(e.ttft_ms)
        .bind(i32::try_from(e.retries).unwrap_or(i32::MAX))
        .bind(e.loop_flag)
        .bind(e.retry_storm_flag)
        .bind(e.fingerprint.as_str())
        .bind(i32::try_from(e.loop_steps).unwrap_or(i32::MAX))
        .bind(e.avoided_micros)
        .bind(e.route_reason.as_deref())
        .bind(e.all_large_micros)
        .bind(e.replica_choice.as_deref())
        .bind(
            e.matched_blocks
                .map(|n| i32::try_from(n).unwrap_or(i32::MAX)),
        )
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
        let rollup = super::report::rollup_upsert_sql(
            "substr(started_at, 1, 10)",
            "ledger WHERE rowid > $1",
        );
        Ok(Self {
            pool,
            rollup,
            inserts: (0..=ROWS_PER_INSERT.ilog2())
                .map(|k| insert_sql(1 << k))
                .collect(),
            upserts: (0..=ROWS_PER_INSERT.ilog2())
                .map(|k| super::report::rollup_values_sql(1 << k))
                .collect(),
        })
    }
}

#[async_trait]
impl LedgerStore for SqliteLedger {
    async fn insert(&self, rows: &[UsageEvent]) -> Result<u64, StoreError> {
        if rows.is_empty() {
            return Ok(0);
        }
        // BEGIN IMMEDIATE takes the write lock first, so no other writer adds ledger rows while
        // this batch is stored: the rows above the largest rowid before it are exactly the ones
        // it inserted (a replayed row already stored is ignored, not inserted).
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let before: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(rowid), 0) FROM ledger")
            .fetch_one(&mut *tx)
            .await?;
        let mut inserted = 0;
        for chunk in statement_chunks(rows) {
            let mut q = sqlx::query(&self.inserts[chunk.len().ilog2() as usize]);
            for e in chunk {
                q = bind_row(q, e);
            }
            inserted += q.execute(&mut *tx).await?.rows_affected();
        }
        if inserted == rows.len() as u64 {
            // Every row is new (the usual case): the batch's sums per rollup row, added from
            // here, instead of SQLite grouping the rows it just stored (a third of its work per
            // row when it did).
            let groups: Vec<_> = super::report::day_groups(rows).into_iter().collect();
            for chunk in statement_chunks(&groups) {
                let mut q = sqlx::query(&self.upserts[chunk.len().ilog2() as usize]);
                for ((day, tenant, model, tier, feature), sums) in chunk {
                    q = q
                        .bind(day.format("%Y-%m-%d").to_string())
                        .bind(*tenant)
                        .bind(*model)
                        .bind(*tier)
                        .bind(*feature);
                    for v in super::report::measure_values(sums) {
                        q = q.bind(v);
                    }
                }
                q.execute(&mut *tx).await?;
            }
        } else if inserted > 0 {
            // Some rows were there already (a replay): the rollup adds exactly the rows stored
            // now, read back from the table.
            sqlx::query(&self.rollup)
                .bind(before)
                .execute(&mut *tx)
                .await?;
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

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    /// The row's time is stored as the text sqlx binds for a `DateTime<Utc>`: the reports'
    /// range queries bind theirs that way and compare text.
    #[tokio::test]
    async fn a_rows_time_is_stored_as_sqlx_binds_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("l.db").display());
        let ledger = SqliteLedger::open(&url).await.unwrap();
        let mut rows = Vec::new();
        for (i, nano) in [0, 120_000_000, 123_456_000, 123_456_789]
            .into_iter()
            .enumerate()
        {
            let mut e = super::super::journal::tests::event(&format!("r{i}"));
            e.started_at = DateTime::from_timestamp(1_764_547_200 + 86_399, nano).unwrap();
            rows.push(e);
        }
        assert_eq!(ledger.insert(&rows).await.unwrap(), 4);
        for e in &rows {
            let same: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE started_at = ?")
                .bind(e.started_at)
                .fetch_one(&ledger.pool)
                .await
                .unwrap();
            assert_eq!(same, 1, "{}", e.started_at);
        }
        let (from, to) = (rows[0].started_at, rows[3].started_at);
        let between = ledger.rows_between(from, to).await.unwrap();
        assert_eq!(
            between.len(),
            3,
            "the last is at the range's end, outside it"
        );
        assert_eq!(between[2].started_at, rows[2].started_at);
    }

    #[test]
    fn a_batch_goes_in_full_statements_then_descending_powers_of_two() {
        let rows: Vec<usize> = (0..64 * 2 + 45).collect();
        let sizes: Vec<usize> = statement_chunks(&rows).map(<[usize]>::len).collect();
        assert_eq!(sizes, [64, 64, 32, 8, 4, 1]);
        let back: Vec<usize> = statement_chunks(&rows).flatten().copied().collect();
        assert_eq!(back, rows, "every row once, in order");
        for n in 0..200 {
            let rows: Vec<usize> = (0..n).collect();
            for chunk in statement_chunks(&rows) {
                assert!(chunk.len().is_power_of_two() && chunk.len() <= ROWS_PER_INSERT);
            }
            assert_eq!(
                statement_chunks(&rows).map(<[usize]>::len).sum::<usize>(),
                n
            );
        }
    }
}
