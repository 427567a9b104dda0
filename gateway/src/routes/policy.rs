//! The per-tenant policy endpoints, one implementation for every kind (cache, guard, routing):
//! `PUT /admin/v1/tenants/{tenant}/{kind}-policy` checks and stores the tenant's own policy and
//! reloads the component that reads it, `GET` shows it, `DELETE` drops it (back to the config's
//! defaults). Each kind says how it is checked, reloaded and shown.

use std::future::Future;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::Json;
use serde::Serialize;

use crate::error::ApiError;
use crate::routes::{parse_json, read_body, tenant, ADMIN_BODY_LIMIT};
use crate::state::AppState;
use crate::store::{StoreError, TenantPolicy};

/// A per-tenant policy the admin API sets, shows and drops.
pub trait AdminPolicy: TenantPolicy + Send + Sized + 'static {
    /// The answer's body.
    type View: Serialize;
    /// The kind's name in messages (`cache`, `guard`, `routing`).
    const NAME: &'static str;
    /// Check a policy an admin sent.
    fn check(&self) -> Result<(), ApiError>;
    /// Reload the component that reads this kind of policy.
    fn reload(state: &AppState) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// The answer for `tenant_id`, whose own policy is `own`.
    fn view(state: &AppState, tenant_id: &str, own: Option<Self>) -> Self::View;
}

/// `PUT /admin/v1/tenants/{tenant}/{kind}-policy`
pub async fn set_policy<P: AdminPolicy>(
    State(state): State<AppState>,
    Path(id_or_name): Path<String>,
    body: Body,
) -> Result<Json<P::View>, ApiError> {
    let policy: P = parse_json(&read_body(body, ADMIN_BODY_LIMIT).await?)?;
    policy.check()?;
    let t = tenant(&state, &id_or_name).await?;
    crate::store::set_policy(state.store.as_ref(), &t.id, &policy).await?;
    P::reload(&state).await?;
    Ok(Json(P::view(&state, &t.id, Some(policy))))
}

/// `GET /admin/v1/tenants/{tenant}/{kind}-policy`
pub async fn get_policy<P: AdminPolicy>(
    State(state): State<AppState>,
    Path(id_or_name): Path<String>,
) -> Result<Json<P::View>, ApiError> {
    let t = tenant(&state, &id_or_name).await?;
    let own = crate::store::policy_of::<P>(state.store.as_ref(), &t.id).await?;
    Ok(Json(P::view(&state, &t.id, own)))
}

/// `DELETE /admin/v1/tenants/{tenant}/{kind}-policy`: back to the config's defaults.
pub async fn delete_policy<P: AdminPolicy>(
    State(state): State<AppState>,
    Path(id_or_name): Path<String>,
) -> Result<Json<P::View>, ApiError> {
    let t = tenant(&state, &id_or_name).await?;
    if !state.store.delete_policy(P::KIND, &t.id).await? {
        return Err(ApiError::NotFound(format!(
            "this tenant has no {} policy of its own",
            P::NAME
        )));
    }
    P::reload(&state).await?;
    Ok(Json(P::view(&state, &t.id, None)))
}
