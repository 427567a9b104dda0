//! The tier decision for a routed request (`model: "auto"`): signals in, tier and reason out.
//!
//! The classifier's score (its expected quality gain on the large tier) is compared with a
//! threshold read off its held-out curve: a policy names a point on that curve (a share of the
//! quality gap to recover, or a share of large calls), and budget pressure moves the point toward
//! the small tier smoothly before the budget refuses anything.

/// The tier a request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// The small tier.
    Small,
    /// The large tier.
    Large,
}

/// Why a request went where it did (shown in `x-gateway-route` and stored in the ledger).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The client named a tier's model: never rerouted.
    Explicit,
    /// The classifier's score against the policy's threshold.
    Classifier,
    /// Budget pressure moved the threshold and changed the tier the policy alone would pick.
    Budget,
    /// The request carries tools or images and the configured rule sends those to one tier.
    Rule,
    /// No classifier is loaded (configured to fall back to the large tier).
    Fallback,
    /// The chosen tier could not answer (no healthy replica, or every attempt failed) and the
    /// other tier did.
    Unhealthy,
}

impl Reason {
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Explicit => "explicit",
            Self::Classifier => "classifier",
            Self::Budget => "budget",
            Self::Rule => "rule",
            Self::Fallback => "fallback",
            Self::Unhealthy => "unhealthy",
        }
    }
}

/// A tenant's routing policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// Recover 95% of the quality gap between the tiers at the least large-call share.
    Quality,
    /// Recover 80% of the gap.
    Balanced,
    /// Recover 50% of the gap.
    Cost,
    /// An explicit share of large calls (0..=1).
    LargeShare(f64),
}

impl Policy {
    /// Parse `quality`, `balanced` or `cost`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "quality" => Some(Self::Quality),
            "balanced" => Some(Self::Balanced),
            "cost" => Some(Self::Cost),
            _ => None,
        }
    }

    /// Name as shown in the header (`share=0.30` for an explicit share).
    pub fn label(self) -> String {
        match self {
            Self::Quality => "quality".into(),
            Self::Balanced => "balanced".into(),
            Self::Cost => "cost".into(),
            Self::LargeShare(s) => format!("share={s:.2}"),
        }
    }

    /// The share of the quality gap a named policy recovers.
    pub fn target_pgr(self) -> Option<f64> {
        match self {
            Self::Quality => Some(0.95),
            Self::Balanced => Some(0.80),
            Self::Cost => Some(0.50),
            Self::LargeShare(_) => None,
        }
    }
}

/// A classifier's held-out curve: for ascending shares of large calls, the score threshold that
/// gives that share and the share of the quality gap it recovered.
#[derive(Debug, Clone)]
pub struct Curve {
    points: Vec<(f64, f32, f64)>,
}

impl Curve {
    /// From `(large_share, threshold, pgr)` points, ascending in share (at least two).
    pub fn new(points: Vec<(f64, f32, f64)>) -> Option<Self> {
        (points.len() >= 2 && points.windows(2).all(|w| w[0].0 <= w[1].0))
            .then_some(Self { points })
    }

    /// The least share of large calls that recovers `pgr` of the gap (1 when none does).
    pub fn share_for_pgr(&self, pgr: f64) -> f64 {
        self.points.iter().find(|p| p.2 >= pgr).map_or(1.0, |p| p.0)
    }

    /// The share of large calls a policy asks for.
    pub fn share_for(&self, policy: Policy) -> f64 {
        match policy {
            Policy::LargeShare(s) => s.clamp(0.0, 1.0),
            p => self.share_for_pgr(p.target_pgr().unwrap_or(1.0)),
        }
    }

    /// A column of the curve at `share`, interpolated linearly between its points.
    fn at(&self, share: f64, column: impl Fn(&(f64, f32, f64)) -> f64) -> f64 {
        let share = share.clamp(0.0, 1.0);
        let i = self.points.partition_point(|p| p.0 < share);
        if i == 0 {
            return column(&self.points[0]);
        }
        let Some(hi) = self.points.get(i) else {
            return column(&self.points[self.points.len() - 1]);
        };
        let lo = &self.points[i - 1];
        let span = hi.0 - lo.0;
        if span <= 0.0 {
            return column(hi);
        }
        let t = (share - lo.0) / span;
        column(lo) + (column(hi) - column(lo)) * t
    }

    /// The score threshold giving `share` large calls.
    pub fn threshold_at(&self, share: f64) -> f32 {
        self.at(share, |p| f64::from(p.1)) as f32
    }

    /// The share of the quality gap recovered with `share` large calls (held out).
    pub fn pgr_at(&self, share: f64) -> f64 {
        self.at(share, |p| p.2)
    }
}

/// Where budget pressure starts moving the threshold: this share of the window's limit used.
pub const PRESSURE_START: f64 = 0.8;

/// The share of large calls left under budget pressure: the policy's share until
/// [`PRESSURE_START`] of the budget is used, then falling linearly to none at the limit.
pub fn pressured_share(share: f64, utilisation: f64) -> f64 {
    if utilisation <= PRESSURE_START {
        return share;
    }
    share * ((1.0 - utilisation) / (1.0 - PRESSURE_START)).clamp(0.0, 1.0)
}

