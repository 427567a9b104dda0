//! Reports over the ledger: the weekly cost report, the explanation of a change in cost between
//! two weeks, and agent loops found from billing data alone.
//!
//! Waste is counted once per row, in priority order: loop (flagged by the loop detector), then
//! retry storm, then failed request (status ≥ 400, including clients that hung up mid-stream).
//! Everything else is *useful* spend, which the explanation breaks down further.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Datelike, Duration, NaiveDate, TimeZone, Utc, Weekday};
use serde::{Deserialize, Serialize};

use super::loops::{self, DetectedLoop, LoopTotals};
use super::{tokens, LedgerStore};
use crate::store::StoreError;
use crate::usage::{CacheStatus, UsageEvent, UsageSource};

/// A ledger column (or expression) to group by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Dimension {
    /// Tenant name.
    Tenant,
    /// Served model (requested model when nothing was served).
    Model,
    /// Tier.
    Tier,
    /// `feature` tag.
    Feature,
    /// `session` tag.
    Session,
    /// API key id.
    Key,
}

impl Dimension {
    /// SQL expression for the dimension (fixed strings, never input).
    fn sql(self) -> &'static str {
        match self {
            Self::Tenant => "tenant_name",
            Self::Model => "COALESCE(served_model, requested_model)",
            Self::Tier => "COALESCE(tier, '-')",
            Self::Feature => "COALESCE(feature, '-')",
            Self::Session => "COALESCE(session, '-')",
            Self::Key => "key_id",
        }
    }
}

/// Sums over a set of ledger rows. Money in micro-dollars.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Aggregate {
    /// Rows.
    pub requests: i64,
    /// Total cost.
    pub cost: i64,
    /// Prompt tokens.
    pub prompt_tokens: i64,
    /// Completion tokens.
    pub completion_tokens: i64,
    /// Prompt tokens served from upstream prefix caches.
    pub cached_tokens: i64,
    /// What cache hits would have cost.
    pub saved: i64,
    /// Requests answered from the gateway's cache.
    pub cache_hits: i64,
    /// Cost of rows flagged as agent loops.
    pub waste_loops: i64,
    /// Cost of rows flagged as retry storms (and not loops).
    pub waste_retries: i64,
    /// Cost of failed rows (status ≥ 400) not already counted as loops or retries.
    pub waste_errors: i64,
    /// Useful rows: not waste (cache hits included).
    pub useful_requests: i64,
    /// Useful rows answered upstream (billed).
    pub billed_requests: i64,
    /// Cost of billed useful rows.
    pub billed_cost: i64,
    /// Output part of `billed_cost`.
    pub billed_output_cost: i64,
    /// Prompt tokens of billed useful rows.
    pub billed_prompt_tokens: i64,
    /// Completion tokens of billed useful rows.
    pub billed_completion_tokens: i64,
    /// Requests the guard refused as part of a loop (throttled or blocked).
    #[serde(default)]
    pub loop_refused: i64,
    /// What answering the refused loop requests would have cost (estimated).
    #[serde(default)]
    pub loop_avoided: i64,
    /// Requests the tier router (`model: "auto"`) sent to a tier, answered.
    #[serde(default)]
    pub routed_requests: i64,
    /// Of those, the ones the large tier answered.
    #[serde(default)]
    pub routed_large: i64,
    /// What the routed requests cost.
    #[serde(default)]
    pub routed_cost: i64,
    /// What they would have cost with every one on the large tier (same tokens, the large
    /// tier's price in force at the time).
    #[serde(default)]
    pub routed_all_large: i64,
    /// Rows of the demo's labelled synthetic history (`usage_source = 'synthetic'`).
    #[serde(default)]
    pub synthetic_requests: i64,
    /// Requests the other tier answered because the chosen one could not
    /// (`route_reason = 'unhealthy'`: the gateway's fallback).
    #[serde(default)]
    pub fallback_requests: i64,
    /// What those cost.
    #[serde(default)]
    pub fallback_cost: i64,
}

impl Aggregate {
    /// The share of routed requests the large tier answered (`None` without routed requests).
    pub fn large_share(&self) -> Option<f64> {
        (self.routed_requests > 0).then(|| self.routed_large as f64 / self.routed_requests as f64)
    }

    /// What the tier router saved against sending every routed request to the large tier.
    pub fn router_saved(&self) -> i64 {
        self.routed_all_large - self.routed_cost
    }

    /// Total waste.
    pub fn waste(&self) -> i64 {
        self.waste_loops + self.waste_retries + self.waste_errors
    }

    /// Cost per 1,000 requests, micro-dollars (rounded to the nearest micro-dollar); 0 without
    /// requests.
    pub fn cost_per_thousand(&self) -> i64 {
        if self.requests <= 0 {
            return 0;
        }
        let v = (i128::from(self.cost) * 1000 + i128::from(self.requests) / 2)
            / i128::from(self.requests);
        i64::try_from(v).unwrap_or(i64::MAX)
    }
}

const WASTE: &str = "(loop_flag OR retry_storm_flag OR status >= 400)";
const HIT: &str = "cache_status IN ('hit_exact', 'hit_semantic')";
const ROUTED: &str = "all_large_micros IS NOT NULL";
const FALLBACK: &str = "route_reason = 'unhealthy'";

