//! Token counting with a BPE tokenizer, for upstreams that report no usage and for estimates.
//!
//! Self-hosted models each have their own vocabulary; the gateway counts with a stated standard
//! BPE (`cl100k_base` by default, `o200k_base` selectable per tier), which is within a few percent
//! of most modern tokenizers on English text. Upstream-reported usage always wins when present.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;

use regex_automata::{meta, Anchored, Input};
use rustc_hash::FxHashMap;
use serde_json::Value;
use tiktoken_rs::{CoreBPE, Rank};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::Semaphore;

use crate::types::TokenizerKind;

/// Reading a body whole (parsing, fingerprinting, hashing its conversation's root) runs on the
/// async workers up to this size: ~1.4 µs per KiB on the standard machine, so ~1.4 ms at most.
pub const SCAN_INLINE_BYTES: usize = 1024 * 1024;

/// New text (not in [`Counts`]) is tokenized on the async workers up to this much per request:
/// BPE costs ~14 µs per KiB on the standard machine, so ~1 ms at most. The tier router's
/// reading of a prompt keeps to the same bound.
pub const NEW_TEXT_INLINE_BYTES: usize = 64 * 1024;

/// Large tokenizations running at once: one per two cores (at least one), so they leave the
/// async workers cores to run on (the rest wait their turn without blocking a worker).
static HEAVY: LazyLock<Semaphore> = LazyLock::new(|| {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    Semaphore::new((cores / 2).max(1))
});

/// Run `work` (reading `bytes` bytes of a request): inline below `inline` bytes, the work of
/// about a millisecond ([`SCAN_INLINE_BYTES`], [`NEW_TEXT_INLINE_BYTES`]); otherwise after a
/// [`HEAVY`] permit, on a thread the runtime takes off its async workers (`block_in_place`), so
/// a long prompt never stalls other requests or the probes. (Handing the worker over costs two
/// context switches and another thread: below a millisecond of work it costs more than it
/// saves, and an 80 KB agent conversation sent off on every step halved the throughput.)
pub async fn off_workers<T>(bytes: usize, inline: usize, work: impl FnOnce() -> T) -> T {
    if bytes < inline {
        return work();
    }
    hand_over(work).await
}

/// A token count on the async worker when `bounded` manages it within
/// [`NEW_TEXT_INLINE_BYTES`] of text not counted before (it is given that allowance, takes
/// what it tokenizes from it and answers `None` past it, tokenizing nothing more); otherwise
/// `whole`, the same count unbounded, off the workers ([`hand_over`]).
pub async fn count_bounded<T>(
    bounded: impl FnOnce(&mut usize) -> Option<T>,
    whole: impl FnOnce() -> T,
) -> T {
    let mut fresh = NEW_TEXT_INLINE_BYTES;
    match bounded(&mut fresh) {
        Some(n) => n,
        None => hand_over(whole).await,
    }
}

