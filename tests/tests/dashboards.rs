//! The Grafana dashboards in `dashboards/grafana/`.
//!
//! - Prometheus dashboards against the metrics the gateway exports
//!   (`gateway::metrics::names::ALL`): every exported metric must be on a dashboard. Whether
//!   each query parses and has data is checked by a real Prometheus (`promql.rs`).
//! - Postgres dashboards against the ledger schema: every SQL query (panel `rawSql` and
//!   template-variable query), with its Grafana macros and variables expanded the way Grafana
//!   expands them, runs on a freshly migrated Postgres holding known ledger rows, and the weekly
//!   cost dashboard's numbers match the weekly report's (`gateway::ledger::report`).
//! - Every dashboard is well-formed Grafana JSON that takes its datasource from the
//!   `${datasource}` variable; what a "query" is depends on the dashboard's kind, which its
//!   `datasource` variable says (`prometheus`: `expr`, `grafana-postgresql-datasource`: `rawSql`).
//!
//! Only the SQL test needs a database (Postgres at `TEST_POSTGRES_URL`, as elsewhere in `e2e`);
//! no gateway, Prometheus or Grafana.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use chrono::{DateTime, Duration, Utc};
use e2e::grafana::*;
use e2e::{StoreKind, TestStore};
use gateway::ledger::loops;
use gateway::ledger::report::{Aggregate, Dimension, IsoWeek};
use gateway::ledger::LedgerStore;
use gateway::usage::{CacheStatus, UsageEvent, UsageSource};
use serde_json::{Map, Value};

#[test]
fn the_metric_finder_matches_whole_names_and_histogram_series() {
    let q = "histogram_quantile(0.95, sum by (le) (rate(gateway_x_seconds_bucket[5m]))) \
             / gateway_y_total_more + gateway_z";
    assert!(query_uses(q, "gateway_x_seconds"));
    assert!(query_uses(q, "gateway_z"));
    assert!(
        !query_uses(q, "gateway_y_total"),
        "a prefix of a longer name"
    );
    assert!(!query_uses(q, "gateway_x"), "a prefix of a longer name");
}

#[test]
fn every_exported_metric_is_on_a_dashboard() {
    let missing = metrics_on_no_dashboard();
    assert!(
        missing.is_empty(),
        "exported metrics no dashboard in dashboards/grafana/ queries: {missing:?}"
    );
}

/// A datasource reference (`"${datasource}"` or `{ "type": ..., "uid": "${datasource}" }`) that
/// points at the datasource variable; a `type`, when given, must be `kind`'s plugin.
fn is_datasource_var(ds: &Value, kind: Kind) -> bool {
    match ds {
        Value::String(s) => s == DATASOURCE_VAR,
        Value::Object(map) => {
            ds["uid"] == DATASOURCE_VAR && map.get("type").is_none_or(|t| t == kind.plugin())
        }
        _ => false,
    }
}

/// Checks every dashboard must pass, whatever it queries: uid, title and schema version set;
/// query variables and panels take their datasource from `${datasource}`; panel ids unique;
/// every panel typed and placed; every target has a non-empty query of the dashboard's kind.
/// Returns the dashboard's kind.
fn assert_well_formed(path: &Path, dashboard: &Value) -> Kind {
    let file = file_name(path);
    let kind = kind(path, dashboard);
    let field = kind.query_field();

    assert!(
        dashboard["uid"]
            .as_str()
            .is_some_and(|u| !u.trim().is_empty()),
        "{file}: no uid"
    );
    assert!(
        dashboard["title"]
            .as_str()
            .is_some_and(|t| !t.trim().is_empty()),
        "{file}: no title"
    );
    assert_eq!(dashboard["schemaVersion"], 39, "{file}: schemaVersion");

    for var in query_variables(dashboard) {
        let name = &var["name"];
        assert!(
            is_datasource_var(&var["datasource"], kind),
            "{file}: variable {name} does not use {DATASOURCE_VAR} ({})",
            kind.plugin()
        );
        assert!(
            variable_query(var).is_some_and(|q| !q.trim().is_empty()),
            "{file}: variable {name} has no query"
        );
    }

    let all = panels(dashboard);
    assert!(!all.is_empty(), "{file}: no panels");
    let mut ids = BTreeSet::new();
    let mut targets_seen = 0;
    for panel in &all {
        let title = panel["title"].as_str().unwrap_or("<untitled>");
        let id = panel["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("{file}: panel {title:?} has no numeric id"));
        assert!(
            ids.insert(id),
            "{file}: panel id {id} ({title:?}) is not unique"
        );
        assert!(
            panel["type"].as_str().is_some_and(|t| !t.is_empty()),
            "{file}: panel {title:?} has no type"
        );
        assert!(
            panel.get("gridPos").is_some(),
            "{file}: panel {title:?} has no gridPos"
        );

        let targets = targets(panel);
        match panel.get("datasource") {
            Some(ds) => assert!(
                is_datasource_var(ds, kind),
                "{file}: panel {title:?} datasource is {ds}, not {DATASOURCE_VAR} ({})",
                kind.plugin()
            ),
            None => assert!(
                targets.is_empty(),
                "{file}: panel {title:?} has queries but no datasource"
            ),
        }
        for target in targets {
            targets_seen += 1;
            let query = target[field].as_str().unwrap_or_default();
            assert!(
                !query.trim().is_empty(),
                "{file}: panel {title:?} has a target without an {field}: {target}"
            );
            if let Some(ds) = target.get("datasource") {
                assert!(
                    is_datasource_var(ds, kind),
                    "{file}: panel {title:?} target datasource is {ds}, not {DATASOURCE_VAR}"
                );
            }
        }
    }
    assert!(targets_seen > 0, "{file}: no panel has a query");
    kind
}

#[test]
fn every_dashboard_is_valid_grafana_json() {
    let mut uids = BTreeSet::new();
    for (path, dashboard) in dashboards() {
        assert_well_formed(&path, &dashboard);
        assert!(
            uids.insert(dashboard["uid"].to_string()),
            "{}: uid {} is used by another dashboard",
            path.display(),
            dashboard["uid"]
        );
    }
}

/// Where the datasource provisioning files live.
const DATASOURCE_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../dashboards/provisioning/datasources"
);

