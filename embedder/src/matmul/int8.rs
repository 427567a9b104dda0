//! `y = x·wᵀ + b` in 8-bit integers: the weights quantised once, when the model loads, each
//! output's row to `i8` with a scale of its own; the activations quantised on each call, each
//! row's [`GROUP`] depths at a time to `u8` with a scale of their own (the group's largest
//! magnitude to ±127, zero at 128); each group's sums exact in `i32`, then scaled to `f32` and
//! added up. A group of its own per 64 depths keeps one large activation (BERT's `[CLS]` and
//! `[SEP]` rows hold a few, 20–60 times the row's next largest) from coarsening the whole
//! row's steps.
//!
//! A short text's pass is bound by the products' instructions once the weights sit in cache
//! ([`super::panels`]): AVX-512 VNNI's `vpdpbusd` sums four `u8 × i8` products into each of
//! sixteen `i32` lanes per instruction, against one `f32` multiply-add per lane for the `f16`
//! kernel, and the weights are half as many bytes again (`embedder/examples/lowp_kernels.rs`:
//! 4.7× the `f16` kernel's speed for the feed-forward product of 16 tokens on Zen 4, without
//! groups). The price is each product's rounding: a question's sentence vector moves away from
//! the `f32` pass's by a cosine of up to ~6e-4 instead of 1e-6 (`forward::Precision::Int8`).
//!
//! The weights have a scale per output and group of [`GROUP`] depths too: with one per output
//! a short text's vector was 8e-3 off (its `[CLS]` and `[SEP]` rows' large activations meet
//! the weights of their depths, rounded to steps set by the row's largest weight), 2.7e-3 with
//! groups; the verifier's decision changed for 0.4–0.7% of dev pairs instead of 0.8–0.9%.
//!
//! The layout is [`super::panels`]'s, four depths at a time: a panel holds [`WIDTH`] outputs'
//! weights as `[depth / 4][WIDTH][4]`, which is what `vpdpbusd` reads. Where AVX-512 VNNI is
//! missing, an AVX2 kernel reads the same layout (each weight widened to `i16`, two products
//! per lane with `vpmaddwd`: on Zen 3 a 16 × 1536 × 384 product 196 → 161–165 µs against the
//! `f16` kernel, `examples/lowp_kernels.rs`), and without AVX2 a portable loop. Where the CPU
//! has AMX (Intel's tile unit, Sapphire Rapids on) and the kernel lets the process use it, one
//! `tdpbusd` multiplies a block of 16 rows by a panel's 16 outputs over a whole group of depths
//! (the panels are already the layout its second operand reads): the 16 × 1536 × 384 product
//! 45–51 → 33–35 µs against the VNNI kernel, a pass of 32 to 256 tokens 10–15% faster and
//! batches ~20% (a 16-token pass the same, ~2.0 ms: there the weights' trip from the
//! third-level cache bounds both). All four compute the same integers and the same floats: a
//! vector does not depend on which CPU made it.

use std::ops::Range;

use super::panels::{split, Out, Shape, WIDTH};
use super::{Rows, Weight};

/// Whether this CPU runs the product with AVX-512 VNNI (or AMX): a short text's pass about
/// twice as fast as with the `f16` kernel. The AVX2 kernel is only ~15% faster than it (Zen 3: a
/// 16-token pass 3.6–3.7 → 3.1 ms), too little to trade the `f16` pass's agreement for by
/// default; the portable loop is ten times slower.
pub fn accelerated() -> bool {
    matches!(Kernel::detected(), Kernel::Amx | Kernel::Vnni)
}

/// Which kernel runs the product on this CPU: `"amx"`, `"avx512-vnni"`, `"avx2"` or
/// `"portable"` (the last ten times slower than the `f16` kernel: worth a warning where `int8`
/// is asked for).
pub fn kernel_name() -> &'static str {
    match Kernel::detected() {
        Kernel::Amx => "amx",
        Kernel::Vnni => "avx512-vnni",
        Kernel::Avx2 => "avx2",
        Kernel::Portable => "portable",
    }
}

/// Which code runs the product (and quantises the activations).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// AMX: `tdpbusd` sums a group's products for 16 rows by 16 outputs in one instruction
    /// (AVX-512 quantises the activations and scales the sums).
    Amx,
    /// AVX-512 VNNI: `vpdpbusd` sums four `u8 × i8` products per lane.
    Vnni,
    /// AVX2: each weight widened to `i16`, `vpmaddwd` sums two `i16` products per lane (the
    /// activations are widened once per call). `vpmaddubsw`, which reads `u8 × i8` directly,
    /// saturates its pairs' sums at `i16` and would not give the same integers.
    Avx2,
    /// Plain integer loops.
    Portable,
}

impl Kernel {
    /// The fastest this CPU runs (checked once).
    fn detected() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if x86::amx() {
                return Self::Amx;
            }
            if x86::vnni() {
                return Self::Vnni;
            }
            if x86::avx2() {
                return Self::Avx2;
            }
        }
        Self::Portable
    }
}

/// The fewest multiply-adds worth splitting over threads with [`Kernel::Vnni`] or
/// [`Kernel::Amx`]: a product there is ~4× faster than the `f16` kernel's, so waking a second
/// thread pays only for larger ones (a 16-token text's pass took 1.7–1.9 ms on one thread
/// against 2.2–2.6 ms split at the `f16` kernel's threshold; Zen 4, two vCPUs). With AMX, a
/// 64-token pass took 6.0–6.3 ms split here against 7.1–7.8 ms on one thread at four times
/// this threshold (Sapphire Rapids, two vCPUs). The AVX2 kernel, about as fast as the `f16`
/// one, splits where it does.
const VNNI_PARALLEL_WORK: usize = 1 << 24;

/// Rows per tile: [`Kernel::Amx`] reads activations 16 rows at a time, so they are padded with
/// up to 15 rows of zeros past the last.
const TILE_ROWS: usize = 16;

/// Depths summed per instruction: `vpdpbusd` sums four products per lane.
const QUAD: usize = 4;

