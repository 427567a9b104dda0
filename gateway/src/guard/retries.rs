//! Client retries: recognised on the request path and held to a per-tenant retry budget.
//!
//! A request is a client retry when the OpenAI SDK says so (`x-stainless-retry-count` ≥ 1), when
//! its `Idempotency-Key` was already sent by the same key within the window, or when the same key
//! sent the very same request (its fingerprint) and got an error answer from trouble upstream
//! ([`Signal::retried_after`]) within
//! `guard.retry_after_error_secs`: how an agent that wraps the SDK in retries of its own (each a
//! new first attempt to the SDK) shows. A concurrent duplicate still in flight, or a repeat after
//! an answer, is not a retry. Retries within the budget — a share of the tenant's recent
//! requests, never fewer than a floor, so a quiet tenant can still retry — go on as usual;
//! beyond it they are refused at once (429 `retry_budget_exceeded`, nothing charged) or, with
//! `guard.retry_action = "flag"`, answered and flagged (`retry_storm_flag` in the ledger).
//!
//! The counts and the keys seen live in the guard's store ([`super::store::GuardStore`]): in this
//! process, or in Redis shared by every replica.

use std::time::Duration;

use router::window::SlidingCounts;

/// What the client said about a request being a retry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientRetry {
    /// `x-stainless-retry-count`: the SDK's attempt number (0 for the first).
    pub sdk_attempt: Option<u32>,
    /// `Idempotency-Key` (checked: at most 256 printable ASCII characters).
    pub idempotency_key: Option<String>,
}

/// Longest `Idempotency-Key` accepted.
pub const MAX_IDEMPOTENCY_KEY: usize = 256;

/// Check an `Idempotency-Key` header value.
pub fn validate_idempotency_key(v: &[u8]) -> Result<String, String> {
    if v.is_empty() || v.len() > MAX_IDEMPOTENCY_KEY || !v.iter().all(|b| (0x21..0x7f).contains(b))
    {
        return Err(format!(
            "the Idempotency-Key header must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII \
             characters without spaces"
        ));
    }
    Ok(String::from_utf8_lossy(v).into_owned())
}

/// How a retry was recognised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// `x-stainless-retry-count` ≥ 1.
    SdkHeader,
    /// A repeated `Idempotency-Key`.
    IdempotencyKey,
    /// The same request again after an error answer to it.
    AfterError,
}

impl Signal {
    /// Lowercase name (metrics label).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SdkHeader => "sdk_header",
            Self::IdempotencyKey => "idempotency_key",
            Self::AfterError => "after_error",
        }
    }

    /// Every signal.
    pub const ALL: [Signal; 3] = [Self::SdkHeader, Self::IdempotencyKey, Self::AfterError];

    /// Whether an answer with `status` (and the gateway's error `kind`, if it made the
    /// answer) makes a repeat of its request a retry: trouble upstream (the servers' failures,
    /// timeouts, overload: 5xx, a model server's 429), not the client's own mistakes and not
    /// the gateway's policies (a budget, a rate limit, a loop, the retry budget: a repeat gets
    /// the same refusal, and a load test of identical requests past a budget is no storm).
    pub fn retried_after(status: u16, kind: Option<&str>) -> bool {
        let policy = kind.is_some_and(|k| crate::error::POLICY_REFUSALS.contains(&k));
        matches!(status, 429 | 500..=599) && !policy
    }
}

/// The retry budget's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetRule {
    /// Retries allowed as a share of the tenant's requests in the window.
    pub share: f64,
    /// Retries always allowed in the window.
    pub floor: u32,
    /// The window.
    pub window: Duration,
}

impl BudgetRule {
    /// The window's bucket at `now_ms` (a tenth of the window each).
    pub fn slot(&self, now_ms: i64) -> u64 {
        let bucket = (self.window.as_millis() / SlidingCounts::BUCKETS as u128).max(1);
        u64::try_from(u128::try_from(now_ms.max(0)).unwrap_or(0) / bucket).unwrap_or(u64::MAX)
    }

    /// The window, ms.
    pub fn window_ms(&self) -> i64 {
        i64::try_from(self.window.as_millis()).unwrap_or(i64::MAX)
    }

    /// Whether `retries` in the window (the current one included) exceed what `requests`
    /// allow: `max(floor, share × requests)`.
    pub fn over(&self, requests: u32, retries: u32) -> bool {
        retries > router::window::allowance(requests, self.share, self.floor)
    }
}

/// How a request is a retry, if it is: the client's word first, then a repeated idempotency key.
pub fn signal(client: &ClientRetry, repeated_key: bool) -> Option<Signal> {
    if client.sdk_attempt.is_some_and(|n| n >= 1) {
        Some(Signal::SdkHeader)
    } else if repeated_key {
        Some(Signal::IdempotencyKey)
    } else {
        None
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn the_clients_word_comes_first_then_its_idempotency_key() {
        let sdk = |n| ClientRetry {
            sdk_attempt: Some(n),
            idempotency_key: None,
        };
        assert_eq!(signal(&sdk(0), false), None, "a first attempt");
        assert_eq!(signal(&sdk(2), true), Some(Signal::SdkHeader));
        let plain = ClientRetry::default();
        assert_eq!(signal(&plain, true), Some(Signal::IdempotencyKey));
        assert_eq!(signal(&plain, false), None);
        assert!(validate_idempotency_key(b"stainless-python-retry-1f3c").is_ok());
        for bad in [&b""[..], b"has space", &[b'a'; 257][..], b"tab\t"] {
            assert!(validate_idempotency_key(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn trouble_upstream_makes_a_repeat_a_retry_the_gateways_own_refusals_do_not() {
        for (status, kind) in [
            (502, Some("bad_gateway")),
            (503, None),
            (429, None),
            (504, Some("timeout")),
        ] {
            assert!(Signal::retried_after(status, kind), "{status} {kind:?}");
        }
        for (status, kind) in [
            (200, None),
            (400, Some("invalid_request")),
            (408, Some("request_timeout")),
            (429, Some("insufficient_quota")),
            (429, Some("rate_limit_exceeded")),
            (429, Some("loop_detected")),
            (429, Some("retry_budget_exceeded")),
        ] {
            assert!(!Signal::retried_after(status, kind), "{status} {kind:?}");
        }
    }

    #[test]
    fn retries_beyond_a_share_of_recent_requests_are_over_budget_with_a_floor() {
        let rule = BudgetRule {
            share: 0.2,
            floor: 3,
            window: Duration::from_secs(10),
        };
        assert!(!rule.over(3, 3), "a quiet tenant: the floor");
        assert!(rule.over(4, 4));
        assert!(!rule.over(50, 10), "20% of 50");
        assert!(rule.over(51, 11));
        assert_eq!(rule.slot(0), 0);
        assert_eq!(rule.slot(999), 0);
        assert_eq!(rule.slot(1_000), 1, "buckets of a tenth of the window");
        assert_eq!(rule.slot(-5), 0);
    }
}
