//! CPU benchmark of the embedder: transformer and static embedding latency for texts of 16, 32,
//! 64 and 256 tokens, the verifier on one candidate pair, transformer batch throughput, and index
//! search time at 10k and 100k entries.
//!
//!   cargo run --release -p embedder --example embed_bench [-- MODEL_DIR]
//!
//! `PRECISION=f32` or `int8` keeps the transformer's matrices that way (default `f16`).
//! `ONLY=16` (a token count) embeds a text of that many tokens for ten seconds and prints its
//! p50 and p99, nothing else (for `perf record`).
//!
//! Needs the model (`scripts/fetch-model.sh`) and the static table (`gateway embed distill`).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "benchmark")]

mod common;

use std::path::PathBuf;
use std::time::Instant;

use common::unit;
use embedder::bert::{BertEmbedder, DIM};
use embedder::index::{CpuIndex, VectorIndex};
use embedder::static_embed::StaticEmbedder;

fn percentile(mut xs: Vec<f64>, p: f64) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[((xs.len() - 1) as f64 * p).round() as usize]
}

fn time<F: FnMut()>(n: usize, mut f: F) -> (f64, f64) {
    f(); // warm up
    let samples: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    (percentile(samples.clone(), 0.5), percentile(samples, 0.99))
}

/// A text of exactly `tokens` model tokens (with [CLS] and [SEP]).
fn text_of(bert: &BertEmbedder, tokens: usize) -> String {
    let mut words = Vec::new();
    let mut i = 0;
    loop {
        words.push(
            [
                "price", "of", "the", "cheapest", "flight", "to", "lisbon", "in", "may",
            ][i % 9],
        );
        i += 1;
        let t = words.join(" ");
        if bert.token_count(&t).unwrap() >= tokens {
            return t;
        }
    }
}

fn main() {
    let dir = std::env::args()
        .nth(1)
        .map_or_else(|| PathBuf::from("models/all-MiniLM-L6-v2"), PathBuf::from);
    let precision = common::precision_from_env();
    let bert = BertEmbedder::load_with(&dir, precision).expect("model: run scripts/fetch-model.sh");
    // Without the table (before `gateway embed distill`) the transformer's rows are still
    // measured.
    let table = StaticEmbedder::load(&dir.join("static.bin"), &dir.join("tokenizer.json")).ok();
    if table.is_none() {
        println!("(no static table: run `gateway embed distill`; its rows and the verifier's are left out)");
    }
    if let Ok(tokens) = std::env::var("ONLY") {
        let tokens: usize = tokens.parse().expect("ONLY: a token count");
        let text = text_of(&bert, tokens);
        let (start, mut times) = (Instant::now(), Vec::new());
        while start.elapsed().as_secs() < 10 {
            let t = Instant::now();
            bert.embed(&[text.as_str()]).unwrap();
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let n = times.len();
        let (p50, p99) = (percentile(times.clone(), 0.5), percentile(times, 0.99));
        println!("{tokens} tokens, {n} passes: p50 {p50:.3} ms, p99 {p99:.3} ms");
        return;
    }
    println!("| what | p50 ms | p99 ms |");
    println!("|---|---|---|");
    for tokens in [16, 32, 64, 256] {
        let text = text_of(&bert, tokens);
        let (p50, p99) = time(if tokens < 256 { 200 } else { 50 }, || {
            bert.embed(&[text.as_str()]).unwrap();
        });
        println!("| transformer, {tokens} tokens | {p50:.3} | {p99:.3} |");
        if let Some(table) = &table {
            let (p50, p99) = time(2000, || {
                table.embed(&text).unwrap();
            });
            println!("| static, {tokens} tokens | {p50:.4} | {p99:.4} |");
        }
    }
    if let Some(table) = &table {
        verifier_row(&bert, table);
    }
    let text = text_of(&bert, 32);
    let batch: Vec<&str> = vec![text.as_str(); 32];
    let t = Instant::now();
    let rounds = 10;
    for _ in 0..rounds {
        bert.embed(&batch).unwrap();
    }
    let per_s = (rounds * batch.len()) as f64 / t.elapsed().as_secs_f64();
    println!("| transformer throughput, batches of 32 × 32 tokens | {per_s:.0} texts/s | |");
    for n in [10_000u64, 100_000] {
        let mut idx = CpuIndex::new(DIM, n as usize, i64::MAX / 2);
        for i in 0..n {
            idx.insert(1, i, &unit(i, DIM), 0);
        }
        let q = unit(n + 7, DIM);
        let (p50, p99) = time(200, || {
            idx.search(1, &q, 5, 0.9, 1);
        });
        println!("| index search, {n} entries × {DIM} f32 | {p50:.3} | {p99:.3} |");
    }
}

/// The verifier judging one candidate pair (what a semantic lookup pays per candidate after
/// embedding the question; the stored side's vectors are kept with the entry).
fn verifier_row(bert: &BertEmbedder, table: &StaticEmbedder) {
    let verifier = embedder::verifier::Verifier::from_json(embedder::semantic::SHIPPED_VERIFIER)
        .expect("shipped verifier");
    let (qa, qb) = (
        "What was the IIT JEE 2016 cutoff for general category?",
        "What was the IIT JEE 2017 cutoff marks for the general category students?",
    );
    let v = bert.embed_with_tokens(&[qa, qb]).unwrap();
    let view = |text, i: usize| embedder::verifier::Text {
        text,
        sentence: &v[i].0,
        tokens: &v[i].1,
    };
    let (p50, p99) = time(500, || {
        verifier.probability(&view(qa, 0), &view(qb, 1), table);
    });
    println!("| verifier, one candidate pair (12 and 15 tokens) | {p50:.4} | {p99:.4} |");
}
