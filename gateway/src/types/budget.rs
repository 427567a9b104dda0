//! Budget policies as stored and typed: scope × calendar window × limit × action, rate limits,
//! and a tenant's fail mode. Plain data (with their calendar arithmetic); enforcement is in
//! [`crate::budget`].

use chrono::{DateTime, Datelike, Duration, TimeZone, Utc};
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

    /// Start of the window containing `t`. Minutes, hours, days and weeks by arithmetic on
    /// the timestamp (a UTC day is 86,400 of its seconds), not by chrono's calendar: the budget
    /// step asks for every policy on every request.
    pub fn start(self, t: DateTime<Utc>) -> DateTime<Utc> {
        const DAY: i64 = 86_400;
        let ts = t.timestamp();
        let floor = |unit: i64| ts - ts.rem_euclid(unit);
        let secs = match self {
            Self::Minute => floor(60),
            Self::Hour => floor(3_600),
            Self::Day => floor(DAY),
            // 1970-01-01 was a Thursday, three days after a Monday.
            Self::Week => floor(DAY) - (ts.div_euclid(DAY) + 3).rem_euclid(7) * DAY,
            Self::Month => {
                return Utc
                    .with_ymd_and_hms(t.year(), t.month(), 1, 0, 0, 0)
                    .single()
                    .unwrap_or(t)
            }
        };
        DateTime::from_timestamp(secs, 0).unwrap_or(t)
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

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use chrono::{DateTime, Datelike, Duration, NaiveDate, TimeZone, Timelike, Utc};
    use rand::{Rng as _, SeedableRng as _};

    use super::Window;

    /// The calendar's answer, by chrono's fields.
    fn by_calendar(w: Window, t: DateTime<Utc>) -> DateTime<Utc> {
        let day = Utc
            .with_ymd_and_hms(t.year(), t.month(), t.day(), 0, 0, 0)
            .unwrap();
        match w {
            Window::Minute => day + Duration::minutes(i64::from(t.hour() * 60 + t.minute())),
            Window::Hour => day + Duration::hours(i64::from(t.hour())),
            Window::Day => day,
            Window::Week => day - Duration::days(i64::from(t.weekday().num_days_from_monday())),
            Window::Month => Utc
                .with_ymd_and_hms(t.year(), t.month(), 1, 0, 0, 0)
                .unwrap(),
        }
    }

    #[test]
    fn a_windows_start_is_the_calendars() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut times: Vec<DateTime<Utc>> = (0..20_000)
            .map(|i| {
                // Around now and across the centuries, before the epoch too.
                let secs = if i % 2 == 0 {
                    rng.random_range(1_700_000_000..1_900_000_000)
                } else {
                    rng.random_range(-5_000_000_000i64..10_000_000_000)
                };
                DateTime::from_timestamp(secs, rng.random_range(0..1_000_000_000)).unwrap()
            })
            .collect();
        // Edges: a window's first and last instants, and a leap second.
        for secs in [
            0,
            -1,
            86_399,
            86_400,
            1_764_547_200,
            1_764_547_199,
            1_767_225_599,
        ] {
            times.push(DateTime::from_timestamp(secs, 0).unwrap());
            times.push(DateTime::from_timestamp(secs, 999_999_999).unwrap());
        }
        let leap = NaiveDate::from_ymd_opt(2016, 12, 31)
            .unwrap()
            .and_hms_nano_opt(23, 59, 59, 1_500_000_000)
            .unwrap()
            .and_utc();
        times.push(leap);
        for t in times {
            for w in Window::ALL {
                assert_eq!(w.start(t), by_calendar(w, t), "{w:?} of {t:?}");
            }
        }
        let wednesday = Utc.with_ymd_and_hms(2026, 12, 2, 13, 37, 45).unwrap();
        let monday = Utc.with_ymd_and_hms(2026, 11, 30, 0, 0, 0).unwrap();
        assert_eq!(Window::Week.start(wednesday), monday);
    }
}
