//! The fast static path: a table of one vector per vocabulary token, distilled from the
//! transformer (the model2vec recipe without its PCA reduction and Zipf weighting: both were
//! measured, see docs/benchmarks.md — they help the static path's own ranking a little but cost
//! the cache verifier a third of its recall at precision 0.90): every token of the vocabulary goes
//! through the model on its own (`[CLS] token [SEP]`, mean-pooled like a sentence), and a text's
//! static embedding is the normalised mean of its tokens' vectors. No matrix products at query
//! time: microseconds per text, for callers that cannot wait for the transformer (loop
//! detection, CPU-only hosts). `gateway embed distill` writes the table next to the model.

use std::io::{Read, Write};
use std::path::Path;

use half::f16;
use half::slice::HalfFloatSliceExt;
use safetensors::Dtype;
use tokenizers::Tokenizer;

use crate::bert::{BertEmbedder, EmbedError, DIM};
use crate::index::normalise;
use crate::model::{read_values, Element};

const MAGIC: &[u8; 8] = b"GWSTATIC";
const VERSION: u32 = 1;
/// Tokens per forward pass while distilling.
const BATCH: usize = 512;

/// A distilled static embedding table with its tokenizer. The rows are kept as f16 (half the
/// memory: 23 MB for this model's 30,522 × 384 instead of 47; a sentence vector, a normalised
/// mean of rows, moves by ~1e-7 in cosine) and written to a file as f32.
pub struct StaticEmbedder {
    dim: usize,
    table: Vec<f16>,
    tokenizer: Tokenizer,
}

impl std::fmt::Debug for StaticEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticEmbedder")
            .field("dim", &self.dim)
            .field("vocab", &(self.table.len() / self.dim.max(1)))
            .finish()
    }
}

fn io(path: &Path, e: std::io::Error) -> EmbedError {
    EmbedError::File {
        path: path.to_owned(),
        message: e.to_string(),
    }
}

impl StaticEmbedder {
    /// Distill the table from `bert`: every vocabulary token through the model. `progress` is
    /// called with (done, total) after each batch.
    pub fn distill(
        bert: &BertEmbedder,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self, EmbedError> {
        let tokenizer = bert.tokenizer().clone();
        let special = |t: &str| {
            tokenizer
                .token_to_id(t)
                .ok_or_else(|| EmbedError::Tokenizer(format!("no {t} token")))
        };
        let (cls, sep) = (special("[CLS]")?, special("[SEP]")?);
        let vocab = u32::try_from(tokenizer.get_vocab_size(true))
            .map_err(|_| EmbedError::Tokenizer("vocabulary too large".into()))?;
        let mut table = Vec::with_capacity(vocab as usize * DIM);
        let mut start = 0u32;
        while start < vocab {
            let end = (start + BATCH as u32).min(vocab);
            let n = (end - start) as usize;
            let ids: Vec<u32> = (start..end).flat_map(|t| [cls, t, sep]).collect();
            let rows = bert.embed_ids(ids, vec![1; n * 3], (n, 3))?;
            for row in rows {
                table.extend(row.iter().map(|&x| f16::from_f32(x)));
            }
            start = end;
            progress(start as usize, vocab as usize);
        }
        Ok(Self {
            dim: DIM,
            table,
            tokenizer: without_limits(tokenizer)?,
        })
    }

    /// Whether `path` holds a table this build can load (present, current version, whole):
    /// its header and length, not its rows.
    pub fn is_current(path: &Path) -> bool {
        open_table(path).is_ok()
    }

    /// Write the table (the tokenizer stays in the model directory).
    pub fn save(&self, path: &Path) -> Result<(), EmbedError> {
        let tmp = path.with_extension("part");
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?);
        let vocab = (self.table.len() / self.dim) as u32;
        let mut header = Vec::with_capacity(20);
        header.extend_from_slice(MAGIC);
        for v in [VERSION, vocab, self.dim as u32] {
            header.extend_from_slice(&v.to_le_bytes());
        }
        f.write_all(&header).map_err(|e| io(&tmp, e))?;
        for x in &self.table {
            f.write_all(&x.to_f32().to_le_bytes())
                .map_err(|e| io(&tmp, e))?;
        }
        f.into_inner()
            .map_err(|e| io(&tmp, e.into_error()))?
            .sync_all()
            .map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io(path, e))
    }

    /// Load a table written by [`StaticEmbedder::save`], with the model's `tokenizer.json`.
    pub fn load(table: &Path, tokenizer: &Path) -> Result<Self, EmbedError> {
        let (table, dim) = read_table::<f16>(table)?;
        let tok =
            Tokenizer::from_file(tokenizer).map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        Ok(Self {
            dim,
            table,
            tokenizer: without_limits(tok)?,
        })
    }

    /// The tokenizer (the model's, without truncation or padding).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Dimension of the vectors.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The same tokenizer over a table whose every row is mapped by `f` into `dim` values (a
    /// linear projection, say: then a text's vector is the projection of its vector, computed
    /// at the cost of `dim`-sized rows). `f` gets each row widened to f32 and `dim` zeros to
    /// fill (or add into).
    pub fn map_rows(&self, dim: usize, f: impl Fn(&[f32], &mut [f32])) -> Self {
        let mut table = vec![f16::ZERO; self.table.len() / self.dim.max(1) * dim];
        let (mut wide, mut mapped) = (vec![0.0f32; self.dim], vec![0.0f32; dim]);
        for (row, out) in self
            .table
            .chunks_exact(self.dim.max(1))
            .zip(table.chunks_exact_mut(dim.max(1)))
        {
            row.convert_to_f32_slice(&mut wide);
            mapped.fill(0.0);
            f(&wide, &mut mapped);
            out.convert_from_f32_slice(&mapped);
        }
        Self {
            dim,
            table,
            tokenizer: self.tokenizer.clone(),
        }
    }

    /// The static embedding of `text`: the L2-normalised mean of its tokens' vectors (zero for
    /// a text without tokens).
    pub fn embed(&self, text: &str) -> Result<Vec<f32>, EmbedError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        Ok(self.embed_ids(enc.get_ids()))
    }

    /// The token ids of `text` (whole text, no special tokens).
    pub fn ids(&self, text: &str) -> Result<Vec<u32>, EmbedError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The static embedding of a token id sequence.
    pub fn embed_ids(&self, ids: &[u32]) -> Vec<f32> {
        self.embed_weighted(ids, |_| 1.0)
    }

    /// The L2-normalised sum of the tokens' rows, each scaled by `weight(id)` (with rarity
    /// weights: the SIF-style sentence vector).
    pub fn embed_weighted(&self, ids: &[u32], weight: impl Fn(u32) -> f32) -> Vec<f32> {
        let mut out = vec![0.0f32; self.dim];
        for &id in ids {
            let at = id as usize * self.dim;
            if let Some(row) = self.table.get(at..at + self.dim) {
                let w = weight(id);
                for (o, x) in out.iter_mut().zip(row) {
                    *o += w * x.to_f32();
                }
            }
        }
        normalise(&mut out);
        out
    }
}

