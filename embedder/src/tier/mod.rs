//! The small/large tier classifier behind `model: "auto"`: how much a prompt gains from the
//! large model over the small one.
//!
//! Two L2-regularised logistic regressions over the same input row ([`features`]: TF-IDF of words
//! and word pairs, plus markers of the question's kind) estimate the probability that each model
//! answers correctly; the **gain** is their difference, the expected quality recovered by sending
//! this prompt to the large model. Ranking by gain beats ranking by "the small model fails"
//! because some prompts defeat both models (no point paying for the large one) and a few are
//! answered by the small one only. `p_large`, the probability that the large model is needed
//! (small wrong, large right), is the gain calibrated by a one-variable logistic fit on held-out
//! gains.
//!
//! [`train`] cross-validates with folds grouped by subject (every subject is held out once, as
//! real traffic brings subjects the training never saw) and ships the held-out curve, so a policy
//! ("recover 80% of the quality gap", "30% large calls") becomes a threshold on the gain read off
//! traffic the model had not seen. [`eval`] has RouteLLM's figures.

pub mod eval;
pub mod features;
pub mod train;

use serde::{Deserialize, Serialize};

pub use eval::{Outcome, RouteCurve, RouteSummary};
pub use features::{Scaler, Vocabulary, HAND};
pub use train::{train, Embedded, Labelled, TierTrainOptions, TierTrained};

use crate::learn::linear::Linear;
use crate::learn::trees::sigmoid;

/// The classifier shipped with the gateway, trained on the RouteLLM MMLU dev file with
/// `gateway router train --data ../shared/data/routing-dev.jsonl`.
pub const SHIPPED_TIER_MODEL: &str = include_str!("../../assets/tier-router.json");

/// One point of the held-out curve: with prompts whose gain is at least `threshold` sent large,
/// `large_share` of calls went large and `pgr` of the quality gap was recovered.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct SharePoint {
    /// Share of calls on the large model (0..=1, ascending along the curve).
    pub large_share: f64,
    /// Gain threshold giving that share on held-out prompts.
    pub threshold: f32,
    /// Held-out PGR at that share.
    pub pgr: f64,
}

/// An embedding of the prompt the classifier reads beside its text features.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EmbeddingInput {
    /// Where the vector comes from: `static` (the static table distilled from
    /// all-MiniLM-L6-v2, [`crate::static_embed`]: microseconds per prompt).
    pub source: String,
    /// Its dimensions.
    pub dim: usize,
    /// How much its (unit-length) vector weighs against the unit-length TF-IDF vector.
    pub weight: f32,
}

/// The embedding sources a classifier may read.
pub const EMBEDDING_SOURCES: &[&str] = &["static"];

/// Points kept on the shipped curve (every 1% of large calls).
pub const CURVE_POINTS: usize = 100;

/// A trained tier classifier.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TierModel {
    /// The marker columns it was trained on (must equal [`HAND`] to load).
    pub hand_columns: Vec<String>,
    /// TF-IDF vocabulary.
    pub vocabulary: Vocabulary,
    /// Marker standardisation.
    pub scaler: Scaler,
    /// Log-odds that the large model answers correctly.
    pub large: Linear,
    /// Log-odds that the small model answers correctly.
    pub small: Linear,
    /// `p_large = sigmoid(a · gain + b)`, fitted on held-out gains.
    pub calibration: [f32; 2],
    /// Held-out curve, ascending in large share.
    pub curve: Vec<SharePoint>,
    /// Held-out figures (folds grouped by subject).
    pub held_out: RouteSummary,
    /// What it was trained on.
    pub trained_on: String,
    /// The prompt embedding it also reads (`None`: text features only, as shipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<EmbeddingInput>,
}

/// The classifier's judgement of one prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierScore {
    /// Expected quality gained on the large model (`P(large right) − P(small right)`, −1..1).
    pub gain: f32,
    /// Probability that the large model is needed (small wrong, large right).
    pub p_large: f32,
}

