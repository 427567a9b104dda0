//! Reports over the ledger: the weekly report, the explanation of a change on a synthetic
//! fortnight whose causes are known, loops found from billing data, and `gatewayctl report`.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use chrono::{DateTime, Duration, Utc};
use e2e::{config, replica, Sim, StoreKind, TestApp, TestStore, ADMIN_TOKEN, BOTH};
use gateway::ledger::report::{self, IsoWeek};
use gateway::usage::UsageEvent;

const W1: IsoWeek = IsoWeek {
    year: 2026,
    week: 46,
};
const W2: IsoWeek = IsoWeek {
    year: 2026,
    week: 47,
};

struct Row<'a> {
    tenant: &'a str,
    model: &'a str,
    at: DateTime<Utc>,
    prompt: u64,
    completion: u64,
    in_price: i64,
    out_price: i64,
    hit: bool,
    looped: bool,
    session: &'a str,
    fingerprint: String,
}

fn event(i: usize, r: &Row) -> UsageEvent {
    let billed = e2e::Billed {
        tenant: r.tenant,
        model: r.model,
        at: r.at,
        prompt: r.prompt,
        completion: r.completion,
        in_price: r.in_price,
        out_price: r.out_price,
    };
    let mut e = e2e::ledger_event(
        format!("{}-{i}-{}", r.tenant, r.at.timestamp_micros()),
        billed,
    );
    e.tags.insert("session".to_owned(), r.session.to_owned());
    e.loop_flag = r.looped;
    e.fingerprint = r.fingerprint.clone();
    if r.hit {
        e2e::into_cache_hit(e)
    } else {
        e
    }
}

/// Two weeks with known causes of change:
/// - alpha (small model) doubles its prompt length;
/// - beta (large model) sees its cache hit rate halve (50% → 25% of requests);
/// - one beta session loops in week 2: 40 identical requests every 30 s.
fn fortnight() -> Vec<UsageEvent> {
    let mut rows = Vec::new();
    for (week, alpha_prompt, beta_hits) in [(W1, 1000, 50), (W2, 2000, 25)] {
        let start = week.start() + Duration::hours(10);
        for i in 0..100 {
            let at = start + Duration::minutes(i as i64 * 7);
            rows.push(event(
                i,
                &Row {
                    tenant: "alpha",
                    model: "m-small",
                    at,
                    prompt: alpha_prompt,
                    completion: 100,
                    in_price: 1,
                    out_price: 4,
                    hit: false,
                    looped: false,
                    session: "-",
                    fingerprint: format!("fa{i}"),
                },
            ));
            rows.push(event(
                1000 + i,
                &Row {
                    tenant: "beta",
                    model: "m-large",
                    at: at + Duration::seconds(1),
                    prompt: 500,
                    completion: 200,
                    in_price: 5,
                    out_price: 20,
                    hit: i < beta_hits,
                    looped: false,
                    session: "-",
                    fingerprint: format!("fb{i}"),
                },
            ));
        }
    }
    let loop_start = W2.start() + Duration::days(2);
    for i in 0..40 {
        rows.push(event(
            5000 + i,
            &Row {
                tenant: "beta",
                model: "m-large",
                at: loop_start + Duration::seconds(30 * i as i64),
                prompt: 500,
                completion: 200,
                in_price: 5,
                out_price: 20,
                hit: false,
                looped: true,
                session: "s-loop",
                fingerprint: "same-question".into(),
            },
        ));
    }
    rows
}

fn term(e: &report::Explanation, name: &str) -> i64 {
    e.terms
        .iter()
        .find(|t| t.term == name)
        .unwrap_or_else(|| panic!("term {name}"))
        .micros
}

