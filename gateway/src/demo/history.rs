//! The demo's labelled synthetic fortnight: ledger rows for the two ISO weeks before the current
//! one, generated (deterministically, from a seed) with known causes of a change in cost, so the
//! dashboard and `gatewayctl report explain` have something true to explain on first launch.
//!
//! Every row is marked `usage_source = 'synthetic'`, which every report counts and says; none of
//! it was a request. The story, from the earlier week to the later one:
//!
//! - traffic grows by about a fifth;
//! - `acme`'s `search` feature makes its prompts four times longer (retrieved context grew): most of the bill's
//!   doubling;
//! - `acme`'s `support-bot` moves a fifth of its calls to the large tier (was a tenth), and the
//!   router sends more of `demo`'s `chat` to large;
//! - the cache hit rate falls (fewer repeats answered from the cache);
//! - one `globex` coding agent gets stuck in a loop for 60 steps, each resending a longer history;
//! - one retry storm: `demo`'s `chat` clients retry through a 20-minute outage.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::config::PriceConfig;
use crate::ledger::report::IsoWeek;
use crate::pricing::{self, PriceBook};
use crate::types::Usage;
use crate::usage::{CacheStatus, UsageEvent, UsageSource};

/// Seed of the generator: the same history on every launch.
pub const SEED: u64 = 20_261_130;

/// Model served by each tier (the demo's simulated models, priced in its config).
const SMALL_MODEL: &str = "sim-small";
const LARGE_MODEL: &str = "sim-large";

/// One stream of traffic: a tenant's feature, in each of the two weeks.
struct Stream {
    tenant: &'static str,
    feature: &'static str,
    /// Model name the clients ask for (`auto`: the tier router chose the tier).
    requested: &'static str,
    /// Sessions the rows are spread over (0: rows carry no session).
    sessions: u32,
    weeks: [Shape; 2],
}

/// A stream's traffic in one week.
#[derive(Clone, Copy)]
struct Shape {
    requests: u32,
    prompt: u32,
    completion: u32,
    /// Share answered by the large tier.
    large: f64,
    /// Share answered from the gateway's cache.
    hits: f64,
}

const fn shape(requests: u32, prompt: u32, completion: u32, large: f64, hits: f64) -> Shape {
    Shape {
        requests,
        prompt,
        completion,
        large,
        hits,
    }
}

const STREAMS: [Stream; 4] = [
    Stream {
        tenant: "acme",
        feature: "search",
        requested: "smart",
        sessions: 0,
        weeks: [
            shape(2000, 1200, 250, 0.40, 0.25),
            shape(2200, 4800, 250, 0.42, 0.20),
        ],
    },
    Stream {
        tenant: "acme",
        feature: "support-bot",
        requested: "fast",
        sessions: 0,
        weeks: [
            shape(2500, 600, 180, 0.10, 0.35),
            shape(2800, 600, 180, 0.20, 0.20),
        ],
    },
    Stream {
        tenant: "demo",
        feature: "chat",
        requested: "auto",
        sessions: 0,
        weeks: [
            shape(1500, 400, 300, 0.30, 0.15),
            shape(1700, 400, 300, 0.36, 0.12),
        ],
    },
    Stream {
        tenant: "globex",
        feature: "coding-agent",
        requested: "smart",
        sessions: 40,
        weeks: [
            shape(600, 5000, 400, 0.70, 0.05),
            shape(660, 5000, 400, 0.70, 0.05),
        ],
    },
];

/// The stuck agent: `globex`'s coding agent, on the large tier.
const LOOP_STEPS: u32 = 60;
/// Steps before the guard caught it (flagged from the next one on).
const LOOP_CAUGHT_AT: u32 = 3;
const LOOP_SESSION: &str = "run-4812";
/// The retry storm: failed retries during the outage, then retries answered after it.
const STORM_FAILED: u32 = 300;
const STORM_ANSWERED: u32 = 260;

/// The tenants and features of the history, for the keys its rows carry.
pub fn streams() -> Vec<(&'static str, &'static str)> {
    let mut out: Vec<_> = STREAMS.iter().map(|s| (s.tenant, s.feature)).collect();
    out.dedup();
    out
}

