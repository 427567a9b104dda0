//! Request bodies: typed views of the known fields, checked with the failing field named, over
//! the JSON object that is forwarded (unknown fields untouched); token estimates and the
//! canonical fingerprint.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{from_value, json_object, Endpoint};
use crate::error::ApiError;
use crate::tokens::Tokenizer;

#[derive(Deserialize)]
struct CommonView<'a> {
    model: &'a str,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptionsView>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    user: Option<&'a str>,
}

/// Longest accepted `model` name, in bytes: it is stored in the ledger and echoed in errors.
pub const MAX_MODEL_LEN: usize = 256;
/// Longest accepted `user`, in bytes: it becomes the ledger's `user` tag.
pub const MAX_USER_LEN: usize = 256;
/// Most choices one request may ask for (`n`), as OpenAI allows.
pub const MAX_CHOICES: u32 = 128;

#[derive(Deserialize)]
struct StreamOptionsView {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct MessageView<'a> {
    role: Role,
    #[serde(default, borrow)]
    content: Option<ContentView<'a>>,
    #[serde(default)]
    tool_calls: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    function_call: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
    Function,
}

#[derive(Deserialize)]
#[serde(untagged)]
#[expect(dead_code, reason = "parsed only to validate the shape")]
enum ContentView<'a> {
    Text(&'a str),
    Parts(Vec<PartView<'a>>),
}

/// One content part: an object with a `type`.
#[derive(Deserialize)]
#[expect(dead_code, reason = "parsed only to validate the shape")]
struct PartView<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
}

#[derive(Deserialize)]
struct ChatView<'a> {
    #[serde(borrow)]
    messages: Vec<MessageView<'a>>,
}

/// A prompt or embedding input: a string, strings, token ids, or arrays of token ids.
#[derive(Deserialize)]
#[serde(untagged)]
#[expect(dead_code, reason = "parsed only to validate the shape")]
enum PromptView<'a> {
    Text(&'a str),
    Texts(Vec<&'a str>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
#[expect(dead_code, reason = "parsed only to validate the shape")]
struct CompletionView<'a> {
    #[serde(borrow)]
    prompt: PromptView<'a>,
}

#[derive(Deserialize)]
#[expect(dead_code, reason = "parsed only to validate the shape")]
struct EmbeddingView<'a> {
    #[serde(borrow)]
    input: PromptView<'a>,
}

/// A validated request, ready to forward.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    /// Which endpoint.
    pub endpoint: Endpoint,
    /// The body as parsed (unknown fields included); `model` is rewritten per upstream.
    body: Map<String, Value>,
    /// The body as received.
    raw: Bytes,
    /// Whether `body` asks a stream for usage where `raw` does not.
    usage_added: bool,
    /// The `max_tokens` written into `body` by a clamp.
    clamp: Option<u64>,
    /// Client-facing model name.
    pub model: String,
    /// Whether the client asked for SSE.
    pub stream: bool,
    /// Whether the client itself asked for the usage chunk.
    pub client_wants_usage: bool,
    /// `max_completion_tokens` or `max_tokens`, if given.
    pub max_tokens: Option<u32>,
    /// Size of the body as received, bytes.
    pub body_bytes: usize,
    /// The last upstream encoding: (upstream model, body bytes).
    encoded: Option<(String, Bytes)>,
}

