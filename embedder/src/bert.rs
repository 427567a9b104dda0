//! The transformer sentence embedder on the CPU: all-MiniLM-L6-v2 (BERT, 6 layers, 384
//! dimensions) run with candle from local files (`model.safetensors`, `tokenizer.json`,
//! `config.json`), then mean pooling over the attention mask and L2 normalisation — the
//! sentence-transformers pipeline of that model (`modules.json`: Transformer → Pooling →
//! Normalize), with its `max_seq_length` of 256 tokens.
//!
//! Agreement with the reference (`scripts/embed-reference.py`, float64) is checked on committed
//! fixtures by `embedder/tests/bert_parity.rs`.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use tokenizers::{PaddingParams, Tokenizer, TruncationParams};

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
    /// The model failed.
    #[error("model: {0}")]
    Model(#[from] candle_core::Error),
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
    /// Each text's L2-normalised sentence vector and its L2-normalised contextual token vectors
    /// (real tokens only, without `[CLS]`/`[SEP]`), as [`BertEmbedder::embed_with_tokens`].
    fn embed_with_tokens(&self, texts: &[&str]) -> Result<Vec<TextVectors>, EmbedError>;
}

impl Embed for BertEmbedder {
    fn device(&self) -> &'static str {
        "cpu"
    }

    fn embed_with_tokens(&self, texts: &[&str]) -> Result<Vec<TextVectors>, EmbedError> {
        BertEmbedder::embed_with_tokens(self, texts)
    }
}

/// Output dimension of all-MiniLM-L6-v2.
pub const DIM: usize = 384;
/// sentence-transformers' `max_seq_length` for this model.
pub const MAX_TOKENS: usize = 256;

/// A tokenized batch: token ids and attention mask (row-major), and (texts, padded length).
type Batch = (Vec<u32>, Vec<u32>, (usize, usize));

/// A text's sentence vector and its contextual token vectors.
pub type TextVectors = (Vec<f32>, Vec<Vec<f32>>);

/// A loaded transformer embedder (CPU).
pub struct BertEmbedder {
    model: BertModel,
    tokenizer: Tokenizer,
    device: Device,
    dir: PathBuf,
}

