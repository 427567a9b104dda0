//! Token counting with a BPE tokenizer, for upstreams that report no usage and for estimates.
//!
//! Self-hosted models each have their own vocabulary; the gateway counts with a stated standard
//! BPE (`cl100k_base` by default, `o200k_base` selectable per tier), which is within a few percent
//! of most modern tokenizers on English text. Upstream-reported usage always wins when present.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
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

/// Token counts of texts already counted, so that an agent resending its whole history pays for
/// its new messages only: a lossy direct-mapped table of [`COUNT_SLOTS`] 8-byte slots (512 KiB,
/// nothing allocated per entry), each holding 40 bits of a text's hash as its tag and the count
/// plus one in the low 24 bits (0: empty). A new text overwrites whatever shared its slot. The
/// hash is seeded per process (64 bits: the slot from the low bits, the tag from the high ones),
/// so a stored count answers only its own text, but for a chance of about 2^-56 per lookup.
struct Counts {
    slots: Box<[AtomicU64]>,
    hasher: foldhash::fast::FixedState,
}

/// Slots of [`Counts`] (a power of two).
const COUNT_SLOTS: usize = 1 << 16;
/// Bits of a slot holding the count (plus one); longer counts are not kept.
const COUNT_BITS: u32 = 24;

static COUNTS: LazyLock<Counts> = LazyLock::new(|| Counts {
    slots: (0..COUNT_SLOTS).map(|_| AtomicU64::new(0)).collect(),
    hasher: foldhash::fast::FixedState::with_seed(rand::random()),
});

impl Counts {
    fn hash(&self, tokenizer: &str, text: &str) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write(tokenizer.as_bytes());
        h.write_u8(0xff);
        h.write(text.as_bytes());
        h.finish()
    }

    fn slot(&self, hash: u64) -> &AtomicU64 {
        // COUNT_SLOTS is a power of two: the low bits pick the slot.
        &self.slots[(hash as usize) & (COUNT_SLOTS - 1)]
    }

    fn get(&self, hash: u64) -> Option<usize> {
        let v = self.slot(hash).load(Ordering::Relaxed);
        let count = v & ((1 << COUNT_BITS) - 1);
        (count != 0 && v >> COUNT_BITS == hash >> COUNT_BITS).then(|| (count - 1) as usize)
    }

    fn put(&self, hash: u64, count: usize) {
        if let Ok(c) = u64::try_from(count + 1) {
            if c < 1 << COUNT_BITS {
                let tag = (hash >> COUNT_BITS) << COUNT_BITS;
                self.slot(hash).store(tag | c, Ordering::Relaxed);
            }
        }
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

    /// Number of tokens in `text` (remembered: see [`Counts`]).
    pub fn count(&self, text: &str) -> usize {
        if text.is_empty() {
            return 0;
        }
        let hash = COUNTS.hash(self.name, text);
        if let Some(n) = COUNTS.get(hash) {
            return n;
        }
        let n = self.encode(text).len();
        COUNTS.put(hash, n);
        n
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

    #[test]
    fn remembered_counts_are_each_tokenizers_own_and_answer_only_their_text() {
        let (cl, o2) = (
            Tokenizer::default(),
            Tokenizer::of(TokenizerKind::O200kBase),
        );
        let texts = [
            "Привет, как дела? Это проверка токенизатора.",
            "fn main() { println!(\"{}\", 40 + 2); } // 日本語のコメント",
            "The quick brown fox jumps over the lazy dog.",
        ];
        // The two vocabularies disagree on at least one text, so a shared entry would show.
        assert!(texts
            .iter()
            .any(|t| cl.encode(t).len() != o2.encode(t).len()));
        for _ in 0..3 {
            for t in texts {
                assert_eq!(cl.count(t), cl.encode(t).len(), "{t}");
                assert_eq!(o2.count(t), o2.encode(t).len(), "{t}");
            }
        }
        // A slot answers only the hash whose tag it holds.
        let c = &*COUNTS;
        let h = c.hash("test-only", "some text");
        c.put(h, 7);
        assert_eq!(c.get(h), Some(7));
        let same_slot_other_tag = h ^ (1 << 60);
        assert_eq!(c.get(same_slot_other_tag), None);
        // A count too long for the slot is not kept (and not mistaken for another).
        let long = c.hash("test-only", "a long one");
        c.put(long, 1 << COUNT_BITS);
        assert_eq!(c.get(long), None);
    }
}
