//! The second-stage verifier of semantic cache hits: a small learned model over features of a
//! candidate pair, because a false hit (answering a different question) is worse than a miss and
//! plain cosine cannot tell "IIT JEE 2016 cutoff" from "IIT JEE 2017 cutoff".
//!
//! Features ([`FEATURES`]): transformer and static cosine; token-level alignments of the two
//! texts (for every token, its best match among the other text's tokens, by static vector and by
//! the transformer's contextual token vector: the weakest match shows a single differing year,
//! place or quantity); mismatched numbers,
//! capitalised words (entities), negations and question words; length ratio and word overlap.
//! The model is gradient-boosted regression trees (logistic loss; a differing number can veto a
//! high cosine, which a linear model cannot express), trained with k-fold cross-validation
//! (`gateway embed train-verifier`); the held-out curve ships in the artefact
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

/// One node of a regression tree: a split (`feature`, go left when the value is at most
/// `threshold`) or, when `feature` is [`LEAF`], a leaf holding `value`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Node {
    /// Feature index, or [`LEAF`].
    pub feature: u16,
    /// Split threshold.
    pub threshold: f32,
    /// Left child (index in the tree's nodes).
    pub left: u32,
    /// Right child.
    pub right: u32,
    /// Leaf value (log-odds contribution, before the learning rate).
    pub value: f32,
}

/// [`Node::feature`] of a leaf.
pub const LEAF: u16 = u16::MAX;

/// One regression tree, root first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Tree {
    /// Nodes; children always come after their parent.
    pub nodes: Vec<Node>,
}

impl Tree {
    fn predict(&self, f: &[f32]) -> f32 {
        let mut i = 0usize;
        loop {
            let Some(n) = self.nodes.get(i) else {
                return 0.0;
            };
            if n.feature == LEAF {
                return n.value;
            }
            let v = f.get(usize::from(n.feature)).copied().unwrap_or(0.0);
            i = if v <= n.threshold { n.left } else { n.right } as usize;
        }
    }
}

/// How the trees are grown.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Boosting rounds (trees).
    pub trees: usize,
    /// Depth of each tree.
    pub depth: usize,
    /// Shrinkage of each tree's contribution.
    pub learning_rate: f32,
    /// L2 regularisation of leaf values.
    pub l2: f32,
    /// Least samples in a leaf.
    pub min_leaf: usize,
    /// Share of the samples each tree sees (drawn by a fixed generator).
    pub subsample: f64,
    /// Candidate split points per feature (quantiles).
    pub bins: usize,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            trees: 200,
            depth: 3,
            learning_rate: 0.1,
            l2: 1.0,
            min_leaf: 20,
            subsample: 0.8,
            bins: 64,
        }
    }
}

/// A trained verifier: gradient-boosted regression trees on the log-odds, and its
/// cross-validated curve.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Verifier {
    /// Feature names (must equal [`FEATURES`] to load).
    pub features: Vec<String>,
    /// Log-odds before any tree (the training set's base rate).
    pub base: f32,
    /// Shrinkage applied to every tree.
    pub learning_rate: f32,
    /// The trees.
    pub trees: Vec<Tree>,
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

/// A fixed xorshift generator (reproducible folds and subsamples).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Training data binned once: per feature, its candidate thresholds and each sample's bin (the
/// first threshold at or above its value; `thresholds.len()` when above all).
struct Binned {
    thresholds: Vec<Vec<f32>>,
    bins: Vec<Vec<u8>>,
}

impl Binned {
    fn new(x: &[Vec<f32>], bins: usize) -> Self {
        let d = x.first().map_or(0, Vec::len);
        let bins = bins.clamp(2, 255);
        let mut thresholds = Vec::with_capacity(d);
        let mut assigned = Vec::with_capacity(d);
        for j in 0..d {
            let mut values: Vec<f32> = x.iter().map(|r| r[j]).collect();
            values.sort_by(f32::total_cmp);
            let mut t: Vec<f32> = (1..bins)
                .map(|q| values[(q * values.len() / bins).min(values.len() - 1)])
                .collect();
            t.dedup();
            let b = x
                .iter()
                .map(|r| u8::try_from(t.partition_point(|&c| c < r[j])).unwrap_or(u8::MAX))
                .collect();
            thresholds.push(t);
            assigned.push(b);
        }
        Self {
            thresholds,
            bins: assigned,
        }
    }
}

struct Grower<'a> {
    data: &'a Binned,
    g: &'a [f32],
    h: &'a [f32],
    p: Params,
    nodes: Vec<Node>,
}