#[tokio::test]
async fn explain_attributes_a_synthetic_fortnight_to_its_known_causes_on_both_stores() {
    for kind in BOTH {
        let store = TestStore::new(kind).await.unwrap();
        let ledger = gateway::ledger::open(&store.url).await.unwrap();
        ledger.insert(&fortnight()).await.unwrap();
        let e = report::explain(ledger.as_ref(), W1, W2, None)
            .await
            .unwrap();
        let total = e.to_micros - e.from_micros;
        assert_eq!(
            e.terms.iter().map(|t| t.micros).sum::<i64>(),
            total,
            "{kind:?}: terms add up"
        );
        // alpha input cost 100 × 1000 µ$ → 100 × 2000 µ$
        assert!(
            (term(&e, "prompt length") - 100_000).abs() <= 2,
            "{kind:?}: {e:#?}"
        );
        // beta billed requests 50 → 75 at 6,500 µ$ each
        assert!(
            (term(&e, "cache hit rate") - 162_500).abs() <= 2,
            "{kind:?}: {e:#?}"
        );
        assert_eq!(term(&e, "waste: agent loops"), 40 * 6_500);
        for quiet in [
            "traffic volume",
            "model/tier mix",
            "completion length",
            "unit price",
            "waste: retry storms",
            "waste: failed requests",
        ] {
            assert!(
                term(&e, quiet).abs() <= 2,
                "{kind:?}: {quiet} should be ~0: {e:#?}"
            );
        }
        assert!(term(&e, "rounding").abs() <= 5);
        assert_eq!(e.top["tenant"][0].key, "beta");
        assert_eq!(e.top["session"][0].key, "s-loop");

        let alpha_only = report::explain(ledger.as_ref(), W1, W2, Some("alpha"))
            .await
            .unwrap();
        assert_eq!(alpha_only.to_micros - alpha_only.from_micros, 100_000);
    }
}

#[tokio::test]
async fn the_weekly_report_sums_the_ledger_with_the_change_from_last_week() {
    let store = TestStore::new(StoreKind::Postgres).await.unwrap();
    let ledger = gateway::ledger::open(&store.url).await.unwrap();
    ledger.insert(&fortnight()).await.unwrap();
    let r = report::weekly(ledger.as_ref(), W2, None).await.unwrap();
    assert_eq!(r.week, "2026-W47");
    assert_eq!(r.previous_week, "2026-W46");
    assert_eq!(r.total.this.requests, 240);
    assert_eq!(r.total.previous.requests, 200);
    // week 2: alpha 100 × (2000 + 400) + beta 75 × 6500 + loop 40 × 6500
    assert_eq!(r.total.this.cost, 240_000 + 487_500 + 260_000);
    assert_eq!(r.total.previous.cost, 140_000 + 325_000);
    assert_eq!(r.total.this.waste_loops, 260_000);
    assert_eq!(r.total.this.cache_hits, 25);
    assert_eq!(r.total.this.saved, 25 * 6_500);
    let by_tenant = &r.by["tenant"];
    assert_eq!(by_tenant[0].key, "beta", "biggest spender first");
    assert_eq!(by_tenant[1].this.cost, 240_000);
    let tiers: Vec<_> = r.by["tier"].iter().map(|l| l.key.as_str()).collect();
    assert_eq!(tiers, vec!["large", "small"]);
    assert_eq!(r.by["feature"].len(), 2);
}

#[tokio::test]
async fn loops_are_found_from_billing_data_alone() {
    let store = TestStore::new(StoreKind::Sqlite).await.unwrap();
    let ledger = gateway::ledger::open(&store.url).await.unwrap();
    let mut rows = fortnight();
    // The same question asked 6 times at irregular times is not a loop.
    for (i, minutes) in [0i64, 1, 90, 95, 400, 401].into_iter().enumerate() {
        rows.push(event(
            9000 + i,
            &Row {
                tenant: "gamma",
                model: "m-small",
                at: W2.start() + Duration::days(3) + Duration::minutes(minutes),
                prompt: 10,
                completion: 10,
                in_price: 1,
                out_price: 1,
                hit: false,
                looped: false,
                session: "s-human",
                fingerprint: "popular".into(),
            },
        ));
    }
    ledger.insert(&rows).await.unwrap();
    let found = report::loops(ledger.as_ref(), W2.start(), W2.end(), 5, 0.5)
        .await
        .unwrap();
    assert_eq!(found.len(), 1, "{found:#?}");
    let f = &found[0];
    assert_eq!(
        (f.session.as_str(), f.requests, f.tenant.as_str()),
        ("s-loop", 40, "beta")
    );
    assert!((f.mean_interval_secs - 30.0).abs() < 0.01);
    assert_eq!(f.cost_micros, 40 * 6_500);
}

