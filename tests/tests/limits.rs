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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_are_tokenized_off_the_async_workers() {
    use wiremock::matchers::method;
    use wiremock::{Mock, MockServer, ResponseTemplate};
    let up = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_json(serde_json::json!({
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})))
        .mount(&up)
        .await;
    let url = format!("{}/v1", up.uri());
    let mut c = config(vec![replica("s", &url, "m")], vec![replica("l", &url, "m")]);
    c.server.max_body_bytes = 8 * 1024 * 1024;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    // A budget, so every request's prompt is counted before it is admitted.
    let r = app
        .admin(
            reqwest::Method::POST,
            "budgets",
            Some(serde_json::json!({"tenant": "acme", "window": "day",
                                    "limit_tokens": 1_000_000_000u64})),
        )
        .await;
    assert_eq!(r.status(), 201);
    // ~2 MiB of made-up words each: each needs real BPE merges (unlike common words, which are
    // one vocabulary lookup), as the hostile prompts that stalled the probes did. Eight
    // different ones: a text counted once is remembered, so a repeated prompt costs nothing.
    let prompts: Vec<String> = (0..8u64)
        .map(|seed| {
            let mut x: u64 = 42 + seed;
            (0..300_000)
                .map(|_| {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    format!("{:x} ", x >> 36)
                })
                .collect()
        })
        .collect();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = {
        let (http, url) = (app.http.clone(), format!("{}/healthz", app.base));
        let done = done.clone();
        tokio::spawn(async move {
            let mut worst = Duration::ZERO;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let t = Instant::now();
                assert_eq!(http.get(&url).send().await.unwrap().status(), 200);
                worst = worst.max(t.elapsed());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            worst
        })
    };
    let started = Instant::now();
    let answers =
        futures_util::future::join_all(prompts.iter().map(|p| app.chat(chat_body("fast", p))))
            .await;
    assert!(answers.iter().all(|r| r.status() == 200));
    let took = started.elapsed();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let worst = probe.await.unwrap();
    // Counted on the two async workers, the eight prompts held /healthz for ~1 s; off them it
    // answers within milliseconds: parsing, fingerprinting and the derived session's hash of
    // a large body run off them too (the test's own client encodes the bodies on the same
    // workers).
    assert!(
        worst < Duration::from_millis(500),
        "/healthz took up to {worst:?} while eight long prompts were counted ({took:?})"
    );
    app.stop().await;
}

/// An oversized header section is refused with 431: in OpenAI shape past 32 KiB; past 100
/// fields by hyper itself, without a body (its cap, kept at the default so that its header
/// arrays stay on the stack), and that connection closed; requests within the limits are
/// served.
#[tokio::test]
async fn oversized_header_sections_get_a_431() {
    let (app, _sim) = app_with(|_| {}).await;
    let url = format!("{}/v1/chat/completions", app.base);
    // A chat request with `n` extra header fields of `len` bytes each.
    let send = |n: usize, len: usize| {
        (0..n)
            .fold(app.http.post(&url), |r, i| {
                r.header(format!("x-h{i}"), "v".repeat(len))
            })
            .bearer_auth(&app.api_key)
            .json(&chat_body("fast", "hi"))
            .send()
    };
    let big = send(1, 40 * 1024).await.unwrap();
    assert_eq!(big.status(), 431);
    let v: Value = big.json().await.unwrap();
    assert_eq!(v["error"]["code"], "request_header_fields_too_large", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("bytes"),
        "{v}"
    );
    assert_eq!(send(150, 1).await.unwrap().status(), 431);
    assert_eq!(send(90, 1).await.unwrap().status(), 200);
    assert_eq!(app.chat(chat_body("fast", "hi")).await.status(), 200);
    app.stop().await;
}