impl ParsedRequest {
    /// The prompt as the text a model server's prefix cache keys on, in order: the tools, then
    /// the messages (or the prompt of a completion). A request that continues another's
    /// conversation starts with the same bytes. Empty for embeddings (nothing is cached there).
    pub fn prefix_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let fields: &[&str] = match self.endpoint {
            Endpoint::Chat => &["tools", "messages"],
            Endpoint::Completions => &["prompt"],
            Endpoint::Embeddings => &[],
        };
        for f in fields {
            if let Some(v) = self.body.get(*f) {
                // Serialising cannot fail for a parsed Value.
                let _ = serde_json::to_writer(&mut out, v);
            }
        }
        out
    }

    /// Parse and validate a body for `endpoint`.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, ApiError> {
        Self::parse_bytes(endpoint, Bytes::copy_from_slice(body))
    }

    /// [`Self::parse`], keeping `raw` (the client's bytes) without a copy.
    pub fn parse_bytes(endpoint: Endpoint, raw: Bytes) -> Result<Self, ApiError> {
        let body_bytes = raw.len();
        let body = json_object(&raw)?;
        let value = Value::Object(body);
        if value.get("model").is_none() {
            return Err(ApiError::invalid("model", "missing required field `model`"));
        }
        let common: CommonView = from_value(&value)?;
        if common.model.is_empty() {
            return Err(ApiError::invalid("model", "`model` must not be empty"));
        }
        if common.model.len() > MAX_MODEL_LEN {
            return Err(ApiError::invalid(
                "model",
                format!("`model` is longer than {MAX_MODEL_LEN} bytes"),
            ));
        }
        if common.n == Some(0) {
            return Err(ApiError::invalid("n", "`n` must be at least 1"));
        }
        if common.n.is_some_and(|n| n > MAX_CHOICES) {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be at most {MAX_CHOICES}"),
            ));
        }
        for (field, value) in [
            ("max_tokens", common.max_tokens),
            ("max_completion_tokens", common.max_completion_tokens),
        ] {
            if value == Some(0) {
                return Err(ApiError::invalid(
                    field,
                    format!("`{field}` must be at least 1"),
                ));
            }
        }
        if common.user.is_some_and(|u| u.len() > MAX_USER_LEN) {
            return Err(ApiError::invalid(
                "user",
                format!("`user` is longer than {MAX_USER_LEN} bytes"),
            ));
        }
        match endpoint {
            Endpoint::Chat => {
                if value.get("messages").is_none() {
                    return Err(ApiError::invalid(
                        "messages",
                        "missing required field `messages`",
                    ));
                }
                let chat: ChatView = from_value(&value)?;
                if chat.messages.is_empty() {
                    return Err(ApiError::invalid(
                        "messages",
                        "`messages` must not be empty",
                    ));
                }
                for (i, m) in chat.messages.iter().enumerate() {
                    // Only an assistant turn that calls a tool may come without content.
                    let calls = m.tool_calls.is_some() || m.function_call.is_some();
                    if m.content.is_none() && !(matches!(m.role, Role::Assistant) && calls) {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content"),
                            "missing required field `content` (only an assistant message with \
                             `tool_calls` may omit it)",
                        ));
                    }
                }
            }
            Endpoint::Completions => {
                if value.get("prompt").is_none() {
                    return Err(ApiError::invalid(
                        "prompt",
                        "missing required field `prompt`",
                    ));
                }
                let _: CompletionView = from_value(&value)?;
            }
            Endpoint::Embeddings => {
                if value.get("input").is_none() {
                    return Err(ApiError::invalid("input", "missing required field `input`"));
                }
                let _: EmbeddingView = from_value(&value)?;
                if common.stream == Some(true) {
                    return Err(ApiError::invalid("stream", "embeddings cannot be streamed"));
                }
            }
        }
        let model = common.model.to_owned();
        let stream = common.stream.unwrap_or(false);
        let client_wants_usage = common
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let max_tokens = common.max_completion_tokens.or(common.max_tokens);
        let Value::Object(mut body) = value else {
            unreachable!("constructed from an object above")
        };
        let usage_added = stream && !client_wants_usage;
        if usage_added {
            // Always learn usage from the upstream; the client's choice is applied on the way back.
            let options = body
                .entry("stream_options")
                .or_insert_with(|| Value::Object(Map::new()));
            if !options.is_object() {
                *options = Value::Object(Map::new());
            }
            if let Value::Object(o) = options {
                o.insert("include_usage".into(), Value::Bool(true));
            }
        }
        Ok(Self {
            endpoint,
            model,
            stream,
            client_wants_usage,
            max_tokens,
            body_bytes,
            body,
            raw,
            usage_added,
            clamp: None,
            encoded: None,
        })
    }

    /// The body as parsed (unknown fields included).
    pub fn body(&self) -> &Map<String, Value> {
        &self.body
    }

    /// The body to send upstream: the client's body with `model` replaced by the upstream's name
    /// (and, for streams, `stream_options.include_usage` on; a clamp's `max_tokens`). Where
    /// those are all that changed, that is the client's bytes with them spliced in (no
    /// re-serialising: an agent's history is sent as it came; see [`Self::spliced`]); else the
    /// parsed body written out, once per upstream model, so a retry on a replica of the same
    /// model reuses the bytes.
    pub fn upstream_body(&mut self, upstream_model: &str) -> Bytes {
        if let Some((model, bytes)) = &self.encoded {
            if model == upstream_model {
                return bytes.clone();
            }
        }
        if let Some(bytes) = self.spliced(upstream_model) {
            return bytes;
        }
        self.body
            .insert("model".into(), Value::String(upstream_model.to_owned()));
        let bytes = Bytes::from(serde_json::to_vec(&self.body).unwrap_or_default());
        self.encoded = Some((upstream_model.to_owned(), bytes.clone()));
        bytes
    }

    /// The client's bytes with the upstream's model, and what the gateway adds, spliced in:
    /// `model`'s string replaced; for a stream that did not ask for usage,
    /// `"stream_options":{"include_usage":true}` added before the closing brace (only where the
    /// client sent no `stream_options` of its own); a clamp written over the length field(s)
    /// the client used, or added as `max_tokens`. `None` where a field is duplicated, a key is
    /// written with escapes or `model` is not a string (the parsed body decides then). One
    /// allocation, nothing kept (a second attempt splices again, which is cheaper than keeping
    /// a shared copy).
    fn spliced(&self, upstream_model: &str) -> Option<Bytes> {
        use std::io::Write as _;
        let raw = &self.raw[..];
        let keys = [
            b"model".as_slice(),
            b"stream_options",
            b"max_completion_tokens",
            b"max_tokens",
        ];
        let super::TopLevel { values, close } = super::top_level(raw, keys)?;
        let [model, options, max_completion, max] = values;
        let model = model.filter(|r| raw.get(r.start) == Some(&b'"'))?;
        if self.usage_added && options.is_some() {
            return None;
        }
        // The edits, in the order they apply: a span replaced, or text added at the brace.
        enum Edit {
            Model,
            Clamp(u64),
            Added,
        }
        let mut edits: [Option<(std::ops::Range<usize>, Edit)>; 4] =
            [Some((model, Edit::Model)), None, None, None];
        if let Some(n) = self.clamp {
            edits[1] = max_completion.map(|r| (r, Edit::Clamp(n)));
            edits[2] = max.map(|r| (r, Edit::Clamp(n)));
        }
        let clamp_added = self
            .clamp
            .filter(|_| edits[1].is_none() && edits[2].is_none());
        if self.usage_added || clamp_added.is_some() {
            edits[3] = Some((close..close, Edit::Added));
        }
        edits.sort_by_key(|e| e.as_ref().map_or(usize::MAX, |(r, _)| r.start));
        let mut out = Vec::with_capacity(raw.len() + upstream_model.len() + 64);
        let mut at = 0;
        for (range, edit) in edits.into_iter().flatten() {
            out.extend_from_slice(&raw[at..range.start]);
            // Writing into a Vec cannot fail.
            match edit {
                Edit::Model => {
                    let _ = serde_json::to_writer(&mut out, upstream_model);
                }
                Edit::Clamp(n) => {
                    let _ = write!(out, "{n}");
                }
                Edit::Added => {
                    // After the last value (the object has one: `model`).
                    if self.usage_added {
                        out.extend_from_slice(br#","stream_options":{"include_usage":true}"#);
                    }
                    if let Some(n) = clamp_added {
                        let _ = write!(out, r#","max_tokens":{n}"#);
                    }
                }
            }
            at = range.end;
        }
        out.extend_from_slice(&raw[at..]);
        Some(Bytes::from(out))
    }

    /// Bound the completion length: write `max_tokens` into the field(s) the client used
    /// (`max_completion_tokens` and/or `max_tokens`; `max_tokens` when it used neither).
    pub fn set_max_tokens(&mut self, max_tokens: u64) {
        let mut wrote = false;
        for field in ["max_completion_tokens", "max_tokens"] {
            if let Some(v) = self.body.get_mut(field) {
                *v = Value::from(max_tokens);
                wrote = true;
            }
        }
        if !wrote {
            self.body
                .insert("max_tokens".into(), Value::from(max_tokens));
        }
        self.max_tokens = Some(u32::try_from(max_tokens).unwrap_or(u32::MAX));
        self.clamp = Some(max_tokens);
        self.encoded = None;
    }

    /// How many completions one request generates (`n`, or `best_of` for completions).
    pub fn choices(&self) -> u64 {
        ["n", "best_of"]
            .iter()
            .filter_map(|f| self.body.get(*f).and_then(Value::as_u64))
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// Fingerprint of the request: the body with `model` as the client named it, minus the fields
    /// that do not change the answer (`stream`, `stream_options`, `user`), keys in sorted order,
    /// whole floats written as integers. Streamed into the hash: nothing of the body is copied
    /// (the parsed body's keys are already in order, so `endpoint` and `model` are merged in
    /// as it is written).
    pub fn fingerprint(&self) -> String {
        use serde::ser::SerializeMap as _;
        use sha2::Digest as _;

        struct View<'a> {
            body: &'a Map<String, Value>,
            /// Sorted, and sorted among the body's keys by the same byte order.
            added: [(&'a str, &'a str); 2],
        }
        impl serde::Serialize for View<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut m = s.serialize_map(None)?;
                let mut added = self.added.iter().peekable();
                for (k, v) in self.body {
                    if matches!(
                        k.as_str(),
                        "stream" | "stream_options" | "user" | "model" | "endpoint"
                    ) {
                        continue;
                    }
                    while let Some((ak, av)) = added.next_if(|(ak, _)| *ak < k.as_str()) {
                        m.serialize_entry(ak, av)?;
                    }
                    m.serialize_entry(k, &Canon(v))?;
                }
                for (ak, av) in added {
                    m.serialize_entry(ak, av)?;
                }
                m.end()
            }
        }
        let view = View {
            body: &self.body,
            added: [
                ("endpoint", self.endpoint.label()),
                ("model", self.model.as_str()),
            ],
        };
        let mut hasher = HashWriter(sha2::Sha256::new());
        let _ = serde_json::to_writer(&mut hasher, &view);
        crate::keys::lower_hex(&hasher.0.finalize()[..16])
    }

    /// What the tier router reads: the text of the latest user message (a chat) or the prompt
    /// (a completion; its first string when a list), and whether the request carries tools,
    /// functions or non-text content parts (images, audio).
    pub fn routing_view(&self) -> (String, bool) {
        let non_empty = |k: &str| match self.body.get(k) {
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Null) | None => false,
            Some(_) => true,
        };
        let mut special = non_empty("tools") || non_empty("functions");
        let text = match self.endpoint {
            Endpoint::Chat => {
                let messages = match self.body.get("messages") {
                    Some(Value::Array(m)) => m.as_slice(),
                    _ => &[],
                };
                let mut text = String::new();
                if let Some(last) = messages
                    .iter()
                    .rev()
                    .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
                {
                    match last.get("content") {
                        Some(Value::String(s)) => text.push_str(s),
                        Some(Value::Array(parts)) => {
                            for part in parts {
                                match part.get("type").and_then(Value::as_str) {
                                    Some("text") => {
                                        if let Some(t) = part.get("text").and_then(Value::as_str) {
                                            if !text.is_empty() {
                                                text.push('\n');
                                            }
                                            text.push_str(t);
                                        }
                                    }
                                    _ => special = true,
                                }
                            }
                        }
                        _ => {}
                    }
                }
                text
            }
            Endpoint::Completions | Endpoint::Embeddings => {
                let field = if self.endpoint == Endpoint::Completions {
                    "prompt"
                } else {
                    "input"
                };
                match self.body.get(field) {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(a)) => a
                        .iter()
                        .find_map(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                    _ => String::new(),
                }
            }
        };
        (text, special)
    }

    /// The request's `user` field (OpenAI's end-user id), if any.
    pub fn end_user(&self) -> Option<&str> {
        self.body.get("user").and_then(Value::as_str)
    }

    /// Prompt tokens as the gateway counts them (when the upstream reports none).
    pub fn count_prompt_tokens(&self, tokenizer: &Tokenizer) -> u64 {
        let n = match self.endpoint {
            Endpoint::Chat => match self.body.get("messages") {
                Some(Value::Array(messages)) => tokenizer.count_chat(messages),
                _ => 0,
            },
            Endpoint::Completions => self
                .body
                .get("prompt")
                .map_or(0, |p| count_input(p, tokenizer)),
            Endpoint::Embeddings => self
                .body
                .get("input")
                .map_or(0, |p| count_input(p, tokenizer)),
        };
        n as u64
    }
}

