//! Agent loops the guard step found, from the ledger rows it marked: when each loop was caught,
//! what it burned before that (its earlier steps), what it burned after (flagged requests still
//! answered), and what throttling or blocking it avoided (refused requests × their estimate).
//!
//! A session's rows are read in order. A row is *marked* when the guard flagged it (`loop_flag`)
//! or refused it (`error_kind = 'loop_detected'`). A loop starts at a marked row that follows
//! unmarked ones and lasts until [`PROGRESS_ROWS`] unmarked rows in a row show the agent moved
//! on. Its earlier steps are the `loop_steps − 1` unmarked rows just before its first marked row
//! (the guard counted them when it caught the loop), no further back than [`LOOKBACK`].

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

use super::LedgerStore;
use crate::store::StoreError;

/// Unmarked rows in a row that end a loop: the agent made progress.
pub const PROGRESS_ROWS: usize = 2;

/// How far before a loop's first marked row its earlier steps may lie (the guard's window is
/// shorter than this by default).
pub fn lookback() -> Duration {
    Duration::hours(1)
}

/// One ledger row of a session the guard marked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardRow {
    /// Tenant id.
    pub tenant_id: String,
    /// Tenant name.
    pub tenant: String,
    /// API key id.
    pub key_id: String,
    /// The `session` tag.
    pub session: String,
    /// Request id (orders rows of one instant).
    pub request_id: String,
    /// Start time.
    pub started_at: DateTime<Utc>,
    /// Cost.
    pub cost_micros: i64,
    /// HTTP status.
    pub status: u16,
    /// The guard flagged it.
    pub loop_flag: bool,
    /// The guard refused it.
    pub refused: bool,
    /// Loop steps the guard counted on it.
    pub loop_steps: u32,
    /// For a refused row, its estimated cost.
    pub avoided_micros: i64,
}

impl GuardRow {
    fn marked(&self) -> bool {
        self.loop_flag || self.refused
    }
}

/// The rows of every session with a marked row in `[$3, $2)`, from `$1` (earlier, for the
/// loops' earlier steps) to `$2`, ordered by session and time; `$4`: optional tenant name.
pub(crate) fn guard_rows_sql(tenant_filter: bool) -> String {
    let tenant = if tenant_filter {
        " AND tenant_name = $4"
    } else {
        ""
    };
    format!(
        "SELECT tenant_id, tenant_name, key_id, session, request_id, started_at, cost_micros, \
         status, loop_flag, CASE WHEN error_kind = 'loop_detected' THEN 1 ELSE 0 END AS refused, \
         loop_steps, avoided_micros FROM ledger \
         WHERE started_at >= $1 AND started_at < $2 AND session IS NOT NULL{tenant} \
         AND (tenant_id, session) IN ( \
           SELECT tenant_id, session FROM ledger \
           WHERE started_at >= $3 AND started_at < $2 AND session IS NOT NULL{tenant} \
           AND (loop_flag OR error_kind = 'loop_detected')) \
         ORDER BY tenant_id, session, started_at, request_id"
    )
}

/// Body of [`LedgerStore::guard_rows`], identical for both stores.
macro_rules! guard_rows_body {
    ($pool:expr, $from:expr, $to:expr, $tenant:expr) => {{
        use sqlx::Row;
        let sql = $crate::ledger::loops::guard_rows_sql($tenant.is_some());
        let mut q = sqlx::query(&sql)
            .bind($from - $crate::ledger::loops::lookback())
            .bind($to)
            .bind($from);
        if let Some(t) = $tenant {
            q = q.bind(t);
        }
        let rows = q.fetch_all($pool).await?;
        rows.iter()
            .map(|r| {
                Ok($crate::ledger::loops::GuardRow {
                    tenant_id: r.try_get("tenant_id")?,
                    tenant: r.try_get("tenant_name")?,
                    key_id: r.try_get("key_id")?,
                    session: r.try_get("session")?,
                    request_id: r.try_get("request_id")?,
                    started_at: r.try_get("started_at")?,
                    cost_micros: r.try_get("cost_micros")?,
                    status: u16::try_from(r.try_get::<i32, _>("status")?).unwrap_or(0),
                    loop_flag: r.try_get("loop_flag")?,
                    refused: r.try_get::<i32, _>("refused")? != 0,
                    loop_steps: u32::try_from(r.try_get::<i32, _>("loop_steps")?).unwrap_or(0),
                    avoided_micros: r.try_get("avoided_micros")?,
                })
            })
            .collect()
    }};
}
pub(crate) use guard_rows_body;

