//! The verifier's trainer end to end on a small synthetic set: questions that differ only in a
//! year are not duplicates, and cosine similarity cannot see it. Vectors come from the static
//! table (the transformer is not needed to exercise training), so the test runs in seconds.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use std::collections::HashMap;

use embedder::eval::threshold_for_precision;
use embedder::static_embed::StaticEmbedder;
use embedder::verifier::{train, Calibration, Embedded, Sources, TrainOptions, Verifier};

fn table() -> StaticEmbedder {
    let dir = common::model_dir();
    StaticEmbedder::load(&dir.join("static.bin"), &dir.join("tokenizer.json"))
        .expect("static table: run `gateway embed distill` (scripts/test.sh does)")
}

/// Static vectors standing in for the transformer's, which reads at most 254 tokens.
fn embedded(table: &StaticEmbedder, text: String) -> Embedded {
    let ids = table.ids(&text).unwrap();
    Embedded {
        sentence: table.embed_ids(&ids),
        tokens: ids
            .iter()
            .take(254)
            .map(|&id| table.embed_ids(&[id]))
            .collect(),
        text,
    }
}

#[test]
fn the_trained_verifier_sees_what_cosine_cannot_and_its_artefact_round_trips() {
    let table = table();
    let subjects = [
        "IIT JEE", "GATE", "CAT", "NEET", "UPSC", "SAT", "GRE", "GMAT", "AIEEE", "CLAT", "BITSAT",
        "XAT", "MAT", "IELTS", "TOEFL", "LSAT", "MCAT", "ACT", "SSC", "IBPS",
    ];
    let forms = [
        "What was the {s} cutoff in {y}?",
        "What is the {s} {y} cutoff?",
        "How high was the {s} cutoff for {y}?",
        "{s} {y} cutoff marks?",
    ];
    let mut rng = embedder::learn::Rng(42);
    let mut pairs = Vec::new();
    // Three sources that share no text: the exams by index modulo 3.
    let mut sources = Sources {
        names: vec!["exams-0".into(), "exams-1".into(), "exams-2".into()],
        of: Vec::new(),
    };
    for _ in 0..600 {
        let at = (rng.next_u64() % subjects.len() as u64) as usize;
        sources.of.push(at % 3);
        let s = subjects[at];
        let (f1, f2) = (rng.next_u64() % 4, rng.next_u64() % 4);
        let y1 = 2010 + rng.next_u64() % 10;
        let duplicate = rng.unit() < 0.5;
        let y2 = if duplicate {
            y1
        } else {
            y1 + 1 + rng.next_u64() % 3
        };
        let text = |f: u64, y: u64| {
            forms[f as usize]
                .replace("{s}", s)
                .replace("{y}", &y.to_string())
        };
        pairs.push((
            embedded(&table, text(f1, y1)),
            embedded(&table, text(f2, y2)),
            duplicate,
        ));
    }
    let labels: Vec<bool> = pairs.iter().map(|p| p.2).collect();
    let trained = train(&pairs, &sources, &table, &TrainOptions::default(), &|_| {});

    // Per source, and with each source held out whole (fitted on the other exams alone): the
    // default setting keeps its precision on the grouped folds, and a model that never saw a
    // source's exams still ranks its duplicates first and keeps its precision at the threshold
    // picked without it.
    assert_eq!(trained.sources.len(), 3);
    for (i, s) in trained.sources.iter().enumerate() {
        assert_eq!(s.name, sources.names[i]);
        assert_eq!(s.pairs, sources.of.iter().filter(|&&o| o == i).count());
        assert!(s.left_out.is_some(), "{} is held out", s.name);
        // The threshold for a source is picked without it (each other one held out in turn),
        // and it transfers: the source held out keeps its precision there.
        let t = s.left_out_threshold.expect("a transferred threshold");
        assert!(t < 1.0, "{}: the others reach precision 0.9", s.name);
        let at = s.left_out.unwrap();
        assert!(
            at.precision >= 0.85 && at.recall > 0.3,
            "{}: {at:?}",
            s.name
        );
        let best = s.left_out_best.expect("the precision is reached held out");
        assert!(best.recall > 0.5, "{}: {best:?}", s.name);
        assert!(s.grouped.precision >= 0.85, "{}: {:?}", s.name, s.grouped);
    }

    // Calibrated on the sources held out (nested: each source's threshold is picked on the
    // others, each held out in turn), the thresholds transfer too, and the shipped curve is
    // read off scores of models that never saw the source they score.
    let strict = train(
        &pairs,
        &sources,
        &table,
        &TrainOptions {
            calibration: Calibration::SourcesHeldOut,
            ..TrainOptions::default()
        },
        &|_| {},
    );
    for s in &strict.sources {
        let t = s.left_out_threshold.expect("a transferred threshold");
        let at = s.left_out.unwrap();
        assert!(t < 1.0 && at.precision >= 0.85, "{}: {t} {at:?}", s.name);
    }
    let shipped = strict.verifier.threshold_for(0.9).expect("0.9 is reached");
    let from_left_out = embedder::eval::at(&strict.left_out, &labels, shipped.threshold);
    assert!((from_left_out.recall - shipped.recall).abs() < 1e-9);

    // Held out, the verifier finds most duplicates at precision 0.9; cosine alone cannot.
    let cosine: Vec<f32> = pairs
        .iter()
        .map(|(a, b, _)| embedder::bert::cosine(&a.sentence, &b.sentence))
        .collect();
    let recall = |s: &[f32]| threshold_for_precision(s, &labels, 0.9).map_or(0.0, |p| p.recall);
    assert!(
        recall(&trained.held_out) > 0.9,
        "{}",
        recall(&trained.held_out)
    );
    assert!(recall(&cosine) < 0.5, "{}", recall(&cosine));

    // No question text is on both sides of an outer split.
    let mut fold_of_text: HashMap<&str, usize> = HashMap::new();
    for (i, (a, b, _)) in pairs.iter().enumerate() {
        for t in [&a.text, &b.text] {
            let f = *fold_of_text.entry(t).or_insert(trained.fold_of[i]);
            assert_eq!(f, trained.fold_of[i], "{t} is in two folds");
        }
    }

    // The artefact loads back and judges a new pair as the trained model does.
    let json = serde_json::to_string(&trained.verifier).unwrap();
    let back = Verifier::from_json(&json).expect("the artefact loads");
    let (a, b) = (
        embedded(&table, "What was the GATE cutoff in 2031?".into()),
        embedded(&table, "What is the GATE 2032 cutoff?".into()),
    );
    let p = back.probability(&a.view(), &b.view(), &table);
    assert_eq!(
        p,
        trained.verifier.probability(&a.view(), &b.view(), &table)
    );
    assert!(p < 0.5, "{p}");
    let same = embedded(&table, "What is the GATE 2031 cutoff?".into());
    assert!(back.probability(&a.view(), &same.view(), &table) > 0.5);
    assert!(back.threshold_for(0.9).is_some());
    // The same words in the same order are the same question, whatever the case and
    // punctuation.
    let (x, y) = (
        embedded(&table, "what was the GATE cutoff in 2031".into()),
        embedded(&table, "What was the GATE cutoff in 2031?".into()),
    );
    assert_eq!(back.probability(&x.view(), &y.view(), &table), 1.0);
    // A pasted document is judged in bounded time (alignment reads as many tokens as the
    // transformer does), and an empty text is judged without NaN.
    let long = embedded(&table, "cutoff marks of the exam in 2031 ".repeat(3000));
    let started = std::time::Instant::now();
    let p = back.probability(&long.view(), &long.view(), &table);
    assert!(p.is_finite() && started.elapsed() < std::time::Duration::from_secs(2));
    let empty = embedded(&table, String::new());
    assert!(back
        .probability(&empty.view(), &a.view(), &table)
        .is_finite());
    let mut broken: serde_json::Value = serde_json::from_str(&json).unwrap();
    broken["columns"][0] = "something_else".into();
    let err = Verifier::from_json(&broken.to_string()).unwrap_err();
    assert!(err.contains("retrain"), "{err}");
    // Linear models the artefact's columns do not name are refused.
    let mut extra: serde_json::Value = serde_json::from_str(&json).unwrap();
    extra["bases"] = serde_json::json!([{ "weights": [1.0], "bias": 0.0 }]);
    let err = Verifier::from_json(&extra.to_string()).unwrap_err();
    assert!(err.contains("inputs"), "{err}");
}
