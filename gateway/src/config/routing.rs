//! `[routing]`: the tier router for `model: "auto"` (and any model name configured as `auto`).
//! A tenant without its own policy (`gatewayctl routing set`) gets `policy` or `large_share`.

use serde::{Deserialize, Serialize};

use crate::types::routing::{RoutePolicyName, RoutingPolicy};

/// What `auto` does when the classifier cannot be loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unavailable {
    /// Refuse to start (a clear error naming the artefact).
    Error,
    /// Start, log a warning, and send every routed request to the large tier (reason
    /// `fallback`).
    Large,
}

/// The tier for a routed request that carries tools or images (the classifier was trained on
/// plain prompts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolsRule {
    /// The large tier.
    Large,
    /// The small tier.
    Small,
    /// The classifier decides from the text as for any request.
    Classifier,
}

/// Tier router settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// A classifier artefact from `gateway router train` (default: the shipped one).
    pub classifier: Option<std::path::PathBuf>,
    /// Default policy: `quality`, `balanced` or `cost`.
    pub policy: RoutePolicyName,
    /// Default share of large calls instead of `policy` (0..=1).
    pub large_share: Option<f64>,
    /// `error` or `large`: when the classifier cannot be loaded.
    pub if_unavailable: Unavailable,
    /// `large`, `small` or `classifier`: the tier of a routed request with tools or images.
    pub tools: ToolsRule,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            classifier: None,
            policy: RoutePolicyName::Balanced,
            large_share: None,
            if_unavailable: Unavailable::Error,
            tools: ToolsRule::Large,
        }
    }
}

impl RoutingConfig {
    /// The defaults as a policy (a tenant's own one replaces it whole).
    pub fn defaults(&self) -> RoutingPolicy {
        RoutingPolicy {
            policy: self.large_share.is_none().then_some(self.policy),
            large_share: self.large_share,
        }
    }
}
