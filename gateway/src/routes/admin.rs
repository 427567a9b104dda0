//! `/admin/v1`: tenants, keys and replica state, behind the admin token.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::keys;
use crate::ledger::loops::{self, DetectedLoop, LoopTotals};
use crate::ledger::report::{self, Explanation, IsoWeek, LoopFinding, WeeklyReport};
use crate::pricing::{usd_to_micros, MicrosPerMtok, Price};
use crate::routes::Query;
use crate::routes::ADMIN_BODY_LIMIT;
use crate::routes::{ledger, parse_json, read_body, tenant, week, List, ListObject};
use crate::state::AppState;
use crate::store::{ApiKey, NewKey, Tenant};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateTenant {
    name: String,
}

fn validate_name(field: &str, name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            field,
            format!("`{field}` must be 1-64 characters of letters, digits, '-', '_' or '.'"),
        ))
    }
}

/// `POST /admin/v1/tenants {"name"}` → 201 with the tenant.
pub async fn create_tenant(
    State(state): State<AppState>,
    body: Body,
) -> Result<Response, ApiError> {
    let req: CreateTenant = parse_json(&read_body(body, ADMIN_BODY_LIMIT).await?)?;
    validate_name("name", &req.name)?;
    let tenant = state.store.create_tenant(&req.name).await?;
    Ok((StatusCode::CREATED, Json(tenant)).into_response())
}

/// `GET /admin/v1/tenants`
pub async fn list_tenants(State(state): State<AppState>) -> Result<Json<List<Tenant>>, ApiError> {
    Ok(Json(List::new(state.store.list_tenants().await?)))
}

/// Body of `DELETE /admin/v1/tenants/{id or name}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeletedTenant {
    /// The tenant's id.
    pub id: String,
    /// Its name.
    pub name: String,
    /// Always `true`.
    pub deleted: bool,
}

