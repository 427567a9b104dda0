//! The transformer's files as both forward passes (the CPU's in [`crate::forward`], the GPU's
//! in `cuda::bert`) read them: the fields of `config.json` they need, every weight from
//! `model.safetensors` (names as the reference BERT implementations load them, with or without
//! a `bert.` prefix), and the tokenizer truncating at [`MAX_TOKENS`] without padding (each
//! pass pads, or not, as it runs).

use std::path::Path;

use safetensors::Dtype;
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
/// an `E`, an `M` unless a pass keeps them otherwise).
#[derive(Debug)]
pub struct Weights<T, M = T, E = M> {
    /// `[vocab, h]`.
    pub word: E,
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

impl<M: Element> Weights<Vec<f32>, Vec<M>> {
    /// Read every weight from the safetensors file at `path`: the matrices (the layers' four
    /// and the word embeddings) as `M`, the rest as `f32`. The file is read tensor by tensor in
    /// small pieces, each converted as it arrives, so loading holds the weights and ~64 KiB
    /// more, never the file's bytes or an `f32` copy of a narrower matrix.
    pub fn read(path: &Path, c: &ModelConfig) -> Result<Self, EmbedError> {
        let mut file = TensorFile::open(path)?;
        let prefix = if file.has("bert.embeddings.word_embeddings.weight") {
            "bert."
        } else {
            ""
        };
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let embeddings = |n: &str| format!("{prefix}embeddings.{n}");
        let mut types: Vec<f32> = file.read(
            &embeddings("token_type_embeddings.weight"),
            &[c.type_vocab_size, h],
        )?;
        types.truncate(h);
        let position = file.read(
            &embeddings("position_embeddings.weight"),
            &[c.max_position_embeddings, h],
        )?;
        let ln_g = file.read(&embeddings("LayerNorm.weight"), &[h])?;
        let ln_b = file.read(&embeddings("LayerNorm.bias"), &[h])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let name = |n: &str| format!("{prefix}encoder.layer.{i}.{n}");
            let mut qkv_w = Vec::with_capacity(3 * h * h);
            let mut qkv_b = Vec::with_capacity(3 * h);
            for part in ["query", "key", "value"] {
                qkv_w.extend(
                    file.read::<M>(&name(&format!("attention.self.{part}.weight")), &[h, h])?,
                );
                qkv_b
                    .extend(file.read::<f32>(&name(&format!("attention.self.{part}.bias")), &[h])?);
            }
            layers.push(Layer {
                qkv_w,
                qkv_b,
                attn_out_w: file.read(&name("attention.output.dense.weight"), &[h, h])?,
                attn_out_b: file.read(&name("attention.output.dense.bias"), &[h])?,
                attn_ln_g: file.read(&name("attention.output.LayerNorm.weight"), &[h])?,
                attn_ln_b: file.read(&name("attention.output.LayerNorm.bias"), &[h])?,
                up_w: file.read(&name("intermediate.dense.weight"), &[inter, h])?,
                up_b: file.read(&name("intermediate.dense.bias"), &[inter])?,
                down_w: file.read(&name("output.dense.weight"), &[h, inter])?,
                down_b: file.read(&name("output.dense.bias"), &[h])?,
                out_ln_g: file.read(&name("output.LayerNorm.weight"), &[h])?,
                out_ln_b: file.read(&name("output.LayerNorm.bias"), &[h])?,
            });
        }
        Ok(Weights {
            word: file.read(&embeddings("word_embeddings.weight"), &[c.vocab_size, h])?,
            position,
            type0: types,
            ln_g,
            ln_b,
            layers,
        })
    }
}

/// A float type weights are kept in, converted from whatever a checkpoint stores.
pub trait Element: Copy + Sized {
    /// Append `bytes`, little-endian values of `dtype` (whole values), converted; `false`
    /// for a type a BERT checkpoint does not store weights in.
    fn extend_from(out: &mut Vec<Self>, dtype: Dtype, bytes: &[u8]) -> bool;
}

impl Element for f32 {
    fn extend_from(out: &mut Vec<f32>, dtype: Dtype, bytes: &[u8]) -> bool {
        match dtype {
            Dtype::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            Dtype::F16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            Dtype::BF16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            #[allow(clippy::cast_possible_truncation, reason = "f64 weights kept as f32")]
            Dtype::F64 => out.extend(bytes.chunks_exact(8).map(|b| {
                f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32
            })),
            _ => return false,
        }
        true
    }
}

