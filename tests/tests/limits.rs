//! Connection-level limits against hostile clients: header trickling (slowloris), body
//! trickling and the connection cap, on raw TCP sockets against a real listener.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::time::{Duration, Instant};

use e2e::{chat_body, config, eventually, replica, Sim, StoreKind, TestApp};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn app_with(tweak: impl FnOnce(&mut gateway::config::ServerConfig)) -> (TestApp, Sim) {
    let sim = Sim::zero("sim-small").await;
    let mut c = config(
        vec![replica("s1", &sim.url, "sim-small")],
        vec![replica("l1", &sim.url, "sim-small")],
    );
    tweak(&mut c.server);
    (TestApp::spawn(c, StoreKind::Sqlite).await, sim)
}

fn addr(app: &TestApp) -> String {
    app.base.trim_start_matches("http://").to_owned()
}

/// Read until the peer closes (or `limit` passes); returns what was read and whether it closed.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (got, true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (got, false),
        }
    }
}

#[tokio::test]
async fn a_client_trickling_its_headers_is_disconnected_at_the_header_deadline() {
    let (app, _sim) = app_with(|s| s.header_read_timeout_ms = 600).await;
    let mut slow = TcpStream::connect(addr(&app)).await.unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    // One header byte every 150 ms: each write is well inside any per-read idle timeout, so
    // only a deadline on the whole header ends this.
    let trickle = async {
        for _ in 0..40 {
            if slow.write_all(b"x").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
            let mut probe = [0u8; 1];
            if let Ok(Ok(0)) =
                tokio::time::timeout(Duration::from_millis(1), slow.peek(&mut probe)).await
            {
                break;
            }
        }
    };
    trickle.await;
    let (_, closed) = read_until_closed(&mut slow, Duration::from_secs(2)).await;
    let held = started.elapsed();
    assert!(closed, "the trickling connection is still open");
    assert!(
        held < Duration::from_secs(3),
        "the trickling connection was held {held:?} with a 600 ms header deadline"
    );
    // The gateway still serves everyone else.
    let resp = app.chat(chat_body("fast", "hello")).await;
    assert_eq!(resp.status(), 200);
    app.stop().await;
}

#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_gets_an_openai_shaped_408() {
    let (app, _sim) = app_with(|s| s.body_read_timeout_ms = 500).await;
    let mut slow = TcpStream::connect(addr(&app)).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\n\
         content-type: application/json\r\ncontent-length: 4000\r\n\r\n{{\"model\":",
        app.api_key
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    for _ in 0..30 {
        let _ = slow.write_all(b" ").await;
        let (got, closed) = read_until_closed(&mut slow, Duration::from_millis(100)).await;
        answer.extend_from_slice(&got);
        if closed || !answer.is_empty() {
            break;
        }
    }
    let (rest, _) = read_until_closed(&mut slow, Duration::from_millis(500)).await;
    answer.extend_from_slice(&rest);
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.starts_with("HTTP/1.1 408"),
        "expected a 408 after {:?}, got: {text}",
        started.elapsed()
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    let body: Value = serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "request_timeout");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("server.body_read_timeout_ms"));
    app.stop().await;
}

#[tokio::test]
async fn at_the_connection_cap_new_connections_wait_until_one_closes() {
    let (app, _sim) = app_with(|s| s.max_connections = 3).await;
    // Three idle connections take every slot.
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(TcpStream::connect(addr(&app)).await.unwrap());
    }
    // Let the listener accept all three before the next one comes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(700))
        .build()
        .unwrap();
    let url = format!("{}/healthz", app.base);
    assert!(
        client.get(&url).send().await.is_err(),
        "a fourth connection was served with max_connections = 3"
    );
    drop(idle.pop());
    eventually(
        "a slot frees when a connection closes",
        Duration::from_secs(5),
        || {
            let client = client.clone();
            let url = url.clone();
            async move {
                client
                    .get(&url)
                    .send()
                    .await
                    .ok()
                    .filter(|r| r.status() == 200)
                    .map(|_| ())
            }
        },
    )
    .await;
    drop(idle);
    app.stop().await;
}
