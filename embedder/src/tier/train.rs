//! Fitting the tier classifier with cross-validation grouped by subject: each fold's model is
//! fitted on the other subjects (vocabulary and scaling included) and scores the held-out ones,
//! so the shipped curve and figures describe prompts about subjects the model never saw. The
//! shipped model is then fitted on every row.

use std::collections::BTreeMap;

use super::eval::{Outcome, RouteCurve, RouteSummary};
use super::features::{self, Scaler, Vocabulary, HAND};
use super::{EmbeddingInput, SharePoint, TierModel, CURVE_POINTS};
use crate::learn::linear::{self, Matrix, Sparse};
use crate::learn::{group_folds, without};

/// One labelled prompt.
#[derive(Debug, Clone)]
pub struct Labelled {
    /// The prompt.
    pub prompt: String,
    /// Whether each model answered it correctly.
    pub outcome: Outcome,
    /// Its subject (folds never split a subject); the prompt itself when the data has none.
    pub group: String,
}

/// Training settings.
#[derive(Debug, Clone, Copy)]
pub struct TierTrainOptions {
    /// Folds (subjects are spread over them).
    pub folds: usize,
    /// Inverse L2 regularisation of both regressions.
    pub c: f64,
    /// Seed of the fold assignment.
    pub seed: u64,
}

impl Default for TierTrainOptions {
    fn default() -> Self {
        Self {
            folds: 5,
            c: 1.0,
            seed: 17,
        }
    }
}

/// Prompt embeddings the classifier reads beside its text features: one unit-length vector per
/// training row, in row order.
#[derive(Debug, Clone, Copy)]
pub struct Embedded<'a> {
    /// Where they come from (see [`super::EMBEDDING_SOURCES`]).
    pub source: &'a str,
    /// One per row.
    pub vectors: &'a [Vec<f32>],
    /// Their weight against the unit-length TF-IDF vector.
    pub weight: f32,
}

/// A trained classifier and what its cross-validation found.
#[derive(Debug, Clone)]
pub struct TierTrained {
    /// The model fitted on every row, with the held-out curve.
    pub model: TierModel,
    /// Held-out figures of the classifier (pooled over folds).
    pub held_out: RouteSummary,
    /// The same folds with prompt length as the score (a baseline that needs no training).
    pub length: RouteSummary,
    /// Each fold's subjects and its own held-out figures.
    pub folds: Vec<(Vec<String>, RouteSummary)>,
    /// Every row's held-out gain (scored by the fold model that did not see its subject).
    pub held_out_gains: Vec<f32>,
}

struct Prepared<'a> {
    terms: Vec<Vec<String>>,
    hand: Vec<Vec<f32>>,
    embedded: Option<Embedded<'a>>,
}

/// The input rows for `rows` under a vocabulary and scaler fitted on `fit_on`.
fn fitted_inputs(p: &Prepared, fit_on: &[usize]) -> (Vocabulary, Scaler, Sparse) {
    let vocab = Vocabulary::fit(fit_on.iter().map(|&r| p.terms[r].as_slice()));
    let scaler = Scaler::fit(fit_on.iter().map(|&r| p.hand[r].as_slice()));
    let rows = p
        .terms
        .iter()
        .zip(&p.hand)
        .enumerate()
        .map(|(i, (t, h))| {
            let mut row = features::row_of(&vocab, &scaler, t, h);
            if let Some(e) = &p.embedded {
                features::push_embedding(&mut row, &vocab, &e.vectors[i], e.weight);
            }
            row
        })
        .collect();
    let x = Sparse {
        cols: vocab.len() + HAND.len() + p.embedded.map_or(0, |e| dim(&e)),
        rows,
    };
    (vocab, scaler, x)
}

struct Fitted {
    vocab: Vocabulary,
    scaler: Scaler,
    large: linear::Linear,
    small: linear::Linear,
    x: Sparse,
}

fn fit(p: &Prepared, data: &[Labelled], rows: &[usize], c: f64) -> Fitted {
    let (vocab, scaler, x) = fitted_inputs(p, rows);
    let large_y: Vec<bool> = data.iter().map(|d| d.outcome.large).collect();
    let small_y: Vec<bool> = data.iter().map(|d| d.outcome.small).collect();
    let (large, small) = rayon::join(
        || linear::fit_sparse(&x, &large_y, rows, c),
        || linear::fit_sparse(&x, &small_y, rows, c),
    );
    Fitted {
        vocab,
        scaler,
        large,
        small,
        x,
    }
}

impl Fitted {
    fn gain(&self, r: usize) -> f32 {
        super::gain(&self.large, &self.small, &self.x.rows[r])
    }
}

