//! One chat message as the steps that read a conversation see it (the loop check, the token
//! count): for a body read from its text, borrowed spans of the client's bytes, each decoded
//! only when a step asks for it; for a body parsed into a tree, its nodes. Both read alike:
//! what a step gets from a message is what it got from the tree (a differential test in
//! `request` holds them equal on generated bodies).

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// One JSON value of a message: a node of the body's tree, or its text in the client's bytes.
#[derive(Debug, Clone, Copy)]
enum Json<'a> {
    Tree(&'a Value),
    Text(&'a [u8]),
}

impl<'a> Json<'a> {
    /// The value when a string.
    fn str(self) -> Option<Cow<'a, str>> {
        match self {
            Json::Tree(v) => v.as_str().map(Cow::Borrowed),
            Json::Text(b) => (b.first() == Some(&b'"'))
                .then(|| serde_json::from_slice::<AnyStr>(b).ok()?.0)
                .flatten(),
        }
    }

    /// The value as serde_json writes the parsed value (keys sorted, numbers as parsed).
    fn written(self) -> String {
        match self {
            Json::Tree(v) => v.to_string(),
            Json::Text(b) => serde_json::from_slice::<Value>(b)
                .map(|v| v.to_string())
                .unwrap_or_default(),
        }
    }
}

/// A tool or function call as a conversation reads it: the function's name and arguments when
/// strings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Call<'a> {
    /// `name`, when a string.
    pub name: Option<Cow<'a, str>>,
    /// `arguments` (JSON text), when a string.
    pub arguments: Option<Cow<'a, str>>,
}

/// One chat message.
#[derive(Debug, Clone, Copy, Default)]
pub struct Message<'a> {
    role: Option<&'a str>,
    name: Option<Json<'a>>,
    content: Option<Json<'a>>,
    tool_calls: Option<Json<'a>>,
    function_call: Option<Json<'a>>,
}

impl<'a> Message<'a> {
    /// A message of a body's tree (anything but an object reads as an empty message).
    pub fn of_value(m: &'a Value) -> Self {
        let get = |k: &str| m.get(k).map(Json::Tree);
        Self {
            role: m.get("role").and_then(Value::as_str),
            name: get("name"),
            content: get("content"),
            tool_calls: get("tool_calls"),
            function_call: get("function_call"),
        }
    }

    /// Every message of a tree's `messages`.
    pub fn of_values(messages: &'a [Value]) -> Vec<Self> {
        messages.iter().map(Self::of_value).collect()
    }

    /// A message read from the client's text: its role, and the text of each member (`None`:
    /// absent; a member written `null` is `Some("null")`).
    pub(super) fn of_text(
        role: &'static str,
        name: Option<&'a [u8]>,
        content: Option<&'a [u8]>,
        tool_calls: Option<&'a [u8]>,
        function_call: Option<&'a [u8]>,
    ) -> Self {
        Self {
            role: Some(role),
            name: name.map(Json::Text),
            content: content.map(Json::Text),
            tool_calls: tool_calls.map(Json::Text),
            function_call: function_call.map(Json::Text),
        }
    }

