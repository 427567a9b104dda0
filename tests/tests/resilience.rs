//! Upstream failures end to end: the simulator's fault schedule and stats, and each replica's
//! circuit breaker (consecutive failures or an error ratio over a sliding window), as
//! `gatewayctl replicas`, the admin API and the metrics show it.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use e2e::{chat_body, config, replica, Sim, StoreKind, TestApp};
use gateway::simulator::{SimOptions, SimProfile};
use reqwest::Method;
use serde_json::{json, Value};

fn zero(model: &str, schedule: &[&str]) -> SimOptions {
    let mut p = SimProfile::zero();
    p.model = model.into();
    let mut o = SimOptions::new(p);
    o.schedule = schedule.iter().map(|w| w.parse().unwrap()).collect();
    o
}

async fn stats(sim: &Sim) -> Value {
    reqwest::get(format!("{}/sim/stats", sim.root))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn an_error_ratio_takes_a_flaky_replica_out_and_the_tier_keeps_answering() {
    let healthy = Sim::start(zero("sim-small", &[])).await;
    // Fails every request for a minute from its start.
    let flaky = Sim::start(zero("sim-small", &["0s+60s=503"])).await;
    let large = Sim::zero("sim-large").await;
    let mut c = config(
        vec![
            replica("ok", &healthy.url, "sim-small"),
            replica("flaky", &flaky.url, "sim-small"),
        ],
        vec![replica("l1", &large.url, "sim-large")],
    );
    // Only the ratio can trip it: 4 requests in the window, half of them failed.
    c.upstream.failure_threshold = 1_000;
    c.upstream.error_ratio = 0.5;
    c.upstream.error_ratio_min_requests = 4;
    c.upstream.fallback_to_other_tier = false;
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    for i in 0..30 {
        let r = app.chat(chat_body("fast", &format!("q{i}"))).await;
        assert_eq!(r.status(), 200, "request {i}: the same-tier retry answers");
        app.next_event().await;
    }
    let seen = stats(&flaky).await;
    let received = seen["requests"].as_u64().unwrap();
    assert_eq!(seen["faulted"]["scheduled_status"], received);
    assert!(
        (4..30).contains(&received),
        "the breaker opened after its first failures, not after all 30: {seen}"
    );
    let (ok, out) = app.ctl(&["replicas"]).await;
    assert!(ok, "{out}");
    let line = out.lines().find(|l| l.contains("flaky")).unwrap();
    assert!(
        line.contains("open") && line.contains("error_ratio"),
        "{out}"
    );
    let v: Value = app
        .admin(Method::GET, "replicas", None)
        .await
        .json()
        .await
        .unwrap();
    let find = |list: &Value, key: &str, value: &str| -> Value {
        list.as_array()
            .unwrap()
            .iter()
            .find(|x| x[key] == value)
            .unwrap()
            .clone()
    };
    let small = find(&v["data"], "tier", "small");
    let ok_replica = find(&small["replicas"], "name", "ok");
    assert_eq!(ok_replica["breaker"], "closed");
    assert_eq!(ok_replica["tripped_by"], Value::Null);
    let metrics = app.metrics().await;
    assert!(
        metrics.contains(
            "gateway_replica_breaker_trips_total{reason=\"error_ratio\",replica=\"flaky\",tier=\"small\"} 1"
        ),
        "{metrics}"
    );
    app.stop().await;
}

#[tokio::test]
async fn the_simulator_takes_a_schedule_over_http_and_refuses_a_bad_one() {
    gateway::telemetry::install_crypto_provider();
    let sim = Sim::zero("sim-small").await;
    let post = |body: Value| {
        let url = format!("{}/sim/faults", sim.root);
        async move {
            reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
        }
    };
    let chat = || {
        let url = format!("{}/chat/completions", sim.url);
        async move {
            reqwest::Client::new()
                .post(url)
                .json(&chat_body("sim-small", "hi"))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    let r = post(json!({"schedule": ["0s+1m=429"]})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(chat().await, 429);
    let r = post(json!({"schedule": ["soon=503"]})).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("AFTER+FOR=WHAT"),
        "{v}"
    );
    // An empty schedule clears it.
    assert_eq!(post(json!({"schedule": []})).await.status(), 200);
    assert_eq!(chat().await, 200);
    // The command line says what a bad window is.
    let o = std::process::Command::new(e2e::binary("gateway"))
        .args(["simulate", "--port", "0", "--fault", "5s+10s=200"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("400-599"), "{err}");
}

/// A gateway whose two small replicas are both `sim` (and a large one on `large`), without
/// failover to the other tier, breakers that never trip, and `tweak` applied.
async fn small_tier_on(
    sim: &Sim,
    large: &Sim,
    tweak: impl FnOnce(&mut gateway::Config),
) -> TestApp {
    let mut c = config(
        vec![
            replica("s1", &sim.url, "sim-small"),
            replica("s2", &sim.url, "sim-small"),
        ],
        vec![replica("l1", &large.url, "sim-large")],
    );
    c.upstream.fallback_to_other_tier = false;
    c.upstream.failure_threshold = 1_000_000;
    c.upstream.error_ratio = 1.0;
    c.upstream.error_ratio_min_requests = 1_000_000;
    tweak(&mut c);
    TestApp::spawn(c, StoreKind::Sqlite).await
}

#[tokio::test]
async fn the_gateways_own_retries_stay_within_the_tiers_retry_budget() {
    let large = Sim::zero("sim-large").await;
    for (min, expect_upstream) in [(3u32, 20u64), (0, 10)] {
        let sim = Sim::start(zero("sim-small", &["0s+60s=500"])).await;
        let mut app = small_tier_on(&sim, &large, |c| {
            c.upstream.retries_same_tier = 1;
            c.upstream.retry_budget_ratio = 0.0;
            c.upstream.retry_budget_min = min;
            c.upstream.throttle_k = 0.0;
        })
        .await;
        for i in 0..10 {
            let r = app.chat(chat_body("fast", &format!("q{i}"))).await;
            assert_eq!(r.status(), 502, "the model server answered 500");
            let e = app.next_event().await;
            assert_eq!(e.cost_micros, 0);
        }
        let received = stats(&sim).await["requests"].as_u64().unwrap();
        assert_eq!(
            received, expect_upstream,
            "min {min}: one retry each with room in the budget, none with a zero budget"
        );
        let metrics = app.metrics().await;
        let outcome = if min == 0 { "budget_exhausted" } else { "sent" };
        assert!(
            metrics.contains(&format!(
                "gateway_upstream_retries_total{{outcome=\"{outcome}\",tier=\"small\"}} 10"
            )),
            "{metrics}"
        );
        app.stop().await;
    }
}

#[tokio::test]
async fn while_the_servers_reject_the_gateway_throttles_locally_and_recovers_after() {
    let large = Sim::zero("sim-large").await;
    let sim = Sim::start(zero("sim-small", &["0s+60s=429"])).await;
    let mut app = small_tier_on(&sim, &large, |c| {
        c.upstream.retries_same_tier = 0;
        c.upstream.throttle_k = 2.0;
        c.upstream.throttle_window_ms = 1_500;
    })
    .await;
    let mut local = 0;
    for i in 0..100 {
        let r = app.chat(chat_body("fast", &format!("q{i}"))).await;
        let status = r.status().as_u16();
        if status == 503 {
            local += 1;
            assert!(r.headers().contains_key("retry-after"));
            let v: Value = r.json().await.unwrap();
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains("adaptive throttling"), "{v}");
        } else {
            assert_eq!(status, 429, "the server's own answer passes through");
        }
        let e = app.next_event().await;
        assert_eq!(e.cost_micros, 0, "nothing is charged");
    }
    let received = stats(&sim).await["requests"].as_u64().unwrap();
    assert_eq!(received + local, 100);
    assert!(
        local >= 60,
        "with every request rejected, p tends to 1: {local} of 100 turned away locally"
    );
    // The servers recover; once the window has forgotten the rejections, all get through.
    reqwest::Client::new()
        .post(format!("{}/sim/faults", sim.root))
        .json(&json!({"schedule": []}))
        .send()
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1_700)).await;
    for i in 0..10 {
        let r = app.chat(chat_body("fast", &format!("after{i}"))).await;
        assert_eq!(r.status(), 200);
        app.next_event().await;
    }
    let metrics = app.metrics().await;
    assert!(
        metrics.contains(&format!(
            "gateway_upstream_throttled_total{{tier=\"small\"}} {local}"
        )),
        "{metrics}"
    );
    app.stop().await;
}

/// `POST /v1/chat/completions` with extra headers.
async fn chat_with(app: &TestApp, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut r = app
        .http
        .post(format!("{}/v1/chat/completions", app.base))
        .bearer_auth(&app.api_key)
        .json(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    r.send().await.unwrap()
}

/// A gateway whose small tier's one replica answers `status` for a minute, with no same-tier
/// retry and no throttling, and a retry budget of exactly `floor` retries: the app and its small
/// simulator (and the large one).
async fn failing_with_retry_floor(status: &str, floor: u32) -> (TestApp, Sim, Sim) {
    let large = Sim::zero("sim-large").await;
    let sim = Sim::start(zero("sim-small", &[&format!("0s+60s={status}")])).await;
    let app = small_tier_on(&sim, &large, |c| {
        c.upstream.retries_same_tier = 0;
        c.upstream.throttle_k = 0.0;
        c.guard.retry_budget_share = 0.0;
        c.guard.retry_budget_floor = floor;
    })
    .await;
    (app, sim, large)
}

#[tokio::test]
async fn client_retries_beyond_the_tenants_retry_budget_are_refused_at_once_and_flagged() {
    let (mut app, sim, _large) = failing_with_retry_floor("500", 2).await;
    let body = chat_body("fast", "summarise the outage");
    // The SDK's first attempt and two retries reach the model server (the floor is 2)...
    for attempt in ["0", "1", "2"] {
        let r = chat_with(&app, &body, &[("x-stainless-retry-count", attempt)]).await;
        assert_eq!(r.status(), 502, "attempt {attempt}");
        let e = app.next_event().await;
        assert!(!e.retry_storm_flag);
    }
    // ...the third retry does not: 429 at once, flagged, charged nothing.
    let r = chat_with(&app, &body, &[("x-stainless-retry-count", "3")]).await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "retry_budget_exceeded", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("retry budget"),
        "{v}"
    );
    let e = app.next_event().await;
    assert!(e.retry_storm_flag);
    assert_eq!((e.status, e.cost_micros), (429, 0));
    assert_eq!(
        stats(&sim).await["requests"],
        3,
        "the refused retry never left"
    );
    // A repeated Idempotency-Key and a plain repeat after an error are retries too.
    let other = chat_body("fast", "another question");
    let r = chat_with(&app, &other, &[("idempotency-key", "req-42")]).await;
    assert_eq!(r.status(), 502);
    app.next_event().await;
    let r = chat_with(&app, &other, &[("idempotency-key", "req-42")]).await;
    assert_eq!(r.status(), 429, "a retry, and the budget is spent");
    app.next_event().await;
    let metrics = app.metrics().await;
    for (signal, n) in [("sdk_header", 3), ("idempotency_key", 1)] {
        assert!(
            metrics.contains(&format!(
                "gateway_client_retries_total{{signal=\"{signal}\",tenant=\"acme\"}} {n}"
            )),
            "{signal}: {metrics}"
        );
    }
    // A bad Idempotency-Key is a clear 400.
    let r = chat_with(&app, &other, &[("idempotency-key", "has space")]).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "Idempotency-Key", "{v}");
    app.stop().await;
}