/// The held-out curve kept in the artefact: every 1% of large calls, the gain threshold that
/// gives it and the PGR reached.
fn share_points(curve: &RouteCurve) -> Vec<SharePoint> {
    let n = curve.len();
    (0..=CURVE_POINTS)
        .map(|j| {
            let share = j as f64 / CURVE_POINTS as f64;
            let k = (share * n as f64).round() as usize;
            // Large iff gain >= threshold; gains lie in [-1, 1].
            let threshold = match k {
                0 => 2.0,
                k if k >= n => -2.0,
                k => curve.scores[k - 1],
            };
            SharePoint {
                large_share: share,
                threshold,
                pgr: curve.pgr[k.min(n)],
            }
        })
        .collect()
}

fn dim(e: &Embedded<'_>) -> usize {
    e.vectors.first().map_or(0, Vec::len)
}

/// Cross-validate with folds grouped by subject, then fit the shipped model on every row, on
/// the text features and, when given, the prompts' embeddings. `progress` hears each stage.
pub fn train(
    data: &[Labelled],
    embedded: Option<Embedded<'_>>,
    opts: TierTrainOptions,
    trained_on: &str,
    mut progress: impl FnMut(&str),
) -> Result<TierTrained, String> {
    if let Some(e) = &embedded {
        let d = dim(e);
        if e.vectors.len() != data.len() || d == 0 || e.vectors.iter().any(|v| v.len() != d) {
            return Err(format!(
                "{} {} embeddings for {} prompts: one vector of the same length per prompt",
                e.vectors.len(),
                e.source,
                data.len()
            ));
        }
    }
    let groups: BTreeMap<&str, usize> = {
        let mut names: Vec<&str> = data.iter().map(|d| d.group.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names.into_iter().enumerate().map(|(i, g)| (g, i)).collect()
    };
    if groups.len() < opts.folds.max(2) {
        return Err(format!(
            "{} subjects cannot fill {} folds grouped by subject",
            groups.len(),
            opts.folds
        ));
    }
    let outcomes: Vec<Outcome> = data.iter().map(|d| d.outcome).collect();
    let p = Prepared {
        terms: data.iter().map(|d| features::terms(&d.prompt)).collect(),
        hand: data.iter().map(|d| features::hand(&d.prompt)).collect(),
        embedded,
    };
    let group_of: Vec<usize> = data.iter().map(|d| groups[d.group.as_str()]).collect();
    let need: Vec<bool> = outcomes.iter().map(|o| !o.small && o.large).collect();
    let all: Vec<usize> = (0..data.len()).collect();
    let folds = group_folds(&all, &group_of, &need, opts.folds, opts.seed);
    let mut gains = vec![0.0f32; data.len()];
    let mut per_fold = Vec::new();
    for (i, held) in folds.iter().enumerate() {
        progress(&format!("fold {}/{}", i + 1, folds.len()));
        let fitted = fit(&p, data, &without(&all, held), opts.c);
        for &r in held {
            gains[r] = fitted.gain(r);
        }
        let mut subjects: Vec<String> = held.iter().map(|&r| data[r].group.clone()).collect();
        subjects.sort_unstable();
        subjects.dedup();
        let (s, o): (Vec<f32>, Vec<Outcome>) =
            held.iter().map(|&r| (gains[r], outcomes[r])).unzip();
        per_fold.push((subjects, RouteCurve::new(&s, &o).summary()));
    }
    let curve = RouteCurve::new(&gains, &outcomes);
    let lengths: Vec<f32> = data
        .iter()
        .map(|d| d.prompt.chars().count() as f32)
        .collect();
    let length = RouteCurve::new(&lengths, &outcomes).summary();
    // p_large: the held-out gain calibrated against "small wrong, large right".
    let mut g = Matrix::new(1);
    for &v in &gains {
        g.push(&[v]);
    }
    let (platt, _) = linear::fit(&g, &need, &all, 1e4, None);
    progress("all rows: the shipped model");
    let f = fit(&p, data, &all, opts.c);
    let model = TierModel {
        hand_columns: HAND.iter().map(|s| (*s).to_owned()).collect(),
        vocabulary: f.vocab,
        scaler: f.scaler,
        large: f.large,
        small: f.small,
        calibration: [platt.weights[0], platt.bias],
        curve: share_points(&curve),
        held_out: curve.summary(),
        trained_on: trained_on.to_owned(),
        embedding: embedded.map(|e| EmbeddingInput {
            source: e.source.to_owned(),
            dim: dim(&e),
            weight: e.weight,
        }),
    };
    Ok(TierTrained {
        held_out: model.held_out,
        model,
        length,
        folds: per_fold,
        held_out_gains: gains,
    })
}
