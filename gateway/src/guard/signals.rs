//! Loop signals inside one request: the `messages` array itself shows the agent repeating. No
//! state, so it works on every replica and on the first request that carries the loop.
//!
//! The conversation is read as *steps*: an assistant action (its text, or its tool calls' names
//! and canonical arguments) and what came back before the next assistant turn (tool results,
//! user messages). Texts are normalised first: times, dates, durations, long numbers (7 digits
//! or more: epochs, generated ids), uuids and other hex runs, and the digits inside words mixing
//! letters and digits are masked, whitespace collapsed, so "the same error again at 12:03:44"
//! equals "the same error again at 12:03:51" while "3 failed" and "2 failed" stay different.
//! Tool-call arguments are compared as written, less the spacing between JSON tokens, unmasked
//! (an offset that moves is progress).
//! A loop is the same step
//! [`MIN_REPEATS`] times in a row, or a cycle of two or three steps repeated twice (A-B-A-B).
//! A progressing agent repeats tools too, but its arguments or results change, and then so do
//! its steps.
//!
//! Work is bounded: only the last [`WINDOW`] messages are read, and of a long message only its
//! first and last [`EDGE`] bytes.

use std::borrow::Cow;
use std::hash::{BuildHasher, Hash, Hasher};

use foldhash::fast::{FixedState, FoldHasher};

use serde_json::Value;

/// Identical steps in a row that make a loop.
pub const MIN_REPEATS: usize = 3;
/// Full repetitions of a 2- or 3-step cycle that make a loop.
pub const MIN_CYCLES: usize = 2;
/// Messages read from the end of the conversation.
pub const WINDOW: usize = 64;
/// Bytes read from each end of a long message.
pub const EDGE: usize = 4096;

/// A loop found in one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loop {
    /// How many times the repeating unit occurs at the end of the conversation.
    pub repeats: usize,
    /// Steps in the repeating unit (1: the same step again and again).
    pub period: usize,
    /// What repeats, for people: e.g. "tool call `run_tests`" or "assistant text".
    pub what: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Step {
    fingerprint: u64,
    what: String,
}

/// The loop at the end of `messages`, if any.
pub fn in_request(messages: &[Value]) -> Option<Loop> {
    let steps = steps(&messages[messages.len().saturating_sub(WINDOW)..]);
    let n = steps.len();
    let same = |a: usize, b: usize| steps[a].fingerprint == steps[b].fingerprint;
    // The same step again and again.
    let mut run = 1;
    while run < n && same(n - 1, n - 1 - run) {
        run += 1;
    }
    if n > 0 && run >= MIN_REPEATS {
        return Some(Loop {
            repeats: run,
            period: 1,
            what: steps[n - 1].what.clone(),
        });
    }
    // A cycle of two or three different steps.
    for period in 2..=3 {
        if n < period * MIN_CYCLES {
            continue;
        }
        let unit = n - period..n;
        if unit.clone().all(|i| same(i, n - period)) {
            continue; // one step repeated: the run above
        }
        let mut cycles = 1;
        while (cycles + 1) * period <= n && unit.clone().all(|i| same(i, i - cycles * period)) {
            cycles += 1;
        }
        if cycles >= MIN_CYCLES {
            let what: Vec<&str> = unit.map(|i| steps[i].what.as_str()).collect();
            return Some(Loop {
                repeats: cycles,
                period,
                what: what.join(" / "),
            });
        }
    }
    None
}

/// The steps of `messages`: each assistant turn and what came back after it.
fn steps(messages: &[Value]) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::new();
    let mut current: Option<(FoldHasher, String)> = None;
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if role == "assistant" {
            if let Some((h, what)) = current.take() {
                out.push(Step {
                    fingerprint: h.finish(),
                    what,
                });
            }
            let mut h = FixedState::default().build_hasher();
            let what = action(m, &mut h);
            current = Some((h, what));
        } else if let Some((h, _)) = current.as_mut() {
            // What came back: tool results, or the user's (or a harness's) reply.
            role.hash(h);
            normalised(&text_of(m.get("content")), h);
        }
    }
    if let Some((h, what)) = current {
        out.push(Step {
            fingerprint: h.finish(),
            what,
        });
    }
    out
}

