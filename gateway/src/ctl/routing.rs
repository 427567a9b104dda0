//! `gatewayctl routing …`: a tenant's routing policy for `model: "auto"`.

use clap::Subcommand;
use reqwest::Method;
use serde_json::{json, Value};

use super::{segment, table, Admin, Answer, Reply};
use crate::routes::routing::RoutingPolicyView;

/// `gatewayctl routing …`
#[derive(Debug, Subcommand)]
pub enum RoutingCommand {
    /// Set a tenant's routing policy: a named point on the classifier's held-out curve, or an
    /// explicit share of large calls.
    #[command(
        after_help = "Examples:\n  gatewayctl routing set --tenant acme --policy cost\n  gatewayctl routing set --tenant acme --large-share 0.3"
    )]
    Set {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// quality (recover 95% of the quality gap between the tiers), balanced (80%) or cost
        /// (50%), each at the least share of large calls.
        #[arg(
            long,
            conflicts_with = "large_share",
            required_unless_present = "large_share"
        )]
        policy: Option<String>,
        /// Share of routed requests sent to the large tier (0..1).
        #[arg(long)]
        large_share: Option<f64>,
    },
    /// Show a tenant's routing policy, the one in force and what it means on the held-out curve.
    #[command(after_help = "Example:\n  gatewayctl routing show --tenant acme")]
    Show {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
    },
    /// Drop a tenant's own routing policy (back to the config's default).
    #[command(after_help = "Example:\n  gatewayctl routing reset --tenant acme")]
    Reset {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
    },
}

impl RoutingCommand {
    /// Call the admin API and render the policy it answers with.
    pub(super) async fn run(self, admin: &Admin) -> anyhow::Result<Reply> {
        let (method, tenant, body) = match self {
            Self::Set {
                tenant,
                policy,
                large_share,
            } => {
                let body = match (policy, large_share) {
                    (Some(p), _) => json!({ "policy": p }),
                    (None, Some(s)) => json!({ "large_share": s }),
                    (None, None) => Value::Object(Default::default()),
                };
                (Method::PUT, tenant, Some(body))
            }
            Self::Show { tenant } => (Method::GET, tenant, None),
            Self::Reset { tenant } => (Method::DELETE, tenant, None),
        };
        let path = format!("tenants/{}/routing-policy", segment(&tenant));
        let a: Answer<RoutingPolicyView> = admin.call(method, &path, body).await?;
        let b = &a.body;
        let policy = match (b.effective.policy, b.effective.large_share) {
            (_, Some(s)) => format!("large share {s:.2}"),
            (Some(p), None) => serde_json::to_value(p)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            (None, None) => "-".into(),
        };
        let pct = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{:.0}%", v * 100.0));
        let h = table(
            &[
                "TENANT",
                "POLICY",
                "LARGE CALLS (HELD OUT)",
                "QUALITY GAP RECOVERED",
                "OWN POLICY",
            ],
            vec![vec![
                b.tenant.clone(),
                policy,
                pct(b.expected_large_share),
                pct(b.expected_quality_recovered),
                if b.policy.is_none() {
                    "no (defaults)".into()
                } else {
                    "yes".into()
                },
            ]],
        );
        Ok(a.reply(h))
    }
}
