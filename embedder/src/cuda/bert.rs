//! [`GpuEmbedder`]: all-MiniLM-L6-v2 on the GPU, the same pipeline as
//! [`BertEmbedder`](crate::bert::BertEmbedder) (BERT forward, mean pooling over the attention
//! mask, L2 normalisation; the token vectors of each text without `[CLS]`/`[SEP]`).
//!
//! One forward pass over a padded batch of `texts × len` tokens (f32 throughout):
//!
//! 1. `embed_layernorm`: word + token type 0 + position embeddings, layer norm.
//! 2. Per layer: the fused QKV projection (one cuBLAS product with the `[3h, h]` weight);
//!    `split_heads` adds the bias and lays q, k, v out per head; scores `q·kᵀ / √dh` (one
//!    strided-batched product over texts × heads); `softmax_masked` (padding keys weigh 0);
//!    context `p·v` (strided-batched); `merge_heads`; the output projection, then
//!    `bias_residual_layernorm`; the feed-forward up-projection, `bias_gelu` (erf form), the
//!    down-projection, `bias_residual_layernorm`.
//! 3. `mean_pool_normalize` (sentence vectors), `l2_normalize_rows` (token vectors), and one
//!    copy of each back to the host.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::ValidAsZeroBits;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DeviceRepr, PushKernelArg};
use tokenizers::Tokenizer;

use super::{
    attention_context, attention_scores, device_err, function, guard, int, linear,
    thread_per_element, warp_per_row, Gpu, MAX_PASS_TOKENS,
};
use crate::bert::{Embed, EmbedError, TextVectors};
use crate::model::{self, ModelConfig};

/// The transformer's kernels (CUDA C).
pub(super) const KERNELS: &str = include_str!("kernels.cu");

/// Attention scores computed at once, in floats (128 MiB): a pass whose `texts × heads × len²`
/// is larger runs its attention in chunks of texts.
const SCORE_BUDGET: usize = 1 << 25;

/// Every weight on the device.
type Weights = model::Weights<CudaSlice<f32>>;

struct Kernels {
    embed_layernorm: CudaFunction,
    split_heads: CudaFunction,
    softmax_masked: CudaFunction,
    merge_heads: CudaFunction,
    bias_residual_layernorm: CudaFunction,
    bias_gelu: CudaFunction,
    mean_pool_normalize: CudaFunction,
    l2_normalize_rows: CudaFunction,
}

/// Activations, reused across calls and grown to the largest pass seen.
struct Workspace {
    ids: CudaSlice<u32>,
    mask: CudaSlice<u32>,
    x: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    ctx: CudaSlice<f32>,
    tmp: CudaSlice<f32>,
    inter: CudaSlice<f32>,
    scores: CudaSlice<f32>,
    pooled: CudaSlice<f32>,
}

/// Grow `buf` to at least `len` elements (contents are not kept: every pass writes what it
/// reads).
fn ensure<T: DeviceRepr + ValidAsZeroBits>(
    stream: &std::sync::Arc<CudaStream>,
    buf: &mut CudaSlice<T>,
    len: usize,
) -> Result<(), EmbedError> {
    if buf.len() < len {
        *buf = stream
            .alloc_zeros(len)
            .map_err(device_err("allocating the workspace"))?;
    }
    Ok(())
}

impl Workspace {
    fn new(stream: &std::sync::Arc<CudaStream>) -> Result<Self, EmbedError> {
        let z = |n| {
            stream
                .alloc_zeros::<f32>(n)
                .map_err(device_err("allocating the workspace"))
        };
        let u = |n| {
            stream
                .alloc_zeros::<u32>(n)
                .map_err(device_err("allocating the workspace"))
        };
        Ok(Self {
            ids: u(1)?,
            mask: u(1)?,
            x: z(1)?,
            qkv: z(1)?,
            q: z(1)?,
            k: z(1)?,
            v: z(1)?,
            ctx: z(1)?,
            tmp: z(1)?,
            inter: z(1)?,
            scores: z(1)?,
            pooled: z(1)?,
        })
    }
}

