//! The second-stage verifier of semantic cache hits: a small learned model over features of a
//! candidate pair, because a false hit (answering a different question) is worse than a miss and
//! plain cosine cannot tell "IIT JEE 2016 cutoff" from "IIT JEE 2017 cutoff".
//!
//! Features ([`FEATURES`]): transformer and static cosine; token-level alignments of the two
//! texts (for every token, its best match among the other text's tokens, by static vector and by
//! the transformer's contextual token vector: the weakest match shows a single differing year,
//! place or quantity); mismatched numbers,
//! capitalised words (entities), negations and question words; length ratio and word overlap.
//! The model is logistic regression on standardised features, trained with k-fold
//! cross-validation (`gateway embed train-verifier`); the held-out curve ships in the artefact
//! so a tenant setting can pick a point on it (a target precision → a threshold).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::bert::cosine;
use crate::eval::Point;
use crate::static_embed::StaticEmbedder;

/// Names of the features, in order.
pub const FEATURES: &[&str] = &[
    "cosine_transformer",
    "cosine_static",
    "align_min",
    "align_mean",
    "numbers_differ",
    "numbers_symmetric_difference",
    "entities_differ",
    "negation_differs",
    "question_word_differs",
    "length_ratio",
    "word_jaccard",
    "same_normalised_text",
    "cosine_transformer_x_align_min",
    "context_align_min",
    "context_align_mean",
];

const NEGATIONS: &[&str] = &["not", "no", "never", "without", "none", "cannot", "nor"];
const QUESTION_WORDS: &[&str] = &[
    "what", "how", "why", "which", "who", "whom", "whose", "where", "when", "is", "are", "can",
    "could", "should", "would", "do", "does", "did", "will", "was", "were",
];

fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '\''))
        .filter(|w| !w.is_empty())
        .map(str::to_owned)
        .collect()
}

fn numbers(ws: &[String]) -> BTreeSet<String> {
    ws.iter()
        .filter(|w| w.chars().any(|c| c.is_ascii_digit()))
        .map(|w| w.to_lowercase())
        .collect()
}

fn entities(ws: &[String]) -> BTreeSet<String> {
    ws.iter()
        .skip(1)
        .filter(|w| w.chars().next().is_some_and(char::is_uppercase))
        .map(|w| w.to_lowercase())
        .collect()
}

fn negated(ws: &[String]) -> bool {
    ws.iter().any(|w| {
        let w = w.to_lowercase();
        NEGATIONS.contains(&w.as_str()) || w.ends_with("n't")
    })
}

fn question_word(ws: &[String]) -> Option<String> {
    ws.iter()
        .map(|w| w.to_lowercase())
        .find(|w| QUESTION_WORDS.contains(&w.as_str()))
}

/// Best-match similarities of `from`'s token vectors against `to`'s.
fn best_matches(from: &[Vec<f32>], to: &[Vec<f32>]) -> Vec<f32> {
    from.iter()
        .map(|a| to.iter().map(|b| cosine(a, b)).fold(-1.0f32, f32::max))
        .collect()
}

/// What the transformer says about a pair: the cosine of the two sentence vectors and the
/// weakest and mean best match of each contextual token among the other text's tokens.
#[derive(Debug, Clone, Copy, Default)]
pub struct TransformerSignals {
    /// Sentence cosine.
    pub cosine: f32,
    /// Weakest best match of a token (a single differing word shows here).
    pub align_min: f32,
    /// Mean best match.
    pub align_mean: f32,
}

/// Alignment of two token vector lists: (weakest, mean) best match, both directions.
pub fn alignment(ta: &[Vec<f32>], tb: &[Vec<f32>]) -> (f32, f32) {
    let mut matches = best_matches(ta, tb);
    matches.extend(best_matches(tb, ta));
    if matches.is_empty() {
        return (0.0, 0.0);
    }
    let min = matches.iter().copied().fold(1.0f32, f32::min);
    (min, matches.iter().sum::<f32>() / matches.len() as f32)
}

