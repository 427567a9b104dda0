//! OpenAI wire formats as the gateway needs them.
//!
//! Requests are kept as a JSON object so fields the gateway does not know are forwarded untouched;
//! a typed *view* of the known fields is checked on the side (with the failing field named, e.g.
//! `messages[1].role`). Responses are passed through; [`SseRewriter`] watches a streamed response
//! event by event to learn usage, and drops the usage-only chunk the gateway asked for on the
//! client's behalf.
//!
//! - [`request`](ParsedRequest): typed views of request bodies, validation, fingerprints;
//! - `usage`: token usage as reported in responses and chunks;
//! - `sse`: the stream rewriter, the stream assembler (for the cache) and SSE replay.

mod request;
mod sse;
mod usage;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;

pub use request::{canonical_numbers, fingerprint_bytes, HashWriter, ParsedRequest};
pub use sse::{replay_sse, SseRewriter, StreamAssembler};
pub use usage::{completion_text, usage_in_body, usage_of, Usage};

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

/// JSON objects in `body` (`{` outside strings), counted in one pass before anything is built.
fn object_count(body: &[u8]) -> usize {
    json_bytes(body)
        .filter(|&(b, inside)| !inside && b == b'{')
        .count()
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
