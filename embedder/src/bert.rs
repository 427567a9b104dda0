//! The transformer sentence embedder on the CPU: all-MiniLM-L6-v2 (BERT, 6 layers, 384
//! dimensions) run by this crate's own forward pass ([`crate::forward`]) from local files (`model.safetensors`, `tokenizer.json`,
//! `config.json`), then mean pooling over the attention mask and L2 normalisation — the
//! sentence-transformers pipeline of that model (`modules.json`: Transformer → Pooling →
//! Normalize), with its `max_seq_length` of 256 tokens.
//!
//! Agreement with the reference (`scripts/embed-reference.py`, float64) is checked on committed
//! fixtures by `embedder/tests/bert_parity.rs`.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use crate::forward::{CpuBert, Paused, Precision, Progress};
use crate::model::{self, ModelConfig, Weights};

/// Why an embedder could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// A model file is missing or unreadable.
    #[error("model file {path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A model asset (the first stage's map, say) does not fit or is damaged.
    #[error("{0}")]
    Invalid(String),
    /// The GPU (driver, NVRTC, cuBLAS) failed or is absent.
    #[error("gpu: {0}")]
    Device(String),
}

/// A sentence embedder the semantic cache can run on: [`BertEmbedder`] on the CPU, or the CUDA
/// implementation (`cuda` feature).
pub trait Embed: Send {
    /// Which implementation: `"cpu"` or `"cuda"`.
    fn device(&self) -> &'static str;
    /// How its matrices are kept: `"f32"` unless the implementation says otherwise.
    fn precision(&self) -> &'static str {
        "f32"
    }
    /// Each text's L2-normalised sentence vector and its L2-normalised contextual token vectors
    /// (real tokens only, without `[CLS]`/`[SEP]`), as [`BertEmbedder::embed_with_tokens`].
    fn embed_with_tokens(&self, texts: &[&str]) -> Result<Vec<TextVectors>, EmbedError>;
    /// [`Embed::embed_with_tokens`], paused once `stop` says so where the implementation can
    /// stop part way (the CPU pass asks before each layer; by default the whole batch is
    /// embedded and nothing pauses).
    fn embed_with_tokens_until(
        &self,
        texts: &[&str],
        stop: &dyn Fn() -> bool,
    ) -> Result<Progress, EmbedError> {
        let _ = stop;
        self.embed_with_tokens(texts).map(Progress::Done)
    }
    /// Go on with an embedding [`Embed::embed_with_tokens_until`] paused.
    fn resume(&self, paused: Paused, stop: &dyn Fn() -> bool) -> Result<Progress, EmbedError> {
        let _ = (paused, stop);
        Err(EmbedError::Invalid(format!(
            "the {} embedder pauses nothing to resume",
            self.device()
        )))
    }
}

impl Embed for BertEmbedder {
    fn device(&self) -> &'static str {
        "cpu"
    }

    fn precision(&self) -> &'static str {
        self.model.precision().name()
    }

    fn embed_with_tokens(&self, texts: &[&str]) -> Result<Vec<TextVectors>, EmbedError> {
        BertEmbedder::embed_with_tokens(self, texts)
    }

    fn embed_with_tokens_until(
        &self,
        texts: &[&str],
        stop: &dyn Fn() -> bool,
    ) -> Result<Progress, EmbedError> {
        BertEmbedder::embed_with_tokens_until(self, texts, stop)
    }

    fn resume(&self, paused: Paused, stop: &dyn Fn() -> bool) -> Result<Progress, EmbedError> {
        Ok(self.model.resume(paused, stop))
    }
}

/// Output dimension of all-MiniLM-L6-v2.
pub const DIM: usize = 384;
/// sentence-transformers' `max_seq_length` for this model.
pub const MAX_TOKENS: usize = 256;

/// A text's sentence vector and its contextual token vectors.
pub type TextVectors = (Vec<f32>, Vec<Vec<f32>>);

/// A loaded transformer embedder (CPU).
pub struct BertEmbedder {
    model: CpuBert,
    tokenizer: Tokenizer,
    dir: PathBuf,
}

