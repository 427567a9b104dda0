//! `y = x·wᵀ + b` for a weight matrix packed once, when the model loads, into panels: each
//! panel holds [`WIDTH`] outputs' weights interleaved by depth (`[depth][WIDTH]`), so the
//! kernel multiplies one activation (broadcast) by the weights of sixteen outputs at once and
//! keeps each output's sum in its own lane: no horizontal sums, and one widening of an `f16`
//! weight vector serves every activation row of a block instead of one pair of rows.
//!
//! [`super::product`] reads the weights as stored (`[out, in]`) and is still what the
//! attention's products (activations against activations, nothing to pack ahead) use. Here the
//! layout is the one general matrix-product libraries copy the weights into on every call, paid
//! once per model instead: with a text of a few dozen tokens the products are bound by the
//! kernel's instructions per multiply-add once the weights sit in cache. AVX-512 where present
//! (twelve rows by thirty-two outputs per step: 24 of its 32 registers hold sums), else AVX2 +
//! FMA + F16C (six rows by sixteen), else a portable loop. The two SIMD paths compute the same
//! floats (one fused multiply-add per weight, in order of depth); the portable loop rounds each
//! product before adding it.

use std::ops::Range;

use rayon::prelude::*;

use super::{span, Rows, Weight, PARALLEL_WORK};

/// Outputs per panel.
pub const WIDTH: usize = 16;

/// A `[outs, depth]` weight matrix in panels of [`WIDTH`] outputs (the last one padded with
/// zeros).
#[derive(Debug, Clone)]
pub struct Panels<W> {
    data: Vec<W>,
    outs: usize,
    depth: usize,
}

impl<W: Weight> Panels<W> {
    /// Pack `w`, `outs` rows of `depth` weights each, stored contiguously (PyTorch's layout).
    ///
    /// Panics if `w` is not `outs × depth` long or `depth` is 0.
    pub fn pack(w: &[W], outs: usize, depth: usize) -> Self {
        assert!(depth > 0, "a matrix of depth 0");
        assert_eq!(
            Some(w.len()),
            outs.checked_mul(depth),
            "not an outs × depth matrix"
        );
        let mut data = vec![W::ZERO; outs.div_ceil(WIDTH) * depth * WIDTH];
        for (j, row) in w.chunks_exact(depth).enumerate() {
            let panel = &mut data[j / WIDTH * depth * WIDTH..][..depth * WIDTH];
            for (k, v) in row.iter().enumerate() {
                panel[k * WIDTH + j % WIDTH] = *v;
            }
        }
        Self { data, outs, depth }
    }

    /// Rows of the matrix (outputs of a product).
    pub fn outs(&self) -> usize {
        self.outs
    }

    /// Weights per row.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Weight `k` of row `j` (the tests' view of the layout).
    #[cfg(test)]
    fn get(&self, j: usize, k: usize) -> W {
        assert!(j < self.outs && k < self.depth, "past the matrix");
        self.data[j / WIDTH * self.depth * WIDTH + k * WIDTH + j % WIDTH]
    }

    /// Panels (the tests' view of the layout).
    #[cfg(test)]
    fn panels(&self) -> usize {
        self.outs.div_ceil(WIDTH)
    }
}

/// `y[i·y_stride + j] = Σₖ x[i][k]·w[j][k] + bias[j]` for every row `i` of `x` and `j` of `w`
/// (`bias` absent: 0), split over rayon's current pool when large enough to pay for it.
///
/// Panics if `x`'s rows are not `w`'s depth, `x`'s rows run past its data, `bias` is not one
/// float per row of `w`, or `y` is too short.
pub fn product<W: Weight>(
    x: Rows<'_>,
    w: &Panels<W>,
    bias: Option<&[f32]>,
    y: &mut [f32],
    y_stride: usize,
) {
    split(
        Shape::checked(x, w.outs, w.depth, bias, PARALLEL_WORK),
        y,
        y_stride,
        |rows, panels, part, part_stride, first| {
            let sub = Rows {
                data: &x.data[rows.start * x.stride..],
                rows: rows.len(),
                ..x
            };
            serial_into(sub, w, bias, panels, part, part_stride, first);
        },
    );
}

