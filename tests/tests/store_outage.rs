//! The database (store) down: what readiness says, what known and unknown keys get, how much
//! store work unknown keys can cause, and what starting a replica does.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::time::{Duration, Instant};

use e2e::{chat_body, config, replica, PrivatePostgres, Sim, TestApp, TestStore};
use serde_json::Value;

fn lookups(metrics: &str, outcome: &str) -> u64 {
    let series = format!("gateway_key_lookups_total{{outcome=\"{outcome}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn random_key(i: usize) -> String {
    format!("sk-gw-{:0>40}", format!("unknown{i}"))
}

#[tokio::test]
async fn unknown_keys_are_bounded_and_the_database_does_not_decide_readiness() {
    let pg = PrivatePostgres::start_migrated().await.unwrap();
    let sim = Sim::zero("sim-small").await;
    let mut c = config(
        vec![replica("s", &sim.url, "sim-small")],
        vec![replica("l", &sim.url, "sim-small")],
    );
    // No refresh during the test: the negative cache lives until the next one.
    c.store.key_refresh_ms = 600_000;
    let store = TestStore::at(&pg.url).await.unwrap();
    let app = TestApp::spawn_on(c, store, true).await;
    let status = |key: String| {
        let app = &app;
        async move {
            app.chat_as(&key, &chat_body("fast", "hi"))
                .await
                .status()
                .as_u16()
        }
    };

    // Database up: an unknown key asked 20 times costs one store lookup.
    for _ in 0..20 {
        assert_eq!(status(random_key(0)).await, 401);
    }
    let m = app.metrics().await;
    assert_eq!(lookups(&m, "unknown"), 1, "{m}");
    assert_eq!(lookups(&m, "cached_unknown"), 19);

    pg.stop().unwrap();
    // Readiness: this replica can still serve.
    let ready = app
        .http
        .get(format!("{}/readyz", app.base))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let body: Value = ready.json().await.unwrap();
    assert_eq!(body["store"], false, "{body}");
    // The known key is served from the snapshot.
    assert_eq!(status(app.api_key.clone()).await, 200);
    // Fifty distinct unknown keys at once: quick 503s (or 401 for the one already known to be
    // unknown), never a 500, and almost no store work.
    let started = Instant::now();
    let answers = futures_util::future::join_all((0..50).map(|i| status(random_key(i)))).await;
    let took = started.elapsed();
    assert!(
        answers.iter().all(|s| *s == 503 || *s == 401),
        "{answers:?}"
    );
    assert_eq!(answers[0], 401, "known unknown: from the negative cache");
    assert!(
        took < Duration::from_secs(3),
        "50 unknown keys took {took:?}"
    );
    let m = app.metrics().await;
    assert!(
        lookups(&m, "error") <= super_bound(took),
        "store lookups during the outage: {} in {took:?}",
        lookups(&m, "error")
    );
    let r = app.chat_as(&random_key(99), &chat_body("fast", "hi")).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("cannot be verified right now"));

    pg.resume().unwrap();
    app.stop().await;
}

/// Lookups allowed while the store fails: the four that may run at once, then one per second of
/// back-off.
fn super_bound(took: Duration) -> u64 {
    gateway::keys::LOOKUP_CONCURRENCY as u64 + took.as_secs() + 1
}

#[tokio::test]
async fn a_replica_started_while_the_database_is_down_exits_naming_store_url() {
    let dir = tempfile::tempdir().unwrap();
    let port = e2e::free_port();
    // A Postgres URL nothing listens on.
    let db_port = e2e::free_port();
    let toml = e2e::offline_toml(
        port,
        &format!("postgres://postgres@127.0.0.1:{db_port}/test"),
        dir.path(),
    );
    let mut child = e2e::serve_binary(dir.path(), &toml, &[]);
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("exits instead of waiting for the database")
        .unwrap();
    let log = std::fs::read_to_string(dir.path().join("gateway.log")).unwrap();
    assert!(!status.success(), "{log}");
    assert!(log.contains("store.url"), "{log}");
    assert!(log.contains("database"), "{log}");
}
