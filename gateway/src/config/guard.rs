//! `[guard]`: agent-loop detection. A tenant without its own policy (`gatewayctl guard set`)
//! gets these defaults.

use serde::{Deserialize, Serialize};

use crate::types::guard::{GuardPolicy, LoopAction};

/// Where session windows live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuardStoreKind {
    /// Redis when the budgets use Redis (`budgets.redis_urls`), else this process.
    Auto,
    /// In this process (each replica sees its own sessions).
    Memory,
    /// Redis (`guard.redis_urls`, or `budgets.redis_urls`): every replica sees one window.
    Redis,
}

/// What happens to a client retry beyond the tenant's retry budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RetryAction {
    /// 429 `retry_budget_exceeded` with `Retry-After`, at once, nothing charged.
    Refuse,
    /// Answer it, flagged (`retry_storm_flag`: the weekly report's "waste: retry storms").
    Flag,
    /// Count retries only.
    Off,
}

/// Agent-loop detection settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GuardConfig {
    /// Look for loops at all (`false`: sessions are still recorded as the `session` tag).
    pub enabled: bool,
    /// Default action: `flag`, `throttle` or `block`.
    pub action: LoopAction,
    /// Default repeats that make a loop (a step k times, or a 2-3 step cycle k times; at least 2).
    pub repeats: u32,
    /// Default session window across requests, seconds.
    pub window_secs: u64,
    /// Turns kept per session (the window's length in requests).
    pub window_requests: usize,
    /// Default cosine similarity for near-duplicate texts (1: exact repeats only).
    pub similarity: f64,
    /// Default cooldown of a throttled session, seconds.
    pub cooldown_secs: u64,
    /// `auto`, `memory` or `redis`.
    pub store: GuardStoreKind,
    /// Redis URLs for the session windows; empty: `budgets.redis_urls`.
    pub redis_urls: Vec<String>,
    /// Longest wait for Redis before the request goes on unguarded, ms.
    pub store_timeout_ms: u64,
    /// Sessions this replica keeps in memory (least recently seen dropped first).
    pub max_sessions: u64,
    /// A session not seen for this long is forgotten (a blocked one stays blocked), s.
    pub session_ttl_secs: u64,
    /// A blocked session stays blocked until an admin clears it or for this long, s (default a
    /// week). At most `max_sessions` blocked sessions are kept in memory (oldest block first).
    pub block_ttl_secs: u64,
    /// Compare texts by their static embeddings (the cache's model directory,
    /// `cache.semantic.model_dir`), so a paraphrased re-ask is a repeat too. Loaded in the
    /// background on the first request. Off by default: on the agent-session fixtures every
    /// threshold that catches paraphrased loops also flags progressing chats (2-9 of 45 for
    /// similarity 0.99-0.93, docs/benchmarks.md).
    pub near_duplicates: bool,
    /// Client retries (the SDK's `x-stainless-retry-count`, a repeated `Idempotency-Key`, the
    /// same request after an error answer to it) allowed per tenant, as a share of its requests in
    /// `retry_window_secs`...
    pub retry_budget_share: f64,
    /// ...and never fewer than this many in the window.
    pub retry_budget_floor: u32,
    /// The retry budget's window, s (also how long an `Idempotency-Key` is remembered).
    pub retry_window_secs: u64,
    /// What happens to a retry beyond the budget.
    pub retry_action: RetryAction,
    /// How long after an error answer from trouble upstream (5xx, a model server's 429) the
    /// same request from the same key is a client retry, s (0: never by this signal).
    pub retry_after_error_secs: u64,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            action: LoopAction::Flag,
            repeats: 3,
            window_secs: 600,
            window_requests: 8,
            similarity: 0.93,
            cooldown_secs: 60,
            store: GuardStoreKind::Auto,
            redis_urls: Vec::new(),
            store_timeout_ms: 100,
            max_sessions: 100_000,
            session_ttl_secs: 3600,
            block_ttl_secs: 7 * 24 * 3600,
            near_duplicates: false,
            retry_budget_share: 0.2,
            retry_budget_floor: 10,
            retry_window_secs: 60,
            retry_action: RetryAction::Refuse,
            retry_after_error_secs: 10,
        }
    }
}

impl GuardConfig {
    /// The retry budget's rule.
    pub fn retry_rule(&self) -> crate::guard::retries::BudgetRule {
        crate::guard::retries::BudgetRule {
            share: self.retry_budget_share,
            floor: self.retry_budget_floor,
            window: std::time::Duration::from_secs(self.retry_window_secs),
        }
    }

    /// The defaults as a policy with every field set.
    pub fn defaults(&self) -> GuardPolicy {
        GuardPolicy {
            action: Some(self.action),
            repeats: Some(self.repeats),
            window_secs: Some(self.window_secs),
            similarity: Some(self.similarity),
            cooldown_secs: Some(self.cooldown_secs),
        }
    }

    /// `policy` over these defaults, every field set.
    pub fn effective(&self, policy: Option<&GuardPolicy>) -> GuardPolicy {
        let d = self.defaults();
        let Some(p) = policy else { return d };
        GuardPolicy {
            action: p.action.or(d.action),
            repeats: p.repeats.or(d.repeats),
            window_secs: p.window_secs.or(d.window_secs),
            similarity: p.similarity.or(d.similarity),
            cooldown_secs: p.cooldown_secs.or(d.cooldown_secs),
        }
    }

    pub(super) fn validate(&self) -> Result<(), super::ConfigError> {
        if let Err((field, message)) = self.defaults().check() {
            return Err(super::invalid(format!("guard.{field}"), message));
        }
        if !(0.0..=1.0).contains(&self.retry_budget_share) {
            return Err(super::invalid(
                "guard.retry_budget_share",
                "must be in [0, 1]",
            ));
        }
        if self.retry_after_error_secs > 3_600 {
            return Err(super::invalid(
                "guard.retry_after_error_secs",
                "must be at most 3600 (s; 0 turns the signal off)",
            ));
        }
        if !(1..=86_400).contains(&self.retry_window_secs) {
            return Err(super::invalid(
                "guard.retry_window_secs",
                "must be between 1 and 86400",
            ));
        }
        if !(2..=64).contains(&self.window_requests) {
            return Err(super::invalid(
                "guard.window_requests",
                "must be between 2 and 64",
            ));
        }
        for (field, v) in [
            ("guard.store_timeout_ms", self.store_timeout_ms),
            ("guard.max_sessions", self.max_sessions),
            ("guard.session_ttl_secs", self.session_ttl_secs),
            ("guard.block_ttl_secs", self.block_ttl_secs),
        ] {
            if v == 0 {
                return Err(super::invalid(field, "must be greater than 0"));
            }
        }
        Ok(())
    }
}
