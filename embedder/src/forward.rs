//! The transformer's forward pass on the CPU: BERT (as all-MiniLM-L6-v2's `config.json` says),
//! the same steps as the GPU's (`cuda::bert`), over unpadded texts.
//!
//! The texts of a pass are laid end to end, one row of `h` floats per token, so the layers'
//! products run over every token of every text at once ([`matmul::product`]); attention runs
//! per text and head over that text's own tokens only, which is what a padded batch's mask
//! computes for its real tokens (a padding key weighs exactly 0 after the softmax). Then the
//! mean over each text's tokens, L2-normalised (the sentence vector), and its token rows but
//! `[CLS]` and `[SEP]`, each L2-normalised.
//!
//! A pass can pause before any layer and go on later from there ([`CpuBert::forward_until`],
//! [`CpuBert::resume`]): the semantic cache's worker pauses an answer being indexed when a
//! lookup, which a request waits for, should go first.

use half::f16;
use rayon::prelude::*;

use crate::bert::TextVectors;
use crate::index::normalise;
use crate::matmul::int8::{self, Int8Panels};
use crate::matmul::panels::{self, Panels};
use crate::matmul::{self, Rows, Weight};
use crate::model::{ModelConfig, Weights};

/// Tokens per pass at most (a text longer than this is a pass of its own): bounds the pass's
/// buffers (~14 KiB per token for this model).
const PASS_TOKENS: usize = 4096;

/// Below this many attention multiply-adds a pass's heads run on the calling thread alone.
const PARALLEL_ATTENTION: usize = 1 << 18;

/// Where a pass stands: its texts' vectors, or paused between two layers.
#[derive(Debug)]
pub enum Progress {
    /// Every text's vectors, in order.
    Done(Vec<TextVectors>),
    /// Stopped before a layer: [`CpuBert::resume`] goes on from there.
    Paused(Box<Paused>),
}

impl Progress {
    /// The vectors, when the pass is done.
    pub fn done(self) -> Option<Vec<TextVectors>> {
        match self {
            Self::Done(vectors) => Some(vectors),
            Self::Paused(_) => None,
        }
    }
}

/// A pass stopped between two layers: the texts already done, the hidden states of those under
/// way and the next layer to run, and the texts after them.
#[derive(Debug)]
pub struct Paused {
    done: Vec<TextVectors>,
    pass: Pass,
    rest: Vec<Vec<u32>>,
    with_tokens: bool,
}

/// A pass under way: each text's first row among its token rows and its length, the hidden
/// states, and the next layer to run.
#[derive(Debug)]
struct Pass {
    spans: Vec<(usize, usize)>,
    x: Vec<f32>,
    layer: usize,
}

/// How the pass keeps the model's matrices (the layers' four and the word embeddings; the
/// biases and layer norms stay `f32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Half the bytes: a short text's pass is bound by reading the weights from memory, so
    /// this is most of what it costs. The vectors stay within a cosine of 1 − 1e-6 of an f32
    /// pass's (`tests/forward_reference.rs` holds both to candle's f32 BERT); the verifier's
    /// decisions on 5,000 dev pairs changed for one pair at each precision target. A
    /// checkpoint with a weight beyond f16's range is kept as `F32`.
    #[default]
    F16,
    /// The checkpoint's own floats.
    F32,
    /// The layers' matrices quantised to 8-bit integers ([`matmul::int8`]); the word
    /// embeddings `f16`. About twice as fast as `F16` for a short text where the CPU has
    /// AVX-512 VNNI ([`Precision::fastest`]; with AMX 10–15% faster again from 32 tokens on),
    /// ~15% faster with AVX2 alone, ten times slower without either (the same vectors on every
    /// CPU); a question's vector within a cosine of ~6e-4 of an f32 pass's (2.7e-3 for a text
    /// of three tokens); the verifier's decisions changed for
    /// 0.4–0.7% of dev pairs at the precision targets 0.8 and 0.9, the precision within
    /// 0.25 points (docs/cache.md).
    Int8,
}

