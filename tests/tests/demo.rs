//! `gateway demo`, the real binary, answers the official Python SDK (chat, streaming, models,
//! embeddings, auth errors) with the key it printed, and opens on a labelled synthetic fortnight
//! whose cost change its dashboard and `gatewayctl report explain` (run as printed) explain.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

#[tokio::test]
async fn gateway_demo_serves_the_python_sdk_with_the_key_it_prints() {
    gateway::telemetry::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let db = dir.path().join("demo.db");
    let mut demo = spawn_demo(port, &db);
    let banner = read_banner(&mut demo).await;
    let key = banner.key.clone().expect("the demo printed an API key");
    let admin = banner.admin.clone();
    assert!(key.starts_with("sk-gw-"));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/sdk_check.py");
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .env("GATEWAY_BASE_URL", format!("http://127.0.0.1:{port}/v1"))
        .env("GATEWAY_API_KEY", &key)
        .output()
        .await
        .unwrap();
    let text = e2e::output_text(&out);
    assert!(
        out.status.success(),
        "python SDK against gateway demo:\n{text}"
    );
    // The simulated models are priced: what the SDK just did costs something this week.
    let admin = admin.expect("the demo printed the admin token");
    let first_synthetic = check_history(port, &admin, &banner).await;
    let http = reqwest::Client::new();
    let report = format!("http://127.0.0.1:{port}/admin/v1/reports/weekly");
    e2e::eventually(
        "the week's cost is above zero",
        Duration::from_secs(10),
        || {
            let (http, report, admin) = (http.clone(), report.clone(), admin.clone());
            async move {
                let v: serde_json::Value = http
                    .get(&report)
                    .bearer_auth(&admin)
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                (v["total"]["this"]["cost"].as_i64()? > 0).then_some(())
            }
        },
    )
    .await;
    demo.kill().await.unwrap();
    let _ = demo.wait().await;

    // A second launch on the same database seeds nothing more, and says the history is there;
    // with --traffic, live requests of the three features arrive on their own.
    let mut again = spawn_demo_with(port, &db, &["--traffic"]);
    let second = read_banner(&mut again).await;
    assert!(
        second
            .text
            .contains("SYNTHETIC fortnight an earlier launch seeded"),
        "{}",
        second.text
    );
    let admin = second.admin.clone().unwrap();
    let explained = explain(port, &admin, &second.explain_weeks.clone().unwrap()).await;
    assert_eq!(
        explained["synthetic_requests"], first_synthetic,
        "no row seeded twice"
    );
    e2e::eventually(
        "--traffic sends requests of every feature",
        Duration::from_secs(30),
        || {
            let admin = admin.clone();
            async move {
                let w = admin_get(port, &admin, "reports/weekly").await;
                let features: Vec<&str> = w["by"]["feature"]
                    .as_array()?
                    .iter()
                    .filter(|l| l["this"]["requests"].as_i64() > Some(0))
                    .filter_map(|l| l["key"].as_str())
                    .collect();
                ["chat", "search", "support-bot"]
                    .iter()
                    .all(|f| features.contains(f))
                    .then_some(())
            }
        },
    )
    .await;
    again.kill().await.unwrap();
}

/// What the demo printed up to `Serving on`.
#[derive(Debug, Clone, Default)]
struct Banner {
    text: String,
    key: Option<String>,
    admin: Option<String>,
    /// The dashboard link's week.
    dashboard_week: Option<String>,
    /// The printed `report explain --from A --to B`.
    explain_weeks: Option<(String, String)>,
    /// The printed gatewayctl explain line's environment and arguments.
    explain_line: Option<CommandLine>,
}

/// A printed shell line: its `NAME=value` environment, then the words after `--`.
type CommandLine = (Vec<(String, String)>, Vec<String>);

fn spawn_demo(port: u16, db: &std::path::Path) -> tokio::process::Child {
    spawn_demo_with(port, db, &[])
}

fn spawn_demo_with(port: u16, db: &std::path::Path, extra: &[&str]) -> tokio::process::Child {
    tokio::process::Command::new(e2e::binary("gateway"))
        .args(["demo", "--port", &port.to_string(), "--store"])
        .arg(format!("sqlite://{}", db.display()))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

async fn read_banner(demo: &mut tokio::process::Child) -> Banner {
    let mut lines = BufReader::new(demo.stdout.take().unwrap()).lines();
    let mut b = Banner::default();
    let found = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            b.text.push_str(&line);
            b.text.push('\n');
            if line.contains("API key") {
                b.key = line.split_whitespace().last().map(str::to_owned);
            }
            if let Some(rest) = line.split("GATEWAY_ADMIN_TOKEN=").nth(1) {
                b.admin = rest.split_whitespace().next().map(str::to_owned);
            }
            if let Some(rest) = line.split("/dashboard?week=").nth(1) {
                b.dashboard_week = Some(rest.trim().to_owned());
            }
            if line.contains("report explain --from") {
                let words: Vec<&str> = line.split_whitespace().collect();
                let after = |flag: &str| {
                    let i = words.iter().position(|w| *w == flag).unwrap();
                    words[i + 1].to_owned()
                };
                b.explain_weeks = Some((after("--from"), after("--to")));
                let env = words
                    .iter()
                    .take_while(|w| w.contains('='))
                    .map(|w| {
                        let (k, v) = w.split_once('=').unwrap();
                        (k.to_owned(), v.to_owned())
                    })
                    .collect();
                let dashdash = words.iter().position(|w| *w == "--").unwrap();
                let args = words[dashdash + 1..]
                    .iter()
                    .map(|w| (*w).to_owned())
                    .collect();
                b.explain_line = Some((env, args));
            }
            if line.starts_with("Serving on") {
                return;
            }
        }
    })
    .await;
    assert!(found.is_ok(), "the demo printed its banner:\n{}", b.text);
    // Keep reading what the demo prints after its banner: a closed pipe would make its next
    // print fail (a `println!` on a closed stdout panics), which is not what a terminal does.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    b
}

