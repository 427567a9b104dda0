//! Request bodies: typed views of the known fields, checked with the failing field named, over
//! the JSON object that is forwarded (unknown fields untouched); token estimates and the
//! canonical fingerprint.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::OnceLock;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{from_value, json_object, Endpoint, Message};
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
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
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

/// A chat body's known fields, read from its text (no tree): what a valid request needs, and
/// where its conversation's root is. Stricter than the tree's views (a duplicated known field,
/// an escaped content part's `type`, a message or `metadata` written as an array: the tree
/// decides those), never looser. Its own struct rather than `CommonView` flattened into one:
/// serde's `flatten` buffers every field, the cost this reader exists to avoid.
#[derive(Deserialize)]
struct ChatText<'a> {
    #[serde(borrow)]
    model: Cow<'a, str>,
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
    best_of: Option<serde_json::Number>,
    #[serde(default, borrow)]
    user: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    metadata: Option<ObjectOnly<MetadataText<'a>>>,
    #[serde(borrow)]
    messages: Vec<ObjectOnly<MessageText<'a>>>,
    #[serde(default, borrow)]
    tools: Option<&'a RawValue>,
    #[serde(default, borrow)]
    functions: Option<&'a RawValue>,
    #[serde(default, borrow)]
    temperature: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct MessageText<'a> {
    role: Role,
    #[serde(default, borrow)]
    content: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    tool_calls: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    function_call: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    name: Option<&'a RawValue>,
}

/// A member's text when present, `null` included (an `Option`'s own reading takes `null` for
/// absent, where the tree keeps it).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// Whether a list member offers anything, as [`ParsedRequest::has_tools`] reads it: a non-empty
/// list, or any value but `null`.
fn offered(member: Option<&RawValue>) -> bool {
    member.is_some_and(|m| match m.get().as_bytes() {
        [b'[', rest @ ..] => rest.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b']'),
        b"null" => false,
        _ => true,
    })
}

/// Whether a member is given: present and not `null`.
fn given(member: Option<&RawValue>) -> bool {
    member.is_some_and(|m| m.get() != "null")
}

impl Role {
    fn as_str(&self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
            Role::Function => "function",
        }
    }
}

/// Where one message's members are in the client's text (see [`super::Message`]).
#[derive(Debug, Clone)]
struct MessageSpans {
    role: &'static str,
    content: Option<Span>,
    tool_calls: Option<Span>,
    function_call: Option<Span>,
    name: Option<Span>,
}

/// A byte range of the client's text.
#[derive(Debug, Clone, Copy)]
struct Span(u32, u32);

impl Span {
    /// Where `part` (a slice of `text`) is in it.
    fn of(part: &str, text: &str) -> Option<Self> {
        let start = (part.as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
        Some(Self(
            u32::try_from(start).ok()?,
            u32::try_from(start + part.len()).ok()?,
        ))
    }

    fn range(self) -> Range<usize> {
        self.0 as usize..self.1 as usize
    }
}

#[derive(Deserialize)]
struct MetadataText<'a> {
    #[serde(default, borrow)]
    session_id: Option<Cow<'a, str>>,
}

/// `T` read only from a JSON object (serde's derived structs also accept an array, by
/// position, where the tree's `get` finds nothing).
struct ObjectOnly<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for ObjectOnly<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Visit<T> {
            type Value = ObjectOnly<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<Self::Value, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(ObjectOnly)
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// What a chat body read from its text keeps of it: where each message's members are (the
/// conversation's root, [`ParsedRequest::write_conversation_root`], is among them), its
/// `metadata.session_id`, and the two reads of the cache's policy.
#[derive(Debug, Clone)]
struct Root {
    metadata_session_id: Option<String>,
    /// Every message's members.
    messages: Vec<MessageSpans>,
    /// Whether the request offers tools or functions ([`ParsedRequest::has_tools`]).
    tools: bool,
    /// Whether `temperature` is exactly 0 ([`ParsedRequest::deterministic`]).
    deterministic: bool,
    /// Where the top-level fields in [`NOTED`] are, noted by the canonical walk.
    noted: super::TopLevel<6>,
    /// Whether the upstream body may be spliced at `noted` (no top-level key written with
    /// escapes: as [`super::top_level`] would say).
    spliceable: bool,
}

/// The top-level fields the canonical walk notes: those the upstream body splices
/// ([`ParsedRequest::upstream_body`]), then those prefix affinity reads
/// ([`ParsedRequest::prefix_bytes`]).
const NOTED: [&str; 6] = [
    "model",
    "stream_options",
    "max_completion_tokens",
    "max_tokens",
    "tools",
    "messages",
];

/// A validated request, ready to forward.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    /// Which endpoint.
    pub endpoint: Endpoint,
    /// The body as parsed (unknown fields included), with what the gateway changed (usage asked
    /// of a stream, a clamp; `model` rewritten per upstream when the bytes cannot be spliced).
    /// A chat body is read from its text and this tree built only for the steps that walk it
    /// (the loop check, the cache, the router, a token count, prefix affinity).
    body: OnceLock<Map<String, Value>>,
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
    /// The first 16 bytes of the SHA-256 of the canonical body ([`Self::fingerprint`]).
    fingerprint: [u8; 16],
    /// The `user` field.
    user: Option<String>,
    /// How many completions the request generates ([`Self::choices`]), when read from the
    /// text (a tree answers when asked).
    choices: Option<u64>,
    /// Where the conversation's root is in `raw`, for a body read from its text.
    root: Option<Root>,
}