impl Precision {
    /// Its name: `"f16"`, `"f32"` or `"int8"` (what [`str::parse`] reads).
    pub fn name(self) -> &'static str {
        match self {
            Self::F16 => "f16",
            Self::F32 => "f32",
            Self::Int8 => "int8",
        }
    }

    /// The fastest precision on this CPU: [`Precision::Int8`] where it has AVX-512 VNNI (or
    /// AMX), else [`Precision::F16`].
    pub fn fastest() -> Self {
        if int8::accelerated() {
            Self::Int8
        } else {
            Self::F16
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    /// `f16`, `f32` or `int8`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f16" => Ok(Self::F16),
            "f32" => Ok(Self::F32),
            "int8" => Ok(Self::Int8),
            other => Err(format!("unknown precision {other:?} (f16, f32 or int8)")),
        }
    }
}

/// A matrix as read (`[rows, width]`): the word embeddings, and each layer's matrices until
/// [`Matrix::packed`].
#[derive(Debug)]
pub enum Matrix {
    /// See [`Precision::F16`].
    F16(Vec<f16>),
    /// See [`Precision::F32`].
    F32(Vec<f32>),
}

impl From<Vec<f16>> for Matrix {
    fn from(v: Vec<f16>) -> Self {
        Self::F16(v)
    }
}

impl From<Vec<f32>> for Matrix {
    fn from(v: Vec<f32>) -> Self {
        Self::F32(v)
    }
}

impl Matrix {
    /// This matrix, `outs` rows, packed into panels for [`Packed::product`] (quantised to
    /// `i8` with `int8`).
    fn packed(self, outs: usize, int8: bool) -> Packed {
        match (self, int8) {
            (Self::F16(w), false) => Packed::F16(Panels::pack(&w, outs, w.len() / outs)),
            (Self::F32(w), false) => Packed::F32(Panels::pack(&w, outs, w.len() / outs)),
            (Self::F16(w), true) => Packed::Int8(Int8Panels::quantise(&w, outs, w.len() / outs)),
            (Self::F32(w), true) => Packed::Int8(Int8Panels::quantise(&w, outs, w.len() / outs)),
        }
    }

    /// Row `i` of this matrix as `[_, width]`, added into `out` (zeros: the row itself).
    fn add_row(&self, i: usize, out: &mut [f32]) {
        fn run<W: Weight>(w: &[W], i: usize, out: &mut [f32]) {
            let width = out.len();
            for (o, v) in out.iter_mut().zip(&w[i * width..(i + 1) * width]) {
                *o += v.to_f32();
            }
        }
        match self {
            Self::F16(w) => run(w, i, out),
            Self::F32(w) => run(w, i, out),
        }
    }
}

/// A layer's weight matrix as the pass keeps it: packed into [`Panels`] for its products.
#[derive(Debug)]
pub enum Packed {
    /// See [`Precision::F16`].
    F16(Panels<f16>),
    /// See [`Precision::F32`].
    F32(Panels<f32>),
    /// See [`Precision::Int8`].
    Int8(Int8Panels),
}

impl Packed {
    /// `y = x·selfᵀ + bias` (see [`panels::product`]), output rows `bias.len()` apart.
    fn product(&self, x: Rows<'_>, bias: &[f32], y: &mut [f32]) {
        match self {
            Self::F16(w) => panels::product(x, w, Some(bias), y, bias.len()),
            Self::F32(w) => panels::product(x, w, Some(bias), y, bias.len()),
            Self::Int8(w) => int8::product(x, w, Some(bias), y, bias.len()),
        }
    }
}

/// The model's weights on the host and what the pass needs to know of its shape.
#[derive(Debug)]
pub struct CpuBert {
    config: ModelConfig,
    weights: Weights<Vec<f32>, Packed, Matrix>,
}