/// Run `work`, known to be long, after a [`HEAVY`] permit, off the async workers (see
/// [`off_workers`]).
pub async fn hand_over<T>(work: impl FnOnce() -> T) -> T {
    let _permit = HEAVY.acquire().await;
    if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        tokio::task::block_in_place(work)
    } else {
        // A current-thread runtime (some tests) has no other worker to hand its tasks to.
        work()
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

/// A BPE vocabulary and the pre-tokenizer that cuts text into the pieces it encodes one at a
/// time: tiktoken's, with its split pattern run by `regex-automata` instead of `fancy_regex`.
///
/// tiktoken's patterns end in `\s+(?!\S)|\s+`, and that look-ahead makes `fancy_regex` run the
/// whole pattern in its backtracking VM: ~3 k instructions per piece, ~45 k for a one-line
/// question (callgrind). Without the look-ahead the pattern is a plain regular expression, and
/// the look-ahead is put back by hand (see [`Vocab::pieces`]); the unit tests hold the counts
/// and ids equal to tiktoken's own on random and real text.
struct Vocab {
    /// tiktoken's encoder, for the rare long pieces (its merge is `O(n log n)` there, where
    /// `byte_pair_split`'s is quadratic): loaded on the first such piece, so a process that
    /// never sees one holds only [`Vocab::ranks`].
    long: fn() -> &'static CoreBPE,
    /// Token bytes to rank, the ordinary tokens only (special ones are text here, as in
    /// tiktoken's `encode_ordinary`).
    ranks: FxHashMap<Vec<u8>, Rank>,
    split: meta::Regex,
    /// Whether `split` is [`CL100K_SPLIT`], whose cuts of an ASCII text [`cl100k_ascii_end`]
    /// makes without the regex.
    ascii_cl100k: bool,
}

/// Pieces of at least this many bytes go to tiktoken's own merge (its heap-based one); so would
/// a one-byte piece missing from the ranks (every byte is a token in both vocabularies, but
/// `byte_pair_split` asserts on one byte, and a request must never reach that assertion).
const LONG_PIECE: usize = 100;

/// tiktoken's `cl100k_base` split pattern, less its `\s+(?!\S)` look-ahead (its possessive
/// quantifiers are plain ones: no alternative here can give back what they keep).
const CL100K_SPLIT: &str = concat!(
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s+$|\s*[\r\n]|\s+"
);

/// Where the piece of the ASCII text `b` that starts at `at` (< `b.len()`) ends, as
/// [`CL100K_SPLIT`] cuts it: its alternatives in order, each with the classes it names read for
/// ASCII (`\p{L}` the letters, `\p{N}` the digits, `\s` tab to carriage return and space).
fn cl100k_ascii_end(b: &[u8], at: usize) -> usize {
    let letter = |i: usize| b.get(i).is_some_and(u8::is_ascii_alphabetic);
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    // `\s` in ASCII: tab, line feed, vertical tab, form feed, carriage return, space.
    let space = |i: usize| b.get(i).is_some_and(|&c| matches!(c, b'\t'..=b'\r' | b' '));
    let line = |i: usize| b.get(i).is_some_and(|&c| c == b'\r' || c == b'\n');
    let other = |i: usize| i < b.len() && !letter(i) && !digit(i) && !space(i);
    let run = |mut i: usize, class: &dyn Fn(usize) -> bool| {
        while class(i) {
            i += 1;
        }
        i
    };
    let lower = |i: usize| b.get(i).map(u8::to_ascii_lowercase);
    // '(?i:[sdmt]|ll|ve|re)
    if b[at] == b'\'' {
        if matches!(lower(at + 1), Some(b's' | b'd' | b'm' | b't')) {
            return at + 2;
        }
        if matches!(
            (lower(at + 1), lower(at + 2)),
            (Some(b'l'), Some(b'l')) | (Some(b'v' | b'r'), Some(b'e'))
        ) {
            return at + 3;
        }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if letter(at) {
        return run(at, &letter);
    }
    if !line(at) && !digit(at) && letter(at + 1) {
        return run(at + 1, &letter);
    }
    // \p{N}{1,3}
    if digit(at) {
        return (at..at + 3).find(|&i| !digit(i)).unwrap_or(at + 3);
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    let punct = if other(at) {
        Some(at)
    } else if b[at] == b' ' && other(at + 1) {
        Some(at + 1)
    } else {
        None
    };
    if let Some(from) = punct {
        return run(run(from, &other), &line);
    }
    // What is left starts with whitespace: \s+$ | \s*[\r\n] | \s+
    let end = run(at, &space);
    if end == b.len() {
        return end;
    }
    match (at..end).rev().find(|&i| line(i)) {
        Some(last_line) => last_line + 1,
        None => end,
    }
}

/// tiktoken's `o200k_base` split pattern, less its `\s+(?!\S)` look-ahead.
const O200K_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+"
);

impl Vocab {
    #[expect(
        clippy::expect_used,
        reason = "the vocabularies and patterns are compiled into the binary: a failure is a build defect"
    )]
    fn load<E: std::fmt::Debug>(
        bpe: Result<CoreBPE, E>,
        long: fn() -> &'static CoreBPE,
        split: &str,
    ) -> Self {
        let bpe = bpe.expect("tiktoken vocabulary");
        let special = bpe.special_tokens();
        let mut tokens = Vec::new();
        // The encoder is private to tiktoken: read it back through `decode_bytes`, rank by rank
        // (ranks are dense; the special tokens sit above the ordinary ones).
        let mut missing = 0;
        for rank in 0.. {
            match bpe.decode_bytes(&[rank]) {
                Ok(bytes) if !special.contains(String::from_utf8_lossy(&bytes).as_ref()) => {
                    tokens.push((bytes, rank));
                    missing = 0;
                }
                Ok(_) => missing = 0,
                Err(_) if missing < 1024 => missing += 1,
                Err(_) => break,
            }
        }
        drop(special);
        drop(bpe);
        // Sized once: growing it would leave its smaller tables freed but still resident.
        let mut ranks = FxHashMap::with_capacity_and_hasher(tokens.len(), Default::default());
        ranks.extend(tokens);
        Self {
            long,
            ranks,
            split: meta::Regex::new(split).expect("split pattern"),
            ascii_cl100k: split == CL100K_SPLIT,
        }
    }

    /// The pieces of `text`, as tiktoken's pattern cuts it. The pattern here ends in `\s+`
    /// where tiktoken's ends in `\s+(?!\S)|\s+`: a run of whitespace that reaches that last
    /// alternative (no line break in it, not at the end of the text: the alternatives before
    /// take those) is followed by a non-space, so tiktoken's look-ahead gives back the run's
    /// last character, which starts the next piece; a run of one is kept whole (`\s+`).
    ///
    /// An ASCII text cut by `cl100k_base` (the default) is cut by [`cl100k_ascii_end`] instead
    /// of the regex: the same pieces (a unit test holds them equal on random ASCII), ~4× fewer
    /// instructions (a one-line question: 7.1 k → 1.7 k, callgrind; docs/benchmarks.md).
    fn pieces<'t>(&self, text: &'t str) -> impl Iterator<Item = &'t str> + use<'t, '_> {
        let ascii = self.ascii_cl100k && text.is_ascii();
        self.pieces_by(text, ascii)
    }

    /// [`Self::pieces`], by the hand scanner (`ascii`, for an ASCII text and `cl100k_base`
    /// only) or by the regex.
    fn pieces_by<'t>(
        &self,
        text: &'t str,
        ascii: bool,
    ) -> impl Iterator<Item = &'t str> + use<'t, '_> {
        let mut at = 0;
        std::iter::from_fn(move || {
            if at >= text.len() {
                return None;
            }
            // Every character starts some alternative, so the next piece starts where the last
            // one ended: an anchored search (no reverse scan for where the match starts).
            let matched = if ascii {
                Some(cl100k_ascii_end(text.as_bytes(), at))
            } else {
                let input = Input::new(text).range(at..).anchored(Anchored::Yes);
                self.split.find(input).map(|m| m.end())
            };
            let Some(mut end) = matched else {
                // Unreachable (every character starts an alternative), but should a character
                // ever match none, the rest is one more piece rather than left uncounted.
                let rest = &text[at..];
                at = text.len();
                return Some(rest);
            };
            let piece = &text[at..end];
            if end < text.len() {
                let mut chars = piece.chars();
                if let (Some(last), Some(_)) = (chars.next_back(), chars.next_back()) {
                    if last.is_whitespace() && last != '\n' && last != '\r' {
                        end -= last.len_utf8();
                    }
                }
            }
            let start = at;
            at = end;
            Some(&text[start..end])
        })
    }

    fn encode(&self, text: &str, out: &mut Vec<Rank>) {
        for piece in self.pieces(text) {
            let bytes = piece.as_bytes();
            if let Some(&rank) = self.ranks.get(bytes) {
                out.push(rank);
            } else if !(2..LONG_PIECE).contains(&bytes.len()) {
                out.extend((self.long)().encode_ordinary(piece));
            } else {
                let parts = tiktoken_rs::byte_pair_split(bytes, &self.ranks);
                out.extend(parts.iter().filter_map(|p| self.ranks.get(*p).copied()));
            }
        }
    }

    fn count(&self, text: &str) -> usize {
        self.pieces(text)
            .map(|piece| {
                let bytes = piece.as_bytes();
                if self.ranks.contains_key(bytes) {
                    1
                } else if !(2..LONG_PIECE).contains(&bytes.len()) {
                    (self.long)().encode_ordinary(piece).len()
                } else {
                    tiktoken_rs::byte_pair_split(bytes, &self.ranks).len()
                }
            })
            .sum()
    }
}

