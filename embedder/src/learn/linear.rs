//! L2-regularised logistic regression over dense rows, fitted by L-BFGS on standardised inputs
//! (the scaling is folded back into the weights, so a fitted model is one dot product).
//!
//! The objective is sklearn's: `C · Σ logloss + ½‖w‖²` with an unpenalised bias, so a `C` found
//! there means the same here.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::trees::sigmoid;
use crate::index::dot;

/// Dense row-major matrix.
#[derive(Debug, Clone, Default)]
pub struct Matrix {
    /// Columns per row.
    pub cols: usize,
    /// `rows × cols` values.
    pub data: Vec<f32>,
}

impl Matrix {
    /// An empty matrix of `cols` columns.
    pub fn new(cols: usize) -> Self {
        Self {
            cols,
            data: Vec::new(),
        }
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// Append a row (must have `cols` values).
    pub fn push(&mut self, row: &[f32]) {
        debug_assert_eq!(row.len(), self.cols);
        self.data.extend_from_slice(row);
    }
}

/// A fitted linear scorer: `margin(x) = w·x + b`, on raw (unstandardised) inputs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Linear {
    /// Weights, one per input.
    pub weights: Vec<f32>,
    /// Bias.
    pub bias: f32,
}

impl Linear {
    /// The log-odds of `x`.
    pub fn margin(&self, x: &[f32]) -> f32 {
        self.bias + dot(&self.weights, x)
    }
}

/// `log(1 + e^m) − y·m`: the log loss of margin `m` for label `y`, stable for large `|m|`.
fn loss_at(m: f64, y: f64) -> f64 {
    m.max(0.0) + (-m.abs()).exp().ln_1p() - y * m
}

/// Each of `d` columns' mean and standard deviation over `rows` (1 where a column is constant).
pub fn column_stats<'a>(rows: impl Iterator<Item = &'a [f32]>, d: usize) -> (Vec<f32>, Vec<f32>) {
    let mut n = 0usize;
    let mut mean = vec![0.0f64; d];
    let mut sq = vec![0.0f64; d];
    for row in rows {
        n += 1;
        for (j, &v) in row.iter().enumerate() {
            mean[j] += f64::from(v);
            sq[j] += f64::from(v) * f64::from(v);
        }
    }
    let n = n.max(1) as f64;
    let mean: Vec<f64> = mean.iter().map(|m| m / n).collect();
    // The variance from the unrounded mean: `s/n − m²` cancels badly for columns far from 0.
    let scale: Vec<f32> = sq
        .iter()
        .zip(&mean)
        .map(|(s, m)| {
            let var = s / n - m * m;
            if var > 1e-12 {
                var.sqrt() as f32
            } else {
                1.0
            }
        })
        .collect();
    (mean.iter().map(|&m| m as f32).collect(), scale)
}

/// Standardised copy of the selected rows, and each column's (mean, scale).
fn standardise(x: &Matrix, rows: &[usize]) -> (Matrix, Vec<f32>, Vec<f32>) {
    let d = x.cols;
    let (mean, scale) = column_stats(rows.iter().map(|&r| x.row(r)), d);
    let mut z = Matrix::new(d);
    z.data.reserve(rows.len() * d);
    for &r in rows {
        z.data.extend(
            x.row(r)
                .iter()
                .zip(&mean)
                .zip(&scale)
                .map(|((v, m), s)| (v - m) / s),
        );
    }
    (z, mean, scale)
}

/// The rows a linear model is fitted on, dense or sparse: row `i`'s dot product with `w`, and
/// `g += r · row i`.
trait Rows: Sync {
    fn dot(&self, i: usize, w: &[f32]) -> f32;
    fn add_scaled(&self, i: usize, r: f32, g: &mut [f32]);
}

impl Rows for Matrix {
    fn dot(&self, i: usize, w: &[f32]) -> f32 {
        dot(w, self.row(i))
    }
    fn add_scaled(&self, i: usize, r: f32, g: &mut [f32]) {
        for (gj, &xj) in g.iter_mut().zip(self.row(i)) {
            *gj += r * xj;
        }
    }
}

impl Rows for Sparse {
    fn dot(&self, i: usize, w: &[f32]) -> f32 {
        self.rows[i].iter().map(|&(j, v)| w[j as usize] * v).sum()
    }
    fn add_scaled(&self, i: usize, r: f32, g: &mut [f32]) {
        for &(j, v) in &self.rows[i] {
            g[j as usize] += r * v;
        }
    }
}

