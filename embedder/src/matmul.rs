//! `y = x·wᵀ (+ b)` on the CPU: a few to a few hundred rows of activations `x` against a matrix
//! `w` stored as PyTorch stores a linear layer's (`[out, in]`, each output's weights
//! contiguous). The attention's products (activations against activations) run here; the
//! layers' weight matrices are packed once into [`panels`] for a faster kernel.
//!
//! General matrix-product libraries (candle's `gemm`, `matrixmultiply`) copy ("pack") both
//! operands into blocks on every call, which pays off for large products. Here a text is a few
//! dozen rows: packing the 1536 × 384 weights for 16 rows cost more than the arithmetic (47% of
//! candle's forward pass in `gemm`'s packing and dispatch against 29% in its multiply kernels,
//! `perf`, 16 tokens). Both operands' rows are already contiguous along the summed dimension, so
//! each output is a dot product of two contiguous rows: this kernel reads four weight rows and
//! two activation rows at a time into eight accumulators (AVX2 + FMA, checked at run time; a
//! portable loop elsewhere) and reads each weight once per block of activation rows, with no
//! copy of either operand.
//!
//! A weight matrix may be `f32` or `f16` ([`Weight`], for [`panels`]): a text of a few dozen
//! tokens is bound by streaming the weights from memory (all-MiniLM-L6's layers are 42 MB as
//! `f32`, more than a 32 MB L3), so half the bytes is most of what a short text's pass costs;
//! each `f16` is widened to `f32` as it is read (F16C) and every sum is in `f32`.

pub mod int8;
pub mod panels;

use std::ops::Range;

use half::f16;
use rayon::prelude::*;

use crate::index::dot;

/// A weight matrix's element type.
pub trait Weight: Copy + Send + Sync + std::fmt::Debug + 'static {
    /// Zero (a panel's padding).
    const ZERO: Self;

    /// As an `f32`.
    fn to_f32(self) -> f32;

    /// Eight weights from `p`, as `f32` lanes.
    ///
    /// # Safety
    /// Eight elements readable at `p`; AVX2 and F16C present (inlined only into code compiled
    /// for them).
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Sixteen weights from `p`, as `f32` lanes.
    ///
    /// # Safety
    /// Sixteen elements readable at `p`; AVX-512 (F) present (inlined only into code compiled
    /// for it).
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Weight for f32 {
    const ZERO: Self = 0.0;

    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    #[allow(unsafe_code)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl Weight for f16 {
    const ZERO: Self = f16::ZERO;

    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::{_mm256_cvtph_ps, _mm_loadu_si128};
        // SAFETY: the caller's contract (16 readable bytes; F16C present).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    #[allow(unsafe_code)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::{_mm256_loadu_si256, _mm512_cvtph_ps};
        // SAFETY: the caller's contract (32 readable bytes; AVX-512 present).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

/// A matrix view: `rows` rows of `cols` elements (`f32` unless a weight matrix says otherwise),
/// row `i` starting at `data[i * stride]`.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a, T = f32> {
    /// The elements, from row 0's first.
    pub data: &'a [T],
    /// How many rows.
    pub rows: usize,
    /// Elements used per row.
    pub cols: usize,
    /// Elements from one row's start to the next's.
    pub stride: usize,
}

impl<'a, T> Rows<'a, T> {
    /// `rows × cols`, stored contiguously.
    pub fn dense(data: &'a [T], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            stride: cols,
        }
    }

    /// Panics unless every row lies within `data` (sizes that overflow included: the unsafe
    /// kernel relies on this).
    fn check(&self) {
        if self.rows > 0 {
            let end = span(self.rows, self.stride, self.cols);
            assert!(end <= self.data.len(), "rows past the end of the data");
        }
    }

    fn row(&self, i: usize) -> &'a [T] {
        &self.data[i * self.stride..i * self.stride + self.cols]
    }
}

/// Elements from the start of row 0 to the end of row `rows - 1` (`rows > 0`), `stride` apart
/// and `cols` long; panics on overflow.
fn span(rows: usize, stride: usize, cols: usize) -> usize {
    let end = (rows - 1)
        .checked_mul(stride)
        .and_then(|n| n.checked_add(cols));
    assert!(end.is_some(), "a matrix view's size overflows");
    end.unwrap_or(usize::MAX)
}

