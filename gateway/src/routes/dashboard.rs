//! `GET /dashboard`: this week's cost day by day beside last week's, by tenant, feature, model
//! and tier, the top keys and sessions, budgets, cache savings and waste, the tier router, and
//! why the cost changed since last week, as one self-contained HTML page (inline CSS and inline SVG: no scripts, fonts or
//! external resources), so every deployment, the embedded SQLite one included, has a dashboard.
//!
//! Behind the admin token (bearer, or HTTP Basic auth with the token as password so a browser
//! can open it). Money is shown exactly: micro-dollars as USD with 6 decimals (`$1234.567890`).

use std::collections::HashMap;

use axum::extract::State;
use axum::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::budget::engine::UsageRow;
use crate::error::ApiError;
use crate::ledger::report::{
    self, Explanation, IsoWeek, ReportLine, RoutingChange, WeeklyLoops, WeeklyReport,
};
use crate::routes::Query;
use crate::routes::{ledger, week};
use crate::state::AppState;
use crate::types::price::Usd;

/// The page may load nothing: inline styles and `data:` images only.
pub const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src data:";

/// Width of the bars' area in the charts, in SVG user units.
const BAR_AREA: f64 = 560.0;
/// Width of the label column left of the bars.
const LABEL_WIDTH: f64 = 220.0;
/// Height of one chart row.
const ROW: u32 = 28;

/// Query of `GET /dashboard`.
#[derive(Deserialize)]
pub struct DashboardQuery {
    /// ISO week (`2026-W48`); default: the current week.
    week: Option<String>,
    /// Restrict to one tenant (name).
    tenant: Option<String>,
}

/// `GET /dashboard[?week=2026-W48][&tenant=…]`: the weekly report and its explanation as HTML.
pub async fn dashboard(
    State(state): State<AppState>,
    Query(q): Query<DashboardQuery>,
) -> Result<Response, ApiError> {
    let now = chrono::Utc::now();
    let w = week("week", q.week.as_deref(), IsoWeek::containing(now))?;
    let tenant = q.tenant.as_deref().filter(|t| !t.is_empty());
    let store = ledger(&state)?;
    let weekly = report::weekly(store, w, tenant).await?;
    let explanation = report::explain(store, w.previous(), w, tenant).await?;
    let live = Live::read(&state, tenant).await;
    let html = render(&weekly, &explanation, &live, w, tenant, now);
    Ok((
        [
            (CONTENT_TYPE, "text/html; charset=utf-8"),
            (CONTENT_SECURITY_POLICY, CSP),
            (CACHE_CONTROL, "no-store"),
        ],
        html,
    )
        .into_response())
}

/// What the page shows from the live state rather than the ledger: key names, and the budgets
/// in their current windows.
struct Live {
    /// Key id → its name (or display prefix).
    key_names: HashMap<String, String>,
    /// (tenant name, its budgets now), or why they could not be read.
    budgets: Result<Vec<(String, Vec<UsageRow>)>, String>,
}

