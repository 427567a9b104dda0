//! `gatewayctl usage`: a tenant's budgets in their current windows (spent, reserved, remaining,
//! reset time); `gatewayctl replicas`: every replica's routing state.

use reqwest::Method;

use super::{opt, query, table, time, Admin, Answer, Reply};
use crate::budget::engine::UsageRow;
use crate::routes::budgets::TenantUsage;
use crate::types::price::Usd;

/// Call the admin API for `tenant`'s usage and render it.
pub(super) async fn run(admin: &Admin, tenant: &str) -> anyhow::Result<Reply> {
    let path = query("usage", &[("tenant", Some(tenant))]);
    let a: Answer<TenantUsage> = admin.call(Method::GET, &path, None).await?;
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
        a.body.data.iter().map(row).collect(),
    );
    Ok(a.reply(h))
}

fn row(r: &UsageRow) -> Vec<String> {
    let (p, st) = (&r.policy, &r.state);
    vec![
        p.id.clone(),
        p.scope.label(),
        p.window.as_str().into(),
        p.action.as_str().into(),
        format!("{} / {}", st.spent_tokens, Usd(st.spent_micros)),
        format!("{} / {}", st.reserved_tokens, Usd(st.reserved_micros)),
        format!(
            "{} / {}",
            opt(r.remaining_tokens),
            opt(r.remaining_micros.map(Usd))
        ),
        time(&r.resets_at),
    ]
}

/// `gatewayctl replicas`: every replica's routing state, its concurrency limit (adaptive or
/// fixed), its breaker and why it opened.
pub(super) async fn replicas(admin: &Admin) -> anyhow::Result<Reply> {
    let a: Answer<serde_json::Value> = admin.call(Method::GET, "replicas", None).await?;
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "-".into(),
        v => v.to_string(),
    };
    let mut rows = Vec::new();
    for tier in a.body["data"].as_array().into_iter().flatten() {
        for r in tier["replicas"].as_array().into_iter().flatten() {
            rows.push(vec![
                text(&tier["tier"]),
                text(&r["name"]),
                text(&r["in_flight"]),
                format!(
                    "{}/{}{}",
                    text(&r["concurrency_limit"]),
                    text(&r["max_concurrency"]),
                    if r["limit_probing"] == true {
                        " (probing)"
                    } else if r["adaptive_limit"] == true {
                        " (adaptive)"
                    } else {
                        ""
                    }
                ),
                text(&r["breaker"]),
                text(&r["tripped_by"]),
                text(&r["consecutive_failures"]),
                format!(
                    "{}/{}",
                    text(&r["window_failures"]),
                    text(&r["window_requests"])
                ),
            ]);
        }
    }
    let h = table(
        &[
            "TIER",
            "REPLICA",
            "IN FLIGHT",
            "LIMIT/MAX",
            "BREAKER",
            "TRIPPED BY",
            "FAILURES IN A ROW",
            "FAILED/REQUESTS (WINDOW)",
        ],
        rows,
    );
    Ok(a.reply(h))
}