/// One measure: its column name, its SQL over raw ledger rows, its field of [`Aggregate`].
type Measure = (&'static str, String, Field);
/// Reads one measure of an [`Aggregate`].
type Field = fn(&Aggregate) -> i64;

/// Every measure of [`Aggregate`] as (column name, SQL over raw ledger rows, its field). The one
/// place these definitions live in SQL: the raw aggregate and the daily rollup both use them.
/// [`Aggregate::of_row`] says the same for one row in Rust (for the writer that adds a batch to
/// the rollup from the rows it holds); a test holds the two equal.
fn measures() -> Vec<Measure> {
    let when = |cond: &str, value: &str| format!("CASE WHEN {cond} THEN {value} ELSE 0 END");
    let billed = format!("NOT {WASTE} AND NOT ({HIT})");
    vec![
        ("requests", "1".to_owned(), |a| a.requests),
        ("cost", "cost_micros".to_owned(), |a| a.cost),
        ("prompt_tokens", "prompt_tokens".to_owned(), |a| {
            a.prompt_tokens
        }),
        ("completion_tokens", "completion_tokens".to_owned(), |a| {
            a.completion_tokens
        }),
        ("cached_tokens", "cached_tokens".to_owned(), |a| {
            a.cached_tokens
        }),
        ("saved", "saved_micros".to_owned(), |a| a.saved),
        ("cache_hits", when(HIT, "1"), |a| a.cache_hits),
        ("waste_loops", when("loop_flag", "cost_micros"), |a| {
            a.waste_loops
        }),
        (
            "waste_retries",
            when("retry_storm_flag AND NOT loop_flag", "cost_micros"),
            |a| a.waste_retries,
        ),
        (
            "waste_errors",
            when(
                "status >= 400 AND NOT loop_flag AND NOT retry_storm_flag",
                "cost_micros",
            ),
            |a| a.waste_errors,
        ),
        ("useful_requests", when(&format!("NOT {WASTE}"), "1"), |a| {
            a.useful_requests
        }),
        ("billed_requests", when(&billed, "1"), |a| a.billed_requests),
        ("billed_cost", when(&billed, "cost_micros"), |a| {
            a.billed_cost
        }),
        (
            "billed_output_cost",
            when(&billed, "output_cost_micros"),
            |a| a.billed_output_cost,
        ),
        (
            "billed_prompt_tokens",
            when(&billed, "prompt_tokens"),
            |a| a.billed_prompt_tokens,
        ),
        (
            "billed_completion_tokens",
            when(&billed, "completion_tokens"),
            |a| a.billed_completion_tokens,
        ),
        (
            "loop_refused",
            when("error_kind = 'loop_detected'", "1"),
            |a| a.loop_refused,
        ),
        ("loop_avoided", "avoided_micros".to_owned(), |a| {
            a.loop_avoided
        }),
        ("routed_requests", when(ROUTED, "1"), |a| a.routed_requests),
        (
            "routed_large",
            when(&format!("{ROUTED} AND tier = 'large'"), "1"),
            |a| a.routed_large,
        ),
        ("routed_cost", when(ROUTED, "cost_micros"), |a| {
            a.routed_cost
        }),
        (
            "routed_all_large",
            "COALESCE(all_large_micros, 0)".to_owned(),
            |a| a.routed_all_large,
        ),
        (
            "synthetic_requests",
            when("usage_source = 'synthetic'", "1"),
            |a| a.synthetic_requests,
        ),
        ("fallback_requests", when(FALLBACK, "1"), |a| {
            a.fallback_requests
        }),
        ("fallback_cost", when(FALLBACK, "cost_micros"), |a| {
            a.fallback_cost
        }),
    ]
}

impl Aggregate {
    /// One ledger row's measures: [`measures`]' definitions (`WASTE`, `HIT`, `ROUTED`,
    /// `FALLBACK` and the `CASE`s) in Rust, over the row as the ledger stores it.
    pub(crate) fn of_row(e: &UsageEvent) -> Self {
        let when = |cond: bool, value: i64| if cond { value } else { 0 };
        let hit = matches!(
            e.cache_status,
            CacheStatus::HitExact | CacheStatus::HitSemantic
        );
        let failed = e.status >= 400;
        let waste = e.loop_flag || e.retry_storm_flag || failed;
        let billed = !waste && !hit;
        let routed = e.all_large_micros.is_some();
        let fallback = e.route_reason.as_deref() == Some("unhealthy");
        let (prompt, completion) = (tokens(e.prompt_tokens), tokens(e.completion_tokens));
        let cost = e.cost_micros;
        Self {
            requests: 1,
            cost,
            prompt_tokens: prompt,
            completion_tokens: completion,
            cached_tokens: tokens(e.cached_tokens),
            saved: e.saved_micros,
            cache_hits: when(hit, 1),
            waste_loops: when(e.loop_flag, cost),
            waste_retries: when(e.retry_storm_flag && !e.loop_flag, cost),
            waste_errors: when(failed && !e.loop_flag && !e.retry_storm_flag, cost),
            useful_requests: when(!waste, 1),
            billed_requests: when(billed, 1),
            billed_cost: when(billed, cost),
            billed_output_cost: when(billed, e.output_cost_micros),
            billed_prompt_tokens: when(billed, prompt),
            billed_completion_tokens: when(billed, completion),
            loop_refused: when(e.error_kind.as_deref() == Some("loop_detected"), 1),
            loop_avoided: e.avoided_micros,
            routed_requests: when(routed, 1),
            routed_large: when(routed && e.tier.as_deref() == Some("large"), 1),
            routed_cost: when(routed, cost),
            routed_all_large: e.all_large_micros.unwrap_or(0),
            synthetic_requests: when(e.usage_source == UsageSource::Synthetic, 1),
            fallback_requests: when(fallback, 1),
            fallback_cost: when(fallback, cost),
        }
    }
}

/// A row's place in the daily rollup: its UTC day, tenant, model, tier and feature, as
/// [`Dimension::sql`] computes them from the stored columns.
pub(crate) type DayKey<'a> = (NaiveDate, &'a str, &'a str, &'a str, &'a str);

/// `rows` summed per rollup key, keys in order (the order the rollup's rows are upserted in).
pub(crate) fn day_groups(rows: &[UsageEvent]) -> BTreeMap<DayKey<'_>, Aggregate> {
    let mut groups: BTreeMap<DayKey<'_>, Aggregate> = BTreeMap::new();
    for e in rows {
        let key = (
            e.started_at.date_naive(),
            e.tenant_name.as_str(),
            e.served_model.as_deref().unwrap_or(&e.requested_model),
            e.tier.as_deref().unwrap_or("-"),
            e.feature().unwrap_or("-"),
        );
        let sum = groups.entry(key).or_default();
        *sum = add(*sum, &Aggregate::of_row(e));
    }
    groups
}

