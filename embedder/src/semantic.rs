//! The semantic cache's decision, independent of where vectors are computed: search the query's
//! namespace for the nearest stored questions, then let the [`Verifier`] judge each candidate
//! pair, and answer only when it is confident enough.
//!
//! Cosine similarity alone cannot tell "IIT JEE 2016 cutoff" from "IIT JEE 2017 cutoff"; the
//! verifier sees the token-level alignment of the two texts (a single differing year shows as one
//! token without a match), so each stored entry keeps its text and contextual token vectors.
//!
//! [`SemanticIndex`] is synchronous and single-owner: the gateway runs it on a dedicated thread
//! (next to the embedding model), so async request handlers never wait on a lock.

use std::collections::HashMap;
use std::sync::Arc;

use crate::bert::TextVectors;
use crate::index::{EntryId, VectorIndex};
use crate::static_embed::StaticEmbedder;
use crate::verifier::{Text, Verifier};

/// The verifier artefact trained on the dev set (`gateway embed train-verifier`), shipped with
/// the crate.
pub const SHIPPED_VERIFIER: &str = include_str!("../assets/verifier.json");

/// Token vectors quantised to one byte per dimension (each vector scaled by its largest
/// component): a stored question costs ~0.4 KB per token instead of 1.5 KB, and the cosine
/// of dequantised unit vectors moves by about 1e-4 — far below what the verifier's features
/// resolve.
#[derive(Debug)]
struct Quantised {
    dim: usize,
    data: Vec<i8>,
    scales: Vec<f32>,
}

impl Quantised {
    fn new(vectors: &[Vec<f32>]) -> Self {
        let dim = vectors.first().map_or(0, Vec::len);
        let mut data = Vec::with_capacity(vectors.len() * dim);
        let mut scales = Vec::with_capacity(vectors.len());
        for v in vectors {
            let max = v.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-12);
            scales.push(max / 127.0);
            #[expect(clippy::cast_possible_truncation, reason = "rounded into -127..=127")]
            data.extend(v.iter().map(|x| (x / max * 127.0).round() as i8));
        }
        Self { dim, data, scales }
    }

    fn vectors(&self) -> Vec<Vec<f32>> {
        if self.dim == 0 {
            return Vec::new();
        }
        self.data
            .chunks_exact(self.dim)
            .zip(&self.scales)
            .map(|(row, s)| row.iter().map(|&q| f32::from(q) * s).collect())
            .collect()
    }
}

/// A stored question: what the verifier needs to judge a new one against it.
#[derive(Debug)]
struct Stored {
    text: String,
    sentence: Vec<f32>,
    tokens: Quantised,
    /// The caller's key for the cached answer.
    key: u128,
}

/// How a lookup searches: how many nearest neighbours the verifier sees, the least cosine
/// for a neighbour to be one, and the verifier probability a hit needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Search {
    /// Nearest neighbours handed to the verifier.
    pub k: usize,
    /// Least cosine similarity of a candidate.
    pub min_cosine: f32,
    /// Least verifier probability of a hit.
    pub threshold: f32,
}

/// A verified match.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    /// The caller's key for the cached answer.
    pub key: u128,
    /// Cosine similarity of the two sentence vectors.
    pub cosine: f32,
    /// The verifier's probability that the two are the same question.
    pub probability: f32,
}

/// What [`SemanticIndex::best`] found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Best {
    /// The best candidate at the threshold asked for.
    pub verdict: Option<Verdict>,
    /// The highest verifier probability among the candidates (`None`: no stored question was
    /// close enough to be a candidate).
    pub top_probability: Option<f32>,
}

/// Nearest-neighbour search plus verification over stored questions.
pub struct SemanticIndex {
    index: Box<dyn VectorIndex>,
    entries: HashMap<EntryId, Stored>,
    verifier: Verifier,
    table: Arc<StaticEmbedder>,
}

impl std::fmt::Debug for SemanticIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SemanticIndex")
            .field("entries", &self.entries.len())
            .finish_non_exhaustive()
    }
}

