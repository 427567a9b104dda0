//! The Grafana dashboards in `dashboards/grafana/` against the metrics the gateway exports
//! (`gateway::metrics::names::ALL`): every metric a query uses must exist, every exported metric
//! must be on a dashboard, and the operations dashboard must be well-formed Grafana JSON that
//! takes its Prometheus datasource from the `${datasource}` variable.
//!
//! Plain file checks: no gateway, no Prometheus, no Grafana.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use gateway::metrics::names;
use serde_json::Value;

/// Where the dashboard JSON files live.
const DASHBOARD_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../dashboards/grafana");

/// The operations dashboard, relative to [`DASHBOARD_DIR`].
const OPERATIONS: &str = "operations.json";

/// What every panel's and target's datasource must point at.
const DATASOURCE_VAR: &str = "${datasource}";

/// Series suffixes a histogram `foo` is exported under (`foo_bucket`, `foo_sum`, `foo_count`).
const HISTOGRAM_SUFFIXES: &[&str] = &["_bucket", "_sum", "_count"];

/// Every `*.json` file in [`DASHBOARD_DIR`], parsed, sorted by path. Panics when there are none.
fn dashboards() -> Vec<(PathBuf, Value)> {
    let mut paths: Vec<PathBuf> = fs::read_dir(DASHBOARD_DIR)
        .unwrap_or_else(|e| panic!("reading {DASHBOARD_DIR}: {e}"))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|ext| ext == "json"))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no dashboards in {DASHBOARD_DIR}");
    paths
        .into_iter()
        .map(|p| {
            let value = parse(&p);
            (p, value)
        })
        .collect()
}

fn parse(path: &Path) -> Value {
    let text =
        fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()))
}

