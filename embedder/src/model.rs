//! The transformer's files as both forward passes (the CPU's in [`crate::forward`], the GPU's
//! in `cuda::bert`) read them: the fields of `config.json` they need, every weight from
//! `model.safetensors` (names as the reference BERT implementations load them, with or without
//! a `bert.` prefix), and the tokenizer truncating at [`MAX_TOKENS`] without padding (each
//! pass pads, or not, as it runs).

use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use tokenizers::{Tokenizer, TruncationParams};

use crate::bert::{EmbedError, MAX_TOKENS};

/// The fields of `config.json` the forward passes need.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct ModelConfig {
    /// Width of the hidden states (384 for all-MiniLM-L6-v2).
    pub hidden_size: usize,
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Layer norms' epsilon.
    pub layer_norm_eps: f64,
    /// Rows of the word embeddings.
    pub vocab_size: usize,
    /// Rows of the position embeddings.
    pub max_position_embeddings: usize,
    /// Rows of the token type embeddings.
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    /// The feed-forward activation (only `gelu`, the erf form, is implemented).
    pub hidden_act: String,
    /// Only `absolute` (or absent) is implemented.
    #[serde(default)]
    pub position_embedding_type: Option<String>,
}

fn default_type_vocab() -> usize {
    2
}

impl ModelConfig {
    /// Read `config.json` and check it describes a model the forward passes implement.
    pub fn read(path: &Path) -> Result<Self, EmbedError> {
        let config: Self =
            serde_json::from_slice(&read(path)?).map_err(|e| bad_file(path, e.to_string()))?;
        config.check(path)?;
        Ok(config)
    }

    fn check(&self, path: &Path) -> Result<(), EmbedError> {
        let bad = |m: &str| Err(bad_file(path, m.to_owned()));
        if self.hidden_act != "gelu" {
            return bad("only the exact (erf) GELU activation is implemented");
        }
        if self
            .position_embedding_type
            .as_deref()
            .is_some_and(|p| p != "absolute")
        {
            return bad("only absolute position embeddings are implemented");
        }
        if self.hidden_size.checked_rem(self.num_attention_heads) != Some(0) {
            return bad("hidden size not a multiple of the number of heads");
        }
        if self.max_position_embeddings < MAX_TOKENS {
            return bad("fewer position embeddings than the token limit");
        }
        if self.type_vocab_size == 0 || self.num_hidden_layers == 0 || self.vocab_size == 0 {
            return bad("empty model");
        }
        Ok(())
    }
}

/// One encoder layer's weights (`T`: the host's `Vec<f32>`, or a device's buffer; `M` the
/// same for the four matrices, which a pass may keep in another precision).
#[derive(Debug)]
pub struct Layer<T, M = T> {
    /// `[3h, h]`: query, key, value weights stacked.
    pub qkv_w: M,
    /// `[3h]`.
    pub qkv_b: T,
    /// `[h, h]`.
    pub attn_out_w: M,
    /// `[h]`.
    pub attn_out_b: T,
    /// `[h]`.
    pub attn_ln_g: T,
    /// `[h]`.
    pub attn_ln_b: T,
    /// `[intermediate, h]`.
    pub up_w: M,
    /// `[intermediate]`.
    pub up_b: T,
    /// `[h, intermediate]`.
    pub down_w: M,
    /// `[h]`.
    pub down_b: T,
    /// `[h]`.
    pub out_ln_g: T,
    /// `[h]`.
    pub out_ln_b: T,
}

/// Every weight the forward passes use (`T` and `M` as in [`Layer`]; the word embeddings are
/// an `M`).
#[derive(Debug)]
pub struct Weights<T, M = T> {
    /// `[vocab, h]`.
    pub word: M,
    /// `[positions, h]`.
    pub position: T,
    /// Row 0 of the token type embeddings (every token is type 0).
    pub type0: T,
    /// The embeddings' layer norm, `[h]` each.
    pub ln_g: T,
    /// See `ln_g`.
    pub ln_b: T,
    /// The encoder layers, in order.
    pub layers: Vec<Layer<T, M>>,
}