/// Top-level fields that do not change the answer, left out of the fingerprint (`model` and
/// `endpoint` are merged in as the client named them).
const FINGERPRINT_SKIP: [&str; 5] = ["stream", "stream_options", "user", "model", "endpoint"];

impl ParsedRequest {
    /// The prompt as the text a model server's prefix cache keys on, in order: the tools, then
    /// the messages (or the prompt of a completion). A request that continues another's
    /// conversation starts with the same bytes. Empty for embeddings (nothing is cached there).
    pub fn prefix_bytes(&self) -> Vec<u8> {
        if let Some(out) = self.prefix_from_text() {
            return out;
        }
        let mut out = Vec::new();
        let fields: &[&str] = match self.endpoint {
            Endpoint::Chat => &["tools", "messages"],
            Endpoint::Completions => &["prompt"],
            Endpoint::Embeddings => &[],
        };
        for f in fields {
            if let Some(v) = self.body().get(*f) {
                // Serialising cannot fail for a parsed Value.
                let _ = serde_json::to_writer(&mut out, v);
            }
        }
        out
    }

    /// [`Self::prefix_bytes`] of a chat read from its text: `tools` and `messages` written as
    /// serde_json writes their parsed values, straight from the client's bytes (where the
    /// canonical walk noted them), without building the tree.
    fn prefix_from_text(&self) -> Option<Vec<u8>> {
        let [.., tools, messages] = &self.root.as_ref()?.noted.values;
        // Checked as UTF-8 when it was read; checked again here rather than trusted.
        let text = std::str::from_utf8(&self.raw).ok()?;
        let mut out = Vec::with_capacity(self.raw.len());
        for range in [tools, messages].into_iter().flatten() {
            super::canon::Writer::new(text, false).value(range.clone(), &mut out)?;
        }
        Some(out)
    }