/// Who a stream's rows belong to: tenant id and key id, by (tenant name, feature).
pub type Owners = BTreeMap<(String, String), (String, String)>;

/// Relative traffic by weekday (Monday first) and by hour (UTC).
const WEEKDAY: [f64; 7] = [1.0, 1.05, 1.1, 1.0, 0.95, 0.45, 0.4];

fn hour_weight(h: u32) -> f64 {
    // A working day: low at night, peaking in the afternoon.
    let x = (f64::from(h) - 14.0) / 5.0;
    0.15 + (-x * x / 2.0).exp()
}

fn pick(rng: &mut StdRng, weights: &[f64]) -> usize {
    let total: f64 = weights.iter().sum();
    let mut x = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    weights.len() - 1
}

fn jitter(rng: &mut StdRng, mean: u32) -> u64 {
    let f = 0.6 + 0.8 * rng.random::<f64>();
    (f64::from(mean) * f).round() as u64
}

fn fingerprint(rng: &mut StdRng) -> String {
    format!("{:032x}", rng.random::<u128>())
}

/// Generates the rows of one history.
struct Generator<'a> {
    rng: StdRng,
    book: PriceBook,
    owners: &'a Owners,
    rows: Vec<UsageEvent>,
}

/// What one generated row is.
struct Call<'a> {
    tenant: &'a str,
    feature: &'a str,
    requested: &'a str,
    at: DateTime<Utc>,
    large: bool,
    prompt: u64,
    completion: u64,
    cache: CacheStatus,
    session: Option<String>,
}

