//! The OpenAI-compatible surface end to end: a real client (`async-openai`) and raw HTTP against
//! a gateway in front of simulated model servers and `wiremock` upstreams.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::time::Duration;

use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, ChatCompletionStreamOptions,
    CreateChatCompletionRequestArgs,
};
use async_openai::types::completions::CreateCompletionRequestArgs;
use async_openai::types::embeddings::CreateEmbeddingRequestArgs;
use e2e::{chat_body, config, eventually, replica, Sim, StoreKind, TestApp};
use futures_util::StreamExt;
use gateway::simulator::{SimOptions, SimProfile};
use gateway::usage::UsageSource;
use serde_json::{json, Value};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

struct Setup {
    app: TestApp,
    small: Vec<Sim>,
    large: Sim,
}

async fn setup_with(
    kind: StoreKind,
    small_opts: SimOptions,
    tweak: impl FnOnce(&mut gateway::Config),
) -> Setup {
    let s1 = Sim::start(small_opts.clone()).await;
    let s2 = Sim::start(small_opts).await;
    let large = Sim::zero("sim-large").await;
    let mut c = config(
        vec![
            replica("s1", &s1.url, "sim-small"),
            replica("s2", &s2.url, "sim-small"),
        ],
        vec![replica("l1", &large.url, "sim-large")],
    );
    tweak(&mut c);
    let app = TestApp::spawn(c, kind).await;
    Setup {
        app,
        small: vec![s1, s2],
        large,
    }
}

fn zero_small() -> SimOptions {
    let mut p = SimProfile::zero();
    p.model = "sim-small".into();
    SimOptions::new(p)
}

async fn setup() -> Setup {
    setup_with(StoreKind::Sqlite, zero_small(), |_| {}).await
}

fn user(text: &str) -> async_openai::types::chat::ChatCompletionRequestMessage {
    ChatCompletionRequestUserMessageArgs::default()
        .content(text)
        .build()
        .unwrap()
        .into()
}

#[tokio::test]
async fn chat_completion_through_the_sdk_is_answered_and_settled_on_both_stores() {
    for kind in e2e::BOTH {
        let mut s = setup_with(kind, zero_small(), |_| {}).await;
        let client = s.app.openai(&s.app.api_key);
        let req = CreateChatCompletionRequestArgs::default()
            .model("fast")
            .messages(vec![user("What is a gateway?")])
            .max_completion_tokens(5u32)
            .build()
            .unwrap();
        let resp = client.chat().create(req).await.unwrap();
        assert!(!resp.choices[0].message.content.clone().unwrap().is_empty());
        let usage = resp.usage.unwrap();
        assert_eq!(usage.completion_tokens, 5);
        let e = s.app.next_event().await;
        assert_eq!(e.tenant_name, "acme");
        assert_eq!(e.key_id, s.app.key_id);
        assert_eq!(e.tags["feature"], "tests");
        assert_eq!(e.requested_model, "fast");
        assert_eq!(e.served_model.as_deref(), Some("sim-small"));
        assert_eq!(e.tier.as_deref(), Some("small"));
        assert!(matches!(e.replica.as_deref(), Some("s1" | "s2")));
        assert_eq!(
            (e.prompt_tokens, e.completion_tokens),
            (u64::from(usage.prompt_tokens), 5)
        );
        assert_eq!(e.usage_source, UsageSource::Upstream);
        assert_eq!(e.status, 200);
        assert!(!e.stream);
        s.app.stop().await;
    }
}

#[tokio::test]
async fn streamed_chat_passes_chunks_and_hides_the_usage_chunk_unless_asked() {
    let mut s = setup().await;
    let client = s.app.openai(&s.app.api_key);
    for ask in [false, true] {
        let mut req = CreateChatCompletionRequestArgs::default();
        req.model("smart")
            .messages(vec![user("stream please")])
            .max_completion_tokens(6u32)
            .stream(true);
        if ask {
            req.stream_options(ChatCompletionStreamOptions {
                include_usage: Some(true),
                include_obfuscation: None,
            });
        }
        let mut stream = client
            .chat()
            .create_stream(req.build().unwrap())
            .await
            .unwrap();
        let (mut text, mut usage_chunks) = (String::new(), 0);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.unwrap();
            if chunk.usage.is_some() {
                usage_chunks += 1;
                assert!(chunk.choices.is_empty());
            }
            for c in chunk.choices {
                text.push_str(c.delta.content.as_deref().unwrap_or(""));
            }
        }
        assert!(!text.is_empty());
        assert_eq!(
            usage_chunks,
            usize::from(ask),
            "usage chunk only when the client asked"
        );
        let e = s.app.next_event().await;
        assert!(e.stream);
        assert_eq!(e.tier.as_deref(), Some("large"));
        assert_eq!(e.completion_tokens, 6);
        assert_eq!(
            e.usage_source,
            UsageSource::Upstream,
            "the gateway asked upstream for usage"
        );
        assert!(e.ttft_ms.is_some());
    }
    let _ = &s.large;
}

