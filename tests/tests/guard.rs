//! The guard step end to end: a request whose conversation shows an agent loop is flagged
//! (header, ledger flag, metric) with its session; a progressing one is not.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use e2e::{Sim, StoreKind, TestApp};
use serde_json::{json, Value};

fn agent(results: &[&str]) -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Make the tests pass."}),
    ];
    for (i, r) in results.iter().enumerate() {
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": format!("c{i}"), "type": "function",
            "function": {"name": "run_tests", "arguments": "{\"path\": \"tests/\"}"}}]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": r}));
    }
    json!({"model": "fast", "messages": messages})
}

async fn app() -> (TestApp, Sim) {
    let sim = Sim::zero("sim-small").await;
    let c = e2e::config_on(&sim, None);
    (TestApp::spawn(c, StoreKind::Sqlite).await, sim)
}

#[tokio::test]
async fn a_looping_agent_is_flagged_with_its_session_and_a_progressing_one_is_not() {
    let (mut app, _sim) = app().await;
    let stuck = agent(&[
        "FAILED test_parse (0.51s) at 10:00:01",
        "FAILED test_parse (0.48s) at 10:00:09",
        "FAILED test_parse (0.50s) at 10:00:17",
    ]);
    let r = send(&app, "run-7", &stuck).await;
    assert_eq!(r.status(), 200);
    let flag = r.headers()["x-gateway-loop"].to_str().unwrap().to_owned();
    assert!(
        flag.starts_with("flagged; session=run-7; repeats=3"),
        "{flag}"
    );
    let e = app.next_event().await;
    assert!(e.loop_flag);
    assert_eq!(e.tags["session"], "run-7");

    let moving = agent(&[
        "3 failed, 7 passed",
        "2 failed, 8 passed",
        "1 failed, 9 passed",
    ]);
    let r = app.chat(moving).await;
    assert_eq!(r.status(), 200);
    assert!(!r.headers().contains_key("x-gateway-loop"));
    let e = app.next_event().await;
    assert!(!e.loop_flag);
    assert!(
        e.tags["session"].starts_with("drv_"),
        "a session without an id is derived: {:?}",
        e.tags
    );
    let m = app.metrics().await;
    assert!(
        m.contains("gateway_guard_loops_total{action=\"flag\"} 1"),
        "{m}"
    );
    assert!(!m.contains("run-7"), "no session in the metrics");
    app.stop().await;
}

#[tokio::test]
async fn an_absurd_session_id_is_refused_naming_the_header() {
    let (app, _sim) = app().await;
    for bad in ["has spaces", &"x".repeat(500)] {
        let r = app
            .http
            .post(format!("{}/v1/chat/completions", app.base))
            .bearer_auth(&app.api_key)
            .header("x-session-id", bad)
            .json(&e2e::chat_body("fast", "hi"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], "x-session-id", "{v}");
    }
    app.stop().await;
}

/// A gateway writing its real ledger (SQLite, flushed every 20 ms), priced, on a simulator.
async fn ledger_app() -> (TestApp, Sim, tempfile::TempDir) {
    let sim = Sim::zero("sim-small").await;
    let mut c = e2e::config_on(&sim, Some((1.0, 2.0)));
    let dir = tempfile::tempdir().unwrap();
    c.ledger.spool_dir = dir.path().to_owned();
    c.ledger.flush_ms = 20;
    let store = e2e::TestStore::new(StoreKind::Sqlite).await.unwrap();
    (TestApp::spawn_with_ledger(c, store).await, sim, dir)
}

/// Wait until the ledger holds `n` rows.
async fn rows_written(ledger: &dyn gateway::ledger::LedgerStore, n: u64) {
    e2e::eventually(
        "the rows written",
        std::time::Duration::from_secs(5),
        || async { (ledger.count().await.unwrap() == n).then_some(()) },
    )
    .await;
}

