//! The response cache end to end: exact hits (buffered and replayed as SSE to a real client),
//! what is and is not cacheable, `Cache-Control`, tenant isolation, per-tenant policies through
//! `gatewayctl`, time to live, settlement of hits (cost 0, saved cost), and the semantic layer
//! with the real all-MiniLM-L6-v2 model and the shipped verifier.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use async_openai::types::chat::CreateChatCompletionRequestArgs;
use e2e::{config, model_dir, replica, Sim, StoreKind, TestApp};
use futures_util::StreamExt;
use gateway::config::{Config, CpuPrecision};
use gateway::usage::CacheStatus;
use serde_json::{json, Value};

fn cache_header(r: &reqwest::Response) -> String {
    r.headers()
        .get("x-gateway-cache")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

fn deterministic(text: &str) -> Value {
    json!({"model": "fast", "temperature": 0, "messages": [{"role": "user", "content": text}]})
}

/// A gateway in front of one zero-latency simulator per tier, exact cache only (no model).
async fn exact_app(kind: StoreKind) -> (TestApp, Sim) {
    let sim = Sim::zero("sim-small").await;
    let large = Sim::zero("sim-large").await;
    let mut c: Config = config(
        vec![replica("s1", &sim.url, "sim-small")],
        vec![replica("l1", &large.url, "sim-large")],
    );
    c.cache.semantic.model_dir = "/nonexistent/model".into();
    e2e::price(&mut c, "sim-small", 1.0, 2.0);
    std::mem::forget(large);
    (TestApp::spawn(c, kind).await, sim)
}

#[tokio::test]
async fn exact_repeats_are_answered_from_the_cache_and_settled_at_cost_zero() {
    for kind in e2e::BOTH {
        let (mut app, sim) = exact_app(kind).await;
        let body = deterministic("What is the capital of France?");
        let first = app.chat(body.clone()).await;
        assert_eq!(first.status(), 200);
        assert_eq!(cache_header(&first), "miss");
        let first_body: Value = first.json().await.unwrap();
        let miss = app.next_event().await;
        assert_eq!(miss.cache_status, CacheStatus::Miss);
        assert!(miss.cost_micros > 0, "the miss is charged");

        // Key order and delivery fields do not matter; the answer is byte-identical.
        let reordered = json!({"messages": [{"content": "What is the capital of France?", "role": "user"}],
                               "user": "someone", "temperature": 0, "model": "fast"});
        let second = app.chat(reordered).await;
        assert_eq!(cache_header(&second), "hit-exact");
        assert_eq!(
            second.headers()["x-gateway-served-model"].to_str().unwrap(),
            "sim-small"
        );
        let second_body: Value = second.json().await.unwrap();
        assert_eq!(first_body, second_body);
        assert_eq!(
            sim.sim.requests(),
            1,
            "the repeat never reached the upstream"
        );
        let hit = app.next_event().await;
        assert_eq!(hit.cache_status, CacheStatus::HitExact);
        assert_eq!(hit.cost_micros, 0);
        assert_eq!(hit.prompt_tokens + hit.completion_tokens, 0);
        assert_eq!(
            hit.saved_micros, miss.cost_micros,
            "saved what the miss cost"
        );
        assert_eq!(hit.served_model.as_deref(), Some("sim-small"));

        // A streamed repeat is replayed as SSE to a real client, with usage when asked.
        let client = app.openai(&app.api_key);
        let req = CreateChatCompletionRequestArgs::default()
            .model("fast")
            .temperature(0.0)
            .messages(vec![
                async_openai::types::chat::ChatCompletionRequestUserMessageArgs::default()
                    .content("What is the capital of France?")
                    .build()
                    .unwrap()
                    .into(),
            ])
            .stream(true)
            .stream_options(async_openai::types::chat::ChatCompletionStreamOptions {
                include_usage: Some(true),
                include_obfuscation: None,
            })
            .build()
            .unwrap();
        let mut stream = client.chat().create_stream(req).await.unwrap();
        let (mut text, mut usage, mut finish) = (String::new(), None, None);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.unwrap();
            for c in &chunk.choices {
                if let Some(t) = &c.delta.content {
                    text.push_str(t);
                }
                if c.finish_reason.is_some() {
                    finish = Some(());
                }
            }
            if chunk.usage.is_some() {
                usage = chunk.usage;
            }
        }
        assert_eq!(
            text,
            first_body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
        );
        assert!(finish.is_some(), "the replay finishes its choice");
        assert_eq!(
            u64::from(usage.expect("usage chunk replayed").completion_tokens),
            first_body["usage"]["completion_tokens"].as_u64().unwrap()
        );
        assert_eq!(sim.sim.requests(), 1);
        assert_eq!(app.next_event().await.cache_status, CacheStatus::HitExact);

        // A streamed miss is assembled and cached for non-streamed repeats too.
        let mut streamed = deterministic("Name a prime number.");
        streamed["stream"] = json!(true);
        let r = app.chat(streamed.clone()).await;
        assert_eq!(cache_header(&r), "miss");
        let sse = r.text().await.unwrap();
        assert!(!sse.contains("\"usage\":{"), "usage not asked for: {sse}");
        let _ = app.next_event().await;
        let r = app.chat(deterministic("Name a prime number.")).await;
        assert_eq!(cache_header(&r), "hit-exact");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["object"], "chat.completion");
        let content = v["choices"][0]["message"]["content"].as_str().unwrap();
        let streamed_text: String = sse
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert_eq!(content, streamed_text);
        assert_eq!(sim.sim.requests(), 2);
        let m = app.metrics().await;
        assert!(
            m.contains("gateway_cache_lookups_total{layer=\"exact\",result=\"hit\"} 3"),
            "{m}"
        );
        assert!(m.contains("gateway_cache_semantic_ready 0"));
        app.stop().await;
    }
}

