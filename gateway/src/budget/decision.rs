//! What the budget step decides, as typed data: an [`Admission`] (with what the client should be
//! told about its budgets) or a [`Refusal`]. No HTTP here: the pipeline renders the headers and
//! [`crate::error::ApiError`] renders the refusal.

use chrono::{DateTime, Utc};

use super::engine::Reservation;
use super::{BudgetError, Limit, RateKind, Scope, Window};

/// The budget step's answer for an admitted request.
#[derive(Debug, Default)]
pub struct Admission {
    /// `max_tokens` to forward (set when a budget or token limit bounds the output).
    pub max_tokens: Option<u64>,
    /// `max_tokens` was lowered below what the client asked for, to this.
    pub clamped_to: Option<u64>,
    /// A `downgrade` budget sent the request to the small tier.
    pub downgraded: bool,
    /// Budgets past their warning percentage.
    pub warnings: Vec<Warning>,
    /// `flag` budgets this request is over (their ids).
    pub flagged: Vec<String>,
    /// The budget with the least room left after this reservation.
    pub tightest: Option<Tightest>,
    /// Admitted against this replica's local share (the shared store is unreachable and the
    /// tenant fails open).
    pub fail_open: bool,
    /// What to commit after the response.
    pub reservation: Option<Reservation>,
}

/// A budget past its warning percentage.
#[derive(Debug, Clone, PartialEq)]
pub struct Warning {
    /// The policy.
    pub policy_id: String,
    /// Share of its limit spent or reserved, percent.
    pub used_percent: f64,
}

/// The budget with the least room left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tightest {
    /// The policy.
    pub policy_id: String,
    /// What it applies to.
    pub scope: Scope,
    /// Its window.
    pub window: Window,
    /// Tokens left (when it limits tokens).
    pub remaining_tokens: Option<u64>,
    /// Micro-dollars left (when it limits USD).
    pub remaining_micros: Option<i64>,
    /// When the window resets.
    pub resets_at: DateTime<Utc>,
}

/// Why the budget step did not admit a request.
#[derive(Debug)]
pub enum Refusal {
    /// A budget cannot cover the request (429 `insufficient_quota`).
    Exhausted(Exhausted),
    /// A rate limit is used up for now (429 `rate_limit_exceeded`).
    RateLimited {
        /// Requests or tokens per minute.
        kind: RateKind,
        /// The limit.
        per_minute: u64,
        /// The key it applies to; `None` for the whole tenant.
        key_id: Option<String>,
        /// When the request would fit, ms from now.
        retry_after_ms: i64,
    },
    /// The shared budget store is unreachable and the tenant fails closed (503).
    StoreUnavailable,
    /// The local store failed (it should not).
    Internal(BudgetError),
}

/// A budget that cannot cover a request, and by how much.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exhausted {
    /// The policy.
    pub policy_id: String,
    /// What it applies to.
    pub scope: Scope,
    /// Its window.
    pub window: Window,
    /// The limit that applied (the hard cap for a downgraded request).
    pub limit: Limit,
    /// Tokens spent or reserved in the window.
    pub used_tokens: u64,
    /// Micro-dollars spent or reserved in the window.
    pub used_micros: i64,
    /// The request's prompt estimate.
    pub prompt_tokens: u64,
    /// The fewest completion tokens it would have been admitted with.
    pub min_tokens: u64,
    /// When the window resets.
    pub resets_at: DateTime<Utc>,
    /// When the refusal was decided.
    pub now: DateTime<Utc>,
}