/// Depths per activation scale.
const GROUP: usize = 64;

/// A `[outs, depth]` weight matrix quantised to `i8`, in panels of [`WIDTH`] outputs (the last
/// padded with zeros, as is the depth to a multiple of [`GROUP`]).
#[derive(Debug, Clone)]
pub struct Int8Panels {
    /// `[panel][depth / 4][WIDTH][4]`.
    data: Vec<i8>,
    /// `[panel][group][WIDTH]`: each output's scale for a group of depths (its weights there
    /// are `scale · data`).
    scale: Vec<f32>,
    /// `[panel][group][WIDTH]`: −128 times each output's sum of a group's quantised weights,
    /// where a group's integer sums start (it takes the activations' zero point back out).
    start: Vec<i32>,
    outs: usize,
    depth: usize,
}

impl Int8Panels {
    /// Quantise `w`, `outs` rows of `depth` weights each, stored contiguously (PyTorch's
    /// layout): each row's largest magnitude in a group of [`GROUP`] depths becomes ±127.
    ///
    /// Panics if `w` is not `outs × depth` long, `depth` is 0 or a weight is not finite.
    pub fn quantise<W: Weight>(w: &[W], outs: usize, depth: usize) -> Self {
        assert!(depth > 0, "a matrix of depth 0");
        assert_eq!(
            Some(w.len()),
            outs.checked_mul(depth),
            "not an outs × depth matrix"
        );
        let groups = depth.div_ceil(GROUP);
        let padded = outs.div_ceil(WIDTH) * WIDTH;
        let mut data = vec![0i8; padded * groups * GROUP];
        let mut scale = vec![0.0f32; padded * groups];
        let mut start = vec![0i32; padded * groups];
        for (j, row) in w.chunks_exact(depth).enumerate() {
            let (panel, lane) = (j / WIDTH, j % WIDTH);
            let base = panel * groups * GROUP * WIDTH + lane * QUAD;
            for (g, part) in row.chunks(GROUP).enumerate() {
                let largest = part.iter().map(|v| v.to_f32().abs()).fold(0.0, f32::max);
                assert!(largest.is_finite(), "a weight that is not finite");
                let s = if largest > 0.0 { largest / 127.0 } else { 1.0 };
                let at = (panel * groups + g) * WIDTH + lane;
                scale[at] = s;
                for (k, v) in part.iter().enumerate() {
                    let k = g * GROUP + k;
                    #[allow(clippy::cast_possible_truncation, reason = "clamped to i8's range")]
                    let q = (v.to_f32() / s).round().clamp(-127.0, 127.0) as i8;
                    data[base + k / QUAD * WIDTH * QUAD + k % QUAD] = q;
                    start[at] -= 128 * i32::from(q);
                }
            }
        }
        Self {
            data,
            scale,
            start,
            outs,
            depth,
        }
    }

    /// Weight `k` of row `j`, as quantised (the tests' view of the layout).
    #[cfg(test)]
    fn get(&self, j: usize, k: usize) -> f32 {
        assert!(j < self.outs && k < self.depth, "past the matrix");
        let (panel, lane) = (j / WIDTH, j % WIDTH);
        let at = panel * self.groups() * GROUP * WIDTH + k / QUAD * WIDTH * QUAD + lane * QUAD;
        let scale = self.scale[(panel * self.groups() + k / GROUP) * WIDTH + lane];
        f32::from(self.data[at + k % QUAD]) * scale
    }

    fn groups(&self) -> usize {
        self.depth.div_ceil(GROUP)
    }

    /// Weights per panel.
    fn panel_len(&self) -> usize {
        self.groups() * GROUP * WIDTH
    }
}

/// A call's activations quantised: row `i`'s group `g` is `data[i][g·GROUP..]` as `u8` (128
/// for zero, padded with it), `x[i][k] ≈ scale[i][g] · (data[i][k] − 128)`.
struct Quantised {
    data: Vec<u8>,
    /// `data` widened to `i16`, for [`Kernel::Avx2`] (empty for the others).
    wide: Vec<i16>,
    /// `[row][group]`.
    scale: Vec<f32>,
    groups: usize,
}

impl Quantised {
    /// `x` quantised for `kernel`.
    fn new(x: Rows<'_>, kernel: Kernel) -> Self {
        let groups = x.cols.div_ceil(GROUP);
        let padded = match kernel {
            Kernel::Amx => x.rows + TILE_ROWS - 1,
            _ => x.rows,
        };
        let mut data = vec![128u8; padded * groups * GROUP];
        let mut scale = vec![0.0f32; padded * groups];
        for (i, (out, scales)) in data
            .chunks_exact_mut(groups * GROUP)
            .zip(scale.chunks_exact_mut(groups))
            .take(x.rows)
            .enumerate()
        {
            for ((group, out), s) in x
                .row(i)
                .chunks(GROUP)
                .zip(out.chunks_exact_mut(GROUP))
                .zip(scales)
            {
                #[cfg(target_arch = "x86_64")]
                if group.len() == GROUP && kernel != Kernel::Portable {
                    *s = match kernel {
                        Kernel::Amx | Kernel::Vnni => x86::quantise(group, out),
                        _ => x86::quantise256(group, out),
                    };
                    continue;
                }
                *s = quantise(group, out);
            }
        }
        let wide = match kernel {
            Kernel::Avx2 => data.iter().map(|&b| i16::from(b)).collect(),
            _ => Vec::new(),
        };
        Self {
            data,
            wide,
            scale,
            groups,
        }
    }

    /// Bytes per row.
    fn stride(&self) -> usize {
        self.groups * GROUP
    }
}

/// The multiplier that takes `largest` (a group's largest magnitude) to 127, and its inverse
/// (the group's scale); a group of zeros, or one not finite, gets steps of 1 (nothing an `f32`
/// pass would keep is lost to it).
fn steps(largest: f32) -> (f32, f32) {
    if largest > 0.0 && largest.is_finite() {
        (127.0 / largest, largest / 127.0)
    } else {
        (1.0, 1.0)
    }
}