#[test]
fn every_dashboard_kind_has_a_provisioned_datasource() {
    let mut provisioned = String::new();
    for entry in
        fs::read_dir(DATASOURCE_DIR).unwrap_or_else(|e| panic!("reading {DATASOURCE_DIR}: {e}"))
    {
        let path = entry.expect("directory entry").path();
        if path
            .extension()
            .is_some_and(|ext| ext == "yaml" || ext == "yml")
        {
            provisioned.push_str(&fs::read_to_string(&path).unwrap());
        }
    }
    for (path, dashboard) in dashboards() {
        let plugin = kind(&path, &dashboard).plugin();
        assert!(
            provisioned
                .lines()
                .any(|line| line.trim() == format!("type: {plugin}")),
            "{}: no file in {DATASOURCE_DIR} provisions a {plugin} datasource",
            path.display()
        );
    }
}

#[test]
fn operations_dashboard_is_valid_grafana_json() {
    let path = Path::new(DASHBOARD_DIR).join(OPERATIONS);
    let dashboard = parse(&path);
    assert_eq!(assert_well_formed(&path, &dashboard), Kind::Prometheus);
    assert_eq!(dashboard["uid"], "llm-gateway-ops");

    // Template variables: a Prometheus datasource picker, and tier/replica from label values.
    let vars = template_variables(&dashboard);
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no template variable {name:?}"))
    };
    let ds = var("datasource");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    for name in ["tier", "replica"] {
        assert_eq!(var(name)["type"], "query", "variable {name}");
    }
    let var_queries = queries(&json_with_only_templating(&dashboard), Kind::Prometheus);
    assert_eq!(var_queries.len(), 2, "{var_queries:?}");
    assert!(
        var_queries.iter().all(|q| q.contains("label_values(")),
        "tier/replica should come from label_values: {var_queries:?}"
    );

    // Ledger health sits in its own row (queue, spool, outcomes, write latency).
    assert!(
        panels(&dashboard)
            .iter()
            .any(|p| p["type"] == "row" && p["title"] == "Ledger"),
        "the ledger has its own row"
    );
}

/// The dashboard's templating section alone, so [`queries`] returns only variable queries.
fn json_with_only_templating(dashboard: &Value) -> Value {
    serde_json::json!({ "templating": dashboard["templating"].clone() })
}

/// Titles of the weekly cost dashboard's stat panels, in order.
const COST_STATS: [&str; 5] = [
    "Cost this period",
    "Requests",
    "Cost per 1k requests",
    "Cache savings",
    "Waste",
];

#[test]
fn weekly_cost_dashboard_is_valid_grafana_json() {
    let path = Path::new(DASHBOARD_DIR).join(WEEKLY_COST);
    let dashboard = parse(&path);
    assert_eq!(assert_well_formed(&path, &dashboard), Kind::Postgres);
    assert_eq!(dashboard["uid"], "llm-gateway-cost");
    assert_eq!(dashboard["title"], "LLM gateway — weekly cost");
    // The current week so far, in the ledger's weeks: UTC, starting on Monday (ISO weeks).
    assert_eq!(dashboard["time"]["from"], "now/w");
    assert_eq!(dashboard["time"]["to"], "now");
    assert_eq!(dashboard["timezone"], "utc");
    assert_eq!(dashboard["weekStart"], "monday");

    let tenant = query_variables(&dashboard)
        .find(|v| v["name"] == "tenant")
        .expect("a `tenant` query variable");
    assert_eq!(
        variable_query(tenant),
        Some("SELECT DISTINCT tenant_name FROM ledger ORDER BY 1")
    );
    assert_eq!(tenant["multi"], true);
    assert_eq!(tenant["includeAll"], true);
    assert!(
        tenant["allValue"].as_str().is_some_and(|a| !a.is_empty()),
        "All needs an allValue the queries recognise (an empty ledger would make `IN ()`)"
    );

    let all = panels(&dashboard);
    let mut money_panels = 0;
    for panel in &all {
        let title = panel["title"].as_str().unwrap_or("<untitled>");
        for target in targets(panel) {
            let sql = target["rawSql"].as_str().unwrap_or_default();
            assert!(
                sql.contains("$tenant") || sql.contains("${tenant"),
                "panel {title:?} ignores the tenant variable:\n{sql}"
            );
            let format = target["format"].as_str().unwrap_or_default();
            assert!(
                ["table", "time_series"].contains(&format),
                "panel {title:?} target format {format:?}"
            );
            if format == "time_series" {
                assert!(
                    sql.contains("$__timeGroupAlias("),
                    "panel {title:?}: a time series needs a time column:\n{sql}"
                );
            }
        }
        if serde_json::to_string(&panel["fieldConfig"])
            .unwrap()
            .contains("\"currencyUSD\"")
        {
            money_panels += 1;
        }
    }
    assert!(
        money_panels >= 10,
        "money is shown in dollars (currencyUSD)"
    );

    let by_title = |title: &str| {
        all.iter()
            .find(|p| p["title"] == title)
            .unwrap_or_else(|| panic!("no panel titled {title:?}"))
    };
    for title in COST_STATS {
        assert_eq!(by_title(title)["type"], "stat", "{title}");
    }
    assert_eq!(
        by_title("Cost this period")["fieldConfig"]["defaults"]["unit"],
        "currencyUSD"
    );
    let budgets = by_title("Budget utilisation per tenant");
    assert_eq!(budgets["type"], "table");
    assert!(targets(budgets).iter().all(|t| t["rawSql"]
        .as_str()
        .is_some_and(|q| q.contains("FROM budgets"))));
}