/// What the decision reads.
#[derive(Debug, Clone, Copy)]
pub struct Signals {
    /// The classifier's score for the prompt (higher: more to gain on the large tier); `None`
    /// when no classifier is loaded.
    pub score: Option<f32>,
    /// The tenant's policy.
    pub policy: Policy,
    /// The highest utilisation (0..=1+) among the tenant's budgets that downgrade.
    pub utilisation: f64,
    /// The rule for a request with tools or images, when it has them: `Some(tier)`.
    pub rule: Option<Choice>,
}

/// The decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// The tier.
    pub tier: Choice,
    /// Why.
    pub reason: Reason,
    /// The share of large calls the threshold was set for.
    pub share: f64,
    /// The threshold the score was compared with.
    pub threshold: f32,
}

/// Decide the tier of a routed request.
pub fn decide(curve: Option<&Curve>, s: &Signals) -> Decision {
    let fixed = |tier, reason| Decision {
        tier,
        reason,
        share: if tier == Choice::Large { 1.0 } else { 0.0 },
        threshold: f32::NAN,
    };
    if let Some(tier) = s.rule {
        return fixed(tier, Reason::Rule);
    }
    let (Some(curve), Some(score)) = (curve, s.score) else {
        return fixed(Choice::Large, Reason::Fallback);
    };
    let share = curve.share_for(s.policy);
    let pressured = pressured_share(share, s.utilisation);
    let threshold = curve.threshold_at(pressured);
    let tier = if score >= threshold {
        Choice::Large
    } else {
        Choice::Small
    };
    let unpressured = if score >= curve.threshold_at(share) {
        Choice::Large
    } else {
        Choice::Small
    };
    Decision {
        tier,
        reason: if tier == unpressured {
            Reason::Classifier
        } else {
            Reason::Budget
        },
        share: pressured,
        threshold,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    /// Scores fall from 1 to -1 as the share grows; PGR rises and saturates at 60%.
    fn curve() -> Curve {
        let pts = (0..=10)
            .map(|i| {
                let s = f64::from(i) / 10.0;
                (s, 1.0 - 2.0 * s as f32, (s / 0.6).min(1.0))
            })
            .collect();
        Curve::new(pts).unwrap()
    }

    fn signals(score: f32, policy: Policy) -> Signals {
        Signals {
            score: Some(score),
            policy,
            utilisation: 0.0,
            rule: None,
        }
    }

    #[test]
    fn policies_read_their_share_off_the_curve() {
        let c = curve();
        assert_eq!(c.share_for(Policy::Cost), 0.3);
        assert_eq!(c.share_for(Policy::Balanced), 0.5);
        assert_eq!(c.share_for(Policy::Quality), 0.6);
        assert_eq!(c.share_for(Policy::LargeShare(1.7)), 1.0);
        assert!((c.threshold_at(0.25) - 0.5).abs() < 1e-6, "interpolated");
        assert!((c.pgr_at(0.3) - 0.5).abs() < 1e-12);
        assert_eq!(c.pgr_at(0.9), 1.0);
        assert_eq!(c.threshold_at(0.0), 1.0);
        assert_eq!(c.threshold_at(1.0), -1.0);
        assert!(Curve::new(vec![(0.5, 0.0, 0.0), (0.2, 0.0, 0.0)]).is_none());
    }

    #[test]
    fn the_score_against_the_threshold_picks_the_tier() {
        let c = curve();
        // Balanced: 50% large, threshold 0.0.
        let hi = decide(Some(&c), &signals(0.1, Policy::Balanced));
        assert_eq!((hi.tier, hi.reason), (Choice::Large, Reason::Classifier));
        let lo = decide(Some(&c), &signals(-0.1, Policy::Balanced));
        assert_eq!((lo.tier, lo.reason), (Choice::Small, Reason::Classifier));
        // Cost asks for 30% large (threshold 0.4): the same 0.1 goes small.
        assert_eq!(
            decide(Some(&c), &signals(0.1, Policy::Cost)).tier,
            Choice::Small
        );
        assert_eq!(
            decide(Some(&c), &signals(-0.9, Policy::LargeShare(1.0))).tier,
            Choice::Large
        );
    }

    #[test]
    fn budget_pressure_moves_the_threshold_smoothly_toward_small() {
        assert_eq!(pressured_share(0.5, 0.5), 0.5);
        assert!((pressured_share(0.5, 0.9) - 0.25).abs() < 1e-12);
        assert_eq!(pressured_share(0.5, 1.2), 0.0);
        let c = curve();
        let mut s = signals(0.1, Policy::Balanced);
        s.utilisation = 0.85;
        // 0.5 · 0.75 = 37.5% large: threshold 0.25, so 0.1 goes small because of the budget.
        let d = decide(Some(&c), &s);
        assert_eq!((d.tier, d.reason), (Choice::Small, Reason::Budget));
        s.score = Some(0.6);
        assert_eq!(decide(Some(&c), &s).reason, Reason::Classifier);
        // Shares shrink monotonically with utilisation.
        let shares: Vec<f64> = (80..=100)
            .map(|u| pressured_share(0.5, f64::from(u) / 100.0))
            .collect();
        assert!(shares.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn rules_and_a_missing_classifier_decide_without_a_score() {
        let mut s = signals(-1.0, Policy::Cost);
        s.rule = Some(Choice::Large);
        assert_eq!(decide(Some(&curve()), &s).reason, Reason::Rule);
        let d = decide(None, &signals(0.0, Policy::Cost));
        assert_eq!((d.tier, d.reason), (Choice::Large, Reason::Fallback));
    }
}