#[tokio::test]
async fn only_cacheable_requests_use_the_cache_and_never_across_tenants() {
    let (mut app, sim) = exact_app(StoreKind::Sqlite).await;
    let mut calls = 0;
    let mut send_twice = async |body: Value, headers: &[(&str, &str)], expect: [&str; 2]| {
        for want in expect {
            let mut req = app
                .http
                .post(format!("{}/v1/chat/completions", app.base))
                .bearer_auth(&app.api_key)
                .json(&body);
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(cache_header(&r), want, "{body} {headers:?}");
            calls += 1;
        }
    };
    // Sampled (temperature absent or > 0): each call is a new sample.
    send_twice(
        json!({"model": "fast", "messages": [{"role": "user", "content": "a poem"}]}),
        &[],
        ["bypass", "bypass"],
    )
    .await;
    let mut warm = deterministic("tools?");
    warm["tools"] = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    send_twice(warm, &[], ["bypass", "bypass"]).await;
    send_twice(
        deterministic("no store"),
        &[("cache-control", "no-store")],
        ["bypass", "bypass"],
    )
    .await;
    // no-cache: always fresh, but the fresh answer is stored.
    send_twice(
        deterministic("fresh"),
        &[("cache-control", "no-cache")],
        ["miss", "miss"],
    )
    .await;
    send_twice(deterministic("fresh"), &[], ["hit-exact", "hit-exact"]).await;
    assert_eq!(sim.sim.requests(), 8, "{calls} calls");
    for _ in 0..calls {
        app.next_event().await;
    }

    // Another tenant asking the same question gets its own answer.
    let r = app
        .admin(
            reqwest::Method::POST,
            "tenants",
            Some(json!({"name": "globex"})),
        )
        .await;
    let tenant: Value = r.json().await.unwrap();
    let r = app
        .admin(
            reqwest::Method::POST,
            "keys",
            Some(json!({"tenant": tenant["id"]})),
        )
        .await;
    let key: Value = r.json().await.unwrap();
    let secret = key["key"].as_str().unwrap();
    let live = &app;
    let r = e2e::eventually(
        "the new key is live",
        Duration::from_secs(5),
        || async move {
            let r = live.chat_as(secret, &deterministic("fresh")).await;
            (r.status() != 401).then_some(r)
        },
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_header(&r), "miss");
    assert_eq!(sim.sim.requests(), 9);
    app.stop().await;
}