impl SemanticIndex {
    /// Wrap `index` (CPU or GPU); `table` is the static embedder the verifier's features use.
    pub fn new(
        index: Box<dyn VectorIndex>,
        verifier: Verifier,
        table: Arc<StaticEmbedder>,
    ) -> Self {
        Self {
            index,
            entries: HashMap::new(),
            verifier,
            table,
        }
    }

    /// The verifier (its held-out curve maps a precision target to a threshold).
    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }

    /// Stored questions.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Nothing stored.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The best of the `search.k` nearest stored questions in `ns` (cosine ≥
    /// `search.min_cosine`) whose verifier probability reaches `search.threshold`, if any; and
    /// the highest probability of any of them (what another threshold would have answered).
    pub fn best(
        &mut self,
        ns: u64,
        text: &str,
        query: &TextVectors,
        search: Search,
        now_ms: i64,
    ) -> Best {
        let Search {
            k,
            min_cosine,
            threshold,
        } = search;
        let hits = self.index.search(ns, &query.0, k, min_cosine, now_ms);
        let mut best: Option<Verdict> = None;
        let mut top: Option<f32> = None;
        for hit in hits {
            let Some(stored) = self.entries.get(&hit.id) else {
                continue;
            };
            let tokens = stored.tokens.vectors();
            let probability = self.verifier.probability(
                &Text {
                    text,
                    sentence: &query.0,
                    tokens: &query.1,
                },
                &Text {
                    text: &stored.text,
                    sentence: &stored.sentence,
                    tokens: &tokens,
                },
                &self.table,
            );
            top = Some(top.map_or(probability, |t| t.max(probability)));
            if probability >= threshold && best.is_none_or(|b| probability > b.probability) {
                best = Some(Verdict {
                    key: stored.key,
                    cosine: hit.score,
                    probability,
                });
            }
        }
        Best {
            verdict: best,
            top_probability: top,
        }
    }

    /// Whether entry `id` is still held (not evicted nor replaced).
    pub fn contains(&self, id: EntryId) -> bool {
        self.index.contains(id)
    }

    /// Store a question (`text` and its vectors) answered by the caller's `key`, as entry `id`
    /// (the caller's, unique: an id given again replaces its entry).
    pub fn insert(
        &mut self,
        ns: u64,
        id: EntryId,
        text: String,
        vectors: TextVectors,
        key: u128,
        now_ms: i64,
    ) {
        self.index.insert(ns, id, &vectors.0, now_ms);
        self.entries.insert(
            id,
            Stored {
                text,
                sentence: vectors.0.clone(),
                tokens: Quantised::new(&vectors.1),
                key,
            },
        );
        // The index evicts on its own (LRU, TTL); drop what it no longer holds, amortised.
        if self.entries.len() > 2 * self.index.len() + 64 {
            let index = &self.index;
            self.entries.retain(|id, _| index.contains(*id));
        }
    }
}

#[cfg(test)]
#[expect(clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn quantised_token_vectors_keep_their_cosines() {
        let unit = |seed: u32| {
            let v: Vec<f32> = (0..384u32)
                .map(|i| ((i * 7 + seed * 13) % 97) as f32 / 97.0 - 0.5)
                .collect();
            let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
            v.into_iter().map(|x| x / n).collect::<Vec<f32>>()
        };
        let vs = vec![unit(1), unit(2), unit(3)];
        let q = Quantised::new(&vs).vectors();
        for (a, b) in vs.iter().zip(&q) {
            assert!((crate::bert::cosine(a, b) - 1.0).abs() < 1e-3);
        }
        let exact = crate::bert::cosine(&vs[0], &vs[1]);
        let approx = crate::bert::cosine(&q[0], &q[1]);
        assert!((exact - approx).abs() < 1e-3, "{exact} vs {approx}");
        assert!(Quantised::new(&[]).vectors().is_empty());
    }

    #[test]
    fn the_shipped_verifier_matches_this_build() {
        let v = Verifier::from_json(SHIPPED_VERIFIER).expect("shipped verifier loads");
        assert!(v.threshold_for(0.5).is_some());
    }
}
