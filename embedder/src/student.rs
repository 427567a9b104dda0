//! The semantic cache's learned first stage: a question whose *student* vector is far from every
//! stored question's in its namespace cannot be a hit, so the transformer is not run for it.
//!
//! The student is the static table's sentence vector (the normalised mean of the question's
//! token rows, microseconds) mapped by a linear map fitted to predict the transformer's sentence
//! vector (ridge regression on ~15,000 texts of the dev sets, reduced to its 128 principal
//! directions: `bench/semantic-prefilter.py fit`, shipped as `assets/gate-student.bin`). Its
//! cosine tracks the transformer's well enough that a threshold well below the cosines of the
//! pairs the verifier accepts keeps them, including reworded paraphrases that share few words
//! (which the token-overlap stage, [`crate::gate::TokenGate`], drops), while most unrelated
//! questions of a small namespace fall below it. Held-out figures (each source scored by a map
//! fitted without it): docs/benchmarks.md.
//!
//! Like the token gate it only errs towards the transformer: a namespace holding more than
//! [`MAX_SCAN`] questions, a question it cannot tokenise, or vectors being pruned at that moment
//! let the lookup through.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use crate::bert::EmbedError;
use crate::gate::{Gate, Near, Stage};
use crate::index::{dot, normalise, EntryId};
use crate::static_embed::{f32s, header, StaticEmbedder};

/// The shipped map, fitted to all-MiniLM-L6-v2's distilled static table.
pub const SHIPPED_STUDENT: &[u8] = include_bytes!("../assets/gate-student.bin");

const MAGIC: &[u8; 8] = b"GWSTUDNT";

/// Most stored questions of one namespace a lookup compares with before letting it through
/// (~1 M multiply-adds; beyond a few thousand varied questions most lookups go on anyway).
pub const MAX_SCAN: usize = 8192;

/// Most stored questions [`StudentGate::near`] names for one lookup; past it, it says it cannot
/// tell which.
pub const MAX_NEAR: usize = 256;

/// A question, a paraphrase of it and an unrelated one: the map's check at load.
const PROBE: [&str; 3] = [
    "How can I learn to cook Italian food at home?",
    "What's the best way to learn Italian cooking at home?",
    "Why does my bicycle tyre keep going flat?",
];

/// A linear map from `[static sentence vector, 1]` to the student vector.
#[derive(Debug, Clone)]
pub struct Projection {
    /// Rows: the static table's dimension plus one (the bias); row-major.
    rows: usize,
    cols: usize,
    weights: Vec<f32>,
}

impl Projection {
    /// Parse a map file: `GWSTUDNT`, version 1, rows, columns (u32 little-endian), then the
    /// weights row-major as little-endian f32.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, EmbedError> {
        let bad = |why: &str| EmbedError::Invalid(format!("student map: {why}"));
        let (version, rows, cols, body) =
            header(bytes, MAGIC).ok_or_else(|| bad("not a GWSTUDNT file"))?;
        if version != 1 {
            return Err(bad("unknown version"));
        }
        if rows < 2 || cols == 0 || body.len() != rows * cols * 4 {
            return Err(bad("size does not match its header"));
        }
        let weights = f32s(body);
        Ok(Self {
            rows,
            cols,
            weights,
        })
    }

    /// The shipped map.
    pub fn shipped() -> Result<Self, EmbedError> {
        Self::from_bytes(SHIPPED_STUDENT)
    }

    /// The dimension of the static vectors it maps.
    pub fn input_dim(&self) -> usize {
        self.rows - 1
    }

    /// The L2-normalised student vector of a static sentence vector.
    fn apply(&self, input: &[f32]) -> Vec<f32> {
        let bias = (self.rows - 1) * self.cols;
        let mut out = self.weights[bias..bias + self.cols].to_vec();
        for (x, row) in input.iter().zip(self.weights.chunks_exact(self.cols)) {
            for (o, w) in out.iter_mut().zip(row) {
                *o += x * w;
            }
        }
        normalise(&mut out);
        out
    }
}

/// One namespace's stored student vectors, row after row.
#[derive(Debug, Default)]
struct Rows {
    ids: Vec<EntryId>,
    vectors: Vec<f32>,
}

/// Student vectors of every stored question, shared between the thread that indexes answers
/// and the requests that look them up.
pub struct StudentGate {
    table: Arc<StaticEmbedder>,
    projection: Projection,
    threshold: f32,
    rows: RwLock<HashMap<u64, Rows>>,
}

impl std::fmt::Debug for StudentGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StudentGate")
            .field("threshold", &self.threshold)
            .field("entries", &self.len())
            .finish_non_exhaustive()
    }
}

impl StudentGate {
    /// A gate that lets through lookups whose student cosine with a stored question reaches
    /// `threshold` (0 lets every lookup through). The map must fit the table's dimension.
    pub fn new(
        table: Arc<StaticEmbedder>,
        projection: Projection,
        threshold: f32,
    ) -> Result<Self, EmbedError> {
        if projection.input_dim() != table.dim() {
            return Err(EmbedError::Invalid(format!(
                "student map fits {}-dimension static vectors, the table has {}",
                projection.input_dim(),
                table.dim()
            )));
        }
        let gate = Self {
            table,
            projection,
            threshold,
            rows: RwLock::new(HashMap::new()),
        };
        // The map only means something for the table it was fitted to: a paraphrase must come
        // out far closer than an unrelated question (0.87 against -0.05 with the shipped pair).
        let (same, other) = (
            gate.cosine(PROBE[0], PROBE[1]),
            gate.cosine(PROBE[0], PROBE[2]),
        );
        if same < other + 0.3 {
            return Err(EmbedError::Invalid(format!(
                "the student map does not fit this static table (a paraphrase at cosine {same:.2}, \
                 an unrelated question at {other:.2}): was the table distilled from another model?"
            )));
        }
        Ok(gate)
    }