impl Generator<'_> {
    fn push(&mut self, call: Call<'_>) -> &mut UsageEvent {
        let (tier, model) = if call.large {
            ("large", LARGE_MODEL)
        } else {
            ("small", SMALL_MODEL)
        };
        let usage = Usage {
            prompt_tokens: call.prompt,
            completion_tokens: call.completion,
            cached_tokens: 0,
        };
        let (input, output) = self.book.cost_split(model, &usage, call.at);
        let hit = matches!(call.cache, CacheStatus::HitExact | CacheStatus::HitSemantic);
        let routed = call.requested == "auto";
        let (tenant_id, key_id) = self
            .owners
            .get(&(call.tenant.to_owned(), call.feature.to_owned()))
            .cloned()
            .unwrap_or_default();
        let mut tags = BTreeMap::from([("feature".to_owned(), call.feature.to_owned())]);
        if let Some(s) = &call.session {
            tags.insert("session".to_owned(), s.clone());
        }
        let latency = if hit {
            2.0 + 6.0 * self.rng.random::<f64>()
        } else if call.large {
            800.0 + 2200.0 * self.rng.random::<f64>()
        } else {
            250.0 + 650.0 * self.rng.random::<f64>()
        };
        let replica = if call.large {
            "sim-large-1"
        } else if self.rng.random::<bool>() {
            "sim-small-1"
        } else {
            "sim-small-2"
        };
        let n = self.rows.len();
        self.rows.push(UsageEvent {
            request_id: format!("demo-history-{n:06}").into(),
            started_at: call.at,
            tenant_id,
            tenant_name: call.tenant.to_owned(),
            key_id,
            tags,
            endpoint: "chat".into(),
            requested_model: call.requested.to_owned(),
            served_model: Some(model.into()),
            tier: Some(tier.to_owned().into()),
            replica: (!hit).then(|| replica.into()),
            prompt_tokens: call.prompt,
            completion_tokens: call.completion,
            cached_tokens: 0,
            usage_source: UsageSource::Synthetic,
            status: 200,
            error_kind: None,
            stream: false,
            client_disconnected: false,
            latency_ms: latency,
            ttft_ms: Some(latency * 0.25),
            retries: 0,
            cache_status: call.cache,
            cost_micros: if hit { 0 } else { input + output },
            output_cost_micros: if hit { 0 } else { output },
            saved_micros: if hit { input + output } else { 0 },
            loop_flag: false,
            retry_storm_flag: false,
            loop_steps: 0,
            avoided_micros: 0,
            route_reason: Some(if routed { "classifier" } else { "explicit" }.into()),
            routed,
            all_large_micros: (routed && !hit).then(|| {
                self.book
                    .cost(LARGE_MODEL, &usage, call.at)
                    .max(input + output)
            }),
            replica_choice: None,
            matched_blocks: None,
            fingerprint: fingerprint(&mut self.rng),
        });
        let last = self.rows.len() - 1;
        &mut self.rows[last]
    }

    /// A random instant of `week`, weighted by weekday and hour.
    fn instant(&mut self, week: IsoWeek) -> DateTime<Utc> {
        let day = pick(&mut self.rng, &WEEKDAY);
        let hours: Vec<f64> = (0..24).map(hour_weight).collect();
        let hour = pick(&mut self.rng, &hours);
        let second = self.rng.random_range(0..3600);
        week.start()
            + Duration::days(day as i64)
            + Duration::hours(hour as i64)
            + Duration::seconds(second)
    }

    fn stream(&mut self, s: &Stream, week: IsoWeek, shape: Shape) {
        for _ in 0..shape.requests {
            let at = self.instant(week);
            let large = self.rng.random::<f64>() < shape.large;
            let cache = if self.rng.random::<f64>() < shape.hits {
                if self.rng.random::<f64>() < 0.7 {
                    CacheStatus::HitExact
                } else {
                    CacheStatus::HitSemantic
                }
            } else {
                CacheStatus::Miss
            };
            let session = (s.sessions > 0)
                .then(|| format!("run-{}", 1000 + self.rng.random_range(0..s.sessions)));
            let prompt = jitter(&mut self.rng, shape.prompt);
            let completion = jitter(&mut self.rng, shape.completion);
            self.push(Call {
                tenant: s.tenant,
                feature: s.feature,
                requested: s.requested,
                at,
                large,
                prompt,
                completion,
                cache,
                session,
            });
        }
    }

    /// The stuck agent: the same step every ~20 s, each resending the growing history.
    fn agent_loop(&mut self, start: DateTime<Utc>) {
        for step in 0..LOOP_STEPS {
            let at = start + Duration::seconds(i64::from(step) * 20 + self.rng.random_range(0..4));
            let prompt = 6000 + 200 * u64::from(step);
            let row = self.push(Call {
                tenant: "globex",
                feature: "coding-agent",
                requested: "smart",
                at,
                large: true,
                prompt,
                completion: 120,
                cache: CacheStatus::Miss,
                session: Some(LOOP_SESSION.to_owned()),
            });
            if step + 1 >= LOOP_CAUGHT_AT {
                // The guard's default action is `flag`: still answered, marked as a loop.
                row.loop_flag = true;
                row.loop_steps = step + 1;
            }
        }
    }

    /// The retry storm: clients retry through an outage (failed, nothing charged), then their
    /// retries pile onto the recovered tier (answered and charged, flagged as a storm).
    fn retry_storm(&mut self, start: DateTime<Utc>) {
        let chat = &STREAMS[2];
        let shape = chat.weeks[1];
        for i in 0..STORM_FAILED + STORM_ANSWERED {
            let failed = i < STORM_FAILED;
            let at = start + Duration::milliseconds(i64::from(i) * 2_100);
            let large = self.rng.random::<f64>() < shape.large;
            let prompt = jitter(&mut self.rng, shape.prompt);
            let completion = jitter(&mut self.rng, shape.completion);
            let row = self.push(Call {
                tenant: chat.tenant,
                feature: chat.feature,
                requested: chat.requested,
                at,
                large,
                prompt: if failed { 0 } else { prompt },
                completion: if failed { 0 } else { completion },
                cache: CacheStatus::Miss,
                session: None,
            });
            row.retry_storm_flag = true;
            if failed {
                row.status = 503;
                row.error_kind = Some("unavailable".into());
                row.cost_micros = 0;
                row.output_cost_micros = 0;
                row.all_large_micros = None;
                row.latency_ms = 30_000.0;
                row.ttft_ms = None;
            }
        }
    }
}

