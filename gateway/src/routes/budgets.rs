//! `/admin/v1/budgets`, `/admin/v1/rate-limits`, `/admin/v1/usage` and a tenant's fail mode:
//! what `gatewayctl budgets|limits|usage` talks to. Every change is applied to this replica's
//! snapshot at once; the others pick it up at their next refresh (`store.key_refresh_ms`).

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use embedder::verifier::CurvePoint;
use serde::{Deserialize, Serialize};

use crate::budget::engine::{limit_from, UsageRow};
use crate::budget::{Action, BudgetPolicy, FailMode, Limit, RateLimit, Scope, Window};
use crate::cache::CachePolicy;
use crate::error::ApiError;
use crate::routes::Query;
use crate::routes::{parse_json, read_body, List, ListObject};
use crate::routes::{tenant, ADMIN_BODY_LIMIT};
use crate::state::AppState;
use crate::store::{NewBudget, Tenant};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetBudget {
    tenant: String,
    #[serde(default)]
    scope: Option<String>,
    window: String,
    #[serde(default)]
    limit_tokens: Option<u64>,
    #[serde(default)]
    limit_usd: Option<f64>,
    #[serde(default)]
    action: Option<String>,
    #[serde(default)]
    hard_limit_tokens: Option<u64>,
    #[serde(default)]
    hard_limit_usd: Option<f64>,
    #[serde(default)]
    warn_percent: Option<u8>,
}

async fn refresh(state: &AppState) -> Result<(), ApiError> {
    state.budgets.refresh().await.map_err(ApiError::from)
}

/// `POST /admin/v1/budgets` → 201 with the policy (created, or replaced for the same tenant,
/// scope and window, keeping its spend).
pub async fn set_budget(State(state): State<AppState>, body: Body) -> Result<Response, ApiError> {
    let req: SetBudget = parse_json(&read_body(body, ADMIN_BODY_LIMIT).await?)?;
    let t = tenant(&state, &req.tenant).await?;
    let scope_text = req.scope.as_deref().unwrap_or("tenant");
    let scope = Scope::parse(scope_text).ok_or_else(|| {
        ApiError::invalid(
            "scope",
            format!("invalid scope {scope_text:?}: use `tenant`, `key:<key id>` or `tag:<name>=<value>`"),
        )
    })?;
    if let Scope::Key(id) = &scope {
        let keys = state.store.list_keys(Some(&t.id)).await?;
        if !keys.iter().any(|k| &k.id == id && k.revoked_at.is_none()) {
            return Err(ApiError::invalid(
                "scope",
                format!("tenant {} has no live key {id:?}", t.name),
            ));
        }
    }
    let window = Window::parse(&req.window).ok_or_else(|| {
        ApiError::invalid(
            "window",
            format!(
                "invalid window {:?}: use minute, hour, day, week or month",
                req.window
            ),
        )
    })?;
    let action_text = req.action.as_deref().unwrap_or("reject");
    let action = Action::parse(action_text).ok_or_else(|| {
        ApiError::invalid(
            "action",
            format!("invalid action {action_text:?}: use reject, downgrade or flag"),
        )
    })?;
    let limit = limit_from(req.limit_tokens, req.limit_usd)
        .map_err(|m| ApiError::invalid("limit_usd", m))?;
    if limit.is_unlimited() {
        return Err(ApiError::invalid(
            "limit_tokens",
            "a budget needs `limit_tokens` and/or `limit_usd`",
        ));
    }
    let hard_limit = limit_from(req.hard_limit_tokens, req.hard_limit_usd)
        .map_err(|m| ApiError::invalid("hard_limit_usd", m))?;
    if action != Action::Downgrade && !hard_limit.is_unlimited() {
        return Err(ApiError::invalid(
            "hard_limit_tokens",
            "a hard limit only applies to the `downgrade` action",
        ));
    }
    if below(&hard_limit, &limit) {
        return Err(ApiError::invalid(
            "hard_limit_tokens",
            "the hard limit must not be below the limit",
        ));
    }
    if req.warn_percent.is_some_and(|w| w == 0 || w > 100) {
        return Err(ApiError::invalid("warn_percent", "must be 1-100"));
    }
    let policy = state
        .store
        .upsert_budget(&NewBudget {
            tenant_id: t.id,
            scope,
            window,
            limit,
            action,
            hard_limit,
            warn_percent: req.warn_percent,
        })
        .await?;
    refresh(&state).await?;
    Ok((StatusCode::CREATED, Json(policy)).into_response())
}

fn below(hard: &Limit, limit: &Limit) -> bool {
    matches!((hard.tokens, limit.tokens), (Some(h), Some(l)) if h < l)
        || matches!((hard.micros, limit.micros), (Some(h), Some(l)) if h < l)
}