/// A group of activations as `u8` (`out`, as long), each rounded to the nearest step (ties to
/// even) with 128 for zero; its scale.
fn quantise(group: &[f32], out: &mut [u8]) -> f32 {
    let (times, scale) = steps(group.iter().fold(0.0f32, |m, v| m.max(v.abs())));
    for (o, &v) in out.iter_mut().zip(group) {
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "clamped to u8's range"
        )]
        let q = ((v * times).round_ties_even().clamp(-127.0, 127.0) + 128.0) as u8;
        *o = q;
    }
    scale
}

/// `y[i·y_stride + j] = Σₖ x[i][k]·w[j][k] + bias[j]` for every row `i` of `x` and `j` of `w`,
/// both quantised (see the module's doc), split over rayon's current pool when large enough
/// to pay for it.
///
/// Panics if `x`'s rows are not `w`'s depth, `x`'s rows run past its data, `bias` is not one
/// float per row of `w`, or `y` is too short.
pub fn product(x: Rows<'_>, w: &Int8Panels, bias: Option<&[f32]>, y: &mut [f32], y_stride: usize) {
    let kernel = Kernel::detected();
    let parallel = match kernel {
        Kernel::Amx | Kernel::Vnni => VNNI_PARALLEL_WORK,
        _ => super::PARALLEL_WORK,
    };
    let shape = Shape::checked(x, w.outs, w.depth, bias, parallel);
    let q = Quantised::new(x, kernel);
    split(
        shape,
        y,
        y_stride,
        |rows, panels, part, part_stride, first| {
            let out = Out {
                y: part,
                y_stride: part_stride,
                first,
                bias,
                outs: w.outs,
            };
            serial(kernel, &q, rows, w, panels, out);
        },
    );
}

/// Rows `rows` of `q` (quantised for `kernel`) against `panels` of `w` on this thread with
/// `kernel` (row `rows.start` is `out`'s first).
fn serial(
    kernel: Kernel,
    q: &Quantised,
    rows: Range<usize>,
    w: &Int8Panels,
    panels: Range<usize>,
    out: Out<'_>,
) {
    let outs = panels.start * WIDTH..(panels.end * WIDTH).min(w.outs);
    if outs.is_empty() || rows.is_empty() {
        return;
    }
    assert!(q.groups == w.groups() && rows.end * q.stride() <= q.data.len());
    assert!(rows.end * q.groups <= q.scale.len());
    assert!(panels.end * w.panel_len() <= w.data.len());
    assert!(panels.end * w.groups() * WIDTH <= w.start.len().min(w.scale.len()));
    assert!(out.first <= outs.start && outs.end - out.first <= out.y_stride);
    assert!(super::span(rows.len(), out.y_stride, outs.end - out.first) <= out.y.len());
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Amx => {
            assert!((rows.end + TILE_ROWS - 1) * q.stride() <= q.data.len());
            assert!((rows.end + TILE_ROWS - 1) * q.groups <= q.scale.len());
            x86::product_tiles(q, rows, w, panels, out);
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Vnni => x86::product(q, rows, w, panels, out),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => {
            assert!(rows.end * q.stride() <= q.wide.len());
            x86::product256(q, rows, w, panels, out);
        }
        _ => portable(q, rows, w, panels, out),
    }
}