impl std::fmt::Debug for BertEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BertEmbedder")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl BertEmbedder {
    /// Whether `dir` holds the files [`BertEmbedder::load`] needs.
    pub fn present(dir: &Path) -> bool {
        ["model.safetensors", "tokenizer.json", "config.json"]
            .iter()
            .all(|f| dir.join(f).is_file())
    }

    /// Load the model from `dir` (as `scripts/fetch-model.sh` lays it out), its matrices kept
    /// as [`Precision::F16`].
    pub fn load(dir: &Path) -> Result<Self, EmbedError> {
        Self::load_with(dir, Precision::default())
    }

    /// [`BertEmbedder::load`] with the matrices kept at `precision`.
    pub fn load_with(dir: &Path, precision: Precision) -> Result<Self, EmbedError> {
        let config = ModelConfig::read(&dir.join("config.json"))?;
        if config.hidden_size != DIM {
            return Err(model::bad_file(
                &dir.join("config.json"),
                format!("hidden size {}, expected {DIM}", config.hidden_size),
            ));
        }
        let tokenizer = model::load_tokenizer(&dir.join("tokenizer.json"))?;
        let weights_path = dir.join("model.safetensors");
        let model = match precision {
            Precision::F16 | Precision::Int8 => {
                let int8 = precision == Precision::Int8;
                let weights = Weights::<Vec<f32>, Vec<half::f16>>::read(&weights_path, &config)?;
                if weights.matrices().flatten().all(|v| v.is_finite()) {
                    CpuBert::new(config, weights, int8)
                } else {
                    // A weight beyond f16's range (±65,504): the checkpoint's own floats
                    // (quantised from them when they are all numbers; one that is not cannot
                    // be, and gives the vectors an f32 pass gives).
                    drop(weights);
                    let weights = Weights::<Vec<f32>>::read(&weights_path, &config)?;
                    let int8 = int8 && weights.matrices().flatten().all(|v| v.is_finite());
                    CpuBert::new(config, weights, int8)
                }
            }
            Precision::F32 => {
                let weights = Weights::<Vec<f32>>::read(&weights_path, &config)?;
                CpuBert::new(config, weights, false)
            }
        };
        Ok(Self {
            model,
            tokenizer,
            dir: dir.to_owned(),
        })
    }

    /// A hash of the model's files (weights, tokenizer, configuration): vectors computed
    /// with another fingerprint came from another model. The same for either [`Precision`]
    /// (their vectors agree to a cosine of 1 − 1e-6).
    pub fn fingerprint(&self) -> Result<u64, EmbedError> {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for f in ["config.json", "tokenizer.json", "model.safetensors"] {
            h.update(&model::read(&self.dir.join(f))?);
        }
        Ok(h.digest())
    }

    /// Token count of `text` as the model sees it (with `[CLS]`/`[SEP]`, after truncation).
    pub fn token_count(&self, text: &str) -> Result<usize, EmbedError> {
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().len())
    }

    /// Embed a batch: one L2-normalised [`DIM`]-vector per text, in order. Each text attends
    /// only to its own tokens (no padding), as a padded batch's mask would have it.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
        Ok(self
            .run(texts, false)?
            .into_iter()
            .map(|(sentence, _)| sentence)
            .collect())
    }

    /// Like [`BertEmbedder::embed`], also returning each text's contextual token vectors
    /// (L2-normalised hidden states of its real tokens, without `[CLS]` and `[SEP]`), for
    /// token-level alignment of two texts.
    pub fn embed_with_tokens(&self, texts: &[&str]) -> Result<Vec<TextVectors>, EmbedError> {
        self.run(texts, true)
    }

    /// [`BertEmbedder::embed_with_tokens`], paused as soon as `stop` says so (it is asked
    /// before each layer, [`CpuBert::forward_until`]); [`Embed::resume`] goes on with it.
    pub fn embed_with_tokens_until(
        &self,
        texts: &[&str],
        stop: &dyn Fn() -> bool,
    ) -> Result<Progress, EmbedError> {
        if texts.is_empty() {
            return Ok(Progress::Done(Vec::new()));
        }
        let ids = model::token_ids(&self.tokenizer, texts, self.model.vocab())?;
        let sequences: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
        Ok(self.model.forward_until(&sequences, true, stop))
    }

    fn run(&self, texts: &[&str], with_tokens: bool) -> Result<Vec<TextVectors>, EmbedError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let ids = model::token_ids(&self.tokenizer, texts, self.model.vocab())?;
        let sequences: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
        Ok(self.model.forward(&sequences, with_tokens))
    }

    /// Embed `shape.0` sequences of token ids laid out in rows of `shape.1` (already with
    /// `[CLS]`/`[SEP]`); `mask` marks each row's real tokens (1, a prefix) and padding (0).
    pub fn embed_ids(
        &self,
        ids: Vec<u32>,
        mask: Vec<u32>,
        shape: (usize, usize),
    ) -> Result<Vec<Vec<f32>>, EmbedError> {
        let (rows, len) = shape;
        if ids.len() != rows * len || mask.len() != rows * len {
            return Err(EmbedError::Invalid(format!(
                "{} ids and {} mask entries for {rows} rows of {len}",
                ids.len(),
                mask.len()
            )));
        }
        if len > MAX_TOKENS {
            return Err(EmbedError::Invalid(format!(
                "rows of {len} tokens, past the model's {MAX_TOKENS}"
            )));
        }
        let vocab = self.model.vocab();
        let mut sequences = Vec::with_capacity(rows);
        for r in 0..rows {
            let row_mask = &mask[r * len..(r + 1) * len];
            let real = row_mask.iter().take_while(|&&m| m == 1).count();
            if real == 0 || row_mask[real..].iter().any(|&m| m != 0) {
                return Err(EmbedError::Invalid(format!(
                    "row {r}'s mask is not real tokens (1) followed by padding (0)"
                )));
            }
            let row = &ids[r * len..r * len + real];
            if row.iter().any(|&id| id as usize >= vocab) {
                return Err(EmbedError::Invalid(format!(
                    "token id past the model's vocabulary ({vocab})"
                )));
            }
            sequences.push(row);
        }
        Ok(self
            .model
            .forward(&sequences, false)
            .into_iter()
            .map(|(sentence, _)| sentence)
            .collect())
    }

    /// The tokenizer (truncating at [`MAX_TOKENS`], no padding).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
}

/// Cosine similarity of two vectors (1.0 for identical directions).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut dot, mut na, mut nb) = (0.0f64, 0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        dot += f64::from(*x) * f64::from(*y);
        na += f64::from(*x) * f64::from(*x);
        nb += f64::from(*y) * f64::from(*y);
    }
    if na == 0.0 || nb == 0.0 {
        return 0.0;
    }
    (dot / (na.sqrt() * nb.sqrt())) as f32
}