impl CpuBert {
    /// The forward pass for a model described by `config` with `weights` (its matrices `f16`
    /// or `f32`, as read: [`Weights::read`]); the layers' matrices are packed into panels here,
    /// one at a time, and with `int8` quantised to `i8` ([`Precision::Int8`]).
    pub fn new<M: Into<Matrix>>(
        config: ModelConfig,
        weights: Weights<Vec<f32>, M>,
        int8: bool,
    ) -> Self {
        // Each matrix has one bias per output row.
        let weights = weights
            .map_matrices(Into::into)
            .map_layers(|m, bias| m.packed(bias.len(), int8));
        Self { config, weights }
    }

    /// How the layers' matrices are kept (`F32` for a model without layers).
    pub fn precision(&self) -> Precision {
        match self.weights.layers.first().map(|l| &l.qkv_w) {
            Some(Packed::F16(_)) => Precision::F16,
            Some(Packed::Int8(_)) => Precision::Int8,
            Some(Packed::F32(_)) | None => Precision::F32,
        }
    }

    /// Rows of the word embeddings.
    pub fn vocab(&self) -> usize {
        self.config.vocab_size
    }

    /// For each sequence of token ids (with `[CLS]` and `[SEP]`, at most the position
    /// embeddings' count, ids within the vocabulary): its sentence vector and, with
    /// `with_tokens`, its token vectors (see the module's doc).
    ///
    /// Panics on an id past the vocabulary or a sequence longer than the position embeddings.
    pub fn forward(&self, sequences: &[&[u32]], with_tokens: bool) -> Vec<TextVectors> {
        match self.forward_until(sequences, with_tokens, &|| false) {
            Progress::Done(vectors) => vectors,
            // Never asked to stop: the pass cannot have paused.
            Progress::Paused(paused) => self.resume(*paused, &|| false).done().unwrap_or_default(),
        }
    }

    /// [`CpuBert::forward`], paused as soon as `stop` says so: it is asked before each layer,
    /// so a pass another one should go before gives way within one layer's work, and
    /// [`CpuBert::resume`] later finishes it from where it stopped.
    pub fn forward_until(
        &self,
        sequences: &[&[u32]],
        with_tokens: bool,
        stop: &dyn Fn() -> bool,
    ) -> Progress {
        self.advance(Vec::new(), None, sequences, with_tokens, stop)
    }

    /// Go on with a pass [`CpuBert::forward_until`] paused (it may pause again).
    pub fn resume(&self, paused: Paused, stop: &dyn Fn() -> bool) -> Progress {
        let rest: Vec<&[u32]> = paused.rest.iter().map(Vec::as_slice).collect();
        self.advance(
            paused.done,
            Some(paused.pass),
            &rest,
            paused.with_tokens,
            stop,
        )
    }

    /// Finish `current`, then embed `rest` a pass at a time, each at most [`PASS_TOKENS`] tokens
    /// (or one text), after the texts `done`.
    fn advance(
        &self,
        mut done: Vec<TextVectors>,
        mut current: Option<Pass>,
        rest: &[&[u32]],
        with_tokens: bool,
        stop: &dyn Fn() -> bool,
    ) -> Progress {
        let mut start = 0;
        loop {
            let mut pass = match current.take() {
                Some(pass) => pass,
                None if start == rest.len() => return Progress::Done(done),
                None => {
                    let mut end = start;
                    let mut tokens = 0;
                    while end < rest.len()
                        && (end == start || tokens + rest[end].len() <= PASS_TOKENS)
                    {
                        tokens += rest[end].len();
                        end += 1;
                    }
                    let pass = self.embeddings(&rest[start..end]);
                    start = end;
                    pass
                }
            };
            if self.layers(&mut pass, stop) {
                done.extend(self.pooled(&pass, with_tokens));
            } else {
                return Progress::Paused(Box::new(Paused {
                    done,
                    pass,
                    rest: rest[start..].iter().map(|s| s.to_vec()).collect(),
                    with_tokens,
                }));
            }
        }
    }