/// A product's two operands and its output's row stride.
#[derive(Debug, Clone, Copy)]
struct Operands<'a> {
    x: Rows<'a>,
    w: Rows<'a>,
    y_stride: usize,
}

/// Below this many multiply-adds a product runs on the calling thread alone.
const PARALLEL_WORK: usize = 1 << 20;

/// Rows of `x` per block: the block (128 KiB of floats) stays in the core's cache while every
/// weight row passes over it.
fn block_rows(depth: usize) -> usize {
    ((32_768 / depth.max(1)) & !1).max(2)
}

/// `y[i·y_stride + j] = Σₖ x[i][k]·w[j][k] + bias[j]` for every row `i` of `x` and `j` of `w`
/// (`bias` absent: 0), split over rayon's current pool when large enough to pay for it.
///
/// Panics if `x` and `w` differ in `cols`, a view's rows run past its data, `bias` is not one
/// float per row of `w`, or `y` is too short.
pub fn product(x: Rows<'_>, w: Rows<'_>, bias: Option<&[f32]>, y: &mut [f32], y_stride: usize) {
    x.check();
    w.check();
    assert_eq!(x.cols, w.cols, "x and w differ in depth");
    assert!(y_stride >= w.rows, "output rows overlap");
    if let Some(b) = bias {
        assert_eq!(b.len(), w.rows, "one bias per output");
    }
    if x.rows == 0 || w.rows == 0 {
        return;
    }
    let y_len = span(x.rows, y_stride, w.rows);
    assert!(y.len() >= y_len, "output too short");
    let y = &mut y[..y_len];
    let threads = rayon::current_num_threads();
    let work = x.rows * w.rows * x.cols.max(1);
    if threads <= 1 || work < PARALLEL_WORK {
        serial(Operands { x, w, y_stride }, y, 0..x.rows, 0..w.rows);
    } else if x.rows >= 8 * threads {
        // Many rows: each thread takes whole output rows (and reads every weight).
        let per = x.rows.div_ceil(threads);
        y.par_chunks_mut(per * y_stride)
            .enumerate()
            .for_each(|(i, part)| {
                let rows = i * per..((i + 1) * per).min(x.rows);
                let first = rows.start;
                let sub = Rows {
                    data: &x.data[first * x.stride..],
                    rows: rows.len(),
                    ..x
                };
                let p = Operands {
                    x: sub,
                    w,
                    y_stride,
                };
                serial(p, part, 0..rows.len(), 0..w.rows);
            });
    } else {
        // Few rows: each thread takes a share of the outputs (and reads only their weights)
        // into a buffer of its own, copied into place after.
        let per = w.rows.div_ceil(threads).next_multiple_of(4);
        let parts: Vec<(Range<usize>, Vec<f32>)> = (0..w.rows.div_ceil(per))
            .into_par_iter()
            .map(|i| {
                let outs = i * per..((i + 1) * per).min(w.rows);
                let mut part = vec![0.0; x.rows * outs.len()];
                let sub = Rows {
                    data: &w.data[outs.start * w.stride..],
                    rows: outs.len(),
                    ..w
                };
                let p = Operands {
                    x,
                    w: sub,
                    y_stride: outs.len(),
                };
                serial(p, &mut part, 0..x.rows, 0..outs.len());
                (outs, part)
            })
            .collect();
        for (outs, part) in parts {
            for (i, row) in part.chunks_exact(outs.len()).enumerate() {
                y[i * y_stride + outs.start..i * y_stride + outs.end].copy_from_slice(row);
            }
        }
    }
    if let Some(b) = bias {
        for i in 0..x.rows {
            for (v, b) in y[i * y_stride..i * y_stride + w.rows].iter_mut().zip(b) {
                *v += b;
            }
        }
    }
}

/// Whether this CPU has AVX2 and FMA (checked once): the paths written for them run.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_available() -> bool {
    avx2::available()
}