#[tokio::test]
async fn the_same_request_again_soon_after_an_error_answer_is_a_retry_without_any_header() {
    let (mut app, sim, _large) = failing_with_retry_floor("503", 1).await;
    // An agent's own retry loop around the SDK: every attempt a first one to the SDK.
    let body = chat_body("fast", "deploy the release");
    let first_attempt = [("x-stainless-retry-count", "0")];
    let r = chat_with(&app, &body, &first_attempt).await;
    assert_eq!(r.status(), 502);
    app.next_event().await;
    let r = chat_with(&app, &body, &first_attempt).await;
    assert_eq!(r.status(), 502, "a retry within the floor of 1");
    assert!(!app.next_event().await.retry_storm_flag);
    let r = chat_with(&app, &body, &[]).await;
    assert_eq!(r.status(), 429, "the second retry is beyond the budget");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "retry_budget_exceeded", "{v}");
    let e = app.next_event().await;
    assert!(e.retry_storm_flag);
    assert_eq!((e.status, e.cost_micros), (429, 0));
    // Another request is no retry; nor is a repeat of one that was answered.
    let r = chat_with(&app, &chat_body("fast", "something else"), &[]).await;
    assert_eq!(r.status(), 502);
    app.next_event().await;
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("gateway_client_retries_total{signal=\"after_error\",tenant=\"acme\"} 2"),
        "{metrics}"
    );
    sim.faults(json!({"schedule": []})).await;
    let answered = chat_body("fast", "all good now");
    for _ in 0..3 {
        assert_eq!(chat_with(&app, &answered, &[]).await.status(), 200);
        assert!(!app.next_event().await.retry_storm_flag);
    }
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("gateway_client_retries_total{signal=\"after_error\",tenant=\"acme\"} 2"),
        "repeats of an answered request are no retries: {metrics}"
    );
    app.stop().await;
}

