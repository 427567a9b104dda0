//! `gatewayctl report …`: cost reports from the ledger (weekly, explain, loops).

use clap::Subcommand;
use reqwest::Method;

use super::{query, Admin, Answer, Report, Section};
use crate::ledger::loops::{DetectedLoop, LoopTotals};
use crate::ledger::report::{Explanation, ReportLine, RoutingChange, WeeklyReport};
use crate::routes::admin::LoopsReport;
use crate::types::price::Usd;

/// `gatewayctl report …`
#[derive(Debug, Subcommand)]
pub enum ReportCommand {
    /// Cost, requests, tokens, cache savings and waste by tenant, model, tier and feature, with
    /// the change from the previous week.
    #[command(
        after_help = "Examples:\n  gatewayctl report weekly --week 2026-W48\n  gatewayctl report weekly --format csv"
    )]
    Weekly {
        /// ISO week, e.g. 2026-W48 (default: this week).
        #[arg(long)]
        week: Option<String>,
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Why the cost changed between two weeks: additive terms and top contributors.
    #[command(after_help = "Example:\n  gatewayctl report explain --from 2026-W47 --to 2026-W48")]
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
    /// Agent loops: those the guard caught (what each burned before and after it was caught,
    /// and what refusing it avoided), and keys/sessions repeating the same request at a steady
    /// cadence found from billing data alone.
    #[command(after_help = "Example:\n  gatewayctl report loops --hours 24 --format csv")]
    Loops {
        /// Look back this many hours.
        #[arg(long, default_value_t = 24)]
        hours: u32,
        /// Least repeats of the same request (billing data).
        #[arg(long, default_value_t = 5)]
        min_repeats: usize,
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
    },
}

const WEEKLY_HEADER: &[&str] = &[
    "KEY",
    "COST $",
    "CHANGE",
    "REQUESTS",
    "$/1K REQ",
    "PROMPT TOK",
    "COMPL TOK",
    "CACHE SAVED $",
    "WASTE $ (LOOPS/RETRIES/ERRORS)",
];

impl ReportCommand {
    /// Call the admin API and lay its report out in sections.
    pub(super) async fn run(self, admin: &Admin) -> anyhow::Result<Report> {
        Ok(match self {
            Self::Weekly { week, tenant } => {
                let path = query(
                    "reports/weekly",
                    &[("week", week.as_deref()), ("tenant", tenant.as_deref())],
                );
                let a: Answer<WeeklyReport> = admin.call(Method::GET, &path, None).await?;
                let r = &a.body;
                let mut sections = vec![Section {
                    title: format!(
                        "Week {} (vs {}){}",
                        r.week,
                        r.previous_week,
                        synthetic_note(
                            r.total.this.synthetic_requests + r.total.previous.synthetic_requests
                        )
                    ),
                    header: WEEKLY_HEADER,
                    rows: vec![weekly_row(&r.total)],
                }];
                for (dim, lines) in &r.by {
                    sections.push(Section {
                        title: format!("By {dim}"),
                        header: WEEKLY_HEADER,
                        rows: lines.iter().map(weekly_row).collect(),
                    });
                }
                sections.extend(detected_sections(&r.loops.total, &r.loops.top));
                sections.push(fallback_section(
                    r.by.get("tenant").map_or(&[][..], Vec::as_slice),
                    &r.total,
                ));
                sections.push(routing_section(
                    &format!(
                        "Tier router (model: auto), {} vs {}",
                        r.week, r.previous_week
                    ),
                    &r.routing,
                ));
                Report {
                    json: a.json,
                    sections,
                }
            }
            Self::Explain { from, to, tenant } => {
                let path = query(
                    "reports/explain",
                    &[
                        ("from", from.as_deref()),
                        ("to", to.as_deref()),
                        ("tenant", tenant.as_deref()),
                    ],
                );
                let a: Answer<Explanation> = admin.call(Method::GET, &path, None).await?;
                Report {
                    sections: explain_sections(&a.body),
                    json: a.json,
                }
            }
            Self::Loops {
                hours,
                min_repeats,
                tenant,
            } => {
                let (hours, min_repeats) = (hours.to_string(), min_repeats.to_string());
                let path = query(
                    "reports/loops",
                    &[
                        ("hours", Some(hours.as_str())),
                        ("min_repeats", Some(min_repeats.as_str())),
                        ("tenant", tenant.as_deref()),
                    ],
                );
                let a: Answer<LoopsReport> = admin.call(Method::GET, &path, None).await?;
                let r = &a.body;
                let rows = r
                    .data
                    .iter()
                    .map(|f| {
                        vec![
                            f.tenant.clone(),
                            f.key_id.clone(),
                            f.session.clone(),
                            f.fingerprint.clone(),
                            f.requests.to_string(),
                            format!("{:.1}", f.mean_interval_secs),
                            Usd(f.cost_micros).to_string(),
                        ]
                    })
                    .collect();
                let mut sections = detected_sections(&r.detected_total, &r.detected);
                sections.push(Section {
                    title: "Repeated requests at a steady cadence (from billing data)".into(),
                    header: &[
                        "TENANT",
                        "KEY",
                        "SESSION",
                        "FINGERPRINT",
                        "REPEATS",
                        "EVERY (s)",
                        "COST $",
                    ],
                    rows,
                });
                Report {
                    json: a.json,
                    sections,
                }
            }
        })
    }
}

