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
    let url = format!("{}/v1/chat/completions", app.base);
    let stuck = agent(&[
        "FAILED test_parse (0.51s) at 10:00:01",
        "FAILED test_parse (0.48s) at 10:00:09",
        "FAILED test_parse (0.50s) at 10:00:17",
    ]);
    let r = app
        .http
        .post(&url)
        .bearer_auth(&app.api_key)
        .header("x-session-id", "run-7")
        .json(&stuck)
        .send()
        .await
        .unwrap();
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

#[tokio::test]
async fn a_flagged_loop_is_counted_as_waste_in_the_weekly_report() {
    let sim = Sim::zero("sim-small").await;
    let mut c = e2e::config_on(&sim, Some((1.0, 2.0)));
    let dir = tempfile::tempdir().unwrap();
    c.ledger.spool_dir = dir.path().to_owned();
    c.ledger.flush_ms = 20;
    let store = e2e::TestStore::new(StoreKind::Sqlite).await.unwrap();
    let app = TestApp::spawn_with_ledger(c, store).await;
    let stuck = agent(&["same error", "same error", "same error"]);
    assert!(app
        .chat(stuck)
        .await
        .headers()
        .contains_key("x-gateway-loop"));
    assert_eq!(app.chat(e2e::chat_body("fast", "hi")).await.status(), 200);
    let ledger = gateway::ledger::open(&app.store.url).await.unwrap();
    e2e::eventually(
        "both rows written",
        std::time::Duration::from_secs(5),
        || async { (ledger.count().await.unwrap() == 2).then_some(()) },
    )
    .await;
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