/// `P(large right) − P(small right)` for an input row.
fn gain(large: &Linear, small: &Linear, row: &[(u32, f32)]) -> f32 {
    sigmoid(large.margin_sparse(row)) - sigmoid(small.margin_sparse(row))
}

impl TierModel {
    /// Load an artefact, checking that it was trained on this build's features.
    pub fn from_json(json: &str) -> Result<Self, String> {
        let mut m: Self = serde_json::from_str(json).map_err(|e| {
            format!("unreadable tier classifier: {e}; retrain it with `gateway router train`")
        })?;
        if m.hand_columns != HAND {
            return Err(format!(
                "the tier classifier was trained on markers {:?}, this build computes {:?}; \
                 retrain it with `gateway router train`",
                m.hand_columns, HAND
            ));
        }
        if let Some(e) = &m.embedding {
            if !EMBEDDING_SOURCES.contains(&e.source.as_str())
                || e.dim == 0
                || !e.weight.is_finite()
            {
                return Err(format!(
                    "the tier classifier reads a `{}` embedding of {} dimensions, which this \
                     build does not compute (it has {EMBEDDING_SOURCES:?}); retrain it with \
                     `gateway router train`",
                    e.source, e.dim
                ));
            }
        }
        let d = m.vocabulary.len() + HAND.len() + m.embedding.as_ref().map_or(0, |e| e.dim);
        if m.vocabulary.idf.len() != m.vocabulary.len()
            || m.large.weights.len() != d
            || m.small.weights.len() != d
            || m.scaler.mean.len() != HAND.len()
            || m.scaler.scale.len() != HAND.len()
            || m.scaler.clip.is_nan()
            || m.scaler.clip <= 0.0
        {
            return Err(format!(
                "the tier classifier's parts do not fit together ({} terms, {} idf, weights {} \
                 and {}, expected {d}); retrain it with `gateway router train`",
                m.vocabulary.len(),
                m.vocabulary.idf.len(),
                m.large.weights.len(),
                m.small.weights.len()
            ));
        }
        if m.curve.len() < 2
            || m.curve
                .windows(2)
                .any(|w| w[0].large_share > w[1].large_share)
        {
            return Err("the tier classifier has no usable held-out curve".into());
        }
        m.vocabulary = m.vocabulary.indexed();
        Ok(m)
    }

    /// Score one prompt (any text: an empty one scores like any other). A classifier that reads
    /// an embedding ([`TierModel::embedding`]) needs [`TierModel::score_with`].
    pub fn score(&self, prompt: &str) -> TierScore {
        self.score_row(features::row(&self.vocabulary, &self.scaler, prompt))
    }

    /// Score one prompt with its embedding, for a classifier that reads one (the vector must have
    /// the artefact's dimensions); a classifier that does not ignores it.
    pub fn score_with(&self, prompt: &str, vector: Option<&[f32]>) -> Result<TierScore, String> {
        let mut row = features::row(&self.vocabulary, &self.scaler, prompt);
        if let Some(e) = &self.embedding {
            match vector {
                Some(v) if v.len() == e.dim => {
                    features::push_embedding(&mut row, &self.vocabulary, v, e.weight)
                }
                Some(v) => {
                    return Err(format!(
                        "the tier classifier reads a {}-dimensional {} embedding, got {}",
                        e.dim,
                        e.source,
                        v.len()
                    ))
                }
                None => {
                    return Err(format!(
                        "the tier classifier reads the prompt's {} embedding",
                        e.source
                    ))
                }
            }
        }
        Ok(self.score_row(row))
    }