/// The loops the guard caught: a totals line, then one line per loop.
fn detected_sections(total: &LoopTotals, loops: &[DetectedLoop]) -> Vec<Section> {
    let rows = loops
        .iter()
        .map(|l| {
            vec![
                l.tenant.clone(),
                l.session.clone(),
                l.detected_at
                    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                l.repeats.to_string(),
                format!("{} ({})", Usd(l.burned_before_micros), l.requests_before),
                format!("{} ({})", Usd(l.burned_after_micros), l.flagged_requests),
                format!("{} ({})", Usd(l.avoided_micros), l.refused),
            ]
        })
        .collect();
    vec![
        Section {
            title: "Agent loops the guard caught".into(),
            header: &[
                "LOOPS",
                "SESSIONS",
                "BURNED BEFORE CAUGHT $",
                "BURNED AFTER (FLAGGED) $",
                "REFUSED",
                "AVOIDED $",
            ],
            rows: vec![vec![
                total.loops.to_string(),
                total.sessions.to_string(),
                Usd(total.burned_before_micros).to_string(),
                Usd(total.burned_after_micros).to_string(),
                total.refused.to_string(),
                Usd(total.avoided_micros).to_string(),
            ]],
        },
        Section {
            title: "Each loop: cost before it was caught (its earlier steps), after (flagged \
                    requests answered) and avoided (refused requests)"
                .into(),
            header: &[
                "TENANT",
                "SESSION",
                "CAUGHT AT",
                "REPEATS",
                "BEFORE $ (REQ)",
                "AFTER $ (REQ)",
                "AVOIDED $ (REFUSED)",
            ],
            rows,
        },
    ]
}

fn weekly_row(l: &ReportLine) -> Vec<String> {
    let t = &l.this;
    vec![
        l.key.clone(),
        Usd(t.cost).to_string(),
        change(t.cost, l.previous.cost),
        t.requests.to_string(),
        Usd(t.cost_per_thousand()).to_string(),
        t.prompt_tokens.to_string(),
        t.completion_tokens.to_string(),
        Usd(t.saved).to_string(),
        format!(
            "{}/{}/{}",
            Usd(t.waste_loops),
            Usd(t.waste_retries),
            Usd(t.waste_errors)
        ),
    ]
}