/// An aggregate's measures in the rollup's column order (the order of [`measures`] and of
/// [`rollup_values_sql`]'s parameters after the five key columns).
pub(crate) fn measure_values(a: &Aggregate) -> impl Iterator<Item = i64> + '_ {
    static FIELDS: std::sync::LazyLock<Vec<Field>> =
        std::sync::LazyLock::new(|| measures().into_iter().map(|(_, _, f)| f).collect());
    FIELDS.iter().map(move |field| field(a))
}

/// Upsert `groups` rollup rows given as parameters, `?` in order: per row the day (text,
/// `YYYY-MM-DD`), tenant, model, tier, feature, then the measures in [`measures`]' order; each
/// adds its sums to the row already there.
pub(crate) fn rollup_values_sql(groups: usize) -> String {
    let names: Vec<&str> = measures().iter().map(|(n, _, _)| *n).collect();
    let row = format!("(?, ?, ?, ?, ?, {})", vec!["?"; names.len()].join(", "));
    format!(
        "INSERT INTO ledger_daily (day, tenant_name, model, tier, feature, {}) VALUES {} \
         ON CONFLICT (day, tenant_name, model, tier, feature) DO UPDATE SET {}",
        names.join(", "),
        vec![row.as_str(); groups].join(", "),
        rollup_updates(&names)
    )
}

fn rollup_updates(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("{n} = ledger_daily.{n} + excluded.{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn sum(expr: &str) -> String {
    format!("CAST(COALESCE(SUM({expr}), 0) AS BIGINT)")
}

fn key_sql(group: &[Dimension], column: fn(Dimension) -> &'static str) -> String {
    if group.is_empty() {
        "''".to_owned()
    } else {
        group
            .iter()
            .map(|d| column(*d))
            .collect::<Vec<_>>()
            .join(" || '|' || ")
    }
}

fn grouped_select(key: &str, measures: &[String], from: &str, tenant_filter: bool) -> String {
    let mut sql = format!("SELECT {key} AS key, {} FROM {from}", measures.join(", "));
    if tenant_filter {
        sql.push_str(" AND tenant_name = $3");
    }
    if key != "''" {
        sql.push_str(&format!(" GROUP BY {key}"));
    }
    sql
}

/// The aggregate over raw rows both stores run: `$1 <= started_at < $2`, optionally
/// `tenant_name = $3`, grouped by `group` (joined with `|` into one key column).
pub(crate) fn aggregate_sql(group: &[Dimension], tenant_filter: bool) -> String {
    let cols: Vec<String> = measures()
        .into_iter()
        .map(|(name, expr, _)| format!("{} AS {name}", sum(&expr)))
        .collect();
    grouped_select(
        &key_sql(group, Dimension::sql),
        &cols,
        "ledger WHERE started_at >= $1 AND started_at < $2",
        tenant_filter,
    )
}

impl Dimension {
    /// The rollup's column for this dimension, if the rollup keeps it.
    fn rollup_column(self) -> Option<&'static str> {
        match self {
            Self::Tenant => Some("tenant_name"),
            Self::Model => Some("model"),
            Self::Tier => Some("tier"),
            Self::Feature => Some("feature"),
            Self::Session | Self::Key => None,
        }
    }
}

/// Whether `group` can be answered from the daily rollup for `[from, to)`.
pub(crate) fn rollup_covers(group: &[Dimension], from: DateTime<Utc>, to: DateTime<Utc>) -> bool {
    let midnight = |t: DateTime<Utc>| t.time() == chrono::NaiveTime::MIN;
    midnight(from) && midnight(to) && group.iter().all(|d| d.rollup_column().is_some())
}

/// The same aggregate from the daily rollup: `$1 <= day < $2` (dates), optionally `$3` tenant.
pub(crate) fn rollup_sql(group: &[Dimension], tenant_filter: bool) -> String {
    let cols: Vec<String> = measures()
        .into_iter()
        .map(|(name, _, _)| format!("{} AS {name}", sum(name)))
        .collect();
    grouped_select(
        &key_sql(group, |d| d.rollup_column().unwrap_or("''")),
        &cols,
        "ledger_daily WHERE day >= $1 AND day < $2",
        tenant_filter,
    )
}

