//! `gatewayctl budgets …`: budget policies (token and USD limits per tenant, key or tag and
//! window) and a tenant's fail mode.

use clap::Subcommand;
use reqwest::Method;
use serde_json::json;

use super::{opt, query, segment, table, Admin, Answer, Reply};
use crate::budget::{BudgetPolicy, Limit};
use crate::routes::budgets::{DeletedBudget, TenantFailMode};
use crate::types::price::Usd;

/// `gatewayctl budgets …`
#[derive(Debug, Subcommand)]
pub enum BudgetCommand {
    /// Create a policy, or replace the one with the same tenant, scope and window (its spend
    /// so far is kept).
    #[command(
        after_help = "Examples:\n  gatewayctl budgets set --tenant acme --window month --usd 500 --warn-percent 80\n  gatewayctl budgets set --tenant acme --scope tag:feature=search --window day --tokens 2000000"
    )]
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
    #[command(after_help = "Example:\n  gatewayctl budgets list --tenant acme")]
    List {
        /// Only this tenant's policies (id or name).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Delete a policy.
    #[command(after_help = "Example:\n  gatewayctl budgets delete bud_0123abcd")]
    Delete {
        /// Policy id (`bud_…`).
        id: String,
    },
    /// What a tenant's requests do while the budget store (Redis) is unreachable.
    #[command(after_help = "Example:\n  gatewayctl budgets fail-mode --tenant acme open")]
    FailMode {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// `closed` (503) or `open` (admit against a local share of each limit).
        mode: String,
    },
}

const HEADER: &[&str] = &[
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

impl BudgetCommand {
    /// Call the admin API and render its answer.
    pub(super) async fn run(self, admin: &Admin) -> anyhow::Result<Reply> {
        Ok(match self {
            Self::Set {
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
                let a: Answer<BudgetPolicy> =
                    admin.call(Method::POST, "budgets", Some(body)).await?;
                let h = format!("budget set\n{}", table(HEADER, vec![row(&a.body)]));
                a.reply(h)
            }
            Self::List { tenant } => {
                let path = query("budgets", &[("tenant", tenant.as_deref())]);
                admin.list(&path, HEADER, row).await?
            }
            Self::Delete { id } => {
                let a: Answer<DeletedBudget> = admin
                    .call(Method::DELETE, &format!("budgets/{id}"), None)
                    .await?;
                a.reply(format!("deleted budget {id}"))
            }
            Self::FailMode { tenant, mode } => {
                let a: Answer<TenantFailMode> = admin
                    .call(
                        Method::PUT,
                        &format!("tenants/{}/fail-mode", segment(&tenant)),
                        Some(json!({"mode": mode})),
                    )
                    .await?;
                let h = format!("tenant {tenant} now fails {}", a.body.fail_mode.as_str());
                a.reply(h)
            }
        })
    }
}

/// A limit's tokens and USD, `-` where unset.
fn limit_cells(l: &Limit) -> (String, String) {
    (opt(l.tokens), opt(l.micros.map(Usd)))
}

fn row(p: &BudgetPolicy) -> Vec<String> {
    let (tokens, usd) = limit_cells(&p.limit);
    let (hard_tokens, hard_usd) = limit_cells(&p.hard_limit);
    vec![
        p.id.clone(),
        p.tenant_id.clone(),
        p.scope.label(),
        p.window.as_str().into(),
        tokens,
        usd,
        p.action.as_str().into(),
        format!("{hard_tokens} / {hard_usd}"),
        opt(p.warn_percent),
    ]
}