/// A product's size: rows of activations, outputs (rows of the weights) and depth; and the
/// fewest multiply-adds worth splitting over threads (below it the calling thread runs it all).
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) rows: usize,
    pub(super) outs: usize,
    pub(super) depth: usize,
    pub(super) parallel: usize,
}

impl Shape {
    /// The shape of `x` against `outs` rows of `depth` weights, splitting from `parallel`
    /// multiply-adds on.
    ///
    /// Panics if `x`'s rows are not `depth` long or run past its data, or `bias` is not one
    /// float per output.
    pub(super) fn checked(
        x: Rows<'_>,
        outs: usize,
        depth: usize,
        bias: Option<&[f32]>,
        parallel: usize,
    ) -> Self {
        x.check();
        assert_eq!(x.cols, depth, "x and w differ in depth");
        if let Some(b) = bias {
            assert_eq!(b.len(), outs, "one bias per output");
        }
        Self {
            rows: x.rows,
            outs,
            depth,
            parallel,
        }
    }
}

/// Runs a product of `shape` over rayon's current pool when large enough to pay for it, else
/// on the calling thread: `serial(rows, panels, part, part_stride, first)` computes rows `rows`
/// by panels `panels` into `part` (row `i - rows.start`'s output `j` at
/// `part[(i - rows.start) · part_stride + j - first]`). Shared by every packed layout.
///
/// Panics if `y` is too short for `shape.rows` rows `y_stride` apart or rows would overlap.
pub(super) fn split<F>(shape: Shape, y: &mut [f32], y_stride: usize, serial: F)
where
    F: Fn(Range<usize>, Range<usize>, &mut [f32], usize, usize) + Sync,
{
    let Shape {
        rows,
        outs,
        depth,
        parallel,
    } = shape;
    assert!(y_stride >= outs, "output rows overlap");
    if rows == 0 || outs == 0 {
        return;
    }
    let y_len = span(rows, y_stride, outs);
    assert!(y.len() >= y_len, "output too short");
    let y = &mut y[..y_len];
    let threads = rayon::current_num_threads();
    let panels = outs.div_ceil(WIDTH);
    if threads <= 1 || rows * outs * depth < parallel {
        serial(0..rows, 0..panels, y, y_stride, 0);
    } else if rows >= 8 * threads {
        // Many rows: each thread takes whole output rows (and reads every weight).
        let per = rows.div_ceil(threads);
        y.par_chunks_mut(per * y_stride)
            .enumerate()
            .for_each(|(i, part)| {
                let first = i * per;
                serial(first..(first + per).min(rows), 0..panels, part, y_stride, 0);
            });
    } else {
        // Few rows: each thread takes whole panels (and reads only their weights) into a
        // buffer of its own, copied into place after.
        let per = panels.div_ceil(threads).next_multiple_of(2);
        let parts: Vec<(Range<usize>, Vec<f32>)> = (0..panels.div_ceil(per))
            .into_par_iter()
            .map(|i| {
                let share = i * per..((i + 1) * per).min(panels);
                let outs = share.start * WIDTH..(share.end * WIDTH).min(outs);
                let mut part = vec![0.0; rows * outs.len()];
                serial(0..rows, share, &mut part, outs.len(), outs.start);
                (outs, part)
            })
            .collect();
        for (outs, part) in parts {
            for (i, row) in part.chunks_exact(outs.len()).enumerate() {
                y[i * y_stride + outs.start..i * y_stride + outs.end].copy_from_slice(row);
            }
        }
    }
}

/// The product for `panels` on this thread, written at their own columns of `y` (the tests'
/// reference for every split).
#[cfg(test)]
fn serial<W: Weight>(
    x: Rows<'_>,
    w: &Panels<W>,
    bias: Option<&[f32]>,
    panels: Range<usize>,
    y: &mut [f32],
    y_stride: usize,
) {
    serial_into(x, w, bias, panels, y, y_stride, 0);
}

