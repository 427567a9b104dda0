//! Budget policies as stored and typed: scope × calendar window × limit × action, rate limits,
//! and a tenant's fail mode. Plain data (with their calendar arithmetic); enforcement is in
//! [`crate::budget`].

use chrono::{DateTime, Datelike, Duration, TimeZone, Timelike, Utc};
use serde::{Deserialize, Serialize};

/// A budget's calendar window, in UTC (weeks are ISO weeks, starting Monday).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Window {
    /// A calendar minute.
    Minute,
    /// A calendar hour.
    Hour,
    /// A UTC day.
    Day,
    /// An ISO week (Monday 00:00 UTC).
    Week,
    /// A calendar month.
    Month,
}

impl Window {
    /// Every window, shortest first.
    pub const ALL: [Window; 5] = [
        Window::Minute,
        Window::Hour,
        Window::Day,
        Window::Week,
        Window::Month,
    ];

    /// Lowercase name, as stored and typed.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Minute => "minute",
            Self::Hour => "hour",
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
        }
    }

    /// Parse a stored or typed name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|w| w.as_str() == s)
    }

    /// Start of the window containing `t`.
    pub fn start(self, t: DateTime<Utc>) -> DateTime<Utc> {
        let day = Utc
            .with_ymd_and_hms(t.year(), t.month(), t.day(), 0, 0, 0)
            .single()
            .unwrap_or(t);
        match self {
            Self::Minute => day + Duration::minutes(i64::from(t.hour() * 60 + t.minute())),
            Self::Hour => day + Duration::hours(i64::from(t.hour())),
            Self::Day => day,
            Self::Week => day - Duration::days(i64::from(t.weekday().num_days_from_monday())),
            Self::Month => Utc
                .with_ymd_and_hms(t.year(), t.month(), 1, 0, 0, 0)
                .single()
                .unwrap_or(day),
        }
    }

    /// End (exclusive) of the window that starts at `start`.
    pub fn end(self, start: DateTime<Utc>) -> DateTime<Utc> {
        match self {
            Self::Minute => start + Duration::minutes(1),
            Self::Hour => start + Duration::hours(1),
            Self::Day => start + Duration::days(1),
            Self::Week => start + Duration::days(7),
            Self::Month => {
                let (y, m) = if start.month() == 12 {
                    (start.year() + 1, 1)
                } else {
                    (start.year(), start.month() + 1)
                };
                Utc.with_ymd_and_hms(y, m, 1, 0, 0, 0)
                    .single()
                    .unwrap_or(start + Duration::days(31))
            }
        }
    }
}

/// What a budget applies to, within its tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "lowercase")]
pub enum Scope {
    /// Every request of the tenant.
    Tenant,
    /// Requests made with one key (its id).
    Key(String),
    /// Requests carrying a tag, e.g. `feature=search`.
    Tag {
        /// Tag name.
        name: String,
        /// Tag value.
        value: String,
    },
}

impl Scope {
    /// `(kind, value)` as stored.
    pub fn to_columns(&self) -> (&'static str, String) {
        match self {
            Self::Tenant => ("tenant", String::new()),
            Self::Key(id) => ("key", id.clone()),
            Self::Tag { name, value } => ("tag", format!("{name}={value}")),
        }
    }

    /// Decode the stored columns.
    pub fn from_columns(kind: &str, value: &str) -> Option<Self> {
        match kind {
            "tenant" => Some(Self::Tenant),
            "key" => Some(Self::Key(value.to_owned())),
            "tag" => {
                let (name, value) = value.split_once('=')?;
                Some(Self::Tag {
                    name: name.to_owned(),
                    value: value.to_owned(),
                })
            }
            _ => None,
        }
    }

