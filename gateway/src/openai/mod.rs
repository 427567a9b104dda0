//! OpenAI wire formats as the gateway needs them.
//!
//! Requests are kept as a JSON object so fields the gateway does not know are forwarded untouched;
//! a typed *view* of the known fields is checked on the side (with the failing field named, e.g.
//! `messages[1].role`). Responses are passed through; [`SseRewriter`] watches a streamed response
//! event by event to learn usage, and drops the usage-only chunk the gateway asked for on the
//! client's behalf.
//!
//! - [`request`](ParsedRequest): typed views of request bodies, validation, fingerprints;
//! - [`message`](Message): a chat message as the conversation's readers see it;
//! - `usage`: token usage as reported in responses and chunks;
//! - `sse`: the stream rewriter, the stream assembler (for the cache) and SSE replay.

mod canon;
mod message;
mod request;
mod sse;
mod usage;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;

pub use message::{Call, Message};
pub use request::{canonical_numbers, fingerprint_bytes, HashWriter, ParsedRequest};
pub use sse::{replay_sse, SseRewriter, StreamAssembler};
pub use usage::{completion_text, usage_in_body, usage_of, Usage};

#[cfg(test)]
/// Two bodies as the `openai` Python client's `json.dumps` writes them (floats as `1.0`), with
/// every kind of character serde_json escapes.
pub(crate) const GOLDEN_BODIES: [&str; 2] = [
    r#"{"model": "fast", "temperature": 1.0, "max_tokens": 16, "stream": false, "messages": [{"role": "system", "content": "Be \"brief\".\n\t\u0001\u001f\u007f \u00e9 \ud83d\udc4d"}, {"role": "user", "content": "hi \\ there"}]}"#,
    r#"{"model": "fast", "top_p": 0.7, "seed": -3, "n": 1, "logit_bias": {"50256": -100.0, "1": 2.5}, "messages": [{"role": "user", "content": [{"type": "text", "text": "x\u2028y"}]}], "metadata": {"b": [1, 2.0, null, true], "a": {"z": "\b\f\r"}}}"#,
];

/// The proxied endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat = 0,
    /// `POST /v1/completions`
    Completions = 1,
    /// `POST /v1/embeddings`
    Embeddings = 2,
}

impl Endpoint {
    /// Every endpoint, in discriminant order.
    pub const ALL: [Endpoint; 3] = [Self::Chat, Self::Completions, Self::Embeddings];

    /// Path below the upstream's `/v1` base URL.
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "chat/completions",
            Self::Completions => "completions",
            Self::Embeddings => "embeddings",
        }
    }

    /// Short label for metrics and usage events.
    pub fn label(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::Completions => "completions",
            Self::Embeddings => "embeddings",
        }
    }
}

/// Deserialize `value` as `T` (which may borrow from it), naming the failing field in the error.
/// The path is tracked only to explain a failure: tracking it costs an allocation per field
/// visited, a dozen per ordinary chat request, so a value that deserializes is read once
/// without it.
pub fn from_value<'a, T: Deserialize<'a>>(value: &'a Value) -> Result<T, ApiError> {
    if let Ok(t) = T::deserialize(value) {
        return Ok(t);
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = format!("invalid field `{path}`: {}", e.inner());
        ApiError::InvalidRequest {
            message,
            param: (path != ".").then_some(path),
        }
    })
}

/// Most JSON objects one request body may hold. A parsed object costs several hundred bytes
/// whatever its size (a map node), so a body of tiny objects (130,000 `{"role":"user",
/// "content":"hi"}` messages in 4 MiB) parsed into ~100 MB; at this cap a body's parsed form
/// stays within a small multiple of its size. No real conversation comes near it (each message
/// is one or two objects).
pub const MAX_OBJECTS: usize = 16_384;

/// Each byte of JSON text, with whether it is part of a string literal (its quotes included):
/// one pass, no parsing.
pub fn json_bytes(json: &[u8]) -> impl Iterator<Item = (u8, bool)> + '_ {
    let (mut in_string, mut escaped) = (false, false);
    json.iter().map(move |&b| {
        let inside = in_string || b == b'"';
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else if b == b'"' {
            in_string = true;
        }
        (b, inside)
    })
}

