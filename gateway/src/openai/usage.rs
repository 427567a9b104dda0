//! Token usage in responses and stream chunks.

use std::sync::LazyLock;

use memchr::memmem;
use serde::Deserialize;
use serde_json::Value;

use crate::tokens::push_text;

pub use crate::types::Usage;

#[derive(Deserialize)]
struct UsageView {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetailsView>,
}

#[derive(Deserialize)]
struct PromptDetailsView {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl From<UsageView> for Usage {
    fn from(u: UsageView) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0),
        }
    }
}

#[derive(Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<UsageView>,
}

/// Read `usage` from a whole JSON response body without building the document. `None` when
/// absent, null or not JSON.
///
/// Model servers write `usage` as the last member of the answer, so it is looked for there
/// first ([`usage_at_end`]), and only it is parsed: the rest of the body (the answer's text,
/// most of it) is not walked by the parser. Any other body goes through serde whole, which
/// skips what it does not need.
pub fn usage_in_body(body: &[u8]) -> Option<Usage> {
    usage_at_end(body).unwrap_or_else(|| usage_by_parse(body))
}

/// `usage` read by parsing the whole body (serde skips the members it does not need).
fn usage_by_parse(body: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<UsageOnly>(body)
        .ok()
        .and_then(|u| u.usage)
        .map(Usage::from)
}

/// The body's `usage` when it is the last member of the top-level object: `"usage"` occurs
/// once, after `{` or `,`, its value parses and only the object's closing brace follows it.
/// In valid JSON such a `"usage"` is a key (a quote inside a string is escaped) of the object
/// that the body's last brace closes, so this reads what serde reads. `None` (the caller parses
/// the whole body) for anything else, and for a body with `\u` escapes (a key could spell
/// `usage` with them). A body that is not JSON before its closing `usage` member still has it
/// read: that is what the server said the answer cost.
fn usage_at_end(body: &[u8]) -> Option<Option<Usage>> {
    // Searchers made once (making one costs more than searching a short answer).
    static KEY: LazyLock<memmem::Finder<'static>> =
        LazyLock::new(|| memmem::Finder::new(b"\"usage\""));
    static ESCAPE: LazyLock<memmem::Finder<'static>> =
        LazyLock::new(|| memmem::Finder::new(b"\\u"));
    let at = KEY.find(body)?;
    let after = at + KEY.needle().len();
    if KEY.find(&body[after..]).is_some() || ESCAPE.find(body).is_some() {
        return None;
    }
    let before = body[..at].trim_ascii_end();
    if !matches!(before.last(), Some(b'{' | b',')) {
        return None;
    }
    let value = body[after..].trim_ascii_start().strip_prefix(b":")?;
    let mut values = serde_json::Deserializer::from_slice(value).into_iter::<Option<UsageView>>();
    let usage = values.next()?.ok()?;
    if value[values.byte_offset()..].trim_ascii() != b"}" {
        return None;
    }
    Some(usage.map(Usage::from))
}

/// Read `usage` from a JSON response or chunk, when present and not null.
pub fn usage_of(value: &Value) -> Option<Usage> {
    let usage = value.get("usage")?;
    if usage.is_null() {
        return None;
    }
    serde_json::from_value::<UsageView>(usage.clone())
        .ok()
        .map(Usage::from)
}