impl Element for half::f16 {
    fn extend_from(out: &mut Vec<half::f16>, dtype: Dtype, bytes: &[u8]) -> bool {
        use half::slice::HalfFloatSliceExt;
        if dtype == Dtype::F16 {
            out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]])),
            );
            return true;
        }
        let mut wide = Vec::new();
        if !f32::extend_from(&mut wide, dtype, bytes) {
            return false;
        }
        let at = out.len();
        out.resize(at + wide.len(), half::f16::ZERO);
        out[at..].convert_from_f32_slice(&wide);
        true
    }
}

/// A safetensors file read one tensor at a time (only its header kept in memory).
struct TensorFile<'p> {
    path: &'p Path,
    file: std::fs::File,
    /// Where the tensors' data starts in the file.
    data_start: u64,
    /// The data's length in bytes.
    data_len: u64,
    header: safetensors::tensor::Metadata,
}

/// Bytes read from a file at a time.
const READ_CHUNK: usize = 64 << 10;

/// `count` values of `dtype` (whole bytes each) read from `file` in pieces of at most
/// [`READ_CHUNK`] bytes, each converted to `T` as it arrives, so only the result and one piece
/// are held; `None` for a type `T` is not made from.
pub(crate) fn read_values<T: Element>(
    file: &mut impl std::io::Read,
    dtype: Dtype,
    count: usize,
) -> std::io::Result<Option<Vec<T>>> {
    let size = (dtype.bitsize() / 8).max(1);
    let piece_len = READ_CHUNK - READ_CHUNK % size;
    let mut out = Vec::with_capacity(count);
    let mut chunk = vec![0u8; piece_len];
    let mut left = count * size;
    while left > 0 {
        let piece = &mut chunk[..left.min(piece_len)];
        file.read_exact(piece)?;
        if !T::extend_from(&mut out, dtype, piece) {
            return Ok(None);
        }
        left -= piece.len();
    }
    Ok(Some(out))
}

impl<'p> TensorFile<'p> {
    fn open(path: &'p Path) -> Result<Self, EmbedError> {
        use std::io::Read;
        let io = |e: std::io::Error| bad_file(path, e.to_string());
        let mut file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut n = [0u8; 8];
        file.read_exact(&mut n)
            .map_err(|_| bad_file(path, "not a safetensors file: no header".into()))?;
        let n = u64::from_le_bytes(n);
        // The format's own limit on a header (100 MB).
        if n > 100_000_000 || 8 + n > len {
            return Err(bad_file(
                path,
                "not a safetensors file: bad header size".into(),
            ));
        }
        let mut header = vec![0u8; usize::try_from(n).unwrap_or(0)];
        file.read_exact(&mut header).map_err(io)?;
        let header = serde_json::from_slice(&header)
            .map_err(|e| bad_file(path, format!("not a safetensors file: {e}")))?;
        Ok(Self {
            path,
            file,
            data_start: 8 + n,
            data_len: len - 8 - n,
            header,
        })
    }

    fn has(&self, name: &str) -> bool {
        self.header.info(name).is_some()
    }

    /// The tensor `name`, which must have `shape`, as `T`s.
    fn read<T: Element>(&mut self, name: &str, shape: &[usize]) -> Result<Vec<T>, EmbedError> {
        use std::io::{Seek, SeekFrom};
        let path = self.path;
        let info = self
            .header
            .info(name)
            .ok_or_else(|| bad_file(path, format!("no tensor {name}")))?;
        if info.shape != shape {
            return Err(bad_file(
                path,
                format!("{name}: shape {:?}, expected {shape:?}", info.shape),
            ));
        }
        let (dtype, (start, end)) = (info.dtype, info.data_offsets);
        let size = dtype.bitsize() / 8;
        let count: usize = shape.iter().product();
        if size == 0
            || end.checked_sub(start) != count.checked_mul(size)
            || end as u64 > self.data_len
        {
            return Err(bad_file(
                path,
                format!("{name}: its bytes do not match its shape"),
            ));
        }
        let io = |e: std::io::Error| bad_file(path, format!("{name}: {e}"));
        self.file
            .seek(SeekFrom::Start(self.data_start + start as u64))
            .map_err(io)?;
        read_values(&mut self.file, dtype, count)
            .map_err(io)?
            .ok_or_else(|| bad_file(path, format!("{name}: {dtype:?} values")))
    }
}

