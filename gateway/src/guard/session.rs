//! Which session (an agent run, a conversation) a request belongs to.
//!
//! In order: the `x-session-id` header (or a `session` tag the key or `x-gateway-tags` set);
//! the request's `user` field; its `metadata.session_id`; else one derived from the key and the
//! conversation's root (system prompt and first user message), so an agent that sends no id at
//! all is still one session. Metrics never carry a session; the ledger row does (tag `session`).

use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::headers;
use crate::openai::ParsedRequest;

/// Longest accepted session id, bytes.
pub const MAX_SESSION_ID: usize = 128;

/// Where a session id came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `x-session-id`, or a `session` tag.
    Client,
    /// The request's `user` field.
    User,
    /// The request's `metadata.session_id`.
    Metadata,
    /// Derived from the key and the conversation's root.
    Derived,
}

/// A request's session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The id (`drv_` + 16 hex digits when derived).
    pub id: String,
    /// Where it came from.
    pub source: Source,
}

/// Check an `x-session-id` header value: printable ASCII, at most [`MAX_SESSION_ID`] bytes.
pub fn validate_header(value: &[u8]) -> Result<String, ApiError> {
    let ok = !value.is_empty()
        && value.len() <= MAX_SESSION_ID
        && value.iter().all(|b| (0x21..=0x7e).contains(b));
    match std::str::from_utf8(value) {
        Ok(s) if ok => Ok(s.to_owned()),
        _ => Err(ApiError::invalid(
            headers::SESSION_ID.as_str(),
            format!(
                "`{}` must be 1-{MAX_SESSION_ID} printable ASCII characters without spaces",
                headers::SESSION_ID
            ),
        )),
    }
}

/// The session of `req` by `key_id`, given the client's id (header or tag).
pub fn of(client: Option<&str>, key_id: &str, req: &ParsedRequest) -> Session {
    if let Some(id) = client {
        return Session {
            id: id.to_owned(),
            source: Source::Client,
        };
    }
    let short = |s: &str| (!s.is_empty() && s.len() <= MAX_SESSION_ID).then(|| s.to_owned());
    if let Some(id) = req.end_user().and_then(short) {
        return Session {
            id,
            source: Source::User,
        };
    }
    if let Some(id) = req.metadata_session_id().and_then(short) {
        return Session {
            id,
            source: Source::Metadata,
        };
    }
    Session {
        id: derived(key_id, req),
        source: Source::Derived,
    }
}

/// `drv_` + a hash of the key, the system prompt and the first user message (or the prompt).
fn derived(key_id: &str, req: &ParsedRequest) -> String {
    // The root's parts go into the hash as they are written: from a tree, straight in; from the
    // text (`ParsedRequest::write_conversation_root`), through one buffer of their size.
    let mut w = crate::openai::HashWriter(Sha256::new());
    w.0.update(key_id.as_bytes());
    w.0.update([0]);
    req.write_conversation_root(&mut w);
    format!("drv_{}", crate::keys::lower_hex(&w.0.finalize()[..8]))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use crate::openai::Endpoint;
    use serde_json::{json, Value};

    /// A chat request with `v`'s fields (and a model).
    fn body(mut v: Value) -> ParsedRequest {
        v["model"] = json!("m");
        ParsedRequest::parse(Endpoint::Chat, v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn the_client_id_wins_then_user_then_metadata_then_the_root() {
        let b = body(json!({"user": "u1", "metadata": {"session_id": "m1"},
                            "messages": [{"role": "user", "content": "hi"}]}));
        assert_eq!(of(Some("h1"), "k", &b).id, "h1");
        assert_eq!(of(None, "k", &b).source, Source::User);
        let b = body(json!({"metadata": {"session_id": "m1"},
                            "messages": [{"role": "user", "content": "hi"}]}));
        assert_eq!(of(None, "k", &b).id, "m1");
        let b = body(json!({"messages": [{"role": "user", "content": "hi"}]}));
        assert_eq!(of(None, "k", &b).source, Source::Derived);
    }

    #[test]
    fn a_derived_session_follows_the_conversation_root_not_its_latest_turns() {
        let start = body(json!({"messages": [
            {"role": "system", "content": "You fix bugs."},
            {"role": "user", "content": "Fix issue 12."}]}));
        let later = body(json!({"messages": [
            {"role": "system", "content": "You fix bugs."},
            {"role": "user", "content": "Fix issue 12."},
            {"role": "assistant", "content": "Looking."},
            {"role": "user", "content": "Go on."}]}));
        let other = body(json!({"messages": [
            {"role": "system", "content": "You fix bugs."},
            {"role": "user", "content": "Fix issue 13."}]}));
        assert_eq!(of(None, "k", &start), of(None, "k", &later));
        assert_ne!(of(None, "k", &start), of(None, "k", &other));
        assert_ne!(of(None, "k", &start), of(None, "k2", &start), "per key");
    }

    /// Derived ids of [`crate::openai::GOLDEN_BODIES`] as `1a27c9d` stored them in its ledger
    /// (the key's id, a zero byte, the system prompt's and first user message's JSON each
    /// followed by a zero byte, SHA-256's first 8 bytes): a session's guard windows outlive an
    /// upgrade only if they stay so.
    #[test]
    fn derived_ids_are_the_ones_earlier_versions_made() {
        let key = "key_8569144fb1394cefa2c70f447ec44853";
        let id = |body: &str| {
            let req = ParsedRequest::parse(Endpoint::Chat, body.as_bytes()).unwrap();
            of(None, key, &req).id
        };
        assert_eq!(id(crate::openai::GOLDEN_BODIES[0]), "drv_2400791bb8dc354f");
        assert_eq!(id(crate::openai::GOLDEN_BODIES[1]), "drv_a2d41292aa209204");
    }

    #[test]
    fn absurd_header_values_are_refused() {
        assert!(validate_header(b"run-42").is_ok());
        for bad in [
            "",
            "has space",
            "tab\there",
            &"x".repeat(MAX_SESSION_ID + 1),
            "é",
        ] {
            assert!(validate_header(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }
}