    /// A pass over `sequences` before its first layer: word + position + token type 0, layer
    /// norm.
    fn embeddings(&self, sequences: &[&[u32]]) -> Pass {
        let c = &self.config;
        let h = c.hidden_size;
        let eps = c.layer_norm_eps;
        let mut spans = Vec::with_capacity(sequences.len());
        let mut t = 0;
        for s in sequences {
            assert!(s.len() <= c.max_position_embeddings, "sequence too long");
            spans.push((t, s.len()));
            t += s.len();
        }
        let w = &self.weights;
        let mut x = vec![0.0f32; t * h];
        for (s, &(first, _)) in sequences.iter().zip(&spans) {
            for (p, &id) in s.iter().enumerate() {
                let id = id as usize;
                assert!(id < c.vocab_size, "token id past the vocabulary");
                let row = &mut x[(first + p) * h..(first + p + 1) * h];
                let position = &w.position[p * h..(p + 1) * h];
                w.word.add_row(id, row);
                for (k, v) in row.iter_mut().enumerate() {
                    *v = *v + position[k] + w.type0[k];
                }
                layer_norm(row, &w.ln_g, &w.ln_b, eps);
            }
        }
        Pass { spans, x, layer: 0 }
    }

    /// Run the pass's layers from its next one: `true` once every layer ran, `false` when
    /// `stop` said so before one (the pass then says which).
    fn layers(&self, pass: &mut Pass, stop: &dyn Fn() -> bool) -> bool {
        let Pass { spans, x, layer } = pass;
        let from = *layer;
        let c = &self.config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let eps = c.layer_norm_eps;
        let t = x.len() / h;
        let w = &self.weights;
        if *layer < w.layers.len() && stop() {
            return false;
        }
        let mut qkv = vec![0.0f32; t * 3 * h];
        let mut ctx = vec![0.0f32; t * h];
        let mut mid = vec![0.0f32; t * inter];
        let mut out = vec![0.0f32; t * h];
        while let Some(l) = w.layers.get(*layer) {
            // Asked before the buffers above for the pass's next layer, then before each.
            if *layer > from && stop() {
                return false;
            }
            l.qkv_w.product(Rows::dense(x, t, h), &l.qkv_b, &mut qkv);
            self.attention(&qkv, spans, &mut ctx);
            l.attn_out_w
                .product(Rows::dense(&ctx, t, h), &l.attn_out_b, &mut out);
            residual_layer_norm(x, &out, h, &l.attn_ln_g, &l.attn_ln_b, eps);
            l.up_w.product(Rows::dense(x, t, h), &l.up_b, &mut mid);
            gelu(&mut mid);
            l.down_w
                .product(Rows::dense(&mid, t, inter), &l.down_b, &mut out);
            residual_layer_norm(x, &out, h, &l.out_ln_g, &l.out_ln_b, eps);
            *layer += 1;
        }
        true
    }

