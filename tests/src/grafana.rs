//! Reading Grafana dashboards the way Grafana does, for the dashboard tests: the dashboard
//! files and their panels, targets and template variables; which exported metrics the PromQL
//! queries show; and the Postgres macros and variables Grafana expands in a dashboard's SQL.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test helpers: failing loudly is the point"
)]

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use chrono::{DateTime, SecondsFormat, Utc};
use gateway::metrics::names;
use serde_json::Value;

/// Where the dashboard JSON files live.
pub const DASHBOARD_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../dashboards/grafana");

/// The operations dashboard (Prometheus), relative to [`DASHBOARD_DIR`].
pub const OPERATIONS: &str = "operations.json";

/// The weekly cost dashboard (Postgres), relative to [`DASHBOARD_DIR`].
pub const WEEKLY_COST: &str = "weekly-cost.json";

/// What every panel's and target's datasource must point at.
pub const DATASOURCE_VAR: &str = "${datasource}";

/// Series suffixes a histogram `foo` is exported under (`foo_bucket`, `foo_sum`, `foo_count`).
pub const HISTOGRAM_SUFFIXES: &[&str] = &["_bucket", "_sum", "_count"];

/// What a dashboard queries: the datasource plugin its `datasource` variable offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// PromQL, in each target's `expr`.
    Prometheus,
    /// SQL on the ledger, in each target's `rawSql`.
    Postgres,
}

impl Kind {
    /// Both kinds.
    pub const ALL: [Self; 2] = [Self::Prometheus, Self::Postgres];

    /// Grafana's plugin id for the datasource.
    pub fn plugin(self) -> &'static str {
        match self {
            Self::Prometheus => "prometheus",
            Self::Postgres => "grafana-postgresql-datasource",
        }
    }

    /// The target field holding the query.
    pub fn query_field(self) -> &'static str {
        match self {
            Self::Prometheus => "expr",
            Self::Postgres => "rawSql",
        }
    }
}

/// The kind of a dashboard, from its `datasource` variable. Panics when it has none or the
/// variable offers a plugin this test does not know.
pub fn kind(path: &Path, dashboard: &Value) -> Kind {
    let var = template_variables(dashboard)
        .iter()
        .find(|v| v["name"] == "datasource" && v["type"] == "datasource")
        .unwrap_or_else(|| {
            panic!(
                "{} has no `datasource` variable of type datasource",
                path.display()
            )
        });
    Kind::ALL
        .into_iter()
        .find(|k| var["query"] == k.plugin())
        .unwrap_or_else(|| {
            panic!(
                "{}: the datasource variable offers {}, not one of {:?}",
                path.display(),
                var["query"],
                Kind::ALL.map(Kind::plugin)
            )
        })
}

/// Every `*.json` file in [`DASHBOARD_DIR`], parsed, sorted by path. Panics when there are none.
pub fn dashboards() -> Vec<(PathBuf, Value)> {
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

/// The dashboard at `path`, parsed (panics naming the file when it is not JSON).
pub fn parse(path: &Path) -> Value {
    let text =
        fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()))
}

