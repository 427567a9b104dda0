//! Embed a list of texts with the GPU transformer and with the CPU one and write both as JSON,
//! for the GPU bundle's comparison with `sentence-transformers` itself
//! (`scripts/gpu/st_parity.py`, run by the bundle's `run.sh`):
//!
//!   cargo run --release -p embedder --features cuda --example gpu_embed -- MODEL_DIR TEXTS OUT
//!
//! `TEXTS` is a JSON array of strings (`embedder/tests/fixtures/parity-texts.json`). `OUT` gets
//! `{"device", "versions", "texts", "cpu": {"sentences", "tokens"}, "gpu": ... | null,
//! "gpu_skipped": reason | null}`: sentence vectors and each text's contextual token vectors
//! (real tokens, without `[CLS]`/`[SEP]`), all L2-normalised. Without a usable GPU, `gpu` is
//! null and `gpu_skipped` says why; the program still exits 0.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "check program")]

use std::path::PathBuf;

use embedder::bert::{BertEmbedder, Embed, TextVectors};
use embedder::cuda::{self, GpuEmbedder};
use embedder::forward::Precision;
use serde_json::{json, Value};

fn vectors(got: &[TextVectors]) -> Value {
    json!({
        "sentences": got.iter().map(|(s, _)| s.clone()).collect::<Vec<_>>(),
        "tokens": got.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>(),
    })
}

fn main() {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [dir, texts_path, out] = args.as_slice() else {
        eprintln!("usage: gpu_embed MODEL_DIR TEXTS.json OUT.json");
        std::process::exit(2);
    };
    let texts: Vec<String> =
        serde_json::from_slice(&std::fs::read(texts_path).expect("read the texts"))
            .expect("the texts file is a JSON array of strings");
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();

    // The CPU's f32 pass: the GPU keeps the checkpoint's f32 weights, so the two compare alike.
    let cpu = BertEmbedder::load_with(dir, Precision::F32).expect("the model loads on the CPU");
    let cpu_vectors = Embed::embed_with_tokens(&cpu, &refs).expect("CPU embedding");
    let (gpu, skipped, device, versions) = match cuda::available() {
        Ok(_) => {
            let gpu = GpuEmbedder::load(dir, 0).expect("the model loads on the GPU");
            let got = gpu.embed_with_tokens(&refs).expect("GPU embedding");
            (
                vectors(&got),
                Value::Null,
                json!(cuda::device_name(0).unwrap_or_else(|e| e.to_string())),
                json!(cuda::versions().unwrap_or_else(|e| e.to_string())),
            )
        }
        Err(e) => {
            println!("skipped: {e}");
            (Value::Null, json!(e.to_string()), Value::Null, Value::Null)
        }
    };
    let doc = json!({
        "device": device,
        "versions": versions,
        "texts": texts,
        "cpu": vectors(&cpu_vectors),
        "gpu": gpu,
        "gpu_skipped": skipped,
    });
    std::fs::write(out, serde_json::to_vec(&doc).unwrap()).expect("write the vectors");
    println!("{} texts embedded into {}", texts.len(), out.display());
}