/// Query naming an optional tenant (id or name).
#[derive(Deserialize)]
pub struct TenantFilter {
    tenant: Option<String>,
}

async fn tenant_filter(state: &AppState, f: &TenantFilter) -> Result<Option<String>, ApiError> {
    Ok(match &f.tenant {
        Some(t) => Some(tenant(state, t).await?.id),
        None => None,
    })
}

/// `GET /admin/v1/budgets[?tenant=…]`
pub async fn list_budgets(
    State(state): State<AppState>,
    Query(f): Query<TenantFilter>,
) -> Result<Json<List<BudgetPolicy>>, ApiError> {
    let tenant_id = tenant_filter(&state, &f).await?;
    let data = state.store.list_budgets(tenant_id.as_deref()).await?;
    Ok(Json(List::new(data)))
}

/// Body of `DELETE /admin/v1/budgets/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeletedBudget {
    /// The policy's id.
    pub id: String,
    /// Always `true`.
    pub deleted: bool,
}

/// `DELETE /admin/v1/budgets/{id}`
pub async fn delete_budget(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<DeletedBudget>, ApiError> {
    if !state.store.delete_budget(&id).await? {
        return Err(ApiError::NotFound(format!("no budget {id:?}")));
    }
    refresh(&state).await?;
    Ok(Json(DeletedBudget { id, deleted: true }))
}

/// Query of `GET /admin/v1/usage`.
#[derive(Deserialize)]
pub struct UsageQuery {
    tenant: String,
}

/// Body of `GET /admin/v1/usage`: a tenant's budgets in their current windows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantUsage {
    /// Always `"list"`.
    pub object: ListObject,
    /// The tenant.
    pub tenant: Tenant,
    /// One row per policy.
    pub data: Vec<UsageRow>,
}

