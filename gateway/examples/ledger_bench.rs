//! Ledger benchmark: ingest rate into Postgres through the real writer, and the time of the
//! weekly report and its explanation over the rows written.
//!
//! ```sh
//! cargo run --release -p gateway --example ledger_bench -- \
//!     postgres://postgres@127.0.0.1:5432/postgres 1000000
//! ```
//! Creates (and drops) a database `gw_ledger_bench_<random>` on that server. With `sqlite` as the
//! first argument, the embedded default instead: a new SQLite file in a temporary directory.
//!
//! ```sh
//! cargo run --release -p gateway --example ledger_bench -- sqlite 1000000
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use chrono::{Duration, Utc};
use gateway::config::LedgerConfig;
use gateway::ledger::report::{self, IsoWeek};
use gateway::ledger::writer::LedgerWriter;
use gateway::metrics::Metrics;
use gateway::usage::{CacheStatus, UsageEvent, UsageSink, UsageSource};
use sqlx::Connection;

fn event(i: u64, week: IsoWeek) -> UsageEvent {
    let tenant = format!("tenant-{}", i % 50);
    let model = if i.is_multiple_of(4) {
        "large"
    } else {
        "small"
    };
    let prompt = 200 + (i * 7919) % 3000;
    let completion = 20 + (i * 104_729) % 400;
    let hit = i.is_multiple_of(10);
    let cost = if hit {
        0
    } else {
        (prompt * 2 + completion * 8) as i64
    };
    UsageEvent {
        request_id: format!("bench-{i}").into(),
        started_at: week.start() + Duration::milliseconds((i % 604_000_000) as i64),
        tenant_id: format!("ten_{}", i % 50),
        tenant_name: tenant,
        key_id: format!("key_{}", i % 400),
        tags: BTreeMap::from([
            ("feature".to_owned(), format!("feature-{}", i % 12)),
            ("session".to_owned(), format!("s-{}", i % 20_000)),
        ]),
        endpoint: "chat".into(),
        requested_model: model.into(),
        served_model: Some(format!("model-{model}").into()),
        tier: Some(model.into()),
        replica: Some(format!("{model}-{}", i % 3).into()),
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: prompt / 3,
        usage_source: UsageSource::Upstream,
        status: if i.is_multiple_of(97) { 502 } else { 200 },
        error_kind: None,
        stream: i.is_multiple_of(2),
        client_disconnected: false,
        latency_ms: 250.0,
        ttft_ms: Some(40.0),
        retries: 0,
        cache_status: if hit {
            CacheStatus::HitExact
        } else {
            CacheStatus::Miss
        },
        cost_micros: cost,
        output_cost_micros: if hit { 0 } else { (completion * 8) as i64 },
        saved_micros: if hit {
            (prompt * 2 + completion * 8) as i64
        } else {
            0
        },
        loop_flag: i.is_multiple_of(211),
        retry_storm_flag: false,
        loop_steps: 0,
        avoided_micros: 0,
        route_reason: Some("explicit".into()),
        routed: false,
        all_large_micros: None,
        replica_choice: None,
        matched_blocks: None,
        fingerprint: format!("{:032x}", i % 50_000),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    gateway::telemetry::install_crypto_provider();
    let mut args = std::env::args().skip(1);
    let server = args
        .next()
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let rows: u64 = args
        .next()
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(1_000_000);
    if server == "sqlite" {
        let dir = tempfile::tempdir()?;
        let url = format!("sqlite://{}", dir.path().join("ledger.db").display());
        return run(&url, rows).await;
    }
    let name = format!("gw_ledger_bench_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(&server).await?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await?;
    let base = server.rsplit_once('/').map_or(server.as_str(), |(b, _)| b);
    let url = format!("{base}/{name}");
    let result = run(&url, rows).await;
    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    result
}

/// `INSERT_BATCH=N`: the store's own insert alone, `N` rows a call (no writer, journal or
/// report), for a per-row cost that does not depend on how the writer happened to batch
/// (`valgrind --tool=callgrind` gives the same count run after run).
async fn insert_only(
    ledger: &dyn gateway::ledger::LedgerStore,
    rows: u64,
    batch: u64,
    weeks: [IsoWeek; 2],
) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut i = 0;
    while i < rows {
        let chunk: Vec<UsageEvent> = (i..(i + batch).min(rows))
            .map(|i| event(i, weeks[(i % 2) as usize]))
            .collect();
        ledger.insert(&chunk).await?;
        i += batch;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "insert only, {batch} rows a call: {rows} rows in {secs:.2} s = {:.0} rows/s ({} stored)",
        rows as f64 / secs,
        ledger.count().await?
    );
    Ok(())
}

async fn run(url: &str, rows: u64) -> anyhow::Result<()> {
    if url.starts_with("postgres") {
        gateway::store::postgres::PostgresStore::migrate(url).await?;
    }
    let ledger = gateway::ledger::open(url).await?;
    let this_week = IsoWeek::containing(Utc::now());
    let weeks = [this_week.previous(), this_week];
    if let Some(batch) = std::env::var("INSERT_BATCH")
        .ok()
        .and_then(|b| b.parse().ok())
    {
        return insert_only(ledger.as_ref(), rows, batch, weeks).await;
    }
    let dir = tempfile::tempdir()?;
    let config = LedgerConfig {
        spool_dir: dir.path().to_owned(),
        queue_capacity: 200_000,
        ..LedgerConfig::default()
    };
    let metrics = Metrics::new()?;
    let (sink, writer) = LedgerWriter::start(Arc::clone(&ledger), &config, &metrics)?;

    // Offer rows as fast as the writer takes them (a full queue would spool: count that too).
    let started = Instant::now();
    for i in 0..rows {
        let e = event(i, weeks[(i % 2) as usize]);
        sink.record(e);
        if i % 10_000 == 9_999 {
            // Let the writer keep up instead of overflowing into the spool.
            while metrics.ledger_queue.get() > 100_000 {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
    }
    writer.shutdown().await;
    let secs = started.elapsed().as_secs_f64();
    let stored = ledger.count().await?;
    let spooled = metrics
        .ledger_rows
        .with_label_values(&["overflow_spooled"])
        .get();
    println!(
        "ingest: {rows} rows in {secs:.1} s = {:.0} rows/s ({stored} stored, {spooled} overflowed to spool)",
        rows as f64 / secs
    );

    if url.starts_with("postgres") {
        sqlx::query("ANALYZE ledger")
            .execute(&sqlx::PgPool::connect(url).await?)
            .await?;
    }
    for _ in 0..2 {
        let t = Instant::now();
        let r = report::weekly(ledger.as_ref(), this_week, None).await?;
        let weekly = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let e = report::explain(ledger.as_ref(), this_week.previous(), this_week, None).await?;
        let explain = t.elapsed().as_secs_f64();
        println!(
            "weekly report over {} rows of {}: {weekly:.2} s; explain {} vs {}: {explain:.2} s (change {} µ$)",
            r.total.this.requests, r.week, e.from_week, e.to_week, e.to_micros - e.from_micros
        );
    }
    Ok(())
}
