//! A tenant's routing policy for `model: "auto"`.

use serde::{Deserialize, Serialize};

/// A named point on the classifier's held-out curve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoutePolicyName {
    /// Recover 95% of the quality gap between the tiers, at the least large-call share.
    Quality,
    /// Recover 80% of the gap.
    Balanced,
    /// Recover 50% of the gap.
    Cost,
}

/// A tenant's routing policy: a named policy, or an explicit share of large calls. Fields left
/// out take the config's `[routing]` default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingPolicy {
    /// `quality`, `balanced` or `cost`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<RoutePolicyName>,
    /// Target share of routed requests sent to the large tier (0..=1), instead of a named
    /// policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub large_share: Option<f64>,
}

impl RoutingPolicy {
    /// Check the fields (one of the two must be set); the error names the field.
    pub fn check(&self) -> Result<(), (&'static str, &'static str)> {
        if self.policy.is_none() && self.large_share.is_none() {
            return Err((
                "policy",
                "must be given (quality, balanced or cost), or `large_share` (0..1) instead",
            ));
        }
        if self.large_share.is_some_and(|s| !(0.0..=1.0).contains(&s)) {
            return Err(("large_share", "must be between 0 and 1"));
        }
        if self.policy.is_some() && self.large_share.is_some() {
            return Err((
                "large_share",
                "cannot be set together with `policy`: give one of them",
            ));
        }
        Ok(())
    }

    /// The pure decision's policy, if this one sets any.
    pub fn decision_policy(&self) -> Option<router::tier::Policy> {
        use router::tier::Policy;
        match (self.policy, self.large_share) {
            (_, Some(s)) => Some(Policy::LargeShare(s)),
            (Some(RoutePolicyName::Quality), None) => Some(Policy::Quality),
            (Some(RoutePolicyName::Balanced), None) => Some(Policy::Balanced),
            (Some(RoutePolicyName::Cost), None) => Some(Policy::Cost),
            (None, None) => None,
        }
    }
}
