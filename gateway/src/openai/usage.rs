//! Token usage in responses and stream chunks.

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