/// A gateway writing its ledger (flushed every `flush_ms`) into `store`, on a simulator.
async fn ledger_app(store: TestStore, flush_ms: u64) -> (TestApp, Sim, tempfile::TempDir) {
    let sim = Sim::zero("sim-small").await;
    let mut c = config(
        vec![replica("s", &sim.url, "sim-small")],
        vec![replica("l", &sim.url, "sim-small")],
    );
    let dir = tempfile::tempdir().unwrap();
    c.ledger.spool_dir = dir.path().to_owned();
    c.ledger.flush_ms = flush_ms;
    (TestApp::spawn_with_ledger(c, store).await, sim, dir)
}

#[tokio::test]
async fn gatewayctl_prints_the_reports_as_tables_csv_and_json() {
    let store = TestStore::new(StoreKind::Sqlite).await.unwrap();
    gateway::ledger::open(&store.url)
        .await
        .unwrap()
        .insert(&fortnight())
        .await
        .unwrap();
    let (app, _sim, _dir) = ledger_app(store, 200).await;
    let ctl = |args: Vec<&str>| {
        let base = app.base.clone();
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        async move {
            let out = tokio::process::Command::new(e2e::binary("gatewayctl"))
                .args(&args)
                .env("GATEWAY_URL", base)
                .env("GATEWAY_ADMIN_TOKEN", ADMIN_TOKEN)
                .output()
                .await
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        }
    };
    let table = ctl(vec!["report", "weekly", "--week", "2026-W47"]).await;
    assert!(
        table.contains("Week 2026-W47 (vs 2026-W46)")
            && table.contains("By tenant")
            && table.contains("beta"),
        "{table}"
    );
    assert!(
        table.contains("0.9875"),
        "total cost $0.9875 shown: {table}"
    );
    let csv = ctl(vec![
        "report", "weekly", "--week", "2026-W47", "--format", "csv",
    ])
    .await;
    assert!(
        csv.lines().any(|l| l.starts_with("alpha,0.240000,")),
        "{csv}"
    );
    let json = ctl(vec![
        "report", "explain", "--from", "2026-W46", "--to", "2026-W47", "--format", "json",
    ])
    .await;
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["to_week"], "2026-W47");
    let explain = ctl(vec![
        "report", "explain", "--from", "2026-W46", "--to", "2026-W47",
    ])
    .await;
    assert!(
        explain.contains("cache hit rate") && explain.contains("Top contributors by session"),
        "{explain}"
    );
    let r = app
        .admin(reqwest::Method::GET, "reports/weekly?week=yesterday", None)
        .await;
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn a_deleted_tenants_history_reports_apart_from_a_new_tenant_of_the_same_name() {
    for kind in BOTH {
        let store = TestStore::new(kind).await.unwrap();
        let ledger = gateway::ledger::open(&store.url).await.unwrap();
        let at = W2.start() + Duration::hours(30);
        let row = |i: usize, tenant_id: &str| {
            let mut e = e2e::ledger_event(
                format!("req-{tenant_id}-{i}"),
                e2e::Billed {
                    tenant: "acme",
                    model: "sim-small",
                    at: at + Duration::minutes(i as i64),
                    prompt: 100,
                    completion: 10,
                    in_price: 1,
                    out_price: 2,
                },
            );
            e.tenant_id = tenant_id.into();
            e
        };
        let old: Vec<_> = (0..3).map(|i| row(i, "ten_old")).collect();
        ledger.insert(&old).await.unwrap();
        let label = "acme (deleted, ten_old)";
        assert_eq!(
            ledger
                .retire_tenant("ten_old", "acme", label)
                .await
                .unwrap(),
            3
        );
        let new: Vec<_> = (0..2).map(|i| row(i, "ten_new")).collect();
        ledger.insert(&new).await.unwrap();
        let r = report::weekly(ledger.as_ref(), W2, None).await.unwrap();
        let by_tenant: Vec<(&str, i64)> = r.by["tenant"]
            .iter()
            .map(|l| (l.key.as_str(), l.this.requests))
            .collect();
        assert_eq!(by_tenant, [(label, 3), ("acme", 2)], "{kind:?}");
        // The same from raw rows (a range the daily rollup does not cover).
        let raw = ledger
            .aggregate(
                at,
                at + Duration::hours(1),
                None,
                &[report::Dimension::Tenant],
            )
            .await
            .unwrap();
        let mut raw: Vec<(String, i64)> = raw.into_iter().map(|(k, a)| (k, a.requests)).collect();
        raw.sort();
        assert_eq!(raw, [("acme".into(), 2), (label.into(), 3)], "{kind:?}");
    }
}

