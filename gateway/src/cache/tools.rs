//! The semantic layer's offline tools behind `gateway embed`: distill the static table from the
//! transformer, evaluate a cosine threshold on labelled pairs, judge one pair with the verifier,
//! and train the verifier (with an on-disk cache of the embedded training texts).

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use embedder::verifier::{Embedded, Sources, TrainOptions};

/// `gateway embed distill`: every vocabulary token through the transformer once, written as the
/// static table (`static.bin` in the model directory unless `out`); with `if_stale`, nothing
/// when the file already holds a table of this build's version.
pub fn distill(model: &Path, out: Option<PathBuf>, if_stale: bool) -> anyhow::Result<()> {
    use embedder::static_embed::StaticEmbedder;
    let out = out.unwrap_or_else(|| model.join("static.bin"));
    if if_stale && StaticEmbedder::is_current(&out) {
        println!("{} is up to date", out.display());
        return Ok(());
    }
    let bert = load_bert(model)?;
    let started = std::time::Instant::now();
    let mut last = 0;
    let table = StaticEmbedder::distill(&bert, |done, total| {
        if done * 10 / total != last {
            last = done * 10 / total;
            eprintln!("distilling: {done}/{total} tokens");
        }
    })?;
    table.save(&out)?;
    println!(
        "wrote {} ({} dimensions) in {:.1} s",
        out.display(),
        table.dim(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Read a pairs file (JSON lines `{"a", "b", "duplicate"}`), up to `limit` pairs.
fn read_pairs(pairs: &Path, limit: Option<usize>) -> anyhow::Result<Vec<embedder::eval::Pair>> {
    let text =
        std::fs::read_to_string(pairs).with_context(|| format!("reading {}", pairs.display()))?;
    let mut data = Vec::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let pair: embedder::eval::Pair = serde_json::from_str(line).with_context(|| {
            format!(
                "{} line {}: expected {{\"a\", \"b\", \"duplicate\"}}",
                pairs.display(),
                i + 1
            )
        })?;
        data.push(pair);
        if limit.is_some_and(|n| data.len() >= n) {
            break;
        }
    }
    anyhow::ensure!(!data.is_empty(), "no pairs in {}", pairs.display());
    Ok(data)
}

/// Sentence vectors and contextual token vectors of every text of `data`, as training pairs.
/// Texts are embedded in batches of 32 sorted by length, so batches pad little.
fn embed_pairs(
    bert: &embedder::bert::BertEmbedder,
    data: &[embedder::eval::Pair],
) -> anyhow::Result<Vec<(Embedded, Embedded, bool)>> {
    let texts: Vec<&str> = data
        .iter()
        .flat_map(|p| [p.a.as_str(), p.b.as_str()])
        .collect();
    let mut order: Vec<usize> = (0..texts.len()).collect();
    order.sort_by_key(|&i| texts[i].len());
    let mut out: Vec<Option<embedder::bert::TextVectors>> = vec![None; texts.len()];
    let started = std::time::Instant::now();
    for (n, chunk) in order.chunks(32).enumerate() {
        let batch: Vec<&str> = chunk.iter().map(|&i| texts[i]).collect();
        for (&i, v) in chunk.iter().zip(bert.embed_with_tokens(&batch)?) {
            out[i] = Some(v);
        }
        if (n + 1) % 100 == 0 {
            eprintln!(
                "embedded {} of {} texts ({:.0} s)",
                (n + 1) * 32,
                texts.len(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    let mut vectors = out.into_iter();
    let mut next = |text: &str| -> anyhow::Result<Embedded> {
        let (sentence, tokens) = vectors
            .next()
            .flatten()
            .context("a text was not embedded")?;
        Ok(Embedded {
            text: text.to_owned(),
            sentence,
            tokens,
        })
    };
    data.iter()
        .map(|p| Ok((next(&p.a)?, next(&p.b)?, p.duplicate)))
        .collect()
}

/// The embedded pairs of `data`, from `cache` when it holds exactly these texts embedded by
/// this model; otherwise embedded now (and the cache rewritten).
fn cached_pairs(
    bert: &embedder::bert::BertEmbedder,
    data: &[embedder::eval::Pair],
    cache: Option<&Path>,
) -> anyhow::Result<Vec<(Embedded, Embedded, bool)>> {
    let fingerprint = bert.fingerprint()?;
    if let Some(path) = cache.filter(|p| p.is_file()) {
        match read_embedded(path, fingerprint) {
            Ok(texts)
                if texts.len() == 2 * data.len()
                    && data
                        .iter()
                        .zip(texts.chunks(2))
                        .all(|(p, t)| p.a == t[0].text && p.b == t[1].text) =>
            {
                eprintln!("embedded texts from {}", path.display());
                let mut it = texts.into_iter();
                return Ok(data
                    .iter()
                    .filter_map(|p| Some((it.next()?, it.next()?, p.duplicate)))
                    .collect());
            }
            Ok(_) => eprintln!("{} holds other texts: embedding again", path.display()),
            Err(e) => eprintln!("{e:#}: embedding again"),
        }
    }
    let pairs = embed_pairs(bert, data)?;
    if let Some(path) = cache {
        write_embedded(path, fingerprint, pairs.iter().flat_map(|(a, b, _)| [a, b]))?;
    }
    Ok(pairs)
}

/// First bytes of a cache file.
const EMBEDDED_MAGIC: &[u8; 8] = b"GWEMBED1";

/// Cache format: [`EMBEDDED_MAGIC`], the dimension (u32) and the model's fingerprint (u64), then
/// per text its UTF-8 length, bytes, token count, the sentence vector and the token vectors as
/// little-endian f32. Written beside the target and renamed, so an interrupted write leaves no
/// half file.
fn write_embedded<'a>(
    path: &Path,
    fingerprint: u64,
    texts: impl Iterator<Item = &'a Embedded>,
) -> anyhow::Result<()> {
    use std::io::Write;
    let part = path.with_extension("part");
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(&part).with_context(|| format!("writing {}", part.display()))?,
    );
    let word = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    f.write_all(EMBEDDED_MAGIC)?;
    f.write_all(&word(embedder::bert::DIM))?;
    f.write_all(&fingerprint.to_le_bytes())?;
    for t in texts {
        f.write_all(&word(t.text.len()))?;
        f.write_all(t.text.as_bytes())?;
        f.write_all(&word(t.tokens.len()))?;
        for v in std::iter::once(&t.sentence).chain(&t.tokens) {
            anyhow::ensure!(
                v.len() == embedder::bert::DIM,
                "vector of {} dimensions",
                v.len()
            );
            for x in v {
                f.write_all(&x.to_le_bytes())?;
            }
        }
    }
    f.into_inner()
        .map_err(|e| anyhow::anyhow!("writing {}: {}", part.display(), e.error()))?
        .sync_all()?;
    std::fs::rename(&part, path).with_context(|| format!("writing {}", path.display()))
}

fn read_embedded(path: &Path, fingerprint: u64) -> anyhow::Result<Vec<Embedded>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut rest: &[u8] = &bytes;
    let mut take = |n: usize| -> anyhow::Result<&[u8]> {
        anyhow::ensure!(rest.len() >= n, "{} is truncated", path.display());
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    let dim = embedder::bert::DIM;
    let floats = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    anyhow::ensure!(
        take(8)? == EMBEDDED_MAGIC && word(take(4)?) == dim,
        "{} is not an embedded-texts file of this build",
        path.display()
    );
    let stored = take(8)?;
    anyhow::ensure!(
        stored == fingerprint.to_le_bytes(),
        "{} was embedded by another model",
        path.display()
    );
    let mut left = bytes.len() - 20;
    let mut out = Vec::new();
    while left > 0 {
        let len = word(take(4)?);
        let text = String::from_utf8(take(len)?.to_vec())?;
        let tokens = word(take(4)?);
        let sentence = floats(take(4 * dim)?);
        let tokens = (0..tokens)
            .map(|_| take(4 * dim).map(floats))
            .collect::<anyhow::Result<Vec<_>>>()?;
        left -= 4 + len + 4 + 4 * dim * (1 + tokens.len());
        out.push(Embedded {
            text,
            sentence,
            tokens,
        });
    }
    Ok(out)
}

fn load_bert(model: &Path) -> anyhow::Result<embedder::bert::BertEmbedder> {
    anyhow::ensure!(
        embedder::bert::BertEmbedder::present(model),
        "no model in {}: run scripts/fetch-model.sh",
        model.display()
    );
    Ok(embedder::bert::BertEmbedder::load(model)?)
}

fn load_table(model: &Path) -> anyhow::Result<embedder::static_embed::StaticEmbedder> {
    let table_path = model.join("static.bin");
    anyhow::ensure!(
        table_path.is_file(),
        "no {}: run `gateway embed distill` first",
        table_path.display()
    );
    Ok(embedder::static_embed::StaticEmbedder::load(
        &table_path,
        &model.join("tokenizer.json"),
    )?)
}

/// `gateway embed verify`: how the verifier judges one pair, and which precision settings
/// would answer one question with the other's answer.
pub fn verify(a: &str, b: &str, model: &Path, verifier: Option<&Path>) -> anyhow::Result<()> {
    let json = match verifier {
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        None => embedder::semantic::SHIPPED_VERIFIER.to_owned(),
    };
    let verifier =
        embedder::verifier::Verifier::from_json(&json).map_err(|e| anyhow::anyhow!(e))?;
    let bert = load_bert(model)?;
    let table = load_table(model)?;
    let v = bert.embed_with_tokens(&[a, b])?;
    fn view<'a>(text: &'a str, v: &'a embedder::bert::TextVectors) -> embedder::verifier::Text<'a> {
        embedder::verifier::Text {
            text,
            sentence: &v.0,
            tokens: &v.1,
        }
    }
    let p = verifier.probability(&view(a, &v[0]), &view(b, &v[1]), &table);
    println!(
        "cosine {:.4}, verifier probability {p:.4}",
        embedder::bert::cosine(&v[0].0, &v[1].0)
    );
    for target in [0.80, 0.85, 0.90, 0.95] {
        match verifier.threshold_for(target) {
            Some(point) => println!(
                "  min precision {target:.2}: threshold {:.3} -> {}",
                point.threshold,
                if p >= point.threshold { "hit" } else { "miss" }
            ),
            None => {
                println!("  min precision {target:.2}: not reached by the verifier's curve -> miss")
            }
        }
    }
    Ok(())
}

/// Pairs files and where their embedded texts are cached.
#[derive(Debug, Clone, Default)]
pub struct PairFiles {
    /// Training pairs files (JSON lines `{"a", "b", "duplicate"[, "source"]}`).
    pub train: Vec<PathBuf>,
    /// Pairs only scored by the shipped model, never trained on.
    pub test: Vec<PathBuf>,
    /// Only the first N pairs of each file.
    pub limit: Option<usize>,
    /// A directory holding one file of embedded texts per pairs file (`<stem>.vectors`).
    pub cache: Option<PathBuf>,
}

/// Training pairs: two embedded texts and whether they are duplicates.
type EmbeddedPairs = Vec<(Embedded, Embedded, bool)>;

/// The embedded pairs of every file in `files` with each pair's source: its `source` field, or
/// the file's stem.
fn load_sources(
    bert: &embedder::bert::BertEmbedder,
    files: &[PathBuf],
    limit: Option<usize>,
    cache: Option<&Path>,
) -> anyhow::Result<(EmbeddedPairs, Sources)> {
    let mut pairs = Vec::new();
    let mut sources = Sources::default();
    for file in files {
        let stem = file
            .file_stem()
            .map_or("pairs".into(), |s| s.to_string_lossy().into_owned());
        let data = read_pairs(file, limit)?;
        if let Some(dir) = cache {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let at = cache.map(|dir| dir.join(format!("{stem}.vectors")));
        pairs.extend(cached_pairs(bert, &data, at.as_deref())?);
        for p in &data {
            let i = sources.index(p.source.as_deref().unwrap_or(&stem));
            sources.of.push(i);
        }
    }
    Ok((pairs, sources))
}

/// Precision and recall, or the hits among no duplicates.
fn show(p: &embedder::eval::Point, duplicates: usize, pairs: usize) -> String {
    if duplicates == 0 {
        format!(
            "{} false hits of {pairs}",
            (p.hit_rate * pairs as f64).round()
        )
    } else {
        format!("{:.3} / {:.3}", p.precision, p.recall)
    }
}

/// `gateway embed train-verifier`: train the verifier on labelled pairs with grouped
/// cross-validation (and each source held out in turn), print the held-out figures per source
/// and write the artefact.
pub fn train_verifier(
    files: &PairFiles,
    model: &Path,
    out: Option<PathBuf>,
    options: TrainOptions,
) -> anyhow::Result<()> {
    use embedder::eval::threshold_for_precision;
    use embedder::verifier::{train, DEFAULT_PRECISION};
    let folds = options.folds;
    let known = embedder::verifier::columns(false);
    if let Some(unknown) = options.without.iter().find(|w| !known.contains(w)) {
        anyhow::bail!("--without {unknown}: the verifier's features are {known:?}");
    }
    let bert = load_bert(model)?;
    let table = load_table(model)?;
    let (embedded, sources) =
        load_sources(&bert, &files.train, files.limit, files.cache.as_deref())?;
    let started = std::time::Instant::now();
    let trained = train(&embedded, &sources, &table, &options, &|m: &str| {
        eprintln!("[{:5.0} s] {m}", started.elapsed().as_secs_f64());
    });
    let y: Vec<bool> = embedded.iter().map(|p| p.2).collect();
    let cosines: Vec<f32> = embedded
        .iter()
        .map(|(a, b, _)| embedder::bert::cosine(&a.sentence, &b.sentence))
        .collect();
    println!(
        "{} pairs, {} duplicates, {folds}-fold cross-validation grouped by text (held-out scores)",
        y.len(),
        y.iter().filter(|&&l| l).count()
    );
    println!("  target precision  cosine alone: recall  trees on {} features: recall  verifier: recall (threshold)", embedder::verifier::FEATURES.len());
    for target in [0.80, 0.85, 0.90, 0.95] {
        let recall = |s: &[f32]| threshold_for_precision(s, &y, target).map_or(0.0, |p| p.recall);
        let v = threshold_for_precision(&trained.held_out, &y, target);
        println!(
            "  {target:16.2}  {:20.3}  {:28.3}  {}",
            recall(&cosines),
            recall(&trained.baseline),
            v.map_or("not reached".to_owned(), |p| format!(
                "{:.3} ({:.3})",
                p.recall, p.threshold
            ))
        );
    }
    // Held-out scores and labels of one outer fold.
    let fold = |k: usize| -> (Vec<f32>, Vec<bool>) {
        trained
            .fold_of
            .iter()
            .zip(trained.held_out.iter().zip(&y))
            .filter(|(f, _)| **f == k)
            .map(|(_, (s, l))| (*s, *l))
            .unzip()
    };
    let per_fold: Vec<String> = (0..folds)
        .map(|k| {
            let (s, l) = fold(k);
            format!(
                "{:.3}",
                threshold_for_precision(&s, &l, DEFAULT_PRECISION).map_or(0.0, |p| p.recall)
            )
        })
        .collect();
    println!(
        "  recall at precision 0.90 per fold: {}",
        per_fold.join(", ")
    );
    // What a tenant at the default setting gets: the shipped threshold, fold by fold.
    let shipped = trained.verifier.threshold_for(DEFAULT_PRECISION);
    if let Some(point) = shipped {
        let at_threshold: Vec<String> = (0..folds)
            .map(|k| {
                let (s, l) = fold(k);
                let p = embedder::eval::at(&s, &l, point.threshold);
                format!("{:.3}/{:.3}", p.precision, p.recall)
            })
            .collect();
        println!(
            "  at the min-precision 0.90 threshold {:.3}, precision/recall per fold: {}",
            point.threshold,
            at_threshold.join(", ")
        );
    }
    println!("  linear models' C on all pairs: {:?}", trained.chosen_c);
    println!(
        "\nper source, precision / recall at the default setting (min precision 0.90):\n  \
         grouped: the shipped threshold on the grouped held-out scores; own best: the most recall \
         at precision 0.90 within the source;\n  source held out: fitted on the other sources, at \
         the threshold (in brackets) the shipped rule picks without it (the others, each held out \
         in turn);\n  by grouped: at the threshold the others' grouped held-out scores pick (the \
         earlier rule)"
    );
    println!(
        "  {:22} {:>6} {:>6}  {:>22}  {:>8}  {:>30}  {:>22}  {:>8}",
        "source",
        "pairs",
        "dups",
        "grouped",
        "own best",
        "source held out",
        "by grouped",
        "own best"
    );
    for s in &trained.sources {
        println!(
            "  {:22} {:6} {:6}  {:>22}  {:>8}  {:>30}  {:>22}  {:>8}",
            s.name,
            s.pairs,
            s.duplicates,
            show(&s.grouped, s.duplicates, s.pairs),
            s.grouped_best
                .map_or("-".into(), |p| format!("{:.3}", p.recall)),
            s.left_out
                .zip(s.left_out_threshold)
                .map_or("-".into(), |(p, t)| format!(
                    "{} ({t:.3})",
                    show(&p, s.duplicates, s.pairs)
                )),
            s.left_out_by_grouped
                .map_or("-".into(), |p| show(&p, s.duplicates, s.pairs)),
            s.left_out_best
                .map_or("-".into(), |p| format!("{:.3}", p.recall)),
        );
    }
    let mut verifier = trained.verifier;
    if !files.test.is_empty() {
        let (test, test_sources) =
            load_sources(&bert, &files.test, files.limit, files.cache.as_deref())?;
        let threshold = shipped.map_or(1.0, |p| p.threshold);
        println!("\ntest pairs (never trained on), the shipped model at threshold {threshold:.3}:");
        for (s, name) in test_sources.names.iter().enumerate() {
            let (scores, labels): (Vec<f32>, Vec<bool>) = test
                .iter()
                .zip(&test_sources.of)
                .filter(|(_, &of)| of == s)
                .map(|((a, b, l), _)| (verifier.probability(&a.view(), &b.view(), &table), *l))
                .unzip();
            let duplicates = labels.iter().filter(|&&l| l).count();
            let p = embedder::eval::at(&scores, &labels, threshold);
            println!(
                "  {name:22} {:6} {duplicates:6}  {:>22}",
                labels.len(),
                show(&p, duplicates, labels.len())
            );
        }
    }
    let names: Vec<String> = files
        .train
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    verifier.trained_on = format!(
        "{} ({} pairs, {folds}-fold grouped cross-validation)",
        names.join(" + "),
        y.len()
    );
    let out = out.unwrap_or_else(|| model.join("verifier.json"));
    std::fs::write(&out, serde_json::to_vec(&verifier)?)
        .with_context(|| format!("writing {}", out.display()))?;
    println!(
        "wrote {} in {:.0} s of training",
        out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `gateway embed eval`: precision, recall and hit rate of a cosine threshold on labelled
/// pairs, for the transformer and the static path, with the curve.
pub fn eval(
    pairs: &Path,
    model: &Path,
    threshold: f32,
    limit: Option<usize>,
    steps: usize,
) -> anyhow::Result<()> {
    use embedder::bert::cosine;
    use embedder::eval::{at, curve, threshold_for_precision};
    use embedder::static_embed::StaticEmbedder;
    let data = read_pairs(pairs, limit)?;
    let labels: Vec<bool> = data.iter().map(|p| p.duplicate).collect();
    let bert = load_bert(model)?;
    let transformer: Vec<f32> = embed_pairs(&bert, &data)?
        .iter()
        .map(|(a, b, _)| cosine(&a.sentence, &b.sentence))
        .collect();
    let mut paths = vec![("transformer", transformer)];
    let table = model.join("static.bin");
    if table.is_file() {
        let s = StaticEmbedder::load(&table, &model.join("tokenizer.json"))?;
        let mut scores = Vec::with_capacity(data.len());
        for p in &data {
            scores.push(cosine(&s.embed(&p.a)?, &s.embed(&p.b)?));
        }
        paths.push(("static", scores));
    } else {
        println!(
            "(no {}: run `gateway embed distill` to evaluate the static path)",
            table.display()
        );
    }
    let duplicates = labels.iter().filter(|&&l| l).count();
    println!("{} pairs, {duplicates} duplicates", data.len());
    for (name, scores) in &paths {
        let p = at(scores, &labels, threshold);
        println!(
            "\n{name}: at threshold {threshold:.3}: precision {:.3}, recall {:.3}, hit rate {:.3}",
            p.precision, p.recall, p.hit_rate
        );
        for target in [0.90, 0.95] {
            match threshold_for_precision(scores, &labels, target) {
                Some(b) => println!(
                    "  precision >= {target:.2}: threshold {:.4}, recall {:.3}, hit rate {:.3}",
                    b.threshold, b.recall, b.hit_rate
                ),
                None => println!("  precision >= {target:.2}: not reached at any threshold"),
            }
        }
        println!("  threshold  precision  recall  hit rate");
        for p in curve(scores, &labels, steps) {
            println!(
                "  {:9.4}  {:9.3}  {:6.3}  {:8.3}",
                p.threshold, p.precision, p.recall, p.hit_rate
            );
        }
    }
    Ok(())
}