/// The budget panel shows the spend of each policy's current window (by the wall clock, so the
/// expected value is computed from the seeded rows the same way).
fn check_budget_utilisation(events: &[UsageEvent], rows: &[Row]) {
    use gateway::budget::Window;
    let now = Utc::now();
    let spent = |window: Window, feature: Option<&str>| -> (u64, i64) {
        let start = window.start(now);
        events
            .iter()
            .filter(|e| e.tenant_id == "ten_alpha" && e.started_at >= start)
            .filter(|e| {
                feature.is_none_or(|f| e.tags.get("feature").map(String::as_str) == Some(f))
            })
            .fold((0, 0), |(t, c), e| {
                let hit = matches!(
                    e.cache_status,
                    gateway::usage::CacheStatus::HitExact
                        | gateway::usage::CacheStatus::HitSemantic
                );
                let tokens = if hit {
                    0
                } else {
                    e.prompt_tokens + e.completion_tokens
                };
                (t + tokens, c + e.cost_micros)
            })
    };
    let find = |window: &str| {
        rows.iter()
            .find(|r| r["window"] == window && r["tenant"] == "alpha")
            .unwrap_or_else(|| panic!("no {window} budget row in {rows:?}"))
    };
    let month = find("month");
    let (tokens, cost) = spent(Window::Month, None);
    assert_eq!(
        month["tokens spent"].as_f64(),
        Some(tokens as f64),
        "{month:?}"
    );
    assert!((month["USD spent"].as_f64().unwrap_or(-1.0) - cost as f64 / 1e6).abs() < 1e-9);
    assert_eq!(month["scope"], "tenant");
    let day = find("day");
    let (_, cost) = spent(Window::Day, Some("alpha-chat"));
    assert!((day["USD spent"].as_f64().unwrap_or(-1.0) - cost as f64 / 1e6).abs() < 1e-9);
    assert_eq!(day["scope"], "tag:feature=alpha-chat");
}

// ---- SQL dashboards on a real Postgres ----

#[test]
fn the_expander_writes_what_grafana_would() {
    let range = TimeRange {
        from: IsoWeek {
            year: 2026,
            week: 48,
        }
        .start(),
        to: IsoWeek {
            year: 2026,
            week: 48,
        }
        .end(),
    };
    let variables = vec![serde_json::json!({
        "type": "query", "name": "tenant", "multi": true, "includeAll": true,
        "allValue": "'__all__'"
    })];
    let mut x = Expansion {
        range,
        variables: &variables,
        selected: BTreeMap::new(),
        options: BTreeMap::new(),
    };
    assert_eq!(
        x.expand("SELECT $__timeGroupAlias(t, '1d', 0) WHERE $__timeFilter(t) AND x IN ($tenant)"),
        "SELECT floor(extract(epoch from t)/86400)*86400 AS \"time\" WHERE t BETWEEN \
         '2026-11-23T00:00:00.000Z' AND '2026-11-30T00:00:00.000Z' AND x IN ('__all__')"
    );
    x.selected.insert(
        "tenant".into(),
        Selected::Values(vec!["a".into(), "o'b".into()]),
    );
    assert_eq!(
        x.expand("${tenant} ${tenant:sqlstring} $__timeFrom() $__timeTo()"),
        "'a','o''b' 'a','o''b' '2026-11-23T00:00:00.000Z' '2026-11-30T00:00:00.000Z'"
    );
}

/// A result row, column name → value (numbers as JSON numbers).
type Row = Map<String, Value>;

