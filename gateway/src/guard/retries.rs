//! Client retries: recognised on the request path and held to a per-tenant retry budget.
//!
//! A request is a client retry when the OpenAI SDK says so (`x-stainless-retry-count` ≥ 1), when
//! its `Idempotency-Key` was already sent by the same key within the window, or when it repeats
//! byte for byte a request of its session that was not answered (the guard store's
//! [`super::store::Seen::retry`]). Retries within the budget — a share of the tenant's recent
//! requests, never fewer than a floor, so a quiet tenant can still retry — go on as usual;
//! beyond it they are refused at once (429 `retry_budget_exceeded`, nothing charged) or, with
//! `guard.retry_action = "flag"`, answered and flagged (`retry_storm_flag` in the ledger).
//!
//! The counts are per process (each replica budgets the traffic it sees).

use std::collections::HashMap;
use std::sync::Mutex;
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
    /// The same request again after one that was not answered.
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

/// Idempotency keys remembered at most (oldest forgotten first).
const MAX_KEYS: usize = 100_000;

/// Per-tenant retry counts and the idempotency keys seen, in this process.
#[derive(Debug)]
pub struct Retries {
    rule: BudgetRule,
    tenants: Mutex<HashMap<String, SlidingCounts>>,
    keys: Mutex<HashMap<(String, String), i64>>,
}

impl Retries {
    /// Empty counts under `rule`.
    pub fn new(rule: BudgetRule) -> Self {
        Self {
            rule,
            tenants: Mutex::new(HashMap::new()),
            keys: Mutex::new(HashMap::new()),
        }
    }

    fn slot(&self, now_ms: i64) -> u64 {
        let bucket = (self.rule.window.as_millis() / SlidingCounts::BUCKETS as u128).max(1);
        u64::try_from(i128::from(now_ms.max(0)) as u128 / bucket).unwrap_or(u64::MAX)
    }

    /// How the request is a retry, if it is: the client's word first, then its idempotency key
    /// (remembered for the window, per API key), then `after_error` (the session store's).
    pub fn recognise(
        &self,
        key_id: &str,
        client: &ClientRetry,
        after_error: bool,
        now_ms: i64,
    ) -> Option<Signal> {
        let repeated_key = client
            .idempotency_key
            .as_ref()
            .is_some_and(|k| self.seen_key(key_id, k, now_ms));
        if client.sdk_attempt.is_some_and(|n| n >= 1) {
            Some(Signal::SdkHeader)
        } else if repeated_key {
            Some(Signal::IdempotencyKey)
        } else if after_error {
            Some(Signal::AfterError)
        } else {
            None
        }
    }

    /// Remember `idem` for `key_id`; whether it was already seen within the window.
    fn seen_key(&self, key_id: &str, idem: &str, now_ms: i64) -> bool {
        let ttl = i64::try_from(self.rule.window.as_millis()).unwrap_or(i64::MAX);
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if keys.len() >= MAX_KEYS {
            keys.retain(|_, at| now_ms - *at < ttl);
            if keys.len() >= MAX_KEYS {
                // Still full of live keys: forget the oldest half.
                let mut ats: Vec<i64> = keys.values().copied().collect();
                ats.sort_unstable();
                let cut = ats[ats.len() / 2];
                keys.retain(|_, at| *at > cut);
            }
        }
        let entry = (key_id.to_owned(), idem.to_owned());
        let seen = keys.get(&entry).is_some_and(|at| now_ms - *at < ttl);
        keys.insert(entry, now_ms);
        seen
    }

    /// Count a request of `tenant` (a retry or not); whether it is a retry beyond the budget:
    /// more retries in the window, this one included, than `max(floor, share × requests)`.
    pub fn over_budget(&self, tenant: &str, retry: bool, now_ms: i64) -> bool {
        self.count(tenant, retry, now_ms).0
    }

    /// [`Retries::over_budget`], and whether this was the tenant's first request seen.
    pub fn count(&self, tenant: &str, retry: bool, now_ms: i64) -> (bool, bool) {
        let slot = self.slot(now_ms);
        let mut tenants = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
        let first = !tenants.contains_key(tenant);
        let counts = tenants.entry(tenant.to_owned()).or_default();
        counts.add(slot, 1, u32::from(retry));
        if !retry {
            return (false, first);
        }
        let (requests, retries) = counts.totals(slot);
        let allowed = ((f64::from(requests) * self.rule.share).floor() as u32).max(self.rule.floor);
        (retries > allowed, first)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    fn retries() -> Retries {
        Retries::new(BudgetRule {
            share: 0.2,
            floor: 3,
            window: Duration::from_secs(10),
        })
    }

    #[test]
    fn a_retry_is_recognised_by_the_sdk_header_a_repeated_key_or_an_unanswered_repeat() {
        let r = retries();
        let first = ClientRetry {
            sdk_attempt: Some(0),
            idempotency_key: Some("k1".into()),
        };
        assert_eq!(r.recognise("key", &first, false, 0), None);
        let again = ClientRetry {
            sdk_attempt: None,
            idempotency_key: Some("k1".into()),
        };
        assert_eq!(
            r.recognise("key", &again, false, 100),
            Some(Signal::IdempotencyKey)
        );
        assert_eq!(
            r.recognise("other-key", &again, false, 100),
            None,
            "per API key"
        );
        assert_eq!(
            r.recognise("key", &again, false, 20_000),
            None,
            "after the window"
        );
        let sdk = ClientRetry {
            sdk_attempt: Some(2),
            idempotency_key: None,
        };
        assert_eq!(r.recognise("key", &sdk, true, 0), Some(Signal::SdkHeader));
        let plain = ClientRetry::default();
        assert_eq!(
            r.recognise("key", &plain, true, 0),
            Some(Signal::AfterError)
        );
        assert_eq!(r.recognise("key", &plain, false, 0), None);
        assert!(validate_idempotency_key(b"stainless-python-retry-1f3c").is_ok());
        for bad in [&b""[..], b"has space", &[b'a'; 257][..], b"tab\t"] {
            assert!(validate_idempotency_key(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn retries_beyond_a_share_of_recent_requests_are_over_budget_with_a_floor() {
        let r = retries();
        // A quiet tenant: the floor of 3 retries.
        assert!(!r.over_budget("t", true, 0));
        assert!(!r.over_budget("t", true, 1));
        assert!(!r.over_budget("t", true, 2));
        assert!(
            r.over_budget("t", true, 3),
            "a fourth retry with 4 requests"
        );
        // A busy tenant: 20% of its requests. With 40 more requests, retries 5 to 10 fit (the
        // tenth makes 50 requests, 20% of which is 10); the eleventh does not.
        for i in 0..40 {
            assert!(!r.over_budget("t", false, 10 + i));
        }
        for i in 0..6 {
            assert!(!r.over_budget("t", true, 100 + i), "retry {}", 5 + i);
        }
        assert!(
            r.over_budget("t", true, 200),
            "the eleventh retry of 51 requests"
        );
        assert!(!r.over_budget("other", true, 200), "per tenant");
        // The window forgets.
        assert!(!r.over_budget("t", true, 30_000));
    }
}