/// `GET /admin/v1/usage?tenant=…`: spent, reserved and remaining per policy and window.
pub async fn usage(
    State(state): State<AppState>,
    Query(q): Query<UsageQuery>,
) -> Result<Json<TenantUsage>, ApiError> {
    let t = tenant(&state, &q.tenant).await?;
    let rows = state
        .budgets
        .usage(&t.id)
        .await
        .map_err(|e| ApiError::Unavailable {
            message: format!("cannot read budget counters: {e}"),
            retry_after: 1,
        })?;
    Ok(Json(TenantUsage {
        object: ListObject::List,
        tenant: t,
        data: rows,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetRateLimit {
    tenant: String,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    rpm: Option<u64>,
    #[serde(default)]
    tpm: Option<u64>,
}

/// `PUT /admin/v1/rate-limits {"tenant", "key"?, "rpm"?, "tpm"?}`
pub async fn set_rate_limit(
    State(state): State<AppState>,
    body: Body,
) -> Result<Json<RateLimit>, ApiError> {
    let req: SetRateLimit = parse_json(&read_body(body, ADMIN_BODY_LIMIT).await?)?;
    let t = tenant(&state, &req.tenant).await?;
    if req.rpm.is_none() && req.tpm.is_none() {
        return Err(ApiError::invalid("rpm", "give `rpm` and/or `tpm`"));
    }
    if req.rpm == Some(0) || req.tpm == Some(0) {
        return Err(ApiError::invalid(
            "rpm",
            "limits must be at least 1 per minute",
        ));
    }
    if let Some(id) = &req.key {
        let keys = state.store.list_keys(Some(&t.id)).await?;
        if !keys.iter().any(|k| &k.id == id) {
            return Err(ApiError::invalid(
                "key",
                format!("tenant {} has no key {id:?}", t.name),
            ));
        }
    }
    let limit = RateLimit {
        tenant_id: t.id,
        key_id: req.key,
        rpm: req.rpm,
        tpm: req.tpm,
    };
    state.store.set_rate_limit(&limit).await?;
    refresh(&state).await?;
    Ok(Json(limit))
}

/// `GET /admin/v1/rate-limits[?tenant=…]`
pub async fn list_rate_limits(
    State(state): State<AppState>,
    Query(f): Query<TenantFilter>,
) -> Result<Json<List<RateLimit>>, ApiError> {
    let tenant_id = tenant_filter(&state, &f).await?;
    let data = state.store.list_rate_limits(tenant_id.as_deref()).await?;
    Ok(Json(List::new(data)))
}

/// Query of `DELETE /admin/v1/rate-limits`.
#[derive(Deserialize)]
pub struct RateLimitTarget {
    tenant: String,
    key: Option<String>,
}

/// Body of `DELETE /admin/v1/rate-limits`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeletedRateLimit {
    /// The tenant's id.
    pub tenant: String,
    /// The key's id; `None` for the tenant's own limit.
    pub key: Option<String>,
    /// Always `true`.
    pub deleted: bool,
}

/// `DELETE /admin/v1/rate-limits?tenant=…[&key=…]`
pub async fn delete_rate_limit(
    State(state): State<AppState>,
    Query(q): Query<RateLimitTarget>,
) -> Result<Json<DeletedRateLimit>, ApiError> {
    let t = tenant(&state, &q.tenant).await?;
    if !state
        .store
        .delete_rate_limit(&t.id, q.key.as_deref())
        .await?
    {
        return Err(ApiError::NotFound("no such rate limit".into()));
    }
    refresh(&state).await?;
    Ok(Json(DeletedRateLimit {
        tenant: t.id,
        key: q.key,
        deleted: true,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetFailMode {
    mode: String,
}

/// Body of `PUT /admin/v1/tenants/{tenant}/fail-mode`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantFailMode {
    /// The tenant's id.
    pub tenant: String,
    /// Its fail mode now.
    pub fail_mode: FailMode,
}

/// `PUT /admin/v1/tenants/{tenant}/fail-mode {"mode": "open"|"closed"}`
pub async fn set_fail_mode(
    State(state): State<AppState>,
    Path(id_or_name): Path<String>,
    body: Body,
) -> Result<Json<TenantFailMode>, ApiError> {
    let req: SetFailMode = parse_json(&read_body(body, ADMIN_BODY_LIMIT).await?)?;
    let mode = FailMode::parse(&req.mode)
        .ok_or_else(|| ApiError::invalid("mode", "use `open` or `closed`"))?;
    let t = tenant(&state, &id_or_name).await?;
    state.store.set_fail_mode(&t.id, mode).await?;
    refresh(&state).await?;
    Ok(Json(TenantFailMode {
        tenant: t.id,
        fail_mode: mode,
    }))
}

/// Body of the `/admin/v1/tenants/{tenant}/cache-policy` endpoints: a tenant's cache policy as
/// stored, as in force, and where it lands on the verifier's curve.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CachePolicyView {
    /// The tenant's id.
    pub tenant: String,
    /// Its own policy; `None`: the config's defaults.
    pub policy: Option<CachePolicy>,
    /// The policy in force (its own over the defaults).
    pub effective: CachePolicy,
    /// Whether this replica's semantic layer is loaded.
    pub semantic_ready: bool,
    /// The verifier curve's point for the effective `min_precision` (`None` when the semantic
    /// layer is not ready or the curve never reaches it).
    pub verifier_point: Option<CurvePoint>,
    /// What each precision setting (the usual ones and the tenant's own) would have answered
    /// of this tenant's semantic lookups on this replica (`None` before the layer is ready).
    #[serde(default)]
    pub calibration: Option<crate::cache::CalibrationView>,
}

/// The precision settings `gatewayctl cache show` compares (with the tenant's own).
pub const CALIBRATION_SETTINGS: [f64; 4] = [0.8, 0.85, 0.9, 0.95];

fn cache_policy_view(
    state: &AppState,
    tenant_id: &str,
    own: Option<CachePolicy>,
) -> CachePolicyView {
    let effective = state.cache.policy(tenant_id);
    let verifier_point = effective
        .min_precision
        .and_then(|p| state.cache.curve_point(p));
    CachePolicyView {
        tenant: tenant_id.to_owned(),
        policy: own,
        semantic_ready: state.cache.semantic_ready(),
        verifier_point,
        calibration: {
            let mut settings = CALIBRATION_SETTINGS.to_vec();
            if let Some(own) = effective.min_precision {
                if !settings.iter().any(|p| (p - own).abs() < 1e-9) {
                    settings.push(own);
                    settings.sort_by(f64::total_cmp);
                }
            }
            state.cache.calibration(tenant_id, &settings)
        },
        effective,
    }
}

impl crate::routes::policy::AdminPolicy for CachePolicy {
    type View = CachePolicyView;
    const NAME: &'static str = "cache";

    /// `{"mode", "ttl_secs", "min_precision", "any_temperature", "tools"}` (fields left out
    /// take the config's defaults).
    fn check(&self) -> Result<(), ApiError> {
        if let Some(p) = self.min_precision {
            if !(0.0..=1.0).contains(&p) {
                return Err(ApiError::invalid(
                    "min_precision",
                    "must be between 0 and 1 (e.g. 0.9)",
                ));
            }
        }
        if self.ttl_secs == Some(0) {
            return Err(ApiError::invalid("ttl_secs", "must be at least 1"));
        }
        Ok(())
    }

    fn reload(
        state: &AppState,
    ) -> impl std::future::Future<Output = Result<(), crate::store::StoreError>> + Send {
        let cache = std::sync::Arc::clone(&state.cache);
        async move { cache.refresh().await }
    }

    fn view(state: &AppState, tenant_id: &str, own: Option<Self>) -> CachePolicyView {
        cache_policy_view(state, tenant_id, own)
    }
}
