//! OpenAI wire formats as the gateway needs them.
//!
//! Requests are kept as a JSON object so fields the gateway does not know are forwarded untouched;
//! a typed *view* of the known fields is checked on the side (with the failing field named, e.g.
//! `messages[1].role`). Responses are passed through; [`SseRewriter`] watches a streamed response
//! event by event to learn usage, and drops the usage-only chunk the gateway asked for on the
//! client's behalf.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::tokens::{push_text, Tokenizer};

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
pub fn from_value<'a, T: Deserialize<'a>>(value: &'a Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = format!("invalid field `{path}`: {}", e.inner());
        ApiError::InvalidRequest {
            message,
            param: (path != ".").then_some(path),
        }
    })
}

/// Parse a request body as a JSON object.
pub fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::InvalidJson(
            "the request body must be a JSON object".into(),
        )),
        Err(e) => Err(ApiError::InvalidJson(e.to_string())),
    }
}

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
}

#[derive(Deserialize)]
struct StreamOptionsView {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
#[expect(dead_code, reason = "fields are parsed only to validate their types")]
struct MessageView<'a> {
    role: Role,
    #[serde(default, borrow)]
    content: Option<ContentView<'a>>,
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
    /// The body as received (unknown fields included); `model` is rewritten per upstream.
    pub body: Map<String, Value>,
    /// Client-facing model name.
    pub model: String,
    /// Whether the client asked for SSE.
    pub stream: bool,
    /// Whether the client itself asked for the usage chunk.
    pub client_wants_usage: bool,
    /// `max_completion_tokens` or `max_tokens`, if given.
    pub max_tokens: Option<u32>,
    /// The last upstream encoding: (upstream model, body bytes).
    encoded: Option<(String, Bytes)>,
}

