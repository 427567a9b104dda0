//! `gatewayctl`: the admin CLI. It talks only to the admin API (`--url`, `GATEWAY_ADMIN_TOKEN`),
//! so it works the same against one gateway or a fleet behind a load balancer.

use std::io::Write;

use anyhow::{anyhow, bail, Context as _};
use clap::{Parser, Subcommand};
use comfy_table::{presets::UTF8_BORDERS_ONLY, Table};
use serde_json::{json, Value};

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
    /// A tenant's budgets in their current windows: spent, reserved, remaining, reset time.
    Usage {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
    },
}

/// `gatewayctl budgets …`
#[derive(Debug, Subcommand)]
pub enum BudgetCommand {
    /// Create a policy, or replace the one with the same tenant, scope and window (its spend
    /// so far is kept).
    Set {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// `tenant`, `key:<key id>` or `tag:<name>=<value>`.
        #[arg(long, default_value = "tenant")]
        scope: String,
        /// minute, hour, day, week (ISO, UTC) or month.
        #[arg(long)]
        window: String,
        /// Most tokens (prompt + completion) per window.
        #[arg(long)]
        tokens: Option<u64>,
        /// Most USD per window.
        #[arg(long)]
        usd: Option<f64>,
        /// reject (429), downgrade (serve from the small tier) or flag (count and mark only).
        #[arg(long, default_value = "reject")]
        action: String,
        /// For downgrade: tokens past which even the small tier is refused.
        #[arg(long)]
        hard_tokens: Option<u64>,
        /// For downgrade: USD past which even the small tier is refused.
        #[arg(long)]
        hard_usd: Option<f64>,
        /// Warn (response header) at this percentage of the limit.
        #[arg(long)]
        warn_percent: Option<u8>,
    },
    /// List policies.
    List {
        /// Only this tenant's policies (id or name).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Delete a policy.
    Delete {
        /// Policy id (`bud_…`).
        id: String,
    },
    /// What a tenant's requests do while the budget store (Redis) is unreachable.
    FailMode {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// `closed` (503) or `open` (admit against a local share of each limit).
        mode: String,
    },
}

/// `gatewayctl cache …`
#[derive(Debug, Subcommand)]
pub enum CacheCommand {
    /// Set a tenant's cache policy (options left out take the gateway config's defaults).
    Set {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// off, exact, or semantic (exact first, then paraphrases).
        #[arg(long)]
        mode: Option<String>,
        /// Time to live of cached answers, seconds.
        #[arg(long)]
        ttl_secs: Option<u64>,
        /// Precision a semantic hit must have on the verifier's held-out curve (e.g. 0.95:
        /// fewer, safer hits; 0.8: more hits, more false ones).
        #[arg(long)]
        min_precision: Option<f64>,
        /// Also cache sampled requests (temperature absent or above 0).
        #[arg(long)]
        any_temperature: bool,
        /// Also cache requests with tools (exact layer only).
        #[arg(long)]
        tools: bool,
    },
    /// Show a tenant's policy, the one in force, and its point on the verifier's curve.
    Show {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
    },
    /// Drop a tenant's own policy (back to the config's defaults).
    Reset {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
    },
}

/// `gatewayctl limits …`
#[derive(Debug, Subcommand)]
pub enum LimitCommand {
    /// Set requests and/or tokens per minute for a tenant (or one of its keys).
    Set {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// Only this key (id); default: the whole tenant.
        #[arg(long)]
        key: Option<String>,
        /// Requests per minute.
        #[arg(long)]
        rpm: Option<u64>,
        /// Tokens per minute (prompt estimate + max_tokens).
        #[arg(long)]
        tpm: Option<u64>,
    },
    /// List rate limits.
    List {
        /// Only this tenant's limits.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Delete a rate limit.
    Delete {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// The key's limit instead of the tenant's.
        #[arg(long)]
        key: Option<String>,
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

/// `gatewayctl report …`
#[derive(Debug, Subcommand)]
pub enum ReportCommand {
    /// Cost, requests, tokens, cache savings and waste by tenant, model, tier and feature, with
    /// the change from the previous week.
    Weekly {
        /// ISO week, e.g. 2026-W48 (default: this week).
        #[arg(long)]
        week: Option<String>,
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Why the cost changed between two weeks: additive terms and top contributors.
    Explain {
        /// First week (default: the week before --to).
        #[arg(long)]
        from: Option<String>,
        /// Second week (default: this week).
        #[arg(long)]
        to: Option<String>,
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Keys/sessions repeating the same request at a steady cadence (agent loops), with cost.
    Loops {
        /// Look back this many hours.
        #[arg(long, default_value_t = 24)]
        hours: u32,
        /// Least repeats of the same request.
        #[arg(long, default_value_t = 5)]
        min_repeats: usize,
    },
}

/// `gatewayctl prices …`
#[derive(Debug, Subcommand)]
pub enum PriceCommand {
    /// Set a model's price from now (or from --from).
    Set {
        /// Served model name.
        model: String,
        /// USD per 1M uncached input tokens.
        #[arg(long)]
        input: f64,
        /// USD per 1M output tokens.
        #[arg(long)]
        output: f64,
        /// USD per 1M cached input tokens (default: the input price).
        #[arg(long)]
        cached_input: Option<f64>,
        /// Effective time, RFC 3339 (default: now).
        #[arg(long)]
        from: Option<String>,
    },
    /// List prices with their history.
    List,
}

/// `gatewayctl tenants …`
#[derive(Debug, Subcommand)]
pub enum TenantCommand {
    /// Create a tenant.
    Create {
        /// Unique name (letters, digits, '-', '_', '.').
        name: String,
    },
    /// List tenants.
    List,
    /// Delete a tenant and revoke all its keys.
    Delete {
        /// Tenant id or name.
        tenant: String,
    },
}

/// `gatewayctl keys …`
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Create a key; the secret is printed once.
    Create {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// Label for the key.
        #[arg(long)]
        name: Option<String>,
        /// Attribution tag `key=value` (repeatable).
        #[arg(long = "tag", value_parser = parse_tag)]
        tags: Vec<(String, String)>,
    },
    /// List keys.
    List {
        /// Only this tenant's keys (id or name).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Revoke a key (takes effect on every replica within the key refresh interval).
    Revoke {
        /// Key id (`key_…`).
        id: String,
    },
}

fn parse_tag(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

/// A thin client for the admin API.
struct Admin {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl Admin {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let url = format!("{}/admin/v1/{path}", self.url.trim_end_matches('/'));
        let mut req = self.http.request(method, &url).bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("cannot reach the gateway at {}", self.url))?;
        let status = resp.status();
        let value: Value = resp.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            let message = value
                .pointer("/error/message")
                .and_then(Value::as_str)
                .unwrap_or("no error message");
            bail!("{status}: {message}");
        }
        Ok(value)
    }
}

fn s(v: &Value, field: &str) -> String {
    match v.get(field) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => "-".into(),
        Some(other) => other.to_string(),
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

fn tags(v: &Value) -> String {
    v.get("tags")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default()
}

fn list(v: &Value) -> Vec<Value> {
    v.get("data")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
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
    use reqwest::Method;
    let (value, human) = match cli.command {
        Command::Tenants { command } => match command {
            TenantCommand::Create { name } => {
                let v = admin
                    .call(Method::POST, "tenants", Some(json!({"name": name})))
                    .await?;
                let h = format!("created tenant {} ({})", s(&v, "name"), s(&v, "id"));
                (v, h)
            }
            TenantCommand::List => {
                let v = admin.call(Method::GET, "tenants", None).await?;
                let rows = list(&v)
                    .iter()
                    .map(|t| vec![s(t, "id"), s(t, "name"), s(t, "created_at")])
                    .collect();
                let h = table(&["ID", "NAME", "CREATED"], rows);
                (v, h)
            }
            TenantCommand::Delete { tenant } => {
                let v = admin
                    .call(Method::DELETE, &format!("tenants/{tenant}"), None)
                    .await?;
                let h = format!("deleted tenant {} and revoked its keys", s(&v, "name"));
                (v, h)
            }
        },
        Command::Keys { command } => match command {
            KeyCommand::Create {
                tenant,
                name,
                tags: t,
            } => {
                let tags: serde_json::Map<String, Value> =
                    t.into_iter().map(|(k, v)| (k, Value::String(v))).collect();
                let v = admin
                    .call(
                        Method::POST,
                        "keys",
                        Some(json!({"tenant": tenant, "name": name, "tags": tags})),
                    )
                    .await?;
                let h = format!(
                    "created key {} for tenant {}\n\n    {}\n\nStore it now: it is not shown again.",
                    s(&v, "id"),
                    s(&v, "tenant_name"),
                    s(&v, "key")
                );
                (v, h)
            }
            KeyCommand::List { tenant } => {
                let path = match &tenant {
                    Some(t) => format!("keys?tenant={t}"),
                    None => "keys".into(),
                };
                let v = admin.call(Method::GET, &path, None).await?;
                let rows = list(&v)
                    .iter()
                    .map(|k| {
                        let status = if k.get("revoked_at").is_some_and(|r| !r.is_null()) {
                            "revoked"
                        } else {
                            "active"
                        };
                        vec![
                            s(k, "id"),
                            s(k, "tenant_name"),
                            s(k, "name"),
                            format!("{}…", s(k, "prefix")),
                            tags(k),
                            status.into(),
                            s(k, "created_at"),
                        ]
                    })
                    .collect();
                let h = table(
                    &["ID", "TENANT", "NAME", "KEY", "TAGS", "STATUS", "CREATED"],
                    rows,
                );
                (v, h)
            }
            KeyCommand::Revoke { id } => {
                let v = admin
                    .call(Method::DELETE, &format!("keys/{id}"), None)
                    .await?;
                (v, format!("revoked key {id}"))
            }
        },
        Command::Prices { command } => prices(&admin, command).await?,
        Command::Budgets { command } => budgets(&admin, command).await?,
        Command::Limits { command } => limits(&admin, command).await?,
        Command::Usage { tenant } => usage(&admin, &tenant).await?,
        Command::Cache { command } => cache(&admin, command).await?,
        Command::Report { command, format } => {
            let (value, tables) = report(&admin, command).await?;
            match format {
                Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?,
                Format::Csv => {
                    for (title, t) in tables {
                        writeln!(out, "# {title}")?;
                        for row in std::iter::once(&t.0).chain(t.1.iter()) {
                            let cells: Vec<String> = row.iter().map(|c| csv_cell(c)).collect();
                            writeln!(out, "{}", cells.join(","))?;
                        }
                    }
                }
                Format::Table => {
                    for (title, (header, rows)) in tables {
                        let header: Vec<&str> = header.iter().map(String::as_str).collect();
                        writeln!(out, "{title}\n{}\n", table(&header, rows))?;
                    }
                }
            }
            return Ok(());
        }
    };
    if cli.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
    } else {
        writeln!(out, "{human}")?;
    }
    Ok(())
}

async fn prices(admin: &Admin, command: PriceCommand) -> anyhow::Result<(Value, String)> {
    use reqwest::Method;
    Ok(match command {
        PriceCommand::Set {
            model,
            input,
            output,
            cached_input,
            from,
        } => {
            let body = json!({"model": model, "input": input, "output": output,
                              "cached_input": cached_input, "effective_from": from});
            let v = admin.call(Method::POST, "prices", Some(body)).await?;
            let h = format!(
                "price of {} from {}: input ${}/1M, output ${}/1M, cached input ${}/1M",
                s(&v, "model"),
                s(&v, "effective_from"),
                s(&v, "input_usd_per_mtok"),
                s(&v, "output_usd_per_mtok"),
                s(&v, "cached_input_usd_per_mtok")
            );
            (v, h)
        }
        PriceCommand::List => {
            let v = admin.call(Method::GET, "prices", None).await?;
            let rows = list(&v)
                .iter()
                .map(|p| {
                    vec![
                        s(p, "model"),
                        s(p, "effective_from"),
                        s(p, "input_usd_per_mtok"),
                        s(p, "output_usd_per_mtok"),
                        s(p, "cached_input_usd_per_mtok"),
                    ]
                })
                .collect();
            let h = table(
                &["MODEL", "FROM", "INPUT $/1M", "OUTPUT $/1M", "CACHED $/1M"],
                rows,
            );
            (v, h)
        }
    })
}

fn opt_usd(v: &Value) -> String {
    if v.is_null() {
        "-".into()
    } else {
        format!("{:.6}", v.as_i64().unwrap_or(0) as f64 / 1e6)
    }
}

fn opt_num(v: &Value) -> String {
    if v.is_null() {
        "-".into()
    } else {
        v.to_string()
    }
}

fn scope_label(v: &Value) -> String {
    let scope = &v["scope"];
    match scope["kind"].as_str() {
        Some("key") => format!("key:{}", scope["value"].as_str().unwrap_or_default()),
        Some("tag") => format!(
            "tag:{}={}",
            scope["value"]["name"].as_str().unwrap_or_default(),
            scope["value"]["value"].as_str().unwrap_or_default()
        ),
        _ => "tenant".into(),
    }
}

fn budget_row(p: &Value) -> Vec<String> {
    vec![
        s(p, "id"),
        s(p, "tenant_id"),
        scope_label(p),
        s(p, "window"),
        opt_num(&p["limit"]["tokens"]),
        opt_usd(&p["limit"]["micros"]),
        s(p, "action"),
        format!(
            "{} / {}",
            opt_num(&p["hard_limit"]["tokens"]),
            opt_usd(&p["hard_limit"]["micros"])
        ),
        opt_num(&p["warn_percent"]),
    ]
}

const BUDGET_HEADER: &[&str] = &[
    "ID",
    "TENANT",
    "SCOPE",
    "WINDOW",
    "TOKENS",
    "USD",
    "ACTION",
    "HARD (TOK / USD)",
    "WARN %",
];

async fn budgets(admin: &Admin, command: BudgetCommand) -> anyhow::Result<(Value, String)> {
    use reqwest::Method;
    Ok(match command {
        BudgetCommand::Set {
            tenant,
            scope,
            window,
            tokens,
            usd,
            action,
            hard_tokens,
            hard_usd,
            warn_percent,
        } => {
            let body = json!({"tenant": tenant, "scope": scope, "window": window,
                "limit_tokens": tokens, "limit_usd": usd, "action": action,
                "hard_limit_tokens": hard_tokens, "hard_limit_usd": hard_usd,
                "warn_percent": warn_percent});
            let v = admin.call(Method::POST, "budgets", Some(body)).await?;
            let h = format!("budget set\n{}", table(BUDGET_HEADER, vec![budget_row(&v)]));
            (v, h)
        }
        BudgetCommand::List { tenant } => {
            let path = match &tenant {
                Some(t) => format!("budgets?tenant={t}"),
                None => "budgets".into(),
            };
            let v = admin.call(Method::GET, &path, None).await?;
            let rows = list(&v).iter().map(budget_row).collect();
            (v.clone(), table(BUDGET_HEADER, rows))
        }
        BudgetCommand::Delete { id } => {
            let v = admin
                .call(Method::DELETE, &format!("budgets/{id}"), None)
                .await?;
            (v, format!("deleted budget {id}"))
        }
        BudgetCommand::FailMode { tenant, mode } => {
            let v = admin
                .call(
                    Method::PUT,
                    &format!("tenants/{tenant}/fail-mode"),
                    Some(json!({"mode": mode})),
                )
                .await?;
            let h = format!("tenant {tenant} now fails {}", s(&v, "fail_mode"));
            (v, h)
        }
    })
}

async fn cache(admin: &Admin, command: CacheCommand) -> anyhow::Result<(Value, String)> {
    use reqwest::Method;
    let (method, tenant, body) = match command {
        CacheCommand::Set {
            tenant,
            mode,
            ttl_secs,
            min_precision,
            any_temperature,
            tools,
        } => {
            let mut body = serde_json::Map::new();
            for (field, value) in [
                ("mode", mode.map(Value::from)),
                ("ttl_secs", ttl_secs.map(Value::from)),
                ("min_precision", min_precision.map(Value::from)),
            ] {
                if let Some(v) = value {
                    body.insert(field.into(), v);
                }
            }
            body.insert("any_temperature".into(), Value::from(any_temperature));
            body.insert("tools".into(), Value::from(tools));
            (Method::PUT, tenant, Some(Value::Object(body)))
        }
        CacheCommand::Show { tenant } => (Method::GET, tenant, None),
        CacheCommand::Reset { tenant } => (Method::DELETE, tenant, None),
    };
    let v = admin
        .call(method, &format!("tenants/{tenant}/cache-policy"), body)
        .await?;
    let e = &v["effective"];
    let point = &v["verifier_point"];
    let semantic = if point.is_null() {
        if v["semantic_ready"] == Value::Bool(true) {
            "no point of the verifier's curve reaches this precision: semantic hits off".into()
        } else {
            "semantic layer not loaded on this replica".to_owned()
        }
    } else {
        let num = |f: &str| point[f].as_f64().map_or("-".into(), |v| format!("{v:.3}"));
        format!(
            "verifier threshold {} (held-out precision {}, recall {})",
            num("threshold"),
            num("precision"),
            num("recall")
        )
    };
    let h = format!(
        "{}\n{}",
        table(
            &[
                "TENANT",
                "MODE",
                "TTL (S)",
                "MIN PRECISION",
                "ANY TEMPERATURE",
                "TOOLS",
                "OWN POLICY"
            ],
            vec![vec![
                s(&v, "tenant"),
                s(e, "mode"),
                s(e, "ttl_secs"),
                s(e, "min_precision"),
                s(e, "any_temperature"),
                s(e, "tools"),
                if v["policy"].is_null() {
                    "no (defaults)".into()
                } else {
                    "yes".into()
                },
            ]],
        ),
        semantic
    );
    Ok((v, h))
}

async fn limits(admin: &Admin, command: LimitCommand) -> anyhow::Result<(Value, String)> {
    use reqwest::Method;
    let row = |l: &Value| {
        vec![
            s(l, "tenant_id"),
            s(l, "key_id"),
            opt_num(&l["rpm"]),
            opt_num(&l["tpm"]),
        ]
    };
    let header = &["TENANT", "KEY", "RPM", "TPM"];
    Ok(match command {
        LimitCommand::Set {
            tenant,
            key,
            rpm,
            tpm,
        } => {
            let body = json!({"tenant": tenant, "key": key, "rpm": rpm, "tpm": tpm});
            let v = admin.call(Method::PUT, "rate-limits", Some(body)).await?;
            let h = format!("rate limit set\n{}", table(header, vec![row(&v)]));
            (v, h)
        }
        LimitCommand::List { tenant } => {
            let path = match &tenant {
                Some(t) => format!("rate-limits?tenant={t}"),
                None => "rate-limits".into(),
            };
            let v = admin.call(Method::GET, &path, None).await?;
            let rows = list(&v).iter().map(row).collect();
            (v.clone(), table(header, rows))
        }
        LimitCommand::Delete { tenant, key } => {
            let mut path = format!("rate-limits?tenant={tenant}");
            if let Some(k) = &key {
                path.push_str(&format!("&key={k}"));
            }
            let v = admin.call(Method::DELETE, &path, None).await?;
            (v, "deleted rate limit".into())
        }
    })
}

async fn usage(admin: &Admin, tenant: &str) -> anyhow::Result<(Value, String)> {
    let v = admin
        .call(
            reqwest::Method::GET,
            &format!("usage?tenant={tenant}"),
            None,
        )
        .await?;
    let rows = list(&v)
        .iter()
        .map(|r| {
            let p = &r["policy"];
            let st = &r["state"];
            vec![
                s(p, "id"),
                scope_label(p),
                s(p, "window"),
                s(p, "action"),
                format!(
                    "{} / {}",
                    opt_num(&st["spent_tokens"]),
                    opt_usd(&st["spent_micros"])
                ),
                format!(
                    "{} / {}",
                    opt_num(&st["reserved_tokens"]),
                    opt_usd(&st["reserved_micros"])
                ),
                format!(
                    "{} / {}",
                    opt_num(&r["remaining_tokens"]),
                    opt_usd(&r["remaining_micros"])
                ),
                s(r, "resets_at"),
            ]
        })
        .collect();
    let h = table(
        &[
            "BUDGET",
            "SCOPE",
            "WINDOW",
            "ACTION",
            "SPENT (TOK / USD)",
            "RESERVED",
            "REMAINING",
            "RESETS AT",
        ],
        rows,
    );
    Ok((v, h))
}

type Tables = Vec<(String, (Vec<String>, Vec<Vec<String>>))>;

fn csv_cell(c: &str) -> String {
    if c.contains([',', '"', '\n']) {
        format!("\"{}\"", c.replace('"', "\"\""))
    } else {
        c.to_owned()
    }
}

fn usd(v: &Value) -> String {
    format!("{:.4}", v.as_i64().unwrap_or(0) as f64 / 1e6)
}

fn change(this: &Value, prev: &Value) -> String {
    let (a, b) = (this.as_i64().unwrap_or(0), prev.as_i64().unwrap_or(0));
    if b == 0 {
        if a == 0 {
            "0%".into()
        } else {
            "new".into()
        }
    } else {
        format!("{:+.1}%", (a - b) as f64 * 100.0 / b as f64)
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

async fn report(admin: &Admin, command: ReportCommand) -> anyhow::Result<(Value, Tables)> {
    use reqwest::Method;
    let q = |pairs: &[(&str, Option<String>)]| {
        let parts: Vec<String> = pairs
            .iter()
            .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={v}")))
            .collect();
        if parts.is_empty() {
            String::new()
        } else {
            format!("?{}", parts.join("&"))
        }
    };
    Ok(match command {
        ReportCommand::Weekly { week, tenant } => {
            let v = admin
                .call(
                    Method::GET,
                    &format!("reports/weekly{}", q(&[("week", week), ("tenant", tenant)])),
                    None,
                )
                .await?;
            let header = strings(&[
                "KEY",
                "COST $",
                "CHANGE",
                "REQUESTS",
                "$/1K REQ",
                "PROMPT TOK",
                "COMPL TOK",
                "CACHE SAVED $",
                "WASTE $ (LOOPS/RETRIES/ERRORS)",
            ]);
            let line = |l: &Value| {
                let t = &l["this"];
                let req = t["requests"].as_i64().unwrap_or(0);
                let per_k = if req > 0 {
                    t["cost"].as_i64().unwrap_or(0) as f64 / 1e6 * 1000.0 / req as f64
                } else {
                    0.0
                };
                vec![
                    s(l, "key"),
                    usd(&t["cost"]),
                    change(&t["cost"], &l["previous"]["cost"]),
                    req.to_string(),
                    format!("{per_k:.4}"),
                    t["prompt_tokens"].to_string(),
                    t["completion_tokens"].to_string(),
                    usd(&t["saved"]),
                    format!(
                        "{}/{}/{}",
                        usd(&t["waste_loops"]),
                        usd(&t["waste_retries"]),
                        usd(&t["waste_errors"])
                    ),
                ]
            };
            let mut tables: Tables = vec![(
                format!("Week {} (vs {})", s(&v, "week"), s(&v, "previous_week")),
                (header.clone(), vec![line(&v["total"])]),
            )];
            if let Some(by) = v["by"].as_object() {
                for (dim, lines) in by {
                    let rows = lines
                        .as_array()
                        .map(|a| a.iter().map(line).collect())
                        .unwrap_or_default();
                    tables.push((format!("By {dim}"), (header.clone(), rows)));
                }
            }
            (v, tables)
        }
        ReportCommand::Explain { from, to, tenant } => {
            let v = admin
                .call(
                    Method::GET,
                    &format!(
                        "reports/explain{}",
                        q(&[("from", from), ("to", to), ("tenant", tenant)])
                    ),
                    None,
                )
                .await?;
            let total =
                v["to_micros"].as_i64().unwrap_or(0) - v["from_micros"].as_i64().unwrap_or(0);
            let terms = v["terms"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|t| {
                            let m = t["micros"].as_i64().unwrap_or(0);
                            let share = if total != 0 {
                                format!("{:.0}%", m as f64 * 100.0 / total as f64)
                            } else {
                                "-".into()
                            };
                            vec![s(t, "term"), format!("{:+.4}", m as f64 / 1e6), share]
                        })
                        .collect()
                })
                .unwrap_or_default();
            let mut tables: Tables = vec![(
                format!(
                    "Cost {} → {}: ${} → ${} ({:+.4})",
                    s(&v, "from_week"),
                    s(&v, "to_week"),
                    usd(&v["from_micros"]),
                    usd(&v["to_micros"]),
                    total as f64 / 1e6
                ),
                (strings(&["TERM", "CHANGE $", "SHARE"]), terms),
            )];
            if let Some(top) = v["top"].as_object() {
                for (dim, list) in top {
                    let rows = list
                        .as_array()
                        .map(|a| {
                            a.iter()
                                .map(|c| {
                                    let d = c["to_micros"].as_i64().unwrap_or(0)
                                        - c["from_micros"].as_i64().unwrap_or(0);
                                    vec![
                                        s(c, "key"),
                                        usd(&c["from_micros"]),
                                        usd(&c["to_micros"]),
                                        format!("{:+.4}", d as f64 / 1e6),
                                    ]
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    tables.push((
                        format!("Top contributors by {dim}"),
                        (strings(&["KEY", "FROM $", "TO $", "CHANGE $"]), rows),
                    ));
                }
            }
            (v, tables)
        }
        ReportCommand::Loops { hours, min_repeats } => {
            let v = admin
                .call(
                    Method::GET,
                    &format!("reports/loops?hours={hours}&min_repeats={min_repeats}"),
                    None,
                )
                .await?;
            let rows = list(&v)
                .iter()
                .map(|f| {
                    vec![
                        s(f, "tenant"),
                        s(f, "key_id"),
                        s(f, "session"),
                        s(f, "fingerprint"),
                        s(f, "requests"),
                        format!("{:.1}", f["mean_interval_secs"].as_f64().unwrap_or(0.0)),
                        usd(&f["cost_micros"]),
                    ]
                })
                .collect();
            let header = strings(&[
                "TENANT",
                "KEY",
                "SESSION",
                "FINGERPRINT",
                "REPEATS",
                "EVERY (s)",
                "COST $",
            ]);
            (
                v,
                vec![(
                    "Repeated requests at a steady cadence".to_owned(),
                    (header, rows),
                )],
            )
        }
    })
}
