//! `gateway`: the server, its migrations, the backend simulator and the demo.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use embedder::verifier::{Embedded, TrainOptions};
use gateway::config::Config;
use gateway::simulator::{SimOptions, SimProfile};

// The proxy path allocates small, short-lived buffers per request; mimalloc's thread-local
// free lists beat glibc malloc there (glibc was ~15% of CPU under load in a perf profile).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Subcommand)]
enum EmbedCommand {
    /// Distill the static embedding table from the transformer (every vocabulary token through
    /// the model once; a minute or two on a CPU).
    Distill {
        /// Model directory (from scripts/fetch-model.sh).
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        model: PathBuf,
        /// Output file (default: static.bin in the model directory).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Do nothing when the output already holds a table of this build's version.
        #[arg(long)]
        if_stale: bool,
    },
    /// Precision, recall and hit rate of the similarity threshold on labelled pairs
    /// (JSON lines `{"a", "b", "duplicate"}`), for the transformer and the static path.
    Eval {
        /// The pairs file.
        #[arg(long)]
        pairs: PathBuf,
        /// Model directory (static.bin in it is used when present).
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        model: PathBuf,
        /// The setting to evaluate: a cosine at or above it is a cache hit.
        #[arg(long, default_value_t = 0.95)]
        threshold: f32,
        /// Only the first N pairs.
        #[arg(long)]
        limit: Option<usize>,
        /// Points on the printed curve.
        #[arg(long, default_value_t = 20)]
        steps: usize,
    },
    /// Judge one pair as the semantic cache would: the cosine of the two questions, the
    /// verifier's probability that they ask the same thing, and which precision settings
    /// (`gatewayctl cache set --min-precision`) would answer one with the other's answer.
    Verify {
        /// The first question.
        a: String,
        /// The second question.
        b: String,
        /// Model directory (needs static.bin: `gateway embed distill`).
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        model: PathBuf,
        /// A verifier artefact (default: the shipped one).
        #[arg(long)]
        verifier: Option<PathBuf>,
    },
    /// Train the cache-hit verifier on labelled pairs with k-fold cross-validation; prints the
    /// held-out precision/recall and writes the model with its held-out curve.
    TrainVerifier {
        /// The pairs file (JSON lines `{"a", "b", "duplicate"}`).
        #[arg(long)]
        pairs: PathBuf,
        /// Model directory (needs static.bin: `gateway embed distill`).
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        model: PathBuf,
        /// Output file (default: verifier.json in the model directory).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Folds.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(2..=50))]
        folds: u16,
        /// Only the first N pairs.
        #[arg(long)]
        limit: Option<usize>,
        /// Keep the embedded texts in this file and reuse them when it matches `--pairs` (the
        /// transformer pass takes minutes; training alone, a few).
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Seed of the fold assignment (to see how much the held-out figures move with it).
        #[arg(long, default_value_t = TrainOptions::default().seed)]
        seed: u64,
    },
}