    /// `role`, or `""` when absent or not a string.
    pub fn role(&self) -> &'a str {
        self.role.unwrap_or("")
    }

    /// `name`, when a string.
    pub fn name(&self) -> Option<Cow<'a, str>> {
        self.name.and_then(Json::str)
    }

    /// The message's text: `content` when a string, its parts' `text` joined by line breaks
    /// when a list, empty when absent or null, and any other value as serde_json writes it.
    pub fn text(&self) -> Cow<'a, str> {
        match self.content {
            None => Cow::Borrowed(""),
            Some(Json::Tree(v)) => match v {
                Value::String(s) => Cow::Borrowed(s),
                Value::Array(parts) => Cow::Owned(
                    parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect::<Vec<_>>()
                        .join("\n"),
                ),
                Value::Null => Cow::Borrowed(""),
                other => Cow::Owned(other.to_string()),
            },
            Some(j @ Json::Text(b)) => match b.first() {
                Some(b'"') => j.str().unwrap_or_default(),
                Some(b'[') => {
                    let texts: Vec<Cow<'a, str>> = parts(b)
                        .into_iter()
                        .filter_map(|p| match p {
                            Part::Object { text, .. } => text,
                            _ => None,
                        })
                        .collect();
                    // One text is the part's own (borrowed where written without escapes).
                    match <[_; 1]>::try_from(texts) {
                        Ok([one]) => one,
                        Err(texts) => Cow::Owned(texts.join("\n")),
                    }
                }
                Some(b'n') => Cow::Borrowed(""),
                _ => Cow::Owned(j.written()),
            },
        }
    }

    /// What the tier router reads of the message: `content` when a string, else the `text` of
    /// its parts of type `text`, joined by line breaks; and whether it has a part of any other
    /// kind (an image, audio, a bare string).
    pub fn routed_text(&self) -> (String, bool) {
        let (mut text, mut other) = (String::new(), false);
        let mut add = |t: &str| {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(t);
        };
        match self.content {
            Some(Json::Tree(Value::String(s))) => add(s),
            Some(Json::Tree(Value::Array(parts))) => {
                for p in parts {
                    match p.get("type").and_then(Value::as_str) {
                        Some("text") => p.get("text").and_then(Value::as_str).map_or((), &mut add),
                        _ => other = true,
                    }
                }
            }
            Some(j @ Json::Text(b)) => match b.first() {
                Some(b'"') => add(&j.str().unwrap_or_default()),
                Some(b'[') => {
                    for p in parts(b) {
                        match p {
                            Part::Object {
                                text,
                                kind: Some(kind),
                            } if kind == "text" => text.as_deref().map_or((), &mut add),
                            _ => other = true,
                        }
                    }
                }
                _ => {}
            },
            _ => {}
        }
        (text, other)
    }

    /// The message's `tool_calls` when a list: each call's function.
    pub fn tool_calls(&self) -> Option<Vec<Call<'a>>> {
        match self.tool_calls? {
            Json::Tree(v) => Some(
                v.as_array()?
                    .iter()
                    .map(|c| call_of_value(c.get("function")))
                    .collect(),
            ),
            Json::Text(b) => (b.first() == Some(&b'['))
                .then(|| serde_json::from_slice::<Vec<ToolCall>>(b).ok())
                .flatten()
                .map(|calls| calls.into_iter().map(|c| c.0).collect()),
        }
    }

    /// The message's `function_call` (the legacy single call), when present (`null` included:
    /// a call with no name).
    pub fn function_call(&self) -> Option<Call<'a>> {
        Some(match self.function_call? {
            Json::Tree(v) => call_of_value(Some(v)),
            Json::Text(b) => serde_json::from_slice::<Function>(b)
                .map(|f| f.0)
                .unwrap_or_default(),
        })
    }
}

impl crate::tokens::ChatMessage for Message<'_> {
    fn role(&self) -> Option<&str> {
        self.role
    }

    fn name(&self) -> Option<Cow<'_, str>> {
        Message::name(self)
    }

    fn push_content(&self, out: &mut String) {
        match self.content {
            None => {}
            Some(Json::Tree(v)) => crate::tokens::push_text(v, out),
            Some(j @ Json::Text(b)) => match b.first() {
                Some(b'"') => out.push_str(&j.str().unwrap_or_default()),
                Some(b'[') => {
                    for p in parts(b) {
                        match p {
                            Part::Bare(t) | Part::Object { text: Some(t), .. } => out.push_str(&t),
                            Part::Object { text: None, .. } | Part::Other => {}
                        }
                    }
                }
                _ => {}
            },
        }
    }

    fn tool_calls_written(&self) -> Option<String> {
        self.tool_calls.map(Json::written)
    }
}

