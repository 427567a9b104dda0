//! Shared by the embedder's integration tests.

use std::path::PathBuf;

use embedder::bert::BertEmbedder;
use embedder::forward::Precision;

/// The model directory: `MODEL_DIR`, or the workspace's `models/all-MiniLM-L6-v2`.
pub fn model_dir() -> PathBuf {
    std::env::var_os("MODEL_DIR").map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../models/all-MiniLM-L6-v2"
            ))
        },
        PathBuf::from,
    )
}

/// The transformer as the gateway runs it, or a failure telling how to get the model.
#[allow(dead_code, reason = "not every test binary needs the transformer")]
pub fn load() -> BertEmbedder {
    load_with(Precision::default())
}

/// The transformer with its matrices at `precision`.
#[allow(dead_code, reason = "not every test binary needs the transformer")]
pub fn load_with(precision: Precision) -> BertEmbedder {
    let dir = model_dir();
    assert!(
        BertEmbedder::present(&dir),
        "no model in {}: run scripts/fetch-model.sh",
        dir.display()
    );
    BertEmbedder::load_with(&dir, precision).expect("the model loads")
}