impl<T, M> Layer<T, M> {
    /// The same layer with each of its four matrices converted by `f`, which gets the matrix
    /// and its bias (one per output row), the rest as they are.
    pub fn map_matrices<N>(self, mut f: impl FnMut(M, &T) -> N) -> Layer<T, N> {
        Layer {
            qkv_w: f(self.qkv_w, &self.qkv_b),
            qkv_b: self.qkv_b,
            attn_out_w: f(self.attn_out_w, &self.attn_out_b),
            attn_out_b: self.attn_out_b,
            attn_ln_g: self.attn_ln_g,
            attn_ln_b: self.attn_ln_b,
            up_w: f(self.up_w, &self.up_b),
            up_b: self.up_b,
            down_w: f(self.down_w, &self.down_b),
            down_b: self.down_b,
            out_ln_g: self.out_ln_g,
            out_ln_b: self.out_ln_b,
        }
    }
}

impl<T, M> Weights<T, M> {
    /// The matrices (the word embeddings, then each layer's four).
    pub fn matrices(&self) -> impl Iterator<Item = &M> {
        std::iter::once(&self.word).chain(
            self.layers
                .iter()
                .flat_map(|l| [&l.qkv_w, &l.attn_out_w, &l.up_w, &l.down_w]),
        )
    }

    /// The same weights with the matrices (the layers' four and the word embeddings) each
    /// converted by `f` (e.g. to a narrower float), the rest as they are.
    pub fn map_matrices<N>(self, mut f: impl FnMut(M) -> N) -> Weights<T, N> {
        let Weights {
            word,
            position,
            type0,
            ln_g,
            ln_b,
            layers,
        } = self.map_layers(|m, _| f(m));
        Weights {
            word: f(word),
            position,
            type0,
            ln_g,
            ln_b,
            layers,
        }
    }
}

