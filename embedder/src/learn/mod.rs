//! The small learners the verifier is built from, with no knowledge of text: gradient-boosted
//! trees ([`trees`]), L2-regularised logistic regression ([`linear`]), principal components
//! ([`pca`]), and cross-validation folds that keep related rows together.

pub mod linear;
pub mod pca;
pub mod trees;

/// A fixed xorshift generator (reproducible folds and subsamples).
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Shuffle in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, (self.next_u64() % (i as u64 + 1)) as usize);
        }
    }
}

/// Split `rows` into `k` folds (held-out row lists) that never separate two rows of the same
/// `groups[row]`: with repeated questions in the data, a row-level split lets a model memorise a
/// question in training and meet it again held out, which overstates what it learned. Groups are
/// shuffled by `seed` and each goes to the fold holding the fewest rows of its majority label so far, so
/// folds come out about equal in size and in positives.
pub fn group_folds(
    rows: &[usize],
    groups: &[usize],
    labels: &[bool],
    k: usize,
    seed: u64,
) -> Vec<Vec<usize>> {
    let k = k.max(2);
    let mut members: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for &r in rows {
        members.entry(groups[r]).or_default().push(r);
    }
    let mut order: Vec<Vec<usize>> = members.into_values().collect();
    Rng(seed | 1).shuffle(&mut order);
    // Larger groups first, so the greedy fill balances.
    order.sort_by_key(|g| std::cmp::Reverse(g.len()));
    let mut folds = vec![Vec::new(); k];
    let mut filled = vec![(0usize, 0usize); k];
    for group in order {
        let positives = group.iter().filter(|&&r| labels[r]).count();
        let negatives = group.len() - positives;
        // The fold with the fewest rows of this group's majority label, then the fewest rows.
        let at = (0..k)
            .min_by_key(|&f| {
                let (p, n) = filled[f];
                (if positives >= negatives { p } else { n }, p + n)
            })
            .unwrap_or(0);
        filled[at].0 += positives;
        filled[at].1 += negatives;
        folds[at].extend(group);
    }
    for f in &mut folds {
        f.sort_unstable();
    }
    folds
}

/// The rows of `rows` not in `held` (both sorted).
pub fn without(rows: &[usize], held: &[usize]) -> Vec<usize> {
    rows.iter()
        .copied()
        .filter(|r| held.binary_search(r).is_err())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_folds_keep_groups_together_and_balance_labels() {
        let n = 1000;
        let groups: Vec<usize> = (0..n).map(|i| i / 3).collect();
        let labels: Vec<bool> = (0..n).map(|i| (i / 3) % 4 == 0).collect();
        let rows: Vec<usize> = (0..n).collect();
        let folds = group_folds(&rows, &groups, &labels, 5, 7);
        assert_eq!(folds.iter().map(Vec::len).sum::<usize>(), n);
        for f in &folds {
            let gs: std::collections::BTreeSet<usize> = f.iter().map(|&r| groups[r]).collect();
            for other in &folds {
                if !std::ptr::eq(f, other) {
                    assert!(other.iter().all(|r| !gs.contains(&groups[*r])));
                }
            }
            assert!((195..=205).contains(&f.len()), "{}", f.len());
            let p = f.iter().filter(|&&r| labels[r]).count();
            assert!((45..=57).contains(&p), "{p}");
        }
        assert_eq!(without(&rows, &folds[0]).len(), n - folds[0].len());
    }
}
