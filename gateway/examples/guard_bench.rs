//! The guard step's cost per request: the in-request loop signal and the session, on a
//! 2-message and a 60-message agent conversation (tool calls with results of a few hundred
//! bytes), as p50 / p99 over many runs.
//!
//! ```sh
//! cargo run --release -p gateway --example guard_bench
//! ```

use std::time::Instant;

use gateway::guard::{session, signals};
use serde_json::{json, Map, Value};

fn conversation(steps: usize) -> Map<String, Value> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Use the tools to fix the bug."}),
        json!({"role": "user", "content": "The parser drops the last field of every record; fix it."}),
    ];
    for i in 0..steps {
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": format!("call_{i}"), "type": "function", "function": {"name": "run",
            "arguments": format!("{{\"cmd\": \"pytest tests/test_parser.py -k case_{i}\"}}")}}]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": format!("call_{i}"),
            "content": format!("============ test session starts at 10:{:02}:{:02} ============\n\
                collected 12 items\n\ntests/test_parser.py ....F.......\n\nFAILED \
                tests/test_parser.py::test_case_{i} - AssertionError: expected 4 fields, got 3\n\
                ======= 1 failed, 11 passed in 0.{:02}s =======", i % 60, (i * 7) % 60, i % 100)}));
    }
    json!({"model": "fast", "messages": messages})
        .as_object()
        .cloned()
        .unwrap_or_default()
}

/// A customer-service chat of `turns` text replies, each answered by the user (the shape whose
/// user messages the guard reads for objections); with `objecting`, the user's answers say the
/// agent is not helping, so the earlier steps are read again.
fn chat(turns: usize, objecting: bool) -> Map<String, Value> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are the support assistant of an online store."}),
        json!({"role": "user", "content": "Hi, I returned a coffee grinder and have not got my money back."}),
    ];
    const ITEMS: [&str; 8] = [
        "kettle", "toaster", "lamp", "rug", "blender", "vase", "chair", "grinder",
    ];
    const STATES: [&str; 4] = [
        "is on its way back to our warehouse",
        "was received and inspected",
        "is waiting for the courier to collect it",
        "was refunded to the card",
    ];
    for i in 0..turns {
        let (item, next) = (ITEMS[i % ITEMS.len()], ITEMS[(i + 1) % ITEMS.len()]);
        messages.push(json!({"role": "assistant", "content": format!(
            "I looked at the {item}: it {} (ticket {}).", STATES[i % STATES.len()], 7000 + 13 * i)}));
        let said = if objecting {
            format!("You're not answering me. What happened to the {item}?")
        } else {
            format!("OK. And the {next}, what about that one?")
        };
        messages.push(json!({"role": "user", "content": said}));
    }
    json!({"model": "fast", "messages": messages})
        .as_object()
        .cloned()
        .unwrap_or_default()
}

fn measure(name: &str, body: &Map<String, Value>) {
    let text = serde_json::to_vec(body).unwrap_or_default();
    let Ok(req) = gateway::openai::ParsedRequest::parse(gateway::openai::Endpoint::Chat, &text)
    else {
        println!("{name}: not a valid chat request");
        return;
    };
    let mut times = Vec::with_capacity(20_000);
    let mut found = 0;
    for _ in 0..20_000 {
        let t = Instant::now();
        let s = session::of(None, "key_bench", &req);
        let messages = req.messages().unwrap_or_default();
        let conversation = signals::Conversation::read(&messages, false);
        if conversation.detect(signals::Detect::default()).is_some() {
            found += 1;
        }
        std::hint::black_box(s);
        times.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    let (p50, p99) = percentiles(&mut times);
    println!(
        "{name}: {} messages, p50 {p50:.1} us, p99 {p99:.1} us ({found} of {} flagged)",
        req.messages().map_or(0, |m| m.len()),
        times.len()
    );
}

/// p50 and p99 of `times`.
fn percentiles(times: &mut [f64]) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    let pct = |p: f64| times[((times.len() as f64 - 1.0) * p) as usize];
    (pct(0.5), pct(0.99))
}

/// The whole step as the pipeline runs it (`Guard::check`, then `Guard::observe` at settle) on
/// the in-process store, each call a new turn of one of `sessions` sessions.
async fn measure_step(sessions: usize, body: &Map<String, Value>) -> anyhow::Result<()> {
    use std::sync::Arc;
    let store = gateway::store::open("sqlite::memory:").await?;
    let config = gateway::config::GuardConfig::default();
    let guard = gateway::guard::Guard::new(
        config.clone(),
        Arc::new(gateway::guard::memory::MemoryGuard::new(
            config.max_sessions,
            std::time::Duration::from_secs(config.session_ttl_secs),
        )),
        store,
        None,
        Arc::new(gateway::budget::SystemClock),
        gateway::metrics::Metrics::new()?,
    )
    .await?;
    // The conversation as the gateway reads it: borrowed views of the body's text.
    let text = serde_json::to_string(&body)?;
    let parsed =
        gateway::openai::ParsedRequest::parse(gateway::openai::Endpoint::Chat, text.as_bytes())?;
    let messages = parsed.messages().unwrap_or_default();
    let ids: Vec<String> = (0..sessions).map(|i| format!("session-{i}")).collect();
    let mut times = Vec::with_capacity(50_000);
    for n in 0..50_000u64 {
        let id = &ids[n as usize % sessions];
        let t = Instant::now();
        let d = guard
            .check(gateway::guard::Check {
                tenant_id: "ten_bench",
                tenant_name: "bench",
                session: id,
                messages: Some(&messages),
                request: n,
            })
            .await;
        let key = gateway::guard::store::SessionKey::new("ten_bench", id);
        guard.observe(&key, n, true, 100).await;
        std::hint::black_box(d);
        times.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    let (p50, p99) = percentiles(&mut times);
    println!(
        "check + observe, {} messages, {sessions} sessions: p50 {p50:.1} us, p99 {p99:.1} us",
        messages.len()
    );
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    measure("2-message request", &conversation(0));
    measure("60-message request", &conversation(29));
    measure("60-message chat", &chat(29, false));
    measure("60-message chat, the user objecting", &chat(29, true));
    for sessions in [1, 10_000] {
        measure_step(sessions, &conversation(0)).await?;
    }
    Ok(())
}