impl<T, M, E> Weights<T, M, E> {
    /// The same weights with the layers' four matrices each converted by `f` (see
    /// [`Layer::map_matrices`]), the word embeddings as they are.
    pub fn map_layers<N>(self, mut f: impl FnMut(M, &T) -> N) -> Weights<T, N, E> {
        Weights {
            word: self.word,
            position: self.position,
            type0: self.type0,
            ln_g: self.ln_g,
            ln_b: self.ln_b,
            layers: self
                .layers
                .into_iter()
                .map(|l| l.map_matrices(&mut f))
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use safetensors::tensor::TensorView;

    use super::*;

    /// A one-layer model of width 8 (4 heads, feed-forward 16, 10 words).
    fn config() -> ModelConfig {
        serde_json::from_value(serde_json::json!({
            "hidden_size": 8, "num_attention_heads": 4, "num_hidden_layers": 1,
            "intermediate_size": 16, "layer_norm_eps": 1e-12, "vocab_size": 10,
            "max_position_embeddings": 256, "hidden_act": "gelu"
        }))
        .unwrap()
    }

    /// Every tensor of [`config`]'s model as f32, each value its index × 0.001 plus a
    /// tensor's own offset (so a tensor read in place of another shows).
    fn tensors(prefix: &str) -> Vec<(String, Vec<usize>, Vec<u8>)> {
        let (h, i) = (8, 16);
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("embeddings.word_embeddings.weight".into(), vec![10, h]),
            ("embeddings.position_embeddings.weight".into(), vec![256, h]),
            ("embeddings.token_type_embeddings.weight".into(), vec![2, h]),
            ("embeddings.LayerNorm.weight".into(), vec![h]),
            ("embeddings.LayerNorm.bias".into(), vec![h]),
        ];
        for (n, s) in [
            ("attention.self.query.weight", vec![h, h]),
            ("attention.self.query.bias", vec![h]),
            ("attention.self.key.weight", vec![h, h]),
            ("attention.self.key.bias", vec![h]),
            ("attention.self.value.weight", vec![h, h]),
            ("attention.self.value.bias", vec![h]),
            ("attention.output.dense.weight", vec![h, h]),
            ("attention.output.dense.bias", vec![h]),
            ("attention.output.LayerNorm.weight", vec![h]),
            ("attention.output.LayerNorm.bias", vec![h]),
            ("intermediate.dense.weight", vec![i, h]),
            ("intermediate.dense.bias", vec![i]),
            ("output.dense.weight", vec![h, i]),
            ("output.dense.bias", vec![h]),
            ("output.LayerNorm.weight", vec![h]),
            ("output.LayerNorm.bias", vec![h]),
        ] {
            shapes.push((format!("encoder.layer.0.{n}"), s));
        }
        shapes
            .into_iter()
            .enumerate()
            .map(|(t, (name, shape))| {
                let n: usize = shape.iter().product();
                #[allow(clippy::cast_precision_loss, reason = "small test values")]
                let bytes = (0..n)
                    .flat_map(|k| (t as f32 + k as f32 * 0.001).to_le_bytes())
                    .collect();
                (format!("{prefix}{name}"), shape, bytes)
            })
            .collect()
    }

    fn file(tensors: &[(String, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let views = tensors.iter().map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        });
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn weights_read_piece_by_piece_are_the_files_values_in_either_precision() {
        let dir = tempfile::tempdir().unwrap();
        let c = config();
        for prefix in ["", "bert."] {
            let path = dir.path().join("model.safetensors");
            std::fs::write(&path, file(&tensors(prefix))).unwrap();
            let wide = Weights::<Vec<f32>>::read(&path, &c).unwrap();
            let narrow = Weights::<Vec<f32>, Vec<half::f16>>::read(&path, &c).unwrap();
            // Tensor 0 is the word embeddings, 1 the positions, 5.. the layer's, in file order.
            assert_eq!(wide.word.len(), 80);
            assert!((wide.word[79] - 0.079).abs() < 1e-6);
            assert!((wide.position[3] - 1.003).abs() < 1e-6);
            assert_eq!(wide.type0.len(), 8);
            assert!((wide.type0[7] - 2.007).abs() < 1e-6);
            let l = &wide.layers[0];
            assert_eq!(l.qkv_w.len(), 3 * 64);
            assert!((l.qkv_w[64] - 7.0).abs() < 1e-6, "key after query");
            assert!((l.qkv_b[8] - 8.0).abs() < 1e-6);
            assert!((l.down_w[127] - 17.127).abs() < 1e-5);
            for (a, b) in wide.layers[0].up_w.iter().zip(&narrow.layers[0].up_w) {
                assert_eq!(half::f16::from_f32(*a), *b);
            }
            assert_eq!(
                narrow.layers[0].up_b, wide.layers[0].up_b,
                "biases stay f32"
            );
        }
    }

    #[test]
    fn a_tensor_longer_than_a_read_and_other_float_types_are_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        // 40,000 values (160 KB as f32: three reads, the last partial), and the same values
        // stored as f16, bf16 and f64.
        #[allow(clippy::cast_precision_loss, reason = "small test values")]
        let values: Vec<f32> = (0..40_000)
            .map(|k| (k % 1000) as f32 * 0.25 - 100.0)
            .collect();
        let f32s: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16s: Vec<u8> = values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let bf16s: Vec<u8> = values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let f64s: Vec<u8> = values
            .iter()
            .flat_map(|v| f64::from(*v).to_le_bytes())
            .collect();
        let views = [
            ("a", Dtype::F32, &f32s),
            ("b", Dtype::F16, &f16s),
            ("c", Dtype::BF16, &bf16s),
            ("d", Dtype::F64, &f64s),
        ]
        .map(|(n, t, b)| (n, TensorView::new(t, vec![200, 200], b).unwrap()));
        std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
        let mut file = TensorFile::open(&path).unwrap();
        for name in ["a", "b", "d"] {
            let wide: Vec<f32> = file.read(name, &[200, 200]).unwrap();
            assert_eq!(wide, values, "{name} as f32");
            let narrow: Vec<half::f16> = file.read(name, &[200, 200]).unwrap();
            assert!(
                narrow.iter().zip(&values).all(|(n, v)| n.to_f32() == *v),
                "{name} as f16"
            );
        }
        // bf16 keeps 8 bits of mantissa: these values are within its rounding.
        let c: Vec<f32> = file.read("c", &[200, 200]).unwrap();
        assert!(c
            .iter()
            .zip(&values)
            .all(|(c, v)| (c - v).abs() <= v.abs() / 128.0));
        assert!(file.read::<f32>("a", &[40_000]).is_err(), "another shape");
    }

    #[test]
    fn a_damaged_weights_file_is_refused_with_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let c = config();
        let err = |bytes: Vec<u8>| {
            std::fs::write(&path, bytes).unwrap();
            Weights::<Vec<f32>, Vec<half::f16>>::read(&path, &c)
                .unwrap_err()
                .to_string()
        };
        let whole = file(&tensors(""));
        assert!(err(whole[..whole.len() - 4].to_vec()).contains("bytes do not match"));
        assert!(err(b"nonsense".to_vec()).contains("not a safetensors file"));
        let mut missing = tensors("");
        missing.retain(|(n, _, _)| n != "encoder.layer.0.output.dense.bias");
        assert!(err(file(&missing)).contains("no tensor encoder.layer.0.output.dense.bias"));
        let mut wrong = tensors("");
        wrong[3].1 = vec![4, 2];
        assert!(err(file(&wrong)).contains("shape [4, 2], expected [8]"));
    }
}