/// Read a table file written by [`StaticEmbedder::save`]: (`vocab × dim` rows, `dim`), as
/// `T`. Read in pieces converted as they arrive, so loading holds the table, not also the
/// file's bytes or an f32 copy of an f16 table.
pub fn read_table<T: Element>(path: &Path) -> Result<(Vec<T>, usize), EmbedError> {
    let (mut file, vocab, dim) = open_table(path)?;
    let table = read_values(&mut file, Dtype::F32, vocab * dim)
        .map_err(|e| io(path, e))?
        .ok_or_else(|| EmbedError::File {
            path: path.to_owned(),
            message: "f32 values this build cannot keep".into(),
        })?;
    Ok((table, dim))
}

/// A table file opened past its header, which is checked (magic, version, and a length that
/// matches its rows and columns): the file, rows, columns.
fn open_table(path: &Path) -> Result<(std::fs::File, usize, usize), EmbedError> {
    let bad = |m: String| EmbedError::File {
        path: path.to_owned(),
        message: m,
    };
    let mut file = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let len = file.metadata().map_err(|e| io(path, e))?.len();
    let mut head = [0u8; 20];
    file.read_exact(&mut head)
        .map_err(|_| bad("not a static embedding table".into()))?;
    let (version, vocab, dim, _) =
        header(&head, MAGIC).ok_or_else(|| bad("not a static embedding table".into()))?;
    if version != VERSION {
        return Err(bad(format!(
            "static table version {version}, this build needs {VERSION}: run `gateway embed distill`"
        )));
    }
    let bytes = vocab
        .checked_mul(dim)
        .and_then(|n| n.checked_mul(4))
        .and_then(|n| u64::try_from(n).ok()?.checked_add(20));
    if dim == 0 || bytes != Some(len) {
        return Err(bad("truncated table".into()));
    }
    Ok((file, vocab, dim))
}

/// The header our matrix files share (`magic`, then version, rows and columns as little-endian
/// u32) and the bytes after it; `None` when `magic` is not there.
pub(crate) fn header<'a>(
    bytes: &'a [u8],
    magic: &[u8; 8],
) -> Option<(u32, usize, usize, &'a [u8])> {
    if bytes.len() < 20 || &bytes[..8] != magic {
        return None;
    }
    let word = |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    Some((word(8), word(12) as usize, word(16) as usize, &bytes[20..]))
}

/// Little-endian f32 values, four bytes each.
pub(crate) fn f32s(body: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(body.len() / 4);
    f32::extend_from(&mut out, Dtype::F32, body);
    out
}

/// Static embeddings read whole texts: no truncation, no padding.
fn without_limits(mut tok: Tokenizer) -> Result<Tokenizer, EmbedError> {
    tok.with_truncation(None)
        .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
    tok.with_padding(None);
    Ok(tok)
}
