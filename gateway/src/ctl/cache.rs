//! `gatewayctl cache …`: a tenant's response-cache policy (exact and semantic layers).

use clap::Subcommand;
use reqwest::Method;
use serde_json::{Map, Value};

use super::{opt, segment, table, Admin, Answer, Reply};
use crate::cache::CacheMode;
use crate::routes::budgets::CachePolicyView;

/// `gatewayctl cache …`
#[derive(Debug, Subcommand)]
pub enum CacheCommand {
    /// Set a tenant's cache policy (options left out take the gateway config's defaults).
    #[command(
        after_help = "Example:\n  gatewayctl cache set --tenant acme --mode semantic --min-precision 0.95 --ttl-secs 600"
    )]
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
    #[command(after_help = "Example:\n  gatewayctl cache show --tenant acme")]
    Show {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
    },
    /// Drop a tenant's own policy (back to the config's defaults).
    #[command(after_help = "Example:\n  gatewayctl cache reset --tenant acme")]
    Reset {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
    },
}

impl CacheCommand {
    /// Call the admin API and render the policy it answers with.
    pub(super) async fn run(self, admin: &Admin) -> anyhow::Result<Reply> {
        let (method, tenant, body) = match self {
            Self::Set {
                tenant,
                mode,
                ttl_secs,
                min_precision,
                any_temperature,
                tools,
            } => {
                let mut body = Map::new();
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
            Self::Show { tenant } => (Method::GET, tenant, None),
            Self::Reset { tenant } => (Method::DELETE, tenant, None),
        };
        let a: Answer<CachePolicyView> = admin
            .call(
                method,
                &format!("tenants/{}/cache-policy", segment(&tenant)),
                body,
            )
            .await?;
        let h = render(&a.body);
        Ok(a.reply(h))
    }
}

fn render(v: &CachePolicyView) -> String {
    let e = &v.effective;
    let semantic = match &v.verifier_point {
        Some(p) => format!(
            "verifier threshold {:.3} (held-out precision {:.3}, recall {:.3})",
            p.threshold, p.precision, p.recall
        ),
        None if v.semantic_ready => {
            "no point of the verifier's curve reaches this precision: semantic hits off".into()
        }
        None => "semantic layer not loaded on this replica".into(),
    };
    let calibration = match &v.calibration {
        Some(c) if c.lookups > 0 => {
            let rows = c
                .settings
                .iter()
                .map(|s| {
                    let own = e
                        .min_precision
                        .is_some_and(|p| (p - s.min_precision).abs() < 1e-9);
                    vec![
                        format!(
                            "{:?}{}",
                            s.min_precision,
                            if own { " (in force)" } else { "" }
                        ),
                        s.point
                            .map_or("-".into(), |p| format!("{:.3}", p.threshold)),
                        s.point
                            .map_or("-".into(), |p| format!("{:.3}", p.precision)),
                        s.point.map_or("-".into(), |p| format!("{:.3}", p.recall)),
                        s.semantic_hit_rate
                            .map_or("-".into(), |r| format!("{:.1}%", r * 100.0)),
                        s.semantic_hits.to_string(),
                    ]
                })
                .collect();
            format!(
                "\n\nWhat each setting would answer of this tenant's own semantic lookups on this \
                 replica ({} seen, {} with no candidate at all):\n{}",
                c.lookups,
                c.without_candidate,
                table(
                    &[
                        "MIN PRECISION",
                        "THRESHOLD",
                        "HELD-OUT PRECISION",
                        "HELD-OUT RECALL",
                        "SEMANTIC HIT RATE",
                        "HITS"
                    ],
                    rows
                )
            )
        }
        Some(_) => "\n\nNo semantic lookup of this tenant seen on this replica yet.".into(),
        None => String::new(),
    };
    format!(
        "{}\n{}{calibration}",
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
                v.tenant.clone(),
                opt(e.mode.map(CacheMode::as_str)),
                opt(e.ttl_secs),
                // `{:?}`: as the JSON has it (`1.0`, not `1`).
                e.min_precision
                    .map_or_else(|| "-".into(), |p| format!("{p:?}")),
                e.any_temperature.to_string(),
                e.tools.to_string(),
                if v.policy.is_none() {
                    "no (defaults)".into()
                } else {
                    "yes".into()
                },
            ]],
        ),
        semantic
    )
}
