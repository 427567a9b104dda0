//! Settlement events: one [`UsageEvent`] per `/v1` request after authentication, produced even
//! when the client disconnects mid-stream, and handed to a [`UsageSink`] off the request path.
//! The cost ledger persists them; until then the default sink logs them.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Where a request's answer came from, as far as caching goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheStatus {
    /// Not eligible for caching, or no cache configured.
    Bypass,
    /// Eligible, not found: answered upstream.
    Miss,
    /// Answered from the exact cache (cost 0; `saved_micros` what it would have cost).
    HitExact,
    /// Answered from the semantic cache (cost 0; `saved_micros` what it would have cost).
    HitSemantic,
    /// A client retry that joined the identical request still running, and got its answer
    /// (cost 0: the tenant pays for that one).
    Coalesced,
}

impl CacheStatus {
    /// The `x-gateway-cache` response header's value.
    pub fn header_value(self) -> &'static str {
        match self {
            Self::Bypass => "bypass",
            Self::Miss => "miss",
            Self::HitExact => "hit-exact",
            Self::HitSemantic => "hit-semantic",
            Self::Coalesced => "coalesced",
        }
    }

    /// The name the ledger stores (serde's, without building a `Value`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bypass => "bypass",
            Self::Miss => "miss",
            Self::HitExact => "hit_exact",
            Self::HitSemantic => "hit_semantic",
            Self::Coalesced => "coalesced",
        }
    }
}

/// How the token counts were obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageSource {
    /// Reported by the upstream.
    Upstream,
    /// Counted by the gateway's tokenizer (upstream reported none, or the stream was cut).
    Tokenizer,
    /// No upstream call produced tokens (rejected before forwarding).
    None,
    /// Not a request at all: a row of the labelled demo history `gateway demo` seeds (the
    /// reports count these and say so).
    Synthetic,
}

impl UsageSource {
    /// The name the ledger stores (serde's, without building a `Value`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Upstream => "upstream",
            Self::Tokenizer => "tokenizer",
            Self::None => "none",
            Self::Synthetic => "synthetic",
        }
    }
}

