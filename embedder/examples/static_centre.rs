//! Write `embedder/assets/static-centre.json`: the mean of the unit-normalised static
//! embeddings of a broad, fixed set of texts (every `a` and `b` of `qqp-dev.jsonl` and
//! `pairs-dev.jsonl`, every `prompt` of `routing-dev.jsonl`, in file order, summed in f64).
//!
//! The static embeddings of all texts share one large component (unrelated questions have
//! cosines near 0.84); subtracting this mean before comparing leaves what tells texts apart.
//! No shipped code reads it yet: it is what two measured experiments used (centred
//! near-duplicate sketches for the loop detector, centred static features for the semantic
//! cache's verifier; docs/benchmarks.md), neither of which beat what ships. A user of it must
//! take it as a committed asset, never compute it from traffic: replicas compare sketches
//! through Redis, so every one must centre the same way.
//!
//! ```sh
//! cargo run -p embedder --example static_centre -- /work/shared/data embedder/assets/static-centre.json [MODEL_DIR]
//! ```
//!
//! `MODEL_DIR` defaults to `models/all-MiniLM-L6-v2` (its `static.bin` from `gateway embed
//! distill`). It also prints how the centre separates duplicates from unrelated pairs (QQP
//! duplicates against each question paired with the next line's other question), raw and
//! centred; those pairs are among the texts the mean was taken over.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "a generator run by hand"
)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use embedder::static_embed::StaticEmbedder;
use serde_json::Value;

/// (file, the text fields read from each line).
const SOURCES: &[(&str, &[&str])] = &[
    ("qqp-dev.jsonl", &["a", "b"]),
    ("pairs-dev.jsonl", &["a", "b"]),
    ("routing-dev.jsonl", &["prompt"]),
];

fn lines(path: &Path) -> Vec<Value> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    BufReader::new(f)
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na * nb)
    }
}

fn percentile(v: &mut [f32], p: f64) -> f32 {
    v.sort_by(f32::total_cmp);
    #[expect(clippy::cast_possible_truncation, reason = "an index")]
    #[expect(clippy::cast_sign_loss, reason = "p in 0..=1")]
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let data = PathBuf::from(
        args.get(1)
            .expect("usage: static_centre DATA_DIR OUT [MODEL_DIR]"),
    );
    let out = PathBuf::from(
        args.get(2)
            .expect("usage: static_centre DATA_DIR OUT [MODEL_DIR]"),
    );
    let model = PathBuf::from(
        args.get(3)
            .map_or("models/all-MiniLM-L6-v2", String::as_str),
    );
    let table = StaticEmbedder::load(&model.join("static.bin"), &model.join("tokenizer.json"))
        .expect("the static table (gateway embed distill)");
    let dim = table.dim();
    let mut sum = vec![0f64; dim];
    let (mut texts, mut empty) = (0usize, 0usize);
    let mut sources = Vec::new();
    let mut qqp = Vec::new();
    for (file, fields) in SOURCES {
        let rows = lines(&data.join(file));
        let mut n = 0usize;
        for row in &rows {
            for field in *fields {
                let text = row[*field].as_str().expect("a text field");
                // `embed` is the L2-normalised mean of the token rows: a unit vector.
                let v = table.embed(text).expect("tokenized");
                if v.iter().all(|x| *x == 0.0) {
                    empty += 1;
                    continue;
                }
                for (s, x) in sum.iter_mut().zip(&v) {
                    *s += f64::from(*x);
                }
                n += 1;
            }
        }
        texts += n;
        sources.push(
            serde_json::json!({"file": file, "fields": fields, "lines": rows.len(), "texts": n}),
        );
        if *file == "qqp-dev.jsonl" {
            qqp = rows;
        }
    }
    #[expect(
        clippy::cast_possible_truncation,
        reason = "f32 is the table's precision"
    )]
    let centre: Vec<f32> = sum.iter().map(|s| (s / texts as f64) as f32).collect();
    let norm = centre.iter().map(|x| x * x).sum::<f32>().sqrt();

    // How well it separates: raw and centred cosines of QQP duplicates and of unrelated pairs.
    let centred = |text: &str| -> Vec<f32> {
        let v = table.embed(text).unwrap();
        v.iter().zip(&centre).map(|(x, c)| x - c).collect()
    };
    let raw = |text: &str| table.embed(text).unwrap();
    let (mut dup, mut dup_c, mut unrel, mut unrel_c) = (vec![], vec![], vec![], vec![]);
    for (i, row) in qqp.iter().enumerate() {
        let a = row["a"].as_str().unwrap();
        if row["duplicate"].as_bool() == Some(true) {
            let b = row["b"].as_str().unwrap();
            dup.push(cosine(&raw(a), &raw(b)));
            dup_c.push(cosine(&centred(a), &centred(b)));
        }
        let other = qqp[(i + 1) % qqp.len()]["b"].as_str().unwrap();
        unrel.push(cosine(&raw(a), &raw(other)));
        unrel_c.push(cosine(&centred(a), &centred(other)));
    }
    for (name, v) in [
        ("qqp duplicates, raw", &mut dup),
        ("qqp duplicates, centred", &mut dup_c),
        ("unrelated pairs, raw", &mut unrel),
        ("unrelated pairs, centred", &mut unrel_c),
    ] {
        let n = v.len();
        println!(
            "{name} ({n}): p1 {:.3}  median {:.3}  p99 {:.3}  p99.9 {:.3}",
            percentile(v, 0.01),
            percentile(v, 0.5),
            percentile(v, 0.99),
            percentile(v, 0.999)
        );
    }

    let asset = serde_json::json!({
        "what": "the mean of the unit-normalised static embeddings (the L2-normalised mean of the \
                 distilled token rows, StaticEmbedder::embed) of every text below, summed in f64 in \
                 file order; subtracted from a unit static embedding before near-duplicate sketches \
                 are compared (gateway/src/guard/near.rs)",
        "regenerate": "cargo run -p embedder --example static_centre -- /work/shared/data \
                       embedder/assets/static-centre.json",
        "model": "all-MiniLM-L6-v2, static.bin from `gateway embed distill`",
        "vocab": vocab_of(&model),
        "dim": dim,
        "sources": sources,
        "texts": texts,
        "texts_without_tokens": empty,
        "norm": norm,
        "vector": centre,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&asset).unwrap() + "\n").unwrap();
    println!(
        "{texts} texts, centre norm {norm:.4}, written to {}",
        out.display()
    );
}

/// Rows of the table file (its header's vocabulary size).
fn vocab_of(model: &Path) -> usize {
    let (table, dim) =
        embedder::static_embed::read_table::<f32>(&model.join("static.bin")).unwrap();
    table.len() / dim
}