/// Hash an assistant turn's action into `h`; returns what it is, for people.
fn action(m: &Value, h: &mut FoldHasher) -> String {
    let calls = m
        .get("tool_calls")
        .and_then(Value::as_array)
        .filter(|c| !c.is_empty());
    if let Some(calls) = calls {
        let mut names = Vec::new();
        for c in calls {
            let f = c.get("function").unwrap_or(&Value::Null);
            let name = f.get("name").and_then(Value::as_str).unwrap_or("?");
            name.hash(h);
            // Arguments are a JSON string, compared without the spacing between its tokens.
            compact(f.get("arguments").and_then(Value::as_str).unwrap_or(""), h);
            names.push(format!("`{name}`"));
        }
        return format!("tool call {}", names.join(", "));
    }
    if let Some(f) = m.get("function_call") {
        let name = f.get("name").and_then(Value::as_str).unwrap_or("?");
        name.hash(h);
        compact(f.get("arguments").and_then(Value::as_str).unwrap_or(""), h);
        return format!("function call `{name}`");
    }
    normalised(&text_of(m.get("content")), h);
    "assistant reply".to_owned()
}

/// Hash JSON text `json` into `h` without the whitespace outside its strings (a fraction of the
/// cost of parsing it; the same agent writes its keys in the same order).
fn compact(json: &str, h: &mut FoldHasher) {
    let out: Vec<u8> = crate::openai::json_bytes(json.as_bytes())
        .filter(|&(b, inside)| inside || !b.is_ascii_whitespace())
        .map(|(b, _)| b)
        .collect();
    h.write(&out);
    h.write_u8(0xff);
}

/// A message's text: the string, or its text parts joined.
fn text_of(content: Option<&Value>) -> Cow<'_, str> {
    match content {
        Some(Value::String(s)) => Cow::Borrowed(s),
        Some(Value::Array(parts)) => Cow::Owned(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        Some(Value::Null) | None => Cow::Borrowed(""),
        Some(other) => Cow::Owned(other.to_string()),
    }
}

/// Hash `text` into `h` after masking what changes between identical steps (see the module
/// docs); a long text is read at both ends only.
fn normalised(text: &str, h: &mut FoldHasher) {
    let mut out = Vec::with_capacity(text.len().min(2 * EDGE + 4));
    if text.len() > 2 * EDGE {
        let head = floor(text, EDGE);
        let tail = ceil(text, text.len() - EDGE);
        mask(&text[..head], &mut out);
        out.extend_from_slice("…".as_bytes());
        mask(&text[tail..], &mut out);
    } else {
        mask(text, &mut out);
    }
    h.write(&out);
    h.write_u8(0xff);
}

