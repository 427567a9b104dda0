//! The cost ledger: every field stored by both stores, costs at the price in force, and no row
//! lost or written twice across a database outage.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chrono::{SubsecRound, Utc};
use e2e::{chat_body, config, replica, PrivatePostgres, Sim, StoreKind, TestApp, TestStore, BOTH};
use gateway::config::PriceConfig;
use gateway::ledger::LedgerStore;
use gateway::usage::{CacheStatus, UsageEvent, UsageSource};
use reqwest::Method;
use serde_json::json;

fn full_event(i: u32) -> UsageEvent {
    UsageEvent {
        request_id: format!("req-{i}").into(),
        started_at: Utc::now().trunc_subsecs(6),
        tenant_id: "ten_1".into(),
        tenant_name: "acme".into(),
        key_id: "key_1".into(),
        tags: BTreeMap::from([
            ("feature".to_owned(), "search".to_owned()),
            ("user".to_owned(), "u-42".to_owned()),
            ("session".to_owned(), "s-7".to_owned()),
            ("team".to_owned(), "growth".to_owned()),
        ]),
        endpoint: "chat".into(),
        requested_model: "fast".into(),
        served_model: Some("sim-small".into()),
        tier: Some("small".into()),
        replica: Some("s1".into()),
        prompt_tokens: 1234,
        completion_tokens: 56,
        cached_tokens: 1024,
        usage_source: UsageSource::Tokenizer,
        status: 499,
        error_kind: Some("stream_timeout".into()),
        stream: true,
        client_disconnected: true,
        latency_ms: 812.5,
        ttft_ms: Some(95.25),
        retries: 2,
        cache_status: CacheStatus::Bypass,
        cost_micros: 987_654,
        output_cost_micros: 654_321,
        saved_micros: 12,
        loop_flag: true,
        retry_storm_flag: true,
        fingerprint: "0123456789abcdef0123456789abcdef".into(),
        loop_steps: 4,
        avoided_micros: 4_321,
        route_reason: Some("classifier".into()),
        routed: true,
        all_large_micros: Some(1_234_567),
        replica_choice: Some("affinity".into()),
        matched_blocks: Some(12),
    }
}

async fn ledger_for(store: &TestStore) -> std::sync::Arc<dyn LedgerStore> {
    gateway::ledger::open(&store.url).await.unwrap()
}

#[tokio::test]
async fn every_usage_field_lands_in_the_ledger_and_replays_are_no_ops_on_both_stores() {
    for kind in BOTH {
        let store = TestStore::new(kind).await.unwrap();
        let ledger = ledger_for(&store).await;
        let mut sparse = full_event(2);
        sparse.served_model = None;
        sparse.tier = None;
        sparse.replica = None;
        sparse.error_kind = None;
        sparse.ttft_ms = None;
        sparse.tags.clear();
        sparse.routed = false;
        sparse.all_large_micros = None;
        sparse.replica_choice = None;
        sparse.matched_blocks = None;
        let rows = vec![full_event(1), sparse];
        assert_eq!(ledger.insert(&rows).await.unwrap(), 2, "{kind:?}");
        assert_eq!(
            ledger.insert(&rows).await.unwrap(),
            0,
            "{kind:?}: a replay inserts nothing"
        );
        let from = Utc::now() - chrono::Duration::hours(1);
        let back = ledger
            .rows_between(from, Utc::now() + chrono::Duration::hours(1))
            .await
            .unwrap();
        assert_eq!(back.len(), 2);
        let by_id = |id: &str| back.iter().find(|r| &*r.request_id == id).unwrap().clone();
        assert_eq!(by_id("req-1"), rows[0], "{kind:?}");
        assert_eq!(by_id("req-2"), rows[1], "{kind:?}");
        assert_eq!(ledger.count().await.unwrap(), 2);
        // The daily rollup counted each row once despite the replay, and agrees with the rows.
        assert_eq!(todays_requests(ledger.as_ref()).await, 2, "{kind:?}");
    }
}

