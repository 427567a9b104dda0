//! Gradient-boosted regression trees on the log-odds (logistic loss, Newton leaf values,
//! histogram splits): small, fast to evaluate, and able to say "a differing number vetoes a high
//! cosine", which no single weight per feature can.

use serde::{Deserialize, Serialize};

use super::Rng;

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

/// A fitted ensemble.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Boosted {
    /// Log-odds before any tree (the training set's base rate).
    pub base: f32,
    /// Shrinkage applied to every tree.
    pub learning_rate: f32,
    /// The trees.
    pub trees: Vec<Tree>,
}

/// The logistic function.
pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
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

impl Boosted {
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
            base,
            learning_rate: p.learning_rate,
            trees,
        }
    }

    /// Log-odds for the row `f`.
    pub fn margin(&self, f: &[f32]) -> f32 {
        let z: f32 = self.trees.iter().map(|t| t.predict(f)).sum();
        self.base + self.learning_rate * z
    }

    /// Probability of the positive class for the row `f`.
    pub fn probability(&self, f: &[f32]) -> f32 {
        sigmoid(self.margin(f))
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn boosted_trees_learn_an_interaction_a_linear_model_cannot() {
        // Positive exactly when one of two signals is on, not both (XOR): no single weight per
        // feature can say that; two levels of splits can.
        let x: Vec<Vec<f32>> = (0..400)
            .map(|i| {
                vec![
                    if i % 2 == 0 { 0.9 } else { 0.3 } + (i % 7) as f32 * 0.01,
                    if (i / 2) % 2 == 0 { 1.0 } else { 0.0 },
                    (i % 5) as f32,
                ]
            })
            .collect();
        let y: Vec<bool> = x.iter().map(|r| (r[0] > 0.5) != (r[1] > 0.5)).collect();
        let (train, held): (Vec<usize>, Vec<usize>) = (0..400).partition(|i| i % 5 != 0);
        let fit_x: Vec<Vec<f32>> = train.iter().map(|&i| x[i].clone()).collect();
        let fit_y: Vec<bool> = train.iter().map(|&i| y[i]).collect();
        let m = Boosted::fit(&fit_x, &fit_y, Params::default());
        assert!(held.iter().all(|&i| (m.probability(&x[i]) > 0.5) == y[i]));
        let back: Boosted = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back.probability(&x[0]), m.probability(&x[0]));
    }
}