/// The file name of `path`.
pub fn file_name(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

/// Every panel, including those nested in (collapsed) rows, in document order.
pub fn panels(dashboard: &Value) -> Vec<&Value> {
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

/// A panel's targets (none for rows and text panels).
pub fn targets(panel: &Value) -> &[Value] {
    panel["targets"].as_array().map_or(&[], Vec::as_slice)
}

/// Every query of `kind` in a dashboard: each `expr` (Prometheus) or `rawSql` (Postgres) string
/// anywhere in it (panel targets, nested rows, annotations) and the query of each `query`
/// template variable on a datasource of that kind.
pub fn queries(dashboard: &Value, kind: Kind) -> Vec<String> {
    fn walk(value: &Value, field: &str, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (key, v) in map {
                    match v {
                        Value::String(q) if key == field => out.push(q.clone()),
                        _ => walk(v, field, out),
                    }
                }
            }
            Value::Array(list) => list.iter().for_each(|v| walk(v, field, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(dashboard, kind.query_field(), &mut out);
    out.extend(
        query_variables(dashboard)
            .filter(|var| var["datasource"]["type"] == kind.plugin())
            .filter_map(|var| variable_query(var).map(str::to_owned)),
    );
    out
}

/// The dashboard's template variables (`templating.list`).
pub fn template_variables(dashboard: &Value) -> &[Value] {
    dashboard["templating"]["list"]
        .as_array()
        .map_or(&[], Vec::as_slice)
}

/// Template variables of type `query`, in order.
pub fn query_variables(dashboard: &Value) -> impl Iterator<Item = &Value> {
    template_variables(dashboard)
        .iter()
        .filter(|var| var["type"] == "query")
}

/// A query variable's query. Older dashboards (and SQL datasources) store it as a string,
/// Prometheus variables as `{ "query": ... }`.
pub fn variable_query(var: &Value) -> Option<&str> {
    match &var["query"] {
        Value::String(q) => Some(q),
        other => other["query"].as_str(),
    }
}

/// Whether a PromQL `query` names the exported metric `name` (or, for a histogram, one of its
/// `_bucket`/`_sum`/`_count` series): an occurrence not followed by more of a longer name.
/// Whether each query is valid PromQL with data behind it is Prometheus's to say
/// (`tests/promql.rs`); this only finds which metrics the dashboards show.
pub fn query_uses(query: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    query.match_indices(name).any(|(i, _)| {
        let before = query[..i].chars().next_back();
        let rest = &query[i + name.len()..];
        let rest = HISTOGRAM_SUFFIXES
            .iter()
            .find_map(|s| rest.strip_prefix(s))
            .unwrap_or(rest);
        !before.is_some_and(ident) && !rest.chars().next().is_some_and(ident)
    })
}

/// The exported metrics (`gateway::metrics::names::ALL`) no Prometheus dashboard queries.
pub fn metrics_on_no_dashboard() -> Vec<&'static str> {
    let queries: Vec<String> = dashboards()
        .iter()
        .filter(|(path, dashboard)| kind(path, dashboard) == Kind::Prometheus)
        .flat_map(|(_, dashboard)| queries(dashboard, Kind::Prometheus))
        .collect();
    names::ALL
        .iter()
        .copied()
        .filter(|name| !queries.iter().any(|q| query_uses(q, name)))
        .collect()
}

/// A dashboard time range as Grafana sends it to the datasource.
#[derive(Debug, Clone, Copy)]
pub struct TimeRange {
    /// Start of the range.
    pub from: DateTime<Utc>,
    /// End of the range.
    pub to: DateTime<Utc>,
}

/// A timestamp as Grafana's SQL macros write it: a quoted RFC 3339 string in UTC.
pub fn time_literal(t: DateTime<Utc>) -> String {
    format!("'{}'", t.to_rfc3339_opts(SecondsFormat::Millis, true))
}

/// A string as a SQL literal (Grafana's `quoteLiteral`, and the `sqlstring` format).
pub fn sql_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// What a template variable is set to.
#[derive(Debug, Clone)]
pub enum Selected {
    /// The "All" option.
    All,
    /// These values.
    Values(Vec<String>),
}

/// Expands a dashboard's SQL the way Grafana does before Postgres sees it: template variables
/// first (in the browser, formatted as Grafana's SQL datasources format them), then the time
/// macros (in Grafana's server). Panics on anything it does not know rather than guessing.
pub struct Expansion<'a> {
    /// The dashboard's time range.
    pub range: TimeRange,
    /// The dashboard's template variables.
    pub variables: &'a [Value],
    /// Chosen values by variable name. A variable not here is at its default: All when it has
    /// that option, else its first option.
    pub selected: BTreeMap<String, Selected>,
    /// What each query variable's query returned (what "All" stands for without an allValue).
    pub options: BTreeMap<String, Vec<String>>,
}

impl Expansion<'_> {
    /// `sql` with its variables and then its time macros expanded.
    pub fn expand(&self, sql: &str) -> String {
        let out = expand_macros(&self.expand_variables(sql), self.range);
        assert!(
            !out.contains('$'),
            "`$` left after expanding (an unknown macro or variable?):\n{out}"
        );
        out
    }

    /// `$name`, `${name}` and `${name:format}` of the dashboard's variables; `$__…` (macros and
    /// Grafana's global variables) are left for [`expand_macros`].
    pub fn expand_variables(&self, sql: &str) -> String {
        let mut out = String::new();
        let mut rest = sql;
        while let Some(i) = rest.find('$') {
            out.push_str(&rest[..i]);
            let after = &rest[i + 1..];
            if after.starts_with("__") {
                out.push('$');
                rest = after;
                continue;
            }
            let (name, format, len) = if let Some(inner) = after.strip_prefix('{') {
                let end = inner
                    .find('}')
                    .unwrap_or_else(|| panic!("unclosed ${{ in:\n{sql}"));
                let (name, format) = match inner[..end].split_once(':') {
                    Some((name, format)) => (name, Some(format)),
                    None => (&inner[..end], None),
                };
                (name, format, end + 2)
            } else {
                let len = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len());
                (&after[..len], None, len)
            };
            let var = self
                .variables
                .iter()
                .find(|v| v["name"] == name)
                .unwrap_or_else(|| panic!("`${name}` is not a variable of the dashboard:\n{sql}"));
            out.push_str(&self.value(var, format));
            rest = &after[len..];
        }
        out.push_str(rest);
        out
    }

    /// A variable's value as Grafana's SQL datasources interpolate it.
    pub fn value(&self, var: &Value, format: Option<&str>) -> String {
        let name = var["name"].as_str().unwrap_or_default();
        let options = self.options.get(name).map_or(&[][..], Vec::as_slice);
        let include_all = var["includeAll"] == true;
        let multi = var["multi"] == true || include_all;
        let selected = self.selected.get(name).cloned().unwrap_or_else(|| {
            if include_all {
                Selected::All
            } else {
                Selected::Values(options.iter().take(1).cloned().collect())
            }
        });
        let values = match selected {
            Selected::All => {
                assert!(include_all, "variable {name} has no All option");
                if let Some(all) = var["allValue"].as_str().filter(|a| !a.is_empty()) {
                    // Grafana inserts a custom all value as it is, unformatted.
                    assert!(
                        !matches!(format, Some("text" | "percentencode")),
                        "${{{name}:{format:?}}} would not use the allValue"
                    );
                    return all.to_owned();
                }
                options.to_vec()
            }
            Selected::Values(values) => values,
        };
        match format {
            // One plain value: inserted with quotes doubled but not quoted.
            None if !multi => values
                .first()
                .map_or(String::new(), |v| v.replace('\'', "''")),
            None | Some("sqlstring") => values
                .iter()
                .map(|v| sql_literal(v))
                .collect::<Vec<_>>()
                .join(","),
            Some("singlequote") => values
                .iter()
                .map(|v| format!("'{}'", v.replace('\'', "\\'")))
                .collect::<Vec<_>>()
                .join(","),
            Some("csv") => values.join(","),
            Some(other) => panic!("format `{other}` (variable {name}) is unknown to this test"),
        }
    }
}

