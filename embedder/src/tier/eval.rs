//! RouteLLM's evaluation of a small/large router (Ong et al., 2024): send the share `s` of
//! prompts with the highest scores to the large model and the rest to the small one; the quality
//! is the share answered correctly. PGR(s), the performance gap recovered, is
//! `(quality(s) − quality(small only)) / (quality(large only) − quality(small only))`; APGR is
//! its area over `s` from 0 to 1 (a random router: 0.5); CPT(x) is the least share of large
//! calls whose PGR reaches `x` (a random router: `x`).

use serde::{Deserialize, Serialize};

/// One labelled prompt's outcome: whether each model answered it correctly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The small model was right.
    pub small: bool,
    /// The large model was right.
    pub large: bool,
}

/// The curve of a router's scores on labelled prompts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouteCurve {
    /// PGR after `k` of `n` prompts went large, `k = 0..=n` (`pgr[k]`).
    pub pgr: Vec<f64>,
    /// The score of the `k`-th prompt sent large (descending), `k = 0..n`.
    pub scores: Vec<f32>,
    /// Quality with every prompt on the small model.
    pub small_quality: f64,
    /// Quality with every prompt on the large model.
    pub large_quality: f64,
}

/// The figures RouteLLM reports.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct RouteSummary {
    /// PGR at 20% large calls.
    pub pgr20: f64,
    /// PGR at 50% large calls.
    pub pgr50: f64,
    /// PGR at 80% large calls.
    pub pgr80: f64,
    /// Area under PGR over the share of large calls.
    pub apgr: f64,
    /// Least share of large calls recovering 50% of the gap.
    pub cpt50: f64,
    /// Least share of large calls recovering 80% of the gap.
    pub cpt80: f64,
}

impl RouteCurve {
    /// The curve of `scores` (higher: more in need of the large model) on `outcomes`. Ties keep
    /// input order, so the figures are reproducible.
    pub fn new(scores: &[f32], outcomes: &[Outcome]) -> Self {
        let n = scores.len().min(outcomes.len());
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        let count = |f: fn(&Outcome) -> bool| outcomes[..n].iter().filter(|o| f(o)).count();
        let small = count(|o| o.small) as f64;
        let large = count(|o| o.large) as f64;
        let gap = large - small;
        let mut pgr = Vec::with_capacity(n + 1);
        let mut correct = small;
        pgr.push(0.0);
        for &i in &order {
            correct +=
                f64::from(u8::from(outcomes[i].large)) - f64::from(u8::from(outcomes[i].small));
            pgr.push(if gap.abs() > 0.0 {
                (correct - small) / gap
            } else {
                0.0
            });
        }
        let nf = n.max(1) as f64;
        Self {
            pgr,
            scores: order.iter().map(|&i| scores[i]).collect(),
            small_quality: small / nf,
            large_quality: large / nf,
        }
    }

    /// Prompts on the curve.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// Whether the curve has no prompts.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    /// PGR with the share `s` of prompts on the large model.
    pub fn pgr_at(&self, s: f64) -> f64 {
        let k = (s.clamp(0.0, 1.0) * self.len() as f64).round() as usize;
        self.pgr[k.min(self.pgr.len() - 1)]
    }

    /// The least share of large calls whose PGR reaches `x` (1 when it never does).
    pub fn cpt(&self, x: f64) -> f64 {
        let n = self.len().max(1) as f64;
        self.pgr
            .iter()
            .position(|&p| p >= x)
            .map_or(1.0, |k| k as f64 / n)
    }

    /// Trapezoid area under PGR over the share of large calls.
    pub fn apgr(&self) -> f64 {
        let n = self.len();
        if n == 0 {
            return 0.0;
        }
        self.pgr
            .windows(2)
            .map(|w| (w[0] + w[1]) / 2.0)
            .sum::<f64>()
            / n as f64
    }

    /// The figures RouteLLM reports.
    pub fn summary(&self) -> RouteSummary {
        RouteSummary {
            pgr20: self.pgr_at(0.2),
            pgr50: self.pgr_at(0.5),
            pgr80: self.pgr_at(0.8),
            apgr: self.apgr(),
            cpt50: self.cpt(0.5),
            cpt80: self.cpt(0.8),
        }
    }
}

impl RouteSummary {
    /// What a random router gets in expectation (PGR equal to the share of large calls).
    pub const RANDOM: Self = Self {
        pgr20: 0.2,
        pgr50: 0.5,
        pgr80: 0.8,
        apgr: 0.5,
        cpt50: 0.5,
        cpt80: 0.8,
    };
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    fn o(small: bool, large: bool) -> Outcome {
        Outcome { small, large }
    }

    #[test]
    fn a_perfect_router_recovers_the_gap_with_the_prompts_that_need_it() {
        // Two of four prompts need the large model; one is right on both; one on neither.
        let outcomes = [
            o(false, true),
            o(true, true),
            o(false, true),
            o(false, false),
        ];
        let perfect = RouteCurve::new(&[0.9, 0.1, 0.8, 0.2], &outcomes);
        assert_eq!(perfect.pgr, [0.0, 0.5, 1.0, 1.0, 1.0]);
        assert_eq!(perfect.cpt(0.8), 0.5);
        assert!((perfect.apgr() - (0.25 + 0.75 + 1.0 + 1.0) / 4.0).abs() < 1e-12);
        let worst = RouteCurve::new(&[0.1, 0.9, 0.2, 0.8], &outcomes);
        assert_eq!(worst.pgr, [0.0, 0.0, 0.0, 0.5, 1.0]);
        assert_eq!(worst.cpt(0.8), 1.0);
        assert!(worst.apgr() < 0.5 && perfect.apgr() > 0.5);
        assert_eq!(perfect.small_quality, 0.25);
        assert_eq!(perfect.large_quality, 0.75);
    }

    #[test]
    fn a_prompt_the_large_model_gets_wrong_costs_quality() {
        let outcomes = [o(true, false), o(false, true), o(false, true)];
        let c = RouteCurve::new(&[0.9, 0.5, 0.4], &outcomes);
        // Gap = 2 - 1 = 1; sending the first large loses one answer.
        assert_eq!(c.pgr, [0.0, -1.0, 0.0, 1.0]);
        assert_eq!(c.summary().cpt50, 1.0);
    }

    #[test]
    fn random_scores_average_half() {
        let mut rng = crate::learn::Rng(5);
        let outcomes: Vec<Outcome> = (0..4000)
            .map(|_| o(rng.unit() < 0.6, rng.unit() < 0.8))
            .collect();
        let scores: Vec<f32> = (0..4000).map(|_| rng.unit() as f32).collect();
        let s = RouteCurve::new(&scores, &outcomes).summary();
        assert!((s.apgr - 0.5).abs() < 0.05, "{s:?}");
        assert!((s.cpt80 - 0.8).abs() < 0.1, "{s:?}");
    }
}
