//! Principal components of a set of vectors: the covariance matrix's leading eigenvectors, by
//! cyclic Jacobi rotations (exact for the 384 × 384 matrices the verifier needs, in about a
//! second, with no linear-algebra dependency).

use serde::{Deserialize, Serialize};

/// A fitted projection onto the leading components.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pca {
    /// Mean of the fitted vectors.
    pub mean: Vec<f32>,
    /// Unit components, leading first (`k` rows of the input dimension).
    pub components: Vec<Vec<f32>>,
}

impl Pca {
    /// Fit `k` components to `vectors` (all of one dimension).
    pub fn fit<'a>(vectors: impl Iterator<Item = &'a [f32]> + Clone, k: usize) -> Self {
        let d = vectors.clone().next().map_or(0, <[f32]>::len);
        let mut n = 0usize;
        let mut mean = vec![0.0f64; d];
        for v in vectors.clone() {
            n += 1;
            mean.iter_mut()
                .zip(v)
                .for_each(|(m, x)| *m += f64::from(*x));
        }
        let nf = n.max(1) as f64;
        mean.iter_mut().for_each(|m| *m /= nf);
        let mut cov = vec![0.0f64; d * d];
        let mut centred = vec![0.0f64; d];
        for v in vectors {
            centred
                .iter_mut()
                .zip(v.iter().zip(&mean))
                .for_each(|(c, (x, m))| *c = f64::from(*x) - m);
            for i in 0..d {
                let ci = centred[i];
                let row = &mut cov[i * d..i * d + i + 1];
                row.iter_mut()
                    .zip(&centred[..=i])
                    .for_each(|(a, cj)| *a += ci * cj);
            }
        }
        for i in 0..d {
            for j in 0..=i {
                cov[i * d + j] /= nf;
                cov[j * d + i] = cov[i * d + j];
            }
        }
        let (values, vectors) = jacobi(cov, d);
        let mut order: Vec<usize> = (0..d).collect();
        order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
        let components = order
            .into_iter()
            .take(k.min(d))
            .map(|c| (0..d).map(|i| vectors[i * d + c] as f32).collect())
            .collect();
        Self {
            mean: mean.iter().map(|&m| m as f32).collect(),
            components,
        }
    }

    /// Coordinates of `v` on the components.
    pub fn project(&self, v: &[f32]) -> Vec<f32> {
        let centred: Vec<f32> = v.iter().zip(&self.mean).map(|(x, m)| x - m).collect();
        self.components
            .iter()
            .map(|c| crate::index::dot(c, &centred))
            .collect()
    }
}

/// Eigen-decomposition of the symmetric `d × d` matrix `a` (row-major): eigenvalues, and
/// eigenvectors as the columns of a row-major matrix.
fn jacobi(mut a: Vec<f64>, d: usize) -> (Vec<f64>, Vec<f64>) {
    let mut v = vec![0.0f64; d * d];
    for i in 0..d {
        v[i * d + i] = 1.0;
    }
    let total: f64 = a.iter().map(|x| x * x).sum::<f64>().max(1e-300);
    for _sweep in 0..60 {
        let off: f64 = (0..d)
            .flat_map(|i| (0..d).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * d + j] * a[i * d + j])
            .sum();
        if off <= 1e-22 * total {
            break;
        }
        for p in 0..d {
            for q in p + 1..d {
                let apq = a[p * d + q];
                if apq.abs() <= 1e-300 || apq * apq <= 1e-30 * total {
                    continue;
                }
                let theta = (a[q * d + q] - a[p * d + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                // A ← Jᵀ A J: rows p, q then columns p, q.
                for k in 0..d {
                    let (akp, akq) = (a[k * d + p], a[k * d + q]);
                    a[k * d + p] = c * akp - s * akq;
                    a[k * d + q] = s * akp + c * akq;
                }
                for k in 0..d {
                    let (apk, aqk) = (a[p * d + k], a[q * d + k]);
                    a[p * d + k] = c * apk - s * aqk;
                    a[q * d + k] = s * apk + c * aqk;
                }
                for k in 0..d {
                    let (vkp, vkq) = (v[k * d + p], v[k * d + q]);
                    v[k * d + p] = c * vkp - s * vkq;
                    v[k * d + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    ((0..d).map(|i| a[i * d + i]).collect(), v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_directions_of_largest_variance() {
        // Points spread 10× along (1, 1, 0)/√2, 3× along (0, 0, 1), 0.1× along (1, -1, 0)/√2.
        let mut rng = crate::learn::Rng(5);
        let s = std::f32::consts::FRAC_1_SQRT_2;
        let pts: Vec<Vec<f32>> = (0..2000)
            .map(|_| {
                let (a, b, c) = (
                    (rng.unit() as f32 - 0.5) * 10.0,
                    (rng.unit() as f32 - 0.5) * 3.0,
                    (rng.unit() as f32 - 0.5) * 0.1,
                );
                vec![1.0 + a * s + c * s, 2.0 + a * s - c * s, -1.0 + b]
            })
            .collect();
        let p = Pca::fit(pts.iter().map(Vec::as_slice), 2);
        assert!((p.components[0][0].abs() - s).abs() < 1e-3);
        assert!((p.components[0][1].abs() - s).abs() < 1e-3);
        assert!((p.components[1][2].abs() - 1.0).abs() < 1e-3);
        assert!((p.mean[0] - 1.0).abs() < 0.2);
        let x = p.project(&pts[0]);
        assert_eq!(x.len(), 2);
    }
}