/// One loop the guard found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DetectedLoop {
    /// Tenant name.
    pub tenant: String,
    /// API key id (of the request it was caught on).
    pub key_id: String,
    /// The session.
    pub session: String,
    /// When it was caught: the first marked row.
    pub detected_at: DateTime<Utc>,
    /// The loop's last marked row.
    pub last_at: DateTime<Utc>,
    /// Steps the guard counted when it caught it.
    pub repeats: u32,
    /// Requests before it was caught that were its earlier steps.
    pub requests_before: u32,
    /// What those cost: the loop's cost before it was caught.
    pub burned_before_micros: i64,
    /// Flagged requests answered from the moment it was caught (the `flag` action lets a loop
    /// run; `throttle` lets one step through per cooldown).
    pub flagged_requests: u32,
    /// What those cost.
    pub burned_after_micros: i64,
    /// Requests refused (throttle or block).
    pub refused: u32,
    /// What answering them would have cost (each priced at the session's latest answered
    /// request).
    pub avoided_micros: i64,
}

impl DetectedLoop {
    /// Everything the loop cost.
    pub fn burned(&self) -> i64 {
        self.burned_before_micros + self.burned_after_micros
    }
}

/// The loops in `rows` (ordered by session and time, as [`guard_rows_sql`] returns them) caught
/// in `[from, ∞)`, most expensive first.
pub fn detect(rows: &[GuardRow], from: DateTime<Utc>) -> Vec<DetectedLoop> {
    let mut out = Vec::new();
    let same_session =
        |a: &GuardRow, b: &GuardRow| a.tenant_id == b.tenant_id && a.session == b.session;
    let mut start = 0;
    while start < rows.len() {
        let mut end = start;
        while end < rows.len() && same_session(&rows[start], &rows[end]) {
            end += 1;
        }
        session_loops(&rows[start..end], from, &mut out);
        start = end;
    }
    out.sort_by(|a, b| {
        b.burned()
            .cmp(&a.burned())
            .then(b.avoided_micros.cmp(&a.avoided_micros))
            .then(a.detected_at.cmp(&b.detected_at))
            .then(a.session.cmp(&b.session))
    });
    out
}

/// The loops of one session's rows.
fn session_loops(rows: &[GuardRow], from: DateTime<Utc>, out: &mut Vec<DetectedLoop>) {
    // Rows after the previous loop's last marked row: where a loop's earlier steps may be.
    let mut free = 0;
    let mut i = 0;
    while i < rows.len() {
        if !rows[i].marked() {
            i += 1;
            continue;
        }
        let first = &rows[i];
        let earlier_from = first.started_at - lookback();
        let earlier: Vec<&GuardRow> = rows[free..i]
            .iter()
            .rev()
            .filter(|r| r.started_at >= earlier_from)
            .take(first.loop_steps.saturating_sub(1) as usize)
            .collect();
        let mut found = DetectedLoop {
            tenant: first.tenant.clone(),
            key_id: first.key_id.clone(),
            session: first.session.clone(),
            detected_at: first.started_at,
            last_at: first.started_at,
            repeats: first.loop_steps,
            requests_before: u32::try_from(earlier.len()).unwrap_or(u32::MAX),
            burned_before_micros: earlier.iter().map(|r| r.cost_micros).sum(),
            flagged_requests: 0,
            burned_after_micros: 0,
            refused: 0,
            avoided_micros: 0,
        };
        let mut unmarked = 0;
        while i < rows.len() && unmarked < PROGRESS_ROWS {
            let r = &rows[i];
            i += 1;
            if !r.marked() {
                unmarked += 1;
                continue;
            }
            unmarked = 0;
            found.last_at = r.started_at;
            if r.refused {
                found.refused += 1;
                found.avoided_micros += r.avoided_micros;
            } else {
                found.flagged_requests += 1;
                found.burned_after_micros += r.cost_micros;
            }
        }
        // The unmarked rows that ended it may be the next loop's earlier steps.
        free = i - unmarked;
        if found.detected_at >= from {
            out.push(found);
        }
    }
}

/// Totals over loops.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoopTotals {
    /// Loops found.
    pub loops: u32,
    /// Sessions they were in.
    pub sessions: u32,
    /// Their cost before they were caught.
    pub burned_before_micros: i64,
    /// Their cost after (flagged requests answered).
    pub burned_after_micros: i64,
    /// Requests refused.
    pub refused: u32,
    /// Estimated cost of the refused requests.
    pub avoided_micros: i64,
}