/// Add the rows of `source` (raw ledger rows; a table, CTE or filtered subquery) to the daily
/// rollup. `day` is the dialect's expression for the UTC day of `started_at`. Keys are upserted
/// in a fixed order so concurrent writers lock rollup rows in the same order.
pub(crate) fn rollup_upsert_sql(day: &str, source: &str) -> String {
    let ms = measures();
    let names: Vec<&str> = ms.iter().map(|(n, _, _)| *n).collect();
    let sums: Vec<String> = ms.iter().map(|(_, e, _)| sum(e)).collect();
    format!(
        "INSERT INTO ledger_daily (day, tenant_name, model, tier, feature, {}) \
         SELECT {day}, tenant_name, {}, {}, {}, {} FROM {source} \
         GROUP BY 1, 2, 3, 4, 5 ORDER BY 1, 2, 3, 4, 5 \
         ON CONFLICT (day, tenant_name, model, tier, feature) DO UPDATE SET {}",
        names.join(", "),
        Dimension::Model.sql(),
        Dimension::Tier.sql(),
        Dimension::Feature.sql(),
        sums.join(", "),
        rollup_updates(&names)
    )
}

/// Decode one aggregate row (same code for both drivers).
macro_rules! decode_aggregate {
    ($row:expr) => {{
        use sqlx::Row;
        let r = $row;
        Ok::<_, StoreError>((
            r.try_get::<String, _>("key")?,
            $crate::ledger::report::Aggregate {
                requests: r.try_get("requests")?,
                cost: r.try_get("cost")?,
                prompt_tokens: r.try_get("prompt_tokens")?,
                completion_tokens: r.try_get("completion_tokens")?,
                cached_tokens: r.try_get("cached_tokens")?,
                saved: r.try_get("saved")?,
                cache_hits: r.try_get("cache_hits")?,
                waste_loops: r.try_get("waste_loops")?,
                waste_retries: r.try_get("waste_retries")?,
                waste_errors: r.try_get("waste_errors")?,
                useful_requests: r.try_get("useful_requests")?,
                billed_requests: r.try_get("billed_requests")?,
                billed_cost: r.try_get("billed_cost")?,
                billed_output_cost: r.try_get("billed_output_cost")?,
                billed_prompt_tokens: r.try_get("billed_prompt_tokens")?,
                billed_completion_tokens: r.try_get("billed_completion_tokens")?,
                loop_refused: r.try_get("loop_refused")?,
                loop_avoided: r.try_get("loop_avoided")?,
                routed_requests: r.try_get("routed_requests")?,
                routed_large: r.try_get("routed_large")?,
                routed_cost: r.try_get("routed_cost")?,
                routed_all_large: r.try_get("routed_all_large")?,
                synthetic_requests: r.try_get("synthetic_requests")?,
                fallback_requests: r.try_get("fallback_requests")?,
                fallback_cost: r.try_get("fallback_cost")?,
            },
        ))
    }};
}
pub(crate) use decode_aggregate;

/// An ISO week, `2026-W48`: Monday 00:00 UTC to the next Monday.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct IsoWeek {
    /// ISO year.
    pub year: i32,
    /// ISO week number.
    pub week: u32,
}

impl IsoWeek {
    /// The week containing `t`.
    pub fn containing(t: DateTime<Utc>) -> Self {
        let w = t.iso_week();
        Self {
            year: w.year(),
            week: w.week(),
        }
    }

    /// Parse `2026-W48` (or `2026-w48`, `W48` meaning this year's).
    pub fn parse(s: &str, now: DateTime<Utc>) -> Option<Self> {
        let s = s.trim();
        let (year, week) = match s.split_once(['W', 'w']) {
            Some(("", w)) => (now.iso_week().year(), w),
            Some((y, w)) => (y.trim_end_matches('-').parse().ok()?, w),
            None => return None,
        };
        let week: u32 = week.parse().ok()?;
        NaiveDate::from_isoywd_opt(year, week, Weekday::Mon)?;
        Some(Self { year, week })
    }

    /// First instant of the week.
    pub fn start(self) -> DateTime<Utc> {
        let monday =
            NaiveDate::from_isoywd_opt(self.year, self.week, Weekday::Mon).unwrap_or_default();
        Utc.from_utc_datetime(&monday.and_hms_opt(0, 0, 0).unwrap_or_default())
    }

    /// First instant after the week.
    pub fn end(self) -> DateTime<Utc> {
        self.start() + Duration::days(7)
    }

    /// The week before.
    pub fn previous(self) -> Self {
        Self::containing(self.start() - Duration::days(1))
    }
}

impl std::fmt::Display for IsoWeek {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-W{:02}", self.year, self.week)
    }
}

/// One line of a weekly report: this week and the previous one.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReportLine {
    /// The group's value (tenant name, model, …).
    pub key: String,
    /// This week.
    pub this: Aggregate,
    /// The week before.
    pub previous: Aggregate,
}