/// Seconds in a Grafana interval such as `'1d'`, `'6h'` or `'5m'`.
pub fn interval_seconds(arg: &str) -> u64 {
    let interval = arg.trim_matches(|c| c == '\'' || c == '"');
    let unit = interval.trim_start_matches(|c: char| c.is_ascii_digit());
    let n: u64 = interval[..interval.len() - unit.len()]
        .parse()
        .unwrap_or_else(|_| panic!("interval {arg} has no number"));
    let per = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => panic!("interval {arg}: unit {unit:?} is unknown to this test"),
    };
    n * per
}

/// Grafana's Postgres macros (as its server expands them) that the dashboards use.
pub fn expand_macros(sql: &str, range: TimeRange) -> String {
    let mut out = String::new();
    let mut rest = sql;
    while let Some(i) = rest.find("$__") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 3..];
        let name_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        let name = &after[..name_len];
        let close = after[name_len..]
            .strip_prefix('(')
            .and_then(|args| args.find(')'))
            .unwrap_or_else(|| panic!("`$__{name}` is not a macro call this test knows:\n{sql}"));
        let args_text = &after[name_len + 1..name_len + 1 + close];
        let args: Vec<&str> = if args_text.trim().is_empty() {
            Vec::new()
        } else {
            args_text.split(',').map(str::trim).collect()
        };
        let group = |col: &str, interval: &str| {
            let s = interval_seconds(interval);
            format!("floor(extract(epoch from {col})/{s})*{s}")
        };
        let expansion = match (name, args.as_slice()) {
            ("timeFilter", [col]) => format!(
                "{col} BETWEEN {} AND {}",
                time_literal(range.from),
                time_literal(range.to)
            ),
            ("timeFrom", []) => time_literal(range.from),
            ("timeTo", []) => time_literal(range.to),
            ("time", [col]) => format!("{col} AS \"time\""),
            // An optional third argument is the fill value, applied by Grafana to the result.
            ("timeGroup", [col, interval] | [col, interval, _]) => group(col, interval),
            ("timeGroupAlias", [col, interval] | [col, interval, _]) => {
                format!("{} AS \"time\"", group(col, interval))
            }
            _ => panic!("macro $__{name}({args_text}) is unknown to this test; teach it"),
        };
        out.push_str(&expansion);
        rest = &after[name_len + 1 + close + 1..];
    }
    out.push_str(rest);
    out
}
