//! The CPU transformer embedder agrees with the reference pipeline on committed fixtures
//! (`scripts/embed-reference.py`: float64, the sentence-transformers steps for this model).
//! Needs the model: `scripts/fetch-model.sh` (the test command runs it).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use embedder::bert::{cosine, DIM};
use serde_json::Value;

fn fixtures() -> Vec<(String, usize, Vec<f32>)> {
    let text = include_str!("fixtures/minilm-reference.json");
    let v: Value = serde_json::from_str(text).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["text"].as_str().unwrap().to_owned(),
                c["tokens"].as_u64().unwrap() as usize,
                c["embedding"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn one_at_a_time_and_batched_match_the_reference_within_1e_4_cosine() {
    let model = common::load();
    let cases = fixtures();
    let texts: Vec<&str> = cases.iter().map(|(t, _, _)| t.as_str()).collect();
    let batched = model.embed(&texts).unwrap();
    let mut worst = 1.0f32;
    for ((text, tokens, reference), batch) in cases.iter().zip(&batched) {
        assert_eq!(model.token_count(text).unwrap(), *tokens, "{text:?}");
        let single = model.embed(&[text.as_str()]).unwrap().remove(0);
        assert_eq!(single.len(), DIM);
        let norm: f32 = single.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{text:?}: norm {norm}");
        for (label, got) in [("single", &single), ("batched", batch)] {
            let c = cosine(got, reference);
            worst = worst.min(c);
            assert!(c >= 1.0 - 1e-4, "{label} {text:?}: cosine {c}");
        }
    }
    eprintln!(
        "worst cosine to the reference over {} cases: {worst}",
        cases.len()
    );
}

#[test]
fn paraphrases_are_closer_than_unrelated_questions() {
    let model = common::load();
    let v = model
        .embed(&[
            "What is the capital of France?",
            "Which city is the capital of France?",
            "How do I bake sourdough bread?",
        ])
        .unwrap();
    assert!(cosine(&v[0], &v[1]) > 0.85);
    assert!(cosine(&v[0], &v[2]) < 0.3);
}

#[test]
fn token_vectors_come_with_the_same_sentence_vector() {
    let model = common::load();
    let texts = [
        "IIT JEE 2016 cutoff",
        "IIT JEE 2017 cutoff for general category",
    ];
    let plain = model.embed(&texts).unwrap();
    let with = model.embed_with_tokens(&texts).unwrap();
    for (i, (sentence, tokens)) in with.iter().enumerate() {
        assert!(cosine(sentence, &plain[i]) > 0.99999);
        assert_eq!(tokens.len(), model.token_count(texts[i]).unwrap() - 2);
        assert!(tokens
            .iter()
            .all(|t| (t.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-4));
    }
    // The differing year is the weakest contextual match.
    let best: Vec<f32> = with[0]
        .1
        .iter()
        .map(|a| with[1].1.iter().map(|b| cosine(a, b)).fold(-1.0, f32::max))
        .collect();
    let mean = best.iter().sum::<f32>() / best.len() as f32;
    assert!(best.iter().copied().fold(1.0, f32::min) < mean);
}

#[test]
fn a_pass_paused_between_layers_and_resumed_gives_the_same_vectors() {
    use embedder::bert::Embed;
    use embedder::forward::Progress;
    use std::cell::Cell;

    let model = common::load();
    let texts = ["How do I learn Rust?", "What is the capital of France?"];
    let whole = model.embed_with_tokens(&texts).unwrap();
    // Never told to stop: asked once before each of the six layers, the same vectors.
    let asked = Cell::new(0);
    let count = || {
        asked.set(asked.get() + 1);
        false
    };
    let kept = model.embed_with_tokens_until(&texts, &count).unwrap();
    assert_eq!(asked.get(), 6);
    assert_eq!(kept.done().expect("not paused"), whole);
    // Told to stop before the fourth layer, then before the sixth once resumed: paused twice,
    // each layer run once, and the vectors of the pass that never stopped.
    let asked = Cell::new(0);
    let stop_at = |n: usize| {
        let asked = &asked;
        move || {
            asked.set(asked.get() + 1);
            asked.get() == n
        }
    };
    let Progress::Paused(paused) = model.embed_with_tokens_until(&texts, &stop_at(4)).unwrap()
    else {
        panic!("not paused before the fourth layer");
    };
    assert_eq!(asked.get(), 4);
    let Progress::Paused(paused) = Embed::resume(&model, *paused, &stop_at(6)).unwrap() else {
        panic!("not paused before the sixth layer");
    };
    assert_eq!(asked.get(), 6);
    let done = Embed::resume(&model, *paused, &|| false).unwrap();
    assert_eq!(done.done().expect("finished"), whole);
    // Texts past one pass's 4,096 tokens: paused in the second pass, the first's vectors kept.
    let long: Vec<String> = (0..20)
        .map(|i| {
            format!(
                "{i} {}",
                "the cache answers a question it has seen before ".repeat(30)
            )
        })
        .collect();
    let long: Vec<&str> = long.iter().map(String::as_str).collect();
    let whole = model.embed_with_tokens(&long).unwrap();
    asked.set(0);
    let Progress::Paused(paused) = model.embed_with_tokens_until(&long, &stop_at(9)).unwrap()
    else {
        panic!("not paused in the second pass");
    };
    let done = Embed::resume(&model, *paused, &|| false).unwrap();
    assert_eq!(asked.get(), 9);
    assert_eq!(done.done().expect("finished"), whole);
    // Nothing to embed: nothing to pause.
    let empty = model.embed_with_tokens_until(&[], &|| true).unwrap();
    assert_eq!(empty.done(), Some(Vec::new()));
}