    /// The student cosine of two texts (0 when one cannot be tokenised).
    pub fn cosine(&self, a: &str, b: &str) -> f32 {
        match (self.tokens(a), self.tokens(b)) {
            (Some(a), Some(b)) => dot(&self.vector(&a), &self.vector(&b)),
            _ => 0.0,
        }
    }

    /// The question's token ids (`None`: it could not be tokenised).
    pub fn tokens(&self, text: &str) -> Option<Vec<u32>> {
        // Without offsets: the same ids as the table's own `ids`, cheaper.
        let enc = self.table.tokenizer().encode_fast(text, false).ok()?;
        Some(enc.get_ids().to_vec())
    }

    /// The student vector of a question's token ids ([`StudentGate::tokens`]).
    pub fn vector(&self, tokens: &[u32]) -> Vec<f32> {
        self.projection.apply(&self.table.embed_ids(tokens))
    }

    /// Stored questions.
    pub fn len(&self) -> usize {
        self.rows
            .read()
            .map_or(0, |r| r.values().map(|n| n.ids.len()).sum())
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record stored question `id` of namespace `ns` by its token ids.
    pub fn insert(&self, ns: u64, id: EntryId, tokens: &[u32]) {
        let vector = self.vector(tokens);
        let Ok(mut rows) = self.rows.write() else {
            return;
        };
        let n = rows.entry(ns).or_default();
        n.ids.push(id);
        n.vectors.extend_from_slice(&vector);
    }

    /// Forget every stored question `keep` says no.
    pub fn retain(&self, mut keep: impl FnMut(EntryId) -> bool) {
        let Ok(mut rows) = self.rows.write() else {
            return;
        };
        let cols = self.projection.cols;
        rows.retain(|_, n| {
            let mut kept = 0;
            for i in 0..n.ids.len() {
                if keep(n.ids[i]) {
                    n.ids[kept] = n.ids[i];
                    n.vectors.copy_within(i * cols..(i + 1) * cols, kept * cols);
                    kept += 1;
                }
            }
            n.ids.truncate(kept);
            n.vectors.truncate(kept * cols);
            kept > 0
        });
    }

    /// Whether a lookup of the question whose [`StudentGate::tokens`] are `tokens` may hit.
    pub fn check_tokens(&self, ns: u64, tokens: &[u32]) -> Gate {
        self.near(ns, tokens).gate()
    }

    /// The stored questions of `ns` whose student cosine with the question reaches the
    /// threshold: the only ones a lookup of it may match.
    pub fn near(&self, ns: u64, tokens: &[u32]) -> Near {
        if self.threshold <= 0.0 {
            return Near::Unknown;
        }
        // Never wait on a request's thread: while the vectors are being pruned, let it through.
        let Ok(rows) = self.rows.try_read() else {
            return Near::Unknown;
        };
        let Some(n) = rows.get(&ns) else {
            return Near::Nothing;
        };
        if n.ids.len() > MAX_SCAN {
            return Near::Unknown;
        }
        let query = self.vector(tokens);
        let near: Vec<EntryId> = n
            .vectors
            .chunks_exact(self.projection.cols)
            .zip(&n.ids)
            .filter(|(stored, _)| dot(&query, stored) >= self.threshold)
            .map(|(_, &id)| id)
            .take(MAX_NEAR + 1)
            .collect();
        match near.len() {
            0 => Near::Nothing,
            // So many near ones say little about which: none is singled out.
            n if n > MAX_NEAR => Near::Unknown,
            _ => Near::Only(near),
        }
    }
}

impl Stage for StudentGate {
    fn tokens(&self, text: &str) -> Option<Vec<u32>> {
        StudentGate::tokens(self, text)
    }
    fn check_tokens(&self, ns: u64, tokens: &[u32]) -> Gate {
        StudentGate::check_tokens(self, ns, tokens)
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    fn map_bytes(rows: usize, cols: usize, weights: &[f32]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        for w in [1u32, rows as u32, cols as u32] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        for w in weights {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b
    }

    #[test]
    fn the_shipped_map_parses_and_a_damaged_one_is_refused() {
        let p = Projection::shipped().unwrap();
        assert_eq!(p.input_dim(), crate::bert::DIM);
        assert_eq!(p.cols, 128);
        assert!(p.weights.iter().all(|w| w.is_finite()));
        assert!(Projection::from_bytes(&SHIPPED_STUDENT[..SHIPPED_STUDENT.len() - 4]).is_err());
        assert!(Projection::from_bytes(b"GWSTATIC\x01\0\0\0\x02\0\0\0\x01\0\0\0").is_err());
        let mut v2 = SHIPPED_STUDENT.to_vec();
        v2[8] = 2;
        assert!(Projection::from_bytes(&v2).is_err());
    }

    #[test]
    fn the_map_adds_its_bias_and_normalises() {
        // Two inputs, two outputs: identity plus bias (0, 1).
        let p = Projection::from_bytes(&map_bytes(3, 2, &[1.0, 0.0, 0.0, 1.0, 0.0, 1.0])).unwrap();
        let v = p.apply(&[3.0, 3.0]);
        assert!(
            (v[0] - 0.6).abs() < 1e-6 && (v[1] - 0.8).abs() < 1e-6,
            "{v:?}"
        );
    }
}