impl Grower<'_> {
    fn leaf(&mut self, rows: &[usize]) -> u32 {
        let (g, h) = rows.iter().fold((0.0f32, 0.0f32), |(g, h), &i| {
            (g + self.g[i], h + self.h[i])
        });
        self.nodes.push(Node {
            feature: LEAF,
            threshold: 0.0,
            left: 0,
            right: 0,
            value: -g / (h + self.p.l2),
        });
        (self.nodes.len() - 1) as u32
    }

    /// The best split of `rows`: (gain, feature, bin).
    fn best_split(&self, rows: &[usize]) -> Option<(f32, usize, usize)> {
        let (gt, ht) = rows.iter().fold((0.0f32, 0.0f32), |(g, h), &i| {
            (g + self.g[i], h + self.h[i])
        });
        let score = |g: f32, h: f32| g * g / (h + self.p.l2);
        let parent = score(gt, ht);
        let mut best: Option<(f32, usize, usize)> = None;
        for (j, t) in self.data.thresholds.iter().enumerate() {
            let mut hist = vec![(0.0f32, 0.0f32, 0usize); t.len() + 1];
            for &i in rows {
                let e = &mut hist[usize::from(self.data.bins[j][i])];
                e.0 += self.g[i];
                e.1 += self.h[i];
                e.2 += 1;
            }
            let (mut gl, mut hl, mut nl) = (0.0f32, 0.0f32, 0usize);
            for (b, e) in hist.iter().enumerate().take(t.len()) {
                gl += e.0;
                hl += e.1;
                nl += e.2;
                let nr = rows.len() - nl;
                if nl < self.p.min_leaf || nr < self.p.min_leaf {
                    continue;
                }
                let gain = score(gl, hl) + score(gt - gl, ht - hl) - parent;
                if gain > 1e-6 && best.is_none_or(|(bg, _, _)| gain > bg) {
                    best = Some((gain, j, b));
                }
            }
        }
        best
    }

    fn grow(&mut self, rows: &[usize], depth: usize) -> u32 {
        if depth >= self.p.depth || rows.len() < 2 * self.p.min_leaf {
            return self.leaf(rows);
        }
        let Some((_, j, b)) = self.best_split(rows) else {
            return self.leaf(rows);
        };
        let (left, right): (Vec<usize>, Vec<usize>) = rows
            .iter()
            .partition(|&&i| usize::from(self.data.bins[j][i]) <= b);
        let at = self.nodes.len();
        self.nodes.push(Node {
            feature: u16::try_from(j).unwrap_or(LEAF),
            threshold: self.data.thresholds[j][b],
            left: 0,
            right: 0,
            value: 0.0,
        });
        let l = self.grow(&left, depth + 1);
        let r = self.grow(&right, depth + 1);
        self.nodes[at].left = l;
        self.nodes[at].right = r;
        at as u32
    }
}

impl Verifier {
    /// Fit gradient-boosted trees (logistic loss, Newton leaf values) on `x` / `y`.
    pub fn fit(x: &[Vec<f32>], y: &[bool], p: Params) -> Self {
        let n = x.len();
        let positives = y.iter().filter(|&&l| l).count() as f32;
        let rate = ((positives + 1.0) / (n as f32 + 2.0)).clamp(1e-4, 1.0 - 1e-4);
        let base = (rate / (1.0 - rate)).ln();
        let data = Binned::new(x, p.bins);
        let mut score = vec![base; n];
        let (mut g, mut h) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut trees = Vec::with_capacity(p.trees);
        for _ in 0..p.trees {
            for i in 0..n {
                let q = sigmoid(score[i]);
                g[i] = q - if y[i] { 1.0 } else { 0.0 };
                h[i] = (q * (1.0 - q)).max(1e-6);
            }
            let rows: Vec<usize> = (0..n).filter(|_| rng.unit() < p.subsample).collect();
            let mut grower = Grower {
                data: &data,
                g: &g,
                h: &h,
                p,
                nodes: Vec::new(),
            };
            grower.grow(&rows, 0);
            let tree = Tree {
                nodes: grower.nodes,
            };
            for (s, row) in score.iter_mut().zip(x) {
                *s += p.learning_rate * tree.predict(row);
            }
            trees.push(tree);
        }
        Self {
            features: FEATURES.iter().map(|s| (*s).to_owned()).collect(),
            base,
            learning_rate: p.learning_rate,
            trees,
            curve: Vec::new(),
            trained_on: String::new(),
        }
    }

    /// Probability that the pair with features `f` is a true duplicate.
    pub fn probability(&self, f: &[f32]) -> f32 {
        let z: f32 = self.trees.iter().map(|t| t.predict(f)).sum();
        sigmoid(self.base + self.learning_rate * z)
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
pub fn cross_validate(x: &[Vec<f32>], y: &[bool], k: usize, params: Params) -> Vec<f32> {
    let n = x.len();
    let k = k.max(2);
    let mut order: Vec<usize> = (0..n).collect();
    // Fixed Fisher-Yates shuffle, so folds are reproducible.
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    for i in (1..n).rev() {
        order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let mut out = vec![0.0f32; n];
    for fold in 0..k {
        let held: Vec<usize> = order.iter().copied().skip(fold).step_by(k).collect();
        let held_set: BTreeSet<usize> = held.iter().copied().collect();
        let (tx, ty): (Vec<Vec<f32>>, Vec<bool>) = (0..n)
            .filter(|i| !held_set.contains(i))
            .map(|i| (x[i].clone(), y[i]))
            .unzip();
        let model = Verifier::fit(&tx, &ty, params);
        for i in held {
            out[i] = model.probability(&x[i]);
        }
    }
    out
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
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
    fn boosted_trees_learn_an_interaction_a_linear_model_cannot() {
        // Duplicate exactly when one of two signals is on, not both (XOR): no single weight
        // per feature can say that; two levels of splits can.
        let d = FEATURES.len();
        let x: Vec<Vec<f32>> = (0..400)
            .map(|i| {
                let mut r = vec![0.0; d];
                r[0] = if i % 2 == 0 { 0.9 } else { 0.3 } + (i % 7) as f32 * 0.01;
                r[4] = if (i / 2) % 2 == 0 { 1.0 } else { 0.0 };
                r
            })
            .collect();
        let y: Vec<bool> = x.iter().map(|r| (r[0] > 0.5) != (r[4] > 0.5)).collect();
        let held = cross_validate(&x, &y, 5, Params::default());
        let correct = held
            .iter()
            .zip(&y)
            .filter(|(p, l)| (**p > 0.5) == **l)
            .count();
        assert_eq!(correct, 400);
        let v = Verifier::fit(&x, &y, Params::default());
        let back: Verifier = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
        assert_eq!(back.probability(&x[0]), v.probability(&x[0]));
    }
}
