//! `gatewayctl`: the admin CLI. It talks only to the admin API (`--url`, `GATEWAY_ADMIN_TOKEN`),
//! so it works the same against one gateway or a fleet behind a load balancer.
//!
//! One file per command group, each holding its subcommand enum and its handler; [`Command`] is
//! the one dispatch enum and [`run`] the one dispatch. Handlers read the server's own response
//! types (those of [`crate::routes`], [`crate::store`], [`crate::budget`] and
//! [`crate::ledger::report`]); `--json` prints the admin API's JSON as received.

mod budgets;
mod cache;
mod guard;
mod keys;
mod limits;
mod prices;
mod report;
mod routing;
mod tenants;
mod usage;

use std::fmt::Display;
use std::io::Write;

use anyhow::{anyhow, bail, Context as _};
use chrono::{DateTime, SecondsFormat, Utc};
use clap::{Parser, Subcommand};
use comfy_table::{presets::UTF8_BORDERS_ONLY, Table};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ErrorBody;
use crate::routes::List;

pub use budgets::BudgetCommand;
pub use cache::CacheCommand;
pub use guard::{GuardCommand, SessionCommand};
pub use keys::KeyCommand;
pub use limits::LimitCommand;
pub use prices::PriceCommand;
pub use report::ReportCommand;
pub use routing::RoutingCommand;
pub use tenants::TenantCommand;

/// Admin CLI for the LLM gateway: tenants, API keys, prices, budgets, rate limits and reports.
#[derive(Debug, Parser)]
#[command(name = "gatewayctl", version, about)]
pub struct Cli {
    /// Base URL of a gateway.
    #[arg(
        long,
        env = "GATEWAY_URL",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    pub url: String,
    /// Admin token (`admin.token` of the gateway).
    #[arg(
        long,
        env = "GATEWAY_ADMIN_TOKEN",
        hide_env_values = true,
        global = true
    )]
    pub token: Option<String>,
    /// Print JSON instead of tables (for scripts).
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Manage tenants.
    Tenants {
        /// Tenant command.
        #[command(subcommand)]
        command: TenantCommand,
    },
    /// Manage API keys.
    Keys {
        /// Key command.
        #[command(subcommand)]
        command: KeyCommand,
    },
    /// Cost reports from the ledger.
    Report {
        /// Report command.
        #[command(subcommand)]
        command: ReportCommand,
        /// Output format.
        #[arg(long, value_enum, default_value = "table", global = true)]
        format: Format,
    },
    /// Manage model prices (USD per 1M tokens, with history).
    Prices {
        /// Price command.
        #[command(subcommand)]
        command: PriceCommand,
    },
    /// Manage budget policies (token and USD limits per tenant, key or tag and window).
    Budgets {
        /// Budget command.
        #[command(subcommand)]
        command: BudgetCommand,
    },
    /// Manage rate limits (requests and tokens per minute, per tenant or key).
    Limits {
        /// Rate limit command.
        #[command(subcommand)]
        command: LimitCommand,
    },
    /// A tenant's response-cache policy (exact and semantic layers).
    Cache {
        /// Cache command.
        #[command(subcommand)]
        command: CacheCommand,
    },
    /// A tenant's agent-loop policy: what a loop is and what happens to it.
    Guard {
        /// Guard command.
        #[command(subcommand)]
        command: GuardCommand,
    },
    /// A tenant's routing policy for `model: "auto"`: how many requests the tier classifier
    /// sends to the large tier.
    Routing {
        /// Routing command.
        #[command(subcommand)]
        command: RoutingCommand,
    },
    /// The sessions the loop guard tracks: list them, show one, clear a throttled or blocked one.
    Sessions {
        /// Session command.
        #[command(subcommand)]
        command: SessionCommand,
    },
    /// Every replica's routing state: in flight, circuit breaker (and why it opened), recent
    /// failures.
    #[command(after_help = "Examples:\n  gatewayctl replicas\n  gatewayctl --json replicas")]
    Replicas,
    /// A tenant's budgets in their current windows: spent, reserved, remaining, reset time.
    #[command(
        after_help = "Examples:\n  gatewayctl usage --tenant acme\n  gatewayctl --json usage --tenant acme"
    )]
    Usage {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
    },
}