#[tokio::test]
async fn a_flagged_loop_is_counted_as_waste_in_the_weekly_report() {
    let (app, _sim, _dir) = ledger_app().await;
    let ledger = gateway::ledger::open(&app.store.url).await.unwrap();
    let stuck = agent(&["same error", "same error", "same error"]);
    assert!(app
        .chat(stuck)
        .await
        .headers()
        .contains_key("x-gateway-loop"));
    assert_eq!(app.chat(e2e::chat_body("fast", "hi")).await.status(), 200);
    rows_written(ledger.as_ref(), 2).await;
    let week = gateway::ledger::report::IsoWeek::containing(chrono::Utc::now());
    let r = gateway::ledger::report::weekly(ledger.as_ref(), week, None)
        .await
        .unwrap();
    let rows = ledger.rows_between(week.start(), week.end()).await.unwrap();
    let looped: i64 = rows
        .iter()
        .filter(|r| r.loop_flag)
        .map(|r| r.cost_micros)
        .sum();
    assert!(looped > 0);
    assert_eq!(
        r.total.this.waste_loops, looped,
        "the flagged request's cost, and only it"
    );
    app.stop().await;
}

#[tokio::test]
async fn the_loops_report_weekly_report_and_page_show_what_a_caught_loop_burned_and_avoided() {
    let (app, _sim, _dir) = ledger_app().await;
    let ledger = gateway::ledger::open(&app.store.url).await.unwrap();
    let (ok, out) = app
        .ctl(&["guard", "set", "--tenant", "acme", "--action", "throttle"])
        .await;
    assert!(ok, "{out}");
    // Progress, then the agent's first two runs of the failing tests (answered), then the third
    // (caught: refused) and one more during the cooldown (refused).
    let hello = send(&app, "run-r", &e2e::chat_body("fast", "hello")).await;
    assert_eq!(hello.status(), 200);
    for n in 1..=2 {
        let results = vec!["FAILED test_parse"; n];
        assert_eq!(send(&app, "run-r", &agent(&results)).await.status(), 200);
    }
    for _ in 0..2 {
        assert_eq!(send(&app, "run-r", &stuck()).await.status(), 429);
    }
    rows_written(ledger.as_ref(), 5).await;
    let now = chrono::Utc::now();
    let mut rows = ledger
        .rows_between(now - chrono::Duration::hours(1), now)
        .await
        .unwrap();
    rows.sort_by_key(|r| r.started_at);
    let steps: i64 = rows[1..3].iter().map(|r| r.cost_micros).sum();
    assert!(steps > 0 && rows[1..3].iter().all(|r| !r.loop_flag));
    let avoided: i64 = rows[3..].iter().map(|r| r.avoided_micros).sum();
    assert!(avoided > 0, "{rows:?}");

    let (ok, out) = app
        .ctl(&["--json", "report", "loops", "--hours", "1"])
        .await;
    assert!(ok, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let d = &v["detected"];
    assert_eq!(d.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(d[0]["session"], "run-r");
    assert_eq!(d[0]["repeats"], 3);
    assert_eq!(
        d[0]["requests_before"], 2,
        "the two earlier runs, not the hello"
    );
    assert_eq!(d[0]["burned_before_micros"], steps);
    assert_eq!(d[0]["flagged_requests"], 0);
    assert_eq!(d[0]["refused"], 2);
    assert_eq!(d[0]["avoided_micros"], avoided);
    assert_eq!(v["detected_total"]["loops"], 1);
    let (ok, table) = app.ctl(&["report", "loops", "--hours", "1"]).await;
    assert!(
        ok && table.contains("Agent loops the guard caught") && table.contains("run-r"),
        "{table}"
    );
    let (ok, out) = app.ctl(&["report", "loops", "--hours", "0"]).await;
    assert!(
        !ok && out.contains("`hours` must be between 1 and"),
        "{out}"
    );

    let (ok, out) = app.ctl(&["--json", "report", "weekly"]).await;
    assert!(ok, "{out}");
    let w: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(w["loops"]["total"]["loops"], 1, "{w}");
    assert_eq!(w["loops"]["total"]["burned_before_micros"], steps);
    assert_eq!(w["loops"]["total"]["avoided_micros"], avoided);
    assert_eq!(w["loops"]["top"][0]["session"], "run-r");

    let page = app
        .http
        .get(format!("{}/dashboard", app.base))
        .bearer_auth(e2e::ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(r#"id="loops-count" data-value="1""#),
        "{page}"
    );
    assert!(page.contains(&format!(
        r#"id="headline-loops-before" data-cost-micros="{steps}""#
    )));
    assert!(page.contains(&format!(
        r#"id="headline-loops-avoided" data-cost-micros="{avoided}""#
    )));
    assert!(page.contains(r#"<tr data-session="run-r""#));
    app.stop().await;
}

/// The guard's session store for `kind` (Redis ones keyed by this test's fresh tenant id).
fn guard_store(kind: e2e::BudgetKind) -> std::sync::Arc<dyn gateway::guard::store::GuardStore> {
    match kind {
        e2e::BudgetKind::Memory => std::sync::Arc::new(gateway::guard::memory::MemoryGuard::new(
            1000,
            std::time::Duration::from_secs(3600),
        )),
        _ => std::sync::Arc::new(
            gateway::guard::redis::RedisGuard::new(
                kind.redis_urls(),
                std::time::Duration::from_secs(2),
            )
            .unwrap(),
        ),
    }
}

async fn app_on(
    kind: e2e::BudgetKind,
    clock: std::sync::Arc<gateway::budget::ManualClock>,
) -> (TestApp, Sim) {
    let sim = Sim::zero("sim-small").await;
    let c = e2e::config_on(&sim, Some((1.0, 2.0)));
    let store = e2e::TestStore::new(StoreKind::Sqlite).await.unwrap();
    let deps = gateway::state::Deps {
        clock: Some(clock),
        guard_store: Some(guard_store(kind)),
        ..Default::default()
    };
    (TestApp::spawn_custom(c, store, true, true, deps).await, sim)
}

async fn send(app: &TestApp, session: &str, body: &Value) -> reqwest::Response {
    send_as(app, &app.api_key, session, body).await
}

/// [`send`] with another API key (a second gateway on the first one's store).
async fn send_as(app: &TestApp, key: &str, session: &str, body: &Value) -> reqwest::Response {
    app.http
        .post(format!("{}/v1/chat/completions", app.base))
        .bearer_auth(key)
        .header("x-session-id", session)
        .json(body)
        .send()
        .await
        .unwrap()
}

fn stuck() -> Value {
    agent(&[
        "FAILED test_parse",
        "FAILED test_parse",
        "FAILED test_parse",
    ])
}

#[tokio::test]
async fn a_throttled_loop_is_refused_for_its_cooldown_then_allowed_on_every_store() {
    for kind in e2e::BUDGET_STORES {
        let clock = gateway::budget::ManualClock::at(chrono::Utc::now());
        let (mut app, _sim) = app_on(kind, clock.clone()).await;
        let (ok, out) = app
            .ctl(&[
                "guard",
                "set",
                "--tenant",
                "acme",
                "--action",
                "throttle",
                "--cooldown-secs",
                "30",
            ])
            .await;
        assert!(ok && out.contains("throttle"), "{out}");
        // A progressing step first: answered, and its cost becomes the session's estimate.
        let r = send(&app, "run-t", &e2e::chat_body("fast", "hello")).await;
        assert_eq!(r.status(), 200, "{kind:?}");
        let _ = app.next_event().await;
        let r = send(&app, "run-t", &stuck()).await;
        assert_eq!(r.status(), 429, "{kind:?}");
        assert_eq!(r.headers()["retry-after"], "30");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "loop_detected", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("run-t")
                && message.contains("run_tests")
                && message.contains("gatewayctl sessions clear"),
            "{message}"
        );
        let e = app.next_event().await;
        assert!(e.loop_flag && e.loop_steps == 3 && e.status == 429, "{e:?}");
        assert!(
            e.avoided_micros > 0,
            "the refused request's estimated cost: {e:?}"
        );
        // During the cooldown even a progressing request of the session is refused.
        clock.advance(std::time::Duration::from_secs(20));
        let r = send(&app, "run-t", &e2e::chat_body("fast", "something new")).await;
        assert_eq!(r.status(), 429, "{kind:?}");
        assert_eq!(r.headers()["retry-after"], "10");
        let _ = app.next_event().await;
        // Another session is not affected.
        let r = send(&app, "run-other", &e2e::chat_body("fast", "hello")).await;
        assert_eq!(r.status(), 200, "{kind:?}");
        let _ = app.next_event().await;
        // After it, the looping step goes through once (flagged) and opens the next cooldown.
        clock.advance(std::time::Duration::from_secs(11));
        let r = send(&app, "run-t", &stuck()).await;
        assert_eq!(r.status(), 200, "{kind:?}");
        assert!(r.headers()["x-gateway-loop"]
            .to_str()
            .unwrap()
            .starts_with("throttled; session=run-t"));
        let _ = app.next_event().await;
        let r = send(&app, "run-t", &stuck()).await;
        assert_eq!(r.status(), 429, "{kind:?}");
        let _ = app.next_event().await;
        let (ok, out) = app
            .ctl(&["--json", "sessions", "show", "--tenant", "acme", "run-t"])
            .await;
        assert!(ok, "{out}");
        let s: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(s["status"], "throttled", "{s}");
        assert_eq!(s["refused"], 3, "{s}");
        assert!(s["avoided_micros"].as_i64().unwrap() > 0, "{s}");
        let m = app.metrics().await;
        assert!(
            m.contains("gateway_guard_loops_total{action=\"throttle\"} 3"),
            "{m}"
        );
        app.stop().await;
    }
}

#[tokio::test]
async fn a_blocked_session_stays_refused_until_gatewayctl_clears_it_on_every_store() {
    for kind in e2e::BUDGET_STORES {
        let clock = gateway::budget::ManualClock::at(chrono::Utc::now());
        let (mut app, _sim) = app_on(kind, clock.clone()).await;
        let (ok, out) = app
            .ctl(&["guard", "set", "--tenant", "acme", "--action", "block"])
            .await;
        assert!(ok, "{out}");
        let r = send(&app, "run/b-1", &stuck()).await;
        assert_eq!(r.status(), 429, "{kind:?}");
        assert_eq!(r.headers()["x-should-retry"], "false");
        assert!(!r.headers().contains_key("retry-after"));
        let _ = app.next_event().await;
        clock.advance(std::time::Duration::from_secs(86_400));
        let r = send(&app, "run/b-1", &e2e::chat_body("fast", "a new plan")).await;
        assert_eq!(r.status(), 429, "still blocked a day later ({kind:?})");
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"].as_str().unwrap().contains("blocked"),
            "{v}"
        );
        let _ = app.next_event().await;
        let (ok, out) = app
            .ctl(&[
                "sessions", "list", "--tenant", "acme", "--status", "blocked",
            ])
            .await;
        assert!(ok && out.contains("run/b-1"), "{out}");
        let (ok, out) = app
            .ctl(&["sessions", "clear", "--tenant", "acme", "run/b-1"])
            .await;
        assert!(ok && out.contains("cleared"), "{out}");
        let r = send(&app, "run/b-1", &e2e::chat_body("fast", "a new plan")).await;
        assert_eq!(r.status(), 200, "cleared ({kind:?})");
        let _ = app.next_event().await;
        let (ok, out) = app
            .ctl(&["sessions", "clear", "--tenant", "acme", "no-such"])
            .await;
        assert!(!ok && out.contains("no session"), "{out}");
        app.stop().await;
    }
}

#[tokio::test]
async fn two_gateways_sharing_redis_see_one_session_window() {
    for kind in [e2e::BudgetKind::Redis, e2e::BudgetKind::RedisCluster] {
        let clock = gateway::budget::ManualClock::at(chrono::Utc::now());
        let (mut a, _sim) = app_on(kind, clock.clone()).await;
        let sim = Sim::zero("sim-small").await;
        let deps = gateway::state::Deps {
            clock: Some(clock.clone()),
            guard_store: Some(guard_store(kind)),
            ..Default::default()
        };
        let store = a.store.clone();
        let mut b =
            TestApp::spawn_custom(e2e::config_on(&sim, None), store, false, true, deps).await;
        // A stateless client re-sends the same question: twice to one gateway, once to the other.
        let ask = e2e::chat_body("fast", "What is the status of order 1182?");
        for app in [&a, &a] {
            let r = send(app, "widget-9", &ask).await;
            assert_eq!(r.status(), 200);
            assert!(!r.headers().contains_key("x-gateway-loop"));
        }
        let _ = (a.next_event().await, a.next_event().await);
        let r = send_as(&b, &a.api_key, "widget-9", &ask).await;
        assert_eq!(r.status(), 200);
        let flag = r
            .headers()
            .get("x-gateway-loop")
            .map(|v| v.to_str().unwrap().to_owned());
        assert!(
            flag.is_some_and(|f| f.contains("session=widget-9")),
            "{kind:?}"
        );
        let _ = b.next_event().await;
        b.stop().await;
        a.stop().await;
    }
}

/// Looping fixtures the detector does not yet catch within 3 requests with exact signals
/// alone (the gateway under test has no static model, so near-duplicates are off). None today:
/// the last two (a non-answer reworded while the customer objects, and tau-bench task 13's
/// identical failing update) are caught by the "repeating while the user objects" shape. A
/// fixture listed here that is caught fails the test, so the list cannot go stale. Measured
/// with `cargo run -p e2e --example guard_fixtures -- --exact-only`; see docs/guard.md.
const KNOWN_MISSES: &[&str] = &[];

#[tokio::test]
async fn agent_session_fixtures_replayed_through_the_gateway_flag_loops_and_not_progress() {
    let (app, _sim) = app().await;
    let mut caught = Vec::new();
    // Every disagreement, reported together.
    let mut wrong = Vec::new();
    for kind in ["looping", "progressing"] {
        for (name, f) in e2e::agent_sessions(kind) {
            let session = f["session_id"].as_str().unwrap_or(&name).to_owned();
            let mut first = None;
            for (i, messages) in e2e::session_requests(&f).into_iter().enumerate() {
                let r = send(
                    &app,
                    &session,
                    &json!({"model": "fast", "messages": messages}),
                )
                .await;
                assert_eq!(r.status(), 200, "{name} request {i}");
                if first.is_none() && r.headers().contains_key("x-gateway-loop") {
                    first = Some(i);
                }
            }
            if kind == "progressing" {
                if let Some(i) = first {
                    wrong.push(format!("progressing session {name} was flagged at {i}"));
                }
                continue;
            }
            let start = f["loop_start"].as_u64().unwrap() as usize;
            let in_time = first.is_some_and(|i| (start..=start + 2).contains(&i));
            if KNOWN_MISSES.contains(&name.as_str()) {
                if in_time {
                    wrong.push(format!("{name} is caught now: take it off KNOWN_MISSES"));
                }
            } else if in_time {
                caught.push(name);
            } else {
                wrong.push(format!(
                    "{name}: first flag at {first:?}, loop starts at request {start}"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert!(
        caught.len() >= 30,
        "{} looping sessions caught",
        caught.len()
    );
    app.stop().await;
}

#[tokio::test]
async fn a_malformed_admin_query_string_is_a_400_in_openai_shape() {
    let (app, _sim) = app().await;
    for path in [
        "tenants/acme/sessions?limit=abc",
        "tenants/acme/sessions?foo=1",
        "usage",
    ] {
        let r = app.admin(reqwest::Method::GET, path, None).await;
        assert_eq!(r.status(), 400, "{path}");
        let v: Value = r.json().await.expect("a JSON error body");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{path}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("query string"),
            "{path}: {v}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn with_its_redis_down_the_guard_backs_off_and_the_in_request_signal_still_flags() {
    use gateway::guard::store::{GuardError, GuardStore, Limits, SessionKey, Turn};
    let dead = format!("redis://127.0.0.1:{}", e2e::free_port());
    let store = std::sync::Arc::new(
        gateway::guard::redis::RedisGuard::new(vec![dead], std::time::Duration::from_secs(2))
            .unwrap(),
    );
    let (key, turn) = (
        SessionKey::new("t", "s"),
        Turn {
            at_ms: 0,
            step: 1,
            request: 1,
            text: false,
            answered: false,
            sketch: None,
        },
    );
    let limits = Limits {
        turns: 8,
        ttl_ms: 60_000,
    };
    let first = store.record(&key, &turn, limits).await.unwrap_err();
    assert!(matches!(first, GuardError::Redis(_)), "{first:?}");
    // Moments later, no second attempt: the request goes on at once.
    let second = store.record(&key, &turn, limits).await.unwrap_err();
    assert!(matches!(second, GuardError::Unavailable), "{second:?}");

    let sim = Sim::zero("sim-small").await;
    let deps = gateway::state::Deps {
        guard_store: Some(store),
        ..Default::default()
    };
    let db = e2e::TestStore::new(StoreKind::Sqlite).await.unwrap();
    let app = TestApp::spawn_custom(e2e::config_on(&sim, None), db, true, true, deps).await;
    let r = send(&app, "run-down", &stuck()).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["x-gateway-loop"]
        .to_str()
        .unwrap()
        .starts_with("flagged; session=run-down"));
    app.stop().await;
}

#[tokio::test]
async fn with_its_redis_frozen_the_guard_is_bounded_by_its_timeout_and_resumes_after() {
    let redis = e2e::PrivateRedis::start().unwrap();
    let store = std::sync::Arc::new(
        gateway::guard::redis::RedisGuard::new(
            vec![redis.url.clone()],
            std::time::Duration::from_millis(600),
        )
        .unwrap(),
    );
    let sim = Sim::zero("sim-small").await;
    let deps = gateway::state::Deps {
        guard_store: Some(store),
        ..Default::default()
    };
    let db = e2e::TestStore::new(StoreKind::Sqlite).await.unwrap();
    let mut app = TestApp::spawn_custom(e2e::config_on(&sim, None), db, true, true, deps).await;
    let ask = e2e::chat_body("fast", "What is the status of order 1182?");
    let r = send(&app, "before", &ask).await;
    assert_eq!(r.status(), 200);
    let _ = app.next_event().await;

    // Frozen (SIGSTOP): the connection stays open and nothing is answered. The guard's call is
    // bounded by its own timeout (the connection sets none), so the request is served; the
    // signal read from the request itself still flags.
    redis.pause().unwrap();
    let started = std::time::Instant::now();
    let r = send(&app, "frozen", &stuck()).await;
    let waited = started.elapsed();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["x-gateway-loop"]
        .to_str()
        .unwrap()
        .starts_with("flagged; session=frozen"));
    assert!(waited < std::time::Duration::from_secs(2), "{waited:?}");
    let _ = app.next_event().await;
    // Within the back-off the next request does not wait out the 600 ms timeout again.
    let started = std::time::Instant::now();
    assert_eq!(send(&app, "before", &ask).await.status(), 200);
    assert!(
        started.elapsed() < std::time::Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
    let _ = app.next_event().await;
    redis.unpause().unwrap();

    // The late answers to the calls that timed out are read and dropped; once the back-off
    // has passed, the same connection serves the shared window again: a question sent three
    // times in a new session is flagged on the third.
    tokio::time::sleep(std::time::Duration::from_millis(2_000)).await;
    for i in 0..3 {
        let r = send(&app, "after", &ask).await;
        assert_eq!(r.status(), 200);
        let flagged = r
            .headers()
            .get("x-gateway-loop")
            .is_some_and(|f| f.to_str().unwrap().contains("session=after"));
        assert_eq!(flagged, i == 2, "request {i}");
        let _ = app.next_event().await;
    }
    app.stop().await;
}