/// The product for `panels` on this thread; output `j` is written at column `j - first` of
/// `y` (`first`: the first output of `panels`, or 0).
fn serial_into<W: Weight>(
    x: Rows<'_>,
    w: &Panels<W>,
    bias: Option<&[f32]>,
    panels: Range<usize>,
    y: &mut [f32],
    y_stride: usize,
    first: usize,
) {
    let outs = panels.start * WIDTH..(panels.end * WIDTH).min(w.outs);
    assert!(first <= outs.start || outs.is_empty());
    if outs.is_empty() || x.rows == 0 {
        return;
    }
    assert!(outs.end - first <= y_stride);
    assert!(span(x.rows, y_stride, outs.end - first) <= y.len());
    let out = Out {
        y,
        y_stride,
        first,
        bias,
        outs: w.outs,
    };
    #[cfg(target_arch = "x86_64")]
    {
        if x86::avx512() {
            x86::product512(x, w, panels, out);
            return;
        }
        if x86::avx2() {
            x86::product256(x, w, panels, out);
            return;
        }
    }
    portable(x, w, panels, out);
}

/// Where a block's sums go: row `i`'s output `j` at `y[i · y_stride + j - first]`, plus
/// `bias[j]`; outputs from `outs` on (a panel's padding) are dropped.
pub(super) struct Out<'a> {
    pub(super) y: &'a mut [f32],
    pub(super) y_stride: usize,
    pub(super) first: usize,
    pub(super) bias: Option<&'a [f32]>,
    pub(super) outs: usize,
}

impl Out<'_> {
    /// Row `i`'s sums for the panel starting at output `j0`.
    #[inline(always)]
    pub(super) fn put(&mut self, i: usize, j0: usize, sums: &[f32; WIDTH]) {
        let n = WIDTH.min(self.outs - j0);
        let at = i * self.y_stride + j0 - self.first;
        let dst = &mut self.y[at..at + n];
        match self.bias {
            Some(b) => {
                for ((d, s), b) in dst.iter_mut().zip(sums).zip(&b[j0..j0 + n]) {
                    *d = s + b;
                }
            }
            None => dst.copy_from_slice(&sums[..n]),
        }
    }
}

