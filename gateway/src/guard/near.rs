//! Near-duplicate texts for the loop detector: a text's static embedding (the embedder's
//! microsecond path: the mean of its tokens' distilled vectors, no transformer), projected to
//! [`SKETCH_DIM`] dimensions by a fixed random ±1 matrix and quantised to bytes, so a session's
//! window keeps a few turns in a few hundred bytes. Cosines of sketches estimate the cosines
//! of the embeddings (Johnson–Lindenstrauss: within about ±0.01 near 0.95).
//!
//! The projection is linear, so it is applied once to every row of the static table when the
//! model loads: a sketch then costs a tokenization and a sum of 128-value rows.

use std::sync::{Arc, OnceLock};

use embedder::static_embed::StaticEmbedder;

/// Dimensions of a sketch.
pub const SKETCH_DIM: usize = 128;

/// A text's sketch: its static embedding, projected and quantised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sketch(pub [i8; SKETCH_DIM]);

impl Sketch {
    /// Cosine similarity of two sketches (0 when either is zero).
    pub fn cosine(&self, other: &Sketch) -> f32 {
        let (mut dot, mut a, mut b) = (0i32, 0i32, 0i32);
        for (x, y) in self.0.iter().zip(other.0.iter()) {
            let (x, y) = (i32::from(*x), i32::from(*y));
            dot += x * y;
            a += x * x;
            b += y * y;
        }
        if a == 0 || b == 0 {
            return 0.0;
        }
        dot as f32 / ((a as f32).sqrt() * (b as f32).sqrt())
    }

    /// The bytes, for a store.
    pub fn to_bytes(&self) -> [u8; SKETCH_DIM] {
        self.0.map(|x| x.to_le_bytes()[0])
    }

    /// From a store's bytes.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let arr: [u8; SKETCH_DIM] = b.try_into().ok()?;
        Some(Self(arr.map(|x| i8::from_le_bytes([x]))))
    }
}

/// The static model, loaded in the background on first use.
pub struct NearDup {
    model: OnceLock<Option<Arc<StaticEmbedder>>>,
    dir: std::path::PathBuf,
    loading: std::sync::atomic::AtomicBool,
    /// `SKETCH_DIM` rows of ±1 signs, one bit each, per embedding dimension.
    signs: Vec<u128>,
}

impl std::fmt::Debug for NearDup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NearDup")
            .field("dir", &self.dir)
            .field("ready", &self.ready())
            .finish()
    }
}

impl NearDup {
    /// Near-duplicates from the static table in `dir` (the semantic cache's model directory).
    pub fn new(dir: std::path::PathBuf) -> Self {
        // A fixed xorshift stream: every replica projects the same way, so their sketches
        // compare in a shared window.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let signs = (0..embedder::bert::DIM)
            .map(|_| u128::from(next()) << 64 | u128::from(next()))
            .collect();
        Self {
            model: OnceLock::new(),
            dir,
            loading: std::sync::atomic::AtomicBool::new(false),
            signs,
        }
    }

    /// A model already loaded (tests, benchmarks).
    pub fn with_model(model: Arc<StaticEmbedder>) -> Self {
        let n = Self::new(std::path::PathBuf::new());
        let projected = n.projected(&model);
        let _ = n.model.set(Some(Arc::new(projected)));
        n
    }

    /// `model` with the projection applied to every row.
    fn projected(&self, model: &StaticEmbedder) -> StaticEmbedder {
        model.map_rows(SKETCH_DIM, |row, out| self.project_into(row, out))
    }

    /// Whether the model is loaded.
    pub fn ready(&self) -> bool {
        matches!(self.model.get(), Some(Some(_)))
    }

    /// Start loading the model on a blocking thread (once); until it is loaded, [`Self::sketch`]
    /// answers `None` and only exact repeats count.
    pub fn warm(self: &Arc<Self>) {
        if self.model.get().is_some()
            || self.loading.swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return;
        }
        let me = Arc::clone(self);
        let load = move || {
            let loaded = match crate::cache::semantic::static_table(&me.dir) {
                Ok(t) => Some(Arc::new(me.projected(&t))),
                Err(e) => {
                    tracing::warn!(error = %e, dir = %me.dir.display(),
                        "the loop detector compares exact repeats only: no static embedding table");
                    None
                }
            };
            let _ = me.model.set(loaded);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(load);
            }
            Err(_) => load(),
        }
    }

    /// The sketch of `text`, `None` while the model is not loaded.
    pub fn sketch(&self, text: &str) -> Option<Sketch> {
        let model = self.model.get()?.as_ref()?;
        // The projected table: the text's vector is already its projection.
        let acc = model.embed(text).ok()?;
        Some(quantise(&acc))
    }

    /// Project one embedding-sized vector to [`SKETCH_DIM`] values.
    fn project_into(&self, v: &[f32], acc: &mut [f32]) {
        for (x, signs) in v.iter().zip(&self.signs) {
            for (j, a) in acc.iter_mut().enumerate() {
                if signs >> j & 1 == 1 {
                    *a += x;
                } else {
                    *a -= x;
                }
            }
        }
    }
}

/// A projected vector as bytes: scaled so its largest value is ±127.
fn quantise(acc: &[f32]) -> Sketch {
    let max = acc.iter().fold(0f32, |m, a| m.max(a.abs()));
    let mut out = [0i8; SKETCH_DIM];
    if max > 0.0 {
        for (o, a) in out.iter_mut().zip(acc.iter().copied()) {
            #[expect(clippy::cast_possible_truncation, reason = "scaled into i8's range")]
            {
                *o = (a / max * 127.0).round() as i8;
            }
        }
    }
    Sketch(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

    use super::*;

    fn table() -> StaticEmbedder {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/all-MiniLM-L6-v2");
        StaticEmbedder::load(&dir.join("static.bin"), &dir.join("tokenizer.json"))
            .expect("static table: scripts/test.sh fetches the model and distills it")
    }

    #[test]
    fn a_sketchs_cosine_estimates_its_texts_static_cosine() {
        let table = Arc::new(table());
        let near = NearDup::with_model(Arc::clone(&table));
        let texts = [
            "Please list every file in the repository and show me its size",
            "Please list all the files in the repository and show me their sizes",
            "What is the capital of France?",
            "How do I bake sourdough bread at home?",
        ];
        let cos = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let mut estimates = Vec::new();
        for (i, a) in texts.iter().enumerate() {
            for b in &texts[i + 1..] {
                let exact = cos(&table.embed(a).unwrap(), &table.embed(b).unwrap());
                let estimate = near.sketch(a).unwrap().cosine(&near.sketch(b).unwrap());
                assert!(
                    (exact - estimate).abs() < 0.1,
                    "{a:?} / {b:?}: sketch {estimate}, static {exact}"
                );
                estimates.push(estimate);
            }
        }
        // The paraphrase pair (the first) is the closest by its sketches too.
        assert!(
            estimates[1..].iter().all(|e| *e < estimates[0] - 0.05),
            "{estimates:?}"
        );
    }
}