    /// Each text's sentence vector (and token vectors) from a finished pass's hidden states.
    fn pooled(&self, pass: &Pass, with_tokens: bool) -> Vec<TextVectors> {
        let h = self.config.hidden_size;
        let x = &pass.x;
        pass.spans
            .iter()
            .map(|&(first, len)| {
                let rows = &x[first * h..(first + len) * h];
                let mut sentence = vec![0.0f64; h];
                for row in rows.chunks_exact(h) {
                    for (s, v) in sentence.iter_mut().zip(row) {
                        *s += f64::from(*v);
                    }
                }
                let n = len.max(1) as f64;
                #[allow(clippy::cast_possible_truncation, reason = "back to the model's f32")]
                let mut sentence: Vec<f32> = sentence.iter().map(|s| (s / n) as f32).collect();
                normalise(&mut sentence);
                let tokens = if with_tokens && len > 2 {
                    rows.chunks_exact(h)
                        .skip(1)
                        .take(len - 2)
                        .map(|r| {
                            let mut r = r.to_vec();
                            normalise(&mut r);
                            r
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                (sentence, tokens)
            })
            .collect()
    }

    /// Self-attention of every text (`spans`: its first row and length) and head: `ctx`
    /// (`[t, h]`, heads side by side) from the queries, keys and values in `qkv` (`[t, 3h]`).
    fn attention(&self, qkv: &[f32], spans: &[(usize, usize)], ctx: &mut [f32]) {
        let c = &self.config;
        let (h, heads) = (c.hidden_size, c.num_attention_heads);
        let dh = h / heads;
        #[allow(clippy::cast_precision_loss, reason = "a head's width")]
        let scale = 1.0 / (dh as f32).sqrt();
        let jobs: Vec<(usize, usize, usize)> = spans
            .iter()
            .filter(|&&(_, len)| len > 0)
            .flat_map(|&(first, len)| (0..heads).map(move |head| (first, len, head)))
            .collect();
        let head = |&(first, len, head): &(usize, usize, usize)| -> Vec<f32> {
            let base = first * 3 * h + head * dh;
            let view = |offset: usize| Rows {
                data: &qkv[base + offset..],
                rows: len,
                cols: dh,
                stride: 3 * h,
            };
            // Scores q·kᵀ/√dh, each query's row softmaxed.
            let mut scores = vec![0.0f32; len * len];
            matmul::product(view(0), view(h), None, &mut scores, len);
            for row in scores.chunks_exact_mut(len) {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for v in row.iter_mut() {
                    *v = ((*v - max) * scale).exp();
                    sum += *v;
                }
                for v in row.iter_mut() {
                    *v /= sum;
                }
            }
            // Values transposed (`[dh, len]`), so the context is scores · (vᵀ)ᵀ.
            let mut vt = vec![0.0f32; dh * len];
            for j in 0..len {
                let v = &qkv[base + 2 * h + j * 3 * h..base + 2 * h + j * 3 * h + dh];
                for (d, value) in v.iter().enumerate() {
                    vt[d * len + j] = *value;
                }
            }
            let mut part = vec![0.0f32; len * dh];
            matmul::product(
                Rows::dense(&scores, len, len),
                Rows::dense(&vt, dh, len),
                None,
                &mut part,
                dh,
            );
            part
        };
        let work: usize = spans.iter().map(|&(_, len)| len * len).sum::<usize>() * h * 2;
        let parts: Vec<Vec<f32>> = if work >= PARALLEL_ATTENTION {
            jobs.par_iter().map(head).collect()
        } else {
            jobs.iter().map(head).collect()
        };
        for (&(first, len, head), part) in jobs.iter().zip(parts) {
            for (j, row) in part.chunks_exact(dh).enumerate() {
                let at = (first + j) * h + head * dh;
                ctx[at..at + dh].copy_from_slice(row);
            }
            debug_assert_eq!(part.len(), len * dh);
        }
    }
}

/// `row = (row - mean) / √(var + eps) · g + b`, the statistics summed in f64.
#[allow(clippy::cast_possible_truncation, reason = "back to the model's f32")]
fn layer_norm(row: &mut [f32], g: &[f32], b: &[f32], eps: f64) {
    #[allow(clippy::cast_precision_loss, reason = "a row's width")]
    let n = row.len() as f64;
    let mean = row.iter().map(|v| f64::from(*v)).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|v| (f64::from(*v) - mean).powi(2))
        .sum::<f64>()
        / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, g), b) in row.iter_mut().zip(g).zip(b) {
        *v = ((f64::from(*v) - mean) * inv) as f32 * g + b;
    }
}

/// `x = layer_norm(x + add)`, row by row.
fn residual_layer_norm(x: &mut [f32], add: &[f32], h: usize, g: &[f32], b: &[f32], eps: f64) {
    for (row, add) in x.chunks_exact_mut(h).zip(add.chunks_exact(h)) {
        for (v, a) in row.iter_mut().zip(add) {
            *v += a;
        }
        layer_norm(row, g, b, eps);
    }
}

/// GELU in its exact form, `x/2 · (1 + erf(x/√2))`, in place; with AVX2 and FMA where the CPU
/// has them (the same arithmetic, eight lanes at a time).
fn gelu(v: &mut [f32]) {
    let run = |c: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if crate::matmul::avx2_available() {
            gelu_avx2::run(c);
            return;
        }
        gelu_lanes(c);
    };
    if v.len() >= 1 << 16 {
        v.par_chunks_mut(1 << 14).for_each(run);
    } else {
        run(v);
    }
}

