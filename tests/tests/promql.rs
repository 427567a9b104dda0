//! The operations dashboard's PromQL, evaluated by a real Prometheus (Debian's `prometheus`
//! package) scraping a gateway under test traffic: every panel expression and template variable
//! must parse and return data. Nothing here re-implements PromQL.
//!
//! The gateway serves chat (streamed and not), cache hits, failovers, an unknown model, a budget
//! and an agent loop while Prometheus scrapes `/metrics` every second; then each expression of
//! `dashboards/grafana/operations.json` is sent to Prometheus's HTTP query API with the Grafana
//! variables expanded as Grafana would (`$tier`, `$replica` as the regex of every value their
//! `label_values` query finds; `$__rate_interval` as four scrape intervals and more).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use e2e::grafana::*;
use e2e::{chat_body, config, free_port, replica, Sim, TestApp};
use serde_json::{json, Value};

/// Prometheus scrapes this often (its flag takes the same text).
const SCRAPE: &str = "1s";
/// What `$__rate_interval` becomes: Grafana's max(interval + scrape, 4 × scrape), with room.
const RATE_INTERVAL: &str = "15s";

fn prometheus() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|d| d.join("prometheus"))
        .chain([PathBuf::from("/usr/bin/prometheus")])
        .find(|p| p.is_file());
    on_path.expect(
        "prometheus is not installed: the dashboard check needs the real one \
         (apt-get install prometheus; scripts/test.sh installs it)",
    )
}

/// A Prometheus server scraping one target, killed on drop.
struct Prometheus {
    base: String,
    child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(target: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: {SCRAPE}\n  evaluation_interval: {SCRAPE}\n\
                 scrape_configs:\n  - job_name: gateway\n    static_configs:\n      \
                 - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let child = tokio::process::Command::new(prometheus())
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("prometheus starts");
        let p = Self {
            base: format!("http://127.0.0.1:{port}"),
            child,
            _dir: dir,
        };
        e2e::eventually("prometheus is ready", Duration::from_secs(30), || {
            let url = format!("{}/-/ready", p.base);
            async move {
                let r = reqwest::get(url).await.ok()?;
                r.status().is_success().then_some(())
            }
        })
        .await;
        p
    }

    /// `GET /api/v1/<path>` with `params`; the `data` of a successful answer, else the error.
    async fn api(&self, path: &str, params: &[(&str, &str)]) -> Result<Value, String> {
        let r = reqwest::Client::new()
            .get(format!("{}/api/v1/{path}", self.base))
            .query(params)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let v: Value = r.json().await.map_err(|e| e.to_string())?;
        if v["status"] == "success" {
            Ok(v["data"].clone())
        } else {
            Err(format!("{}: {}", v["errorType"], v["error"]))
        }
    }
}

/// One round of traffic touching every part of the pipeline the dashboard shows.
async fn traffic(app: &TestApp, small: &[Sim], large: &Sim, round: usize) {
    let mut streamed = chat_body("fast", "hi");
    streamed["stream"] = json!(true);
    let _ = app.chat(streamed).await.text().await;
    let _ = app.chat(chat_body("smart", "hello")).await.text().await;
    let _ = app
        .chat(chat_body("auto", "What is 2 + 2?"))
        .await
        .text()
        .await;
    let _ = app.chat(chat_body("nope", "hi")).await.text().await;
    // A failed replica: the gateway fails over (or answers an error when both fail).
    small[round % 2].faults(json!({"fail_next": 1})).await;
    let _ = app.chat(chat_body("fast", "hi")).await.text().await;
    if round.is_multiple_of(3) {
        for s in small {
            s.faults(json!({"fail_next": 1})).await;
        }
        let _ = app.chat(chat_body("fast", "both down")).await.text().await;
        // The model server refuses the request (a 400 is passed through, not failed over): an
        // error answered by a tier, for the error-ratio panels (`status!~"2.."`).
        large.faults(json!({"fail_next": 1, "status": 400})).await;
        let _ = app.chat(chat_body("smart", "refused")).await.text().await;
    }
    // A repeated deterministic request: a cache miss, then hits.
    let mut repeat = chat_body("fast", &format!("again {}", round % 2));
    repeat["temperature"] = json!(0);
    for _ in 0..2 {
        let _ = app.chat(repeat.clone()).await.text().await;
    }
    // An agent loop, which the guard flags.
    let _ = app.chat(e2e::looping_chat()).await.text().await;
}

/// Grafana's value of a multi-value variable with every value selected, as a regex.
fn all_values(values: &Value) -> String {
    let v: Vec<String> = values
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(regex_escape)
        .collect();
    format!("({})", v.join("|"))
}

fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            if "\\.+*?()|[]{}^$".contains(c) {
                vec!['\\', c]
            } else {
                vec![c]
            }
        })
        .collect()
}