    /// Parse the CLI/API form: `tenant`, `key:<key id>`, `tag:<name>=<value>`.
    pub fn parse(s: &str) -> Option<Self> {
        if s == "tenant" {
            return Some(Self::Tenant);
        }
        if let Some(id) = s.strip_prefix("key:") {
            return (!id.is_empty()).then(|| Self::Key(id.to_owned()));
        }
        let tag = s.strip_prefix("tag:")?;
        let (name, value) = tag.split_once('=')?;
        (!name.is_empty() && !value.is_empty()).then(|| Self::Tag {
            name: name.to_owned(),
            value: value.to_owned(),
        })
    }

    /// The CLI/API form (inverse of [`Scope::parse`]).
    pub fn label(&self) -> String {
        match self {
            Self::Tenant => "tenant".into(),
            Self::Key(id) => format!("key:{id}"),
            Self::Tag { name, value } => format!("tag:{name}={value}"),
        }
    }

    /// Whether a request by `key_id` carrying `tags` falls in this scope.
    pub fn matches(&self, key_id: &str, tags: &std::collections::BTreeMap<String, String>) -> bool {
        match self {
            Self::Tenant => true,
            Self::Key(id) => id == key_id,
            Self::Tag { name, value } => tags.get(name) == Some(value),
        }
    }
}

/// What happens when a budget cannot admit a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Answer 429 `insufficient_quota`.
    Reject,
    /// Serve from the small tier instead, until the hard cap (if any), then reject.
    Downgrade,
    /// Admit, count, and flag (metric, log, response header).
    Flag,
}

impl Action {
    /// Lowercase name, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reject => "reject",
            Self::Downgrade => "downgrade",
            Self::Flag => "flag",
        }
    }

    /// Parse a stored or typed name.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Reject, Self::Downgrade, Self::Flag]
            .into_iter()
            .find(|a| a.as_str() == s)
    }
}

/// What a tenant's requests do while the shared budget store (Redis) is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailMode {
    /// Answer 503 until the store is back.
    Closed,
    /// Admit against a local, conservative share of each limit on this replica.
    Open,
}

impl FailMode {
    /// Lowercase name, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
        }
    }

    /// Parse a stored or typed name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "closed" => Some(Self::Closed),
            "open" => Some(Self::Open),
            _ => None,
        }
    }
}

/// A pair of optional limits: tokens and micro-dollars.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limit {
    /// Most tokens (prompt + completion).
    pub tokens: Option<u64>,
    /// Most micro-dollars.
    pub micros: Option<i64>,
}

impl Limit {
    /// Neither limit set.
    pub fn is_unlimited(&self) -> bool {
        self.tokens.is_none() && self.micros.is_none()
    }

    /// This limit scaled by `share` (rounded down), for the local fail-open fallback.
    pub fn scaled(&self, share: f64) -> Self {
        Self {
            tokens: self.tokens.map(|t| (t as f64 * share) as u64),
            micros: self.micros.map(|m| (m as f64 * share) as i64),
        }
    }
}

/// A budget policy, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetPolicy {
    /// Stable id (`bud_…`); counters are keyed by it, so editing a policy keeps its spend.
    pub id: String,
    /// Owning tenant id.
    pub tenant_id: String,
    /// What it applies to.
    pub scope: Scope,
    /// The calendar window.
    pub window: Window,
    /// The limit.
    pub limit: Limit,
    /// What happens at the limit.
    pub action: Action,
    /// For `downgrade`: the cap past which even small-tier requests are rejected.
    pub hard_limit: Limit,
    /// Warn (header, metric) once this percentage of a limit is spent or reserved.
    pub warn_percent: Option<u8>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

/// Requests and tokens per minute, for a tenant (`key_id` empty) or one of its keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLimit {
    /// Owning tenant id.
    pub tenant_id: String,
    /// The key it applies to; `None` for the whole tenant.
    pub key_id: Option<String>,
    /// Requests per minute.
    pub rpm: Option<u64>,
    /// Tokens (prompt estimate + max_tokens) per minute.
    pub tpm: Option<u64>,
}