/// The weekly cost report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WeeklyReport {
    /// The week reported.
    pub week: String,
    /// The week compared against.
    pub previous_week: String,
    /// Everything.
    pub total: ReportLine,
    /// By dimension, biggest spend first.
    pub by: BTreeMap<String, Vec<ReportLine>>,
    /// Agent loops the guard found this week.
    #[serde(default)]
    pub loops: WeeklyLoops,
    /// The tier router by tenant: its share of large calls and what it saved against
    /// everything on large, this week and the one before; then `total`.
    #[serde(default)]
    pub routing: Vec<RoutingChange>,
    /// Each day of the week (`key`: its date) beside the same weekday of the week before.
    #[serde(default)]
    pub daily: Vec<ReportLine>,
    /// The [`TOP_SPENDERS`] most expensive API keys (`key`: key id) and sessions this week.
    #[serde(default)]
    pub top: BTreeMap<String, Vec<ReportLine>>,
}

/// API keys and sessions listed by name in the weekly report.
pub const TOP_SPENDERS: usize = 5;

/// The weekly report's agent loops: totals, and the most expensive ones.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WeeklyLoops {
    /// Over every loop found this week.
    pub total: LoopTotals,
    /// The week before.
    pub previous: LoopTotals,
    /// The [`TOP_LOOPS`] most expensive.
    pub top: Vec<DetectedLoop>,
}

/// Loops listed by name in the weekly report.
pub const TOP_LOOPS: usize = 10;

async fn grouped(
    ledger: &dyn LedgerStore,
    week: IsoWeek,
    tenant: Option<&str>,
    group: &[Dimension],
) -> Result<HashMap<String, Aggregate>, StoreError> {
    Ok(ledger
        .aggregate(week.start(), week.end(), tenant, group)
        .await?
        .into_iter()
        .collect())
}

fn lines(
    this: HashMap<String, Aggregate>,
    previous: HashMap<String, Aggregate>,
) -> Vec<ReportLine> {
    let mut keys: Vec<String> = this.keys().chain(previous.keys()).cloned().collect();
    keys.sort();
    keys.dedup();
    let mut out: Vec<ReportLine> = keys
        .into_iter()
        .map(|key| ReportLine {
            this: this.get(&key).copied().unwrap_or_default(),
            previous: previous.get(&key).copied().unwrap_or_default(),
            key,
        })
        .collect();
    out.sort_by(|a, b| b.this.cost.cmp(&a.this.cost).then(a.key.cmp(&b.key)));
    out
}

/// Build the weekly report for `week` (optionally one tenant) with the change from the week
/// before.
pub async fn weekly(
    ledger: &dyn LedgerStore,
    week: IsoWeek,
    tenant: Option<&str>,
) -> Result<WeeklyReport, StoreError> {
    let previous = week.previous();
    let total = lines(
        grouped(ledger, week, tenant, &[]).await?,
        grouped(ledger, previous, tenant, &[]).await?,
    )
    .pop()
    .unwrap_or(ReportLine {
        key: String::new(),
        this: Aggregate::default(),
        previous: Aggregate::default(),
    });
    let mut by = BTreeMap::new();
    for (name, dim) in [
        ("tenant", Dimension::Tenant),
        ("model", Dimension::Model),
        ("tier", Dimension::Tier),
        ("feature", Dimension::Feature),
    ] {
        let this = grouped(ledger, week, tenant, &[dim]).await?;
        let prev = grouped(ledger, previous, tenant, &[dim]).await?;
        by.insert(name.to_owned(), lines(this, prev));
    }
    let mut found = loops::detected(ledger, week.start(), week.end(), tenant).await?;
    let before = loops::detected(ledger, previous.start(), previous.end(), tenant).await?;
    let total_loops = LoopTotals::of(&found);
    found.truncate(TOP_LOOPS);
    let routing = RoutingChange::by_tenant(
        by.get("tenant").map_or(&[][..], Vec::as_slice),
        (&total.previous, &total.this),
    );
    let mut daily = Vec::with_capacity(7);
    for d in 0..7 {
        let day = |w: IsoWeek| {
            let from = w.start() + Duration::days(d);
            (from, from + Duration::days(1))
        };
        let one = |(from, to): (DateTime<Utc>, DateTime<Utc>)| async move {
            let rows = ledger.aggregate(from, to, tenant, &[]).await?;
            Ok::<_, StoreError>(
                rows.into_iter()
                    .map(|(_, a)| a)
                    .fold(Aggregate::default(), |a, b| add(a, &b)),
            )
        };
        let (from, to) = day(week);
        daily.push(ReportLine {
            key: from.date_naive().to_string(),
            this: one((from, to)).await?,
            previous: one(day(previous)).await?,
        });
    }
    let mut top = BTreeMap::new();
    for (name, dim) in [("key", Dimension::Key), ("session", Dimension::Session)] {
        let mut l = lines(
            grouped(ledger, week, tenant, &[dim]).await?,
            grouped(ledger, previous, tenant, &[dim]).await?,
        );
        // Untagged traffic is not a session; keys and sessions idle this week are not top.
        l.retain(|l| l.this.requests > 0 && !(dim == Dimension::Session && l.key == "-"));
        l.truncate(TOP_SPENDERS);
        top.insert(name.to_owned(), l);
    }
    Ok(WeeklyReport {
        week: week.to_string(),
        previous_week: previous.to_string(),
        total: ReportLine {
            key: "total".into(),
            ..total
        },
        by,
        loops: WeeklyLoops {
            total: total_loops,
            previous: LoopTotals::of(&before),
            top: found,
        },
        routing,
        daily,
        top,
    })
}