impl std::fmt::Debug for BertEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BertEmbedder")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, EmbedError> {
    std::fs::read(path).map_err(|e| EmbedError::File {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

impl BertEmbedder {
    /// Whether `dir` holds the files [`BertEmbedder::load`] needs.
    pub fn present(dir: &Path) -> bool {
        ["model.safetensors", "tokenizer.json", "config.json"]
            .iter()
            .all(|f| dir.join(f).is_file())
    }

    /// Load the model from `dir` (as `scripts/fetch-model.sh` lays it out).
    pub fn load(dir: &Path) -> Result<Self, EmbedError> {
        let config_path = dir.join("config.json");
        let config: Config =
            serde_json::from_slice(&read(&config_path)?).map_err(|e| EmbedError::File {
                path: config_path.clone(),
                message: e.to_string(),
            })?;
        let tokenizer_path = dir.join("tokenizer.json");
        let mut tokenizer = Tokenizer::from_bytes(read(&tokenizer_path)?)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: MAX_TOKENS,
                ..Default::default()
            }))
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        tokenizer.with_padding(Some(PaddingParams::default()));
        let device = Device::Cpu;
        let weights = read(&dir.join("model.safetensors"))?;
        let vb = VarBuilder::from_buffered_safetensors(weights, DType::F32, &device)?;
        let model = BertModel::load(vb, &config)?;
        Ok(Self {
            model,
            tokenizer,
            device,
            dir: dir.to_owned(),
        })
    }

    /// A hash of the model's files (weights, tokenizer, configuration): vectors computed
    /// with another fingerprint came from another model.
    pub fn fingerprint(&self) -> Result<u64, EmbedError> {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for f in ["config.json", "tokenizer.json", "model.safetensors"] {
            h.update(&read(&self.dir.join(f))?);
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

    /// Embed a batch: one L2-normalised [`DIM`]-vector per text, in order. Texts are padded to
    /// the longest in the batch; padding is masked out of attention and pooling.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let (ids, mask, shape) = self.encode(texts)?;
        self.forward_pooled(ids, mask, shape)
    }

    /// Tokenize a batch: ids and attention mask, row-major, padded to the longest text.
    fn encode(&self, texts: &[&str]) -> Result<Batch, EmbedError> {
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        let len = encodings.first().map_or(0, |e| e.get_ids().len());
        let mut ids = Vec::with_capacity(texts.len() * len);
        let mut mask = Vec::with_capacity(texts.len() * len);
        for e in &encodings {
            ids.extend_from_slice(e.get_ids());
            mask.extend_from_slice(e.get_attention_mask());
        }
        Ok((ids, mask, (texts.len(), len)))
    }

    /// Like [`BertEmbedder::embed`], also returning each text's contextual token vectors
    /// (L2-normalised hidden states of its real tokens, without `[CLS]` and `[SEP]`), for
    /// token-level alignment of two texts.
    pub fn embed_with_tokens(&self, texts: &[&str]) -> Result<Vec<TextVectors>, EmbedError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let (ids, mask, shape) = self.encode(texts)?;
        let len = shape.1;
        let (pooled, hidden) = self.forward(ids, mask.clone(), shape)?;
        let hidden = hidden.to_vec3::<f32>()?;
        let mut out = Vec::with_capacity(texts.len());
        for (i, (p, rows)) in pooled.into_iter().zip(hidden).enumerate() {
            let real = mask[i * len..(i + 1) * len]
                .iter()
                .filter(|&&m| m == 1)
                .count();
            let tokens = rows
                .into_iter()
                .take(real.saturating_sub(1))
                .skip(1)
                .map(|mut v| {
                    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
                    v.iter_mut().for_each(|x| *x /= n);
                    v
                })
                .collect();
            out.push((p, tokens));
        }
        Ok(out)
    }

    /// Embed sequences of token ids of equal length `shape.1` (already with `[CLS]`/`[SEP]`);
    /// `mask` marks real tokens (1) and padding (0).
    pub fn embed_ids(
        &self,
        ids: Vec<u32>,
        mask: Vec<u32>,
        shape: (usize, usize),
    ) -> Result<Vec<Vec<f32>>, EmbedError> {
        self.forward_pooled(ids, mask, shape)
    }

    /// The tokenizer (truncating at [`MAX_TOKENS`], padding batches).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn forward_pooled(
        &self,
        ids: Vec<u32>,
        mask: Vec<u32>,
        shape: (usize, usize),
    ) -> Result<Vec<Vec<f32>>, EmbedError> {
        Ok(self.forward(ids, mask, shape)?.0)
    }

    /// Pooled, normalised sentence vectors and the raw hidden states `[batch, len, DIM]`.
    fn forward(
        &self,
        ids: Vec<u32>,
        mask: Vec<u32>,
        shape: (usize, usize),
    ) -> Result<(Vec<Vec<f32>>, Tensor), EmbedError> {
        let ids = Tensor::from_vec(ids, shape, &self.device)?;
        let mask = Tensor::from_vec(mask, shape, &self.device)?;
        let types = ids.zeros_like()?;
        let hidden = self.model.forward(&ids, &types, Some(&mask))?;
        // Mean over the unmasked tokens, then L2 normalisation.
        let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
        let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
        let counts = mask.sum(1)?.clamp(1e-9f32, f32::MAX)?;
        let mean = summed.broadcast_div(&counts)?;
        let norm = mean
            .sqr()?
            .sum_keepdim(1)?
            .sqrt()?
            .clamp(1e-12f32, f32::MAX)?;
        Ok((mean.broadcast_div(&norm)?.to_vec2::<f32>()?, hidden))
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
