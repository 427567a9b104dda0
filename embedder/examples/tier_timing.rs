//! Per-prompt latency of the shipped tier classifier (`TierModel::score`): one warm-up pass over
//! the prompts, then every call of the timed passes is timed on its own. Prints the percentiles
//! of every call and of each prompt's fastest pass (less sensitive to a busy machine).
//!
//!   cargo run --release -p embedder --example tier_timing [-- DATA.jsonl [PASSES]]
//!
//! `DATA.jsonl` has a `prompt` field per line (default: the crate's copy of the RouteLLM MMLU dev
//! file, `tests/fixtures/routing-dev.jsonl`); `PASSES` timed passes (default 5).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "benchmark")]

use std::hint::black_box;
use std::time::Instant;

use embedder::tier::{TierModel, SHIPPED_TIER_MODEL};

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/routing-dev.jsonl"
        )
        .to_owned()
    });
    let passes: usize = args.next().map_or(5, |p| p.parse().expect("PASSES"));
    let text = std::fs::read_to_string(&path).expect("reading the prompts");
    let prompts: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            v["prompt"].as_str().expect("a prompt field").to_owned()
        })
        .collect();
    let model = TierModel::from_json(SHIPPED_TIER_MODEL).expect("shipped tier model");

    let mut checksum = 0.0f64;
    for p in &prompts {
        checksum += f64::from(black_box(model.score(black_box(p))).gain);
    }
    // micros[pass][prompt]
    let mut micros = vec![vec![0.0f64; prompts.len()]; passes];
    for pass in &mut micros {
        for (p, t_out) in prompts.iter().zip(pass.iter_mut()) {
            let t = Instant::now();
            let s = black_box(model.score(black_box(p)));
            *t_out = t.elapsed().as_secs_f64() * 1e6;
            black_box(s);
        }
    }
    // Each prompt's fastest pass: the cost of the code with the machine's noise (preemption,
    // interrupts) mostly left out.
    let mut best: Vec<f64> = (0..prompts.len())
        .map(|i| micros.iter().map(|pass| pass[i]).fold(f64::MAX, f64::min))
        .collect();
    let mut all: Vec<f64> = micros.into_iter().flatten().collect();
    println!(
        "{} prompts x {passes} passes (gain sum {checksum:.6})",
        prompts.len()
    );
    for (what, xs) in [("every call", &mut all), ("best of passes", &mut best)] {
        xs.sort_by(f64::total_cmp);
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        println!(
            "  {what:>14}: p50 {:6.2} µs  p90 {:6.2} µs  p99 {:6.2} µs  max {:7.2} µs  mean {mean:6.2} µs",
            percentile(xs, 0.5),
            percentile(xs, 0.9),
            percentile(xs, 0.99),
            xs[xs.len() - 1],
        );
    }
}
