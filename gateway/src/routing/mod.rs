//! The route step's tier choice for `model: "auto"` (and any model name configured as `auto`):
//! the tier classifier from `embedder` scores the prompt, the pure decision in
//! `router::tier` turns the score and the tenant's policy into a tier and a reason.

pub mod tools;

use std::sync::Arc;
use std::time::Duration;

use embedder::static_embed::StaticEmbedder;
use embedder::tier::TierModel;
use router::tier::{Choice, Curve, Decision, Policy, Reason, Signals};

use crate::config::{RoutingConfig, ToolsRule, Unavailable};
use crate::store::{Store, StoreError, TenantPolicies};
use crate::tasks::Background;
use crate::types::routing::RoutingPolicy;
use crate::types::Tier;

/// A loaded classifier: the model, its held-out curve, and the static embedding table when the
/// model reads the prompt's embedding.
struct Loaded {
    model: TierModel,
    curve: Curve,
    statics: Option<StaticEmbedder>,
}

/// The tier router: the classifier (when loaded), its held-out curve and the tenants' policies.
pub struct TierRouter {
    config: RoutingConfig,
    model: Option<Loaded>,
    policies: TenantPolicies<RoutingPolicy>,
}

impl std::fmt::Debug for TierRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierRouter")
            .field(
                "classifier",
                &self.model.as_ref().map(|l| &l.model.trained_on),
            )
            .finish_non_exhaustive()
    }
}

/// What the route step decided for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// The tier.
    pub tier: Tier,
    /// Why.
    pub reason: Reason,
    /// The classifier's probability that the large tier is needed, when it scored the prompt.
    pub p_large: Option<f32>,
    /// The policy in force (`balanced`, `share=0.30`, …).
    pub policy: String,
    /// The budget pressure that moved the threshold: the share used of the tenant's tightest
    /// `downgrade` budget, when past [`router::tier::PRESSURE_START`].
    pub budget_used: Option<f64>,
}

impl Routed {
    /// The `x-gateway-route` header value: `tier=small reason=classifier p_large=0.17
    /// policy=balanced`.
    pub fn header(&self) -> String {
        let mut v = format!("tier={} reason={}", self.tier, self.reason.as_str());
        if let Some(p) = self.p_large {
            v.push_str(&format!(" p_large={p:.2}"));
        }
        v.push_str(" policy=");
        v.push_str(&self.policy);
        if let Some(u) = self.budget_used {
            v.push_str(&format!(" budget_used={u:.2}"));
        }
        v
    }
}

/// Read a classifier artefact (the shipped one without a path), checked against this build.
pub fn read_classifier(path: Option<&std::path::Path>) -> Result<TierModel, String> {
    let json = match path {
        Some(p) => {
            std::fs::read_to_string(p).map_err(|e| format!("reading {}: {e}", p.display()))?
        }
        None => embedder::tier::SHIPPED_TIER_MODEL.to_owned(),
    };
    TierModel::from_json(&json)
}

/// Load the classifier `config` names, with its held-out curve and, when it reads the static
/// embedding, the static table of the model in `model_dir`.
fn load(config: &RoutingConfig, model_dir: &std::path::Path) -> Result<Loaded, String> {
    let model = read_classifier(config.classifier.as_deref())
        .map_err(|e| format!("routing.classifier: {e}"))?;
    let curve = Curve::new(
        model
            .curve
            .iter()
            .map(|p| (p.large_share, p.threshold, p.pgr))
            .collect(),
    )
    .ok_or("the tier classifier's held-out curve is not ascending")?;
    let statics = match &model.embedding {
        Some(e) => {
            let table = tools::static_model(model_dir).map_err(|err| {
                format!(
                    "routing.classifier reads the prompt's {} embedding: {err:#}",
                    e.source
                )
            })?;
            if table.dim() != e.dim {
                return Err(format!(
                    "routing.classifier reads {}-dimensional embeddings, the model in {} gives {}",
                    e.dim,
                    model_dir.display(),
                    table.dim()
                ));
            }
            Some(table)
        }
        None => None,
    };
    Ok(Loaded {
        model,
        curve,
        statics,
    })
}

