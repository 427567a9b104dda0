//! Calibration of a similarity score against labelled duplicate pairs: precision, recall and hit
//! rate at a threshold, and the whole curve. Used by `gateway embed eval --pairs FILE.jsonl`.

use serde::Deserialize;

/// One labelled pair (a line of the pairs file: `{"a": …, "b": …, "duplicate": true}`).
#[derive(Debug, Clone, Deserialize)]
pub struct Pair {
    /// First text.
    pub a: String,
    /// Second text.
    pub b: String,
    /// Whether the two ask the same thing.
    pub duplicate: bool,
    /// Where the pair comes from (a corpus or kind of text), when the file says.
    #[serde(default)]
    pub source: Option<String>,
}

/// Quality at one threshold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// Scores at or above this count as a (cache) hit.
    pub threshold: f32,
    /// Hits that are true duplicates (1.0 when there are no hits).
    pub precision: f64,
    /// True duplicates that are hits.
    pub recall: f64,
    /// Share of all pairs that are hits.
    pub hit_rate: f64,
}

/// Precision, recall and hit rate of `scores` against `labels` at `threshold`.
pub fn at(scores: &[f32], labels: &[bool], threshold: f32) -> Point {
    let (mut tp, mut hits, mut positives) = (0usize, 0usize, 0usize);
    for (&s, &l) in scores.iter().zip(labels) {
        positives += usize::from(l);
        if s >= threshold {
            hits += 1;
            tp += usize::from(l);
        }
    }
    let ratio = |a: usize, b: usize, empty: f64| if b == 0 { empty } else { a as f64 / b as f64 };
    Point {
        threshold,
        precision: ratio(tp, hits, 1.0),
        recall: ratio(tp, positives, 0.0),
        hit_rate: ratio(hits, scores.len(), 0.0),
    }
}

/// The curve at `steps` evenly spaced thresholds over the observed score range.
pub fn curve(scores: &[f32], labels: &[bool], steps: usize) -> Vec<Point> {
    let lo = scores.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if scores.is_empty() || steps == 0 {
        return Vec::new();
    }
    (0..=steps)
        .map(|i| at(scores, labels, lo + (hi - lo) * i as f32 / steps as f32))
        .collect()
}

/// The lowest threshold whose precision is at least `precision` (the most recall at that
/// precision), scanning every distinct score.
pub fn threshold_for_precision(scores: &[f32], labels: &[bool], precision: f64) -> Option<Point> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&i, &j| scores[j].total_cmp(&scores[i]));
    let positives = labels.iter().filter(|&&l| l).count();
    let (mut tp, mut best) = (0usize, None);
    for (n, &i) in order.iter().enumerate() {
        tp += usize::from(labels[i]);
        let hits = n + 1;
        let next_differs = order.get(n + 1).is_none_or(|&j| scores[j] < scores[i]);
        if next_differs && tp as f64 / hits as f64 >= precision {
            best = Some(Point {
                threshold: scores[i],
                precision: tp as f64 / hits as f64,
                recall: if positives == 0 {
                    0.0
                } else {
                    tp as f64 / positives as f64
                },
                hit_rate: hits as f64 / scores.len() as f64,
            });
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_recall_and_hit_rate() {
        let scores = [0.9, 0.8, 0.7, 0.6];
        let labels = [true, false, true, false];
        let p = at(&scores, &labels, 0.75);
        assert_eq!((p.precision, p.recall, p.hit_rate), (0.5, 0.5, 0.5));
        let p = at(&scores, &labels, 0.95);
        assert_eq!((p.precision, p.recall, p.hit_rate), (1.0, 0.0, 0.0));
        let best = threshold_for_precision(&scores, &labels, 0.6).unwrap_or(p);
        assert_eq!((best.threshold, best.recall), (0.7, 1.0));
        assert_eq!(curve(&scores, &labels, 3).len(), 4);
    }
}
