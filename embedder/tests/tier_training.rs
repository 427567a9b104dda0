//! The tier classifier trained on the real RouteLLM MMLU dev file (a copy in `fixtures/`), with
//! folds grouped by subject: every prompt is scored by a model that never saw its subject.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use embedder::tier::{train, Labelled, Outcome, TierModel, TierTrainOptions};

fn dev() -> Vec<Labelled> {
    let text = include_str!("fixtures/routing-dev.jsonl");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Labelled {
                prompt: v["prompt"].as_str().unwrap().to_owned(),
                outcome: Outcome {
                    small: v["small_correct"].as_bool().unwrap(),
                    large: v["large_correct"].as_bool().unwrap(),
                },
                group: v["source"].as_str().unwrap().to_owned(),
            }
        })
        .collect()
}

#[test]
fn held_out_by_subject_the_classifier_beats_prompt_length_and_random() {
    let data = dev();
    let t = train(
        &data,
        None,
        TierTrainOptions::default(),
        "routing-dev.jsonl",
        |_| {},
    )
    .unwrap();
    eprintln!("classifier {:?}\nlength {:?}", t.held_out, t.length);
    assert!(
        t.held_out.apgr > t.length.apgr + 0.05,
        "grouped-fold APGR {:.3} vs prompt length {:.3}",
        t.held_out.apgr,
        t.length.apgr
    );
    assert!(t.held_out.apgr > 0.6, "{:?}", t.held_out);
    assert!(t.held_out.cpt80 < 0.7, "{:?}", t.held_out);
    // No fold holds a subject another fold holds.
    let mut seen = std::collections::BTreeSet::new();
    for (subjects, _) in &t.folds {
        for s in subjects {
            assert!(seen.insert(s.clone()), "{s} in two folds");
        }
    }
    assert_eq!(seen.len(), 28);
    // The artefact round-trips, and its curve turns policies into thresholds that give the
    // held-out shares on the held-out gains.
    let json = serde_json::to_string(&t.model).unwrap();
    let m = TierModel::from_json(&json).unwrap();
    for p in m
        .curve
        .iter()
        .filter(|p| p.large_share > 0.05 && p.large_share < 0.95)
    {
        let large = t
            .held_out_gains
            .iter()
            .filter(|&&g| g >= p.threshold)
            .count() as f64
            / data.len() as f64;
        assert!((large - p.large_share).abs() < 0.02, "{p:?}: {large}");
    }
    // The calibrated probability rises with the gain.
    let lo = m.score(
        "Which state is the capital of France?\nA. Paris\nB. Rome\nC. Oslo\nD. Bern\nAnswer:",
    );
    assert!((0.0..=1.0).contains(&lo.p_large));
    assert!(m.calibration[0] > 0.0, "{:?}", m.calibration);
}

#[test]
fn too_few_subjects_for_the_folds_is_a_clear_error() {
    let data: Vec<Labelled> = dev()
        .into_iter()
        .filter(|d| d.group.ends_with("anatomy"))
        .collect();
    let e = train(&data, None, TierTrainOptions::default(), "x", |_| {}).unwrap_err();
    assert!(e.contains("1 subjects cannot fill 5 folds"), "{e}");
}