/// One request's settlement (also the cost ledger's row, the spool's line format, and the
/// ledger journal's record: its fields are written by position there, so a field added or moved
/// needs a new journal format; `ledger::journal`'s frozen-format test says so).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageEvent {
    /// Gateway request id (`x-request-id`).
    pub request_id: Arc<str>,
    /// When the request arrived (written as chrono writes it, by [`Rfc3339`]).
    #[serde(with = "started_at")]
    pub started_at: DateTime<Utc>,
    /// Tenant id.
    pub tenant_id: String,
    /// Tenant name.
    pub tenant_name: String,
    /// API key id.
    pub key_id: String,
    /// Key tags merged with `x-gateway-tags` of the request.
    pub tags: BTreeMap<String, String>,
    /// `chat`, `completions` or `embeddings` (borrowed from the label, owned when read back).
    pub endpoint: Cow<'static, str>,
    /// Model name the client asked for.
    pub requested_model: String,
    /// Model name the upstream served, if one was reached (shared with the replica's target).
    pub served_model: Option<Arc<str>>,
    /// Tier that served it (borrowed from the tier's name, owned when read back).
    pub tier: Option<Cow<'static, str>>,
    /// Replica that served it (shared with the replica's target).
    pub replica: Option<Arc<str>>,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Prompt tokens served from the upstream's prefix cache.
    pub cached_tokens: u64,
    /// How the counts were obtained.
    pub usage_source: UsageSource,
    /// HTTP status returned to the client (499 when the client went away mid-stream).
    pub status: u16,
    /// Error kind, when the request failed.
    pub error_kind: Option<String>,
    /// Whether the response was streamed.
    pub stream: bool,
    /// Whether the client disconnected before the end.
    pub client_disconnected: bool,
    /// Total time to the last byte, ms.
    pub latency_ms: f64,
    /// Time to the first streamed event (or the whole body), ms.
    pub ttft_ms: Option<f64>,
    /// Upstream attempts beyond the first.
    pub retries: u32,
    /// Cache outcome.
    pub cache_status: CacheStatus,
    /// Cost at the served model's price in force at `started_at`, micro-dollars.
    pub cost_micros: i64,
    /// The part of `cost_micros` paid for output (completion) tokens; the rest is input.
    pub output_cost_micros: i64,
    /// What a cache hit would have cost upstream, micro-dollars (0 otherwise).
    pub saved_micros: i64,
    /// Set when the loop detector flagged the request.
    pub loop_flag: bool,
    /// Set when the retry-storm detector flagged the request.
    pub retry_storm_flag: bool,
    /// Steps of the loop the guard caught on this request (0: none); the session's rows before
    /// its first flagged one are the loop's earlier steps.
    #[serde(default)]
    pub loop_steps: u32,
    /// For a request the guard refused: what answering it would have cost (the session's latest
    /// answered request), micro-dollars.
    #[serde(default)]
    pub avoided_micros: i64,
    /// Why the request went to its tier (`explicit`, `classifier`, `budget`, `rule`,
    /// `fallback`, `unhealthy`); `None` when it was refused before the route step.
    #[serde(default)]
    pub route_reason: Option<Cow<'static, str>>,
    /// The tier router (`model: "auto"`) chose the tier (not stored: `all_large_micros` says it
    /// in the ledger).
    #[serde(default)]
    pub routed: bool,
    /// For a routed request that was answered: what it would have cost on the large tier at the
    /// prices in force (its own cost when the large tier served it), micro-dollars; `None`
    /// otherwise. Set at settle.
    #[serde(default)]
    pub all_large_micros: Option<i64>,
    /// How prefix-affinity chose the replica (`affinity`, `rendezvous`, `least-loaded`,
    /// `imbalanced`); `None` when the tier chooses by load alone.
    #[serde(default)]
    pub replica_choice: Option<String>,
    /// Leading prompt blocks the router had sent to that replica before (with affinity).
    #[serde(default)]
    pub matched_blocks: Option<u32>,
    /// SHA-256 (first 32 hex digits) of the canonical request: same question, same fingerprint.
    /// Never the prompt text.
    pub fingerprint: String,
}

impl UsageEvent {
    /// The `feature` tag.
    pub fn feature(&self) -> Option<&str> {
        self.tags.get("feature").map(String::as_str)
    }

    /// The end user: the `user` tag (or the request's `user` field, copied into it).
    pub fn end_user(&self) -> Option<&str> {
        self.tags.get("user").map(String::as_str)
    }

    /// The `session` tag (an agent run, a conversation).
    pub fn session(&self) -> Option<&str> {
        self.tags.get("session").map(String::as_str)
    }
}

/// A UTC time as RFC 3339 text, byte for byte as chrono writes it with
/// `SecondsFormat::AutoSi` (no fraction, or 3, 6 or 9 digits, whichever is exact), ending in
/// `Z` or `+00:00`: the form serde gives a [`UsageEvent`]'s `started_at` (the journal's records,
/// the spool's lines) and the one sqlx binds into the SQLite ledger, whose queries compare it as
/// text. Written digit by digit into a buffer on the stack instead of through chrono's `Display`
/// path (a formatter, which postcard's `collect_str` runs twice to learn the length first): the
/// journal's append went from 4.7 k to 3.0 k instructions per row (docs/benchmarks.md, twentieth
/// sitting).
#[derive(Clone, Copy)]
pub struct Rfc3339 {
    bytes: [u8; Self::MAX],
    len: usize,
}

impl Rfc3339 {
    /// `2026-12-05T13:37:45.123456789+00:00`.
    const MAX: usize = 35;