/// The generated text of a response or chunk (all choices), for counting when no usage comes.
pub fn completion_text(value: &Value, out: &mut String) {
    let Some(Value::Array(choices)) = value.get("choices") else {
        return;
    };
    for c in choices {
        if let Some(text) = c.get("text") {
            push_text(text, out);
        }
        for holder in ["message", "delta"] {
            if let Some(m) = c.get(holder) {
                if let Some(content) = m.get("content") {
                    push_text(content, out);
                }
                if let Some(Value::String(r)) = m.get("reasoning_content") {
                    out.push_str(r);
                }
                if let Some(calls) = m.get("tool_calls") {
                    if !calls.is_null() {
                        out.push_str(&calls.to_string());
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    const TEXTS: [&str; 8] = [
        "Paris.",
        r#"{"usage": {"prompt_tokens": 99}}"#,
        "a \\\"usage\\\": {",
        "}]}],\"usage\":{\"prompt_tokens\":7}",
        "\\\\",
        "\\u0022usage\\u0022",
        "caf\u{e9} \u{1f600}",
        "",
    ];

    fn space(rng: &mut StdRng) -> &'static str {
        ["", " ", "\n  ", "\t"][rng.random_range(0..4)]
    }

    fn usage_member(rng: &mut StdRng) -> String {
        match rng.random_range(0..6) {
            0 => "null".to_owned(),
            1 => "{}".to_owned(),
            2 => format!(
                r#"{{"prompt_tokens":{},"completion_tokens":{},"total_tokens":1}}"#,
                rng.random_range(0..100_000u32),
                rng.random_range(0..100_000u32)
            ),
            3 => format!(
                r#"{{ "completion_tokens" : {} , "prompt_tokens_details" : {{"cached_tokens": {}, "audio_tokens": null}}, "prompt_tokens":{} }}"#,
                rng.random_range(0..100u32),
                rng.random_range(0..100u32),
                rng.random_range(0..100u32)
            ),
            4 => r#"{"prompt_tokens":"12"}"#.to_owned(),
            _ => r#"{"prompt_tokens":3,"prompt_tokens_details":null}"#.to_owned(),
        }
    }

    /// A response body with its members in any order, text that looks like `usage`, a nested
    /// `usage` inside a choice, and a top-level one (or none).
    fn body(rng: &mut StdRng) -> String {
        let text = TEXTS[rng.random_range(0..TEXTS.len())];
        let escaped = serde_json::to_string(text).unwrap_or_default();
        let mut members = vec![
            format!(r#""id":"chatcmpl-{}""#, rng.random_range(0..1000u32)),
            r#""object":"chat.completion""#.to_owned(),
            format!(r#""created":{}"#, rng.random_range(0..2_000_000_000u32)),
            format!(
                r#""choices":[{{"index":0,"message":{{"role":"assistant","content":{escaped}}},{}"finish_reason":"stop"}}]"#,
                if rng.random_bool(0.2) {
                    r#""usage":{"prompt_tokens":5},"#
                } else {
                    ""
                }
            ),
            r#""system_fingerprint":null"#.to_owned(),
        ];
        if rng.random_bool(0.2) {
            members.push(r#""meta":{"usage":[1,{"a":"}"}],"b":[]}"#.to_owned());
        }
        if rng.random_bool(0.9) {
            members.push(format!(r#""usage":{}{}"#, space(rng), usage_member(rng)));
        }
        match rng.random_range(0..10) {
            // `usage` as a value, or as a key spelt with an escape (a duplicate to serde).
            0 => members.push(r#""note":"usage""#.to_owned()),
            1 => members.push(r#""us\u0061ge":{"prompt_tokens":1}"#.to_owned()),
            _ => {}
        }
        for i in (1..members.len()).rev() {
            members.swap(i, rng.random_range(0..=i));
        }
        if rng.random_bool(0.5) {
            // Where servers write it: last.
            if let Some(i) = members.iter().position(|m| m.starts_with(r#""usage""#)) {
                let last = members.len() - 1;
                members.swap(i, last);
            }
        }
        let mut out = String::from(space(rng));
        out.push('{');
        for (i, m) in members.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(space(rng));
            out.push_str(m);
            out.push_str(space(rng));
        }
        out.push('}');
        out.push_str(space(rng));
        out
    }

    #[test]
    fn the_usage_member_is_read_as_a_parse_of_the_whole_body_reads_it() {
        let mut rng = StdRng::seed_from_u64(19);
        let mut at_end = 0;
        for _ in 0..20_000 {
            let b = body(&mut rng);
            assert_eq!(
                usage_in_body(b.as_bytes()),
                usage_by_parse(b.as_bytes()),
                "{b}"
            );
            at_end += usize::from(usage_at_end(b.as_bytes()).is_some());
        }
        // Both ways are taken: the member found at the end, and the whole parse.
        assert!((2_000..18_000).contains(&at_end), "{at_end}");
        let fixed = [
            r#"{"usage":{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":3}}}"#,
            r#"{"choices":[],"usage":null}"#,
            r#"{"choices":[{"usage":{"prompt_tokens":9}}]}"#,
            // Given twice, or spelt with an escape: left to serde (which refuses the duplicate).
            r#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}"#,
            r#"{"us\u0061ge":{"prompt_tokens":4}}"#,
            r#"[{"usage":{"prompt_tokens":1}}]"#,
            "",
            "not json",
        ];
        for b in fixed {
            assert_eq!(
                usage_in_body(b.as_bytes()),
                usage_by_parse(b.as_bytes()),
                "{b}"
            );
        }
        assert_eq!(
            usage_in_body(br#"{"us\u0061ge":{"prompt_tokens":4}}"#).map(|u| u.prompt_tokens),
            Some(4)
        );
    }

    #[test]
    fn a_body_cut_short_or_garbled_is_read_without_a_panic() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..300 {
            let b = body(&mut rng).into_bytes();
            // Cut anywhere: read as serde reads it (nothing, until the cut is past the object).
            for cut in 0..b.len() {
                let short = &b[..cut];
                assert_eq!(usage_in_body(short), usage_by_parse(short), "{short:?}");
            }
            // Bytes flipped: any answer, but no panic.
            let mut garbled = b.clone();
            for _ in 0..4 {
                let i = rng.random_range(0..garbled.len());
                garbled[i] = b"{}[]\",:\\ x"[rng.random_range(0..10)];
            }
            let _ = usage_in_body(&garbled);
        }
        // What the server said it used is read even when the rest of its body is broken.
        let broken = br#"{"x":tru,"usage":{"prompt_tokens":3,"completion_tokens":4}}"#;
        assert_eq!(usage_by_parse(broken), None);
        assert_eq!(
            usage_in_body(broken).map(|u| (u.prompt_tokens, u.completion_tokens)),
            Some((3, 4))
        );
    }
}
