//! Where session windows live: the [`GuardStore`] contract, its data, and the one encoding of a
//! turn both stores use. [`super::memory::MemoryGuard`] (this process, bounded LRU) and
//! [`super::redis::RedisGuard`] (shared by every replica; one Lua script per call, every key
//! under the tenant's `{hash tag}`) pass one conformance suite (`tests/tests/guard_store.rs`).

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::near::{Sketch, SKETCH_DIM};

/// Failures of a guard store; the request then goes on unguarded (the in-request signal
/// still applies).
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// Redis failed or is unreachable.
    #[error("guard store error: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// The store did not answer within `guard.store_timeout_ms`.
    #[error("guard store timed out")]
    Timeout,
    /// The store failed moments ago and is skipped until its backoff ends.
    #[error("guard store unavailable (backing off after a failure)")]
    Unavailable,
    /// A reply could not be decoded.
    #[error("guard store protocol error: {0}")]
    Protocol(String),
}

/// A session of a tenant: one string (tenant id, a NUL, session id), so making, hashing and
/// comparing one is one allocation and one pass, for the check and again at settle.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SessionKey {
    joined: String,
    split: usize,
}

impl SessionKey {
    /// Session `session` of tenant `tenant_id`.
    pub fn new(tenant_id: &str, session: &str) -> Self {
        let mut joined = String::with_capacity(tenant_id.len() + 1 + session.len());
        joined.push_str(tenant_id);
        joined.push('\0');
        joined.push_str(session);
        Self {
            joined,
            split: tenant_id.len(),
        }
    }

    /// The tenant id.
    pub fn tenant_id(&self) -> &str {
        &self.joined[..self.split]
    }

    /// The session id.
    pub fn session(&self) -> &str {
        &self.joined[self.split + 1..]
    }
}

/// One request's latest turn, as a session window keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// When it arrived, ms since the epoch.
    pub at_ms: i64,
    /// Hash of the turn (normalised; the same step, the same hash).
    pub step: u64,
    /// Hash of the whole request (a byte-identical retry has the same one).
    pub request: u64,
    /// A text reply or ask (not a tool call): compared by its sketch too.
    pub text: bool,
    /// Set at settle when the request was answered (2xx). Only the newest turn's mark decides
    /// anything (a byte-identical request sent before it was answered is a retry; an older turn
    /// never becomes the newest again), so a window a store answers carries it for its newest
    /// turn; the Redis store keeps no older turn's.
    pub answered: bool,
    /// Its sketch, when the static model was loaded (boxed: most turns have none, and a window
    /// of unboxed ones would be four times the size).
    pub sketch: Option<Box<Sketch>>,
}

/// Bytes of an encoded turn.
pub const TURN_BYTES: usize = 8 + 8 + 8 + 1 + SKETCH_DIM;
/// Offset of the flags byte in an encoded turn (the Lua scripts read it).
pub const FLAGS_AT: usize = 24;
const TEXT: u8 = 1;
const ANSWERED: u8 = 2;
const SKETCHED: u8 = 4;

impl Turn {
    /// Whether a loop could end at this turn after the `earlier` ones: one of them is the same
    /// step, or this one has a sketch (compared by cosine). A loop ends in a repeat of its latest
    /// step, so a turn unlike every earlier one, and without a sketch, ends none.
    pub fn may_repeat<'a>(&self, mut earlier: impl Iterator<Item = &'a Turn>) -> bool {
        self.sketch.is_some() || earlier.any(|t| t.step == self.step)
    }

    /// The fixed-size encoding both stores keep: at, step, request (big-endian), flags, sketch.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(TURN_BYTES);
        b.extend_from_slice(&self.at_ms.to_be_bytes());
        b.extend_from_slice(&self.step.to_be_bytes());
        b.extend_from_slice(&self.request.to_be_bytes());
        let mut flags = 0;
        if self.text {
            flags |= TEXT;
        }
        if self.answered {
            flags |= ANSWERED;
        }
        if self.sketch.is_some() {
            flags |= SKETCHED;
        }
        b.push(flags);
        match &self.sketch {
            Some(s) => b.extend_from_slice(&s.to_bytes()),
            None => b.extend_from_slice(&[0; SKETCH_DIM]),
        }
        b
    }

    /// Decode [`Self::encode`]'s bytes.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != TURN_BYTES {
            return None;
        }
        let u = |at: usize| u64::from_be_bytes(b[at..at + 8].try_into().unwrap_or_default());
        let flags = b[FLAGS_AT];
        Some(Self {
            at_ms: i64::from_be_bytes(b[0..8].try_into().ok()?),
            step: u(8),
            request: u(16),
            text: flags & TEXT != 0,
            answered: flags & ANSWERED != 0,
            sketch: if flags & SKETCHED != 0 {
                Sketch::from_bytes(&b[FLAGS_AT + 1..]).map(Box::new)
            } else {
                None
            },
        })
    }

    /// The request hash as the Lua scripts compare it (the encoding's bytes 16..24).
    pub fn request_bytes(request: u64) -> [u8; 8] {
        request.to_be_bytes()
    }
}