/// Output format of reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Human tables.
    Table,
    /// Comma-separated values (one section per table).
    Csv,
    /// The admin API's JSON.
    Json,
}

/// A thin client for the admin API.
struct Admin {
    http: reqwest::Client,
    url: String,
    token: String,
}

/// A typed answer of the admin API, with its JSON as received (what `--json` prints).
struct Answer<T> {
    body: T,
    json: Value,
}

impl<T> Answer<T> {
    /// What the command prints: this answer's JSON, or `human`.
    fn reply(self, human: String) -> Reply {
        Reply {
            json: self.json,
            human,
        }
    }
}

impl Admin {
    /// `method /admin/v1/{path}` with an optional JSON body; the answer read as `T`, or the
    /// error's status and message.
    async fn call<T: DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Answer<T>> {
        let url = format!("{}/admin/v1/{path}", self.url.trim_end_matches('/'));
        let mut req = self
            .http
            .request(method.clone(), &url)
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("cannot reach the gateway at {}", self.url))?;
        let status = resp.status();
        let json: Value = resp.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            let message = ErrorBody::deserialize(&json)
                .map_or_else(|_| "no error message".to_owned(), |e| e.error.message);
            bail!("{status}: {message}");
        }
        let body = T::deserialize(&json)
            .with_context(|| format!("unexpected answer to {method} /admin/v1/{path}"))?;
        Ok(Answer { body, json })
    }

    /// `GET /admin/v1/{path}`: a list, shown as a table of one `row` per item.
    async fn list<T: DeserializeOwned>(
        &self,
        path: &str,
        header: &[&str],
        row: impl Fn(&T) -> Vec<String>,
    ) -> anyhow::Result<Reply> {
        let a: Answer<List<T>> = self.call(reqwest::Method::GET, path, None).await?;
        let h = table(header, a.body.data.iter().map(row).collect());
        Ok(a.reply(h))
    }
}

/// What a command (other than `report`) prints: the admin API's JSON with `--json`, else a human
/// rendering of it.
struct Reply {
    json: Value,
    human: String,
}

/// One titled table of a report.
struct Section {
    title: String,
    header: &'static [&'static str],
    rows: Vec<Vec<String>>,
}

/// What `report` prints: the admin API's JSON, or its sections as tables or CSV.
struct Report {
    json: Value,
    sections: Vec<Section>,
}

impl Report {
    fn write(self, format: Format, out: &mut impl Write) -> anyhow::Result<()> {
        match format {
            Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&self.json)?)?,
            Format::Csv => {
                for s in self.sections {
                    writeln!(out, "# {}", s.title)?;
                    let header: Vec<String> = s.header.iter().map(|h| (*h).to_owned()).collect();
                    for row in std::iter::once(&header).chain(s.rows.iter()) {
                        let cells: Vec<String> = row.iter().map(|c| csv_cell(c)).collect();
                        writeln!(out, "{}", cells.join(","))?;
                    }
                }
            }
            Format::Table => {
                for s in self.sections {
                    writeln!(out, "{}\n{}\n", s.title, table(s.header, s.rows))?;
                }
            }
        }
        Ok(())
    }
}

fn csv_cell(c: &str) -> String {
    if c.contains([',', '"', '\n']) {
        format!("\"{}\"", c.replace('"', "\"\""))
    } else {
        c.to_owned()
    }
}

fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY).set_header(header.to_vec());
    for r in rows {
        t.add_row(r);
    }
    t.to_string()
}

/// `s` as one path segment.
fn segment(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// `v`, or `-` when absent.
fn opt<T: Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// A time as the admin API writes it (RFC 3339, UTC, `Z`).
fn time(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::AutoSi, true)
}

/// `path` with the query parameters that are given: `keys?tenant=acme`, or `keys`.
fn query(path: &str, params: &[(&str, Option<&str>)]) -> String {
    let given: Vec<String> = params
        .iter()
        .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
        .collect();
    if given.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", given.join("&"))
    }
}