/// Run `sql` as Grafana would (it must not fail) and return its rows as JSON objects.
async fn run(pool: &sqlx::PgPool, sql: &str, what: &str) -> Vec<Row> {
    if let Err(e) = sqlx::query(sql).fetch_all(pool).await {
        panic!("{what} fails on a migrated Postgres: {e}\n{sql}");
    }
    // Again, as JSON: NUMERIC (money divided by 1e6) has no sqlx decoder without extra features.
    let wrapped = format!(
        "SELECT to_jsonb(q)::text FROM (\n{}\n) AS q",
        sql.trim().trim_end_matches(';')
    );
    let rows: Vec<(String,)> = sqlx::query_as(&wrapped)
        .fetch_all(pool)
        .await
        .unwrap_or_else(|e| panic!("{what} as JSON: {e}\n{wrapped}"));
    rows.into_iter()
        .map(|(json,)| match serde_json::from_str(&json).unwrap() {
            Value::Object(row) => row,
            other => panic!("{what}: row {other} is not an object"),
        })
        .collect()
}

/// A query variable's option from one row of its query: `__value`, or the only column.
fn option_value(row: &Row) -> String {
    let value = row.get("__value").or_else(|| match row.len() {
        1 => row.values().next(),
        _ => None,
    });
    match value {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => panic!("variable query row {row:?}: use one column or __text/__value"),
    }
}

/// The week the SQL test looks at; the week before is the week-over-week comparison.
const THIS_WEEK: IsoWeek = IsoWeek {
    year: 2026,
    week: 48,
};

/// One billed small-tier chat request of `tenant`, tagged `feature=<tenant>-chat`.
fn event(n: usize, tenant: &str, at: DateTime<Utc>, cost_micros: i64) -> UsageEvent {
    let billed = e2e::Billed {
        tenant,
        model: "m-small",
        at,
        prompt: 1_000,
        completion: 100,
        in_price: 0,
        out_price: 0,
    };
    let mut e = e2e::ledger_event(format!("req-{n}"), billed);
    e.tags
        .insert("feature".to_owned(), format!("{tenant}-chat"));
    e.cost_micros = cost_micros;
    e.output_cost_micros = cost_micros / 4;
    e.fingerprint = format!("fp{n}");
    e
}

/// Ledger rows of every kind in [`THIS_WEEK`] and the week before (different amounts), plus
/// rows outside both weeks that no panel may count:
/// - alpha: small-tier chat every day, one large-tier search request; no waste;
/// - beta: large tier; an agent loop, a retry storm, a row flagged as both (a loop), a failed
///   request (502), one the upstream refused but billed (400), a client that hung up (499) and
///   a rejected one (429, nothing served);
/// - o'brien (a quote, for the variable's quoting): untagged, cache hits, a client that hung up.
fn ledger_rows() -> Vec<UsageEvent> {
    let mut rows: Vec<UsageEvent> = Vec::new();
    let mut push = |tenant: &str, at: DateTime<Utc>, cost: i64, edit: &dyn Fn(&mut UsageEvent)| {
        let mut e = event(rows.len(), tenant, at, cost);
        edit(&mut e);
        rows.push(e);
    };
    let large = |e: &mut UsageEvent| {
        e.requested_model = "m-large".into();
        e.served_model = Some("m-large".into());
        e.tier = Some("large".into());
    };
    for (scale, week) in [(1, THIS_WEEK.previous()), (2, THIS_WEEK)] {
        let at = |day: i64, hour: i64| week.start() + Duration::days(day) + Duration::hours(hour);
        for day in 0..7 {
            // Routed (`auto`) to small: the large tier would have cost five times as much.
            push("alpha", at(day, 9), 1_000 * scale + 10 * day, &|e| {
                e.requested_model = "auto".into();
                e.route_reason = Some("classifier".into());
                e.all_large_micros = Some(5 * e.cost_micros);
            });
        }
        push("alpha", at(2, 14), 40_000 * scale, &|e| {
            large(e);
            e.tags.insert("feature".into(), "alpha-search".into());
        });

        for day in 0..3 {
            push("beta", at(day, 11), 25_000 * scale, &large);
        }
        push("beta", at(3, 1), 7_000 * scale, &|e| {
            large(e);
            e.loop_flag = true;
        });
        push("beta", at(3, 2), 5_000 * scale, &|e| {
            large(e);
            e.retry_storm_flag = true;
            e.retries = 3;
        });
        push("beta", at(3, 3), 3_000 * scale, &|e| {
            large(e);
            e.loop_flag = true;
            e.retry_storm_flag = true;
        });
        push("beta", at(4, 4), 2_000 * scale, &|e| {
            large(e);
            e.status = 502;
            e.error_kind = Some("upstream".into());
        });
        push("beta", at(4, 5), 1_500 * scale, &|e| {
            large(e);
            e.status = 499;
            e.stream = true;
            e.client_disconnected = true;
            e.usage_source = UsageSource::Tokenizer;
        });
        push("beta", at(4, 6), 300 * scale, &|e| {
            large(e);
            e.status = 400;
            e.error_kind = Some("upstream_rejected".into());
        });
        push("beta", at(5, 6), 0, &|e| {
            e.status = 429;
            e.error_kind = Some("rate_limited".into());
            e.served_model = None;
            e.tier = None;
            e.replica = None;
            e.prompt_tokens = 0;
            e.completion_tokens = 0;
            e.usage_source = UsageSource::None;
        });

        // beta's agent: progress, two earlier steps, caught on the third (flagged, answered),
        // then refused twice; a second loop of the same session after two steps of progress,
        // caught on its second step and refused.
        let step = |e: &mut UsageEvent, session: &str| {
            large(e);
            e.tags.insert("session".into(), session.into());
        };
        let minute = |m: i64| at(2, 20) + Duration::minutes(m);
        push("beta", minute(0), 900 * scale, &|e| step(e, "run-42"));
        push("beta", minute(1), 1_100 * scale, &|e| step(e, "run-42"));
        push("beta", minute(2), 1_200 * scale, &|e| step(e, "run-42"));
        push("beta", minute(3), 1_300 * scale, &|e| {
            step(e, "run-42");
            e.loop_flag = true;
            e.loop_steps = 3;
        });
        let refused = |e: &mut UsageEvent, session: &str, steps: u32, avoided: i64| {
            step(e, session);
            e.loop_flag = true;
            e.loop_steps = steps;
            e.status = 429;
            e.error_kind = Some("loop_detected".into());
            e.prompt_tokens = 0;
            e.completion_tokens = 0;
            e.avoided_micros = avoided;
        };
        push("beta", minute(4), 0, &|e| {
            refused(e, "run-42", 4, 1_300 * scale)
        });
        push("beta", minute(5), 0, &|e| {
            refused(e, "run-42", 4, 1_300 * scale)
        });
        push("beta", minute(30), 700 * scale, &|e| step(e, "run-42"));
        push("beta", minute(31), 800 * scale, &|e| step(e, "run-42"));
        push("beta", minute(32), 0, &|e| {
            refused(e, "run-42", 2, 800 * scale)
        });
        // o'brien's agent is caught on its first request.
        push("o'brien", at(5, 7), 0, &|e| {
            refused(e, "o'run", 3, 0);
            e.tags.remove("feature");
        });

        push("o'brien", at(1, 8), 12_000 * scale, &|e| e.tags.clear());
        push("o'brien", at(1, 9), 0, &|e| {
            e.tags.clear();
            e.cache_status = CacheStatus::HitExact;
            e.saved_micros = 30_000 * scale;
        });
        push("o'brien", at(6, 20), 0, &|e| {
            e.tags.clear();
            e.cache_status = CacheStatus::HitSemantic;
            e.saved_micros = 20_000 * scale;
        });
        push("o'brien", at(6, 21), 800 * scale, &|e| {
            e.tags.clear();
            e.status = 499;
            e.stream = true;
            e.client_disconnected = true;
        });
    }
    // On the edges of this week: its first instant (not in the week before) and the last
    // millisecond Grafana's "This week" includes.
    push("alpha", THIS_WEEK.start(), 123, &|_| {});
    push(
        "beta",
        THIS_WEEK.end() - Duration::milliseconds(1),
        456,
        &|_| {},
    );
    // Outside both weeks.
    let before = THIS_WEEK.previous().previous().start() + Duration::hours(12);
    push("alpha", before, 999_999, &|_| {});
    push(
        "beta",
        THIS_WEEK.end() + Duration::hours(1),
        888_888,
        &|_| {},
    );
    rows
}