#[tokio::test]
async fn deleting_a_tenant_through_the_admin_api_relabels_its_ledger_rows() {
    let store = TestStore::new(StoreKind::Sqlite).await.unwrap();
    let (app, _sim, _dir) = ledger_app(store, 20).await;
    for _ in 0..2 {
        assert_eq!(app.chat(e2e::chat_body("fast", "hi")).await.status(), 200);
    }
    let ledger = gateway::ledger::open(&app.store.url).await.unwrap();
    e2e::eventually(
        "two rows written",
        std::time::Duration::from_secs(5),
        || async { (ledger.count().await.unwrap() == 2).then_some(()) },
    )
    .await;
    let r = app
        .admin(reqwest::Method::DELETE, "tenants/acme", None)
        .await;
    assert_eq!(r.status(), 200);
    let now = Utc::now();
    let rows = ledger
        .rows_between(now - Duration::hours(1), now + Duration::hours(1))
        .await
        .unwrap();
    let expected = format!("acme (deleted, {})", app.tenant_id);
    assert!(rows.iter().all(|r| r.tenant_name == expected), "{rows:?}");
}

/// Routed rows: alpha's `auto` traffic goes from 8 of 10 on large (week 1) to 4 of 10 (week 2);
/// each request is 1,000 prompt + 100 completion tokens, 1,400 µ$ on small and 7,000 µ$ on
/// large. beta only names its model (never routed).
fn routed_fortnight() -> Vec<UsageEvent> {
    let mut rows = Vec::new();
    for (week, large) in [(W1, 8), (W2, 4)] {
        for i in 0..10 {
            let (model, in_price, out_price) = if i < large {
                ("m-large", 5, 20)
            } else {
                ("m-small", 1, 4)
            };
            let at = week.start() + Duration::hours(10) + Duration::minutes(i as i64);
            let mut e = event(
                i,
                &Row {
                    tenant: "alpha",
                    model,
                    at,
                    prompt: 1000,
                    completion: 100,
                    in_price,
                    out_price,
                    hit: false,
                    looped: false,
                    session: "-",
                    fingerprint: format!("r{i}"),
                },
            );
            e.requested_model = "auto".into();
            e.route_reason = Some("classifier".into());
            e.all_large_micros = Some(7_000);
            rows.push(e);
            rows.push(event(
                100 + i,
                &Row {
                    tenant: "beta",
                    model: "m-large",
                    at,
                    prompt: 1000,
                    completion: 100,
                    in_price: 5,
                    out_price: 20,
                    hit: false,
                    looped: false,
                    session: "-",
                    fingerprint: format!("b{i}"),
                },
            ));
        }
    }
    rows
}