/// The index just past the string literal whose opening quote is at `open`: the next `"` that
/// is not escaped, found with memchr (many bytes at a time); `None` when it is unterminated.
fn string_end(json: &[u8], open: usize) -> Option<usize> {
    string_end_noting(json, open, |_| {})
}

/// [`string_end`], calling `escaped` with the character after each backslash on the way.
fn string_end_noting(json: &[u8], open: usize, mut escaped: impl FnMut(u8)) -> Option<usize> {
    let mut j = open + 1;
    loop {
        let k = memchr::memchr2(b'"', b'\\', json.get(j..)?)?;
        if json[j + k] == b'"' {
            return Some(j + k + 1);
        }
        // An escape: skip the backslash and the character it escapes.
        if let Some(&c) = json.get(j + k + 1) {
            escaped(c);
        }
        j += k + 2;
    }
}

/// JSON objects in `body` (`{` outside strings), counted in one pass before anything is built:
/// outside a string it jumps to the next `"` or `{`, through a string to its closing quote
/// ([`string_end`]; an agent's 80 KB history is mostly long strings), so the count costs a few
/// microseconds, not one branch per byte.
fn object_count(body: &[u8]) -> usize {
    let mut count = 0;
    let mut i = 0;
    while let Some(at) = memchr::memchr2(b'"', b'{', &body[i..]) {
        let at = i + at;
        if body[at] == b'{' {
            count += 1;
            i = at + 1;
        } else {
            match string_end(body, at) {
                Some(end) => i = end,
                // Unterminated: the rest is inside the string.
                None => return count,
            }
        }
    }
    count
}

/// Where some top-level fields of a JSON object are, for splicing new values into a client's
/// bytes (see [`top_level`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopLevel<const N: usize> {
    /// Each key's value (its bytes, quotes included for a string), `None` when absent.
    pub values: [Option<std::ops::Range<usize>>; N],
    /// The object's closing brace.
    pub close: usize,
}