/// The weekly report's sums for `week` per value of `dim`, over `tenants` (all when `None`).
/// Only the fields the dashboard shows are summed across tenants.
async fn report_by(
    ledger: &dyn LedgerStore,
    week: IsoWeek,
    dim: Dimension,
    tenants: Option<&[String]>,
) -> BTreeMap<String, Aggregate> {
    let group = if dim == Dimension::Tenant {
        vec![Dimension::Tenant]
    } else {
        vec![Dimension::Tenant, dim]
    };
    let mut out: BTreeMap<String, Aggregate> = BTreeMap::new();
    for (key, a) in ledger
        .aggregate(week.start(), week.end(), None, &group)
        .await
        .unwrap()
    {
        let (tenant, value) = if dim == Dimension::Tenant {
            (key.as_str(), key.as_str())
        } else {
            key.split_once('|').unwrap()
        };
        if tenants.is_some_and(|t| !t.iter().any(|s| s == tenant)) {
            continue;
        }
        let sum = out.entry(value.to_owned()).or_default();
        sum.requests += a.requests;
        sum.cost += a.cost;
        sum.saved += a.saved;
        sum.waste_loops += a.waste_loops;
        sum.waste_retries += a.waste_retries;
        sum.waste_errors += a.waste_errors;
        sum.useful_requests += a.useful_requests;
        sum.routed_requests += a.routed_requests;
        sum.routed_large += a.routed_large;
        sum.routed_cost += a.routed_cost;
        sum.routed_all_large += a.routed_all_large;
    }
    out
}

fn costs(report: &BTreeMap<String, Aggregate>) -> BTreeMap<String, i64> {
    report.iter().map(|(k, a)| (k.clone(), a.cost)).collect()
}

fn column<'a>(row: &'a Row, name: &str) -> &'a Value {
    row.get(name)
        .unwrap_or_else(|| panic!("no column {name:?} in {row:?}"))
}

/// A money column (dollars on the dashboard) in micro-dollars.
fn micros(row: &Row, name: &str) -> i64 {
    let v = column(row, name);
    let dollars = v
        .as_f64()
        .unwrap_or_else(|| panic!("{name} = {v} is not a number"));
    (dollars * 1e6).round() as i64
}

