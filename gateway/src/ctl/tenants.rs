//! `gatewayctl tenants …`: create, list and delete tenants.

use clap::Subcommand;
use reqwest::Method;
use serde_json::json;

use super::{segment, time, Admin, Answer, Reply};
use crate::routes::admin::DeletedTenant;
use crate::store::Tenant;

/// `gatewayctl tenants …`
#[derive(Debug, Subcommand)]
pub enum TenantCommand {
    /// Create a tenant.
    #[command(after_help = "Example:\n  gatewayctl tenants create acme")]
    Create {
        /// Unique name (letters, digits, '-', '_', '.').
        name: String,
    },
    /// List tenants.
    #[command(
        after_help = "Examples:\n  gatewayctl tenants list\n  gatewayctl --json tenants list"
    )]
    List,
    /// Delete a tenant and revoke all its keys.
    #[command(after_help = "Example:\n  gatewayctl tenants delete acme")]
    Delete {
        /// Tenant id or name.
        tenant: String,
    },
}

impl TenantCommand {
    /// Call the admin API and render its answer.
    pub(super) async fn run(self, admin: &Admin) -> anyhow::Result<Reply> {
        Ok(match self {
            Self::Create { name } => {
                let a: Answer<Tenant> = admin
                    .call(Method::POST, "tenants", Some(json!({"name": name})))
                    .await?;
                let h = format!("created tenant {} ({})", a.body.name, a.body.id);
                a.reply(h)
            }
            Self::List => {
                let row = |t: &Tenant| vec![t.id.clone(), t.name.clone(), time(&t.created_at)];
                admin
                    .list("tenants", &["ID", "NAME", "CREATED"], row)
                    .await?
            }
            Self::Delete { tenant } => {
                let a: Answer<DeletedTenant> = admin
                    .call(
                        Method::DELETE,
                        &format!("tenants/{}", segment(&tenant)),
                        None,
                    )
                    .await?;
                let h = format!("deleted tenant {} and revoked its keys", a.body.name);
                a.reply(h)
            }
        })
    }
}