    /// `t` as text ending in `Z` (`zulu`) or `+00:00`; `None` for a year outside 0–9999, which
    /// chrono writes with a sign (callers fall back to chrono there).
    pub fn utc(t: &DateTime<Utc>, zulu: bool) -> Option<Self> {
        use chrono::{Datelike as _, Timelike as _};
        let date = t.date_naive();
        let year = u32::try_from(date.year()).ok().filter(|y| *y <= 9999)?;
        let mut out = Self {
            bytes: [0; Self::MAX],
            len: 0,
        };
        let time = t.time();
        let clock = time.num_seconds_from_midnight();
        let (mut sec, mut nano) = (clock % 60, time.nanosecond());
        if nano >= 1_000_000_000 {
            // A leap second: chrono writes it as second 60.
            sec += 1;
            nano -= 1_000_000_000;
        }
        out.pair(year / 100);
        out.pair(year % 100);
        out.push(b'-');
        out.pair(date.month());
        out.push(b'-');
        out.pair(date.day());
        out.push(b'T');
        out.pair(clock / 3600);
        out.push(b':');
        out.pair(clock / 60 % 60);
        out.push(b':');
        out.pair(sec);
        if nano != 0 {
            out.push(b'.');
            let nano = u64::from(nano);
            let (n, pairs) = if nano % 1_000_000 == 0 {
                (nano / 1_000_000 * 10, 2)
            } else if nano % 1_000 == 0 {
                (nano / 1_000, 3)
            } else {
                (nano * 10, 5)
            };
            // 3, 6 or 9 digits as pairs; a trailing zero appended to odd widths is cut after.
            let mut div = 100u64.pow(pairs - 1);
            for _ in 0..pairs {
                out.pair(u32::try_from(n / div % 100).unwrap_or(0));
                div /= 100;
            }
            if pairs != 3 {
                out.len -= 1;
            }
        }
        for b in if zulu { b"Z".as_slice() } else { b"+00:00" } {
            out.push(*b);
        }
        Some(out)
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        // Only ASCII digits and separators are ever pushed.
        std::str::from_utf8(&self.bytes[..self.len]).unwrap_or_default()
    }

    fn push(&mut self, b: u8) {
        self.bytes[self.len] = b;
        self.len += 1;
    }

    /// `n` (below 100) as two digits.
    fn pair(&mut self, n: u32) {
        let n = u8::try_from(n % 100).unwrap_or(0);
        self.bytes[self.len] = b'0' + n / 10;
        self.bytes[self.len + 1] = b'0' + n % 10;
        self.len += 2;
    }
}

/// `started_at` in serde: [`Rfc3339`]'s text (chrono's own form), read back by chrono.
mod started_at {
    use chrono::{DateTime, Utc};
    use serde::{Deserialize as _, Deserializer, Serialize as _, Serializer};

    pub fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        match super::Rfc3339::utc(t, true) {
            Some(text) => s.serialize_str(text.as_str()),
            None => t.serialize(s),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        DateTime::<Utc>::deserialize(d)
    }
}

/// Receives settlement events. `record` must not block: implementations queue the event.
pub trait UsageSink: Send + Sync + 'static {
    /// Take one event.
    fn record(&self, event: UsageEvent);
}

/// The default sink: writes each event as one structured log line (target `usage`).
#[derive(Debug, Default, Clone, Copy)]
pub struct LogSink;

impl UsageSink for LogSink {
    fn record(&self, event: UsageEvent) {
        if !tracing::enabled!(target: "usage", tracing::Level::INFO) {
            return;
        }
        match serde_json::to_string(&event) {
            Ok(json) => tracing::info!(target: "usage", event = %json, "usage"),
            Err(e) => tracing::warn!(error = %e, "usage event not serialisable"),
        }
    }
}

/// A sink that forwards events into a tokio channel (tests, and the ledger writer's queue).
#[derive(Debug, Clone)]
pub struct ChannelSink(pub tokio::sync::mpsc::UnboundedSender<UsageEvent>);

impl UsageSink for ChannelSink {
    fn record(&self, event: UsageEvent) {
        let _ = self.0.send(event);
    }
}