/// The tier router's lines: routed requests, large-call share and its change, and what it saved
/// against everything on large.
/// Requests the other tier answered because the chosen one could not, by tenant (those with
/// any in either week) and in total.
fn fallback_section(tenants: &[ReportLine], total: &ReportLine) -> Section {
    let rows = tenants
        .iter()
        .filter(|l| l.this.fallback_requests > 0 || l.previous.fallback_requests > 0)
        .chain(std::iter::once(total))
        .map(|l| {
            vec![
                l.key.clone(),
                l.this.fallback_requests.to_string(),
                Usd(l.this.fallback_cost).to_string(),
                l.previous.fallback_requests.to_string(),
                Usd(l.previous.fallback_cost).to_string(),
            ]
        })
        .collect();
    Section {
        title: "Fallback to the other tier (the chosen tier could not answer)".into(),
        header: &[
            "TENANT",
            "FALLBACKS",
            "COST $",
            "WEEK BEFORE",
            "COST BEFORE $",
        ],
        rows,
    }
}

fn routing_section(title: &str, lines: &[RoutingChange]) -> Section {
    let share = |s: Option<f64>| s.map_or("-".to_owned(), |s| format!("{:.1}%", s * 100.0));
    let rows = lines
        .iter()
        .map(|l| {
            let change = match (l.from_large_share, l.to_large_share) {
                (Some(a), Some(b)) => format!("{:+.1} pt", (b - a) * 100.0),
                (None, Some(_)) => "new".into(),
                _ => "-".into(),
            };
            vec![
                l.key.clone(),
                l.to_requests.to_string(),
                share(l.to_large_share),
                share(l.from_large_share),
                change,
                Usd(l.to_saved_micros).to_string(),
                Usd(l.from_saved_micros).to_string(),
            ]
        })
        .collect();
    Section {
        title: title.to_owned(),
        header: &[
            "TENANT",
            "ROUTED",
            "LARGE SHARE",
            "BEFORE",
            "CHANGE",
            "SAVED VS ALL-LARGE $",
            "SAVED BEFORE $",
        ],
        rows,
    }
}

/// Said after a report's first title when its weeks hold the demo's synthetic history.
fn synthetic_note(rows: i64) -> String {
    if rows > 0 {
        format!(
            " — DEMO DATA: {rows} of these rows are synthetic, seeded by `gateway demo`, not \
             requests"
        )
    } else {
        String::new()
    }
}

fn explain_sections(e: &Explanation) -> Vec<Section> {
    let total = e.to_micros - e.from_micros;
    let terms = e
        .terms
        .iter()
        .map(|t| {
            let share = if total != 0 {
                format!("{:.0}%", t.micros as f64 * 100.0 / total as f64)
            } else {
                "-".into()
            };
            vec![t.term.clone(), format!("{:+}", Usd(t.micros)), share]
        })
        .collect();
    let mut sections = vec![Section {
        title: format!(
            "Cost {} → {}: {:#} → {:#} ({:+}){}",
            e.from_week,
            e.to_week,
            Usd(e.from_micros),
            Usd(e.to_micros),
            Usd(total),
            synthetic_note(e.synthetic_requests)
        ),
        header: &["TERM", "CHANGE $", "SHARE"],
        rows: terms,
    }];
    for (dim, contributors) in &e.top {
        let rows = contributors
            .iter()
            .map(|c| {
                vec![
                    c.key.clone(),
                    Usd(c.from_micros).to_string(),
                    Usd(c.to_micros).to_string(),
                    format!("{:+}", Usd(c.to_micros - c.from_micros)),
                ]
            })
            .collect();
        sections.push(Section {
            title: format!("Top contributors by {dim}"),
            header: &["KEY", "FROM $", "TO $", "CHANGE $"],
            rows,
        });
    }
    sections.push(routing_section(
        &format!(
            "Tier router (model: auto), {} vs {}",
            e.to_week, e.from_week
        ),
        &e.routing,
    ));
    sections
}

/// The relative change from `prev` to `this`: `+12.5%`, `0%`, or `new` from nothing.
fn change(this: i64, prev: i64) -> String {
    if prev == 0 {
        if this == 0 {
            "0%".into()
        } else {
            "new".into()
        }
    } else {
        format!("{:+.1}%", (this - prev) as f64 * 100.0 / prev as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_relative_and_new_from_nothing() {
        assert_eq!(change(150, 100), "+50.0%");
        assert_eq!(change(0, 0), "0%");
        assert_eq!(change(1, 0), "new");
    }
}