/// Run one CLI invocation, writing human or JSON output to `out`.
pub async fn run(cli: Cli, out: &mut impl Write) -> anyhow::Result<()> {
    crate::telemetry::install_crypto_provider();
    let token = cli
        .token
        .clone()
        .ok_or_else(|| anyhow!("no admin token: pass --token or set GATEWAY_ADMIN_TOKEN"))?;
    let admin = Admin {
        http: reqwest::Client::new(),
        url: cli.url.clone(),
        token,
    };
    let reply = match cli.command {
        Command::Tenants { command } => command.run(&admin).await?,
        Command::Keys { command } => command.run(&admin).await?,
        Command::Prices { command } => command.run(&admin).await?,
        Command::Budgets { command } => command.run(&admin).await?,
        Command::Limits { command } => command.run(&admin).await?,
        Command::Usage { tenant } => usage::run(&admin, &tenant).await?,
        Command::Replicas => usage::replicas(&admin).await?,
        Command::Cache { command } => command.run(&admin).await?,
        Command::Guard { command } => command.run(&admin).await?,
        Command::Routing { command } => command.run(&admin).await?,
        Command::Sessions { command } => command.run(&admin).await?,
        Command::Report { command, format } => {
            // `--json` means JSON for every command, reports included.
            let format = if cli.json { Format::Json } else { format };
            return command.run(&admin).await?.write(format, out);
        }
    };
    if cli.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&reply.json)?)?;
    } else {
        writeln!(out, "{}", reply.human)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command's `--help` ends with examples, and every example is a valid command line.
    #[test]
    fn every_command_has_examples_that_parse() {
        use clap::CommandFactory;
        fn leaves(c: &clap::Command, path: String, out: &mut Vec<(String, String)>) {
            let subs: Vec<_> = c
                .get_subcommands()
                .filter(|s| s.get_name() != "help")
                .collect();
            for s in &subs {
                leaves(s, format!("{path} {}", s.get_name()), out);
            }
            if subs.is_empty() {
                let help = c.get_after_help().map(|h| h.to_string());
                out.push((path, help.unwrap_or_default()));
            }
        }
        let mut all = Vec::new();
        leaves(&Cli::command(), "gatewayctl".into(), &mut all);
        assert!(all.len() >= 20, "{} commands", all.len());
        for (path, help) in all {
            let examples: Vec<&str> = help
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with("gatewayctl "))
                .collect();
            assert!(!examples.is_empty(), "`{path} --help` has no example");
            for e in examples {
                assert!(
                    e.starts_with(&path.replace("gatewayctl", "gatewayctl --json"))
                        || e.starts_with(&path),
                    "`{e}` is not an example of `{path}`"
                );
                if let Err(err) = Cli::try_parse_from(e.split_whitespace()) {
                    panic!("`{e}` does not parse: {err}");
                }
            }
        }
    }

    #[test]
    fn times_read_as_the_admin_api_writes_them() -> anyhow::Result<()> {
        for t in [
            "2026-11-23T10:00:00Z",
            "2026-11-23T10:00:00.120Z",
            "2026-11-23T10:00:00.123456Z",
            "2026-11-23T10:00:00.123456789Z",
        ] {
            let parsed: DateTime<Utc> = t.parse()?;
            assert_eq!(serde_json::to_value(parsed)?, Value::String(time(&parsed)));
            assert_eq!(time(&parsed), t);
        }
        Ok(())
    }

    #[test]
    fn queries_name_only_the_given_parameters() {
        assert_eq!(query("keys", &[("tenant", None)]), "keys");
        assert_eq!(
            query(
                "rate-limits",
                &[("tenant", Some("acme")), ("key", Some("key_1"))]
            ),
            "rate-limits?tenant=acme&key=key_1"
        );
        assert_eq!(
            query(
                "reports/explain",
                &[("from", None), ("to", Some("2026-W48"))]
            ),
            "reports/explain?to=2026-W48"
        );
    }

    #[test]
    fn csv_cells_are_quoted_only_when_needed() {
        assert_eq!(csv_cell("alpha"), "alpha");
        assert_eq!(csv_cell("a,b"), "\"a,b\"");
        assert_eq!(csv_cell("say \"hi\""), "\"say \"\"hi\"\"\"");
    }
}