/// The product for `rows` of `x` and `outs` of `w` on this thread, in blocks of rows.
fn serial(p: Operands<'_>, y: &mut [f32], rows: Range<usize>, outs: Range<usize>) {
    let step = block_rows(p.x.cols);
    let mut start = rows.start;
    while start < rows.end {
        let block = start..(start + step).min(rows.end);
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            avx2::product(p, y, block, outs.clone());
            start += step;
            continue;
        }
        portable(p, y, block, outs.clone());
        start += step;
    }
}

/// The product without SIMD intrinsics (the compiler vectorises the 8-wide lanes as the target
/// allows): every machine's path where AVX2 and FMA are missing, and the reference the tests
/// hold the AVX2 path to.
fn portable(p: Operands<'_>, y: &mut [f32], rows: Range<usize>, outs: Range<usize>) {
    for j in outs {
        let wr = p.w.row(j);
        for i in rows.clone() {
            y[i * p.y_stride + j] = dot(p.x.row(i), wr);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2 {
    //! The product with AVX2 and FMA: four weight rows by two activation rows per step.

    use std::arch::x86_64::{
        __m128, __m256, _mm256_castps256_ps128, _mm256_extractf128_ps, _mm256_fmadd_ps,
        _mm256_hadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm_add_ps, _mm_storeu_ps,
    };
    use std::ops::Range;
    use std::sync::OnceLock;

    use super::Operands;

    /// Whether this CPU has AVX2 and FMA (checked once).
    pub(super) fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }

    /// Whether it also has F16C, which `f16` weights need ([`super::panels`]; every CPU with
    /// AVX2 has it; a virtual machine may hide it).
    pub(super) fn f16c() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| std::arch::is_x86_feature_detected!("f16c"))
    }

    /// As [`super::portable`]; only call where [`available`] said so.
    pub(super) fn product(p: Operands<'_>, y: &mut [f32], rows: Range<usize>, outs: Range<usize>) {
        let Operands { x, w, y_stride } = p;
        assert!(available());
        // Every index below is within these bounds, the views' and the output's checked here.
        x.check();
        w.check();
        assert_eq!(x.cols, w.cols);
        assert!(rows.end <= x.rows && outs.end <= w.rows && outs.end <= y_stride);
        if !rows.is_empty() {
            assert!(super::span(rows.end, y_stride, outs.end) <= y.len());
        }
        // SAFETY: AVX2 and FMA are present (asserted above), and `kernel` reads only rows
        // `rows` of `x` and `outs` of `w`, `cols` floats each from its start (within the
        // data by `Rows::check`, overflow included), and writes only `y[i · y_stride + j]` for
        // those `i` and `j` (within `y` by the assertion above).
        unsafe { kernel(p, y, rows, outs) }
    }

    /// The four sums of `a`, `b`, `c` and `d`'s lanes.
    ///
    /// # Safety
    /// Only where AVX2 is available.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
        let ab = _mm256_hadd_ps(a, b);
        let cd = _mm256_hadd_ps(c, d);
        let abcd = _mm256_hadd_ps(ab, cd);
        _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1))
    }

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::similar_names, reason = "aRC: accumulator of row R, column C")]
    unsafe fn kernel(p: Operands<'_>, y: &mut [f32], rows: Range<usize>, outs: Range<usize>) {
        let Operands { x, w, y_stride } = p;
        let depth = x.cols;
        let vec_depth = depth - depth % 8;
        let (xp, wp, yp) = (x.data.as_ptr(), w.data.as_ptr(), y.as_mut_ptr());
        let tail = |i: usize, j: usize| -> f32 {
            let (xr, wr) = (x.row(i), w.row(j));
            (vec_depth..depth).map(|k| xr[k] * wr[k]).sum()
        };
        let mut j = outs.start;
        while j + 4 <= outs.end {
            // SAFETY (for the whole block): see `product`.
            unsafe {
                let w0 = wp.add(j * w.stride);
                let (w1, w2, w3) = (w0.add(w.stride), w0.add(2 * w.stride), w0.add(3 * w.stride));
                let mut i = rows.start;
                while i + 2 <= rows.end {
                    let x0 = xp.add(i * x.stride);
                    let x1 = x0.add(x.stride);
                    let (mut a00, mut a01, mut a02, mut a03) = (
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                    );
                    let (mut a10, mut a11, mut a12, mut a13) = (a00, a01, a02, a03);
                    let mut k = 0;
                    while k < vec_depth {
                        let (u, v) = (_mm256_loadu_ps(x0.add(k)), _mm256_loadu_ps(x1.add(k)));
                        let c = _mm256_loadu_ps(w0.add(k));
                        a00 = _mm256_fmadd_ps(u, c, a00);
                        a10 = _mm256_fmadd_ps(v, c, a10);
                        let c = _mm256_loadu_ps(w1.add(k));
                        a01 = _mm256_fmadd_ps(u, c, a01);
                        a11 = _mm256_fmadd_ps(v, c, a11);
                        let c = _mm256_loadu_ps(w2.add(k));
                        a02 = _mm256_fmadd_ps(u, c, a02);
                        a12 = _mm256_fmadd_ps(v, c, a12);
                        let c = _mm256_loadu_ps(w3.add(k));
                        a03 = _mm256_fmadd_ps(u, c, a03);
                        a13 = _mm256_fmadd_ps(v, c, a13);
                        k += 8;
                    }
                    _mm_storeu_ps(yp.add(i * y_stride + j), sum4(a00, a01, a02, a03));
                    _mm_storeu_ps(yp.add((i + 1) * y_stride + j), sum4(a10, a11, a12, a13));
                    if vec_depth < depth {
                        for c in 0..4 {
                            *yp.add(i * y_stride + j + c) += tail(i, j + c);
                            *yp.add((i + 1) * y_stride + j + c) += tail(i + 1, j + c);
                        }
                    }
                    i += 2;
                }
                if i < rows.end {
                    let x0 = xp.add(i * x.stride);
                    let (mut a0, mut a1, mut a2, mut a3) = (
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                    );
                    let mut k = 0;
                    while k < vec_depth {
                        let u = _mm256_loadu_ps(x0.add(k));
                        a0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w0.add(k)), a0);
                        a1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w1.add(k)), a1);
                        a2 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w2.add(k)), a2);
                        a3 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w3.add(k)), a3);
                        k += 8;
                    }
                    _mm_storeu_ps(yp.add(i * y_stride + j), sum4(a0, a1, a2, a3));
                    if vec_depth < depth {
                        for c in 0..4 {
                            *yp.add(i * y_stride + j + c) += tail(i, j + c);
                        }
                    }
                }
            }
            j += 4;
        }
        // The last outputs (fewer than four).
        for j in j..outs.end {
            for i in rows.clone() {
                y[i * y_stride + j] = super::dot(x.row(i), w.row(j));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    /// Deterministic floats in [-1, 1).
    pub(super) fn floats(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// `run(x, w, outs, y, alone)` for products split by rows and by panels (`w`: `outs` rows
    /// of `x.cols` weights, dense; `y`: `outs` floats a row): with `alone` it computes the
    /// product on the calling thread (and may check it), otherwise as on the pool it is
    /// called in; on pools of two to four threads the outputs are exactly the calling
    /// thread's.
    pub(super) fn every_split(run: impl Fn(Rows<'_>, &[f32], usize, &mut [f32], bool) + Sync) {
        for (rows, outs, depth) in [(5usize, 408usize, 600usize), (7, 1160, 384), (64, 72, 400)] {
            let xd = floats(rows * depth, 4);
            let wd = floats(outs * depth, 5);
            let x = Rows::dense(&xd, rows, depth);
            let mut alone = vec![f32::NAN; rows * outs];
            run(x, &wd, outs, &mut alone, true);
            for threads in [2, 3, 4] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut y = vec![f32::NAN; rows * outs];
                pool.install(|| run(x, &wd, outs, &mut y, false));
                assert_eq!(y, alone, "{rows}×{outs}×{depth} on {threads} threads");
            }
        }
    }

    /// The product in f64, one output at a time.
    pub(super) fn reference<W: Weight>(
        x: Rows<'_>,
        w: Rows<'_, W>,
        bias: Option<&[f32]>,
    ) -> Vec<f64> {
        let mut out = Vec::new();
        for i in 0..x.rows {
            for j in 0..w.rows {
                let s: f64 = (0..x.cols)
                    .map(|k| f64::from(x.row(i)[k]) * f64::from(w.row(j)[k].to_f32()))
                    .sum();
                out.push(s + bias.map_or(0.0, |b| f64::from(b[j])));
            }
        }
        out
    }

    /// `product` and the portable path against the f64 product.
    #[test]
    fn every_shape_matches_the_product_in_f64_with_strides_tails_and_bias() {
        // Odd rows and outputs (the one-row and fewer-than-four paths), depths that are not a
        // multiple of 8 (the tails), strided views (the attention's heads), and products large
        // enough to be split by rows and by outputs over threads.
        for (rows, outs, depth, stride_pad) in [
            (1, 1, 1, 0),
            (2, 4, 8, 0),
            (3, 7, 13, 3),
            (5, 9, 32, 64),
            (16, 1152, 384, 0),
            (17, 384, 1536, 0),
            (300, 384, 384, 5),
            (64, 64, 250, 0),
        ] {
            let (xs, ws) = (depth + stride_pad, depth + stride_pad);
            let xd = floats(rows * xs, 1);
            let wd = floats(outs * ws, 2);
            let bias = floats(outs, 3);
            let x = Rows {
                data: &xd,
                rows,
                cols: depth,
                stride: xs,
            };
            let w = Rows {
                data: &wd,
                rows: outs,
                cols: depth,
                stride: ws,
            };
            let want = reference(x, w, Some(&bias));
            let y_stride = outs + 2;
            let mut y = vec![f32::NAN; (rows - 1) * y_stride + outs];
            product(x, w, Some(&bias), &mut y, y_stride);
            let mut portable_y = vec![0.0; rows * outs];
            let p = Operands {
                x,
                w,
                y_stride: outs,
            };
            super::portable(p, &mut portable_y, 0..rows, 0..outs);
            let tolerance = 1e-5 * depth as f64;
            for i in 0..rows {
                for j in 0..outs {
                    let (got, want) = (f64::from(y[i * y_stride + j]), want[i * outs + j]);
                    assert!(
                        (got - want).abs() <= tolerance,
                        "{rows}×{outs}×{depth} at {i},{j}: {got} vs {want}"
                    );
                    let p = f64::from(portable_y[i * outs + j]) + f64::from(bias[j]);
                    assert!((p - want).abs() <= tolerance, "portable at {i},{j}");
                }
                // The gap between output rows is left as it was.
                for j in outs..y_stride {
                    if i + 1 < rows {
                        assert!(y[i * y_stride + j].is_nan(), "wrote past an output row");
                    }
                }
            }
        }
    }

    #[test]
    fn an_empty_product_writes_nothing_and_a_short_output_is_refused() {
        let x = Rows::dense(&[], 0, 4);
        let w = Rows::dense(&[1.0; 8], 2, 4);
        let mut y = vec![];
        product(x, w, None, &mut y, 2);
        let x = Rows::dense(&[1.0; 4], 1, 4);
        let short = std::panic::catch_unwind(|| {
            let mut y = vec![0.0; 1];
            product(x, w, None, &mut y, 2);
        });
        assert!(short.is_err());
        let past = std::panic::catch_unwind(|| {
            let x = Rows::dense(&[1.0; 3], 1, 4);
            let mut y = vec![0.0; 2];
            product(x, w, None, &mut y, 2);
        });
        assert!(past.is_err());
        // Sizes that wrap around are refused, not trusted.
        let huge = std::panic::catch_unwind(|| {
            let x = Rows {
                data: &[0.0; 4],
                rows: 3,
                cols: 4,
                stride: 1 << (usize::BITS - 1),
            };
            let mut y = vec![0.0; 8];
            product(x, w, None, &mut y, 2);
        });
        assert!(huge.is_err());
        let wide = std::panic::catch_unwind(|| {
            let x = Rows::dense(&[1.0; 8], 2, 4);
            let mut y = vec![0.0; 4];
            product(x, w, None, &mut y, 1 << (usize::BITS - 1));
        });
        assert!(wide.is_err());
    }
}
