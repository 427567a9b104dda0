//! The route step end to end: `auto` requests get the tier the shipped classifier and the
//! tenant's policy pick, with the `x-gateway-route` header and the ledger's reason; explicit
//! model names are never rerouted; tools follow the configured rule; a bad artefact is a clear
//! startup error unless the config says to fall back to the large tier.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use e2e::{chat_body, model_dir, Sim, StoreKind, TestApp, TestStore};
use gateway::config::{Config, Unavailable};
use gateway::state::{AppState, Deps};
use reqwest::Method;
use serde_json::{json, Value};

/// Prompts of the small committed fixture (15 per MMLU subject).
fn prompts() -> Vec<String> {
    std::fs::read_to_string(SMALL_FIXTURE)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["prompt"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect()
}

async fn app() -> (TestApp, Sim) {
    let sim = Sim::zero("sim-small").await;
    let c = e2e::config_on(&sim, None);
    (TestApp::spawn(c, StoreKind::Sqlite).await, sim)
}

fn route_header(r: &reqwest::Response) -> String {
    r.headers()["x-gateway-route"].to_str().unwrap().to_owned()
}

#[tokio::test]
async fn auto_gets_the_classifiers_tier_with_its_reason_and_explicit_names_are_kept() {
    let (mut app, _sim) = app().await;
    let mut tiers = std::collections::BTreeSet::new();
    for p in prompts().iter().step_by(7).take(40) {
        let r = app.chat(chat_body("auto", p)).await;
        assert_eq!(r.status(), 200);
        let h = route_header(&r);
        let served = r.headers()["x-gateway-tier"].to_str().unwrap().to_owned();
        let parts: Vec<&str> = h.split(' ').collect();
        assert_eq!(parts[0], format!("tier={served}"), "{h}");
        assert_eq!(parts[1], "reason=classifier", "{h}");
        let p_large: f64 = parts[2].strip_prefix("p_large=").unwrap().parse().unwrap();
        assert!((0.0..=1.0).contains(&p_large), "{h}");
        assert_eq!(parts[3], "policy=balanced", "{h}");
        let e = app.next_event().await;
        assert_eq!(e.route_reason.as_deref(), Some("classifier"));
        assert_eq!(e.tier.as_deref(), Some(served.as_str()));
        tiers.insert(served);
    }
    assert_eq!(
        tiers.len(),
        2,
        "a balanced policy sends some prompts each way: {tiers:?}"
    );
    // Explicit names: the tier they name, whatever the prompt; no route header.
    for (model, tier) in [("fast", "small"), ("smart", "large")] {
        let r = app.chat(chat_body(model, &prompts()[0])).await;
        assert_eq!(r.headers()["x-gateway-tier"], tier);
        assert!(!r.headers().contains_key("x-gateway-route"));
        let e = app.next_event().await;
        assert_eq!(e.route_reason.as_deref(), Some("explicit"));
    }
    app.stop().await;
}

async fn large_calls(app: &mut TestApp, prompts: &[String]) -> usize {
    let mut large = 0;
    for p in prompts {
        let r = app.chat(chat_body("auto", p)).await;
        assert_eq!(r.status(), 200);
        large += usize::from(r.headers()["x-gateway-tier"] == "large");
        app.next_event().await;
    }
    large
}

#[tokio::test]
async fn policies_move_the_large_share_in_the_order_they_promise() {
    let (mut app, _sim) = app().await;
    let sample: Vec<String> = prompts().into_iter().step_by(5).take(60).collect();
    let mut counts = Vec::new();
    for policy in ["cost", "balanced", "quality"] {
        let r = app
            .admin(
                Method::PUT,
                "tenants/acme/routing-policy",
                Some(json!({ "policy": policy })),
            )
            .await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert!(v["expected_large_share"].as_f64().unwrap() > 0.0, "{v}");
        counts.push(large_calls(&mut app, &sample).await);
    }
    assert!(
        counts[0] <= counts[1] && counts[1] <= counts[2],
        "cost, balanced, quality: {counts:?}"
    );
    assert!(counts[0] < counts[2], "{counts:?}");
    for (share, expected) in [(0.0, 0), (1.0, sample.len())] {
        let (ok, out) = app
            .ctl(&[
                "routing",
                "set",
                "--tenant",
                "acme",
                "--large-share",
                &share.to_string(),
            ])
            .await;
        assert!(ok, "{out}");
        assert_eq!(
            large_calls(&mut app, &sample).await,
            expected,
            "share {share}"
        );
    }
    let r = app.chat(chat_body("auto", "hello")).await;
    assert!(
        route_header(&r).ends_with("policy=share=1.00"),
        "{}",
        route_header(&r)
    );
    app.next_event().await;
    let (ok, out) = app.ctl(&["routing", "show", "--tenant", "acme"]).await;
    assert!(
        ok && out.contains("large share 1.00") && out.contains("yes"),
        "{out}"
    );
    let (ok, out) = app.ctl(&["routing", "reset", "--tenant", "acme"]).await;
    assert!(ok && out.contains("balanced"), "{out}");
    app.stop().await;
}

#[tokio::test]
async fn a_bad_policy_is_a_clear_error_naming_the_field() {
    let (app, _sim) = app().await;
    for (body, param) in [
        (json!({"large_share": 1.5}), "large_share"),
        (json!({"policy": "cost", "large_share": 0.2}), "large_share"),
        (json!({}), "policy"),
    ] {
        let r = app
            .admin(
                Method::PUT,
                "tenants/acme/routing-policy",
                Some(body.clone()),
            )
            .await;
        assert_eq!(r.status(), 400, "{body}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    let r = app
        .admin(
            Method::PUT,
            "tenants/acme/routing-policy",
            Some(json!({"policy": "cheap"})),
        )
        .await;
    assert_eq!(r.status(), 400);
    let r = app
        .admin(Method::DELETE, "tenants/acme/routing-policy", None)
        .await;
    assert_eq!(r.status(), 404, "no policy of its own to drop");
    app.stop().await;
}

#[tokio::test]
async fn tools_follow_the_rule_and_an_empty_prompt_routes() {
    let (mut app, _sim) = app().await;
    let body = json!({"model": "auto", "messages": [{"role": "user", "content": "What is the weather?"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]});
    let r = app.chat(body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(route_header(&r), "tier=large reason=rule policy=balanced");
    assert_eq!(app.next_event().await.route_reason.as_deref(), Some("rule"));
    let image = json!({"model": "auto", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]});
    let r = app.chat(image).await;
    assert!(route_header(&r).starts_with("tier=large reason=rule"));
    app.next_event().await;
    let r = app.chat(chat_body("auto", "")).await;
    assert_eq!(r.status(), 200);
    assert!(
        route_header(&r).contains("reason=classifier"),
        "{}",
        route_header(&r)
    );
    app.next_event().await;
    app.stop().await;
}

async fn build(c: Config) -> anyhow::Result<AppState> {
    let store = TestStore::new(StoreKind::Sqlite).await.unwrap();
    let mut c = c;
    c.store.url = store.url.clone();
    c.ledger.enabled = false;
    AppState::build(
        c,
        Deps {
            store: Some(store.store),
            ..Deps::default()
        },
    )
    .await
}

#[tokio::test]
async fn a_broken_artefact_stops_the_start_unless_auto_may_fall_back_to_large() {
    let sim = Sim::zero("sim-small").await;
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("router.json");
    std::fs::write(&bad, r#"{"hand_columns": ["length"]}"#).unwrap();
    let mut c = e2e::config_on(&sim, None);
    c.routing.classifier = Some(bad.clone());
    let e = format!("{:#}", build(c.clone()).await.unwrap_err());
    assert!(
        e.contains("tier classifier") && e.contains("gateway router train"),
        "{e}"
    );
    c.routing.classifier = Some(dir.path().join("missing.json"));
    let e = format!("{:#}", build(c.clone()).await.unwrap_err());
    assert!(
        e.contains("missing.json") && e.contains("if_unavailable"),
        "{e}"
    );

    c.routing.if_unavailable = Unavailable::Large;
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let r = app
        .chat(chat_body("auto", "Prove the Riemann hypothesis."))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        route_header(&r),
        "tier=large reason=fallback policy=balanced"
    );
    assert_eq!(
        app.next_event().await.route_reason.as_deref(),
        Some("fallback")
    );
    app.stop().await;
}

/// The small committed fixture (15 prompts per MMLU subject).
const SMALL_FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../embedder/tests/fixtures/routing-small.jsonl"
);

/// Run the `gateway` binary: whether it succeeded, and its stdout then stderr.
fn run(args: &[&str]) -> (bool, String) {
    let o = std::process::Command::new(e2e::binary("gateway"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

#[tokio::test]
async fn router_train_and_eval_run_on_the_small_fixture() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tier.json");
    let data = SMALL_FIXTURE;
    let (ok, text) = run(&[
        "router",
        "train",
        "--data",
        data,
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    assert!(
        text.contains("420 prompts, 28 subjects, 5 folds grouped by subject"),
        "{text}"
    );
    for col in ["PGR20", "PGR50", "PGR80", "APGR", "CPT(50)", "CPT(80)"] {
        assert!(text.contains(col), "{text}");
    }
    assert!(
        text.contains("prompt length") && text.contains("random (expected)"),
        "{text}"
    );
    let (ok, text) = run(&[
        "router",
        "eval",
        "--data",
        data,
        "--model",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    assert!(
        text.contains("420 prompts") && text.contains("classifier"),
        "{text}"
    );
    let (ok, text) = run(&["router", "eval", "--data", data]);
    assert!(
        ok && text.contains("routing-dev.jsonl"),
        "the shipped model: {text}"
    );
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"x\", \"small_correct\": 1}\n").unwrap();
    let (ok, text) = run(&["router", "eval", "--data", bad.to_str().unwrap()]);
    assert!(
        !ok && text.contains("bad.jsonl:1: `small_correct` must be true or false"),
        "{text}"
    );
}

/// A chat body with a small `max_tokens` and its own `user` (its own guard session).
fn routed_body(text: &str, i: usize) -> Value {
    json!({"model": "auto", "max_tokens": 16, "user": format!("u{i}"),
           "messages": [{"role": "user", "content": text}]})
}

#[tokio::test]
async fn budget_pressure_moves_a_prompt_to_small_before_the_limit_and_any_429() {
    let sim = Sim::zero("sim-small").await;
    let mut c = e2e::config_on(&sim, None);
    c.cache.mode = gateway::cache::CacheMode::Off;
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    // A prompt the balanced policy sends large, with no pressure.
    let mut prompt = None;
    for p in prompts().iter().step_by(3) {
        let r = app.chat(routed_body(p, 0)).await;
        let e = app.next_event().await;
        if r.headers()["x-gateway-tier"] == "large" {
            prompt = Some((p.clone(), e.prompt_tokens + e.completion_tokens));
            break;
        }
    }
    let (prompt, tokens) = prompt.expect("some prompt goes large");
    // Room for about 40 such requests below the soft limit.
    let limit = 40 * tokens;
    let r = app
        .admin(
            Method::POST,
            "budgets",
            Some(
                json!({"tenant": "acme", "window": "day", "limit_tokens": limit,
                        "action": "downgrade", "hard_limit_tokens": 2 * limit}),
            ),
        )
        .await;
    assert_eq!(r.status(), 201);
    // Until the hard cap refuses: (tier, reason, budget_used, header).
    let mut seen = Vec::new();
    for i in 1..=200 {
        let r = app.chat(routed_body(&prompt, i)).await;
        if r.status() == 429 {
            break;
        }
        assert_eq!(r.status(), 200, "request {i}");
        let h = route_header(&r);
        let e = app.next_event().await;
        let used = h
            .split(' ')
            .find_map(|kv| kv.strip_prefix("budget_used="))
            .map(|u| u.parse::<f64>().unwrap());
        seen.push((
            e.tier.unwrap().into_owned(),
            e.route_reason.unwrap().into_owned(),
            used,
            h,
        ));
    }
    assert!(seen.len() < 200, "the hard cap never refused: {seen:#?}");
    let moved = seen
        .iter()
        .position(|s| s.1 == "budget")
        .unwrap_or_else(|| panic!("pressure never moved the prompt: {seen:#?}"));
    for (i, s) in seen.iter().enumerate() {
        if i < moved {
            assert_eq!(
                (s.0.as_str(), s.1.as_str()),
                ("large", "classifier"),
                "{s:?}"
            );
        } else {
            // Once pressure moves it, it stays small (pressure only grows within the window).
            assert_eq!((s.0.as_str(), s.1.as_str()), ("small", "budget"), "{s:?}");
        }
    }
    // It moved before the soft limit was reached: smoothly, not at the limit.
    let used = seen[moved].2.expect("the header says the pressure");
    assert!((0.8..1.0).contains(&used), "{:?}", seen[moved]);
    assert!(
        seen[..moved].iter().all(|s| s.2.is_none_or(|u| u < used)),
        "{seen:#?}"
    );
    // The refusal came only once the soft limit was passed (the hard cap is twice it).
    assert_eq!(seen.last().unwrap().2, Some(1.0), "{seen:#?}");
    app.stop().await;
}

#[tokio::test]
async fn an_answer_from_the_other_tier_says_the_chosen_one_was_unhealthy() {
    let sim = Sim::zero("sim-small").await;
    // The large tier's only replica refuses connections.
    let mut c = e2e::config(
        vec![e2e::replica("s", &sim.url, "sim-small")],
        vec![e2e::replica("l", "http://127.0.0.1:9/v1", "sim-large")],
    );
    c.cache.mode = gateway::cache::CacheMode::Off;
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let body = json!({"model": "auto", "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]});
    let r = app.chat(body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-gateway-tier"], "small");
    assert_eq!(route_header(&r), "tier=small reason=unhealthy chosen=large");
    let e = app.next_event().await;
    assert_eq!(e.route_reason.as_deref(), Some("unhealthy"));
    assert_eq!(e.tier.as_deref(), Some("small"));
    // An explicit name that fails over says so too.
    let r = app.chat(chat_body("smart", "hi")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(route_header(&r), "tier=small reason=unhealthy chosen=large");
    assert_eq!(
        app.next_event().await.route_reason.as_deref(),
        Some("unhealthy")
    );
    app.stop().await;
}

#[tokio::test]
async fn a_routed_answer_records_what_it_would_have_cost_on_large() {
    let small = Sim::zero("sim-small").await;
    let large = Sim::zero("sim-large").await;
    let mut c = e2e::config(
        vec![e2e::replica("s", &small.url, "sim-small")],
        vec![e2e::replica("l", &large.url, "sim-large")],
    );
    c.cache.mode = gateway::cache::CacheMode::Off;
    for (model, input, output) in [("sim-small", 1.0, 2.0), ("sim-large", 10.0, 30.0)] {
        e2e::price(&mut c, model, input, output);
    }
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let mut tiers = std::collections::BTreeSet::new();
    for (i, p) in prompts().iter().step_by(9).take(20).enumerate() {
        let r = app.chat(routed_body(p, i)).await;
        assert_eq!(r.status(), 200);
        let e = app.next_event().await;
        let tokens = (e.prompt_tokens as f64, e.completion_tokens as f64);
        let at_large = (tokens.0 * 10.0 + tokens.1 * 30.0).round() as i64;
        let all_large = e
            .all_large_micros
            .expect("a routed answer has its large-tier cost");
        match e.tier.as_deref() {
            Some("large") => assert_eq!(all_large, e.cost_micros),
            _ => {
                assert!(
                    (all_large - at_large).abs() <= 1,
                    "{all_large} vs {at_large}"
                );
                assert!(all_large > e.cost_micros, "{e:?}");
            }
        }
        tiers.insert(e.tier.unwrap());
    }
    assert_eq!(tiers.len(), 2, "both tiers answered: {tiers:?}");
    let r = app.chat(chat_body("smart", "hi")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        app.next_event().await.all_large_micros,
        None,
        "an explicit name is not routed"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_classifier_that_reads_the_static_embedding_trains_evaluates_and_routes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tier-static.json");
    let data = SMALL_FIXTURE;
    let model = model_dir();
    let (ok, text) = run(&[
        "router",
        "train",
        "--data",
        data,
        "--out",
        out.to_str().unwrap(),
        "--embedding",
        "static",
        "--embedding-model",
        model.to_str().unwrap(),
    ]);
    assert!(ok && text.contains("APGR"), "{text}");
    let artefact: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(artefact["embedding"]["source"], "static");
    assert_eq!(artefact["embedding"]["dim"], 384);
    let eval = |embedding_model: &str| {
        run(&[
            "router",
            "eval",
            "--data",
            data,
            "--model",
            out.to_str().unwrap(),
            "--embedding-model",
            embedding_model,
        ])
    };
    let (ok, text) = eval(model.to_str().unwrap());
    assert!(ok && text.contains("static embedding per prompt"), "{text}");
    let (ok, text) = eval("/nonexistent/model");
    assert!(
        !ok && text.contains("static embedding") && text.contains("fetch-model"),
        "{text}"
    );

    // The gateway routes with it, embedding each prompt with the semantic cache's model.
    let sim = Sim::zero("sim-small").await;
    let mut c = e2e::config_on(&sim, None);
    c.routing.classifier = Some(out.clone());
    c.cache.semantic.model_dir = model.clone();
    let mut app = TestApp::spawn(c.clone(), StoreKind::Sqlite).await;
    let mut tiers = std::collections::BTreeSet::new();
    for p in prompts().iter().step_by(11).take(20) {
        let r = app.chat(chat_body("auto", p)).await;
        assert_eq!(r.status(), 200);
        let h = route_header(&r);
        assert!(h.contains("reason=classifier"), "{h}");
        tiers.insert(r.headers()["x-gateway-tier"].to_str().unwrap().to_owned());
        app.next_event().await;
    }
    assert_eq!(tiers.len(), 2, "{tiers:?}");
    app.stop().await;
    // Without the embedding model it cannot score: a startup error that says why.
    c.cache.semantic.model_dir = "/nonexistent/model".into();
    let e = format!("{:#}", build(c).await.unwrap_err());
    assert!(e.contains("static embedding"), "{e}");
}
