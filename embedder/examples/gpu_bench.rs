//! GPU benchmark of the embedder (feature `cuda`): transformer batch throughput on the GPU
//! against the CPU, the static table on the GPU, and the index scan of 1M × 384 fp16 vectors
//! against the memory-bandwidth floor.
//!
//!   cargo run --release -p embedder --features cuda --example gpu_bench [-- MODEL_DIR]
//!
//! Needs the model (`scripts/fetch-model.sh`); uses the static table (`static.bin` beside the
//! model, from `gateway embed distill`) when present, a random table of the same shape if not.
//! Without a usable GPU it says why and exits 0.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "benchmark")]

mod common;

use std::path::PathBuf;
use std::time::Instant;

use common::unit;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaContext;
use embedder::bert::{BertEmbedder, Embed, DIM};
use embedder::cuda::{self, GpuEmbedder, GpuIndex, GpuStatic};
use embedder::static_embed::StaticEmbedder;

/// Rows of the scan benchmark.
const SCAN_ROWS: usize = 1_000_000;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// A text of exactly `tokens` model tokens (with [CLS] and [SEP]).
fn text_of(bert: &BertEmbedder, tokens: usize) -> String {
    let words = [
        "price", "of", "the", "cheapest", "flight", "to", "lisbon", "in", "may",
    ];
    let mut text = Vec::new();
    for i in 0.. {
        text.push(words[i % words.len()]);
        let t = text.join(" ");
        if bert.token_count(&t).unwrap() >= tokens {
            return t;
        }
    }
    unreachable!()
}

/// Texts per second of `f` over `texts` texts: one warm-up call, then calls until at least
/// `min_s` seconds or `max_rounds` rounds.
fn throughput(texts: usize, min_s: f64, max_rounds: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    let mut rounds = 0;
    while rounds < max_rounds && (rounds == 0 || t.elapsed().as_secs_f64() < min_s) {
        f();
        rounds += 1;
    }
    (rounds * texts) as f64 / t.elapsed().as_secs_f64()
}

/// Device-to-device copy bandwidth in bytes moved (read + write) per second: the median of
/// ten copies of 1 GiB.
fn copy_bandwidth() -> f64 {
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let bytes = 1usize << 30;
    let src = stream.alloc_zeros::<u8>(bytes).unwrap();
    let mut dst = stream.alloc_zeros::<u8>(bytes).unwrap();
    stream.memcpy_dtod(&src, &mut dst).unwrap();
    stream.synchronize().unwrap();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let samples: Vec<f64> = (0..10)
        .map(|_| {
            let start = stream.record_event(timing).unwrap();
            stream.memcpy_dtod(&src, &mut dst).unwrap();
            let end = stream.record_event(timing).unwrap();
            f64::from(start.elapsed_ms(&end).unwrap()) / 1e3
        })
        .collect();
    2.0 * bytes as f64 / median(samples)
}