/// `DELETE /admin/v1/tenants/{id or name}`: deletes the tenant and revokes its keys.
pub async fn delete_tenant(
    State(state): State<AppState>,
    Path(id_or_name): Path<String>,
) -> Result<Json<DeletedTenant>, ApiError> {
    let t = tenant(&state, &id_or_name).await?;
    if !state.store.delete_tenant(&t.id).await? {
        return Err(ApiError::NotFound(format!("no tenant {id_or_name:?}")));
    }
    state.auth.forget_tenant(&t.id);
    state.metrics.forget_tenant(&t.name);
    if let Some(ledger) = &state.ledger {
        // Its history reports apart from a tenant created later under the same name.
        let label = format!("{} (deleted, {})", t.name, t.id);
        ledger.retire_tenant(&t.id, &t.name, &label).await?;
    }
    Ok(Json(DeletedTenant {
        id: t.id,
        name: t.name,
        deleted: true,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateKey {
    tenant: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    tags: BTreeMap<String, String>,
    /// Tags its clients may add (`x-gateway-tags`, the request's `user`); absent: any the key
    /// does not fix; `[]`: none.
    #[serde(default)]
    client_tags: Option<Vec<String>>,
}

/// Body of `POST /admin/v1/keys`: the key's metadata and, this once, its secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedKey {
    /// The stored metadata.
    #[serde(flatten)]
    pub meta: ApiKey,
    /// The secret (`sk-gw-…`), never shown again.
    #[serde(rename = "key")]
    pub secret: String,
}

/// `POST /admin/v1/keys {"tenant", "name"?, "tags"?, "client_tags"?}` → 201 with the secret `key` (shown once).
pub async fn create_key(State(state): State<AppState>, body: Body) -> Result<Response, ApiError> {
    let req: CreateKey = parse_json(&read_body(body, ADMIN_BODY_LIMIT).await?)?;
    if let Some(name) = &req.name {
        validate_name("name", name)?;
    }
    for k in req.tags.keys() {
        validate_name("tags", k)?;
    }
    for k in req.client_tags.iter().flatten() {
        validate_name("client_tags", k)?;
    }
    let t = tenant(&state, &req.tenant).await?;
    let generated = keys::generate();
    let key = state
        .store
        .create_key(NewKey {
            tenant_id: t.id,
            name: req.name,
            hash: generated.hash.clone(),
            prefix: generated.prefix,
            tags: req.tags,
            client_tags: req.client_tags,
        })
        .await?;
    state.auth.remember(&generated.hash, key.clone());
    let body = CreatedKey {
        meta: key,
        secret: generated.secret,
    };
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// Query of `GET /admin/v1/keys`.
#[derive(Deserialize)]
pub struct KeyFilter {
    /// Tenant id or name.
    tenant: Option<String>,
}

/// `GET /admin/v1/keys[?tenant=…]`
pub async fn list_keys(
    State(state): State<AppState>,
    Query(filter): Query<KeyFilter>,
) -> Result<Json<List<ApiKey>>, ApiError> {
    let tenant_id = match &filter.tenant {
        Some(t) => Some(tenant(&state, t).await?.id),
        None => None,
    };
    let keys = state.store.list_keys(tenant_id.as_deref()).await?;
    Ok(Json(List::new(keys)))
}

/// Body of `DELETE /admin/v1/keys/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokedKey {
    /// The key's id.
    pub id: String,
    /// Always `true`.
    pub revoked: bool,
}

/// `DELETE /admin/v1/keys/{id}`: revoke; every replica drops it within `store.key_refresh_ms`.
pub async fn revoke_key(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<RevokedKey>, ApiError> {
    if !state.store.revoke_key(&id).await? {
        return Err(ApiError::NotFound(format!("no live key {id:?}")));
    }
    state.auth.forget(&id);
    Ok(Json(RevokedKey { id, revoked: true }))
}

/// `GET /admin/v1/replicas`: routing state of every replica.
pub async fn replicas(State(state): State<AppState>) -> Json<Value> {
    let tiers: Vec<Value> = state
        .upstreams
        .snapshot(std::time::Instant::now())
        .into_iter()
        .map(|(tier, rs)| {
            let rs: Vec<Value> = rs
                .into_iter()
                .map(|r| {
                    json!({"name": r.name, "in_flight": r.in_flight, "healthy": r.healthy,
                           "consecutive_failures": r.consecutive_failures,
                           "breaker": r.breaker.as_str(),
                           "tripped_by": r.tripped_by.map(router::Trip::as_str),
                           "window_requests": r.window.0, "window_failures": r.window.1,
                           "concurrency_limit": r.limit, "max_concurrency": r.max_concurrency,
                           "adaptive_limit": r.adaptive, "limit_probing": r.probing})
                })
                .collect();
            json!({"tier": tier, "replicas": rs})
        })
        .collect();
    Json(json!({"object": "list", "data": tiers}))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetPrice {
    model: String,
    /// USD per 1M uncached input tokens.
    input: f64,
    /// USD per 1M output tokens.
    output: f64,
    /// USD per 1M cached input tokens (default: `input`).
    #[serde(default)]
    cached_input: Option<f64>,
    /// When the price starts to apply (RFC 3339; default: now).
    #[serde(default)]
    effective_from: Option<chrono::DateTime<chrono::Utc>>,
}

/// A [`Price`] as the admin API shows it: per 1M tokens, in USD and in micro-dollars.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PriceView {
    /// Served model name.
    pub model: String,
    /// When the price starts to apply.
    pub effective_from: DateTime<Utc>,
    /// USD per 1M uncached input tokens.
    pub input_usd_per_mtok: f64,
    /// USD per 1M output tokens.
    pub output_usd_per_mtok: f64,
    /// USD per 1M cached input tokens.
    pub cached_input_usd_per_mtok: f64,
    /// Micro-dollars per 1M uncached input tokens.
    pub input_micros_per_mtok: MicrosPerMtok,
    /// Micro-dollars per 1M output tokens.
    pub output_micros_per_mtok: MicrosPerMtok,
    /// Micro-dollars per 1M cached input tokens.
    pub cached_input_micros_per_mtok: MicrosPerMtok,
}

impl From<&Price> for PriceView {
    fn from(p: &Price) -> Self {
        let usd = |micros: i64| micros as f64 / 1e6;
        Self {
            model: p.model.clone(),
            effective_from: p.effective_from,
            input_usd_per_mtok: usd(p.input),
            output_usd_per_mtok: usd(p.output),
            cached_input_usd_per_mtok: usd(p.cached_input),
            input_micros_per_mtok: p.input,
            output_micros_per_mtok: p.output,
            cached_input_micros_per_mtok: p.cached_input,
        }
    }
}

/// `POST /admin/v1/prices`: add a price (USD per 1M tokens) effective now or at `effective_from`.
pub async fn set_price(State(state): State<AppState>, body: Body) -> Result<Response, ApiError> {
    let req: SetPrice = parse_json(&read_body(body, ADMIN_BODY_LIMIT).await?)?;
    if req.model.is_empty() {
        return Err(ApiError::invalid("model", "`model` must not be empty"));
    }
    let micros = |field: &str, usd: f64| {
        usd_to_micros(usd).ok_or_else(|| {
            ApiError::invalid(
                field,
                format!("`{field}` must be a non-negative USD amount"),
            )
        })
    };
    let price = Price {
        model: req.model,
        effective_from: req.effective_from.unwrap_or_else(chrono::Utc::now),
        input: micros("input", req.input)?,
        output: micros("output", req.output)?,
        cached_input: micros("cached_input", req.cached_input.unwrap_or(req.input))?,
    };
    state.store.insert_price(&price).await?;
    state.prices.refresh().await?;
    Ok((StatusCode::CREATED, Json(PriceView::from(&price))).into_response())
}

/// `GET /admin/v1/prices`: every price with its history.
pub async fn list_prices(State(state): State<AppState>) -> Result<Json<List<PriceView>>, ApiError> {
    let prices = state.store.list_prices().await?;
    Ok(Json(List::new(
        prices.iter().map(PriceView::from).collect(),
    )))
}

/// Query of the report endpoints.
#[derive(Deserialize)]
pub struct ReportQuery {
    /// ISO week (`2026-W48`); default: the current week.
    week: Option<String>,
    /// First week of an explanation.
    from: Option<String>,
    /// Second week of an explanation.
    to: Option<String>,
    /// Restrict to one tenant (name).
    tenant: Option<String>,
    /// Loops: look back this many hours (default 24).
    hours: Option<u32>,
    /// Loops: least repeats of the same request (default 5).
    min_repeats: Option<usize>,
}

/// `GET /admin/v1/reports/weekly?week=2026-W48[&tenant=…]`
pub async fn weekly_report(
    State(state): State<AppState>,
    Query(q): Query<ReportQuery>,
) -> Result<Json<WeeklyReport>, ApiError> {
    let current = IsoWeek::containing(chrono::Utc::now());
    let w = week("week", q.week.as_deref(), current)?;
    let report = report::weekly(ledger(&state)?, w, q.tenant.as_deref()).await?;
    Ok(Json(report))
}

/// `GET /admin/v1/reports/explain?from=2026-W47&to=2026-W48[&tenant=…]`
pub async fn explain_report(
    State(state): State<AppState>,
    Query(q): Query<ReportQuery>,
) -> Result<Json<Explanation>, ApiError> {
    let current = IsoWeek::containing(chrono::Utc::now());
    let to = week("to", q.to.as_deref(), current)?;
    let from = week("from", q.from.as_deref(), to.previous())?;
    let e = report::explain(ledger(&state)?, from, to, q.tenant.as_deref()).await?;
    Ok(Json(e))
}

/// Body of `GET /admin/v1/reports/loops`: the loops found since `since`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoopsReport {
    /// Always `"list"`.
    pub object: ListObject,
    /// Start of the look-back.
    pub since: DateTime<Utc>,
    /// Least repeats of the same request counted as a loop (billing data).
    pub min_repeats: usize,
    /// Found from billing data alone: the same request repeated at a steady cadence.
    pub data: Vec<LoopFinding>,
    /// Found by the guard step on the request path, most expensive first.
    #[serde(default)]
    pub detected: Vec<DetectedLoop>,
    /// Totals over `detected`.
    #[serde(default)]
    pub detected_total: LoopTotals,
}

/// The longest look-back of the loops report: a year.
const MAX_LOOKBACK_HOURS: u32 = 366 * 24;

/// `GET /admin/v1/reports/loops[?hours=24&min_repeats=5&tenant=…]`
pub async fn loops_report(
    State(state): State<AppState>,
    Query(q): Query<ReportQuery>,
) -> Result<Json<LoopsReport>, ApiError> {
    let hours = q.hours.unwrap_or(24);
    if !(1..=MAX_LOOKBACK_HOURS).contains(&hours) {
        return Err(ApiError::invalid(
            "hours",
            format!("`hours` must be between 1 and {MAX_LOOKBACK_HOURS}, got {hours}"),
        ));
    }
    let now = chrono::Utc::now();
    let since = now - chrono::Duration::hours(i64::from(hours));
    let min = q.min_repeats.unwrap_or(5).max(2);
    let store = ledger(&state)?;
    let tenant = q.tenant.as_deref().filter(|t| !t.is_empty());
    let mut found = report::loops(store, since, now, min, 0.5).await?;
    if let Some(t) = tenant {
        found.retain(|f| f.tenant == t);
    }
    let detected = loops::detected(store, since, now, tenant).await?;
    Ok(Json(LoopsReport {
        object: ListObject::List,
        since,
        min_repeats: min,
        data: found,
        detected_total: LoopTotals::of(&detected),
        detected,
    }))
}