// Each reads its ranks from a copy of tiktoken's vocabulary (~23 MB) and drops it: idle RSS
// with the default tokenizer loaded 58.7 MB, where keeping tiktoken's encoder was 51.8 MB and
// keeping both 65 MB (release build, docs/benchmarks.md).
static CL100K: LazyLock<Vocab> = LazyLock::new(|| {
    Vocab::load(
        tiktoken_rs::cl100k_base(),
        tiktoken_rs::cl100k_base_singleton,
        CL100K_SPLIT,
    )
});
static O200K: LazyLock<Vocab> = LazyLock::new(|| {
    Vocab::load(
        tiktoken_rs::o200k_base(),
        tiktoken_rs::o200k_base_singleton,
        O200K_SPLIT,
    )
});

/// A named BPE tokenizer (the vocabulary loads once per process, on first use).
#[derive(Clone, Copy)]
pub struct Tokenizer {
    name: &'static str,
    vocab: &'static LazyLock<Vocab>,
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
            vocab: &CL100K,
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
                vocab: &O200K,
            },
        }
    }

    /// The tokenizer's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Load the vocabulary now rather than on the first request.
    pub fn warm(&self) {
        LazyLock::force(self.vocab);
    }

    /// Token ids of `text` (special tokens treated as text).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        self.vocab.encode(text, &mut out);
        out
    }

    /// Number of tokens in `text` (remembered: see [`Counts`]).
    pub fn count(&self, text: &str) -> usize {
        let mut unbounded = usize::MAX;
        self.count_within(text, &mut unbounded).unwrap_or_default()
    }

    /// Number of tokens in `text` when it is remembered ([`Counts`]) or is no longer than what
    /// is left of `fresh`, the bytes of new text this count may still tokenize (taken from
    /// it); `None` otherwise, nothing tokenized.
    pub fn count_within(&self, text: &str, fresh: &mut usize) -> Option<usize> {
        if text.is_empty() {
            return Some(0);
        }
        let hash = COUNTS.hash(self.name, text);
        if let Some(n) = COUNTS.get(hash) {
            return Some(n);
        }
        *fresh = fresh.checked_sub(text.len())?;
        let n = self.vocab.count(text);
        COUNTS.put(hash, n);
        Some(n)
    }

    /// Prompt tokens of a chat request's `messages`, counted the way OpenAI documents it: each
    /// message costs its text plus a fixed overhead, plus a primer for the reply.
    pub fn count_chat<M: ChatMessage>(&self, messages: &[M]) -> usize {
        let mut unbounded = usize::MAX;
        self.count_chat_within(messages, &mut unbounded)
            .unwrap_or_default()
    }

    /// [`Self::count_chat`] tokenizing at most `fresh` bytes of new text
    /// ([`Self::count_within`]); `None` when it would need more.
    pub fn count_chat_within<M: ChatMessage>(
        &self,
        messages: &[M],
        fresh: &mut usize,
    ) -> Option<usize> {
        let mut total = TOKENS_REPLY_PRIMER;
        for m in messages {
            total += TOKENS_PER_MESSAGE;
            if let Some(role) = m.role() {
                total += self.count_within(role, fresh)?;
            }
            if let Some(name) = m.name() {
                total += self.count_within(&name, fresh)?;
            }
            let mut text = String::new();
            m.push_content(&mut text);
            if let Some(calls) = m.tool_calls_written() {
                text.push_str(&calls);
            }
            total += self.count_within(&text, fresh)?;
        }
        Some(total)
    }
}