fn main() {
    let dir = std::env::args().nth(1).map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../models/all-MiniLM-L6-v2"
            ))
        },
        PathBuf::from,
    );
    let devices = match cuda::available() {
        Ok(n) => n,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    println!(
        "device 0 of {devices}: {}",
        cuda::device_name(0).unwrap_or_else(|e| e.to_string())
    );
    let cpu = BertEmbedder::load(&dir).expect("model: run scripts/fetch-model.sh");
    let t = Instant::now();
    let gpu = GpuEmbedder::load(&dir, 0).unwrap();
    println!(
        "GpuEmbedder::load (upload + NVRTC): {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let text = text_of(&cpu, 32);

    println!();
    println!("| what | GPU | CPU | GPU / CPU |");
    println!("|---|---|---|---|");
    for batch in [1usize, 32, 256] {
        let texts = vec![text.as_str(); batch];
        let g = throughput(batch, 1.0, 200, || {
            gpu.embed_with_tokens(&texts).unwrap();
        });
        // The CPU only on a small sample: one timed call of at most 32 texts.
        let sample = &texts[..batch.min(32)];
        let c = throughput(sample.len(), 0.0, 1, || {
            Embed::embed_with_tokens(&cpu, sample).unwrap();
        });
        println!(
            "| transformer, batch {batch} × 32 tokens, with token vectors | {g:.0} texts/s | {c:.0} texts/s | {:.1}× |",
            g / c
        );
    }

    // Static table: the distilled one when present, else a random one of the same shape.
    let table_path = dir.join("static.bin");
    let tokenizer = cpu.tokenizer();
    let ids: Vec<u32> = tokenizer
        .encode(text.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec();
    let (gpu_static, cpu_static, label) = if table_path.is_file() {
        (
            GpuStatic::load(&table_path, 0).unwrap(),
            Some(StaticEmbedder::load(&table_path, &dir.join("tokenizer.json")).unwrap()),
            "distilled table",
        )
    } else {
        let vocab = tokenizer.get_vocab_size(true);
        let table: Vec<f32> = (0..vocab as u64).flat_map(|i| unit(i, DIM)).collect();
        (
            GpuStatic::new(&table, DIM, 0).unwrap(),
            None,
            "random table (no static.bin)",
        )
    };
    let batch: Vec<Vec<u32>> = vec![ids.clone(); 256];
    let g = throughput(batch.len(), 1.0, 1000, || {
        gpu_static.embed_ids(&batch).unwrap();
    });
    let c = cpu_static.as_ref().map(|s| {
        throughput(batch.len(), 0.5, 1000, || {
            for seq in &batch {
                std::hint::black_box(s.embed_ids(seq));
            }
        })
    });
    println!(
        "| static ({label}), batch 256 × {} ids | {g:.0} texts/s | {} | {} |",
        ids.len(),
        c.map_or("-".to_owned(), |c| format!("{c:.0} texts/s")),
        c.map_or("-".to_owned(), |c| format!("{:.1}×", g / c)),
    );

    // The index scan: 1M × 384 fp16 rows in one namespace.
    let t = Instant::now();
    let mut index = GpuIndex::new(DIM, SCAN_ROWS, i64::MAX / 4, 0).unwrap();
    let chunk = 65_536;
    for start in (0..SCAN_ROWS).step_by(chunk) {
        let end = (start + chunk).min(SCAN_ROWS);
        let vectors: Vec<Vec<f32>> = (start..end).map(|i| unit(i as u64, DIM)).collect();
        let entries: Vec<(u64, &[f32])> = vectors
            .iter()
            .enumerate()
            .map(|(i, v)| ((start + i) as u64, v.as_slice()))
            .collect();
        index.insert_many(1, &entries, 0).unwrap();
    }
    println!(
        "| index fill, {SCAN_ROWS} × {DIM} | {:.1} s | | |",
        t.elapsed().as_secs_f64()
    );
    let query = unit(SCAN_ROWS as u64 + 7, DIM);
    let kernel_ms = median(
        (0..21)
            .map(|_| f64::from(index.time_scan(1, &query, 5, 0.3, 1).unwrap()))
            .collect(),
    );
    // Threshold -1: every row is a candidate (the per-group top-k sees the most offers).
    let kernel_all_ms = median(
        (0..21)
            .map(|_| f64::from(index.time_scan(1, &query, 16, -1.0, 1).unwrap()))
            .collect(),
    );
    let search_ms = median(
        (0..21)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(embedder::index::VectorIndex::search(
                    &mut index, 1, &query, 5, 0.3, 1,
                ));
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    );
    let bandwidth = copy_bandwidth();
    let matrix_bytes = (2 * SCAN_ROWS * DIM) as f64;
    let floor_ms = matrix_bytes / bandwidth * 1e3;
    println!(
        "| scan kernel, {SCAN_ROWS} × {DIM} fp16, k = 5, threshold 0.3 (median of 21) | {kernel_ms:.3} ms | | |"
    );
    println!("| scan kernel, k = 16, threshold -1 (median of 21) | {kernel_all_ms:.3} ms | | |");
    println!("| search call (upload, scan, copy back, merge) | {search_ms:.3} ms | | |");
    println!(
        "| device-to-device copy bandwidth (read + write, 1 GiB) | {:.0} GB/s | | |",
        bandwidth / 1e9
    );
    println!(
        "| bandwidth floor of the scan (2·N·d bytes / copy bandwidth) | {floor_ms:.3} ms | | |"
    );
    println!(
        "| scan / floor (target ≤ 2×) | {:.2}× | | |",
        kernel_ms / floor_ms
    );
}
