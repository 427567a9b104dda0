//! Token counting with a BPE tokenizer, for upstreams that report no usage and for estimates.
//!
//! Self-hosted models each have their own vocabulary; the gateway counts with a stated standard
//! BPE (`cl100k_base` by default, `o200k_base` selectable per tier), which is within a few percent
//! of most modern tokenizers on English text. Upstream-reported usage always wins when present.

use std::sync::LazyLock;

use serde_json::Value;
use tiktoken_rs::CoreBPE;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::Semaphore;

use crate::types::TokenizerKind;

/// Requests whose body is at least this large are tokenized off the async workers.
pub const OFF_WORKER_BYTES: usize = 64 * 1024;

/// Large tokenizations running at once: one per two cores (at least one), so they leave the
/// async workers cores to run on (the rest wait their turn without blocking a worker).
static HEAVY: LazyLock<Semaphore> = LazyLock::new(|| {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    Semaphore::new((cores / 2).max(1))
});

/// Run `count` (work that reads a request of `bytes` bytes whole: parsing, hashing,
/// tokenizing): inline when small; otherwise after a [`HEAVY`] permit, on a thread the runtime
/// takes off its async workers (`block_in_place`), so a long prompt never stalls other requests
/// or the probes.
pub async fn off_workers<T>(bytes: usize, count: impl FnOnce() -> T) -> T {
    if bytes < OFF_WORKER_BYTES {
        return count();
    }
    let _permit = HEAVY.acquire().await;
    if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        tokio::task::block_in_place(count)
    } else {
        // A current-thread runtime (some tests) has no other worker to hand its tasks to.
        count()
    }
}

/// Tokens OpenAI adds per chat message for the role and separators.
const TOKENS_PER_MESSAGE: usize = 4;
/// Tokens that prime the assistant's reply.
const TOKENS_REPLY_PRIMER: usize = 3;

/// A named BPE tokenizer (the vocabulary loads once per process, on first use).
#[derive(Clone, Copy)]
pub struct Tokenizer {
    name: &'static str,
    bpe: fn() -> &'static CoreBPE,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

impl Default for Tokenizer {
    fn default() -> Self {
        Self {
            name: "cl100k_base",
            bpe: tiktoken_rs::cl100k_base_singleton,
        }
    }
}

impl Tokenizer {
    /// The tokenizer a tier names.
    pub fn of(kind: TokenizerKind) -> Self {
        match kind {
            TokenizerKind::Cl100kBase => Self::default(),
            TokenizerKind::O200kBase => Self {
                name: kind.as_str(),
                bpe: tiktoken_rs::o200k_base_singleton,
            },
        }
    }

    /// The tokenizer's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Load the vocabulary now rather than on the first request.
    pub fn warm(&self) {
        let _ = (self.bpe)();
    }

    /// Token ids of `text` (special tokens treated as text).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        (self.bpe)().encode_ordinary(text)
    }

    /// Number of tokens in `text`.
    pub fn count(&self, text: &str) -> usize {
        if text.is_empty() {
            0
        } else {
            self.encode(text).len()
        }
    }

    /// Prompt tokens of a chat request's `messages`, counted the way OpenAI documents it: each
    /// message costs its text plus a fixed overhead, plus a primer for the reply.
    pub fn count_chat(&self, messages: &[Value]) -> usize {
        let mut total = TOKENS_REPLY_PRIMER;
        for m in messages {
            total += TOKENS_PER_MESSAGE;
            if let Some(role) = m.get("role").and_then(Value::as_str) {
                total += self.count(role);
            }
            if let Some(name) = m.get("name").and_then(Value::as_str) {
                total += self.count(name);
            }
            let mut text = String::new();
            if let Some(content) = m.get("content") {
                push_text(content, &mut text);
            }
            if let Some(calls) = m.get("tool_calls") {
                text.push_str(&calls.to_string());
            }
            total += self.count(&text);
        }
        total
    }
}

/// Append the text of an OpenAI `content` value (a string, or an array of parts with `text`).
pub fn push_text(content: &Value, out: &mut String) {
    match content {
        Value::String(s) => out.push_str(s),
        Value::Array(parts) => {
            for p in parts {
                match p {
                    Value::String(s) => out.push_str(s),
                    Value::Object(o) => {
                        if let Some(Value::String(s)) = o.get("text") {
                            out.push_str(s);
                        }
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn counts_match_the_reference_tokenizer() {
        let t = Tokenizer::default();
        // "hello world" is two tokens in cl100k_base.
        assert_eq!(t.count("hello world"), 2);
        assert_eq!(t.count(""), 0);
        let msgs = vec![json!({"role": "user", "content": "hello world"})];
        assert_eq!(t.count_chat(&msgs), 3 + 4 + 1 + 2);
        let parts =
            vec![json!({"role": "user", "content": [{"type": "text", "text": "hello world"}]})];
        assert_eq!(t.count_chat(&parts), t.count_chat(&msgs));
    }

    #[test]
    fn each_configurable_kind_gets_its_own_vocabulary() {
        let o200k = Tokenizer::of(TokenizerKind::O200kBase);
        assert_eq!(o200k.name(), "o200k_base");
        assert_eq!(
            Tokenizer::of(TokenizerKind::Cl100kBase).name(),
            "cl100k_base"
        );
        assert_eq!(o200k.encode("hello world").len(), 2);
    }
}