/// One term of an explanation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Term {
    /// What changed.
    pub term: String,
    /// Its contribution to the change in cost, micro-dollars (signed).
    pub micros: i64,
}

/// A contributor to the change (a tenant, tag or session) and its change in cost.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Contributor {
    /// Its value.
    pub key: String,
    /// Cost in the first week.
    pub from_micros: i64,
    /// Cost in the second week.
    pub to_micros: i64,
}

/// Why the cost changed between two weeks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Explanation {
    /// First week.
    pub from_week: String,
    /// Second week.
    pub to_week: String,
    /// Cost in the first week.
    pub from_micros: i64,
    /// Cost in the second week.
    pub to_micros: i64,
    /// Terms, adding up exactly to `to_micros - from_micros`.
    pub terms: Vec<Term>,
    /// Largest changes by tenant, feature tag and session.
    pub top: BTreeMap<String, Vec<Contributor>>,
    /// The tier router by tenant (those with routed requests in either week), then `total`.
    #[serde(default)]
    pub routing: Vec<RoutingChange>,
    /// Rows of the demo's synthetic history in the two weeks (0 on real traffic).
    #[serde(default)]
    pub synthetic_requests: i64,
}

/// The tier router's share of large calls and savings for one tenant (or `total`), in the two
/// weeks of an explanation (or a report's week and the one before).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutingChange {
    /// Tenant name, or `total`.
    pub key: String,
    /// Routed requests in the first week.
    pub from_requests: i64,
    /// Routed requests in the second week.
    pub to_requests: i64,
    /// Share answered by the large tier in the first week (`None`: nothing routed).
    pub from_large_share: Option<f64>,
    /// Share answered by the large tier in the second week.
    pub to_large_share: Option<f64>,
    /// Saved against everything on large in the first week, micro-dollars.
    pub from_saved_micros: i64,
    /// Saved against everything on large in the second week, micro-dollars.
    pub to_saved_micros: i64,
}

impl RoutingChange {
    /// From a line's two aggregates (`previous` is the first week).
    pub fn of(key: &str, from: &Aggregate, to: &Aggregate) -> Self {
        Self {
            key: key.to_owned(),
            from_requests: from.routed_requests,
            to_requests: to.routed_requests,
            from_large_share: from.large_share(),
            to_large_share: to.large_share(),
            from_saved_micros: from.router_saved(),
            to_saved_micros: to.router_saved(),
        }
    }

    /// The routing lines of report lines by tenant (`this` the second week) and their total:
    /// tenants that routed nothing in either week are left out.
    pub fn by_tenant(lines: &[ReportLine], total: (&Aggregate, &Aggregate)) -> Vec<Self> {
        let mut out: Vec<Self> = lines
            .iter()
            .filter(|l| l.this.routed_requests > 0 || l.previous.routed_requests > 0)
            .map(|l| Self::of(&l.key, &l.previous, &l.this))
            .collect();
        out.push(Self::of("total", total.0, total.1));
        out
    }
}

/// Logarithmic mean, the LMDI weight.
fn log_mean(a: f64, b: f64) -> f64 {
    if (a - b).abs() < 1e-9 {
        a
    } else {
        (a - b) / (a.ln() - b.ln())
    }
}

/// Zero-safe log ratio (LMDI's small-value substitution).
fn ln_ratio(a: f64, b: f64) -> f64 {
    const EPS: f64 = 1e-9;
    (a.max(EPS) / b.max(EPS)).ln()
}

/// Useful spend of one segment as factors: cost = N · share · billed · per-token · price.
struct Factors {
    share: f64,
    billed: f64,
    prompt: f64,
    completion: f64,
    input_price: f64,
    output_price: f64,
    input_cost: f64,
    output_cost: f64,
}

fn factors(a: &Aggregate, useful_total: f64) -> Factors {
    let div = |x: i64, y: i64| if y > 0 { x as f64 / y as f64 } else { 0.0 };
    let input_cost = (a.billed_cost - a.billed_output_cost) as f64;
    Factors {
        share: if useful_total > 0.0 {
            a.useful_requests as f64 / useful_total
        } else {
            0.0
        },
        billed: div(a.billed_requests, a.useful_requests),
        prompt: div(a.billed_prompt_tokens, a.billed_requests),
        completion: div(a.billed_completion_tokens, a.billed_requests),
        input_price: div(a.billed_cost - a.billed_output_cost, a.billed_prompt_tokens),
        output_price: div(a.billed_output_cost, a.billed_completion_tokens),
        input_cost,
        output_cost: a.billed_output_cost as f64,
    }
}

