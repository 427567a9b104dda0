//! Research tool (issue 19, item 3): for each pair of a JSONL pairs file
//! (`{"a","b","duplicate"[,"source"]}`), the shipped verifier's probability, the transformer and
//! static cosines, and both texts' model token ids, as JSON lines on stdout. With these,
//! `bench/semantic-prefilter.py gate` measures how many of the verifier's own hits a cheap first
//! stage would keep.
//!
//!   cargo run --release -p embedder --example pair_scores -- PAIRS [MODEL_DIR] > SCORES.jsonl
//!
//! With `STATIC_ONLY=1`: only the two texts' static sentence vectors (`static_a`, `static_b`),
//! in seconds (no transformer), to join with the scores line by line. With `PRECISION=f32` or
//! `int8`: the transformer's matrices kept as the checkpoint's `f32`, or quantised to 8-bit
//! integers, instead of the default `f16` (to compare the verifier's decisions each way); the thresholds for precision 0.8, 0.9 and 0.95
//! are printed on stderr.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "research tool"
)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;

use embedder::bert::{cosine, BertEmbedder};
use embedder::semantic::SHIPPED_VERIFIER;
use embedder::static_embed::StaticEmbedder;
use embedder::verifier::{Text, Verifier};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let pairs = PathBuf::from(&args[1]);
    let dir = args
        .get(2)
        .map_or_else(|| PathBuf::from("models/all-MiniLM-L6-v2"), PathBuf::from);
    let precision = common::precision_from_env();
    let bert = BertEmbedder::load_with(&dir, precision).expect("model");
    let table =
        StaticEmbedder::load(&dir.join("static.bin"), &dir.join("tokenizer.json")).expect("table");
    let verifier = Verifier::from_json(SHIPPED_VERIFIER).expect("verifier");
    for target in [0.8, 0.9, 0.95] {
        eprintln!(
            "threshold for precision {target}: {:?}",
            verifier.threshold_for(target)
        );
    }
    let rows: Vec<serde_json::Value> = BufReader::new(std::fs::File::open(&pairs).unwrap())
        .lines()
        .map(Result::unwrap)
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(&l).unwrap())
        .collect();
    let out = std::io::stdout();
    let mut out = out.lock();
    if std::env::var("STATIC_ONLY").is_ok_and(|v| v == "1") {
        for row in &rows {
            let line = serde_json::json!({
                "static_a": table.embed(row["a"].as_str().unwrap()).unwrap(),
                "static_b": table.embed(row["b"].as_str().unwrap()).unwrap(),
            });
            writeln!(out, "{line}").unwrap();
        }
        return;
    }
    for (n, chunk) in rows.chunks(16).enumerate() {
        let texts: Vec<&str> = chunk
            .iter()
            .flat_map(|r| [r["a"].as_str().unwrap(), r["b"].as_str().unwrap()])
            .collect();
        let vectors = bert.embed_with_tokens(&texts).unwrap();
        for (i, row) in chunk.iter().enumerate() {
            let (a, b) = (texts[2 * i], texts[2 * i + 1]);
            let (va, vb) = (&vectors[2 * i], &vectors[2 * i + 1]);
            let p = verifier.probability(
                &Text {
                    text: a,
                    sentence: &va.0,
                    tokens: &va.1,
                },
                &Text {
                    text: b,
                    sentence: &vb.0,
                    tokens: &vb.1,
                },
                &table,
            );
            let line = serde_json::json!({
                "source": row.get("source").and_then(|s| s.as_str()).unwrap_or("qqp"),
                "duplicate": row["duplicate"],
                "p": p,
                "cos": cosine(&va.0, &vb.0),
                "static_cos": cosine(&table.embed(a).unwrap(), &table.embed(b).unwrap()),
                "ids_a": table.ids(a).unwrap(),
                "ids_b": table.ids(b).unwrap(),
            });
            writeln!(out, "{line}").unwrap();
        }
        if n % 50 == 0 {
            eprintln!("{} / {}", n * 16, rows.len());
        }
    }
}