/// Write whole-valued floats as integers (`0.0` → `0`), so equal requests hash equally whatever
/// the client's JSON encoder does with numbers.
/// A JSON value serialized as the fingerprint sees it: whole floats (`1.0`) as integers.
struct Canon<'a>(&'a Value);

impl serde::Serialize for Canon<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap as _, SerializeSeq as _};
        match self.0 {
            Value::Number(n) => match whole(n) {
                Some(i) => s.serialize_i64(i),
                None => n.serialize(s),
            },
            Value::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for i in items {
                    seq.serialize_element(&Canon(i))?;
                }
                seq.end()
            }
            Value::Object(map) => {
                let mut m = s.serialize_map(Some(map.len()))?;
                for (k, v) in map {
                    m.serialize_entry(k, &Canon(v))?;
                }
                m.end()
            }
            other => other.serialize(s),
        }
    }
}

/// `n` as an integer when it is a float with no fractional part, in the exact range.
fn whole(n: &serde_json::Number) -> Option<i64> {
    let f = n
        .as_f64()
        .filter(|f| n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15)?;
    #[expect(
        clippy::cast_possible_truncation,
        reason = "checked whole and in range"
    )]
    Some(f as i64)
}

/// Feeds what serde_json writes into a hash (no copy of the value is made).
pub struct HashWriter(pub sha2::Sha256);