/// Decompose the change in cost from `from` to `to` into additive terms: traffic volume,
/// model/tier mix (segments are tenant × served model), cache hit rate (the share of requests
/// answered by the gateway's cache), prompt length, completion length, unit price (price changes
/// and the upstreams' prefix-cache discount), and waste (loops, retry storms, failed requests),
/// by LMDI-I (log-mean Divisia index), which has no residual; rounding is put in `rounding`.
pub async fn explain(
    ledger: &dyn LedgerStore,
    from: IsoWeek,
    to: IsoWeek,
    tenant: Option<&str>,
) -> Result<Explanation, StoreError> {
    let seg = [Dimension::Tenant, Dimension::Model];
    let s0 = grouped(ledger, from, tenant, &seg).await?;
    let s1 = grouped(ledger, to, tenant, &seg).await?;
    let t0 = s0.values().fold(Aggregate::default(), add);
    let t1 = s1.values().fold(Aggregate::default(), add);
    let (n0, n1) = (t0.useful_requests as f64, t1.useful_requests as f64);
    let mut effects = [0.0f64; 6]; // volume, mix, cache, prompt, completion, price
    let mut keys: Vec<&String> = s0.keys().chain(s1.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let a0 = s0.get(key).copied().unwrap_or_default();
        let a1 = s1.get(key).copied().unwrap_or_default();
        let (f0, f1) = (factors(&a0, n0), factors(&a1, n1));
        for (c0, c1, len0, len1, p0, p1, is_input) in [
            (
                f0.input_cost,
                f1.input_cost,
                f0.prompt,
                f1.prompt,
                f0.input_price,
                f1.input_price,
                true,
            ),
            (
                f0.output_cost,
                f1.output_cost,
                f0.completion,
                f1.completion,
                f0.output_price,
                f1.output_price,
                false,
            ),
        ] {
            if c0 <= 0.0 && c1 <= 0.0 {
                continue;
            }
            let w = log_mean(c1.max(1e-9), c0.max(1e-9));
            effects[0] += w * ln_ratio(n1, n0);
            effects[1] += w * ln_ratio(f1.share, f0.share);
            effects[2] += w * ln_ratio(f1.billed, f0.billed);
            effects[if is_input { 3 } else { 4 }] += w * ln_ratio(len1, len0);
            effects[5] += w * ln_ratio(p1, p0);
        }
    }
    let names = [
        "traffic volume",
        "model/tier mix",
        "cache hit rate",
        "prompt length",
        "completion length",
        "unit price",
    ];
    let mut terms: Vec<Term> = names
        .iter()
        .zip(effects)
        .map(|(term, e)| Term {
            term: (*term).to_owned(),
            micros: e.round() as i64,
        })
        .collect();
    terms.push(Term {
        term: "waste: agent loops".into(),
        micros: t1.waste_loops - t0.waste_loops,
    });
    terms.push(Term {
        term: "waste: retry storms".into(),
        micros: t1.waste_retries - t0.waste_retries,
    });
    terms.push(Term {
        term: "waste: failed requests".into(),
        micros: t1.waste_errors - t0.waste_errors,
    });
    let explained: i64 = terms.iter().map(|t| t.micros).sum();
    terms.push(Term {
        term: "rounding".into(),
        micros: (t1.cost - t0.cost) - explained,
    });

    let mut top = BTreeMap::new();
    let mut routing = Vec::new();
    for (name, dim) in [
        ("tenant", Dimension::Tenant),
        ("feature", Dimension::Feature),
        ("session", Dimension::Session),
    ] {
        let a = grouped(ledger, from, tenant, &[dim]).await?;
        let b = grouped(ledger, to, tenant, &[dim]).await?;
        let by = lines(b, a);
        if dim == Dimension::Tenant {
            routing = RoutingChange::by_tenant(&by, (&t0, &t1));
        }
        let mut c: Vec<Contributor> = by
            .into_iter()
            // Untagged traffic is not a session.
            .filter(|l| !(dim == Dimension::Session && l.key == "-"))
            .map(|l| Contributor {
                key: l.key,
                from_micros: l.previous.cost,
                to_micros: l.this.cost,
            })
            .collect();
        c.sort_by_key(|x| std::cmp::Reverse((x.to_micros - x.from_micros).abs()));
        c.truncate(5);
        top.insert(name.to_owned(), c);
    }
    Ok(Explanation {
        from_week: from.to_string(),
        to_week: to.to_string(),
        from_micros: t0.cost,
        to_micros: t1.cost,
        terms,
        top,
        routing,
        synthetic_requests: t0.synthetic_requests + t1.synthetic_requests,
    })
}

fn add(a: Aggregate, b: &Aggregate) -> Aggregate {
    Aggregate {
        requests: a.requests + b.requests,
        cost: a.cost + b.cost,
        prompt_tokens: a.prompt_tokens + b.prompt_tokens,
        completion_tokens: a.completion_tokens + b.completion_tokens,
        cached_tokens: a.cached_tokens + b.cached_tokens,
        saved: a.saved + b.saved,
        cache_hits: a.cache_hits + b.cache_hits,
        waste_loops: a.waste_loops + b.waste_loops,
        waste_retries: a.waste_retries + b.waste_retries,
        waste_errors: a.waste_errors + b.waste_errors,
        useful_requests: a.useful_requests + b.useful_requests,
        billed_requests: a.billed_requests + b.billed_requests,
        billed_cost: a.billed_cost + b.billed_cost,
        billed_output_cost: a.billed_output_cost + b.billed_output_cost,
        billed_prompt_tokens: a.billed_prompt_tokens + b.billed_prompt_tokens,
        billed_completion_tokens: a.billed_completion_tokens + b.billed_completion_tokens,
        loop_refused: a.loop_refused + b.loop_refused,
        loop_avoided: a.loop_avoided + b.loop_avoided,
        routed_requests: a.routed_requests + b.routed_requests,
        routed_large: a.routed_large + b.routed_large,
        routed_cost: a.routed_cost + b.routed_cost,
        routed_all_large: a.routed_all_large + b.routed_all_large,
        synthetic_requests: a.synthetic_requests + b.synthetic_requests,
        fallback_requests: a.fallback_requests + b.fallback_requests,
        fallback_cost: a.fallback_cost + b.fallback_cost,
    }
}