/// `label_values(selector, label)` (Grafana's variable query): the selector and the label.
fn label_values(query: &str) -> (String, String) {
    let inner = query
        .trim()
        .strip_prefix("label_values(")
        .and_then(|q| q.strip_suffix(')'))
        .unwrap_or_else(|| panic!("unsupported variable query {query:?}"));
    let (selector, label) = inner
        .rsplit_once(',')
        .expect("label_values(selector, label)");
    (selector.trim().to_owned(), label.trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operations_panel_query_parses_and_returns_data_in_prometheus() {
    let small = vec![Sim::zero("sim-small").await, Sim::zero("sim-small").await];
    let large = Sim::zero("sim-large").await;
    let mut cfg = config(
        vec![
            replica("small-1", &small[0].url, "sim-small"),
            replica("small-2", &small[1].url, "sim-small"),
        ],
        vec![replica("large-1", &large.url, "sim-large")],
    );
    // The semantic layer loaded, for its panels (lookup latency, the model's device and
    // precision).
    cfg.cache.semantic.model_dir = e2e::model_dir();
    cfg.cache.semantic.preload = true;
    let app = TestApp::spawn(cfg, e2e::StoreKind::Sqlite).await;
    let r = app
        .admin(
            reqwest::Method::POST,
            "budgets",
            Some(json!({"tenant": "acme", "window": "day", "limit_tokens": 1000000})),
        )
        .await;
    assert_eq!(r.status(), 201);
    app.semantic_ready().await;
    let target = app.base.trim_start_matches("http://").to_owned();
    let mut prom = Prometheus::start(&target).await;

    // Traffic for a while, so every counter has samples a rate can be taken over.
    let start = Instant::now();
    let mut round = 0;
    while start.elapsed() < Duration::from_secs(8) {
        traffic(&app, &small, &large, round).await;
        round += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    e2e::eventually(
        "prometheus scraped the gateway several times",
        Duration::from_secs(30),
        || {
            let prom = &prom;
            async move {
                let q = format!("count_over_time(up{{job=\"gateway\"}}[{RATE_INTERVAL}])");
                let d = prom.api("query", &[("query", &q)]).await.ok()?;
                let n: f64 = d["result"][0]["value"][1].as_str()?.parse().ok()?;
                (n >= 6.0).then_some(())
            }
        },
    )
    .await;
    let up = prom.api("query", &[("query", "up")]).await.unwrap();
    assert_eq!(
        up["result"][0]["value"][1], "1",
        "the scrape succeeds: {up}"
    );

    let path = std::path::Path::new(DASHBOARD_DIR).join(OPERATIONS);
    let dashboard = parse(&path);
    let mut failures = Vec::new();

    // Template variables first: their values are what the panels' `$tier`, `$replica` expand to.
    let mut vars: Vec<(String, String)> = Vec::new();
    for var in query_variables(&dashboard) {
        let name = var["name"].as_str().unwrap().to_owned();
        let mut query = variable_query(var).expect("variable query").to_owned();
        for (n, v) in &vars {
            query = query.replace(&format!("${n}"), v);
        }
        let (selector, label) = label_values(&query);
        match prom
            .api(&format!("label/{label}/values"), &[("match[]", &selector)])
            .await
        {
            Ok(values) if values.as_array().is_some_and(|v| !v.is_empty()) => {
                vars.push((name, all_values(&values)));
            }
            Ok(values) => {
                failures.push(format!("variable {name}: {query} found nothing ({values})"))
            }
            Err(e) => failures.push(format!("variable {name}: {query}: {e}")),
        }
    }
    vars.push(("__rate_interval".to_owned(), RATE_INTERVAL.to_owned()));
    // Longest names first, so `$tier` does not eat the start of a longer one.
    vars.sort_by_key(|(n, _)| std::cmp::Reverse(n.len()));

    // The panels' expressions (the variables' `label_values` queries were run above).
    let exprs: Vec<String> = queries(&dashboard, Kind::Prometheus)
        .into_iter()
        .filter(|q| !q.trim_start().starts_with("label_values("))
        .collect();
    assert!(exprs.len() >= 20, "only {} queries found", exprs.len());
    for expr in &exprs {
        let mut q = expr.clone();
        for (n, v) in &vars {
            q = q
                .replace(&format!("${{{n}}}"), v)
                .replace(&format!("${n}"), v);
        }
        assert!(!q.contains('$'), "an unexpanded variable in {q}");
        match prom.api("query", &[("query", &q)]).await {
            Ok(d) if d["result"].as_array().is_some_and(|r| !r.is_empty()) => {}
            Ok(d) => failures.push(format!("no data: {q}\n  ({d})")),
            Err(e) => failures.push(format!("does not parse or run: {q}\n  {e}")),
        }
    }
    let _ = prom.child.kill().await;
    assert!(
        failures.is_empty(),
        "{} of {} operations-dashboard queries fail in Prometheus:\n{}",
        failures.len(),
        exprs.len(),
        failures.join("\n")
    );
}