#[tokio::test]
async fn tenant_policies_from_gatewayctl_switch_modes_and_time_to_live() {
    let (app, sim) = exact_app(StoreKind::Sqlite).await;
    let (ok, out) = app
        .ctl(&["cache", "set", "--tenant", "acme", "--mode", "off"])
        .await;
    assert!(ok, "{out}");
    assert!(out.contains("off"), "{out}");
    let body = deterministic("policy?");
    for _ in 0..2 {
        assert_eq!(cache_header(&app.chat(body.clone()).await), "bypass");
    }
    let (ok, out) = app
        .ctl(&[
            "cache",
            "set",
            "--tenant",
            "acme",
            "--mode",
            "exact",
            "--ttl-secs",
            "1",
            "--any-temperature",
        ])
        .await;
    assert!(ok, "{out}");
    let sampled = json!({"model": "fast", "messages": [{"role": "user", "content": "sampled"}]});
    assert_eq!(cache_header(&app.chat(sampled.clone()).await), "miss");
    assert_eq!(cache_header(&app.chat(sampled.clone()).await), "hit-exact");
    e2e::eventually(
        "the answer expires after its 1 s ttl",
        Duration::from_secs(3),
        || async { (cache_header(&app.chat(sampled.clone()).await) == "miss").then_some(()) },
    )
    .await;
    let (ok, out) = app.ctl(&["cache", "show", "--tenant", "acme"]).await;
    assert!(ok && out.contains("exact") && out.contains("yes"), "{out}");
    let (ok, out) = app
        .ctl(&["cache", "set", "--tenant", "acme", "--min-precision", "1.5"])
        .await;
    assert!(!ok && out.contains("between 0 and 1"), "{out}");
    let (ok, out) = app.ctl(&["cache", "reset", "--tenant", "acme"]).await;
    assert!(ok && out.contains("no (defaults)"), "{out}");
    assert_eq!(cache_header(&app.chat(sampled).await), "bypass");
    assert_eq!(sim.sim.requests(), 5);
    app.stop().await;
}

/// One simulator behind both tiers, the semantic layer on the repository's model, loaded at start.
fn semantic_config(sim: &Sim) -> Config {
    let mut c = config(
        vec![replica("s1", &sim.url, "sim-small")],
        vec![replica("l1", &sim.url, "sim-small")],
    );
    c.cache.semantic.model_dir = model_dir();
    c.cache.semantic.preload = true;
    c
}

/// A gateway with the semantic layer loaded (`semantic_config`, then `tweak`), and its upstream.
async fn semantic_app(tweak: impl FnOnce(&mut Config)) -> (TestApp, Sim) {
    let sim = Sim::zero("sim-small").await;
    let mut c = semantic_config(&sim);
    tweak(&mut c);
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    app.semantic_ready().await;
    (app, sim)
}

#[tokio::test]
async fn paraphrases_hit_the_semantic_layer_and_near_misses_do_not_with_int8_matrices() {
    paraphrases_hit_and_near_misses_do_not(CpuPrecision::Int8).await;
}

/// The same with `f16` matrices (where the CPU has AVX-512 VNNI, `auto` is `int8`; elsewhere
/// `int8` runs the AVX2 kernel, or without AVX2 the portable loop, `f16` the packed kernels).
#[tokio::test]
async fn paraphrases_hit_the_semantic_layer_and_near_misses_do_not_with_f16_matrices() {
    paraphrases_hit_and_near_misses_do_not(CpuPrecision::F16).await;
}