/// The last loop found in a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoopNote {
    /// What repeated, for people.
    pub what: String,
    /// How many times.
    pub repeats: u32,
    /// Steps in the repeating unit.
    pub period: u32,
    /// When it was found, ms since the epoch.
    pub at_ms: i64,
}

/// What a store knows about a session.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionState {
    /// First request, ms since the epoch.
    pub first_seen_ms: i64,
    /// Latest request, ms since the epoch.
    pub last_seen_ms: i64,
    /// Requests seen (retries included).
    pub requests: u64,
    /// Requests answered while flagged as a loop.
    pub flagged: u64,
    /// Requests refused (throttled or blocked).
    pub refused: u64,
    /// What the session's answered requests cost, micro-dollars.
    pub cost_micros: i64,
    /// What its latest answered request cost: the estimate for one it is refused.
    pub last_cost_micros: i64,
    /// What refusing its requests saved (estimated), micro-dollars.
    pub avoided_micros: i64,
    /// Refused until then (a throttle's cooldown), ms since the epoch; 0: none.
    pub cooldown_until_ms: i64,
    /// Blocked since then until an admin clears it, ms since the epoch; 0: not blocked.
    pub blocked_at_ms: i64,
    /// The latest loop found.
    pub last_loop: Option<LoopNote>,
}

/// A session as `gatewayctl sessions` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// Tenant id.
    pub tenant_id: String,
    /// Session id.
    pub session: String,
    /// Its state.
    #[serde(flatten)]
    pub state: SessionState,
    /// Turns in its window.
    pub turns: usize,
}

/// What the caller knows about a request being a client retry, for
/// [`GuardStore::retry_counts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Known<'a> {
    /// The client said so (or repeated an `Idempotency-Key`).
    Retry,
    /// A retry if API key `key_id` got an error answer to `fingerprint` within `ttl_ms`
    /// ([`GuardStore::mark_failed`]).
    IfFailed {
        /// The API key.
        key_id: &'a str,
        /// The request's fingerprint.
        fingerprint: &'a str,
        /// Now, ms since the epoch.
        now_ms: i64,
        /// How long after an error answer a repeat counts as a retry.
        ttl_ms: i64,
    },
}

/// A tenant's retry-budget counts over the window, and what the count found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryCounts {
    /// Requests in the window (this one included).
    pub requests: u32,
    /// Client retries in the window (this one included, if it is one).
    pub retries: u32,
    /// This request repeats one that got an error answer lately ([`Known::IfFailed`]).
    pub after_error: bool,
}

/// `sessions` most recently seen first (ties by id), at most `limit`: how both stores list.
pub fn most_recent(mut sessions: Vec<SessionInfo>, limit: usize) -> Vec<SessionInfo> {
    sessions.sort_by(|a, b| {
        b.state
            .last_seen_ms
            .cmp(&a.state.last_seen_ms)
            .then_with(|| a.session.cmp(&b.session))
    });
    sessions.truncate(limit);
    sessions
}

/// What [`GuardStore::record`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// The session before this request.
    pub state: SessionState,
    /// Its earlier turns, oldest first (this one not included); none when no loop can end at
    /// this turn (see [`Turn::may_repeat`]), which spares the copy on almost every request.
    pub window: Vec<Turn>,
    /// This request repeats the newest turn's request byte for byte and that one was not
    /// answered: a client retry, not a new step (not added to the window).
    pub retry: bool,
}

