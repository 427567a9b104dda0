//! Throwaway research tool: for each pair of a JSONL pairs file ({"a","b","duplicate"}), write
//! the transformer sentence vectors of `a` and `b` (little-endian f32, 2 x 384 per pair, in file
//! order) to `OUT_PREFIX.f32`, the static-table sentence vectors likewise to
//! `OUT_PREFIX.static.f32`, the model token ids of each text (without [CLS]/[SEP]) as JSON lines
//! to `OUT_PREFIX.ids.jsonl`, and the contextual token vectors (L2-normalised, f16 bits, the
//! tokens in `ids.jsonl` order, truncated to the model's limit) to `OUT_PREFIX.tok.f16`.
//!
//!   cargo run --release -p embedder --example dump_pair_vectors -- PAIRS OUT_PREFIX [MODEL_DIR]

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "research tool"
)]

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::PathBuf;
use std::time::Instant;

use embedder::bert::BertEmbedder;
use embedder::static_embed::StaticEmbedder;

/// f32 -> IEEE half bits (round to nearest, no NaN care needed for unit vectors).
fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let man = b & 0x007f_ffff;
    if exp <= 0 {
        if exp < -10 {
            return sign;
        }
        let m = (man | 0x0080_0000) >> (1 - exp);
        return sign | ((m + 0x1000) >> 13) as u16;
    }
    if exp >= 31 {
        return sign | 0x7c00;
    }
    let v = ((exp as u32) << 10) | (man >> 13);
    let round = (man >> 12) & 1;
    sign | (v + round) as u16
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let pairs = PathBuf::from(&args[1]);
    let prefix = &args[2];
    let dir = args
        .get(3)
        .map_or_else(|| PathBuf::from("models/all-MiniLM-L6-v2"), PathBuf::from);
    let bert = BertEmbedder::load(&dir).expect("model");
    let table =
        StaticEmbedder::load(&dir.join("static.bin"), &dir.join("tokenizer.json")).expect("table");
    let mut texts: Vec<String> = Vec::new();
    for line in BufReader::new(std::fs::File::open(&pairs).unwrap()).lines() {
        let line = line.unwrap();
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        texts.push(v["a"].as_str().unwrap().to_owned());
        texts.push(v["b"].as_str().unwrap().to_owned());
    }
    eprintln!("{} pairs", texts.len() / 2);
    let mut out = BufWriter::new(std::fs::File::create(format!("{prefix}.f32")).unwrap());
    let mut stat = BufWriter::new(std::fs::File::create(format!("{prefix}.static.f32")).unwrap());
    let mut ids = BufWriter::new(std::fs::File::create(format!("{prefix}.ids.jsonl")).unwrap());
    let mut tok = BufWriter::new(std::fs::File::create(format!("{prefix}.tok.f16")).unwrap());
    let t0 = Instant::now();
    // Sort by length within the run so batches pad little, then write in file order.
    let mut order: Vec<usize> = (0..texts.len()).collect();
    order.sort_by_key(|&i| texts[i].len());
    let mut sent: Vec<Vec<f32>> = vec![Vec::new(); texts.len()];
    let mut toks: Vec<Vec<Vec<f32>>> = vec![Vec::new(); texts.len()];
    for (n, chunk) in order.chunks(32).enumerate() {
        let batch: Vec<&str> = chunk.iter().map(|&i| texts[i].as_str()).collect();
        let res = bert.embed_with_tokens(&batch).unwrap();
        for (&i, (p, t)) in chunk.iter().zip(res) {
            sent[i] = p;
            toks[i] = t;
        }
        if n % 100 == 0 {
            eprintln!(
                "{} / {} texts, {:.0}s",
                n * 32,
                texts.len(),
                t0.elapsed().as_secs_f64()
            );
        }
    }
    for (i, text) in texts.iter().enumerate() {
        for x in &sent[i] {
            out.write_all(&x.to_le_bytes()).unwrap();
        }
        for x in table.embed(text).unwrap() {
            stat.write_all(&x.to_le_bytes()).unwrap();
        }
        let enc = bert.tokenizer().encode(text.as_str(), true).unwrap();
        let real: Vec<u32> = enc
            .get_ids()
            .iter()
            .zip(enc.get_attention_mask())
            .filter(|(_, &m)| m == 1)
            .map(|(&id, _)| id)
            .collect();
        let inner = &real[1..real.len().saturating_sub(1).max(1)];
        assert_eq!(inner.len(), toks[i].len(), "token count of text {i}");
        serde_json::to_writer(&mut ids, inner).unwrap();
        ids.write_all(b"\n").unwrap();
        for v in &toks[i] {
            for &x in v {
                tok.write_all(&f16_bits(x).to_le_bytes()).unwrap();
            }
        }
    }
    out.flush().unwrap();
    stat.flush().unwrap();
    ids.flush().unwrap();
    tok.flush().unwrap();
    eprintln!("done in {:.0}s", t0.elapsed().as_secs_f64());
}