/// Every panel, including those nested in (collapsed) rows, in document order.
fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for panel in list.as_array().into_iter().flatten() {
            out.push(panel);
            if let Some(nested) = panel.get("panels") {
                walk(nested, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// Every PromQL query in a dashboard: each `expr` string anywhere in it (panel targets, nested
/// rows, annotations) and the query of each `query` template variable.
fn queries(dashboard: &Value) -> Vec<String> {
    fn walk(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (key, v) in map {
                    match (key.as_str(), v) {
                        ("expr", Value::String(expr)) => out.push(expr.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(list) => list.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(dashboard, &mut out);
    for var in template_variables(dashboard) {
        if var["type"] != "query" {
            continue;
        }
        // Older dashboards store the query as a string, newer ones as `{ "query": ... }`.
        match &var["query"] {
            Value::String(q) => out.push(q.clone()),
            other => {
                if let Some(q) = other["query"].as_str() {
                    out.push(q.to_owned());
                }
            }
        }
    }
    out
}

fn template_variables(dashboard: &Value) -> &[Value] {
    dashboard["templating"]["list"]
        .as_array()
        .map_or(&[], Vec::as_slice)
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident_continue(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Identifiers (`[a-zA-Z_:][a-zA-Z0-9_:]*`) in a PromQL expression that start with `gateway_`.
///
/// Skips string literals (label values such as `replica="gateway_a"` are not metrics), comments,
/// number and duration literals (`0.95`, `5m`), and Grafana variables (`$tier`, `${datasource}`,
/// `$__rate_interval`). Label names starting with `gateway_` would be reported too; none exist.
fn gateway_identifiers(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut chars = expr.char_indices().peekable();
    while let Some((start, c)) = chars.next() {
        match c {
            '"' | '\'' | '`' => {
                while let Some((_, d)) = chars.next() {
                    if d == '\\' && c != '`' {
                        chars.next();
                    } else if d == c {
                        break;
                    }
                }
            }
            '#' => {
                for (_, d) in chars.by_ref() {
                    if d == '\n' {
                        break;
                    }
                }
            }
            '$' => {
                if chars.next_if(|&(_, d)| d == '{').is_some() {
                    for (_, d) in chars.by_ref() {
                        if d == '}' {
                            break;
                        }
                    }
                } else {
                    while chars.next_if(|&(_, d)| is_ident_continue(d)).is_some() {}
                }
            }
            c if c.is_ascii_digit() => {
                while chars
                    .next_if(|&(_, d)| d.is_ascii_alphanumeric() || d == '.' || d == '_')
                    .is_some()
                {}
            }
            c if is_ident_start(c) => {
                let mut end = start + c.len_utf8();
                while let Some((i, d)) = chars.next_if(|&(_, d)| is_ident_continue(d)) {
                    end = i + d.len_utf8();
                }
                let ident = &expr[start..end];
                if ident.starts_with("gateway_") {
                    out.insert(ident.to_owned());
                }
            }
            _ => {}
        }
    }
    out
}

/// The exported metric a series name belongs to: itself when exported under that name, else the
/// histogram it is a `_bucket`/`_sum`/`_count` series of. `None` when it matches nothing.
fn exported_metric(series: &str) -> Option<&'static str> {
    let exact = names::ALL.iter().find(|&&name| name == series);
    exact
        .or_else(|| {
            HISTOGRAM_SUFFIXES
                .iter()
                .filter_map(|suffix| series.strip_suffix(suffix))
                .find_map(|base| names::ALL.iter().find(|&&name| name == base))
        })
        .copied()
}

/// Metric (series) names each dashboard's queries use, keyed by dashboard file name.
fn metrics_used() -> BTreeMap<String, BTreeSet<String>> {
    dashboards()
        .iter()
        .map(|(path, dashboard)| {
            let qs = queries(dashboard);
            assert!(
                !qs.is_empty(),
                "{} has no queries: nothing to check",
                path.display()
            );
            let used = qs.iter().flat_map(|q| gateway_identifiers(q)).collect();
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            (file, used)
        })
        .collect()
}

#[test]
fn tokenizer_finds_metrics_and_skips_strings_variables_and_numbers() {
    let found = gateway_identifiers(
        "histogram_quantile(0.95, sum by (le) (rate(gateway_x_seconds_bucket{replica=\"gateway_no\", \
         tier=~\"$tier\"}[$__rate_interval]))) / on() gateway_y_total # gateway_comment\n\
         + ${gateway_var} + $gateway_var2 + 1e9 + not_gateway_z",
    );
    let expected: BTreeSet<String> = ["gateway_x_seconds_bucket", "gateway_y_total"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(found, expected);
    assert_eq!(
        exported_metric(&format!("{}_bucket", names::DURATION)),
        Some(names::DURATION)
    );
    assert_eq!(exported_metric(names::REQUESTS), Some(names::REQUESTS));
    assert_eq!(exported_metric("gateway_nonexistent_bucket"), None);
}

#[test]
fn every_metric_an_operations_panel_queries_is_exported() {
    let used = metrics_used();
    let mut total = 0;
    let mut unknown = Vec::new();
    for (file, series) in &used {
        total += series.len();
        for s in series {
            if exported_metric(s).is_none() {
                unknown.push(format!("{file}: {s}"));
            }
        }
    }
    assert!(
        used.get(OPERATIONS).is_some_and(|s| !s.is_empty()),
        "{OPERATIONS} queries no gateway_ metric"
    );
    assert!(total > 0, "no gateway_ metric in any dashboard query");
    assert!(
        unknown.is_empty(),
        "dashboards query metrics the gateway does not export (see gateway/src/metrics.rs):\n{}",
        unknown.join("\n")
    );
}

#[test]
fn every_exported_metric_is_on_a_dashboard() {
    let on_dashboards: BTreeSet<&str> = metrics_used()
        .values()
        .flatten()
        .filter_map(|s| exported_metric(s))
        .collect();
    let missing: Vec<&str> = names::ALL
        .iter()
        .copied()
        .filter(|name| !on_dashboards.contains(name))
        .collect();
    assert!(
        missing.is_empty(),
        "exported metrics no dashboard in dashboards/grafana/ queries: {missing:?}"
    );
}

/// A datasource reference (`"${datasource}"` or `{ "type": ..., "uid": "${datasource}" }`) that
/// points at the datasource variable.
fn is_datasource_var(ds: &Value) -> bool {
    match ds {
        Value::String(s) => s == DATASOURCE_VAR,
        Value::Object(_) => ds["uid"] == DATASOURCE_VAR,
        _ => false,
    }
}

#[test]
fn operations_dashboard_is_valid_grafana_json() {
    let path = Path::new(DASHBOARD_DIR).join(OPERATIONS);
    let dashboard = parse(&path);

    assert_eq!(dashboard["uid"], "llm-gateway-ops");
    assert!(
        dashboard["title"]
            .as_str()
            .is_some_and(|t| !t.trim().is_empty()),
        "no title"
    );
    assert_eq!(dashboard["schemaVersion"], 39);

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
        let v = var(name);
        assert_eq!(v["type"], "query", "variable {name}");
        assert!(
            is_datasource_var(&v["datasource"]),
            "variable {name} does not use {DATASOURCE_VAR}"
        );
    }
    let var_queries = queries(&json_with_only_templating(&dashboard));
    assert!(
        var_queries.iter().all(|q| q.contains("label_values(")),
        "tier/replica should come from label_values: {var_queries:?}"
    );

    let all = panels(&dashboard);
    assert!(!all.is_empty(), "no panels");
    let mut ids = BTreeSet::new();
    let mut targets_seen = 0;
    for panel in &all {
        let title = panel["title"].as_str().unwrap_or("<untitled>");
        let id = panel["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("panel {title:?} has no numeric id"));
        assert!(ids.insert(id), "panel id {id} ({title:?}) is not unique");
        assert!(
            panel["type"].as_str().is_some_and(|t| !t.is_empty()),
            "panel {title:?} has no type"
        );
        assert!(
            panel.get("gridPos").is_some(),
            "panel {title:?} has no gridPos"
        );

        let targets = panel["targets"].as_array().map_or(&[][..], Vec::as_slice);
        match panel.get("datasource") {
            Some(ds) => assert!(
                is_datasource_var(ds),
                "panel {title:?} datasource is {ds}, not {DATASOURCE_VAR}"
            ),
            None => assert!(
                targets.is_empty(),
                "panel {title:?} has queries but no datasource"
            ),
        }
        for target in targets {
            targets_seen += 1;
            let expr = target["expr"].as_str().unwrap_or_default();
            assert!(
                !expr.trim().is_empty(),
                "panel {title:?} has a target without an expr: {target}"
            );
            if let Some(ds) = target.get("datasource") {
                assert!(
                    is_datasource_var(ds),
                    "panel {title:?} target datasource is {ds}, not {DATASOURCE_VAR}"
                );
            }
        }
    }
    assert!(targets_seen > 0, "no panel has a query");

    // Ledger health sits in its own row (queue, spool, outcomes, write latency).
    assert!(
        all.iter()
            .any(|p| p["type"] == "row" && p["title"] == "Ledger"),
        "the ledger has its own row"
    );
}

/// The dashboard's templating section alone, so [`queries`] returns only variable queries.
fn json_with_only_templating(dashboard: &Value) -> Value {
    serde_json::json!({ "templating": dashboard["templating"].clone() })
}