impl Weights<Vec<f32>> {
    /// Read every weight from the safetensors file `bytes` (read from `path`), as f32.
    pub fn read(bytes: &[u8], path: &Path, c: &ModelConfig) -> Result<Self, EmbedError> {
        let tensors = SafeTensors::deserialize(bytes)
            .map_err(|e| bad_file(path, format!("not a safetensors file: {e}")))?;
        let prefix = if tensors
            .tensor("bert.embeddings.word_embeddings.weight")
            .is_ok()
        {
            "bert."
        } else {
            ""
        };
        // Each tensor converted straight from the file's bytes (no intermediate copy, so
        // loading holds the file and the weights, not a third copy).
        let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>, EmbedError> {
            let full = format!("{prefix}{name}");
            let tensor = tensors
                .tensor(&full)
                .map_err(|_| bad_file(path, format!("no tensor {full}")))?;
            if tensor.shape() != shape {
                return Err(bad_file(
                    path,
                    format!("{full}: shape {:?}, expected {shape:?}", tensor.shape()),
                ));
            }
            floats(tensor.dtype(), tensor.data())
                .ok_or_else(|| bad_file(path, format!("{full}: {:?} values", tensor.dtype())))
        };
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let mut types = get(
            "embeddings.token_type_embeddings.weight",
            &[c.type_vocab_size, h],
        )?;
        types.truncate(h);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let name = |n: &str| format!("encoder.layer.{i}.{n}");
            let mut qkv_w = Vec::with_capacity(3 * h * h);
            let mut qkv_b = Vec::with_capacity(3 * h);
            for part in ["query", "key", "value"] {
                qkv_w.extend(get(
                    &name(&format!("attention.self.{part}.weight")),
                    &[h, h],
                )?);
                qkv_b.extend(get(&name(&format!("attention.self.{part}.bias")), &[h])?);
            }
            layers.push(Layer {
                qkv_w,
                qkv_b,
                attn_out_w: get(&name("attention.output.dense.weight"), &[h, h])?,
                attn_out_b: get(&name("attention.output.dense.bias"), &[h])?,
                attn_ln_g: get(&name("attention.output.LayerNorm.weight"), &[h])?,
                attn_ln_b: get(&name("attention.output.LayerNorm.bias"), &[h])?,
                up_w: get(&name("intermediate.dense.weight"), &[inter, h])?,
                up_b: get(&name("intermediate.dense.bias"), &[inter])?,
                down_w: get(&name("output.dense.weight"), &[h, inter])?,
                down_b: get(&name("output.dense.bias"), &[h])?,
                out_ln_g: get(&name("output.LayerNorm.weight"), &[h])?,
                out_ln_b: get(&name("output.LayerNorm.bias"), &[h])?,
            });
        }
        Ok(Weights {
            word: get("embeddings.word_embeddings.weight", &[c.vocab_size, h])?,
            position: get(
                "embeddings.position_embeddings.weight",
                &[c.max_position_embeddings, h],
            )?,
            type0: types,
            ln_g: get("embeddings.LayerNorm.weight", &[h])?,
            ln_b: get("embeddings.LayerNorm.bias", &[h])?,
            layers,
        })
    }
}

impl<T, M> Weights<T, M> {
    /// The same weights with the matrices (the layers' four and the word embeddings) each
    /// converted by `f` (e.g. to a narrower float), the rest as they are.
    pub fn map_matrices<N>(self, mut f: impl FnMut(M) -> N) -> Weights<T, N> {
        Weights {
            word: f(self.word),
            position: self.position,
            type0: self.type0,
            ln_g: self.ln_g,
            ln_b: self.ln_b,
            layers: self
                .layers
                .into_iter()
                .map(|l| Layer {
                    qkv_w: f(l.qkv_w),
                    qkv_b: l.qkv_b,
                    attn_out_w: f(l.attn_out_w),
                    attn_out_b: l.attn_out_b,
                    attn_ln_g: l.attn_ln_g,
                    attn_ln_b: l.attn_ln_b,
                    up_w: f(l.up_w),
                    up_b: l.up_b,
                    down_w: f(l.down_w),
                    down_b: l.down_b,
                    out_ln_g: l.out_ln_g,
                    out_ln_b: l.out_ln_b,
                })
                .collect(),
        }
    }
}

impl<T> Weights<T> {
    /// The same weights, each converted by `f` (e.g. copied to a device), in order.
    pub fn try_map<U, E>(&self, mut f: impl FnMut(&T) -> Result<U, E>) -> Result<Weights<U>, E> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(Layer {
                qkv_w: f(&l.qkv_w)?,
                qkv_b: f(&l.qkv_b)?,
                attn_out_w: f(&l.attn_out_w)?,
                attn_out_b: f(&l.attn_out_b)?,
                attn_ln_g: f(&l.attn_ln_g)?,
                attn_ln_b: f(&l.attn_ln_b)?,
                up_w: f(&l.up_w)?,
                up_b: f(&l.up_b)?,
                down_w: f(&l.down_w)?,
                down_b: f(&l.down_b)?,
                out_ln_g: f(&l.out_ln_g)?,
                out_ln_b: f(&l.out_ln_b)?,
            });
        }
        Ok(Weights {
            word: f(&self.word)?,
            position: f(&self.position)?,
            type0: f(&self.type0)?,
            ln_g: f(&self.ln_g)?,
            ln_b: f(&self.ln_b)?,
            layers,
        })
    }
}

/// A tensor's little-endian `data` of `dtype` as f32 (`None` for a type a BERT checkpoint does
/// not store weights in).
fn floats(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        #[allow(clippy::cast_possible_truncation, reason = "f64 weights kept as f32")]
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32)
            .collect(),
        _ => return None,
    })
}

/// The model's tokenizer, truncating at [`MAX_TOKENS`], without padding.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, EmbedError> {
    let mut tokenizer =
        Tokenizer::from_bytes(read(path)?).map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length: MAX_TOKENS,
            ..Default::default()
        }))
        .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
    tokenizer.with_padding(None);
    Ok(tokenizer)
}

/// Tokenize `texts` (with `[CLS]`/`[SEP]`, truncated), refusing an id past the vocabulary.
pub fn token_ids(
    tokenizer: &Tokenizer,
    texts: &[&str],
    vocab: usize,
) -> Result<Vec<Vec<u32>>, EmbedError> {
    let encodings = tokenizer
        .encode_batch(texts.to_vec(), true)
        .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
    encodings
        .into_iter()
        .map(|e| {
            let ids = e.get_ids();
            if ids.iter().any(|&id| id as usize >= vocab) {
                return Err(EmbedError::Tokenizer(format!(
                    "token id past the model's vocabulary ({vocab})"
                )));
            }
            Ok(ids.to_vec())
        })
        .collect()
}

/// A model file's bytes.
pub fn read(path: &Path) -> Result<Vec<u8>, EmbedError> {
    std::fs::read(path).map_err(|e| bad_file(path, e.to_string()))
}

/// [`EmbedError::File`] for `path`.
pub fn bad_file(path: &Path, message: String) -> EmbedError {
    EmbedError::File {
        path: path.to_owned(),
        message,
    }
}
