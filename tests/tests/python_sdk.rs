//! The official `openai` Python SDK against a real gateway (see `tests/python/sdk_check.py`).
//! `scripts/test.sh` installs the SDK; without it this test fails rather than skips.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use e2e::{config, replica, Sim, StoreKind, TestApp};

#[tokio::test]
async fn the_python_sdk_runs_chat_streaming_models_embeddings_and_sees_auth_errors() {
    let small = Sim::zero("sim-small").await;
    let large = Sim::zero("sim-large").await;
    let c = config(
        vec![replica("s", &small.url, "sim-small")],
        vec![replica("l", &large.url, "sim-large")],
    );
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/sdk_check.py");
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .env("GATEWAY_BASE_URL", format!("{}/v1", app.base))
        .env("GATEWAY_API_KEY", &app.api_key)
        .output()
        .await
        .expect("python3 runs");
    let text = e2e::output_text(&out);
    assert!(out.status.success(), "python SDK checks failed:\n{text}");
    assert!(text.contains("all checks passed"), "{text}");
}