/// How a window is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Turns kept.
    pub turns: usize,
    /// A session not seen for this long is forgotten (a blocked one is kept), ms.
    pub ttl_ms: i64,
}

/// A decision to write back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mark {
    /// Count one flagged request.
    pub flagged: bool,
    /// Count one refused request, and what answering it would have cost.
    pub refused: Option<i64>,
    /// Open a cooldown until then, ms since the epoch.
    pub cooldown_until_ms: Option<i64>,
    /// Block the session (since then, ms since the epoch).
    pub blocked_at_ms: Option<i64>,
    /// The loop found.
    pub found: Option<LoopNote>,
}

/// Where session windows live. `record` is one atomic step per request.
#[async_trait]
pub trait GuardStore: Send + Sync + 'static {
    /// Add `turn` to the session's window (unless it is a retry of the newest turn's request,
    /// see [`Seen::retry`]) and answer the session as it was.
    async fn record(
        &self,
        key: &SessionKey,
        turn: &Turn,
        limits: Limits,
    ) -> Result<Seen, GuardError>;
    /// Write a decision back.
    async fn mark(&self, key: &SessionKey, mark: &Mark) -> Result<(), GuardError>;
    /// A request of the session settled: mark its turn (by request hash) answered when `ok`,
    /// and add its cost. A store with round trips may queue it for a moment (Redis: until its
    /// flusher or the tenant's next turn from this gateway takes it); this store's own calls
    /// for the session ([`Self::record`], [`Self::record_and_count`], [`Self::get`],
    /// [`Self::list`]) see it.
    async fn settle(
        &self,
        key: &SessionKey,
        request: u64,
        ok: bool,
        cost_micros: i64,
    ) -> Result<(), GuardError>;
    /// Send whatever [`Self::settle`] queued (at shutdown).
    async fn flush(&self) {}
    /// A tenant's sessions, most recently seen first, at most `limit`.
    async fn list(&self, tenant_id: &str, limit: usize) -> Result<Vec<SessionInfo>, GuardError>;
    /// One session.
    async fn get(&self, key: &SessionKey) -> Result<Option<SessionInfo>, GuardError>;
    /// Forget a session (its window, cooldown and block); `false` when there was none.
    async fn clear(&self, key: &SessionKey) -> Result<bool, GuardError>;
    /// Remember that API key `key_id` of `tenant_id` sent `Idempotency-Key` `idem` (for
    /// `ttl_ms`); whether it had already sent it within that time (a client retry).
    async fn idempotency_seen(
        &self,
        tenant_id: &str,
        key_id: &str,
        idem: &str,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<bool, GuardError>;
    /// Remember that API key `key_id` of `tenant_id` got an error answer (one worth retrying)
    /// to the request whose fingerprint is `fingerprint`, for `ttl_ms`.
    async fn mark_failed(
        &self,
        tenant_id: &str,
        key_id: &str,
        fingerprint: &str,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<(), GuardError>;
    /// Count one request of `tenant_id` (and one retry, when `known` says it is one, or, for
    /// [`Known::IfFailed`], when its key got an error answer to its fingerprint within the
    /// ttl: one round trip either way) in retry-budget bucket `slot`; the tenant's (requests,
    /// retries) over the window's [`router::window::SlidingCounts::BUCKETS`] buckets ending
    /// at `slot`, and whether the request was found to follow an error answer. State lives
    /// `ttl_ms` after the tenant's latest request.
    async fn retry_counts(
        &self,
        tenant_id: &str,
        known: Known<'_>,
        slot: u64,
        ttl_ms: i64,
    ) -> Result<RetryCounts, GuardError>;
    /// [`Self::record`], then [`Self::retry_counts`] for the session's tenant: the two calls
    /// every request makes while the loop check is on, in one round trip where the store has
    /// round trips (Redis overrides this).
    async fn record_and_count(
        &self,
        key: &SessionKey,
        turn: &Turn,
        limits: Limits,
        known: Known<'_>,
        slot: u64,
        ttl_ms: i64,
    ) -> Result<(Seen, RetryCounts), GuardError> {
        let seen = self.record(key, turn, limits).await?;
        let counts = self
            .retry_counts(key.tenant_id(), known, slot, ttl_ms)
            .await?;
        Ok((seen, counts))
    }
}