/// Mean log loss over `rows` (labels `y[k]` for `rows[k]`) plus `lambda/2 ‖w‖²` and its
/// gradient, at `wb` (`d` weights then the bias).
fn objective(
    x: &impl Rows,
    rows: &[usize],
    y: &[f32],
    wb: &[f32],
    lambda: f32,
    grad: &mut [f32],
) -> f64 {
    let d = wb.len() - 1;
    let (w, b) = (&wb[..d], wb[d]);
    let n = rows.len();
    let chunk = n.div_ceil(rayon::current_num_threads().max(1) * 4).max(256);
    let (loss, g) = (0..n)
        .into_par_iter()
        .chunks(chunk)
        .map(|idx| {
            let mut g = vec![0.0f32; d + 1];
            let mut loss = 0.0f64;
            for k in idx {
                let m = b + x.dot(rows[k], w);
                loss += loss_at(f64::from(m), f64::from(y[k]));
                let r = sigmoid(m) - y[k];
                x.add_scaled(rows[k], r, &mut g[..d]);
                g[d] += r;
            }
            (loss, g)
        })
        .reduce(
            || (0.0, vec![0.0f32; d + 1]),
            |(la, mut ga), (lb, gb)| {
                ga.iter_mut().zip(&gb).for_each(|(a, b)| *a += b);
                (la + lb, ga)
            },
        );
    let inv = 1.0 / n.max(1) as f32;
    for j in 0..d {
        grad[j] = g[j] * inv + lambda * w[j];
    }
    grad[d] = g[d] * inv;
    loss / n.max(1) as f64
        + 0.5 * f64::from(lambda) * w.iter().map(|v| f64::from(v * v)).sum::<f64>()
}

/// Fit on the selected `rows` of `x` with labels `y` (indexed like `x`) and inverse
/// regularisation `c`. `start` (weights then bias, in the standardised space) warm-starts the
/// solver; the returned state can warm-start the next `c`.
pub fn fit(
    x: &Matrix,
    y: &[bool],
    rows: &[usize],
    c: f64,
    start: Option<&[f32]>,
) -> (Linear, Vec<f32>) {
    let (z, mean, scale) = standardise(x, rows);
    let labels: Vec<f32> = rows.iter().map(|&r| if y[r] { 1.0 } else { 0.0 }).collect();
    let lambda = (1.0 / (c * rows.len().max(1) as f64)) as f32;
    let all: Vec<usize> = (0..rows.len()).collect();
    let wb = lbfgs(z.cols + 1, start, |wb, g| {
        objective(&z, &all, &labels, wb, lambda, g)
    });
    let d = x.cols;
    let weights: Vec<f32> = wb[..d].iter().zip(&scale).map(|(w, s)| w / s).collect();
    let bias = wb[d] - weights.iter().zip(&mean).map(|(w, m)| w * m).sum::<f32>();
    (Linear { weights, bias }, wb)
}

/// Limited-memory BFGS (10 pairs) with a backtracking Armijo line search, minimising
/// `objective(x, grad)` (which returns the value and writes the gradient) over `d` variables.
fn lbfgs(
    d: usize,
    start: Option<&[f32]>,
    mut objective: impl FnMut(&[f32], &mut [f32]) -> f64,
) -> Vec<f32> {
    const MEMORY: usize = 10;
    const MAX_ITER: usize = 500;
    let mut x = match start {
        Some(s) if s.len() == d => s.to_vec(),
        _ => vec![0.0f32; d],
    };
    let mut g = vec![0.0f32; d];
    let mut f = objective(&x, &mut g);
    let mut hist: std::collections::VecDeque<(Vec<f32>, Vec<f32>, f32)> = Default::default();
    let mut g_new = vec![0.0f32; d];
    for _ in 0..MAX_ITER {
        let gmax = g.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        if gmax < 1e-5 {
            break;
        }
        // Two-loop recursion: direction = -H g.
        let mut q: Vec<f32> = g.clone();
        let mut alphas = Vec::with_capacity(hist.len());
        for (s, yv, rho) in hist.iter().rev() {
            let a = rho * dot(s, &q);
            q.iter_mut().zip(yv).for_each(|(qi, yi)| *qi -= a * yi);
            alphas.push(a);
        }
        if let Some((s, yv, _)) = hist.back() {
            let gamma = dot(s, yv) / dot(yv, yv).max(1e-20);
            q.iter_mut().for_each(|v| *v *= gamma);
        } else {
            let norm = dot(&g, &g).sqrt().max(1e-20);
            q.iter_mut().for_each(|v| *v /= norm);
        }
        for ((s, yv, rho), a) in hist.iter().zip(alphas.iter().rev()) {
            let b = rho * dot(yv, &q);
            q.iter_mut().zip(s).for_each(|(qi, si)| *qi += (a - b) * si);
        }
        let mut dir: Vec<f32> = q.iter().map(|v| -v).collect();
        let mut slope = dot(&g, &dir);
        if slope >= 0.0 {
            // Not a descent direction (numerical trouble): restart from steepest descent.
            hist.clear();
            let norm = dot(&g, &g).sqrt().max(1e-20);
            dir = g.iter().map(|v| -v / norm).collect();
            slope = dot(&g, &dir);
        }
        let mut step = 1.0f32;
        let mut moved = false;
        let mut x_new = vec![0.0f32; d];
        for _ in 0..30 {
            x_new
                .iter_mut()
                .zip(&x)
                .zip(&dir)
                .for_each(|((n, o), di)| *n = o + step * di);
            let f_new = objective(&x_new, &mut g_new);
            if f_new <= f + 1e-4 * f64::from(step * slope) {
                let s: Vec<f32> = x_new.iter().zip(&x).map(|(a, b)| a - b).collect();
                let yv: Vec<f32> = g_new.iter().zip(&g).map(|(a, b)| a - b).collect();
                let sy = dot(&s, &yv);
                if sy > 1e-12 {
                    if hist.len() == MEMORY {
                        hist.pop_front();
                    }
                    hist.push_back((s, yv, 1.0 / sy));
                }
                let done = (f - f_new).abs() <= 1e-10 * f.abs().max(1.0);
                std::mem::swap(&mut x, &mut x_new);
                std::mem::swap(&mut g, &mut g_new);
                f = f_new;
                moved = true;
                if done {
                    return x;
                }
                break;
            }
            step *= 0.5;
        }
        if !moved {
            break;
        }
    }
    x
}

