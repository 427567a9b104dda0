//! The second-stage verifier of semantic cache hits: a small learned model over a candidate
//! pair, because a false hit (answering a different question) is worse than a miss and plain
//! cosine cannot tell "IIT JEE 2016 cutoff" from "IIT JEE 2017 cutoff".
//!
//! It is a stack ([`features`] lists every input):
//! - four L2-regularised logistic regressions over vector representations of the pair: a
//!   symmetric bilinear form of the sentence vectors' leading principal components, the product
//!   and difference of the sentence vectors, the same of the max-pooled contextual token vectors,
//!   and the rarity-weighted direction of each side's unmatched tokens;
//! - gradient-boosted trees over lexical and alignment features (cosines, each token's best match
//!   in the other text, mismatched numbers, entities, negations and question words, rarity of the
//!   unmatched tokens) plus the four regressions' scores. Trees can say "a differing number
//!   vetoes a high cosine", which no single weight can.
//!
//! [`train`] fits it with cross-validation whose folds keep every repeat of a question on one
//! side (`gateway embed train-verifier`); the held-out curve ships in the artefact so a tenant
//! setting can pick a point on it (a target precision → a threshold).

pub mod features;
pub mod train;

use serde::{Deserialize, Serialize};

pub use features::{Text, BASES, EXTRA, FEATURES, FORM};
pub use train::{
    train, Calibration, Embedded, SourceFigures, Sources, TrainOptions, Trained, DEFAULT_PRECISION,
};

use crate::eval::Point;
use crate::learn::linear::Linear;
use crate::learn::trees::Boosted;
use crate::static_embed::StaticEmbedder;
use features::{PairBasics, Stats};

/// Every column the trees read, in order: [`FEATURES`], [`FORM`], [`EXTRA`], then with the
/// linear models over vectors (`linear`), [`BASES`].
pub fn columns(linear: bool) -> Vec<String> {
    let bases: &[&str] = if linear { BASES } else { &[] };
    FEATURES
        .iter()
        .chain(FORM)
        .chain(EXTRA)
        .chain(bases)
        .map(|s| (*s).to_owned())
        .collect()
}

/// A trained verifier and its cross-validated curve.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Verifier {
    /// The columns the trees were trained on (must equal [`columns`] to load).
    pub columns: Vec<String>,
    /// What was fitted on the training texts (token rarity, principal components).
    pub stats: Stats,
    /// One linear model per [`BASES`] entry.
    pub bases: Vec<Linear>,
    /// The trees.
    pub trees: Boosted,
    /// Held-out (cross-validated) precision/recall by threshold on the verifier's probability;
    /// the precision is the worst source's (see [`train`]).
    pub curve: Vec<CurvePoint>,
    /// What it was trained on.
    pub trained_on: String,
}

/// One point of the shipped curve.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct CurvePoint {
    /// Probability threshold.
    pub threshold: f32,
    /// Held-out precision at it (the lowest among the training sources).
    pub precision: f64,
    /// Held-out recall at it.
    pub recall: f64,
}

impl From<Point> for CurvePoint {
    fn from(p: Point) -> Self {
        Self {
            threshold: p.threshold,
            precision: p.precision,
            recall: p.recall,
        }
    }
}

impl Verifier {
    /// Load an artefact, checking that it was trained on this build's features.
    pub fn from_json(json: &str) -> Result<Self, String> {
        let v: Self = serde_json::from_str(json).map_err(|e| {
            format!("unreadable verifier: {e}; retrain it with `gateway embed train-verifier`")
        })?;
        let linear = v.stats.pca.is_some();
        if v.columns != columns(linear) {
            return Err(format!(
                "the verifier was trained on columns {:?}, this build computes {:?}; \
                 retrain it with `gateway embed train-verifier`",
                v.columns,
                columns(linear)
            ));
        }
        let (dim, k) = v
            .stats
            .pca
            .as_ref()
            .map_or((0, 0), |p| (p.mean.len(), p.components.len()));
        let expected: Vec<usize> = if linear {
            vec![k * (k + 1) / 2, 2 * dim, 2 * dim, 3 * dim + 4]
        } else {
            Vec::new()
        };
        let found: Vec<usize> = v.bases.iter().map(|b| b.weights.len()).collect();
        if found != expected
            || v.stats
                .pca
                .as_ref()
                .is_some_and(|p| p.components.iter().any(|c| c.len() != dim))
        {
            return Err(format!(
                "the verifier's linear models take {found:?} inputs, this build computes \
                 {expected:?}; retrain it with `gateway embed train-verifier`"
            ));
        }
        if v.curve.is_empty() {
            return Err("the verifier has no held-out curve".into());
        }
        Ok(v)
    }

    /// Probability that `a` and `b` ask the same question.
    pub fn probability(&self, a: &Text<'_>, b: &Text<'_>, table: &StaticEmbedder) -> f32 {
        let basics = PairBasics::new(a, b, table);
        let inputs = self.stats.inputs(&basics, a, b, table);
        self.judge(&basics, inputs)
    }

    /// The probability of a pair from its basics and inputs (training scores held-out pairs
    /// through here too). The same words in the same order are the same question, whatever
    /// the model says: "what is love" and "What is love?" must not miss at a strict setting.
    fn judge(&self, basics: &PairBasics, inputs: features::Inputs) -> f32 {
        if basics.same_words {
            return 1.0;
        }
        let mut row = inputs.features;
        row.extend(
            self.bases
                .iter()
                .zip(&inputs.bases)
                .map(|(m, x)| m.margin(x)),
        );
        self.trees.probability(&row)
    }

    /// The lowest threshold whose held-out precision reaches `precision` (a tenant's setting),
    /// or `None` when the curve never gets there.
    pub fn threshold_for(&self, precision: f64) -> Option<CurvePoint> {
        lowest_reaching(&self.curve, precision)
    }
}

/// The lowest threshold of `curve` whose precision reaches `precision`.
pub(crate) fn lowest_reaching(curve: &[CurvePoint], precision: f64) -> Option<CurvePoint> {
    curve
        .iter()
        .filter(|p| p.precision >= precision && p.recall > 0.0)
        .min_by(|a, b| a.threshold.total_cmp(&b.threshold))
        .copied()
}