/// The features of a pair, given what the transformer says about it.
pub fn features(a: &str, b: &str, t: TransformerSignals, table: &StaticEmbedder) -> Vec<f32> {
    let cosine_transformer = t.cosine;
    let (wa, wb) = (words(a), words(b));
    let tokens = |t: &str| table.token_vectors(t).unwrap_or_default();
    let (ta, tb) = (tokens(a), tokens(b));
    let (align_min, align_mean) = alignment(&ta, &tb);
    let cosine_static = match (table.embed(a), table.embed(b)) {
        (Ok(x), Ok(y)) => cosine(&x, &y),
        _ => 0.0,
    };
    let (na, nb) = (numbers(&wa), numbers(&wb));
    let (ea, eb) = (entities(&wa), entities(&wb));
    let lower = |ws: &[String]| ws.iter().map(|w| w.to_lowercase()).collect::<BTreeSet<_>>();
    let (la, lb) = (lower(&wa), lower(&wb));
    let union = la.union(&lb).count().max(1);
    let (lena, lenb) = (wa.len().max(1) as f32, wb.len().max(1) as f32);
    let flag = |x: bool| if x { 1.0 } else { 0.0 };
    vec![
        cosine_transformer,
        cosine_static,
        align_min,
        align_mean,
        flag(na != nb),
        na.symmetric_difference(&nb).count() as f32,
        ea.symmetric_difference(&eb).count() as f32,
        flag(negated(&wa) != negated(&wb)),
        flag(question_word(&wa) != question_word(&wb)),
        lena.min(lenb) / lena.max(lenb),
        la.intersection(&lb).count() as f32 / union as f32,
        flag(la == lb),
        cosine_transformer * align_min,
        t.align_min,
        t.align_mean,
    ]
}

/// A trained verifier: standardisation, logistic weights, and its cross-validated curve.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Verifier {
    /// Feature names (must equal [`FEATURES`] to load).
    pub features: Vec<String>,
    /// Per-feature mean.
    pub mean: Vec<f32>,
    /// Per-feature standard deviation.
    pub scale: Vec<f32>,
    /// Logistic weights.
    pub weights: Vec<f32>,
    /// Logistic bias.
    pub bias: f32,
    /// Held-out (cross-validated) precision/recall by threshold on the verifier's probability.
    pub curve: Vec<CurvePoint>,
    /// What it was trained on.
    pub trained_on: String,
}

/// One point of the shipped curve.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct CurvePoint {
    /// Probability threshold.
    pub threshold: f32,
    /// Held-out precision at it.
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

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

impl Verifier {
    /// Fit logistic regression (full-batch gradient descent, L2) on `x` / `y`.
    pub fn fit(x: &[Vec<f32>], y: &[bool], epochs: usize, l2: f32) -> Self {
        let d = FEATURES.len();
        let n = x.len().max(1) as f32;
        let mut mean = vec![0.0f32; d];
        for row in x {
            for (m, v) in mean.iter_mut().zip(row) {
                *m += v / n;
            }
        }
        let mut scale = vec![0.0f32; d];
        for row in x {
            for ((s, v), m) in scale.iter_mut().zip(row).zip(&mean) {
                *s += (v - m) * (v - m) / n;
            }
        }
        scale.iter_mut().for_each(|s| *s = s.sqrt().max(1e-6));
        let z: Vec<Vec<f32>> = x
            .iter()
            .map(|r| {
                r.iter()
                    .zip(&mean)
                    .zip(&scale)
                    .map(|((v, m), s)| (v - m) / s)
                    .collect()
            })
            .collect();
        let (mut w, mut b) = (vec![0.0f32; d], 0.0f32);
        let lr = 0.5f32;
        for _ in 0..epochs {
            let (mut gw, mut gb) = (vec![0.0f32; d], 0.0f32);
            for (row, &label) in z.iter().zip(y) {
                let p = sigmoid(row.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>() + b);
                let err = p - if label { 1.0 } else { 0.0 };
                for (g, v) in gw.iter_mut().zip(row) {
                    *g += err * v / n;
                }
                gb += err / n;
            }
            for (wi, g) in w.iter_mut().zip(&gw) {
                *wi -= lr * (g + l2 * *wi);
            }
            b -= lr * gb;
        }
        Self {
            features: FEATURES.iter().map(|s| (*s).to_owned()).collect(),
            mean,
            scale,
            weights: w,
            bias: b,
            curve: Vec::new(),
            trained_on: String::new(),
        }
    }