/// A repeated request at a steady cadence: an agent stuck in a loop, seen in billing data.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoopFinding {
    /// API key id.
    pub key_id: String,
    /// Tenant name.
    pub tenant: String,
    /// `session` tag, or `-`.
    pub session: String,
    /// The repeated request's fingerprint.
    pub fingerprint: String,
    /// How many times it was sent.
    pub requests: usize,
    /// Mean time between repeats, seconds.
    pub mean_interval_secs: f64,
    /// Coefficient of variation of the intervals (0 = perfectly steady).
    pub cadence_cv: f64,
    /// What the repeats cost.
    pub cost_micros: i64,
    /// First and last repeat.
    pub first: DateTime<Utc>,
    /// Last repeat.
    pub last: DateTime<Utc>,
}

/// Find sessions/keys that sent the same request at least `min_repeats` times since `since`
/// with intervals whose coefficient of variation is at most `max_cv`.
pub async fn loops(
    ledger: &dyn LedgerStore,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
    min_repeats: usize,
    max_cv: f64,
) -> Result<Vec<LoopFinding>, StoreError> {
    let rows = ledger.repeats(since, until, min_repeats.max(2)).await?;
    let mut groups: BTreeMap<(String, String, String), Vec<RepeatRow>> = BTreeMap::new();
    for r in rows {
        groups
            .entry((r.key_id.clone(), r.session.clone(), r.fingerprint.clone()))
            .or_default()
            .push(r);
    }
    let mut out = Vec::new();
    for ((key_id, session, fingerprint), mut hits) in groups {
        hits.sort_by_key(|h| h.started_at);
        if hits.len() < min_repeats {
            continue;
        }
        let intervals: Vec<f64> = hits
            .windows(2)
            .map(|w| (w[1].started_at - w[0].started_at).num_milliseconds() as f64 / 1000.0)
            .collect();
        let mean = intervals.iter().sum::<f64>() / intervals.len() as f64;
        let var =
            intervals.iter().map(|i| (i - mean).powi(2)).sum::<f64>() / intervals.len() as f64;
        let cv = if mean > 0.0 { var.sqrt() / mean } else { 0.0 };
        if cv > max_cv {
            continue;
        }
        out.push(LoopFinding {
            tenant: hits[0].tenant.clone(),
            key_id,
            session,
            fingerprint,
            requests: hits.len(),
            mean_interval_secs: mean,
            cadence_cv: cv,
            cost_micros: hits.iter().map(|h| h.cost_micros).sum(),
            first: hits[0].started_at,
            last: hits[hits.len() - 1].started_at,
        });
    }
    out.sort_by_key(|f| std::cmp::Reverse(f.cost_micros));
    Ok(out)
}

/// One row of a repeated request (for [`loops`]).
#[derive(Debug, Clone)]
pub struct RepeatRow {
    /// API key id.
    pub key_id: String,
    /// Tenant name.
    pub tenant: String,
    /// Session tag or `-`.
    pub session: String,
    /// Fingerprint.
    pub fingerprint: String,
    /// Start time.
    pub started_at: DateTime<Utc>,
    /// Cost.
    pub cost_micros: i64,
}

/// Rows whose (key, session, fingerprint) occurs at least `$3` times in `[$1, $2)`.
pub(crate) const REPEATS_SQL: &str =
    "SELECT l.key_id, l.tenant_name, COALESCE(l.session, '-') AS session, \
     l.fingerprint, l.started_at, l.cost_micros FROM ledger l JOIN ( \
       SELECT key_id, COALESCE(session, '-') AS session, fingerprint FROM ledger \
       WHERE started_at >= $1 AND started_at < $2 \
       GROUP BY key_id, COALESCE(session, '-'), fingerprint HAVING COUNT(*) >= $3 \
     ) g ON g.key_id = l.key_id AND g.session = COALESCE(l.session, '-') \
       AND g.fingerprint = l.fingerprint \
     WHERE l.started_at >= $1 AND l.started_at < $2";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso_weeks_parse_and_bound() {
        let now = Utc
            .with_ymd_and_hms(2026, 11, 30, 12, 0, 0)
            .single()
            .unwrap_or_default();
        let w = IsoWeek::parse("2026-W48", now).unwrap_or(IsoWeek { year: 0, week: 0 });
        assert_eq!(w.to_string(), "2026-W48");
        assert_eq!(w.start().to_rfc3339(), "2026-11-23T00:00:00+00:00");
        assert_eq!(w.end(), IsoWeek::containing(now).start());
        assert_eq!(w.previous().to_string(), "2026-W47");
        assert_eq!(IsoWeek::parse("W49", now), Some(IsoWeek::containing(now)));
        assert_eq!(IsoWeek::parse("2026-W54", now), None);
        assert_eq!(IsoWeek::parse("yesterday", now), None);
        assert_eq!(
            IsoWeek {
                year: 2027,
                week: 1
            }
            .previous()
            .to_string(),
            "2026-W53"
        );
    }

    #[test]
    fn cost_per_thousand_requests_rounds() {
        let a = Aggregate {
            requests: 3,
            cost: 1_000,
            ..Aggregate::default()
        };
        assert_eq!(a.cost_per_thousand(), 333_333);
        assert_eq!(Aggregate::default().cost_per_thousand(), 0);
    }
}
