//! The learned first stage with the shipped map and the distilled table: a stored question's
//! paraphrases go through to the transformer, including a rewording that shares few words;
//! unrelated questions are decided without it.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use std::sync::Arc;

use embedder::gate::{Gate, Stage};
use embedder::static_embed::StaticEmbedder;
use embedder::student::{Projection, StudentGate, MAX_SCAN};

fn table() -> StaticEmbedder {
    let dir = common::model_dir();
    StaticEmbedder::load(&dir.join("static.bin"), &dir.join("tokenizer.json"))
        .expect("static table: run `gateway embed distill` (scripts/test.sh does)")
}

fn gate(threshold: f32) -> StudentGate {
    StudentGate::new(Arc::new(table()), Projection::shipped().unwrap(), threshold).unwrap()
}

#[test]
fn a_table_the_map_was_not_fitted_to_is_refused() {
    // The same tokenizer over a table whose rows are shuffled between dimensions (a model of
    // the same size whose dimensions mean other things).
    let other = table().map_rows(384, |row, out| {
        for (i, o) in out.iter_mut().enumerate() {
            *o = row[(i * 97 + 13) % 384];
        }
    });
    let e = StudentGate::new(Arc::new(other), Projection::shipped().unwrap(), 0.45).unwrap_err();
    assert!(
        e.to_string().contains("does not fit this static table"),
        "{e}"
    );
}

fn store(g: &StudentGate, ns: u64, id: u64, text: &str) {
    g.insert(ns, id, &g.tokens(text).unwrap());
}

const COOK: &str = "How can I learn to cook Italian food at home?";
const DROUGHT: &str =
    "What is likely to happen to crop yields if a region experiences a long drought?";

#[test]
fn paraphrases_go_through_and_unrelated_questions_are_misses() {
    let g = gate(0.45);
    assert_eq!(g.check(1, COOK), Gate::Miss, "an empty namespace");
    store(&g, 1, 1, COOK);
    store(&g, 1, 2, DROUGHT);
    for paraphrase in [
        "How do I learn to cook Italian food at home?",
        "What's the best way to learn Italian cooking at home?",
        // Shares almost no words with DROUGHT (the token-overlap stage drops it).
        "How are harvests usually affected when an area faces extended drought?",
    ] {
        assert_eq!(g.check(1, paraphrase), Gate::Through, "{paraphrase}");
    }
    for unrelated in [
        "What is the capital of Australia?",
        "Why does my bicycle tyre keep going flat?",
        "Write a haiku about the sea.",
    ] {
        assert_eq!(g.check(1, unrelated), Gate::Miss, "{unrelated}");
    }
    assert_eq!(
        g.check(2, "How do I learn to cook Italian food at home?"),
        Gate::Miss,
        "another namespace holds nothing"
    );
    // The student's cosine orders them as the transformer would.
    assert!(
        g.cosine(COOK, "How do I learn to cook Italian food at home?")
            > g.cosine(COOK, "What is the capital of Australia?") + 0.3
    );
    // Off: everything goes through.
    assert_eq!(
        gate(0.0).check(1, "What is the capital of Australia?"),
        Gate::Through
    );
}

#[test]
fn forgotten_questions_no_longer_let_lookups_through_and_a_huge_namespace_is_not_scanned() {
    let g = gate(0.45);
    store(&g, 1, 1, COOK);
    store(&g, 1, 2, DROUGHT);
    store(&g, 3, 3, COOK);
    assert_eq!(g.len(), 3);
    g.retain(|id| id != 1);
    assert_eq!(g.len(), 2);
    assert_eq!(
        g.check(1, "How do I learn to cook Italian food at home?"),
        Gate::Miss
    );
    assert_eq!(
        g.check(3, "How do I learn to cook Italian food at home?"),
        Gate::Through
    );
    assert_eq!(
        g.check(
            1,
            "How are harvests usually affected when an area faces extended drought?"
        ),
        Gate::Through
    );
    // Past MAX_SCAN stored questions the gate lets every lookup through rather than scan.
    let tokens = g.tokens(DROUGHT).unwrap();
    for id in 10..(10 + MAX_SCAN as u64) {
        g.insert(1, id, &tokens);
    }
    assert_eq!(
        g.check(1, "What is the capital of Australia?"),
        Gate::Through
    );
    g.retain(|id| id < 10);
    assert_eq!(g.check(1, "What is the capital of Australia?"), Gate::Miss);
}

#[test]
fn a_lookup_learns_which_stored_questions_it_may_match() {
    use embedder::gate::Near;

    let g = gate(0.45);
    let near = |text: &str| g.near(1, &g.tokens(text).unwrap());
    assert_eq!(near(COOK), Near::Nothing, "an empty namespace");
    store(&g, 1, 1, COOK);
    store(&g, 1, 2, DROUGHT);
    store(
        &g,
        1,
        3,
        "Can you recommend books for learning Italian cooking at home?",
    );
    let Near::Only(ids) = near("What's the best way to learn Italian cooking at home?") else {
        panic!("a paraphrase of a stored question goes through");
    };
    assert!(ids.contains(&1) && !ids.contains(&2), "{ids:?}");
    assert_eq!(
        near("How are harvests usually affected when an area faces extended drought?"),
        Near::Only(vec![2])
    );
    assert_eq!(near("Write a haiku about the sea."), Near::Nothing);
    assert_eq!(gate(0.0).near(1, &g.tokens(COOK).unwrap()), Near::Unknown);
}