impl std::io::Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        sha2::Digest::update(&mut self.0, buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Rewrite whole floats (`1.0`) as integers, in place (what [`ParsedRequest::fingerprint`]
/// hashes, for callers that keep a canonical copy).
pub fn canonical_numbers(v: &mut Value) {
    match v {
        Value::Number(n) => {
            if let Some(i) = whole(n) {
                *v = Value::from(i);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(canonical_numbers),
        Value::Object(map) => map.values_mut().for_each(canonical_numbers),
        _ => {}
    }
}

fn count_input(input: &Value, tokenizer: &Tokenizer) -> usize {
    match input {
        Value::String(s) => tokenizer.count(s),
        Value::Array(items) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => tokenizer.count(s),
                Value::Number(_) => 1,
                Value::Array(tokens) => tokens.len(),
                _ => 0,
            })
            .sum(),
        _ => 0,
    }
}

/// First 32 hex digits of SHA-256 of `bytes`.
pub fn fingerprint_bytes(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(bytes);
    crate::keys::lower_hex(&digest[..16])
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use crate::openai::GOLDEN_BODIES;
    use serde_json::json;

    fn parse(endpoint: Endpoint, v: Value) -> Result<ParsedRequest, ApiError> {
        ParsedRequest::parse(endpoint, v.to_string().as_bytes())
    }

    #[test]
    fn a_body_of_too_many_objects_is_refused_before_it_is_parsed() {
        let many: Vec<Value> = (0..super::super::MAX_OBJECTS)
            .map(|_| json!({"role": "user", "content": "hi"}))
            .collect();
        let e = parse(Endpoint::Chat, json!({"model": "m", "messages": many})).unwrap_err();
        assert!(e.to_string().contains("JSON objects"), "{e}");
        // Braces inside strings (escaped quotes included) are text, not objects.
        let text = "{\\\"{{{".repeat(super::super::MAX_OBJECTS);
        assert!(parse(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "user", "content": text}]})
        )
        .is_ok());
    }

    #[test]
    fn the_streamed_fingerprint_hashes_the_same_bytes_as_a_canonical_copy() {
        for body in [
            json!({"model": "fast", "temperature": 0.0, "n": 2, "stream": true, "user": "u",
                   "messages": [{"role": "user", "content": "hi", "weight": 1.5}],
                   "endpoint": "sneaky", "a": [1.0, 2, {"z": 3.0}]}),
            json!({"model": "fast", "messages": [{"role": "user", "content": "x"}]}),
            // Keys on either side of the two merged in, by byte order.
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "": 0,
                   "Z": 1, "e": 2, "endpoint0": 3, "endpoinu": 4, "mode": 5, "model0": 6,
                   "zz": 7, "stream": false}),
        ] {
            let req = parse(Endpoint::Chat, body).unwrap();
            let mut canonical = req.body.clone();
            for k in ["stream", "stream_options", "user"] {
                canonical.remove(k);
            }
            canonical.insert("model".into(), Value::String(req.model.clone()));
            canonical.insert("endpoint".into(), Value::String("chat".into()));
            let mut canonical = Value::Object(canonical);
            canonical_numbers(&mut canonical);
            let expected = fingerprint_bytes(&serde_json::to_vec(&canonical).unwrap());
            assert_eq!(req.fingerprint(), expected);
        }
    }

    #[test]
    fn invalid_fields_are_named() {
        let e = parse(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"content": "x"}]}),
        )
        .unwrap_err();
        assert!(
            matches!(&e, ApiError::InvalidRequest { param: Some(p), .. } if p == "messages[0]"),
            "{e:?}"
        );
        let e = parse(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}),
        )
        .unwrap_err();
        assert!(
            matches!(&e, ApiError::InvalidRequest { param: Some(p), .. } if p == "messages[0].role"),
            "{e:?}"
        );
        let e = parse(Endpoint::Chat, json!({"messages": []})).unwrap_err();
        assert!(matches!(&e, ApiError::InvalidRequest { param: Some(p), .. } if p == "model"));
        let e = parse(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}),
        )
        .unwrap_err();
        assert!(matches!(&e, ApiError::InvalidRequest { param: Some(p), .. } if p == "max_tokens"));
        let e = ParsedRequest::parse(Endpoint::Chat, b"{not json").unwrap_err();
        assert!(matches!(e, ApiError::InvalidJson(_)));
        let e = parse(Endpoint::Embeddings, json!({"model": "m"})).unwrap_err();
        assert!(matches!(&e, ApiError::InvalidRequest { param: Some(p), .. } if p == "input"));
    }

    #[test]
    fn unknown_fields_survive_and_usage_is_requested_for_streams() {
        let mut r = parse(
            Endpoint::Chat,
            json!({"model": "fast", "messages": [{"role": "user", "content": "hi"}],
                   "stream": true, "stream_options": {"other": 1}, "brand_new_param": {"x": [1, 2]}}),
        )
        .unwrap();
        assert!(r.stream && !r.client_wants_usage);
        let up: Value = serde_json::from_slice(&r.upstream_body("real-model")).unwrap();
        assert_eq!(up["model"], "real-model");
        assert_eq!(up["brand_new_param"], json!({"x": [1, 2]}));
        assert_eq!(
            up["stream_options"],
            json!({"other": 1, "include_usage": true})
        );
    }

    #[test]
    fn an_unchanged_body_goes_upstream_as_the_client_sent_it_with_the_model_spliced() {
        let raw = r#"{ "messages": [{"role": "user", "content": "say \"model\"", "model": "x"}],
            "model" : "fast", "temperature": 0.50, "extra": {"model": "kept"} }"#;
        let mut r = ParsedRequest::parse(Endpoint::Chat, raw.as_bytes()).unwrap();
        let up = r.upstream_body("real \"model\"");
        assert_eq!(
            std::str::from_utf8(&up).unwrap(),
            raw.replace(r#""model" : "fast""#, r#""model" : "real \"model\"""#),
            "the client's bytes, spacing and float spelling kept"
        );
        // Another replica's model: spliced afresh.
        let up: Value = serde_json::from_slice(&r.upstream_body("other")).unwrap();
        assert_eq!(up["model"], "other");
        // A clamp changes the body: it is written out, with the clamp.
        r.set_max_tokens(5);
        let up: Value = serde_json::from_slice(&r.upstream_body("other")).unwrap();
        assert_eq!(
            (up["model"].clone(), up["max_tokens"].clone()),
            (json!("other"), json!(5))
        );
        assert_eq!(up["extra"], json!({"model": "kept"}));
        // A duplicated model key is not spliced (the parsed body decides).
        let mut d = ParsedRequest::parse(
            Endpoint::Chat,
            br#"{"model":"a","messages":[{"role":"user","content":"hi"}],"model":"fast"}"#,
        )
        .unwrap();
        let up: Value = serde_json::from_slice(&d.upstream_body("real")).unwrap();
        assert_eq!(up["model"], "real");
        // A stream that already asks for usage is sent as it came too.
        let raw = r#"{"model":"fast","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#;
        let mut st = ParsedRequest::parse(Endpoint::Chat, raw.as_bytes()).unwrap();
        assert_eq!(
            std::str::from_utf8(&st.upstream_body("real")).unwrap(),
            raw.replace(r#""fast""#, r#""real""#)
        );
    }

    #[test]
    fn usage_for_a_stream_and_a_clamp_are_spliced_into_the_clients_bytes_too() {
        let msgs = r#""messages": [{"role": "user", "content": "}{\"max_tokens\": 1}"}]"#;
        let cases: [(String, Option<u64>); 6] = [
            // A stream that did not ask for usage: usage added before the brace.
            (
                format!(r#"{{"model": "fast", "stream": true, {msgs}, "temperature": 0.50 }}"#),
                None,
            ),
            // A clamp over the field the client used, and over both when it used both.
            (
                format!(r#"{{"model":"fast","max_tokens": 900 ,{msgs},"temperature": 0.50}}"#),
                Some(7),
            ),
            (
                format!(
                    r#"{{"max_completion_tokens":900,"model":"fast",{msgs},"max_tokens":null,"temperature": 0.50}}"#
                ),
                Some(7),
            ),
            // A clamp where the client set no length: `max_tokens` added; with a stream too.
            (
                format!(r#"{{"model":"fast",{msgs},"temperature": 0.50}}"#),
                Some(7),
            ),
            (
                format!(r#"{{"model":"fast","stream":true,{msgs},"temperature": 0.50}}"#),
                Some(7),
            ),
            // A stream whose own stream_options lack usage: the parsed body is written out.
            (
                format!(
                    r#"{{"model":"fast","stream":true,"stream_options":{{"x":1}},{msgs},"temperature": 0.50}}"#
                ),
                None,
            ),
        ];
        for (i, (raw, clamp)) in cases.iter().enumerate() {
            let mut r = ParsedRequest::parse(Endpoint::Chat, raw.as_bytes()).unwrap();
            if let Some(n) = clamp {
                r.set_max_tokens(*n);
            }
            let up = r.upstream_body("real");
            let text = std::str::from_utf8(&up).unwrap();
            // The same body as the parsed one written out.
            let mut expected = r.body().clone();
            expected.insert("model".into(), json!("real"));
            let got: Value = serde_json::from_slice(&up).unwrap();
            assert_eq!(got, Value::Object(expected), "case {i}: {text}");
            // Spliced: the client's spelling of the float is kept (written out, it is 0.5).
            assert_eq!(text.contains("0.50"), i < 5, "case {i}: {text}");
        }
    }

    /// The fingerprints of [`GOLDEN_BODIES`] as `1a27c9d` stored them in its ledger: the exact
    /// cache's keys (shared through Redis across versions) and the ledger's repeat reports
    /// depend on a request's fingerprint staying the same from one version to the next.
    #[test]
    fn fingerprints_are_the_ones_earlier_versions_stored() {
        let fingerprint = |body: &str| {
            ParsedRequest::parse(Endpoint::Chat, body.as_bytes())
                .unwrap()
                .fingerprint()
        };
        assert_eq!(
            fingerprint(GOLDEN_BODIES[0]),
            "5b0c512092675f04692eebd75b36c71a"
        );
        assert_eq!(
            fingerprint(GOLDEN_BODIES[1]),
            "a9e2e6c358358089d121fe2d8b6accb6"
        );
    }

    #[test]
    fn fingerprints_ignore_key_order_and_delivery_fields_but_not_content() {
        let a = parse(
            Endpoint::Chat,
            json!({"model": "fast", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .unwrap();
        let body = r#"{"messages":[{"content":"hi","role":"user"}],"stream":true,"user":"u1","temperature":0.0,"model":"fast"}"#;
        let b = ParsedRequest::parse(Endpoint::Chat, body.as_bytes()).unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        let c = parse(
            Endpoint::Chat,
            json!({"model": "fast", "temperature": 0, "messages": [{"role": "user", "content": "hi!"}]}),
        )
        .unwrap();
        assert_ne!(a.fingerprint(), c.fingerprint());
        assert_eq!(b.end_user(), Some("u1"));
    }
}