#[tokio::test]
async fn a_large_batch_that_replays_part_of_an_earlier_one_stores_and_rolls_up_each_row_once() {
    for kind in BOTH {
        let store = TestStore::new(kind).await.unwrap();
        let ledger = ledger_for(&store).await;
        let rows: Vec<UsageEvent> = (0..150).map(full_event).collect();
        // The first 70 are stored, then all 150 arrive (a spool replay overlapping live rows):
        // more rows than one SQLite statement holds, some of them already there.
        assert_eq!(ledger.insert(&rows[..70]).await.unwrap(), 70, "{kind:?}");
        assert_eq!(ledger.insert(&rows).await.unwrap(), 80, "{kind:?}");
        assert_eq!(ledger.count().await.unwrap(), 150, "{kind:?}");
        assert_eq!(todays_requests(ledger.as_ref()).await, 150, "{kind:?}");
    }
}

/// Rows of every kind the measures tell apart: cache outcomes, loop and retry flags, failures,
/// tiers, routed or not, fallbacks, refusals, usage sources, with and without a feature or a
/// served model; spread over yesterday and today (never at midnight), two tenants.
fn varied_event(i: u32) -> UsageEvent {
    let mut e = full_event(i);
    // A small integer hash, so the choices are independent of each other.
    let pick = |n: u32, salt: u32| {
        let mut x = i.wrapping_mul(0x9E37_79B9) ^ salt.wrapping_mul(0x85EB_CA6B);
        x ^= x >> 15;
        x = x.wrapping_mul(0xC2B2_AE35);
        x ^= x >> 13;
        x % n
    };
    let today = Utc::now()
        .date_naive()
        .and_hms_opt(0, 0, 0)
        .unwrap()
        .and_utc();
    e.started_at = today - chrono::Duration::days(i64::from(pick(2, 1)))
        + chrono::Duration::seconds(1 + i64::from(i % 3600));
    e.tenant_name = ["acme", "globex"][pick(2, 2) as usize].into();
    e.cache_status = [
        CacheStatus::Bypass,
        CacheStatus::Miss,
        CacheStatus::HitExact,
        CacheStatus::HitSemantic,
        CacheStatus::Coalesced,
    ][pick(5, 3) as usize];
    e.loop_flag = pick(4, 4) == 0;
    e.retry_storm_flag = pick(4, 5) == 0;
    e.status = [200, 200, 429, 499, 502][pick(5, 6) as usize];
    e.tier = [None, Some("small".into()), Some("large".into())][pick(3, 7) as usize].clone();
    e.route_reason =
        [None, Some("classifier".into()), Some("unhealthy".into())][pick(3, 8) as usize].clone();
    e.all_large_micros = (pick(2, 9) == 0).then_some(i64::from(i) * 1_000);
    e.routed = e.all_large_micros.is_some();
    e.error_kind = [
        None,
        Some("loop_detected".into()),
        Some("upstream_error".into()),
    ][pick(3, 10) as usize]
        .clone();
    e.usage_source = [
        UsageSource::Upstream,
        UsageSource::Tokenizer,
        UsageSource::None,
        UsageSource::Synthetic,
    ][pick(4, 11) as usize];
    if pick(3, 12) == 0 {
        e.tags.remove("feature");
    }
    if pick(4, 13) == 0 {
        e.served_model = None;
    }
    e.cost_micros = i64::from(pick(10_000, 14));
    e.output_cost_micros = e.cost_micros / 3;
    e.saved_micros = i64::from(pick(500, 15));
    e.avoided_micros = i64::from(pick(700, 16));
    e.prompt_tokens = u64::from(pick(3_000, 17));
    e.completion_tokens = u64::from(pick(300, 18));
    e.cached_tokens = e.prompt_tokens / 2;
    e
}

