//! Per-tenant online calibration of the semantic layer: for every semantic lookup this replica
//! ran for a tenant, the highest verifier probability among its candidates (already computed by
//! the lookup), so an operator can see what each precision setting would have answered of that
//! tenant's own traffic before changing it (`gatewayctl cache show`).
//!
//! Counts are kept in [`BINS`] probability bins per tenant (under 1 KiB each) and halved once a
//! tenant's total reaches [`HALVE_AT`], so old traffic fades. A setting's expected hit rate counts
//! the bins wholly at or above its threshold: it can read low by one bin (0.005), never high.

use std::collections::HashMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Probability bins (width 1 / `BINS`).
pub const BINS: usize = 200;
/// A tenant's counts are halved when its lookups reach this.
pub const HALVE_AT: u32 = 1 << 20;

#[derive(Debug)]
struct Scores {
    bins: [u32; BINS],
    /// Lookups with no candidate at all (nothing stored close enough).
    none: u32,
    total: u32,
}

impl Default for Scores {
    fn default() -> Self {
        Self {
            bins: [0; BINS],
            none: 0,
            total: 0,
        }
    }
}

impl Scores {
    fn halve(&mut self) {
        for b in &mut self.bins {
            *b /= 2;
        }
        self.none /= 2;
        self.total = self.bins.iter().sum::<u32>() + self.none;
    }

    /// Lookups whose best candidate reached `threshold` (bins wholly at or above it).
    fn at_least(&self, threshold: f32) -> u32 {
        let first = ((f64::from(threshold) * BINS as f64).ceil().max(0.0) as usize).min(BINS);
        self.bins[first..].iter().sum()
    }
}

/// What the semantic layer saw of one tenant's lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seen {
    /// Semantic lookups counted (after any halving).
    pub lookups: u64,
    /// Of those, the ones with no candidate at all: a miss at every setting.
    pub without_candidate: u64,
}

/// The calibration counts of every tenant on this replica.
#[derive(Debug, Default)]
pub struct Calibration {
    tenants: Mutex<HashMap<String, Scores>>,
}

impl Calibration {
    /// Count one semantic lookup of `tenant`: its best candidate's probability, or `None` when
    /// it had no candidate.
    pub fn record(&self, tenant: &str, top: Option<f32>) {
        let Ok(mut tenants) = self.tenants.lock() else {
            return;
        };
        let scores = match tenants.get_mut(tenant) {
            Some(s) => s,
            None => tenants.entry(tenant.to_owned()).or_default(),
        };
        match top {
            Some(p) => {
                let bin = ((f64::from(p) * BINS as f64).floor().max(0.0) as usize).min(BINS - 1);
                scores.bins[bin] += 1;
            }
            None => scores.none += 1,
        }
        scores.total += 1;
        if scores.total >= HALVE_AT {
            scores.halve();
        }
    }

    /// `tenant`'s lookups, and for each threshold the lookups it would have answered.
    pub fn expected(&self, tenant: &str, thresholds: &[f32]) -> (Seen, Vec<u64>) {
        let Ok(tenants) = self.tenants.lock() else {
            return (
                Seen {
                    lookups: 0,
                    without_candidate: 0,
                },
                vec![0; thresholds.len()],
            );
        };
        match tenants.get(tenant) {
            Some(s) => (
                Seen {
                    lookups: u64::from(s.total),
                    without_candidate: u64::from(s.none),
                },
                thresholds
                    .iter()
                    .map(|t| u64::from(s.at_least(*t)))
                    .collect(),
            ),
            None => (
                Seen {
                    lookups: 0,
                    without_candidate: 0,
                },
                vec![0; thresholds.len()],
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_threshold_counts_the_lookups_whose_best_candidate_reached_it() {
        let c = Calibration::default();
        for p in [0.10, 0.50, 0.84, 0.86, 0.97, 0.999] {
            c.record("t", Some(p));
        }
        c.record("t", None);
        let (seen, hits) = c.expected("t", &[0.0, 0.5, 0.85, 0.95, 1.0]);
        assert_eq!(
            seen,
            Seen {
                lookups: 7,
                without_candidate: 1
            }
        );
        assert_eq!(hits, vec![6, 5, 3, 2, 0]);
        // Another tenant sees none of it.
        assert_eq!(c.expected("u", &[0.5]).1, vec![0]);
    }

    #[test]
    fn a_threshold_inside_a_bin_never_counts_more_than_it_should() {
        let c = Calibration::default();
        c.record("t", Some(0.8441)); // bin [0.840, 0.845)
        assert_eq!(c.expected("t", &[0.844]).1, vec![0], "reads low, not high");
        assert_eq!(c.expected("t", &[0.840]).1, vec![1]);
    }

    #[test]
    fn old_traffic_fades() {
        let c = Calibration::default();
        for _ in 0..HALVE_AT {
            c.record("t", Some(0.9));
        }
        let (seen, hits) = c.expected("t", &[0.5]);
        assert_eq!(seen.lookups, u64::from(HALVE_AT / 2));
        assert_eq!(hits, vec![u64::from(HALVE_AT / 2)]);
    }
}