#[tokio::test]
async fn upstreams_without_usage_are_counted_with_the_tokenizer() {
    let mut opts = zero_small();
    opts.report_usage = false;
    let mut s = setup_with(StoreKind::Sqlite, opts, |_| {}).await;
    for stream in [false, true] {
        let mut body = chat_body("fast", "count me");
        body["max_tokens"] = json!(7);
        body["stream"] = json!(stream);
        let resp = s.app.chat(body).await;
        assert_eq!(resp.status(), 200);
        let text = resp.text().await.unwrap();
        assert!(
            !text.contains("\"usage\":{"),
            "no usage invented in the response"
        );
        let e = s.app.next_event().await;
        assert_eq!(e.usage_source, UsageSource::Tokenizer);
        assert_eq!(e.completion_tokens, 7, "seven one-token words, counted");
        // 3 primer + 4 per message + "user" (1) + "count me" (2)
        assert_eq!(e.prompt_tokens, 10);
    }
}

#[tokio::test]
async fn completions_embeddings_and_models_work_through_the_sdk() {
    let mut s = setup().await;
    let client = s.app.openai(&s.app.api_key);
    let c = client
        .completions()
        .create(
            CreateCompletionRequestArgs::default()
                .model("fast")
                .prompt("Once upon")
                .max_tokens(4u32)
                .build()
                .unwrap(),
        )
        .await
        .unwrap();
    assert!(!c.choices[0].text.is_empty());
    assert_eq!(s.app.next_event().await.endpoint, "completions");

    let e = client
        .embeddings()
        .create(
            CreateEmbeddingRequestArgs::default()
                .model("fast")
                .input(vec!["a", "b c"])
                .build()
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(e.data.len(), 2);
    let ev = s.app.next_event().await;
    assert_eq!(ev.endpoint, "embeddings");
    assert_eq!(ev.prompt_tokens, 3);

    let models = client.models().list().await.unwrap();
    let ids: Vec<_> = models.data.iter().map(|m| m.id.as_str()).collect();
    for m in ["fast", "smart", "auto", "sim-small", "sim-large"] {
        assert!(ids.contains(&m), "{m} in {ids:?}");
    }
    assert_eq!(client.models().retrieve("smart").await.unwrap().id, "smart");
    assert!(client.models().retrieve("gpt-9").await.is_err());
}

#[tokio::test]
async fn unknown_fields_are_forwarded_untouched_and_model_is_rewritten() {
    let s = setup().await;
    let mut body = chat_body("fast", "hi");
    body["brand_new_param"] = json!({"nested": [1, 2, 3]});
    body["temperature"] = json!(0.3);
    let resp = s.app.chat(body).await;
    assert_eq!(resp.status(), 200);
    let replica = resp.headers()["x-gateway-replica"]
        .to_str()
        .unwrap()
        .to_owned();
    let sim = if replica == "s1" {
        &s.small[0]
    } else {
        &s.small[1]
    };
    let seen = sim.last_request().await;
    assert_eq!(seen["brand_new_param"], json!({"nested": [1, 2, 3]}));
    assert_eq!(seen["temperature"], json!(0.3));
    assert_eq!(seen["model"], "sim-small");
}

async fn error_of(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap();
    assert!(
        body["error"]["message"].is_string(),
        "OpenAI-shaped error: {body}"
    );
    assert!(body["error"].get("type").is_some() && body["error"].get("param").is_some());
    (status, body)
}

#[tokio::test]
async fn bad_requests_get_openai_shaped_errors_naming_the_problem() {
    let mut s = setup_with(StoreKind::Sqlite, zero_small(), |c| {
        c.server.max_body_bytes = 2048
    })
    .await;
    let url = format!("{}/v1/chat/completions", s.app.base);

    let (st, b) = error_of(s.app.chat_text("{nope").await).await;
    assert_eq!(st, 400);
    assert_eq!(b["error"]["code"], "invalid_json");

    let (st, b) = error_of(
        s.app
            .chat(json!({"model": "fast", "messages": [{"role": "user", "content": 5}]}))
            .await,
    )
    .await;
    assert_eq!(st, 400);
    assert_eq!(b["error"]["param"], "messages[0].content");

    let (st, b) = error_of(s.app.chat(json!({"model": "fast"})).await).await;
    assert_eq!((st, b["error"]["param"].as_str()), (400, Some("messages")));

    let (st, b) = error_of(s.app.chat(chat_body("gpt-9", "hi")).await).await;
    assert_eq!(
        (st, b["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );

    for (body, param) in [
        (chat_body(&"m".repeat(300), "hi"), "model"),
        (
            json!({"model": "fast", "n": 1000, "messages": [{"role": "user", "content": "hi"}]}),
            "n",
        ),
        (
            json!({"model": "fast", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}),
            "max_tokens",
        ),
        (
            json!({"model": "fast", "messages": [{"role": "user"}]}),
            "messages[0].content",
        ),
        (
            json!({"model": "fast", "user": "u".repeat(300), "messages": [{"role": "user", "content": "hi"}]}),
            "user",
        ),
    ] {
        let (st, b) = error_of(s.app.chat(body).await).await;
        assert_eq!(
            (st, b["error"]["param"].as_str()),
            (400, Some(param)),
            "{b}"
        );
    }
    // An assistant turn that calls a tool may come without content.
    let tool_turn = json!({"model": "fast", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]});
    assert_eq!(s.app.chat(tool_turn).await.status(), 200);
    let tags = (0..20)
        .map(|i| format!("t{i}=v"))
        .collect::<Vec<_>>()
        .join(",");
    let (st, b) = error_of(
        s.app
            .http
            .post(&url)
            .bearer_auth(&s.app.api_key)
            .header("x-gateway-tags", tags)
            .json(&chat_body("fast", "hi"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (st, b["error"]["param"].as_str()),
        (400, Some("x-gateway-tags")),
        "{b}"
    );

    let big = chat_body("fast", &"x".repeat(4096));
    let (st, b) = error_of(s.app.chat(big).await).await;
    assert_eq!(
        (st, b["error"]["code"].as_str()),
        (413, Some("request_too_large"))
    );

    let (st, _) = error_of(s.app.post("/v1/nothing-here", &json!({})).await).await;
    assert_eq!(st, 404);
    let get = s
        .app
        .http
        .get(&url)
        .bearer_auth(&s.app.api_key)
        .send()
        .await
        .unwrap();
    let (st, b) = error_of(get).await;
    assert_eq!(st, 405, "{b}");

    // Eleven rejections settled (and the one tool turn answered among them).
    let mut answered = 0;
    for _ in 0..12 {
        let e = s.app.next_event().await;
        if e.status == 200 {
            answered += 1;
            continue;
        }
        assert!(
            e.error_kind.is_some() && e.status >= 400,
            "rejections are settled too: {e:?}"
        );
        assert_eq!(e.prompt_tokens + e.completion_tokens, 0);
    }
    assert_eq!(answered, 1);
}

#[tokio::test]
async fn missing_or_bad_keys_are_401_for_the_sdk() {
    let s = setup().await;
    for key in [
        "",
        "sk-wrong",
        "sk-gw-0000000000000000000000000000000000000000",
    ] {
        let err = s
            .app
            .openai(key)
            .chat()
            .create(
                CreateChatCompletionRequestArgs::default()
                    .model("fast")
                    .messages(vec![user("x")])
                    .build()
                    .unwrap(),
            )
            .await
            .unwrap_err();
        match err {
            async_openai::error::OpenAIError::ApiError(e) => {
                assert_eq!(e.status_code, 401);
                assert_eq!(e.api_error.code.as_deref(), Some("invalid_api_key"));
            }
            other => panic!("expected an API error, got {other:?}"),
        }
    }
    let resp = s
        .app
        .http
        .get(format!("{}/v1/models", s.app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
}

fn completion_json(model: &str) -> Value {
    json!({"id": "x", "object": "chat.completion", "created": 0, "model": model,
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
}

#[tokio::test]
async fn a_5xx_is_retried_once_on_another_replica_of_the_same_tier() {
    let failing = MockServer::start().await;
    let healthy = MockServer::start().await;
    let large = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .respond_with(ResponseTemplate::new(503))
        .expect(1)
        .mount(&failing)
        .await;
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .respond_with(ResponseTemplate::new(200).set_body_json(completion_json("m")))
        .expect(1)
        .mount(&healthy)
        .await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200))
        .expect(0)
        .mount(&large)
        .await;
    let mut c = config(
        vec![
            replica("bad", &format!("{}/v1", failing.uri()), "m"),
            replica("good", &format!("{}/v1", healthy.uri()), "m"),
        ],
        vec![replica("l1", &format!("{}/v1", large.uri()), "L")],
    );
    c.upstream.failure_threshold = 5;
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    // Pin the first attempt to the failing replica: the other one is busy.
    let app_state = app.state.clone();
    let tier = app_state
        .upstreams
        .tier(gateway::config::Tier::Small)
        .unwrap();
    let _busy = tier.set.choose(std::time::Instant::now(), &[0]).unwrap();
    let resp = app.chat(chat_body("fast", "hi")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-gateway-replica"], "good");
    assert_eq!(resp.headers()["x-gateway-retries"], "1");
    let e = app.next_event().await;
    assert_eq!(e.retries, 1);
    assert_eq!(e.replica.as_deref(), Some("good"));
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("gateway_upstream_errors_total{kind=\"status_5xx\",replica=\"bad\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn when_a_whole_tier_fails_the_other_tier_answers_and_without_fallback_it_is_502() {
    for fallback in [true, false] {
        let s = setup_with(StoreKind::Sqlite, zero_small(), |c| {
            c.upstream.fallback_to_other_tier = fallback
        })
        .await;
        for sim in &s.small {
            sim.faults(json!({"fail_next": 1, "status": 500})).await;
        }
        let resp = s.app.chat(chat_body("fast", "hi")).await;
        if fallback {
            assert_eq!(resp.status(), 200);
            assert_eq!(resp.headers()["x-gateway-tier"], "large");
            assert_eq!(resp.headers()["x-gateway-retries"], "2");
        } else {
            let (st, b) = error_of(resp).await;
            assert_eq!(st, 502);
            assert_eq!(b["error"]["type"], "api_error");
        }
    }
}

#[tokio::test]
async fn unreachable_replicas_give_502_then_503_once_taken_out() {
    // Ports that refuse connections: bind, note the port, close.
    let dead = |_: u8| async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        drop(l);
        format!("http://{a}/v1")
    };
    let (a, b) = (dead(0).await, dead(1).await);
    let mut c = config(vec![replica("a", &a, "m")], vec![replica("b", &b, "M")]);
    c.upstream.failure_threshold = 1;
    c.upstream.cooldown_ms = 60_000;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let (st, _) = error_of(app.chat(chat_body("fast", "hi")).await).await;
    assert_eq!(st, 502, "connect failures on both tiers");
    let resp = app.chat(chat_body("fast", "hi")).await;
    assert_eq!(resp.headers()["retry-after"], "1");
    let (st, b) = error_of(resp).await;
    assert_eq!(st, 503, "both replicas cooling down: {b}");
    let ready = app
        .http
        .get(format!("{}/readyz", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
}

#[tokio::test]
async fn a_slow_first_byte_is_a_504() {
    let slow = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(completion_json("m"))
                .set_delay(Duration::from_millis(1500)),
        )
        .mount(&slow)
        .await;
    let mut c = config(
        vec![replica("slow", &format!("{}/v1", slow.uri()), "m")],
        vec![replica("slow-l", &format!("{}/v1", slow.uri()), "m")],
    );
    c.upstream.first_byte_timeout_ms = 200;
    c.upstream.fallback_to_other_tier = false;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let (st, b) = error_of(app.chat(chat_body("fast", "hi")).await).await;
    assert_eq!(st, 504, "{b}");
}

/// A wiremock upstream answering every POST with `completion_json` after `delay`.
async fn delayed_upstream(delay: Duration) -> MockServer {
    let up = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(completion_json("m"))
                .set_delay(delay),
        )
        .mount(&up)
        .await;
    up
}

async fn requests_to(up: &MockServer) -> usize {
    up.received_requests().await.map_or(0, |r| r.len())
}

#[tokio::test]
async fn a_hung_tier_costs_one_first_byte_budget_not_one_timeout_per_attempt() {
    let hung = delayed_upstream(Duration::from_secs(10)).await;
    let url = format!("{}/v1", hung.uri());
    // Three attempts (two small replicas, then the large tier), 600 ms each, sharing 900 ms.
    let mut c = config(
        vec![replica("h1", &url, "m"), replica("h2", &url, "m")],
        vec![replica("h3", &url, "m")],
    );
    c.upstream.first_byte_timeout_ms = 600;
    c.upstream.first_byte_budget_ms = 900;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let started = std::time::Instant::now();
    let (st, b) = error_of(app.chat(chat_body("fast", "hi")).await).await;
    let took = started.elapsed();
    assert_eq!(st, 504, "{b}");
    assert!(
        took >= Duration::from_millis(850) && took < Duration::from_millis(1500),
        "504 after {took:?}: the attempts share a 900 ms first-byte budget (1.8 s if each had its own)"
    );
    assert_eq!(
        requests_to(&hung).await,
        2,
        "600 ms, then the 300 ms left; no third attempt"
    );
}

#[tokio::test]
async fn streams_fail_over_at_their_own_shorter_first_byte_timeout() {
    let slow = delayed_upstream(Duration::from_millis(1500)).await;
    let url = format!("{}/v1", slow.uri());
    let mut c = config(vec![replica("s", &url, "m")], vec![replica("l", &url, "m")]);
    c.upstream.stream_first_byte_timeout_ms = 300;
    c.upstream.first_byte_timeout_ms = 5_000;
    c.upstream.first_byte_budget_ms = 5_000;
    c.upstream.fallback_to_other_tier = false;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let mut body = chat_body("fast", "hi");
    body["stream"] = json!(true);
    let started = std::time::Instant::now();
    let (st, b) = error_of(app.chat(body).await).await;
    assert_eq!(
        st, 504,
        "a stream's headers did not come within 300 ms: {b}"
    );
    assert!(started.elapsed() < Duration::from_millis(1400));
    // The same answer, not streamed, is waited for: it is the whole generation.
    assert_eq!(app.chat(chat_body("fast", "hi")).await.status(), 200);
}

#[tokio::test]
async fn after_the_cooldown_one_probe_goes_to_a_tripped_replica_while_the_rest_go_elsewhere() {
    let hung = delayed_upstream(Duration::from_secs(10)).await;
    let healthy = delayed_upstream(Duration::from_millis(100)).await;
    let mut c = config(
        vec![
            replica("hung", &format!("{}/v1", hung.uri()), "m"),
            replica("ok", &format!("{}/v1", healthy.uri()), "m"),
        ],
        vec![replica("l", &format!("{}/v1", healthy.uri()), "m")],
    );
    c.upstream.first_byte_timeout_ms = 300;
    c.upstream.failure_threshold = 1;
    c.upstream.cooldown_ms = 400;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    // Trip `hung`: every request goes there or to `ok`; send until it has been tried once.
    eventually(
        "the hung replica is tried and tripped",
        Duration::from_secs(10),
        || async {
            assert_eq!(app.chat(chat_body("fast", "hi")).await.status(), 200);
            (requests_to(&hung).await == 1).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Cooled down: eight requests at once, and only one of them may probe the hung replica.
    let answers =
        futures_util::future::join_all((0..8).map(|_| app.chat(chat_body("fast", "hi")))).await;
    assert!(answers.iter().all(|r| r.status() == 200));
    assert_eq!(
        requests_to(&hung).await,
        2,
        "one probe after the cooldown, not every request at once"
    );
}

#[tokio::test]
async fn an_answer_over_max_response_bytes_is_a_502_and_not_retried() {
    let up = MockServer::start().await;
    let mut big = completion_json("m");
    big["choices"][0]["message"]["content"] = json!("x".repeat(300_000));
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_json(big))
        .expect(1)
        .mount(&up)
        .await;
    let url = format!("{}/v1", up.uri());
    let mut c = config(
        vec![replica("a", &url, "m"), replica("b", &url, "m")],
        vec![replica("c", &url, "m")],
    );
    c.upstream.max_response_bytes = 100_000;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let (st, b) = error_of(app.chat(chat_body("fast", "hi")).await).await;
    assert_eq!(st, 502);
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("upstream.max_response_bytes = 100000"),
        "{b}"
    );
    let replicas = app.state.upstreams.snapshot(std::time::Instant::now());
    assert!(
        replicas
            .iter()
            .flat_map(|(_, r)| r)
            .all(|r| r.consecutive_failures == 0),
        "not held against the replica: {replicas:?}"
    );
}

#[tokio::test]
async fn upstream_429_is_passed_through_with_its_retry_after() {
    let up = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(429)
                .insert_header("retry-after", "7")
                .set_body_json(json!({"error": {"message": "slow down", "type": "rate_limit_error", "param": null, "code": "rate_limit_exceeded"}})),
        )
        .expect(1)
        .mount(&up)
        .await;
    let c = config(
        vec![replica("u", &format!("{}/v1", up.uri()), "m")],
        vec![replica("u2", &format!("{}/v1", up.uri()), "m")],
    );
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let resp = app.chat(chat_body("fast", "hi")).await;
    assert_eq!(
        resp.headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap()),
        Some("7")
    );
    let (st, b) = error_of(resp).await;
    assert_eq!(
        (st, b["error"]["code"].as_str()),
        (429, Some("rate_limit_exceeded"))
    );
}

#[tokio::test]
async fn upstream_4xx_is_passed_through_without_retry() {
    let up = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(400).set_body_json(json!({"error": {"message": "context too long", "type": "invalid_request_error", "param": null, "code": null}})))
        .expect(1).mount(&up).await;
    let c = config(
        vec![replica("u", &format!("{}/v1", up.uri()), "m")],
        vec![replica("u2", &format!("{}/v1", up.uri()), "m")],
    );
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let (st, b) = error_of(app.chat(chat_body("fast", "hi")).await).await;
    assert_eq!(st, 400);
    assert_eq!(b["error"]["message"], "context too long");
    assert_eq!(
        app.next_event().await.error_kind.as_deref(),
        Some("upstream_400")
    );
}

#[tokio::test]
async fn consecutive_failures_take_a_replica_out_of_rotation() {
    let s = setup_with(StoreKind::Sqlite, zero_small(), |c| {
        c.upstream.failure_threshold = 2;
        c.upstream.cooldown_ms = 60_000;
    })
    .await;
    s.small[0].faults(json!({"fail_next": 100})).await;
    for _ in 0..10 {
        assert_eq!(s.app.chat(chat_body("fast", "hi")).await.status(), 200);
    }
    assert_eq!(
        s.small[0].sim.requests(),
        2,
        "s1 saw two failures, then was taken out"
    );
    assert_eq!(s.small[1].sim.requests(), 10);
    let metrics = s.app.metrics().await;
    assert!(
        metrics.contains("gateway_replica_healthy{replica=\"s1\",tier=\"small\"} 0"),
        "{metrics}"
    );
}

async fn disconnect_mid_stream(
    policy: gateway::config::DisconnectPolicy,
) -> gateway::usage::UsageEvent {
    let mut p = SimProfile::zero();
    p.model = "sim-small".into();
    p.decode_ms_per_token = 10.0;
    let mut s = setup_with(StoreKind::Sqlite, SimOptions::new(p), |c| {
        c.upstream.on_client_disconnect = policy
    })
    .await;
    let mut body = chat_body("fast", "long answer");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(60);
    let resp = s.app.chat(body).await;
    let mut bytes = resp.bytes_stream();
    let first = bytes.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(bytes); // the client hangs up after the first chunk
    s.app.next_event().await
}

#[tokio::test]
async fn a_client_hang_up_mid_stream_is_still_settled_with_the_upstream_usage() {
    let e = disconnect_mid_stream(gateway::config::DisconnectPolicy::Drain).await;
    assert!(e.client_disconnected);
    assert_eq!(e.status, 499);
    assert_eq!(
        e.usage_source,
        UsageSource::Upstream,
        "the stream was drained to its usage chunk"
    );
    assert_eq!(e.completion_tokens, 60);
}

/// A client that gives up before a non-streamed answer drops the handler's future, never the
/// pipeline's work: the answer is still read from the upstream and settled at its usage.
#[tokio::test]
async fn a_client_giving_up_before_a_buffered_answer_still_gets_it_read_and_settled() {
    let mut p = SimProfile::zero();
    p.model = "sim-small".into();
    p.decode_ms_per_token = 10.0;
    let mut s = setup_with(StoreKind::Sqlite, SimOptions::new(p), |_| {}).await;
    let mut body = chat_body("fast", "long answer");
    body["max_tokens"] = json!(40); // ~400 ms upstream
    let gave_up = s
        .app
        .http
        .post(format!("{}/v1/chat/completions", s.app.base))
        .bearer_auth(&s.app.api_key)
        .timeout(std::time::Duration::from_millis(100))
        .json(&body)
        .send()
        .await;
    assert!(gave_up.is_err(), "the client timed out first");
    let e = s.app.next_event().await;
    assert_eq!(e.status, 200, "the upstream answer was read to its end");
    assert_eq!(e.usage_source, UsageSource::Upstream);
    assert_eq!(e.completion_tokens, 40);
}

#[tokio::test]
async fn with_cancel_policy_a_hang_up_stops_the_upstream_and_counts_what_was_received() {
    let e = disconnect_mid_stream(gateway::config::DisconnectPolicy::Cancel).await;
    assert!(e.client_disconnected);
    assert_eq!(e.usage_source, UsageSource::Tokenizer);
    assert!(e.completion_tokens < 60, "{}", e.completion_tokens);
    assert!(e.prompt_tokens > 0);
}

#[tokio::test]
async fn streaming_does_not_wait_for_the_whole_response() {
    let mut p = SimProfile::zero();
    p.model = "sim-small".into();
    p.decode_ms_per_token = 50.0;
    let s = setup_with(StoreKind::Sqlite, SimOptions::new(p), |_| {}).await;
    let mut body = chat_body("fast", "hi");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(20); // ~1 s of decoding upstream
    let start = std::time::Instant::now();
    let resp = s.app.chat(body).await;
    let mut bytes = resp.bytes_stream();
    let _first = bytes.next().await.unwrap().unwrap();
    let first_at = start.elapsed();
    while bytes.next().await.is_some() {}
    let total = start.elapsed();
    assert!(
        first_at * 4 < total,
        "first chunk at {first_at:?} of {total:?}: chunks are passed through as they come"
    );
}

#[tokio::test]
async fn metrics_expose_every_defined_name_after_traffic() {
    // The semantic layer loaded too, so the metrics it sets when it loads have series.
    let s = setup_with(StoreKind::Sqlite, zero_small(), |c| {
        c.cache.semantic.model_dir = e2e::model_dir();
        c.cache.semantic.preload = true;
    })
    .await;
    s.app.semantic_ready().await;
    // A budget, so budget decisions are counted too.
    let r = s
        .app
        .admin(
            reqwest::Method::POST,
            "budgets",
            Some(json!({"tenant": "acme", "window": "day", "limit_tokens": 1000000})),
        )
        .await;
    assert_eq!(r.status(), 201);
    let mut body = chat_body("fast", "hi");
    body["stream"] = json!(true);
    let _ = s.app.chat(body).await.text().await;
    let _ = s.app.chat(chat_body("nope", "hi")).await;
    s.small[0].faults(json!({"fail_next": 1})).await;
    s.small[1].faults(json!({"fail_next": 1})).await;
    let _ = s.app.chat(chat_body("fast", "hi")).await;
    // A repeated deterministic request, so the cache counts a hit and its saving.
    let mut repeat = chat_body("fast", "again");
    repeat["temperature"] = json!(0);
    for _ in 0..2 {
        let _ = s.app.chat(repeat.clone()).await.text().await;
    }
    // An agent loop, so the guard counts one and its cost.
    let _ = s.app.chat(e2e::looping_chat()).await.text().await;
    let text = s.app.metrics().await;
    for name in gateway::metrics::names::ALL {
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "{name} missing from /metrics"
        );
    }
    assert!(
        text.contains(
            "gateway_requests_total{model=\"fast\",status=\"200\",tenant=\"acme\",tier=\"small\"}"
        ),
        "{text}"
    );
    // A name the configuration does not know is one `unknown` label, never the client's text.
    assert!(!text.contains("nope"), "{text}");
    assert!(
        text.contains(
            "gateway_requests_total{model=\"unknown\",status=\"404\",tenant=\"acme\",tier=\"none\"}"
        ),
        "{text}"
    );
}

#[tokio::test]
async fn probes_answer_without_a_key() {
    let s = setup().await;
    let h = s
        .app
        .http
        .get(format!("{}/healthz", s.app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(h.status(), 200);
    let r: Value = s
        .app
        .http
        .get(format!("{}/readyz", s.app.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["ready"], true);
    assert_eq!(r["store"], true);
}

#[tokio::test]
async fn stopping_the_server_ends_every_background_loop_of_its_components() {
    for budgets in e2e::BUDGET_STORES {
        let sim = Sim::zero("sim-small").await;
        let mut c = config(
            vec![replica("s", &sim.url, "sim-small")],
            vec![replica("l", &sim.url, "sim-small")],
        );
        c.budgets = budgets.config();
        // The shared cache on the same Redis (or Cluster) as the budgets.
        c.cache.redis_urls = budgets.redis_urls();
        let app = TestApp::spawn(c, StoreKind::Sqlite).await;
        let body = json!({"model": "fast", "temperature": 0,
            "messages": [{"role": "user", "content": "background loops"}]});
        assert_eq!(app.chat(body).await.status(), 200);
        let state = app.state.clone();
        assert!(
            state.background.running() >= 4,
            "refreshers and commit loop run"
        );
        app.stop().await;
        assert_eq!(
            state.background.running(),
            0,
            "{budgets:?}: every loop ended"
        );
    }
}

/// What the upstream receives and the client gets back, byte for byte where the gateway now
/// writes less itself: the `Host` the HTTP/1 client would have written (made once per replica),
/// and the upstream's `content-length` passed on with the unchanged body.
#[tokio::test]
async fn the_upstream_gets_its_own_host_and_the_client_the_answers_length() {
    let up = delayed_upstream(Duration::ZERO).await;
    let c = config(
        vec![replica("w1", &format!("{}/v1", up.uri()), "m")],
        vec![replica("w2", &format!("{}/v1", up.uri()), "m")],
    );
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    for _ in 0..2 {
        let resp = app.chat(chat_body("fast", "hi")).await;
        assert_eq!(resp.status(), 200);
        let length = resp.headers()["content-length"]
            .to_str()
            .unwrap()
            .to_owned();
        let body = resp.bytes().await.unwrap();
        assert_eq!(length, body.len().to_string());
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v, completion_json("m"), "the upstream's body, unchanged");
    }
    let seen = up.received_requests().await.unwrap_or_default();
    assert_eq!(seen.len(), 2);
    let authority = up.uri().trim_start_matches("http://").to_owned();
    for r in &seen {
        let hosts: Vec<_> = r.headers.get_all("host").iter().collect();
        assert_eq!(hosts.len(), 1, "one Host header: {:?}", r.headers);
        assert_eq!(hosts[0].to_str().unwrap(), authority);
    }
}

/// With the loop check off, a chat body is read from its text, not parsed into a tree: what
/// the gateway records of it (fingerprint, derived session, `user` tag) and what the upstream
/// and the client get are the same as for the tree the library parses it into.
#[tokio::test]
async fn a_chat_read_from_its_text_is_recorded_as_its_tree_would_be() {
    use gateway::openai::{Endpoint, ParsedRequest};
    let mut s = setup_with(StoreKind::Sqlite, zero_small(), |c| {
        c.guard.enabled = false;
    })
    .await;
    // Keys out of order, spacing, whole floats, escapes, nested objects, a stream whose usage
    // the gateway asks for on its own behalf.
    let bodies = [
        r#"{"temperature": 1.0, "model": "fast", "max_tokens": 4, "messages": [{"role": "system", "content": "Be \"brief\".\n\u00e9"}, {"role": "user", "content": "hi \\ there"}], "user": "u-7"}"#,
        r#" { "messages" : [ {"content": [{"type": "text", "text": "x\u2028y"}], "role": "user"} ], "model":"fast", "logit_bias": {"50256": -100.0, "1": 2.5}, "metadata": {"b": [1, 2.0], "a": {"z": "\b"}}, "stream": true } "#,
    ];
    for body in bodies {
        let tree =
            ParsedRequest::parse_tree(Endpoint::Chat, body.as_bytes().to_vec().into()).unwrap();
        let session = gateway::guard::session::of(None, &s.app.key_id, &tree);
        let r = s.app.chat_text(body).await;
        assert_eq!(r.status(), 200, "{body}");
        let text = r.text().await.unwrap();
        let e = s.app.next_event().await;
        assert_eq!(e.fingerprint, tree.fingerprint(), "{body}");
        assert_eq!(e.tags["session"], session.id, "{body}");
        assert_eq!(
            e.tags.get("user").map(String::as_str),
            tree.end_user(),
            "{body}"
        );
        assert_eq!(e.stream, tree.stream);
        assert!(e.prompt_tokens > 0 && e.completion_tokens > 0, "{e:?}");
        if tree.stream {
            // The usage chunk the gateway asked for is not passed on.
            assert!(
                text.contains("[DONE]") && !text.contains("\"usage\":{"),
                "{text}"
            );
        }
        // The upstream got the client's body with the upstream model (and, for the stream,
        // usage asked for), as the tree would be written out.
        let mut tree = tree;
        let expected: Value = serde_json::from_slice(&tree.upstream_body("sim-small")).unwrap();
        let mut got = Vec::new();
        for sim in &s.small {
            got.push(sim.last_request().await);
        }
        assert!(got.contains(&expected), "{expected} not in {got:?}");
    }
    s.app.stop().await;
}