/// all-MiniLM-L6-v2 on an NVIDIA GPU (see the [module docs](super)).
pub struct GpuEmbedder {
    gpu: Gpu,
    blas: CudaBlas,
    kernels: Kernels,
    weights: Weights,
    config: ModelConfig,
    tokenizer: Tokenizer,
    workspace: Mutex<Workspace>,
    dir: PathBuf,
    ordinal: usize,
}

impl Drop for GpuEmbedder {
    fn drop(&mut self) {
        // Runs before the fields drop: cudarc destroys the cuBLAS handle without binding the
        // context, so make this device's context current for it (matters for ordinal > 0, or a
        // thread with another context current).
        let _ = self.gpu.ctx.bind_to_thread();
    }
}

impl std::fmt::Debug for GpuEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuEmbedder")
            .field("dir", &self.dir)
            .field("ordinal", &self.ordinal)
            .finish_non_exhaustive()
    }
}

impl GpuEmbedder {
    /// Load the model from `dir` (as `scripts/fetch-model.sh` lays it out: `model.safetensors`,
    /// `tokenizer.json`, `config.json`) onto CUDA device `ordinal`: the weights are uploaded once
    /// and the kernels compiled. Fails with [`EmbedError::Device`] where there is no usable GPU
    /// (see [`available`](super::available)).
    pub fn load(dir: &Path, ordinal: usize) -> Result<Self, EmbedError> {
        let config = ModelConfig::read(&dir.join("config.json"))?;
        let tokenizer = model::load_tokenizer(&dir.join("tokenizer.json"))?;
        let weights_path = dir.join("model.safetensors");
        let host = model::Weights::<Vec<f32>>::read(&weights_path, &config)?;
        let gpu = Gpu::open(ordinal)?;
        let (weights, kernels, blas, workspace) = guard("loading the model onto the GPU", || {
            let weights = host.try_map(|v| {
                gpu.stream
                    .clone_htod(v)
                    .map_err(device_err("uploading the weights"))
            })?;
            let module = gpu.compile(KERNELS, &[])?;
            let kernels = Kernels {
                embed_layernorm: function(&module, "embed_layernorm")?,
                split_heads: function(&module, "split_heads")?,
                softmax_masked: function(&module, "softmax_masked")?,
                merge_heads: function(&module, "merge_heads")?,
                bias_residual_layernorm: function(&module, "bias_residual_layernorm")?,
                bias_gelu: function(&module, "bias_gelu")?,
                mean_pool_normalize: function(&module, "mean_pool_normalize")?,
                l2_normalize_rows: function(&module, "l2_normalize_rows")?,
            };
            let blas = CudaBlas::new(gpu.stream.clone()).map_err(device_err("cublasCreate"))?;
            let workspace = Workspace::new(&gpu.stream)?;
            gpu.stream
                .synchronize()
                .map_err(device_err("uploading the weights"))?;
            Ok((weights, kernels, blas, workspace))
        })?;
        Ok(Self {
            gpu,
            blas,
            kernels,
            weights,
            config,
            tokenizer,
            workspace: Mutex::new(workspace),
            dir: dir.to_owned(),
            ordinal,
        })
    }

    /// The CUDA device this runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Output dimension (384 for all-MiniLM-L6-v2).
    pub fn dim(&self) -> usize {
        self.config.hidden_size
    }

