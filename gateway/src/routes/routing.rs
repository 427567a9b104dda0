//! Admin routes of the tier router: a tenant's routing policy for `model: "auto"` (what
//! `gatewayctl routing` calls).

use axum::body::Body;
use axum::extract::{Path, State};
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::routes::{parse_json, read_body, tenant, ADMIN_BODY_LIMIT};
use crate::state::AppState;
use crate::store::PolicyKind;
use crate::types::routing::RoutingPolicy;

/// Body of the `/admin/v1/tenants/{tenant}/routing-policy` endpoints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoutingPolicyView {
    /// The tenant's id.
    pub tenant: String,
    /// Its own policy; `None`: the config's default.
    pub policy: Option<RoutingPolicy>,
    /// The policy in force.
    pub effective: RoutingPolicy,
    /// The share of routed requests the policy sends to the large tier on the classifier's
    /// held-out curve (`None`: no classifier loaded, everything goes large).
    pub expected_large_share: Option<f64>,
    /// The share of the quality gap between the tiers recovered there, held out.
    pub expected_quality_recovered: Option<f64>,
}

fn policy_view(state: &AppState, tenant_id: &str, own: Option<RoutingPolicy>) -> RoutingPolicyView {
    let expected = state.routing.expected(tenant_id);
    RoutingPolicyView {
        tenant: tenant_id.to_owned(),
        policy: own,
        effective: state.routing.policy(tenant_id),
        expected_large_share: expected.map(|(share, _)| share),
        expected_quality_recovered: expected.map(|(_, pgr)| pgr),
    }
}

/// `PUT /admin/v1/tenants/{tenant}/routing-policy {"policy": "quality"|"balanced"|"cost"}` or
/// `{"large_share": 0.3}`.
pub async fn set_policy(
    State(state): State<AppState>,
    Path(id_or_name): Path<String>,
    body: Body,
) -> Result<Json<RoutingPolicyView>, ApiError> {
    let policy: RoutingPolicy = parse_json(&read_body(body, ADMIN_BODY_LIMIT).await?)?;
    policy
        .check()
        .map_err(|(field, message)| ApiError::invalid(field, format!("`{field}` {message}")))?;
    let t = tenant(&state, &id_or_name).await?;
    crate::store::set_policy(state.store.as_ref(), &t.id, &policy).await?;
    state.routing.refresh().await?;
    Ok(Json(policy_view(&state, &t.id, Some(policy))))
}

/// `GET /admin/v1/tenants/{tenant}/routing-policy`
pub async fn get_policy(
    State(state): State<AppState>,
    Path(id_or_name): Path<String>,
) -> Result<Json<RoutingPolicyView>, ApiError> {
    let t = tenant(&state, &id_or_name).await?;
    let own = crate::store::policy_of::<RoutingPolicy>(state.store.as_ref(), &t.id).await?;
    Ok(Json(policy_view(&state, &t.id, own)))
}

/// `DELETE /admin/v1/tenants/{tenant}/routing-policy`: back to the config's default.
pub async fn delete_policy(
    State(state): State<AppState>,
    Path(id_or_name): Path<String>,
) -> Result<Json<RoutingPolicyView>, ApiError> {
    let t = tenant(&state, &id_or_name).await?;
    if !state
        .store
        .delete_policy(PolicyKind::Routing, &t.id)
        .await?
    {
        return Err(ApiError::NotFound(
            "this tenant has no routing policy of its own".into(),
        ));
    }
    state.routing.refresh().await?;
    Ok(Json(policy_view(&state, &t.id, None)))
}
