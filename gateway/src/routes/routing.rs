//! The tier router's admin view: a tenant's routing policy for `model: "auto"` and what it means
//! on the classifier's curve (served by [`crate::routes::policy`]; what `gatewayctl routing` calls).

use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::state::AppState;
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

impl crate::routes::policy::AdminPolicy for RoutingPolicy {
    type View = RoutingPolicyView;
    const NAME: &'static str = "routing";

    /// `{"policy": "quality"|"balanced"|"cost"}` or `{"large_share": 0.3}`.
    fn check(&self) -> Result<(), ApiError> {
        RoutingPolicy::check(self)
            .map_err(|(field, message)| ApiError::invalid(field, format!("`{field}` {message}")))
    }

    fn reload(
        state: &AppState,
    ) -> impl std::future::Future<Output = Result<(), crate::store::StoreError>> + Send {
        let routing = std::sync::Arc::clone(&state.routing);
        async move { routing.refresh().await }
    }

    fn view(state: &AppState, tenant_id: &str, own: Option<Self>) -> RoutingPolicyView {
        policy_view(state, tenant_id, own)
    }
}