#[tokio::test]
async fn flag_mode_answers_a_retry_beyond_the_budget_flagged_and_duplicates_are_not_retries() {
    let large = Sim::zero("sim-large").await;
    let sim = Sim::start(zero("sim-small", &[])).await;
    let mut app = small_tier_on(&sim, &large, |c| {
        c.guard.retry_budget_share = 0.0;
        c.guard.retry_budget_floor = 0;
        c.guard.retry_action = gateway::config::RetryAction::Flag;
    })
    .await;
    let body = chat_body("fast", "the same question");
    let r = chat_with(&app, &body, &[("x-stainless-retry-count", "1")]).await;
    assert_eq!(r.status(), 200, "answered");
    assert!(app.next_event().await.retry_storm_flag, "and flagged");
    // Identical requests without a retry signal (a load test, a fan-out) are not retries, even
    // concurrent ones.
    let sends: Vec<_> = (0..8).map(|_| app.chat(body.clone())).collect();
    for r in futures_util::future::join_all(sends).await {
        assert_eq!(r.status(), 200);
    }
    for _ in 0..8 {
        assert!(!app.next_event().await.retry_storm_flag);
    }
    app.stop().await;
}

#[tokio::test]
async fn two_gateways_sharing_redis_share_one_retry_budget() {
    for kind in [e2e::BudgetKind::Redis, e2e::BudgetKind::RedisCluster] {
        let sim = Sim::zero("sim-small").await;
        let guard_store = || -> std::sync::Arc<dyn gateway::guard::store::GuardStore> {
            std::sync::Arc::new(
                gateway::guard::redis::RedisGuard::new(
                    kind.redis_urls(),
                    std::time::Duration::from_secs(2),
                )
                .unwrap(),
            )
        };
        let mut c = e2e::config_on(&sim, None);
        c.guard.retry_budget_share = 0.0;
        c.guard.retry_budget_floor = 1;
        let deps = || gateway::state::Deps {
            guard_store: Some(guard_store()),
            ..Default::default()
        };
        let store = e2e::TestStore::new(StoreKind::Sqlite).await.unwrap();
        let mut a = TestApp::spawn_custom(c.clone(), store, true, true, deps()).await;
        let mut b = TestApp::spawn_custom(c, a.store.clone(), false, true, deps()).await;
        b.api_key = a.api_key.clone();
        let retry = [("x-stainless-retry-count", "1")];
        let r = chat_with(&a, &chat_body("fast", "one"), &retry).await;
        assert_eq!(r.status(), 200, "{kind:?}: the floor allows one retry");
        a.next_event().await;
        let r = chat_with(&b, &chat_body("fast", "two"), &retry).await;
        assert_eq!(
            r.status(),
            429,
            "{kind:?}: the other gateway sees the first one's retry"
        );
        b.next_event().await;
        b.stop().await;
        a.stop().await;
    }
}