/// The history's rows for the weeks `earlier` and the one after it, priced at `prices` (the
/// demo's configured prices, applied as if in force all along).
pub fn rows(
    earlier: IsoWeek,
    owners: &Owners,
    prices: &BTreeMap<String, PriceConfig>,
) -> Vec<UsageEvent> {
    let mut g = Generator {
        rng: StdRng::seed_from_u64(SEED),
        book: PriceBook::new(pricing::configured(prices, DateTime::UNIX_EPOCH)),
        owners,
        rows: Vec::new(),
    };
    let later = IsoWeek::containing(earlier.end());
    for (i, week) in [earlier, later].into_iter().enumerate() {
        for s in &STREAMS {
            g.stream(s, week, s.weeks[i]);
        }
    }
    // Tuesday 10:12 and Thursday 14:05 of the later week.
    g.agent_loop(later.start() + Duration::days(1) + Duration::minutes(10 * 60 + 12));
    g.retry_storm(later.start() + Duration::days(3) + Duration::minutes(14 * 60 + 5));
    g.rows.sort_by_key(|r| r.started_at);
    g.rows
}

/// What [`seed`] stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seeded {
    /// The earlier week.
    pub earlier: IsoWeek,
    /// The later week (the one to look at).
    pub later: IsoWeek,
    /// Rows stored.
    pub rows: u64,
}

/// Seed the history for the two weeks before `now`'s, once per database: nothing when the
/// ledger already holds synthetic rows (a relaunch) or there is no ledger. Creates the
/// history's tenants when missing and one key per feature (nobody holds their secrets).
pub async fn seed(
    state: &crate::state::AppState,
    prices: &BTreeMap<String, PriceConfig>,
    now: DateTime<Utc>,
) -> anyhow::Result<Option<Seeded>> {
    let Some(ledger) = state.ledger.as_ref() else {
        return Ok(None);
    };
    let seen = ledger
        .aggregate(DateTime::UNIX_EPOCH, now + Duration::days(1), None, &[])
        .await?;
    if seen.iter().any(|(_, a)| a.synthetic_requests > 0) {
        return Ok(None);
    }
    let mut owners = Owners::new();
    let mut budgeted = BTreeMap::new();
    for (tenant, feature) in streams() {
        let t = match state.store.find_tenant(tenant).await? {
            Some(t) => t,
            None => state.store.create_tenant(tenant).await?,
        };
        let generated = crate::keys::generate();
        let key = state
            .store
            .create_key(crate::store::NewKey {
                tenant_id: t.id.clone(),
                name: Some(format!("{feature} (demo history)")),
                hash: generated.hash,
                prefix: generated.prefix,
                tags: BTreeMap::from([("feature".to_owned(), feature.to_owned())]),
                client_tags: None,
            })
            .await?;
        owners.insert(
            (tenant.to_owned(), feature.to_owned()),
            (t.id.clone(), key.id),
        );
        budgeted.insert(tenant, t.id);
    }
    // A monthly budget per tenant without one (flag only: nothing is refused), so the dashboard shows
    // utilisation move with live traffic.
    for (tenant, tenant_id) in budgeted {
        if !state.store.list_budgets(Some(&tenant_id)).await?.is_empty() {
            continue; // the operator's own budgets stay as they are
        }
        let usd = match tenant {
            "acme" => 150,
            "globex" => 80,
            _ => 5,
        };
        state
            .store
            .upsert_budget(&crate::store::NewBudget {
                tenant_id,
                scope: crate::budget::Scope::Tenant,
                window: crate::budget::Window::Month,
                limit: crate::budget::Limit {
                    tokens: None,
                    micros: Some(usd * 1_000_000),
                },
                action: crate::budget::Action::Flag,
                hard_limit: crate::budget::Limit::default(),
                warn_percent: Some(80),
            })
            .await?;
    }
    state.budgets.refresh().await?;
    let later = IsoWeek::containing(now).previous();
    let earlier = later.previous();
    let rows = ledger.insert(&rows(earlier, &owners, prices)).await?;
    Ok(Some(Seeded {
        earlier,
        later,
        rows,
    }))
}
