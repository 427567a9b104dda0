//! Replay the agent-session fixtures (`tests/fixtures/agent-sessions/`) through the guard step
//! in process, and report detection delay and false positives: for each looping session, how
//! many requests after its `loop_start` the first flag came (goal: within 3, i.e. delay ≤ 2);
//! for each progressing one, whether anything was flagged.
//!
//! ```sh
//! cargo run --release -p e2e --example guard_fixtures [-- --exact-only] [--verbose] [--similarity 0.97]
//! ```
//!
//! Near-duplicates use the static table in `models/all-MiniLM-L6-v2` (`gateway embed distill`).

use std::path::Path;
use std::sync::Arc;

use gateway::budget::SystemClock;
use gateway::config::GuardConfig;
use gateway::guard::{memory::MemoryGuard, near::NearDup, Check, Decision, Guard};
use gateway::openai::Endpoint;
use serde_json::Value;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let exact = args.iter().any(|a| a == "--exact-only");
    let verbose = args.iter().any(|a| a == "--verbose");
    let near = if exact {
        None
    } else {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/all-MiniLM-L6-v2");
        let table = embedder::static_embed::StaticEmbedder::load(
            &dir.join("static.bin"),
            &dir.join("tokenizer.json"),
        )?;
        Some(Arc::new(NearDup::with_model(Arc::new(table))))
    };
    let store = gateway::store::open("sqlite::memory:").await?;
    // `--similarity 0.97`: the near-duplicate threshold (default: the configuration's).
    let mut config = GuardConfig::default();
    if let Some(v) = args
        .iter()
        .position(|a| a == "--similarity")
        .and_then(|i| args.get(i + 1))
    {
        config.similarity = v.parse()?;
    }
    let new_guard = || async {
        Ok::<_, anyhow::Error>(
            Guard::new(
                config.clone(),
                Arc::new(MemoryGuard::new(1000, std::time::Duration::from_secs(3600))),
                Arc::clone(&store),
                None,
                Arc::new(SystemClock),
                gateway::metrics::Metrics::new()?,
            )
            .await?
            .with_near(near.clone()),
        )
    };
    // `--unlabelled DIR`: sessions with no label (real transcripts, `bench/real-sessions.py`);
    // every flag is printed for a person to judge.
    if let Some(dir) = args
        .iter()
        .position(|a| a == "--unlabelled")
        .and_then(|i| args.get(i + 1))
    {
        let mut files: Vec<_> = std::fs::read_dir(dir)?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        files.sort();
        let (mut sessions, mut requests, mut flagged) = (0, 0, 0);
        for p in files {
            let f: Value = serde_json::from_slice(&std::fs::read(&p)?)?;
            let name = p.file_stem().and_then(|s| s.to_str()).unwrap_or("?");
            let reqs = e2e::session_requests(&f);
            sessions += 1;
            requests += reqs.len();
            if let Some((i, found)) = replay(&new_guard().await?, name, &reqs).await {
                flagged += 1;
                println!(
                    "FLAGGED {name} at request {i} of {}: {} x{} p{}",
                    reqs.len(),
                    found.what,
                    found.repeats,
                    found.period
                );
            }
        }
        println!(
            "unlabelled: {sessions} sessions, {requests} requests; flagged {flagged} sessions"
        );
        return Ok(());
    }
    let (mut caught, mut late, mut missed, mut early, mut fp, mut progressing, mut looping) =
        (0, 0, 0, 0, 0, 0, 0);
    let mut delays = Vec::new();
    for kind in ["looping", "progressing"] {
        for (name, f) in e2e::agent_sessions(kind) {
            let session = f
                .get("session_id")
                .and_then(Value::as_str)
                .unwrap_or(&name)
                .to_owned();
            let first = replay(&new_guard().await?, &session, &e2e::session_requests(&f)).await;
            if verbose {
                if let Some((i, found)) = &first {
                    println!(
                        "  {name} flagged at {i}: {} x{} p{}",
                        found.what, found.repeats, found.period
                    );
                }
            }
            let first = first.map(|(i, _)| i);
            if kind == "progressing" {
                progressing += 1;
                if let Some(i) = first {
                    fp += 1;
                    println!("FALSE POSITIVE {name} at request {i}");
                }
                continue;
            }
            looping += 1;
            let start = f.get("loop_start").and_then(Value::as_u64).unwrap_or(0) as usize;
            let loop_kind = f.get("loop_kind").and_then(Value::as_str).unwrap_or("?");
            match first {
                Some(i) if i < start => {
                    early += 1;
                    println!("EARLY {name} ({loop_kind}) at {i}, loop_start {start}");
                }
                Some(i) if i - start <= 2 => {
                    caught += 1;
                    delays.push(i - start);
                }
                Some(i) => {
                    late += 1;
                    delays.push(i - start);
                    println!("LATE {name} ({loop_kind}) at {i}, loop_start {start}");
                }
                None => {
                    missed += 1;
                    println!("MISSED {name} ({loop_kind}), loop_start {start}");
                    if verbose {
                        let reqs = e2e::session_requests(&f);
                        for r in reqs.iter().skip(start).take(3) {
                            if let Some(t) = gateway::guard::signals::latest_turn(r) {
                                println!(
                                    "    | {}",
                                    t.text()
                                        .replace('\n', " ⏎ ")
                                        .chars()
                                        .take(400)
                                        .collect::<String>()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    delays.sort_unstable();
    let mean = delays.iter().sum::<usize>() as f64 / delays.len().max(1) as f64;
    println!(
        "looping {looping}: caught within 3 requests {caught}, late {late}, missed {missed}, early {early}; \
         mean delay {mean:.2} requests after loop_start\nprogressing {progressing}: flagged {fp} \
         (false-positive rate {:.1}%)\nnear-duplicates: {}",
        100.0 * fp as f64 / progressing.max(1) as f64,
        if exact { "off" } else { "on" }
    );
    Ok(())
}

/// Send a session's requests through `guard` (each observed as answered); the first flag's
/// request index and what it found.
async fn replay(
    guard: &Guard,
    session: &str,
    requests: &[Vec<Value>],
) -> Option<(usize, gateway::guard::Loop)> {
    let mut first = None;
    for (i, messages) in requests.iter().enumerate() {
        let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
        let fp = gateway::openai::fingerprint_bytes(body.as_bytes());
        let request = gateway::guard::request_hash(&fp);
        // The conversation as the gateway reads it (borrowed views of the body's text where
        // the body is valid).
        let parsed = gateway::openai::ParsedRequest::parse(Endpoint::Chat, body.as_bytes()).ok();
        let views = match &parsed {
            Some(r) => r.messages().unwrap_or_default(),
            None => gateway::openai::Message::of_values(messages),
        };
        let d = guard
            .check(Check {
                tenant_id: "t",
                tenant_name: "t",
                session,
                messages: Some(&views),
                request,
            })
            .await;
        let key = gateway::guard::store::SessionKey::new("t", session);
        guard.observe(&key, request, true, 100).await;
        if let Decision::Flag { found, .. } = d {
            first.get_or_insert((i, found));
        }
    }
    first
}
