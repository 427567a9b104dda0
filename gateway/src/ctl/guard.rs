//! `gatewayctl guard …` (a tenant's agent-loop policy) and `gatewayctl sessions …` (the
//! sessions the guard tracks: list, show, clear a throttled or blocked one).

use clap::Subcommand;
use reqwest::Method;
use serde_json::{Map, Value};

use super::{opt, query, segment, table, time, Admin, Answer, Reply};
use crate::guard::decide::describe;
use crate::routes::guard::{ClearedSession, GuardPolicyView, SessionView};
use crate::routes::List;
use crate::types::price::Usd;

/// `gatewayctl guard …`
#[derive(Debug, Subcommand)]
pub enum GuardCommand {
    /// Set a tenant's loop policy (options left out take the gateway config's defaults).
    #[command(
        after_help = "Examples:\n  gatewayctl guard set --tenant acme --action throttle --cooldown-secs 120\n  gatewayctl guard set --tenant acme --action block --repeats 4 --similarity 0.95"
    )]
    Set {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// flag (answer, with the x-gateway-loop header), throttle (429 and a cooldown for the
        /// session) or block (429 until `gatewayctl sessions clear`).
        #[arg(long)]
        action: Option<String>,
        /// Repeats of a step (or of a 2-3 step cycle) that make a loop, at least 2.
        #[arg(long)]
        repeats: Option<u32>,
        /// How far back the session window counts a repeated turn, seconds.
        #[arg(long)]
        window_secs: Option<u64>,
        /// Cosine similarity above which two texts are the same step (1: exact repeats only).
        #[arg(long)]
        similarity: Option<f64>,
        /// How long a throttled session is refused, seconds.
        #[arg(long)]
        cooldown_secs: Option<u64>,
    },
    /// Show a tenant's loop policy and the one in force.
    #[command(after_help = "Example:\n  gatewayctl guard show --tenant acme")]
    Show {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
    },
    /// Drop a tenant's own loop policy (back to the config's defaults).
    #[command(after_help = "Example:\n  gatewayctl guard reset --tenant acme")]
    Reset {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
    },
}

impl GuardCommand {
    /// Call the admin API and render the policy it answers with.
    pub(super) async fn run(self, admin: &Admin) -> anyhow::Result<Reply> {
        let (method, tenant, body) = match self {
            Self::Set {
                tenant,
                action,
                repeats,
                window_secs,
                similarity,
                cooldown_secs,
            } => {
                let mut body = Map::new();
                for (field, value) in [
                    ("action", action.map(Value::from)),
                    ("repeats", repeats.map(Value::from)),
                    ("window_secs", window_secs.map(Value::from)),
                    ("similarity", similarity.map(Value::from)),
                    ("cooldown_secs", cooldown_secs.map(Value::from)),
                ] {
                    if let Some(v) = value {
                        body.insert(field.into(), v);
                    }
                }
                (Method::PUT, tenant, Some(Value::Object(body)))
            }
            Self::Show { tenant } => (Method::GET, tenant, None),
            Self::Reset { tenant } => (Method::DELETE, tenant, None),
        };
        let a: Answer<GuardPolicyView> = admin
            .call(
                method,
                &format!("tenants/{}/guard-policy", segment(&tenant)),
                body,
            )
            .await?;
        let e = &a.body.effective;
        let h = table(
            &[
                "TENANT",
                "ACTION",
                "REPEATS",
                "WINDOW (S)",
                "SIMILARITY",
                "COOLDOWN (S)",
                "OWN POLICY",
            ],
            vec![vec![
                a.body.tenant.clone(),
                opt(e.action.map(crate::guard::LoopAction::as_str)),
                opt(e.repeats),
                opt(e.window_secs),
                e.similarity
                    .map_or_else(|| "-".into(), |s| format!("{s:?}")),
                opt(e.cooldown_secs),
                if a.body.policy.is_none() {
                    "no (defaults)".into()
                } else {
                    "yes".into()
                },
            ]],
        );
        Ok(a.reply(h))
    }
}

/// `gatewayctl sessions …`
#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// A tenant's sessions, most recently seen first (every replica's with the Redis store).
    #[command(
        after_help = "Examples:\n  gatewayctl sessions list --tenant acme\n  gatewayctl sessions list --tenant acme --status blocked"
    )]
    List {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// Only sessions with this status: ok, flagged, throttled, blocked.
        #[arg(long)]
        status: Option<String>,
        /// Most sessions shown.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// One session: its counts, what it cost, the loop found, its cooldown or block.
    #[command(after_help = "Example:\n  gatewayctl sessions show --tenant acme run-42")]
    Show {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// Session id (`x-session-id`, or as `sessions list` shows it).
        session: String,
    },
    /// Clear a session: forget its window, cooldown and block, so it is answered again.
    #[command(after_help = "Example:\n  gatewayctl sessions clear --tenant acme run-42")]
    Clear {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// Session id.
        session: String,
    },
}

const HEADER: &[&str] = &[
    "SESSION",
    "STATUS",
    "REQUESTS",
    "FLAGGED",
    "REFUSED",
    "COST",
    "AVOIDED",
    "LAST SEEN",
    "LOOP",
];

fn row(s: &SessionView) -> Vec<String> {
    vec![
        s.session.clone(),
        s.status.clone(),
        s.requests.to_string(),
        s.flagged.to_string(),
        s.refused.to_string(),
        Usd(s.cost_micros).to_string(),
        Usd(s.avoided_micros).to_string(),
        time(&s.last_seen),
        opt(s
            .last_loop
            .as_ref()
            .map(|l| describe(&l.what, l.repeats, l.period))),
    ]
}

impl SessionCommand {
    /// Call the admin API and render what it answers.
    pub(super) async fn run(self, admin: &Admin) -> anyhow::Result<Reply> {
        match self {
            Self::List {
                tenant,
                status,
                limit,
            } => {
                let limit = limit.to_string();
                let path = query(
                    &format!("tenants/{}/sessions", segment(&tenant)),
                    &[
                        ("limit", Some(limit.as_str())),
                        ("status", status.as_deref()),
                    ],
                );
                let a: Answer<List<SessionView>> = admin.call(Method::GET, &path, None).await?;
                let h = table(HEADER, a.body.data.iter().map(row).collect());
                Ok(a.reply(h))
            }
            Self::Show { tenant, session } => {
                let path = format!(
                    "tenants/{}/sessions/{}",
                    segment(&tenant),
                    segment(&session)
                );
                let a: Answer<SessionView> = admin.call(Method::GET, &path, None).await?;
                let s = &a.body;
                let mut h = table(HEADER, vec![row(s)]);
                if let Some(until) = &s.cooldown_until {
                    h.push_str(&format!("\nthrottled until {}", time(until)));
                }
                if let Some(since) = &s.blocked_at {
                    h.push_str(&format!(
                        "\nblocked since {}; clear it with: gatewayctl sessions clear --tenant {} {}",
                        time(since),
                        tenant,
                        s.session
                    ));
                }
                Ok(a.reply(h))
            }
            Self::Clear { tenant, session } => {
                let path = format!(
                    "tenants/{}/sessions/{}",
                    segment(&tenant),
                    segment(&session)
                );
                let a: Answer<ClearedSession> = admin.call(Method::DELETE, &path, None).await?;
                let h = format!(
                    "cleared session {} of tenant {}: its next request is answered afresh",
                    a.body.session, a.body.tenant
                );
                Ok(a.reply(h))
            }
        }
    }
}