/// The product without SIMD intrinsics (the compiler vectorises the sixteen lanes as the
/// target allows): where neither AVX-512 nor AVX2 is present, and the tests' second path.
fn portable<W: Weight>(x: Rows<'_>, w: &Panels<W>, panels: Range<usize>, mut out: Out<'_>) {
    let depth = w.depth;
    for p in panels {
        let panel = &w.data[p * depth * WIDTH..(p + 1) * depth * WIDTH];
        for i in 0..x.rows {
            let mut sums = [0.0f32; WIDTH];
            for (xk, wk) in x.row(i).iter().zip(panel.chunks_exact(WIDTH)) {
                for (s, v) in sums.iter_mut().zip(wk) {
                    *s += xk * v.to_f32();
                }
            }
            out.put(i, p * WIDTH, &sums);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    //! The kernels: a block of `R` activation rows by `P` panels, `R · P` vector accumulators,
    //! each step one activation broadcast against each panel's sixteen weights.

    use std::arch::x86_64::{
        __m256, _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_setzero_ps, _mm256_storeu_ps,
        _mm512_fmadd_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
    };
    use std::ops::Range;
    use std::sync::OnceLock;

    use super::{Out, Panels, Rows, Weight, WIDTH};

    /// Whether this CPU has AVX-512 (F) (checked once): `f16` widens with it too.
    pub(super) fn avx512() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
    }

    /// Whether the AVX2 kernel can run: AVX2, FMA and F16C (every CPU with AVX2 has F16C; a
    /// virtual machine that hides it gets the portable loop).
    pub(super) fn avx2() -> bool {
        crate::matmul::avx2::available() && crate::matmul::avx2::f16c()
    }

    /// Checks what every kernel below relies on, once per call: the rows of `x` lie within
    /// its data (`Rows::check`), the panels within `w`'s, and `out` holds every output.
    fn checked<W: Weight>(x: Rows<'_>, w: &Panels<W>, panels: &Range<usize>, out: &Out<'_>) {
        x.check();
        assert_eq!(x.cols, w.depth);
        assert!(panels.end * WIDTH * w.depth <= w.data.len());
        if x.rows > 0 && panels.start < panels.end {
            let last = (panels.end * WIDTH).min(out.outs);
            assert!(out.first <= panels.start * WIDTH && last - out.first <= out.y_stride);
            assert!(super::span(x.rows, out.y_stride, last - out.first) <= out.y.len());
        }
    }

    /// Twelve rows by two panels per block, with AVX-512; only call where [`avx512`] said so.
    pub(super) fn product512<W: Weight>(
        x: Rows<'_>,
        w: &Panels<W>,
        panels: Range<usize>,
        mut out: Out<'_>,
    ) {
        assert!(avx512());
        checked(x, w, &panels, &out);
        let mut p = panels.start;
        while p < panels.end {
            let two = p + 1 < panels.end;
            let mut i = 0;
            while i < x.rows {
                let r = (x.rows - i).min(12);
                // SAFETY: AVX-512 is present (asserted above); the block reads rows
                // `i..i + r` of `x` (each `depth` floats within its data, `checked`) and
                // panels `p` and, with `two`, `p + 1` of `w` (within its data, `checked`).
                unsafe {
                    macro_rules! rows {
                        ($($n:literal)*) => {
                            match (r, two) {
                                $(($n, true) => block512::<W, $n, 2>(x, w, p, i, &mut out),
                                  ($n, false) => block512::<W, $n, 1>(x, w, p, i, &mut out),)*
                                _ => unreachable!(),
                            }
                        };
                    }
                    rows!(1 2 3 4 5 6 7 8 9 10 11 12);
                }
                i += r;
            }
            p += if two { 2 } else { 1 };
        }
    }

    /// Six rows by one panel per block, with AVX2, FMA and F16C; only call where [`avx2`] said
    /// so.
    pub(super) fn product256<W: Weight>(
        x: Rows<'_>,
        w: &Panels<W>,
        panels: Range<usize>,
        mut out: Out<'_>,
    ) {
        assert!(avx2());
        checked(x, w, &panels, &out);
        for p in panels {
            let mut i = 0;
            while i < x.rows {
                let r = (x.rows - i).min(6);
                // SAFETY: as in `product512`, with AVX2, FMA and F16C present.
                unsafe {
                    macro_rules! rows {
                        ($($n:literal)*) => {
                            match r {
                                $($n => block256::<W, $n>(x, w, p, i, &mut out),)*
                                _ => unreachable!(),
                            }
                        };
                    }
                    rows!(1 2 3 4 5 6);
                }
                i += r;
            }
        }
    }

    /// Rows `i..i + R` of `x` against panels `p..p + P` of `w`, written to `out`.
    ///
    /// # Safety
    /// AVX-512 present; those rows and panels exist (see [`checked`]).
    #[target_feature(enable = "avx512f")]
    unsafe fn block512<W: Weight, const R: usize, const P: usize>(
        x: Rows<'_>,
        w: &Panels<W>,
        p: usize,
        i: usize,
        out: &mut Out<'_>,
    ) {
        // SAFETY (the whole body): the caller's contract.
        unsafe {
            let depth = w.depth;
            let xp = x.data.as_ptr().add(i * x.stride);
            let wp = w.data.as_ptr().add(p * depth * WIDTH);
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            for k in 0..depth {
                let mut ws = [_mm512_setzero_ps(); P];
                for (q, v) in ws.iter_mut().enumerate() {
                    *v = W::load16(wp.add(q * depth * WIDTH + k * WIDTH));
                }
                for (r, a) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*xp.add(r * x.stride + k));
                    for (a, v) in a.iter_mut().zip(&ws) {
                        *a = _mm512_fmadd_ps(b, *v, *a);
                    }
                }
            }
            let mut sums = [0.0f32; WIDTH];
            for (r, a) in acc.iter().enumerate() {
                for (q, v) in a.iter().enumerate() {
                    _mm512_storeu_ps(sums.as_mut_ptr(), *v);
                    out.put(i + r, (p + q) * WIDTH, &sums);
                }
            }
        }
    }

    /// Rows `i..i + R` of `x` against panel `p` of `w`, written to `out`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C present; those rows and that panel exist (see [`checked`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block256<W: Weight, const R: usize>(
        x: Rows<'_>,
        w: &Panels<W>,
        p: usize,
        i: usize,
        out: &mut Out<'_>,
    ) {
        // SAFETY (the whole body): the caller's contract.
        unsafe {
            let depth = w.depth;
            let xp = x.data.as_ptr().add(i * x.stride);
            let wp = w.data.as_ptr().add(p * depth * WIDTH);
            let mut acc: [[__m256; 2]; R] = [[_mm256_setzero_ps(); 2]; R];
            for k in 0..depth {
                let lo = W::load8(wp.add(k * WIDTH));
                let hi = W::load8(wp.add(k * WIDTH + 8));
                for (r, a) in acc.iter_mut().enumerate() {
                    let b = _mm256_broadcast_ss(&*xp.add(r * x.stride + k));
                    a[0] = _mm256_fmadd_ps(b, lo, a[0]);
                    a[1] = _mm256_fmadd_ps(b, hi, a[1]);
                }
            }
            let mut sums = [0.0f32; WIDTH];
            for (r, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(sums.as_mut_ptr(), a[0]);
                _mm256_storeu_ps(sums.as_mut_ptr().add(8), a[1]);
                out.put(i + r, p * WIDTH, &sums);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use half::f16;

    use super::*;
    use crate::matmul::tests::{floats, reference};

    #[test]
    fn packing_keeps_every_weight_and_pads_with_zeros() {
        let w: Vec<f32> = (0..37 * 5).map(|v| v as f32).collect();
        let p = Panels::pack(&w, 37, 5);
        assert_eq!((p.outs(), p.depth(), p.panels()), (37, 5, 3));
        for j in 0..37 {
            for k in 0..5 {
                assert_eq!(p.get(j, k), w[j * 5 + k]);
            }
        }
        assert!(
            p.data[2 * 5 * WIDTH..]
                .iter()
                .filter(|v| **v == 0.0)
                .count()
                >= 11 * 5
        );
        assert!(std::panic::catch_unwind(|| Panels::pack(&w, 36, 5)).is_err());
        assert!(std::panic::catch_unwind(|| Panels::<f32>::pack(&[], 3, 0)).is_err());
    }

    #[test]
    fn every_shape_matches_the_product_in_f64_on_every_path() {
        every_shape::<f32>(|v| v);
        every_shape::<f16>(f16::from_f32);
    }

    /// `product` and each path this CPU has against the f64 product of the weights' own
    /// values.
    fn every_shape<W: Weight>(from: impl Fn(f32) -> W) {
        // Fewer outputs than a panel, a last panel part full, an odd count of panels (the
        // one-panel blocks), blocks of rows with tails of one to five, strided activations,
        // and products large enough to be split by rows and by panels over threads.
        for (rows, outs, depth, stride_pad) in [
            (1, 1, 1, 0),
            (2, 16, 8, 0),
            (3, 7, 13, 3),
            (9, 40, 32, 64),
            (13, 48, 5, 0),
            (16, 1152, 384, 0),
            (17, 384, 1536, 0),
            (300, 384, 384, 5),
            (64, 80, 250, 0),
            (5, 408, 600, 0),
        ] {
            let xs = depth + stride_pad;
            let xd = floats(rows * xs, 1);
            let wd: Vec<W> = floats(outs * depth, 2).into_iter().map(&from).collect();
            let bias = floats(outs, 3);
            let x = Rows {
                data: &xd,
                rows,
                cols: depth,
                stride: xs,
            };
            let packed = Panels::pack(&wd, outs, depth);
            let want = reference(x, Rows::dense(&wd, outs, depth), Some(&bias));
            let y_stride = outs + 2;
            let check = |y: &[f32], path: &str| {
                let tolerance = 1e-5 * depth as f64;
                for i in 0..rows {
                    for j in 0..outs {
                        let (got, want) = (f64::from(y[i * y_stride + j]), want[i * outs + j]);
                        assert!(
                            (got - want).abs() <= tolerance,
                            "{path} {rows}×{outs}×{depth} at {i},{j}: {got} vs {want}"
                        );
                    }
                    // The gap between output rows is left as it was.
                    if i + 1 < rows {
                        for j in outs..y_stride {
                            assert!(y[i * y_stride + j].is_nan(), "{path} wrote past a row");
                        }
                    }
                }
            };
            let fresh = || vec![f32::NAN; (rows - 1) * y_stride + outs];
            let mut y = fresh();
            product(x, &packed, Some(&bias), &mut y, y_stride);
            check(&y, "product");
            let all = 0..packed.panels();
            let mut y = fresh();
            portable(x, &packed, all.clone(), out(&mut y, y_stride, &bias, outs));
            check(&y, "portable");
            #[cfg(target_arch = "x86_64")]
            {
                if x86::avx2() {
                    let mut y = fresh();
                    x86::product256(x, &packed, all.clone(), out(&mut y, y_stride, &bias, outs));
                    check(&y, "avx2");
                }
                if x86::avx512() {
                    let mut y = fresh();
                    x86::product512(x, &packed, all.clone(), out(&mut y, y_stride, &bias, outs));
                    check(&y, "avx512");
                }
            }
        }
    }

    fn out<'a>(y: &'a mut [f32], y_stride: usize, bias: &'a [f32], outs: usize) -> Out<'a> {
        Out {
            y,
            y_stride,
            first: 0,
            bias: Some(bias),
            outs,
        }
    }

    #[test]
    fn every_split_over_threads_gives_the_serial_product() {
        crate::matmul::tests::every_split(|x, w, outs, y, alone| {
            let packed = Panels::pack(w, outs, x.cols);
            if alone {
                serial(x, &packed, None, 0..packed.panels(), y, outs);
                let want = reference(x, Rows::dense(w, outs, x.cols), None);
                for (got, want) in y.iter().zip(&want) {
                    assert!((f64::from(*got) - want).abs() <= 1e-5 * x.cols as f64);
                }
            } else {
                product(x, &packed, None, y, outs);
            }
        });
    }

    #[test]
    fn a_short_output_or_a_mismatched_depth_is_refused() {
        let w = Panels::pack(&[1.0f32; 8], 2, 4);
        let x = Rows::dense(&[1.0; 8], 2, 4);
        let mut y = vec![0.0; 4];
        product(x, &w, None, &mut y, 2);
        assert_eq!(y, [4.0; 4]);
        let mut empty: Vec<f32> = vec![];
        product(Rows::dense(&[], 0, 4), &w, None, &mut empty, 2);
        assert!(std::panic::catch_unwind(|| {
            let mut y = vec![0.0; 3];
            product(x, &w, None, &mut y, 2);
        })
        .is_err());
        assert!(std::panic::catch_unwind(|| {
            let mut y = vec![0.0; 4];
            product(Rows::dense(&[1.0; 6], 2, 3), &w, None, &mut y, 2);
        })
        .is_err());
        assert!(std::panic::catch_unwind(|| {
            let mut y = vec![0.0; 4];
            product(x, &w, Some(&[1.0]), &mut y, 2);
        })
        .is_err());
    }
}
