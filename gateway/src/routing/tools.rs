//! `gateway router train` and `gateway router eval`: fit the tier classifier on labelled prompts
//! and print RouteLLM's figures beside a random router and prompt length.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::Context;
use embedder::static_embed::StaticEmbedder;
use embedder::tier::{
    train, Embedded, Labelled, Outcome, RouteCurve, RouteSummary, TierModel, TierTrainOptions,
};

/// The prompt embedding `router train` may add to the classifier's input.
#[derive(Debug, Clone)]
pub struct EmbeddingArgs {
    /// `static` (the static table of the model in `model_dir`), or `None` for text only.
    pub source: Option<String>,
    /// Its weight against the unit-length TF-IDF vector.
    pub weight: f32,
    /// The embedding model's directory (its static table is distilled there on first use).
    pub model_dir: PathBuf,
}

/// The static table of the model in `dir` (distilled on first use).
pub fn static_model(dir: &Path) -> anyhow::Result<StaticEmbedder> {
    crate::cache::semantic::static_table(dir).map_err(|e| {
        anyhow::anyhow!(
            "the static embedding of {}: {e} (fetch the model with scripts/fetch-model.sh)",
            dir.display()
        )
    })
}

/// Every prompt's static embedding.
fn embed_all(table: &StaticEmbedder, prompts: &[&str]) -> anyhow::Result<Vec<Vec<f32>>> {
    prompts
        .iter()
        .map(|p| {
            table
                .embed(p)
                .map_err(|e| anyhow::anyhow!("embedding a prompt: {e}"))
        })
        .collect()
}

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
pub fn train_router(
    data: &Path,
    out: &Path,
    opts: TierTrainOptions,
    embedding: &EmbeddingArgs,
) -> anyhow::Result<()> {
    let rows = read_labelled(data)?;
    let vectors = match embedding.source.as_deref() {
        None => None,
        Some("static") => {
            let table = static_model(&embedding.model_dir)?;
            let prompts: Vec<&str> = rows.iter().map(|r| r.prompt.as_str()).collect();
            Some(embed_all(&table, &prompts)?)
        }
        Some(other) => anyhow::bail!(
            "--embedding {other}: the classifier can read `static` embeddings (or none)"
        ),
    };
    let embedded = vectors.as_deref().map(|vectors| Embedded {
        source: "static",
        vectors,
        weight: embedding.weight,
    });
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
    let trained = train(&rows, embedded, opts, &name, |stage| eprintln!("  {stage}"))
        .map_err(anyhow::Error::msg)?;
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

/// Score every prompt, timing the embedding (when the classifier reads one) and the
/// classifier apart: (gains, embedding µs, classifier µs).
fn timed_scores(
    m: &TierModel,
    table: Option<&StaticEmbedder>,
    rows: &[Labelled],
) -> anyhow::Result<(Vec<f32>, Vec<f64>, Vec<f64>)> {
    let (mut gains, mut embed_us, mut score_us) = (Vec::new(), Vec::new(), Vec::new());
    for r in rows {
        let t = std::time::Instant::now();
        let vector = match table {
            Some(table) => Some(
                table
                    .embed(&r.prompt)
                    .map_err(|e| anyhow::anyhow!("embedding a prompt: {e}"))?,
            ),
            None => None,
        };
        embed_us.push(t.elapsed().as_secs_f64() * 1e6);
        let t = std::time::Instant::now();
        let score = m
            .score_with(&r.prompt, vector.as_deref())
            .map_err(anyhow::Error::msg)?;
        score_us.push(t.elapsed().as_secs_f64() * 1e6);
        gains.push(score.gain);
    }
    Ok((gains, embed_us, score_us))
}

/// p50 and p99 of `v`, sorted in place.
fn p50_p99(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// `gateway router eval`: the artefact's figures on a labelled file. A classifier that reads
/// the static embedding takes it from the model in `embedding_model`.
pub fn eval_router(
    data: &Path,
    model: Option<PathBuf>,
    embedding_model: &Path,
) -> anyhow::Result<()> {
    let rows = read_labelled(data)?;
    let m = super::read_classifier(model.as_deref()).map_err(anyhow::Error::msg)?;
    let statics = match &m.embedding {
        Some(_) => Some(static_model(embedding_model)?),
        None => None,
    };
    let outcomes: Vec<Outcome> = rows.iter().map(|r| r.outcome).collect();
    let (scores, mut embed_us, mut micros) = timed_scores(&m, statics.as_ref(), &rows)?;
    let (p50, p99) = p50_p99(&mut micros);
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
        "scoring time per prompt: p50 {p50:.1} µs, p99 {p99:.1} µs (features and both regressions)"
    );
    if let Some(e) = &m.embedding {
        let (p50, p99) = p50_p99(&mut embed_us);
        println!(
            "{} embedding per prompt: p50 {p50:.1} µs, p99 {p99:.1} µs (weight {})",
            e.source, e.weight
        );
    }
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
