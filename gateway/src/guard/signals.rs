//! Loop signals inside one request: the `messages` array itself shows the agent repeating. No
//! state, so it works on every replica and on the first request that carries the loop.
//!
//! The conversation is read as *steps*: an assistant action (its text, or its tool calls' names
//! and canonical arguments) and what came back before the next assistant turn (tool results,
//! user messages). Texts are normalised first: times, dates, durations, long numbers (7 digits
//! or more: epochs, generated ids), uuids and other hex runs, and the digits inside words mixing
//! letters and digits are masked, whitespace collapsed, so "the same error again at 12:03:44"
//! equals "the same error again at 12:03:51" while "3 failed" and "2 failed" stay different.
//! Tool-call arguments are compared as written, less the spacing between JSON tokens, unmasked
//! (an offset that moves is progress).
//! A loop is the same step
//! [`MIN_REPEATS`] times in a row, or a cycle of two or three steps repeated twice (A-B-A-B).
//! A progressing agent repeats tools too, but its arguments or results change, and then so do
//! its steps.
//!
//! Work is bounded: only the last [`WINDOW`] messages are read, and of a long message only its
//! first and last [`EDGE`] bytes.

use std::borrow::Cow;
use std::hash::{BuildHasher, Hash, Hasher};

use foldhash::fast::{FixedState, FoldHasher};

use serde_json::Value;

use crate::openai::Message;

/// Identical steps in a row that make a loop.
pub const MIN_REPEATS: usize = 3;
/// Full repetitions of a 2- or 3-step cycle that make a loop.
pub const MIN_CYCLES: usize = 2;
/// Messages read from the end of the conversation.
pub const WINDOW: usize = 64;
/// Bytes read from each end of a long message.
pub const EDGE: usize = 4096;

/// A loop found in one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loop {
    /// How many times the repeating unit occurs at the end of the conversation.
    pub repeats: usize,
    /// Steps in the repeating unit (1: the same step again and again).
    pub period: usize,
    /// What repeats, for people: e.g. "tool call `run_tests`" or "assistant text".
    pub what: String,
}

impl Loop {
    /// Steps the loop spans (its repeats times its period).
    pub fn steps(&self) -> usize {
        self.repeats * self.period
    }
}

/// How the detector judges repetition.
#[derive(Clone, Copy)]
pub struct Detect<'a> {
    /// Identical steps in a row that make a loop (cycles: this many full cycles, at least 2).
    pub repeats: usize,
    /// Near-duplicate texts: their sketches and the cosine above which two texts are the same.
    pub near: Option<(&'a super::near::NearDup, f32)>,
}

impl Default for Detect<'_> {
    fn default() -> Self {
        Self {
            repeats: MIN_REPEATS,
            near: None,
        }
    }
}

/// One step of a conversation: an assistant action and what came back after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Hash of the whole step (action and outcome, normalised).
    pub fingerprint: u64,
    /// Hash of the outcome alone.
    outcome: u64,
    /// Hash of the action alone.
    action: u64,
    /// Hash of the outcome's shape: every number masked but those that measure progress
    /// (`40%`, `3 failed`, `page 2`), so counters, PIDs and durations that tick do not hide a
    /// repeat while a job that moves on still differs.
    shape: u64,
    /// Hash of the tool names called (0 for a text reply).
    names: u64,
    /// Bytes of the outcome's masked text (how much came back).
    outcome_len: usize,
    /// What the action is, for people (made once per step: most are one of a few phrases).
    pub what: Cow<'static, str>,
    /// The action's text (a reply's masked words, or tool names and arguments), for
    /// near-duplicate comparison; bounded.
    action_text: String,
    /// The outcome's masked text; bounded.
    outcome_text: String,
    /// Words of a tool call's argument values (sorted hashes; empty for a text reply).
    words: Vec<u64>,
    /// A text reply that asks something (has a `?`) and that a user message answered.
    asks: bool,
    /// Identifiers a text reply mentions (see [`id_tokens`]).
    mentioned: Vec<u64>,
    /// Identifiers the user's reply to a text reply gave.
    given: Vec<u64>,
    /// A text reply whose action is its fenced code blocks.
    code: bool,
    /// What came back is a short reply from the user with no digit in it (an objection, a
    /// "still wrong"), not a tool's or a harness's output, and no number that could move.
    plain_reply: bool,
    /// A tool said it failed ([`says_failed`]); read for the latest step, and for the steps
    /// of [`OBJECTION_STEPS`] when the user objects (false for the others).
    failed: bool,
    /// Hash of what the tools answered (the outcome less what the user said).
    tool_outcome: u64,
    /// Where the assistant turn is, and the last user message after it, before the next
    /// assistant turn (indices into the messages read; `None`: the user did not speak).
    at: usize,
    user_at: Option<usize>,
    /// The user's message after this step says the agent is not helping ([`objects`]); read
    /// only when the latest one does, for the steps of [`OBJECTION_STEPS`].
    objected: bool,
    /// A text reply's content words ([`content_words`]); read like `objected`.
    content: Vec<u64>,
}

impl Step {
    /// Whether the action was a tool call.
    pub fn is_tool(&self) -> bool {
        self.names != 0
    }

    /// Whether a user message came back after this step.
    fn user_spoke(&self) -> bool {
        self.user_at.is_some()
    }

    /// The text compared for near-duplicates (empty unless read with texts).
    pub fn text(&self) -> String {
        format!("{}\n{}", self.action_text, self.outcome_text)
    }
}

/// The loop at the end of `messages`, if any (exact repeats only, the default threshold).
pub fn in_request(messages: &[Value]) -> Option<Loop> {
    detect(messages, Detect::default())
}

/// The loop at the end of `messages`, judged by `d`.
pub fn detect(messages: &[Value], d: Detect<'_>) -> Option<Loop> {
    Conversation::read(&Message::of_values(messages), d.near.is_some()).detect(d)
}

/// The latest turn of a request (see [`Conversation::latest_turn`]).
pub fn latest_turn(messages: &[Value]) -> Option<Step> {
    Conversation::read(&Message::of_values(messages), true)
        .latest_turn()
        .cloned()
}

/// A request's conversation, read once: the steps of its last [`WINDOW`] messages, or, when
/// it has no assistant turn yet, its ask.
#[derive(Debug, Clone)]
pub struct Conversation {
    steps: Vec<Step>,
    ask: Option<Step>,
}