impl LoopTotals {
    /// Sum `loops`.
    pub fn of(loops: &[DetectedLoop]) -> Self {
        let mut sessions: Vec<(&str, &str)> = loops
            .iter()
            .map(|l| (l.tenant.as_str(), l.session.as_str()))
            .collect();
        sessions.sort_unstable();
        sessions.dedup();
        Self {
            loops: u32::try_from(loops.len()).unwrap_or(u32::MAX),
            sessions: u32::try_from(sessions.len()).unwrap_or(u32::MAX),
            burned_before_micros: loops.iter().map(|l| l.burned_before_micros).sum(),
            burned_after_micros: loops.iter().map(|l| l.burned_after_micros).sum(),
            refused: loops.iter().map(|l| l.refused).sum(),
            avoided_micros: loops.iter().map(|l| l.avoided_micros).sum(),
        }
    }
}

/// The loops the guard caught in `[from, to)` (optionally one tenant), most expensive first.
pub async fn detected(
    ledger: &dyn LedgerStore,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    tenant: Option<&str>,
) -> Result<Vec<DetectedLoop>, StoreError> {
    let rows = ledger.guard_rows(from, to, tenant).await?;
    Ok(detect(&rows, from))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(session: &str, minute: i64, cost: i64, mark: Option<(bool, u32)>) -> GuardRow {
        let (refused, steps) = mark.unwrap_or((false, 0));
        GuardRow {
            tenant_id: "t1".into(),
            tenant: "acme".into(),
            key_id: "k1".into(),
            session: session.into(),
            request_id: format!("{session}-{minute}"),
            started_at: DateTime::<Utc>::UNIX_EPOCH + Duration::minutes(minute),
            cost_micros: if refused { 0 } else { cost },
            status: if refused { 429 } else { 200 },
            loop_flag: mark.is_some(),
            refused,
            loop_steps: steps,
            avoided_micros: if refused { cost } else { 0 },
        }
    }

    #[test]
    fn a_loop_burns_its_earlier_steps_then_what_the_action_lets_through() {
        let flag = Some((false, 3));
        let refuse = Some((true, 3));
        let rows = vec![
            row("a", 0, 1, None),    // progress, not part of the loop
            row("a", 1, 10, None),   // step 1
            row("a", 2, 20, None),   // step 2
            row("a", 3, 30, flag),   // caught on step 3, answered (flag)
            row("a", 4, 40, refuse), // refused: 40 avoided
            row("a", 5, 50, None),   // one unmarked row does not end it
            row("a", 6, 60, flag),
            row("a", 7, 1, None), // two unmarked rows: progress
            row("a", 8, 1, None),
            row("a", 9, 70, refuse), // a second loop; its earlier steps are rows 7 and 8
            row("b", 0, 5, refuse),  // caught on the first request of a session
        ];
        let found = detect(&rows, DateTime::<Utc>::UNIX_EPOCH);
        assert_eq!(found.len(), 3, "{found:#?}");
        let first = &found[0];
        assert_eq!((first.requests_before, first.burned_before_micros), (2, 30));
        assert_eq!((first.flagged_requests, first.burned_after_micros), (2, 90));
        assert_eq!((first.refused, first.avoided_micros), (1, 40));
        let second = &found[1];
        assert_eq!(
            (
                second.requests_before,
                second.burned_before_micros,
                second.refused
            ),
            (2, 2, 1)
        );
        assert_eq!(second.avoided_micros, 70);
        let third = &found[2];
        assert_eq!((third.session.as_str(), third.requests_before), ("b", 0));
        let t = LoopTotals::of(&found);
        assert_eq!((t.loops, t.sessions, t.refused), (3, 2, 3));
        assert_eq!(t.burned_before_micros + t.burned_after_micros, 122);
        assert_eq!(t.avoided_micros, 115);
    }

    #[test]
    fn a_loop_caught_before_the_period_is_not_reported_and_steps_stay_in_the_lookback() {
        let rows = vec![
            row("a", 0, 10, None),
            row("a", 100, 20, None),
            row("a", 101, 30, Some((false, 3))),
        ];
        let found = detect(&rows, DateTime::<Utc>::UNIX_EPOCH + Duration::minutes(50));
        assert_eq!(found.len(), 1);
        assert_eq!(
            (found[0].requests_before, found[0].burned_before_micros),
            (1, 20),
            "the row 100 minutes earlier is outside the hour"
        );
        assert!(detect(&rows, DateTime::<Utc>::UNIX_EPOCH + Duration::minutes(102)).is_empty());
    }
}