impl ParsedRequest {
    /// Parse and validate a body for `endpoint`.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, ApiError> {
        let body = json_object(body)?;
        let value = Value::Object(body);
        if value.get("model").is_none() {
            return Err(ApiError::invalid("model", "missing required field `model`"));
        }
        let common: CommonView = from_value(&value)?;
        if common.model.is_empty() {
            return Err(ApiError::invalid("model", "`model` must not be empty"));
        }
        if common.n == Some(0) {
            return Err(ApiError::invalid("n", "`n` must be at least 1"));
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
        if stream {
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
            body,
            encoded: None,
        })
    }

    /// The body to send upstream: the client's body with `model` replaced by the upstream's name
    /// (and, for streams, `stream_options.include_usage` on). Encoded once per upstream model, so
    /// a retry on a replica of the same model reuses the bytes.
    pub fn upstream_body(&mut self, upstream_model: &str) -> Bytes {
        if let Some((model, bytes)) = &self.encoded {
            if model == upstream_model {
                return bytes.clone();
            }
        }
        self.body
            .insert("model".into(), Value::String(upstream_model.to_owned()));
        let bytes = Bytes::from(serde_json::to_vec(&self.body).unwrap_or_default());
        self.encoded = Some((upstream_model.to_owned(), bytes.clone()));
        bytes
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
    /// that do not change the answer (`stream`, `stream_options`, `user`), keys in sorted order.
    pub fn fingerprint(&self) -> String {
        let mut canonical = self.body.clone();
        for k in ["stream", "stream_options", "user"] {
            canonical.remove(k);
        }
        canonical.insert("model".into(), Value::String(self.model.clone()));
        canonical.insert(
            "endpoint".into(),
            Value::String(self.endpoint.label().into()),
        );
        let mut canonical = Value::Object(canonical);
        canonical_numbers(&mut canonical);
        fingerprint_bytes(&serde_json::to_vec(&canonical).unwrap_or_default())
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
pub fn canonical_numbers(v: &mut Value) {
    match v {
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|f| n.is_f64() && f.fract() == 0.0) {
                if f.abs() < 9.0e15 {
                    #[expect(
                        clippy::cast_possible_truncation,
                        reason = "checked whole and in range"
                    )]
                    let i = f as i64;
                    *v = Value::from(i);
                }
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
    hex::encode(&digest[..16])
}

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

/// Read `usage` from a whole JSON response body without building the document (the rest of the
/// body is skipped, not allocated). `None` when absent, null or not JSON.
pub fn usage_in_body(body: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<UsageOnly>(body)
        .ok()
        .and_then(|u| u.usage)
        .map(Usage::from)
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

/// Watches an SSE byte stream event by event: learns usage, collects generated text, and drops
/// the usage-only chunk when the client did not ask for it. Events are forwarded byte-for-byte
/// otherwise, as soon as they are complete.
#[derive(Debug)]
pub struct SseRewriter {
    buf: BytesMut,
    forward_usage: bool,
    /// Usage reported by the upstream, if any.
    pub usage: Option<Usage>,
    /// Generated text seen so far.
    pub text: String,
    /// Whether `data: [DONE]` was seen.
    pub done: bool,
    /// Data events seen.
    pub events: u64,
    /// Rebuilds the whole response for the cache, when set.
    pub assembler: Option<StreamAssembler>,
}

impl SseRewriter {
    /// `forward_usage`: whether the client asked for usage itself.
    pub fn new(forward_usage: bool) -> Self {
        Self {
            buf: BytesMut::new(),
            forward_usage,
            usage: None,
            text: String::new(),
            done: false,
            events: 0,
            assembler: None,
        }
    }

    /// Feed upstream bytes; returns the bytes to send to the client now (possibly empty).
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        self.buf.extend_from_slice(chunk);
        let mut out = BytesMut::new();
        while let Some(end) = event_end(&self.buf) {
            let event = self.buf.split_to(end).freeze();
            if let Some(kept) = self.inspect(event) {
                out.extend_from_slice(&kept);
            }
        }
        out.freeze()
    }

    /// The upstream ended: flush whatever partial event remains.
    pub fn finish(&mut self) -> Bytes {
        let rest = self.buf.split().freeze();
        if rest.is_empty() {
            return rest;
        }
        self.inspect(rest).unwrap_or_default()
    }

    fn inspect(&mut self, event: Bytes) -> Option<Bytes> {
        let text = std::str::from_utf8(&event).ok()?;
        let mut data = String::new();
        for line in text.lines() {
            if let Some(d) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(d.strip_prefix(' ').unwrap_or(d));
            }
        }
        if data.is_empty() {
            return Some(event);
        }
        if data.trim() == "[DONE]" {
            self.done = true;
            return Some(event);
        }
        self.events += 1;
        let Ok(mut value) = serde_json::from_str::<Value>(&data) else {
            return Some(event);
        };
        completion_text(&value, &mut self.text);
        if let Some(a) = &mut self.assembler {
            a.push(&value);
        }
        let Some(usage) = usage_of(&value) else {
            return Some(event);
        };
        self.usage = Some(usage);
        if self.forward_usage {
            return Some(event);
        }
        let has_choices = value
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|c| !c.is_empty());
        if !has_choices {
            return None;
        }
        // Usage attached to a content chunk: keep the content, hide the usage.
        if let Value::Object(o) = &mut value {
            o.remove("usage");
        }
        Some(Bytes::from(format!("data: {value}\n\n")))
    }
}

/// Rebuilds the non-streamed response from a streamed one, chunk by chunk, so a streamed answer
/// can be cached and later served to either kind of client. Only plain content is supported: a
/// stream with tool calls, logprobs or non-text content, or one that did not finish every choice,
/// yields nothing.
#[derive(Debug)]
pub struct StreamAssembler {
    endpoint: Endpoint,
    head: Map<String, Value>,
    /// index → (content, finish_reason)
    choices: std::collections::BTreeMap<u64, (String, Option<Value>)>,
    usage: Option<Value>,
    unsupported: bool,
}

impl StreamAssembler {
    /// An assembler for a stream of `endpoint` (chat or completions).
    pub fn new(endpoint: Endpoint) -> Self {
        Self {
            endpoint,
            head: Map::new(),
            choices: std::collections::BTreeMap::new(),
            usage: None,
            unsupported: endpoint == Endpoint::Embeddings,
        }
    }