async fn paraphrases_hit_and_near_misses_do_not(precision: CpuPrecision) {
    let sim = Sim::zero("sim-small").await;
    let large = Sim::zero("sim-large").await;
    let mut c = config(
        vec![replica("s1", &sim.url, "sim-small")],
        vec![replica("l1", &large.url, "sim-large")],
    );
    c.cache.semantic.model_dir = model_dir();
    c.cache.semantic.preload = true;
    c.cache.semantic.precision = precision;
    assert!(
        c.cache
            .semantic
            .model_dir
            .join("model.safetensors")
            .exists(),
        "run scripts/fetch-model.sh"
    );
    // Generous: the static table is distilled on first use when scripts/test.sh did not.
    c.cache.semantic.lookup_timeout_ms = 5_000;
    let mut app = TestApp::spawn(c, StoreKind::Sqlite).await;
    app.semantic_ready().await;
    let set_precision = async |p: &str| {
        let (ok, out) = app
            .ctl(&["cache", "set", "--tenant", "acme", "--min-precision", p])
            .await;
        assert!(ok && out.contains("verifier threshold"), "{out}");
    };
    let ask = async |system: Option<&str>, text: &str| {
        let mut body = deterministic(text);
        if let Some(s) = system {
            body["messages"] = json!([{"role": "system", "content": s},
                                      {"role": "user", "content": text}]);
        }
        let r = app.chat(body).await;
        assert_eq!(r.status(), 200);
        cache_header(&r)
    };
    let (a, b) = (
        "How can I learn to cook Italian food at home?",
        "How do I learn to cook Italian food at home?",
    );
    set_precision("0.9").await;
    assert_eq!(ask(None, a).await, "miss");
    assert_eq!(ask(None, b).await, "hit-semantic");
    // One differing number: the verifier refuses what cosine similarity alone (0.97) accepts.
    let iit = |year: &str| format!("What was the IIT JEE {year} cutoff for general category?");
    assert_eq!(ask(None, &iit("2016")).await, "miss");
    assert_eq!(ask(None, &iit("2017")).await, "miss");
    // The tenant's precision target picks the verifier threshold: this paraphrase is not
    // confident enough at 0.9, and is at 0.8 (a new namespace, so nothing is stored yet).
    // (Verifier probability 0.80: thresholds 0.84 at 0.9 and 0.61 at 0.8 on the shipped
    // curve; `gateway embed verify` prints them.)
    let (c, d) = (
        "What is the best way to learn Python?",
        "How do I get started with Python?",
    );
    assert_eq!(ask(None, c).await, "miss");
    assert_eq!(ask(None, d).await, "miss");
    set_precision("0.8").await;
    assert_eq!(ask(Some("Be brief."), c).await, "miss");
    assert_eq!(ask(Some("Be brief."), d).await, "hit-semantic");
    assert_eq!(sim.sim.requests(), 6);
    let mut events = Vec::new();
    for _ in 0..8 {
        events.push(app.next_event().await);
    }
    let hit = &events[1];
    assert_eq!(hit.cache_status, CacheStatus::HitSemantic);
    assert_eq!(hit.cost_micros, 0);

    // A different system prompt is a different namespace: no hit, however close the question.
    let mut other = deterministic("How do I learn to cook Italian food at home?");
    other["messages"] = json!([{"role": "system", "content": "Answer in French."},
                               {"role": "user", "content": "How do I learn to cook Italian food at home?"}]);
    let r = app.chat(other).await;
    assert_eq!(cache_header(&r), "miss");
    assert_eq!(sim.sim.requests(), 7);
    let m = app.metrics().await;
    assert!(m.contains("gateway_cache_semantic_ready 1"), "{m}");
    assert!(
        m.contains("gateway_cache_lookups_total{layer=\"semantic\",result=\"hit\"} 2"),
        "{m}"
    );
    let name = match precision {
        CpuPrecision::Int8 => "int8",
        CpuPrecision::F16 | CpuPrecision::Auto => "f16",
    };
    let model =
        format!("gateway_cache_semantic_model_info{{device=\"cpu\",precision=\"{name}\"}} 1");
    assert!(m.contains(&model), "{model} in {m}");
    app.stop().await;
}

