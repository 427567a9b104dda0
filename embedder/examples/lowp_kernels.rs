//! Would a lower-precision kernel pay for the transformer's products on this CPU? One product of
//! the size that dominates a short text's pass (16 tokens against all-MiniLM-L6's 1536 × 384
//! feed-forward matrix), on one thread, three ways, each with sixteen outputs per register and
//! eight activation rows per block:
//!
//! - `shipped f16`: the gateway's own kernel (`embedder::matmul::panels`, one thread);
//! - `shipped int8`: the gateway's own 8-bit kernel (`embedder::matmul::int8`, one thread, the
//!   activations quantised on each call; AMX, AVX-512 VNNI, AVX2 or a portable loop);
//! - `f16`: the same arithmetic (weights `f16` in panels, widened to `f32`, one fused
//!   multiply-add per weight; activations `f32`) in the simple kernel the next two share;
//! - `bf16`: weights and activations rounded to bfloat16, two products summed in `f32` per
//!   instruction (AVX-512 BF16's `vdpbf16ps`);
//! - `int8`: weights quantised per output (`i8`), activations per row (`u8`, zero point 128),
//!   four products summed in `i32` per instruction (AVX-512 VNNI's `vpdpbusd`).
//!
//! It prints the time per product and each way's error against an `f64` product (root mean
//! square, relative). The data are random (uniform), not the model's: real activations have
//! outliers that make per-row `int8` worse; this measures the kernels, not the model's accuracy.
//!
//!   cargo run --release -p embedder --example lowp_kernels
//!
//! A way the CPU lacks is skipped (said so).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "benchmark")]
#![cfg_attr(target_arch = "x86_64", allow(unsafe_code))]

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m512bh, _mm256_loadu_si256, _mm512_cvtph_ps, _mm512_dpbf16_ps, _mm512_dpbusd_epi32,
        _mm512_fmadd_ps, _mm512_loadu_si512, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps,
        _mm512_setzero_si512, _mm512_storeu_ps, _mm512_storeu_si512,
    };

    use half::{bf16, f16};

    /// Activation rows (tokens).
    pub const M: usize = 16;
    /// Depth (the model's width).
    pub const K: usize = 384;
    /// Outputs (the feed-forward width).
    pub const N: usize = 1536;

    /// `y = x·wᵀ` with `w` packed `[N/16][K][16]` as `f16`.
    ///
    /// # Safety
    /// AVX-512 F present; `x` holds `M × K`, `w` `N × K`, `y` `M × N` elements.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn f16_product(x: &[f32], w: &[f16], y: &mut [f32]) {
        for p in 0..N / 16 {
            for rows in 0..M / 8 {
                let mut acc = [_mm512_setzero_ps(); 8];
                for k in 0..K {
                    // SAFETY: in bounds by the sizes above.
                    let wv = unsafe {
                        _mm512_cvtph_ps(_mm256_loadu_si256(w.as_ptr().add((p * K + k) * 16).cast()))
                    };
                    for (r, a) in acc.iter_mut().enumerate() {
                        let xv = _mm512_set1_ps(x[(rows * 8 + r) * K + k]);
                        *a = _mm512_fmadd_ps(xv, wv, *a);
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    let out = &mut y[(rows * 8 + r) * N + p * 16..][..16];
                    // SAFETY: sixteen floats writable at `out`.
                    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *a) };
                }
            }
        }
    }

    /// `y = x·wᵀ` with `w` packed `[N/16][K/2][16][2]` and `x` as pairs, both bfloat16.
    ///
    /// # Safety
    /// AVX-512 F and BF16 present; `x` holds `M × K/2` pairs, `w` `N × K`, `y` `M × N`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn bf16_product(x: &[u32], w: &[bf16], y: &mut [f32]) {
        for p in 0..N / 16 {
            for rows in 0..M / 8 {
                let mut acc = [_mm512_setzero_ps(); 8];
                for k2 in 0..K / 2 {
                    // SAFETY: in bounds by the sizes above; a bf16 vector is 32 lanes of bits.
                    let wv: __m512bh = unsafe {
                        std::mem::transmute(_mm512_loadu_si512(
                            w.as_ptr().add((p * K / 2 + k2) * 32).cast(),
                        ))
                    };
                    for (r, a) in acc.iter_mut().enumerate() {
                        let pair = x[(rows * 8 + r) * (K / 2) + k2] as i32;
                        // SAFETY: sixteen copies of a pair of bf16 bits.
                        let xv: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(pair)) };
                        *a = _mm512_dpbf16_ps(*a, xv, wv);
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    let out = &mut y[(rows * 8 + r) * N + p * 16..][..16];
                    // SAFETY: sixteen floats writable at `out`.
                    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *a) };
                }
            }
        }
    }

    /// `y = x·wᵀ` in integers, `w` packed `[N/16][K/4][16][4]` as `i8`, `x` as four `u8` a lane.
    ///
    /// # Safety
    /// AVX-512 F and VNNI present; `x` holds `M × K/4` quads, `w` `N × K`, `y` `M × N`.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn int8_product(x: &[u32], w: &[i8], y: &mut [i32]) {
        for p in 0..N / 16 {
            for rows in 0..M / 8 {
                let mut acc = [_mm512_setzero_si512(); 8];
                for k4 in 0..K / 4 {
                    // SAFETY: in bounds by the sizes above.
                    let wv =
                        unsafe { _mm512_loadu_si512(w.as_ptr().add((p * K / 4 + k4) * 64).cast()) };
                    for (r, a) in acc.iter_mut().enumerate() {
                        let quad = _mm512_set1_epi32(x[(rows * 8 + r) * (K / 4) + k4] as i32);
                        *a = _mm512_dpbusd_epi32(*a, quad, wv);
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    let out = &mut y[(rows * 8 + r) * N + p * 16..][..16];
                    // SAFETY: sixteen integers writable at `out`.
                    unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), *a) };
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn main() {
    use half::{bf16, f16};
    use std::time::Instant;
    use x86::{K, M, N};

    let mut seed = 1u64;
    let mut uniform = || {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let x: Vec<f32> = (0..M * K).map(|_| uniform()).collect();
    let w: Vec<f32> = (0..N * K).map(|_| uniform() * 0.1).collect();
    let exact: Vec<f64> = (0..M * N)
        .map(|i| {
            let (r, j) = (i / N, i % N);
            (0..K)
                .map(|k| f64::from(x[r * K + k]) * f64::from(w[j * K + k]))
                .sum()
        })
        .collect();
    let error = |y: &[f64]| {
        let (e, n) = y.iter().zip(&exact).fold((0.0, 0.0), |(e, n), (a, b)| {
            (e + (a - b) * (a - b), n + b * b)
        });
        (e / n).sqrt()
    };
    // The best of five rounds of 400 products (another process's burst slows a round, never
    // speeds one up).
    let time = |f: &mut dyn FnMut()| {
        f();
        let runs = 400;
        (0..5)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..runs {
                    f();
                }
                t.elapsed().as_secs_f64() / f64::from(runs) * 1e6
            })
            .fold(f64::INFINITY, f64::min)
    };
    let flops = 2.0 * (M * N * K) as f64;
    let report = |name: &str, us: f64, err: f64| {
        println!(
            "{name}: {us:.1} µs per product ({:.0} GFLOP/s), relative error {err:.2e}",
            flops / us / 1e3
        );
    };

    // The shipped kernel (its own panels and blocking), on one thread.
    let wt: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let panels = embedder::matmul::panels::Panels::pack(&wt, N, K);
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let mut ys = vec![0.0f32; M * N];
    let shipped = one.install(|| {
        time(&mut || {
            embedder::matmul::panels::product(
                embedder::matmul::Rows::dense(&x, M, K),
                &panels,
                None,
                &mut ys,
                N,
            );
        })
    });
    report(
        "shipped f16",
        shipped,
        error(&ys.iter().map(|&v| f64::from(v)).collect::<Vec<_>>()),
    );

    // The shipped int8 kernel (whichever this CPU runs: AMX, AVX-512 VNNI, AVX2 or the portable
    // loop), on one thread, activations quantised on each call as in the model.
    let quantised = embedder::matmul::int8::Int8Panels::quantise(&w, N, K);
    let shipped8 = one.install(|| {
        time(&mut || {
            embedder::matmul::int8::product(
                embedder::matmul::Rows::dense(&x, M, K),
                &quantised,
                None,
                &mut ys,
                N,
            );
        })
    });
    report(
        "shipped int8",
        shipped8,
        error(&ys.iter().map(|&v| f64::from(v)).collect::<Vec<_>>()),
    );

    // f16 in the simple kernel the other two share.
    let mut wf = vec![f16::ZERO; N * K];
    for j in 0..N {
        for k in 0..K {
            wf[(j / 16 * K + k) * 16 + j % 16] = f16::from_f32(w[j * K + k]);
        }
    }
    let mut y = vec![0.0f32; M * N];
    // SAFETY: AVX-512 F checked; sizes as the kernel asks.
    let f16_us = if is_x86_feature_detected!("avx512f") {
        let us = time(&mut || unsafe { x86::f16_product(&x, &wf, &mut y) });
        report(
            "f16 ",
            us,
            error(&y.iter().map(|&v| f64::from(v)).collect::<Vec<_>>()),
        );
        Some(us)
    } else {
        println!("f16: no AVX-512 here (the gateway uses its AVX2 kernel)");
        None
    };

    // bf16 weights and activations.
    let mut wb = vec![bf16::ZERO; N * K];
    for j in 0..N {
        for k in 0..K {
            wb[((j / 16 * K + k) / 2 * 16 + j % 16) * 2 + k % 2] = bf16::from_f32(w[j * K + k]);
        }
    }
    let xb: Vec<u32> = (0..M * K / 2)
        .map(|i| {
            let (r, k2) = (i / (K / 2), i % (K / 2));
            let lo = u32::from(bf16::from_f32(x[r * K + 2 * k2]).to_bits());
            let hi = u32::from(bf16::from_f32(x[r * K + 2 * k2 + 1]).to_bits());
            lo | hi << 16
        })
        .collect();
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16") {
        // SAFETY: AVX-512 F and BF16 checked; sizes as the kernel asks.
        let us = time(&mut || unsafe { x86::bf16_product(&xb, &wb, &mut y) });
        report(
            "bf16",
            us,
            error(&y.iter().map(|&v| f64::from(v)).collect::<Vec<_>>()),
        );
        if let Some(base) = f16_us {
            println!("  {:.2}x the f16 kernel's speed", base / us);
        }
    } else {
        println!("bf16: no AVX-512 BF16 here");
    }

    // int8: weights per output, activations per row (u8 around 128).
    let w_scale: Vec<f32> = (0..N)
        .map(|j| w[j * K..][..K].iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0)
        .collect();
    let mut wq = vec![0i8; N * K];
    let mut w_sum = vec![0i32; N];
    for j in 0..N {
        for k in 0..K {
            let q = (w[j * K + k] / w_scale[j]).round().clamp(-127.0, 127.0) as i8;
            wq[((j / 16 * K + k) / 4 * 16 + j % 16) * 4 + k % 4] = q;
            w_sum[j] += i32::from(q);
        }
    }
    let x_scale: Vec<f32> = (0..M)
        .map(|r| x[r * K..][..K].iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0)
        .collect();
    let xq: Vec<u32> = (0..M * K / 4)
        .map(|i| {
            let (r, k4) = (i / (K / 4), i % (K / 4));
            (0..4).fold(0u32, |quad, b| {
                let q = (x[r * K + 4 * k4 + b] / x_scale[r]).round() as i32 + 128;
                quad | (q as u32) << (8 * b)
            })
        })
        .collect();
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni") {
        let mut yi = vec![0i32; M * N];
        // SAFETY: AVX-512 F and VNNI checked; sizes as the kernel asks.
        let us = time(&mut || unsafe { x86::int8_product(&xq, &wq, &mut yi) });
        let y: Vec<f64> = (0..M * N)
            .map(|i| {
                let (r, j) = (i / N, i % N);
                f64::from(yi[i] - 128 * w_sum[j]) * f64::from(x_scale[r]) * f64::from(w_scale[j])
            })
            .collect();
        report("int8", us, error(&y));
        if let Some(base) = f16_us {
            println!("  {:.2}x the f16 kernel's speed", base / us);
        }
    } else {
        println!("int8: no AVX-512 VNNI here");
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("lowp_kernels: x86-64 only");
}
