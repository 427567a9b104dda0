//! Prefix-affinity replica choice through the real gateway (`upstream.replica_choice`): a
//! conversation's turns go back to the replica that served its prefix, new conversations spread,
//! the choice is said in `x-gateway-replica-choice` and the ledger row, and a replica that
//! cannot take requests is never chosen.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::BTreeMap;

use e2e::{config, replica, Sim, StoreKind, TestApp};
use gateway::config::ReplicaChoice;
use serde_json::{json, Value};

/// A system prompt of a dozen 256-byte blocks, shared by every turn of conversation `n`.
fn system(n: usize) -> String {
    format!("You are support agent #{n}. ").repeat(120)
}

fn turn(n: usize, turns: usize) -> Value {
    let mut messages = vec![json!({"role": "system", "content": system(n)})];
    for t in 0..turns {
        messages
            .push(json!({"role": "user", "content": format!("question {t} of conversation {n}")}));
        messages.push(json!({"role": "assistant", "content": format!("answer {t}")}));
    }
    messages.push(json!({"role": "user", "content": "and one more thing?"}));
    json!({"model": "fast", "messages": messages, "max_tokens": 8})
}

fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// The small tier on `sims` (`small-0`, `small-1`, …), choosing replicas by `choice`.
fn on(sims: &[Sim], choice: ReplicaChoice) -> gateway::config::Config {
    let mut c = config(
        sims.iter()
            .enumerate()
            .map(|(i, s)| replica(&format!("small-{i}"), &s.url, "sim-small"))
            .collect(),
        vec![replica("large", &sims[0].url, "sim-small")],
    );
    c.upstream.replica_choice = choice;
    c
}

async fn three_sims() -> Vec<Sim> {
    vec![
        Sim::zero("sim-small").await,
        Sim::zero("sim-small").await,
        Sim::zero("sim-small").await,
    ]
}

async fn app(choice: ReplicaChoice) -> (TestApp, Vec<Sim>) {
    let sims = three_sims().await;
    let mut c = on(&sims, choice);
    c.upstream.fallback_to_other_tier = false;
    (TestApp::spawn(c, StoreKind::Sqlite).await, sims)
}

#[tokio::test]
async fn a_conversation_returns_to_the_replica_holding_its_prefix() {
    for choice in [ReplicaChoice::AffinityGate, ReplicaChoice::AffinityWeighted] {
        let (mut app, _sims) = app(choice).await;
        let mut first_replica = BTreeMap::new();
        for n in 0..12 {
            let r = app.chat(turn(n, 0)).await;
            assert_eq!(r.status(), 200);
            let how = header(&r, "x-gateway-replica-choice");
            assert!(how.starts_with("reason=rendezvous"), "{choice:?}: {how}");
            first_replica.insert(n, header(&r, "x-gateway-replica"));
            let _ = r.text().await;
            let e = app.next_event().await;
            assert_eq!(e.replica_choice.as_deref(), Some("rendezvous"));
        }
        let spread: std::collections::BTreeSet<&String> = first_replica.values().collect();
        assert!(
            spread.len() >= 2,
            "new conversations spread: {first_replica:?}"
        );
        // Later turns of each conversation: the same replica, with most blocks matched.
        for turns in 1..4 {
            for n in 0..12 {
                let r = app.chat(turn(n, turns)).await;
                assert_eq!(r.status(), 200);
                assert_eq!(
                    header(&r, "x-gateway-replica"),
                    first_replica[&n],
                    "{choice:?}"
                );
                let how = header(&r, "x-gateway-replica-choice");
                let matched: usize = how
                    .split("matched_blocks=")
                    .nth(1)
                    .and_then(|m| m.parse().ok())
                    .unwrap();
                assert!(how.starts_with("reason=affinity") && matched >= 10, "{how}");
                let _ = r.text().await;
                let e = app.next_event().await;
                assert_eq!(e.replica_choice.as_deref(), Some("affinity"));
                assert_eq!(e.matched_blocks, Some(matched as u32));
            }
        }
        let m = app.metrics().await;
        assert!(
            m.contains("gateway_replica_choices_total{reason=\"affinity\""),
            "{m}"
        );
        assert!(
            m.contains("gateway_prefix_blocks_total{kind=\"matched\""),
            "{m}"
        );
        app.stop().await;
    }
}

#[tokio::test]
async fn a_replica_that_is_down_is_never_chosen_even_when_it_holds_the_prefix() {
    let (mut app, sims) = app(ReplicaChoice::AffinityGate).await;
    let r = app.chat(turn(0, 0)).await;
    let home = header(&r, "x-gateway-replica");
    let _ = r.text().await;
    let _ = app.next_event().await;
    let index: usize = home.trim_start_matches("small-").parse().unwrap();
    // Its server fails every request: the circuit opens after the failures, and the turns go
    // elsewhere (answered, since another replica of the tier takes over).
    sims[index]
        .faults(json!({"fail_next": 1000, "status": 503}))
        .await;
    let mut elsewhere = 0;
    for turns in 1..8 {
        let r = app.chat(turn(0, turns)).await;
        assert_eq!(r.status(), 200, "another replica answers");
        if header(&r, "x-gateway-replica") != home {
            elsewhere += 1;
        }
        let _ = r.text().await;
        let _ = app.next_event().await;
    }
    assert_eq!(elsewhere, 7, "every turn answered by another replica");
    app.stop().await;
}