impl Live {
    async fn read(state: &AppState, tenant: Option<&str>) -> Self {
        let key_names = state
            .store
            .list_keys(None)
            .await
            .map(|keys| {
                keys.into_iter()
                    .map(|k| {
                        let name = k.name.clone().unwrap_or_else(|| format!("{}…", k.prefix));
                        (k.id, format!("{name} ({})", k.tenant_name))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let budgets = async {
            let tenants = state
                .store
                .list_tenants()
                .await
                .map_err(|e| e.to_string())?;
            let mut out = Vec::new();
            for t in tenants
                .into_iter()
                .filter(|t| tenant.is_none_or(|name| t.name == name))
            {
                let rows = state
                    .budgets
                    .usage(&t.id)
                    .await
                    .map_err(|e| e.to_string())?;
                if !rows.is_empty() {
                    out.push((t.name, rows));
                }
            }
            Ok(out)
        }
        .await;
        Self { key_names, budgets }
    }
}

/// Escape text for HTML element content and (double- or single-quoted) attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Percent-encode a query parameter value (unreserved characters pass).
fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Micro-dollars as exact USD with 6 decimals: `$1234.567890`, `-$0.000100`.
pub fn usd(micros: i64) -> String {
    format!("{:#}", Usd(micros))
}

/// A signed change in micro-dollars: `+$0.100000`, `-$0.100000`, `$0.000000`.
fn usd_change(micros: i64) -> String {
    if micros > 0 {
        format!("+{}", usd(micros))
    } else {
        usd(micros)
    }
}

/// Relative change, `+12.5%`; `new` when there was nothing before.
fn percent(this: i64, previous: i64) -> String {
    match (this, previous) {
        (0, 0) => "0.0%".to_owned(),
        (_, 0) => "new".to_owned(),
        _ => format!(
            "{:+.1}%",
            (this - previous) as f64 * 100.0 / previous.abs() as f64
        ),
    }
}

/// Render the whole page.
fn render(
    r: &WeeklyReport,
    e: &Explanation,
    live: &Live,
    w: IsoWeek,
    tenant: Option<&str>,
    now: chrono::DateTime<chrono::Utc>,
) -> String {
    let scope = tenant.map_or(String::new(), |t| format!(" — tenant {}", escape(t)));
    let link = |target: IsoWeek| {
        let mut href = format!("?week={target}");
        if let Some(t) = tenant {
            href.push_str(&format!("&tenant={}", url_encode(t)));
        }
        escape(&href)
    };
    let next = IsoWeek::containing(w.end());
    let next_link = if next.start() <= now {
        format!(r#" · <a href="{}">{next} →</a>"#, link(next))
    } else {
        String::new()
    };
    let mut html = format!(
        r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>LLM gateway — cost {week}</title>
<style>{STYLE}</style>
</head>
<body>
<header>
<h1>Cost dashboard <span class="week">{week}</span>{scope}</h1>
<p class="nav">compared with {previous} · <a href="{prev_link}">← {previous}</a>{next_link}</p>
</header>
"#,
        csp = escape(CSP),
        week = escape(&r.week),
        previous = escape(&r.previous_week),
        prev_link = link(w.previous()),
    );
    let synthetic = r.total.this.synthetic_requests + r.total.previous.synthetic_requests;
    if synthetic > 0 {
        html.push_str(&format!(
            r#"<p class="demo" id="demo-data" data-rows="{synthetic}"><strong>Demo data.</strong> {synthetic} of the rows in these two weeks are a labelled synthetic history that <code>gateway demo</code> seeded (ledger <code>usage_source = 'synthetic'</code>), not requests. Start the demo with <code>--no-history</code> to skip it.</p>
"#
        ));
    }
    html.push_str(&headline(&r.total));
    html.push_str(&trend(&r.daily, &r.week, &r.previous_week));
    html.push_str(&explanation(e));
    for (dim, title, color) in [
        ("tenant", "Cost by tenant", "#4f6df5"),
        ("feature", "Cost by feature tag", "#7c3aed"),
    ] {
        let lines = r.by.get(dim).map(Vec::as_slice).unwrap_or_default();
        html.push_str(&chart(dim, title, color, lines));
    }
    html.push_str(&top(r, &live.key_names));
    html.push_str(&budgets(&live.budgets, now));
    html.push_str(&savings_and_waste(&r.total));
    for (dim, title, color) in [
        ("model", "Cost by model", "#16a34a"),
        ("tier", "Cost by tier", "#d97706"),
    ] {
        let lines = r.by.get(dim).map(Vec::as_slice).unwrap_or_default();
        html.push_str(&chart(dim, title, color, lines));
    }
    html.push_str(&routing(&r.routing));
    html.push_str(&loops(&r.loops));
    html.push_str(
        "<footer>Amounts are exact: the ledger's micro-dollars shown as USD with 6 decimals. \
         Weeks are ISO weeks, Monday 00:00 UTC.</footer>\n</body>\n</html>\n",
    );
    html
}

/// The headline numbers with the change from last week.
fn headline(total: &ReportLine) -> String {
    let (a, b) = (&total.this, &total.previous);
    let mut out = String::from("<section class=\"headline\">\n");
    out.push_str(&card_money("cost", "Cost", a.cost, b.cost));
    out.push_str(&format!(
        r#"<div class="card" id="headline-requests" data-value="{this}"><div class="label">Requests</div><div class="value">{this}</div><div class="change">{delta:+} ({pct}) vs {previous}</div></div>
"#,
        this = a.requests,
        previous = b.requests,
        delta = a.requests - b.requests,
        pct = percent(a.requests, b.requests),
    ));
    out.push_str(&card_money(
        "cost-per-1k",
        "Cost per 1k requests",
        a.cost_per_thousand(),
        b.cost_per_thousand(),
    ));
    out.push_str(&card_money("saved", "Cache savings", a.saved, b.saved));
    out.push_str(&card_money("waste", "Waste", a.waste(), b.waste()));
    out.push_str("</section>\n");
    out
}

/// One headline card for an amount of money.
fn card_money(id: &str, label: &str, this: i64, previous: i64) -> String {
    format!(
        r#"<div class="card" id="headline-{id}" data-cost-micros="{this}"><div class="label">{label}</div><div class="value">{value}</div><div class="change">{delta} ({pct}) vs {prev}</div></div>
"#,
        value = usd(this),
        delta = usd_change(this - previous),
        pct = percent(this, previous),
        prev = usd(previous),
    )
}

/// A horizontal bar chart (one `<rect>` per line, width proportional to this week's cost) and a
/// table of the exact amounts under it.
fn chart(dim: &str, title: &str, color: &str, lines: &[ReportLine]) -> String {
    let max = lines.iter().map(|l| l.this.cost).max().unwrap_or(0).max(0);
    let rows = u32::try_from(lines.len()).unwrap_or(u32::MAX).max(1);
    let height = rows * ROW + 8;
    let width = LABEL_WIDTH + BAR_AREA + 140.0;
    let mut out = format!(
        r#"<section class="chart" id="by-{dim}">
<h2>{title}</h2>
<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="{title}">
"#
    );
    if lines.is_empty() {
        out.push_str(
            r##"<text x="0" y="20" fill="#6b7280">No spend recorded this week.</text>
"##,
        );
    }
    for (i, l) in (0u32..).zip(lines) {
        let y = i * ROW + 4;
        let cost = l.this.cost.max(0);
        let bar = if max > 0 {
            cost as f64 / max as f64 * BAR_AREA
        } else {
            0.0
        };
        let key = escape(&l.key);
        let label = escape(&shorten(&l.key, 30));
        out.push_str(&format!(
            r##"<g class="row"><text x="{lx}" y="{ty}" text-anchor="end" class="key">{label}</text><rect x="{LABEL_WIDTH}" y="{y}" width="{bar:.2}" height="20" rx="3" fill="{color}" data-key="{key}" data-cost-micros="{cost}"><title>{key}: {amount} ({requests} requests)</title></rect><text x="{vx:.2}" y="{ty}" class="amount">{amount}</text></g>
"##,
            lx = LABEL_WIDTH - 8.0,
            ty = y + 15,
            amount = usd(l.this.cost),
            requests = l.this.requests,
            vx = LABEL_WIDTH + bar + 6.0,
        ));
    }
    out.push_str("</svg>\n");
    out.push_str(&format!(
        r#"<table class="amounts" id="table-{dim}">
<thead><tr><th>{dim}</th><th>This week</th><th>Last week</th><th>Change</th><th>Requests</th><th>Waste</th></tr></thead>
<tbody>
"#
    ));
    for l in lines {
        out.push_str(&format!(
            r#"<tr data-key="{key}" data-cost-micros="{cost}"><td>{key}</td><td class="num">{this}</td><td class="num">{prev}</td><td class="num">{delta} ({pct})</td><td class="num">{requests}</td><td class="num">{waste}</td></tr>
"#,
            key = escape(&l.key),
            cost = l.this.cost,
            this = usd(l.this.cost),
            prev = usd(l.previous.cost),
            delta = usd_change(l.this.cost - l.previous.cost),
            pct = percent(l.this.cost, l.previous.cost),
            requests = l.this.requests,
            waste = usd(l.this.waste()),
        ));
    }
    out.push_str("</tbody>\n</table>\n</section>\n");
    out
}

/// Daily cost: a pair of columns per weekday, this week's beside the same day of last week's,
/// and the exact amounts under it.
fn trend(days: &[ReportLine], week: &str, previous: &str) -> String {
    const HEIGHT: f64 = 160.0;
    const SLOT: f64 = 100.0;
    let max = days
        .iter()
        .map(|d| d.this.cost.max(d.previous.cost))
        .max()
        .unwrap_or(0)
        .max(1);
    let names = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];
    let width = SLOT * 7.0 + 40.0;
    let mut out = format!(
        r##"<section class="chart" id="daily">
<h2>Daily cost: {week} beside {previous}</h2>
<p class="legend"><span class="swatch this"></span>{week} <span class="swatch prev"></span>{previous}</p>
<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" viewBox="0 0 {width} {h}" role="img" aria-label="Daily cost, {week} beside {previous}">
<line x1="20" y1="{HEIGHT}" x2="{x2}" y2="{HEIGHT}" stroke="#d1d5db"/>
"##,
        week = escape(week),
        previous = escape(previous),
        h = HEIGHT + 24.0,
        x2 = width - 20.0,
    );
    let bar = |cost: i64| (cost.max(0) as f64 / max as f64 * (HEIGHT - 8.0)).max(0.0);
    for (i, (d, name)) in days.iter().zip(names).enumerate() {
        let x = 20.0 + SLOT * i as f64 + 14.0;
        let (this, prev) = (bar(d.this.cost), bar(d.previous.cost));
        out.push_str(&format!(
            r##"<g class="day" data-day="{day}"><rect class="prev" x="{px:.1}" y="{py:.2}" width="32" height="{prev:.2}" rx="2" fill="#c7d2fe" data-cost-micros="{pc}"><title>{name} of {previous_week}: {pusd}</title></rect><rect class="this" x="{tx:.1}" y="{ty:.2}" width="32" height="{this:.2}" rx="2" fill="#4f6df5" data-cost-micros="{tc}"><title>{day}: {tusd}</title></rect><text x="{lx:.1}" y="{ly}" text-anchor="middle" class="key">{name}</text></g>
"##,
            day = escape(&d.key),
            previous_week = escape(previous),
            px = x,
            py = HEIGHT - prev,
            pc = d.previous.cost,
            pusd = usd(d.previous.cost),
            tx = x + 36.0,
            ty = HEIGHT - this,
            tc = d.this.cost,
            tusd = usd(d.this.cost),
            lx = x + 34.0,
            ly = HEIGHT + 18.0,
        ));
    }
    out.push_str("</svg>\n");
    out.push_str(&format!(
        r#"<div class="scroll"><table class="amounts" id="table-daily">
<thead><tr><th>Day</th><th>{week}</th><th>{previous}</th><th>Change</th><th>Requests</th></tr></thead>
<tbody>
"#,
        week = escape(week),
        previous = escape(previous),
    ));
    for (d, name) in days.iter().zip(names) {
        out.push_str(&format!(
            r#"<tr data-key="{day}" data-cost-micros="{cost}"><td>{name} {day}</td><td class="num">{this}</td><td class="num">{prev}</td><td class="num">{delta} ({pct})</td><td class="num">{requests}</td></tr>
"#,
            day = escape(&d.key),
            cost = d.this.cost,
            this = usd(d.this.cost),
            prev = usd(d.previous.cost),
            delta = usd_change(d.this.cost - d.previous.cost),
            pct = percent(d.this.cost, d.previous.cost),
            requests = d.this.requests,
        ));
    }
    out.push_str("</tbody>\n</table></div>\n</section>\n");
    out
}

/// The most expensive API keys (by name) and sessions this week.
fn top(r: &WeeklyReport, key_names: &HashMap<String, String>) -> String {
    let mut out = String::from(
        r#"<section class="chart" id="top">
<h2>Top keys and sessions this week</h2>
<div class="columns">
"#,
    );
    for (dim, title) in [("key", "API key"), ("session", "Session")] {
        let lines = r.top.get(dim).map(Vec::as_slice).unwrap_or_default();
        out.push_str(&format!(
            r#"<div class="scroll"><table class="amounts" id="table-top-{dim}">
<thead><tr><th>{title}</th><th>This week</th><th>Last week</th><th>Requests</th></tr></thead>
<tbody>
"#
        ));
        if lines.is_empty() {
            out.push_str("<tr><td colspan=\"4\">none this week</td></tr>\n");
        }
        for l in lines {
            let label = if dim == "key" {
                key_names
                    .get(&l.key)
                    .cloned()
                    .unwrap_or_else(|| l.key.clone())
            } else {
                l.key.clone()
            };
            out.push_str(&format!(
                r#"<tr data-key="{key}" data-cost-micros="{cost}"><td title="{key}">{label}</td><td class="num">{this}</td><td class="num">{prev}</td><td class="num">{requests}</td></tr>
"#,
                key = escape(&l.key),
                label = escape(&shorten(&label, 40)),
                cost = l.this.cost,
                this = usd(l.this.cost),
                prev = usd(l.previous.cost),
                requests = l.this.requests,
            ));
        }
        out.push_str("</tbody>\n</table></div>\n");
    }
    out.push_str("</div>\n</section>\n");
    out
}

/// Budget utilisation per tenant: each policy's spend (and reservations) in its current window
/// against its limit, as a bar.
fn budgets(
    budgets: &Result<Vec<(String, Vec<UsageRow>)>, String>,
    now: chrono::DateTime<chrono::Utc>,
) -> String {
    let mut out = String::from(
        r#"<section class="chart" id="budgets">
<h2>Budgets now</h2>
"#,
    );
    let tenants = match budgets {
        Err(e) => {
            out.push_str(&format!(
                "<p class=\"nav\">Budget counters could not be read: {}</p>\n</section>\n",
                escape(e)
            ));
            return out;
        }
        Ok(t) if t.is_empty() => {
            out.push_str(
                "<p class=\"nav\">No budget is set (<code>gatewayctl budgets set</code>).</p>\n</section>\n",
            );
            return out;
        }
        Ok(t) => t,
    };
    out.push_str(
        r#"<div class="scroll"><table class="amounts" id="table-budgets">
<thead><tr><th>Tenant</th><th>Applies to</th><th>Window</th><th>Used</th><th>Limit</th><th></th><th>Resets</th></tr></thead>
<tbody>
"#,
    );
    for (tenant, rows) in tenants {
        for u in rows {
            let p = &u.policy;
            let (kind, value) = p.scope.to_columns();
            let scope = if value.is_empty() {
                kind.to_owned()
            } else {
                format!("{kind} {value}")
            };
            // Money when the policy limits money, else tokens; reservations count as used.
            let (used, limit, text) = match (p.limit.micros, p.limit.tokens) {
                (Some(limit), _) => {
                    let used = u.state.spent_micros + u.state.reserved_micros;
                    (used as f64, limit as f64, (usd(used), usd(limit)))
                }
                (None, Some(limit)) => {
                    let used = u.state.spent_tokens + u.state.reserved_tokens;
                    (
                        used as f64,
                        limit as f64,
                        (format!("{used} tokens"), format!("{limit} tokens")),
                    )
                }
                (None, None) => (0.0, 0.0, ("-".to_owned(), "none".to_owned())),
            };
            let share = if limit > 0.0 { used / limit } else { 0.0 };
            let color = if share >= 1.0 {
                "#dc2626"
            } else if share >= 0.8 {
                "#d97706"
            } else {
                "#16a34a"
            };
            let resets = u.resets_at - now;
            out.push_str(&format!(
                r##"<tr data-tenant="{tenant}" data-used="{share:.4}"><td>{tenant}</td><td>{scope}</td><td>{window}</td><td class="num">{used}</td><td class="num">{limit}</td><td><svg xmlns="http://www.w3.org/2000/svg" width="120" height="14" viewBox="0 0 120 14" role="img" aria-label="{pct:.0}% used"><rect width="120" height="14" rx="3" fill="#e5e7eb"/><rect width="{w:.1}" height="14" rx="3" fill="{color}"/></svg> {pct:.0}%</td><td>in {hours}h</td></tr>
"##,
                tenant = escape(tenant),
                scope = escape(&scope),
                window = p.window.as_str(),
                used = text.0,
                limit = text.1,
                pct = share * 100.0,
                w = share.min(1.0) * 120.0,
                hours = resets.num_hours().max(0),
            ));
        }
    }
    out.push_str("</tbody>\n</table></div>\n</section>\n");
    out
}

/// What the cache saved and what was wasted, by cause, against last week.
fn savings_and_waste(total: &ReportLine) -> String {
    let (a, b) = (&total.this, &total.previous);
    let hit_rate = |x: &report::Aggregate| {
        if x.requests > 0 {
            format!("{:.1}%", x.cache_hits as f64 * 100.0 / x.requests as f64)
        } else {
            "-".to_owned()
        }
    };
    let mut out = format!(
        r#"<section class="chart" id="savings-waste">
<h2>Cache savings and waste</h2>
<div class="headline">
<div class="card" id="cache-hit-rate" data-value="{hits}"><div class="label">Cache hit rate</div><div class="value">{rate}</div><div class="change">{hits} hits; {rate_before} last week</div></div>
"#,
        hits = a.cache_hits,
        rate = hit_rate(a),
        rate_before = hit_rate(b),
    );
    out.push_str(&card_money("cache-saved", "Cache saved", a.saved, b.saved));
    out.push_str(&card_money(
        "waste-loops",
        "Waste: agent loops",
        a.waste_loops,
        b.waste_loops,
    ));
    out.push_str(&card_money(
        "waste-retries",
        "Waste: retry storms",
        a.waste_retries,
        b.waste_retries,
    ));
    out.push_str(&card_money(
        "waste-errors",
        "Waste: failed requests",
        a.waste_errors,
        b.waste_errors,
    ));
    out.push_str(&format!(
        r#"<div class="card" id="fallbacks" data-value="{n}" data-cost-micros="{cost}"><div class="label">Fallbacks to the other tier</div><div class="value">{n}</div><div class="change">{usd}; {before} the week before</div></div>
"#,
        n = a.fallback_requests,
        cost = a.fallback_cost,
        usd = usd(a.fallback_cost),
        before = b.fallback_requests,
    ));
    out.push_str("</div>\n</section>\n");
    out
}

/// The agent loops the guard caught: what they burned before and after being caught, and what
/// refusing their requests avoided, then the most expensive loops.
/// The tier router (`model: "auto"`) by tenant: its share of large calls this week and the one
/// before, and what it saved against sending every routed request to the large tier.
fn routing(lines: &[RoutingChange]) -> String {
    let mut out = String::from(
        r#"<section class="routing" id="routing">
<h2>Tier router (model: auto)</h2>
"#,
    );
    if lines
        .iter()
        .all(|l| l.to_requests == 0 && l.from_requests == 0)
    {
        out.push_str("<p class=\"nav\">No request was routed by the tier router in these weeks.</p>\n</section>\n");
        return out;
    }
    let share = |s: Option<f64>| s.map_or("-".to_owned(), |s| format!("{:.1}%", s * 100.0));
    out.push_str(
        r#"<table class="amounts" id="table-routing">
<thead><tr><th>Tenant</th><th>Routed</th><th>Large share</th><th>Last week</th><th>Saved vs all-large</th><th>Last week</th></tr></thead>
<tbody>
"#,
    );
    for l in lines {
        out.push_str(&format!(
            r#"<tr data-tenant="{key}" data-large-share="{raw}" data-saved-micros="{saved_micros}"><td>{key}</td><td class="num">{routed}</td><td class="num">{this}</td><td class="num">{before}</td><td class="num">{saved}</td><td class="num">{saved_before}</td></tr>
"#,
            key = escape(&l.key),
            raw = l.to_large_share.map_or(String::new(), |s| format!("{s:.4}")),
            saved_micros = l.to_saved_micros,
            routed = l.to_requests,
            this = share(l.to_large_share),
            before = share(l.from_large_share),
            saved = usd(l.to_saved_micros),
            saved_before = usd(l.from_saved_micros),
        ));
    }
    out.push_str("</tbody>\n</table>\n</section>\n");
    out
}

fn loops(l: &WeeklyLoops) -> String {
    let (a, b) = (&l.total, &l.previous);
    let mut out = String::from(
        r#"<section class="loops" id="loops">
<h2>Agent loops the guard caught</h2>
<div class="headline">
"#,
    );
    out.push_str(&format!(
        r#"<div class="card" id="loops-count" data-value="{this}"><div class="label">Loops caught</div><div class="value">{this}</div><div class="change">in {sessions} sessions; {previous} the week before</div></div>
"#,
        this = a.loops,
        sessions = a.sessions,
        previous = b.loops,
    ));
    out.push_str(&card_money(
        "loops-before",
        "Burned before caught",
        a.burned_before_micros,
        b.burned_before_micros,
    ));
    out.push_str(&card_money(
        "loops-after",
        "Burned after (flagged, answered)",
        a.burned_after_micros,
        b.burned_after_micros,
    ));
    out.push_str(&card_money(
        "loops-avoided",
        "Avoided by throttle/block",
        a.avoided_micros,
        b.avoided_micros,
    ));
    out.push_str("</div>\n");
    if l.top.is_empty() {
        out.push_str("<p class=\"nav\">No agent loop caught this week.</p>\n</section>\n");
        return out;
    }
    out.push_str(
        r#"<table class="amounts" id="table-loops">
<thead><tr><th>Tenant</th><th>Session</th><th>Caught at (UTC)</th><th>Repeats</th><th>Before caught</th><th>After</th><th>Refused</th><th>Avoided</th></tr></thead>
<tbody>
"#,
    );
    for d in &l.top {
        out.push_str(&format!(
            r#"<tr data-session="{session}" data-cost-micros="{burned}" data-avoided-micros="{avoided_micros}"><td>{tenant}</td><td title="{session}">{short}</td><td>{at}</td><td class="num">{repeats}</td><td class="num">{before} ({before_n})</td><td class="num">{after} ({after_n})</td><td class="num">{refused}</td><td class="num">{avoided}</td></tr>
"#,
            session = escape(&d.session),
            short = escape(&shorten(&d.session, 30)),
            tenant = escape(&d.tenant),
            burned = d.burned(),
            avoided_micros = d.avoided_micros,
            at = d.detected_at.format("%a %H:%M:%S"),
            repeats = d.repeats,
            before = usd(d.burned_before_micros),
            before_n = d.requests_before,
            after = usd(d.burned_after_micros),
            after_n = d.flagged_requests,
            refused = d.refused,
            avoided = usd(d.avoided_micros),
        ));
    }
    out.push_str("</tbody>\n</table>\n</section>\n");
    out
}

/// The week-over-week explanation: terms adding up to the change, and the largest contributors.
fn explanation(e: &Explanation) -> String {
    let mut out = format!(
        r#"<section class="explain" id="explanation">
<h2>Why the cost changed: {from} → {to}</h2>
<p>{from_cost} → {to_cost} (<span id="explain-change" data-cost-micros="{change}">{change_usd}</span>). The terms below add up exactly to the change.</p>
<table class="amounts" id="table-terms">
<thead><tr><th>Term</th><th>Contribution</th></tr></thead>
<tbody>
"#,
        from = escape(&e.from_week),
        to = escape(&e.to_week),
        from_cost = usd(e.from_micros),
        to_cost = usd(e.to_micros),
        change = e.to_micros - e.from_micros,
        change_usd = usd_change(e.to_micros - e.from_micros),
    );
    for t in &e.terms {
        out.push_str(&format!(
            r#"<tr data-term="{term}" data-cost-micros="{micros}"><td>{term}</td><td class="num">{amount}</td></tr>
"#,
            term = escape(&t.term),
            micros = t.micros,
            amount = usd_change(t.micros),
        ));
    }
    out.push_str("</tbody>\n</table>\n");
    if let Some(top) = e.top.get("tenant").filter(|c| !c.is_empty()) {
        out.push_str(
            r#"<h3>Largest changes by tenant</h3>
<table class="amounts" id="table-top-tenants">
<thead><tr><th>Tenant</th><th>Before</th><th>After</th><th>Change</th></tr></thead>
<tbody>
"#,
        );
        for c in top {
            out.push_str(&format!(
                r#"<tr><td>{key}</td><td class="num">{from}</td><td class="num">{to}</td><td class="num">{delta}</td></tr>
"#,
                key = escape(&c.key),
                from = usd(c.from_micros),
                to = usd(c.to_micros),
                delta = usd_change(c.to_micros - c.from_micros),
            ));
        }
        out.push_str("</tbody>\n</table>\n");
    }
    out.push_str("</section>\n");
    out
}

/// At most `max` characters, with an ellipsis when cut (the full key is in the `<title>`).
fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

const STYLE: &str = "
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;padding:24px 32px;\
background:#f6f7fb;color:#111827}
h1{font-size:24px;margin:0 0 4px}h1 .week{color:#4f6df5}h2{font-size:18px;margin:0 0 12px}
h3{font-size:15px;margin:16px 0 8px}.nav{color:#6b7280;margin:0 0 20px}.nav a{color:#4f6df5}
.headline{display:flex;flex-wrap:wrap;gap:12px;margin-bottom:20px}
.card{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:12px 16px;min-width:180px}
.card .label{color:#6b7280;font-size:13px}.card .value{font-size:22px;font-weight:600;\
font-variant-numeric:tabular-nums}.card .change{color:#6b7280;font-size:12px}
section.chart,section.explain,section.routing,section.loops{background:#fff;\
border:1px solid #e5e7eb;border-radius:8px;padding:16px;margin-bottom:20px}
p.demo{background:#fef3c7;border:1px solid #f59e0b;border-radius:8px;padding:10px 14px;margin:0 0 20px}
.legend{color:#374151;font-size:13px;margin:0 0 8px}.swatch{display:inline-block;width:12px;\
height:12px;border-radius:2px;margin:0 4px 0 12px;vertical-align:-1px}.swatch.this{background:#4f6df5}\
.swatch.prev{background:#c7d2fe}
.columns{display:flex;flex-wrap:wrap;gap:24px}.scroll{overflow-x:auto;max-width:100%}
@media (max-width:640px){body{padding:12px}.card{min-width:0;flex:1 1 40%}\
table.amounts th,table.amounts td{padding:4px 6px}h1{font-size:20px}}
svg{display:block;max-width:100%;height:auto;font-size:13px}svg .key{fill:#374151}\
svg .amount{fill:#111827;font-variant-numeric:tabular-nums}
table.amounts{border-collapse:collapse;margin-top:12px;font-size:13px}
table.amounts th,table.amounts td{border-bottom:1px solid #e5e7eb;padding:4px 12px;text-align:left}
table.amounts td.num{text-align:right;font-variant-numeric:tabular-nums;font-family:ui-monospace,monospace}
footer{color:#6b7280;font-size:12px}
";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn money_is_exact_with_six_decimals() {
        assert_eq!(usd(0), "$0.000000");
        assert_eq!(usd(1_234_567_890), "$1234.567890");
        assert_eq!(usd(-100), "-$0.000100");
        assert_eq!(usd_change(100_000), "+$0.100000");
        assert_eq!(percent(150, 100), "+50.0%");
        assert_eq!(percent(5, 0), "new");
    }

    #[test]
    fn interpolated_text_is_escaped() {
        assert_eq!(
            escape(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(url_encode("a b&c"), "a%20b%26c");
    }
}