    /// Embed a batch: one L2-normalised sentence vector per text, in order, as
    /// [`BertEmbedder::embed`](crate::bert::BertEmbedder::embed) (only the sentence vectors
    /// come back from the GPU).
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
        Ok(self
            .run(texts, false)?
            .into_iter()
            .map(|(sentence, _)| sentence)
            .collect())
    }

    /// Tokenize, run the passes, split the results per text.
    fn run(&self, texts: &[&str], with_tokens: bool) -> Result<Vec<TextVectors>, EmbedError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let ids = model::token_ids(&self.tokenizer, texts, self.config.vocab_size)?;
        let sequences: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
        let mut workspace = self
            .workspace
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        guard("running the transformer on the GPU", || {
            self.gpu
                .ctx
                .bind_to_thread()
                .map_err(device_err("binding the CUDA context"))?;
            let h = self.config.hidden_size;
            let mut out = Vec::with_capacity(texts.len());
            for pass in passes(&sequences) {
                let batch = &sequences[pass];
                let len = batch.iter().map(|s| s.len()).max().unwrap_or(1).max(1);
                let mut ids = vec![0u32; batch.len() * len];
                let mut mask = vec![0u32; batch.len() * len];
                for (i, s) in batch.iter().enumerate() {
                    ids[i * len..i * len + s.len()].copy_from_slice(s);
                    mask[i * len..i * len + s.len()].fill(1);
                }
                let (pooled, hidden) =
                    self.forward(&mut workspace, &ids, &mask, batch.len(), len, with_tokens)?;
                for (i, s) in batch.iter().enumerate() {
                    let sentence = pooled[i * h..(i + 1) * h].to_vec();
                    // The real tokens but the first ([CLS]) and the last ([SEP]).
                    let tokens = if with_tokens {
                        (1..s.len().saturating_sub(1))
                            .map(|j| hidden[(i * len + j) * h..(i * len + j + 1) * h].to_vec())
                            .collect()
                    } else {
                        Vec::new()
                    };
                    out.push((sentence, tokens));
                }
            }
            Ok(out)
        })
    }

    /// One forward pass over `texts × len` padded tokens: the pooled sentence vectors
    /// `[texts, h]` and, with `with_tokens`, the normalised hidden states `[texts · len, h]`.
    #[allow(clippy::too_many_lines, reason = "one straight sequence of launches")]
    fn forward(
        &self,
        ws: &mut Workspace,
        ids: &[u32],
        mask: &[u32],
        texts: usize,
        len: usize,
        with_tokens: bool,
    ) -> Result<(Vec<f32>, Vec<f32>), EmbedError> {
        let c = &self.config;
        let (h, heads, inter) = (c.hidden_size, c.num_attention_heads, c.intermediate_size);
        let dh = h / heads;
        let t = texts * len;
        let stream = &self.gpu.stream;
        let k = &self.kernels;
        let w = &self.weights;
        #[allow(clippy::cast_possible_truncation, reason = "eps is 1e-12, an f32")]
        let eps = c.layer_norm_eps as f32;
        #[allow(clippy::cast_precision_loss, reason = "head sizes are small")]
        let scale = 1.0 / (dh as f32).sqrt();
        let chunk = (SCORE_BUDGET / (heads * len * len)).clamp(1, texts);

        ensure(stream, &mut ws.ids, t)?;
        ensure(stream, &mut ws.mask, t)?;
        ensure(stream, &mut ws.x, t * h)?;
        ensure(stream, &mut ws.qkv, t * 3 * h)?;
        ensure(stream, &mut ws.q, t * h)?;
        ensure(stream, &mut ws.k, t * h)?;
        ensure(stream, &mut ws.v, t * h)?;
        ensure(stream, &mut ws.ctx, t * h)?;
        ensure(stream, &mut ws.tmp, t * h)?;
        ensure(stream, &mut ws.inter, t * inter)?;
        ensure(stream, &mut ws.scores, chunk * heads * len * len)?;
        ensure(stream, &mut ws.pooled, texts * h)?;

        stream
            .memcpy_htod(ids, &mut ws.ids.slice_mut(0..t))
            .map_err(device_err("uploading token ids"))?;
        stream
            .memcpy_htod(mask, &mut ws.mask.slice_mut(0..t))
            .map_err(device_err("uploading the attention mask"))?;

        let (t_i, len_i, h_i, heads_i) = (
            int(t, "tokens")?,
            int(len, "length")?,
            int(h, "hidden size")?,
            int(heads, "heads")?,
        );
        let (inter_i, h3_i, dh_i, texts_i) = (
            int(inter, "intermediate size")?,
            int(3 * h, "hidden size")?,
            int(dh, "head size")?,
            int(texts, "texts")?,
        );
        int(t * inter, "activations")?;
        int(t * 3 * h, "activations")?;

        // SAFETY (every launch below): the arguments follow the kernel's signature in
        // kernels.cu in order and type (device pointers to f32 / u32, then `int`s and a
        // `float`); every buffer was grown above to the extent the launch shape covers
        // (`t` tokens of `h`, `3h` or `inter` floats, `chunk` texts of scores, `texts` pooled
        // rows); token ids are below the vocabulary (checked by the caller) and positions below
        // `len <= MAX_TOKENS <= max_position_embeddings` (checked at load).
        unsafe {
            stream
                .launch_builder(&k.embed_layernorm)
                .arg(&ws.ids)
                .arg(&w.word)
                .arg(&w.position)
                .arg(&w.type0)
                .arg(&w.ln_g)
                .arg(&w.ln_b)
                .arg(&mut ws.x)
                .arg(&t_i)
                .arg(&len_i)
                .arg(&h_i)
                .arg(&eps)
                .launch(warp_per_row(t))
        }
        .map_err(device_err("embed_layernorm"))?;

        for layer in &w.layers {
            // SAFETY (every cuBLAS call below): the configurations' extents (see `linear`,
            // `attention_scores`, `attention_context`) stay within the buffers grown above.
            unsafe {
                self.blas
                    .gemm(linear(t_i, h_i, h3_i), &layer.qkv_w, &ws.x, &mut ws.qkv)
            }
            .map_err(device_err("cuBLAS: QKV projection"))?;
            unsafe {
                stream
                    .launch_builder(&k.split_heads)
                    .arg(&ws.qkv)
                    .arg(&layer.qkv_b)
                    .arg(&mut ws.q)
                    .arg(&mut ws.k)
                    .arg(&mut ws.v)
                    .arg(&t_i)
                    .arg(&len_i)
                    .arg(&h_i)
                    .arg(&heads_i)
                    .launch(thread_per_element(t * 3 * h))
            }
            .map_err(device_err("split_heads"))?;

            let mut first = 0;
            while first < texts {
                let n = chunk.min(texts - first);
                let (from, to) = (first * heads * len * dh, (first + n) * heads * len * dh);
                let batch = int(n * heads, "attention batch")?;
                let rows = int(n * heads * len, "attention rows")?;
                let (q, kk, v) = (
                    ws.q.slice(from..to),
                    ws.k.slice(from..to),
                    ws.v.slice(from..to),
                );
                let mask_view = ws.mask.slice(first * len..(first + n) * len);
                unsafe {
                    self.blas.gemm_strided_batched(
                        attention_scores(len_i, dh_i, batch, scale),
                        &kk,
                        &q,
                        &mut ws.scores,
                    )
                }
                .map_err(device_err("cuBLAS: attention scores"))?;
                unsafe {
                    stream
                        .launch_builder(&k.softmax_masked)
                        .arg(&mut ws.scores)
                        .arg(&mask_view)
                        .arg(&rows)
                        .arg(&len_i)
                        .arg(&heads_i)
                        .launch(warp_per_row(n * heads * len))
                }
                .map_err(device_err("softmax_masked"))?;
                let mut context = ws.tmp.slice_mut(from..to);
                unsafe {
                    self.blas.gemm_strided_batched(
                        attention_context(len_i, dh_i, batch),
                        &v,
                        &ws.scores,
                        &mut context,
                    )
                }
                .map_err(device_err("cuBLAS: attention context"))?;
                first += n;
            }

            unsafe {
                stream
                    .launch_builder(&k.merge_heads)
                    .arg(&ws.tmp)
                    .arg(&mut ws.ctx)
                    .arg(&t_i)
                    .arg(&len_i)
                    .arg(&h_i)
                    .arg(&heads_i)
                    .launch(thread_per_element(t * h))
            }
            .map_err(device_err("merge_heads"))?;
            unsafe {
                self.blas.gemm(
                    linear(t_i, h_i, h_i),
                    &layer.attn_out_w,
                    &ws.ctx,
                    &mut ws.tmp,
                )
            }
            .map_err(device_err("cuBLAS: attention output"))?;
            unsafe {
                stream
                    .launch_builder(&k.bias_residual_layernorm)
                    .arg(&ws.tmp)
                    .arg(&layer.attn_out_b)
                    .arg(&mut ws.x)
                    .arg(&layer.attn_ln_g)
                    .arg(&layer.attn_ln_b)
                    .arg(&t_i)
                    .arg(&h_i)
                    .arg(&eps)
                    .launch(warp_per_row(t))
            }
            .map_err(device_err("bias_residual_layernorm (attention)"))?;
            unsafe {
                self.blas
                    .gemm(linear(t_i, h_i, inter_i), &layer.up_w, &ws.x, &mut ws.inter)
            }
            .map_err(device_err("cuBLAS: feed-forward up"))?;
            unsafe {
                stream
                    .launch_builder(&k.bias_gelu)
                    .arg(&mut ws.inter)
                    .arg(&layer.up_b)
                    .arg(&t_i)
                    .arg(&inter_i)
                    .launch(thread_per_element(t * inter))
            }
            .map_err(device_err("bias_gelu"))?;
            unsafe {
                self.blas.gemm(
                    linear(t_i, inter_i, h_i),
                    &layer.down_w,
                    &ws.inter,
                    &mut ws.tmp,
                )
            }
            .map_err(device_err("cuBLAS: feed-forward down"))?;
            unsafe {
                stream
                    .launch_builder(&k.bias_residual_layernorm)
                    .arg(&ws.tmp)
                    .arg(&layer.down_b)
                    .arg(&mut ws.x)
                    .arg(&layer.out_ln_g)
                    .arg(&layer.out_ln_b)
                    .arg(&t_i)
                    .arg(&h_i)
                    .arg(&eps)
                    .launch(warp_per_row(t))
            }
            .map_err(device_err("bias_residual_layernorm (output)"))?;
        }

        unsafe {
            stream
                .launch_builder(&k.mean_pool_normalize)
                .arg(&ws.x)
                .arg(&ws.mask)
                .arg(&mut ws.pooled)
                .arg(&texts_i)
                .arg(&len_i)
                .arg(&h_i)
                .launch(warp_per_row(texts))
        }
        .map_err(device_err("mean_pool_normalize"))?;
        let pooled = stream
            .clone_dtoh(&ws.pooled.slice(0..texts * h))
            .map_err(device_err("copying sentence vectors back"))?;
        let hidden = if with_tokens {
            unsafe {
                stream
                    .launch_builder(&k.l2_normalize_rows)
                    .arg(&mut ws.x)
                    .arg(&t_i)
                    .arg(&h_i)
                    .launch(warp_per_row(t))
            }
            .map_err(device_err("l2_normalize_rows"))?;
            stream
                .clone_dtoh(&ws.x.slice(0..t * h))
                .map_err(device_err("copying token vectors back"))?
        } else {
            Vec::new()
        };
        stream
            .synchronize()
            .map_err(device_err("running the forward pass"))?;
        Ok((pooled, hidden))
    }
}