#[tokio::test]
async fn the_reports_show_the_large_call_share_by_tenant_and_what_the_router_saved() {
    for kind in BOTH {
        let store = TestStore::new(kind).await.unwrap();
        let ledger = gateway::ledger::open(&store.url).await.unwrap();
        ledger.insert(&routed_fortnight()).await.unwrap();
        let r = report::weekly(ledger.as_ref(), W2, None).await.unwrap();
        let keys: Vec<&str> = r.routing.iter().map(|l| l.key.as_str()).collect();
        assert_eq!(keys, ["alpha", "total"], "{kind:?}: beta routed nothing");
        for line in &r.routing {
            assert_eq!((line.from_requests, line.to_requests), (10, 10), "{kind:?}");
            assert_eq!(line.from_large_share, Some(0.8), "{kind:?}");
            assert_eq!(line.to_large_share, Some(0.4), "{kind:?}");
            // 2 and 6 requests on small, each 7,000 − 1,400 µ$ cheaper than on large.
            assert_eq!(line.from_saved_micros, 2 * 5_600, "{kind:?}");
            assert_eq!(line.to_saved_micros, 6 * 5_600, "{kind:?}");
        }
        let alpha = &r.by["tenant"]
            .iter()
            .find(|l| l.key == "alpha")
            .unwrap()
            .this;
        assert_eq!(alpha.router_saved(), 6 * 5_600);
        // A part of a week is read from the raw rows, not the daily rollup: same answer.
        let raw = ledger
            .aggregate(W2.start(), W2.start() + Duration::hours(11), None, &[])
            .await
            .unwrap();
        assert_eq!(raw[0].1.routed_large, 4, "{kind:?}");
        assert_eq!(raw[0].1.router_saved(), 6 * 5_600, "{kind:?}");
        let e = report::explain(ledger.as_ref(), W1, W2, None)
            .await
            .unwrap();
        assert_eq!(e.routing, r.routing, "{kind:?}");
    }
    // The tables say it too.
    let store = TestStore::new(StoreKind::Sqlite).await.unwrap();
    gateway::ledger::open(&store.url)
        .await
        .unwrap()
        .insert(&routed_fortnight())
        .await
        .unwrap();
    let (app, _sim, _dir) = ledger_app(store, 200).await;
    for args in [
        &["report", "weekly", "--week", "2026-W47"][..],
        &[
            "report", "explain", "--from", "2026-W46", "--to", "2026-W47",
        ][..],
    ] {
        let (ok, out) = app.ctl(args).await;
        assert!(ok, "{out}");
        let line = out
            .lines()
            .find(|l| l.contains(" alpha ") && l.contains("40.0%"))
            .unwrap_or_else(|| panic!("{out}"));
        for cell in ["80.0%", "-40.0 pt", "0.033600", "0.011200"] {
            assert!(line.contains(cell), "{cell} in {line}\n{out}");
        }
        assert!(out.contains("Tier router (model: auto)"), "{out}");
    }
}

#[tokio::test]
async fn the_weekly_report_counts_fallbacks_to_the_other_tier() {
    // Of routed_fortnight's alpha rows, the last three of the second week were answered by the
    // other tier because the chosen one could not.
    let mut rows = routed_fortnight();
    let mut fallback_cost = 0;
    let mut marked = 0;
    for e in rows.iter_mut().rev() {
        if e.tenant_name == "alpha" && e.started_at >= W2.start() && marked < 3 {
            e.route_reason = Some("unhealthy".into());
            fallback_cost += e.cost_micros;
            marked += 1;
        }
    }
    for kind in BOTH {
        let store = TestStore::new(kind).await.unwrap();
        let ledger = gateway::ledger::open(&store.url).await.unwrap();
        ledger.insert(&rows).await.unwrap();
        let r = report::weekly(ledger.as_ref(), W2, None).await.unwrap();
        assert_eq!(r.total.this.fallback_requests, 3, "{kind:?}");
        assert_eq!(r.total.this.fallback_cost, fallback_cost, "{kind:?}");
        assert_eq!(r.total.previous.fallback_requests, 0, "{kind:?}");
        let beta = r.by["tenant"].iter().find(|l| l.key == "beta").unwrap();
        assert_eq!(beta.this.fallback_requests, 0);
        // The raw rows say the same as the daily rollup.
        let raw = ledger
            .aggregate(W2.start(), W2.end() - Duration::seconds(1), None, &[])
            .await
            .unwrap();
        assert_eq!(raw[0].1.fallback_requests, 3, "{kind:?}");
    }
    let store = TestStore::new(StoreKind::Sqlite).await.unwrap();
    gateway::ledger::open(&store.url)
        .await
        .unwrap()
        .insert(&rows)
        .await
        .unwrap();
    let (app, _sim, _dir) = ledger_app(store, 200).await;
    let (ok, out) = app.ctl(&["report", "weekly", "--week", "2026-W47"]).await;
    assert!(ok, "{out}");
    assert!(out.contains("Fallback to the other tier"), "{out}");
    let line = out
        .lines()
        .skip_while(|l| !l.contains("Fallback to the other tier"))
        .find(|l| l.contains(" alpha "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains(" 3 "), "{line}");
    app.stop().await;
}