#[tokio::test]
async fn least_loaded_choice_says_nothing_about_prefixes() {
    let (mut app, _sims) = app(ReplicaChoice::LeastLoaded).await;
    let r = app.chat(turn(0, 0)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-gateway-replica-choice"), "");
    let _ = r.text().await;
    let e = app.next_event().await;
    assert_eq!(e.replica_choice, None);
    assert_eq!(e.matched_blocks, None);
    app.stop().await;
}

#[tokio::test]
async fn a_server_busy_with_other_traffic_is_seen_in_its_own_metrics() {
    use gateway::simulator::{SimOptions, SimProfile};
    // Two replicas that generate one sequence at a time (the rest waits, as in vLLM).
    let mut p = SimProfile::small();
    p.max_running = 1;
    p.decode_ms_per_token = 10.0;
    let sims = [
        Sim::start(SimOptions::new(p.clone())).await,
        Sim::start(SimOptions::new(p)).await,
    ];
    let mut c = config(
        sims.iter()
            .enumerate()
            .map(|(i, s)| {
                let mut r = replica(&format!("small-{i}"), &s.url, "sim-small");
                r.metrics_url = Some(format!("{}/metrics", s.root));
                r
            })
            .collect(),
        vec![replica("large", &sims[0].url, "sim-small")],
    );
    c.upstream.replica_choice = ReplicaChoice::AffinityGate;
    c.upstream.scrape_interval_ms = 100;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let r = app.chat(turn(0, 0)).await;
    let home = header(&r, "x-gateway-replica");
    let _ = r.text().await;
    let index: usize = home.trim_start_matches("small-").parse().unwrap();
    // Other clients (another gateway, say) queue 40 requests on that server directly: this
    // gateway has nothing in flight there, only the server's metrics show it.
    let http = reqwest::Client::new();
    let url = format!("{}/chat/completions", sims[index].url);
    let mut others = Vec::new();
    for _ in 0..40 {
        let (http, url) = (http.clone(), url.clone());
        others.push(tokio::spawn(async move {
            let body =
                json!({"model": "sim-small", "messages": [{"role": "user", "content": "x"}]});
            let _ = http.post(url).json(&body).send().await;
        }));
    }
    e2e::eventually(
        "the next turn avoids the busy server",
        std::time::Duration::from_secs(10),
        || {
            let app = &app;
            let home = home.clone();
            async move {
                let r = app.chat(turn(0, 1)).await;
                let how = header(&r, "x-gateway-replica-choice");
                let at = header(&r, "x-gateway-replica");
                let _ = r.text().await;
                (at != home && how.starts_with("reason=imbalanced")).then_some(())
            }
        },
    )
    .await;
    for o in others {
        o.abort();
    }
    app.stop().await;
}

/// The simulators' prefix-cache hit rate (cached prompt tokens / prompt tokens).
async fn hit_rate(sims: &[Sim]) -> f64 {
    let (mut queries, mut hits) = (0.0, 0.0);
    for s in sims {
        let v: Value = reqwest::get(format!("{}/sim/stats", s.root))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        queries += v["prefix_cache_queries"].as_f64().unwrap();
        hits += v["prefix_cache_hits"].as_f64().unwrap();
    }
    hits / queries.max(1.0)
}

/// 10 system prompts x 3 conversations x 4 turns, conversation `i` through gateway `i % n`,
/// on three fresh simulators; returns their prefix-cache hit rate.
async fn shared_prefix_workload(choice: ReplicaChoice, gateways: usize) -> f64 {
    let sims = three_sims().await;
    let mut apps = Vec::new();
    for _ in 0..gateways {
        apps.push(TestApp::spawn(on(&sims, choice), StoreKind::Sqlite).await);
    }
    let mut conversation = 0;
    for family in 0..10 {
        for _ in 0..3 {
            let app = &apps[conversation % gateways];
            for turns in 0..4 {
                let mut body = turn(family, turns);
                body["messages"][1]["content"] = json!(format!("conversation {conversation}"));
                let r = app.chat(body).await;
                assert_eq!(r.status(), 200);
                let _ = r.text().await;
            }
            conversation += 1;
        }
    }
    for app in apps {
        app.stop().await;
    }
    hit_rate(&sims).await
}

#[tokio::test]
async fn three_gateways_sharing_nothing_reuse_prefixes_nearly_as_well_as_one() {
    let default = gateway::config::UpstreamConfig::default().replica_choice;
    assert_eq!(default, ReplicaChoice::AffinityWeighted);
    let one = shared_prefix_workload(default, 1).await;
    let three = shared_prefix_workload(default, 3).await;
    let least_loaded = shared_prefix_workload(ReplicaChoice::LeastLoaded, 3).await;
    eprintln!(
        "prefix-cache hit rate: one gateway {one:.3}, three {three:.3}, three least-loaded \
         {least_loaded:.3}"
    );
    assert!(
        three >= one * 0.9,
        "three gateways within 10% of one: {three:.3} vs {one:.3}"
    );
    assert!(
        three > least_loaded + 0.1,
        "affinity reuses more than least-loaded: {three:.3} vs {least_loaded:.3}"
    );
}

#[tokio::test]
async fn round_robin_takes_each_replica_in_turn() {
    let (app, _sims) = app(ReplicaChoice::RoundRobin).await;
    let mut seen = Vec::new();
    for _ in 0..6 {
        let r = app.chat(turn(0, 0)).await;
        assert_eq!(
            header(&r, "x-gateway-replica-choice"),
            "",
            "no affinity said"
        );
        seen.push(header(&r, "x-gateway-replica"));
        let _ = r.text().await;
    }
    assert_eq!(seen[..3], seen[3..], "a fixed rotation: {seen:?}");
    let distinct: std::collections::BTreeSet<&String> = seen.iter().collect();
    assert_eq!(distinct.len(), 3, "every replica in turn: {seen:?}");
    app.stop().await;
}