impl Embed for GpuEmbedder {
    fn device(&self) -> &'static str {
        "cuda"
    }

    fn embed_with_tokens(&self, texts: &[&str]) -> Result<Vec<TextVectors>, EmbedError> {
        self.run(texts, true)
    }
}

/// Split a batch into passes of at most [`MAX_PASS_TOKENS`] padded tokens, in order.
fn passes(sequences: &[&[u32]]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut longest = 0;
    for (i, s) in sequences.iter().enumerate() {
        let len = s.len().max(1);
        if i > start && (i - start + 1) * longest.max(len) > MAX_PASS_TOKENS {
            out.push(start..i);
            start = i;
            longest = 0;
        }
        longest = longest.max(len);
    }
    if start < sequences.len() {
        out.push(start..sequences.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_cover_the_batch_in_order_within_the_token_budget() {
        let long = vec![1u32; 256];
        let short = [1u32; 3];
        let seqs: Vec<&[u32]> = (0..600)
            .map(|i| if i % 7 == 0 { &long[..] } else { &short[..] })
            .collect();
        let p = passes(&seqs);
        assert_eq!(p.first().map(|r| r.start), Some(0));
        assert_eq!(p.last().map(|r| r.end), Some(600));
        for w in p.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        for r in &p {
            let longest = seqs[r.clone()].iter().map(|s| s.len()).max().unwrap_or(0);
            assert!(r.len() * longest <= MAX_PASS_TOKENS, "{r:?}");
        }
        assert_eq!(passes(&[]), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(passes(&[&short[..]]), vec![0..1]);
    }
}