/// The SDK's first attempt of `body`, given up after 300 ms.
async fn gives_up_after_300ms(app: &TestApp, body: &Value) {
    let first = app
        .http
        .post(format!("{}/v1/chat/completions", app.base))
        .bearer_auth(&app.api_key)
        .header("x-stainless-retry-count", "0")
        .timeout(std::time::Duration::from_millis(300))
        .json(body)
        .send()
        .await;
    assert!(first.is_err(), "the client gave up");
}

/// A gateway whose small tier answers (or starts streaming) 1.2 s late, after a client's
/// timeout, cache off, priced: the app and its small simulator (and the large one).
async fn answering_late() -> (TestApp, Sim, Sim) {
    let large = Sim::zero("sim-large").await;
    let sim = Sim::start(zero("sim-small", &["0s+60s=slow:1200ms"])).await;
    let mut c = config(
        vec![replica("s1", &sim.url, "sim-small")],
        vec![replica("l1", &large.url, "sim-large")],
    );
    c.cache.mode = gateway::cache::CacheMode::Off;
    e2e::price(&mut c, "sim-small", 1.0, 2.0);
    (TestApp::spawn(c, StoreKind::Sqlite).await, sim, large)
}

#[tokio::test]
async fn an_sdk_retry_of_a_request_still_running_joins_it_and_is_charged_nothing() {
    let (mut app, sim, _large) = answering_late().await;
    let body = chat_body("fast", "a slow question");
    // The SDK's first attempt times out after 300 ms...
    gives_up_after_300ms(&app, &body).await;
    // ...and its retry joins the request still running upstream.
    let r = chat_with(&app, &body, &[("x-stainless-retry-count", "1")]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-gateway-cache"], "coalesced");
    let v: Value = r.json().await.unwrap();
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    assert_eq!(
        stats(&sim).await["requests"],
        1,
        "one upstream request for two attempts"
    );
    let mut events = [app.next_event().await, app.next_event().await];
    events.sort_by_key(|e| e.cache_status == gateway::usage::CacheStatus::Coalesced);
    let (billed, joined) = (&events[0], &events[1]);
    assert_eq!(joined.cache_status, gateway::usage::CacheStatus::Coalesced);
    assert_eq!((joined.status, joined.cost_micros), (200, 0));
    assert!(billed.cost_micros > 0 && billed.status == 200, "{billed:?}");
    // Not a retry: an identical request runs on its own.
    let r = app.chat(body).await;
    assert_ne!(r.headers()["x-gateway-cache"], "coalesced");
    app.next_event().await;
    assert_eq!(stats(&sim).await["requests"], 2);
    app.stop().await;
}

#[tokio::test]
async fn an_sdk_retry_of_a_stream_still_running_joins_it_from_its_first_chunk() {
    let (mut app, sim, _large) = answering_late().await;
    let mut body = chat_body("fast", "a slow streamed question");
    body["stream"] = json!(true);
    gives_up_after_300ms(&app, &body).await;
    // The retry gets the whole stream, from its first chunk, off the one upstream request.
    let r = chat_with(&app, &body, &[("x-stainless-retry-count", "1")]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-gateway-cache"], "coalesced");
    let text = r.text().await.unwrap();
    assert!(text.contains("\"role\":\"assistant\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(stats(&sim).await["requests"], 1, "one upstream request");
    let mut events = [app.next_event().await, app.next_event().await];
    events.sort_by_key(|e| e.cache_status == gateway::usage::CacheStatus::Coalesced);
    let (billed, joined) = (&events[0], &events[1]);
    assert_eq!(joined.cache_status, gateway::usage::CacheStatus::Coalesced);
    assert_eq!((joined.status, joined.cost_micros), (200, 0));
    assert!(
        billed.cost_micros > 0 && billed.completion_tokens > 0,
        "{billed:?}"
    );
    // The stream ended: the same request again runs on its own.
    let r = chat_with(&app, &body, &[("x-stainless-retry-count", "2")]).await;
    assert_ne!(r.headers()["x-gateway-cache"], "coalesced");
    let _ = r.text().await;
    app.next_event().await;
    assert_eq!(stats(&sim).await["requests"], 2);
    app.stop().await;
}

#[tokio::test]
async fn fallback_to_the_large_tier_is_bounded_by_the_tenants_share_and_counted() {
    let large = Sim::zero("sim-large").await;
    // The whole small tier fails.
    let small = Sim::start(zero("sim-small", &["0s+60s=500"])).await;
    let mut c = config(
        vec![replica("s1", &small.url, "sim-small")],
        vec![replica("l1", &large.url, "sim-large")],
    );
    c.upstream.retries_same_tier = 0;
    c.upstream.failure_threshold = 1_000_000;
    c.upstream.error_ratio = 1.0;
    c.upstream.error_ratio_min_requests = 1_000_000;
    c.upstream.throttle_k = 0.0;
    c.upstream.fallback_max_share = 0.25;
    c.upstream.fallback_min = 2;
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let mut answered_large = 0;
    for i in 0..12 {
        let r = app.chat(chat_body("fast", &format!("q{i}"))).await;
        let e = app.next_event().await;
        if r.status() == 200 {
            assert_eq!(r.headers()["x-gateway-tier"], "large");
            assert_eq!(e.route_reason.as_deref(), Some("unhealthy"));
            answered_large += 1;
        } else {
            assert_eq!(
                r.status(),
                502,
                "the small tier's error, not a costlier answer"
            );
        }
    }
    // At most max(2, 25% of 12) = 3 of the 12 went to the large tier.
    assert_eq!(answered_large, 3);
    assert_eq!(stats(&large).await["requests"], 3);
    let metrics = app.metrics().await;
    for (outcome, n) in [("answered", 3), ("over_share", 9)] {
        assert!(
            metrics.contains(&format!(
                "gateway_fallbacks_total{{outcome=\"{outcome}\",tenant=\"acme\",tier=\"large\"}} {n}"
            )),
            "{outcome}: {metrics}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn a_tier_at_capacity_queues_a_few_requests_briefly_and_sheds_the_rest_at_once() {
    let large = Sim::zero("sim-large").await;
    let sim = Sim::start(zero("sim-small", &["0s+60s=slow:400ms"])).await;
    let mut s1 = replica("s1", &sim.url, "sim-small");
    s1.max_concurrency = 1;
    let mut c = config(vec![s1], vec![replica("l1", &large.url, "sim-large")]);
    c.upstream.fallback_to_other_tier = false;
    c.upstream.queue_depth = 1;
    c.upstream.queue_wait_ms = 1_000;
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let started = std::time::Instant::now();
    let sends: Vec<_> = (0..3)
        .map(|i| {
            let (http, base, key) = (app.http.clone(), app.base.clone(), app.api_key.clone());
            async move {
                // Staggered, so the first holds the slot and the second is queued.
                tokio::time::sleep(std::time::Duration::from_millis(50 * i)).await;
                let r = http
                    .post(format!("{base}/v1/chat/completions"))
                    .bearer_auth(key)
                    .json(&chat_body("fast", &format!("q{i}")))
                    .send()
                    .await
                    .unwrap();
                (
                    r.status().as_u16(),
                    started.elapsed(),
                    r.text().await.unwrap(),
                )
            }
        })
        .collect();
    let results = futures_util::future::join_all(sends).await;
    assert_eq!(results[0].0, 200);
    assert_eq!(
        results[1].0, 200,
        "queued until the slot freed: {results:?}"
    );
    assert!(
        results[1].1 >= std::time::Duration::from_millis(700),
        "{results:?}"
    );
    assert_eq!(results[2].0, 503, "the queue was full: {results:?}");
    assert!(results[2].2.contains("queue_depth"), "{results:?}");
    assert!(
        results[2].1 < std::time::Duration::from_millis(300),
        "shed at once: {results:?}"
    );
    for _ in 0..3 {
        let e = app.next_event().await;
        assert!(e.status != 503 || e.cost_micros == 0);
    }
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("gateway_shed_requests_total{reason=\"queue_full\",tier=\"small\"} 1"),
        "{metrics}"
    );
    app.stop().await;
}

/// A `sim-small` server that generates `max_running` sequences at once (more wait in its queue),
/// each `base_ms` to its first token, then `decode_ms` per token.
async fn batching(max_running: usize, base_ms: f64, decode_ms: f64) -> Sim {
    let mut p = SimProfile::zero();
    p.model = "sim-small".into();
    p.max_running = max_running;
    p.base_ms = base_ms;
    p.decode_ms_per_token = decode_ms;
    Sim::start(SimOptions::new(p)).await
}

/// Two waves of 40 streaming clients against one replica that batches 4 sequences (more wait in
/// its queue): the deepest queue the server had in the second wave, the lowest concurrency
/// limit the admin API showed, and whether every request was answered.
async fn overload_waves(adaptive: bool) -> (u64, u64, bool) {
    let sim = batching(4, 5.0, 10.0).await;
    let large = Sim::zero("sim-large").await;
    let mut c = config(
        vec![replica("s1", &sim.url, "sim-small")],
        vec![replica("l1", &large.url, "sim-large")],
    );
    c.upstream.fallback_to_other_tier = false;
    c.upstream.adaptive_concurrency = adaptive;
    c.upstream.adaptive_min_concurrency = 2;
    c.upstream.queue_wait_ms = 30_000;
    c.upstream.first_byte_budget_ms = 30_000;
    c.upstream.stream_first_byte_timeout_ms = 30_000;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let send = |i: usize| {
        let (http, base, key) = (app.http.clone(), app.base.clone(), app.api_key.clone());
        async move {
            let mut body = chat_body("fast", &format!("question {i}"));
            body["stream"] = json!(true);
            body["max_tokens"] = json!(4);
            let r = http
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
                .unwrap();
            let ok = r.status() == 200;
            ok && r.text().await.unwrap().contains("[DONE]")
        }
    };
    let small = || async {
        let v = app.admin_json("replicas").await;
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tier"] == "small")
            .unwrap()["replicas"][0]
            .clone()
    };
    let limit = || async { small().await["concurrency_limit"].as_u64().unwrap() };
    // Warm: the server's own pace, four at a time (what it batches). With the adaptive limit the
    // first answer starts a probe of the unloaded latency at the floor, which 8 answers end.
    for round in 0..12 {
        let all = futures_util::future::join_all((0..4).map(|i| send(round * 4 + i))).await;
        assert!(all.iter().all(|ok| *ok));
        if adaptive && round == 0 {
            let r = small().await;
            assert_eq!(
                (
                    r["limit_probing"].as_bool(),
                    r["concurrency_limit"].as_u64()
                ),
                (Some(true), Some(2)),
                "{r}"
            );
        }
    }
    assert_eq!(small().await["limit_probing"], false);
    let mut all_ok = true;
    let mut min_limit = u64::MAX;
    let mut deepest = 0;
    for wave in 0..2 {
        let clients = futures_util::future::join_all((0..40).map(|c| async move {
            let mut ok = true;
            for n in 0..5 {
                ok &= send(1_000 * (wave + 1) + c * 10 + n).await;
            }
            ok
        }));
        let watch = async {
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(40)).await;
                min_limit = min_limit.min(limit().await);
                if wave == 1 {
                    deepest = deepest.max(stats(&sim).await["waiting"].as_u64().unwrap());
                }
            }
        };
        tokio::select! {
            done = clients => all_ok &= done.iter().all(|ok| *ok),
            () = watch => unreachable!(),
        }
    }
    app.stop().await;
    (deepest, min_limit, all_ok)
}

#[tokio::test]
async fn a_replica_whose_ttft_grows_gets_fewer_requests_and_the_rest_wait_at_the_gateway() {
    let (deepest, min_limit, all_ok) = overload_waves(true).await;
    assert!(all_ok, "every request answered (queued at the gateway)");
    assert!(
        min_limit <= 12,
        "the limit fell from 64 towards the 4 the server batches: {min_limit}"
    );
    // Typically 10-11 deep; on a loaded 2-core machine (CI failed once at 14; 14 and 15 seen
    // in 2 of 18 runs beside two busy loops) deeper for a moment, as the limit moves on
    // latencies that the host's own load also stretches. Bounded by 18: under half the fixed
    // case's queue.
    assert!(
        deepest <= 18,
        "the server's queue stayed short in the second wave: {deepest}"
    );
    // The same load with a fixed limit piles up at the server.
    let (fixed_deepest, min_limit, all_ok) = overload_waves(false).await;
    assert!(all_ok);
    assert_eq!(min_limit, 64, "fixed at max_concurrency");
    assert!(
        fixed_deepest >= 24 && fixed_deepest >= 2 * deepest,
        "without it the server queues: {fixed_deepest} (adaptive: {deepest})"
    );
}

#[tokio::test]
async fn ten_times_a_tiers_capacity_is_answered_within_a_bound_or_refused_at_once_for_nothing() {
    // A server batching 2 sequences of about 100 ms: some 20 answers a second.
    let sim = batching(2, 20.0, 20.0).await;
    let large = Sim::zero("sim-large").await;
    let mut s1 = replica("s1", &sim.url, "sim-small");
    s1.max_concurrency = 2;
    let mut c = config(vec![s1], vec![replica("l1", &large.url, "sim-large")]);
    c.upstream.fallback_to_other_tier = false;
    c.upstream.queue_wait_ms = 500;
    c.budgets = e2e::BudgetKind::Memory.config();
    e2e::price(&mut c, "sim-small", 1.0, 2.0);
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let r = app
        .admin(
            Method::POST,
            "budgets",
            Some(json!({"tenant": "acme", "window": "day", "limit_tokens": 100_000_000})),
        )
        .await;
    assert_eq!(r.status(), 201);
    // Offered at 200 a second, open loop, for 3 s: ten times what the server answers.
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(5));
    let mut sends = Vec::new();
    for i in 0..600 {
        tick.tick().await;
        let (http, base, key) = (app.http.clone(), app.base.clone(), app.api_key.clone());
        sends.push(tokio::spawn(async move {
            let mut body = chat_body("fast", &format!("offered {i}"));
            body["max_tokens"] = json!(4);
            let started = std::time::Instant::now();
            let r = http
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let retry_after = r.headers().contains_key("retry-after");
            let _ = r.bytes().await;
            (status, started.elapsed(), retry_after)
        }));
    }
    let results: Vec<_> = futures_util::future::join_all(sends)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let admitted: Vec<_> = results.iter().filter(|r| r.0 == 200).collect();
    let refused: Vec<_> = results.iter().filter(|r| r.0 == 503).collect();
    assert_eq!(
        admitted.len() + refused.len(),
        600,
        "answered or refused as overloaded, nothing else"
    );
    assert!(
        admitted.len() >= 30,
        "the server's pace: {}",
        admitted.len()
    );
    assert!(refused.len() >= 400, "the rest: {}", refused.len());
    assert!(
        refused.iter().all(|r| r.2),
        "every refusal says when to retry"
    );
    // An admitted request waited at most the queue's 500 ms, then was served (slack for a
    // loaded test machine).
    let slowest = admitted.iter().map(|r| r.1).max().unwrap();
    assert!(
        slowest < std::time::Duration::from_millis(2_500),
        "admitted requests' wait is bounded: {slowest:?}"
    );
    // Most refusals come at once (a full queue, or a wait it could not sit out), not after it.
    let metrics = app.metrics().await;
    let shed = |reason: &str| -> u64 {
        let line = format!("gateway_shed_requests_total{{reason=\"{reason}\",tier=\"small\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .unwrap_or_else(|| panic!("{reason}: {metrics}"))
            .parse()
            .unwrap()
    };
    let (at_once, after_wait) = (
        shed("expected_wait") + shed("queue_full"),
        shed("queue_timeout"),
    );
    assert_eq!(at_once + after_wait, refused.len() as u64);
    assert!(
        at_once >= 9 * after_wait,
        "refused at once: {at_once}, after the wait: {after_wait}"
    );
    // Nothing is charged for a refusal, and no reservation is left behind.
    for _ in 0..600 {
        let e = app.next_event().await;
        if e.status == 503 {
            assert_eq!((e.cost_micros, e.prompt_tokens), (0, 0), "{e:?}");
        } else {
            assert!(e.cost_micros > 0, "{e:?}");
        }
    }
    app.wait_reserved_zero("acme").await;
    app.stop().await;
}