/// GELU over `v` in a form the compiler vectorises: no call, no branch per element.
#[inline(always)]
fn gelu_lanes(v: &mut [f32]) {
    for x in v {
        *x = 0.5 * *x * (1.0 + erf(*x * std::f32::consts::FRAC_1_SQRT_2));
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod gelu_avx2 {
    /// [`super::gelu_lanes`] compiled for AVX2 and FMA; only call where the CPU has them.
    pub(super) fn run(v: &mut [f32]) {
        assert!(crate::matmul::avx2_available());
        // SAFETY: AVX2 and FMA are present (asserted above); `lanes` is safe code.
        unsafe { lanes(v) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn lanes(v: &mut [f32]) {
        super::gelu_lanes(v);
    }
}

/// erf(x) for `f32`, as the rational function `x·P(x²)/Q(x²)` on `[-4, 4]` (erf is ±1 to `f32`
/// precision beyond) that Eigen and XLA use for `f32`: within a few units in the last place of
/// `erff`, without its branches, so a loop of it vectorises. Products and sums kept apart (no
/// fused multiply-add), so every path computes the same floats.
#[inline(always)]
fn erf(x: f32) -> f32 {
    const P: [f32; 7] = [
        -2.726_142_4e-10,
        2.770_681_5e-8,
        -2.101_024e-6,
        -5.692_506_2e-5,
        -7.349_906_4e-4,
        -2.954_6e-3,
        -1.609_603_3e-2,
    ];
    const Q: [f32; 5] = [
        -1.456_607_15e-5,
        -2.133_740_5e-4,
        -1.682_827e-3,
        -7.373_329_3e-3,
        -1.426_473_9e-2,
    ];
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = P[0];
    for c in &P[1..] {
        p = p * x2 + c;
    }
    let mut q = Q[0];
    for c in &Q[1..] {
        q = q * x2 + c;
    }
    x * p / q
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_parse_by_name_and_the_fastest_follows_the_cpu() {
        for (name, precision) in [
            ("f16", Precision::F16),
            ("f32", Precision::F32),
            ("int8", Precision::Int8),
        ] {
            assert_eq!(name.parse::<Precision>(), Ok(precision));
            assert_eq!(precision.name(), name);
        }
        let refused = "fp8".parse::<Precision>();
        assert!(refused.is_err_and(|e| e.contains("f16, f32 or int8")));
        let fastest = Precision::fastest();
        assert_eq!(fastest == Precision::Int8, int8::accelerated());
        assert!(matches!(fastest, Precision::Int8 | Precision::F16));
    }

    #[test]
    fn erf_matches_libm_to_a_few_units_in_the_last_place() {
        let mut worst = 0.0f64;
        for i in -1_000_000..=1_000_000 {
            let x = i as f32 * 6e-6;
            let (got, want) = (erf(x), libm::erff(x));
            worst = worst.max(f64::from((got - want).abs()));
        }
        assert!(worst <= 5e-7, "largest difference {worst}");
        assert_eq!(erf(9.0), libm::erff(9.0));
        assert_eq!(erf(-9.0), -1.0);
        assert_eq!(erf(0.0), 0.0);
    }

    #[test]
    fn gelu_is_the_same_on_every_path() {
        let xs: Vec<f32> = (0..5000).map(|i| (i as f32 - 2500.0) * 3.1e-3).collect();
        let mut a = xs.clone();
        gelu(&mut a);
        let mut b = xs.clone();
        gelu_lanes(&mut b);
        assert_eq!(a, b);
        for (x, y) in xs.iter().zip(&a) {
            let exact = 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
            assert!(
                (y - exact).abs() <= 1e-6 * x.abs().max(1.0),
                "{x}: {y} vs {exact}"
            );
        }
    }
}
