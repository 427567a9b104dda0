//! `gateway demo`, the real binary, answers the official Python SDK (chat, streaming, models,
//! embeddings, auth errors) with the key it printed.

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
    let mut demo = tokio::process::Command::new(e2e::binary("gateway"))
        .args(["demo", "--port", &port.to_string(), "--store"])
        .arg(format!("sqlite://{}", dir.path().join("demo.db").display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(demo.stdout.take().unwrap()).lines();
    let mut key = None;
    let mut admin = None;
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("API key") {
                key = line.split_whitespace().last().map(str::to_owned);
            }
            if let Some(rest) = line.split("GATEWAY_ADMIN_TOKEN=").nth(1) {
                admin = rest.split_whitespace().next().map(str::to_owned);
            }
            if line.starts_with("Serving on") {
                return;
            }
        }
    })
    .await;
    assert!(found.is_ok(), "the demo printed its banner");
    let key = key.expect("the demo printed an API key");
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
}