fn count(row: &Row, name: &str) -> i64 {
    let v = column(row, name);
    v.as_i64()
        .unwrap_or_else(|| panic!("{name} = {v} is not an integer"))
}

fn text(row: &Row, name: &str) -> String {
    let v = column(row, name);
    v.as_str()
        .unwrap_or_else(|| panic!("{name} = {v} is not text"))
        .to_owned()
}

/// `key` column → sum of the `money` column, in micro-dollars (rows of one key, e.g. a time
/// series' days, add up).
fn money_by(rows: &[Row], key: &str, money: &str) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    for row in rows {
        *out.entry(text(row, key)).or_default() += micros(row, money);
    }
    out
}

/// The weekly cost dashboard's numbers (panel title → rows) against the ledger rows and the
/// weekly report, for the time range [`THIS_WEEK`] and the selected tenants (`None`: All).
async fn check_weekly_cost(
    ledger: &dyn LedgerStore,
    events: &[UsageEvent],
    range: TimeRange,
    tenants: Option<&[String]>,
    panel: &BTreeMap<String, Vec<Row>>,
) {
    let rows = |title: &str| {
        panel
            .get(title)
            .unwrap_or_else(|| panic!("{WEEKLY_COST} has no panel titled {title:?}"))
    };
    let stat = |title: &str| {
        let r = rows(title);
        assert_eq!(r.len(), 1, "stat {title:?} returns one row: {r:?}");
        r[0].clone()
    };
    let ctx = tenants.map_or("All".to_owned(), |t| t.join(", "));

    // The total, straight from the rows inserted.
    let expected_cost: i64 = events
        .iter()
        .filter(|e| e.started_at >= range.from && e.started_at <= range.to)
        .filter(|e| tenants.is_none_or(|t| t.contains(&e.tenant_name)))
        .map(|e| e.cost_micros)
        .sum();
    assert!(expected_cost > 0);
    assert_eq!(
        micros(&stat("Cost this period"), "cost"),
        expected_cost,
        "total cost ({ctx})"
    );

    // Everything else as the weekly report defines it.
    let by_tenant = report_by(ledger, THIS_WEEK, Dimension::Tenant, tenants).await;
    let mut total = Aggregate::default();
    for a in by_tenant.values() {
        total.requests += a.requests;
        total.cost += a.cost;
        total.saved += a.saved;
        total.waste_loops += a.waste_loops;
        total.waste_retries += a.waste_retries;
        total.waste_errors += a.waste_errors;
    }
    assert_eq!(total.cost, expected_cost, "the report's total ({ctx})");
    assert!(
        total.saved > 0 && total.waste() > 0,
        "the data has savings and waste"
    );
    assert_eq!(
        count(&stat("Requests"), "requests"),
        total.requests,
        "{ctx}"
    );
    let per_1k = column(&stat("Cost per 1k requests"), "cost per 1k requests")
        .as_f64()
        .unwrap();
    let want_per_1k = total.cost as f64 / 1e6 * 1000.0 / total.requests as f64;
    assert!(
        (per_1k - want_per_1k).abs() < 1e-9,
        "cost per 1k requests {per_1k} != {want_per_1k} ({ctx})"
    );
    assert_eq!(
        micros(&stat("Cache savings"), "cache savings"),
        total.saved,
        "{ctx}"
    );
    assert_eq!(micros(&stat("Waste"), "waste"), total.waste(), "{ctx}");

    let got: BTreeMap<String, [i64; 4]> = rows("Cost by tenant")
        .iter()
        .map(|r| {
            let tenant = text(r, "tenant");
            let values = [
                count(r, "requests"),
                micros(r, "cost"),
                micros(r, "cache savings"),
                micros(r, "waste"),
            ];
            (tenant, values)
        })
        .collect();
    let want: BTreeMap<String, [i64; 4]> = by_tenant
        .iter()
        .map(|(t, a)| (t.clone(), [a.requests, a.cost, a.saved, a.waste()]))
        .collect();
    assert_eq!(
        got, want,
        "cost by tenant: [requests, cost, savings, waste] ({ctx})"
    );

    for (title, key, dim) in [
        ("Cost by served model", "model", Dimension::Model),
        ("Cost by feature", "feature", Dimension::Feature),
        ("Daily cost by tier", "metric", Dimension::Tier),
        ("Daily cost by tenant (top 10)", "metric", Dimension::Tenant),
    ] {
        let want = costs(&report_by(ledger, THIS_WEEK, dim, tenants).await);
        assert_eq!(money_by(rows(title), key, "cost"), want, "{title} ({ctx})");
    }
    for title in ["Daily cost by tier", "Daily cost by tenant (top 10)"] {
        for row in rows(title) {
            let t = column(row, "time").as_f64().unwrap();
            assert!(
                t % 86_400.0 == 0.0
                    && t >= range.from.timestamp() as f64
                    && t <= range.to.timestamp() as f64,
                "{title}: {t} is not a UTC day in the range"
            );
        }
    }

    let got: BTreeMap<String, [i64; 4]> = rows("Waste by tenant")
        .iter()
        .map(|r| {
            let values = [
                micros(r, "agent loops"),
                micros(r, "retry storms"),
                micros(r, "failed requests"),
                count(r, "wasted requests"),
            ];
            assert_eq!(values[..3].iter().sum::<i64>(), micros(r, "waste"));
            (text(r, "tenant"), values)
        })
        .collect();
    let want: BTreeMap<String, [i64; 4]> = by_tenant
        .iter()
        .filter(|(_, a)| a.requests > a.useful_requests)
        .map(|(t, a)| {
            let values = [
                a.waste_loops,
                a.waste_retries,
                a.waste_errors,
                a.requests - a.useful_requests,
            ];
            (t.clone(), values)
        })
        .collect();
    assert_eq!(
        got, want,
        "waste by tenant: [loops, retry storms, failed, wasted requests] ({ctx})"
    );

    // One key per tenant in the data, key_<tenant>; alpha's key is in api_keys with a name.
    let spenders = rows("Top spenders (API keys)");
    let want: BTreeMap<String, i64> = by_tenant
        .iter()
        .map(|(t, a)| (format!("key_{t}"), a.cost))
        .collect();
    assert_eq!(money_by(spenders, "key id", "cost"), want, "{ctx}");
    for row in spenders {
        let named = text(row, "key id") == "key_alpha";
        assert_eq!(
            text(row, "key name"),
            if named { "alpha production" } else { "" }
        );
    }

    // The loops the guard caught, as the weekly report and `gatewayctl report loops` count them.
    let caught = |r: &Row| {
        (
            text(r, "tenant"),
            text(r, "session"),
            count(r, "repeats"),
            [
                count(r, "requests before"),
                micros(r, "burned before caught"),
                count(r, "flagged after"),
                micros(r, "burned after"),
                count(r, "refused"),
                micros(r, "avoided"),
            ],
        )
    };
    let got: Vec<_> = rows("Agent loops the guard caught")
        .iter()
        .map(caught)
        .collect();
    let want: Vec<_> = loops::detected(ledger, THIS_WEEK.start(), THIS_WEEK.end(), None)
        .await
        .unwrap()
        .into_iter()
        .filter(|l| tenants.is_none_or(|t| t.contains(&l.tenant)))
        .map(|l| {
            (
                l.tenant,
                l.session,
                i64::from(l.repeats),
                [
                    i64::from(l.requests_before),
                    l.burned_before_micros,
                    i64::from(l.flagged_requests),
                    l.burned_after_micros,
                    i64::from(l.refused),
                    l.avoided_micros,
                ],
            )
        })
        .collect();
    assert_eq!(got, want, "agent loops the guard caught ({ctx})");
    if tenants.is_none() {
        assert_eq!(
            want.len(),
            3,
            "two loops of beta's agent, one of o'brien's: {want:?}"
        );
        assert_eq!(
            want[0].3,
            [2, 2 * 2_300, 1, 2 * 1_300, 2, 2 * 2_600],
            "beta's first loop"
        );
    }

    let previous = report_by(ledger, THIS_WEEK.previous(), Dimension::Tenant, tenants).await;
    // The tier router's lines, as the weekly report computes them.
    let got: BTreeMap<String, (i64, i64, i64)> = rows("Tier router (model: auto) by tenant")
        .iter()
        .map(|r| {
            let share = column(r, "large share").as_f64().unwrap_or(-1.0);
            let routed = count(r, "routed requests");
            let large = (share * routed as f64).round() as i64;
            (
                text(r, "tenant"),
                (routed, large, micros(r, "saved vs all-large")),
            )
        })
        .collect();
    let want: BTreeMap<String, (i64, i64, i64)> = by_tenant
        .iter()
        .chain(previous.iter())
        .filter(|(_, a)| a.routed_requests > 0)
        .map(|(t, _)| {
            let a = by_tenant.get(t).copied().unwrap_or_default();
            (
                t.clone(),
                (a.routed_requests, a.routed_large, a.router_saved()),
            )
        })
        .collect();
    assert_eq!(got, want, "tier router: (routed, large, saved) ({ctx})");
    if tenants.is_none() {
        assert_eq!(got["alpha"].0, 7, "alpha's daily auto requests: {got:?}");
        assert!(got["alpha"].2 > 0, "{got:?}");
    }

    let got: BTreeMap<String, [i64; 3]> = rows("Cost by tenant: this period vs the one before")
        .iter()
        .map(|r| {
            let values = [
                micros(r, "this period"),
                micros(r, "previous period"),
                micros(r, "change"),
            ];
            (text(r, "tenant"), values)
        })
        .collect();
    let mut want: BTreeMap<String, [i64; 3]> = BTreeMap::new();
    for tenant in by_tenant.keys().chain(previous.keys()) {
        let now = by_tenant.get(tenant).map_or(0, |a| a.cost);
        let before = previous.get(tenant).map_or(0, |a| a.cost);
        want.insert(tenant.clone(), [now, before, now - before]);
    }
    assert_eq!(
        got, want,
        "week over week: [this, previous, change] ({ctx})"
    );
}