    /// Take in one parsed chunk.
    pub fn push(&mut self, chunk: &Value) {
        for field in ["id", "created", "model", "system_fingerprint"] {
            if let Some(v) = chunk.get(field) {
                self.head.entry(field).or_insert_with(|| v.clone());
            }
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.usage = Some(u.clone());
        }
        let Some(Value::Array(choices)) = chunk.get("choices") else {
            return;
        };
        for c in choices {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            let entry = self.choices.entry(index).or_default();
            if c.get("logprobs").is_some_and(|l| !l.is_null()) {
                self.unsupported = true;
            }
            let piece = match self.endpoint {
                Endpoint::Chat => {
                    let delta = c.get("delta");
                    for f in ["tool_calls", "function_call", "refusal"] {
                        if delta.and_then(|d| d.get(f)).is_some_and(|v| !v.is_null()) {
                            self.unsupported = true;
                        }
                    }
                    delta.and_then(|d| d.get("content"))
                }
                _ => c.get("text"),
            };
            match piece {
                Some(Value::String(t)) => entry.0.push_str(t),
                None | Some(Value::Null) => {}
                Some(_) => self.unsupported = true,
            }
            if let Some(r) = c.get("finish_reason").filter(|r| !r.is_null()) {
                entry.1 = Some(r.clone());
            }
        }
    }

    /// The equivalent non-streamed response body, when the stream was complete and supported.
    pub fn finish(self) -> Option<Bytes> {
        if self.unsupported
            || self.choices.is_empty()
            || self.choices.values().any(|(_, r)| r.is_none())
        {
            return None;
        }
        let mut out = self.head;
        let (object, choices): (&str, Vec<Value>) = match self.endpoint {
            Endpoint::Chat => (
                "chat.completion",
                self.choices
                    .into_iter()
                    .map(|(index, (content, reason))| {
                        serde_json::json!({"index": index, "logprobs": null, "finish_reason": reason,
                            "message": {"role": "assistant", "content": content}})
                    })
                    .collect(),
            ),
            _ => (
                "text_completion",
                self.choices
                    .into_iter()
                    .map(|(index, (text, reason))| {
                        serde_json::json!({"index": index, "text": text, "logprobs": null,
                            "finish_reason": reason})
                    })
                    .collect(),
            ),
        };
        out.insert("object".into(), Value::from(object));
        out.insert("choices".into(), Value::Array(choices));
        if let Some(u) = self.usage {
            out.insert("usage".into(), u);
        }
        serde_json::to_vec(&out).ok().map(Bytes::from)
    }
}

/// Replay a stored non-streamed response (chat or completions) as an SSE stream, the way an
/// upstream would have streamed it: a role chunk, the content, a finish chunk per choice, the
/// usage chunk when `include_usage`, then `[DONE]`. `None` when `body` is not such a response.
pub fn replay_sse(body: &[u8], endpoint: Endpoint, include_usage: bool) -> Option<Bytes> {
    use serde_json::json;
    let v: Value = serde_json::from_slice(body).ok()?;
    let choices = v.get("choices")?.as_array()?;
    let mut head = Map::new();
    for field in ["id", "created", "model", "system_fingerprint"] {
        if let Some(x) = v.get(field) {
            head.insert(field.into(), x.clone());
        }
    }
    let object = match endpoint {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completions => "text_completion",
        Endpoint::Embeddings => return None,
    };
    head.insert("object".into(), Value::from(object));
    let mut out = BytesMut::new();
    let mut emit = |choices: Value, usage: Option<&Value>| {
        let mut chunk = head.clone();
        chunk.insert("choices".into(), choices);
        if let Some(u) = usage {
            chunk.insert("usage".into(), u.clone());
        }
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(Value::Object(chunk).to_string().as_bytes());
        out.extend_from_slice(b"\n\n");
    };
    for (i, c) in choices.iter().enumerate() {
        let index = c.get("index").cloned().unwrap_or_else(|| Value::from(i));
        let reason = c.get("finish_reason").cloned().unwrap_or(Value::Null);
        match endpoint {
            Endpoint::Chat => {
                let message = c.get("message")?;
                let mut delta = Map::new();
                delta.insert("role".into(), Value::from("assistant"));
                delta.insert(
                    "content".into(),
                    message.get("content").cloned().unwrap_or(Value::Null),
                );
                if let Some(Value::Array(calls)) = message.get("tool_calls") {
                    let calls: Vec<Value> = calls
                        .iter()
                        .enumerate()
                        .map(|(n, call)| {
                            let mut call = call.clone();
                            if let Value::Object(o) = &mut call {
                                o.insert("index".into(), Value::from(n));
                            }
                            call
                        })
                        .collect();
                    delta.insert("tool_calls".into(), Value::Array(calls));
                }
                emit(
                    json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": null}]),
                    None,
                );
                emit(
                    json!([{"index": index, "delta": {}, "logprobs": null, "finish_reason": reason}]),
                    None,
                );
            }
            _ => emit(
                json!([{"index": index, "text": c.get("text").cloned().unwrap_or(Value::from("")),
                        "logprobs": null, "finish_reason": reason}]),
                None,
            ),
        }
    }
    if include_usage {
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            emit(json!([]), Some(u));
        }
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    Some(out.freeze())
}

