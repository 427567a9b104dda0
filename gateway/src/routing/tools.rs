//! `gateway router train` and `gateway router eval`: fit the tier classifier on labelled prompts
//! and print RouteLLM's figures beside a random router and prompt length.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::Context;
use embedder::tier::{train, Labelled, Outcome, RouteCurve, RouteSummary, TierTrainOptions};

/// Read JSON lines `{"prompt", "small_correct", "large_correct", "source"?}`; a row without a
/// `source` is its own group.
pub fn read_labelled(path: &Path) -> anyhow::Result<Vec<Labelled>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let field = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_bool)
                .with_context(|| {
                    format!("{}:{}: `{k}` must be true or false", path.display(), i + 1)
                })
        };
        let prompt = v
            .get("prompt")
            .and_then(serde_json::Value::as_str)
            .with_context(|| format!("{}:{}: `prompt` must be a string", path.display(), i + 1))?
            .to_owned();
        let group = v
            .get("source")
            .and_then(serde_json::Value::as_str)
            .map_or_else(|| prompt.clone(), str::to_owned);
        rows.push(Labelled {
            outcome: Outcome {
                small: field("small_correct")?,
                large: field("large_correct")?,
            },
            prompt,
            group,
        });
    }
    anyhow::ensure!(
        !rows.is_empty(),
        "{} holds no labelled prompts",
        path.display()
    );
    Ok(rows)
}

/// The figures table: one line per router.
fn table(rows: &[(&str, RouteSummary)]) -> String {
    let mut out = format!(
        "{:<28} {:>6} {:>6} {:>6} {:>6} {:>8} {:>8}\n",
        "router", "PGR20", "PGR50", "PGR80", "APGR", "CPT(50)", "CPT(80)"
    );
    for (name, s) in rows {
        out.push_str(&format!(
            "{name:<28} {:>6.3} {:>6.3} {:>6.3} {:>6.3} {:>8.3} {:>8.3}\n",
            s.pgr20, s.pgr50, s.pgr80, s.apgr, s.cpt50, s.cpt80
        ));
    }
    out
}

/// `gateway router train`.
pub fn train_router(data: &Path, out: &Path, opts: TierTrainOptions) -> anyhow::Result<()> {
    let rows = read_labelled(data)?;
    let subjects = {
        let mut g: Vec<&str> = rows.iter().map(|r| r.group.as_str()).collect();
        g.sort_unstable();
        g.dedup();
        g.len()
    };
    eprintln!(
        "{} prompts, {} subjects, {} folds grouped by subject",
        rows.len(),
        subjects,
        opts.folds
    );
    let name = data.file_name().map_or_else(
        || data.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let trained =
        train(&rows, opts, &name, |stage| eprintln!("  {stage}")).map_err(anyhow::Error::msg)?;
    println!("held out by subject (each prompt scored by a model that never saw its subject):");
    print!(
        "{}",
        table(&[
            ("classifier", trained.held_out),
            ("prompt length", trained.length),
            ("random (expected)", RouteSummary::RANDOM),
        ])
    );
    println!("per fold:");
    for (subjects, s) in &trained.folds {
        println!(
            "  APGR {:.3}  CPT(80) {:.3}  {}",
            s.apgr,
            s.cpt80,
            subjects.join(" ")
        );
    }
    let json = serde_json::to_string(&trained.model)?;
    std::fs::write(out, &json).with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {} ({} KiB)", out.display(), json.len() / 1024);
    Ok(())
}

/// `gateway router eval`: the artefact's figures on a labelled file.
pub fn eval_router(data: &Path, model: Option<PathBuf>) -> anyhow::Result<()> {
    let rows = read_labelled(data)?;
    let m = super::read_classifier(model.as_deref()).map_err(anyhow::Error::msg)?;
    let outcomes: Vec<Outcome> = rows.iter().map(|r| r.outcome).collect();
    let mut micros = Vec::with_capacity(rows.len());
    let scores: Vec<f32> = rows
        .iter()
        .map(|r| {
            let t = std::time::Instant::now();
            let gain = m.score(&r.prompt).gain;
            micros.push(t.elapsed().as_secs_f64() * 1e6);
            gain
        })
        .collect();
    micros.sort_by(f64::total_cmp);
    let at = |q: f64| micros[((micros.len() - 1) as f64 * q).round() as usize];
    let lengths: Vec<f32> = rows
        .iter()
        .map(|r| r.prompt.chars().count() as f32)
        .collect();
    let curve = RouteCurve::new(&scores, &outcomes);
    println!(
        "{} prompts; quality small only {:.3}, large only {:.3} (model trained on {})",
        rows.len(),
        curve.small_quality,
        curve.large_quality,
        m.trained_on
    );
    if data
        .file_name()
        .is_some_and(|n| n.to_string_lossy() == m.trained_on)
    {
        println!(
            "note: {} is the file this classifier was trained on, so the classifier's line is \
             in-sample (optimistic); its own CV line is the held-out figure",
            m.trained_on
        );
    }
    println!(
        "scoring time per prompt: p50 {:.1} µs, p99 {:.1} µs (features and both regressions)",
        at(0.5),
        at(0.99)
    );
    print!(
        "{}",
        table(&[
            ("classifier", curve.summary()),
            (
                "prompt length",
                RouteCurve::new(&lengths, &outcomes).summary()
            ),
            ("random (expected)", RouteSummary::RANDOM),
            ("classifier, its own CV", m.held_out),
        ])
    );
    Ok(())
}