/// LLM gateway and cost-control proxy.
#[derive(Debug, Parser)]
#[command(name = "gateway", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API.
    Serve {
        /// TOML configuration file.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Override `server.listen`.
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Apply the Postgres migrations (SQLite is migrated at start).
    Migrate {
        /// TOML configuration file (its `store.url`).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Database URL; overrides the config's `store.url`.
        #[arg(long, env = "DATABASE_URL")]
        database_url: Option<String>,
    },
    /// Embedding model tools.
    Embed {
        /// Embed command.
        #[command(subcommand)]
        command: EmbedCommand,
    },
    /// Run a SIMULATED OpenAI-compatible model server (for demos, tests and benchmarks).
    Simulate {
        /// Timing profile: small, large or zero (no latency).
        #[arg(long, default_value = "small")]
        profile: String,
        /// Port on 127.0.0.1 (0 = any free port).
        #[arg(long, default_value_t = 9001)]
        port: u16,
        /// Model name to serve (default: sim-<profile>).
        #[arg(long)]
        model: Option<String>,
        /// Never report usage (like some servers), to exercise token counting.
        #[arg(long)]
        no_usage: bool,
        /// Probability of answering 500.
        #[arg(long, default_value_t = 0.0)]
        error_rate: f64,
        /// Probability of a latency spike.
        #[arg(long, default_value_t = 0.0)]
        spike_rate: f64,
        /// Latency spike size in ms.
        #[arg(long, default_value_t = 500)]
        spike_ms: u64,
    },
    /// Run the gateway on its embedded default in front of simulated model servers.
    Demo {
        /// Port on 127.0.0.1.
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Store URL.
        #[arg(long, default_value = "sqlite://gateway-demo.db")]
        store: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    gateway::telemetry::init();
    gateway::telemetry::install_crypto_provider();
    match Cli::parse().command {
        Command::Serve { config, listen } => {
            let mut config = Config::load(config.as_deref())?;
            if let Some(listen) = listen {
                config.server.listen = listen;
            }
            gateway::run(config).await
        }
        Command::Migrate {
            config,
            database_url,
        } => {
            let url = match database_url {
                Some(u) => u,
                None => Config::load(config.as_deref())?.store.url,
            };
            if url.starts_with("sqlite:") {
                gateway::store::sqlite::SqliteStore::open(&url).await?;
            } else {
                gateway::store::postgres::PostgresStore::migrate(&url)
                    .await
                    .context("migrating postgres")?;
            }
            println!("migrated {}", gateway::state::redact_url(&url));
            Ok(())
        }
        Command::Embed {
            command:
                EmbedCommand::Distill {
                    model,
                    out,
                    if_stale,
                },
        } => {
            use embedder::bert::BertEmbedder;
            use embedder::static_embed::StaticEmbedder;
            let out = out.unwrap_or_else(|| model.join("static.bin"));
            if if_stale && StaticEmbedder::is_current(&out) {
                println!("{} is up to date", out.display());
                return Ok(());
            }
            anyhow::ensure!(
                BertEmbedder::present(&model),
                "no model in {}: run scripts/fetch-model.sh",
                model.display()
            );
            let bert = BertEmbedder::load(&model)?;
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
        Command::Embed {
            command:
                EmbedCommand::Eval {
                    pairs,
                    model,
                    threshold,
                    limit,
                    steps,
                },
        } => embed_eval(&pairs, &model, threshold, limit, steps),
        Command::Embed {
            command:
                EmbedCommand::Verify {
                    a,
                    b,
                    model,
                    verifier,
                },
        } => verify_pair(&a, &b, &model, verifier.as_deref()),
        Command::Embed {
            command:
                EmbedCommand::TrainVerifier {
                    pairs,
                    model,
                    out,
                    folds,
                    limit,
                    cache,
                    seed,
                },
        } => train_verifier(
            &pairs,
            &model,
            out,
            limit,
            cache,
            TrainOptions {
                folds: usize::from(folds),
                seed,
                ..TrainOptions::default()
            },
        ),
        Command::Simulate {
            profile,
            port,
            model,
            no_usage,
            error_rate,
            spike_rate,
            spike_ms,
        } => {
            let mut p = SimProfile::by_name(&profile).with_context(|| {
                format!("unknown --profile {profile:?}: use small, large or zero")
            })?;
            if let Some(m) = model {
                p.model = m;
            }
            let options = SimOptions {
                profile: p,
                report_usage: !no_usage,
                error_rate,
                spike_rate,
                spike_ms,
            };
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .with_context(|| format!("binding 127.0.0.1:{port}"))?;
            println!(
                "SIMULATED model server ({profile}) on http://{}/v1",
                listener.local_addr()?
            );
            gateway::simulator::serve(listener, gateway::simulator::Simulator::new(options))
                .await?;
            Ok(())
        }
        Command::Demo { port, store } => {
            gateway::demo::run(gateway::demo::DemoOptions {
                listen: SocketAddr::from(([127, 0, 0, 1], port)),
                store_url: store,
            })
            .await
        }
    }
}

/// Read a pairs file (JSON lines `{"a", "b", "duplicate"}`), up to `limit` pairs.
fn read_pairs(
    pairs: &std::path::Path,
    limit: Option<usize>,
) -> anyhow::Result<Vec<embedder::eval::Pair>> {
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
    cache: Option<&std::path::Path>,
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
    path: &std::path::Path,
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

fn read_embedded(path: &std::path::Path, fingerprint: u64) -> anyhow::Result<Vec<Embedded>> {
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

fn load_bert(model: &std::path::Path) -> anyhow::Result<embedder::bert::BertEmbedder> {
    anyhow::ensure!(
        embedder::bert::BertEmbedder::present(model),
        "no model in {}: run scripts/fetch-model.sh",
        model.display()
    );
    Ok(embedder::bert::BertEmbedder::load(model)?)
}

fn load_table(model: &std::path::Path) -> anyhow::Result<embedder::static_embed::StaticEmbedder> {
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

fn verify_pair(
    a: &str,
    b: &str,
    model: &std::path::Path,
    verifier: Option<&std::path::Path>,
) -> anyhow::Result<()> {
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

fn train_verifier(
    pairs: &std::path::Path,
    model: &std::path::Path,
    out: Option<PathBuf>,
    limit: Option<usize>,
    cache: Option<PathBuf>,
    options: TrainOptions,
) -> anyhow::Result<()> {
    use embedder::eval::threshold_for_precision;
    use embedder::verifier::train;
    let folds = options.folds;
    let data = read_pairs(pairs, limit)?;
    let bert = load_bert(model)?;
    let table = load_table(model)?;
    let embedded = cached_pairs(&bert, &data, cache.as_deref())?;
    let started = std::time::Instant::now();
    let trained = train(&embedded, &table, &options, &|m: &str| {
        eprintln!("[{:5.0} s] {m}", started.elapsed().as_secs_f64());
    });
    let y: Vec<bool> = data.iter().map(|p| p.duplicate).collect();
    let cosines: Vec<f32> = embedded
        .iter()
        .map(|(a, b, _)| embedder::bert::cosine(&a.sentence, &b.sentence))
        .collect();
    println!(
        "{} pairs, {} duplicates, {folds}-fold cross-validation grouped by question (held-out scores)",
        y.len(),
        y.iter().filter(|&&l| l).count()
    );
    println!("  target precision  cosine alone: recall  trees on 15 features: recall  verifier: recall (threshold)");
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
                threshold_for_precision(&s, &l, 0.90).map_or(0.0, |p| p.recall)
            )
        })
        .collect();
    println!(
        "  recall at precision 0.90 per fold: {}",
        per_fold.join(", ")
    );
    // What a tenant at the default setting gets: the shipped threshold, fold by fold.
    if let Some(point) = trained.verifier.threshold_for(0.90) {
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
    let mut verifier = trained.verifier;
    verifier.trained_on = format!(
        "{} ({} pairs, {folds}-fold grouped cross-validation)",
        pairs.display(),
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

fn embed_eval(
    pairs: &std::path::Path,
    model: &std::path::Path,
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
