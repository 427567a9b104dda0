//! Shared by the embedder's examples (benchmarks). Each example uses some of it.

#![allow(dead_code, reason = "each example uses some of these")]

use embedder::forward::Precision;

/// The transformer's precision named by `PRECISION` (`f16`, `f32` or `int8`; unset: the
/// default).
pub fn precision_from_env() -> Precision {
    std::env::var("PRECISION").map_or(Precision::default(), |p| {
        p.parse().expect("PRECISION: f16, f32 or int8")
    })
}

/// A deterministic pseudo-random unit vector of `dim` dimensions (xorshift from `seed`).
pub fn unit(seed: u64, dim: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v: Vec<f32> = (0..dim)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let n = v.iter().map(|a| a * a).sum::<f32>().sqrt();
    v.iter_mut().for_each(|a| *a /= n);
    v
}