/// Index just past the first complete event (blank-line terminated) in `buf`.
fn event_end(buf: &[u8]) -> Option<usize> {
    let lf = memchr::memmem::find(buf, b"\n\n").map(|i| i + 2);
    let crlf = memchr::memmem::find(buf, b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(endpoint: Endpoint, v: Value) -> Result<ParsedRequest, ApiError> {
        ParsedRequest::parse(endpoint, v.to_string().as_bytes())
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

    #[test]
    fn a_stream_is_assembled_into_a_response_and_replayed_back() {
        let chunks = [
            json!({"id": "c1", "created": 7, "model": "m", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
            json!({"id": "c1", "created": 7, "model": "m",
                   "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]}),
            json!({"id": "c1", "created": 7, "model": "m",
                   "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]}),
            json!({"id": "c1", "created": 7, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
        ];
        let mut a = StreamAssembler::new(Endpoint::Chat);
        chunks.iter().for_each(|c| a.push(c));
        let body = a.finish().unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], "Hello");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["completion_tokens"], 2);

        for include_usage in [false, true] {
            let sse = replay_sse(&body, Endpoint::Chat, include_usage).unwrap();
            let mut rw = SseRewriter::new(true);
            rw.assembler = Some(StreamAssembler::new(Endpoint::Chat));
            let _ = rw.push(&sse);
            assert!(rw.done);
            assert_eq!(rw.text, "Hello");
            assert_eq!(rw.usage.is_some(), include_usage);
            let again = rw.assembler.take().unwrap().finish().unwrap();
            let w: Value = serde_json::from_slice(&again).unwrap();
            assert_eq!(w["choices"], v["choices"]);
        }

        // Unfinished, tool-calling or logprob streams are not assembled.
        let mut unfinished = StreamAssembler::new(Endpoint::Chat);
        unfinished.push(&chunks[1]);
        assert!(unfinished.finish().is_none());
        let mut tools = StreamAssembler::new(Endpoint::Chat);
        tools.push(
            &json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]},
                                        "finish_reason": "tool_calls"}]}),
        );
        assert!(tools.finish().is_none());

        let mut c = StreamAssembler::new(Endpoint::Completions);
        c.push(
            &json!({"id": "x", "choices": [{"index": 0, "text": "4", "finish_reason": "length"}]}),
        );
        let body = c.finish().unwrap();
        let sse = String::from_utf8(
            replay_sse(&body, Endpoint::Completions, false)
                .unwrap()
                .to_vec(),
        )
        .unwrap();
        assert!(
            sse.contains("\"text\":\"4\"") && sse.ends_with("data: [DONE]\n\n"),
            "{sse}"
        );
    }

    #[test]
    fn rewriter_drops_the_usage_chunk_unless_asked_and_handles_split_events() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,",
            "\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n",
            "data: [DONE]\n\n"
        );
        for forward in [false, true] {
            let mut rw = SseRewriter::new(forward);
            let mut out = Vec::new();
            for piece in stream.as_bytes().chunks(7) {
                out.extend_from_slice(&rw.push(piece));
            }
            out.extend_from_slice(&rw.finish());
            let out = String::from_utf8(out).unwrap();
            assert_eq!(rw.text, "Hello");
            assert!(rw.done);
            assert_eq!(
                rw.usage,
                Some(Usage {
                    prompt_tokens: 5,
                    completion_tokens: 2,
                    cached_tokens: 4
                })
            );
            assert_eq!(out.contains("usage"), forward, "{out}");
            assert!(out.ends_with("data: [DONE]\n\n"));
        }
    }
}