    fn score_row(&self, row: Vec<(u32, f32)>) -> TierScore {
        let gain = gain(&self.large, &self.small, &row);
        TierScore {
            gain,
            p_large: sigmoid(self.calibration[0] * gain + self.calibration[1]),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn a_classifier_that_reads_an_embedding_needs_one_of_its_size() {
        let shipped = TierModel::from_json(SHIPPED_TIER_MODEL).unwrap();
        assert_eq!(
            shipped.score_with("hi", Some(&[1.0])).unwrap(),
            shipped.score("hi"),
            "a text-only classifier ignores a vector"
        );
        let mut v: serde_json::Value = serde_json::from_str(SHIPPED_TIER_MODEL).unwrap();
        v["embedding"] = serde_json::json!({"source": "static", "dim": 3, "weight": 1.0});
        let e = TierModel::from_json(&v.to_string()).unwrap_err();
        assert!(e.contains("do not fit") && e.contains("retrain"), "{e}");
        for side in ["large", "small"] {
            let w = v[side]["weights"].as_array_mut().unwrap();
            w.extend([
                serde_json::json!(0.0),
                serde_json::json!(0.0),
                serde_json::json!(2.0),
            ]);
        }
        let m = TierModel::from_json(&v.to_string()).unwrap();
        assert!(m
            .score_with("hi", None)
            .unwrap_err()
            .contains("static embedding"));
        assert!(m
            .score_with("hi", Some(&[0.0; 4]))
            .unwrap_err()
            .contains("3-dimensional"));
        // Its last column weighs 2 on both sides: equal log-odds shifts, a different gain.
        let a = m.score_with("hi", Some(&[0.0, 0.0, 0.0])).unwrap();
        assert_eq!(a, shipped.score("hi"));
        let b = m.score_with("hi", Some(&[0.0, 0.0, 1.0])).unwrap();
        assert_ne!(a.gain, b.gain);
        v["embedding"]["source"] = serde_json::json!("transformer");
        let e = TierModel::from_json(&v.to_string()).unwrap_err();
        assert!(e.contains("`transformer`") && e.contains("retrain"), "{e}");
    }

    #[test]
    fn the_shipped_model_loads_scores_any_text_and_refuses_a_mismatch() {
        let m = TierModel::from_json(SHIPPED_TIER_MODEL).expect("shipped tier model loads");
        assert!(m.held_out.apgr > 0.5, "{:?}", m.held_out);
        let s = m.score("");
        assert!(s.gain.is_finite() && (0.0..=1.0).contains(&s.p_large));
        let mut broken: serde_json::Value = serde_json::from_str(SHIPPED_TIER_MODEL).unwrap();
        broken["hand_columns"] = serde_json::json!(["length"]);
        let e = TierModel::from_json(&broken.to_string()).unwrap_err();
        assert!(e.contains("retrain"), "{e}");
        let mut unclipped: serde_json::Value = serde_json::from_str(SHIPPED_TIER_MODEL).unwrap();
        unclipped["scaler"].as_object_mut().unwrap().remove("clip");
        let e = TierModel::from_json(&unclipped.to_string()).unwrap_err();
        assert!(e.contains("clip") && e.contains("retrain"), "{e}");
        assert!(TierModel::from_json("{}")
            .unwrap_err()
            .contains("unreadable"));
    }

    #[test]
    fn free_form_prompts_are_scored_by_their_words_not_pinned_by_a_missing_marker() {
        // The training prompts are all multiple choice; a chat turn has no options. Unclipped,
        // that one marker put every such prompt at a gain of ~1 (always large).
        let m = TierModel::from_json(SHIPPED_TIER_MODEL).unwrap();
        let gains: Vec<f32> = [
            "What is 2+2?",
            "Hi",
            "Explain quantum entanglement to a ten-year-old.",
            "Write a Python function that parses ISO 8601 dates and handles time zones.",
            "Translate 'good morning' into French.",
            "What is the capital of France?",
        ]
        .iter()
        .map(|p| m.score(p).gain)
        .collect();
        assert!(gains.iter().all(|&g| g < 0.9), "{gains:?}");
        let (lo, hi) = gains
            .iter()
            .fold((f32::MAX, f32::MIN), |(lo, hi), &g| (lo.min(g), hi.max(g)));
        assert!(hi - lo > 0.1, "{gains:?}");
    }
}