/// Sparse rows: each a list of `(column, value)` over `cols` columns.
#[derive(Debug, Clone, Default)]
pub struct Sparse {
    /// Columns per row.
    pub cols: usize,
    /// The rows.
    pub rows: Vec<Vec<(u32, f32)>>,
}

impl Linear {
    /// The log-odds of a sparse row.
    pub fn margin_sparse(&self, x: &[(u32, f32)]) -> f32 {
        self.bias
            + x.iter()
                .map(|&(j, v)| self.weights.get(j as usize).map_or(0.0, |w| w * v))
                .sum::<f32>()
    }
}

/// Fit on the selected `rows` of sparse `x` with labels `y` (indexed like `x`) and inverse
/// regularisation `c`, on the inputs as they are (no standardisation: for TF-IDF rows, scaling
/// each column to unit variance would blow up rare terms). Same objective as [`fit`].
pub fn fit_sparse(x: &Sparse, y: &[bool], rows: &[usize], c: f64) -> Linear {
    let d = x.cols;
    let lambda = (1.0 / (c * rows.len().max(1) as f64)) as f32;
    let labels: Vec<f32> = rows.iter().map(|&r| if y[r] { 1.0 } else { 0.0 }).collect();
    let wb = lbfgs(d + 1, None, |wb, g| {
        objective(x, rows, &labels, wb, lambda, g)
    });
    Linear {
        weights: wb[..d].to_vec(),
        bias: wb[d],
    }
}

/// Mean log loss of `model` on the selected rows.
pub fn log_loss(model: &Linear, x: &Matrix, y: &[bool], rows: &[usize]) -> f64 {
    let total: f64 = rows
        .iter()
        .map(|&r| {
            loss_at(
                f64::from(model.margin(x.row(r))),
                if y[r] { 1.0 } else { 0.0 },
            )
        })
        .sum();
    total / rows.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_a_linear_boundary_and_regularisation_shrinks_it() {
        // y = 1 when 2·x0 - x1 + 0.5 > noise; x2 is irrelevant and scaled large.
        let mut rng = crate::learn::Rng(11);
        let mut x = Matrix::new(3);
        let mut y = Vec::new();
        for _ in 0..4000 {
            let a = rng.unit() as f32 * 2.0 - 1.0;
            let b = rng.unit() as f32 * 2.0 - 1.0;
            let c = (rng.unit() as f32 - 0.5) * 1000.0;
            let noise = (rng.unit() as f32 - 0.5) * 0.5;
            x.push(&[a, b, c]);
            y.push(2.0 * a - b + 0.5 > noise);
        }
        let rows: Vec<usize> = (0..4000).collect();
        let (m, state) = fit(&x, &y, &rows, 10.0, None);
        let correct = rows
            .iter()
            .filter(|&&r| (m.margin(x.row(r)) > 0.0) == y[r])
            .count();
        assert!(correct > 3800, "{correct}");
        let ratio = m.weights[0] / -m.weights[1];
        assert!((1.6..2.4).contains(&ratio), "{ratio}");
        assert!(m.weights[2].abs() * 500.0 < m.weights[0].abs() * 0.2);
        let (strong, _) = fit(&x, &y, &rows, 1e-4, Some(&state));
        assert!(strong.weights[0].abs() < m.weights[0].abs() / 4.0);
        assert!(log_loss(&m, &x, &y, &rows) < log_loss(&strong, &x, &y, &rows));
    }
}