fn call_of_value(f: Option<&Value>) -> Call<'_> {
    let s = |k: &str| f?.get(k)?.as_str().map(Cow::Borrowed);
    Call {
        name: s("name"),
        arguments: s("arguments"),
    }
}

/// One content part: a bare string, an object (its `text` and `type` when strings), or anything
/// else.
#[derive(Default)]
enum Part<'a> {
    Bare(Cow<'a, str>),
    Object {
        text: Option<Cow<'a, str>>,
        kind: Option<Cow<'a, str>>,
    },
    #[default]
    Other,
}

/// The parts of a content list (none when it is not one).
fn parts(b: &[u8]) -> Vec<Part<'_>> {
    serde_json::from_slice::<Vec<Part>>(b).unwrap_or_default()
}

/// Skips whatever a visitor is handed that it does not read.
macro_rules! skip_scalars {
    () => {
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
    };
}

/// Reads a string, borrowed where written without escapes, as `$wrap(Cow<str>)`.
macro_rules! strings {
    ($wrap:expr) => {
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
            Ok($wrap(Cow::Borrowed(s)))
        }
        fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
            Ok($wrap(Cow::Owned(s.to_owned())))
        }
        fn visit_string<E>(self, s: String) -> Result<Self::Value, E> {
            Ok($wrap(Cow::Owned(s)))
        }
    };
}

/// Reads anything but an object as the default (nothing read).
macro_rules! objects_only {
    () => {
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        skip_scalars!();
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            skip_seq(seq).map(|()| Default::default())
        }
    };
}

fn skip_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// A string (borrowed where written without escapes), or `None` for any other value.
#[derive(Default)]
struct AnyStr<'a>(Option<Cow<'a, str>>);

impl<'de> Deserialize<'de> for AnyStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = AnyStr<'de>;
            strings!(|s| AnyStr(Some(s)));
            skip_scalars!();
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                skip_seq(seq).map(|()| AnyStr(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                skip_map(map).map(|()| AnyStr(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// Reads an object's members named in `keys` that are strings into `out` (a duplicated key:
/// its last value, as the tree keeps), skipping the rest.
fn string_members<'de, A: MapAccess<'de>>(
    mut map: A,
    keys: &[&str],
    out: &mut [Option<Cow<'de, str>>],
) -> Result<(), A::Error> {
    while let Some(AnyStr(key)) = map.next_key::<AnyStr>()? {
        match keys.iter().position(|k| Some(*k) == key.as_deref()) {
            Some(i) => out[i] = map.next_value::<AnyStr>()?.0,
            None => {
                map.next_value::<IgnoredAny>()?;
            }
        }
    }
    Ok(())
}

/// A call's function object: its `name` and `arguments` when strings (anything but an object:
/// neither).
#[derive(Default)]
struct Function<'a>(Call<'a>);

impl<'de> Deserialize<'de> for Function<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Function<'de>;
            objects_only!();
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let mut out = [None, None];
                string_members(map, &["name", "arguments"], &mut out)?;
                let [name, arguments] = out;
                Ok(Function(Call { name, arguments }))
            }
        }
        d.deserialize_any(V)
    }
}

/// One entry of `tool_calls`: its `function` (a duplicated `function`: the last).
#[derive(Default)]
struct ToolCall<'a>(Call<'a>);

impl<'de> Deserialize<'de> for ToolCall<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ToolCall<'de>;
            objects_only!();
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut call = Call::default();
                while let Some(AnyStr(key)) = map.next_key::<AnyStr>()? {
                    if key.as_deref() == Some("function") {
                        call = map.next_value::<Function>()?.0;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(ToolCall(call))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Part<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Part<'de>;
            strings!(Part::Bare);
            skip_scalars!();
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                skip_seq(seq).map(|()| Part::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let mut out = [None, None];
                string_members(map, &["text", "type"], &mut out)?;
                let [text, kind] = out;
                Ok(Part::Object { text, kind })
            }
        }
        d.deserialize_any(V)
    }
}