    /// Parse and validate a body for `endpoint`.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, ApiError> {
        Self::parse_bytes(endpoint, Bytes::copy_from_slice(body))
    }

    /// [`Self::parse`], keeping `raw` (the client's bytes) without a copy. A chat body is read
    /// from its text where that reads exactly as its tree would ([`Self::read_chat_text`]);
    /// anything else, and every invalid body, is parsed into a tree, whose views name what is
    /// wrong.
    pub fn parse_bytes(endpoint: Endpoint, raw: Bytes) -> Result<Self, ApiError> {
        if endpoint == Endpoint::Chat {
            if let Some(req) = Self::read_chat_text(raw.clone()) {
                return Ok(req);
            }
        }
        Self::parse_tree(endpoint, raw)
    }

    /// A valid chat body read from its text: its known fields by borrowed views, its
    /// fingerprint written canonically straight from the text ([`super::canon`]), where its
    /// conversation's root is. `None` for anything the tree might read differently or refuse
    /// (the tree then decides): a known field twice, a message or `metadata` written as an
    /// array, a number or string serde_json would refuse, too many objects.
    fn read_chat_text(raw: Bytes) -> Option<Self> {
        let text = std::str::from_utf8(&raw).ok()?;
        let mut view: ChatText = serde_json::from_str(text).ok()?;
        check_common(
            &view.model,
            view.n,
            view.max_tokens,
            view.max_completion_tokens,
            view.user.as_deref(),
        )
        .ok()?;
        if view.messages.is_empty() {
            return None;
        }
        // The first system and first user message's content, as the tree's `find` sees them.
        let at = |m: Option<&RawValue>| match m {
            None => Some(None),
            Some(m) => Span::of(m.get(), text).map(Some),
        };
        // Each message's spans, collected into the allocation its view was read into.
        let messages = std::mem::take(&mut view.messages)
            .into_iter()
            .map(|ObjectOnly(m)| {
                let span = match m.content {
                    Some(c) => {
                        let c = c.get();
                        let shaped = match c.as_bytes().first() {
                            Some(b'"') => true,
                            Some(b'[') => serde_json::from_str::<Vec<PartView>>(c).is_ok(),
                            _ => false,
                        };
                        if !shaped {
                            return None;
                        }
                        Some(Span::of(c, text)?)
                    }
                    None => {
                        let calls = given(m.tool_calls) || given(m.function_call);
                        if !(matches!(m.role, Role::Assistant) && calls) {
                            return None;
                        }
                        None
                    }
                };
                Some(MessageSpans {
                    role: m.role.as_str(),
                    content: span,
                    tool_calls: at(m.tool_calls)?,
                    function_call: at(m.function_call)?,
                    name: at(m.name)?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        let model = view.model.into_owned();
        let edits = super::canon::Edits {
            skip: &FINGERPRINT_SKIP,
            add: &[("endpoint", Endpoint::Chat.label()), ("model", &model)],
        };
        let mut hasher = HashWriter(sha2::Digest::new());
        let (noted, spliceable) = super::canon::Writer::new(text, true).object(
            edits,
            NOTED,
            &mut Vec::with_capacity(text.len()),
            &mut hasher,
        )?;
        let stream = view.stream.unwrap_or(false);
        let client_wants_usage = view
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let choices = [
            view.n.map(u64::from),
            view.best_of.as_ref().and_then(serde_json::Number::as_u64),
        ];
        Some(Self {
            endpoint: Endpoint::Chat,
            body: OnceLock::new(),
            usage_added: stream && !client_wants_usage,
            clamp: None,
            model,
            stream,
            client_wants_usage,
            max_tokens: view.max_completion_tokens.or(view.max_tokens),
            body_bytes: raw.len(),
            encoded: None,
            fingerprint: first16(hasher.0),
            user: view.user.map(Cow::into_owned),
            choices: Some(choices.into_iter().flatten().max().unwrap_or(1).max(1)),
            root: Some(Root {
                metadata_session_id: view
                    .metadata
                    .and_then(|ObjectOnly(m)| m.session_id)
                    .map(Cow::into_owned),
                messages,
                tools: offered(view.tools) || offered(view.functions),
                // A number serde_json refuses sent the body to the tree (the canonical walk).
                deterministic: view
                    .temperature
                    .and_then(|t| serde_json::from_str::<f64>(t.get()).ok())
                    .is_some_and(|t| t == 0.0),
                noted,
                spliceable,
            }),
            raw,
        })
    }

    /// Parse `raw` into a tree and validate it by views over the tree, naming the failing field:
    /// the reference reading, whatever the endpoint (the text reader is held equal to it).
    pub fn parse_tree(endpoint: Endpoint, raw: Bytes) -> Result<Self, ApiError> {
        let body_bytes = raw.len();
        let body = json_object(&raw)?;
        let value = Value::Object(body);
        if value.get("model").is_none() {
            return Err(ApiError::invalid("model", "missing required field `model`"));
        }
        let common: CommonView = from_value(&value)?;
        check_common(
            common.model,
            common.n,
            common.max_tokens,
            common.max_completion_tokens,
            common.user,
        )?;
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
        let user = common.user.map(str::to_owned);
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
            ask_usage(&mut body);
        }
        let fingerprint = tree_fingerprint(&body, endpoint, &model);
        Ok(Self {
            endpoint,
            model,
            stream,
            client_wants_usage,
            max_tokens,
            body_bytes,
            body: OnceLock::from(body),
            raw,
            usage_added,
            clamp: None,
            encoded: None,
            fingerprint,
            user,
            choices: None,
            root: None,
        })
    }

    /// The body as parsed (unknown fields included), built from the client's bytes on first
    /// use.
    pub fn body(&self) -> &Map<String, Value> {
        self.body.get_or_init(|| self.tree())
    }

    /// The client's body parsed, with what the gateway changed since (as `body` holds it).
    fn tree(&self) -> Map<String, Value> {
        // The text was read whole (and checked to read as this tree does) when it was parsed.
        let mut body = serde_json::from_slice(&self.raw).unwrap_or_default();
        if self.usage_added {
            ask_usage(&mut body);
        }
        if let Some(n) = self.clamp {
            write_clamp(&mut body, n);
        }
        body
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
        let mut body = self.body.take().unwrap_or_else(|| self.tree());
        body.insert("model".into(), Value::String(upstream_model.to_owned()));
        let bytes = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
        self.body = OnceLock::from(body);
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
        // Noted when the body was read from its text; else found by a scan of its top level.
        let found = match &self.root {
            Some(root) => root.spliceable.then(|| root.noted.clone()),
            None => super::top_level(raw, NOTED.map(str::as_bytes)),
        };
        let super::TopLevel {
            values: [model, options, max_completion, max, ..],
            close,
        } = found?;
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
        if let Some(body) = self.body.get_mut() {
            write_clamp(body, max_tokens);
        }
        self.max_tokens = Some(u32::try_from(max_tokens).unwrap_or(u32::MAX));
        self.clamp = Some(max_tokens);
        self.encoded = None;
    }

    /// How many completions one request generates (`n`, or `best_of` for completions).
    pub fn choices(&self) -> u64 {
        self.choices.unwrap_or_else(|| {
            ["n", "best_of"]
                .iter()
                .filter_map(|f| self.body().get(*f).and_then(Value::as_u64))
                .max()
                .unwrap_or(1)
                .max(1)
        })
    }

    /// Fingerprint of the request: the body with `model` as the client named it, minus the fields
    /// that do not change the answer (`stream`, `stream_options`, `user`), keys in sorted order,
    /// whole floats written as integers; the first 16 bytes of its SHA-256 in hex. Made once, at
    /// parse.
    pub fn fingerprint(&self) -> String {
        crate::keys::lower_hex(&self.fingerprint)
    }

    /// Writes the conversation's root as a derived session hashes it: for a chat, the first
    /// system message's and the first user message's `content` (as serde_json writes the parsed
    /// value), each followed by a zero byte; else the prompt.
    pub fn write_conversation_root(&self, h: &mut HashWriter) {
        use std::io::Write as _;
        if let Some(root) = self.root_text() {
            let _ = h.write_all(&root);
            return;
        }
        let body = self.body();
        match body.get("messages") {
            Some(Value::Array(messages)) => {
                let first = |role: &str| {
                    messages
                        .iter()
                        .find(|m| m.get("role").and_then(Value::as_str) == Some(role))
                        .and_then(|m| m.get("content"))
                };
                for part in [first("system"), first("user")] {
                    if let Some(v) = part {
                        let _ = serde_json::to_writer(&mut *h, v);
                    }
                    let _ = h.write_all(&[0]);
                }
            }
            _ => {
                if let Some(p) = body.get("prompt") {
                    let _ = serde_json::to_writer(&mut *h, p);
                }
            }
        }
    }

    /// [`Self::write_conversation_root`]'s bytes, written from the text of a body read that way.
    fn root_text(&self) -> Option<Vec<u8>> {
        let root = self.root.as_ref()?;
        let mut out = Vec::new();
        for role in ["system", "user"] {
            let first = root.messages.iter().find(|m| m.role == role);
            if let Some(span) = first.and_then(|m| m.content) {
                // Only the part's own bytes are checked as text (not the whole body again).
                let text = std::str::from_utf8(&self.raw[span.range()]).ok()?;
                super::canon::Writer::new(text, false).value(0..text.len(), &mut out)?;
            }
            out.push(0);
        }
        Some(out)
    }

    /// The request's `metadata.session_id`, when a string.
    pub fn metadata_session_id(&self) -> Option<&str> {
        match &self.root {
            Some(root) => root.metadata_session_id.as_deref(),
            None => self
                .body()
                .get("metadata")
                .and_then(|m| m.get("session_id"))
                .and_then(Value::as_str),
        }
    }

    /// What the tier router reads: the text of the latest user message (a chat) or the prompt
    /// (a completion; its first string when a list), and whether the request carries tools,
    /// functions or non-text content parts (images, audio).
    pub fn routing_view(&self) -> (String, bool) {
        let (text, other_parts) = match self.endpoint {
            Endpoint::Chat => {
                // The last user message (read from the client's text where the body was).
                let messages = self.messages().unwrap_or_default();
                messages
                    .iter()
                    .rev()
                    .find(|m| m.role() == "user")
                    .map(Message::routed_text)
                    .unwrap_or_default()
            }
            Endpoint::Completions | Endpoint::Embeddings => {
                let field = if self.endpoint == Endpoint::Completions {
                    "prompt"
                } else {
                    "input"
                };
                let text = match self.body().get(field) {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(a)) => a
                        .iter()
                        .find_map(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                    _ => String::new(),
                };
                (text, false)
            }
        };
        // A request with tools, or with a part that is not text, is `special`.
        (text, self.has_tools() || other_parts)
    }

    /// A chat's messages as the steps that read a conversation see them: borrowed from the
    /// client's text for a body read that way (each member decoded when asked; no tree is
    /// built), else the tree's. `None` when not a chat, or when `messages` is not a list.
    pub fn messages(&self) -> Option<Vec<Message<'_>>> {
        if self.endpoint != Endpoint::Chat {
            return None;
        }
        if let Some(root) = &self.root {
            let raw = &self.raw[..];
            let at = |s: Option<Span>| s.map(|s| &raw[s.range()]);
            return Some(
                root.messages
                    .iter()
                    .map(|m| {
                        Message::of_text(
                            m.role,
                            at(m.name),
                            at(m.content),
                            at(m.tool_calls),
                            at(m.function_call),
                        )
                    })
                    .collect(),
            );
        }
        match self.body().get("messages") {
            Some(Value::Array(m)) => Some(Message::of_values(m)),
            _ => None,
        }
    }

    /// Whether the request offers the model tools or functions (a non-empty list, or any value
    /// but `null`).
    pub fn has_tools(&self) -> bool {
        if let Some(root) = &self.root {
            return root.tools;
        }
        ["tools", "functions"]
            .iter()
            .any(|f| match self.body().get(*f) {
                Some(Value::Array(a)) => !a.is_empty(),
                Some(Value::Null) | None => false,
                Some(_) => true,
            })
    }

    /// Whether `temperature` is present and exactly 0.
    pub fn deterministic(&self) -> bool {
        if let Some(root) = &self.root {
            return root.deterministic;
        }
        self.body()
            .get("temperature")
            .and_then(Value::as_f64)
            .is_some_and(|t| t == 0.0)
    }

    /// The request's `user` field (OpenAI's end-user id), if any.
    pub fn end_user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// Prompt tokens as the gateway counts them (when the upstream reports none).
    pub fn count_prompt_tokens(&self, tokenizer: &Tokenizer) -> u64 {
        let mut unbounded = usize::MAX;
        self.count_prompt_tokens_within(tokenizer, &mut unbounded)
            .unwrap_or_default()
    }

    /// [`Self::count_prompt_tokens`] tokenizing at most `fresh` bytes of text not counted
    /// before ([`Tokenizer::count_within`]); `None` when it would need more.
    pub fn count_prompt_tokens_within(
        &self,
        tokenizer: &Tokenizer,
        fresh: &mut usize,
    ) -> Option<u64> {
        let n = match self.endpoint {
            Endpoint::Chat => match self.messages() {
                Some(m) => tokenizer.count_chat_within(&m, fresh)?,
                None => 0,
            },
            Endpoint::Completions => match self.body().get("prompt") {
                Some(p) => count_input(p, tokenizer, fresh)?,
                None => 0,
            },
            Endpoint::Embeddings => match self.body().get("input") {
                Some(p) => count_input(p, tokenizer, fresh)?,
                None => 0,
            },
        };
        Some(n as u64)
    }
}

/// The checks of the fields every endpoint shares, beyond their types.
fn check_common(
    model: &str,
    n: Option<u32>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    user: Option<&str>,
) -> Result<(), ApiError> {
    if model.is_empty() {
        return Err(ApiError::invalid("model", "`model` must not be empty"));
    }
    if model.len() > MAX_MODEL_LEN {
        return Err(ApiError::invalid(
            "model",
            format!("`model` is longer than {MAX_MODEL_LEN} bytes"),
        ));
    }
    if n == Some(0) {
        return Err(ApiError::invalid("n", "`n` must be at least 1"));
    }
    if n.is_some_and(|n| n > MAX_CHOICES) {
        return Err(ApiError::invalid(
            "n",
            format!("`n` must be at most {MAX_CHOICES}"),
        ));
    }
    for (field, value) in [
        ("max_tokens", max_tokens),
        ("max_completion_tokens", max_completion_tokens),
    ] {
        if value == Some(0) {
            return Err(ApiError::invalid(
                field,
                format!("`{field}` must be at least 1"),
            ));
        }
    }
    if user.is_some_and(|u| u.len() > MAX_USER_LEN) {
        return Err(ApiError::invalid(
            "user",
            format!("`user` is longer than {MAX_USER_LEN} bytes"),
        ));
    }
    Ok(())
}

/// Ask a stream for its usage: the gateway always learns usage from the upstream (the client's
/// choice is applied on the way back).
fn ask_usage(body: &mut Map<String, Value>) {
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

/// Write a clamp into the length field(s) the client used (`max_completion_tokens` and/or
/// `max_tokens`; `max_tokens` when it used neither).
fn write_clamp(body: &mut Map<String, Value>, max_tokens: u64) {
    let mut wrote = false;
    for field in ["max_completion_tokens", "max_tokens"] {
        if let Some(v) = body.get_mut(field) {
            *v = Value::from(max_tokens);
            wrote = true;
        }
    }
    if !wrote {
        body.insert("max_tokens".into(), Value::from(max_tokens));
    }
}

/// The first 16 bytes of a hash.
fn first16(hasher: sha2::Sha256) -> [u8; 16] {
    use sha2::Digest as _;
    let mut out = [0; 16];
    out.copy_from_slice(&hasher.finalize()[..16]);
    out
}

/// [`ParsedRequest::fingerprint`] of a body parsed into a tree: streamed into the hash, nothing
/// of the body copied (the tree's keys are already in order, so `endpoint` and `model` are
/// merged in as it is written).
fn tree_fingerprint(body: &Map<String, Value>, endpoint: Endpoint, model: &str) -> [u8; 16] {
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
                if FINGERPRINT_SKIP.contains(&k.as_str()) {
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
        body,
        added: [("endpoint", endpoint.label()), ("model", model)],
    };
    let mut hasher = HashWriter(sha2::Sha256::new());
    let _ = serde_json::to_writer(&mut hasher, &view);
    first16(hasher.0)
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
pub(super) fn whole(n: &serde_json::Number) -> Option<i64> {
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

fn count_input(input: &Value, tokenizer: &Tokenizer, fresh: &mut usize) -> Option<usize> {
    match input {
        Value::String(s) => tokenizer.count_within(s, fresh),
        Value::Array(items) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => tokenizer.count_within(s, fresh),
                Value::Number(_) => Some(1),
                Value::Array(tokens) => Some(tokens.len()),
                _ => Some(0),
            })
            .sum(),
        _ => Some(0),
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
            let mut canonical = req.body().clone();
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

    /// A chat body with its members in any order and spacing: unknown fields of every JSON
    /// kind (floats, escapes, nested objects with unsorted and duplicated keys), messages of
    /// every role and content shape, and the fields the gateway reads, sometimes of a type or
    /// shape the text reader leaves to the tree.
    fn random_chat(rng: &mut rand::rngs::StdRng) -> String {
        use rand::Rng as _;
        const TEXTS: [&str; 8] = [
            "hi",
            "Be \"brief\".\n\t\u{1}",
            "caf\u{e9} \u{1f44d} \u{2028}",
            "back\\slash / slash",
            "",
            "{\"not\": [\"json\"]}",
            "\u{7f}",
            "a\u{0}b",
        ];
        fn pick<'a>(rng: &mut rand::rngs::StdRng, from: &[&'a str]) -> &'a str {
            from[rng.random_range(0..from.len())]
        }
        let text = |rng: &mut rand::rngs::StdRng| {
            let t = pick(rng, &TEXTS);
            if rng.random_bool(0.2) {
                // Escaped where it need not be.
                t.chars()
                    .map(|c| format!("\\u{:04x}", u32::from(c) & 0xffff))
                    .collect::<String>()
                    .pipe_quoted()
            } else {
                serde_json::to_string(t).unwrap()
            }
        };
        let number = |rng: &mut rand::rngs::StdRng| {
            pick(
                rng,
                &[
                    "0",
                    "1",
                    "-3",
                    "2.0",
                    "0.50",
                    "1e2",
                    "-0",
                    "-0.0",
                    "12345678901234567890",
                    "1.5E-3",
                    "100000000000000000000",
                    "9007199254740993.0",
                ],
            )
            .to_owned()
        };
        let space = |rng: &mut rand::rngs::StdRng| pick(rng, &["", "", " ", "\n  ", "\t"]);
        let content = |rng: &mut rand::rngs::StdRng| {
            match rng.random_range(0..11) {
            0 => format!(
                r#"[{{"type":"text","text":{}}},{{"text":"x","type":"image_url","image_url":{{"url":"u","detail":1.0}}}}]"#,
                text(rng)
            ),
            1 => "[]".to_owned(),
            2 => "null".to_owned(),
            3 => r#"[{"type":"te\u0078t","text":"y"}]"#.to_owned(),
            4 => r#"[{"type":"text","text":"a","text":"b"},{"type":"text","text":1},{"type":"text","text":"c"}]"#.to_owned(),
            5 => format!(
                r#"[{{"type":"text","text":{}}},{{"type":"text","text":{}}}]"#,
                text(rng),
                text(rng)
            ),
            // A part of another kind with a `text` too (the router reads it as not text).
            6 => r#"[{"type":"input_audio","input_audio":{"data":"eA=="},"text":"heard"},{"type":"text","text":"t"}]"#.to_owned(),
            _ => text(rng),
        }
        };
        let message = |rng: &mut rand::rngs::StdRng| {
            let role = pick(
                rng,
                &["system", "user", "user", "assistant", "tool", "developer"],
            );
            let mut members = vec![
                format!(r#""role":"{role}""#),
                format!(r#""content":{}"#, content(rng)),
            ];
            if role == "assistant" && rng.random_bool(0.4) {
                let calls = pick(
                    rng,
                    &[
                        r#""tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]"#,
                        r#""tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]"#,
                        r#""tool_calls":[{"id":"c1","function":{"arguments":"{\"b\": 1, \"a\": [2.0]}","name":"read_file","name":"g"}},{"function":7},{"id":"c3"},"x"]"#,
                        r#""tool_calls":[{"type":"function","function":{"n\u0061me":"run","arguments":{"cmd":"ls"}}}]"#,
                        r#""tool_calls":[]"#,
                        r#""tool_calls":null"#,
                        r#""function_call":{"name":"lookup","arguments":"{\"q\":\"x\"}"}"#,
                        r#""function_call":null"#,
                        r#""function_call":{"name":5}"#,
                    ],
                );
                // Calls given instead of content; `null` ones beside it (as some clients send).
                if !calls.ends_with("null") {
                    members.pop();
                }
                members.push(calls.to_owned());
            }
            if rng.random_bool(0.1) {
                members.push(format!(r#""name":{}"#, text(rng)));
            }
            if rng.random_bool(0.02) {
                members.push(r#""name":5"#.to_owned());
            }
            if rng.random_bool(0.015) {
                members.push(r#""content":"again""#.to_owned());
            }
            for i in (1..members.len()).rev() {
                members.swap(i, rng.random_range(0..=i));
            }
            if rng.random_bool(0.01) {
                return format!(r#"["{role}","hi"]"#);
            }
            format!("{{{}}}", members.join(","))
        };
        let mut members = vec![format!(
            r#""model":{}"#,
            pick(rng, &[r#""fast""#, r#""f\u0061st""#, r#""m/\"x\"""#])
        )];
        let n = rng.random_range(1..6);
        let messages: Vec<String> = (0..n).map(|_| message(rng)).collect();
        members.push(format!(r#""messages":[{}]"#, messages.join(",")));
        for (p, member) in [
            (
                0.3,
                format!(r#""stream":{}"#, pick(rng, &["true", "false", "null"])),
            ),
            (
                0.2,
                format!(
                    r#""stream_options":{}"#,
                    pick(
                        rng,
                        &[
                            r#"{"include_usage":true}"#,
                            r#"{"include_usage":false,"x":1.0}"#,
                            "null",
                            "[true]"
                        ]
                    )
                ),
            ),
            (0.3, format!(r#""temperature":{}"#, number(rng))),
            (
                0.2,
                format!(r#""max_tokens":{}"#, pick(rng, &["16", "5.0", "null", "0"])),
            ),
            (
                0.1,
                format!(r#""max_completion_tokens":{}"#, pick(rng, &["32", "7"])),
            ),
            (
                0.2,
                format!(r#""n":{}"#, pick(rng, &["1", "2", "200", "null"])),
            ),
            (
                0.1,
                format!(r#""best_of":{}"#, pick(rng, &["3", "1.5", r#""4""#])),
            ),
            (0.2, format!(r#""user":{}"#, text(rng))),
            (
                0.2,
                format!(
                    r#""metadata":{}"#,
                    pick(
                        rng,
                        &[
                            r#"{"session_id":"s-1","b":[1,2.0],"a":{"z":"\b"}}"#,
                            r#"{"session_id":5}"#,
                            r#"["s"]"#,
                            r#"{"session_id":"","k":1,"k":2}"#
                        ]
                    )
                ),
            ),
            (
                0.3,
                format!(
                    r#""logit_bias":{{"50256":-100.0,"1":2.5,"10":{}}}"#,
                    number(rng)
                ),
            ),
            (
                0.2,
                r#""tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{}}}}]"#.to_owned(),
            ),
            (
                0.1,
                format!(
                    r#""{}":{}"#,
                    pick(rng, &["tools", "functions"]),
                    pick(rng, &["[]", "[ \n]", "null", "{}", r#"[{"name":"f"}]"#, "0"])
                ),
            ),
            (0.1, r#""endpoint":"sneaky""#.to_owned()),
            (0.1, format!(r#""x\u0079":{}"#, text(rng))),
            (0.05, r#""dup":1,"dup":{"b":2,"a":1}"#.to_owned()),
            (0.05, r#""model":"other""#.to_owned()),
            (0.03, r#""big":1e400"#.to_owned()),
        ] {
            if rng.random_bool(p) {
                members.push(member);
            }
        }
        for i in (1..members.len()).rev() {
            members.swap(i, rng.random_range(0..=i));
        }
        let sep = format!("{},{}", space(rng), space(rng));
        format!(
            "{}{{{}{}}}{}",
            space(rng),
            space(rng),
            members.join(&sep),
            space(rng)
        )
    }

    /// What each message reads as.
    fn views(r: &ParsedRequest) -> Option<Vec<String>> {
        let messages = r.messages()?;
        Some(
            messages
                .iter()
                .map(|m| {
                    format!(
                        "{:?}",
                        (
                            m.role(),
                            m.name(),
                            m.text(),
                            m.tool_calls(),
                            m.function_call()
                        )
                    )
                })
                .collect(),
        )
    }

    /// What the loop check reads of the conversation (every step, with its texts).
    fn conversation(r: &ParsedRequest) -> Option<String> {
        let messages = r.messages()?;
        Some(format!(
            "{:?}",
            crate::guard::signals::Conversation::read(&messages, true)
        ))
    }

    /// Quoting for a string of `\u` escapes built by hand.
    trait PipeQuoted {
        fn pipe_quoted(self) -> String;
    }
    impl PipeQuoted for String {
        fn pipe_quoted(self) -> String {
            format!("\"{self}\"")
        }
    }

    /// Everything the gateway reads of a chat body is the same whether the body was read from
    /// its text or parsed into a tree, and the text reader leaves to the tree exactly what the
    /// tree reads differently or refuses.
    #[test]
    fn a_chat_read_from_its_text_reads_as_its_tree() {
        use rand::SeedableRng as _;
        let mut rng = rand::rngs::StdRng::seed_from_u64(19);
        let (mut read, mut valid) = (0, 0);
        let tokens = crate::tokens::Tokenizer::default();
        for _ in 0..20_000 {
            let text = random_chat(&mut rng);
            let raw = Bytes::from(text.clone());
            let fast = ParsedRequest::read_chat_text(raw.clone());
            let tree = ParsedRequest::parse_tree(Endpoint::Chat, raw);
            valid += usize::from(tree.is_ok());
            let Some(mut fast) = fast else { continue };
            read += 1;
            let Ok(mut tree) = tree else {
                panic!("read from the text but refused as a tree: {text}")
            };
            assert!(tree.root.is_none());
            assert_eq!(fast.fingerprint(), tree.fingerprint(), "{text}");
            assert_eq!(fast.model, tree.model, "{text}");
            assert_eq!(
                (
                    fast.stream,
                    fast.client_wants_usage,
                    fast.usage_added,
                    fast.max_tokens
                ),
                (
                    tree.stream,
                    tree.client_wants_usage,
                    tree.usage_added,
                    tree.max_tokens
                ),
                "{text}"
            );
            assert_eq!(fast.choices(), tree.choices(), "{text}");
            assert_eq!(fast.end_user(), tree.end_user(), "{text}");
            assert_eq!(
                fast.metadata_session_id(),
                tree.metadata_session_id(),
                "{text}"
            );
            let session = |r: &ParsedRequest| crate::guard::session::of(None, "k", r);
            assert_eq!(session(&fast), session(&tree), "{text}");
            assert_eq!(views(&fast), views(&tree), "{text}");
            assert_eq!(conversation(&fast), conversation(&tree), "{text}");
            assert_eq!(
                fast.count_prompt_tokens(&tokens),
                tree.count_prompt_tokens(&tokens),
                "{text}"
            );
            assert_eq!(
                (fast.has_tools(), fast.deterministic()),
                (tree.has_tools(), tree.deterministic()),
                "{text}"
            );
            let root = fast.root.as_ref().unwrap();
            assert_eq!(
                root.spliceable.then_some(&root.noted),
                super::super::top_level(text.as_bytes(), NOTED.map(str::as_bytes)).as_ref(),
                "{text}"
            );
            assert_eq!(fast.routing_view(), tree.routing_view(), "{text}");
            assert_eq!(fast.prefix_bytes(), tree.prefix_bytes(), "{text}");
            assert!(fast.body.get().is_none(), "a view built the tree: {text}");
            assert_eq!(fast.body(), tree.body(), "{text}");
            assert_eq!(fast.upstream_body("up"), tree.upstream_body("up"), "{text}");
            fast.set_max_tokens(7);
            tree.set_max_tokens(7);
            assert_eq!(
                fast.upstream_body("up2"),
                tree.upstream_body("up2"),
                "{text}"
            );
            assert_eq!(fast.body(), tree.body(), "{text}");
        }
        // Most valid bodies are read from their text (the rest are left to the tree by design:
        // an escaped part type, a message or `metadata` as an array, a duplicated known field,
        // a `best_of` or `session_id` of another type).
        assert!(read * 10 > valid * 7, "{read} of {valid}");
    }

    /// A body read from its text builds its tree only when a step asks for it, with what the
    /// gateway changed by then.
    #[test]
    fn the_tree_of_a_chat_read_from_its_text_is_built_on_first_use() {
        let text = r#"{"model":"m","stream":true,"max_tokens":9,"messages":[{"role":"user","content":"hi"}]}"#;
        let mut req = ParsedRequest::parse(Endpoint::Chat, text.as_bytes()).unwrap();
        assert!(req.root.is_some() && req.body.get().is_none());
        req.set_max_tokens(4);
        assert!(req.body.get().is_none());
        assert_eq!(req.body()["max_tokens"], json!(4));
        assert_eq!(req.body()["stream_options"], json!({"include_usage": true}));
        assert_eq!(req.choices(), 1);
        for golden in GOLDEN_BODIES {
            let req = ParsedRequest::parse(Endpoint::Chat, golden.as_bytes()).unwrap();
            assert!(req.root.is_some(), "{golden}");
        }
    }

    /// An agent's conversation, small or large, is read from its text: the loop check and the
    /// token count read borrowed views of it as they read the tree, and no tree is built.
    #[test]
    fn a_conversation_is_read_from_its_text_without_a_tree() {
        let big = "line with \"quotes\", a tab\t and 12:03:44\n".repeat(120);
        let tokens = crate::tokens::Tokenizer::default();
        for output in ["ok".to_owned(), big] {
            let text = json!({"model": "m", "temperature": 1.0, "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "run", "arguments": "{\"cmd\": \"ls\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": output},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c2", "type": "function",
                    "function": {"arguments": "{\"cmd\":\"ls\"}", "name": "run"}}]},
                {"role": "tool", "tool_call_id": "c2", "content": output},
            ]})
            .to_string();
            let raw = Bytes::from(text.clone());
            let req = ParsedRequest::parse_bytes(Endpoint::Chat, raw.clone()).unwrap();
            let tree = ParsedRequest::parse_tree(Endpoint::Chat, raw).unwrap();
            assert!(req.root.is_some(), "{text}");
            let read = conversation(&req).unwrap();
            assert!(read.contains("`run`"), "{read}");
            assert_eq!(read, conversation(&tree).unwrap());
            assert_eq!(
                req.count_prompt_tokens(&tokens),
                tree.count_prompt_tokens(&tokens)
            );
            assert!(req.body.get().is_none());
            assert_eq!(req.fingerprint(), tree.fingerprint());
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