impl Conversation {
    /// Read `messages`; with `texts`, keep each step's masked text for near-duplicate
    /// comparison (without, [`Step::text`] is empty).
    pub fn read(messages: &[Message<'_>], texts: bool) -> Self {
        let tail = &messages[messages.len().saturating_sub(WINDOW)..];
        let mut steps = steps(tail, texts);
        read_objections(tail, &mut steps);
        // Steps start at assistant turns: none means nothing was answered yet.
        let ask = if steps.is_empty() {
            ask(tail, texts)
        } else {
            None
        };
        Self { steps, ask }
    }

    /// The latest turn: the last step (the newest assistant action and what came back since),
    /// or, in a conversation with no assistant turn yet, the ask itself (every non-system
    /// message). `None` without messages.
    pub fn latest_turn(&self) -> Option<&Step> {
        self.steps.last().or(self.ask.as_ref())
    }

    /// The loop at the end of the conversation, judged by `d`.
    pub fn detect(&self, d: Detect<'_>) -> Option<Loop> {
        detect_steps(&self.steps, d)
    }
}

fn detect_steps(steps: &[Step], d: Detect<'_>) -> Option<Loop> {
    // Sketched on demand, each once; only with a near-duplicate model.
    let sketches: Vec<std::cell::OnceCell<Option<super::near::Sketch>>> = match d.near {
        Some(_) => (0..steps.len())
            .map(|_| std::cell::OnceCell::new())
            .collect(),
        None => Vec::new(),
    };
    let near = |a: usize, b: usize| -> bool {
        let Some((model, threshold)) = d.near else {
            return false;
        };
        let (x, y) = (&steps[a], &steps[b]);
        // A tool call is the same step only with the same tools and the same outcome (a job
        // polled to a new percentage, a file paged to new lines are progress); a text reply
        // when both the reply and what answered it are close.
        let comparable = if x.is_tool() || y.is_tool() {
            x.names == y.names && x.outcome == y.outcome
        } else {
            true
        };
        if !comparable {
            return false;
        }
        let sketch = |i: usize| {
            sketches[i]
                .get_or_init(|| model.sketch(&steps[i].text()))
                .clone()
        };
        match (sketch(a), sketch(b)) {
            (Some(p), Some(q)) => p.cosine(&q) >= threshold,
            _ => false,
        }
    };
    let same = |a: usize, b: usize| {
        let (x, y) = (&steps[a], &steps[b]);
        x.fingerprint == y.fingerprint
            || (x.action == y.action && x.shape == y.shape)
            || similar_actions(x, y)
            || near(a, b)
    };
    if let Some((repeats, period)) = repetition(steps.len(), same, d.repeats) {
        let n = steps.len();
        let what: Vec<&str> = (n - period..n).map(|i| steps[i].what.as_ref()).collect();
        return Some(Loop {
            repeats,
            period,
            what: what.join(" / "),
        });
    }
    interrupted_run(steps, d.repeats)
        .or_else(|| run_through_thoughts(steps, d.repeats))
        .or_else(|| resubmitted_after_the_user(steps, d.repeats))
        .or_else(|| reworded_lookups(steps, d.repeats))
        .or_else(|| asked_again(steps, d.repeats))
        .or_else(|| code_reoffered(steps, d.repeats))
        .or_else(|| repeated_while_user_objects(steps, d.repeats))
}

/// Identifiers read from one message, at most.
const IDS_KEPT: usize = 32;

/// The identifiers in `text` (order numbers, booking codes, account ids: runs of three or more
/// ASCII letters and digits with at least one digit), lowercased and hashed, into `ids`
/// (sorted, deduplicated, at most [`IDS_KEPT`] read). A long text is read at its ends only.
fn id_tokens(text: &str, ids: &mut Vec<u64>) {
    let b = text.as_bytes();
    let ends: [&[u8]; 2] = if b.len() > 2 * EDGE {
        [&b[..EDGE], &b[b.len() - EDGE..]]
    } else {
        [b, &[]]
    };
    let from = ids.len();
    for part in ends {
        for word in part.split(|c| !c.is_ascii_alphanumeric()) {
            if ids.len() - from >= IDS_KEPT {
                break;
            }
            if word.len() >= 3 && word.iter().any(u8::is_ascii_digit) {
                let mut h = FixedState::default().build_hasher();
                for &c in word {
                    h.write_u8(c.to_ascii_lowercase());
                }
                ids.push(h.finish());
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
}

/// The last `repeats` steps (at least [`MIN_REPEATS`]) that a shape must span; `None` when the
/// conversation has fewer.
fn last_repeats(steps: &[Step], repeats: usize) -> Option<&[Step]> {
    steps.get(steps.len().checked_sub(repeats.max(MIN_REPEATS))?..)
}

/// The agent keeps asking for what the user keeps giving: the last `repeats` steps (at least
/// 3) are text replies that ask something, each answered by the user with the same identifier
/// (an order number, a booking code), and none of the replies after the first answer mentions
/// it — no tool looked it up, no reply used it. An agent that takes the answer in says it back
/// or acts on it; one that asks again, in whatever words, has not.
fn asked_again(steps: &[Step], repeats: usize) -> Option<Loop> {
    let last = last_repeats(steps, repeats)?;
    if !last.iter().all(|s| s.asks) {
        return None;
    }
    let (first, after) = last.split_first()?;
    let ignored = first.given.iter().any(|id| {
        after
            .iter()
            .all(|s| s.given.binary_search(id).is_ok() && s.mentioned.binary_search(id).is_err())
    });
    ignored.then(|| Loop {
        repeats: last.len(),
        period: 1,
        what: "assistant asking again for what the user already gave".to_owned(),
    })
}

/// What a text reply with fenced code is, for people (and how [`steps`] knows one).
const CODE_REPLY: &str = "assistant reply (the same code block)";

/// The longest masked reply, in bytes, that counts as a user's short objection.
const PLAIN_REPLY: usize = 240;

/// The same code offered again and again while the user keeps objecting: the last `repeats`
/// steps (at least 3) are text replies whose fenced code blocks are the same, each answered
/// by a short user message with no digit in it. A user who gets the very same snippet back
/// three times has not been helped, however the prose around it was reworded. Not caught:
/// tool output and a harness's observations (a file paged with `scroll_down` comes back long),
/// and replies carrying numbers (a job polled to 40%, then 80%, is moving).
fn code_reoffered(steps: &[Step], repeats: usize) -> Option<Loop> {
    let last = last_repeats(steps, repeats)?;
    let same = last
        .iter()
        .all(|s| s.code && s.plain_reply && s.action == last[0].action);
    same.then(|| Loop {
        repeats: last.len(),
        period: 1,
        what: "the same code block offered again while the user objects".to_owned(),
    })
}

/// Content words that reworded replies must all share to say the same thing.
const SHARED_WORDS: usize = 4;

/// The agent repeats itself and the user says so ([`objects`]: "you're not answering",
/// "there's some confusion", "actually, I wanted …"):
/// - among the last [`OBJECTION_STEPS`] steps, a tool call that failed was made the very same
///   way at least `repeats - 1` times (at least 2), and the user objected after the first of
///   them (tau-bench airline task 13: the update with an unavailable flight fails, the user
///   says "Actually, I wanted HAT052", the same update fails again); or
/// - the last `repeats` steps (at least 3) are text replies, each answered by the user, all
///   but at most one of those answers object (the latest among them), and the replies share at
///   least [`SHARED_WORDS`] content words: the same non-answer reworded to a customer who
///   keeps saying it is not one.
///
/// A user's objection alone is not a loop (the agent may take it and move on), nor are
/// similar replies to a user who keeps asking for more, nor a failing call retried once
/// without the user objecting (real progressing runs do that).
fn repeated_while_user_objects(steps: &[Step], repeats: usize) -> Option<Loop> {
    let last = steps.last()?;
    let k = repeats.max(MIN_REPEATS);
    let window = &steps[steps.len().saturating_sub(OBJECTION_STEPS)..];
    let objection = window.iter().rposition(|s| s.objected)?;
    for (i, x) in window.iter().enumerate().take(objection + 1) {
        if !(x.is_tool() && x.failed) {
            continue;
        }
        let count = 1 + window[i + 1..].iter().filter(|y| identical(x, y)).count();
        if count + 1 >= k {
            return Some(Loop {
                repeats: count,
                period: 1,
                what: format!("{} failing the same way while the user objects", x.what),
            });
        }
    }
    if !last.objected {
        return None;
    }
    let replies = last_repeats(steps, repeats)?;
    let answered = replies
        .iter()
        .all(|s| !s.is_tool() && !s.code && s.user_at.is_some());
    let objections = replies.iter().filter(|s| s.objected).count();
    if !answered || objections + 1 < replies.len() {
        return None;
    }
    let (first, rest) = replies.split_first()?;
    let shared = first
        .content
        .iter()
        .filter(|w| rest.iter().all(|s| s.content.binary_search(w).is_ok()))
        .count();
    (shared >= SHARED_WORDS).then(|| Loop {
        repeats: replies.len(),
        period: 1,
        what: "assistant reply saying the same thing while the user objects".to_owned(),
    })
}

/// Whether two steps are the very same: the same action with the same outcome, or with an
/// outcome of the same shape (counters and durations that tick).
fn identical(x: &Step, y: &Step) -> bool {
    x.fingerprint == y.fingerprint || (x.action == y.action && x.shape == y.shape)
}

/// A run broken once: the last step and at least `repeats - 1` identical ones among the
/// `repeats` before it (A-A-x-A, A-x-A-A). The agent did one other thing in between (looked
/// at the file again, ran a sed) and went back to the very same step with the very same
/// outcome, which a step that changed nothing cannot make different. Counted from 3 repeats
/// (A-x-A alone is a cycle's business).
fn interrupted_run(steps: &[Step], repeats: usize) -> Option<Loop> {
    let count = broken_run(steps.len(), |a, b| identical(&steps[a], &steps[b]), repeats)?;
    Some(Loop {
        repeats: count,
        period: 1,
        what: format!("{} (one other step between)", steps.last()?.what),
    })
}

/// The tool names of a step that calls `think` alone (see [`run_through_thoughts`]).
fn think_names() -> u64 {
    FixedState::default().hash_one("think") | 1
}

/// The same step `repeats` times with only thoughts between: a `think` tool call (the
/// reasoning scratchpad of tau-bench's agents and of Anthropic's published `think` tool) reads
/// and changes nothing, so a run of the very same step separated by thoughts alone is a run
/// (a failing booking resubmitted unchanged after each reworded thought). Anything else
/// between breaks it: a calculation that comes back with a number, an edit, a reply.
fn run_through_thoughts(steps: &[Step], repeats: usize) -> Option<Loop> {
    let think = think_names();
    let mut acting = steps.iter().rev().filter(|s| s.names != think);
    let last = acting.next()?;
    let mut run = 1;
    for s in acting {
        if !identical(s, last) {
            break;
        }
        run += 1;
    }
    // Without a thought between, the run rule has already judged it.
    let thoughts = steps
        .iter()
        .rev()
        .take_while(|s| s.names == think || identical(s, last))
        .any(|s| s.names == think);
    (run >= repeats.max(MIN_REPEATS) && thoughts).then(|| Loop {
        repeats: run,
        period: 1,
        what: format!("{} (only thoughts between)", last.what),
    })
}

/// The same failing call sent again after each word from the user: the last step is a tool
/// call whose result says it failed ([`says_failed`]), and the same call, answered the same way
/// by the tools, came at least `repeats - 1` (at least 2) times before, each pair of them with
/// the user speaking in between. The user has been told, has answered, and the agent sends the call it already
/// knows the answer to (tau-bench airline task 13: the same unavailable flight in the update
/// five times while the user keeps asking for another change). One retry after the user
/// answers is ordinary; the third identical call is not. A call that succeeds is not this (an
/// agent re-reads a record to answer each new question), and without the user between, the
/// run shapes judge it (an agent resubmitting between its own calculations is working).
fn resubmitted_after_the_user(steps: &[Step], repeats: usize) -> Option<Loop> {
    let (last, earlier) = steps.split_last()?;
    if !last.failed {
        return None;
    }
    let need = repeats.max(MIN_REPEATS);
    let (mut count, mut user_since) = (1, false);
    // From the newest back: each earlier occurrence counts when the user spoke after it (in
    // what came back to it, or later), before the occurrence that followed.
    for s in earlier.iter().rev() {
        // The same call (its action hash covers the tool names) answered the same way by the
        // tools (what the user said after it is not part of the call's answer).
        if s.action == last.action && s.tool_outcome == last.tool_outcome {
            if !(user_since || s.user_spoke()) {
                return None;
            }
            count += 1;
            if count >= need {
                return Some(Loop {
                    repeats: count,
                    period: 1,
                    what: format!("{} sent again after the user answered", last.what),
                });
            }
            user_since = false;
        } else {
            user_since |= s.user_spoke();
        }
    }
    None
}

/// A run broken once at the end of a sequence of `n` items compared by `same`: the last item
/// and at least `repeats - 1` like it among the `repeats` before it (at least [`MIN_REPEATS`]).
/// Returns how many.
pub fn broken_run(n: usize, same: impl Fn(usize, usize) -> bool, repeats: usize) -> Option<usize> {
    let k = repeats.max(MIN_REPEATS);
    if n < k + 1 {
        return None;
    }
    let count = 1 + (n - 1 - k..n - 1).filter(|&i| same(i, n - 1)).count();
    (count >= k).then_some(count)
}

/// Outcomes at least this long (masked bytes) say something: an empty list, `ok` or `not
/// found` can answer different asks alike, a page of results cannot.
pub const SUBSTANTIAL_OUTCOME: usize = 64;

/// The same lookup reworded, with only conversation between: among the last `2 × repeats - 1`
/// steps, every tool call is to the same tools and got the very same substantial outcome, at
/// least `repeats` of them, in at least two wordings, and the last step is one of them; the
/// other steps are text replies. The agent keeps asking its tools for something else (the user
/// said the answer does not fit) and keeps getting, and relaying, the same thing. The same
/// lookup in the same words between replies is not enough: an agent may re-read a record to
/// answer each new question about it.
fn reworded_lookups(steps: &[Step], repeats: usize) -> Option<Loop> {
    let k = repeats.max(2);
    let n = steps.len();
    let last = steps.last()?;
    if !last.is_tool() || last.outcome_len < SUBSTANTIAL_OUTCOME || n < 2 * k - 1 {
        return None;
    }
    let window = &steps[n - (2 * k - 1)..];
    let mut count = 0;
    let mut reworded = false;
    for s in window.iter().filter(|s| s.is_tool()) {
        if s.names != last.names || s.outcome != last.outcome {
            return None;
        }
        count += 1;
        reworded |= s.action != last.action;
    }
    (count >= k && reworded).then(|| Loop {
        repeats: count,
        period: 1,
        what: format!("{} reworded between replies", last.what),
    })
}

/// The repetition at the end of a sequence of `n` items compared by `same`: the run of items
/// like the last (when at least `repeats` long), else a cycle of two or three items repeated
/// `repeats.min(MIN_CYCLES)`+ times. Returns (repeats, period).
pub fn repetition(
    n: usize,
    same: impl Fn(usize, usize) -> bool,
    repeats: usize,
) -> Option<(usize, usize)> {
    if n == 0 {
        return None;
    }
    let mut run = 1;
    while run < n && same(n - 1, n - 1 - run) {
        run += 1;
    }
    if run >= repeats {
        return Some((run, 1));
    }
    let min_cycles = repeats.clamp(2, MIN_CYCLES.max(2));
    for period in 2..=3 {
        if n < period * min_cycles {
            continue;
        }
        let unit = n - period..n;
        if unit.clone().all(|i| same(i, n - period)) {
            continue; // one step repeated: the run above
        }
        let mut cycles = 1;
        while (cycles + 1) * period <= n && unit.clone().all(|i| same(i, i - cycles * period)) {
            cycles += 1;
        }
        if cycles >= min_cycles {
            return Some((cycles, period));
        }
    }
    None
}

/// The ask of a conversation with no assistant turn yet: its non-system messages as one step,
/// whose fingerprint is their gist (see [`gist_into`]): a stateless client re-asking in other
/// function words sends the same ask.
fn ask(tail: &[Message<'_>], texts: bool) -> Option<Step> {
    let mut h = FixedState::default().build_hasher();
    let mut gist = FixedState::default().build_hasher();
    let mut words = 0;
    let mut text = Vec::new();
    let mut len = 0;
    for m in tail {
        let role = m.role();
        if role == "system" || role == "developer" {
            continue;
        }
        role.hash(&mut h);
        role.hash(&mut gist);
        let t = m.text();
        let out = masked_edges(&t);
        h.write(&out);
        h.write_u8(0xff);
        words += gist_into(&out, &mut gist);
        gist.write_u8(0xff);
        if texts && text.len() < TEXT_KEPT {
            text.extend_from_slice(&out[..out.len().min(TEXT_KEPT - text.len())]);
            text.push(b' ');
        }
        len += out.len();
    }
    let exact = h.finish();
    // The ask is its gist (the same request reworded in function words is the same ask), or,
    // with no content word at all, its exact text.
    let fingerprint = if words > 0 { gist.finish() } else { exact };
    (exact != FixedState::default().build_hasher().finish()).then(|| Step {
        fingerprint,
        outcome: fingerprint,
        action: 0,
        // An ask is compared by its fingerprint alone (across requests, as a turn), never by
        // action and shape, so its shape is not computed.
        shape: 0,
        names: 0,
        outcome_len: len,
        what: Cow::Borrowed("the same request"),
        action_text: String::new(),
        outcome_text: bounded_text(&text),
        words: Vec::new(),
        asks: false,
        mentioned: Vec::new(),
        given: Vec::new(),
        code: false,
        plain_reply: false,
        failed: false,
        tool_outcome: 0,
        at: 0,
        user_at: None,
        objected: false,
        content: Vec::new(),
    })
}

/// Longest text kept per step part for near-duplicate comparison, bytes.
const TEXT_KEPT: usize = 1024;

fn bounded_text(masked: &[u8]) -> String {
    let s = String::from_utf8_lossy(&masked[..masked.len().min(TEXT_KEPT)]);
    s.into_owned()
}

/// The steps of `messages`: each assistant turn and what came back after it.
fn steps(messages: &[Message<'_>], texts: bool) -> Vec<Step> {
    struct Open {
        h: FoldHasher<'static>,
        outcome: FoldHasher<'static>,
        action_hash: u64,
        shape: FoldHasher<'static>,
        names: u64,
        outcome_len: usize,
        what: Cow<'static, str>,
        action: Vec<u8>,
        words: Vec<u64>,
        result: Vec<u8>,
        asks: bool,
        answered: bool,
        mentioned: Vec<u64>,
        given: Vec<u64>,
        code: bool,
        plain: bool,
        tool_outcome: FoldHasher<'static>,
        at: usize,
        user_at: Option<usize>,
    }
    let close = |o: Open| Step {
        fingerprint: o.h.finish(),
        outcome: o.outcome.finish(),
        action: o.action_hash,
        shape: o.shape.finish(),
        names: o.names,
        outcome_len: o.outcome_len,
        what: o.what,
        action_text: bounded_text(&o.action),
        outcome_text: bounded_text(&o.result),
        words: o.words,
        asks: o.asks && o.answered,
        mentioned: o.mentioned,
        given: o.given,
        code: o.code,
        plain_reply: o.plain && o.outcome_len > 0 && o.outcome_len <= PLAIN_REPLY,
        failed: false,
        tool_outcome: o.tool_outcome.finish(),
        at: o.at,
        user_at: o.user_at,
        objected: false,
        content: Vec::new(),
    };
    let mut out: Vec<Step> = Vec::new();
    let mut current: Option<Open> = None;
    for (i, m) in messages.iter().enumerate() {
        let role = m.role();
        if role == "assistant" {
            if let Some(o) = current.take() {
                out.push(close(o));
            }
            let mut h = FixedState::default().build_hasher();
            let mut action = Vec::new();
            let mut words = Vec::new();
            let (what, names) = action_of(m, &mut h, texts.then_some(&mut action), &mut words);
            let code = names == 0 && what == CODE_REPLY;
            let action_hash = h.finish();
            // A text reply: does it ask, and which identifiers does it mention.
            let mut mentioned = Vec::new();
            let asks = names == 0 && {
                let t = m.text();
                id_tokens(&t, &mut mentioned);
                t.contains('?')
            };
            current = Some(Open {
                h,
                outcome: FixedState::default().build_hasher(),
                action_hash,
                shape: FixedState::default().build_hasher(),
                names,
                outcome_len: 0,
                what,
                action,
                words,
                result: Vec::new(),
                asks,
                answered: false,
                mentioned,
                given: Vec::new(),
                code,
                plain: true,
                tool_outcome: FixedState::default().build_hasher(),
                at: i,
                user_at: None,
            });
        } else if let Some(o) = current.as_mut() {
            // What came back: tool results, or the user's (or a harness's) reply.
            // Hashed once, into the step's fingerprint and its outcome alike.
            let mut part = FixedState::default().build_hasher();
            role.hash(&mut part);
            let content = m.text();
            o.plain &= role == "user" && !content.bytes().any(|b| b.is_ascii_digit());
            if role == "user" {
                o.user_at = Some(i);
            }
            o.outcome_len += normalised(
                &content,
                &mut part,
                texts.then_some(&mut o.result),
                Some(&mut o.shape),
            );
            let part = part.finish();
            o.h.write_u64(part);
            o.outcome.write_u64(part);
            if role != "user" {
                o.tool_outcome.write_u64(part);
            }
            if o.asks && role == "user" {
                o.answered = true;
                id_tokens(&content, &mut o.given);
            }
        }
    }
    if let Some(o) = current {
        let mut last = close(o);
        last.failed = tool_failed(&messages[last.at + 1..]);
        out.push(last);
    }
    out
}

/// Whether a tool answering among `outcome` (the messages after a tool call, up to the next
/// assistant turn) says it failed.
fn tool_failed(outcome: &[Message<'_>]) -> bool {
    outcome
        .iter()
        .any(|m| matches!(m.role(), "tool" | "function") && says_failed(&m.text()))
}

/// The longest user message read as a person objecting, bytes.
const OBJECTION_TURN: usize = 512;

/// Steps read again when the user objects: the latest few (a session window's worth).
const OBJECTION_STEPS: usize = 8;

/// Which of the last [`OBJECTION_STEPS`] steps of `messages` the user objected to
/// ([`objects`]), and, when one was, what the rule for it needs of those steps: which tool
/// calls failed, the text replies' content words. A conversation where the user does not
/// object costs one scan of the head of each user message among those steps.
fn read_objections(messages: &[Message<'_>], steps: &mut [Step]) {
    let n = steps.len();
    let window = n.saturating_sub(OBJECTION_STEPS);
    let mut any = false;
    for s in &mut steps[window..] {
        s.objected = s.user_at.is_some_and(|i| {
            let text = messages[i].text();
            // A person's turn is short; a harness's observation sent as a user message (a
            // coding agent's command output, where `confusion_matrix` or "useless" can be
            // code) is not read as one.
            text.len() <= OBJECTION_TURN && objects(&text)
        });
        any |= s.objected;
    }
    if !any {
        return;
    }
    for k in window..n {
        // What came back to a step ends where the next assistant turn starts.
        let end = steps.get(k + 1).map_or(messages.len(), |next| next.at);
        let s = &mut steps[k];
        if s.is_tool() {
            s.failed = tool_failed(&messages[s.at + 1..end]);
        } else {
            s.content = content_words(&masked_edges(&messages[s.at].text()));
        }
    }
}

/// Phrases looked for, case-insensitively, at the head of a message.
struct Lexicon {
    phrases: &'static [&'static str],
    /// Bytes read from the start of a message (at most [`Lexicon::LONGEST_HEAD`]).
    head: usize,
    finders: std::sync::OnceLock<Vec<memchr::memmem::Finder<'static>>>,
}

impl Lexicon {
    const LONGEST_HEAD: usize = 512;

    const fn new(phrases: &'static [&'static str], head: usize) -> Self {
        assert!(head <= Self::LONGEST_HEAD);
        Self {
            phrases,
            head,
            finders: std::sync::OnceLock::new(),
        }
    }

    /// Whether the first `head` bytes of `text`, lowercased, hold any of the phrases (each
    /// lowercase).
    fn says(&self, text: &str) -> bool {
        let finders = self.finders.get_or_init(|| {
            self.phrases
                .iter()
                .map(|w| memchr::memmem::Finder::new(w.as_bytes()))
                .collect()
        });
        let head = &text.as_bytes()[..text.len().min(self.head)];
        let mut lower = [0u8; Self::LONGEST_HEAD];
        for (l, b) in lower.iter_mut().zip(head) {
            *l = b.to_ascii_lowercase();
        }
        let lower = &lower[..head.len()];
        finders.iter().any(|f| f.find(lower).is_some())
    }
}

/// Whether a tool result says the call failed: its first 256 bytes name an error (`Error:
/// flight HAT030 not available`, `{"ok": false, "error": …}`, `ERROR: column "x" does not
/// exist`, a traceback, `permission denied`). Read for the latest step of a request, and for
/// the recent ones when the user objects ([`read_objections`]).
fn says_failed(text: &str) -> bool {
    static FAILED: Lexicon = Lexicon::new(
        &[
            "error",
            "fail",
            "not available",
            "not found",
            "not enough",
            "invalid",
            "denied",
            "unable",
            "cannot",
            "exception",
            "traceback",
            "does not exist",
        ],
        256,
    );
    FAILED.says(text)
}

/// Whether a user's message says the agent is not helping: that it repeats itself ("you keep
/// saying", "I already told you"), does not answer ("you're not answering", "that's not what
/// I asked", "useless") or has misunderstood ("there's some confusion", "a mix-up", "actually,
/// I wanted …"), in its first 512 bytes. Not "still failing" or "wrong": a coding user
/// reporting the next error is moving the work on.
fn objects(text: &str) -> bool {
    static OBJECTS: Lexicon = Lexicon::new(
        &[
            "not answering",
            "not what i asked",
            "not what i meant",
            "not what i said",
            "already told you",
            "already said",
            "already gave you",
            "already asked",
            "you keep",
            "same thing",
            "same answer",
            "repeating yourself",
            "you just said",
            "useless",
            "not helpful",
            "doesn't help",
            "does not help",
            "didn't help",
            "not listening",
            "misunderstanding",
            "misunderstood",
            "confusion",
            "confused",
            "mix-up",
            "mixup",
            "answer my question",
            "that's not right",
            "that is not right",
            "actually, i want",
            "actually i want",
            "i meant",
            "as i said",
            "like i said",
        ],
        512,
    );
    OBJECTS.says(text)
}

/// Hash an assistant turn's action into `h` and write its text to `text` (when kept); returns
/// what it is (for people) and a hash of the tools it called (0: a text reply).
fn action_of(
    m: &Message<'_>,
    h: &mut FoldHasher,
    mut text: Option<&mut Vec<u8>>,
    words: &mut Vec<u64>,
) -> (Cow<'static, str>, u64) {
    let calls = m.tool_calls().filter(|c| !c.is_empty());
    let mut names_h = FixedState::default().build_hasher();
    let mut call = |name: &str, args: &str, h: &mut FoldHasher, text: &mut Option<&mut Vec<u8>>| {
        name.hash(h);
        name.hash(&mut names_h);
        if let Some(t) = text.as_deref_mut() {
            t.extend_from_slice(name.as_bytes());
            t.push(b' ');
        }
        let masked = compact(args, h, text.as_deref_mut());
        // Arguments too long to read whole (a patch, a file written out) are marked: their
        // first words (a diff's header) alone do not make two silent calls one attempt.
        if !value_words(&masked, words) && words.first() != Some(&UNREAD) {
            words.insert(0, UNREAD);
        }
        if let Some(t) = text.as_deref_mut() {
            t.push(b'\n');
        }
    };
    if let Some(calls) = calls {
        let mut what = String::from("tool call ");
        for (i, c) in calls.iter().enumerate() {
            let name = c.name.as_deref().unwrap_or("?");
            call(name, c.arguments.as_deref().unwrap_or(""), h, &mut text);
            if i > 0 {
                what.push_str(", ");
            }
            what.push('`');
            what.push_str(name);
            what.push('`');
        }
        return (Cow::Owned(what), names_h.finish() | 1);
    }
    if let Some(f) = m.function_call() {
        let name = f.name.as_deref().unwrap_or("?");
        call(name, f.arguments.as_deref().unwrap_or(""), h, &mut text);
        return (
            Cow::Owned(format!("function call `{name}`")),
            names_h.finish() | 1,
        );
    }
    let content = m.text();
    if content.len() <= CANONICAL_ARGS && content.trim_start().starts_with(['{', '[']) {
        // A JSON reply (a ReAct-style action object): its keys in order, its spacing ignored.
        // A longer one is read at its ends like any text, so the work stays bounded.
        compact(&content, h, text);
    } else if let Some(blocks) = fenced_blocks(&content) {
        // A reply with fenced code: the code is what it does (a text-protocol agent's
        // command, the snippet a chat answer offers); the prose around it is commentary, and
        // a rewording of it is the same action. The whole reply is still what near-duplicates
        // compare.
        normalised(&blocks, h, None, None);
        if let Some(text) = text {
            let mut unused = FixedState::default().build_hasher();
            normalised(&content, &mut unused, Some(text), None);
        }
        return (Cow::Borrowed(CODE_REPLY), 0);
    } else {
        normalised(&content, h, text, None);
    }
    (Cow::Borrowed("assistant reply"), 0)
}

/// The contents of the fenced code blocks (```` ``` ````) of a reply, each less its fence line
/// (the language tag), joined; `None` without a closed block. A long reply is read at its ends
/// only, like any text.
fn fenced_blocks(text: &str) -> Option<String> {
    const FENCE: &str = "```";
    let bounded: Cow<'_, str> = if text.len() > 2 * EDGE {
        let head = floor(text, EDGE);
        let tail = ceil(text, text.len() - EDGE);
        Cow::Owned(format!("{}…{}", &text[..head], &text[tail..]))
    } else {
        Cow::Borrowed(text)
    };
    let mut rest: &str = &bounded;
    let mut blocks = String::new();
    while let Some(open) = rest.find(FENCE) {
        let after = &rest[open + FENCE.len()..];
        // The fence line ends the tag; the block runs to the next fence.
        let body = after.find('\n').map_or("", |nl| &after[nl + 1..]);
        let Some(close) = body.find(FENCE) else { break };
        blocks.push_str(&body[..close]);
        blocks.push('\u{1f}');
        rest = &body[close + FENCE.len()..];
    }
    (!blocks.is_empty()).then_some(blocks)
}

/// Longest tool-call arguments parsed to put their keys in order; longer ones are compared as
/// written, less the spacing between tokens.
const CANONICAL_ARGS: usize = 64 * 1024;

/// Hash tool-call arguments (JSON text) into `h`, and append them to `text`: parsed and written
/// back with sorted keys and no spacing (the same call with its keys in another order is the
/// same call), then masked like any text (a fresh idempotency key or request id does not make a
/// new call; a moved offset does).
fn compact(json: &str, h: &mut FoldHasher, text: Option<&mut Vec<u8>>) -> Vec<u8> {
    let canonical = (json.len() <= CANONICAL_ARGS)
        .then(|| serde_json::from_str::<Value>(json).ok())
        .flatten()
        .map(|v| v.to_string());
    let canonical = canonical.unwrap_or_else(|| {
        let bytes: Vec<u8> = crate::openai::json_bytes(json.as_bytes())
            .filter(|&(b, inside)| inside || !b.is_ascii_whitespace())
            .map(|(b, _)| b)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    });
    let mut out = Vec::with_capacity(canonical.len());
    mask(&canonical, &mut out);
    h.write(&out);
    h.write_u8(0xff);
    if let Some(text) = text.filter(|t| t.len() < TEXT_KEPT) {
        text.extend_from_slice(&out[..out.len().min(TEXT_KEPT)]);
    }
    out
}

/// Words of a tool call's arguments read for [`similar_actions`], at most.
const WORDS_KEPT: usize = 64;

/// First among the words of a call whose arguments were too long to read whole (see
/// [`similar_actions`]).
const UNREAD: u64 = 0;

/// The words of the string values in masked JSON `json` (not its keys), hashed, into `words`
/// (sorted, deduplicated, at most [`WORDS_KEPT`] read): runs of two or more ASCII letters,
/// lowercased (even hashes), and runs of digits (odd hashes: [`is_number`]), so `arg1` is
/// `arg` and `1`. Whether every word was read.
fn value_words(json: &[u8], words: &mut Vec<u64>) -> bool {
    let mut in_string = false;
    let mut escaped = false;
    // Where the current string's words start in `words` (dropped again if it is a key).
    let mut string_from = words.len();
    // The current run's start, and whether it is digits.
    let mut run: Option<(usize, bool)> = None;
    let end = |run: Option<(usize, bool)>, to: usize, words: &mut Vec<u64>| {
        let Some((from, digits)) = run else { return };
        if digits || to - from >= 2 {
            let mut h = FixedState::default().build_hasher();
            for &b in &json[from..to] {
                h.write_u8(b.to_ascii_lowercase());
            }
            let h = h.finish();
            words.push(if digits { h | 1 } else { h & !1 });
        }
    };
    let mut i = 0;
    while i < json.len() && words.len() < WORDS_KEPT {
        let b = json[i];
        if !in_string {
            if b == b'"' {
                in_string = true;
                string_from = words.len();
            }
        } else if escaped {
            // `\n`, `\t`, … separate words; an escaped letter is not part of one.
            escaped = false;
        } else if b.is_ascii_alphanumeric() {
            let digit = b.is_ascii_digit();
            match run {
                Some((_, d)) if d == digit => {}
                _ => {
                    end(run, i, words);
                    run = Some((i, digit));
                }
            }
        } else {
            end(run.take(), i, words);
            match b {
                b'\\' => escaped = true,
                b'"' => {
                    in_string = false;
                    let next = json[i + 1..].iter().find(|c| !c.is_ascii_whitespace());
                    if next == Some(&b':') {
                        words.truncate(string_from);
                    }
                }
                _ => {}
            }
        }
        i += 1;
    }
    words.sort_unstable();
    words.dedup();
    i >= json.len()
}

/// Whether a word of [`value_words`] is a run of digits.
fn is_number(word: u64) -> bool {
    word & 1 == 1
}

/// Share of word sets two tool calls need in common (Jaccard) to be the same attempt reworded,
/// when they called the same tools and got the same result back.
pub const SIMILAR_ACTIONS: f64 = 0.7;

/// Whether two tool calls are one attempt reworded: the same tools, the very same (masked)
/// result, and arguments whose words mostly agree (a search reworded that returns the same
/// hits). A call whose result changed, or that asks for other things, is not. A result that
/// says nothing (under [`SUBSTANTIAL_OUTCOME`] bytes: an empty output, `ok`) cannot show that
/// two calls did the same thing, so then the words must be the same ones, only quoted,
/// ordered or cased otherwise (`grep -rn 'def f' src` and `grep -Rn "def f" ./src/`, both
/// finding nothing): a silent `sed -i` on `arg1` and another on `arg2` are two edits, an edit
/// that adds to another's replacement is a new one (so a search with a qualifier added is not
/// matched either), and two silent calls whose arguments were too long to read whole (two
/// patches of one file) are not compared by words.
fn similar_actions(x: &Step, y: &Step) -> bool {
    if !(x.is_tool() && x.names == y.names && x.outcome == y.outcome) {
        return false;
    }
    let (a, b) = (&x.words, &y.words);
    if x.outcome_len < SUBSTANTIAL_OUTCOME {
        return a.first().is_some_and(|w| *w != UNREAD) && a == b;
    }
    // With a result to go by, numbers are left out: the same lookup for page 2 and page 3
    // that found the same hits was one attempt.
    let (only_a, only_b, common) = overlap(a, b, |w| !is_number(w) && w != UNREAD);
    if common + only_a == 0 || common + only_b == 0 {
        return false;
    }
    common as f64 >= SIMILAR_ACTIONS * (common + only_a + only_b) as f64
}

/// Of two sorted word sets, the words `keep` keeps: how many only in `a`, only in `b`, in both.
fn overlap(a: &[u64], b: &[u64], keep: impl Fn(u64) -> bool) -> (usize, usize, usize) {
    let mut a = a.iter().copied().filter(|w| keep(*w)).peekable();
    let mut b = b.iter().copied().filter(|w| keep(*w)).peekable();
    let (mut only_a, mut only_b, mut common) = (0, 0, 0);
    loop {
        match (a.peek(), b.peek()) {
            (Some(x), Some(y)) if x == y => {
                common += 1;
                a.next();
                b.next();
            }
            (Some(x), Some(y)) if x < y => {
                only_a += 1;
                a.next();
            }
            (Some(_), None) => {
                only_a += 1;
                a.next();
            }
            (_, Some(_)) => {
                only_b += 1;
                b.next();
            }
            (None, None) => return (only_a, only_b, common),
        }
    }
}

/// Hash `text` into `h` after masking what changes between identical steps (see the module
/// docs), and append the masked text to `kept` (up to [`TEXT_KEPT`] bytes in all); a long text
/// is read at both ends only.
fn normalised(
    text: &str,
    h: &mut FoldHasher,
    kept: Option<&mut Vec<u8>>,
    shape: Option<&mut FoldHasher>,
) -> usize {
    let out = masked_edges(text);
    h.write(&out);
    h.write_u8(0xff);
    if let Some(shape) = shape {
        shape.write_u64(out.shape());
    }
    if let Some(kept) = kept.filter(|k| k.len() < TEXT_KEPT) {
        let room = TEXT_KEPT - kept.len();
        kept.extend_from_slice(&out[..out.len().min(room)]);
        kept.push(b' ');
    }
    out.len()
}

/// `text` masked (see [`mask`]); a long text is read at both ends only. A text of
/// [`KEPT_MIN_BYTES`] or more is looked up first among the texts masked for earlier requests
/// ([`MASKED`]), and kept there from its second time ([`SEEN`]).
fn masked_edges(text: &str) -> Masked {
    let (head, tail) = edges(text);
    if text.len() < KEPT_MIN_BYTES {
        return Masked::Now(mask_edges(head, tail));
    }
    let key = kept_key(head, tail);
    let same = |k: &KeptMask| {
        k.head == head.len()
            && k.read[..k.head] == *head.as_bytes()
            && k.read[k.head..] == *tail.unwrap_or("").as_bytes()
            && k.tail == tail.is_some()
    };
    if let Some(kept) = MASKED.get(&key).filter(|k| same(k)) {
        return Masked::Kept(kept);
    }
    let masked = mask_edges(head, tail);
    if !seen_before(key) {
        return Masked::Now(masked);
    }
    let read = [head.as_bytes(), tail.unwrap_or("").as_bytes()].concat();
    let kept = std::sync::Arc::new(KeptMask {
        masked: masked.into_boxed_slice(),
        read: read.into_boxed_slice(),
        head: head.len(),
        tail: tail.is_some(),
        shape: std::sync::OnceLock::new(),
    });
    MASKED.insert(key, std::sync::Arc::clone(&kept));
    Masked::Kept(kept)
}

/// The keys of long texts masked lately, one per slot of a table indexed by the key (lossy).
/// A text's masking is kept only when it comes a second time: an agent's messages come with
/// each of its later calls, while traffic whose long texts never repeat pays a store here
/// rather than a copy into [`MASKED`] and its eviction.
static SEEN: [std::sync::atomic::AtomicU64; 1 << 14] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 1 << 14];

/// Whether `key` was the latest key of its slot in [`SEEN`] (it is now).
fn seen_before(key: u64) -> bool {
    let slot = &SEEN[(key as usize) & (SEEN.len() - 1)];
    slot.swap(key, std::sync::atomic::Ordering::Relaxed) == key
}

/// Where [`MASKED`] keeps the masking of a text read as `head` and `tail`.
fn kept_key(head: &str, tail: Option<&str>) -> u64 {
    let mut h = FixedState::default().build_hasher();
    h.write(head.as_bytes());
    h.write_u8(u8::from(tail.is_some()));
    h.write(tail.unwrap_or("").as_bytes());
    h.finish()
}

/// The parts of `text` that are read: all of it, or its first and last [`EDGE`] bytes (at
/// character boundaries).
fn edges(text: &str) -> (&str, Option<&str>) {
    if text.len() > 2 * EDGE {
        let head = floor(text, EDGE);
        let tail = ceil(text, text.len() - EDGE);
        (&text[..head], Some(&text[tail..]))
    } else {
        (text, None)
    }
}

/// The masked text of [`edges`]: the head, and after `…` the tail.
fn mask_edges(head: &str, tail: Option<&str>) -> Vec<u8> {
    let mut out = Vec::with_capacity(head.len() + tail.map_or(0, |t| t.len() + 3));
    mask(head, &mut out);
    if let Some(tail) = tail {
        out.extend_from_slice("…".as_bytes());
        mask(tail, &mut out);
    }
    out
}

/// Shortest text whose masking is kept for later requests: below it, masking again costs
/// less than the lookup.
const KEPT_MIN_BYTES: usize = 1024;

/// Bytes of masked texts kept (what was read and its masking, both counted).
const KEPT_BYTES: u64 = 16 << 20;

/// A long text's masking, kept with the bytes it was made from (a lookup's hash is checked by
/// comparing them, so a collision is a miss, never another text's masking).
#[derive(Debug)]
struct KeptMask {
    /// The head and the tail read, one after the other.
    read: Box<[u8]>,
    /// Where the head ends in `read`.
    head: usize,
    /// Whether the text was long enough to be read at its two ends.
    tail: bool,
    masked: Box<[u8]>,
    /// Its shape's hash ([`shape_of`]), made when first asked for.
    shape: std::sync::OnceLock<u64>,
}

/// Masked long texts kept across requests: an agent sends its whole conversation again with
/// every call, so all but its newest messages were masked for the call before. Bounded by
/// [`KEPT_BYTES`]; evicted least recently used first.
static MASKED: std::sync::LazyLock<moka::sync::Cache<u64, std::sync::Arc<KeptMask>, FixedState>> =
    std::sync::LazyLock::new(|| {
        moka::sync::Cache::builder()
            .max_capacity(KEPT_BYTES)
            .weigher(|_, k: &std::sync::Arc<KeptMask>| {
                u32::try_from(k.read.len() + k.masked.len() + 64).unwrap_or(u32::MAX)
            })
            .build_with_hasher(FixedState::default())
    });

/// A masked text: masked for this request, or kept from an earlier one.
enum Masked {
    Now(Vec<u8>),
    Kept(std::sync::Arc<KeptMask>),
}

impl Masked {
    /// The hash of its shape ([`shape_of`]), made once for a kept masking.
    fn shape(&self) -> u64 {
        match self {
            Self::Now(v) => shape_of(v),
            Self::Kept(k) => *k.shape.get_or_init(|| shape_of(&k.masked)),
        }
    }
}

impl std::ops::Deref for Masked {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Now(v) => v,
            Self::Kept(k) => &k.masked,
        }
    }
}

/// Words that carry no content in an ask: articles, pronouns, auxiliaries, question words and
/// politeness. Negations are not among them: "not good value" is another ask than "good value".
const FUNCTION_WORD_LIST: [&[u8]; 78] = [
    b"a", b"about", b"am", b"an", b"and", b"any", b"are", b"as", b"at", b"be", b"been", b"but",
    b"by", b"can", b"could", b"did", b"do", b"does", b"for", b"from", b"had", b"has", b"have",
    b"hello", b"hey", b"hi", b"how", b"i", b"i'm", b"if", b"in", b"into", b"is", b"it", b"it's",
    b"its", b"just", b"kindly", b"me", b"my", b"of", b"on", b"or", b"our", b"please", b"should",
    b"so", b"some", b"tell", b"thank", b"thanks", b"that", b"the", b"their", b"them", b"then",
    b"there", b"these", b"they", b"this", b"those", b"to", b"us", b"was", b"we", b"were", b"what",
    b"what's", b"when", b"where", b"which", b"who", b"why", b"will", b"with", b"would", b"you",
    b"your",
];

/// Longest function word, bytes.
const LONGEST_FUNCTION_WORD: usize = 8;

/// A word of at most 16 bytes, lowercased, as one integer (its bytes little-endian; no word
/// holds a NUL, so each has its own).
const fn packed_lower(word: &[u8]) -> u128 {
    let mut x = 0u128;
    let mut k = 0;
    while k < word.len() {
        x |= (word[k].to_ascii_lowercase() as u128) << (8 * k);
        k += 1;
    }
    x
}

/// Longest word [`packed_lower`] packs, bytes.
const LONGEST_PACKED: usize = 16;

/// The words of `list` packed and sorted: membership is a binary search, one integer compare
/// per step ([`is_listed`]).
const fn packed_sorted<const N: usize>(list: &[&[u8]; N]) -> [u128; N] {
    let mut t = [0u128; N];
    let mut i = 0;
    while i < N {
        assert!(list[i].len() <= LONGEST_PACKED);
        t[i] = packed_lower(list[i]);
        // Insertion sort (a const context has no `sort`).
        let mut j = i;
        while j > 0 && t[j - 1] > t[j] {
            let x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
            j -= 1;
        }
        i += 1;
    }
    t
}

/// Whether `word` is, case aside, one of the words `set` packs ([`packed_sorted`]).
fn is_listed(word: &[u8], set: &[u128]) -> bool {
    !word.is_empty()
        && word.len() <= LONGEST_PACKED
        && set.binary_search(&packed_lower(word)).is_ok()
}

/// [`FUNCTION_WORD_LIST`] packed and sorted.
const FUNCTION_WORDS: [u128; FUNCTION_WORD_LIST.len()] = {
    let mut i = 0;
    while i < FUNCTION_WORD_LIST.len() {
        assert!(FUNCTION_WORD_LIST[i].len() <= LONGEST_FUNCTION_WORD);
        i += 1;
    }
    packed_sorted(&FUNCTION_WORD_LIST)
};

/// The bytes of a word in an ask's gist: ASCII letters and digits, `'`, the masks' `<`, `>`
/// and `#`, and every non-ASCII byte.
const GIST_WORD: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0;
    while i < 256 {
        let c = i as u8;
        t[i] = c.is_ascii_alphanumeric() || matches!(c, b'\'' | b'<' | b'>' | b'#') || c >= 0x80;
        i += 1;
    }
    t
};

/// Hash the *gist* of masked text `out` into `h`: its content words in order, lowercased, less
/// function words ([`FUNCTION_WORD_LIST`]) and punctuation ("How do I reset my API key?" and "how can i reset the
/// api key" have one gist; "reset the API key" and "delete the API key" do not, nor do two
/// routes in opposite directions). Returns the number of content words.
fn gist_into(out: &[u8], h: &mut FoldHasher) -> usize {
    let mut count = 0;
    each_content_word(out, |piece, word_ends| {
        h.write(piece);
        if word_ends {
            h.write_u8(b' ');
            count += 1;
        }
    });
    count
}

/// Each content word of masked text `out`, lowercased, in order (see [`gist_into`]), with
/// whether the word ends there: a word longer than 64 bytes is given in 64-byte pieces.
fn each_content_word(out: &[u8], mut f: impl FnMut(&[u8], bool)) {
    let is_word = |c: u8| GIST_WORD[usize::from(c)];
    let mut i = 0;
    while i < out.len() {
        if !is_word(out[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < out.len() && is_word(out[i]) {
            i += 1;
        }
        let word = &out[start..i];
        let w = word.strip_suffix(b"'").unwrap_or(word);
        if w.iter().all(|c| *c == b'\'') {
            continue;
        }
        if w.len() <= LONGEST_FUNCTION_WORD {
            // Short: lowercased into one integer (a word with a non-ASCII byte matches no
            // function word, all ASCII).
            let lower = packed_lower(w);
            if FUNCTION_WORDS.binary_search(&lower).is_ok() {
                continue;
            }
            f(&lower.to_le_bytes()[..w.len()], true);
        } else {
            let mut buf = [0u8; 64];
            let mut chunks = w.chunks(buf.len()).peekable();
            while let Some(chunk) = chunks.next() {
                let b = &mut buf[..chunk.len()];
                b.copy_from_slice(chunk);
                b.make_ascii_lowercase();
                f(b, chunks.peek().is_none());
            }
        }
    }
}

/// Content words of a reply read, at most.
const CONTENT_WORDS: usize = 256;

/// The set of a text's content words (masked text `out`; sorted hashes), crudely stemmed
/// ("refunds" is "refund", "approved" is "approv") so that a reworded reply saying the same
/// thing keeps its words. Numbers and masks are left out (every reply has some), and so are
/// runs longer than 64 bytes (a token, a path: no word of prose).
fn content_words(out: &[u8]) -> Vec<u64> {
    let mut words = Vec::new();
    // Whether the piece at hand starts its word.
    let mut starts = true;
    each_content_word(out, |w, word_ends| {
        let whole = std::mem::replace(&mut starts, word_ends) && word_ends;
        let number = |c: &u8| c.is_ascii_digit() || matches!(c, b'#' | b'<' | b'>');
        if !whole || words.len() >= CONTENT_WORDS || w.iter().any(number) {
            return;
        }
        let mut w = w;
        if w.len() > 3 && w.ends_with(b"s") && !w.ends_with(b"ss") {
            w = &w[..w.len() - 1];
        }
        if w.len() > 5 {
            w = w
                .strip_suffix(b"ed")
                .or_else(|| w.strip_suffix(b"ing"))
                .unwrap_or(w);
        }
        words.push(FixedState::default().hash_one(w));
    });
    words.sort_unstable();
    words.dedup();
    words
}

/// Words next to a number that make it a measure of progress (kept in the shape).
const PROGRESS_AFTER: &[&[u8]; 30] = &[
    b"passed",
    b"failed",
    b"failures",
    b"errors",
    b"error",
    b"warnings",
    b"warning",
    b"done",
    b"complete",
    b"completed",
    b"remaining",
    b"left",
    b"processed",
    b"rows",
    b"items",
    b"files",
    b"tests",
    b"records",
    b"succeeded",
    b"pending",
    b"running",
    b"ready",
    b"of",
    b"skipped",
    b"found",
    b"matches",
    b"results",
    b"percent",
    b"bytes",
    b"lines",
];
const PROGRESS_BEFORE: &[&[u8]; 16] = &[
    b"page",
    b"step",
    b"epoch",
    b"iteration",
    b"stage",
    b"batch",
    b"part",
    b"offset",
    b"cursor",
    b"progress",
    b"of",
    b"position",
    b"remaining",
    b"percent",
    b"completed",
    b"done",
];

/// [`PROGRESS_AFTER`] and [`PROGRESS_BEFORE`] packed, for [`is_listed`].
const PROGRESS_AFTER_SET: [u128; PROGRESS_AFTER.len()] = packed_sorted(PROGRESS_AFTER);
const PROGRESS_BEFORE_SET: [u128; PROGRESS_BEFORE.len()] = packed_sorted(PROGRESS_BEFORE);

/// The hash of the shape of masked text `out`: every run of digits is one `#`, except a
/// number that measures progress (followed by `%` or a word of [`PROGRESS_AFTER`], or after a
/// word of [`PROGRESS_BEFORE`]), which is kept. Only compared between the steps of one
/// request, so how it is made may change between versions.
fn shape_of(out: &[u8]) -> u64 {
    let mut h = FixedState::default().build_hasher();
    shape_into(out, &mut h);
    h.finish()
}

/// [`shape_of`], written into `h`.
fn shape_into(out: &[u8], h: &mut FoldHasher) {
    let word_at = |i: usize| -> &[u8] {
        let mut j = i;
        while j < out.len() && out[j].is_ascii_alphabetic() {
            j += 1;
        }
        &out[i..j]
    };
    // Written to `h` run by run (text, then each number or its mask), nothing copied.
    let mut i = 0;
    while i < out.len() {
        if !out[i].is_ascii_digit() {
            let text = i;
            while i < out.len() && !out[i].is_ascii_digit() {
                i += 1;
            }
            h.write(&out[text..i]);
            continue;
        }
        let start = i;
        while i < out.len() && out[i].is_ascii_digit() {
            i += 1;
        }
        let after = if out.get(i) == Some(&b' ') { i + 1 } else { i };
        let next = word_at(after);
        let before = {
            // The word before, across a key's punctuation: `page 2`, `"queue_position": 2`.
            let mut e = start;
            let mut skipped = 0;
            while e > 0 && skipped < 3 && matches!(out[e - 1], b' ' | b'"' | b':' | b'=') {
                e -= 1;
                skipped += 1;
            }
            let mut b = e;
            while b > 0 && out[b - 1].is_ascii_alphabetic() {
                b -= 1;
            }
            &out[b..e]
        };
        let progress = out.get(i) == Some(&b'%')
            || is_listed(next, &PROGRESS_AFTER_SET)
            || is_listed(before, &PROGRESS_BEFORE_SET);
        if progress {
            h.write(&out[start..i]);
        } else {
            h.write_u8(b'#');
        }
    }
    h.write_u8(0xff);
}

/// Whether `b` starts with a uuid (8-4-4-4-12 hex digits).
fn is_uuid(b: &[u8]) -> bool {
    // The dashes first: almost every word fails there at once.
    b.len() >= 36
        && [8, 13, 18, 23].iter().all(|&i| b[i] == b'-')
        && b[..36].iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
        && b.get(36).is_none_or(|c| !c.is_ascii_alphanumeric())
}

fn floor(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// What [`mask`] makes of a byte.
const OTHER: u8 = 0;
const SPACE: u8 = 1;
const LETTER: u8 = 2;
const DIGIT: u8 = 3;

const MASK_CLASS: [u8; 256] = {
    let mut t = [OTHER; 256];
    let mut i = 0;
    while i < 256 {
        let c = i as u8;
        t[i] = if c.is_ascii_whitespace() {
            SPACE
        } else if c.is_ascii_digit() {
            DIGIT
        } else if c.is_ascii_alphabetic() {
            LETTER
        } else {
            OTHER
        };
        i += 1;
    }
    t
};

/// The masking itself, token by token (runs of ASCII letters and digits, and the separators
/// that join numbers into times and decimals), written to `out`. One pass: each byte is
/// classed by a table and copied as it is read; a word that turns out to be a number or an id
/// is taken back and its mask written instead.
fn mask(text: &str, out: &mut Vec<u8>) {
    let b = text.as_bytes();
    let class = |i: usize| MASK_CLASS[usize::from(b[i])];
    // The output is never longer than the input.
    out.reserve(b.len());
    let mut i = 0;
    let mut space = false;
    while i < b.len() {
        let kind = class(i);
        if kind == SPACE {
            space = true;
            i += 1;
            continue;
        }
        if std::mem::take(&mut space) {
            out.push(b' ');
        }
        if kind == OTHER {
            out.push(b[i]);
            i += 1;
            continue;
        }
        // One pass over the word: copied, its end found and its digits counted.
        let start = i;
        let at = out.len();
        let mut digits = 0;
        while i < b.len() {
            let k = class(i);
            if !matches!(k, LETTER | DIGIT) {
                break;
            }
            digits += usize::from(k == DIGIT);
            out.push(b[i]);
            i += 1;
        }
        // A uuid's first group is a word of 8 hex digits followed by a dash.
        if i - start == 8 && b.get(i) == Some(&b'-') && is_uuid(&b[start..]) {
            out.truncate(at);
            out.extend_from_slice(b"<id>");
            i = start + 36;
            continue;
        }
        if digits == 0 {
            // Letters alone: kept as copied.
            continue;
        }
        let word = &b[start..i];
        if digits == word.len() {
            // A number; swallow the rest of a time (12:03:44) or a decimal (0.531).
            let mut joined = false;
            while i + 1 < b.len() && matches!(b[i], b':' | b'.') && b[i + 1].is_ascii_digit() {
                i += 1;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
                joined = true;
            }
            if joined || word.len() >= 7 {
                out.truncate(at);
                out.extend_from_slice(b"<n>");
            }
        } else if word.len() >= 8 || (word.len() >= 4 && word.iter().all(u8::is_ascii_hexdigit)) {
            // A hex run (a hash) or a long run of letters and digits: a generated id.
            out.truncate(at);
            out.extend_from_slice(b"<id>");
        } else {
            // Letters and digits (`30Z`, `01T10`, `req42x`): the digits are masked.
            out.truncate(at);
            let mut in_digits = false;
            for &c in word {
                if c.is_ascii_digit() {
                    if !in_digits {
                        out.push(b'#');
                    }
                    in_digits = true;
                } else {
                    out.push(c);
                    in_digits = false;
                }
            }
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use serde_json::json;

    /// A long text's masking is kept and found again for the next request, and only for the
    /// same bytes read: a text whose hash finds another's kept masking is masked itself.
    #[test]
    fn a_long_text_is_masked_once_and_its_masking_found_again() {
        let long = format!(
            "run 7 at 12:03:44 id 550e8400-e29b-41d4-a716-446655440000 {}",
            "ok. ".repeat(3000)
        );
        let (head, tail) = edges(&long);
        assert!(tail.is_some());
        // Masked the first time, kept the second, found the third.
        let once = masked_edges(&long);
        assert!(matches!(once, Masked::Now(_)));
        assert_eq!(*once, *mask_edges(head, tail));
        let first = masked_edges(&long);
        let again = masked_edges(&long);
        match (&first, &again) {
            (Masked::Kept(a), Masked::Kept(b)) => assert!(std::sync::Arc::ptr_eq(a, b)),
            _ => panic!("a long text's masking is kept from its second time"),
        }
        assert_eq!(*first, *once);
        assert_eq!(first.shape(), shape_of(&mask_edges(head, tail)));
        assert_eq!(again.shape(), first.shape());
        // Short texts are masked each time.
        assert!(matches!(
            masked_edges("the same error at 12:03:44"),
            Masked::Now(_)
        ));
        // Another text's masking kept under this text's key (a collision) is not used.
        let other = format!("{}!", "x".repeat(2000));
        let (oh, ot) = edges(&other);
        MASKED.insert(
            kept_key(oh, ot),
            std::sync::Arc::new(KeptMask {
                read: b"something else".to_vec().into_boxed_slice(),
                head: 14,
                tail: false,
                masked: b"wrong".to_vec().into_boxed_slice(),
                shape: std::sync::OnceLock::new(),
            }),
        );
        assert_eq!(*masked_edges(&other), *mask_edges(oh, ot));
        // A text equal at both ends to a kept one reads the same (the middle is never read).
        let middle = format!(
            "{}{}{}",
            &long[..EDGE],
            "different middle ".repeat(500),
            &long[long.len() - EDGE..]
        );
        assert_eq!(*masked_edges(&middle), *first);
    }

    /// A packed word list answers as comparing with each word, case aside, did.
    #[test]
    fn packed_word_lists_answer_as_the_lists() {
        let listed = |w: &[u8], list: &[&[u8]]| list.iter().any(|x| x.eq_ignore_ascii_case(w));
        let mut words: Vec<Vec<u8>> = Vec::new();
        for w in PROGRESS_AFTER
            .iter()
            .chain(PROGRESS_BEFORE)
            .chain(&FUNCTION_WORD_LIST)
        {
            words.push(w.to_vec());
            words.push(w.to_ascii_uppercase());
            words.push(w[..w.len() - 1].to_vec());
            words.push([*w, b"s"].concat());
        }
        words.extend([
            b"".to_vec(),
            b"x".repeat(16),
            b"x".repeat(17),
            b"Passedd".to_vec(),
        ]);
        for w in &words {
            assert_eq!(
                is_listed(w, &PROGRESS_AFTER_SET),
                listed(w, PROGRESS_AFTER),
                "{w:?}"
            );
            assert_eq!(
                is_listed(w, &PROGRESS_BEFORE_SET),
                listed(w, PROGRESS_BEFORE),
                "{w:?}"
            );
            assert_eq!(
                is_listed(w, &FUNCTION_WORDS),
                listed(w, &FUNCTION_WORD_LIST),
                "{w:?}"
            );
        }
    }

    fn call(name: &str, args: Value) -> Value {
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": name, "arguments": args.to_string()}}]})
    }

    fn result(text: &str) -> Value {
        json!({"role": "tool", "tool_call_id": "c", "content": text})
    }

    fn session<S: AsRef<str>>(steps: &[(Value, S)]) -> Vec<Value> {
        let mut m = vec![
            json!({"role": "system", "content": "You are a coding agent."}),
            json!({"role": "user", "content": "Fix the failing test."}),
        ];
        for (a, r) in steps {
            m.push(a.clone());
            m.push(result(r.as_ref()));
        }
        m
    }

    #[test]
    fn repeating_while_the_user_objects_is_a_loop_and_objecting_alone_is_not() {
        let say = |role: &str, text: &str| json!({"role": role, "content": text});
        // The same non-answer, reworded, to a customer who says it is not one.
        let replies = [
            "Refunds go back to your original payment method and take 5-10 business days after approval.",
            "I understand. Once a refund is approved it returns to the original payment method; it takes 5-10 business days.",
            "Sorry for the wait! Approved refunds normally take 5 to 10 business days to reach the payment method.",
        ];
        let users = [
            "Where is my money?",
            "You're not answering me. Was it sent?",
            "That's not what I asked. I need a reference for my bank.",
        ];
        let mut chat = vec![say("user", "I returned a grinder, where is my refund?")];
        for (r, u) in replies.iter().zip(users) {
            chat.push(say("assistant", r));
            chat.push(say("user", u));
        }
        let found = in_request(&chat).unwrap();
        assert!(found.what.contains("while the user objects"), "{found:?}");
        // The same replies to a user who asks for more, or different replies to one who
        // objects, are not a loop.
        let mut asking = chat.clone();
        asking[4] = say("user", "And how long for a card?");
        asking[6] = say("user", "And for a bank transfer?");
        assert_eq!(in_request(&asking), None);
        let mut helped = chat.clone();
        helped[3] = say("assistant", "Let me check with the payments team.");
        helped[5] = say(
            "assistant",
            "The transfer reference is RF-2291; your bank can trace it.",
        );
        assert_eq!(in_request(&helped), None);

        // The same failing call twice, then the user says there is a misunderstanding.
        let update = call("update_reservation", json!({"flight": "HAT030"}));
        let failing = "Error: flight HAT030 not available";
        let mut calls = vec![
            say("user", "Change my flight to HAT052."),
            update.clone(),
            result(failing),
            say(
                "assistant",
                "HAT030 is not available. Shall I search another?",
            ),
            say("user", "I wanted HAT052, from Atlanta."),
            update.clone(),
            result(failing),
            say("assistant", "There is still an issue with HAT030."),
            say(
                "user",
                "I think there might be a misunderstanding: Atlanta to Las Vegas.",
            ),
        ];
        let found = in_request(&calls).unwrap();
        assert_eq!((found.repeats, found.period), (2, 1), "{found:?}");
        assert!(found.what.contains("update_reservation"), "{found:?}");
        // Without the objection, or when the call succeeded, it is not.
        let last = calls.len() - 1;
        calls[last] = say("user", "Please use Atlanta to Las Vegas.");
        assert_eq!(in_request(&calls), None);
        // The user objecting between the two failures is the same loop.
        calls[4] = say("user", "Actually, I wanted HAT052, from Atlanta.");
        assert!(in_request(&calls).is_some());
        calls[4] = say("user", "I wanted HAT052, from Atlanta.");

        // A coding agent's observations, sent as user messages, are not a person objecting:
        // command output that mentions `confusion_matrix` after similar replies is progress.
        let mut coding = vec![say("user", "Fix the crash in sklearn's confusion_matrix.")];
        for (i, file) in ["metrics.py", "_classification.py", "test_metrics.py"]
            .iter()
            .enumerate()
        {
            coding.push(say(
                "assistant",
                &format!("THOUGHT: look at the confusion matrix code in {file}.\n```bash\ngrep -n confusion {file}\n```"),
            ));
            coding.push(say(
                "user",
                &format!("<returncode>0</returncode>\n<output>{}: def confusion_matrix(y_true, y_pred): # the same thing as before, confusion {i}\n</output>", 100 + i),
            ));
        }
        assert_eq!(in_request(&coding), None);
        calls[last] = say("user", "I think there might be a misunderstanding.");
        calls[2] = result("{\"status\": \"updated\"}");
        calls[6] = result("{\"status\": \"updated\"}");
        assert_eq!(in_request(&calls), None);
    }

    #[test]
    fn one_attempt_reworded_with_the_same_result_is_a_loop_and_other_attempts_are_not() {
        let grep = |cmd: &str| call("bash", json!({ "command": cmd }));
        let empty = "<returncode>1</returncode><output></output>";
        let reworded = session(&[
            (grep("grep -rn 'def load_plugins' src"), empty),
            (grep("grep -Rn \"def load_plugins\" ./src/"), empty),
            (grep("grep -rn \"def load_plugins\" src/"), empty),
        ]);
        assert_eq!(in_request(&reworded).map(|l| l.repeats), Some(3));
        // Looking for three different things and finding none is not one attempt repeated.
        let different = session(&[
            (grep("grep -rn 'def load_plugins' src"), empty),
            (grep("grep -rn 'class PluginLoader' src"), empty),
            (grep("grep -rn 'register_plugin' src"), empty),
        ]);
        assert_eq!(in_request(&different), None);
        // Nor is the same search reworded when what comes back changes.
        let search = |q: &str| call("web_search", json!({ "query": q, "page": 1 }));
        let progressing = session(&[
            (search("kafka rebalance storm causes"), "results: KIP-345"),
            (
                search("causes of kafka rebalance storms"),
                "results: KIP-429",
            ),
            (
                search("kafka consumer rebalance storm causes"),
                "results: KIP-848",
            ),
        ]);
        assert_eq!(in_request(&progressing), None);
        // Keys are not words: two edits of other files with the same empty output differ.
        let edit = |path: &str| call("write_file", json!({ "path": path, "content": "x = 1" }));
        let edits = session(&[
            (edit("src/app/models.py"), ""),
            (edit("src/app/views.py"), ""),
            (edit("docs/usage.md"), ""),
        ]);
        assert_eq!(in_request(&edits), None);
        // Seen in real coding-agent runs (mini-swe-agent): silent edits that differ in one
        // identifier or one digit are edits of other things, however alike their words.
        let ok = "<returncode>0</returncode><output></output>";
        let sed = |n: u8| {
            grep(&format!(
                "sed -i 's/arg{n}_is_arr = isinstance(args\\[{n}\\], np.ndarray)/arg{n}_is_seq = \
                 isinstance(args[{n}], (np.ndarray, Sequence))/' ./pyvista/core/grid.py"
            ))
        };
        let seds = session(&[(sed(0), ok), (sed(1), ok), (sed(2), ok)]);
        assert_eq!(in_request(&seds), None);
        // And patches of one file, written silently: their first 64 words (the diff's header
        // and context) agree, what they change does not.
        let context: String = (0..40).map(|i| format!(" line{i} of context\n")).collect();
        let patch = |change: &str| {
            grep(&format!(
                "cat > fix.patch << 'EOF'\n--- a/django/db/models/sql/compiler.py\n+++ \
                 b/django/db/models/sql/compiler.py\n@@ -711,7 +711,12 @@\n{context}-    old\n\
                 +    {change}\nEOF"
            ))
        };
        let patches = session(&[
            (patch("ordering = model_ordering"), ok),
            (patch("ordering = parent_ordering"), ok),
            (patch("if name == 'pk': ordering = []"), ok),
        ]);
        assert_eq!(in_request(&patches), None);
        // The very same patch written again and again is still a loop.
        let same = session(&[
            (patch("ordering = model_ordering"), ok),
            (patch("ordering = model_ordering"), ok),
            (patch("ordering = model_ordering"), ok),
        ]);
        assert_eq!(in_request(&same).map(|l| l.repeats), Some(3));
    }

    #[test]
    fn a_json_reply_is_compared_with_its_spacing_ignored() {
        let reply = |text: &str| json!({"role": "assistant", "content": text});
        let error =
            json!({"role": "user", "content": "Could not parse LLM output: action_input missing"});
        let mut m = vec![json!({"role": "user", "content": "Where does the Rhine rise?"})];
        for text in [
            r#"{"thought": "Switzerland.", "action": "finish"}"#,
            r#"{"thought": "Switzerland.","action": "finish"}"#,
            r#"{"action":"finish", "thought":"Switzerland."}"#,
        ] {
            m.push(reply(text));
            m.push(error.clone());
        }
        assert_eq!(in_request(&m).map(|l| l.repeats), Some(3));
    }

    #[test]
    fn the_same_call_with_the_same_result_three_times_is_a_loop() {
        let step = (
            call("run_tests", json!({"path": "tests/"})),
            "FAILED test_x: 1 failed",
        );
        let m = session(&[step.clone(), step.clone()]);
        assert_eq!(in_request(&m), None, "twice is not yet a loop");
        let m = session(&[step.clone(), step.clone(), step]);
        let l = in_request(&m).unwrap();
        assert_eq!((l.repeats, l.period), (3, 1));
        assert_eq!(l.what, "tool call `run_tests`");
    }

    #[test]
    fn timestamps_ids_and_durations_do_not_hide_a_repeat() {
        let steps: Vec<(Value, String)> = (0..3)
            .map(|i| {
                (
                    call("check_job", json!({"job": "build"})),
                    format!(
                        "2026-12-01T10:0{i}:3{i}Z job 550e840{i}-e29b-41d4-a716-44665544000{i} \
                         still failing after 0.5{i}s (epoch 176452800{i})"
                    ),
                )
            })
            .collect();
        assert!(in_request(&session(&steps)).is_some());
    }

    #[test]
    fn arguments_differing_only_in_spacing_are_the_same_call() {
        let raw = |args: &str| {
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c",
                "type": "function", "function": {"name": "grep", "arguments": args}}]})
        };
        let steps = [
            (raw(r#"{"pattern": "fn main", "path": "src/"}"#), "no match"),
            (raw(r#"{"pattern":"fn main","path":"src/"}"#), "no match"),
            (
                raw("{\n  \"pattern\": \"fn main\",\n  \"path\": \"src/\"\n}"),
                "no match",
            ),
        ];
        assert!(in_request(&session(&steps)).is_some());
        // Keys in another order are the same call; a different value is not.
        let steps = [
            (raw(r#"{"pattern": "fn main", "path": "src/"}"#), "no match"),
            (raw(r#"{"path": "src/", "pattern": "fn main"}"#), "no match"),
            (raw(r#"{"pattern": "fn run", "path": "src/"}"#), "no match"),
        ];
        assert!(in_request(&session(&steps)).is_none());
        let steps = [
            (raw(r#"{"pattern": "fn main", "path": "src/"}"#), "no match"),
            (raw(r#"{"path": "src/", "pattern": "fn main"}"#), "no match"),
            (raw(r#"{"path":"src/","pattern":"fn main"}"#), "no match"),
        ];
        assert!(in_request(&session(&steps)).is_some());
    }

    #[test]
    fn an_a_b_a_b_cycle_is_a_loop() {
        let a = (call("open_file", json!({"path": "a.py"})), "def f(): pass");
        let b = (
            call("edit_file", json!({"path": "a.py", "text": "x"})),
            "SyntaxError line 3",
        );
        let l = in_request(&session(&[a.clone(), b.clone(), a, b])).unwrap();
        assert_eq!((l.repeats, l.period), (2, 2));
    }

    #[test]
    fn progress_is_not_a_loop() {
        // Running the tests again after each edit, with a different outcome each time.
        let steps = [
            (call("run_tests", json!({})), "3 failed, 7 passed"),
            (call("edit_file", json!({"path": "a.py", "line": 10})), "ok"),
            (call("run_tests", json!({})), "2 failed, 8 passed"),
            (call("edit_file", json!({"path": "a.py", "line": 42})), "ok"),
            (call("run_tests", json!({})), "1 failed, 9 passed"),
        ];
        assert_eq!(in_request(&session(&steps)), None);
        // Paging through a file (below and beyond line 1000): same tool, moving argument.
        let pages = |from: i64| -> Vec<(Value, String)> {
            (from..from + 6)
                .map(|i| {
                    (
                        call("read_file", json!({"path": "big.py", "offset": i * 100})),
                        format!("lines {}-{}", i * 100, i * 100 + 99),
                    )
                })
                .collect()
        };
        assert_eq!(in_request(&session(&pages(0))), None);
        assert_eq!(in_request(&session(&pages(10))), None);
        // Polling a job that moves on.
        let polls: Vec<(Value, String)> = (1..=5)
            .map(|i| {
                (
                    call("job_status", json!({"id": "j1"})),
                    format!("{}% done", i * 20),
                )
            })
            .collect();
        assert_eq!(in_request(&session(&polls)), None);
    }

    #[test]
    fn a_chat_agent_given_the_same_format_error_again_and_again_is_a_loop() {
        let mut m = vec![json!({"role": "user", "content": "Answer in JSON."})];
        for _ in 0..3 {
            m.push(json!({"role": "assistant", "content": "Sure! Here is the answer: yes"}));
            m.push(json!({"role": "user", "content": "Your reply was not valid JSON. Try again."}));
        }
        assert!(in_request(&m).is_some());
    }

    #[test]
    fn a_text_protocol_agent_is_judged_by_its_command_blocks_not_its_prose() {
        let reply = |prose: &str, blocks: &[&str]| {
            let code: Vec<String> = blocks.iter().map(|b| format!("```\n{b}\n```")).collect();
            json!({"role": "assistant", "content": format!("DISCUSSION\n{prose}\n\n{}", code.join("\n\n"))})
        };
        let said = |text: &str| json!({"role": "user", "content": text});
        let error = "Your output was not formatted correctly. You must always include one \
                     discussion and one command as part of your response.";
        let two = ["open src/parse.py", "search_file \"def parse\""];
        let mut m = vec![said("ISSUE: parse('1h30m') is wrong.")];
        for prose in [
            "Let me open the file and search for the function.",
            "I'll open parse.py and jump to parse.",
            "Opening the file and searching for the definition.",
        ] {
            m.push(reply(prose, &two));
            m.push(said(error));
        }
        let l = in_request(&m).unwrap();
        assert_eq!((l.repeats, l.period), (3, 1));
        // Paging: the same command, reworded, with a new window of the file each time.
        let mut m = vec![said("ISSUE: parse('1h30m') is wrong.")];
        for (prose, window) in [
            ("Let me scroll down.", "101: def tokens(text):"),
            ("More of it.", "201: def units(spec):"),
            ("Still not there.", "301: def parse(spec):"),
        ] {
            m.push(reply(prose, &["scroll_down"]));
            m.push(said(&format!(
                "[File: src/parse.py (900 lines total)]\n{window} ..."
            )));
        }
        assert_eq!(in_request(&m), None);
        // The same error after different commands is not one step repeated.
        let mut m = vec![said("ISSUE: parse('1h30m') is wrong.")];
        for cmd in ["open a.py", "open b.py", "open c.py"] {
            m.push(reply("Next file.", &[cmd, "goto 10"]));
            m.push(said(error));
        }
        assert_eq!(in_request(&m), None);
    }

    #[test]
    fn the_same_snippet_offered_again_while_the_user_objects_is_a_loop() {
        let offer = |prose: &str, code: &str| json!({"role": "assistant", "content": format!("{prose}\n\n```regex\n{code}\n```\n")});
        let said = |text: &str| json!({"role": "user", "content": text});
        let ask = said("A regex for lowercase identifiers with hyphens, like foo-bar_baz?");
        let mut m = vec![ask.clone()];
        for (prose, objection) in [
            (
                "You can use:",
                "That doesn't match foo-bar_baz, it fails on the hyphen.",
            ),
            (
                "Good catch! Here's one that handles it:",
                "It's the same regex. Still fails.",
            ),
            (
                "Sorry! Try this one:",
                "You keep giving me the same thing. The hyphen!",
            ),
        ] {
            m.push(offer(prose, "^[a-z_]+$"));
            m.push(said(objection));
        }
        let l = in_request(&m).unwrap();
        assert_eq!((l.repeats, l.period), (3, 1), "{l:?}");
        // Twice is not yet a loop.
        assert_eq!(in_request(&m[..5]), None);
        // A new snippet each time is help being tried.
        let mut m = vec![ask.clone()];
        for code in ["^[a-z_]+$", "^[a-z_-]+$", "^[a-z][a-z_-]*$"] {
            m.push(offer("Try:", code));
            m.push(said("Still not right."));
        }
        assert_eq!(in_request(&m), None);
        // The same status command while a number moves is a job being watched.
        let mut m = vec![said("Deploy and tell me when it is live.")];
        for progress in ["rollout 20% done", "rollout 60% done", "rollout 90% done"] {
            m.push(offer("Checking:", "kubectl rollout status deploy/web"));
            m.push(said(progress));
        }
        assert_eq!(in_request(&m), None);
        // A harness's long observation is not a user's objection.
        let mut m = vec![said("ISSUE: parse is wrong.")];
        for name in ["tokens", "units", "parse"] {
            m.push(offer("Scrolling.", "scroll_down"));
            let line = format!("    def {name}(text): return split(text)\n");
            m.push(said(&format!("[File: src/parse.py]\n{}", line.repeat(8))));
        }
        assert_eq!(in_request(&m), None);
    }

    #[test]
    fn the_same_failing_call_with_only_thoughts_between_is_a_loop() {
        // tau-bench airline, task 8 trial 1 (gpt-4o): the same booking fails three times,
        // each time after a reworded `think`, then the agent hands over to a human.
        let book = (
            call(
                "book_reservation",
                json!({"user_id": "u1", "flights": ["HAT069"], "paid": 1625}),
            ),
            "Error: payment amount does not add up, total price is 4875, but paid 1625",
        );
        let think = |t: &str| (call("think", json!({ "thought": t })), "");
        let m = session(&[
            book.clone(),
            think("The payment may be wrong. I need to verify the segments."),
            book.clone(),
            think("I need to verify the correct flight segments and the total."),
        ]);
        assert_eq!(in_request(&m), None, "twice");
        let mut three = m.clone();
        three.extend(session(std::slice::from_ref(&book)).into_iter().skip(2));
        let l = in_request(&three).unwrap();
        assert_eq!((l.repeats, l.period), (3, 1));
        assert!(l.what.contains("only thoughts between"), "{}", l.what);
        // A calculation between comes back with something new: the agent is working on it
        // (task 11 trial 2 recalculates and then books successfully).
        let calc = (
            call("calculate", json!({"expression": "158 + 141"})),
            "299.0",
        );
        let m = session(&[
            book.clone(),
            think("recalculate"),
            book.clone(),
            think("the total may be off"),
            calc,
            book,
        ]);
        assert_eq!(in_request(&m), None);
    }

    #[test]
    fn the_same_failing_call_sent_again_after_each_user_answer_is_a_loop() {
        // tau-bench airline, task 13: the update with the unavailable flight, again and again,
        // while the user keeps asking for the change.
        let update = |error: bool| {
            (
                call(
                    "update_reservation_flights",
                    json!({"reservation_id": "XEWRD9", "flights": ["HAT030", "HAT052"]}),
                ),
                if error {
                    "Error: flight HAT030 not available on date 2024-05-13"
                } else {
                    r#"{"reservation_id": "XEWRD9", "flights": ["HAT030", "HAT052"], "cabin": "economy"}"#
                },
            )
        };
        let user = |said: &str| {
            vec![
                json!({"role": "assistant", "content": "It seems flight HAT030 is not available."}),
                json!({"role": "user", "content": said}),
            ]
        };
        let mut m = session(&[update(true)]);
        // (A user correcting the agent, "Actually, I wanted …", is an objection: see
        // `repeating_while_the_user_objects_is_a_loop_and_objecting_alone_is_not`.)
        m.extend(user("I'd like HAT052, can you do that?"));
        m.extend(session(&[update(true)]).into_iter().skip(2));
        m.extend(user("Please focus on the Atlanta to Las Vegas flight."));
        assert_eq!(in_request(&m), None, "one retry after the user answered");
        m.extend(session(&[update(true)]).into_iter().skip(2));
        let l = in_request(&m).unwrap();
        assert_eq!((l.repeats, l.period), (3, 1));
        assert!(l.what.contains("after the user answered"), "{}", l.what);
        // The user's word may come back with the tool's answer itself.
        let mut m = session(&[update(true)]);
        for _ in 0..2 {
            m.push(json!({"role": "user", "content": "Try that again please."}));
            m.extend(session(&[update(true)]).into_iter().skip(2));
        }
        assert_eq!(in_request(&m).map(|l| l.repeats), Some(3));
        // A record read again for each new question succeeds each time: not this.
        let mut m = session(&[update(false)]);
        for said in ["And the cabin?", "And the dates?"] {
            m.extend(user(said));
            m.extend(session(&[update(false)]).into_iter().skip(2));
        }
        assert_eq!(in_request(&m), None);
    }

    #[test]
    fn the_same_step_three_times_with_one_other_between_is_a_loop() {
        let write = (
            call(
                "bash",
                json!({"command": "cat > fix.patch << 'EOF'\n+ raise Http404\nEOF"}),
            ),
            "<returncode>0</returncode><output></output>",
        );
        let look = (
            call("bash", json!({"command": "sed -n '250,270p' resolvers.py"})),
            "<returncode>0</returncode><output>def match(self, path):</output>",
        );
        let m = session(&[write.clone(), write.clone(), look.clone()]);
        assert_eq!(in_request(&m), None, "twice, then something else");
        let m = session(&[write.clone(), write.clone(), look.clone(), write.clone()]);
        let l = in_request(&m).unwrap();
        assert_eq!((l.repeats, l.period), (3, 1));
        assert!(l.what.contains("one other step"), "{}", l.what);
        // Re-running the tests after each of two different edits, the failure unchanged: the
        // agent is trying things, not repeating one.
        let test = (call("run_tests", json!({})), "FAILED test_parse: 1 failed");
        let edit = |new: &str| {
            let args = json!({"path": "parse.py", "old": "hours * 60", "new": new});
            (
                call("str_replace", args),
                "The file parse.py has been edited.",
            )
        };
        let m = session(&[
            test.clone(),
            edit("hours * 3600"),
            test.clone(),
            edit("int(hours) * 3600 + minutes"),
            test.clone(),
        ]);
        assert_eq!(in_request(&m), None);
        // Two others between is not one interruption.
        let m = session(&[write.clone(), look, edit("x"), write.clone(), write]);
        assert_eq!(in_request(&m), None);
    }

    #[test]
    fn a_lookup_reworded_between_replies_with_the_same_result_is_a_loop() {
        let article = r#"{"results": [{"id": "kb-118", "title": "Cancel your membership", "body": "Go to Account > Membership > Cancel membership on the website."}]}"#;
        let search = |q: &str| call("search_kb", json!({ "query": q }));
        let answer = |text: &str| json!({"role": "assistant", "content": text});
        let user = |text: &str| json!({"role": "user", "content": text});
        let conversation = |steps: &[(Value, &str, &str, &str)]| {
            let mut m = vec![user("How do I cancel my membership?")];
            for (action, found, reply, objection) in steps {
                m.push(action.clone());
                m.push(result(found));
                m.push(answer(reply));
                m.push(user(objection));
            }
            m
        };
        let mut m = conversation(&[
            (
                search("cancel membership"),
                article,
                "Go to Account > Membership.",
                "I pay through Apple.",
            ),
            (
                search("how to cancel subscription"),
                article,
                "Open Account > Membership.",
                "Again: Apple.",
            ),
        ]);
        m.push(search("membership cancellation"));
        m.push(result(article));
        let l = in_request(&m).unwrap();
        assert_eq!(l.repeats, 3);
        assert!(l.what.contains("reworded"), "{}", l.what);
        // Re-reading the same record to answer each new question about it is not a loop.
        let order = r#"{"order_id": "G9012", "status": "shipped", "items": [{"name": "kettle", "qty": 1}], "address": "12 Elm St"}"#;
        let lookup = || call("get_order", json!({"order_id": "G9012"}));
        let mut m = conversation(&[
            (lookup(), order, "It has shipped.", "What was in it?"),
            (lookup(), order, "One kettle.", "Where is it going?"),
        ]);
        m.push(lookup());
        m.push(result(order));
        assert_eq!(in_request(&m), None);
        // Reworded searches that find nothing say too little to call it the same step.
        let mut m = conversation(&[
            (
                search("flights LAX ORD May 13"),
                "[]",
                "None found.",
                "Try one stop.",
            ),
            (
                search("one-stop LAX ORD May 13"),
                "[]",
                "None either.",
                "Try May 14.",
            ),
        ]);
        m.push(search("flights LAX ORD May 14"));
        m.push(result("[]"));
        assert_eq!(in_request(&m), None);
        // Nor is a reworded search whose result changes.
        let mut m = conversation(&[(
            search("cancel membership"),
            article,
            "Go to Account > Membership.",
            "I pay through Apple.",
        )]);
        m.push(search("cancel membership app store"));
        m.push(result(&article.replace("kb-118", "kb-240")));
        m.push(answer("Cancel it in the App Store settings."));
        m.push(user("And the refund?"));
        m.push(search("membership refund"));
        m.push(result(article));
        assert_eq!(in_request(&m), None);
    }

    #[test]
    fn asking_again_for_what_the_user_already_gave_is_a_loop() {
        let chat = |turns: &[(&str, &str)]| {
            let mut m =
                vec![json!({"role": "user", "content": "I need to change my delivery address."})];
            for (reply, user) in turns {
                m.push(json!({"role": "assistant", "content": reply}));
                m.push(json!({"role": "user", "content": user}));
            }
            m
        };
        let asked = chat(&[
            ("Could you share your order number?", "It's G9012."),
            (
                "Thanks! Could you provide the order ID?",
                "I just did. G9012.",
            ),
        ]);
        assert_eq!(in_request(&asked), None, "asked twice is not yet a loop");
        let asked = chat(&[
            ("Could you share your order number?", "It's G9012."),
            (
                "Thanks! Could you provide the order ID?",
                "I just did. G9012.",
            ),
            (
                "Can you confirm your order number so I can pull it up?",
                "G9012!!!",
            ),
        ]);
        let l = in_request(&asked).unwrap();
        assert_eq!(l.repeats, 3);
        // An agent that takes the identifier in says it back, and may ask other things.
        let progressing = chat(&[
            ("Could you share your order number?", "It's G9012."),
            (
                "Order G9012 is processing. What is the new address?",
                "12 Elm St, for G9012.",
            ),
            ("Shall I change G9012 to 12 Elm St?", "Yes, G9012, please."),
        ]);
        assert_eq!(in_request(&progressing), None);
        // A user who names the order in every message while the agent answers is not
        // answering the same question again.
        let progressing = chat(&[
            ("Could you share your order number?", "It's G9012."),
            ("It ships tomorrow.", "Can G9012 go to my office?"),
            ("Yes. Which address?", "G9012 to 4 Oak Rd."),
        ]);
        assert_eq!(in_request(&progressing), None);
    }

    #[test]
    fn a_huge_conversation_is_read_in_bounded_work() {
        let big = "x".repeat(32 * 1024);
        let mut m = Vec::new();
        for i in 0..2000 {
            m.push(json!({"role": "assistant", "content": format!("part {}", i % 997)}));
            m.push(json!({"role": "user", "content": big.clone()}));
        }
        // The last 64 messages, 8 KiB of each at most: microseconds, not the 64 MiB given. The
        // fastest of five runs, so that a busy machine (the suite runs tests in parallel on
        // two cores) does not fail it by a scheduling delay.
        let fastest = (0..5)
            .map(|_| {
                let t = std::time::Instant::now();
                assert_eq!(in_request(&m), None);
                t.elapsed()
            })
            .min()
            .unwrap();
        assert!(
            fastest < std::time::Duration::from_millis(50),
            "{fastest:?}"
        );
    }

    #[test]
    fn an_ask_reworded_in_function_words_is_the_same_ask_and_another_ask_is_not() {
        let ask = |q: &str| {
            let m = [
                json!({"role": "system", "content": "You are the help assistant."}),
                json!({"role": "user", "content": q}),
            ];
            latest_turn(&m).unwrap().fingerprint
        };
        let reset = ask("How do I reset my API key?");
        assert_eq!(reset, ask("how can i reset the api key"));
        assert_eq!(reset, ask("reset api key how??"));
        for other in [
            "How do I delete my API key?",
            "What are the steps to regenerate an API key?",
            "How do I reset my API key on the EU workspace?",
        ] {
            assert_ne!(reset, ask(other), "{other}");
        }
        // Negation, order and numbers are content.
        assert_ne!(
            ask("Review: Good value for the price."),
            ask("Review: Not good value for the price.")
        );
        assert_ne!(
            ask("Review: it's good value."),
            ask("Review: it isn't good value.")
        );
        assert_ne!(
            ask("flights from Paris to Rome"),
            ask("flights from Rome to Paris")
        );
        assert_ne!(ask("status of order 1182?"), ask("status of order 1183?"));
        // An ask of function words alone is compared as written.
        assert_ne!(ask("what is it?"), ask("what was it?"));
        // A word longer than 64 bytes is one word, not its pieces.
        let long = "k".repeat(128);
        assert_ne!(
            ask(&format!("decode {long}")),
            ask(&format!("decode {} {}", &long[..64], &long[64..]))
        );
        assert_eq!(
            ask(&format!("decode {long}")),
            ask(&format!("Decode {long}?"))
        );
    }

    #[test]
    fn a_run_broken_once_is_found_in_any_sequence() {
        let same = |xs: &'static [u8]| move |a: usize, b: usize| xs[a] == xs[b];
        assert_eq!(broken_run(4, same(b"aaxa"), 3), Some(3));
        assert_eq!(broken_run(4, same(b"axaa"), 3), Some(3));
        assert_eq!(broken_run(4, same(b"axya"), 3), None);
        assert_eq!(
            broken_run(3, same(b"aaa"), 3),
            None,
            "a plain run is repetition's"
        );
        assert_eq!(broken_run(5, same(b"aaxaa"), 4), Some(4));
    }
}
