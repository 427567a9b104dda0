//! The static table distilled from the transformer: every vocabulary token present, a saved
//! table loads back identical, and it still ranks a paraphrase above an unrelated question.
//! Needs the model: `scripts/fetch-model.sh` (the test command runs it).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use embedder::bert::{cosine, DIM};
use embedder::static_embed::StaticEmbedder;

#[test]
fn distilled_table_round_trips_and_ranks_paraphrases_first() {
    let dir = common::model_dir();
    let bert = common::load();
    let mut batches = 0;
    let table = StaticEmbedder::distill(&bert, |done, total| {
        batches += 1;
        assert!(done <= total);
    })
    .unwrap();
    assert_eq!(table.dim(), DIM);
    assert!(batches >= 30_000 / 512);

    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("static.bin");
    table.save(&path).unwrap();
    let loaded = StaticEmbedder::load(&path, &dir.join("tokenizer.json")).unwrap();
    let texts = [
        "What is the capital of France?",
        "Which city is the capital of France?",
        "How do I bake sourdough bread?",
    ];
    let a: Vec<Vec<f32>> = texts.iter().map(|t| table.embed(t).unwrap()).collect();
    let b: Vec<Vec<f32>> = texts.iter().map(|t| loaded.embed(t).unwrap()).collect();
    assert_eq!(a, b, "a saved table loads back identical");
    assert!((a[0].iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-5);
    assert!(
        cosine(&a[0], &a[1]) > cosine(&a[0], &a[2]) + 0.1,
        "paraphrase {} vs unrelated {}",
        cosine(&a[0], &a[1]),
        cosine(&a[0], &a[2])
    );
    assert_eq!(table.embed("").unwrap(), vec![0.0; DIM]);
    assert!(StaticEmbedder::load(&dir.join("config.json"), &dir.join("tokenizer.json")).is_err());
}

#[test]
fn a_mapped_row_is_its_own_rows_image_even_when_the_map_adds_into_its_output() {
    let dir = common::model_dir();
    let table = StaticEmbedder::load(&dir.join("static.bin"), &dir.join("tokenizer.json"))
        .expect("static table: run `gateway embed distill` (scripts/test.sh does)");
    // A map that adds into its output (as the loop detector's projection does): each row
    // must start from zeros, not from the row before it.
    let mapped = table.map_rows(2, |row, out| {
        out[0] += row[0];
        out[1] += row[1];
    });
    for id in [0u32, 1, 2, 1000, 2023, 30_000] {
        let (whole, image) = (table.embed_ids(&[id]), mapped.embed_ids(&[id]));
        let norm = whole[0].hypot(whole[1]);
        assert!(
            (image[0] - whole[0] / norm).abs() < 1e-3 && (image[1] - whole[1] / norm).abs() < 1e-3,
            "token {id}: {image:?} against {:?}",
            [whole[0] / norm, whole[1] / norm]
        );
    }
}