    /// Probability that the pair with features `f` is a true duplicate.
    pub fn probability(&self, f: &[f32]) -> f32 {
        let z: f32 = f
            .iter()
            .zip(&self.mean)
            .zip(&self.scale)
            .zip(&self.weights)
            .map(|(((v, m), s), w)| (v - m) / s * w)
            .sum();
        sigmoid(z + self.bias)
    }

    /// The lowest threshold whose held-out precision reaches `precision` (a tenant's setting),
    /// or `None` when the curve never gets there.
    pub fn threshold_for(&self, precision: f64) -> Option<CurvePoint> {
        self.curve
            .iter()
            .filter(|p| p.precision >= precision && p.recall > 0.0)
            .min_by(|a, b| a.threshold.total_cmp(&b.threshold))
            .copied()
    }
}

/// Held-out probabilities from `k`-fold cross-validation (folds by a fixed shuffle), in input
/// order: each pair is scored by a model that never saw it.
pub fn cross_validate(x: &[Vec<f32>], y: &[bool], k: usize, epochs: usize, l2: f32) -> Vec<f32> {
    let n = x.len();
    let mut order: Vec<usize> = (0..n).collect();
    // Fixed Fisher-Yates shuffle (xorshift), so folds are reproducible.
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        order.swap(i, (s % (i as u64 + 1)) as usize);
    }
    let mut out = vec![0.0f32; n];
    for fold in 0..k.max(2) {
        let held: Vec<usize> = order.iter().copied().skip(fold).step_by(k.max(2)).collect();
        let held_set: BTreeSet<usize> = held.iter().copied().collect();
        let (tx, ty): (Vec<Vec<f32>>, Vec<bool>) = (0..n)
            .filter(|i| !held_set.contains(i))
            .map(|i| (x[i].clone(), y[i]))
            .unzip();
        let model = Verifier::fit(&tx, &ty, epochs, l2);
        for i in held {
            out[i] = model.probability(&x[i]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_features_see_differing_numbers_entities_and_negations() {
        let (a, b) = (
            words("What is the IIT JEE 2016 cutoff?"),
            words("What is the IIT JEE 2017 cutoff?"),
        );
        assert_ne!(numbers(&a), numbers(&b));
        assert_eq!(entities(&a), entities(&b));
        assert!(negated(&words("Why can't I sleep?")));
        assert!(!negated(&words("Why can I sleep?")));
        assert_eq!(
            question_word(&words("How do I sleep?")).as_deref(),
            Some("how")
        );
    }

    #[test]
    fn logistic_regression_separates_a_separable_set() {
        let d = FEATURES.len();
        let x: Vec<Vec<f32>> = (0..200)
            .map(|i| {
                let mut r = vec![0.0; d];
                r[0] = if i % 2 == 0 { 0.9 } else { 0.2 } + (i % 7) as f32 * 0.01;
                r
            })
            .collect();
        let y: Vec<bool> = (0..200).map(|i| i % 2 == 0).collect();
        let held = cross_validate(&x, &y, 5, 200, 1e-4);
        let correct = held
            .iter()
            .zip(&y)
            .filter(|(p, l)| (**p > 0.5) == **l)
            .count();
        assert_eq!(correct, 200);
    }
}