/// The product in plain integer loops: where neither kernel can run, and the tests' second
/// path (the same integers and the same floats, rounded in the same order).
fn portable(
    q: &Quantised,
    rows: Range<usize>,
    w: &Int8Panels,
    panels: Range<usize>,
    mut out: Out<'_>,
) {
    let (len, groups) = (w.panel_len(), w.groups());
    for p in panels {
        let panel = &w.data[p * len..(p + 1) * len];
        for i in rows.clone() {
            let xr = &q.data[i * q.stride()..(i + 1) * q.stride()];
            let mut sums = [0.0f32; WIDTH];
            for g in 0..groups {
                let mut ints = [0i32; WIDTH];
                ints.copy_from_slice(&w.start[(p * groups + g) * WIDTH..][..WIDTH]);
                let xg = &xr[g * GROUP..(g + 1) * GROUP];
                let wg = &panel[g * GROUP * WIDTH..(g + 1) * GROUP * WIDTH];
                for (xq, wq) in xg.chunks_exact(QUAD).zip(wg.chunks_exact(WIDTH * QUAD)) {
                    for (s, wl) in ints.iter_mut().zip(wq.chunks_exact(QUAD)) {
                        for (a, b) in xq.iter().zip(wl) {
                            *s += i32::from(*a) * i32::from(*b);
                        }
                    }
                }
                let scale = q.scale[i * groups + g];
                let scales = &w.scale[(p * groups + g) * WIDTH..][..WIDTH];
                for ((s, v), ws) in sums.iter_mut().zip(ints).zip(scales) {
                    #[allow(clippy::cast_precision_loss, reason = "as the kernel converts")]
                    let v = v as f32;
                    *s = v.mul_add(scale * ws, *s);
                }
            }
            out.put(i - rows.start, p * WIDTH, &sums);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    //! The kernels: a block of `R` activation rows by `P` panels, `R · P` integer accumulators
    //! (one group's sums) and as many float ones, each step four activations (one row's,
    //! broadcast) against each panel's sixteen outputs' four weights (AVX-512 VNNI); or by
    //! one panel, eight outputs at a time (AVX2).

    use std::arch::asm;
    use std::arch::x86_64::{__cpuid_count, _mm512_load_si512, _mm_prefetch, _MM_HINT_T0};
    use std::arch::x86_64::{
        __m256, __m256i, _mm256_add_epi32, _mm256_andnot_ps, _mm256_castps256_ps128,
        _mm256_cvtepi32_ps, _mm256_cvtepi8_epi16, _mm256_cvtps_epi32, _mm256_extractf128_ps,
        _mm256_fmadd_ps, _mm256_hadd_epi32, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_madd_epi16,
        _mm256_max_epi32, _mm256_max_ps, _mm256_min_epi32, _mm256_mul_ps, _mm256_packs_epi32,
        _mm256_packus_epi16, _mm256_permute4x64_epi64, _mm256_permutevar8x32_epi32,
        _mm256_set1_epi32, _mm256_set1_epi64x, _mm256_set1_ps, _mm256_setr_epi32,
        _mm256_setzero_ps, _mm256_setzero_si256, _mm256_storeu_ps, _mm256_storeu_si256,
        _mm_cvtss_f32, _mm_loadu_si128, _mm_max_ps, _mm_max_ss, _mm_movehl_ps, _mm_shuffle_ps,
    };
    use std::arch::x86_64::{
        _mm512_abs_ps, _mm512_add_epi32, _mm512_cvtepi32_epi8, _mm512_cvtepi32_ps,
        _mm512_cvtps_epi32, _mm512_dpbusd_epi32, _mm512_fmadd_ps, _mm512_loadu_ps,
        _mm512_loadu_si512, _mm512_max_epi32, _mm512_max_ps, _mm512_min_epi32, _mm512_mul_ps,
        _mm512_reduce_max_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps,
        _mm512_setzero_si512, _mm512_storeu_ps, _mm_storeu_si128,
    };
    use std::ops::Range;
    use std::sync::OnceLock;

    use super::{Int8Panels, Out, Quantised, GROUP, QUAD, TILE_ROWS, WIDTH};

    /// Whether this CPU has AMX with 8-bit integers (and AVX-512 VNNI, for the rest of the
    /// work) and the operating system lets this process use the tiles (asked once: on Linux a
    /// process must ask for the tiles' 8 KiB of register state before its first tile
    /// instruction; where it is refused, the VNNI kernel runs).
    pub(super) fn amx() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            // CPUID leaf 7: EDX bit 24 is AMX-TILE, bit 25 AMX-INT8 (leaf 7 exists where
            // AVX-512 does).
            const TILE_INT8: u32 = 3 << 24;
            vnni() && __cpuid_count(7, 0).edx & TILE_INT8 == TILE_INT8 && tiles_permitted()
        })
    }

    /// Asks Linux for the tiles' register state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
    /// XFEATURE_XTILEDATA)`, for the whole process and every thread it runs).
    #[cfg(target_os = "linux")]
    fn tiles_permitted() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a system call that only changes which register state the process may use.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn tiles_permitted() -> bool {
        false
    }

    /// The tiles' shapes for [`tiles`] (`ldtilecfg`'s 64 bytes, palette 1), two sets of three
    /// so that one step's tiles load while the last one's are still in use: `tmm0`/`tmm3` a
    /// block's activations, 16 rows of a group's 64 bytes; `tmm1`/`tmm4` a panel's weights for
    /// the group, 16 rows (four depths each) of 16 outputs' four bytes; `tmm2`/`tmm5` the sums,
    /// 16 rows of 16 `i32`.
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    impl TileConfig {
        fn new() -> Self {
            let mut config = [0u8; 64];
            config[0] = 1;
            for tile in 0..6 {
                // Bytes per row (a `u16` from byte 16), rows (a byte each from byte 48).
                config[16 + 2 * tile] = 64;
                config[48 + tile] = 16;
            }
            Self(config)
        }
    }

    /// A step's sums as `tilestored` writes them: 16 rows of 16 `i32`.
    #[repr(C, align(64))]
    struct Sums([i32; TILE_ROWS * WIDTH]);

    /// How far ahead of a step its weights are fetched into the first-level cache: two steps'
    /// panels (a pass's weights come from the third level: fetched as each step needs them,
    /// the tile loads wait for them one after another).
    const AHEAD: usize = 2 * GROUP * WIDTH;

    /// Blocks of 16 rows by all of `panels`, with AMX; only call where [`amx`] said so,
    /// [`super::serial`]'s bounds hold and `q` has [`TILE_ROWS`]` - 1` rows of padding past
    /// `rows`.
    pub(super) fn product_tiles(
        q: &Quantised,
        rows: Range<usize>,
        w: &Int8Panels,
        panels: Range<usize>,
        mut out: Out<'_>,
    ) {
        assert!(amx() && GROUP == 64 && WIDTH * QUAD == 64);
        let config = TileConfig::new();
        // SAFETY: AMX is present and permitted (asserted above); the configuration is 64
        // bytes, aligned.
        unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
        let mut i = rows.start;
        while i < rows.end {
            let r = (rows.end - i).min(TILE_ROWS);
            // SAFETY: AMX and AVX-512 are present and the tiles configured; the block reads
            // rows `i..i + 16` of `q` and their scales (padded: asserted by `serial`), `panels`
            // of `w` and their start values and scales.
            unsafe { tiles(q, w, panels.clone(), i, r, rows.start, &mut out) };
            i += r;
        }
        // SAFETY: AMX is present; the tiles are not used past here.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// Rows `i..i + 16` of `q` against `panels` of `w`, the first `r` of them written to `out`
    /// (whose first row is `first`), as a run of steps, one per panel and group: `tdpbusd`
    /// sums the group's products into a zeroed tile, which is stored; then AVX-512 adds the
    /// start values and scales the sums as [`block`] does, one step behind, so that each
    /// step's tile work runs while the last step's sums are scaled (the two use alternate
    /// tiles and buffers).
    ///
    /// # Safety
    /// AMX and AVX-512 present, the tiles configured by [`TileConfig`]; those rows (with
    /// padding) and those panels exist.
    #[target_feature(enable = "avx512f")]
    unsafe fn tiles(
        q: &Quantised,
        w: &Int8Panels,
        panels: Range<usize>,
        i: usize,
        r: usize,
        first: usize,
        out: &mut Out<'_>,
    ) {
        // SAFETY (the whole body): the caller's contract.
        unsafe {
            let (groups, stride) = (w.groups(), q.stride());
            // A panel's groups follow each other, and so do the panels: step `n`'s weights,
            // start values and scales are the `n`-th from `panels.start`'s.
            let At {
                x: xp,
                scales,
                w: wp,
                wscales: wsp,
                starts: sp,
            } = At::new(&q.data, q, w, panels.start, i);
            let mut ints = [Sums([0; TILE_ROWS * WIDTH]), Sums([0; TILE_ROWS * WIDTH])];
            let mut sums = [_mm512_setzero_ps(); TILE_ROWS];
            let steps = panels.len() * groups;
            for n in 0..=steps {
                if n < steps {
                    let x = xp.add(n % groups * GROUP);
                    let wn = wp.add(n * GROUP * WIDTH);
                    // A prefetch never faults: past the weights' end it fetches nothing useful.
                    let ahead = wn.wrapping_add(AHEAD);
                    for line in 0..GROUP * WIDTH / 64 {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line * 64).cast());
                    }
                    let b = ints[n % 2].0.as_mut_ptr();
                    if n % 2 == 0 {
                        asm!(
                            "tileloadd tmm0, [{x} + {stride}*1]",
                            "tileloadd tmm1, [{w} + {line}*1]",
                            "tilezero tmm2",
                            "tdpbusd tmm2, tmm0, tmm1",
                            "tilestored [{b} + {line}*1], tmm2",
                            x = in(reg) x, stride = in(reg) stride, w = in(reg) wn,
                            line = in(reg) WIDTH * QUAD, b = in(reg) b,
                            options(nostack),
                        );
                    } else {
                        asm!(
                            "tileloadd tmm3, [{x} + {stride}*1]",
                            "tileloadd tmm4, [{w} + {line}*1]",
                            "tilezero tmm5",
                            "tdpbusd tmm5, tmm3, tmm4",
                            "tilestored [{b} + {line}*1], tmm5",
                            x = in(reg) x, stride = in(reg) stride, w = in(reg) wn,
                            line = in(reg) WIDTH * QUAD, b = in(reg) b,
                            options(nostack),
                        );
                    }
                }
                if n == 0 {
                    continue;
                }
                let m = n - 1;
                let g = m % groups;
                let start = _mm512_loadu_si512(sp.add(m * WIDTH).cast());
                let wscale = _mm512_loadu_ps(wsp.add(m * WIDTH));
                let b = ints[m % 2].0.as_ptr();
                for (row, s) in sums.iter_mut().enumerate() {
                    let v = _mm512_add_epi32(_mm512_load_si512(b.add(row * WIDTH).cast()), start);
                    let both = _mm512_mul_ps(_mm512_set1_ps(*scales.add(row * groups + g)), wscale);
                    *s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), both, *s);
                }
                if g + 1 == groups {
                    let p = panels.start + m / groups;
                    let mut lanes = [0.0f32; WIDTH];
                    for (row, s) in sums.iter_mut().enumerate().take(r) {
                        _mm512_storeu_ps(lanes.as_mut_ptr(), *s);
                        out.put(i + row - first, p * WIDTH, &lanes);
                    }
                    sums = [_mm512_setzero_ps(); TILE_ROWS];
                }
            }
        }
    }

    /// Whether this CPU has AVX-512 (F) and VNNI (checked once).
    pub(super) fn vnni() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vnni")
        })
    }

    /// [`super::quantise`] for a whole group (the same bytes, but for activations that are not
    /// numbers); only call where [`vnni`] said so.
    pub(super) fn quantise(group: &[f32], out: &mut [u8]) -> f32 {
        assert!(vnni() && group.len() == GROUP && out.len() == GROUP);
        // SAFETY: AVX-512 is present and both slices hold a group (asserted above).
        unsafe { quantise_group(group, out) }
    }

    /// # Safety
    /// AVX-512 present; `group` and `out` hold [`GROUP`] elements.
    #[target_feature(enable = "avx512f")]
    unsafe fn quantise_group(group: &[f32], out: &mut [u8]) -> f32 {
        // SAFETY (the whole body): the caller's contract.
        unsafe {
            let x = group.as_ptr();
            let v = [0, 16, 32, 48].map(|at| _mm512_loadu_ps(x.add(at)));
            let m = v.iter().fold(_mm512_setzero_ps(), |m, v| {
                _mm512_max_ps(m, _mm512_abs_ps(*v))
            });
            let (times, scale) = super::steps(_mm512_reduce_max_ps(m));
            let times = _mm512_set1_ps(times);
            let (lo, hi, zero) = (
                _mm512_set1_epi32(-127),
                _mm512_set1_epi32(127),
                _mm512_set1_epi32(128),
            );
            for (n, v) in v.iter().enumerate() {
                // Rounded to nearest, ties to even (the default rounding mode).
                let q = _mm512_cvtps_epi32(_mm512_mul_ps(*v, times));
                let q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), zero);
                _mm_storeu_si128(out.as_mut_ptr().add(n * 16).cast(), _mm512_cvtepi32_epi8(q));
            }
            scale
        }
    }

    /// Whether the AVX2 kernel can run: AVX2 and FMA.
    pub(super) fn avx2() -> bool {
        crate::matmul::avx2::available()
    }

    /// [`super::quantise`] for a whole group with AVX2 (the same bytes, but for activations
    /// that are not numbers); only call where [`avx2`] said so.
    pub(super) fn quantise256(group: &[f32], out: &mut [u8]) -> f32 {
        assert!(avx2() && group.len() == GROUP && out.len() == GROUP);
        // SAFETY: AVX2 is present and both slices hold a group (asserted above).
        unsafe { quantise_group256(group, out) }
    }

    /// # Safety
    /// AVX2 present; `group` and `out` hold [`GROUP`] elements.
    #[target_feature(enable = "avx2")]
    unsafe fn quantise_group256(group: &[f32], out: &mut [u8]) -> f32 {
        // SAFETY (the whole body): the caller's contract.
        unsafe {
            let x = group.as_ptr();
            let v: [__m256; 8] = std::array::from_fn(|n| _mm256_loadu_ps(x.add(n * 8)));
            let sign = _mm256_set1_ps(-0.0);
            let m = v.iter().fold(_mm256_setzero_ps(), |m, v| {
                _mm256_max_ps(m, _mm256_andnot_ps(sign, *v))
            });
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
            let (times, scale) = super::steps(_mm_cvtss_f32(m));
            let times = _mm256_set1_ps(times);
            let (lo, hi, zero) = (
                _mm256_set1_epi32(-127),
                _mm256_set1_epi32(127),
                _mm256_set1_epi32(128),
            );
            let q: [__m256i; 8] = std::array::from_fn(|n| {
                // Rounded to nearest, ties to even (the default rounding mode).
                let q = _mm256_cvtps_epi32(_mm256_mul_ps(v[n], times));
                _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q, lo), hi), zero)
            });
            // Packing works within 128-bit halves: four vectors' bytes come out as their
            // low quarters, then their high ones; the permutation puts each vector's together.
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            for (n, q) in q.chunks_exact(4).enumerate() {
                let bytes = _mm256_packus_epi16(
                    _mm256_packs_epi32(q[0], q[1]),
                    _mm256_packs_epi32(q[2], q[3]),
                );
                let bytes = _mm256_permutevar8x32_epi32(bytes, order);
                _mm256_storeu_si256(out.as_mut_ptr().add(n * 32).cast(), bytes);
            }
            scale
        }
    }

    /// Six rows by one panel per block, with AVX2; only call where [`avx2`] said so,
    /// [`super::serial`]'s bounds hold and `q` has its widened activations. (The loops are
    /// `product`'s, written out again: driven through a shared closure instead, the blocks of
    /// six rows ran 20% slower, 194 against 161–165 µs for a 16 × 1536 × 384 product on Zen 3,
    /// and with five rows a 32-token pass lost what int8 gained.)
    pub(super) fn product256(
        q: &Quantised,
        rows: Range<usize>,
        w: &Int8Panels,
        panels: Range<usize>,
        mut out: Out<'_>,
    ) {
        assert!(avx2() && q.wide.len() == q.data.len());
        for p in panels {
            let mut i = rows.start;
            while i < rows.end {
                let r = (rows.end - i).min(6);
                // SAFETY: AVX2 is present (asserted above); the block reads rows `i..i + r`
                // of `q`'s widened activations and their scales, panel `p` of `w` and its
                // start values (all within their data: `serial`, and `wide` is `data`'s
                // length).
                unsafe {
                    macro_rules! rows {
                        ($($n:literal)*) => {
                            match r {
                                $($n => block256::<$n>(q, w, p, i, rows.start, &mut out),)*
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

    /// Where a block's operands start: row `i`'s activations in `x` (`q.data` or `q.wide`)
    /// and their scales, panel `p`'s weights, their scales and start values.
    struct At<T> {
        x: *const T,
        scales: *const f32,
        w: *const i8,
        wscales: *const f32,
        starts: *const i32,
    }

    impl<T> At<T> {
        /// # Safety
        /// Row `i` and panel `p` exist, and `x` holds `q`'s rows.
        unsafe fn new(x: &[T], q: &Quantised, w: &Int8Panels, p: usize, i: usize) -> Self {
            let groups = w.groups();
            // SAFETY: the caller's contract.
            unsafe {
                Self {
                    x: x.as_ptr().add(i * q.stride()),
                    scales: q.scale.as_ptr().add(i * groups),
                    w: w.data.as_ptr().add(p * w.panel_len()),
                    wscales: w.scale.as_ptr().add(p * groups * WIDTH),
                    starts: w.start.as_ptr().add(p * groups * WIDTH),
                }
            }
        }
    }

    /// Rows `i..i + R` of `q` against panel `p` of `w`, written to `out` (whose first row is
    /// `first`): each half of the panel's outputs in turn, eight at a time. Four weights of
    /// four outputs (sixteen bytes) widen into one vector, whose lanes `vpmaddwd` sums in
    /// pairs against a row's four activations: each output's sum is in two lanes until the
    /// group's end, where `vphaddd` adds them.
    ///
    /// # Safety
    /// AVX2 present; those rows and that panel exist.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block256<const R: usize>(
        q: &Quantised,
        w: &Int8Panels,
        p: usize,
        i: usize,
        first: usize,
        out: &mut Out<'_>,
    ) {
        // SAFETY (the whole body): the caller's contract.
        unsafe {
            let (groups, stride) = (w.groups(), q.stride());
            let At {
                x: xp,
                scales,
                w: wp,
                wscales: wsp,
                starts: sp,
            } = At::new(&q.wide, q, w, p, i);
            let mut sums = [[0.0f32; WIDTH]; R];
            for half in 0..2 {
                let mut s = [_mm256_setzero_ps(); R];
                for g in 0..groups {
                    let mut ints = [[_mm256_setzero_si256(); 2]; R];
                    for k4 in g * GROUP / QUAD..(g + 1) * GROUP / QUAD {
                        let at = wp.add(k4 * WIDTH * QUAD + half * WIDTH / 2 * QUAD);
                        let w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(at.cast()));
                        let w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(at.add(16).cast()));
                        for (r, a) in ints.iter_mut().enumerate() {
                            let four = xp
                                .add(r * stride + k4 * QUAD)
                                .cast::<i64>()
                                .read_unaligned();
                            let b = _mm256_set1_epi64x(four);
                            a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(b, w0));
                            a[1] = _mm256_add_epi32(a[1], _mm256_madd_epi16(b, w1));
                        }
                    }
                    let at = g * WIDTH + half * WIDTH / 2;
                    let start = _mm256_loadu_si256(sp.add(at).cast());
                    let wscale = _mm256_loadu_ps(wsp.add(at));
                    for (r, (s, a)) in s.iter_mut().zip(&ints).enumerate() {
                        // Pairs of outputs in the order 0 1 4 5 2 3 6 7: swap the middle two.
                        let pairs = _mm256_hadd_epi32(a[0], a[1]);
                        let pairs = _mm256_permute4x64_epi64::<0b11_01_10_00>(pairs);
                        let ints = _mm256_add_epi32(pairs, start);
                        let both =
                            _mm256_mul_ps(_mm256_set1_ps(*scales.add(r * groups + g)), wscale);
                        *s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), both, *s);
                    }
                }
                for (sum, s) in sums.iter_mut().zip(&s) {
                    _mm256_storeu_ps(sum.as_mut_ptr().add(half * WIDTH / 2), *s);
                }
            }
            for (r, sum) in sums.iter().enumerate() {
                out.put(i + r - first, p * WIDTH, sum);
            }
        }
    }

    /// Six rows by two panels per block; only call where [`vnni`] said so and
    /// [`super::serial`]'s bounds hold.
    pub(super) fn product(
        q: &Quantised,
        rows: Range<usize>,
        w: &Int8Panels,
        panels: Range<usize>,
        mut out: Out<'_>,
    ) {
        assert!(vnni());
        let mut p = panels.start;
        while p < panels.end {
            let two = p + 1 < panels.end;
            let mut i = rows.start;
            while i < rows.end {
                let r = (rows.end - i).min(6);
                // SAFETY: AVX-512 VNNI is present (asserted above); the block reads rows
                // `i..i + r` of `q` and their scales, panels `p` and, with `two`, `p + 1` of
                // `w` and their start values (all within their data: `serial`).
                unsafe {
                    macro_rules! rows {
                        ($($n:literal)*) => {
                            match (r, two) {
                                $(($n, true) => block::<$n, 2>(q, w, p, i, rows.start, &mut out),
                                  ($n, false) => block::<$n, 1>(q, w, p, i, rows.start, &mut out),)*
                                _ => unreachable!(),
                            }
                        };
                    }
                    rows!(1 2 3 4 5 6);
                }
                i += r;
            }
            p += if two { 2 } else { 1 };
        }
    }

    /// Rows `i..i + R` of `q` against panels `p..p + P` of `w`, written to `out` (whose first
    /// row is `first`).
    ///
    /// # Safety
    /// AVX-512 VNNI present; those rows and panels exist.
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn block<const R: usize, const P: usize>(
        q: &Quantised,
        w: &Int8Panels,
        p: usize,
        i: usize,
        first: usize,
        out: &mut Out<'_>,
    ) {
        // SAFETY (the whole body): the caller's contract.
        unsafe {
            let (len, groups, stride) = (w.panel_len(), w.groups(), q.stride());
            let At {
                x: xp,
                scales,
                w: wp,
                wscales: wsp,
                starts: sp,
            } = At::new(&q.data, q, w, p, i);
            let mut sums = [[_mm512_setzero_ps(); P]; R];
            for g in 0..groups {
                let mut starts = [_mm512_setzero_si512(); P];
                for (n, v) in starts.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(sp.add((n * groups + g) * WIDTH).cast());
                }
                let mut ints = [starts; R];
                for k4 in g * GROUP / QUAD..(g + 1) * GROUP / QUAD {
                    let mut ws = starts;
                    for (n, v) in ws.iter_mut().enumerate() {
                        *v = _mm512_loadu_si512(wp.add(n * len + k4 * WIDTH * QUAD).cast());
                    }
                    for (r, a) in ints.iter_mut().enumerate() {
                        let four = xp
                            .add(r * stride + k4 * QUAD)
                            .cast::<i32>()
                            .read_unaligned();
                        let b = _mm512_set1_epi32(four);
                        for (a, v) in a.iter_mut().zip(&ws) {
                            *a = _mm512_dpbusd_epi32(*a, b, *v);
                        }
                    }
                }
                let mut wscales = [_mm512_setzero_ps(); P];
                for (n, v) in wscales.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(wsp.add((n * groups + g) * WIDTH));
                }
                for (r, (s, a)) in sums.iter_mut().zip(&ints).enumerate() {
                    let scale = _mm512_set1_ps(*scales.add(r * groups + g));
                    for ((s, a), ws) in s.iter_mut().zip(a).zip(&wscales) {
                        let both = _mm512_mul_ps(scale, *ws);
                        *s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*a), both, *s);
                    }
                }
            }
            let mut lanes = [0.0f32; WIDTH];
            for (r, s) in sums.iter().enumerate() {
                for (n, v) in s.iter().enumerate() {
                    _mm512_storeu_ps(lanes.as_mut_ptr(), *v);
                    out.put(i + r - first, (p + n) * WIDTH, &lanes);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use crate::matmul::tests::{floats, reference};

    #[test]
    fn quantising_keeps_each_weight_within_half_a_step_and_pads_with_zeros() {
        let (outs, depth) = (37, 7);
        let w: Vec<f32> = floats(outs * depth, 9);
        let p = Int8Panels::quantise(&w, outs, depth);
        for j in 0..outs {
            let step = p.scale[j / WIDTH * WIDTH + j % WIDTH];
            for k in 0..depth {
                assert!((p.get(j, k) - w[j * depth + k]).abs() <= step / 2.0 + 1e-7);
            }
        }
        // Padding outputs and depths are zeros (they add nothing to a sum).
        assert!(p.start[outs..].iter().all(|&s| s == 0));
        for j in 0..p.start.len() {
            let base = j / WIDTH * GROUP * WIDTH + j % WIDTH * QUAD;
            for k in depth..GROUP {
                assert_eq!(p.data[base + k / QUAD * WIDTH * QUAD + k % QUAD], 0);
            }
        }
        let zero = Int8Panels::quantise(&[0.0f32; 4], 1, 4);
        assert_eq!(zero.scale[0], 1.0);
    }

    /// The product's error against the f64 product of the unquantised operands, relative to
    /// the sizes of the sums: within what 8-bit steps on both sides allow.
    #[test]
    fn every_shape_is_within_quantisation_error_of_the_product_in_f64_on_every_path() {
        for (rows, outs, depth, pad) in [
            (1, 1, 1, 0),
            (2, 16, 8, 0),
            (3, 17, 13, 3),
            (13, 40, 65, 0),
            (25, 64, 384, 5),
            (16, 1536, 384, 0),
        ] {
            let xs = depth + pad;
            let xd: Vec<f32> = floats(rows * xs, 1).iter().map(|v| v * 3.0).collect();
            let wd = floats(outs * depth, 2);
            let bias = floats(outs, 3);
            let x = Rows {
                data: &xd,
                rows,
                cols: depth,
                stride: xs,
            };
            let w = Int8Panels::quantise(&wd, outs, depth);
            let want = reference(x, Rows::dense(&wd, outs, depth), Some(&bias));
            let y_stride = outs + 1;
            let mut y = vec![f32::NAN; rows * y_stride];
            product(x, &w, Some(&bias), &mut y, y_stride);
            let plain = serial_with(Kernel::Portable, x, &w, &bias);
            for kernel in kernels() {
                assert_eq!(
                    serial_with(kernel, x, &w, &bias),
                    plain,
                    "{kernel:?} and the portable loop differ at {rows}×{outs}×{depth}"
                );
            }
            // Each operand is within half a step of its value; the sum of `depth` products,
            // each off by at most |x|·step_w/2 + |w|·step_x/2 (and the product of the halves).
            let (step_x, step_w) = (3.0 / 127.0, 1.0 / 127.0);
            let bound = depth as f64 * (3.0 * step_w / 2.0 + step_x / 2.0 + step_x * step_w / 4.0);
            for i in 0..rows {
                for j in 0..outs {
                    let got = y[i * y_stride + j];
                    assert_eq!(got, plain[i * outs + j], "the paths differ at {i},{j}");
                    let want = want[i * outs + j];
                    assert!(
                        (f64::from(got) - want).abs() <= bound,
                        "{rows}×{outs}×{depth} at {i},{j}: {got} vs {want}"
                    );
                }
                if i + 1 < rows {
                    assert!(y[i * y_stride + outs].is_nan(), "wrote past an output row");
                }
            }
        }
    }

    /// The kernels besides the portable loop that this CPU runs.
    fn kernels() -> Vec<Kernel> {
        let mut all = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if x86::amx() {
                all.push(Kernel::Amx);
            }
            if x86::vnni() {
                all.push(Kernel::Vnni);
            }
            if x86::avx2() {
                all.push(Kernel::Avx2);
            }
        }
        all
    }

    /// The product of `x` and `w` by `kernel` on this thread (`x` quantised for it), plus
    /// `bias`, as a dense `rows × outs` matrix.
    fn serial_with(kernel: Kernel, x: Rows<'_>, w: &Int8Panels, bias: &[f32]) -> Vec<f32> {
        let q = Quantised::new(x, kernel);
        let mut y = vec![f32::NAN; x.rows * w.outs];
        let out = Out {
            y: &mut y,
            y_stride: w.outs,
            first: 0,
            bias: Some(bias),
            outs: w.outs,
        };
        serial(kernel, &q, 0..x.rows, w, 0..w.outs.div_ceil(WIDTH), out);
        y
    }

    #[test]
    fn the_kernel_named_is_the_fastest_this_cpu_has() {
        let want = match kernels().first() {
            Some(Kernel::Amx) => "amx",
            Some(Kernel::Vnni) => "avx512-vnni",
            Some(Kernel::Avx2) => "avx2",
            _ => "portable",
        };
        assert_eq!(kernel_name(), want);
        assert_eq!(accelerated(), want == "amx" || want == "avx512-vnni");
    }

    #[test]
    fn every_quantiser_gives_the_same_bytes_ties_to_even() {
        let mut groups: Vec<Vec<f32>> = (0..50u16)
            .map(|seed| {
                let times = f32::from(seed) + 0.5;
                floats(GROUP, u64::from(seed))
                    .iter()
                    .map(|v| v * times)
                    .collect()
            })
            .collect();
        // A largest magnitude of 127 makes each step 1: halves are ties.
        let mut ties = vec![127.0f32, 2.5, -3.5, 0.5, -0.5, 1.5];
        ties.resize(GROUP, 0.0);
        groups.push(ties);
        groups.push(vec![0.0; GROUP]);
        for group in &groups {
            let mut plain = [0u8; GROUP];
            let scale = quantise(group, &mut plain);
            if group[1] == 2.5 {
                assert_eq!(plain[..6], [255, 130, 124, 128, 128, 130]);
            }
            #[cfg(target_arch = "x86_64")]
            for kernel in kernels() {
                let mut fast = [0u8; GROUP];
                let quantise = match kernel {
                    Kernel::Amx | Kernel::Vnni => x86::quantise,
                    _ => x86::quantise256,
                };
                assert_eq!(quantise(group, &mut fast), scale, "{kernel:?}");
                assert_eq!(fast, plain, "{kernel:?}");
            }
        }
    }

    #[test]
    fn every_split_over_threads_gives_the_serial_product() {
        crate::matmul::tests::every_split(|x, w, outs, y, alone| {
            let packed = Int8Panels::quantise(w, outs, x.cols);
            if alone {
                let kernel = Kernel::detected();
                let q = Quantised::new(x, kernel);
                let out = Out {
                    y,
                    y_stride: outs,
                    first: 0,
                    bias: None,
                    outs,
                };
                serial(kernel, &q, 0..x.rows, &packed, 0..outs.div_ceil(WIDTH), out);
            } else {
                product(x, &packed, None, y, outs);
            }
        });
    }

    #[test]
    fn a_row_of_zeros_gives_the_bias_and_a_row_of_one_value_its_sums() {
        let w = Int8Panels::quantise(&[1.0f32, -1.0, 0.0, 1.0], 2, 2);
        let x = [0.0f32, 0.0, 2.0, 2.0];
        let mut y = vec![f32::NAN; 4];
        product(Rows::dense(&x, 2, 2), &w, Some(&[1.0, -1.0]), &mut y, 2);
        assert_eq!(y[..2], [1.0, -1.0]);
        for (got, want) in y[2..].iter().zip([1.0, 1.0]) {
            assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        }
    }
}