/// `GET /admin/v1/<path>` of the demo, as JSON. A connection that fails is tried again for a few
/// seconds; any answer is returned as is.
async fn admin_get(port: u16, admin: &str, path: &str) -> serde_json::Value {
    let url = format!("http://127.0.0.1:{port}/admin/v1/{path}");
    let mut tries = 0;
    loop {
        match reqwest::Client::new()
            .get(&url)
            .bearer_auth(admin)
            .send()
            .await
        {
            Ok(r) => return r.json().await.unwrap(),
            Err(e) if tries < 10 => {
                eprintln!("{url}: {e}; trying again");
                tries += 1;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("{url}: {e}"),
        }
    }
}

async fn explain(port: u16, admin: &str, (from, to): &(String, String)) -> serde_json::Value {
    admin_get(port, admin, &format!("reports/explain?from={from}&to={to}")).await
}

fn term(e: &serde_json::Value, name: &str) -> i64 {
    e["terms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["term"] == name)
        .unwrap_or_else(|| panic!("no term {name:?} in {e}"))["micros"]
        .as_i64()
        .unwrap()
}

/// The seeded fortnight tells the story it was built to: the bill roughly doubles, mostly
/// through longer prompts, with more traffic, more large-tier calls, fewer cache hits, a loop
/// and a retry storm; the page and the CLI say so, and mark the rows as demo data.
async fn check_history(port: u16, admin: &str, banner: &Banner) -> serde_json::Value {
    let weeks = banner
        .explain_weeks
        .clone()
        .expect("the demo printed an explain line");
    assert_eq!(
        banner.dashboard_week.as_ref(),
        Some(&weeks.1),
        "{}",
        banner.text
    );
    let e = explain(port, admin, &weeks).await;
    let (from, to) = (
        e["from_micros"].as_i64().unwrap(),
        e["to_micros"].as_i64().unwrap(),
    );
    let ratio = to as f64 / from as f64;
    assert!(from > 5_000_000, "the earlier week costs dollars: {e}");
    assert!(
        (1.8..=2.4).contains(&ratio),
        "the bill roughly doubles: {ratio:.2}\n{e}"
    );
    assert!(e["synthetic_requests"].as_i64().unwrap() > 10_000, "{e}");
    let prompt = term(&e, "prompt length");
    for (name, min) in [
        ("traffic volume", 1),
        ("model/tier mix", 1),
        ("cache hit rate", 1),
        ("waste: agent loops", 1_000_000),
        ("waste: retry storms", 1),
    ] {
        let v = term(&e, name);
        assert!(v >= min, "{name} is {v}: {e}");
        assert!(
            prompt > v,
            "longer prompts are the largest cause, not {name}: {e}"
        );
    }
    assert!(
        prompt * 3 > to - from,
        "longer prompts explain a large part of the change: {e}"
    );
    // The feature that did it leads the contributors.
    assert_eq!(e["top"]["feature"][0]["key"], "search", "{e}");

    // The weekly report: traffic up about a fifth, the loop found, the rows marked.
    let w = admin_get(port, admin, &format!("reports/weekly?week={}", weeks.1)).await;
    let (a, b) = (
        w["total"]["previous"]["requests"].as_f64().unwrap(),
        w["total"]["this"]["requests"].as_f64().unwrap(),
    );
    assert!((1.15..=1.25).contains(&(b / a)), "traffic +20%: {a} -> {b}");
    assert!(
        w["loops"]["total"]["loops"].as_i64().unwrap() >= 1,
        "{}",
        w["loops"]
    );
    assert_eq!(w["daily"].as_array().unwrap().len(), 7);

    // The dashboard at the printed week says it is demo data and shows the same change.
    let page = reqwest::Client::new()
        .get(format!(
            "http://127.0.0.1:{port}/dashboard?week={}",
            weeks.1
        ))
        .bearer_auth(admin)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("id=\"demo-data\""),
        "the page marks demo data"
    );
    assert!(
        page.contains(&format!("data-cost-micros=\"{}\"", to - from)),
        "the page shows the explained change"
    );

    // The printed gatewayctl line works as printed (its binary, its environment, its words).
    let (env, args) = banner.explain_line.clone().unwrap();
    assert_eq!(args.first().map(String::as_str), Some("report"), "{args:?}");
    let out = tokio::process::Command::new(e2e::binary("gatewayctl"))
        .args(&args)
        .envs(env)
        .output()
        .await
        .unwrap();
    let text = e2e::output_text(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("DEMO DATA"), "{text}");
    assert!(text.contains("prompt length"), "{text}");
    e["synthetic_requests"].clone()
}