/// A shared sink handle.
pub type SharedSink = Arc<dyn UsageSink>;

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod stored_names {
    use super::{CacheStatus, UsageSource};

    /// The ledger stores `as_str`, and reads rows back with serde: the two must agree.
    #[test]
    fn as_str_is_the_serde_name() {
        let serde_name = |v: serde_json::Value| v.as_str().unwrap().to_owned();
        for s in [
            CacheStatus::Bypass,
            CacheStatus::Miss,
            CacheStatus::HitExact,
            CacheStatus::HitSemantic,
            CacheStatus::Coalesced,
        ] {
            assert_eq!(s.as_str(), serde_name(serde_json::to_value(s).unwrap()));
        }
        for s in [
            UsageSource::Upstream,
            UsageSource::Tokenizer,
            UsageSource::None,
            UsageSource::Synthetic,
        ] {
            assert_eq!(s.as_str(), serde_name(serde_json::to_value(s).unwrap()));
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod rfc3339 {
    use chrono::{DateTime, NaiveDate, SecondsFormat, Utc};
    use rand::{Rng as _, SeedableRng as _};

    use super::Rfc3339;

    /// A time serialised as `UsageEvent::started_at` is.
    #[derive(serde::Serialize)]
    struct Ours(#[serde(with = "super::started_at")] DateTime<Utc>);

    fn as_chrono_writes(t: DateTime<Utc>) {
        for zulu in [true, false] {
            let ours = Rfc3339::utc(&t, zulu).unwrap();
            assert_eq!(
                ours.as_str(),
                t.to_rfc3339_opts(SecondsFormat::AutoSi, zulu),
                "{t:?}"
            );
        }
        // And serde's form (the journal's, the spool's) is chrono's serde form.
        assert_eq!(
            serde_json::to_string(&Ours(t)).unwrap(),
            serde_json::to_string(&t).unwrap()
        );
        assert_eq!(
            postcard::to_stdvec(&Ours(t)).unwrap(),
            postcard::to_stdvec(&t).unwrap()
        );
    }

    #[test]
    fn times_are_written_byte_for_byte_as_chrono_writes_them() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let first = NaiveDate::from_ymd_opt(0, 1, 1)
            .unwrap()
            .and_hms_opt(0, 0, 0);
        let last = NaiveDate::from_ymd_opt(9999, 12, 31)
            .unwrap()
            .and_hms_opt(23, 59, 59);
        let (first, last) = (
            first.unwrap().and_utc().timestamp(),
            last.unwrap().and_utc().timestamp(),
        );
        for i in 0..50_000 {
            // Every fraction width AutoSi picks: none, milli, micro, nano.
            let nano = match i % 4 {
                0 => 0,
                1 => rng.random_range(1..1_000) * 1_000_000,
                2 => rng.random_range(1..1_000_000) * 1_000,
                _ => rng.random_range(1..1_000_000_000),
            };
            // Mostly around now, some anywhere in years 0-9999.
            let secs = if i % 2 == 0 {
                rng.random_range(1_700_000_000..1_900_000_000)
            } else {
                rng.random_range(first..=last)
            };
            as_chrono_writes(DateTime::from_timestamp(secs, nano).unwrap());
        }
        as_chrono_writes(DateTime::from_timestamp(first, 0).unwrap());
        as_chrono_writes(DateTime::from_timestamp(last, 999_999_999).unwrap());
        // A leap second (chrono keeps it as a nanosecond past 10^9 and writes second 60).
        let leap = NaiveDate::from_ymd_opt(2016, 12, 31)
            .unwrap()
            .and_hms_nano_opt(23, 59, 59, 1_250_000_000)
            .unwrap()
            .and_utc();
        as_chrono_writes(leap);
    }

    #[test]
    fn a_year_chrono_writes_with_a_sign_is_left_to_chrono() {
        let far = NaiveDate::from_ymd_opt(12_026, 1, 2)
            .unwrap()
            .and_hms_opt(3, 4, 5);
        let far = far.unwrap().and_utc();
        assert!(Rfc3339::utc(&far, true).is_none());
        assert_eq!(
            serde_json::to_string(&Ours(far)).unwrap(),
            "\"+12026-01-02T03:04:05Z\""
        );
    }
}
