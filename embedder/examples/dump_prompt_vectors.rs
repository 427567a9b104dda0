//! Throwaway research tool: for each row of a JSONL file with a `prompt` field, write the
//! transformer sentence vector (little-endian f32 x 384, file order) to `OUT_PREFIX.f32` and the
//! static-table vector to `OUT_PREFIX.static.f32`. Distills `static.bin` when it is missing.
//!
//!   cargo run --release -p embedder --example dump_prompt_vectors -- FILE OUT_PREFIX [MODEL_DIR]

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "research tool"
)]

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::PathBuf;

use embedder::bert::BertEmbedder;
use embedder::static_embed::StaticEmbedder;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let file = PathBuf::from(&args[1]);
    let prefix = &args[2];
    let dir = args
        .get(3)
        .map_or_else(|| PathBuf::from("models/all-MiniLM-L6-v2"), PathBuf::from);
    let bert = BertEmbedder::load(&dir).expect("model");
    let table_path = dir.join("static.bin");
    if !StaticEmbedder::is_current(&table_path) {
        let t = StaticEmbedder::distill(&bert, |_, _| {}).unwrap();
        t.save(&table_path).unwrap();
    }
    let table = StaticEmbedder::load(&table_path, &dir.join("tokenizer.json")).expect("table");
    let mut texts = Vec::new();
    for line in BufReader::new(std::fs::File::open(&file).unwrap()).lines() {
        let line = line.unwrap();
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        texts.push(v["prompt"].as_str().unwrap().to_owned());
    }
    let mut dense = BufWriter::new(std::fs::File::create(format!("{prefix}.f32")).unwrap());
    let mut stat = BufWriter::new(std::fs::File::create(format!("{prefix}.static.f32")).unwrap());
    for chunk in texts.chunks(32) {
        let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
        for v in bert.embed(&refs).unwrap() {
            for x in v {
                dense.write_all(&x.to_le_bytes()).unwrap();
            }
        }
        for t in chunk {
            for x in table.embed(t).unwrap() {
                stat.write_all(&x.to_le_bytes()).unwrap();
            }
        }
    }
    eprintln!("{} prompts", texts.len());
}
