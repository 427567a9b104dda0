//! Streamed responses: the rewriter that watches an SSE stream event by event, the assembler that
//! rebuilds a whole response from one (for the cache), and the replay of a stored response as
//! SSE.

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value};

use super::{completion_text, usage_of, Endpoint, Usage};

/// Largest SSE event the rewriter holds while waiting for its end, bytes: an upstream that never
/// ends an event cannot grow the gateway's memory without bound.
pub const MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// An upstream event grew past [`MAX_EVENT_BYTES`] without ending.
#[derive(Debug, thiserror::Error)]
#[error("an upstream SSE event exceeded {MAX_EVENT_BYTES} bytes")]
pub struct EventTooLarge;

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

    /// Feed upstream bytes; returns the bytes to send to the client now (possibly empty), or
    /// an error when an unfinished event has grown past [`MAX_EVENT_BYTES`].
    pub fn push(&mut self, chunk: &[u8]) -> Result<Bytes, EventTooLarge> {
        self.buf.extend_from_slice(chunk);
        let mut out = BytesMut::new();
        while let Some(end) = event_end(&self.buf) {
            let event = self.buf.split_to(end).freeze();
            if let Some(kept) = self.inspect(event) {
                out.extend_from_slice(&kept);
            }
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            self.buf.clear();
            return Err(EventTooLarge);
        }
        Ok(out.freeze())
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
    fn an_event_that_never_ends_is_refused_past_the_limit() {
        let mut rw = SseRewriter::new(false);
        let piece = vec![b'x'; 1024 * 1024];
        let mut refused = false;
        for _ in 0..(MAX_EVENT_BYTES / piece.len() + 2) {
            if rw.push(&piece).is_err() {
                refused = true;
                break;
            }
        }
        assert!(refused);
        assert!(rw.buf.is_empty(), "the buffer is released");
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
                out.extend_from_slice(&rw.push(piece).unwrap());
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