fn floor(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// The masking itself, token by token (runs of ASCII letters and digits, and the separators
/// that join numbers into times and decimals), written to `out`.
fn mask(text: &str, out: &mut Vec<u8>) {
    let b = text.as_bytes();
    let mut i = 0;
    let mut space = false;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            space = true;
            i += 1;
            continue;
        }
        if space {
            out.push(b' ');
            space = false;
        }
        if !c.is_ascii_alphanumeric() {
            out.push(c);
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && b[i].is_ascii_alphanumeric() {
            i += 1;
        }
        let word = &b[start..i];
        let digits = word.iter().filter(|c| c.is_ascii_digit()).count();
        if digits == word.len() {
            // A number; swallow the rest of a time (12:03:44) or a decimal (0.531).
            let mut joined = false;
            while i + 1 < b.len() && matches!(b[i], b':' | b'.') && b[i + 1].is_ascii_digit() {
                i += 1;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
                joined = true;
            }
            if joined || word.len() >= 7 {
                out.extend_from_slice(b"<n>");
            } else {
                out.extend_from_slice(word);
            }
        } else if digits > 0 && word.len() >= 4 && word.iter().all(u8::is_ascii_hexdigit) {
            // A hex run: a uuid's groups, a hash, a generated id.
            out.extend_from_slice(b"<id>");
        } else if digits > 0 {
            // Letters and digits (`30Z`, `01T10`, `req42x`): the digits are masked.
            let mut in_digits = false;
            for &c in word {
                if c.is_ascii_digit() {
                    if !in_digits {
                        out.push(b'#');
                    }
                    in_digits = true;
                } else {
                    out.push(c);
                    in_digits = false;
                }
            }
        } else {
            out.extend_from_slice(word);
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, args: Value) -> Value {
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": name, "arguments": args.to_string()}}]})
    }

    fn result(text: &str) -> Value {
        json!({"role": "tool", "tool_call_id": "c", "content": text})
    }

    fn session<S: AsRef<str>>(steps: &[(Value, S)]) -> Vec<Value> {
        let mut m = vec![
            json!({"role": "system", "content": "You are a coding agent."}),
            json!({"role": "user", "content": "Fix the failing test."}),
        ];
        for (a, r) in steps {
            m.push(a.clone());
            m.push(result(r.as_ref()));
        }
        m
    }

    #[test]
    fn the_same_call_with_the_same_result_three_times_is_a_loop() {
        let step = (
            call("run_tests", json!({"path": "tests/"})),
            "FAILED test_x: 1 failed",
        );
        let m = session(&[step.clone(), step.clone()]);
        assert_eq!(in_request(&m), None, "twice is not yet a loop");
        let m = session(&[step.clone(), step.clone(), step]);
        let l = in_request(&m).unwrap();
        assert_eq!((l.repeats, l.period), (3, 1));
        assert_eq!(l.what, "tool call `run_tests`");
    }

    #[test]
    fn timestamps_ids_and_durations_do_not_hide_a_repeat() {
        let steps: Vec<(Value, String)> = (0..3)
            .map(|i| {
                (
                    call("check_job", json!({"job": "build"})),
                    format!(
                        "2026-12-01T10:0{i}:3{i}Z job 550e840{i}-e29b-41d4-a716-44665544000{i} \
                         still failing after 0.5{i}s (epoch 176452800{i})"
                    ),
                )
            })
            .collect();
        assert!(in_request(&session(&steps)).is_some());
    }

    #[test]
    fn arguments_differing_only_in_spacing_are_the_same_call() {
        let raw = |args: &str| {
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c",
                "type": "function", "function": {"name": "grep", "arguments": args}}]})
        };
        let steps = [
            (raw(r#"{"pattern": "fn main", "path": "src/"}"#), "no match"),
            (raw(r#"{"pattern":"fn main","path":"src/"}"#), "no match"),
            (
                raw("{\n  \"pattern\": \"fn main\",\n  \"path\": \"src/\"\n}"),
                "no match",
            ),
        ];
        assert!(in_request(&session(&steps)).is_some());
        // Spacing inside a string is part of the argument.
        let steps = [
            (raw(r#"{"pattern": "fn main"}"#), "no match"),
            (raw(r#"{"pattern": "fn  main"}"#), "no match"),
            (raw(r#"{"pattern": "fn   main"}"#), "no match"),
        ];
        assert!(in_request(&session(&steps)).is_none());
    }

    #[test]
    fn an_a_b_a_b_cycle_is_a_loop() {
        let a = (call("open_file", json!({"path": "a.py"})), "def f(): pass");
        let b = (
            call("edit_file", json!({"path": "a.py", "text": "x"})),
            "SyntaxError line 3",
        );
        let l = in_request(&session(&[a.clone(), b.clone(), a, b])).unwrap();
        assert_eq!((l.repeats, l.period), (2, 2));
    }

    #[test]
    fn progress_is_not_a_loop() {
        // Running the tests again after each edit, with a different outcome each time.
        let steps = [
            (call("run_tests", json!({})), "3 failed, 7 passed"),
            (call("edit_file", json!({"path": "a.py", "line": 10})), "ok"),
            (call("run_tests", json!({})), "2 failed, 8 passed"),
            (call("edit_file", json!({"path": "a.py", "line": 42})), "ok"),
            (call("run_tests", json!({})), "1 failed, 9 passed"),
        ];
        assert_eq!(in_request(&session(&steps)), None);
        // Paging through a file (below and beyond line 1000): same tool, moving argument.
        let pages = |from: i64| -> Vec<(Value, String)> {
            (from..from + 6)
                .map(|i| {
                    (
                        call("read_file", json!({"path": "big.py", "offset": i * 100})),
                        format!("lines {}-{}", i * 100, i * 100 + 99),
                    )
                })
                .collect()
        };
        assert_eq!(in_request(&session(&pages(0))), None);
        assert_eq!(in_request(&session(&pages(10))), None);
        // Polling a job that moves on.
        let polls: Vec<(Value, String)> = (1..=5)
            .map(|i| {
                (
                    call("job_status", json!({"id": "j1"})),
                    format!("{}% done", i * 20),
                )
            })
            .collect();
        assert_eq!(in_request(&session(&polls)), None);
    }

    #[test]
    fn a_chat_agent_given_the_same_format_error_again_and_again_is_a_loop() {
        let mut m = vec![json!({"role": "user", "content": "Answer in JSON."})];
        for _ in 0..3 {
            m.push(json!({"role": "assistant", "content": "Sure! Here is the answer: yes"}));
            m.push(json!({"role": "user", "content": "Your reply was not valid JSON. Try again."}));
        }
        assert!(in_request(&m).is_some());
    }

    #[test]
    fn a_huge_conversation_is_read_in_bounded_work() {
        let big = "x".repeat(32 * 1024);
        let mut m = Vec::new();
        for i in 0..2000 {
            m.push(json!({"role": "assistant", "content": format!("part {}", i % 997)}));
            m.push(json!({"role": "user", "content": big.clone()}));
        }
        let t = std::time::Instant::now();
        assert_eq!(in_request(&m), None);
        // The last 64 messages, 8 KiB of each at most: microseconds, not the 64 MiB given.
        assert!(
            t.elapsed() < std::time::Duration::from_millis(50),
            "{:?}",
            t.elapsed()
        );
    }
}