/// The writer adds a batch to the daily rollup from the rows it holds (or, after a replay, from
/// the rows it stored): every measure of every rollup row must equal the same aggregate over the
/// raw rows, whatever the batch sizes.
#[tokio::test]
async fn the_daily_rollup_agrees_with_the_rows_for_every_kind_of_row_on_both_stores() {
    use gateway::ledger::report::Dimension;
    let rows: Vec<UsageEvent> = (0..400).map(varied_event).collect();
    for kind in BOTH {
        let store = TestStore::new(kind).await.unwrap();
        let ledger = ledger_for(&store).await;
        let mut at = 0;
        for n in [1, 7, 64, 100, 28] {
            assert_eq!(ledger.insert(&rows[at..at + n]).await.unwrap(), n as u64);
            at += n;
        }
        // A replay overlapping new rows.
        assert_eq!(ledger.insert(&rows[150..]).await.unwrap(), 200, "{kind:?}");
        let today = Utc::now()
            .date_naive()
            .and_hms_opt(0, 0, 0)
            .unwrap()
            .and_utc();
        let (from, to) = (
            today - chrono::Duration::days(1),
            today + chrono::Duration::days(1),
        );
        let all = [
            Dimension::Tenant,
            Dimension::Model,
            Dimension::Tier,
            Dimension::Feature,
        ];
        let sorted = |mut v: Vec<(String, gateway::ledger::report::Aggregate)>| {
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        for group in [&all[..], &[Dimension::Model], &[]] {
            let rollup = sorted(ledger.aggregate(from, to, None, group).await.unwrap());
            let raw = sorted(
                ledger
                    .aggregate(from + chrono::Duration::microseconds(1), to, None, group)
                    .await
                    .unwrap(),
            );
            assert!(
                rollup.len() >= group.len(),
                "{kind:?} {group:?}: {rollup:?}"
            );
            assert_eq!(
                rollup, raw,
                "{kind:?} {group:?}: the rollup agrees with the rows"
            );
        }
        let days = [today - chrono::Duration::days(1), today];
        for day in days {
            let next = day + chrono::Duration::days(1);
            let rollup = sorted(
                ledger
                    .aggregate(day, next, Some("acme"), &all)
                    .await
                    .unwrap(),
            );
            let raw = sorted(
                ledger
                    .aggregate(
                        day + chrono::Duration::microseconds(1),
                        next,
                        Some("acme"),
                        &all,
                    )
                    .await
                    .unwrap(),
            );
            assert!(!rollup.is_empty(), "{kind:?}: rows on {day}");
            assert_eq!(rollup, raw, "{kind:?} {day}: one day, one tenant");
        }
    }
}

/// A regression guard, not a benchmark: a batch of the default size must be stored within the
/// default write timeout, or at saturation every batch times out and goes to the spool (a
/// quadratic parameter lookup once made the SQLite writer take 2.7 s for one in release builds).
#[tokio::test]
async fn a_default_size_batch_is_stored_within_the_write_timeout_on_both_stores() {
    let defaults = gateway::config::LedgerConfig::default();
    for kind in BOTH {
        let store = TestStore::new(kind).await.unwrap();
        let ledger = ledger_for(&store).await;
        let rows: Vec<UsageEvent> = (0..defaults.batch_rows)
            .map(|i| full_event(u32::try_from(i).unwrap()))
            .collect();
        let started = std::time::Instant::now();
        let stored = ledger.insert(&rows).await.unwrap();
        let took = started.elapsed();
        assert_eq!(stored, rows.len() as u64, "{kind:?}");
        // In a debug build on a busy CI machine (about 0.3 s quiet): only a gross regression fails.
        assert!(
            took.as_millis() < u128::from(defaults.write_timeout_ms),
            "{kind:?}: {} rows took {took:?} (write timeout {} ms)",
            rows.len(),
            defaults.write_timeout_ms
        );
    }
}

/// Today's requests of the one tenant, as the daily rollup counts them; checked to agree with
/// the raw rows (a range that starts a microsecond into the day is read from them).
async fn todays_requests(ledger: &dyn LedgerStore) -> i64 {
    use gateway::ledger::report::Dimension;
    let day = Utc::now()
        .date_naive()
        .and_hms_opt(0, 0, 0)
        .unwrap()
        .and_utc();
    let next = day + chrono::Duration::days(1);
    let rollup = ledger
        .aggregate(day, next, None, &[Dimension::Tenant])
        .await
        .unwrap();
    let raw = ledger
        .aggregate(
            day + chrono::Duration::microseconds(1),
            next,
            None,
            &[Dimension::Tenant],
        )
        .await
        .unwrap();
    assert_eq!(rollup, raw, "the rollup agrees with the rows");
    rollup[0].1.requests
}

/// Rows that started within an hour of now.
async fn recent_rows(ledger: &dyn LedgerStore) -> Vec<UsageEvent> {
    let now = Utc::now();
    let hour = chrono::Duration::hours(1);
    ledger.rows_between(now - hour, now + hour).await.unwrap()
}

async fn wait_for_rows(ledger: &dyn LedgerStore, n: u64, within: Duration) {
    let what = format!("the ledger has {n} rows");
    e2e::eventually(&what, within, || async {
        (ledger.count().await.unwrap_or(0) >= n).then_some(())
    })
    .await;
}

#[tokio::test]
async fn requests_are_costed_at_the_price_in_force_including_cached_tokens() {
    let sim = Sim::zero("sim-small").await;
    let mut c = config(
        vec![replica("s", &sim.url, "sim-small")],
        vec![replica("l", &sim.url, "sim-small")],
    );
    c.prices.insert(
        "sim-small".into(),
        PriceConfig {
            input: 2.0,
            output: 8.0,
            cached_input: Some(0.5),
        },
    );
    let dir = tempfile::tempdir().unwrap();
    c.ledger.spool_dir = dir.path().to_owned();
    c.ledger.flush_ms = 20;
    let store = TestStore::new(StoreKind::Sqlite).await.unwrap();
    let ledger = ledger_for(&store).await;
    let app = TestApp::spawn_with_ledger(c, store).await;

    // A long shared prefix: the second request hits the simulator's prefix cache.
    let long = "the quick brown fox jumps over the lazy dog ".repeat(20);
    let mut body = chat_body("fast", &long);
    body["max_tokens"] = json!(10);
    assert_eq!(app.chat(body.clone()).await.status(), 200);
    assert_eq!(app.chat(body.clone()).await.status(), 200);
    wait_for_rows(ledger.as_ref(), 2, Duration::from_secs(5)).await;

    let r = app
        .admin(
            Method::POST,
            "prices",
            Some(json!({"model": "sim-small", "input": 4.0, "output": 16.0, "cached_input": 1.0})),
        )
        .await;
    assert_eq!(r.status(), 201);
    assert_eq!(app.chat(body).await.status(), 200);
    wait_for_rows(ledger.as_ref(), 3, Duration::from_secs(5)).await;

    let rows = recent_rows(ledger.as_ref()).await;
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0].cached_tokens, 0);
    assert!(
        rows[1].cached_tokens > 0,
        "second request reused the prefix"
    );
    for (i, r) in rows.iter().enumerate() {
        let (input, output, cached) = if i < 2 {
            (2.0, 8.0, 0.5)
        } else {
            (4.0, 16.0, 1.0)
        };
        let uncached = (r.prompt_tokens - r.cached_tokens) as f64;
        let expected = (uncached * input
            + r.cached_tokens as f64 * cached
            + r.completion_tokens as f64 * output)
            .round() as i64;
        assert_eq!(r.cost_micros, expected, "row {i}: {r:?}");
        assert_eq!(r.tenant_name, "acme");
        assert_eq!(r.tags["feature"], "tests");
        assert_eq!(r.fingerprint.len(), 32);
    }
    assert_eq!(
        rows[0].fingerprint, rows[2].fingerprint,
        "same question, same fingerprint"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_database_outage_loses_no_row_and_writes_none_twice() {
    let pg = PrivatePostgres::start_migrated().await.unwrap();
    let sim = Sim::zero("sim-small").await;
    let mut c = config(
        vec![replica("s", &sim.url, "sim-small")],
        vec![replica("l", &sim.url, "sim-small")],
    );
    let dir = tempfile::tempdir().unwrap();
    c.store.url = pg.url.clone();
    c.ledger.spool_dir = dir.path().to_owned();
    c.ledger.flush_ms = 20;
    c.ledger.write_timeout_ms = 500;
    let store = TestStore::at(&pg.url).await.unwrap();
    let app = TestApp::spawn_with_ledger(c, store).await;

    let send = |n: usize| {
        let app = &app;
        async move {
            let mut worst = Duration::ZERO;
            for i in 0..n {
                let t = Instant::now();
                let status = app
                    .chat(chat_body("fast", &format!("question {i}")))
                    .await
                    .status();
                assert_eq!(status, 200);
                worst = worst.max(t.elapsed());
            }
            worst
        }
    };
    send(50).await;
    pg.stop().unwrap();
    // Keys are cached, so requests keep working while the database is down.
    let worst_during_outage = send(100).await;
    assert!(
        worst_during_outage < Duration::from_secs(1),
        "requests not held up: {worst_during_outage:?}"
    );
    let spooled = || async {
        let metrics = app.metrics().await;
        metrics
            .lines()
            .find(|l| l.starts_with("gateway_ledger_spooled_rows "))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    e2e::eventually(
        "rows go to the spool during the outage",
        Duration::from_secs(5),
        || async { (spooled().await > 0.0).then_some(()) },
    )
    .await;
    pg.resume().unwrap();
    send(50).await;
    let ledger = gateway::ledger::open(&pg.url).await.unwrap();
    wait_for_rows(ledger.as_ref(), 200, Duration::from_secs(15)).await;
    app.stop().await;
    let rows = recent_rows(ledger.as_ref()).await;
    let ids: std::collections::HashSet<_> = rows.iter().map(|r| r.request_id.clone()).collect();
    assert_eq!(rows.len(), 200, "every request has exactly one row");
    assert_eq!(ids.len(), 200);
}

/// `gateway serve` (the real binary) on a SQLite store in `dir`, its ledger's rows waiting
/// `flush_ms` in the queue, with `journal` on or off.
fn ledger_process(
    dir: &std::path::Path,
    sim: &Sim,
    flush_ms: u64,
    journal: bool,
) -> (tokio::process::Child, String) {
    let port = e2e::free_port();
    let db = format!("sqlite://{}", dir.join("g.db").display());
    let toml = e2e::serve_toml(
        port,
        &db,
        dir,
        (&sim.url, &sim.url),
        "[cache]\nmode = \"off\"",
    );
    let (flush, journal) = (flush_ms.to_string(), journal.to_string());
    let env = [
        ("GATEWAY__LEDGER__FLUSH_MS", Some(flush.as_str())),
        ("GATEWAY__LEDGER__JOURNAL", Some(journal.as_str())),
    ];
    let child = e2e::serve_binary(dir, &toml, &env);
    (child, format!("http://127.0.0.1:{port}"))
}

/// The status of a chat request with `text` for model `fast` to the gateway at `base`.
async fn ask(http: &reqwest::Client, base: &str, secret: &str, text: &str) -> u16 {
    http.post(format!("{base}/v1/chat/completions"))
        .bearer_auth(secret)
        .json(&chat_body("fast", text))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// A tenant and a key in the SQLite store at `url` (created and migrated): the key's secret.
async fn key_in(url: &str) -> String {
    let store = TestStore::at(url).await.unwrap();
    let tenant = store.store.create_tenant("acme").await.unwrap();
    let g = gateway::keys::generate();
    store
        .store
        .create_key(gateway::store::NewKey {
            tenant_id: tenant.id,
            name: None,
            hash: g.hash,
            prefix: g.prefix,
            tags: BTreeMap::new(),
            client_tags: None,
        })
        .await
        .unwrap();
    g.secret
}

#[tokio::test]
async fn a_gateway_stopped_by_sigterm_answers_and_writes_every_row_on_either_runtime() {
    gateway::telemetry::install_crypto_provider();
    let sim = Sim::zero("sim-small").await;
    for runtime in [("per-core", "3"), ("shared", "0")] {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("g.db").display());
        let secret = key_in(&url).await;
        let port = e2e::free_port();
        let toml = e2e::serve_toml(
            port,
            &url,
            dir.path(),
            (&sim.url, &sim.url),
            "[cache]\nmode = \"off\"",
        );
        // Rows wait in the queue until the drain at shutdown writes them.
        let env = [
            ("GATEWAY__LEDGER__FLUSH_MS", Some("30000")),
            ("GATEWAY__SERVER__RUNTIME", Some(runtime.0)),
            ("GATEWAY__SERVER__THREADS", Some(runtime.1)),
        ];
        let mut child = e2e::serve_binary(dir.path(), &toml, &env);
        let base = format!("http://127.0.0.1:{port}");
        e2e::until_healthy(&base, &mut child).await;
        // Eight clients at once, each on connections of its own, so that every lane serves some.
        let sends = (0..8).map(|c| {
            let (base, secret) = (base.clone(), secret.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                for i in 0..10 {
                    let status = ask(&http, &base, &secret, &format!("question {c}-{i}")).await;
                    assert_eq!(status, 200, "{runtime:?}");
                }
            })
        });
        for s in futures_util::future::join_all(sends).await {
            s.unwrap();
        }
        let pid = child.id().unwrap().to_string();
        let term = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(term.success());
        let exit = tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .expect("the gateway exits after its drain")
            .unwrap();
        let log = std::fs::read_to_string(dir.path().join("gateway.log")).unwrap();
        assert!(exit.success(), "{runtime:?}: {exit:?}\n{log}");
        let ledger = gateway::ledger::open(&url).await.unwrap();
        let rows = recent_rows(ledger.as_ref()).await;
        let ids: std::collections::HashSet<_> = rows.iter().map(|r| r.request_id.clone()).collect();
        assert_eq!(
            (rows.len(), ids.len()),
            (80, 80),
            "{runtime:?}: every row, once, written by the drain"
        );
        if runtime.0 == "per-core" {
            assert!(log.contains("threads=3"), "{log}");
        }
    }
}

#[tokio::test]
async fn a_gateway_killed_with_rows_queued_loses_none_of_them() {
    gateway::telemetry::install_crypto_provider();
    let sim = Sim::zero("sim-small").await;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("g.db").display());
    let secret = key_in(&url).await;
    // Rows wait 30 s in the queue: at the kill every one of them is only in the process.
    let (mut child, base) = ledger_process(dir.path(), &sim, 30_000, true);
    e2e::until_healthy(&base, &mut child).await;
    let http = reqwest::Client::new();
    let n = 120;
    for i in 0..n {
        assert_eq!(
            ask(&http, &base, &secret, &format!("question {i}")).await,
            200
        );
    }
    let ledger = gateway::ledger::open(&url).await.unwrap();
    assert_eq!(
        ledger.count().await.unwrap(),
        0,
        "nothing written before the kill"
    );
    child.start_kill().unwrap(); // SIGKILL: no drain, no flush
    child.wait().await.unwrap();
    let (mut child, base) = ledger_process(dir.path(), &sim, 200, true);
    e2e::until_healthy(&base, &mut child).await;
    wait_for_rows(ledger.as_ref(), n, Duration::from_secs(15)).await;
    let rows = recent_rows(ledger.as_ref()).await;
    let ids: std::collections::HashSet<_> = rows.iter().map(|r| r.request_id.clone()).collect();
    assert_eq!(
        (rows.len(), ids.len()),
        (n as usize, n as usize),
        "every row, once"
    );
    child.start_kill().unwrap();
}
