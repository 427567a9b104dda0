//! `gateway demo --traffic`: a small background client so the live numbers move while you watch:
//! about one request a second through the demo's own API, with the demo key, as three features
//! (`chat` on `auto`, `search` on `smart`, `support-bot` on `fast`), repeats the cache answers,
//! and now and then an agent stuck in a loop (flagged by the guard) and a burst of SDK retries.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// Questions the simulated users ask (repeats are answered by the cache).
const QUESTIONS: [&str; 8] = [
    "How do I reset my password?",
    "What is the refund policy for annual plans?",
    "Summarise the release notes for version 2.4.",
    "How can I export my data to CSV?",
    "Which regions is the service available in?",
    "Explain the difference between the free and the pro plan.",
    "How do I add a teammate to my workspace?",
    "What does error code 4012 mean?",
];

/// One request of the mix, `n` counting from 0.
fn request(n: u64, rng: &mut rand::rngs::StdRng) -> (Value, Vec<(&'static str, String)>) {
    let (model, feature) = match n % 3 {
        0 => ("auto", "chat"),
        1 => ("smart", "search"),
        _ => ("fast", "support-bot"),
    };
    let mut headers = vec![("x-gateway-tags", format!("feature={feature}"))];
    // Every 40th request starts an agent that repeats one failing step five times.
    let phase = n % 40;
    if phase < 5 {
        let mut messages = vec![json!({"role": "user", "content": "Fix the failing test."})];
        for _ in 0..=phase {
            messages.push(json!({"role": "assistant", "content": "Running the test suite again."}));
            messages
                .push(json!({"role": "user", "content": "FAILED tests/test_api.py::test_login"}));
        }
        headers.push(("x-session-id", format!("demo-agent-{}", n / 40)));
        return (
            json!({"model": "fast", "messages": messages, "max_tokens": 64}),
            headers,
        );
    }
    // A burst of SDK retries every 60 requests.
    if n % 60 >= 50 {
        headers.push(("x-stainless-retry-count", (1 + n % 2).to_string()));
    }
    let q = QUESTIONS[rng.random_range(0..QUESTIONS.len())];
    let temperature = if rng.random::<f64>() < 0.7 { 0.0 } else { 0.7 };
    (
        json!({
            "model": model,
            "temperature": temperature,
            "max_tokens": 96,
            "messages": [{"role": "user", "content": q}],
        }),
        headers,
    )
}

/// Send the mix to `base` (`http://127.0.0.1:PORT`) with `key` until the process ends.
pub fn spawn(base: String, key: String) {
    tokio::spawn(async move {
        let http = reqwest::Client::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut n = 0u64;
        loop {
            let (body, headers) = request(n, &mut rng);
            let mut req = http
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth(&key)
                .json(&body);
            for (name, value) in headers {
                req = req.header(name, value);
            }
            if let Ok(r) = req.send().await {
                let _ = r.bytes().await;
            }
            n += 1;
            let pause = 600 + rng.random_range(0..800);
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
    });
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn the_mix_has_each_feature_an_agent_loop_and_retries() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let reqs: Vec<_> = (0..120).map(|n| request(n, &mut rng)).collect();
        let tag = |f: &str| {
            reqs.iter()
                .filter(|(_, h)| {
                    h.iter()
                        .any(|(k, v)| *k == "x-gateway-tags" && v.ends_with(f))
                })
                .count()
        };
        assert!(tag("=chat") > 10 && tag("=search") > 10 && tag("=support-bot") > 10);
        let sessions = reqs
            .iter()
            .filter(|(_, h)| h.iter().any(|(k, _)| *k == "x-session-id"))
            .count();
        assert_eq!(sessions, 15, "5 steps of an agent every 40 requests");
        assert!(reqs
            .iter()
            .any(|(_, h)| h.iter().any(|(k, _)| *k == "x-stainless-retry-count")));
        // The agent's last step repeats the same action and result five times.
        let (agent, _) = &reqs[4];
        assert_eq!(agent["messages"].as_array().unwrap().len(), 11);
    }
}