#[tokio::test]
async fn every_dashboard_sql_query_runs_on_a_migrated_postgres() {
    let store = TestStore::new(StoreKind::Postgres)
        .await
        .expect("a fresh migrated Postgres database (see TEST_POSTGRES_URL)");
    let ledger = gateway::ledger::open(&store.url).await.unwrap();
    let events = ledger_rows();
    assert_eq!(ledger.insert(&events).await.unwrap(), events.len() as u64);
    let pool = sqlx::PgPool::connect(&store.url).await.unwrap();
    for sql in [
        "INSERT INTO tenants (id, name, created_at) VALUES ('ten_alpha', 'alpha', now())",
        "INSERT INTO api_keys (id, tenant_id, name, key_hash, key_prefix, created_at) \
         VALUES ('key_alpha', 'ten_alpha', 'alpha production', 'h', 'gw_alpha', now())",
        "INSERT INTO budgets (id, tenant_id, scope_kind, scope_value, window_kind, limit_tokens, \
         limit_micros, action, updated_at) VALUES \
         ('bud_month', 'ten_alpha', 'tenant', '', 'month', 1000000, 50000000, 'reject', now()), \
         ('bud_tag', 'ten_alpha', 'tag', 'feature=alpha-chat', 'day', NULL, 1000000, 'flag', now())",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }

    // Grafana's "This week" (UTC, weeks start on Monday): up to the week's last millisecond.
    let range = TimeRange {
        from: THIS_WEEK.start(),
        to: THIS_WEEK.end() - Duration::milliseconds(1),
    };
    // A week without rows: stats must say 0, not "No data".
    let empty = IsoWeek {
        year: 2020,
        week: 2,
    };
    let empty = TimeRange {
        from: empty.start(),
        to: empty.end() - Duration::milliseconds(1),
    };
    // This week with the tenant variable at All, then at two tenants (one with a quote in its
    // name); an empty week.
    let scenarios = [
        (range, None),
        (range, Some(vec!["alpha".to_owned(), "o'brien".to_owned()])),
        (empty, None),
    ];

    let mut sql_queries = 0;
    let mut weekly_cost_checked = 0;
    for (path, dashboard) in dashboards() {
        if kind(&path, &dashboard) != Kind::Postgres {
            continue;
        }
        let file = file_name(&path);
        for (n, (range, tenants)) in scenarios.iter().enumerate() {
            let range = *range;
            let has_rows = n < 2;
            let ctx = format!(
                "{} to {}, tenant: {}",
                range.from,
                range.to,
                tenants.as_ref().map_or("All".to_owned(), |t| t.join(", "))
            );
            let mut x = Expansion {
                range,
                variables: template_variables(&dashboard),
                selected: BTreeMap::new(),
                options: BTreeMap::new(),
            };
            if let Some(t) = tenants {
                x.selected
                    .insert("tenant".into(), Selected::Values(t.clone()));
            }
            // Variables first, in order: their options are what "All" stands for.
            for var in query_variables(&dashboard) {
                let name = var["name"].as_str().unwrap_or_default().to_owned();
                let sql = x.expand(variable_query(var).unwrap_or_default());
                let rows = run(&pool, &sql, &format!("{file}: variable {name}")).await;
                x.options
                    .insert(name, rows.iter().map(option_value).collect());
            }
            // Every SQL query in the file, in panels or not.
            let mut results: BTreeMap<String, Vec<Row>> = BTreeMap::new();
            for raw in queries(&dashboard, Kind::Postgres) {
                let sql = x.expand(&raw);
                let rows = run(&pool, &sql, &format!("{file} ({ctx})")).await;
                results.insert(raw, rows);
                sql_queries += 1;
            }
            // Panel results by title. The data has rows of every kind in this week, so with every
            // tenant selected an empty panel means a query filters wrongly.
            let mut by_title = BTreeMap::new();
            for panel in panels(&dashboard) {
                let title = panel["title"].as_str().unwrap_or("<untitled>");
                for target in targets(panel) {
                    let raw = target["rawSql"].as_str().unwrap_or_default();
                    let rows = &results[raw];
                    assert!(
                        tenants.is_some() || !has_rows || !rows.is_empty(),
                        "{file}: panel {title:?} returns no rows ({ctx}):\n{}",
                        x.expand(raw)
                    );
                    if panel["type"] == "stat" && !has_rows {
                        assert!(
                            rows.len() == 1 && rows[0].values().all(|v| v.as_f64() == Some(0.0)),
                            "{file}: stat {title:?} over no rows should be 0, is {rows:?}"
                        );
                    }
                    if target["format"] == "time_series" {
                        assert!(
                            rows.iter().all(|r| r.contains_key("time")),
                            "{file}: time series {title:?} has no time column"
                        );
                    }
                    by_title.insert(title.to_owned(), rows.clone());
                }
            }
            if file == WEEKLY_COST && has_rows && tenants.is_none() {
                check_budget_utilisation(&events, &by_title["Budget utilisation per tenant"]);
            }
            if file == WEEKLY_COST && has_rows {
                assert_eq!(x.options["tenant"], ["alpha", "beta", "o'brien"]);
                check_weekly_cost(&*ledger, &events, range, tenants.as_deref(), &by_title).await;
                weekly_cost_checked += 1;
            }
        }
    }
    assert!(
        sql_queries > 0,
        "no SQL query in any dashboard: nothing was checked"
    );
    assert_eq!(weekly_cost_checked, 2, "{WEEKLY_COST} was not checked");
}