/// Beside Quora questions (issue 18): a swapped route asks something else however close its
/// words, and a reworded instruction asks the same. Each pair in its own namespace (system
/// prompt), so nothing else stored can be the candidate. Verifier probabilities on the shipped
/// artefact (`gateway embed verify`): the swap 0.57 (below every setting's threshold), the
/// summary instruction 0.85 (threshold 0.84 at the default 0.9), the translation 0.69
/// (threshold 0.61 at 0.8).
#[tokio::test]
async fn a_swapped_route_misses_and_a_reworded_instruction_hits() {
    let (app, _sim) = semantic_app(|c| c.cache.semantic.lookup_timeout_ms = 5_000).await;
    let ask = async |system: &str, text: &str| {
        let mut body = deterministic(text);
        body["messages"] = json!([{"role": "system", "content": system},
                                  {"role": "user", "content": text}]);
        let r = app.chat(body).await;
        assert_eq!(r.status(), 200);
        cache_header(&r)
    };
    let set_precision = async |p: &str| {
        let (ok, out) = app
            .ctl(&["cache", "set", "--tenant", "acme", "--min-precision", p])
            .await;
        assert!(ok, "{out}");
    };
    let (travel, writer, translator, air) = (
        "You are a travel assistant.",
        "You are a writing assistant.",
        "You are a translator.",
        "You book flights.",
    );
    let (there, back) = (
        "Show me flights from Paris to Rome on Friday",
        "Show me flights from Rome to Paris on Friday",
    );
    // (precision setting, system prompt, question, what the cache answers)
    let steps = [
        ("0.9", travel, there, "miss"),
        ("0.9", travel, back, "miss"),
        (
            "0.9",
            writer,
            "Summarize the following article in three bullet points.",
            "miss",
        ),
        (
            "0.9",
            writer,
            "Give me a three-bullet summary of the following article.",
            "hit-semantic",
        ),
        // A looser setting answers a looser rewording; the swap still misses.
        (
            "0.8",
            translator,
            "Translate the following sentence into French.",
            "miss",
        ),
        (
            "0.8",
            translator,
            "Translate this sentence to French.",
            "hit-semantic",
        ),
        ("0.8", travel, back, "hit-exact"),
        ("0.8", air, there, "miss"),
        ("0.8", air, back, "miss"),
    ];
    let mut setting = "";
    for (precision, system, question, expected) in steps {
        if precision != setting {
            set_precision(precision).await;
            setting = precision;
        }
        assert_eq!(
            ask(system, question).await,
            expected,
            "{system} {question} at {precision}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn asking_for_cuda_without_a_usable_gpu_is_a_clear_startup_error() {
    let sim = Sim::zero("sim-small").await;
    let mut c = config(
        vec![replica("s1", &sim.url, "sim-small")],
        vec![replica("l1", &sim.url, "sim-small")],
    );
    c.cache.semantic.device = gateway::config::EmbedDevice::Cuda;
    let store = e2e::TestStore::new(StoreKind::Sqlite).await.unwrap();
    c.store.url = store.url.clone();
    let deps = gateway::Deps {
        store: Some(std::sync::Arc::clone(&store.store)),
        ..Default::default()
    };
    match gateway::AppState::build(c, deps).await {
        // A machine with a GPU and a `cuda` build may start; everywhere else it must say why not.
        Ok(_) => eprintln!("a GPU is usable here: nothing to check"),
        Err(e) => {
            let message = format!("{e:#}");
            assert!(
                message.contains("cache.semantic.device") && message.contains("no GPU can be used"),
                "{message}"
            );
        }
    }
}

#[tokio::test]
async fn an_answer_clamped_by_a_budget_is_not_cached() {
    let (app, sim) = exact_app(StoreKind::Sqlite).await;
    let r = app
        .admin(
            reqwest::Method::POST,
            "budgets",
            Some(json!({"tenant": "acme", "window": "day", "limit_tokens": 400})),
        )
        .await;
    assert_eq!(r.status(), 201);
    let mut body = deterministic("Tell me everything.");
    body["max_tokens"] = json!(1000);
    let r = app.chat(body.clone()).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("x-gateway-budget-clamped"));
    assert_eq!(cache_header(&r), "miss");
    // Not the answer to the request as asked: the repeat goes upstream again.
    let r = app.chat(body).await;
    assert_eq!(cache_header(&r), "miss");
    assert_eq!(sim.sim.requests(), 2);
    app.stop().await;
}

/// The first stage (`cache.semantic.gate_overlap`): a question sharing none of its rare words
/// with what its namespace holds is a miss without an embedding, counted as `gated`; a
/// paraphrase sent right after the answer it matches is still looked up and hits.
#[tokio::test]
async fn the_first_stage_decides_unrelated_questions_without_the_model() {
    first_stage_decides_unrelated_questions(|c| c.cache.semantic.gate_overlap = 0.15).await;
}

/// The learned first stage (`cache.semantic.gate_student`), the same way.
#[tokio::test]
async fn the_learned_first_stage_decides_unrelated_questions_without_the_model() {
    first_stage_decides_unrelated_questions(|c| c.cache.semantic.gate_student = 0.45).await;
}

async fn first_stage_decides_unrelated_questions(stage: impl FnOnce(&mut Config)) {
    let (app, sim) = semantic_app(|c| {
        c.cache.semantic.lookup_timeout_ms = 5_000;
        stage(c);
    })
    .await;
    let (ok, out) = app
        .ctl(&["cache", "set", "--tenant", "acme", "--min-precision", "0.9"])
        .await;
    assert!(ok, "{out}");
    let steps = [
        ("How can I learn to cook Italian food at home?", "miss"),
        (
            "How do I learn to cook Italian food at home?",
            "hit-semantic",
        ),
        ("What is the capital of Australia?", "miss"),
        ("Why does my bicycle tyre keep going flat?", "miss"),
    ];
    for (question, expected) in steps {
        let r = app.chat(deterministic(question)).await;
        assert_eq!(r.status(), 200);
        assert_eq!(cache_header(&r), expected, "{question}");
    }
    assert_eq!(sim.sim.requests(), 3);
    let m = app.metrics().await;
    let count = |result: &str| {
        let line =
            format!("gateway_cache_lookups_total{{layer=\"semantic\",result=\"{result}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(&line))
            .map_or(0, |v| v.trim().parse::<u64>().unwrap())
    };
    // The first question found an empty namespace (a miss without a lookup); the paraphrase
    // was embedded and hit; the two unrelated questions never reached the model.
    assert_eq!(count("hit"), 1, "{m}");
    assert_eq!(count("gated"), 2, "{m}");
    assert_eq!(count("skipped"), 0, "{m}");
    assert!(
        m.contains("gateway_cache_semantic_seconds_count 1"),
        "one embedded lookup: {m}"
    );
    // The first answer was indexed before the paraphrase hit it; none was dropped.
    assert!(
        !m.contains("gateway_cache_semantic_answers_total{result=\"indexed\"} 0"),
        "{m}"
    );
    assert!(
        m.contains("gateway_cache_semantic_answers_total{result=\"dropped\"} 0"),
        "{m}"
    );
    app.stop().await;
}

/// The model's threads (the worker and the pool its matrix products run on) run at
/// `cache.semantic.nice`, below the threads answering requests, and (the model on the CPU, as
/// here) in the idle scheduling class (`cache.semantic.idle_class`, on by default); 0 leaves
/// their niceness as it is.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_model_threads_yield_the_cpu_to_requests() {
    const SCHED_OTHER: i64 = 0;
    const SCHED_IDLE: i64 = 5;
    /// (thread name, niceness, scheduling policy) of every thread of this process.
    fn threads() -> Vec<(String, i64, i64)> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| {
                let dir = t.ok()?.path();
                let name = std::fs::read_to_string(dir.join("comm")).ok()?;
                let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
                // After the name's closing parenthesis: state is field 3, niceness field 19,
                // policy field 41.
                let fields: Vec<&str> = stat.rsplit_once(") ")?.1.split(' ').collect();
                let nice = fields.get(16)?.parse().ok()?;
                let policy = fields.get(38)?.parse().ok()?;
                Some((name.trim().to_owned(), nice, policy))
            })
            .collect()
    }
    let (app, _sim) = semantic_app(|c| c.cache.semantic.nice = 12).await;
    let all = threads();
    // The process's own niceness (0 unless the tests were started under `nice`): the model's
    // threads go down to 12 from it, never back up.
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let base: i64 = stat
        .rsplit_once(") ")
        .unwrap()
        .1
        .split(' ')
        .nth(16)
        .unwrap()
        .parse()
        .unwrap();
    let model = base.max(12);
    let priority = |prefix: &str| -> Vec<(i64, i64)> {
        all.iter()
            .filter(|(n, ..)| n.starts_with(prefix))
            .map(|t| (t.1, t.2))
            .collect()
    };
    // The worker joins the class once the model is loaded (on the CPU).
    assert_eq!(
        priority("gw-semantic"),
        vec![(model, SCHED_IDLE)],
        "{all:?}"
    );
    let pool = priority("gw-embed-");
    assert!(
        !pool.is_empty() && pool.iter().all(|&t| t == (model, SCHED_IDLE)),
        "{all:?}"
    );
    // Everything else (the runtime answering requests) keeps its priority and class.
    assert!(
        all.iter()
            .filter(|(n, ..)| !n.starts_with("gw-semantic") && !n.starts_with("gw-embed-"))
            .all(|t| (t.1, t.2) == (base, SCHED_OTHER)),
        "{all:?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_saturated_semantic_layer_is_skipped_not_waited_for() {
    let sim = Sim::zero("sim-small").await;
    let mut c = semantic_config(&sim);
    // Nothing may wait for the model: every semantic lookup is shed (the first question's
    // namespace is empty, so it is not even looked up; the paraphrase is shed).
    c.cache.semantic.max_queue = 0;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    app.semantic_ready().await;
    for text in [
        "How do I learn to cook Italian food at home?",
        "How can I learn to cook Italian food at home?",
    ] {
        let r = app.chat(deterministic(text)).await;
        assert_eq!(r.status(), 200);
        assert_eq!(cache_header(&r), "miss");
    }
    // The exact layer is unaffected.
    let r = app
        .chat(deterministic(
            "How can I learn to cook Italian food at home?",
        ))
        .await;
    assert_eq!(cache_header(&r), "hit-exact");
    let m = app.metrics().await;
    assert!(
        m.contains("gateway_cache_lookups_total{layer=\"semantic\",result=\"skipped\"} 1"),
        "{m}"
    );
    // Neither fresh answer could queue for the index: both counted as dropped.
    for (result, n) in [("dropped", 2), ("indexed", 0)] {
        assert!(
            m.contains(&format!(
                "gateway_cache_semantic_answers_total{{result=\"{result}\"}} {n}\n"
            )),
            "{result}: {m}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn with_redis_a_repeat_hits_on_every_replica() {
    let sim = Sim::zero("sim-small").await;
    let mut c = config(
        vec![replica("s1", &sim.url, "sim-small")],
        vec![replica("l1", &sim.url, "sim-small")],
    );
    c.cache.semantic.model_dir = "/nonexistent/model".into();
    c.cache.redis_urls = vec![e2e::redis_url()];
    let store = e2e::TestStore::new(StoreKind::Sqlite).await.unwrap();
    let a = TestApp::spawn_on(c.clone(), store, true).await;
    let b = TestApp::spawn_on(c.clone(), a.store.reopen().await.unwrap(), false).await;
    // Unique per run: the shared Redis outlives test runs.
    let text = format!("Shared across replicas? {}", uuid::Uuid::new_v4());
    let r = a.chat(deterministic(&text)).await;
    assert_eq!(cache_header(&r), "miss");
    let first: Value = r.json().await.unwrap();
    // The shared copy is written in the background.
    let (other, key, text) = (&b, &a.api_key, &text);
    let second = e2e::eventually(
        "replica b sees a's answer",
        Duration::from_secs(5),
        || async move {
            let r = other.chat_as(key, &deterministic(text)).await;
            (cache_header(&r) == "hit-exact").then_some(r)
        },
    )
    .await;
    assert_eq!(
        cache_header(&second),
        "hit-exact",
        "replica b sees a's answer"
    );
    let second: Value = second.json().await.unwrap();
    assert_eq!(first, second);
    let m = b.metrics().await;
    assert!(
        m.contains("gateway_cache_lookups_total{layer=\"shared\",result=\"hit\"} 1"),
        "{m}"
    );

    // Redis unreachable: a miss within the timeout, and the request is served.
    let mut down = c.clone();
    down.cache.redis_urls = vec!["redis://127.0.0.1:1".into()];
    let d = TestApp::spawn_on(down, a.store.reopen().await.unwrap(), false).await;
    let started = std::time::Instant::now();
    let r = d
        .http
        .post(format!("{}/v1/chat/completions", d.base))
        .bearer_auth(&a.api_key)
        .json(&deterministic("Redis is down"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(cache_header(&r), "miss");
    assert!(started.elapsed() < Duration::from_secs(2));
    for app in [a, b, d] {
        app.stop().await;
    }
}

#[tokio::test]
async fn with_redis_frozen_a_lookup_is_a_miss_within_its_timeout() {
    let redis = e2e::PrivateRedis::start().unwrap();
    let sim = Sim::zero("sim-small").await;
    let mut c = config(
        vec![replica("s1", &sim.url, "sim-small")],
        vec![replica("l1", &sim.url, "sim-small")],
    );
    c.cache.semantic.model_dir = "/nonexistent/model".into();
    c.cache.redis_urls = vec![redis.url.clone()];
    c.cache.redis_timeout_ms = 200;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    let r = app.chat(deterministic("Asked while Redis answers")).await;
    assert_eq!(cache_header(&r), "miss");
    // Frozen (SIGSTOP): the connection stays open and nothing is answered. The lookup is bounded
    // by the cache's own timeout (the connection sets none of its own), so the request is a
    // miss served by the upstream, not a request waiting on Redis.
    redis.pause().unwrap();
    let started = std::time::Instant::now();
    let r = app.chat(deterministic("Asked while Redis is frozen")).await;
    let waited = started.elapsed();
    redis.unpause().unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(cache_header(&r), "miss");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
    app.stop().await;
}

#[tokio::test]
async fn the_semantic_layer_loads_only_once_a_policy_asks_for_it() {
    let sim = Sim::zero("sim-small").await;
    let mut c = semantic_config(&sim);
    c.cache.mode = gateway::cache::CacheMode::Exact;
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    assert!(
        !app.state.cache.semantic_started(),
        "no tenant uses it: no model in memory"
    );
    let (ok, out) = app
        .ctl(&["cache", "set", "--tenant", "acme", "--mode", "semantic"])
        .await;
    assert!(ok, "{out}");
    assert!(app.state.cache.semantic_started());
    app.semantic_ready().await;
    app.stop().await;
}

#[tokio::test]
async fn with_the_semantic_default_the_model_loads_on_the_first_request_that_needs_it() {
    let sim = Sim::zero("sim-small").await;
    let mut c = config(
        vec![replica("s1", &sim.url, "sim-small")],
        vec![replica("l1", &sim.url, "sim-small")],
    );
    c.cache.semantic.model_dir = model_dir();
    // As in the other semantic tests: a loaded machine (CI beside a build) can make an
    // embedding outlast the default 250 ms, and a lookup that waits too long goes on as a miss.
    c.cache.semantic.lookup_timeout_ms = 5_000;
    assert_eq!(c.cache.mode, gateway::cache::CacheMode::Semantic);
    assert!(!c.cache.semantic.preload, "lazy by default");
    let app = TestApp::spawn(c, StoreKind::Sqlite).await;
    // Requests the cache cannot use (sampled) start nothing.
    let r = app.chat(e2e::chat_body("fast", "a sampled question")).await;
    assert_eq!(r.status(), 200);
    assert!(!app.state.cache.semantic_started(), "no model at start");
    // The first cacheable one starts the load and is answered at once (exact layer only).
    let r = app
        .chat(deterministic("What is the capital of France?"))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_header(&r), "miss");
    assert!(app.state.cache.semantic_started());
    app.semantic_ready().await;
    // Then a new question is indexed, and its paraphrase is answered from it.
    let r = app
        .chat(deterministic(
            "How can I learn to cook Italian food at home?",
        ))
        .await;
    assert_eq!(cache_header(&r), "miss");
    let r = app
        .chat(deterministic(
            "How do I learn to cook Italian food at home?",
        ))
        .await;
    assert_eq!(cache_header(&r), "hit-semantic");
    app.stop().await;
}

#[tokio::test]
async fn cache_show_says_what_each_precision_setting_would_answer_of_the_tenants_own_lookups() {
    let (app, _sim) = semantic_app(|c| c.cache.semantic.lookup_timeout_ms = 5_000).await;
    let (ok, out) = app.ctl(&["cache", "show", "--tenant", "acme"]).await;
    assert!(ok, "{out}");
    assert!(
        out.contains("No semantic lookup of this tenant seen"),
        "{out}"
    );
    let questions = [
        "How can I learn to cook Italian food at home?",
        "How do I learn to cook Italian food at home?",
        "What was the IIT JEE 2016 cutoff for general category?",
        "What was the IIT JEE 2017 cutoff for general category?",
        "What is the best way to learn Python?",
        "How should I start learning Python programming?",
    ];
    let mut answered = 0;
    for q in questions {
        let r = app.chat(deterministic(q)).await;
        assert_eq!(r.status(), 200);
        if cache_header(&r) == "hit-semantic" {
            answered += 1;
        }
    }
    assert!(answered >= 1, "the paraphrase pair hits at the default");
    let (ok, out) = app
        .ctl(&["--json", "cache", "show", "--tenant", "acme"])
        .await;
    assert!(ok, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let cal = &v["calibration"];
    assert_eq!(cal["lookups"], 6, "{cal}");
    assert!(cal["without_candidate"].as_u64().unwrap() >= 1, "{cal}");
    let settings = cal["settings"].as_array().unwrap();
    let precisions: Vec<f64> = settings
        .iter()
        .map(|s| s["min_precision"].as_f64().unwrap())
        .collect();
    assert_eq!(precisions, vec![0.8, 0.85, 0.9, 0.95]);
    let hits: Vec<u64> = settings
        .iter()
        .map(|s| s["semantic_hits"].as_u64().unwrap())
        .collect();
    // A stricter setting never answers more.
    assert!(hits.windows(2).all(|w| w[0] >= w[1]), "{hits:?}");
    // At the setting in force (0.9) it counts exactly the semantic hits the tenant got.
    assert_eq!(hits[2], answered, "{cal}");
    let rate = settings[2]["semantic_hit_rate"].as_f64().unwrap();
    assert!((rate - answered as f64 / 6.0).abs() < 1e-9);
    // The table says the same to a person.
    let (ok, out) = app.ctl(&["cache", "show", "--tenant", "acme"]).await;
    assert!(ok && out.contains("0.9 (in force)"), "{out}");
    app.stop().await;
}