impl TierRouter {
    /// A router with the tenants' policies from `tenants`. The classifier is loaded only when
    /// `routed` (some model name is configured as `auto`); one that cannot be loaded is an error
    /// unless `routing.if_unavailable = "large"`. A classifier that reads the static embedding
    /// takes it from the embedding model in `model_dir` (the semantic cache's).
    pub async fn new(
        config: RoutingConfig,
        model_dir: &std::path::Path,
        tenants: Arc<dyn Store>,
        routed: bool,
    ) -> anyhow::Result<Self> {
        let model = if routed {
            match load(&config, model_dir) {
                Ok(m) => Some(m),
                Err(e) if config.if_unavailable == Unavailable::Large => {
                    tracing::warn!(error = %e, "no tier classifier: `auto` goes to the large tier");
                    None
                }
                Err(e) => anyhow::bail!(
                    "{e} (set routing.if_unavailable = \"large\" to start without it)"
                ),
            }
        } else {
            None
        };
        let router = Self {
            config,
            model,
            policies: TenantPolicies::new(tenants),
        };
        router.refresh().await?;
        Ok(router)
    }

    /// Reload the policies every `every` until `background` stops.
    pub fn start(self: &Arc<Self>, background: &Background, every: Duration) {
        let router = Arc::clone(self);
        background.every("routing policies", every, move || {
            let router = Arc::clone(&router);
            async move { router.refresh().await }
        });
    }

    /// Reload every tenant's policy.
    pub async fn refresh(&self) -> Result<(), StoreError> {
        self.policies.refresh().await
    }

    /// The policy in force for `tenant_id`: its own, else the config's default.
    pub fn policy(&self, tenant_id: &str) -> RoutingPolicy {
        self.policies
            .get(tenant_id)
            .unwrap_or_else(|| self.config.defaults())
    }

    /// The decision's form of `tenant_id`'s policy (a stored or configured policy always names
    /// one; `balanced` otherwise).
    fn decision_policy(&self, tenant_id: &str) -> Policy {
        self.policy(tenant_id)
            .decision_policy()
            .unwrap_or(Policy::Balanced)
    }

    /// What `tenant_id`'s policy means on the classifier's held-out curve: the share of routed
    /// requests sent large and the share of the quality gap recovered (`None`: no classifier).
    pub fn expected(&self, tenant_id: &str) -> Option<(f64, f64)> {
        let curve = &self.model.as_ref()?.curve;
        let share = curve.share_for(self.decision_policy(tenant_id));
        Some((share, curve.pgr_at(share)))
    }

    /// Decide the tier of a routed request from its prompt text, under `budget_used` pressure
    /// (the share used of the tenant's tightest `downgrade` budget, 0..=1).
    pub fn route(
        &self,
        tenant_id: &str,
        prompt: &str,
        tools_or_images: bool,
        budget_used: f64,
    ) -> Routed {
        let policy = self.decision_policy(tenant_id);
        let rule = match (tools_or_images, self.config.tools) {
            (true, ToolsRule::Large) => Some(Choice::Large),
            (true, ToolsRule::Small) => Some(Choice::Small),
            _ => None,
        };
        let score = match (&self.model, rule) {
            (Some(loaded), None) => loaded.score(prompt),
            _ => None,
        };
        let signals = Signals {
            score: score.map(|s| s.gain),
            policy,
            utilisation: budget_used,
            rule,
        };
        let Decision { tier, reason, .. } =
            router::tier::decide(self.model.as_ref().map(|l| &l.curve), &signals);
        Routed {
            tier: match tier {
                Choice::Small => Tier::Small,
                Choice::Large => Tier::Large,
            },
            reason,
            p_large: score.map(|s| s.p_large),
            policy: policy.label(),
            budget_used: (score.is_some() && budget_used > router::tier::PRESSURE_START)
                .then_some(budget_used.min(1.0)),
        }
    }
}

impl Loaded {
    /// The classifier's score of `prompt` (with its static embedding when the model reads one);
    /// `None`, with a warning, when the prompt cannot be embedded (the decision then falls back).
    fn score(&self, prompt: &str) -> Option<embedder::tier::TierScore> {
        let vector = match &self.statics {
            Some(table) => match table.embed(prompt) {
                Ok(v) => Some(v),
                Err(e) => {
                    tracing::warn!(error = %e, "could not embed the prompt for the tier classifier");
                    return None;
                }
            },
            None => None,
        };
        match self.model.score_with(prompt, vector.as_deref()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "the tier classifier could not score the prompt");
                None
            }
        }
    }
}