/// A chat message as [`Tokenizer::count_chat`] reads it (`openai::Message`, which reads a body's
/// text or its tree; the trait keeps this module below `openai`).
pub trait ChatMessage {
    /// `role`, when a string.
    fn role(&self) -> Option<&str>;
    /// `name`, when a string.
    fn name(&self) -> Option<std::borrow::Cow<'_, str>>;
    /// Appends the text of `content` (see [`push_text`]).
    fn push_content(&self, out: &mut String);
    /// `tool_calls` (any value, `null` included) as serde_json writes the parsed value.
    fn tool_calls_written(&self) -> Option<String>;
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
        let of = crate::openai::Message::of_values;
        assert_eq!(t.count_chat(&of(&msgs)), 3 + 4 + 1 + 2);
        let parts =
            vec![json!({"role": "user", "content": [{"type": "text", "text": "hello world"}]})];
        assert_eq!(t.count_chat(&of(&parts)), t.count_chat(&of(&msgs)));
    }

    /// Text that exercises every alternative of both split patterns and the look-ahead put
    /// back by hand: runs of spaces, tabs, line breaks and Unicode spaces before words, digits
    /// and punctuation; contractions in both cases; marks, CJK, Cyrillic, emoji; long pieces.
    fn random_text(rng: &mut impl rand::Rng) -> String {
        const PARTS: &[&str] = &[
            " ",
            "  ",
            "   ",
            "\t",
            "\n",
            "\r\n",
            "\n\n",
            " \n",
            "\u{a0}",
            "\u{2003}",
            "\u{3000}",
            "hello",
            "World",
            "HTTP",
            "x",
            "I",
            "'s",
            "'S",
            "'ll",
            "'Re",
            "'d",
            "'",
            "don't",
            "1",
            "42",
            "2026",
            "12345678",
            ".",
            ",",
            "!?",
            "...",
            "/",
            "//",
            "(",
            ")",
            "{}",
            "-",
            "_",
            "#",
            "\"",
            "café",
            "e\u{301}",
            "日本語",
            "Привет",
            "ΣΑΣ",
            "🙂",
            "👍🏽",
            "ß",
            "\u{200b}",
            "Ⅻ",
            "٣",
            "x1",
            "a.b",
            "foo_bar",
            "camelCase",
            "<|endoftext|>",
        ];
        let n = rng.random_range(0..40);
        (0..n)
            .map(|_| PARTS[rng.random_range(0..PARTS.len())])
            .collect()
    }

    #[test]
    fn pieces_counts_and_ids_match_tiktoken_itself() {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(19);
        let mut texts: Vec<String> = (0..20_000).map(|_| random_text(&mut rng)).collect();
        texts.extend(
            [
                "a".repeat(300),
                format!("prefix {} suffix", "Zq".repeat(200)),
                " ".repeat(250) + "x",
                "\n".repeat(120) + "  y",
                "7".repeat(500),
                "!?".repeat(150) + "\n\n",
                "fn main() {\n    let x = 1;\n\n    println!(\"{x}\");\n}\n".repeat(20),
                "The quick brown fox   jumps\tover the lazy dog.  \n  Next line\u{a0}\u{a0}here  "
                    .into(),
                "QmFzZTY0IGJsb2Igd2l0aG91dCBzcGFjZXM=".repeat(40),
            ]
            .map(String::from),
        );
        let reference = [
            (Tokenizer::default(), tiktoken_rs::cl100k_base_singleton()),
            (
                Tokenizer::of(TokenizerKind::O200kBase),
                tiktoken_rs::o200k_base_singleton(),
            ),
        ];
        for (ours, theirs) in reference {
            for t in &texts {
                let want = theirs.encode_ordinary(t);
                assert_eq!(ours.encode(t), want, "{}: {t:?}", ours.name());
                assert_eq!(ours.vocab.count(t), want.len(), "{}: {t:?}", ours.name());
            }
        }
    }

    #[test]
    fn the_ascii_scanner_cuts_ascii_text_as_the_cl100k_regex_does() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(23);
        let vocab = &*CL100K;
        // Every ASCII byte, with the ones the alternatives turn on (quotes, the contraction
        // letters, the whitespace kinds, digits) far more often than the rest.
        let common = b"'sSdDmMtTlLvVrReE  \t\n\r\x0b\x0c019aZ.!_-";
        let mut texts: Vec<String> = (0..50_000)
            .map(|_| {
                let n = rng.random_range(0..24);
                (0..n)
                    .map(|_| {
                        if rng.random_bool(0.7) {
                            char::from(common[rng.random_range(0..common.len())])
                        } else {
                            char::from(rng.random_range(0u8..128))
                        }
                    })
                    .collect()
            })
            .collect();
        texts.extend(
            [
                "",
                " ",
                "  ",
                "\n",
                " \n ",
                "a  ",
                "  a",
                "'",
                "''s",
                "'LL",
                "'ve",
                "1234567",
                " !!\r\n\nx",
            ]
            .map(String::from),
        );
        for t in &texts {
            let fast: Vec<&str> = vocab.pieces_by(t, true).collect();
            let regex: Vec<&str> = vocab.pieces_by(t, false).collect();
            assert_eq!(fast, regex, "{t:?}");
        }
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

    #[test]
    fn a_bounded_count_tokenizes_only_the_new_text_it_is_allowed() {
        let t = Tokenizer::default();
        // Texts no other test counts (the table is the process's).
        let old = "a_bounded_count: the history an agent sent on its last step";
        let new = "a_bounded_count: the new tool result, longer than what is left";
        let remembered = t.count(old);
        // A remembered text costs none of the allowance, whatever its length.
        let mut fresh = 0;
        assert_eq!(t.count_within(old, &mut fresh), Some(remembered));
        // New text beyond what is left: nothing counted, nothing remembered, nothing taken.
        let mut fresh = new.len() - 1;
        assert_eq!(t.count_within(new, &mut fresh), None);
        assert_eq!(fresh, new.len() - 1);
        assert_eq!(COUNTS.get(COUNTS.hash(t.name, new)), None);
        // Within it: counted as `count` counts it, its bytes taken from the allowance.
        let mut fresh = new.len() + 5;
        assert_eq!(t.count_within(new, &mut fresh), Some(t.encode(new).len()));
        assert_eq!(fresh, 5);
        // A conversation: the same total as unbounded once its texts are remembered.
        let messages = [
            serde_json::json!({"role": "user", "content": old}),
            serde_json::json!({"role": "assistant", "content": new, "name": "a_bounded_count"}),
        ];
        let messages = crate::openai::Message::of_values(&messages);
        let mut none_left = 0;
        assert_eq!(t.count_chat_within(&messages, &mut none_left), None);
        let total = t.count_chat(&messages);
        assert_eq!(t.count_chat_within(&messages, &mut none_left), Some(total));
    }
}
