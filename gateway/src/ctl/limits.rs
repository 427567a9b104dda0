//! `gatewayctl limits …`: rate limits (requests and tokens per minute, per tenant or key).

use clap::Subcommand;
use reqwest::Method;
use serde_json::json;

use super::{opt, query, table, Admin, Answer, Reply};
use crate::budget::RateLimit;
use crate::routes::budgets::DeletedRateLimit;

/// `gatewayctl limits …`
#[derive(Debug, Subcommand)]
pub enum LimitCommand {
    /// Set requests and/or tokens per minute for a tenant (or one of its keys).
    #[command(
        after_help = "Example:\n  gatewayctl limits set --tenant acme --rpm 600 --tpm 200000"
    )]
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
    #[command(after_help = "Example:\n  gatewayctl limits list --tenant acme")]
    List {
        /// Only this tenant's limits.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Delete a rate limit.
    #[command(after_help = "Example:\n  gatewayctl limits delete --tenant acme")]
    Delete {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// The key's limit instead of the tenant's.
        #[arg(long)]
        key: Option<String>,
    },
}

const HEADER: &[&str] = &["TENANT", "KEY", "RPM", "TPM"];

impl LimitCommand {
    /// Call the admin API and render its answer.
    pub(super) async fn run(self, admin: &Admin) -> anyhow::Result<Reply> {
        Ok(match self {
            Self::Set {
                tenant,
                key,
                rpm,
                tpm,
            } => {
                let body = json!({"tenant": tenant, "key": key, "rpm": rpm, "tpm": tpm});
                let a: Answer<RateLimit> =
                    admin.call(Method::PUT, "rate-limits", Some(body)).await?;
                let h = format!("rate limit set\n{}", table(HEADER, vec![row(&a.body)]));
                a.reply(h)
            }
            Self::List { tenant } => {
                let path = query("rate-limits", &[("tenant", tenant.as_deref())]);
                admin.list(&path, HEADER, row).await?
            }
            Self::Delete { tenant, key } => {
                let path = query(
                    "rate-limits",
                    &[("tenant", Some(tenant.as_str())), ("key", key.as_deref())],
                );
                let a: Answer<DeletedRateLimit> = admin.call(Method::DELETE, &path, None).await?;
                a.reply("deleted rate limit".into())
            }
        })
    }
}

fn row(l: &RateLimit) -> Vec<String> {
    vec![
        l.tenant_id.clone(),
        opt(l.key_id.as_deref()),
        opt(l.rpm),
        opt(l.tpm),
    ]
}