/// Where the top-level fields `keys` of the JSON object `body` are, when each of them appears
/// at most once among its top-level keys and no top-level key is written with escapes (one
/// could spell a key another way); `None` otherwise, or when `body` is not an object. `body`
/// is valid JSON (it parsed); the scan jumps through strings ([`string_end`]).
pub fn top_level<const N: usize>(body: &[u8], keys: [&[u8]; N]) -> Option<TopLevel<N>> {
    let skip_space = |mut j: usize| {
        while body.get(j).is_some_and(u8::is_ascii_whitespace) {
            j += 1;
        }
        j
    };
    let mut values: [Option<std::ops::Range<usize>>; N] = std::array::from_fn(|_| None);
    let start = skip_space(0);
    if body.get(start) != Some(&b'{') {
        return None;
    }
    // The value being read at depth 1: which key's, and where it starts.
    let mut open: Option<(usize, usize)> = None;
    let (mut depth, mut i, mut expect_key) = (0usize, start, false);
    // The value being read ends before `at` (spacing trimmed).
    let end_value = |values: &mut [Option<std::ops::Range<usize>>; N],
                     open: &mut Option<(usize, usize)>,
                     at: usize| {
        if let Some((k, from)) = open.take() {
            let mut to = at;
            while to > from && body[to - 1].is_ascii_whitespace() {
                to -= 1;
            }
            values[k] = Some(from..to);
        }
    };
    while i < body.len() {
        match body[i] {
            b'"' => {
                let end = string_end(body, i)?;
                if depth == 1 && expect_key {
                    let name = &body[i + 1..end - 1];
                    if name.contains(&b'\\') {
                        return None;
                    }
                    let colon = skip_space(end);
                    if body.get(colon) != Some(&b':') {
                        return None;
                    }
                    expect_key = false;
                    let value = skip_space(colon + 1);
                    if let Some(k) = keys.iter().position(|key| *key == name) {
                        if values[k].is_some() {
                            return None;
                        }
                        // Marked as seen at once; its end is set where the value ends.
                        values[k] = Some(value..value);
                        open = Some((k, value));
                    }
                    i = value;
                    continue;
                }
                i = end;
                continue;
            }
            b'{' | b'[' => {
                depth += 1;
                expect_key = depth == 1;
            }
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    end_value(&mut values, &mut open, i);
                    return Some(TopLevel { values, close: i });
                }
            }
            b',' if depth == 1 => {
                end_value(&mut values, &mut open, i);
                expect_key = true;
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Parse a request body as a JSON object.
pub fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let objects = object_count(body);
    if objects > MAX_OBJECTS {
        return Err(ApiError::InvalidRequest {
            message: format!(
                "the request body holds {objects} JSON objects; at most {MAX_OBJECTS} are \
                 accepted (e.g. that many messages)"
            ),
            param: None,
        });
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::InvalidJson(
            "the request body must be a JSON object".into(),
        )),
        Err(e) => Err(ApiError::InvalidJson(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: one byte at a time.
    fn counted_byte_by_byte(body: &[u8]) -> usize {
        json_bytes(body)
            .filter(|&(b, inside)| !inside && b == b'{')
            .count()
    }

    #[test]
    fn objects_are_counted_as_the_byte_by_byte_reference_counts_them() {
        let mut cases: Vec<Vec<u8>> = [
            r#"{"a":{"b":[{},{}]},"s":"{not {an} object"}"#,
            r#"{"s":"an escaped quote \" then {","t":{}}"#,
            r#"{"s":"a backslash \\","t":{}}"#,
            r#"{"s":"\\\"{\\","u":"\u007b"}"#,
            r#"{"unterminated":"{{{"#,
            r#"{"ends with a backslash":"\"#,
            "",
            "{",
            r#""{""#,
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/agent-sessions"
        );
        for kind in ["looping", "progressing"] {
            for entry in std::fs::read_dir(format!("{dir}/{kind}"))
                .into_iter()
                .flatten()
            {
                if let Ok(bytes) = std::fs::read(entry.map(|e| e.path()).unwrap_or_default()) {
                    cases.push(bytes);
                }
            }
        }
        assert!(cases.len() > 50, "the fixtures were read");
        for case in &cases {
            // Every prefix too: cut strings, escapes and objects.
            for end in (0..=case.len()).step_by(case.len() / 97 + 1) {
                let b = &case[..end];
                assert_eq!(
                    object_count(b),
                    counted_byte_by_byte(b),
                    "{}",
                    String::from_utf8_lossy(&b[..b.len().min(120)])
                );
            }
        }
    }

    #[test]
    fn top_level_fields_are_found_only_where_splicing_them_is_safe() {
        fn span(body: &str) -> Option<&str> {
            top_level(body.as_bytes(), [b"model".as_slice()])
                .and_then(|t| t.values[0].clone())
                .filter(|r| body.as_bytes()[r.start] == b'"')
                .map(|r| &body[r])
        }
        assert_eq!(
            span(
                r#"{"messages":[{"model":"inner","content":"\"model\": \"x\""}], "model" : "fast" ,"n":1}"#
            ),
            Some(r#""fast""#)
        );
        assert_eq!(span(r#"{"model":"a\"b"}"#), Some(r#""a\"b""#));
        for refused in [
            r#"{"metadata":{"model":"inner"}}"#,
            r#"{"model":"a","model":"b"}"#,
            r#"{"mod\u0065l":"a","model":"b"}"#,
            r#"{"model":42}"#,
            r#"{"model":"unterminated"#,
            r#"["model","fast"]"#,
        ] {
            assert_eq!(span(refused), None, "{refused}");
        }
        // Any value: numbers, objects, arrays, literals, spacing trimmed; and the closing brace.
        let body = r#" { "a" : 12 , "n": [1, {"b": "}"}], "o" : {"x": null} ,"t":true } "#;
        let Some(t) = top_level(body.as_bytes(), [b"a".as_slice(), b"n", b"o", b"t", b"z"]) else {
            panic!("an object")
        };
        let got: Vec<Option<&str>> = t
            .values
            .iter()
            .map(|r| r.clone().map(|r| &body[r]))
            .collect();
        assert_eq!(
            got,
            [
                Some("12"),
                Some(r#"[1, {"b": "}"}]"#),
                Some(r#"{"x": null}"#),
                Some("true"),
                None
            ]
        );
        assert_eq!(&body[t.close..], "} ");
        assert_eq!(
            top_level(b"{}", [b"a".as_slice()]).map(|t| t.close),
            Some(1)
        );
    }
}
